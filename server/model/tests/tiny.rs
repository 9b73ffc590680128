//! Loading and forward-pass tests on tiny GGUF files the tests write
//! themselves (random weights, 2 layers, byte-level vocabulary), so they run
//! without the real model.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use samplerd_model::{ChatMessage, Model, ModelError, ModelOptions, attr};
use std::path::{Path, PathBuf};

const D: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const FF: usize = 96;
const LAYERS: usize = 2;

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
    v.push("Ġt".into());
    v.push("he".into());
    v
}

// The unit tests' generator (the methods this file does not use are dead code here).
#[allow(dead_code)]
#[path = "../src/test_rng.rs"]
mod test_rng;
use test_rng::Lcg;

fn matrix(rng: &mut Lcg, rows: usize, cols: usize, scale: f32, dtype: GgmlDType) -> QTensor {
    let v: Vec<f32> = (0..rows * cols).map(|_| rng.f() * scale).collect();
    let t = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
    QTensor::quantize(&t, dtype).unwrap()
}

fn vector(rng: &mut Lcg, n: usize, base: f32, scale: f32) -> QTensor {
    let v: Vec<f32> = (0..n).map(|_| base + rng.f() * scale).collect();
    QTensor::quantize(
        &Tensor::from_vec(v, n, &Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap()
}

/// Weight formats of a tiny model: (attn_q/k, ffn_gate/up, ffn_down per
/// layer) and the feed-forward width.
struct Formats {
    qk: GgmlDType,
    gate_up: GgmlDType,
    down: [GgmlDType; LAYERS],
    ff: usize,
    /// The attention output projection's format (F16 or BF16: kept).
    attn_out: GgmlDType,
}

/// The default tiny model's formats: Q4_1 and Q8_0 kept, F32/F16
/// requantised at load.
const MIXED: Formats = Formats {
    qk: GgmlDType::Q4_1,
    gate_up: GgmlDType::Q4_1,
    down: [GgmlDType::F32; LAYERS],
    ff: FF,
    attn_out: GgmlDType::F16,
};

/// [`MIXED`] with a BF16 attention output projection.
const MIXED_BF16: Formats = Formats {
    attn_out: GgmlDType::BF16,
    ..MIXED
};

/// A Q4_K_M-like tiny model: Q5_0 fallbacks for the 64-wide rows, Q4_K and
/// Q6_K down projections (256-wide rows).
const K_QUANTS: Formats = Formats {
    qk: GgmlDType::Q5_0,
    gate_up: GgmlDType::Q5_0,
    down: [GgmlDType::Q4K, GgmlDType::Q6K],
    ff: 256,
    attn_out: GgmlDType::F16,
};

/// Writes a tiny model; `arch` is written to `general.architecture` (and
/// used as the metadata prefix); qwen2 gets q/k/v biases.
fn write_tiny(path: &Path, arch: &str) {
    write_tiny_pre(path, arch, "smollm")
}

/// [`write_tiny`] with `tokenizer.ggml.pre = pre`.
fn write_tiny_pre(path: &Path, arch: &str, pre: &str) {
    write_model_pre(path, arch, &MIXED, pre)
}

fn write_model(path: &Path, arch: &str, fm: &Formats) {
    write_model_pre(path, arch, fm, "smollm")
}

fn write_model_pre(path: &Path, arch: &str, fm: &Formats, pre: &str) {
    let ff = fm.ff;
    let mut rng = Lcg(42);
    let toks = vocab();
    let n_vocab = toks.len();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    tensors.push((
        "token_embd.weight".into(),
        matrix(&mut rng, n_vocab, D, 1.0, GgmlDType::Q8_0),
    ));
    let dkv = KV_HEADS * D / HEADS;
    for l in 0..LAYERS {
        let n = |s: &str| format!("blk.{l}.{s}");
        // Each norm, then the (name, rows, columns, scale, format) of the
        // matrices after it, in this order (one RNG stream makes them all).
        tensors.push((n("attn_norm.weight"), vector(&mut rng, D, 1.0, 0.1)));
        for (name, rows, cols, scale, dtype) in [
            ("attn_q.weight", D, D, 0.3, fm.qk),
            ("attn_k.weight", dkv, D, 0.3, fm.qk),
            ("attn_v.weight", dkv, D, 0.3, GgmlDType::Q8_0),
            ("attn_output.weight", D, D, 0.2, fm.attn_out),
        ] {
            tensors.push((n(name), matrix(&mut rng, rows, cols, scale, dtype)));
        }
        tensors.push((n("ffn_norm.weight"), vector(&mut rng, D, 1.0, 0.1)));
        for (name, rows, cols, scale, dtype) in [
            ("ffn_gate.weight", ff, D, 0.3, fm.gate_up),
            ("ffn_up.weight", ff, D, 0.3, fm.gate_up),
            ("ffn_down.weight", D, ff, 0.2, fm.down[l]),
        ] {
            tensors.push((n(name), matrix(&mut rng, rows, cols, scale, dtype)));
        }
        if arch == "qwen2" {
            tensors.push((n("attn_q.bias"), vector(&mut rng, D, 0.0, 0.1)));
            tensors.push((n("attn_k.bias"), vector(&mut rng, dkv, 0.0, 0.1)));
            tensors.push((n("attn_v.bias"), vector(&mut rng, dkv, 0.0, 0.1)));
        }
    }
    tensors.push(("output_norm.weight".into(), vector(&mut rng, D, 1.0, 0.1)));
    let mut types = vec![Value::I32(3); 3];
    types.extend((3..n_vocab).map(|_| Value::I32(1)));
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.context_length"), Value::U32(256)),
        (format!("{arch}.embedding_length"), Value::U32(D as u32)),
        (format!("{arch}.block_count"), Value::U32(LAYERS as u32)),
        (format!("{arch}.feed_forward_length"), Value::U32(ff as u32)),
        (
            format!("{arch}.attention.head_count"),
            Value::U32(HEADS as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            Value::U32(KV_HEADS as u32),
        ),
        (format!("{arch}.rope.freq_base"), Value::F32(10000.0)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(toks.iter().map(|t| Value::String(t.clone())).collect()),
        ),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(vec![
                Value::String("Ġ t".into()),
                Value::String("h e".into()),
            ]),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
}

fn tiny(dir: &tempfile::TempDir, arch: &str) -> PathBuf {
    let p = dir.path().join(format!("tiny-{arch}.gguf"));
    write_tiny(&p, arch);
    p
}

fn opts() -> ModelOptions {
    ModelOptions {
        n_threads: 2,
        n_ctx: 64,
        ..Default::default()
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn loads_and_runs_llama_and_qwen2() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["llama", "qwen2"] {
        let m = Model::load(&tiny(&dir, arch), &opts()).unwrap();
        let c = m.config();
        assert_eq!(
            (
                c.n_embd,
                c.n_layer,
                c.n_head,
                c.n_head_kv,
                c.head_dim,
                c.n_ff
            ),
            (D, LAYERS, HEADS, KV_HEADS, D / HEADS, FF)
        );
        assert_eq!(c.rope_neox, arch == "qwen2");
        assert_eq!(m.n_vocab(), vocab().len());
        assert_eq!(m.n_ctx(), 64);
        let mut s = m.new_session().unwrap();
        let logits = s.prefill(&[1, 50, 60, 70, 2]).unwrap().to_vec();
        assert_eq!(logits.len(), m.n_vocab());
        assert!(logits.iter().all(|x| x.is_finite()));
        assert!(
            logits.iter().any(|&x| x != logits[0]),
            "logits must depend on the vocabulary row"
        );
        assert_eq!(s.position(), 5);
        let next = s.decode(80).unwrap();
        assert_eq!(next.len(), m.n_vocab());
        assert_eq!(s.position(), 6);
    }
}

#[test]
fn kv_cache_decode_matches_full_prefill() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["llama", "qwen2"] {
        let m = Model::load(&tiny(&dir, arch), &opts()).unwrap();
        let toks: Vec<u32> = vec![1, 40, 41, 42, 100, 7, 9, 250, 33, 12, 2, 44];
        // Token by token through the cache…
        let mut inc = m.new_session().unwrap();
        inc.prefill(&toks[..3]).unwrap();
        for (i, &t) in toks.iter().enumerate().skip(3) {
            let step = inc.decode(t).unwrap().to_vec();
            // …equals one prefill of the whole prefix.
            let mut full = m.new_session().unwrap();
            let whole = full.prefill(&toks[..=i]).unwrap();
            let d = max_diff(&step, whole);
            assert!(
                d <= 1e-4,
                "{arch}: position {i}: decode vs prefill differ by {d}"
            );
        }
    }
}

#[test]
fn sessions_are_independent_and_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::load(&tiny(&dir, "llama"), &opts()).unwrap();
    let mut a = m.new_session().unwrap();
    let mut b = m.new_session().unwrap();
    let la = a.prefill(&[5, 6, 7]).unwrap().to_vec();
    b.prefill(&[9, 9]).unwrap();
    let lb = b.decode(9).unwrap().to_vec();
    let la2 = m
        .new_session()
        .unwrap()
        .prefill(&[5, 6, 7])
        .unwrap()
        .to_vec();
    assert_eq!(la, la2);
    assert_ne!(la, lb);
    // Truncate and replay gives the same logits.
    a.truncate(2);
    assert_eq!(a.position(), 2);
    assert_eq!(a.decode(7).unwrap(), &la[..]);
}

/// A forked session continues as a fresh prefill of the same prompt would,
/// bit for bit, alone or batched, and leaves its parent untouched.
#[test]
fn forked_sessions_continue_as_a_fresh_prefill_bit_for_bit() {
    let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let dir = tempfile::tempdir().unwrap();
    for arch in ["llama", "qwen2"] {
        let m = Model::load(&tiny(&dir, arch), &opts()).unwrap();
        let prompt = [1, 40, 41, 7, 250];
        let continuations: [[u32; 3]; 3] = [[3, 4, 5], [6, 7, 8], [3, 9, 9]];
        let solo: Vec<Vec<Vec<u32>>> = continuations
            .iter()
            .map(|c| {
                let mut s = m.new_session().unwrap();
                s.prefill(&prompt).unwrap();
                c.iter().map(|&t| bits(s.decode(t).unwrap())).collect()
            })
            .collect();
        let mut parent = m.new_session().unwrap();
        let prefilled = bits(parent.prefill(&prompt).unwrap());
        let mut forks: Vec<_> = (1..3)
            .map(|_| parent.fork().unwrap().expect("the CPU backend forks"))
            .collect();
        for f in &forks {
            assert_eq!(f.position(), prompt.len());
            assert_eq!(bits(f.logits()), prefilled);
            assert_eq!(f.cached_tokens(), &prompt);
        }
        forks.insert(0, parent);
        for k in 0..3 {
            // Step 0 alone per session, then batched.
            if k == 0 {
                for (i, s) in forks.iter_mut().enumerate() {
                    assert_eq!(bits(s.decode(continuations[i][k]).unwrap()), solo[i][k]);
                }
                continue;
            }
            let toks: Vec<u32> = (0..3).map(|i| continuations[i][k]).collect();
            let mut batch: Vec<&mut _> = forks.iter_mut().collect();
            m.decode_batch(&mut batch, &toks).unwrap();
            for (i, s) in forks.iter().enumerate() {
                assert!(bits(s.logits()) == solo[i][k], "{arch}: fork {i} step {k}");
            }
        }
    }
}

#[test]
fn batched_decode_equals_each_sequence_alone_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["llama", "qwen2"] {
        let m = Model::load(&tiny(&dir, arch), &opts()).unwrap();
        // Different prompt lengths (positions), capacities and tokens.
        let prompts: [&[u32]; 4] = [&[1, 40, 41], &[5], &[9, 9, 9, 9, 9, 9, 9], &[250, 7]];
        let caps = [64, 16, 32, 64];
        let steps: [[u32; 3]; 4] = [[3, 4, 5], [6, 7, 8], [100, 101, 102], [12, 2, 44]];
        let mut solo = Vec::new();
        for ((p, &cap), st) in prompts.iter().zip(&caps).zip(&steps) {
            let mut s = m.new_session_with_capacity(cap).unwrap();
            s.prefill(p).unwrap();
            solo.push(
                st.iter()
                    .map(|&t| s.decode(t).unwrap().to_vec())
                    .collect::<Vec<_>>(),
            );
        }
        let mut sessions: Vec<_> = prompts
            .iter()
            .zip(&caps)
            .map(|(p, &cap)| {
                let mut s = m.new_session_with_capacity(cap).unwrap();
                s.prefill(p).unwrap();
                s
            })
            .collect();
        for k in 0..3 {
            // Sequences join and leave: step k batches sequences k.. only.
            let mut batch: Vec<&mut _> = sessions.iter_mut().skip(k % 2).collect();
            let toks: Vec<u32> = (k % 2..4).map(|i| steps[i][k]).collect();
            m.decode_batch(&mut batch, &toks).unwrap();
            for (i, s) in (k % 2..4).zip(batch) {
                let want: Vec<u32> = solo[i][k].iter().map(|x| x.to_bits()).collect();
                let got: Vec<u32> = s.logits().iter().map(|x| x.to_bits()).collect();
                assert!(
                    want == got,
                    "{arch}: sequence {i} step {k} differs from its solo run"
                );
            }
            if k % 2 == 1 {
                // Sequence 0 sat this step out: catch it up alone.
                sessions[0].decode(steps[0][k]).unwrap();
            }
        }
        // A full cache is refused before anything runs.
        let mut full = m.new_session_with_capacity(2).unwrap();
        full.prefill(&[1, 2]).unwrap();
        let mut other = m.new_session().unwrap();
        other.prefill(&[3]).unwrap();
        let err = m
            .decode_batch(&mut [&mut other, &mut full], &[4, 5])
            .unwrap_err();
        assert!(err.to_string().contains("context"), "{err}");
        assert_eq!((other.position(), full.position()), (1, 2));
    }
}

#[test]
fn errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::load(&tiny(&dir, "llama"), &opts()).unwrap();
    let mut s = m.new_session_with_capacity(4).unwrap();
    assert!(matches!(s.prefill(&[]), Err(ModelError::EmptyInput)));
    let e = s.prefill(&[100_000]).unwrap_err();
    assert!(e.to_string().contains("100000"), "{e}");
    s.prefill(&[1, 2, 3]).unwrap();
    let e = s.prefill(&[4, 5]).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::ContextFull {
                position: 3,
                n_tokens: 2,
                capacity: 4
            }
        ),
        "{e}"
    );
}

