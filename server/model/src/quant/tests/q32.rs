//! The 32-value formats' products: the kernels against the scalar reference and the f32 dot product.

use crate::pool::ThreadPool;
use crate::quant::{Acts, BlockQ8_1, QK, QMatrix, quantize_q8_1, scalar};
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
