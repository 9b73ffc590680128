//! How deep and how many-ruled a constraint's grammar text is, measured
//! before anything compiles it.
//!
//! Why: compiling a grammar recurses. llama.cpp's GBNF parser (ours in
//! the constraint plugin, like llama.cpp's `parse_sequence`) descends once
//! per parenthesis; llguidance's Lark compiler (`Compiler::do_rule`)
//! once per rule along a chain of rule references, its JSON Schema
//! compiler (`define_ref`) once per `$ref` along a chain and once per level
//! of nesting, and the regex translation once per group. Input-sized
//! recursion overflowed the sampling thread's 2 MiB stack and killed the
//! process (a GBNF nested 5,000 deep, a 700-rule Lark chain, 700 chained
//! `$ref`s). So the compile runs on a thread whose stack is sized for
//! `limits.max_constraint_depth` and `limits.max_constraint_rules`
//! (`super::stack_bytes`), and these two figures are checked against those
//! limits first.
//!
//! The scans are single pass and iterative (no recursion on the input):
//! `depth` is the deepest bracket nesting (parentheses, brackets and
//! braces, a regex's groups and classes included, outside strings and
//! comments) and `rules` the number of named definitions and terminals
//! (GBNF and Lark rules, terminals, string and regex literals: each a rule
//! or lexeme llguidance builds one by one). A JSON Schema is parsed and its
//! `depth` is the deepest the compiler can recurse, following `$ref`s
//! ([`json_unfolded`]); its `rules` count the distinct `$ref` targets and
//! the object properties (the compiler recurses once per property of an
//! object). Every recursion of a compile is bounded by the two together,
//! and so is the compile work that grows faster than the text (llguidance
//! deduplicates lexemes and property sequences pairwise: quadratic in
//! their number). A count may exceed what a compiler sees (a bracket in a
//! regex that is never used), never fall short of it, except for `$ref`s
//! that are not local JSON pointers (`#/…`), which are not followed.

use std::collections::HashMap;

use serde_json::Value;

/// What [`measure`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    /// The deepest bracket nesting.
    pub depth: usize,
    /// Named definitions and distinct `$ref` targets.
    pub rules: usize,
}

/// The shape of grammar text of `kind` (`json_schema`, `regex`, `lark`,
/// `gbnf`; the choice list and `json_object` are flat).
pub fn measure(kind: &str, text: &str) -> Shape {
    match kind {
        "gbnf" => gbnf(text.as_bytes()),
        "lark" => lark(text.as_bytes()),
        "json_schema" => json(text),
        "regex" => Shape {
            depth: regex(text.as_bytes(), 0, None).1,
            rules: 1,
        },
        _ => Shape { depth: 1, rules: 1 },
    }
}

/// Bracket depth with its maximum.
#[derive(Default)]
struct Depth {
    now: usize,
    max: usize,
}

impl Depth {
    fn open(&mut self) {
        self.now += 1;
        self.max = self.max.max(self.now);
    }

    fn close(&mut self) {
        self.now = self.now.saturating_sub(1);
    }
}

/// The index after a quoted string starting at `i` (`s[i]` is the quote):
/// a backslash escapes the next byte. Unterminated: the end.
fn skip_quoted(s: &[u8], i: usize, quote: u8) -> usize {
    let mut j = i + 1;
    while j < s.len() {
        match s[j] {
            b'\\' => j += 2,
            c if c == quote => return j + 1,
            _ => j += 1,
        }
    }
    s.len()
}