#[test]
fn missing_file_is_named() {
    let p = Path::new("/nonexistent/dir/model.gguf");
    let e = Model::load(p, &opts()).unwrap_err();
    assert!(matches!(e, ModelError::NotFound { .. }), "{e:?}");
    assert!(e.to_string().contains("/nonexistent/dir/model.gguf"), "{e}");
}

#[test]
fn non_gguf_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("notes.txt");
    std::fs::write(&p, "this is not a model\n").unwrap();
    let e = Model::load(&p, &opts()).unwrap_err();
    assert!(matches!(e, ModelError::NotGguf { .. }), "{e:?}");
    assert!(
        e.to_string().contains("notes.txt") && e.to_string().contains("GGUF"),
        "{e}"
    );
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        Model::load(&empty, &opts()),
        Err(ModelError::NotGguf { .. })
    ));
}

#[test]
fn truncated_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(&dir, "llama");
    let bytes = std::fs::read(&p).unwrap();
    for keep in [bytes.len() - 100, bytes.len() / 2, 64, 10] {
        let t = dir.path().join(format!("cut-{keep}.gguf"));
        std::fs::write(&t, &bytes[..keep]).unwrap();
        let e = Model::load(&t, &opts()).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(&format!("cut-{keep}.gguf")), "{msg}");
        assert!(
            matches!(e, ModelError::Truncated { .. }),
            "keep {keep}: {e:?}"
        );
    }
}

