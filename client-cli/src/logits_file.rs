//! Reading one step's logits from a file or stdin: NumPy `.npy` (float32,
//! or float64 converted; one row), raw little-endian f32 (`.f32`, `.bin`),
//! or a JSON array (`.json`). The result is the raw little-endian f32 bytes
//! the `logits_f32le` fast path sends, plus the values for local use.
//!
//! The `.npy` reader is a small hand parser (magic, version, header dict:
//! `descr`, `fortran_order`, `shape`) — enough for what NumPy writes with
//! `np.save`, without pulling a parser crate into the client.

use std::io::Read;
use std::path::Path;

use crate::cli::LogitsFormat;

/// Why a logits file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LogitsError {
    #[error("cannot read {path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot tell the format of {0} from its extension; use --format npy|raw|json")]
    UnknownFormat(String),
    #[error("{path}: {msg}")]
    Invalid { path: String, msg: String },
}

/// Logits read from a file.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    /// The values.
    pub values: Vec<f32>,
}

impl Logits {
    /// Raw little-endian f32 bytes (`SampleRequest.logits_f32le`).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        self.values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }
}

/// The format implied by a file name, if any.
pub fn format_from_extension(path: &Path) -> Option<LogitsFormat> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    match ext.as_str() {
        "npy" => Some(LogitsFormat::Npy),
        "f32" | "bin" | "raw" => Some(LogitsFormat::Raw),
        "json" => Some(LogitsFormat::Json),
        _ => None,
    }
}

/// Guesses the format of unnamed bytes (stdin): the .npy magic, a JSON
/// array, else raw f32.
pub fn sniff_format(bytes: &[u8]) -> LogitsFormat {
    if bytes.starts_with(NPY_MAGIC) {
        return LogitsFormat::Npy;
    }
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first == Some(&b'[') && std::str::from_utf8(bytes).is_ok() {
        LogitsFormat::Json
    } else {
        LogitsFormat::Raw
    }
}

/// Reads `path` (`-` = stdin) in `format` (default: from the extension,
/// sniffed for stdin).
pub fn read(path: &Path, format: Option<LogitsFormat>) -> Result<Logits, LogitsError> {
    let stdin = path.as_os_str() == "-";
    let name = if stdin {
        "<stdin>".to_string()
    } else {
        path.display().to_string()
    };
    let format = match format {
        Some(f) => Some(f),
        None if stdin => None,
        None => Some(
            format_from_extension(path).ok_or_else(|| LogitsError::UnknownFormat(name.clone()))?,
        ),
    };
    let io = |source| LogitsError::Io {
        path: name.clone(),
        source,
    };
    let bytes = if stdin {
        let mut buf = Vec::new();
        std::io::stdin().lock().read_to_end(&mut buf).map_err(io)?;
        buf
    } else {
        std::fs::read(path).map_err(io)?
    };
    let format = format.unwrap_or_else(|| sniff_format(&bytes));
    parse(&bytes, format).map_err(|msg| LogitsError::Invalid { path: name, msg })
}

/// Parses bytes in a known format.
pub fn parse(bytes: &[u8], format: LogitsFormat) -> Result<Logits, String> {
    let values = match format {
        LogitsFormat::Raw => parse_raw(bytes)?,
        LogitsFormat::Json => parse_json(bytes)?,
        LogitsFormat::Npy => parse_npy(bytes)?,
    };
    if values.is_empty() {
        return Err("no logits (empty)".into());
    }
    Ok(Logits { values })
}

