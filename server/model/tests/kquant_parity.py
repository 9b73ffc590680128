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

Steps of 8 or more tokens take another path in ggml, its tiled K-quant
matmul (`ggml-cpu/tiled/`): a whole matrix product through ggml's own graph
(`ggml_mul_mat`, 2 threads) must equal `model_probe ktiled` bit for bit
for 8 to 40 tokens by 64 rows of each K-quant.

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


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def declare_graph_api(base, cpu):
    """The ggml graph functions `graph_matmul` calls, with their C types."""
    for f in ["ggml_init", "ggml_new_tensor_2d", "ggml_mul_mat", "ggml_new_graph", "ggml_get_data"]:
        getattr(base, f).restype = ctypes.c_void_p
    base.ggml_init.argtypes = [InitParams]
    base.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_mul_mat.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    base.ggml_new_graph.argtypes = [ctypes.c_void_p]
    base.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    base.ggml_get_data.argtypes = [ctypes.c_void_p]
    base.ggml_free.argtypes = [ctypes.c_void_p]
    cpu.ggml_graph_compute_with_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


def graph_matmul(base, cpu, ty, raw, rows, xs):
    """`raw` (rows × COLS of type `ty`) times the f32 rows `xs`, through
    ggml's graph: its tiled path for 8+ rows. Token-major f32 bits."""
    ctx = base.ggml_init(InitParams(256 << 20, None, False))
    a = base.ggml_new_tensor_2d(ctx, ty, COLS, rows)
    ctypes.memmove(base.ggml_get_data(a), raw, len(raw))
    xb = np.ascontiguousarray(np.array(xs, dtype=np.float32))
    b = base.ggml_new_tensor_2d(ctx, 0, COLS, len(xs))
    ctypes.memmove(base.ggml_get_data(b), xb.ctypes.data, xb.nbytes)
    c = base.ggml_mul_mat(ctx, a, b)
    gf = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(gf, c)
    cpu.ggml_graph_compute_with_ctx(ctx, gf, 2)
    out = np.ctypeslib.as_array(ctypes.cast(base.ggml_get_data(c), ctypes.POINTER(ctypes.c_uint32)),
                                shape=(len(xs) * rows,)).copy()
    base.ggml_free(ctx)
    return out


def check_tiled(base, cpu, rng):
    """Failures of the tiled order against ggml's graph (see the module doc)."""
    declare_graph_api(base, cpu)
    failed = 0
    rows = 64
    for name in ["q4_K", "q5_K", "q6_K"]:
        ty, qk, bb, qfn = TYPES[name]
        quant = getattr(base, qfn)
        raws = []
        for _ in range(rows):
            w = (rng.standard_normal(COLS) * rng.uniform(0.01, 0.2)).astype(np.float32)
            raw = ctypes.create_string_buffer(COLS // qk * bb)
            quant(ctypes.c_void_p(w.ctypes.data), raw, ctypes.c_int64(COLS))
            raws.append(raw.raw)
        for n_tok in [8, 9, 16, 17, 40]:
            xs = [(rng.standard_normal(COLS) * rng.standard_normal(COLS) * rng.uniform(0.01, 4)).astype(np.float32)
                  for _ in range(n_tok)]
            want = graph_matmul(base, cpu, ty, b"".join(raws), rows, xs)
            req = {"kind": name, "cols": COLS, "rows": [r.hex() for r in raws],
                   "xs": [[float(v) for v in x] for x in xs]}
            got = np.array(R.probe("ktiled", stdin=json.dumps(req))["out"], dtype=np.uint32)
            equal = int((got == want).sum())
            failed += equal != len(want)
            print(f"{'OK  ' if equal == len(want) else 'FAIL'} {name} tiled, {n_tok} tokens x {rows} rows: "
                  f"{equal}/{len(want)} equal to ggml_mul_mat's bit for bit")
    return failed


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
    failed += check_tiled(base, cpu, rng)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
