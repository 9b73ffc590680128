//! `samplerctl sample FILE`: one stateless Sample call on logits read from a
//! file or stdin (sent as raw `logits_f32le`). Prints the chosen token id on
//! its own line; with `--n-probs N` also the top candidates of the raw
//! logits and after the chain (a second call with `post_sampling_probs`).

use std::process::ExitCode;

use anyhow::Context as _;
use samplerd_api::v1::{SampleRequest, SampleResponse, TokenProbability};
use serde_json::json;

use crate::cli::{ConnArgs, SampleArgs};
use crate::connect::connect;
use crate::logits_file;
use crate::output::{Style, emit, paint, prob_json, sample_response_json, table};
use crate::params::sampling_params;

/// Runs `sample`.
pub async fn run(conn: &ConnArgs, args: SampleArgs) -> anyhow::Result<ExitCode> {
    // Read the input before connecting: a bad file is reported as such.
    let logits = logits_file::read(&args.file, args.format)?;
    let c = connect(conn).await?;
    let mut client = c.sampler();
    let request = SampleRequest {
        logits: Vec::new(),
        logits_f32le: logits.to_le_bytes().into(),
        previous_tokens: args.prev_tokens.clone(),
        params: Some(sampling_params(&args.sampling)),
        step: args.step,
        n_probs: args.n_probs,
        post_sampling_probs: false,
        constraint_tokens: Vec::new(),
        sparse: None,
        shared: None,
    };
    let raw: SampleResponse = client.sample(request.clone()).await?.into_inner();
    let post = if args.n_probs > 0 {
        let req = SampleRequest {
            post_sampling_probs: true,
            ..request
        };
        Some(
            client
                .sample(req)
                .await
                .context("sample (post-chain probabilities)")?
                .into_inner(),
        )
    } else {
        None
    };

    if args.json {
        let mut obj = sample_response_json(&raw);
        obj["vocab"] = json!(logits.values.len());
        if let Some(p) = &post {
            obj["probs"] = json!(raw.probs.iter().map(prob_json).collect::<Vec<_>>());
            obj["post_sampling_probs"] = json!(p.probs.iter().map(prob_json).collect::<Vec<_>>());
        }
        emit(&format!("{obj}\n"))?;
        return Ok(ExitCode::SUCCESS);
    }

    let mut text = format!("{}\n", raw.token_id);
    if let Some(post) = &post {
        let n = args.n_probs;
        let raw_title = format!("Top {n} of the raw logits (softmax)");
        let post_title = format!("Top {n} after the chain");
        text.push_str(&format!(
            "\n{}\n{}\n{}\n{}\n",
            paint(Style::Bold, &raw_title),
            probs_table(&raw.probs, raw.token_id),
            paint(Style::Bold, &post_title),
            probs_table(&post.probs, raw.token_id),
        ));
        text.push_str(&format!(
            "chosen {} (p={:.4}, logprob={:.4}), seed {}, step {}, vocab {}\n",
            raw.token_id,
            raw.probability,
            raw.logprob,
            raw.seed,
            raw.step,
            logits.values.len()
        ));
    }
    emit(&text)?;
    Ok(ExitCode::SUCCESS)
}

/// Rank, token, probability, logprob; the chosen token is marked `*`.
fn probs_table(probs: &[TokenProbability], chosen: u32) -> String {
    let rows: Vec<Vec<String>> = probs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            vec![
                format!("{}", i + 1),
                format!(
                    "{}{}",
                    p.token_id,
                    if p.token_id == chosen { " *" } else { "" }
                ),
                format!("{:.6}", p.probability),
                format!("{:.4}", p.logprob),
            ]
        })
        .collect();
    table(&["RANK", "TOKEN", "PROB", "LOGPROB"], &rows)
}
