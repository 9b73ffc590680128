#!/usr/bin/env python3
"""Sampler parity with llama.cpp itself.

Applies llama.cpp's sampler chain (llama-cpp-python's bundled libllama,
`llama_sampler_*` through ctypes) and ours (the core plugin through the
plugin ABI, via the `chain_probe` example) to the same random logits across
many parameter combinations — vocabularies from 2 to 151,936, every stage
of the default chain, windows with repeats and out-of-range ids, edge
values — and compares the surviving candidates and their probabilities
(relative tolerance 1e-5), then DRY cases over repetitive windows. The
final draw is excluded: llama.cpp draws with
mt19937, we with the host's ChaCha stream (documented in docs/SAMPLING.md).

Env: SAMPLERD_CHAIN_PROBE (path to chain_probe), SAMPLERD_PLUGIN (core .so),
PARITY_CASES (number of random cases, default 400), PARITY_DRY_CASES
(default 80).
"""
import ctypes
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import llama_cpp as L

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
PROBE = os.environ.get("SAMPLERD_CHAIN_PROBE", os.path.join(TARGET, "release", "examples", "chain_probe"))
PLUGIN = os.environ.get("SAMPLERD_PLUGIN", os.path.join(TARGET, "release", "libsamplerd_core_stages.so"))
RTOL = 1e-5

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)
assert TOKEN_DATA.itemsize == ctypes.sizeof(L.llama_token_data)

# The bundled libllama takes five arguments, (n_vocab, last_n, repeat, freq,
# present), as its own include/llama.h and llama-cpp-python's binding say.
# (An earlier version of this script bound a four-argument form; on x86-64
# that put last_n into n_vocab and left last_n as register garbage, so the
# window size was ignored.) `check_penalties_binding` proves the binding on
# hand-checked cases, including one where last_n cuts the window.
init_penalties = L.llama_sampler_init_penalties

# DRY: the bundled libllama's llama_sampler_init_dry takes seven arguments
# (vocab, multiplier, base, allowed_length, penalty_last_n, breakers,
# n_breakers), as llama-cpp-python binds it; `check_dry_binding` proves it
# on a hand-checked case. The vocabulary is only read for sequence
# breakers, and these cases have none (ours: `dry_sequence_breakers =
# [""]`); breakers are covered by llama.cpp's own test_dry cases in
# server/tests/llama_cases.rs. penalty_last_n = -1 (llama.cpp: the model's
# training context, which a null vocabulary does not have) is left out.
init_dry = L.llama_sampler_init_dry

DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0, typical_p=1.0,
                repeat_penalty=1.1, frequency_penalty=0.0, presence_penalty=0.0,
                repeat_last_n=64, top_n_sigma=-1.0)


