//! GGUF loading: the header, metadata and tensor index through candle-core's
//! `quantized::gguf_file`, hyper-parameters for the supported architectures
//! (llama — which Mistral GGUFs also use —, qwen2, qwen3; see
//! [`GgufFile::config`]), and the raw bytes / f32 values of individual tensors.

#![forbid(unsafe_code)]

use crate::error::ModelError;
use crate::quant::{KQuant, QMatrix};
use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Supported model architectures (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1–3.x, and Mistral / Mistral Nemo (their GGUFs say `llama`).
    Llama,
    Qwen2,
    /// Qwen2's block without q/k/v biases, with a per-head RMSNorm of q and
    /// k before RoPE (llama.cpp `src/models/qwen3.cpp`).
    Qwen3,
}

impl Arch {
    /// Every supported architecture, as `general.architecture` names it.
    pub const SUPPORTED: &'static str = "llama (also Mistral), qwen2, qwen3";

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// Model hyper-parameters read from `<arch>.*` metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub arch: Arch,
    /// `<arch>.context_length`: the training context.
    pub n_ctx_train: usize,
    /// `<arch>.embedding_length`.
    pub n_embd: usize,
    /// `<arch>.block_count`.
    pub n_layer: usize,
    /// `<arch>.attention.head_count`.
    pub n_head: usize,
    /// `<arch>.attention.head_count_kv` (defaults to `n_head`).
    pub n_head_kv: usize,
    /// `<arch>.attention.key_length` (default `n_embd / n_head`); it may
    /// differ from `n_embd / n_head` (Qwen3 0.6B/4B, Mistral Nemo), so the
    /// query and attention-output width is `n_head * head_dim`
    /// ([`Self::q_dim`]), not `n_embd`.
    pub head_dim: usize,
    /// `<arch>.feed_forward_length`.
    pub n_ff: usize,
    /// `<arch>.rope.freq_base` (default 10000).
    pub rope_freq_base: f32,
    /// `<arch>.rope.dimension_count` (default `head_dim`).
    pub rope_dim: usize,
    /// Linear RoPE scaling: `1 / <arch>.rope.scaling.factor` (1 without
    /// one, or with scaling type `none`); llama.cpp's `freq_scale`.
    pub rope_freq_scale: f32,
    /// NEOX-style rotation (pairs `i`, `i + rope_dim/2`; qwen2/3) instead of
    /// adjacent pairs (llama, whose GGUF q/k weights are permuted for it).
    pub rope_neox: bool,
    /// `<arch>.attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// Per-head RMSNorm of q and k before RoPE (qwen3's
    /// `blk.N.attn_q_norm.weight` / `attn_k_norm.weight`).
    pub qk_norm: bool,
    /// Rows of `token_embd.weight`.
    pub n_vocab: usize,
}

