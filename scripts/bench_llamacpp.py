#!/usr/bin/env python3
"""llama.cpp (llama-cpp-python) reference numbers for the model benchmark:
prefill tok/s and greedy decode tok/s (128 new tokens) for one stream, on the
same chat prompt as `cargo run --release -p samplerd-model --example model_bench`.

Run with the test venv:  $HOME/.cache/samplerd/venv/bin/python scripts/bench_llamacpp.py [--threads 2] [--runs 5] [--new 128]
Prints one JSON object (medians plus every run).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server", "model", "tests"))
import llamacpp_ref as R  # noqa: E402  (also disables the AMX repack that SIGILLs here)
import numpy as np  # noqa: E402

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the sea, the weather and the keeper's daily routine in detail.")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1, help="the user message this many times (17: a 557-token prompt)")
    a = ap.parse_args()
    llm = R.load(n_threads=a.threads, n_ctx=1024)
    # Same rendering as ours (the model's ChatML template, system prompt included).
    prompt = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
              f"<|im_start|>user\n{' '.join([PROMPT] * a.repeat)}<|im_end|>\n<|im_start|>assistant\n")
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    pre, dec = [], []
    for _ in range(a.runs):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        pre.append(len(ids) / (time.perf_counter() - t0))
        t1 = time.perf_counter()
        for _ in range(a.new):
            t = int(np.argmax(R.last_logits(llm)))
            llm.eval([t])
        dec.append(a.new / (time.perf_counter() - t1))
    print(json.dumps({
        "engine": "llama.cpp (llama-cpp-python %s)" % R.llama_cpp.__version__, "threads": a.threads,
        "prompt_tokens": len(ids), "new_tokens": a.new, "runs": a.runs,
        "prefill_tok_s": float(np.median(pre)), "decode_tok_s": float(np.median(dec)),
        "prefill_all": pre, "decode_all": dec,
    }))


if __name__ == "__main__":
    main()
