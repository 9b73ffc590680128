//! Architecture variants on tiny GGUF files written here: qwen3 (per-head
//! q/k norm, query width != embedding width), Llama 3.1-style
//! `rope_freqs.weight`, and the hyper-parameters and tensors the loader
//! refuses by name. Numerical parity with llama.cpp for these variants is
//! `arch_parity.py`'s job; here: loading, plumbing and errors.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use samplerd_model::{Arch, Model, ModelError, ModelOptions};
use std::path::{Path, PathBuf};

const D: usize = 64;
const FF: usize = 96;

#[allow(dead_code)]
#[path = "../src/test_rng.rs"]
mod test_rng;
use test_rng::Lcg;

/// A tiny model description; `edit` changes the tensor list and metadata
/// before writing.
struct Spec {
    arch: &'static str,
    n_head: usize,
    n_kv: usize,
    /// `attention.key_length`, or `None` for `D / n_head`.
    key_length: Option<usize>,
    qk_norm: bool,
    rope_freqs: Option<Vec<f32>>,
}

impl Spec {
    fn head_dim(&self) -> usize {
        self.key_length.unwrap_or(D / self.n_head)
    }
}

fn qwen3() -> Spec {
    Spec {
        arch: "qwen3",
        n_head: 4,
        n_kv: 2,
        key_length: Some(32),
        qk_norm: true,
        rope_freqs: None,
    }
}

fn llama() -> Spec {
    Spec {
        arch: "llama",
        n_head: 4,
        n_kv: 2,
        key_length: None,
        qk_norm: false,
        rope_freqs: None,
    }
}

type Tensors = Vec<(String, QTensor)>;
type Meta = Vec<(String, Value)>;

fn q(v: Vec<f32>, shape: &[usize], dtype: GgmlDType) -> QTensor {
    let t = Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
    QTensor::quantize(&t, dtype).unwrap()
}

