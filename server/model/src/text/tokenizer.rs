//! The tokenizer, built from the GGUF metadata itself (`tokenizer.ggml.*`)
//! with the `tokenizers` crate so that token ids equal llama.cpp's.
//!
//! Supported (`tokenizer.ggml.model`):
//! - `"gpt2"`: byte-level BPE (never a prefix space) with the pre-tokenizer
//!   family llama.cpp picks for `tokenizer.ggml.pre` (`crate::text::pre_tokenizer`:
//!   default, GPT-2, SmolLM, Qwen2 and Llama 3 — whose whole-word vocabulary
//!   hits skip the merges, as llama.cpp's `ignore_merges`); another name is
//!   a load error naming it. Control and user-defined tokens (from
//!   `tokenizer.ggml.token_type`) are registered as added tokens, so
//!   `<|im_start|>` written in a raw prompt is one token when special
//!   parsing is on (as llama-server does for prompts).
//! - `"llama"`: SentencePiece-style merges by `tokenizer.ggml.scores` with
//!   byte fallback, as llama.cpp runs them (`crate::text::spm`): Llama 1 and 2,
//!   Mistral v0.1–v0.3.
//!
//! Another model is a load error naming the key and value.
//!
//! Decoding: [`Tokenizer::token_bytes`] gives a token's raw bytes (which may
//! be part of a UTF-8 character; see [`crate::Utf8Streamer`]): byte-level
//! for BPE, `▁` as a space and `<0xXX>` as its byte for SentencePiece, as
//! llama.cpp's `token_to_piece`.

#![forbid(unsafe_code)]

use crate::error::ModelError;
use crate::gguf::GgufFile;
use crate::text::pre_tokenizer::PreTokenizer;
use crate::text::spm::{Special, SpmEncoder};
use candle_core::quantized::gguf_file::Value;
use tokenizers::AddedToken;
use tokenizers::models::bpe::{BPE, Vocab};

/// GGUF token types (`tokenizer.ggml.token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Attribute flags of a vocabulary entry (see [`TokenInfo`]).
pub mod attr {
    /// A control token (`<|im_start|>`, `<|endoftext|>`…): not text.
    pub const CONTROL: u32 = 1;
    /// Ends generation (eos, eot, eom, `<|im_end|>`…).
    pub const END_OF_GENERATION: u32 = 2;
    /// A single raw byte (`<0x0A>`-style tokens).
    pub const BYTE: u32 = 4;
    /// Unused / unknown slot.
    pub const UNUSED: u32 = 8;
    /// User-defined token (matched verbatim in text).
    pub const USER_DEFINED: u32 = 16;
}

/// One vocabulary entry for sampler plugins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenInfo {
    /// The bytes the token stands for (control tokens: their text).
    pub bytes: Vec<u8>,
    /// [`attr`] flags.
    pub attrs: u32,
}

/// Strings llama.cpp treats as end-of-generation when they are tokens.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// How text becomes ids: the two vocabulary types llama.cpp calls BPE and
/// SPM.
enum Encoder {
    Bpe(Box<BpeEncoder>),
    Spm(Box<SpmEncoder>),
}

/// `tokenizers`' BPE, with and without the control tokens.
struct BpeEncoder {
    /// Control + user-defined tokens are added tokens (special parsing on).
    with_special: tokenizers::Tokenizer,
    /// Only user-defined tokens are added (special parsing off).
    plain: tokenizers::Tokenizer,
}

/// The model's tokenizer (see the module docs).
pub struct Tokenizer {
    encoder: Encoder,
    /// The text of every token that special parsing turns into a token and
    /// plain text does not (`<|im_end|>`, `</s>`, …).
    control_texts: Vec<String>,
    vocab: Vec<TokenInfo>,
    texts: Vec<String>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    eog: Vec<u32>,
    pre: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("n_vocab", &self.vocab.len())
            .field("pre", &self.pre)
            .finish_non_exhaustive()
    }
}

fn bytes_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let keep = (b'!' as u32..=b'~' as u32).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        map[b as usize] = if keep {
            char::from_u32(b).unwrap_or('\0')
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
            c
        };
    }
    map
}

