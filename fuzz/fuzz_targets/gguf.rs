//! Fuzzes GGUF loading (`samplerd_model::gguf`): arbitrary bytes written to
//! a file, then everything `Model::load` reads before the forward pass —
//! header and metadata, hyper-parameters, the tokenizer, the chat template
//! and every weight tensor (shapes, types, bounds, dequantisation).
//!
//! Oracle: a malformed file is a `ModelError`, never a panic, an abort or an
//! allocation the file's size does not justify.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use samplerd_model::gguf::{GgufFile, Weights};
use samplerd_model::{ChatMessage, ChatTemplate, Tokenizer};

/// One scratch file per fuzzing process (tmpfs when available).
fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("samplerd-fuzz-gguf-{}", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let path = scratch();
    std::fs::write(path, data).expect("write the scratch file");
    let Ok(mut g) = GgufFile::open(path) else {
        return;
    };
    let _ = g.arch();
    let tokenizer = Tokenizer::from_gguf(&g);
    if let Ok(t) = &tokenizer {
        let _ = t.encode("Hello, world! 你好 <|im_start|>", t.add_bos(), true);
        let text = |id: Option<u32>| id.and_then(|i| t.token_text(i)).unwrap_or("").to_string();
        if let Ok(Some(src)) = g.get_str("tokenizer.chat_template")
            && let Ok(tpl) = ChatTemplate::new(Some(src), &text(t.bos()), &text(t.eos()))
        {
            let _ = tpl.render(&[ChatMessage::new("user", "hi")]);
        }
    }
    let Ok(config) = g.config() else { return };
    let _ = Weights::load(&mut g, &config);
});
