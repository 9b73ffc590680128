//! A vocabulary read on its own, without a model (GGUF or `tokenizer.json`).
//!
//! A vocabulary read on its own, without a model: each token's bytes and
//! attributes from a GGUF's tokenizer metadata, or from a Hugging Face
//! `tokenizer.json` (through the `tokenizers` crate). For clients that run
//! their model elsewhere and send logits, when a stage needs token bytes
//! (a grammar constraint).

use std::collections::HashMap;
use std::path::Path;

use tokenizers::DecoderWrapper;

use super::tokenizer::Tokenizer;
use super::vocab::{TokenInfo, attr};
use crate::error::ModelError;
use crate::gguf::GgufFile;

/// Plain text: no [`attr`] flag.
const TEXT: u32 = 0;

/// Special tokens that end generation by name, as llama.cpp recognises
/// them when a vocabulary does not say (`llama_vocab::impl::load`'s EOG
/// list in src/llama-vocab.cpp); a `tokenizer.json` carries no EOS id.
const EOG_NAMES: &[&str] = &[
    "</s>",
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
];

/// Reads the vocabulary of `path`: a `.json` file is a Hugging Face
/// tokenizer, anything else a GGUF (whose weights are not read).
pub fn read_vocabulary(path: &Path) -> Result<Vec<TokenInfo>, ModelError> {
    Ok(read_tokenizer(path)?.vocabulary().to_vec())
}

/// Reads the tokenizer of `path` (as [`read_vocabulary`] reads its
/// vocabulary), to turn text into ids as well.
pub fn read_tokenizer(path: &Path) -> Result<FileTokenizer, ModelError> {
    if path.extension().is_some_and(|e| e == "json") {
        let parsed = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        let vocab = json_vocabulary(&parsed);
        // `tokenizers` keeps "special-token text is text" as a setting of
        // the tokenizer, not of a call: one copy per setting.
        let mut literal = parsed.clone();
        literal.set_encode_special_tokens(true);
        return Ok(FileTokenizer::Json(Box::new(JsonTokenizer {
            parsed,
            literal,
            vocab,
        })));
    }
    let gguf = GgufFile::open(path)?;
    Ok(FileTokenizer::Gguf(Box::new(Tokenizer::from_gguf(&gguf)?)))
}

/// Text to token ids and ids back to bytes, with one vocabulary: the
/// model's tokenizer, or one read on its own ([`FileTokenizer`]).
pub trait TextCodec: Send + Sync {
    /// Token ids of `text`. `add_special`: the tokens the vocabulary adds
    /// around a text (BOS when it asks for one, as llama.cpp's
    /// `llama_tokenize` with `add_special`, src/llama-vocab.cpp);
    /// `parse_special`: special-token text (`<|im_start|>`) becomes that
    /// token instead of plain text.
    fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, ModelError>;

    /// Per token id its bytes and [`attr`] flags.
    fn vocabulary(&self) -> &[TokenInfo];
}

impl TextCodec for Tokenizer {
    fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, ModelError> {
        Tokenizer::encode(self, text, add_special, parse_special)
    }

    fn vocabulary(&self) -> &[TokenInfo] {
        Tokenizer::vocabulary(self)
    }
}

/// A tokenizer read from a file: a GGUF's (ids equal llama.cpp's, see
/// [`Tokenizer`]) or a Hugging Face `tokenizer.json` (ids as the
/// `tokenizers` library gives them).
pub enum FileTokenizer {
    Gguf(Box<Tokenizer>),
    Json(Box<JsonTokenizer>),
}

/// A `tokenizer.json`, with and without special-token parsing.
pub struct JsonTokenizer {
    parsed: tokenizers::Tokenizer,
    literal: tokenizers::Tokenizer,
    vocab: Vec<TokenInfo>,
}

impl TextCodec for FileTokenizer {
    fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, ModelError> {
        match self {
            FileTokenizer::Gguf(t) => Tokenizer::encode(t, text, add_special, parse_special),
            FileTokenizer::Json(j) => {
                let tk = if parse_special { &j.parsed } else { &j.literal };
                // `add_special_tokens` runs the file's post-processor (BOS
                // and the like, where the tokenizer declares them).
                let enc = tk.encode_fast(text, add_special).map_err(|e| {
                    ModelError::Tokenizer(format!("encoding {} bytes: {e}", text.len()))
                })?;
                Ok(enc.get_ids().to_vec())
            }
        }
    }

    fn vocabulary(&self) -> &[TokenInfo] {
        match self {
            FileTokenizer::Gguf(t) => t.vocabulary(),
            FileTokenizer::Json(j) => &j.vocab,
        }
    }
}

