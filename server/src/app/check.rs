//! `samplerd check-config`: the effective configuration, the loaded stages
//! and the default chain — or the first problem, naming the key and the
//! source that set it (file, environment variable, flag or default).

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::path::Path;

use crate::app::config::{self, CliOverrides, ConfigError, LoadedConfig};
use crate::app::server::load_registry;
use crate::service::Defaults;

/// Loads everything `serve` would load and renders a report.
pub fn check_config(config_file: Option<&Path>, cli: &CliOverrides) -> Result<String, ConfigError> {
    let loaded = config::load(config_file, cli)?;
    let registry = load_registry(&loaded.config).map_err(|e| plugin_error(&loaded, e))?;
    let defaults = Defaults::build(&loaded.config, &registry).map_err(|e| {
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
    Ok(out)
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
