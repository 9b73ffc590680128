//! The real SmolLM2 vocabulary from its GGUF file (only the tokenizer
//! metadata is read), and its deterministic extension to 151,936 tokens.

use std::collections::HashSet;
use std::io::{self, Read};

use samplerd_plugin_sdk::abi::{SD_TOKEN_BYTE, SD_TOKEN_CONTROL, SD_TOKEN_EOG, SD_TOKEN_UNUSED};

struct R<'a>(&'a [u8]);

impl R<'_> {
    fn take(&mut self, n: usize) -> io::Result<&[u8]> {
        if self.0.len() < n {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short GGUF"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn string(&mut self) -> io::Result<Vec<u8>> {
        let n = self.u64()? as usize;
        Ok(self.take(n)?.to_vec())
    }
}

enum V {
    Int(i64),
    Strings(Vec<Vec<u8>>),
    Ints(Vec<i64>),
    Other,
}

fn scalar(r: &mut R<'_>, ty: u32) -> io::Result<Option<i64>> {
    Ok(match ty {
        0 | 1 | 7 => Some(r.take(1)?[0] as i64),
        2 | 3 => Some(u16::from_le_bytes(r.take(2)?.try_into().unwrap()) as i64),
        4 => Some(r.u32()? as i64),
        5 => Some(r.u32()? as i32 as i64),
        6 => {
            r.take(4)?;
            None
        }
        10 | 11 => Some(r.u64()? as i64),
        12 => {
            r.take(8)?;
            None
        }
        8 => {
            r.string()?;
            None
        }
        _ => return Err(io::Error::other(format!("GGUF type {ty}"))),
    })
}

fn value(r: &mut R<'_>, ty: u32) -> io::Result<V> {
    match ty {
        8 => {
            r.string()?;
            Ok(V::Other)
        }
        9 => {
            let et = r.u32()?;
            let n = r.u64()? as usize;
            if et == 8 {
                (0..n)
                    .map(|_| r.string())
                    .collect::<io::Result<_>>()
                    .map(V::Strings)
            } else {
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    out.push(scalar(r, et)?.unwrap_or(0));
                }
                Ok(V::Ints(out))
            }
        }
        _ => Ok(scalar(r, ty)?.map_or(V::Other, V::Int)),
    }
}

/// GPT-2's byte-level alphabet: printable bytes stand for themselves, the
/// others for U+0100 onwards (so a space is "Ġ").
fn byte_decoder() -> [Option<u8>; 512] {
    let mut map = [None; 512];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        let c = if printable {
            b as u32
        } else {
            n += 1;
            255 + n
        };
        map[c as usize] = Some(b);
    }
    map
}

fn decode_bpe(tok: &[u8], dec: &[Option<u8>; 512]) -> Vec<u8> {
    let s = String::from_utf8_lossy(tok);
    let mut out = Vec::new();
    for ch in s.chars() {
        match dec.get(ch as usize).copied().flatten() {
            Some(b) => out.push(b),
            None => out.extend_from_slice(ch.to_string().as_bytes()),
        }
    }
    out
}

/// (token bytes, SD_TOKEN_* attributes) of the GGUF's vocabulary.
pub fn read(path: &std::path::Path) -> io::Result<Vec<(Vec<u8>, u32)>> {
    let mut buf = Vec::new();
    // The metadata is at the front; 8 MiB holds a 152k-token vocabulary.
    std::fs::File::open(path)?
        .take(8 << 20)
        .read_to_end(&mut buf)?;
    let mut r = R(&buf);
    if r.take(4)? != b"GGUF" {
        return Err(io::Error::other("not a GGUF file"));
    }
    let _version = r.u32()?;
    let _tensors = r.u64()?;
    let n_kv = r.u64()?;
    let (mut tokens, mut types, mut eos) = (Vec::new(), Vec::new(), None);
    for _ in 0..n_kv {
        let key = r.string()?;
        let ty = r.u32()?;
        match (key.as_slice(), value(&mut r, ty)?) {
            (b"tokenizer.ggml.tokens", V::Strings(t)) => tokens = t,
            (b"tokenizer.ggml.token_type", V::Ints(t)) => types = t,
            (b"tokenizer.ggml.eos_token_id", V::Int(e)) => eos = Some(e as usize),
            _ => {}
        }
    }
    let dec = byte_decoder();
    Ok(tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let ty = types.get(i).copied().unwrap_or(1);
            let mut attr = match ty {
                3 => SD_TOKEN_CONTROL,
                5 => SD_TOKEN_UNUSED,
                6 => SD_TOKEN_BYTE,
                _ => 0,
            };
            let is_end = t.as_slice() == b"<|im_end|>" || t.as_slice() == b"<|endoftext|>";
            if Some(i) == eos || (ty == 3 && is_end) {
                attr |= SD_TOKEN_EOG | SD_TOKEN_CONTROL;
            }
            let bytes = if attr & SD_TOKEN_CONTROL != 0 {
                t.clone()
            } else {
                decode_bpe(t, &dec)
            };
            (bytes, attr)
        })
        .collect())
}

/// Extends `vocab` to `n` tokens with concatenations of pairs of its
/// normal tokens (pair i: token i % m followed by token (7919·i + i / m) % m, where
/// m is the real size), skipping any that already exist: a deterministic
/// stand-in for a larger BPE vocabulary, whose long tokens are such merges.
pub fn extend(mut vocab: Vec<(Vec<u8>, u32)>, n: usize) -> Vec<(Vec<u8>, u32)> {
    let m = vocab.len();
    let mut seen: HashSet<Vec<u8>> = vocab.iter().map(|(b, _)| b.clone()).collect();
    let mut i = 0usize;
    while vocab.len() < n {
        // the round (i / m) shifts the partner, so pairs never repeat
        let (a, b) = (i % m, (i * 7919 + i / m) % m);
        i += 1;
        if vocab[a].1 != 0 || vocab[b].1 != 0 {
            continue;
        }
        let mut w = vocab[a].0.clone();
        w.extend_from_slice(&vocab[b].0);
        if seen.insert(w.clone()) {
            vocab.push((w, 0));
        }
    }
    vocab
}
