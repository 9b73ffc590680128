"""Shared llama.cpp (llama-cpp-python) reference helpers for the parity
scripts (`tokenizer_parity.py`, `greedy_parity.py`) and
`scripts/bench_llamacpp.py`.

Two quirks of this environment are handled here:

* llama.cpp's AMX "extra buffer type" (weight repacking for Intel AMX) dies
  with SIGILL on these VMs (tile instructions are not enabled for the
  process), so `use_extra_bufts` is turned off: llama.cpp then runs its
  ordinary AVX2/AVX-512 CPU kernels on the GGUF weights as stored.
* With `logits_all=False`, `Llama.eval` no longer copies logits into
  `Llama.scores`; we read the last row with `llama_get_logits_ith(ctx, -1)`.
"""
import json
import os
import subprocess
import sys

import llama_cpp
import llama_cpp.llama_cpp as C
import numpy as np

_orig_model_params = C.llama_model_default_params


def _model_params():
    p = _orig_model_params()
    p.use_extra_bufts = False
    return p


C.llama_model_default_params = _model_params

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
MODEL = os.environ.get("SAMPLERD_MODEL", os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def load(vocab_only=False, n_threads=2, n_ctx=2048, model=None):
    return llama_cpp.Llama(
        model or MODEL, vocab_only=vocab_only, n_threads=n_threads, n_threads_batch=n_threads, n_ctx=n_ctx,
        logits_all=False, verbose=False, flash_attn=False,
    )


def last_logits(llm):
    ptr = C.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def is_eog(llm, t):
    return bool(C.llama_vocab_is_eog(llm._model.vocab, t))


def log_softmax_at(logits, i):
    """log softmax(logits)[i] in float64 (as `model_probe greedy` reports it)."""
    x = logits.astype(np.float64)
    m = x.max()
    return float(x[i] - m - np.log(np.exp(x - m).sum()))


def greedy(llm, prompt_ids, n, logprobs=None):
    """Greedy (argmax, first on ties) continuation; stops after an EOG token.
    Returns (tokens, first-step logits); with a list as `logprobs`, appends
    each chosen token's log-probability to it."""
    llm.reset()
    llm.eval(prompt_ids)
    out, first = [], None
    for _ in range(n):
        lg = last_logits(llm)
        if first is None:
            first = lg
        t = int(np.argmax(lg))
        if logprobs is not None:
            logprobs.append(log_softmax_at(lg, t))
        out.append(t)
        if is_eog(llm, t) or len(out) == n:
            break
        llm.eval([t])
    return out, first


def requantize(src, dst, ftype=None):
    """Writes `src` requantised by llama.cpp's own quantiser (default
    Q4_K_M, `allow_requantize`) to `dst`; raises on failure."""
    import ctypes
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M if ftype is None else ftype
    p.allow_requantize = True
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}) returned {rc}")


def probe(*args, stdin=""):
    """Runs our `model_probe` example (release build) and returns its JSON."""
    cmd = ["cargo", "run", "--quiet", "--release", "-p", "samplerd-model", "--example", "model_probe", "--", *args]
    r = subprocess.run(cmd, cwd=ROOT, input=stdin, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"model_probe failed ({r.returncode}):\n{r.stderr}")
    return json.loads(r.stdout)