#[test]
fn unsupported_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny(&dir, "gpt2");
    let e = Model::load(&p, &opts()).unwrap_err();
    assert!(
        matches!(&e, ModelError::UnsupportedArchitecture { arch, .. } if arch == "gpt2"),
        "{e:?}"
    );
    assert!(e.to_string().contains("tiny-gpt2.gguf"), "{e}");
    assert!(
        e.to_string().ends_with(
            "unsupported architecture \"gpt2\" (supported: llama (also Mistral), qwen2, qwen3)"
        ),
        "{e}"
    );
}

/// A pre-tokenizer llama.cpp does not know is a load error naming the key
/// and the value (llama.cpp refuses it too); a known family loads.
#[test]
fn unknown_pre_tokenizer_is_named_and_known_families_load() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny-tekken.gguf");
    write_tiny_pre(&p, "llama", "tekken");
    let e = Model::load(&p, &opts()).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.ggml.pre") && e.contains("\"tekken\"") && e.contains("llama-bpe"),
        "{e}"
    );
    for pre in ["llama-bpe", "qwen2", "gpt-2", "default"] {
        let p = dir.path().join(format!("tiny-{pre}.gguf"));
        write_tiny_pre(&p, "llama", pre);
        let m = Model::load(&p, &opts()).unwrap();
        assert_eq!(m.tokenizer().pre_tokenizer(), pre);
        assert!(
            !m.tokenizer()
                .encode("he t1", false, true)
                .unwrap()
                .is_empty()
        );
    }
}

