//! The emulation cases of every weight format the CUDA backend keeps.
//!
//! `emulation` runs them with `formats.cpp`: the embedding
//! lookup against `QMatrix::dequant_row`, the weight products in both
//! kernel layouts (`mmw_*`, `mm_*`) against `QMatrix::matmul` in each of
//! the CPU's orders a launch can pick (`format::Order`: one token, several
//! tokens, the tiled K-quant order of 8+, the one-row order of the last
//! layer's feed-forward), and `quantize_q8_k` against
//! `quant::quantize_q8_k`. The matrices are built from GGUF bytes as the
//! loader builds them and sent as `format::DevFormat::of` uploads them.

use std::path::Path;

use half::{bf16, f16};

use super::out::{Out, bytes, quantized};
use crate::cuda::format::{ActKind, DevFormat, Order, Q8K_BYTES};
use crate::ggml::{self, Flavor};
use crate::pool::ThreadPool;
use crate::quant::BlockBf16;
use crate::quant::{Acts, KQuant, QK, QMatrix};
use crate::quant::{BlockQ8K, QK_K, quantize_q8_k};
use crate::test_rng::Lcg;

/// A random `rows × cols` matrix of format `f` (scales of realistic size,
/// both signs), from GGUF bytes as the loader reads them.
fn matrix(f: DevFormat, rows: usize, cols: usize, r: &mut Lcg) -> QMatrix {
    let h = |v: f32| f16::from_f32(v).to_le_bytes();
    let mut raw = Vec::new();
    let bytes = |raw: &mut Vec<u8>, n: usize, r: &mut Lcg| raw.extend((0..n).map(|_| r.byte()));
    let (n32, nk) = (rows * cols / QK, rows * cols / QK_K);
    let k = |kind: KQuant, raw: &mut Vec<u8>, r: &mut Lcg| {
        for _ in 0..nk {
            let (d, dmin) = (h(0.001 + 0.01 * r.f()), h(0.002 * r.f()));
            if kind == KQuant::Q6K {
                bytes(raw, 208, r);
                raw.extend(d);
            } else {
                raw.extend(d);
                raw.extend(dmin);
                bytes(raw, kind.block_bytes() - 4, r);
            }
        }
        QMatrix::from_k_bytes(kind, rows, cols, raw)
    };
    let m = match f {
        DevFormat::Q8_0 => {
            let w: Vec<f32> = (0..rows * cols).map(|_| r.f31()).collect();
            QMatrix::q8_0_from_f32(rows, cols, &w)
        }
        DevFormat::Q4_1 | DevFormat::Q5_0 | DevFormat::Q5_1 => {
            for _ in 0..n32 {
                raw.extend(h(0.1 * r.f31()));
                if f != DevFormat::Q5_0 {
                    raw.extend(h(0.5 * r.f31()));
                }
                if f != DevFormat::Q4_1 {
                    raw.extend(r.u32().to_le_bytes());
                }
                bytes(&mut raw, 16, r);
            }
            match f {
                DevFormat::Q4_1 => QMatrix::from_q4_1_bytes(rows, cols, &raw),
                DevFormat::Q5_0 => QMatrix::from_q5_0_bytes(rows, cols, &raw),
                _ => QMatrix::from_q5_1_bytes(rows, cols, &raw),
            }
        }
        DevFormat::Q4K => k(KQuant::Q4K, &mut raw, r),
        DevFormat::Q5K => k(KQuant::Q5K, &mut raw, r),
        DevFormat::Q6K => k(KQuant::Q6K, &mut raw, r),
        DevFormat::F16 => {
            raw.extend((0..rows * cols).flat_map(|_| h(r.f31())));
            QMatrix::from_f16_bytes(rows, cols, &raw)
        }
        DevFormat::Bf16 => {
            raw.extend((0..rows * cols).flat_map(|_| bf16::from_f32(r.f31()).to_le_bytes()));
            QMatrix::from_bf16_bytes(rows, cols, &raw)
        }
    };
    let m = m.expect("whole blocks");
    assert_eq!(DevFormat::of(&m).0, f, "the loader keeps {f:?}");
    m
}

fn index(f: DevFormat) -> i32 {
    DevFormat::ALL.iter().position(|&g| g == f).expect("listed") as i32
}

/// One product case: the kernels' arguments and the expected outputs.
struct MmCase {
    label: String,
    fmt: DevFormat,
    rows: usize,
    cols: usize,
    /// The weights as uploaded.
    w: Vec<u8>,
    n: usize,
    tiled: bool,
    gemm: bool,
    pairs: bool,
    lanes: usize,
    /// The activations in the form the format reads.
    x: Vec<u8>,
    want: Vec<f32>,
}