fn build(s: &Spec) -> (Tensors, Meta) {
    let mut rng = Lcg(7);
    let mut r = |n: usize, base: f32, scale: f32| -> Vec<f32> {
        (0..n).map(|_| base + rng.f() * scale).collect()
    };
    let n_vocab = vocab().len();
    let hd = s.head_dim();
    let (dq, dkv) = (s.n_head * hd, s.n_kv * hd);
    let mut t: Tensors = vec![(
        "token_embd.weight".into(),
        q(r(n_vocab * D, 0.0, 1.0), &[n_vocab, D], GgmlDType::Q8_0),
    )];
    for l in 0..2 {
        let n = |x: &str| format!("blk.{l}.{x}");
        for (name, rows, cols) in [
            ("attn_q.weight", dq, D),
            ("attn_k.weight", dkv, D),
            ("attn_v.weight", dkv, D),
            ("attn_output.weight", D, dq),
            ("ffn_gate.weight", FF, D),
            ("ffn_up.weight", FF, D),
            ("ffn_down.weight", D, FF),
        ] {
            let m = q(r(rows * cols, 0.0, 0.3), &[rows, cols], GgmlDType::Q8_0);
            t.push((n(name), m));
        }
        for name in ["attn_norm.weight", "ffn_norm.weight"] {
            t.push((n(name), q(r(D, 1.0, 0.1), &[D], GgmlDType::F32)));
        }
        if s.qk_norm {
            for name in ["attn_q_norm.weight", "attn_k_norm.weight"] {
                t.push((n(name), q(r(hd, 1.0, 0.2), &[hd], GgmlDType::F32)));
            }
        }
    }
    t.push((
        "output_norm.weight".into(),
        q(r(D, 1.0, 0.1), &[D], GgmlDType::F32),
    ));
    if let Some(f) = &s.rope_freqs {
        let n = f.len();
        t.push((
            "rope_freqs.weight".into(),
            q(f.clone(), &[n], GgmlDType::F32),
        ));
    }
    let a = s.arch;
    let mut m: Meta = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (format!("{a}.context_length"), Value::U32(128)),
        (format!("{a}.embedding_length"), Value::U32(D as u32)),
        (format!("{a}.block_count"), Value::U32(2)),
        (format!("{a}.feed_forward_length"), Value::U32(FF as u32)),
        (
            format!("{a}.attention.head_count"),
            Value::U32(s.n_head as u32),
        ),
        (
            format!("{a}.attention.head_count_kv"),
            Value::U32(s.n_kv as u32),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("smollm".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(vocab().into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(
                (0..n_vocab)
                    .map(|i| Value::I32(if i < 3 { 3 } else { 1 }))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(vec![
                Value::String("Ġ t".into()),
                Value::String("h e".into()),
            ]),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
    ];
    if let Some(k) = s.key_length {
        m.push((format!("{a}.attention.key_length"), Value::U32(k as u32)));
    }
    (t, m)
}

/// The byte-level vocabulary of GPT-2 style BPE after three control tokens,
/// and two merges.
fn vocab() -> Vec<String> {
    let mut v: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .map(String::from)
        .to_vec();
    let mut n = 0u32;
    for b in 0..256u32 {
        let keep =
            (33..=126).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let c = if keep {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
        v.push(c.to_string());
    }
    v.extend(["Ġt", "he"].map(String::from));
    v
}

fn write(path: &Path, t: &Tensors, m: &Meta) {
    let m: Vec<(&str, &Value)> = m.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<(&str, &QTensor)> = t.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &m, &t).unwrap();
}

/// Writes `s` after `edit` to `dir/name` and loads it.
fn load(
    dir: &tempfile::TempDir,
    name: &str,
    s: &Spec,
    edit: impl FnOnce(&mut Tensors, &mut Meta),
) -> (PathBuf, Result<std::sync::Arc<Model>, ModelError>) {
    let (mut t, mut m) = build(s);
    edit(&mut t, &mut m);
    let p = dir.path().join(name);
    write(&p, &t, &m);
    let opts = ModelOptions {
        n_threads: 2,
        n_ctx: 64,
        ..Default::default()
    };
    let r = Model::load(&p, &opts);
    (p, r)
}

fn greedy_logits(m: &Model, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut s = m.new_session().unwrap();
    let mut out = vec![s.prefill(prompt).unwrap().to_vec()];
    for _ in 0..steps {
        let l = out.last().unwrap();
        let next = (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32;
        out.push(s.decode(next).unwrap().to_vec());
    }
    out
}

fn tensor_error(e: &ModelError) -> (&str, &str) {
    match e {
        ModelError::Tensor {
            tensor, problem, ..
        } => (tensor.as_str(), problem.as_str()),
        other => panic!("expected a tensor error, got {other:?}"),
    }
}

fn metadata_error(e: &ModelError) -> (&str, &str) {
    match e {
        ModelError::Metadata { key, problem, .. } => (key.as_str(), problem.as_str()),
        other => panic!("expected a metadata error, got {other:?}"),
    }
}

#[test]
fn qwen3_with_wider_queries_loads_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (_, m) = load(&dir, "qwen3.gguf", &qwen3(), |_, _| {});
    let m = m.unwrap();
    let c = m.config();
    assert_eq!(c.arch, Arch::Qwen3);
    assert!(c.qk_norm && c.rope_neox);
    assert_eq!((c.head_dim, c.q_dim(), c.n_embd), (32, 128, 64));
    let l = greedy_logits(&m, &[5, 6, 7, 8], 6);
    assert!(l.iter().flatten().all(|x| x.is_finite()));
    // The q/k norms are used: changing one changes the logits.
    let (_, m2) = load(&dir, "qwen3b.gguf", &qwen3(), |t, _| {
        let i = t
            .iter()
            .position(|(n, _)| n == "blk.0.attn_k_norm.weight")
            .unwrap();
        t[i].1 = q(vec![2.0; 32], &[32], GgmlDType::F32);
    });
    assert_ne!(greedy_logits(&m2.unwrap(), &[5, 6, 7, 8], 0)[0], l[0]);
}

#[test]
fn qwen3_without_q_norm_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (p, r) = load(&dir, "no-q-norm.gguf", &qwen3(), |t, _| {
        t.retain(|(n, _)| n != "blk.1.attn_q_norm.weight")
    });
    let e = r.unwrap_err();
    assert_eq!(tensor_error(&e), ("blk.1.attn_q_norm.weight", "missing"));
    assert!(e.to_string().contains(&*p.to_string_lossy()), "{e}");
}

#[test]
fn qwen3_q_norm_of_the_wrong_size_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (_, r) = load(&dir, "short-q-norm.gguf", &qwen3(), |t, _| {
        let i = t
            .iter()
            .position(|(n, _)| n == "blk.0.attn_q_norm.weight")
            .unwrap();
        t[i].1 = q(vec![1.0; 16], &[16], GgmlDType::F32);
    });
    let e = r.unwrap_err();
    let (tensor, problem) = tensor_error(&e);
    assert_eq!(tensor, "blk.0.attn_q_norm.weight");
    assert!(problem.contains("expected 32 values, found 16"), "{e}");
}

#[test]
fn qwen3_with_a_bias_is_refused() {
    // llama.cpp's qwen3 has no q/k/v biases; a file with one is not a
    // qwen3 model this host (or llama.cpp) computes correctly.
    let dir = tempfile::tempdir().unwrap();
    let (_, r) = load(&dir, "qwen3-bias.gguf", &qwen3(), |t, _| {
        t.push((
            "blk.0.attn_q.bias".into(),
            q(vec![0.0; 128], &[128], GgmlDType::F32),
        ))
    });
    let e = r.unwrap_err();
    let (tensor, problem) = tensor_error(&e);
    assert_eq!(tensor, "blk.0.attn_q.bias");
    assert!(
        problem.contains("not used by the qwen3 forward pass"),
        "{e}"
    );
}

#[test]
fn rope_freqs_are_applied() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, f: Option<Vec<f32>>| {
        let s = Spec {
            rope_freqs: f,
            ..llama()
        };
        let (_, m) = load(&dir, name, &s, |_, _| {});
        greedy_logits(&m.unwrap(), &[10, 20, 30, 40, 50], 4)
    };
    let plain = run("plain.gguf", None);
    // Unit factors: bit-identical to no factors (x / 1 is exact).
    assert_eq!(run("ones.gguf", Some(vec![1.0; 8])), plain);
    // Llama 3-style factors (1 for high frequencies, up to 8 for low ones).
    let f = vec![1.0, 1.0, 1.3, 2.0, 4.0, 8.0, 8.0, 8.0];
    assert_ne!(run("llama3.gguf", Some(f)), plain);
}

