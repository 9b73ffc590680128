//! Tests of the K-quant formats and their kernels.
//!
//! Tests of the K-quant formats: the AVX2 kernels equal the scalar reference
//! bit for bit on random blocks, the block layouts decode like candle's
//! independent ggml port, products approximate the f32 dot product, and
//! Q8_K quantisation follows `quantize_row_q8_K_ref`.

use crate::pool::ThreadPool;
use crate::quant::acts::Acts;
use crate::quant::convert::KQuant;
use crate::quant::format::kquant::{BlockQ8K, QK_K, quantize_q8_k};
use crate::quant::format::q8::{BlockQ8_1, quantize_q8_1};
use crate::quant::kernels::Kernels;
use crate::quant::matrix::QMatrix;
use crate::test_rng::Lcg;
use candle_core::quantized::GgmlDType;
use half::f16;

/// `n` random blocks of `kind` as GGUF bytes (scales of realistic size).
fn random_raw(kind: KQuant, n: usize, r: &mut Lcg) -> Vec<u8> {
    let mut raw = Vec::with_capacity(n * kind.block_bytes());
    for _ in 0..n {
        let d = f16::from_f32(0.001 + 0.01 * r.f().abs()).to_le_bytes();
        let dmin = f16::from_f32(0.002 * r.f().abs()).to_le_bytes();
        match kind {
            KQuant::Q4K | KQuant::Q5K => {
                raw.extend_from_slice(&d);
                raw.extend_from_slice(&dmin);
                let rest = kind.block_bytes() - 4;
                raw.extend((0..rest).map(|_| r.byte()));
            }
            KQuant::Q6K => {
                raw.extend((0..208).map(|_| r.byte()));
                raw.extend_from_slice(&d);
            }
        }
    }
    raw
}

fn ggml_dtype(kind: KQuant) -> GgmlDType {
    match kind {
        KQuant::Q4K => GgmlDType::Q4K,
        KQuant::Q5K => GgmlDType::Q5K,
        KQuant::Q6K => GgmlDType::Q6K,
    }
}

