//! Text: the tokenizer and its pre-tokenizers, vocabularies, the chat template, bytes back to text.

pub mod chat;
pub mod chat_tokens;
pub mod fast_split;
pub mod pre_tokenizer;
mod spm;
pub mod streamer;
pub mod tokenizer;
pub mod vocab;
pub mod vocab_file;

pub use chat::{ChatMessage, ChatTemplate};
pub use chat_tokens::chat_tokens;
pub use streamer::Utf8Streamer;
pub use tokenizer::Tokenizer;
pub use vocab::{TokenInfo, attr};
pub use vocab_file::{FileTokenizer, TextCodec, read_tokenizer, read_vocabulary};
