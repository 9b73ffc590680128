//! `samplerctl generate PROMPT`: the Generate RPC, streamed to stdout as
//! tokens arrive, then a one-line summary on stderr (tokens, tokens/s,
//! finish reason, seed). `--json` prints one JSON object per message.
//! Ctrl-C drops the stream (the server sees the cancellation) and exits 130.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Instant;

use samplerd_api::v1::generate_response::Event;
use samplerd_api::v1::{ChatMessage, DraftSource, Finished, GenerateRequest, Speculation};

use crate::cli::{ConnArgs, DraftSourceArg, GenerateArgs};
use crate::commands::Interrupted;
use crate::connect::connect;
use crate::output::{Style, finish_reason_name, generate_response_json, paint_err};
use crate::params::sampling_params;

/// Builds the request: `prompt`, or `messages` with --chat/--system/--user.
fn request(args: &GenerateArgs) -> GenerateRequest {
    let chat = args.chat || args.system.is_some() || !args.user.is_empty();
    let (prompt, messages) = if chat {
        let mut m = Vec::new();
        if let Some(s) = &args.system {
            m.push(ChatMessage {
                role: "system".into(),
                content: s.clone(),
            });
        }
        for content in std::iter::once(&args.prompt).chain(&args.user) {
            m.push(ChatMessage {
                role: "user".into(),
                content: content.clone(),
            });
        }
        (String::new(), m)
    } else {
        (args.prompt.clone(), Vec::new())
    };
    GenerateRequest {
        prompt,
        messages,
        max_tokens: args.max_tokens,
        params: Some(sampling_params(&args.sampling)),
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        n_probs: args.n_probs,
        post_sampling_probs: args.post_sampling_probs,
        min_tokens: args.min_tokens,
        stop_token_ids: args.stop_token_ids.clone(),
        bad_words: args.bad_words.clone(),
        penalize_prompt: args.no_penalize_prompt.then_some(false),
        reasoning_budget: args.reasoning_budget,
        reasoning_budget_message: args.reasoning_budget_message.clone(),
        n: args.choices,
        speculation: args.speculate.map(|source| Speculation {
            source: match source {
                DraftSourceArg::PromptLookup => DraftSource::PromptLookup,
                DraftSourceArg::Model => DraftSource::Model,
            } as i32,
            max_draft_tokens: args.max_draft.unwrap_or(0),
        }),
        ..Default::default()
    }
}