fn candle_dequant(dtype: GgmlDType, raw: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    candle_core::quantized::ggml_file::qtensor_from_ggml(
        dtype,
        raw,
        vec![rows, cols],
        &candle_core::Device::Cpu,
    )
    .and_then(|q| q.dequantize(&candle_core::Device::Cpu))
    .and_then(|t| t.flatten_all())
    .and_then(|t| t.to_vec1::<f32>())
    .expect("candle dequantises")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `m` times one token's Q8_K activations with kernel family `k`
/// (`tiled`: the tiled order).
fn k_rows(k: &Kernels, m: &QMatrix, a: &[BlockQ8K], tiled: bool) -> Vec<f32> {
    let mut out = vec![0f32; m.rows()];
    k.tile(m, 0..m.rows(), &[], a, tiled, &mut out);
    out
}

/// `m` times one token's Q8_K activations through the matmul dispatch
/// (whichever kernels this CPU uses; `tiled` as [`Acts::tiled`]).
fn k_matmul(pool: &ThreadPool, m: &QMatrix, a: &[BlockQ8K], tiled: &[bool]) -> Vec<f32> {
    let mut out = vec![0f32; m.rows()];
    let acts = Acts {
        q8: &[],
        q8k: a,
        tiled,
        ..Acts::q8(&[])
    };
    m.matmul(pool, acts, 1, &mut out);
    out
}

/// `m` times one token's Q8_1 activations with kernel family `k`.
fn q8_rows(k: &Kernels, m: &QMatrix, a: &[BlockQ8_1]) -> Vec<f32> {
    let mut out = vec![0f32; m.rows()];
    k.tile(m, 0..m.rows(), a, &[], false, &mut out);
    out
}

/// Asserts that `m`'s dequantised rows equal `theirs` (row-major) within
/// `tol` relative.
fn assert_rows_close(m: &QMatrix, theirs: &[f32], tol: f32, what: &str) {
    let cols = m.cols();
    let mut ours = vec![0f32; cols];
    for i in 0..m.rows() {
        m.dequant_row(i, &mut ours);
        for (j, (a, b)) in ours.iter().zip(&theirs[i * cols..]).enumerate() {
            assert!(
                (a - b).abs() <= tol * (1.0 + b.abs()),
                "{what} row {i} value {j}: {a} vs candle {b}"
            );
        }
    }
}

/// Asserts that `want[i]` is the f32 product of `m`'s dequantised row `i`
/// with `x` within `rel` of the sum of the products' magnitudes (plus `abs`).
fn assert_near_f32(m: &QMatrix, x: &[f32], want: &[f32], rel: f32, abs: f32, what: &str) {
    let mut row = vec![0f32; m.cols()];
    for (i, w) in want.iter().enumerate() {
        m.dequant_row(i, &mut row);
        let exact: f32 = row.iter().zip(x).map(|(a, b)| a * b).sum();
        let mag: f32 = row.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
        assert!(
            (w - exact).abs() <= rel * mag + abs,
            "{what} row {i}: {w} vs {exact} (Σ|·| {mag})"
        );
    }
}

#[test]
fn simd_equals_scalar_and_f32() {
    let (rows, cols) = (7, 3 * QK_K);
    let mut r = Lcg(11);
    let pool = ThreadPool::new(2);
    for kind in [KQuant::Q4K, KQuant::Q5K, KQuant::Q6K] {
        for trial in 0..20 {
            let raw = random_raw(kind, rows * cols / QK_K, &mut r);
            let m = QMatrix::from_k_bytes(kind, rows, cols, &raw).unwrap();
            let scale = if trial % 2 == 0 { 1.0 } else { 40.0 };
            let mut x: Vec<f32> = (0..cols).map(|_| r.f() * scale).collect();
            if trial == 3 {
                x[..QK_K].fill(0.0); // an all-zero activation block
            }
            let mut xq = vec![BlockQ8K::default(); cols / QK_K];
            quantize_q8_k(&x, &mut xq);
            let want = k_rows(&Kernels::scalar(), &m, &xq, false);
            if let Some(avx2) = Kernels::avx2() {
                let got = k_rows(&avx2, &m, &xq, false);
                for i in 0..rows {
                    assert_eq!(
                        got[i].to_bits(),
                        want[i].to_bits(),
                        "{kind:?} trial {trial} row {i}: avx2 {} scalar {}",
                        got[i],
                        want[i]
                    );
                }
            }
            // The tiled order: AVX2 equals scalar, and the dispatch follows
            // `Acts::tiled`.
            let want_t = k_rows(&Kernels::scalar(), &m, &xq, true);
            if let Some(avx2) = Kernels::avx2() {
                let got = k_rows(&avx2, &m, &xq, true);
                assert_eq!(bits(&got), bits(&want_t), "{kind:?} tiled");
            }
            let via = k_matmul(&pool, &m, &xq, &[true]);
            assert_eq!(bits(&via), bits(&want_t), "{kind:?} tiled matmul");
            for (a, b) in want_t.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{kind:?}: tiled {a} vs dot {b}"
                );
            }
            // Through the matmul dispatch (whichever kernel this CPU uses).
            let via = k_matmul(&pool, &m, &xq, &[]);
            assert_eq!(bits(&via), bits(&want), "{kind:?} matmul");
            // Close to the f32 product of the dequantised weights.
            assert_near_f32(&m, &x, &want, 0.02, 1e-6, &format!("{kind:?}"));
        }
    }
}

