//! llama.cpp GBNF → llguidance Lark.
//!
//! llguidance's Rust crate has no GBNF front end (its converter,
//! `gbnf_to_lark.py`, is Python). This is the same translation in Rust,
//! with the two faults that converter has on llama.cpp's own grammars
//! fixed at the source:
//!
//! - **Escapes.** The Python converter writes `\U0010FFFF` as `\U10FFFF`, an
//!   escape the regex engine rejects, so any grammar with a `\U` escape (and
//!   `\u` ones with leading zeros stripped) fails to compile. Here every
//!   escape is decoded to its character first; literals are re-escaped as
//!   JSON strings (Lark's literal syntax) and character classes are written
//!   with `\x{…}` escapes, which the regex engine accepts for every scalar.
//! - **Greedy terminals.** The converter turns every rule whose body is
//!   all terminals into a Lark TERMINAL, i.e. one greedy lexeme. In
//!   `arithmetic.gbnf` that makes `num ::= [0-9]+ ws` with
//!   `ws ::= [ \t\n]*` one lexeme that swallows the `"\n"` the root rule
//!   needs to end a line, so a line can never end. GBNF is a
//!   character-level grammar without a lexer, so here every GBNF rule stays
//!   a Lark *rule*: only character classes and literals are lexemes and
//!   repetition is the parser's, which keeps GBNF's meaning. The price is
//!   more Earley work per byte than with merged lexemes.
//!
//! Remaining difference: a multi-character literal is one lexeme, and the
//! lexer is greedy across literals that extend each other (`"a" "bc"` vs
//! `"ab"` at the same position); no llama.cpp grammar relies on that.

use std::fmt::Write as _;

/// A GBNF syntax error, with its line and column (1-based).
#[derive(Debug, thiserror::Error)]
#[error("{message} at line {line}, column {column}")]
pub struct GbnfError {
    pub message: String,
    pub line: usize,
    pub column: usize,
}

/// One element of a GBNF rule body.
#[derive(Debug)]
enum Node {
    Literal(String),
    /// `[...]`: negated?, ranges of chars (inclusive).
    Class(bool, Vec<(char, char)>),
    Any,
    Rule(String, usize),
    Seq(Vec<Node>),
    Alt(Vec<Node>),
    Repeat(Box<Node>, u32, Option<u32>),
}

struct Parser<'a> {
    src: &'a str,
    pos: usize,
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

