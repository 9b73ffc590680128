//! `samplerctl tokenize`, `detokenize` and `info`: the server's tokenizer
//! (the model's, or a named vocabulary's) and what the server is.

use std::io::Read as _;
use std::process::ExitCode;

use samplerd_api::v1;
use serde_json::json;

use crate::cli::{ConnArgs, DetokenizeArgs, InfoArgs, TokenizeArgs};
use crate::connect::connect;
use crate::output::{Style, emit, paint, table};

/// The argument, or all of stdin when it is `-`.
fn text_arg(text: String) -> anyhow::Result<String> {
    if text != "-" {
        return Ok(text);
    }
    let mut s = String::new();
    std::io::stdin().read_to_string(&mut s)?;
    Ok(s)
}

/// Tokenize: the ids, one line, comma-separated (`--json`: an array).
pub async fn tokenize(conn: &ConnArgs, args: TokenizeArgs) -> anyhow::Result<ExitCode> {
    let c = connect(conn).await?;
    let tokens = c
        .sampler()
        .tokenize(v1::TokenizeRequest {
            text: text_arg(args.text)?,
            add_special: args.add_special,
            parse_special: !args.no_parse_special,
            vocabulary: args.vocabulary.unwrap_or_default(),
        })
        .await?
        .into_inner()
        .tokens;
    if args.json {
        emit(&format!("{}\n", json!(tokens)))?;
    } else {
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        emit(&format!("{}\n", ids.join(",")))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Detokenize: the text as it is (no newline added).
pub async fn detokenize(conn: &ConnArgs, args: DetokenizeArgs) -> anyhow::Result<ExitCode> {
    let c = connect(conn).await?;
    let text = c
        .sampler()
        .detokenize(v1::DetokenizeRequest {
            tokens: args.tokens,
            vocabulary: args.vocabulary.unwrap_or_default(),
            skip_special: args.skip_special,
        })
        .await?
        .into_inner()
        .text;
    if args.json {
        emit(&format!("{}\n", json!(text)))?;
    } else {
        emit(&text)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// GetServerInfo, as a listing (`--json`: every field).
pub async fn info(conn: &ConnArgs, args: InfoArgs) -> anyhow::Result<ExitCode> {
    let c = connect(conn).await?;
    let resp = c
        .sampler()
        .get_server_info(v1::GetServerInfoRequest {})
        .await?
        .into_inner();
    if args.json {
        emit(&format!(
            "{}\n",
            serde_json::to_string_pretty(&to_json(&resp))?
        ))?;
    } else {
        emit(&render(&resp))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn limits_rows(l: &v1::ServerLimits) -> Vec<(&'static str, String)> {
    vec![
        ("max_message_bytes", l.max_message_bytes.to_string()),
        ("max_vocab", l.max_vocab.to_string()),
        ("max_n_probs", l.max_n_probs.to_string()),
        ("max_batch_rows", l.max_batch_rows.to_string()),
        ("max_draft_tokens", l.max_draft_tokens.to_string()),
        ("max_window_tokens", l.max_window_tokens.to_string()),
        ("max_chain_stages", l.max_chain_stages.to_string()),
        (
            "max_concurrent_streams",
            l.max_concurrent_streams.to_string(),
        ),
        ("max_constraint_bytes", l.max_constraint_bytes.to_string()),
        (
            "max_request_duration_secs",
            l.max_request_duration_secs.to_string(),
        ),
        ("max_tokens", l.max_tokens.to_string()),
        ("default_max_tokens", l.default_max_tokens.to_string()),
        ("max_prompt_bytes", l.max_prompt_bytes.to_string()),
        ("max_prompt_tokens", l.max_prompt_tokens.to_string()),
        (
            "max_generate_request_bytes",
            l.max_generate_request_bytes.to_string(),
        ),
        ("max_stop_strings", l.max_stop_strings.to_string()),
        ("max_stop_bytes", l.max_stop_bytes.to_string()),
    ]
}

fn render(r: &v1::GetServerInfoResponse) -> String {
    let mut out = String::new();
    let build = r.build.clone().unwrap_or_default();
    let mut head = vec![
        vec!["version".to_string(), r.version.clone()],
        vec![
            "build".to_string(),
            [
                build.git_describe.as_str(),
                build.profile.as_str(),
                &build.target_features.join("+"),
            ]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" "),
        ],
        vec!["device".to_string(), r.device.clone()],
    ];
    match &r.model {
        Some(m) => {
            let weights: Vec<String> = m
                .weight_types
                .iter()
                .map(|(k, v)| format!("{k}×{v}"))
                .collect();
            head.push(vec!["model".to_string(), m.file_name.clone()]);
            head.push(vec!["architecture".to_string(), m.architecture.clone()]);
            head.push(vec!["weights".to_string(), weights.join(" ")]);
            head.push(vec!["n_vocab".to_string(), m.n_vocab.to_string()]);
            head.push(vec!["n_ctx".to_string(), m.n_ctx.to_string()]);
            head.push(vec!["numerics".to_string(), r.numerics.clone()]);
        }
        None => head.push(vec!["model".to_string(), "none".to_string()]),
    }
    head.push(vec![
        "request id header".to_string(),
        r.request_id_header.clone(),
    ]);
    out.push_str(&format!("{}\n", paint(Style::Bold, "Server")));
    out.push_str(&table(&["", ""], &head));
    if !r.vocabularies.is_empty() {
        out.push_str(&format!("\n{}\n", paint(Style::Bold, "Vocabularies")));
        let rows: Vec<Vec<String>> = r
            .vocabularies
            .iter()
            .map(|v| vec![v.name.clone(), v.n_vocab.to_string(), v.path.clone()])
            .collect();
        out.push_str(&table(&["NAME", "TOKENS", "PATH"], &rows));
    }
    if let Some(l) = &r.limits {
        out.push_str(&format!("\n{}\n", paint(Style::Bold, "Limits")));
        let rows: Vec<Vec<String>> = limits_rows(l)
            .into_iter()
            .map(|(k, v)| vec![k.to_string(), v])
            .collect();
        out.push_str(&table(&["LIMIT", "VALUE"], &rows));
    }
    out
}

fn to_json(r: &v1::GetServerInfoResponse) -> serde_json::Value {
    let build = r.build.clone().unwrap_or_default();
    json!({
        "version": r.version,
        "build": {
            "git_describe": build.git_describe,
            "profile": build.profile,
            "target_features": build.target_features,
        },
        "model": r.model.as_ref().map(|m| json!({
            "file_name": m.file_name,
            "architecture": m.architecture,
            "weight_types": m.weight_types,
            "n_vocab": m.n_vocab,
            "n_ctx": m.n_ctx,
        })),
        "numerics": r.numerics,
        "device": r.device,
        "vocabularies": r.vocabularies.iter().map(|v| json!({
            "name": v.name, "n_vocab": v.n_vocab, "path": v.path,
        })).collect::<Vec<_>>(),
        "limits": r.limits.as_ref().map(|l| limits_rows(l)
            .into_iter()
            .map(|(k, v)| (k.to_string(), json!(v.parse::<u64>().unwrap_or_default())))
            .collect::<serde_json::Map<_, _>>()),
        "request_id_header": r.request_id_header,
    })
}