/// A prompt's K-quant products (several tokens at once, runs of tiled
/// tokens through `Kernels::tiled_tokens`) equal each token's own product
/// bit for bit, with tiled and vector-dot tokens mixed in one batch; the
/// AVX2 several-token kernels equal the scalar ones.
#[test]
fn several_tiled_tokens_equal_one_token_at_a_time() {
    let mut r = Lcg(17);
    let pool = ThreadPool::new(2);
    for kind in [KQuant::Q4K, KQuant::Q5K, KQuant::Q6K] {
        for (rows, cols) in [(7usize, 2 * QK_K), (70, QK_K)] {
            let raw = random_raw(kind, rows * cols / QK_K, &mut r);
            let m = QMatrix::from_k_bytes(kind, rows, cols, &raw).unwrap();
            let nb = cols / QK_K;
            for tiled in [
                &[true; 9][..],
                &[true, true, false, true, true, true, true, true, false, true][..],
            ] {
                let n_tok = tiled.len();
                let x: Vec<f32> = (0..n_tok * cols).map(|_| r.f() * 8.0).collect();
                let mut xq = vec![BlockQ8K::default(); n_tok * nb];
                quantize_q8_k(&x, &mut xq);
                let acts = Acts {
                    q8: &[],
                    q8k: &xq,
                    tiled,
                    ..Acts::q8(&[])
                };
                let mut got = vec![0f32; n_tok * rows];
                m.matmul(&pool, acts, n_tok, &mut got);
                let mut want = Vec::new();
                for (t, &tl) in tiled.iter().enumerate() {
                    want.extend(k_matmul(&pool, &m, &xq[t * nb..(t + 1) * nb], &[tl]));
                }
                let what = format!("{kind:?} {rows}x{cols}, tiled {tiled:?}");
                assert_eq!(bits(&got), bits(&want), "matmul: {what}");
                if tiled.iter().all(|&t| t) {
                    let run = |k: &Kernels| {
                        let mut v = vec![0f32; n_tok * rows];
                        k.tiled_tokens(&m, 0..rows, &xq, n_tok, &mut v);
                        v
                    };
                    assert_eq!(
                        bits(&run(&Kernels::scalar())),
                        bits(&want),
                        "scalar: {what}"
                    );
                    if let Some(avx2) = Kernels::avx2() {
                        assert_eq!(bits(&run(&avx2)), bits(&want), "avx2: {what}");
                    }
                }
            }
        }
    }
}

#[test]
fn layouts_decode_like_candle() {
    let (rows, cols) = (3, 2 * QK_K);
    let mut r = Lcg(5);
    for kind in [KQuant::Q4K, KQuant::Q5K, KQuant::Q6K] {
        let raw = random_raw(kind, rows * cols / QK_K, &mut r);
        let m = QMatrix::from_k_bytes(kind, rows, cols, &raw).unwrap();
        let theirs = candle_dequant(ggml_dtype(kind), &raw, rows, cols);
        assert_rows_close(&m, &theirs, 1e-6, &format!("{kind:?}"));
    }
    // Wrong lengths and row lengths are refused.
    assert!(QMatrix::from_k_bytes(KQuant::Q4K, 1, QK_K, &[0u8; 143]).is_none());
    assert!(QMatrix::from_k_bytes(KQuant::Q6K, 1, 288, &[0u8; 210]).is_none());
}

#[test]
fn q4_0_and_q5_0_become_equal_q8_0() {
    let (rows, cols) = (2, 64);
    let mut r = Lcg(9);
    for (five, dtype, bytes) in [(false, GgmlDType::Q4_0, 18), (true, GgmlDType::Q5_0, 22)] {
        let mut raw = Vec::new();
        for _ in 0..rows * cols / 32 {
            raw.extend_from_slice(&f16::from_f32(0.01 + r.f().abs() * 0.1).to_le_bytes());
            raw.extend((2..bytes).map(|_| r.byte()));
        }
        let m = QMatrix::q8_0_from_q4_0_or_q5_0(five, rows, cols, &raw).unwrap();
        assert_eq!(m.format(), "q8_0");
        let theirs = candle_dequant(dtype, &raw, rows, cols);
        let mut ours = vec![0f32; cols];
        for i in 0..rows {
            m.dequant_row(i, &mut ours);
            assert_eq!(&ours[..], &theirs[i * cols..(i + 1) * cols], "{dtype:?}");
        }
        if five {
            // Native Q5_0: same values, and its kernels (scalar and this
            // CPU's) give the Q8_0 kernels' bits on the converted blocks.
            let n = QMatrix::from_q5_0_bytes(rows, cols, &raw).unwrap();
            assert_eq!(n.format(), "q5_0");
            for i in 0..rows {
                n.dequant_row(i, &mut ours);
                assert_eq!(&ours[..], &theirs[i * cols..(i + 1) * cols], "native q5_0");
            }
            let x: Vec<f32> = (0..cols).map(|_| r.f() * 4.0).collect();
            let mut xq = vec![BlockQ8_1::default(); cols / 32];
            quantize_q8_1(&x, &mut xq);
            let pool = ThreadPool::new(2);
            let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
            m.matmul(&pool, Acts::q8(&xq), 1, &mut a);
            n.matmul(&pool, Acts::q8(&xq), 1, &mut b);
            assert_eq!(bits(&a), bits(&b), "native q5_0 vs q8_0");
            // Several tokens (the expanded-tile path) give the same bits.
            let xq2: Vec<_> = xq.iter().chain(&xq).copied().collect();
            let mut b2 = vec![0f32; 2 * rows];
            n.matmul(&pool, Acts::q8(&xq2), 2, &mut b2);
            assert_eq!(bits(&b2[..rows]), bits(&a), "q5_0, 2 tokens");
            assert_eq!(bits(&b2[rows..]), bits(&a), "q5_0, 2 tokens");
            assert_eq!(
                bits(&a),
                bits(&q8_rows(&Kernels::scalar(), &n, &xq)),
                "scalar q5_0 vs q8_0"
            );
            if let Some(avx2) = Kernels::avx2() {
                assert_eq!(
                    bits(&a),
                    bits(&q8_rows(&avx2, &n, &xq)),
                    "avx2 q5_0 vs q8_0"
                );
            }
            assert!(matches!(n.q5_0_as_q8_0(), Some(QMatrix::Q8_0 { .. })));
        }
    }
}

