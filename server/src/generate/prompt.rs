//! A Generate request's prompt as tokens: the chat template applied (or the
//! text as it is), tokenized, and held to `generate.max_prompt_tokens` and
//! the context, each refusal naming the field and the limit.

#![forbid(unsafe_code)]

use samplerd_model::Model;
use samplerd_sampling::echo;

use super::config::GenerateConfig;
use super::generator::Prompt;
use crate::request::errors::RequestError;

/// The prompt's tokens (see [`ModelHost::prompt_tokens`]).
pub(super) fn prompt_tokens(
    model: &Model,
    cfg: &GenerateConfig,
    prompt: &Prompt,
) -> Result<Vec<u32>, RequestError> {
    let tok = model.tokenizer();
    let tokens = match prompt {
        Prompt::Text(text) => tok.encode(text, tok.add_bos(), true).map_err(|e| {
            RequestError::invalid("prompt", echo::foreign(&e.to_string()).into_owned())
        })?,
        // The template's own error may quote a message (`raise_exception`).
        Prompt::Chat(msgs) => model
            .chat_tokens(msgs, cfg.parse_special_in_content)
            .map_err(|e| {
                RequestError::invalid("messages", echo::foreign(&e.to_string()).into_owned())
            })?,
    };
    if tokens.is_empty() {
        return Err(RequestError::invalid("prompt", "tokenizes to no tokens"));
    }
    if tokens.len() > cfg.max_prompt_tokens {
        return Err(RequestError::limit(
            "prompt",
            "generate.max_prompt_tokens",
            format!(
                "{} tokens exceed the limit of {} (generate.max_prompt_tokens)",
                tokens.len(),
                cfg.max_prompt_tokens
            ),
        ));
    }
    if tokens.len() >= model.n_ctx() {
        return Err(RequestError::limit(
            "prompt",
            "generate.n_ctx",
            format!(
                "{} tokens do not fit the context of {} (leave room for at least one new token)",
                tokens.len(),
                model.n_ctx()
            ),
        ));
    }
    Ok(tokens)
}