#[test]
fn tokenizer_from_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let m = Model::load(&tiny(&dir, "llama"), &opts()).unwrap();
    let tk = m.tokenizer();
    let im_start = tk.token_id("<|im_start|>").unwrap();
    let gt = tk.token_id("Ġt").unwrap();
    let ids = tk.encode("<|im_start|>he t1", false, true).unwrap();
    assert_eq!(ids[0], im_start);
    assert!(
        ids.contains(&gt) && ids.contains(&tk.token_id("he").unwrap()),
        "{ids:?}"
    );
    // Special parsing off: the markup is plain bytes.
    let plain = tk.encode("<|im_start|>", false, false).unwrap();
    assert!(!plain.contains(&im_start) && plain.len() > 1, "{plain:?}");
    // Byte-level decode round-trips any text, including split characters.
    for text in ["he said \"hi\"\n\tok", "日本語 😀", "  spaces  "] {
        let ids = tk.encode(text, false, true).unwrap();
        assert_eq!(tk.decode(&ids, false), text);
    }
    assert!(tk.is_eog(2) && tk.is_eog(0) && !tk.is_eog(1));
    let v = m.vocabulary();
    assert_eq!(v.len(), m.n_vocab());
    assert_eq!(
        v[2].attrs & (attr::CONTROL | attr::END_OF_GENERATION),
        attr::CONTROL | attr::END_OF_GENERATION
    );
    assert_eq!(v[usize::try_from(gt).unwrap()].bytes, b" t");
    // No chat template in the file: the ChatML fallback.
    assert!(!m.chat_template().is_model_template());
    let p = m.render_chat(&[ChatMessage::new("user", "hi")]).unwrap();
    assert_eq!(p, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
}