fn tok_err(gguf: &GgufFile, key: &str, problem: impl Into<String>) -> ModelError {
    ModelError::Metadata {
        path: gguf.path().to_path_buf(),
        key: key.into(),
        problem: problem.into(),
    }
}

/// The BPE encoder: `tokenizers`' BPE over the GGUF's vocabulary and
/// merges, with the pre-tokenizer `family`.
fn bpe_encoder(
    gguf: &GgufFile,
    texts: &[String],
    types: &[i32],
    family: &PreTokenizer,
) -> Result<Encoder, ModelError> {
    let merges: Vec<(String, String)> = match gguf.get("tokenizer.ggml.merges") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                let s = v
                    .to_string()
                    .map_err(|e| tok_err(gguf, "tokenizer.ggml.merges", e.to_string()))?;
                let (l, r) = s.split_once(' ').ok_or_else(|| {
                    tok_err(
                        gguf,
                        "tokenizer.ggml.merges",
                        format!("merge {s:?} has no space"),
                    )
                })?;
                Ok((l.to_string(), r.to_string()))
            })
            .collect::<Result<_, ModelError>>()?,
        _ => {
            return Err(tok_err(
                gguf,
                "tokenizer.ggml.merges",
                "missing (needed for BPE)",
            ));
        }
    };
    // Duplicate strings keep their first id (llama.cpp's map keeps the
    // last; no shipped BPE vocabulary holds a string twice).
    let mut vocab = Vocab::default();
    for (i, t) in texts.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(i as u32);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(family.ignore_merges())
        .build()
        .map_err(|e| ModelError::Tokenizer(format!("building BPE: {e}")))?;
    let pre_tok = family.build().map_err(ModelError::Tokenizer)?;
    let mut plain = tokenizers::Tokenizer::new(bpe);
    plain.with_pre_tokenizer(Some(pre_tok));
    let mut with_special = plain.clone();
    let added = |ty: i32| -> Vec<AddedToken> {
        (0..texts.len())
            .filter(|&i| types[i] == ty)
            .map(|i| AddedToken::from(texts[i].clone(), true).normalized(false))
            .collect()
    };
    let user = added(token_type::USER_DEFINED);
    let add = |tk: &mut tokenizers::Tokenizer, tokens: Vec<AddedToken>| {
        tk.add_special_tokens(tokens)
            .map(|_| ())
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    };
    add(&mut plain, user.clone())?;
    add(&mut with_special, user)?;
    add(&mut with_special, added(token_type::CONTROL))?;
    Ok(Encoder::Bpe(Box::new(BpeEncoder {
        with_special,
        plain,
    })))
}

