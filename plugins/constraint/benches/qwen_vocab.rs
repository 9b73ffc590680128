//! Qwen's real BPE vocabulary, laid out as Qwen2's 151,936 logits: the
//! 151,643 BPE tokens of `qwen.tiktoken` (`scripts/fetch-model.sh qwen-vocab`;
//! each line a token's bytes in base64 and its id), Qwen2.5's 22 added
//! tokens, and unused padding up to the logits width. `<|endoftext|>` and
//! `<|im_end|>` end generation, as llama.cpp's loader marks them for Qwen2.

use std::io;

use base64::Engine as _;
use samplerd_plugin_sdk::abi::{SD_TOKEN_CONTROL, SD_TOKEN_EOG, SD_TOKEN_UNUSED};

/// Qwen2's logits width (its embedding rows, padded past the tokens).
pub const N_LOGITS: usize = 151_936;

/// Qwen2.5's added tokens, from id 151,643 on (`<tool_call>` and
/// `</tool_call>` are plain text to a grammar; the rest are control).
const ADDED: [&str; 22] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
];

/// Reads `path` (a `qwen.tiktoken`): `(bytes, attributes)` per token id.
pub fn read(path: &std::path::Path) -> io::Result<Vec<(Vec<u8>, u32)>> {
    let text = std::fs::read_to_string(path)?;
    let bad = |line: usize, what: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: line {line}: {what}", path.display()),
        )
    };
    let mut vocab = Vec::with_capacity(N_LOGITS);
    for (i, line) in text.lines().enumerate() {
        let (b64, id) = line
            .split_once(' ')
            .ok_or_else(|| bad(i + 1, "no `base64 id` pair"))?;
        if id.parse::<usize>().ok() != Some(vocab.len()) {
            return Err(bad(i + 1, "ids are not 0, 1, 2, … in order"));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| bad(i + 1, &e.to_string()))?;
        vocab.push((bytes, 0));
    }
    for name in ADDED {
        let attr = match name {
            "<|endoftext|>" | "<|im_end|>" => SD_TOKEN_EOG | SD_TOKEN_CONTROL,
            "<tool_call>" | "</tool_call>" => 0,
            _ => SD_TOKEN_CONTROL,
        };
        vocab.push((name.as_bytes().to_vec(), attr));
    }
    while vocab.len() < N_LOGITS {
        vocab.push((
            format!("[PAD{}]", vocab.len()).into_bytes(),
            SD_TOKEN_UNUSED,
        ));
    }
    Ok(vocab)
}
