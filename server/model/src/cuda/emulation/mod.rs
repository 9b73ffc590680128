//! The CUDA kernels checked bit for bit against the CPU backend without a GPU.
//!
//! The kernel source is compiled as C++ with a small emulation of the
//! CUDA built-ins (`prelude.h`: a thread per CUDA thread, barriers,
//! shuffles through shared slots) and run by `harness.cpp` over cases
//! whose expected results come from the CPU code itself
//! (`ggml::attention::attention_head`, `ggml::expf::swiglu`,
//! `cpu::forward::norm::rms_norm`, `cpu::rope::apply_rope`, `quantize_q8_1`;
//! every weight format's cases, `QMatrix::matmul` / `dequant_row` /
//! `quantize_q8_k`, are in `formats`), in both ggml flavours. The GPU
//! must match the CPU exactly (docs/ARCHITECTURE.md, "CUDA", and
//! docs/perf-log/2026-11-30-cuda.md: last-bit differences change greedy
//! tokens), so this runs with every `cargo test`,
//! with or without the `cuda` feature; it skips with a notice when no C++20
//! compiler is found (`CXX`, else `g++`).

mod formats;
mod out;

use std::path::Path;
use std::process::Command;

use half::f16;

use crate::ggml::{self, Flavor};
use crate::test_rng::Lcg;
use out::{Out, quantized};

const PRELUDE: &str = include_str!("prelude.h");
const HARNESS: &str = include_str!("harness.cpp");
const FORMATS: &str = include_str!("formats.cpp");

fn write_attention(dir: &Path, r: &mut Lcg, fl: Flavor) {
    let (nh, hd) = (3usize, 64usize);
    // Chunk (256) and vector (8 / 16 / 64) boundaries on both sides.
    let positions = [1usize, 5, 64, 255, 257, 300];
    let mut f = Out::create(dir, "attention.bin");
    f.put(&[(positions.len() * 2) as i32]);
    for decode in [true, false] {
        for &n_pos in &positions {
            let qkv: Vec<f32> = (0..(nh + 2) * hd).map(|_| r.f31() * 4.0).collect();
            let k: Vec<u16> = (0..n_pos * hd)
                .map(|_| f16::from_f32(r.f31() * 3.0).to_bits())
                .collect();
            let v: Vec<u16> = (0..n_pos * hd)
                .map(|_| f16::from_f32(r.f31() * 2.0).to_bits())
                .collect();
            let kf: Vec<f32> = k.iter().map(|&b| f16::from_bits(b).to_f32()).collect();
            let vf: Vec<f32> = v.iter().map(|&b| f16::from_bits(b).to_f32()).collect();
            let scale = 1.0 / (hd as f32).sqrt();
            let mut out = vec![0f32; nh * hd];
            let mut scores = vec![0f32; n_pos.div_ceil(16) * 16];
            let mut acc = vec![0f32; 64 * hd];
            for h in 0..nh {
                let q: Vec<f32> = qkv[h * hd..(h + 1) * hd]
                    .iter()
                    .map(|&x| f16::from_f32(x).to_f32())
                    .collect();
                let head = ggml::attention::Head {
                    q16: &q,
                    kf: &kf,
                    vf: &vf,
                    n_pos,
                    scale,
                    decode,
                    flavor: fl,
                };
                ggml::attention::attention_head(
                    &head,
                    &mut scores,
                    &mut acc,
                    &mut out[h * hd..(h + 1) * hd],
                );
            }
            f.put(&[decode as i32, n_pos as i32, nh as i32, hd as i32]);
            f.put(&qkv);
            f.put(&k);
            f.put(&v);
            f.put(&out);
            f.put(&quantized(&out));
        }
    }
}

fn write_norm(dir: &Path, r: &mut Lcg) {
    let (rows, d, eps) = (3usize, 576usize, 1e-5f32);
    let mut x: Vec<f32> = (0..rows * d).map(|_| r.f31() * 5.0).collect();
    x[7] = 300.0; // an outlier channel, as real residual streams have
    let add: Vec<f32> = (0..rows * d).map(|_| r.f31()).collect();
    let w: Vec<f32> = (0..d).map(|_| r.f31() * 2.0).collect();
    let summed: Vec<f32> = x.iter().zip(&add).map(|(a, b)| a + b).collect();
    let mut normed = vec![0f32; rows * d];
    crate::cpu::forward::norm::rms_norm(&summed, &w, eps, &mut normed);
    let mut f = Out::create(dir, "norm.bin");
    f.put(&[rows as i32, d as i32]);
    f.put(&[eps]);
    f.put(&x);
    f.put(&add);
    f.put(&w);
    f.put(&summed);
    f.put(&normed);
    f.put(&quantized(&normed));
}

