//! Terminal output: colour (only on a terminal, never with `NO_COLOR`),
//! gRPC status codes by their canonical names, the one-line error report,
//! and the JSON shapes of proto messages (prost types are not serde).

use std::io::IsTerminal;
use std::sync::OnceLock;

use samplerd_api::{code_name, v1};
use serde_json::{Value, json};

static STDOUT_COLOR: OnceLock<bool> = OnceLock::new();
static STDERR_COLOR: OnceLock<bool> = OnceLock::new();

fn no_color() -> bool {
    std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty())
}

fn stdout_color() -> bool {
    *STDOUT_COLOR.get_or_init(|| !no_color() && std::io::stdout().is_terminal())
}

fn stderr_color() -> bool {
    *STDERR_COLOR.get_or_init(|| !no_color() && std::io::stderr().is_terminal())
}

/// ANSI styles used by the client.
#[derive(Clone, Copy)]
pub enum Style {
    Bold,
    Dim,
    Red,
    Green,
    Yellow,
    Cyan,
}

impl Style {
    fn code(self) -> &'static str {
        match self {
            Style::Bold => "1",
            Style::Dim => "2",
            Style::Red => "1;31",
            Style::Green => "32",
            Style::Yellow => "33",
            Style::Cyan => "36",
        }
    }
}

fn paint_if(on: bool, style: Style, text: &str) -> String {
    if on {
        format!("\x1b[{}m{text}\x1b[0m", style.code())
    } else {
        text.to_string()
    }
}

/// `text` styled for stdout (plain when stdout is not a terminal).
pub fn paint(style: Style, text: &str) -> String {
    paint_if(stdout_color(), style, text)
}

/// `text` styled for stderr (plain when stderr is not a terminal).
pub fn paint_err(style: Style, text: &str) -> String {
    paint_if(stderr_color(), style, text)
}

/// `INVALID_ARGUMENT: params.top_p must be …` — code and message, no dump.
pub fn status_line(s: &tonic::Status) -> String {
    let msg = s.message().trim();
    if msg.is_empty() {
        code_name(s.code()).to_string()
    } else {
        format!("{}: {msg}", code_name(s.code()))
    }
}

/// Prints `error: …` on stderr. A gRPC status anywhere in the chain is
/// shown as `CODE: message`; transport failures of a status are reduced to
/// their root cause.
pub fn print_error(err: &anyhow::Error) {
    let text = match err.chain().find_map(|e| e.downcast_ref::<tonic::Status>()) {
        Some(status) => {
            let mut line = status_line(status);
            if let Some(src) = std::error::Error::source(status) {
                let cause = crate::connect::root_cause(src);
                if !line.contains(&cause) {
                    line = format!("{line} ({cause})");
                }
            }
            // Keep any context added above the status ("sample: …").
            match err.chain().next() {
                Some(top) if top.downcast_ref::<tonic::Status>().is_none() => {
                    format!("{top}: {line}")
                }
                _ => line,
            }
        }
        None => format!("{err:#}"),
    };
    eprintln!("{} {text}", paint_err(Style::Red, "error:"));
}