/// Runs `generate`.
pub async fn run(conn: &ConnArgs, args: GenerateArgs) -> anyhow::Result<ExitCode> {
    let c = connect(conn).await?;
    let mut client = c.sampler();
    let started = Instant::now();
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);

    let mut stream = tokio::select! {
        r = client.generate(request(&args)) => r?.into_inner(),
        _ = &mut ctrl_c => return Err(Interrupted.into()),
    };

    let mut stdout = std::io::stdout().lock();
    let mut tokens = 0u64;
    let mut first_token: Option<Instant> = None;
    let mut finished: Option<Finished> = None;
    // With several choices, each one's text until its Finished.
    let several = args.choices > 1;
    let mut texts = vec![String::new(); args.choices as usize];
    loop {
        let msg = tokio::select! {
            m = stream.message() => match m {
                Ok(m) => m,
                Err(status) => {
                    // Finish the partial line before the error line.
                    if !args.json && tokens > 0 {
                        let _ = writeln!(stdout);
                    }
                    return Err(status.into());
                }
            },
            _ = &mut ctrl_c => {
                // Dropping the stream resets the HTTP/2 stream: the server
                // sees the cancellation and stops generating.
                drop(stream);
                let _ = stdout.flush();
                if !args.json {
                    eprintln!();
                }
                eprintln!("{}", paint_err(Style::Yellow, "interrupted"));
                return Err(Interrupted.into());
            }
        };
        let Some(msg) = msg else { break };
        if args.json {
            writeln!(stdout, "{}", generate_response_json(&msg))?;
            stdout.flush()?;
        }
        match msg.event {
            Some(Event::Token(t)) if several => {
                tokens += 1;
                first_token.get_or_insert_with(Instant::now);
                if let Some(text) = texts.get_mut(t.choice as usize) {
                    text.push_str(&t.text);
                }
            }
            Some(Event::Finished(f)) if several => {
                if !args.json {
                    let text = texts.get(f.choice as usize).map_or("", String::as_str);
                    writeln!(
                        stdout,
                        "--- choice {} (seed {}, {}) ---",
                        f.choice,
                        f.seed,
                        finish_reason_name(f.finish_reason)
                    )?;
                    writeln!(stdout, "{text}{}", f.text)?;
                    stdout.flush()?;
                }
                if f.choice == 0 {
                    finished = Some(f);
                }
            }
            Some(Event::Token(t)) => {
                tokens += 1;
                first_token.get_or_insert_with(Instant::now);
                if !args.json && !t.text.is_empty() {
                    stdout.write_all(t.text.as_bytes())?;
                    stdout.flush()?;
                }
            }
            Some(Event::Finished(f)) => {
                // Text held back until the end (a possible stop-string
                // prefix, an incomplete character) is released here.
                if !args.json && !f.text.is_empty() {
                    stdout.write_all(f.text.as_bytes())?;
                    stdout.flush()?;
                }
                finished = Some(f);
            }
            // samplerctl does not ask for them; `--json` prints any.
            Some(Event::PromptLogprobs(_)) | None => {}
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    if !args.json {
        writeln!(stdout)?;
        stdout.flush()?;
    }
    drop(stdout);

    let Some(f) = finished else {
        anyhow::bail!("the stream ended without a Finished message after {tokens} tokens");
    };
    // Several choices: every choice's tokens, at the rate they arrived.
    let completion = match &f.usage {
        Some(u) if !several => u64::from(u.completion_tokens),
        _ => tokens,
    };
    let reported = f.timings.as_ref().map(|t| t.decode_tokens_per_second);
    let tps = match reported.filter(|_| !several) {
        Some(t) if t > 0.0 => t,
        _ => {
            let decode = first_token.map_or(elapsed, |t| t.elapsed().as_secs_f64());
            if decode > 0.0 && completion > 1 {
                (completion - 1) as f64 / decode
            } else {
                completion as f64 / elapsed.max(1e-9)
            }
        }
    };
    let (prompt_tokens, cached) = f
        .usage
        .as_ref()
        .map_or((0, 0), |u| (u.prompt_tokens, u.cached_prompt_tokens));
    let drafts = match f.usage.as_ref() {
        Some(u) if args.speculate.is_some() => format!(
            ", drafts: {} of {} accepted",
            u.accepted_draft_tokens, u.draft_tokens
        ),
        _ => String::new(),
    };
    let numerics = f
        .timings
        .as_ref()
        .map(|t| t.numerics.as_str())
        .filter(|n| !n.is_empty())
        .unwrap_or("not reported");
    if !args.json {
        eprintln!(
            "{}",
            paint_err(
                Style::Dim,
                &format!(
                    "{completion} tokens ({prompt_tokens} prompt, {cached} from the prompt cache) in {elapsed:.2}s, {tps:.1} tokens/s, finish: {}, seed: {}, numerics: {numerics}{drafts}",
                    finish_reason_name(f.finish_reason),
                    f.seed
                )
            )
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::SamplingArgs;

    fn args(prompt: &str) -> GenerateArgs {
        GenerateArgs {
            prompt: prompt.into(),
            chat: false,
            system: None,
            user: vec![],
            max_tokens: Some(16),
            stop: vec!["\n".into()],
            ignore_eos: false,
            min_tokens: 0,
            stop_token_ids: vec![],
            bad_words: vec![],
            no_penalize_prompt: false,
            reasoning_budget: None,
            reasoning_budget_message: String::new(),
            n_probs: 0,
            post_sampling_probs: false,
            json: false,
            choices: 1,
            speculate: None,
            max_draft: None,
            sampling: SamplingArgs::default(),
        }
    }

    #[test]
    fn choices_become_n() {
        assert_eq!(request(&args("hi")).n, 1);
        let mut a = args("hi");
        a.choices = 4;
        assert_eq!(request(&a).n, 4);
    }

    #[test]
    fn raw_prompt_and_chat() {
        let r = request(&args("hi"));
        assert_eq!(r.prompt, "hi");
        assert!(r.messages.is_empty());
        assert_eq!(r.max_tokens, Some(16));

        let mut a = args("hi");
        a.system = Some("be brief".into());
        let r = request(&a);
        assert!(r.prompt.is_empty());
        let roles: Vec<_> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user"]);
        assert_eq!(r.speculation, None);
    }

    #[test]
    fn speculation_flags() {
        let mut a = args("hi");
        a.speculate = Some(DraftSourceArg::PromptLookup);
        let s = request(&a).speculation.unwrap();
        assert_eq!(s.source, DraftSource::PromptLookup as i32);
        assert_eq!(s.max_draft_tokens, 0, "the server's limit");
        a.speculate = Some(DraftSourceArg::Model);
        a.max_draft = Some(4);
        let s = request(&a).speculation.unwrap();
        assert_eq!(s.source, DraftSource::Model as i32);
        assert_eq!(s.max_draft_tokens, 4);
    }
}