impl<'a> Parser<'a> {
    fn err<T>(&self, at: usize, message: impl Into<String>) -> Result<T, GbnfError> {
        let before = &self.src[..at.min(self.src.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        Err(GbnfError {
            message: message.into(),
            line,
            column,
        })
    }

    fn peek(&self) -> Option<char> {
        self.src[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    /// Spaces, tabs and `#` comments; newlines too when `newlines`.
    fn skip_space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '\r' | '\n' if newlines => self.pos += 1,
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n' && c != '\r') {
                        self.bump();
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<(String, usize), GbnfError> {
        let start = self.pos;
        while self.peek().is_some_and(is_word) {
            self.pos += 1;
        }
        if self.pos == start {
            return self.err(start, "expected a rule name");
        }
        Ok((self.src[start..self.pos].to_string(), start))
    }

    fn hex(&mut self, digits: usize, at: usize) -> Result<char, GbnfError> {
        let s = self.src.get(self.pos..self.pos + digits).unwrap_or("");
        let v = (s.len() == digits && s.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(s, 16).ok())
            .flatten();
        let Some(v) = v else {
            return self.err(at, format!("invalid escape: expected {digits} hex digits"));
        };
        self.pos += digits;
        match char::from_u32(v) {
            Some(c) => Ok(c),
            None => self.err(
                at,
                format!("invalid escape: U+{v:X} is not a Unicode scalar value"),
            ),
        }
    }

    /// One possibly escaped character (llama.cpp's escapes).
    fn char(&mut self) -> Result<char, GbnfError> {
        let at = self.pos;
        match self.bump() {
            None => self.err(at, "unexpected end of grammar"),
            Some('\\') => match self.bump() {
                Some('x') => self.hex(2, at),
                Some('u') => self.hex(4, at),
                Some('U') => self.hex(8, at),
                Some('t') => Ok('\t'),
                Some('r') => Ok('\r'),
                Some('n') => Ok('\n'),
                Some(c @ ('\\' | '"' | '[' | ']' | '-' | '/')) => Ok(c),
                Some(c) => self.err(at, format!("invalid escape \\{c}")),
                None => self.err(at, "unexpected end of grammar in an escape"),
            },
            Some(c) => Ok(c),
        }
    }

    fn literal(&mut self) -> Result<Node, GbnfError> {
        let start = self.pos;
        self.pos += 1; // the opening quote
        let mut s = String::new();
        loop {
            match self.peek() {
                None => return self.err(start, "unterminated string literal"),
                Some('"') => {
                    self.pos += 1;
                    return Ok(Node::Literal(s));
                }
                Some(_) => s.push(self.char()?),
            }
        }
    }

    fn class(&mut self) -> Result<Node, GbnfError> {
        let start = self.pos;
        self.pos += 1; // '['
        let negated = self.peek() == Some('^');
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                None => return self.err(start, "unterminated character class"),
                Some(']') => {
                    self.pos += 1;
                    break;
                }
                Some(_) => {
                    let lo = self.char()?;
                    let mut hi = lo;
                    if self.peek() == Some('-') && !self.src[self.pos + 1..].starts_with(']') {
                        self.pos += 1;
                        let at = self.pos;
                        hi = self.char()?;
                        if hi < lo {
                            return self.err(at, format!("range {lo:?}-{hi:?} is reversed"));
                        }
                    }
                    ranges.push((lo, hi));
                }
            }
        }
        Ok(Node::Class(negated, ranges))
    }

    fn alternatives(&mut self, nested: bool) -> Result<Node, GbnfError> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            self.skip_space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(if alts.len() == 1 {
            alts.pop().expect("one")
        } else {
            Node::Alt(alts)
        })
    }

    fn sequence(&mut self, nested: bool) -> Result<Node, GbnfError> {
        let mut items = Vec::new();
        loop {
            self.skip_space(nested);
            let at = self.pos;
            let node = match self.peek() {
                Some('"') => self.literal()?,
                Some('[') => self.class()?,
                Some('.') => {
                    self.pos += 1;
                    Node::Any
                }
                Some('(') => {
                    self.pos += 1;
                    self.skip_space(true);
                    let inner = self.alternatives(true)?;
                    self.skip_space(true);
                    if self.peek() != Some(')') {
                        return self.err(self.pos, "expected ')'");
                    }
                    self.pos += 1;
                    inner
                }
                Some(c) if is_word(c) => {
                    let (name, at) = self.name()?;
                    Node::Rule(name, at)
                }
                _ => break,
            };
            let node = self.repetition(node, at)?;
            items.push(node);
        }
        self.skip_space(nested);
        Ok(if items.len() == 1 {
            items.pop().expect("one")
        } else {
            Node::Seq(items)
        })
    }

    fn number(&mut self) -> Result<u32, GbnfError> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        match self.src[start..self.pos].parse() {
            Ok(n) => Ok(n),
            Err(_) => self.err(start, "expected a repetition count"),
        }
    }

    fn repetition(&mut self, node: Node, at: usize) -> Result<Node, GbnfError> {
        let (min, max) = match self.peek() {
            Some('*') => (0, None),
            Some('+') => (1, None),
            Some('?') => (0, Some(1)),
            Some('{') => {
                self.pos += 1;
                self.skip_space(true);
                let min = self.number()?;
                self.skip_space(true);
                let max = match self.bump() {
                    Some('}') => Some(min),
                    Some(',') => {
                        self.skip_space(true);
                        let max = if self.peek().is_some_and(|c| c.is_ascii_digit()) {
                            Some(self.number()?)
                        } else {
                            None
                        };
                        self.skip_space(true);
                        if self.bump() != Some('}') {
                            return self.err(self.pos, "expected '}'");
                        }
                        max
                    }
                    _ => return self.err(self.pos, "expected ',' or '}'"),
                };
                if max.is_some_and(|m| m < min) {
                    return self.err(
                        at,
                        format!("repetition {{{min},{}}} has max < min", max.unwrap_or(0)),
                    );
                }
                return Ok(Node::Repeat(Box::new(node), min, max));
            }
            _ => return Ok(node),
        };
        self.pos += 1;
        Ok(Node::Repeat(Box::new(node), min, max))
    }
}

/// The regex text of one character inside a class, always escaped.
fn class_char(out: &mut String, c: char) {
    let _ = write!(out, "\\x{{{:X}}}", c as u32);
}

struct Emitter<'a> {
    names: &'a [(String, usize)],
}

