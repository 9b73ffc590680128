//! `samplerctl stages`: ListStages as a readable table — each loaded stage
//! with its library and description, its parameters with kind, default and
//! description, then the server's default chain. `--json` for scripts.

use std::process::ExitCode;

use samplerd_api::v1::{ListStagesRequest, ListStagesResponse};
use serde_json::json;

use crate::cli::{ConnArgs, StagesArgs};
use crate::connect::connect;
use crate::output::{Style, emit, paint, param_value_json, param_value_text, table};

/// Lists the stages.
pub async fn run(conn: &ConnArgs, args: StagesArgs) -> anyhow::Result<ExitCode> {
    let c = connect(conn).await?;
    let resp = c
        .sampler()
        .list_stages(ListStagesRequest {})
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

/// The human-readable listing.
fn render(resp: &ListStagesResponse) -> String {
    let mut out = String::new();
    let rows: Vec<Vec<String>> = resp
        .stages
        .iter()
        .map(|s| vec![s.name.clone(), s.library.clone(), s.description.clone()])
        .collect();
    out.push_str(&format!(
        "{}\n",
        paint(
            Style::Bold,
            &format!("Loaded stages ({})", resp.stages.len())
        )
    ));
    out.push_str(&table(&["STAGE", "LIBRARY", "DESCRIPTION"], &rows));
    for s in &resp.stages {
        if s.params.is_empty() {
            continue;
        }
        out.push('\n');
        out.push_str(&format!(
            "{}\n",
            paint(Style::Cyan, &format!("{} parameters", s.name))
        ));
        let rows: Vec<Vec<String>> = s
            .params
            .iter()
            .map(|p| {
                vec![
                    format!("  {}", p.name),
                    p.kind.clone(),
                    p.default_value
                        .as_ref()
                        .map(param_value_text)
                        .unwrap_or_else(|| "-".into()),
                    p.description.clone(),
                ]
            })
            .collect();
        out.push_str(&table(
            &["  PARAM", "KIND", "DEFAULT", "DESCRIPTION"],
            &rows,
        ));
    }
    out.push('\n');
    out.push_str(&format!("{}\n", paint(Style::Bold, "Default chain")));
    let names: Vec<&str> = resp.default_chain.iter().map(|s| s.name.as_str()).collect();
    out.push_str(&format!("  {}\n", names.join(" → ")));
    for (i, spec) in resp.default_chain.iter().enumerate() {
        let mut params: Vec<String> = spec
            .params
            .iter()
            .map(|(k, v)| format!("{k}={}", param_value_text(v)))
            .collect();
        params.sort();
        let line = format!("  {:>2}. {} {}", i + 1, spec.name, params.join(" "));
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn to_json(resp: &ListStagesResponse) -> serde_json::Value {
    let spec_json = |s: &samplerd_api::v1::StageSpec| {
        json!({
            "name": s.name,
            "params": s.params.iter().map(|(k, v)| (k.clone(), param_value_json(v))).collect::<serde_json::Map<_, _>>(),
        })
    };
    json!({
        "stages": resp.stages.iter().map(|s| json!({
            "name": s.name,
            "library": s.library,
            "path": s.path,
            "description": s.description,
            "params": s.params.iter().map(|p| json!({
                "name": p.name,
                "kind": p.kind,
                "default": p.default_value.as_ref().map(param_value_json),
                "description": p.description,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "default_chain": resp.default_chain.iter().map(spec_json).collect::<Vec<_>>(),
        "default_chain_description": resp.default_chain_description,
    })
}