/// Writes `text` to stdout and flushes. Unlike `print!` this returns the
/// error (a closed pipe, as in `samplerctl stages | head`, is then a quiet
/// exit; see [`is_broken_pipe`]).
pub fn emit(text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// True when the error chain holds a broken-pipe I/O error (stdout closed
/// by the reader): not worth an error message.
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    // A broken pipe under an RPC error is the connection failing (e.g. the
    // server closing a TLS handshake it refused), not stdout.
    if err
        .chain()
        .any(|e| e.is::<tonic::Status>() || e.is::<tonic::transport::Error>())
    {
        return false;
    }
    err.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Prints a warning line on stderr.
pub fn warn(text: &str) {
    eprintln!("{} {text}", paint_err(Style::Yellow, "warning:"));
}

/// JSON of a `TokenProbability`.
pub fn prob_json(p: &v1::TokenProbability) -> Value {
    json!({"token_id": p.token_id, "probability": p.probability, "logprob": p.logprob})
}

/// JSON of a `SampleResponse`.
pub fn sample_response_json(r: &v1::SampleResponse) -> Value {
    json!({
        "token_id": r.token_id,
        "probability": r.probability,
        "logprob": r.logprob,
        "seed": r.seed,
        "step": r.step,
        "probs": r.probs.iter().map(prob_json).collect::<Vec<_>>(),
    })
}

/// JSON of a `GenerateResponse` (`{"token": …}`, `{"finished": …}` or
/// `{"prompt_logprobs": […]}`).
pub fn generate_response_json(r: &v1::GenerateResponse) -> Value {
    use v1::generate_response::Event;
    match &r.event {
        Some(Event::Token(t)) => json!({"token": {
            "token_id": t.token_id,
            "text": t.text,
            "probability": t.probability,
            "logprob": t.logprob,
            "probs": t.probs.iter().map(prob_json).collect::<Vec<_>>(),
        }}),
        Some(Event::Finished(f)) => json!({"finished": {
            "finish_reason": finish_reason_name(f.finish_reason),
            "usage": f.usage.as_ref().map(|u| json!({
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "cached_prompt_tokens": u.cached_prompt_tokens,
                "resumed_tokens": u.resumed_tokens,
                "draft_tokens": u.draft_tokens,
                "accepted_draft_tokens": u.accepted_draft_tokens,
            })),
            "seed": f.seed,
            "text": f.text,
            "timings": f.timings.as_ref().map(|t| json!({
                "prefill_ms": t.prefill_ms,
                "decode_tokens_per_second": t.decode_tokens_per_second,
                "sampling_us_per_token": t.sampling_us_per_token,
                "numerics": t.numerics,
            })),
        }}),
        Some(Event::PromptLogprobs(p)) => json!({"prompt_logprobs": p.tokens.iter().map(|t| json!({
            "token_id": t.token_id,
            "logprob": t.logprob,
            "rank": t.rank,
            "top": t.top.iter().map(prob_json).collect::<Vec<_>>(),
        })).collect::<Vec<_>>()}),
        None => json!({}),
    }
}

/// `FinishReason` as its proto name (`MAX_TOKENS`).
pub fn finish_reason_name(raw: i32) -> String {
    v1::FinishReason::try_from(raw)
        .map(|r| r.as_str_name().to_string())
        .unwrap_or_else(|_| format!("UNKNOWN({raw})"))
}

/// JSON of a `ParamValue`.
pub fn param_value_json(v: &v1::ParamValue) -> Value {
    use v1::param_value::Kind;
    match &v.kind {
        Some(Kind::Number(n)) => json!(n),
        Some(Kind::Text(s)) => json!(s),
        Some(Kind::TokenMap(m)) => Value::Object(
            m.entries
                .iter()
                .map(|e| (e.token_id.to_string(), json!(e.value)))
                .collect(),
        ),
        Some(Kind::Strings(l)) => json!(l.values),
        None => Value::Null,
    }
}

/// A `ParamValue` as short text (`40`, `"x"`, `{1: -inf}`, `[a, b]`).
pub fn param_value_text(v: &v1::ParamValue) -> String {
    use v1::param_value::Kind;
    match &v.kind {
        Some(Kind::Number(n)) => format_number(*n),
        Some(Kind::Text(s)) => format!("{s:?}"),
        Some(Kind::TokenMap(m)) => {
            let items: Vec<String> = m
                .entries
                .iter()
                .map(|e| format!("{}: {}", e.token_id, e.value))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        Some(Kind::Strings(l)) => format!("[{}]", l.values.join(", ")),
        None => "-".into(),
    }
}

/// Integers without a fraction, others as the shortest round-trip text —
/// of the f32 when the value is an f32 widened to f64 (`0.95`, not
/// `0.949999988079071`).
pub fn format_number(n: f64) -> String {
    if n.fract() == 0.0 && n.abs() < 1e15 {
        format!("{}", n as i64)
    } else if f64::from(n as f32) == n {
        format!("{}", n as f32)
    } else {
        format!("{n}")
    }
}

/// Left-aligned columns; `header` is bolded on a terminal.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let cols = header.len();
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate().take(cols) {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                let pad = width[i] - c.chars().count();
                s.push_str(c);
                s.push_str(&" ".repeat(pad + 2));
            }
        }
        s.trim_end().to_string()
    };
    let mut out = String::new();
    let head = line(header.iter().map(|h| h.to_string()).collect());
    out.push_str(&paint(Style::Bold, &head));
    out.push('\n');
    for r in rows {
        out.push_str(&line(r.clone()));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines() {
        let s = tonic::Status::invalid_argument("params.top_p must be in (0, 1], got 1.5");
        assert_eq!(
            status_line(&s),
            "INVALID_ARGUMENT: params.top_p must be in (0, 1], got 1.5"
        );
        assert_eq!(status_line(&tonic::Status::unavailable("")), "UNAVAILABLE");
    }

    #[test]
    fn numbers() {
        assert_eq!(format_number(40.0), "40");
        assert_eq!(format_number(0.95), "0.95");
        assert_eq!(format_number(-1.0), "-1");
        assert_eq!(format_number(f64::from(1.1f32)), "1.1");
    }
}
