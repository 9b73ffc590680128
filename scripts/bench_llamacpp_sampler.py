#!/usr/bin/env python3
"""llama.cpp's sampler chain cost on this machine, for docs/PERFORMANCE.md.

Times `llama_sampler_apply` of llama.cpp's chain (llama-cpp-python's bundled
libllama via ctypes) on random N(0, 3) logits, the same parameters as our
benchmark: the default chain (penalties 64/1.1 → top-k 40 → top-p 0.95 →
temperature 0.8 → dist), greedy (penalties → greedy) and top-k off with
top-p 0.95. Reports medians over many iterations, apply alone and with the
candidate array rebuilt each token (as llama_sampler_sample does).
Usage: python scripts/bench_llamacpp_sampler.py [--iterations N] [--json]
"""
import argparse
import ctypes
import json
import statistics
import time

import numpy as np
import llama_cpp as L

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)


def chain(kind, vocab):
    c = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    # The bundled libllama takes (n_vocab, last_n, repeat, freq, present).
    L.llama_sampler_chain_add(c, L.llama_sampler_init_penalties(vocab, 64, 1.1, 0.0, 0.0))
    if kind == "greedy":
        L.llama_sampler_chain_add(c, L.llama_sampler_init_greedy())
        return c
    L.llama_sampler_chain_add(c, L.llama_sampler_init_top_k(0 if kind == "top_p_only" else 40))
    L.llama_sampler_chain_add(c, L.llama_sampler_init_top_p(0.95, 1))
    L.llama_sampler_chain_add(c, L.llama_sampler_init_temp(0.8))
    L.llama_sampler_chain_add(c, L.llama_sampler_init_dist(42))
    return c


def measure(kind, vocab, iterations):
    rng = np.random.default_rng(7)
    inputs = [rng.normal(0, 3, vocab).astype(np.float32) for _ in range(8)]
    c = chain(kind, vocab)
    for i in range(64):
        L.llama_sampler_accept(c, (i * 2654435761) % vocab)
    data = np.zeros(vocab, dtype=TOKEN_DATA)
    ids = np.arange(vocab, dtype=np.int32)
    apply_us, total_us = [], []
    for it in range(iterations):
        t0 = time.perf_counter_ns()
        data["id"] = ids
        data["logit"] = inputs[it % len(inputs)]
        data["p"] = 0
        arr = L.llama_token_data_array(data.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), vocab, -1, False)
        t1 = time.perf_counter_ns()
        L.llama_sampler_apply(c, ctypes.byref(arr))
        t2 = time.perf_counter_ns()
        apply_us.append((t2 - t1) / 1e3)
        total_us.append((t2 - t0) / 1e3)
    L.llama_sampler_free(c)
    return {"kind": kind, "vocab": vocab, "iterations": iterations,
            "apply_us_p50": statistics.median(apply_us), "build_apply_us_p50": statistics.median(total_us)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    for vocab in (151936, 49152):
        for kind in ("default", "greedy", "top_p_only"):
            n = a.iterations if kind != "top_p_only" else max(20, a.iterations // 10)
            rows.append(measure(kind, vocab, n))
    if a.json:
        print(json.dumps(rows))
    else:
        print(f"llama.cpp (llama-cpp-python {L.__version__}) sampler chain, median µs per token")
        print(f"{'chain':<12} {'vocab':>7} {'apply':>10} {'build+apply':>12}")
        for r in rows:
            print(f"{r['kind']:<12} {r['vocab']:>7} {r['apply_us_p50']:>10.1f} {r['build_apply_us_p50']:>12.1f}")


if __name__ == "__main__":
    main()