/// The index of the end of the line at or after `i`.
fn skip_line(s: &[u8], i: usize) -> usize {
    s[i..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(s.len(), |p| i + p)
}

fn skip_space(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && matches!(s[i], b' ' | b'\t' | b'\r' | b'\n') {
        i += 1;
    }
    i
}

/// The rules of a GBNF or Lark grammar as a graph: each rule's own
/// bracket depth, and its references to rules with the depth they stand
/// at. Its longest path is how deep a compile recurses: llguidance's Lark
/// compiler (`Compiler::do_rule`) compiles a rule where it is first
/// referenced, from inside the referencing rule's nesting.
#[derive(Default)]
struct Rules {
    ids: HashMap<Vec<u8>, usize>,
    rules: Vec<Rule>,
    /// Literals and classes (lexemes).
    lexemes: usize,
    /// GBNF: the first rule's name, seen before any rule exists.
    pending: Option<Vec<u8>>,
}

/// One rule's bracket depth, and its references: (name, depth at it).
type Rule = (usize, Vec<(Vec<u8>, usize)>);

impl Rules {
    fn define(&mut self, name: &[u8]) {
        let id = self.rules.len();
        self.ids.entry(name.to_vec()).or_insert(id);
        self.rules.push((0, Vec::new()));
    }

    fn reference(&mut self, name: &[u8], depth: usize) {
        if let Some(r) = self.rules.last_mut() {
            r.1.push((name.to_vec(), depth));
        }
    }

    fn reach(&mut self, depth: usize) {
        if let Some(r) = self.rules.last_mut() {
            r.0 = r.0.max(depth);
        }
    }

    /// The shape, each bracket level weighing `per_level` (a GBNF group
    /// becomes up to three nested Lark groups) and each reference one more.
    fn shape(&self, per_level: usize) -> Shape {
        // Node 0 starts anywhere: every rule is a possible start.
        let n = self.rules.len() + 1;
        let mut h = vec![0; n];
        let mut edges = vec![Vec::new(); n];
        edges[0] = (1..n).map(|r| (r, 0)).collect();
        for (r, (depth, refs)) in self.rules.iter().enumerate() {
            h[r + 1] = depth * per_level;
            for (name, at) in refs {
                if let Some(&to) = self.ids.get(name) {
                    edges[r + 1].push((to + 1, at * per_level + 1));
                }
            }
        }
        Shape {
            depth: longest_path(&h, &edges),
            rules: self.rules.len() + self.lexemes,
        }
    }
}

fn is_word(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'-'
}

/// GBNF: parentheses outside literals, classes and `#` comments; the rule
/// graph's longest path ([`Rules`], three levels per parenthesis: the
/// translation to Lark nests every sequence, alternation and repetition);
/// one rule per `::=` and per literal or class.
fn gbnf(s: &[u8]) -> Shape {
    let mut g = Rules::default();
    let mut d = Depth::default();
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'#' => i = skip_line(s, i),
            b'"' => {
                g.lexemes += 1;
                i = skip_quoted(s, i, b'"');
            }
            b'[' => {
                g.lexemes += 1;
                i = skip_quoted(s, i, b']');
            }
            b'(' => {
                d.open();
                g.reach(d.now);
                i += 1;
            }
            b')' => {
                d.close();
                i += 1;
            }
            b':' if s[i..].starts_with(b"::=") => {
                // The word before names this rule: it was recorded as a
                // reference of the previous one.
                let name = g.rules.last_mut().and_then(|r| r.1.pop());
                let name = g.pending.take().or(name.map(|n| n.0));
                g.define(&name.unwrap_or_default());
                d.now = 0;
                i += 3;
            }
            c if is_word(c) => {
                let start = i;
                while i < s.len() && is_word(s[i]) {
                    i += 1;
                }
                if g.rules.is_empty() {
                    // Before the first rule: its name.
                    g.pending = Some(s[start..i].to_vec());
                } else {
                    g.reference(&s[start..i], d.now);
                }
            }
            _ => i += 1,
        }
    }
    let mut shape = g.shape(3);
    shape.depth = shape.depth.max(d.max);
    shape
}

