#!/usr/bin/env python3
"""Writes (or checks) the stored reference of `model.numerics = "portable"`:
greedy continuations of the shipped SmolLM2-135M Q4_1 model computed by
llama.cpp's AVX2 build (plain CPU kernels, `use_extra_bufts = False`,
n_threads 2). `portable` computes that build's arithmetic order on every
CPU, so the reference holds on any machine, unlike the live llama.cpp of
`greedy_parity.py`, which is whichever build suits the CPU it runs on.

The reference needs a llama.cpp built for AVX2 without AVX-512, loaded
through llama-cpp-python's `LLAMA_CPP_LIB_PATH`. From the sdist of the
llama-cpp-python pinned in scripts/requirements-test.txt:

    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build-avx2 \\
      -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF \\
      -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \\
      -DGGML_AVX512=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
      -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF
    cmake --build build-avx2 -j2
    LLAMA_CPP_LIB_PATH=$PWD/build-avx2/bin $HOME/.cache/samplerd/venv/bin/python \\
      server/model/tests/write_portable_reference.py [--write]

Without --write it recomputes the reference and compares it with the stored
file (exit 1 on a difference). The Rust test
`real_model.rs::smollm2_portable_numerics_equals_the_stored_llama_cpp_avx2_reference`
checks samplerd against the stored file.
"""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_ref as R  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "portable_reference.json")
N_TOKENS = 48
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Explain in two sentences how a bicycle stays upright.",
    "Give me a recipe for pancakes.",
]


def prompts():
    return [f"{SYSTEM}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]


def compute():
    info = R.llama_cpp.llama_print_system_info().decode()
    if "AVX512 = 1" in info or "AVX2 = 1" not in info:
        sys.exit(f"not an AVX2-only llama.cpp build (set LLAMA_CPP_LIB_PATH): {info}")
    with open(R.MODEL, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    llm = R.load(n_threads=2, model=R.MODEL)
    cases = []
    for text in prompts():
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        lps = []
        tokens, _ = R.greedy(llm, ids, N_TOKENS, logprobs=lps)
        cases.append({"prompt": text, "prompt_ids": ids, "tokens": tokens, "logprobs": lps})
    return {
        "about": "greedy continuations by llama.cpp's AVX2 build (llama-cpp-python "
                 f"{R.llama_cpp.__version__}, GGML_NATIVE=OFF GGML_AVX2=ON GGML_FMA=ON GGML_F16C=ON "
                 "GGML_AVX512=OFF, use_extra_bufts=False, n_threads=2, argmax per step): "
                 "the reference of model.numerics = \"portable\"; written by "
                 "server/model/tests/write_portable_reference.py",
        "system_info": info.strip(),
        "model": os.path.basename(R.MODEL),
        "model_sha256": digest,
        "cases": cases,
    }


def main():
    ref = compute()
    if "--write" in sys.argv:
        os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
        with open(FIXTURE, "w") as f:
            json.dump(ref, f, indent=1)
            f.write("\n")
        print(f"wrote {FIXTURE}: {len(ref['cases'])} prompts")
        return 0
    with open(FIXTURE) as f:
        stored = json.load(f)
    bad = 0
    for a, b in zip(ref["cases"], stored["cases"]):
        same = a["prompt_ids"] == b["prompt_ids"] and a["tokens"] == b["tokens"]
        dlp = max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0)
        bad += not same
        print(f"{'OK  ' if same else 'FAIL'} {len(a['tokens'])} tokens, max |Δlogprob| {dlp:.2e}: {a['prompt'][-50:]!r}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
