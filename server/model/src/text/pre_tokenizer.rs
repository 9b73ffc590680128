//! The pre-tokenizers of llama.cpp's byte-level BPE vocabularies.
//!
//! The pre-tokenizers of llama.cpp's byte-level BPE vocabularies, chosen by
//! `tokenizer.ggml.pre` exactly as llama.cpp chooses them
//! (`llama_vocab::impl::load` and `llm_tokenizer_bpe::llm_tokenizer_bpe` in
//! `src/llama-vocab.cpp`): each family's split regexes, applied in order
//! (each splits the pieces the previous one left, matches and gaps alike),
//! then GPT-2's byte-to-unicode mapping. A name llama.cpp does not know is
//! refused, as llama.cpp refuses it; a known family samplerd does not build
//! is refused naming the ones it does.

#![forbid(unsafe_code)]

use tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};

/// GPT-2's regex (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_GPT2`, and the second
/// split of the default and SmolLM families).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Qwen2's (`LLAMA_VOCAB_PRE_TYPE_QWEN2`): digits one by one.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's (`LLAMA_VOCAB_PRE_TYPE_LLAMA3`): digits in groups of up to three.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's default family (no `tokenizer.ggml.pre`, or `"default"`):
/// four splits in turn.
const DEFAULT: [&str; 4] = [
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
];

/// A pre-tokenizer family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    Default,
    Gpt2,
    Smollm,
    Qwen2,
    Llama3,
}

/// `tokenizer.ggml.pre` values per family, as llama.cpp lists them.
const NAMES: &[(PreTokenizer, &[&str])] = &[
    (PreTokenizer::Default, &["default"]),
    (
        PreTokenizer::Gpt2,
        &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "exaone4",
        ],
    ),
    (PreTokenizer::Smollm, &["smollm"]),
    (
        PreTokenizer::Qwen2,
        &["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"],
    ),
    (
        PreTokenizer::Llama3,
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
    ),
];

impl PreTokenizer {
    /// The family of `tokenizer.ggml.pre` (`None`: the key is absent, which
    /// llama.cpp reads as `"default"`), or an error message naming the value
    /// and the supported names.
    pub fn from_gguf(pre: Option<&str>) -> Result<Self, String> {
        let name = pre.unwrap_or("default");
        NAMES
            .iter()
            .find(|(_, names)| names.contains(&name))
            .map(|&(family, _)| family)
            .ok_or_else(|| {
                let supported: Vec<&str> =
                    NAMES.iter().flat_map(|(_, n)| n.iter().copied()).collect();
                format!(
                    "pre-tokenizer {name:?} is not supported (supported: {})",
                    supported.join(", ")
                )
            })
    }

    /// Whether a pre-token that is itself in the vocabulary is emitted whole
    /// rather than merged up (llama.cpp's `ignore_merges`).
    pub fn ignore_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Whether BOS is added when the GGUF has no `tokenizer.ggml.add_bos_token`.
    pub fn adds_bos(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// The `tokenizers` pre-tokenizer: the family's splits, then the
    /// byte-level mapping (which does no splitting of its own).
    pub fn build(self) -> Result<PreTokenizerWrapper, String> {
        let regexes: &[&str] = match self {
            PreTokenizer::Default => &DEFAULT,
            PreTokenizer::Gpt2 => &[GPT2],
            PreTokenizer::Smollm => &[r"\p{N}", GPT2],
            PreTokenizer::Qwen2 => &[QWEN2],
            PreTokenizer::Llama3 => &[LLAMA3],
        };
        let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(regexes.len() + 1);
        for r in regexes {
            let split = Split::new(
                SplitPattern::Regex((*r).into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| format!("{self:?} regex {r:?}: {e}"))?;
            steps.push(split.into());
        }
        steps.push(ByteLevel::new(false, false, false).into());
        Ok(Sequence::new(steps).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _};

    fn pieces(p: PreTokenizer, text: &str) -> Vec<String> {
        let mut s = PreTokenizedString::from(text);
        p.build().unwrap().pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_string())
            .collect()
    }

    #[test]
    fn names_map_to_llama_cpp_families_and_unknown_names_are_refused() {
        assert_eq!(PreTokenizer::from_gguf(None), Ok(PreTokenizer::Default));
        assert_eq!(
            PreTokenizer::from_gguf(Some("llama-bpe")),
            Ok(PreTokenizer::Llama3)
        );
        assert_eq!(
            PreTokenizer::from_gguf(Some("qwen2")),
            Ok(PreTokenizer::Qwen2)
        );
        assert_eq!(
            PreTokenizer::from_gguf(Some("gpt-2")),
            Ok(PreTokenizer::Gpt2)
        );
        let e = PreTokenizer::from_gguf(Some("tekken")).unwrap_err();
        assert!(e.contains("\"tekken\"") && e.contains("llama-bpe"), "{e}");
    }

    #[test]
    fn digits_group_as_each_family_groups_them() {
        // Byte-level mapped pieces: 'Ġ' is a space.
        assert_eq!(pieces(PreTokenizer::Llama3, "1234567"), ["123", "456", "7"]);
        assert_eq!(pieces(PreTokenizer::Qwen2, "123"), ["1", "2", "3"]);
        assert_eq!(pieces(PreTokenizer::Gpt2, "x 1234"), ["x", "Ġ1234"]);
        // The default family splits runs of digits in threes after the rest.
        assert_eq!(pieces(PreTokenizer::Default, "12345"), ["123", "45"]);
        assert_eq!(pieces(PreTokenizer::Llama3, "I'LL go"), ["I", "'LL", "Ġgo"]);
    }
}