impl Emitter<'_> {
    fn rule_name(&self, i: usize) -> String {
        format!("r{i}_{}", self.names[i].0.to_ascii_lowercase())
    }

    fn emit(&self, node: &Node, out: &mut String, p: &Parser<'_>) -> Result<(), GbnfError> {
        match node {
            Node::Literal(s) => {
                out.push_str(&serde_json::to_string(s).expect("a string serialises"));
            }
            Node::Class(negated, ranges) => {
                out.push_str("/[");
                if *negated {
                    out.push('^');
                }
                for &(lo, hi) in ranges {
                    class_char(out, lo);
                    if hi != lo {
                        out.push('-');
                        class_char(out, hi);
                    }
                }
                out.push_str("]/");
            }
            Node::Any => out.push_str("/(?s:.)/"),
            Node::Rule(name, at) => match self.names.iter().position(|(n, _)| n == name) {
                Some(i) => out.push_str(&self.rule_name(i)),
                None => return p.err(*at, format!("undefined rule {name:?}")),
            },
            Node::Seq(items) if items.is_empty() => out.push_str("\"\""),
            Node::Seq(items) => {
                out.push('(');
                for (k, n) in items.iter().enumerate() {
                    if k > 0 {
                        out.push(' ');
                    }
                    self.emit(n, out, p)?;
                }
                out.push(')');
            }
            Node::Alt(alts) => {
                out.push('(');
                for (k, n) in alts.iter().enumerate() {
                    if k > 0 {
                        out.push_str(" | ");
                    }
                    self.emit(n, out, p)?;
                }
                out.push(')');
            }
            Node::Repeat(inner, min, max) => {
                out.push('(');
                self.emit(inner, out, p)?;
                out.push(')');
                match (min, max) {
                    (0, None) => out.push('*'),
                    (1, None) => out.push('+'),
                    (0, Some(1)) => out.push('?'),
                    (m, None) => {
                        let _ = write!(out, "{{{m},}}");
                    }
                    (m, Some(n)) => {
                        let _ = write!(out, "{{{m},{n}}}");
                    }
                }
            }
        }
        Ok(())
    }
}

/// Translates a GBNF grammar (start rule `root`) into Lark.
pub fn to_lark(src: &str) -> Result<String, GbnfError> {
    let mut p = Parser { src, pos: 0 };
    let mut names: Vec<(String, usize)> = Vec::new();
    let mut bodies: Vec<Node> = Vec::new();
    loop {
        p.skip_space(true);
        if p.peek().is_none() {
            break;
        }
        let (name, at) = p.name()?;
        p.skip_space(false);
        if !p.src[p.pos..].starts_with("::=") {
            return p.err(p.pos, format!("expected '::=' after rule name {name:?}"));
        }
        p.pos += 3;
        p.skip_space(true);
        let body = p.alternatives(false)?;
        match p.peek() {
            None | Some('\n' | '\r') => {}
            Some(c) => return p.err(p.pos, format!("unexpected {c:?}")),
        }
        if names.iter().any(|(n, _)| *n == name) {
            return p.err(at, format!("rule {name:?} is defined twice"));
        }
        names.push((name, at));
        bodies.push(body);
    }
    let Some(root) = names.iter().position(|(n, _)| n == "root") else {
        return p.err(src.len(), "no rule named \"root\"");
    };
    let em = Emitter { names: &names };
    let mut out = format!("start: {}\n", em.rule_name(root));
    for (i, body) in bodies.iter().enumerate() {
        out.push_str(&em.rule_name(i));
        out.push_str(": ");
        em.emit(body, &mut out, &p)?;
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translates_escapes_classes_and_repetition() {
        let lark = to_lark("root ::= \"a\\x41\\u00e9\" [^\\U0010FFFF0-9]{2,} x?\nx ::= .").unwrap();
        assert_eq!(
            lark,
            "start: r0_root\n\
             r0_root: (\"aAé\" (/[^\\x{10FFFF}\\x{30}-\\x{39}]/){2,} (r1_x)?)\n\
             r1_x: /(?s:.)/\n"
        );
    }

    #[test]
    fn errors_carry_line_and_column() {
        let e = to_lark("root ::= a\na ::= \"x\" \\q").unwrap_err();
        assert_eq!(e.to_string(), "unexpected '\\\\' at line 2, column 11");
        let e = to_lark("root ::= b").unwrap_err();
        assert_eq!(e.to_string(), "undefined rule \"b\" at line 1, column 10");
        let e = to_lark("a ::= \"x\"").unwrap_err();
        assert!(e.to_string().starts_with("no rule named \"root\""), "{e}");
    }
}