/// A model with K-quant (and Q5_0) weights loads them natively, runs, keeps
/// batched decoding bit-identical to each sequence alone, and decode through
/// the cache stays close to a full prefill (prefills of 8+ tokens take
/// ggml's tiled-matmul order, single tokens its vector-dot order).
#[test]
fn k_quant_model_loads_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny-k.gguf");
    write_model(&p, "llama", &K_QUANTS);
    let m = Model::load(&p, &opts()).unwrap();
    let f = m.weight_formats();
    assert_eq!(f.get("q4_K"), Some(&1), "{f:?}");
    assert_eq!(f.get("q6_K"), Some(&1), "{f:?}");
    // Per layer: q and k apart (v is Q8_0, so q/k/v do not fuse), gate/up fused.
    assert_eq!(f.get("q5_0"), Some(&6), "{f:?}");
    let toks: Vec<u32> = vec![1, 40, 41, 42, 100, 7, 9, 250, 33, 12, 2, 44];
    let mut inc = m.new_session().unwrap();
    inc.prefill(&toks[..9]).unwrap();
    for (i, &t) in toks.iter().enumerate().skip(9) {
        let step = inc.decode(t).unwrap().to_vec();
        assert!(step.iter().all(|x| x.is_finite()));
        let mut full = m.new_session().unwrap();
        let d = max_diff(&step, full.prefill(&toks[..=i]).unwrap());
        assert!(d <= 1e-3, "position {i}: decode vs prefill differ by {d}");
    }
    // Batched decode equals each sequence alone, bit for bit.
    assert_batched_decode_equals_alone(&m, &[&toks[..9], &toks[2..5], &toks[..1]]);
}

/// One decode step of token 77 for the sessions of `prompts` batched
/// together gives each the logits it gets alone, bit for bit.
fn assert_batched_decode_equals_alone(m: &Model, prompts: &[&[u32]]) {
    let (mut alone, mut sessions) = (Vec::new(), Vec::new());
    for p in prompts {
        let mut s = m.new_session().unwrap();
        s.prefill(p).unwrap();
        let mut t = m.new_session().unwrap();
        t.prefill(p).unwrap();
        alone.push(t.decode(77).unwrap().to_vec());
        sessions.push(s);
    }
    let mut refs: Vec<&mut _> = sessions.iter_mut().collect();
    m.decode_batch(&mut refs, &vec![77; prompts.len()]).unwrap();
    for (i, (s, a)) in sessions.iter().zip(&alone).enumerate() {
        assert_eq!(
            s.logits().iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "sequence {i}"
        );
    }
}