/// The SentencePiece encoder: `tokenizer.ggml.scores`, the special tokens
/// of `tokenizer.ggml.token_type` and `tokenizer.ggml.add_space_prefix`.
fn spm_encoder(gguf: &GgufFile, texts: &[String], types: &[i32]) -> Result<Encoder, ModelError> {
    let key = "tokenizer.ggml.scores";
    let scores: Vec<f32> = match gguf.get(key) {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.to_f32())
            .collect::<Result<_, _>>()
            .map_err(|e| tok_err(gguf, key, e.to_string()))?,
        _ => {
            return Err(tok_err(
                gguf,
                key,
                "missing (needed for SentencePiece merges)",
            ));
        }
    };
    if scores.len() != texts.len() {
        return Err(tok_err(
            gguf,
            key,
            format!("{} entries for {} tokens", scores.len(), texts.len()),
        ));
    }
    let specials = (0..texts.len())
        .filter_map(|i| {
            let only_when_parsing_special = match types[i] {
                token_type::CONTROL | token_type::UNKNOWN => true,
                token_type::USER_DEFINED => false,
                _ => return None,
            };
            Some(Special {
                id: i as u32,
                text: texts[i].clone(),
                only_when_parsing_special,
            })
        })
        .collect();
    let add_space_prefix = gguf
        .get_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    Ok(Encoder::Spm(Box::new(SpmEncoder::new(
        texts,
        scores,
        specials,
        add_space_prefix,
    ))))
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, ModelError> {
        let model = gguf.get_str("tokenizer.ggml.model")?.unwrap_or("gpt2");
        let spm = match model {
            "gpt2" => false,
            "llama" => true,
            _ => {
                return Err(tok_err(
                    gguf,
                    "tokenizer.ggml.model",
                    format!(
                        "unsupported tokenizer model {model:?} (supported: \"gpt2\" byte-level \
                         BPE, \"llama\" SentencePiece)"
                    ),
                ));
            }
        };
        let texts: Vec<String> = match gguf.get("tokenizer.ggml.tokens") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.to_string().cloned())
                .collect::<Result<_, _>>()
                .map_err(|e| tok_err(gguf, "tokenizer.ggml.tokens", e.to_string()))?,
            _ => {
                return Err(tok_err(
                    gguf,
                    "tokenizer.ggml.tokens",
                    "missing or not an array",
                ));
            }
        };
        let n = texts.len();
        let types: Vec<i32> = match gguf.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.to_i32()
                        .or_else(|_| v.to_u32().map(|x| x as i32))
                        .unwrap_or(1)
                })
                .collect(),
            _ => vec![token_type::NORMAL; n],
        };
        if types.len() != n {
            return Err(tok_err(
                gguf,
                "tokenizer.ggml.token_type",
                format!("{} entries for {n} tokens", types.len()),
            ));
        }
        // llama.cpp's defaults for a SentencePiece vocabulary without the keys.
        let (bos_default, eos_default) = if spm {
            (Some(1), Some(2))
        } else {
            (None, None)
        };
        let id = |key: &str, default: Option<usize>| -> Result<Option<u32>, ModelError> {
            Ok(gguf
                .get_usize(key)?
                .or(default)
                .map(|x| x as u32)
                .filter(|&x| (x as usize) < n))
        };
        let bos = id("tokenizer.ggml.bos_token_id", bos_default)?;
        let eos = id("tokenizer.ggml.eos_token_id", eos_default)?;
        let (encoder, pre, family_adds_bos) = if spm {
            let encoder = spm_encoder(gguf, &texts, &types)?;
            (encoder, "spm".to_string(), true)
        } else {
            let pre_name = gguf.get_str("tokenizer.ggml.pre")?;
            let family = PreTokenizer::from_gguf(pre_name)
                .map_err(|e| tok_err(gguf, "tokenizer.ggml.pre", e))?;
            let encoder = bpe_encoder(gguf, &texts, &types, &family)?;
            let pre = pre_name.unwrap_or("default").to_string();
            (encoder, pre, family.adds_bos())
        };
        let add_bos = gguf
            .get_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(family_adds_bos);

        let mut eog: Vec<u32> = Vec::new();
        eog.extend(eos);
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            eog.extend(id(key, None)?);
        }
        for (i, t) in texts.iter().enumerate() {
            if EOG_TEXTS.contains(&t.as_str())
                && matches!(types[i], token_type::CONTROL | token_type::USER_DEFINED)
            {
                eog.push(i as u32);
            }
        }
        eog.sort_unstable();
        eog.dedup();

        let b2u = bytes_to_unicode();
        let mut u2b = std::collections::HashMap::with_capacity(256);
        for (b, c) in b2u.iter().enumerate() {
            u2b.insert(*c, b as u8);
        }
        let vocab_info = texts
            .iter()
            .zip(&types)
            .enumerate()
            .map(|(i, (t, &ty))| {
                let mut attrs = match ty {
                    token_type::CONTROL => attr::CONTROL,
                    token_type::BYTE => attr::BYTE,
                    token_type::UNUSED | token_type::UNKNOWN => attr::UNUSED,
                    token_type::USER_DEFINED => attr::USER_DEFINED,
                    _ => 0,
                };
                if eog.contains(&(i as u32)) {
                    attrs |= attr::END_OF_GENERATION;
                }
                let bytes = match ty {
                    token_type::CONTROL | token_type::USER_DEFINED => t.as_bytes().to_vec(),
                    token_type::UNUSED => Vec::new(),
                    token_type::BYTE => parse_byte_token(t)
                        .map(|b| vec![b])
                        .unwrap_or_else(|| t.as_bytes().to_vec()),
                    // SentencePiece's `<unk>` is printed as its text (and
                    // skipped as a control token when decoding without
                    // special tokens), as llama.cpp's `token_to_piece`.
                    token_type::UNKNOWN if spm => t.as_bytes().to_vec(),
                    _ if spm => t.replace('\u{2581}', " ").into_bytes(),
                    _ => t
                        .chars()
                        .flat_map(|c| {
                            u2b.get(&c)
                                .copied()
                                .map(|b| vec![b])
                                .unwrap_or_else(|| c.to_string().into_bytes())
                        })
                        .collect(),
                };
                TokenInfo { bytes, attrs }
            })
            .collect();
        let control_texts = match &encoder {
            Encoder::Spm(e) => e.parsed_special_texts().map(String::from).collect(),
            Encoder::Bpe(_) => (0..n)
                .filter(|&i| types[i] == token_type::CONTROL && !texts[i].is_empty())
                .map(|i| texts[i].clone())
                .collect(),
        };
        Ok(Tokenizer {
            encoder,
            control_texts,
            vocab: vocab_info,
            texts,
            bos,
            eos,
            add_bos,
            eog,
            pre,
        })
    }

    /// Token ids of `text`. `add_bos`: prepend BOS when the model asks for it
    /// (`tokenizer.ggml.add_bos_token`); `parse_special`: control tokens
    /// written in the text become their ids (otherwise they are plain text).
    pub fn encode(
        &self,
        text: &str,
        add_bos: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, ModelError> {
        self.encode_parts(&[(text, parse_special)], add_bos)
    }

    /// Token ids of the concatenation of `parts`, each `(text,
    /// parse_special)`: a prompt whose markup is parsed for special tokens
    /// and whose content is not. SentencePiece tokenizes the text between
    /// special tokens as one, whichever parts it came from (so content
    /// without special-token text gives the ids of the whole text
    /// tokenized at once); BPE tokenizes each part on its own.
    pub fn encode_parts(
        &self,
        parts: &[(&str, bool)],
        add_bos: bool,
    ) -> Result<Vec<u32>, ModelError> {
        let len: usize = parts.iter().map(|(t, _)| t.len()).sum();
        let mut ids = Vec::with_capacity(len / 3 + 2);
        if add_bos && self.add_bos {
            ids.extend(self.bos);
        }
        match &self.encoder {
            Encoder::Bpe(bpe) => {
                for &(text, parse_special) in parts {
                    let tk = if parse_special {
                        &bpe.with_special
                    } else {
                        &bpe.plain
                    };
                    let enc = tk.encode_fast(text, false).map_err(|e| {
                        ModelError::Tokenizer(format!("encoding {} bytes: {e}", text.len()))
                    })?;
                    ids.extend_from_slice(enc.get_ids());
                }
            }
            Encoder::Spm(spm) => {
                let frags = parts
                    .iter()
                    .flat_map(|&(text, parse_special)| spm.partition(text, parse_special));
                spm.encode_fragments(frags, &mut ids)
                    .map_err(ModelError::Tokenizer)?;
            }
        }
        Ok(ids)
    }

    /// Whether `text` holds a control token's text (which special-token
    /// parsing would turn into that token).
    pub fn has_control_text(&self, text: &str) -> bool {
        self.control_texts.iter().any(|c| text.contains(c.as_str()))
    }

    /// The raw bytes token `id` stands for (control tokens: their text;
    /// unknown ids: empty).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.vocab
            .get(id as usize)
            .map(|t| t.bytes.as_slice())
            .unwrap_or(&[])
    }

    /// The token's string as stored in the GGUF (byte-level encoded).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(|s| s.as_str())
    }

    /// The id of an exact token string.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.texts.iter().position(|t| t == text).map(|i| i as u32)
    }

    /// Decodes ids into text (lossy UTF-8; control and unknown tokens
    /// skipped unless `special`).
    pub fn decode(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if let Some(t) = self.vocab.get(id as usize) {
                if t.attrs & (attr::CONTROL | attr::UNUSED) != 0 && !special {
                    continue;
                }
                bytes.extend_from_slice(&t.bytes);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    pub fn n_vocab(&self) -> usize {
        self.vocab.len()
    }
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    /// Whether the model wants BOS prepended (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// End-of-generation ids (sorted).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }
    /// `tokenizer.ggml.pre`.
    pub fn pre_tokenizer(&self) -> &str {
        &self.pre
    }
    /// Per token id its bytes and [`attr`] flags (for sampler plugins).
    pub fn vocabulary(&self) -> &[TokenInfo] {
        &self.vocab
    }
}

fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}