impl MmCase {
    fn put(&self, f: &mut Out) {
        f.put(&[self.label.len() as i32]);
        f.put(self.label.as_bytes());
        f.put(&[
            index(self.fmt),
            self.rows as i32,
            self.cols as i32,
            self.n as i32,
            self.tiled as i32,
            self.gemm as i32,
            self.pairs as i32,
            self.lanes as i32,
            self.w.len() as i32,
            self.x.len() as i32,
        ]);
        f.put(&self.w);
        f.put(&self.x);
        f.put(&self.want);
    }
}

/// `m` times `n` tokens of `x` on the CPU with the given order flags: the
/// activations as the kernels read them, and `QMatrix::matmul`'s result.
fn product(m: &QMatrix, x: &[f32], n: usize, order: Order, fl: Flavor) -> (Vec<u8>, Vec<f32>) {
    let pool = ThreadPool::new(1);
    let mut out = vec![0f32; n * m.rows()];
    let (tiled, gemm) = (vec![order.tiled; n], vec![order.gemm; n]);
    let acts = |q8, q8k, x| Acts {
        q8,
        q8k,
        tiled: &tiled,
        x,
        gemm: &gemm,
        flavor: fl,
    };
    let sent = match DevFormat::of(m).0.acts() {
        ActKind::Q8_1 => {
            let xq = quantized(x);
            m.matmul(&pool, acts(&xq, &[], &[]), n, &mut out);
            bytes(&xq).to_vec()
        }
        ActKind::Q8K => {
            let mut xq = vec![BlockQ8K::default(); x.len() / QK_K];
            quantize_q8_k(x, &mut xq);
            m.matmul(&pool, acts(&[], &xq, &[]), n, &mut out);
            bytes(&xq).to_vec()
        }
        ActKind::F32 => {
            m.matmul(&pool, acts(&[], &[], x), n, &mut out);
            bytes(x).to_vec()
        }
    };
    (sent, out)
}

/// A BF16 product in the order the CPU backend does not take on this CPU
/// for the AVX-512 flavour (pairs, or lanes, whichever `dot_half_row`
/// skips), computed with that order's own function, so the kernels' other
/// branch is checked too.
fn bf16_other_order(m: &QMatrix, x: &[f32], n: usize, gemm: bool) -> (bool, Vec<f32>) {
    let QMatrix::Bf16 { blocks, cols, .. } = m else {
        unreachable!("a BF16 matrix")
    };
    let pairs = !ggml::flavor::has_avx512_bf16();
    let mut xr = Vec::new();
    crate::quant::format::half::round_acts(x, true, &mut xr);
    let nb = cols / QK;
    let mut out = Vec::new();
    for t in 0..n {
        for row in blocks.chunks_exact(nb) {
            let xt = &xr[t * cols..(t + 1) * cols];
            out.push(if pairs {
                ggml::half::dot_bf16_pairs::<BlockBf16>(row, xt, gemm)
            } else {
                ggml::half::dot_half_row_scalar(row, xt, gemm, Flavor::Avx512)
            });
        }
    }
    (pairs, out)
}