/// Lark (llguidance's dialect): `()`, `[]` and `{}` outside strings,
/// regexes and `#` / `//` comments, plus each regex's own depth where it
/// stands; the rule graph's longest path ([`Rules`]); one rule per
/// definition (`name:` / `NAME:` / `?name.2:` / `name{x}:` at the start of
/// a line) and per string or regex literal; an inline `%json` schema adds
/// its own measure where it stands.
fn lark(s: &[u8]) -> Shape {
    let mut g = Rules::default();
    let mut d = Depth::default();
    // Inline schemas and regexes: deepest reach where they stand.
    let mut inner = Shape::default();
    let mut line_start = true;
    let mut i = 0;
    while i < s.len() {
        if line_start {
            line_start = false;
            let at = skip_space(s, i);
            if let Some((name, after)) = definition(s, at) {
                g.define(name);
                d.now = 0;
                i = after;
            } else {
                i = at;
            }
            continue;
        }
        match s[i] {
            b'\n' => {
                line_start = true;
                i += 1;
            }
            b'#' => i = skip_line(s, i),
            b'/' if s.get(i + 1) == Some(&b'/') => i = skip_line(s, i),
            b'/' => {
                g.lexemes += 1;
                let (end, depth) = regex(s, i + 1, Some(b'/'));
                inner.depth = inner.depth.max(d.now + depth);
                i = end + 1;
            }
            b'"' => {
                g.lexemes += 1;
                i = skip_quoted(s, i, b'"');
            }
            b'%' if s[i..].starts_with(b"%json") => {
                // An inline JSON Schema: measured as one.
                let open = skip_space(s, i + 5);
                let end = json_end(s, open);
                let json = std::str::from_utf8(&s[open..end]).map_or(Shape::default(), json);
                inner.depth = inner.depth.max(d.now + json.depth);
                inner.rules += json.rules;
                i = end;
            }
            // A directive or grammar reference: not a rule name.
            b'%' | b'@' => {
                i += 1;
                while i < s.len() && is_word(s[i]) {
                    i += 1;
                }
            }
            b'(' | b'[' | b'{' => {
                d.open();
                g.reach(d.now);
                i += 1;
            }
            b')' | b']' | b'}' => {
                d.close();
                i += 1;
            }
            c if is_word(c) => {
                let start = i;
                while i < s.len() && is_word(s[i]) {
                    i += 1;
                }
                g.reference(&s[start..i], d.now);
            }
            _ => i += 1,
        }
    }
    let shape = g.shape(1);
    Shape {
        depth: shape.depth.max(d.max).max(inner.depth),
        rules: shape.rules + inner.rules,
    }
}

/// The end of the JSON value that starts at `i` (`{…}` or `[…]`, strings
/// skipped; the end of the text when unbalanced).
fn json_end(s: &[u8], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < s.len() {
        match s[i] {
            b'"' => {
                i = skip_quoted(s, i, b'"');
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            _ if depth == 0 => return i,
            _ => {}
        }
        i += 1;
    }
    s.len()
}

/// A Lark rule or terminal definition at `i`: `[!?]* name ({…})? (.N)? :`
/// with a single colon. Its name and where its body starts.
fn definition(s: &[u8], mut i: usize) -> Option<(&[u8], usize)> {
    while i < s.len() && matches!(s[i], b'!' | b'?') {
        i += 1;
    }
    let name = i;
    while i < s.len() && is_word(s[i]) {
        i += 1;
    }
    if i == name || !(s[name].is_ascii_alphabetic() || s[name] == b'_') {
        return None;
    }
    let end = i;
    if s.get(i) == Some(&b'{') {
        while i < s.len() && !matches!(s[i], b'}' | b'\n') {
            i += 1;
        }
        i += 1;
    }
    if s.get(i) == Some(&b'.') {
        i += 1;
        while i < s.len() && (s[i].is_ascii_digit() || s[i] == b'-') {
            i += 1;
        }
    }
    while i < s.len() && matches!(s[i], b' ' | b'\t') {
        i += 1;
    }
    (s.get(i) == Some(&b':') && s.get(i + 1) != Some(&b':')).then(|| (&s[name..end], i + 1))
}

/// JSON Schema: the lexical bracket depth (a document too deep to parse
/// is measured by it alone: serde_json, in the plugin too, refuses more
/// than 128 levels), else the unfolded depth and the rules of
/// [`json_unfolded`].
fn json(text: &str) -> Shape {
    let mut d = Depth::default();
    let s = text.as_bytes();
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'"' => {
                i = skip_quoted(s, i, b'"');
                continue;
            }
            b'{' | b'[' => d.open(),
            b'}' | b']' => d.close(),
            _ => {}
        }
        i += 1;
    }
    match serde_json::from_str::<Value>(text) {
        Ok(root) => {
            let u = json_unfolded(&root);
            Shape {
                depth: u.depth.max(d.max),
                rules: u.rules,
            }
        }
        Err(_) => Shape {
            depth: d.max,
            rules: 1,
        },
    }
}