def llama_chain(params, n_vocab, window):
    """llama.cpp's chain in its default order, stages at neutral values
    included (they are no-ops there), temperature last; no final draw."""
    p = {**DEFAULTS, **params}
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    bias = params.get("logit_bias") or []
    if bias:
        arr = (L.llama_logit_bias * len(bias))(*[L.llama_logit_bias(t, b) for t, b in bias])
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_logit_bias(n_vocab, len(bias), arr))
    last_n = p["repeat_last_n"] if p["repeat_last_n"] >= 0 else 65536
    L.llama_sampler_chain_add(chain, init_penalties(
        n_vocab, last_n, p["repeat_penalty"], p["frequency_penalty"], p["presence_penalty"]))
    if p.get("dry_multiplier", 0.0) != 0.0:
        L.llama_sampler_chain_add(chain, init_dry(
            None, p["dry_multiplier"], p["dry_base"], p["dry_allowed_length"],
            p["dry_penalty_last_n"], None, 0))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_n_sigma(p["top_n_sigma"]))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(p["top_k"]))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_typical(p["typical_p"], 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(p["top_p"], 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(p["min_p"], 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(p["temperature"]))
    for t in window:
        L.llama_sampler_accept(chain, t)
    return chain


def llama_survivors(logits, params, window):
    n = len(logits)
    data = np.zeros(n, dtype=TOKEN_DATA)
    data["id"] = np.arange(n, dtype=np.int32)
    data["logit"] = logits
    arr = L.llama_token_data_array(
        data.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), n, -1, False)
    chain = llama_chain(params, n, window)
    try:
        L.llama_sampler_apply(chain, ctypes.byref(arr))
    finally:
        L.llama_sampler_free(chain)
    # The chain may have moved its data pointer (xtc/top-k style offsets).
    size = arr.size
    out = np.ctypeslib.as_array(arr.data, shape=(size,)).view(TOKEN_DATA) if size else data[:0]
    out = out[np.isfinite(out["logit"])]
    lg = out["logit"].astype(np.float64)
    probs = np.exp(lg - lg.max())
    probs /= probs.sum()
    order = np.argsort(out["id"])
    return out["id"][order].astype(np.int64), probs[order]


def check_penalties_binding():
    """docs/SAMPLING.md's "the / cat" example: 8.5 / 1.1 for a repeated token;
    then last_n = 2 over the window [0, 0, 1]: only the last two count."""
    ids, probs = llama_survivors(np.array([8.5, 7.9], dtype=np.float32),
                                 {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, [0, 0, 0])
    want = np.exp([8.5 / 1.1, 7.9]) / np.exp([8.5 / 1.1, 7.9]).sum()
    assert np.allclose(probs, want, rtol=1e-5), (probs, want)
    ids, probs = llama_survivors(np.array([2.0, 2.0, 2.0], dtype=np.float32),
                                 {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repeat_last_n": 2,
                                  "repeat_penalty": 1.0, "frequency_penalty": 1.0}, [0, 0, 1])
    want = np.exp([1.0, 1.0, 2.0]) / np.exp([1.0, 1.0, 2.0]).sum()
    assert np.allclose(probs, want, rtol=1e-5), (probs, want)


def check_dry_binding():
    """History 0 1 2 0 1: only token 2 continues a repeat ("0 1" → 2, length
    2), so with multiplier 1, base 2, allowed_length 1 its logit drops by
    1·2^(2−1) = 2 and the others keep theirs."""
    ids, probs = llama_survivors(np.zeros(3, dtype=np.float32),
                                 {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0,
                                  "dry_multiplier": 1.0, "dry_base": 2.0, "dry_allowed_length": 1,
                                  "dry_penalty_last_n": 64}, [0, 1, 2, 0, 1])
    want = np.exp([0.0, 0.0, -2.0]) / np.exp([0.0, 0.0, -2.0]).sum()
    assert np.allclose(probs, want, rtol=1e-5), (probs, want)


def dry_params(rng, vocab):
    """A DRY case: DRY on (no sequence breakers) before the default chain's
    truncations at everyday values, so its penalties reach the result."""
    p = {"temperature": float(rng.choice([0.8, 1.0, 1.5])),
         "top_k": int(rng.choice([0, 40, vocab])),
         "top_p": float(rng.choice([1.0, 0.95])),
         "min_p": float(rng.choice([0.0, 0.05])),
         "repeat_penalty": float(rng.choice([1.0, 1.1]))}
    p["dry_multiplier"] = float(rng.choice([0.25, 0.8, 1.0, 2.0]))
    p["dry_base"] = float(rng.choice([1.0, 1.1, 1.75, 3.0]))
    p["dry_allowed_length"] = int(rng.choice([0, 1, 2, 3, 5]))
    p["dry_penalty_last_n"] = int(rng.choice([1, 16, 64, 64, 512]))
    p["dry_sequence_breakers"] = [""]
    for k in ("dry_multiplier", "dry_base", "temperature", "top_p", "min_p", "repeat_penalty"):
        p[k] = float(np.float32(p[k]))
    return p


def repetitive_window(rng, logits):
    """20 to ~300 tokens built from a few repeated phrases of the likeliest
    tokens (so the tokens DRY penalises are ones the chain keeps), with
    noise: long repeats for DRY to find, some cut short."""
    top = np.argsort(logits)[-min(len(logits), 24):]
    phrases = [rng.choice(top, size=int(rng.integers(1, 9))).tolist() for _ in range(4)]
    window, length = [], int(rng.integers(20, 300))
    while len(window) < length:
        if rng.random() < 0.8:
            window += phrases[int(rng.integers(0, 4))]
        else:
            window.append(int(rng.integers(0, len(logits))))
    if rng.random() < 0.5:
        window += phrases[0][: int(rng.integers(1, len(phrases[0]) + 1))]
    return [int(t) for t in window]


def random_params(rng, vocab):
    p = {}
    r = rng.random
    p["temperature"] = float(rng.choice([0.0, 0.01, 0.5, 0.8, 1.0, 1.5, 3.0]))
    p["top_k"] = int(rng.choice([0, 1, 2, 5, 40, 100, vocab, vocab + 7]))
    p["top_p"] = float(rng.choice([1.0, 0.95, 0.5, 0.1, 0.999, float(np.float32(r()) * 0.98 + 0.01)]))
    p["min_p"] = float(rng.choice([0.0, 0.0, 0.05, 0.2, 0.9]))
    p["typical_p"] = float(rng.choice([1.0, 1.0, 1.0, 0.9, 0.5, 0.2]))
    p["repeat_penalty"] = float(rng.choice([1.0, 1.1, 1.5, 0.8, 2.0]))
    p["frequency_penalty"] = float(rng.choice([0.0, 0.0, 0.5, 1.0]))
    p["presence_penalty"] = float(rng.choice([0.0, 0.0, 0.3, 1.0]))
    p["repeat_last_n"] = int(rng.choice([0, 1, 8, 64, 64, -1]))
    p["top_n_sigma"] = float(rng.choice([-1.0, -1.0, -1.0, 1.0, 2.5]))
    if r() < 0.3:
        ids = rng.integers(0, vocab + 3, size=int(rng.integers(1, 6)))
        p["logit_bias"] = [[int(t), float(np.float32(rng.normal(0, 5)))] for t in ids if t < vocab]
    # f32-representable values, so both sides see the same numbers.
    for k, v in list(p.items()):
        if isinstance(v, float):
            p[k] = float(np.float32(v))
    return p


def main():
    check_penalties_binding()
    check_dry_binding()
    n_cases = int(os.environ.get("PARITY_CASES", "400"))
    rng = np.random.default_rng(20261130)
    vocabs = [2, 3, 10, 100, 1000, 5000, 32000, 49152, 151936]
    cases, chunks, offset = [], [], 0
    for i in range(n_cases):
        vocab = int(vocabs[i % len(vocabs)]) if i < 3 * len(vocabs) else int(rng.choice(vocabs[:6]))
        logits = (rng.normal(0, 3, vocab)).astype(np.float32)
        if vocab > 4 and rng.random() < 0.2:
            logits[rng.integers(0, vocab, size=2)] = -np.inf
        if rng.random() < 0.1:  # ties
            logits[: min(vocab, 5)] = logits[0]
        window = rng.integers(0, max(2, min(vocab, 50)), size=int(rng.integers(0, 100))).tolist()
        if rng.random() < 0.2:
            window.append(vocab + 5)  # out of range: skipped on both sides
        params = random_params(rng, vocab)
        cases.append({"offset": offset, "vocab": vocab, "params": params, "window": window})
        chunks.append(logits)
        offset += vocab
    # Pinned edge cases.
    edge = [
        {"temperature": 0.0}, {"top_k": 1}, {"top_p": 1.0, "top_k": 0}, {"top_p": 0.95, "top_k": 0},
        {"repeat_penalty": 1.0, "repeat_last_n": 0}, {"min_p": 0.5, "top_k": 0, "top_p": 1.0},
    ]
    for ep in edge:
        vocab = 151936
        logits = rng.normal(0, 3, vocab).astype(np.float32)
        cases.append({"offset": offset, "vocab": vocab, "params": ep, "window": list(range(0, 640, 10))})
        chunks.append(logits)
        offset += vocab

    # top-p over the whole vocabulary (top-k off): nuclei of 3,000-40,000
    # tokens, where the f32 rounding of llama.cpp's sums decides the cut;
    # ties inside the nucleus (equal probabilities in the running sum, the
    # cut itself in untied tokens, since llama.cpp's order among ties at
    # the cut is std::sort's); a large unsorted candidate list (after
    # top_n_sigma); a window that changes the order of the top tokens.
    def tied_top(lg, n_top, step):
        top = np.argsort(lg)[-n_top:]
        lg[top] = np.round(lg[top] / step) * step
        return lg
    nucleus_cases = [
        (151936, 3.0, {"top_p": 0.95, "top_k": 0, "temperature": 1.0}, None),
        (151936, 3.0, {"top_p": 0.99, "top_k": 0}, None),
        (151936, 3.0, {"top_p": 0.5, "top_k": 0}, None),
        (151936, 1.0, {"top_p": 0.95, "top_k": 0}, None),
        (151936, 1.0, {"top_p": 0.9, "top_k": 0, "min_p": 0.05}, None),
        (151936, 6.0, {"top_p": 0.95, "top_k": 0}, None),
        (151936, 3.0, {"top_p": 0.95, "top_k": 0}, lambda lg: tied_top(lg, 800, 0.25)),
        (151936, 2.0, {"top_p": 0.9, "top_k": 0}, lambda lg: tied_top(lg, 3000, 0.125)),
        (151936, 3.0, {"top_p": 0.95, "top_k": 0, "top_n_sigma": 2.5}, None),
        (151936, 3.0, {"top_p": 0.95, "top_k": 20000}, None),
        (49152, 3.0, {"top_p": 0.95, "top_k": 0, "repeat_penalty": 1.5}, None),
        (32000, 2.0, {"top_p": 0.97, "top_k": 0, "frequency_penalty": 0.5}, None),
        (5000, 3.0, {"top_p": 0.95, "top_k": 0}, lambda lg: tied_top(lg, 100, 0.5)),
    ]
    for vocab, sd, ep, tweak in nucleus_cases:
        logits = rng.normal(0, sd, vocab).astype(np.float32)
        if tweak is not None:
            logits = tweak(logits).astype(np.float32)
        window = rng.integers(0, vocab, size=64).tolist()
        cases.append({"offset": offset, "vocab": vocab, "params": ep, "window": window})
        chunks.append(logits)
        offset += vocab

    # DRY (llama.cpp's `dry` sampler, between penalties and top_n_sigma),
    # from its own stream so the cases above stay as they were.
    dry_rng = np.random.default_rng(20261203)
    n_dry = int(os.environ.get("PARITY_DRY_CASES", "80"))
    dry_changed = 0
    for i in range(n_dry):
        vocab = int(dry_rng.choice([3, 10, 100, 1000, 32000, 49152, 151936]))
        logits = dry_rng.normal(0, 3, vocab).astype(np.float32)
        params, window = dry_params(dry_rng, vocab), repetitive_window(dry_rng, logits)
        cases.append({"offset": offset, "vocab": vocab, "params": params, "window": window})
        chunks.append(logits)
        offset += vocab
        # The reference must feel DRY, or agreeing with it proves nothing.
        off = llama_survivors(logits, {**params, "dry_multiplier": 0.0}, window)
        on = llama_survivors(logits, params, window)
        if len(on[0]) != len(off[0]) or not np.array_equal(on[0], off[0]) or not np.allclose(on[1], off[1], rtol=RTOL):
            dry_changed += 1
    print(f"DRY changes llama.cpp's result in {dry_changed} of {n_dry} DRY cases")
    assert n_dry == 0 or dry_changed * 4 >= n_dry, "the DRY cases barely exercise DRY"

    all_logits = np.concatenate(chunks).astype("<f4")
    with tempfile.TemporaryDirectory() as tmp:
        lpath = os.path.join(tmp, "logits.f32")
        all_logits.tofile(lpath)
        proc = subprocess.run([PROBE, PLUGIN, lpath], input="\n".join(json.dumps(c) for c in cases),
                              capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(proc.stderr)
        raise SystemExit(f"chain_probe failed with {proc.returncode}")
    ours = [json.loads(l) for l in proc.stdout.splitlines()]
    assert len(ours) == len(cases), (len(ours), len(cases))

    passed = failed = 0
    for i, (case, mine) in enumerate(zip(cases, ours)):
        logits = all_logits[case["offset"]: case["offset"] + case["vocab"]]
        ids, probs = llama_survivors(logits, case["params"], case["window"])
        problem = None
        if "error" in mine:
            problem = f"ours failed: {mine['error']}"
        else:
            surv = mine["survivors"]
            my_ids = np.array([s[0] for s in surv], dtype=np.int64)
            my_p = np.array([s[1] for s in surv], dtype=np.float64)
            if len(my_ids) != len(ids) or not np.array_equal(my_ids, ids):
                extra = sorted(set(my_ids.tolist()) - set(ids.tolist()))[:5]
                missing = sorted(set(ids.tolist()) - set(my_ids.tolist()))[:5]
                problem = f"survivors differ: ours {len(my_ids)} llama {len(ids)}; extra {extra} missing {missing}"
            elif not np.allclose(my_p, probs, rtol=RTOL, atol=1e-9):
                j = int(np.argmax(np.abs(my_p - probs) / np.maximum(probs, 1e-30)))
                problem = f"probability of token {ids[j]}: ours {my_p[j]:.9g} llama {probs[j]:.9g}"
        if problem:
            failed += 1
            if failed <= 15:
                print(f"case {i}: vocab={case['vocab']} params={case['params']} window_len={len(case['window'])}\n"
                      f"  chain: {mine.get('chain')}\n  {problem}")
        else:
            passed += 1
    print(f"sampler parity vs llama.cpp {L.__version__}: {len(cases)} cases")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
