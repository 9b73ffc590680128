//! Exactness tests of the large path: the exps' error bounds, the block
//! sums and the normaliser against sequential f32, the cut against a plain
//! llama.cpp reference, the ladder walk against the bucket walk.

use samplerd_plugin_sdk::prelude::SdCandidate;

use super::bucket_walk::walk_impl;
#[cfg(target_arch = "x86_64")]
use super::exp::exp16x4;
use super::exp::{EXP_REL_ERR, libm_exp};
use super::grid_sum::F32Sum;
use super::kept::{write_kept, write_kept_from};
#[cfg(target_arch = "x86_64")]
use super::ladder;
use super::normaliser::{softmax_sum_and_gather, softmax_sum_impl};
use super::nucleus::{Scratch, gather_nucleus, nucleus};
#[cfg(target_arch = "x86_64")]
use super::shared::has_avx512;
use super::shared::{Gathered, desc_key};
use crate::util::exp_f32;

fn xorshift(seed: u64) -> impl FnMut() -> f64 {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[test]
fn exp_error_bound() {
    // Every 97th f32 in (-87.33, 0]: exp_f32 within EXP_REL_ERR / 2 of
    // libm (the constant carries a factor 2 of margin).
    let mut worst = 0.0f64;
    let top = (-87.33f32).to_bits();
    let mut b = 0x8000_0000u32;
    while b <= top {
        let x = f32::from_bits(b);
        let want = libm_exp(x) as f64;
        let got = exp_f32(x) as f64;
        worst = worst.max(((got - want) / want).abs());
        b += 97;
    }
    assert!(worst <= (EXP_REL_ERR as f64) / 2.0, "worst {worst:e}");
}

/// The largest relative error of `exp16x4` against libm over every
/// `step`-th f32 in (LO, 0] (None without AVX-512F + FMA).
#[cfg(target_arch = "x86_64")]
fn avx512_exp_worst_error(step: u32) -> Option<f64> {
    let cpu = samplerd_numerics::features();
    if !(cpu.avx512f() && cpu.fma()) {
        return None;
    }
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn worst_error(step: u32) -> f64 {
        use std::arch::x86_64::*;
        let mut worst = 0.0f64;
        let top = samplerd_numerics::exp::consts::LO.to_bits();
        let mut b = 0x8000_0000u32;
        let mut xs = [0.0f32; 64];
        let mut out = [0.0f32; 64];
        while b <= top {
            for (j, v) in xs.iter_mut().enumerate() {
                *v = f32::from_bits(b.saturating_add(step * j as u32).min(top));
            }
            // SAFETY: 64 floats in and out, AVX-512F enabled.
            unsafe {
                let v: [__m512; 4] =
                    std::array::from_fn(|k| _mm512_loadu_ps(xs.as_ptr().add(16 * k)));
                let e = exp16x4(v);
                for (k, ek) in e.iter().enumerate() {
                    _mm512_storeu_ps(out.as_mut_ptr().add(16 * k), *ek);
                }
            }
            for (&x, &got) in xs.iter().zip(&out) {
                let want = libm_exp(x) as f64;
                if want >= f32::MIN_POSITIVE as f64 {
                    worst = worst.max(((got as f64 - want) / want).abs());
                }
            }
            b = b.saturating_add(step * 64);
        }
        worst
    }
    // SAFETY: the CPU supports AVX-512F and FMA (checked above).
    Some(unsafe { worst_error(step) })
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_exp_error_bound() {
    // The fused multiply-add exp of the normaliser pass, every 97th
    // f32: within half of EXP_REL_ERR (skipped on CPUs without
    // AVX-512F + FMA).
    if let Some(worst) = avx512_exp_worst_error(97) {
        assert!(worst <= EXP_REL_ERR as f64 / 2.0, "worst {worst:e}");
    }
}

/// Every f32 in (LO, 0] (about 10^9 values, ~10 s in release):
/// `cargo test --release -p samplerd-core-stages -- --ignored
/// exp16_every_float`. Measured 2026-11-30: see [`EXP_REL_ERR`].
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn exp16_every_float() {
    if let Some(worst) = avx512_exp_worst_error(1) {
        eprintln!("exp16x4: worst relative error {worst:e}");
        assert!(worst <= EXP_REL_ERR as f64 / 2.0, "worst {worst:e}");
    }
}

#[test]
fn block_sums_are_bit_identical_to_sequential_f32() {
    let mut rnd = xorshift(3);
    for case in 0..200 {
        let n = 1 + (rnd() * 5000.0) as usize;
        let sd = [0.5, 3.0, 10.0, 30.0][case % 4];
        let mut x: Vec<f32> = (0..n)
            .map(|_| ((rnd() + rnd() + rnd() - 1.5) * 2.0 * sd) as f32)
            .collect();
        if case % 7 == 0 {
            // ties and repeated values
            for v in x.iter_mut().step_by(3) {
                *v = 1.25;
            }
        }
        if case % 11 == 0 {
            x[0] = f32::NEG_INFINITY;
        }
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut want = 0.0f32;
        for &v in &x {
            want += (v - max).exp();
        }
        let mut g = Gathered::default();
        let (got, mass) = softmax_sum_and_gather(&x, max, max - 2.0, &mut g);
        assert_eq!(got.to_bits(), want.to_bits(), "case {case} n {n}");
        let want_mass: f32 = x
            .iter()
            .filter(|&&v| v >= max - 2.0)
            .map(|&v| (v - max).exp())
            .sum();
        assert!(
            (mass - want_mass).abs() <= 1e-4 * want_mass,
            "case {case}: gathered mass {mass} vs {want_mass}"
        );
        // the portable pass (what a CPU without AVX-512 runs) agrees
        let mut gp = Gathered::default();
        let (zp, mp) = softmax_sum_impl(&x, max, max - 2.0, &mut gp);
        assert_eq!(zp.to_bits(), got.to_bits(), "case {case}: portable pass");
        assert_eq!(
            (gp.idx.clone(), gp.val.clone()),
            (g.idx.clone(), g.val.clone())
        );
        assert!((mp - mass).abs() <= 1e-4 * mass.max(f32::MIN_POSITIVE));
        let idx = g.idx.clone();
        let gv: Vec<f32> = idx.iter().map(|&i| x[i as usize]).collect();
        assert_eq!(g.val, gv);
        let gw: Vec<u32> = (0..n as u32)
            .filter(|&i| x[i as usize] >= max - 2.0)
            .collect();
        assert_eq!(idx, gw);
    }
}

/// llama.cpp's top-p, written plainly: libm expf, f32 running sums,
/// a full sort. Returns the kept positions in order.
fn reference(x: &[f32], p: f32, min_keep: usize) -> Vec<u32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut z = 0.0f32;
    for &v in x {
        z += libm_exp(v - max);
    }
    let mut order: Vec<u32> = (0..x.len() as u32).collect();
    order.sort_by_key(|&i| (desc_key(x[i as usize]), i));
    let mut cum = 0.0f32;
    for (k, &i) in order.iter().enumerate() {
        cum += libm_exp(x[i as usize] - max) / z;
        if cum >= p && k + 1 >= min_keep {
            order.truncate(k + 1);
            break;
        }
    }
    order
}

#[test]
fn nucleus_equals_the_plain_reference() {
    let mut rnd = xorshift(11);
    let mut s = Scratch::default();
    for case in 0..160 {
        let n = match case % 5 {
            0 => 151_936,
            1 => 1 + (rnd() * 300.0) as usize,
            _ => 1_000 + (rnd() * 60_000.0) as usize,
        };
        let sd = [0.3, 1.0, 3.0, 6.0, 12.0][(case / 5) % 5];
        let mut x: Vec<f32> = (0..n)
            .map(|_| {
                let g: f64 = (0..4).map(|_| rnd()).sum::<f64>() - 2.0;
                (g * 1.7 * sd) as f32
            })
            .collect();
        if case % 7 == 3 {
            // ties across the cut, and a plateau at the top
            for v in x.iter_mut().step_by(2) {
                *v = (*v * 4.0).round() / 4.0;
            }
        }
        if case % 9 == 4 {
            for v in x.iter_mut().step_by(5) {
                *v = f32::NEG_INFINITY;
            }
            x[0] = 1.0;
        }
        let p = [0.5f32, 0.8, 0.9, 0.95, 0.99, 0.999, 0.3, 1.0 - 1e-6][case % 8];
        let min_keep = if case % 11 == 5 { n / 2 + 1 } else { 1 };
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let cut = nucleus(&x, max, p, min_keep, &mut s);
        let got: Vec<u32> = (0..n as u32)
            .filter(|&i| cut.keeps(x[i as usize], i))
            .collect();
        let in_gathered: Vec<u32> = s
            .gathered()
            .idx
            .iter()
            .copied()
            .filter(|&i| cut.keeps(x[i as usize], i))
            .collect();
        let mut want = reference(&x, p, min_keep);
        want.sort_unstable();
        assert_eq!(cut.kept, want.len(), "case {case}: n {n} sd {sd} p {p}");
        assert_eq!(got, want, "case {case}: n {n} sd {sd} p {p}");
        assert_eq!(
            in_gathered, want,
            "case {case}: the gathered set holds the kept"
        );
        // the candidate writer (AVX-512 where present) and the portable
        // loop write exactly the kept ones, in position order
        let blank = SdCandidate {
            id: u32::MAX,
            logit: 0.0,
        };
        let mut out = vec![blank; s.gathered().len()];
        write_kept(s.gathered(), cut, &mut out);
        let ids: Vec<u32> = out[..cut.kept].iter().map(|c| c.id).collect();
        assert_eq!(ids, want, "case {case}: write_kept");
        assert!(
            out[..cut.kept]
                .iter()
                .all(|c| c.logit.to_bits() == x[c.id as usize].to_bits())
        );
        let mut out2 = vec![blank; s.gathered().len()];
        write_kept_from(s.gathered(), cut, &mut out2, 0, 0);
        let ids2: Vec<u32> = out2[..cut.kept].iter().map(|c| c.id).collect();
        assert_eq!(ids2, want, "case {case}: portable write_kept");
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn ladder_walk_equals_the_bucket_walk() {
    // The AVX-512 fast path either finds the bucket walk's very cut or
    // declines; on ordinary logits it must decide nearly always.
    if !has_avx512() {
        return;
    }
    let mut rnd = xorshift(23);
    let mut s = Scratch::default();
    let (mut decided, mut ordinary, mut ordinary_decided) = (0, 0, 0);
    let cases = 1200;
    for case in 0..cases {
        let n = match case % 4 {
            0 => 151_936,
            1 => 49_152,
            _ => 4_000 + (rnd() * 120_000.0) as usize,
        };
        let sd = [1.0, 2.0, 3.0, 4.0, 6.0][(case / 4) % 5];
        let mut x: Vec<f32> = (0..n)
            .map(|_| {
                let g: f64 = (0..4).map(|_| rnd()).sum::<f64>() - 2.0;
                (g * 1.7 * sd) as f32
            })
            .collect();
        let odd = case % 6 == 5;
        if odd {
            // coarse logits: many equal values, ties in the sums
            for v in x.iter_mut() {
                *v = (*v * 2.0).round() / 2.0;
            }
        }
        let p = [0.9f32, 0.95, 0.8, 0.99, 0.6, 0.5, 0.3, 0.75][case % 8];
        let min_keep = if case % 13 == 7 { 50 } else { 1 };
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let t = gather_nucleus(&x, max, p, min_keep, &mut s);
        // SAFETY: AVX-512F and POPCNT checked above.
        let fast = unsafe { ladder::walk(t, &mut s.gathered, &s.sample, &mut s.ladder) };
        let slow = walk_impl(t, &s.gathered, &mut s.buckets);
        if let Some(cut) = fast {
            assert_eq!(Some(cut), slow, "case {case}: n {n} sd {sd} p {p}");
            decided += 1;
        }
        // ordinary: peaked enough that the top set is small
        if !odd && sd >= 3.0 && s.gathered().len() >= 4096 {
            ordinary += 1;
            ordinary_decided += fast.is_some() as usize;
        }
    }
    assert!(
        ordinary_decided * 10 >= ordinary * 9,
        "the fast path decided {ordinary_decided} of {ordinary} ordinary cases ({decided} of {cases} in all)"
    );
}

#[test]
fn exact_adds_match_plain_f32() {
    let mut rnd = xorshift(5);
    let mut s = F32Sum::new();
    let mut want = 0.0f32;
    for _ in 0..100_000 {
        let v = (rnd() * 1e-3) as f32;
        s.add_exact(v);
        want += v;
        assert_eq!(s.value().to_bits(), want.to_bits());
    }
}