fn write_swiglu(dir: &Path, r: &mut Lcg, fl: Flavor) {
    let (n, n_ff) = (2usize, 1536usize);
    let gu: Vec<f32> = (0..n * 2 * n_ff).map(|_| r.f31() * 12.0).collect();
    let mut act = vec![0f32; n * n_ff];
    for t in 0..n {
        let (g, u) = gu[t * 2 * n_ff..(t + 1) * 2 * n_ff].split_at(n_ff);
        ggml::expf::swiglu(g, u, &mut act[t * n_ff..(t + 1) * n_ff], fl);
    }
    let mut f = Out::create(dir, "swiglu.bin");
    f.put(&[n as i32, n_ff as i32]);
    f.put(&gu);
    f.put(&act);
    f.put(&quantized(&act));
}

fn write_rope(dir: &Path, r: &mut Lcg) {
    let (nh, nkv, hd, pos, cap) = (3usize, 1usize, 64usize, 9usize, 16usize);
    let pairs = hd / 2;
    let qkv: Vec<f32> = (0..(nh + 2 * nkv) * hd).map(|_| r.f31() * 2.0).collect();
    // Any cos/sin values do: the kernel reads the table the host computed.
    let table: Vec<f32> = (0..(pos + 1) * pairs * 2).map(|_| r.f31()).collect();
    let row: Vec<(f32, f32)> = table[pos * pairs * 2..]
        .chunks_exact(2)
        .map(|c| (c[0], c[1]))
        .collect();
    for neox in [false, true] {
        let mut want = qkv.clone();
        for h in 0..nh + nkv {
            crate::cpu::rope::apply_rope(&mut want[h * hd..(h + 1) * hd], &row, neox);
        }
        let to_f16 =
            |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| f16::from_f32(x).to_bits()).collect() };
        let name = if neox { "rope_neox.bin" } else { "rope.bin" };
        let mut f = Out::create(dir, name);
        f.put(&[
            nh as i32,
            nkv as i32,
            hd as i32,
            pairs as i32,
            neox as i32,
            pos as i32,
            cap as i32,
        ]);
        f.put(&qkv);
        f.put(&table);
        f.put(&want[..nh * hd]);
        f.put(&to_f16(&want[nh * hd..(nh + nkv) * hd]));
        f.put(&to_f16(&qkv[(nh + nkv) * hd..]));
    }
}

/// Both arithmetic orders (`model.numerics`): `portable` is AVX2's on every
/// CPU, `native` AVX-512's on AVX-512 CPUs. The harness is compiled once and
/// run over each flavour's cases.
#[test]
fn kernels_match_the_cpu_bit_for_bit_in_a_cpu_emulation() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        eprintln!("NOTICE: no C++ compiler ({cxx}); skipping the CUDA kernel emulation check");
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    for (name, text) in [
        ("prelude.h", PRELUDE),
        ("harness.cpp", HARNESS),
        ("formats.cpp", FORMATS),
        ("kernels_all.cu", crate::cuda::source::KERNEL_SOURCE),
    ] {
        std::fs::write(d.join(name), text).expect("emulation sources");
    }
    let exe = d.join("harness");
    let build = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O1",
            "-ffp-contract=off",
            "-fno-fast-math",
            "-w",
            "-pthread",
            "-o",
        ])
        .arg(&exe)
        .arg(d.join("harness.cpp"))
        .output()
        .expect("running the C++ compiler");
    if !build.status.success() {
        let err = String::from_utf8_lossy(&build.stderr);
        if err.contains("_Float16") || err.contains("c++20") || err.contains("atomic_ref") {
            eprintln!(
                "NOTICE: {cxx} lacks C++20 / _Float16; skipping the CUDA kernel emulation check"
            );
            return;
        }
        panic!("the emulated kernels do not compile with {cxx}:\n{err}");
    }
    // The cases that do not depend on the flavour run with the first only.
    for (fl, shared) in [(Flavor::Avx2, true), (Flavor::Avx512, false)] {
        let cases = d.join(fl.name());
        std::fs::create_dir(&cases).expect("case dir");
        let mut r = Lcg(12345);
        write_attention(&cases, &mut r, fl);
        write_swiglu(&cases, &mut r, fl);
        if shared {
            write_norm(&cases, &mut r);
            write_rope(&cases, &mut r);
        }
        formats::write_cases(&cases, &mut r, fl, shared);
        let run = Command::new(&exe)
            .arg(&cases)
            .arg(fl.lanes().to_string())
            .arg((shared as i32).to_string())
            .output()
            .expect("running the emulated kernels");
        let report = String::from_utf8_lossy(&run.stdout);
        eprintln!("{report}");
        assert!(
            run.status.success(),
            "emulated CUDA kernels differ from the CPU backend ({:?} flavour):\n{report}{}",
            fl,
            String::from_utf8_lossy(&run.stderr)
        );
    }
}
