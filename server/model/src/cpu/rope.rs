//! Rotary position embedding: the angle table and the rotation.
//!
//! Rotary position embedding as llama.cpp's CPU backend computes it
//! (`ggml/src/ggml-cpu/ops.cpp`: `ggml_rope_cache_init`, `rope_yarn`,
//! `rotate_pairs`), shared by the CPU forward pass and the CUDA backend's
//! host-computed table so both rotate by the same bits.

#![forbid(unsafe_code)]

use crate::gguf::Config;

/// cos/sin per rotated pair at position `pos`: llama.cpp's iterative theta
/// (`theta *= theta_scale` per pair), divided by the pair's frequency
/// factor (`rope_freqs.weight` of Llama 3.1+; `ggml_rope_cache_init`'s
/// `theta/ff`) and multiplied by the linear scale (`rope_yarn`'s
/// `freq_scale * theta_extrap`; YaRN's extrapolation mix is never used: the
/// loader refuses YaRN). Without factors and scaling both operations are
/// exact (`x / 1`, `1 * x`), so the angles are those of plain RoPE.
pub fn rope_table(c: &Config, freq_factors: Option<&[f32]>, pos: usize, table: &mut [(f32, f32)]) {
    let theta_scale = c.rope_freq_base.powf(-2.0 / c.rope_dim as f32);
    let mut theta = pos as f32;
    for (i, e) in table.iter_mut().enumerate() {
        let ff = freq_factors.map_or(1.0, |f| f[i]);
        let t = c.rope_freq_scale * (theta / ff);
        *e = (t.cos(), t.sin());
        theta *= theta_scale;
    }
}

/// Rotates `x` (one head) by `table` (its first `2 * table.len()` values:
/// adjacent pairs, or the NEOX halves `i`, `i + table.len()`).
pub(crate) fn apply_rope(x: &mut [f32], table: &[(f32, f32)], neox: bool) {
    let half = table.len();
    for (i, &(cos, sin)) in table.iter().enumerate() {
        let (a, b) = if neox {
            (i, i + half)
        } else {
            (2 * i, 2 * i + 1)
        };
        let (x0, x1) = (x[a], x[b]);
        // The contraction GCC picks for ggml's rotate_pairs (bit-exact parity).
        x[a] = x0.mul_add(cos, -(x1 * sin));
        x[b] = x0.mul_add(sin, x1 * cos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rope_dim: usize, freq_scale: f32) -> Config {
        Config {
            arch: crate::gguf::Arch::Llama,
            n_ctx_train: 64,
            n_embd: 64,
            n_layer: 1,
            n_head: 2,
            n_head_kv: 2,
            head_dim: 32,
            n_ff: 64,
            rope_freq_base: 500000.0,
            rope_dim,
            rope_freq_scale: freq_scale,
            rope_neox: false,
            rms_eps: 1e-5,
            qk_norm: false,
            n_vocab: 8,
        }
    }

    #[test]
    fn unit_factors_and_scale_give_plain_rope() {
        let c = config(32, 1.0);
        let (mut plain, mut ones) = (vec![(0.0, 0.0); 16], vec![(0.0, 0.0); 16]);
        rope_table(&c, None, 37, &mut plain);
        rope_table(&c, Some(&[1.0; 16]), 37, &mut ones);
        assert_eq!(plain, ones);
    }

    #[test]
    fn factors_divide_each_pairs_angle() {
        let c = config(8, 1.0);
        let mut t = vec![(0.0, 0.0); 4];
        rope_table(&c, Some(&[1.0, 2.0, 8.0, 32.0]), 5, &mut t);
        let mut theta = 5f32;
        let scale = 500000f32.powf(-2.0 / 8.0);
        for (i, ff) in [1.0f32, 2.0, 8.0, 32.0].iter().enumerate() {
            assert_eq!(t[i], ((theta / ff).cos(), (theta / ff).sin()));
            theta *= scale;
        }
        // Linear scaling by 4 equals a factor of 4 on every pair.
        let (mut lin, mut fac) = (vec![(0.0, 0.0); 4], vec![(0.0, 0.0); 4]);
        rope_table(&config(8, 0.25), None, 9, &mut lin);
        rope_table(&c, Some(&[4.0; 4]), 9, &mut fac);
        for (a, b) in lin.iter().zip(&fac) {
            assert!(
                (a.0 - b.0).abs() < 1e-6 && (a.1 - b.1).abs() < 1e-6,
                "{a:?} {b:?}"
            );
        }
    }
}