/// How deep llguidance's JSON Schema compiler can recurse on `root`, and
/// its rules (distinct `$ref` targets and object properties).
///
/// The compiler descends the schema's nesting, and at a `$ref` whose
/// target it has not compiled yet, into the target: a chain of `$ref`s
/// nests as deep as the sum of its links. This is an upper bound for any
/// order the compiler takes: a graph whose nodes are the document and each
/// `$ref` target (a target nested in another is entered from it with the
/// levels between as weight), whose edges are the `$ref`s (the levels to
/// the `$ref` from the target it lies in, plus one), and its longest path
/// from the document with each cycle (strongly connected component)
/// counted as all of its members twice over (a target is expanded once,
/// but can also be passed through by nesting).
fn json_unfolded(root: &Value) -> Shape {
    // Node 0 is the document; the targets follow.
    let mut ids: HashMap<*const Value, usize> = HashMap::new();
    ids.insert(root as *const Value, 0);
    let mut properties = 0usize;
    let mut stack = vec![root];
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref")
                    && let Some(t) = resolve(root, r)
                {
                    let n = ids.len();
                    ids.entry(t as *const Value).or_insert(n);
                }
                if let Some(Value::Object(p)) = m.get("properties") {
                    properties += p.len();
                }
                stack.extend(m.values());
            }
            Value::Array(a) => stack.extend(a.iter()),
            _ => {}
        }
    }
    let n = ids.len();
    let mut h = vec![0usize; n];
    let mut edges: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
    // (value, its depth, the target it lies in, that target's depth)
    let mut walk = vec![(root, 0usize, 0usize, 0usize)];
    while let Some((v, depth, mut within, mut base)) = walk.pop() {
        if let Some(&t) = ids.get(&(v as *const Value))
            && t != within
        {
            edges[within].push((t, depth - base));
            (within, base) = (t, depth);
        }
        h[within] = h[within].max(depth - base);
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref")
                    && let Some(t) = resolve(root, r)
                {
                    edges[within].push((ids[&(t as *const Value)], depth - base + 1));
                }
                walk.extend(m.values().map(|c| (c, depth + 1, within, base)));
            }
            Value::Array(a) => walk.extend(a.iter().map(|c| (c, depth + 1, within, base))),
            _ => {}
        }
    }
    Shape {
        depth: longest_path(&h, &edges),
        rules: n + properties,
    }
}

/// The target of a local `$ref` (`#` and a JSON pointer, percent-encoded
/// as in a URI fragment), if it is one and resolves.
fn resolve<'a>(root: &'a Value, r: &str) -> Option<&'a Value> {
    let fragment = r.strip_prefix('#')?;
    let mut bytes = Vec::with_capacity(fragment.len());
    let f = fragment.as_bytes();
    let mut i = 0;
    while i < f.len() {
        let hex = || {
            std::str::from_utf8(f.get(i + 1..i + 3)?)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        };
        match (f[i], hex()) {
            (b'%', Some(b)) => {
                bytes.push(b);
                i += 3;
            }
            (c, _) => {
                bytes.push(c);
                i += 1;
            }
        }
    }
    root.pointer(std::str::from_utf8(&bytes).ok()?)
}