impl Config {
    /// Width of the queries and of the attention output: `n_head * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of the keys (and values): `n_head_kv * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

/// The largest head size the attention pass handles (its per-head query
/// buffer; llama.cpp's largest common head size is 256 too).
pub const MAX_HEAD_DIM: usize = 256;

/// An open GGUF file: parsed header and metadata, plus the file for tensor reads.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    file: File,
    file_len: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Opens and parses `path`; a missing file, a non-GGUF file and a
    /// truncated header are distinct errors naming the path.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let pb = path.to_path_buf();
        let mut file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ModelError::NotFound { path: pb.clone() },
            _ => ModelError::Io {
                path: pb.clone(),
                source: e,
            },
        })?;
        let file_len = file
            .metadata()
            .map_err(|e| ModelError::Io {
                path: pb.clone(),
                source: e,
            })?
            .len();
        if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
            return Err(ModelError::NotGguf {
                path: pb,
                reason: "is a directory".into(),
            });
        }
        let mut magic = [0u8; 4];
        let got = read_up_to(&mut file, &mut magic).map_err(|e| ModelError::Io {
            path: pb.clone(),
            source: e,
        })?;
        if got < 4 || &magic != b"GGUF" {
            return Err(ModelError::NotGguf {
                path: pb,
                reason: format!(
                    "expected magic \"GGUF\", found {:?} ({} bytes)",
                    String::from_utf8_lossy(&magic[..got]),
                    file_len
                ),
            });
        }
        file.seek(SeekFrom::Start(0)).map_err(|e| ModelError::Io {
            path: pb.clone(),
            source: e,
        })?;
        let mut reader = std::io::BufReader::with_capacity(1 << 20, &mut file);
        let content = Content::read(&mut reader).map_err(|e| {
            let msg = e.to_string();
            if msg.contains("unknown magic") || msg.contains("version") {
                ModelError::NotGguf {
                    path: pb.clone(),
                    reason: msg,
                }
            } else {
                ModelError::Truncated {
                    path: pb.clone(),
                    reason: format!("header/metadata: {msg}"),
                }
            }
        })?;
        drop(reader);
        if content.tensor_data_offset > file_len {
            return Err(ModelError::Truncated {
                path: pb,
                reason: format!(
                    "tensor data starts at {} but the file has {} bytes",
                    content.tensor_data_offset, file_len
                ),
            });
        }
        Ok(GgufFile {
            path: pb,
            content,
            file,
            file_len,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self) -> &std::collections::HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn meta_err(&self, key: &str, problem: impl Into<String>) -> ModelError {
        ModelError::Metadata {
            path: self.path.clone(),
            key: key.into(),
            problem: problem.into(),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.meta_err(
                key,
                format!("expected a string, found {:?}", v.value_type()),
            )),
        }
    }

    pub fn get_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        let v = match self.get(key) {
            None => return Ok(None),
            Some(v) => v,
        };
        let n: i128 = match v {
            Value::U8(x) => *x as i128,
            Value::I8(x) => *x as i128,
            Value::U16(x) => *x as i128,
            Value::I16(x) => *x as i128,
            Value::U32(x) => *x as i128,
            Value::I32(x) => *x as i128,
            Value::U64(x) => *x as i128,
            Value::I64(x) => *x as i128,
            // Some converters write per-layer arrays; take the first value.
            Value::Array(a) if !a.is_empty() => return self.array_first_usize(key, a),
            other => {
                return Err(self.meta_err(
                    key,
                    format!("expected an integer, found {:?}", other.value_type()),
                ));
            }
        };
        usize::try_from(n)
            .map(Some)
            .map_err(|_| self.meta_err(key, format!("value {n} out of range")))
    }

    fn array_first_usize(&self, key: &str, a: &[Value]) -> Result<Option<usize>, ModelError> {
        match a[0]
            .to_u64()
            .or_else(|_| a[0].to_u32().map(u64::from))
            .or_else(|_| a[0].to_i32().map(|x| x as u64))
        {
            Ok(x) => Ok(Some(x as usize)),
            Err(_) => Err(self.meta_err(key, "expected an integer array")),
        }
    }

    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x)),
            Some(Value::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => {
                Err(self.meta_err(key, format!("expected a float, found {:?}", v.value_type())))
            }
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(x)) => Ok(Some(*x)),
            Some(v) => {
                Err(self.meta_err(key, format!("expected a bool, found {:?}", v.value_type())))
            }
        }
    }

    fn require_usize(&self, key: &str) -> Result<usize, ModelError> {
        self.get_usize(key)?
            .ok_or_else(|| self.meta_err(key, "missing"))
    }

    /// The architecture, checked against the supported ones.
    pub fn arch(&self) -> Result<Arch, ModelError> {
        let a = self
            .get_str("general.architecture")?
            .ok_or_else(|| self.meta_err("general.architecture", "missing"))?;
        match a {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            other => Err(ModelError::UnsupportedArchitecture {
                path: self.path.clone(),
                arch: other.to_string(),
            }),
        }
    }

    /// Reads and validates the hyper-parameters. Keys and defaults follow
    /// llama.cpp's `llama_model::load_hparams` (`src/llama-model.cpp`);
    /// hyper-parameters that would change the computation in ways this host
    /// does not implement (mixture of experts, YaRN / LongRoPE scaling,
    /// a custom attention scale, different K and V head sizes) are
    /// [`ModelError::Metadata`] errors naming the key, never ignored.
    pub fn config(&self) -> Result<Config, ModelError> {
        let arch = self.arch()?;
        let p = arch.name();
        let k = |s: &str| format!("{p}.{s}");
        let n_embd = self.require_usize(&k("embedding_length"))?;
        let n_head = self.require_usize(&k("attention.head_count"))?;
        let n_head_kv = self
            .get_usize(&k("attention.head_count_kv"))?
            .unwrap_or(n_head);
        if n_head == 0 {
            return Err(self.meta_err(&k("attention.head_count"), "0 heads"));
        }
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(self.meta_err(
                &k("attention.head_count_kv"),
                format!("{n_head_kv} KV heads do not divide {n_head} heads"),
            ));
        }
        let head_dim = match self.get_usize(&k("attention.key_length"))? {
            Some(hd) => hd,
            None if n_embd % n_head == 0 => n_embd / n_head,
            None => {
                return Err(self.meta_err(
                    &k("attention.head_count"),
                    format!(
                        "{n_head} heads do not divide embedding length {n_embd} \
                         (and there is no attention.key_length)"
                    ),
                ));
            }
        };
        if head_dim == 0 || head_dim > MAX_HEAD_DIM || head_dim % 2 != 0 {
            return Err(self.meta_err(
                &k("attention.key_length"),
                format!(
                    "head size {head_dim} unsupported (expected an even size up to {MAX_HEAD_DIM})"
                ),
            ));
        }
        if let Some(hv) = self.get_usize(&k("attention.value_length"))?
            && hv != head_dim
        {
            return Err(self.meta_err(
                &k("attention.value_length"),
                format!(
                    "value head size {hv} differs from the key head size {head_dim}; not supported"
                ),
            ));
        }
        let rope_dim = self
            .get_usize(&k("rope.dimension_count"))?
            .unwrap_or(head_dim);
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(self.meta_err(
                &k("rope.dimension_count"),
                format!("{rope_dim} invalid for head size {head_dim}"),
            ));
        }
        self.check_unsupported(p)?;
        let n_vocab = match self.content.tensor_infos.get("token_embd.weight") {
            Some(t) => t.shape.dims()[0],
            None => return Err(self.tensor_err("token_embd.weight", "missing")),
        };
        Ok(Config {
            arch,
            n_ctx_train: self.get_usize(&k("context_length"))?.unwrap_or(2048),
            n_embd,
            n_layer: self.require_usize(&k("block_count"))?,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: self.require_usize(&k("feed_forward_length"))?,
            rope_freq_base: self.get_f32(&k("rope.freq_base"))?.unwrap_or(10000.0),
            rope_dim,
            rope_freq_scale: self.rope_freq_scale(p)?,
            rope_neox: matches!(arch, Arch::Qwen2 | Arch::Qwen3),
            rms_eps: self
                .get_f32(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            qk_norm: arch == Arch::Qwen3,
            n_vocab,
        })
    }

    /// llama.cpp's `freq_scale`: `rope.scaling.type` defaults to `linear`,
    /// whose `1 / rope.scaling.factor` (or the older `rope.scale_linear`)
    /// scales every angle; `none` means 1 (`llama_context` constructor,
    /// "never scale if scaling type is none"). YaRN and LongRoPE change the
    /// angles per dimension in ways not implemented here: refused.
    fn rope_freq_scale(&self, p: &str) -> Result<f32, ModelError> {
        let type_key = format!("{p}.rope.scaling.type");
        let factor = match self.get_f32(&format!("{p}.rope.scaling.factor"))? {
            Some(f) => Some(f),
            None => self.get_f32(&format!("{p}.rope.scale_linear"))?,
        };
        match self.get_str(&type_key)?.unwrap_or("linear") {
            "none" => Ok(1.0),
            "linear" => match factor {
                // llama.cpp: `ropescale == 0.0f ? 1.0f : 1.0f/ropescale`.
                None | Some(0.0) => Ok(1.0),
                Some(f) if f.is_finite() && f > 0.0 => Ok(1.0 / f),
                Some(f) => Err(self.meta_err(
                    &format!("{p}.rope.scaling.factor"),
                    format!("{f} is not a positive scale factor"),
                )),
            },
            other => Err(self.meta_err(
                &type_key,
                format!("RoPE scaling {other:?} is not supported (supported: none, linear)"),
            )),
        }
    }

    /// Hyper-parameters whose presence changes the model in ways this host
    /// does not implement; each is refused by name.
    fn check_unsupported(&self, p: &str) -> Result<(), ModelError> {
        // Mixtral-style mixture of experts (llama.cpp reads it for `llama`).
        let experts = format!("{p}.expert_count");
        if let Some(n) = self.get_usize(&experts)?
            && n > 0
        {
            return Err(self.meta_err(
                &experts,
                format!("{n} experts: mixture-of-experts models are not supported"),
            ));
        }
        // A custom attention scale instead of 1/sqrt(head size) (granite).
        let scale = format!("{p}.attention.scale");
        if let Some(s) = self.get_f32(&scale)?
            && s != 0.0
        {
            return Err(self.meta_err(
                &scale,
                format!("attention scale {s} is not supported (only 1/sqrt(head size))"),
            ));
        }
        // llama.cpp multiplies every RoPE cos/sin by it (`rope_yarn`'s mscale).
        let attn_factor = format!("{p}.rope.scaling.attn_factor");
        if let Some(f) = self.get_f32(&attn_factor)?
            && f != 1.0
        {
            return Err(self.meta_err(
                &attn_factor,
                format!("RoPE attention factor {f} is not supported (only 1)"),
            ));
        }
        // `<arch>.attention.sliding_window` (some Mistral 7B v0.1
        // conversions) is deliberately not refused: llama.cpp's `llama`
        // architecture does not read it either and attends over the whole
        // context (`src/models/llama.cpp`), and parity with it is the goal.
        Ok(())
    }

    pub(crate) fn tensor_err(&self, name: &str, problem: impl Into<String>) -> ModelError {
        ModelError::Tensor {
            path: self.path.clone(),
            tensor: name.into(),
            problem: problem.into(),
        }
    }

    /// Every tensor's name, in no particular order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.content.tensor_infos.keys().map(String::as_str)
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.content
            .tensor_infos
            .get(name)
            .ok_or_else(|| self.tensor_err(name, "missing"))
    }

    /// Shape as (rows, cols) for matrices, (n, 1) for vectors; candle's order
    /// (outermost first).
    pub fn dims(&self, name: &str) -> Result<Vec<usize>, ModelError> {
        Ok(self.info(name)?.shape.dims().to_vec())
    }

    /// The tensor's raw bytes, bounds-checked against the file length.
    pub fn raw(&mut self, name: &str) -> Result<(GgmlDType, Vec<usize>, Vec<u8>), ModelError> {
        let info = self.info(name)?;
        let (dtype, dims) = (info.ggml_dtype, info.shape.dims().to_vec());
        let elems: usize = dims.iter().product();
        if !elems.is_multiple_of(dtype.block_size()) {
            return Err(self.tensor_err(
                name,
                format!("{elems} elements not a multiple of the {dtype:?} block size"),
            ));
        }
        let size = (elems / dtype.block_size() * dtype.type_size()) as u64;
        let start = self.content.tensor_data_offset.saturating_add(info.offset);
        if start.saturating_add(size) > self.file_len {
            return Err(ModelError::Truncated {
                path: self.path.clone(),
                reason: format!(
                    "tensor {name} ({dtype:?}, {size} bytes) needs bytes {start}..{} but the file has {}",
                    start + size,
                    self.file_len
                ),
            });
        }
        let mut buf = vec![0u8; size as usize];
        let io = |e| ModelError::Io {
            path: self.path.clone(),
            source: e,
        };
        self.file.seek(SeekFrom::Start(start)).map_err(io)?;
        self.file.read_exact(&mut buf).map_err(|e| ModelError::Io {
            path: self.path.clone(),
            source: e,
        })?;
        Ok((dtype, dims, buf))
    }

    /// The tensor dequantised to f32 (any type candle supports).
    pub fn f32_values(&mut self, name: &str) -> Result<Vec<f32>, ModelError> {
        let (dtype, dims, raw) = self.raw(name)?;
        if dtype == GgmlDType::F32 {
            return Ok(raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect());
        }
        let qt = candle_core::quantized::ggml_file::qtensor_from_ggml(
            dtype,
            &raw,
            dims,
            &candle_core::Device::Cpu,
        )
        .map_err(|e| self.tensor_err(name, format!("decoding {dtype:?}: {e}")))?;
        qt.dequantize(&candle_core::Device::Cpu)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| self.tensor_err(name, format!("dequantising {dtype:?}: {e}")))
    }

    /// A 1-D tensor of `n` f32 values (norm weights, biases).
    pub fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        let v = self.f32_values(name)?;
        if v.len() != n {
            return Err(self.tensor_err(name, format!("expected {n} values, found {}", v.len())));
        }
        Ok(v)
    }

    /// A `rows × cols` weight matrix in a kernel format: Q4_1, Q5_0, Q5_1, Q8_0,
    /// Q4_K, Q5_K and Q6_K kept as they are, Q4_0 as the equal Q8_0 blocks,
    /// everything else requantised to Q8_0. A tensor cut short by
    /// the end of the file is a [`ModelError::Truncated`] naming it and the
    /// byte range it needs (see [`Self::raw`]).
    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<QMatrix, ModelError> {
        let dims = self.dims(name)?;
        if dims != [rows, cols] {
            return Err(self.tensor_err(
                name,
                format!("expected shape [{rows}, {cols}], found {dims:?}"),
            ));
        }
        if !cols.is_multiple_of(crate::quant::QK) {
            return Err(self.tensor_err(name, format!("row length {cols} is not a multiple of 32")));
        }
        let dtype = self.info(name)?.ggml_dtype;
        // The formats read from their stored blocks, by constructor; the
        // others through f32.
        type FromBytes = fn(usize, usize, &[u8]) -> Option<QMatrix>;
        let from_bytes: Option<FromBytes> = match dtype {
            GgmlDType::Q8_0 => Some(QMatrix::from_q8_0_bytes),
            GgmlDType::Q4_1 => Some(QMatrix::from_q4_1_bytes),
            GgmlDType::Q5_0 => Some(QMatrix::from_q5_0_bytes),
            GgmlDType::Q5_1 => Some(QMatrix::from_q5_1_bytes),
            GgmlDType::Q4_0 => Some(|r, c, raw| QMatrix::q8_0_from_q4_0_or_q5_0(false, r, c, raw)),
            GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => {
                if !cols.is_multiple_of(crate::quant_k::QK_K) {
                    return Err(self.tensor_err(
                        name,
                        format!("{dtype:?} row length {cols} is not a multiple of 256"),
                    ));
                }
                Some(match dtype {
                    GgmlDType::Q4K => |r, c, raw| QMatrix::from_k_bytes(KQuant::Q4K, r, c, raw),
                    GgmlDType::Q5K => |r, c, raw| QMatrix::from_k_bytes(KQuant::Q5K, r, c, raw),
                    _ => |r, c, raw| QMatrix::from_k_bytes(KQuant::Q6K, r, c, raw),
                })
            }
            _ => None,
        };
        let m = match from_bytes {
            Some(from_bytes) => {
                let (_, _, raw) = self.raw(name)?;
                from_bytes(rows, cols, &raw)
            }
            None => {
                let v = self.f32_values(name)?;
                QMatrix::q8_0_from_f32(rows, cols, &v)
            }
        };
        m.ok_or_else(|| self.tensor_err(name, format!("{dtype:?} data has the wrong size")))
    }
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}
