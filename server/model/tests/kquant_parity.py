#!/usr/bin/env python3
"""Kernel parity: our single-row products (`model_probe kdot`) must equal
llama.cpp's own CPU kernels bit for bit on the same bytes, for the formats
the model host keeps natively beyond Q4_1/Q8_0: Q4_K, Q5_K and Q6_K
(`ggml_vec_dot_q*_K_q8_K` on Q8_K activations), Q5_0
(`ggml_vec_dot_q5_0_q8_0`) and Q5_1 (`ggml_vec_dot_q5_1_q8_1`). Weights come from ggml's reference quantisers,
activations are quantised by ggml's CPU `from_float` on ggml's side and by
ours on ours, so the activation quantisation is checked too.

The kernels are called through llama-cpp-python's bundled libggml-cpu
(`ggml_get_type_traits_cpu`), on this machine; nothing is stored.

Run: $HOME/.cache/samplerd/venv/bin/python server/model/tests/kquant_parity.py [ROWS]
(exits 0 with a notice when the bundled libraries cannot be found).
"""
import ctypes
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_ref as R  # noqa: E402

# ggml_type ids and block bytes; (type, block values, block bytes, reference quantiser)
TYPES = {
    "q4_K": (12, 256, 144, "quantize_row_q4_K_ref"),
    "q5_K": (13, 256, 176, "quantize_row_q5_K_ref"),
    "q6_K": (14, 256, 210, "quantize_row_q6_K_ref"),
    "q5_0": (6, 32, 22, "quantize_row_q5_0_ref"),
    "q5_1": (7, 32, 24, "quantize_row_q5_1_ref"),
}
COLS = 1536  # SmolLM2's feed-forward width (six super-blocks)


class Traits(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
ACT_BYTES = {15: 292, 8: 34, 9: 36}  # block_q8_K per 256 values, block_q8_0 / q8_1 per 32


def libs():
    d = os.path.join(os.path.dirname(R.llama_cpp.__file__), "lib")
    base, cpu = glob.glob(os.path.join(d, "libggml-base.so*")), glob.glob(os.path.join(d, "libggml-cpu.so*"))
    if not base or not cpu:
        return None
    base = ctypes.CDLL(sorted(base)[0], mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(sorted(cpu)[0], mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    cpu.ggml_cpu_init()
    return base, cpu


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    found = libs()
    if found is None:
        print("NOTICE: llama-cpp-python's libggml libraries not found; skipping")
        return 0
    base, cpu = found
    rng = np.random.default_rng(2026)
    failed = 0
    for name, (ty, qk, bb, qfn) in TYPES.items():
        tr = cpu.ggml_get_type_traits_cpu(ty).contents
        vec_dot = VEC_DOT(tr.vec_dot)
        act = cpu.ggml_get_type_traits_cpu(tr.vec_dot_type).contents
        from_float = FROM_FLOAT(act.from_float)
        quant = getattr(base, qfn)
        rows, want = [], []
        for _ in range(n):
            w = (rng.standard_normal(COLS) * rng.uniform(0.01, 0.2)).astype(np.float32)
            raw = ctypes.create_string_buffer(COLS // qk * bb)
            quant(ctypes.c_void_p(w.ctypes.data), raw, ctypes.c_int64(COLS))
            # Heavy-tailed activations, like SwiGLU outputs; some all-zero blocks.
            x = (rng.standard_normal(COLS) * rng.standard_normal(COLS) * rng.uniform(0.01, 4)).astype(np.float32)
            if rng.uniform() < 0.05:
                x[:256] = 0
            xq = ctypes.create_string_buffer(COLS // (256 if tr.vec_dot_type == 15 else 32) * ACT_BYTES[tr.vec_dot_type])
            from_float(x.ctypes.data, xq, COLS)
            s = ctypes.c_float()
            vec_dot(COLS, ctypes.byref(s), 0, raw, 0, xq, 0, 1)
            want.append(int(np.float32(s.value).view(np.uint32)))
            rows.append({"raw": raw.raw.hex(), "x": [float(v) for v in x]})
        got = R.probe("kdot", stdin=json.dumps({"kind": name, "cols": COLS, "rows": rows}))["dot"]
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        failed += bool(bad) or len(got) != n
        print(f"{'OK  ' if not bad else 'FAIL'} {name}: {n - len(bad)}/{n} rows equal to llama.cpp's "
              f"ggml_vec_dot_{name}_{ {6: 'q8_0', 7: 'q8_1'}.get(ty, 'q8_K') } bit for bit")
        for i in bad[:3]:
            print(f"  row {i}: llama.cpp {np.uint32(want[i]).view(np.float32)!r} ours {np.uint32(got[i]).view(np.float32)!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
