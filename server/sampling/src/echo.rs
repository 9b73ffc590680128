//! Bounded echoes of client values, for error messages and logs.
//!
//! An error names the value it refuses, but a value can be as long as the
//! message limit lets it be (64 MiB by default, and 60 MB of one repeated
//! byte travel as 58 KB of gzip). Echoed whole, a status carried it about
//! four times (`grpc-message`, and `grpc-status-details-bin`'s
//! `Status.message`, `BadRequest` description and `ResourceInfo` name),
//! built in memory past every size limit: 229 MB of trailers and 750 MB
//! more resident memory for one such request. So every echo goes through
//! here: [`quote`] (and [`quote_list`]) for a message, which keeps at most
//! [`MAX_ECHO_BYTES`] of the value and states its full length; [`excerpt`]
//! for a detail field that holds a bare name; [`digest`] for a log line at
//! INFO, which carries only the length and a short hash of the content.

use std::borrow::Cow;
use std::fmt::{self, Display, Write as _};

use sha2::{Digest as _, Sha256};

/// The most bytes of one client value an error message or detail quotes
/// (escapes included). Enough to recognise a name or the start of a
/// grammar; the full length is stated beside it.
pub const MAX_ECHO_BYTES: usize = 200;

/// `s` as an error message quotes it: escaped and in double quotes like
/// `{:?}`; a value whose quote would pass [`MAX_ECHO_BYTES`] is cut there
/// at a character boundary, with `…` and its full length:
/// `"vvvv…" (60000000 bytes)`.
pub fn quote(s: &str) -> Quoted<'_> {
    Quoted(s)
}

/// See [`quote`].
#[derive(Clone, Copy, Debug)]
pub struct Quoted<'a>(&'a str);

impl Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_quoted(f, self.0, self.0.len())
    }
}

/// `kept`, the first bytes of a value of `len` bytes, quoted as [`quote`]
/// quotes the value.
fn write_quoted(f: &mut fmt::Formatter<'_>, kept: &str, len: usize) -> fmt::Result {
    let (escaped, whole) = escaped_prefix(kept, MAX_ECHO_BYTES);
    if whole && kept.len() == len {
        write!(f, "\"{escaped}\"")
    } else {
        write!(f, "\"{escaped}…\" ({len} bytes)")
    }
}

/// A client value kept in an error for later: at most [`MAX_ECHO_BYTES`]
/// of it and its full length (so an error holds no copy of a 60 MB name).
/// Displays as [`quote`] displays the value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Echo {
    kept: String,
    len: usize,
}

impl Echo {
    pub fn new(value: &str) -> Self {
        Echo {
            kept: cut(value, MAX_ECHO_BYTES).to_owned(),
            len: value.len(),
        }
    }

    /// The value, or its first [`MAX_ECHO_BYTES`] and `…` (a bare name for
    /// a detail field such as `ResourceInfo.resource_name`).
    pub fn excerpt(&self) -> Cow<'_, str> {
        if self.kept.len() == self.len {
            Cow::Borrowed(&self.kept)
        } else {
            Cow::Owned(format!("{}…", self.kept))
        }
    }

    /// The value's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Display for Echo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_quoted(f, &self.kept, self.len)
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends at a
/// character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `s` escaped as `{:?}` escapes a string (without the quotes), up to the
/// last character whose escape still fits in `max` bytes; whether that
/// was all of `s`.
fn escaped_prefix(s: &str, max: usize) -> (String, bool) {
    let mut out = String::with_capacity(s.len().min(max));
    for c in s.chars() {
        let before = out.len();
        // `escape_debug` is what `{:?}` writes for a character inside a
        // string; a `"` is escaped here by hand (`{:?}` of a str does too).
        if c == '"' {
            out.push_str("\\\"");
        } else {
            let _ = write!(out, "{}", c.escape_debug());
        }
        if out.len() > max {
            out.truncate(before);
            return (out, false);
        }
    }
    (out, true)
}

/// A list of strings as an error message quotes it:
/// `["a", "b"]`, or, past [`MAX_ECHO_BYTES`] in all, the items that fit,
/// `…` and the list's size: `["a", "b", …] (70000 strings, 910000 bytes)`.
pub fn quote_list<S: AsRef<str>>(items: &[S]) -> QuotedList<'_, S> {
    QuotedList(items)
}

/// See [`quote_list`].
#[derive(Clone, Copy, Debug)]
pub struct QuotedList<'a, S>(&'a [S]);

impl<S: AsRef<str>> Display for QuotedList<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::from("[");
        let mut budget = MAX_ECHO_BYTES;
        for (i, item) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            let (escaped, whole) =
                escaped_prefix(item.as_ref(), budget.saturating_sub(sep.len() + 2));
            if !whole {
                // The part of this item that fits, then the list's size.
                let bytes: usize = self.0.iter().map(|s| s.as_ref().len()).sum();
                let n = self.0.len();
                let plural = if n == 1 { "" } else { "s" };
                out.push_str(sep);
                if escaped.is_empty() {
                    out.push('…');
                } else {
                    let _ = write!(out, "\"{escaped}…\"");
                }
                return write!(f, "{out}] ({n} string{plural}, {bytes} bytes)");
            }
            let _ = write!(out, "{sep}\"{escaped}\"");
            budget = budget.saturating_sub(sep.len() + escaped.len() + 2);
        }
        out.push(']');
        f.write_str(&out)
    }
}

