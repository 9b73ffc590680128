//! An open GGUF file: header, metadata and tensor index, and a tensor's raw bytes or f32 values.
//!
//! Parsed through candle-core's `quantized::gguf_file`; the
//! hyper-parameters (`hparams`) and the weight matrices (`matrix`) are read
//! through it.

#![forbid(unsafe_code)]

use crate::error::ModelError;
use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// candle's error as one line, without the backtrace candle attaches when
/// `RUST_BACKTRACE` is set (`Error::WithBacktrace` prints its frames after
/// the message: a corrupt header's start-up error went on for ~45 frames
/// of build paths).
fn candle_message(e: &candle_core::Error) -> String {
    use candle_core::Error;
    match e {
        Error::WithBacktrace { inner, .. } => candle_message(inner),
        Error::WithPath { inner, path } => format!("path: {path:?} {}", candle_message(inner)),
        Error::Context { inner, context } => format!("{context}: {}", candle_message(inner)),
        other => other.to_string(),
    }
}

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
            let msg = candle_message(&e);
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

    pub(super) fn meta_err(&self, key: &str, problem: impl Into<String>) -> ModelError {
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

    pub(super) fn require_usize(&self, key: &str) -> Result<usize, ModelError> {
        self.get_usize(key)?
            .ok_or_else(|| self.meta_err(key, "missing"))
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

    pub(super) fn info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
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
        .map_err(|e| {
            self.tensor_err(name, format!("decoding {dtype:?}: {}", candle_message(&e)))
        })?;
        qt.dequantize(&candle_core::Device::Cpu)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| {
                self.tensor_err(
                    name,
                    format!("dequantising {dtype:?}: {}", candle_message(&e)),
                )
            })
    }

    /// A 1-D tensor of `n` f32 values (norm weights, biases).
    pub fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        let v = self.f32_values(name)?;
        if v.len() != n {
            return Err(self.tensor_err(name, format!("expected {n} values, found {}", v.len())));
        }
        Ok(v)
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
