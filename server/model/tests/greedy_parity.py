#!/usr/bin/env python3
"""Greedy parity: for chat prompts, our greedy continuation (via
`model_probe greedy`, 2 threads) must equal llama.cpp's (argmax each step,
temperature 0 / top_k 1 / no repeat penalty, n_threads=2, logits_all=False)
for at least 32 tokens (or until an end-of-generation token).

Run: $HOME/.cache/samplerd/venv/bin/python server/model/tests/greedy_parity.py [N]
(needs models/SmolLM2-135M-Instruct.Q4_1.gguf; exits 0 with a notice if absent).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_ref as R  # noqa: E402

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers and explain why they are prime."}],
]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    if not os.path.exists(R.MODEL):
        print(f"NOTICE: {R.MODEL} absent (run scripts/fetch-model.sh); skipping")
        return 0
    llm = R.load(n_threads=2)
    failed = 0
    for msgs in PROMPTS:
        ours = R.probe("greedy", R.MODEL, str(n), stdin=json.dumps({"messages": msgs}))
        ids = llm.tokenize(ours["prompt"].encode(), add_bos=True, special=True)
        if ids != ours["prompt_ids"]:
            failed += 1
            print(f"PROMPT TOKENS DIFFER for {msgs!r}")
            continue
        ref, _ = R.greedy(llm, ids, n)
        same = 0
        while same < min(len(ref), len(ours["tokens"])) and ref[same] == ours["tokens"][same]:
            same += 1
        ok = ref == ours["tokens"]
        failed += not ok
        print(f"{'OK  ' if ok else 'FAIL'} {same}/{len(ref)} tokens equal: {msgs[-1]['content'][:40]!r} -> {ours['text'][:60]!r}")
        if not ok:
            print(f"  llama.cpp {ref}\n  ours      {ours['tokens']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