#[test]
fn q8_k_follows_ggml_ref() {
    let mut r = Lcg(3);
    let mut x: Vec<f32> = (0..2 * QK_K).map(|_| r.f() * 3.0).collect();
    x[17] = -7.5; // the largest magnitude: iscale = -127 / max, so it maps to -127
    x[QK_K + 5] = 9.0;
    x[QK_K + 6] = -9.0; // ties keep the first
    let mut q = vec![BlockQ8K::default(); 2];
    quantize_q8_k(&x, &mut q);
    assert_eq!(q[0].qs[17], -127);
    assert_eq!(q[0].d, 1.0 / (-127.0 / -7.5f32));
    assert_eq!(q[1].qs[5], -127);
    assert_eq!(q[1].qs[6], 127);
    for b in &q {
        for k in 0..16 {
            let s: i32 = b.qs[16 * k..16 * k + 16].iter().map(|&v| v as i32).sum();
            assert_eq!(b.bsums[k] as i32, s);
        }
    }
    for (i, v) in x.iter().enumerate() {
        let b = &q[i / QK_K];
        assert!((b.d * b.qs[i % QK_K] as f32 - v).abs() <= b.d.abs() * 0.5 + 1e-6);
    }
    // Round half to even: 0.5 and 1.5 steps.
    let mut h = vec![0f32; QK_K];
    h[0] = -127.0;
    h[1] = -0.5;
    h[2] = -1.5;
    quantize_q8_k(&h, &mut q[..1]);
    assert_eq!((q[0].qs[0], q[0].qs[1], q[0].qs[2]), (-127, 0, -2));
    quantize_q8_k(&[0.0; QK_K], &mut q[..1]);
    assert_eq!((q[0].d, q[0].qs[0], q[0].bsums[0]), (0.0, 0, 0));
}

#[test]
fn q5_1_kernels_agree() {
    let (rows, cols) = (5, 96);
    let mut r = Lcg(13);
    let mut raw = Vec::new();
    for _ in 0..rows * cols / 32 {
        raw.extend_from_slice(&f16::from_f32(0.01 + r.f().abs() * 0.1).to_le_bytes());
        raw.extend_from_slice(&f16::from_f32(-r.f().abs()).to_le_bytes());
        raw.extend((4..24).map(|_| r.byte()));
    }
    let m = QMatrix::from_q5_1_bytes(rows, cols, &raw).unwrap();
    let theirs = candle_dequant(GgmlDType::Q5_1, &raw, rows, cols);
    assert_rows_close(&m, &theirs, 1e-6, "q5_1");
    let x: Vec<f32> = (0..cols).map(|_| r.f() * 4.0).collect();
    let mut xq = vec![BlockQ8_1::default(); cols / 32];
    quantize_q8_1(&x, &mut xq);
    let want = q8_rows(&Kernels::scalar(), &m, &xq);
    let mut got = vec![0f32; rows];
    m.matmul(&ThreadPool::new(2), Acts::q8(&xq), 1, &mut got);
    assert_eq!(bits(&got), bits(&want), "matmul vs scalar");
    if let Some(avx2) = Kernels::avx2() {
        assert_eq!(
            bits(&q8_rows(&avx2, &m, &xq)),
            bits(&want),
            "avx2 vs scalar"
        );
    }
    assert_near_f32(&m, &x, &want, 0.03, 1e-3, "q5_1");
}
