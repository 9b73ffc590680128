#!/usr/bin/env python3
"""Greedy parity: for chat prompts, our greedy continuation (via
`model_probe greedy`, 2 threads) must equal llama.cpp's (argmax each step,
temperature 0 / top_k 1 / no repeat penalty, n_threads=2, logits_all=False)
for at least 32 tokens (or until an end-of-generation token), and each
chosen token's log-probability must agree within 1e-3.

Five models: the shipped one (Q4_1 and Q8_0 weights) and the same model
requantised by llama.cpp's own quantiser to Q4_K_M, Q5_K_M, F16 and BF16 in a temporary
directory (for this 576-wide model: Q4_K/Q5_K and Q6_K feed-forward down
projections, the rest Q5_0/Q5_1/Q8_0 fallbacks, as in published files of
it). The reference
is computed here, on this machine, never stored.

samplerd follows the arithmetic order of the llama.cpp build it is compared
with: `model.numerics = "native"` for the venv's own build (native to this
CPU), `"portable"` (llama.cpp's AVX2 order) when that build has no AVX-512 —
e.g. an AVX2 build loaded with LLAMA_CPP_LIB_PATH (how to build one:
write_portable_reference.py). Measured on an AVX-512 CPU: `native` against
the venv's AVX-512 build and `portable` against an AVX2 build are each
equal on every prompt of every model.

Run: $HOME/.cache/samplerd/venv/bin/python server/model/tests/greedy_parity.py [N]
(needs models/SmolLM2-135M-Instruct.Q4_1.gguf; exits 0 with a notice if absent).
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_ref as R  # noqa: E402

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [{"role": "user", "content": "Explain in two sentences how a bicycle stays upright."}],
]
LOGPROB_TOL = 1e-3


def check(model, n, label):
    """Returns the number of failing prompts for `model`."""
    llm = R.load(n_threads=2, model=model)
    failed = 0
    for msgs in PROMPTS:
        ours = R.probe("greedy", model, str(n), stdin=json.dumps({"messages": msgs}))
        ids = llm.tokenize(ours["prompt"].encode(), add_bos=True, special=True)
        if ids != ours["prompt_ids"]:
            failed += 1
            print(f"{label}: PROMPT TOKENS DIFFER for {msgs!r}")
            continue
        ref_lp = []
        ref, _ = R.greedy(llm, ids, n, logprobs=ref_lp)
        same = 0
        while same < min(len(ref), len(ours["tokens"])) and ref[same] == ours["tokens"][same]:
            same += 1
        # Log-probabilities over the common prefix (after it the contexts differ).
        dlp = max((abs(a - b) for a, b in zip(ref_lp[:same], ours["logprobs"][:same])), default=0.0)
        ok = ref == ours["tokens"] and dlp <= LOGPROB_TOL
        failed += not ok
        print(f"{label}: {'OK  ' if ok else 'FAIL'} {same}/{len(ref)} tokens equal, max |Δlogprob| {dlp:.2e}: "
              f"{msgs[-1]['content'][:40]!r} -> {ours['text'][:60]!r}")
        if ref != ours["tokens"]:
            print(f"  llama.cpp {ref}\n  ours      {ours['tokens']}")
    del llm
    return failed


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    if not os.path.exists(R.MODEL):
        print(f"NOTICE: {R.MODEL} absent (run scripts/fetch-model.sh); skipping")
        return 0
    info = R.llama_cpp.llama_print_system_info().decode()
    os.environ["SAMPLERD_NUMERICS"] = "native" if "AVX512 = 1" in info else "portable"
    print(f"llama.cpp: {info.strip()}\nsamplerd: model.numerics = {os.environ['SAMPLERD_NUMERICS']}")
    failed = check(R.MODEL, n, os.path.basename(R.MODEL))
    with tempfile.TemporaryDirectory() as tmp:
        for name, ftype in [("Q4_K_M", R.llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M),
                            ("Q5_K_M", R.llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M),
                            ("F16", R.llama_cpp.LLAMA_FTYPE_MOSTLY_F16),
                            ("BF16", R.llama_cpp.LLAMA_FTYPE_MOSTLY_BF16)]:
            path = os.path.join(tmp, f"requantised.{name}.gguf")
            R.requantize(R.MODEL, path, ftype)
            failed += check(path, n, f"{name} (requantised)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
