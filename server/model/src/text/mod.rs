//! Text: the tokenizer and its pre-tokenizers, the chat template, and bytes back to text.

pub mod chat;
pub mod chat_tokens;
pub mod pre_tokenizer;
mod spm;
pub mod streamer;
pub mod tokenizer;
pub mod vocab_file;