/// F16 and BF16 weights (the tiny model's attention output) stay as
/// stored, not Q8_0; a prompt step (tinyBLAS order) and one-token steps
/// (vector-dot order) agree closely, and a batched decode equals each
/// sequence alone bit for bit (a row's order depends only on its own
/// sequence's step).
#[test]
fn f16_and_bf16_weights_are_kept_and_batched_decode_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    for (fm, format) in [(&MIXED, "f16"), (&MIXED_BF16, "bf16")] {
        let p = dir.path().join(format!("tiny-{format}.gguf"));
        write_model(&p, "llama", fm);
        half_precision_model_runs(&Model::load(&p, &opts()).unwrap(), format);
    }
}

fn half_precision_model_runs(m: &Model, format: &str) {
    let f = m.weight_formats();
    assert_eq!(f.get(format), Some(&LAYERS), "{f:?}");
    let toks: Vec<u32> = vec![1, 40, 41, 42, 100, 7, 9, 250, 33, 12];
    let mut inc = m.new_session().unwrap();
    inc.prefill(&toks[..3]).unwrap();
    for (i, &t) in toks.iter().enumerate().skip(3) {
        let step = inc.decode(t).unwrap().to_vec();
        let mut full = m.new_session().unwrap();
        let d = max_diff(&step, full.prefill(&toks[..=i]).unwrap());
        assert!(d <= 1e-3, "position {i}: decode vs prefill differ by {d}");
    }
    assert_batched_decode_equals_alone(m, &[&toks[..9], &toks[2..4], &toks[..1]]);
}

/// A K-quant tensor cut short by the end of the file is a load error naming
/// the tensor, its type and the bytes it needs.
#[test]
fn truncated_k_quant_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny-k.gguf");
    write_model(&p, "llama", &K_QUANTS);
    let bytes = std::fs::read(&p).unwrap();
    let content = gguf_file::Content::read(&mut std::io::Cursor::new(&bytes)).unwrap();
    let name = "blk.1.ffn_down.weight";
    let info = &content.tensor_infos[name];
    assert_eq!(info.ggml_dtype, GgmlDType::Q6K);
    let start = content.tensor_data_offset + info.offset;
    let cut = dir.path().join("cut-k.gguf");
    std::fs::write(&cut, &bytes[..start as usize + 1000]).unwrap();
    let e = Model::load(&cut, &opts()).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ModelError::Truncated { .. }), "{e:?}");
    // 64 rows of 256 values: 64 blocks of 210 bytes.
    for want in [
        name,
        "Q6K",
        "13440 bytes",
        &format!("{start}..{}", start + 13440),
    ] {
        assert!(msg.contains(want), "{want:?} missing from {msg}");
    }
}

/// A prompt's cached prefix stands in for a fresh prefill bit for bit on a
/// K-quant model too, where a step's order also depends on whether it is
/// tiled (8+ tokens): the rest is run in the fresh prefill's order.
#[test]
fn k_quant_reused_prefix_equals_a_fresh_prefill_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny-k.gguf");
    write_model(&p, "llama", &K_QUANTS);
    let m = Model::load(&p, &opts()).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 250).collect();
    let mut fresh = m.new_session().unwrap();
    let want: Vec<u32> = fresh
        .prefill(&prompt)
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    // Earlier prompts: shorter ones (some not tiled), one that decoded on.
    for earlier in [4usize, 9, 20, 35, 39] {
        let mut s = m.new_session().unwrap();
        s.prefill(&prompt[..earlier]).unwrap();
        s.decode(prompt[earlier]).unwrap();
        let n = s.reuse_prefix(&prompt);
        let got: Vec<u32> = s
            .prefill(&prompt[n..])
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(got, want, "earlier prompt of {earlier} tokens, {n} reused");
        if earlier >= 8 {
            assert_eq!(
                n,
                earlier.min(prompt.len() - 8),
                "earlier prompt of {earlier}"
            );
        } else {
            assert_eq!(n, 0, "a 4-token step's positions are not a tiled prompt's");
        }
    }
}

fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|x| x.to_bits()).collect()
}