/// The most bytes of a message from elsewhere that is passed on to the
/// client — a chat template's or the tokenizer's error, which may quote a
/// client value — as the plugin ABI bounds a stage's message
/// (`SD_ERROR_MESSAGE_LEN`, 511 bytes and a NUL).
pub const MAX_FOREIGN_BYTES: usize = 512;

/// A message from elsewhere (see [`MAX_FOREIGN_BYTES`]), cut to that bound
/// with `…`.
pub fn foreign(text: &str) -> Cow<'_, str> {
    excerpt(text, MAX_FOREIGN_BYTES)
}

/// At most `max` bytes of `s`, cut at a character boundary, with `…` when
/// cut (for a detail field that holds a bare name, such as
/// `ResourceInfo.resource_name`).
pub fn excerpt(s: &str, max: usize) -> Cow<'_, str> {
    let kept = cut(s, max);
    if kept.len() == s.len() {
        Cow::Borrowed(s)
    } else {
        Cow::Owned(format!("{kept}…"))
    }
}

/// Client content as an INFO log line carries it: its length and a short
/// hash, never the content itself — `<1048576 bytes #3f2a9c01>`. The hash
/// (the first 4 bytes of SHA-256) tells two requests' grammars or prompts
/// apart, and matches the content a client reports, without the content
/// reaching the log pipeline.
pub fn digest(content: &[u8]) -> Digest {
    let hash = Sha256::digest(content);
    Digest {
        len: content.len(),
        hash: [hash[0], hash[1], hash[2], hash[3]],
    }
}

/// See [`digest`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Digest {
    len: usize,
    hash: [u8; 4],
}

impl Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d] = self.hash;
        write!(f, "<{} bytes #{a:02x}{b:02x}{c:02x}{d:02x}>", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_value_is_quoted_whole_as_debug_quotes_it() {
        for s in ["", "plain", "tab\there \"quoted\" \\ é 日本", "\u{0}\u{1b}"] {
            assert_eq!(quote(s).to_string(), format!("{s:?}"));
        }
    }

    #[test]
    fn a_long_value_is_cut_and_its_length_stated() {
        let s = "v".repeat(60_000_000);
        let q = quote(&s).to_string();
        assert_eq!(
            q,
            format!("\"{}…\" (60000000 bytes)", "v".repeat(MAX_ECHO_BYTES))
        );
        // Escapes count towards the bound, and a cut never splits a
        // character or an escape.
        let s = "\u{1b}é".repeat(1000);
        let q = quote(&s).to_string();
        let inner = q.strip_prefix('"').unwrap().split("…\"").next().unwrap();
        assert!(inner.len() <= MAX_ECHO_BYTES, "{}", inner.len());
        assert!(inner.ends_with('é'), "{inner}");
        assert!(q.ends_with(&format!("({} bytes)", s.len())), "{q}");
    }

    #[test]
    fn exactly_the_bound_is_whole() {
        let s = "x".repeat(MAX_ECHO_BYTES);
        assert_eq!(quote(&s).to_string(), format!("\"{s}\""));
        let s = "x".repeat(MAX_ECHO_BYTES + 1);
        assert!(quote(&s).to_string().ends_with("(201 bytes)"));
    }

    #[test]
    fn lists_keep_the_items_that_fit() {
        assert_eq!(quote_list(&["a", "\n"]).to_string(), r#"["a", "\n"]"#);
        assert_eq!(quote_list::<&str>(&[]).to_string(), "[]");
        let many: Vec<String> = (0..70_000).map(|i| format!("s{i}")).collect();
        let q = quote_list(&many).to_string();
        assert!(q.starts_with(r#"["s0", "s1", "#), "{q}");
        let bytes: usize = many.iter().map(String::len).sum();
        assert!(
            q.ends_with(&format!("…] (70000 strings, {bytes} bytes)")),
            "{q}"
        );
        assert!(q.len() <= MAX_ECHO_BYTES + 40, "{}", q.len());
        let one = vec!["y".repeat(10_000)];
        let q = quote_list(&one).to_string();
        assert!(q.starts_with("[\"yyy"), "{q}");
        assert!(q.ends_with("y…\"] (1 string, 10000 bytes)"), "{q}");
        assert!(q.len() <= MAX_ECHO_BYTES + 40, "{}", q.len());
    }

    #[test]
    fn an_echo_keeps_the_bound_and_quotes_as_quote_does() {
        for s in ["short".to_string(), "w".repeat(5_000), "é".repeat(150)] {
            let e = Echo::new(&s);
            assert_eq!(e.to_string(), quote(&s).to_string());
            assert_eq!(e.len(), s.len());
            assert_eq!(e.excerpt(), excerpt(&s, MAX_ECHO_BYTES));
            assert!(e.kept.len() <= MAX_ECHO_BYTES);
        }
    }

    #[test]
    fn excerpts_cut_at_a_character() {
        assert_eq!(excerpt("name", 10), "name");
        assert_eq!(excerpt("ééé", 3), "é…");
    }

    #[test]
    fn a_digest_is_the_length_and_four_bytes_of_sha256() {
        // SHA-256("abc") = ba7816bf…
        assert_eq!(digest(b"abc").to_string(), "<3 bytes #ba7816bf>");
        assert_ne!(digest(b"abd"), digest(b"abc"));
    }
}