#[test]
fn rope_freqs_of_the_wrong_length_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let s = Spec {
        rope_freqs: Some(vec![1.0; 16]),
        ..llama()
    };
    let (p, r) = load(&dir, "long-freqs.gguf", &s, |_, _| {});
    let e = r.unwrap_err();
    let (tensor, problem) = tensor_error(&e);
    assert_eq!(tensor, "rope_freqs.weight");
    assert!(
        problem.contains("expected shape [8]") && problem.contains("found 16 values"),
        "{e}"
    );
    assert!(e.to_string().contains(&*p.to_string_lossy()), "{e}");
    let s = Spec {
        rope_freqs: Some(vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ..llama()
    };
    let (_, r) = load(&dir, "zero-freq.gguf", &s, |_, _| {});
    let e = r.unwrap_err();
    assert_eq!(tensor_error(&e).0, "rope_freqs.weight");
}

#[test]
fn unsupported_hyper_parameters_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "llama.rope.scaling.type",
            Value::String("yarn".into()),
            "RoPE scaling \"yarn\" is not supported",
        ),
        ("llama.expert_count", Value::U32(8), "mixture-of-experts"),
        (
            "llama.attention.value_length",
            Value::U32(32),
            "differs from the key head size 16",
        ),
        ("llama.attention.scale", Value::F32(0.5), "attention scale"),
        (
            "llama.rope.scaling.attn_factor",
            Value::F32(1.2),
            "RoPE attention factor",
        ),
    ];
    for (i, (key, value, want)) in cases.into_iter().enumerate() {
        let (p, r) = load(&dir, &format!("case{i}.gguf"), &llama(), |_, m| {
            m.push((key.into(), value))
        });
        let e = r.unwrap_err();
        let (k, problem) = metadata_error(&e);
        assert_eq!(k, key);
        assert!(problem.contains(want), "{key}: {e}");
        assert!(e.to_string().contains(&*p.to_string_lossy()), "{e}");
    }
}

#[test]
fn supported_rope_scaling_and_sliding_window_load() {
    let dir = tempfile::tempdir().unwrap();
    let (_, m) = load(&dir, "linear.gguf", &llama(), |_, m| {
        m.push((
            "llama.rope.scaling.type".into(),
            Value::String("linear".into()),
        ));
        m.push(("llama.rope.scaling.factor".into(), Value::F32(4.0)));
        // Mistral 7B v0.1 style; llama.cpp's llama architecture ignores it.
        m.push(("llama.attention.sliding_window".into(), Value::U32(4096)));
    });
    assert_eq!(m.unwrap().config().rope_freq_scale, 0.25);
    let (_, m) = load(&dir, "none.gguf", &llama(), |_, m| {
        m.push((
            "llama.rope.scaling.type".into(),
            Value::String("none".into()),
        ));
        m.push(("llama.rope.scaling.factor".into(), Value::F32(4.0)));
    });
    assert_eq!(m.unwrap().config().rope_freq_scale, 1.0);
}

