//! Chat prompts: the model's chat template rendered with minijinja.
//!
//! Chat prompts: renders the model's `tokenizer.chat_template` (Jinja) with
//! minijinja, or ChatML when the model has no template.
//!
//! The template sees `messages` (list of `{role, content}`),
//! `add_generation_prompt = true`, `bos_token`, `eos_token`, and a
//! `raise_exception(msg)` function as in Hugging Face's renderer.

#![forbid(unsafe_code)]

use crate::error::ModelError;
use serde::{Deserialize, Serialize};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    source: Option<String>,
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
}

const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        msg,
    ))
}

impl ChatTemplate {
    /// Compiles `source` (the model's template), or ChatML when `None`.
    pub fn new(source: Option<&str>, bos: &str, eos: &str) -> Result<Self, ModelError> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(false);
        env.set_lstrip_blocks(false);
        env.add_function("raise_exception", raise_exception);
        let src = source.unwrap_or(CHATML).to_string();
        env.add_template_owned("chat", src)
            .map_err(|e| ModelError::ChatTemplate(format!("compiling: {e:#}")))?;
        Ok(ChatTemplate {
            source: source.map(str::to_string),
            env,
            bos: bos.into(),
            eos: eos.into(),
        })
    }

    /// Whether this is the model's own template (false: the ChatML fallback).
    pub fn is_model_template(&self) -> bool {
        self.source.is_some()
    }

    /// Renders `messages` with `add_generation_prompt = true`.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, ModelError> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| ModelError::ChatTemplate(format!("rendering: {e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_fallback() {
        let t = ChatTemplate::new(None, "", "").unwrap();
        let s = t.render(&[ChatMessage::new("user", "Hi")]).unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn template_error_is_reported() {
        let t = ChatTemplate::new(Some("{{ raise_exception('no system role') }}"), "", "").unwrap();
        let e = t.render(&[]).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
        assert!(ChatTemplate::new(Some("{% for %}"), "", "").is_err());
    }
}