/// The longest path from node 0 (a node's own subtree depth `h` ends a
/// path), each strongly connected component's internal length bounded by
/// twice the sum of its members' longest inner edges. Tarjan's algorithm,
/// iterative; components come out in reverse topological order, so each
/// one's successors are done before it.
fn longest_path(h: &[usize], edges: &[Vec<(usize, usize)>]) -> usize {
    let n = h.len();
    const NONE: usize = usize::MAX;
    let (mut index, mut low, mut comp) = (vec![NONE; n], vec![0; n], vec![NONE; n]);
    let mut on_stack = vec![false; n];
    let mut scc_stack = Vec::new();
    let mut best: Vec<usize> = Vec::new();
    let mut next = 0;
    // (node, next edge to look at)
    let mut calls = vec![(0usize, 0usize)];
    index[0] = 0;
    low[0] = 0;
    next += 1;
    scc_stack.push(0);
    on_stack[0] = true;
    while let Some(&mut (v, ref mut e)) = calls.last_mut() {
        if let Some(&(u, _)) = edges[v].get(*e) {
            *e += 1;
            if index[u] == NONE {
                index[u] = next;
                low[u] = next;
                next += 1;
                scc_stack.push(u);
                on_stack[u] = true;
                calls.push((u, 0));
            } else if on_stack[u] {
                low[v] = low[v].min(index[u]);
            }
            continue;
        }
        calls.pop();
        if let Some(&(parent, _)) = calls.last() {
            low[parent] = low[parent].min(low[v]);
        }
        if low[v] != index[v] {
            continue;
        }
        let c = best.len();
        let mut members = Vec::new();
        loop {
            let w = scc_stack.pop().expect("v is on the stack");
            on_stack[w] = false;
            comp[w] = c;
            members.push(w);
            if w == v {
                break;
            }
        }
        let mut inner = 0usize;
        let mut out = 0usize;
        for &m in &members {
            out = out.max(h[m]);
            let mut longest_inner = 0;
            for &(u, w) in &edges[m] {
                if comp[u] == c {
                    longest_inner = longest_inner.max(w);
                } else {
                    out = out.max(w.saturating_add(best[comp[u]]));
                }
            }
            inner = inner.saturating_add(longest_inner);
        }
        best.push(inner.saturating_mul(2).saturating_add(out));
    }
    best[comp[0]]
}

