//! A vocabulary's entries: GGUF token types, attribute flags, and each token's bytes.

#![forbid(unsafe_code)]

/// GGUF token types (`tokenizer.ggml.token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Attribute flags of a vocabulary entry (see [`TokenInfo`]).
pub mod attr {
    /// A control token (`<|im_start|>`, `<|endoftext|>`…): not text.
    pub const CONTROL: u32 = 1;
    /// Ends generation (eos, eot, eom, `<|im_end|>`…).
    pub const END_OF_GENERATION: u32 = 2;
    /// A single raw byte (`<0x0A>`-style tokens).
    pub const BYTE: u32 = 4;
    /// Unused / unknown slot.
    pub const UNUSED: u32 = 8;
    /// User-defined token (matched verbatim in text).
    pub const USER_DEFINED: u32 = 16;
}

/// One vocabulary entry for sampler plugins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenInfo {
    /// The bytes the token stands for (control tokens: their text).
    pub bytes: Vec<u8>,
    /// [`attr`] flags.
    pub attrs: u32,
}

/// Each token's [`TokenInfo`]: its bytes as llama.cpp's `token_to_piece`
/// gives them (byte-level BPE decoded through the GPT-2 byte table, `▁` as a
/// space and `<0xXX>` as its byte for SentencePiece, control and
/// user-defined tokens as their text) and its [`attr`] flags (`eog`: the
/// end-of-generation ids).
pub(crate) fn token_infos(
    texts: &[String],
    types: &[i32],
    eog: &[u32],
    spm: bool,
) -> Vec<TokenInfo> {
    let b2u = bytes_to_unicode();
    let mut u2b = std::collections::HashMap::with_capacity(256);
    for (b, c) in b2u.iter().enumerate() {
        u2b.insert(*c, b as u8);
    }
    texts
        .iter()
        .zip(types)
        .enumerate()
        .map(|(i, (t, &ty))| {
            let mut attrs = match ty {
                token_type::CONTROL => attr::CONTROL,
                token_type::BYTE => attr::BYTE,
                token_type::UNUSED | token_type::UNKNOWN => attr::UNUSED,
                token_type::USER_DEFINED => attr::USER_DEFINED,
                _ => 0,
            };
            if eog.contains(&(i as u32)) {
                attrs |= attr::END_OF_GENERATION;
            }
            let bytes = match ty {
                token_type::CONTROL | token_type::USER_DEFINED => t.as_bytes().to_vec(),
                token_type::UNUSED => Vec::new(),
                token_type::BYTE => parse_byte_token(t)
                    .map(|b| vec![b])
                    .unwrap_or_else(|| t.as_bytes().to_vec()),
                // SentencePiece's `<unk>` is printed as its text (and
                // skipped as a control token when decoding without
                // special tokens), as llama.cpp's `token_to_piece`.
                token_type::UNKNOWN if spm => t.as_bytes().to_vec(),
                _ if spm => t.replace('\u{2581}', " ").into_bytes(),
                _ => t
                    .chars()
                    .flat_map(|c| {
                        u2b.get(&c)
                            .copied()
                            .map(|b| vec![b])
                            .unwrap_or_else(|| c.to_string().into_bytes())
                    })
                    .collect(),
            };
            TokenInfo { bytes, attrs }
        })
        .collect()
}

/// GPT-2's byte-to-character map: the bytes that print as themselves,
/// the rest from U+0100 on in byte order.
pub(crate) fn bytes_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let keep = (b'!' as u32..=b'~' as u32).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        map[b as usize] = if keep {
            char::from_u32(b).unwrap_or('\0')
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
            c
        };
    }
    map
}

fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}