fn parse_raw(bytes: &[u8]) -> Result<Vec<f32>, String> {
    if !bytes.len().is_multiple_of(4) {
        return Err(format!(
            "raw f32 data must be a multiple of 4 bytes, got {} bytes",
            bytes.len()
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn parse_json(bytes: &[u8]) -> Result<Vec<f32>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("invalid JSON: {e}"))?;
    // Accept [..], [[..]] (one row) and {"logits": [..]}.
    let arr = match &v {
        serde_json::Value::Object(m) => m.get("logits").unwrap_or(&v),
        _ => &v,
    };
    let arr = match arr {
        serde_json::Value::Array(rows) if rows.len() == 1 && rows[0].is_array() => &rows[0],
        a => a,
    };
    let serde_json::Value::Array(items) = arr else {
        return Err("expected a JSON array of numbers".into());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_f64()
                .map(|f| f as f32)
                .ok_or_else(|| format!("element {i} is not a number: {x}"))
        })
        .collect()
}

const NPY_MAGIC: &[u8] = b"\x93NUMPY";

fn parse_npy(bytes: &[u8]) -> Result<Vec<f32>, String> {
    if !bytes.starts_with(NPY_MAGIC) || bytes.len() < 10 {
        return Err("not a .npy file (bad magic)".into());
    }
    let major = bytes[6];
    let (header_len, start) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err("truncated .npy header".into());
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let header = bytes
        .get(start..start + header_len)
        .ok_or("truncated .npy header")?;
    let header = std::str::from_utf8(header).map_err(|_| "non-UTF-8 .npy header")?;
    let data = &bytes[start + header_len..];

    let descr = dict_value(header, "descr").ok_or("no 'descr' in .npy header")?;
    let descr = descr.trim_matches(|c| c == '\'' || c == '"');
    let fortran = dict_value(header, "fortran_order").unwrap_or("False");
    let shape_text = dict_value(header, "shape").ok_or("no 'shape' in .npy header")?;
    let shape: Vec<usize> = shape_text
        .trim_matches(|c| c == '(' || c == ')')
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse()
                .map_err(|_| format!("bad .npy shape {shape_text}"))
        })
        .collect::<Result<_, _>>()?;
    let count: usize = shape.iter().product();
    let rows = shape.iter().filter(|&&d| d > 1).count();
    if rows > 1 {
        return Err(format!(
            "expected one row of logits, got shape {shape_text}"
        ));
    }
    let _ = fortran; // one row: C and Fortran order are the same bytes
    let values: Vec<f32> = match descr {
        "<f4" | "f4" => parse_raw(data)?,
        ">f4" => data
            .chunks_exact(4)
            .map(|c| f32::from_be_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "<f8" | "f8" => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
            .collect(),
        other => {
            return Err(format!(
                "unsupported .npy dtype {other:?} (expected float32 '<f4' or float64 '<f8')"
            ));
        }
    };
    if values.len() != count {
        return Err(format!(
            ".npy data holds {} values but the shape {shape_text} says {count}",
            values.len()
        ));
    }
    Ok(values)
}

/// The raw text of `'key': value` in a Python dict literal (values here are
/// strings, booleans or tuples).
fn dict_value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let pat_single = format!("'{key}'");
    let pat_double = format!("\"{key}\"");
    let at = header
        .find(&pat_single)
        .map(|i| i + pat_single.len())
        .or_else(|| header.find(&pat_double).map(|i| i + pat_double.len()))?;
    let rest = header[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = if rest.starts_with('(') {
        rest.find(')')? + 1
    } else {
        rest.find([',', '}']).unwrap_or(rest.len())
    };
    Some(rest[..end].trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `np.save` writes for a 1-D float32 array (version 1.0).
    pub fn npy_bytes(values: &[f32], shape: &str) -> Vec<u8> {
        let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = NPY_MAGIC.to_vec();
        out.extend([1, 0]);
        out.extend((header.len() as u16).to_le_bytes());
        out.extend(header.as_bytes());
        for v in values {
            out.extend(v.to_le_bytes());
        }
        out
    }

    #[test]
    fn npy_one_and_two_dims() {
        let v = [1.0f32, -2.5, 3.25];
        assert_eq!(
            parse(&npy_bytes(&v, "(3,)"), LogitsFormat::Npy)
                .unwrap()
                .values,
            v
        );
        assert_eq!(
            parse(&npy_bytes(&v, "(1, 3)"), LogitsFormat::Npy)
                .unwrap()
                .values,
            v
        );
        assert!(parse(&npy_bytes(&v, "(4,)"), LogitsFormat::Npy).is_err());
        let err = parse(&npy_bytes(&[0.0; 4], "(2, 2)"), LogitsFormat::Npy).unwrap_err();
        assert!(err.contains("one row"), "{err}");
    }

    #[test]
    fn raw_and_json() {
        let bytes: Vec<u8> = [0.5f32, 1.5].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(parse(&bytes, LogitsFormat::Raw).unwrap().values, [0.5, 1.5]);
        assert!(parse(&bytes[..5], LogitsFormat::Raw).is_err());
        assert_eq!(
            parse(b"[1, 2.5]", LogitsFormat::Json).unwrap().values,
            [1.0, 2.5]
        );
        assert_eq!(
            parse(b"[[1, 2]]", LogitsFormat::Json).unwrap().values,
            [1.0, 2.0]
        );
        assert_eq!(
            parse(br#"{"logits": [3]}"#, LogitsFormat::Json)
                .unwrap()
                .values,
            [3.0]
        );
        assert!(parse(b"[1, \"x\"]", LogitsFormat::Json).is_err());
        assert!(parse(b"[]", LogitsFormat::Json).is_err());
    }

    #[test]
    fn sniffing_and_extensions() {
        assert_eq!(sniff_format(b"  [1,2]"), LogitsFormat::Json);
        assert_eq!(sniff_format(&npy_bytes(&[1.0], "(1,)")), LogitsFormat::Npy);
        assert_eq!(sniff_format(&1.0f32.to_le_bytes()), LogitsFormat::Raw);
        assert_eq!(
            format_from_extension(Path::new("a.NPY")),
            Some(LogitsFormat::Npy)
        );
        assert_eq!(
            format_from_extension(Path::new("a.bin")),
            Some(LogitsFormat::Raw)
        );
        assert_eq!(format_from_extension(Path::new("a.txt")), None);
    }
}
