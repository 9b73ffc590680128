//! The tokenizer, built from the GGUF metadata so that token ids equal llama.cpp's.
//!
//! BPE runs through the `tokenizers` crate.
//!
//! Supported (`tokenizer.ggml.model`):
//! - `"gpt2"`: byte-level BPE (never a prefix space) with the pre-tokenizer
//!   family llama.cpp picks for `tokenizer.ggml.pre` (`pre_tokenizer`:
//!   default, GPT-2, SmolLM, Qwen2 and Llama 3 — whose whole-word vocabulary
//!   hits skip the merges, as llama.cpp's `ignore_merges`); another name is
//!   a load error naming it. Control and user-defined tokens (from
//!   `tokenizer.ggml.token_type`) are registered as added tokens, so
//!   `<|im_start|>` written in a raw prompt is one token when special
//!   parsing is on (as llama-server does for prompts).
//! - `"llama"`: SentencePiece-style merges by `tokenizer.ggml.scores` with
//!   byte fallback, as llama.cpp runs them (`spm`): Llama 1 and 2,
//!   Mistral v0.1–v0.3.
//!
//! Another model is a load error naming the key and value.
//!
//! Decoding: [`Tokenizer::token_bytes`] gives a token's raw bytes (which may
//! be part of a UTF-8 character; see
//! [`Utf8Streamer`](super::streamer::Utf8Streamer)): byte-level
//! for BPE, `▁` as a space and `<0xXX>` as its byte for SentencePiece, as
//! llama.cpp's `token_to_piece`.

#![forbid(unsafe_code)]

use super::fast_split::FastSplit;
use super::pre_tokenizer::PreTokenizer;
use super::spm::{Special, SpmEncoder};
use super::vocab::{TokenInfo, attr, token_infos, token_type};
use crate::error::ModelError;
use crate::gguf::GgufFile;
use candle_core::quantized::gguf_file::Value;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::{AddedToken, Model as _};

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
    /// The texts of `with_special`'s and `plain`'s added tokens.
    special_texts: Vec<String>,
    plain_texts: Vec<String>,
    /// The family's pieces without `tokenizers`' pre-tokenizer, where the
    /// family has such a splitter ([`FastSplit`]): used for a text that
    /// holds no added token, where the two pipelines agree.
    fast: Option<FastSplit>,
}

impl BpeEncoder {
    /// `text`'s ids with special parsing on or off, appended to `ids`.
    fn encode(&self, text: &str, parse_special: bool, ids: &mut Vec<u32>) -> Result<(), String> {
        let (tk, added) = if parse_special {
            (&self.with_special, &self.special_texts)
        } else {
            (&self.plain, &self.plain_texts)
        };
        if let Some(fast) = &self.fast
            && !added.iter().any(|a| text.contains(a.as_str()))
        {
            let model = tk.get_model();
            return fast.for_each(text, |piece| {
                let tokens = model.tokenize(piece).map_err(|e| e.to_string())?;
                ids.extend(tokens.iter().map(|t| t.id));
                Ok(())
            });
        }
        let enc = tk.encode_fast(text, false).map_err(|e| e.to_string())?;
        ids.extend_from_slice(enc.get_ids());
        Ok(())
    }
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
    let control = added(token_type::CONTROL);
    let contents = |t: &[AddedToken]| t.iter().map(|a| a.content.clone()).collect::<Vec<_>>();
    let plain_texts = contents(&user);
    let mut special_texts = plain_texts.clone();
    special_texts.extend(contents(&control));
    let add = |tk: &mut tokenizers::Tokenizer, tokens: Vec<AddedToken>| {
        tk.add_special_tokens(tokens)
            .map(|_| ())
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    };
    add(&mut plain, user.clone())?;
    add(&mut with_special, user)?;
    add(&mut with_special, control)?;
    Ok(Encoder::Bpe(Box::new(BpeEncoder {
        with_special,
        plain,
        special_texts,
        plain_texts,
        fast: FastSplit::for_family(*family),
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

/// Whether `tokenizer.ggml.model` names a SentencePiece vocabulary
/// (`"llama"`) rather than byte-level BPE (`"gpt2"`, the default); another
/// model is an error naming it.
fn is_spm(gguf: &GgufFile) -> Result<bool, ModelError> {
    let model = gguf.get_str("tokenizer.ggml.model")?.unwrap_or("gpt2");
    match model {
        "gpt2" => Ok(false),
        "llama" => Ok(true),
        _ => Err(tok_err(
            gguf,
            "tokenizer.ggml.model",
            format!(
                "unsupported tokenizer model {model:?} (supported: \"gpt2\" byte-level \
                 BPE, \"llama\" SentencePiece)"
            ),
        )),
    }
}

/// Every token's text (`tokenizer.ggml.tokens`).
fn token_texts(gguf: &GgufFile) -> Result<Vec<String>, ModelError> {
    match gguf.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<Result<_, _>>()
            .map_err(|e| tok_err(gguf, "tokenizer.ggml.tokens", e.to_string())),
        _ => Err(tok_err(
            gguf,
            "tokenizer.ggml.tokens",
            "missing or not an array",
        )),
    }
}

/// Every token's type (`tokenizer.ggml.token_type`; all normal without the
/// key), one per token of the `n`.
fn token_types(gguf: &GgufFile, n: usize) -> Result<Vec<i32>, ModelError> {
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
    Ok(types)
}

/// The token id under `key` (else `default`), when inside the `n` tokens.
fn token_id(
    gguf: &GgufFile,
    key: &str,
    default: Option<usize>,
    n: usize,
) -> Result<Option<u32>, ModelError> {
    Ok(gguf
        .get_usize(key)?
        .or(default)
        .map(|x| x as u32)
        .filter(|&x| (x as usize) < n))
}

/// The end-of-generation ids, sorted: eos, eot and eom, and every control or
/// user-defined token whose text llama.cpp treats as one ([`EOG_TEXTS`]).
fn eog_ids(
    gguf: &GgufFile,
    eos: Option<u32>,
    texts: &[String],
    types: &[i32],
) -> Result<Vec<u32>, ModelError> {
    let n = texts.len();
    let mut eog: Vec<u32> = Vec::new();
    eog.extend(eos);
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        eog.extend(token_id(gguf, key, None, n)?);
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
    Ok(eog)
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, ModelError> {
        let spm = is_spm(gguf)?;
        let texts = token_texts(gguf)?;
        let types = token_types(gguf, texts.len())?;
        let n = texts.len();
        // llama.cpp's defaults for a SentencePiece vocabulary without the keys.
        let (bos_default, eos_default) = if spm {
            (Some(1), Some(2))
        } else {
            (None, None)
        };
        let bos = token_id(gguf, "tokenizer.ggml.bos_token_id", bos_default, n)?;
        let eos = token_id(gguf, "tokenizer.ggml.eos_token_id", eos_default, n)?;
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
        let eog = eog_ids(gguf, eos, &texts, &types)?;
        let vocab_info = token_infos(&texts, &types, &eog, spm);
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
                    bpe.encode(text, parse_special, &mut ids).map_err(|e| {
                        ModelError::Tokenizer(format!("encoding {} bytes: {e}", text.len()))
                    })?;
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
