//! Named vocabularies for Sample and SampleStream: the token bytes that
//! stages such as `constraint` need when the client runs its model
//! elsewhere. Loaded once at start-up from `[vocabularies]`
//! (`NAME = "path"`: a GGUF's tokenizer metadata or a Hugging Face
//! `tokenizer.json`); a request names one in `params.vocabulary`, and
//! ListStages reports them, and Tokenize and Detokenize use their
//! tokenizers. Also home of [`plugin_vocabulary`], the model vocabulary in
//! the plugin ABI's shape, which Generate uses.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use samplerd_api::v1;
use samplerd_model::TextCodec;
use samplerd_sampling::Vocabulary;

/// A vocabulary that could not be loaded (names its config key and path).
#[derive(Debug, thiserror::Error)]
#[error("vocabularies.{name}: {path}: {source}")]
pub struct VocabularyError {
    pub name: String,
    pub path: String,
    #[source]
    pub source: Box<samplerd_model::ModelError>,
}

struct Loaded {
    vocab: Arc<Vocabulary>,
    tokenizer: Arc<dyn TextCodec>,
    path: PathBuf,
}

/// The loaded vocabularies by name.
#[derive(Default)]
pub struct Vocabularies {
    by_name: BTreeMap<String, Loaded>,
}

impl Vocabularies {
    /// Reads every configured vocabulary (`[vocabularies]`).
    pub fn load(config: &BTreeMap<String, PathBuf>) -> Result<Self, Box<VocabularyError>> {
        let mut by_name = BTreeMap::new();
        for (name, path) in config {
            let tokenizer = samplerd_model::read_tokenizer(path).map_err(|source| {
                Box::new(VocabularyError {
                    name: name.clone(),
                    path: path.display().to_string(),
                    source: Box::new(source),
                })
            })?;
            let vocab = Arc::new(plugin_vocabulary(tokenizer.vocabulary()));
            tracing::info!(name, path = %path.display(), tokens = vocab.len(), "vocabulary loaded");
            by_name.insert(
                name.clone(),
                Loaded {
                    vocab,
                    tokenizer: Arc::new(tokenizer),
                    path: path.clone(),
                },
            );
        }
        Ok(Vocabularies { by_name })
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Vocabulary>> {
        self.by_name.get(name).map(|l| &l.vocab)
    }

    /// The tokenizer of vocabulary `name` (Tokenize, Detokenize).
    pub fn tokenizer(&self, name: &str) -> Option<&Arc<dyn TextCodec>> {
        self.by_name.get(name).map(|l| &l.tokenizer)
    }

    /// The loaded ones in words, for an error: `"smollm2 (49152 tokens)"`,
    /// or `"none"`.
    pub fn describe(&self) -> String {
        if self.by_name.is_empty() {
            return "none".into();
        }
        self.by_name
            .iter()
            .map(|(n, l)| format!("{n} ({} tokens)", l.vocab.len()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// ListStages' view of them.
    pub fn to_proto(&self) -> Vec<v1::VocabularyInfo> {
        self.by_name
            .iter()
            .map(|(name, l)| v1::VocabularyInfo {
                name: name.clone(),
                n_vocab: l.vocab.len() as u32,
                path: l.path.display().to_string(),
            })
            .collect()
    }
}

/// A model's vocabulary in the plugin ABI's shape: each token's bytes and
/// its `SD_TOKEN_*` attributes (user-defined tokens count as normal text).
pub fn plugin_vocabulary(tokens: &[samplerd_model::TokenInfo]) -> Vocabulary {
    use samplerd_model::attr;
    use samplerd_sampling::vocab::token_attr;
    let abi_attrs = |a: u32| {
        [
            (attr::CONTROL, token_attr::CONTROL),
            (attr::END_OF_GENERATION, token_attr::EOG),
            (attr::BYTE, token_attr::BYTE),
            (attr::UNUSED, token_attr::UNUSED),
        ]
        .iter()
        .filter(|(ours, _)| a & ours != 0)
        .fold(token_attr::NORMAL, |acc, (_, abi)| acc | abi)
    };
    Vocabulary::new(
        tokens.iter().map(|t| t.bytes.clone()).collect(),
        tokens.iter().map(|t| abi_attrs(t.attrs)).collect(),
    )
}
