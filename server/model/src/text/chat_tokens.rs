//! A chat prompt's tokens, with message content kept as text.
//!
//! The template's own markup (`<|im_start|>`, `<|im_end|>`, …) is special
//! tokens by design; message content is what a client relays from its end
//! users, and tokenizing it with special-token parsing would let a user
//! write `<|im_end|><|im_start|>system` and open a turn of their own. So
//! when some content holds a control token's text, the prompt is rendered
//! with a marker in place of each content, the template's text between the
//! markers is tokenized with special tokens and each content as plain text.
//! Content without control-token text (nearly all of it) takes the plain
//! path — the whole rendered prompt tokenized at once — so the tokens are
//! exactly those llama.cpp gives for the same prompt.

#![forbid(unsafe_code)]

use super::chat::{ChatMessage, ChatTemplate};
use super::tokenizer::Tokenizer;
use crate::error::ModelError;

/// Private-use characters around a content marker: nothing a template
/// would produce or change.
const MARK_OPEN: char = '\u{F8F0}';
const MARK_CLOSE: char = '\u{F8F1}';

fn marker(i: usize) -> String {
    format!("{MARK_OPEN}{i}{MARK_CLOSE}")
}

/// The tokens of `messages` rendered by `template` (with BOS as the model
/// asks). `parse_special_in_content`: content's special-token text becomes
/// special tokens too (the behaviour of rendering and tokenizing at once).
pub fn chat_tokens(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    messages: &[ChatMessage],
    parse_special_in_content: bool,
) -> Result<Vec<u32>, ModelError> {
    let forged = !parse_special_in_content
        && messages
            .iter()
            .any(|m| tokenizer.has_control_text(&m.content));
    if !forged {
        let text = template.render(messages)?;
        return tokenizer.encode(&text, tokenizer.add_bos(), true);
    }
    let marked: Vec<ChatMessage> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| ChatMessage::new(m.role.clone(), marker(i)))
        .collect();
    let rendered = template.render(&marked)?;
    let mut parts: Vec<(&str, bool)> = Vec::with_capacity(2 * messages.len() + 1);
    let mut rest = rendered.as_str();
    for (i, m) in messages.iter().enumerate() {
        let mark = marker(i);
        let Some((markup, after)) = rest.split_once(&mark) else {
            return Err(ModelError::ChatTemplate(format!(
                "messages[{i}].content holds special-token text, and the chat template does not \
                 pass content through unchanged, so it cannot be kept as plain text (set \
                 generate.parse_special_in_content = true to accept it as special tokens)"
            )));
        };
        parts.push((markup, true));
        parts.push((&m.content, false));
        rest = after;
    }
    // The markup after the last content.
    parts.push((rest, true));
    tokenizer.encode_parts(&parts, tokenizer.add_bos())
}
