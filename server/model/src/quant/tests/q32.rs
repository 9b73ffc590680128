//! The 32-value formats' products against the scalar reference and the f32 dot product.

use crate::pool::ThreadPool;
use crate::quant::acts::Acts;
use crate::quant::format::block::QK;
use crate::quant::format::q5_0::as_q8_0;
use crate::quant::format::q8::BlockQ8_0;
use crate::quant::format::q8::{BlockQ8_1, quantize_q8_1};
use crate::quant::kernels::{Kernels, scalar};
use crate::quant::matrix::QMatrix;
use crate::test_rng::Lcg;
use half::f16;

#[test]
fn kernels_match_scalar_and_f32() {
    let (rows, cols) = (37, 96);
    let mut seed = Lcg(7);
    let w: Vec<f32> = (0..rows * cols).map(|_| seed.f31()).collect();
    let x: Vec<f32> = (0..cols).map(|_| seed.f31() * 3.0).collect();
    let mut xq = vec![BlockQ8_1::default(); cols / QK];
    quantize_q8_1(&x, &mut xq);
    let q8 = QMatrix::q8_0_from_f32(rows, cols, &w).unwrap();
    // A Q4_1 matrix from raw bytes (d = 0.1, m = -0.75, nibbles from the lcg).
    let mut raw = Vec::new();
    for _ in 0..rows * cols / QK {
        raw.extend_from_slice(&f16::from_f32(0.1).to_le_bytes());
        raw.extend_from_slice(&f16::from_f32(-0.75).to_le_bytes());
        for _ in 0..16 {
            raw.push(((seed.f31() + 1.0) * 127.0) as u8);
        }
    }
    let q4 = QMatrix::from_q4_1_bytes(rows, cols, &raw).unwrap();
    let pool = ThreadPool::new(2);
    for m in [&q8, &q4] {
        let mut out = vec![0f32; rows];
        m.matmul(&pool, Acts::q8(&xq), 1, &mut out);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            let reference = match m {
                QMatrix::Q8_0 { blocks, .. } => scalar::dot(&blocks[r * 3..r * 3 + 3], &xq),
                QMatrix::Q4_1 { blocks, .. } => scalar::dot(&blocks[r * 3..r * 3 + 3], &xq),
                _ => unreachable!(),
            };
            // The SIMD kernels and the scalar reference do the same float
            // operations in the same order: equal bits.
            assert_eq!(
                out[r].to_bits(),
                reference.to_bits(),
                "{} row {r}",
                m.format()
            );
            m.dequant_row(r, &mut row);
            let exact: f32 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
            assert!(
                (out[r] - exact).abs() < 0.05 * (1.0 + exact.abs()),
                "{} row {r}: {} vs {exact}",
                m.format(),
                out[r]
            );
        }
    }
}

/// `n` random GGUF blocks of a 32-value format: an f16 scale (and an
/// f16 minimum where `with_min`), then `rest` random bytes.
fn raw_blocks(n: usize, with_min: bool, rest: usize, r: &mut Lcg) -> Vec<u8> {
    let mut raw = Vec::new();
    for _ in 0..n {
        raw.extend_from_slice(&f16::from_f32(0.01 + r.f().abs() * 0.1).to_le_bytes());
        if with_min {
            raw.extend_from_slice(&f16::from_f32(-r.f().abs()).to_le_bytes());
        }
        raw.extend((0..rest).map(|_| r.byte()));
    }
    raw
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A prompt's product (several tokens through `Kernels::tokens`, on the
/// pool, 64-row tiles) equals each token's one-token product bit for
/// bit, for every 32-value format, row counts that leave partial row
/// groups and token counts that leave partial token groups; and the
/// AVX2 several-token kernels equal the scalar ones.
#[test]
fn several_tokens_equal_one_token_at_a_time() {
    let mut r = Lcg(21);
    let pool = ThreadPool::new(2);
    for (rows, cols) in [(1usize, 64usize), (5, 96), (67, 64), (130, 128)] {
        let nb = rows * cols / 32;
        let mats = [
            QMatrix::from_q8_0_bytes(rows, cols, &raw_blocks(nb, false, 32, &mut r)),
            QMatrix::from_q4_1_bytes(rows, cols, &raw_blocks(nb, true, 16, &mut r)),
            QMatrix::from_q5_0_bytes(rows, cols, &raw_blocks(nb, false, 20, &mut r)),
            QMatrix::from_q5_1_bytes(rows, cols, &raw_blocks(nb, true, 20, &mut r)),
        ];
        for m in mats.into_iter().map(|m| m.expect("whole blocks")) {
            for n_tok in [2usize, 3, 5] {
                let x: Vec<f32> = (0..n_tok * cols).map(|_| r.f() * 4.0).collect();
                let mut xq = vec![BlockQ8_1::default(); n_tok * cols / 32];
                quantize_q8_1(&x, &mut xq);
                let mut got = vec![0f32; n_tok * rows];
                m.matmul(&pool, Acts::q8(&xq), n_tok, &mut got);
                let mut want = vec![0f32; n_tok * rows];
                for t in 0..n_tok {
                    let a = &xq[t * cols / 32..(t + 1) * cols / 32];
                    m.matmul(&pool, Acts::q8(a), 1, &mut want[t * rows..(t + 1) * rows]);
                }
                let what = format!("{} {rows}x{cols}, {n_tok} tokens", m.format());
                assert_eq!(bits(&got), bits(&want), "matmul: {what}");
                let expanded: Vec<BlockQ8_0> = match &m {
                    QMatrix::Q5_0 { blocks, .. } => blocks.iter().map(as_q8_0).collect(),
                    _ => Vec::new(),
                };
                let mut scalar = vec![0f32; n_tok * rows];
                Kernels::scalar().tokens(&m, 0..rows, &expanded, &xq, n_tok, &mut scalar);
                assert_eq!(bits(&scalar), bits(&want), "scalar kernels: {what}");
                if let Some(avx2) = Kernels::avx2() {
                    let mut v = vec![0f32; n_tok * rows];
                    avx2.tokens(&m, 0..rows, &expanded, &xq, n_tok, &mut v);
                    assert_eq!(bits(&v), bits(&want), "avx2 kernels: {what}");
                    // The build without VNNI, whatever this CPU has.
                    #[cfg(target_arch = "x86_64")]
                    {
                        use crate::quant::kernels::avx2::tokens::tokens_no_vnni as no_vnni;
                        let mut v = vec![0f32; n_tok * rows];
                        match &m {
                            QMatrix::Q8_0 { blocks, .. } => {
                                no_vnni::<_, 4, 2>(blocks, &xq, n_tok, &mut v)
                            }
                            QMatrix::Q4_1 { blocks, .. } => {
                                no_vnni::<_, 4, 2>(blocks, &xq, n_tok, &mut v)
                            }
                            QMatrix::Q5_0 { .. } => {
                                no_vnni::<_, 4, 2>(&expanded, &xq, n_tok, &mut v)
                            }
                            QMatrix::Q5_1 { blocks, .. } => {
                                no_vnni::<_, 4, 2>(blocks, &xq, n_tok, &mut v)
                            }
                            _ => unreachable!(),
                        }
                        assert_eq!(bits(&v), bits(&want), "avx2 kernels without VNNI: {what}");
                    }
                }
            }
        }
    }
}
