//! The hostile-grammar corpus: each shape that once crashed or starved a
//! server, generated at any size, in each constraint syntax. Shared by
//! `tests/hostile_constraints.rs` (the real server binary) and
//! `examples/constraint_stack.rs` (the stack each shape needs).
#![allow(dead_code)]

/// One hostile constraint: its `params.constraint` kind and text.
pub struct Case {
    pub shape: &'static str,
    pub kind: &'static str,
    pub text: String,
}

/// Every shape, for [`generate`].
pub const SHAPES: &[&str] = &[
    "gbnf-nest",
    "gbnf-nest-seq",
    "gbnf-chain",
    "gbnf-alternation",
    "gbnf-chain-nested",
    "lark-nest",
    "lark-chain",
    "lark-terminal-chain",
    "lark-alternation",
    "lark-chain-nested",
    "json-nest",
    "json-ref-chain",
    "json-ref-cycle",
    "json-enum",
    "json-properties",
    "regex-nest",
    "regex-alternation",
    "regex-counted",
    "regex-blowup",
];

/// `shape` at size `n` (nesting levels, rules, alternatives).
pub fn generate(shape: &'static str, n: usize) -> Case {
    let (kind, text) = match shape {
        // ((((("a"))))): collapses to one literal, only the parser nests.
        "gbnf-nest" => (
            "gbnf",
            format!("root ::= {}\"a\"{}", "(".repeat(n), ")".repeat(n)),
        ),
        // ("a" ("a" ( … ))): a nested sequence that stays nested.
        "gbnf-nest-seq" => (
            "gbnf",
            format!("root ::= {}\"a\"{}", "(\"a\" ".repeat(n), ")".repeat(n)),
        ),
        // root ::= r0, r0 ::= r1, …, rN ::= "a".
        "gbnf-chain" => {
            let mut g = String::from("root ::= r0\n");
            for i in 0..n {
                g.push_str(&format!("r{i} ::= r{}\n", i + 1));
            }
            g.push_str(&format!("r{n} ::= \"a\"\n"));
            ("gbnf", g)
        }
        // A chain whose every reference stands 8 groups deep.
        "gbnf-chain-nested" => {
            let mut g = String::from("root ::= r0\n");
            for i in 0..n {
                g.push_str(&format!(
                    "r{i} ::= {}r{}{}\n",
                    "(\"x\" ".repeat(8),
                    i + 1,
                    ")".repeat(8)
                ));
            }
            g.push_str(&format!("r{n} ::= \"a\"\n"));
            ("gbnf", g)
        }
        "gbnf-alternation" => ("gbnf", format!("root ::= {}", alternatives(n, " | "))),
        "lark-nest" => (
            "lark",
            format!("start: {}\"a\"{}", "(\"a\" ".repeat(n), ")".repeat(n)),
        ),
        "lark-chain" => {
            let mut g = String::from("start: a0\n");
            for i in 0..n {
                g.push_str(&format!("a{i}: a{}\n", i + 1));
            }
            g.push_str(&format!("a{n}: \"a\"\n"));
            ("lark", g)
        }
        "lark-terminal-chain" => {
            let mut g = String::from("start: T0\n");
            for i in 0..n {
                g.push_str(&format!("T{i}: T{}\n", i + 1));
            }
            g.push_str(&format!("T{n}: \"a\"\n"));
            ("lark", g)
        }
        "lark-chain-nested" => {
            let mut g = String::from("start: a0\n");
            for i in 0..n {
                g.push_str(&format!(
                    "a{i}: {}a{}{}\n",
                    "(\"x\" ".repeat(8),
                    i + 1,
                    ")".repeat(8)
                ));
            }
            g.push_str(&format!("a{n}: \"a\"\n"));
            ("lark", g)
        }
        "lark-alternation" => ("lark", format!("start: {}", alternatives(n, " | "))),
        // {"type":"object","properties":{"a":{ … }}} n deep.
        "json-nest" => {
            let open = r#"{"type":"object","properties":{"a":"#.repeat(n);
            let close = "}}".repeat(n);
            (
                "json_schema",
                format!(r#"{open}{{"type":"string"}}{close}"#),
            )
        }
        // a0 → a1 → … → aN, a string.
        "json-ref-chain" => ("json_schema", ref_chain(n, false)),
        // a0 → … → aN → a0, each an object with an optional `x`.
        "json-ref-cycle" => ("json_schema", ref_chain(n, true)),
        "json-enum" => {
            let values: Vec<String> = (0..n).map(|i| format!("\"w{i}\"")).collect();
            (
                "json_schema",
                format!(r#"{{"enum":[{}]}}"#, values.join(",")),
            )
        }
        // An object of n properties, each with its own pattern.
        "json-properties" => {
            let props: Vec<String> = (0..n)
                .map(|i| format!(r#""p{i}":{{"type":"string","pattern":"^x{i}$"}}"#))
                .collect();
            (
                "json_schema",
                format!(
                    r#"{{"type":"object","properties":{{{}}}}}"#,
                    props.join(",")
                ),
            )
        }
        "regex-nest" => ("regex", format!("{}a{}", "(".repeat(n), ")".repeat(n))),
        "regex-alternation" => (
            "regex",
            (0..n)
                .map(|i| format!("w{i}"))
                .collect::<Vec<_>>()
                .join("|"),
        ),
        // Counted repetition inside counted repetition: n^2 states.
        "regex-counted" => ("regex", format!("(a{{1,{n}}}){{1,{n}}}b")),
        // The n-th last byte is "a": a DFA of 2^n states.
        "regex-blowup" => ("regex", format!("[ab]*a[ab]{{{n}}}")),
        other => panic!("unknown shape {other}"),
    };
    Case { shape, kind, text }
}

/// `"w0" | "w1" | …` (n of them).
fn alternatives(n: usize, sep: &str) -> String {
    (0..n)
        .map(|i| format!("\"w{i}\""))
        .collect::<Vec<_>>()
        .join(sep)
}

fn ref_chain(n: usize, cycle: bool) -> String {
    let mut defs: Vec<String> = (0..n)
        .map(|i| {
            let next = format!(r##"{{"$ref":"#/$defs/a{}"}}"##, i + 1);
            if cycle {
                format!(r#""a{i}":{{"type":"object","properties":{{"x":{next}}}}}"#)
            } else {
                format!(r#""a{i}":{next}"#)
            }
        })
        .collect();
    defs.push(if cycle {
        format!(r##""a{n}":{{"type":"object","properties":{{"x":{{"$ref":"#/$defs/a0"}}}}}}"##)
    } else {
        format!(r#""a{n}":{{"type":"string"}}"#)
    });
    format!(
        r##"{{"$ref":"#/$defs/a0","$defs":{{{}}}}}"##,
        defs.join(",")
    )
}