#[test]
fn unused_tensors_and_other_architectures_are_named() {
    let dir = tempfile::tempdir().unwrap();
    // An attention output bias (optional in llama.cpp's llama) is not
    // implemented: refused by name rather than ignored.
    let (_, r) = load(&dir, "bo.gguf", &llama(), |t, _| {
        t.push((
            "blk.1.attn_output.bias".into(),
            q(vec![0.0; D], &[D], GgmlDType::F32),
        ))
    });
    let e = r.unwrap_err();
    assert_eq!(tensor_error(&e).0, "blk.1.attn_output.bias");
    // rope_freqs.weight belongs to llama only (llama.cpp's qwen3 does not load it).
    let s = Spec {
        rope_freqs: Some(vec![1.0; 16]),
        ..qwen3()
    };
    let (_, r) = load(&dir, "qwen3-freqs.gguf", &s, |_, _| {});
    assert_eq!(tensor_error(&r.unwrap_err()).0, "rope_freqs.weight");
    let s = Spec {
        arch: "mistral3",
        ..llama()
    };
    let (p, r) = load(&dir, "mistral3.gguf", &s, |_, _| {});
    let e = r.unwrap_err();
    assert!(
        matches!(&e, ModelError::UnsupportedArchitecture { arch, .. } if arch == "mistral3"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains(&*p.to_string_lossy()) && msg.contains("qwen3"),
        "{msg}"
    );
}

#[test]
fn batched_decode_of_new_variants_equals_each_sequence_alone() {
    // The batched step indexes q and the attention output by the query
    // width and applies the q/k norm and frequency factors per row.
    let dir = tempfile::tempdir().unwrap();
    let llama3 = Spec {
        rope_freqs: Some(vec![1.0, 1.0, 1.3, 2.0, 4.0, 8.0, 8.0, 8.0]),
        ..llama()
    };
    for (name, s) in [("qwen3", qwen3()), ("llama3", llama3)] {
        let (_, m) = load(&dir, &format!("{name}.gguf"), &s, |_, _| {});
        let m = m.unwrap();
        let prompts: [&[u32]; 3] = [&[1, 40, 41], &[5], &[9, 9, 9, 9, 9, 9, 9, 9, 9]];
        let steps: [[u32; 2]; 3] = [[3, 4], [6, 7], [100, 101]];
        let mut solo = Vec::new();
        let mut sessions = Vec::new();
        for (p, st) in prompts.iter().zip(&steps) {
            let mut s = m.new_session().unwrap();
            s.prefill(p).unwrap();
            solo.push(st.map(|t| s.decode(t).unwrap().to_vec()));
            let mut b = m.new_session().unwrap();
            b.prefill(p).unwrap();
            sessions.push(b);
        }
        for k in 0..2 {
            let mut batch: Vec<&mut _> = sessions.iter_mut().collect();
            let toks: Vec<u32> = steps.iter().map(|s| s[k]).collect();
            m.decode_batch(&mut batch, &toks).unwrap();
            for (i, s) in batch.iter().enumerate() {
                let want: Vec<u32> = solo[i][k].iter().map(|x| x.to_bits()).collect();
                let got: Vec<u32> = s.logits().iter().map(|x| x.to_bits()).collect();
                assert!(want == got, "{name}: sequence {i} step {k} differs");
            }
        }
    }
}

/// qwen3 (per-head q/k norms, NEOX RoPE, wider queries): the verify pass
/// of speculative decoding (`Model::decode_rows`) gives every row the bits
/// of the decode step of that token, for K = 1…8 drafts.
#[test]
fn qwen3_verify_rows_equal_decode_steps_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (_, m) = load(&dir, "qwen3-rows.gguf", &qwen3(), |_, _| {});
    let m = m.unwrap();
    let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // Long enough that attention's decode and prompt orders differ.
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 259).collect();
    let toks = [9u32, 100, 7, 250, 33, 12, 2, 44, 45];
    for k in 1..=8 {
        let mut seq = m.new_session().unwrap();
        seq.prefill(&prompt).unwrap();
        let want: Vec<_> = toks[..=k]
            .iter()
            .map(|&t| bits(seq.decode(t).unwrap()))
            .collect();
        let mut s = m.new_session().unwrap();
        s.prefill(&prompt).unwrap();
        m.decode_rows(&mut [&mut s], &[&toks[..=k]]).unwrap();
        let got: Vec<_> = s.logits_rows().map(bits).collect();
        assert!(got == want, "K = {k}: rows differ from decode steps");
    }
}