/// The verify pass of speculative decoding (`Model::decode_rows`): for a
/// token and K = 1…8 drafts after a 40-token prompt, every row equals the
/// decode step of that token, bit for bit — alone, and batched with a
/// second sequence's verify pass and a third's single token; a rollback
/// to the token and some accepted drafts (`Session::truncate`) leaves a
/// cache whose next decode step equals the sequential run's, booked as
/// decode steps (a resume reuses them).
fn assert_rows_equal_decode_steps(m: &Model, what: &str) {
    // Long enough that attention's decode and prompt orders differ.
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 1) % 261).collect();
    let drafts: Vec<u32> = vec![44, 45, 7, 9, 250, 33, 200, 2, 17];
    for k in 1..=8 {
        let toks = &drafts[..=k];
        let fresh = || {
            let mut s = m.new_session().unwrap();
            s.prefill(&prompt).unwrap();
            s
        };
        let mut seq = fresh();
        let want: Vec<Vec<u32>> = toks.iter().map(|&t| bits(seq.decode(t).unwrap())).collect();
        let mut alone = fresh();
        m.decode_rows(&mut [&mut alone], &[toks]).unwrap();
        let got: Vec<Vec<u32>> = alone.logits_rows().map(bits).collect();
        assert!(
            got == want,
            "{what}: K = {k}, alone: rows differ from decode steps"
        );
        assert_eq!(
            bits(alone.logits()),
            want[k],
            "{what}: K = {k}: logits() is the last row"
        );
        let (mut other, mut third, mut batched) =
            (m.new_session().unwrap(), m.new_session().unwrap(), fresh());
        other.prefill(&prompt[..3]).unwrap();
        third.prefill(&prompt[..7]).unwrap();
        m.decode_rows(
            &mut [&mut other, &mut batched, &mut third],
            &[&[5, 6, 7][..], toks, &[8][..]],
        )
        .unwrap();
        let got: Vec<Vec<u32>> = batched.logits_rows().map(bits).collect();
        assert!(
            got == want,
            "{what}: K = {k}, batched: rows differ from decode steps"
        );
        let mut solo = m.new_session().unwrap();
        solo.prefill(&prompt[..7]).unwrap();
        assert_eq!(
            bits(third.logits()),
            bits(solo.decode(8).unwrap()),
            "{what}: K = {k}, third"
        );
        // Rollback: the token and `j` accepted drafts stay, then a new token.
        let j = k / 2;
        alone.truncate(prompt.len() + 1 + j);
        let mut reference = fresh();
        for &t in &toks[..=j] {
            reference.decode(t).unwrap();
        }
        assert_eq!(
            alone.cached_tokens(),
            reference.cached_tokens(),
            "{what}: K = {k}"
        );
        assert_eq!(
            bits(alone.decode(99).unwrap()),
            bits(reference.decode(99).unwrap()),
            "{what}: K = {k}: after a rollback to {j} accepted drafts"
        );
        let mut replay: Vec<u32> = toks[..=j].to_vec();
        replay.push(99);
        replay.push(98);
        assert_eq!(
            alone.reusable_replay(&prompt, &replay),
            prompt.len() + j + 2,
            "{what}: verified positions are booked as decode steps"
        );
    }
    // A verify pass that does not fit is refused before anything runs.
    let mut full = m.new_session_with_capacity(prompt.len() + 2).unwrap();
    full.prefill(&prompt).unwrap();
    let err = m
        .decode_rows(&mut [&mut full], &[&[1, 2, 3][..]])
        .unwrap_err();
    assert!(err.to_string().contains("context"), "{what}: {err}");
    assert_eq!(full.position(), prompt.len());
    let err = m.decode_rows(&mut [&mut full], &[&[][..]]).unwrap_err();
    assert!(matches!(err, ModelError::EmptyInput), "{what}: {err}");
}

#[test]
fn verify_rows_equal_decode_steps_bit_for_bit_in_every_format() {
    let dir = tempfile::tempdir().unwrap();
    for arch in ["llama", "qwen2"] {
        let m = Model::load(&tiny(&dir, arch), &opts()).unwrap();
        assert_rows_equal_decode_steps(&m, &format!("{arch} q4_1/q8_0/f16"));
    }
    for (fm, what) in [(&MIXED_BF16, "bf16"), (&K_QUANTS, "q5_0/q4_K/q6_K")] {
        let p = dir
            .path()
            .join(format!("tiny-rows-{what}.gguf").replace('/', "-"));
        write_model(&p, "llama", fm);
        assert_rows_equal_decode_steps(&Model::load(&p, &opts()).unwrap(), what);
    }
}