/// A regex from `i` to `end` (a Lark regex's closing `/`, or the end of
/// the text): groups and (nested) classes count as depth; a backslash
/// escapes the next byte. Returns where it ended (the index of `end`) and
/// its depth.
fn regex(s: &[u8], mut i: usize, end: Option<u8>) -> (usize, usize) {
    let mut d = Depth::default();
    // Open classes: inside one, only `[` (a nested class) and `]` count.
    let mut classes = 0usize;
    while i < s.len() {
        let c = s[i];
        if Some(c) == end {
            break;
        }
        match c {
            b'\\' => i += 1,
            b'[' => {
                classes += 1;
                d.open();
                // `[]…]` and `[^]…]`: a `]` first is a literal.
                let mut j = i + 1;
                if s.get(j) == Some(&b'^') {
                    j += 1;
                }
                if s.get(j) == Some(&b']') {
                    i = j;
                }
            }
            b']' if classes > 0 => {
                classes -= 1;
                d.close();
            }
            b'(' if classes == 0 => d.open(),
            b')' if classes == 0 => d.close(),
            _ => {}
        }
        i += 1;
    }
    (i.min(s.len()), d.max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(kind: &str, text: &str) -> (usize, usize) {
        let s = measure(kind, text);
        (s.depth, s.rules)
    }

    #[test]
    fn gbnf_counts_groups_outside_literals_classes_and_comments() {
        // Two rules and three lexemes ("(", [(], "x\"(").
        let g = "root ::= (\"(\" [(] ( a ) ) # ((((\na ::= \"x\\\"(\"";
        // `a` is referenced two parentheses deep: 2 × 3 levels and the
        // reference.
        assert_eq!(shape("gbnf", g), (7, 5));
        let deep = format!("root ::= {}\"a\"{}", "(".repeat(5000), ")".repeat(5000));
        assert_eq!(shape("gbnf", &deep), (15_000, 2));
        let chain: String = (0..700).map(|i| format!("r{i} ::= r{}\n", i + 1)).collect();
        assert_eq!(shape("gbnf", &chain), (699, 700));
    }

    #[test]
    fn lark_counts_definitions_literals_brackets_and_regex_groups() {
        let g = "start: a | [b] // (((\n?a.2: \"(\" /(x[(])?/ # ((\nB: /((y))/\nc{x}: x\n";
        // `[b]` is 1; the regex `(x[(])` reaches 2 at depth 0; `((y))` 2.
        // Four definitions, three literals.
        assert_eq!(shape("lark", g), (2, 7));
        let chain: String = (0..700).map(|i| format!("a{i}: a{}\n", i + 1)).collect();
        assert_eq!(shape("lark", &chain), (699, 700));
        // Each link one bracket deeper: 2 levels per link.
        let nested: String = (0..100).map(|i| format!("a{i}: (a{})\n", i + 1)).collect();
        assert_eq!(shape("lark", &nested), (2 * 99 + 1, 100));
    }

    #[test]
    fn lark_measures_an_inline_json_schema_as_json() {
        let g = "start: %json { \"$ref\": \"#/$defs/a\", \"$defs\": {\"a\": {\"$ref\" : \"#/$defs/b\"}, \"b\": {}} }\n";
        // The document, a and b; `start` is the fourth rule.
        assert_eq!(shape("lark", g), (3, 4));
    }

    #[test]
    fn json_depth_follows_refs_and_counts_a_cycle_twice() {
        let s = r##"{"$ref":"#/$defs/a","$defs":{"a":{"$ref":"#/$defs/a","x":"[{"},"b":{"items":[{"$ref":"#/$defs/a"}]}}}"##;
        // The $ref at depth 4 into a, whose self-loop counts 2 and whose
        // "x" 1 more: 5 + 3.
        assert_eq!(shape("json_schema", s), (8, 2));
    }

    #[test]
    fn json_ref_chains_count_every_link_whatever_the_order() {
        let chain = |order: &mut dyn Iterator<Item = usize>| {
            let defs: Vec<String> = order
                .map(|i| format!(r##""a{i}":{{"$ref":"#/$defs/a{}"}}"##, i + 1))
                .chain([r#""a700":{"type":"string"}"#.to_string()])
                .collect();
            format!(
                r##"{{"$ref":"#/$defs/a0","$defs":{{{}}}}}"##,
                defs.join(",")
            )
        };
        let forward = measure("json_schema", &chain(&mut (0..700)));
        let backward = measure("json_schema", &chain(&mut (0..700).rev()));
        assert_eq!(forward, backward);
        assert!(forward.depth > 700, "{forward:?}");
        assert_eq!(forward.rules, 702);
        // A cycle of 100 objects, each an object whose property refs the next.
        let defs: Vec<String> = (0..100)
            .map(|i| {
                format!(
                    r##""a{i}":{{"type":"object","properties":{{"x":{{"$ref":"#/$defs/a{}"}}}}}}"##,
                    (i + 1) % 100
                )
            })
            .collect();
        let cycle = format!(
            r##"{{"$ref":"#/$defs/a0","$defs":{{{}}}}}"##,
            defs.join(",")
        );
        let s = measure("json_schema", &cycle);
        assert!(s.depth >= 400, "{s:?}");
        assert_eq!(s.rules, 101 + 100);
    }

    #[test]
    fn json_refs_resolve_percent_encoded_pointers_and_skip_others() {
        let s = r##"{"$defs":{"a b":{"type":"string"}},"properties":{"x":{"$ref":"#/$defs/a%20b"},"y":{"$ref":"https://example.com/s"}}}"##;
        // The document and `a b`; two properties.
        assert_eq!(shape("json_schema", s).1, 4);
    }

    #[test]
    fn unparsable_json_is_measured_by_its_brackets() {
        let deep = format!("{}{}", "[".repeat(300), "]".repeat(300));
        assert_eq!(shape("json_schema", &deep), (300, 1));
        assert_eq!(shape("json_schema", "{\"a\": [}"), (2, 1));
    }

    #[test]
    fn regex_counts_groups_and_nested_classes() {
        assert_eq!(shape("regex", r"(a(b)\()[[:alpha:][^]]]"), (2, 1));
        assert_eq!(shape("regex", r"\(\(\("), (0, 1));
        assert_eq!(shape("regex", &"(".repeat(300)), (300, 1));
    }

    #[test]
    fn flat_kinds_are_flat() {
        assert_eq!(shape("choice", ""), (1, 1));
        assert_eq!(shape("json_object", ""), (1, 1));
    }
}
