//! `samplerd check-config`: the effective configuration, the loaded stages
//! and the default chain — or the first problem, naming the key and the
//! source that set it (file, environment variable, flag or default). Every
//! file `serve` would open is opened here too (TLS certificate, key and
//! CA, the tokens file, the model's GGUF header, the plugins), so a
//! configuration that passes does not then fail at start-up.

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::path::Path;

use crate::app::config::{self, CliOverrides, ConfigError, LoadedConfig};
use crate::app::server::load_registry;
use crate::service::defaults::Defaults;

/// What `check-config` found in a configuration that passes.
#[derive(Debug)]
pub struct Checked {
    /// The effective configuration, the loaded stages and the default chain.
    pub report: String,
    /// What `serve` would log as a warning at start-up (an expired server
    /// certificate), one line each.
    pub warnings: Vec<String>,
}

/// Loads everything `serve` would load and renders a report.
pub fn check_config(
    config_file: Option<&Path>,
    cli: &CliOverrides,
) -> Result<Checked, ConfigError> {
    let loaded = config::load(config_file, cli)?;
    let warnings = open_files(&loaded)?;
    let registry = load_registry(&loaded.config).map_err(|e| plugin_error(&loaded, e))?;
    let defaults = Defaults::build(
        &loaded.config.chain,
        &loaded.config.sampling,
        loaded.config.limits.max_chain_stages,
        &registry,
    )
    .map_err(|e| {
        let value = loaded
            .figment
            .find_value(&e.key)
            .ok()
            .and_then(|v| serde_json::to_string(&v).ok())
            .unwrap_or_else(|| "(default)".to_string());
        let message = match e.error {
            samplerd_sampling::ChainError::Param { message, .. } => message,
            other => other.to_string(),
        };
        loaded.invalid(&e.key, value, message)
    })?;
    let mut out = String::new();
    let _ = writeln!(out, "# effective configuration");
    out.push_str(&config::to_toml(&loaded.config));
    let _ = writeln!(out, "\n# loaded stages");
    for s in registry.stages() {
        let _ = writeln!(
            out,
            "#   {:<14} {} ({})",
            s.name,
            s.library,
            s.path.display()
        );
    }
    let _ = writeln!(out, "\n# default chain\n#   {}", defaults.chain.describe());
    if loaded.config.model.path.is_some() {
        let numerics = loaded.config.model.numerics;
        let _ = writeln!(
            out,
            "\n# model arithmetic (model.numerics)\n#   {}: {}",
            numerics.describe(),
            match numerics {
                samplerd_model::Numerics::Portable =>
                    "llama.cpp's AVX2 build's order on every CPU (and on CUDA)",
                samplerd_model::Numerics::Native => "the llama.cpp build native to this CPU",
            }
        );
        // Where `serve` would put the model (it refuses to start when this
        // fails, so check-config does too).
        let device = loaded.config.model.device;
        let resolved = samplerd_model::cuda::resolve(device)
            .map_err(|e| loaded.invalid("model.device", device, e.to_string()))?;
        let _ = writeln!(
            out,
            "\n# model device (model.device)\n#   {}: {}",
            resolved.placement, resolved.reason
        );
    }
    Ok(Checked {
        report: out,
        warnings,
    })
}

fn plugin_error(loaded: &LoadedConfig, e: samplerd_sampling::LoadError) -> ConfigError {
    let c = &loaded.config;
    let key = if !c.plugins.files.is_empty() && c.plugins.dirs.is_empty() {
        "plugins.files"
    } else if c.plugins.dirs.is_empty() {
        // Nothing configured: the core library next to the executable.
        return ConfigError::Invalid {
            key: "plugins".into(),
            value: "(none configured)".into(),
            origin: "built-in default: the core stages library next to the executable".into(),
            message: e.to_string(),
        };
    } else {
        "plugins.dirs"
    };
    let value = format!(
        "{:?}",
        if key == "plugins.files" {
            &c.plugins.files
        } else {
            &c.plugins.dirs
        }
    );
    loaded.invalid(key, value, e.to_string())
}

/// Opens what `serve` reads before it serves: TLS files (their PEM
/// content, the key against the certificate), the bearer-token file, and
/// the model's (and the draft model's) GGUF header, hyper-parameters and
/// tokenizer, the two vocabularies compared (the weights are not read).
/// Returns the warnings `serve` would log.
fn open_files(loaded: &LoadedConfig) -> Result<Vec<String>, ConfigError> {
    use crate::transport::tls::TlsError;
    let c = &loaded.config;
    let file_error = |key: &str, message: String| ConfigError::File {
        origin: loaded.source_of(key),
        message,
    };
    let mut warnings = Vec::new();
    match c.tls.server_config() {
        Ok(tls) => warnings.extend(tls.and_then(|t| t.validity_warning)),
        Err(e) => {
            let key = match &e {
                TlsError::Read { key, .. }
                | TlsError::Content { key, .. }
                | TlsError::Incomplete { key, .. } => key,
                TlsError::Mismatch { .. } => "tls.key_file",
                TlsError::Build(_) => "tls.cert_file",
            };
            return Err(file_error(key, e.to_string()));
        }
    }
    if let Some(path) = &c.auth.tokens_file {
        crate::transport::auth::TokenSet::load(path)
            .map_err(|e| file_error("auth.tokens_file", e.to_string()))?;
    }
    let target = match &c.model.path {
        Some(path) => Some((
            path,
            model_header("model.path", path).map_err(|m| file_error("model.path", m))?,
        )),
        None => None,
    };
    if let Some(draft) = &c.model.draft_path {
        // `config::validate` refused a draft model without a model.
        let Some((path, tokenizer)) = &target else {
            return Ok(warnings);
        };
        let draft_tokenizer = model_header("model.draft_path", draft)
            .map_err(|m| file_error("model.draft_path", m))?;
        crate::generate::draft_model::check_vocabulary(
            (path, tokenizer.vocabulary()),
            (draft, draft_tokenizer.vocabulary()),
        )
        .map_err(|why| {
            file_error(
                "model.draft_path",
                format!(
                    "model.draft_path: the draft model does not share the vocabulary of \
                     model.path {}: {why}",
                    path.display()
                ),
            )
        })?;
    }
    Ok(warnings)
}

/// What `serve` reads of a model file before its weights — the header, the
/// hyper-parameters and the tokenizer (its pre-tokenizer family among
/// them) — or why not, prefixed with `key`.
fn model_header(key: &str, path: &std::path::Path) -> Result<samplerd_model::Tokenizer, String> {
    crate::generate::check_model_file(path).map_err(|e| format!("{key}: {}", e.source))?;
    samplerd_model::gguf::GgufFile::open(path)
        .and_then(|g| {
            g.config()?;
            samplerd_model::Tokenizer::from_gguf(&g)
        })
        .map_err(|e| format!("{key}: {e}"))
}