/// `formats`: which formats' products to check (the flavour changes only
/// the F16 / BF16 ones).
fn write_mm(dir: &Path, r: &mut Lcg, fl: Flavor, formats: &[DevFormat]) {
    let mut cases = Vec::new();
    // The vector dot (one token, or the one-row order of any step);
    // tinyBLAS (F16/BF16 steps of 2+ tokens); the tiled K-quant order (and
    // tinyBLAS: a step of 8+).
    let vec_dot = Order::of_step(1, false);
    let (gemm, tiled) = (Order::of_step(2, false), Order::of_step(8, false));
    for &f in formats {
        // Shapes: rows that do not fill the last block of threads; rows of
        // more than one round of the warp kernels (32 blocks for the
        // 32-value formats, 4 super-blocks for the K-quants), fewer, and
        // for the half formats a tail beyond the AVX-512 vector dot's
        // 64-value steps (96).
        let shapes: &[(usize, usize)] = match f.acts() {
            ActKind::Q8_1 => &[(17, 1536), (9, 96), (5, 1056)],
            ActKind::Q8K => &[(17, 256), (9, 2304), (5, 1280)],
            ActKind::F32 => &[(17, 96), (9, 576), (5, 1536)],
        };
        // Token counts and the orders a launch gives them.
        let orders: &[(usize, Order)] = match f.acts() {
            ActKind::Q8_1 => &[(1, vec_dot), (2, vec_dot), (5, vec_dot)],
            ActKind::Q8K => &[(1, vec_dot), (3, vec_dot), (9, tiled), (9, vec_dot)],
            ActKind::F32 => &[(1, vec_dot), (5, gemm), (2, gemm), (3, vec_dot)],
        };
        for &(rows, cols) in shapes {
            let m = matrix(f, rows, cols, r);
            for &(n, order) in orders {
                let x: Vec<f32> = (0..n * cols).map(|_| r.f31() * 3.0).collect();
                let (sent, want) = product(&m, &x, n, order, fl);
                let pairs =
                    f == DevFormat::Bf16 && fl == Flavor::Avx512 && ggml::flavor::has_avx512_bf16();
                let label = format!(
                    "{} {rows}x{cols} n_tok={n}{}{}",
                    f.suffix(),
                    if order.tiled { " tiled" } else { "" },
                    if order.gemm && !order.tiled {
                        " gemm"
                    } else {
                        ""
                    },
                );
                let case = |label, pairs, x, want| MmCase {
                    label,
                    fmt: f,
                    rows,
                    cols,
                    w: DevFormat::of(&m).1.to_vec(),
                    n,
                    tiled: order.tiled,
                    gemm: order.gemm,
                    pairs,
                    lanes: fl.lanes(),
                    x,
                    want,
                };
                if f == DevFormat::Bf16 && fl == Flavor::Avx512 {
                    let (other, want) = bf16_other_order(&m, &x, n, order.gemm);
                    let label = format!("{label} pairs={other} (the other CPU's order)");
                    cases.push(case(label, other, sent.clone(), want));
                }
                cases.push(case(label, pairs, sent, want));
            }
        }
    }
    let mut out = Out::create(dir, "mm.bin");
    out.put(&[cases.len() as i32]);
    for c in &cases {
        c.put(&mut out);
    }
}

fn write_embed(dir: &Path, r: &mut Lcg) {
    let mut f = Out::create(dir, "embed.bin");
    f.put(&[DevFormat::ALL.len() as i32]);
    for fmt in DevFormat::ALL {
        let cols = if fmt.acts() == ActKind::Q8K { 512 } else { 96 };
        let m = matrix(fmt, 7, cols, r);
        let tokens = [3u32, 0, 6];
        let mut want = vec![0f32; tokens.len() * cols];
        for (t, &tok) in tokens.iter().enumerate() {
            m.dequant_row(tok as usize, &mut want[t * cols..(t + 1) * cols]);
        }
        let w = DevFormat::of(&m).1;
        f.put(&[index(fmt), cols as i32, tokens.len() as i32, w.len() as i32]);
        f.put(&tokens);
        f.put(w);
        f.put(&want);
    }
}

fn write_q8k(dir: &Path, r: &mut Lcg) {
    let n = 6;
    let mut x: Vec<f32> = (0..n * QK_K)
        .map(|i| r.f31() * [1.0, 40.0, 1e-3][i / QK_K % 3])
        .collect();
    // An all-zero block, and blocks whose largest magnitude comes twice (the
    // first sets the scale's sign): within one lane's eight values of the
    // kernel, and in two lanes.
    x[3 * QK_K..4 * QK_K].fill(0.0);
    x[4 * QK_K + 40] = -50.0;
    x[4 * QK_K + 43] = 50.0;
    x[5 * QK_K + 17] = -7.5;
    x[5 * QK_K + 200] = 7.5;
    let mut want = vec![BlockQ8K::default(); n];
    quantize_q8_k(&x, &mut want);
    let mut f = Out::create(dir, "q8k.bin");
    f.put(&[n as i32]);
    f.put(&x);
    f.put(&want);
}

/// The format cases into `dir`: with `shared`, every format's and the
/// flavour-independent ones (the block sizes the host uploads, checked
/// against the CUDA structs; embeddings; Q8_K); without, only the products
/// the flavour changes (F16 / BF16).
pub(super) fn write_cases(dir: &Path, r: &mut Lcg, fl: Flavor, shared: bool) {
    if !shared {
        write_mm(dir, r, fl, &[DevFormat::F16, DevFormat::Bf16]);
        return;
    }
    let mut f = Out::create(dir, "sizes.bin");
    let sizes: Vec<i32> = DevFormat::ALL
        .iter()
        .map(|f| f.block_bytes() as i32)
        .collect();
    f.put(&sizes);
    f.put(&[Q8K_BYTES as i32]);
    write_embed(dir, r);
    write_q8k(dir, r);
    write_mm(dir, r, fl, &DevFormat::ALL);
}
