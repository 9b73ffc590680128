//! Tiny models for the CUDA tests (here and the server's) and the thinking
//! tests: 2 layers of width 256 (whole K-quant super-blocks), a byte-level
//! vocabulary (any text tokenizes), every matrix — the embedding and output
//! too — in one weight format; [`write_thinking_model`] is a Qwen3-style
//! one whose vocabulary has `<think>` and `</think>` as special tokens.
//! Shared by path, so it has no dependency on the tests' helpers.
#![allow(dead_code)]

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

pub const D: usize = 256;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const FF: usize = 256;
pub const LAYERS: usize = 2;
/// Three specials, 256 bytes, two merges.
pub const N_VOCAB: usize = 261;
pub const CTX: usize = 64;

/// Every weight format the device keeps natively (the CPU loader keeps
/// each as it is).
pub const FORMATS: [GgmlDType; 9] = [
    GgmlDType::Q8_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
    GgmlDType::F16,
    GgmlDType::BF16,
];

/// A 64-bit LCG's values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// GPT-2's byte-to-character map (bytes that print as themselves, the rest
/// from U+0100 on).
fn byte_chars() -> Vec<char> {
    let mut out = Vec::new();
    let mut n = 0u32;
    for b in 0..256u32 {
        let keep =
            (33..=126).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        out.push(if keep {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        });
    }
    out
}

fn vocab() -> Vec<String> {
    let mut v: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    v.extend(byte_chars().into_iter().map(|c| c.to_string()));
    v.push("\u{120}t".into());
    v.push("he".into());
    v
}

fn matrix(rng: &mut Rng, rows: usize, cols: usize, scale: f32, dtype: GgmlDType) -> QTensor {
    let v: Vec<f32> = (0..rows * cols).map(|_| rng.f() * scale).collect();
    let t = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
    QTensor::quantize(&t, dtype).unwrap()
}

fn vector(rng: &mut Rng, n: usize, base: f32, scale: f32) -> QTensor {
    let v: Vec<f32> = (0..n).map(|_| base + rng.f() * scale).collect();
    QTensor::quantize(
        &Tensor::from_vec(v, n, &Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap()
}

/// A tiny model with every matrix (the embedding and output too) in `dtype`;
/// qwen2 gets q/k/v biases and NeoX RoPE.
pub fn write_model(path: &Path, arch: &str, dtype: GgmlDType) {
    write(path, arch, dtype, &[], 7);
}

/// [`write_model`] with the weights drawn from `seed` (another model over
/// the same vocabulary; seed 7 is [`write_model`]'s).
pub fn write_model_seeded(path: &Path, arch: &str, dtype: GgmlDType, seed: u64) {
    write(path, arch, dtype, &[], seed);
}

/// The ids of `<think>` and `</think>` in [`write_thinking_model`]'s
/// vocabulary (after the base vocabulary).
pub const THINK: u32 = N_VOCAB as u32;
pub const END_THINK: u32 = N_VOCAB as u32 + 1;

/// A Qwen3-style tiny model (qwen3: per-head q/k RMSNorm) whose
/// vocabulary ends with the control tokens `<think>` and `</think>`, as
/// Qwen3's does: what a server finds reasoning markers in without
/// configuration.
pub fn write_thinking_model(path: &Path) {
    write(path, "qwen3", GgmlDType::Q8_0, &["<think>", "</think>"], 7);
}

/// The model, `specials` appended to the vocabulary as control tokens.
fn write(path: &Path, arch: &str, dtype: GgmlDType, specials: &[&str], seed: u64) {
    let n_vocab = N_VOCAB + specials.len();
    let mut rng = Rng(seed);
    let mut tensors: Vec<(String, QTensor)> = vec![(
        "token_embd.weight".into(),
        matrix(&mut rng, n_vocab, D, 1.0, dtype),
    )];
    let dkv = KV_HEADS * D / HEADS;
    for l in 0..LAYERS {
        let n = |s: &str| format!("blk.{l}.{s}");
        tensors.push((n("attn_norm.weight"), vector(&mut rng, D, 1.0, 0.1)));
        for (name, rows, cols, scale) in [
            ("attn_q.weight", D, D, 0.3),
            ("attn_k.weight", dkv, D, 0.3),
            ("attn_v.weight", dkv, D, 0.3),
            ("attn_output.weight", D, D, 0.2),
        ] {
            tensors.push((n(name), matrix(&mut rng, rows, cols, scale, dtype)));
        }
        tensors.push((n("ffn_norm.weight"), vector(&mut rng, D, 1.0, 0.1)));
        for (name, rows, cols, scale) in [
            ("ffn_gate.weight", FF, D, 0.3),
            ("ffn_up.weight", FF, D, 0.3),
            ("ffn_down.weight", D, FF, 0.2),
        ] {
            tensors.push((n(name), matrix(&mut rng, rows, cols, scale, dtype)));
        }
        if arch == "qwen2" {
            tensors.push((n("attn_q.bias"), vector(&mut rng, D, 0.0, 0.1)));
            tensors.push((n("attn_k.bias"), vector(&mut rng, dkv, 0.0, 0.1)));
            tensors.push((n("attn_v.bias"), vector(&mut rng, dkv, 0.0, 0.1)));
        }
        if arch == "qwen3" {
            let hd = D / HEADS;
            tensors.push((n("attn_q_norm.weight"), vector(&mut rng, hd, 1.0, 0.1)));
            tensors.push((n("attn_k_norm.weight"), vector(&mut rng, hd, 1.0, 0.1)));
        }
    }
    tensors.push(("output_norm.weight".into(), vector(&mut rng, D, 1.0, 0.1)));
    tensors.push((
        "output.weight".into(),
        matrix(&mut rng, n_vocab, D, 0.5, dtype),
    ));
    let mut words = vocab();
    words.extend(specials.iter().map(|s| s.to_string()));
    let toks: Vec<Value> = words.into_iter().map(Value::String).collect();
    assert_eq!(toks.len(), n_vocab);
    let mut types = vec![Value::I32(3); 3];
    types.extend((3..N_VOCAB).map(|_| Value::I32(1)));
    types.extend(specials.iter().map(|_| Value::I32(3)));
    let u = |v: usize| Value::U32(v as u32);
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.context_length"), u(256)),
        (format!("{arch}.embedding_length"), u(D)),
        (format!("{arch}.block_count"), u(LAYERS)),
        (format!("{arch}.feed_forward_length"), u(FF)),
        (format!("{arch}.attention.head_count"), u(HEADS)),
        (format!("{arch}.attention.head_count_kv"), u(KV_HEADS)),
        (format!("{arch}.rope.freq_base"), Value::F32(10000.0)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(toks)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.pre".into(), Value::String("smollm".into())),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(vec![
                Value::String("\u{120} t".into()),
                Value::String("h e".into()),
            ]),
        ),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        ("tokenizer.ggml.bos_token_id".into(), u(1)),
        ("tokenizer.ggml.eos_token_id".into(), u(2)),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
}