fn json_vocabulary(tk: &tokenizers::Tokenizer) -> Vec<TokenInfo> {
    let byte_level = uses_byte_level(tk.get_decoder());
    let unicode_to_byte = gpt2_unicode_to_byte();
    let added = tk.get_added_tokens_decoder();
    let n = tk.get_vocab_size(true);
    let mut out = Vec::with_capacity(n);
    for id in 0..n as u32 {
        let Some(text) = tk.id_to_token(id) else {
            out.push(TokenInfo {
                bytes: Vec::new(),
                attrs: attr::UNUSED,
            });
            continue;
        };
        if let Some(a) = added.get(&id).filter(|a| a.special) {
            let eog = EOG_NAMES.contains(&a.content.as_str());
            out.push(TokenInfo {
                bytes: a.content.clone().into_bytes(),
                attrs: attr::CONTROL | if eog { attr::END_OF_GENERATION } else { 0 },
            });
            continue;
        }
        out.push(if byte_level {
            TokenInfo {
                bytes: text
                    .chars()
                    .map(|c| unicode_to_byte.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    // Not in the byte alphabet: an added (non-special) token,
                    // which stands for its own text.
                    .unwrap_or_else(|| text.clone().into_bytes()),
                attrs: TEXT,
            }
        } else {
            sentencepiece_piece(&text)
        });
    }
    out
}

/// Whether the tokenizer decodes GPT-2 style (each byte one printable
/// character), directly or inside a decoder sequence.
fn uses_byte_level(d: Option<&DecoderWrapper>) -> bool {
    match d {
        Some(DecoderWrapper::ByteLevel(_)) => true,
        Some(DecoderWrapper::Sequence(seq)) => seq
            .get_decoders()
            .iter()
            .any(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
        _ => false,
    }
}

/// A SentencePiece-style piece: `▁` is a space, `<0xNN>` one raw byte.
fn sentencepiece_piece(text: &str) -> TokenInfo {
    if let Some(hex) = text.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
        && hex.len() == 2
        && let Ok(b) = u8::from_str_radix(hex, 16)
    {
        return TokenInfo {
            bytes: vec![b],
            attrs: attr::BYTE,
        };
    }
    TokenInfo {
        bytes: text.replace('\u{2581}', " ").into_bytes(),
        attrs: TEXT,
    }
}

/// GPT-2's byte ↔ printable-character table, inverted: the printable
/// ASCII and Latin-1 bytes stand for themselves, the other 68 bytes for
/// U+0100 onwards, in byte order.
fn gpt2_unicode_to_byte() -> HashMap<char, u8> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut next = 0x100;
    (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            (char::from_u32(c).expect("valid scalar"), b as u8)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_table_covers_every_byte_once() {
        let t = gpt2_unicode_to_byte();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'Ġ'], b' ', "Ġ (U+0120) is the space");
        assert_eq!(t[&'Ċ'], b'\n', "Ċ (U+010A) is the newline");
        assert_eq!(t[&'a'], b'a');
        let mut bytes: Vec<u8> = t.values().copied().collect();
        bytes.sort_unstable();
        assert_eq!(bytes, (0..=255).collect::<Vec<u8>>());
    }

    /// A byte-level BPE `tokenizer.json` (GPT-2 / Qwen / SmolLM2 style):
    /// pieces decode through the byte table, special added tokens are
    /// control tokens, and the known end-of-text one ends generation.
    #[test]
    fn a_byte_level_tokenizer_json_gives_each_tokens_bytes() {
        let json = r#"{"version":"1.0","truncation":null,"padding":null,
          "added_tokens":[{"id":3,"content":"<|endoftext|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
          "normalizer":null,
          "pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},
          "post_processor":null,
          "decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},
          "model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,
                   "fuse_unk":false,"byte_fallback":false,"vocab":{"a":0,"Ġb":1,"Ċ":2},"merges":[]}}"#;
        let dir = std::env::temp_dir().join(format!("samplerd-vocab-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        let v = read_vocabulary(&path).expect("reads");
        std::fs::remove_dir_all(&dir).unwrap();
        let bytes: Vec<&[u8]> = v.iter().map(|t| t.bytes.as_slice()).collect();
        assert_eq!(bytes, [&b"a"[..], b" b", b"\n", b"<|endoftext|>"]);
        assert_eq!(v[1].attrs, TEXT);
        assert_eq!(v[3].attrs, attr::CONTROL | attr::END_OF_GENERATION);
    }

    #[test]
    fn sentencepiece_pieces_become_bytes() {
        assert_eq!(sentencepiece_piece("▁the").bytes, b" the");
        let b = sentencepiece_piece("<0x0A>");
        assert_eq!((b.bytes, b.attrs), (vec![b'\n'], attr::BYTE));
    }
}
