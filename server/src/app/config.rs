//! Configuration: one typed struct per component, each default written
//! once, in its component's `Default` impl: the ones below (the listen
//! address, `[plugins]`, `[logging]`, `[model]`), and beside their
//! components `[chain]` and the seed (`service/defaults.rs`), `[limits]`
//! (`service/limits.rs`), `[generate]` (`generate/mod.rs`), `[metrics]`
//! (`transport/metrics.rs`), `[shutdown]` (`app/shutdown.rs`),
//! `[limits.parallel_logprob]` (`service/lse_helper.rs`), `[tls]` and
//! `[auth]` (derived: nothing set) and `[sampling]`
//! (`samplerd_sampling::SamplingParams`, from the values the core stages
//! declare, `samplerd_plugin_sdk::defaults`). The layers below `app` get
//! their part of it as values. Layered with figment as built-in defaults →
//! `samplerd.toml` (`--config` / `SAMPLERD_CONFIG`) → environment
//! `SAMPLERD_*` (nested keys joined with `__`, e.g.
//! `SAMPLERD_SAMPLING__TOP_K=20`) → command-line flags.
//!
//! Errors name the key and the source that set it (figment metadata).

#![forbid(unsafe_code)]

use std::fmt;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use serde::{Deserialize, Serialize};

use crate::service::constraint::CONSTRAINT_PLUGIN_FILE;
use crate::service::defaults::{ChainConfig, SamplingDefaults};
use crate::service::limits::LimitsConfig;
use crate::transport::listen::{Listen, ListenAddr};

/// Default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
/// Environment prefix of every configuration variable.
pub const ENV_PREFIX: &str = "SAMPLERD_";
/// Environment variable naming the configuration file.
pub const ENV_CONFIG: &str = "SAMPLERD_CONFIG";
/// File name of the core stages plugin, looked up next to the executable
/// when no plugin directory or file is configured.
pub const CORE_PLUGIN_FILE: &str = "libsamplerd_core_stages.so";

/// The whole server configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// gRPC listen address(es): `HOST:PORT` or `unix:/path`, one or a
    /// list (`transport::listen`).
    pub listen: Listen,
    pub plugins: PluginsConfig,
    pub chain: ChainConfig,
    pub sampling: SamplingDefaults,
    pub limits: LimitsConfig,
    pub logging: LoggingConfig,
    pub model: ModelConfig,
    pub generate: crate::generate::GenerateConfig,
    pub metrics: crate::transport::metrics::MetricsConfig,
    pub shutdown: crate::app::shutdown::ShutdownConfig,
    /// Serve gRPC reflection (grpcurl without a .proto). Behind the bearer
    /// token when `[auth]` is on.
    pub reflection: bool,
    pub tls: crate::transport::tls::TlsConfig,
    pub auth: crate::transport::auth::AuthConfig,
    pub transport: crate::transport::listen::TransportConfig,
    /// When responses are compressed.
    pub compression: crate::transport::compression::CompressionConfig,
    /// Named vocabularies for Sample and SampleStream (`NAME = "path"`: a
    /// GGUF or a Hugging Face tokenizer.json), which `params.vocabulary`
    /// names.
    pub vocabularies: std::collections::BTreeMap<String, PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: DEFAULT_LISTEN
                .parse()
                .expect("valid default listen address"),
            plugins: PluginsConfig::default(),
            chain: ChainConfig::default(),
            sampling: SamplingDefaults::default(),
            limits: LimitsConfig::default(),
            logging: LoggingConfig::default(),
            model: ModelConfig::default(),
            generate: crate::generate::GenerateConfig::default(),
            metrics: crate::transport::metrics::MetricsConfig::default(),
            shutdown: crate::app::shutdown::ShutdownConfig::default(),
            reflection: true,
            tls: crate::transport::tls::TlsConfig::default(),
            auth: crate::transport::auth::AuthConfig::default(),
            transport: crate::transport::listen::TransportConfig::default(),
            compression: crate::transport::compression::CompressionConfig::default(),
            vocabularies: Default::default(),
        }
    }
}

/// Where sampler-stage plugins come from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PluginsConfig {
    /// Directories whose `*.so` files are all loaded.
    pub dirs: Vec<PathBuf>,
    /// Individual plugin libraries.
    pub files: Vec<PathBuf>,
    /// Load plugins even when they (or their directory) are group/world-
    /// writable or owned by another user than the service user or root.
    pub allow_untrusted_permissions: bool,
    /// SHA-256 pins by library file name: `{ "libfoo.so" = "<64 hex>" }`;
    /// a mismatch refuses start-up.
    pub sha256: std::collections::BTreeMap<String, String>,
}

impl PluginsConfig {
    /// The (dirs, files) to load. With nothing configured: the core stages
    /// library next to the running executable (`target/<profile>/` for
    /// cargo builds), and the constraint library when it is there too —
    /// those files, never the whole directory.
    pub fn resolve(&self) -> (Vec<PathBuf>, Vec<PathBuf>) {
        if self.dirs.is_empty() && self.files.is_empty() {
            let exe_dir = std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(Path::to_path_buf))
                .unwrap_or_else(|| PathBuf::from("."));
            let constraint = exe_dir.join(CONSTRAINT_PLUGIN_FILE);
            let mut files = vec![exe_dir.join(CORE_PLUGIN_FILE)];
            files.extend(constraint.is_file().then_some(constraint));
            (Vec::new(), files)
        } else {
            (self.dirs.clone(), self.files.clone())
        }
    }

    /// The trust checks every plugin passes before it is opened.
    pub fn trust_policy(&self) -> samplerd_sampling::TrustPolicy {
        samplerd_sampling::TrustPolicy {
            allow_untrusted_permissions: self.allow_untrusted_permissions,
            sha256: self.sha256.clone(),
            ..Default::default()
        }
    }
}

/// Log output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Logging.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoggingConfig {
    /// `RUST_LOG`-style filter (`RUST_LOG`, when set, wins).
    pub filter: String,
    /// `text` or `json`.
    pub format: LogFormat,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        LoggingConfig {
            filter: "info".to_string(),
            format: LogFormat::Text,
        }
    }
}

/// The model host (Generate).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// GGUF model file; unset = no model (Generate answers
    /// FAILED_PRECONDITION).
    pub path: Option<PathBuf>,
    /// Where the forward pass runs: "auto" (CUDA when a GPU, its driver and
    /// NVRTC are present, else the CPU), "cuda" (a start-up error without
    /// one) or "cpu".
    pub device: samplerd_model::DeviceRequest,
    /// Whose arithmetic order the forward pass follows: "portable" (llama.cpp's
    /// AVX2 build's, on every CPU and on CUDA: every node of a fleet gives a
    /// request the same tokens) or "native" (the llama.cpp build native to
    /// this CPU: AVX-512's where the CPU has it).
    pub numerics: samplerd_model::Numerics,
    /// A second, smaller GGUF sharing the model's vocabulary, loaded beside
    /// it (same device and numerics) to draft tokens for Generate requests
    /// with `speculation.source = DRAFT_SOURCE_MODEL`; unset = those are
    /// refused. A vocabulary mismatch is a start-up error naming both files.
    pub draft_path: Option<PathBuf>,
}

/// Command-line overrides (the last layer). `None`/empty = not given.
#[derive(Clone, Debug, Default)]
pub struct CliOverrides {
    /// `--listen`, repeatable.
    pub listen: Vec<ListenAddr>,
    pub plugin_dirs: Vec<PathBuf>,
    pub model: Option<PathBuf>,
    pub auth_tokens_file: Option<PathBuf>,
}

/// Name of the command-line source in error messages.
const CLI_SOURCE: &str = "command-line flag";

impl Provider for CliOverrides {
    fn metadata(&self) -> Metadata {
        Metadata::named(CLI_SOURCE)
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let mut root = Dict::new();
        if !self.listen.is_empty() {
            let list: Vec<String> = self.listen.iter().map(ToString::to_string).collect();
            root.insert("listen".into(), list.into());
        }
        if !self.plugin_dirs.is_empty() {
            let dirs: Vec<String> = self
                .plugin_dirs
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            let mut plugins = Dict::new();
            plugins.insert("dirs".into(), dirs.into());
            root.insert("plugins".into(), plugins.into());
        }
        if let Some(model) = &self.model {
            let mut m = Dict::new();
            m.insert("path".into(), model.display().to_string().into());
            root.insert("model".into(), m.into());
        }
        if let Some(tokens) = &self.auth_tokens_file {
            let mut a = Dict::new();
            a.insert("tokens_file".into(), tokens.display().to_string().into());
            root.insert("auth".into(), a.into());
        }
        Ok(Profile::Default.collect(root))
    }
}

/// A configuration problem, naming the key and where its value came from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Figment(String),
    /// A file the configuration names cannot be used (the message names
    /// the key and the path).
    #[error("{message} (set by {origin})")]
    File { origin: String, message: String },
    #[error("{key} = {value} (from {origin}): {message}")]
    Invalid {
        key: String,
        value: String,
        origin: String,
        message: String,
    },
}

/// The assembled layers and the typed result.
pub struct LoadedConfig {
    pub config: Config,
    pub figment: Figment,
}

impl LoadedConfig {
    /// Where `key` (dotted path) got its value: "file /x/samplerd.toml",
    /// "environment variable `SAMPLERD_LISTEN`", "command-line flag" or
    /// "built-in default".
    pub fn source_of(&self, key: &str) -> String {
        source_of(&self.figment, key)
    }

    /// A validation error for `key`.
    pub fn invalid(
        &self,
        key: &str,
        value: impl fmt::Display,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError::Invalid {
            key: key.to_string(),
            value: value.to_string(),
            origin: self.source_of(key),
            message: message.into(),
        }
    }
}

fn source_of(figment: &Figment, key: &str) -> String {
    match figment.find_metadata(key) {
        Some(md) => describe_metadata(md, key),
        None => "built-in default".to_string(),
    }
}

fn describe_metadata(md: &Metadata, key: &str) -> String {
    let name = md.name.to_string();
    match &md.source {
        Some(figment::Source::File(path)) => format!("{name} {}", path.display()),
        _ if name.contains("environment") => {
            let var = format!("{ENV_PREFIX}{}", key.replace('.', "__").to_uppercase());
            format!("environment variable `{var}`")
        }
        _ => name,
    }
}

/// Builds the figment: defaults → file → env → flags. `config_file`
/// overrides `SAMPLERD_CONFIG`; with neither, `./samplerd.toml` is read
/// when present.
pub fn figment(config_file: Option<&Path>, cli: &CliOverrides) -> Figment {
    let file = config_file
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(ENV_CONFIG).map(PathBuf::from));
    let mut f = Figment::from(Serialized::defaults(Config::default()));
    f = match file {
        // An explicitly named file must exist.
        Some(path) => f.merge(Toml::file_exact(path)),
        None => f.merge(Toml::file("samplerd.toml")),
    };
    // Only variables naming a configuration section are config: other
    // SAMPLERD_* variables (samplerctl's SAMPLERD_ADDR / SAMPLERD_TOKEN, test
    // and script settings) share the prefix and must not break start-up.
    let env = Env::prefixed(ENV_PREFIX)
        .filter(|key| {
            let key = key.as_str().to_ascii_lowercase();
            match key.split_once("__") {
                Some((section, _)) => CONFIG_SECTIONS.contains(&section),
                // A bare name can only be a scalar key: `SAMPLERD_MODEL`
                // is not the `[model]` table.
                None => CONFIG_SCALARS.contains(&key.as_str()),
            }
        })
        .split("__");
    f.merge(env).merge(cli.clone())
}

/// Top-level tables of [`Config`] (set as `SAMPLERD_<TABLE>__<KEY>`).
const CONFIG_SECTIONS: &[&str] = &[
    "plugins",
    "chain",
    "sampling",
    "limits",
    "logging",
    "model",
    "generate",
    "metrics",
    "shutdown",
    "tls",
    "auth",
    "transport",
    "compression",
    "vocabularies",
];
/// Top-level scalar keys of [`Config`] (set as `SAMPLERD_<KEY>`).
const CONFIG_SCALARS: &[&str] = &["listen", "reflection"];

/// Loads and type-checks the configuration (no plugin checks; see
/// `check::check_config` for the chain).
pub fn load(config_file: Option<&Path>, cli: &CliOverrides) -> Result<LoadedConfig, ConfigError> {
    let figment = figment(config_file, cli);
    let config: Config = figment
        .extract()
        .map_err(|e| ConfigError::Figment(format_figment_error(e)))?;
    let loaded = LoadedConfig { config, figment };
    validate(&loaded)?;
    Ok(loaded)
}

/// Every figment error on its own line, each naming key and source.
fn format_figment_error(err: figment::Error) -> String {
    let mut lines = Vec::new();
    for e in err {
        let key = e.path.join(".");
        let source = e
            .metadata
            .as_ref()
            .map(|md| describe_metadata(md, &key))
            .unwrap_or_else(|| "built-in default".to_string());
        let key = if key.is_empty() {
            "(root)".to_string()
        } else {
            key
        };
        lines.push(format!("{key} (from {source}): {}", e.kind));
    }
    lines.join("\n")
}

/// Checks that do not need plugins (the sampling defaults' ranges are
/// their stages' to check, when the default chain is built).
fn validate(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let c = &loaded.config;
    let limits: [(&str, usize); 5] = [
        ("limits.max_message_bytes", c.limits.max_message_bytes),
        ("limits.max_batch_rows", c.limits.max_batch_rows),
        ("limits.max_vocab", c.limits.max_vocab),
        (
            "limits.max_concurrent_streams",
            c.limits.max_concurrent_streams,
        ),
        ("limits.max_window_tokens", c.limits.max_window_tokens),
    ];
    for (key, v) in limits {
        if v == 0 {
            return Err(loaded.invalid(key, v, "must be > 0"));
        }
    }
    validate_constraint_limits(loaded)?;
    let markers = &c.generate.reasoning_markers;
    if !matches!(markers.len(), 0 | 2) {
        let shown: String = format!("{markers:?}").chars().take(200).collect();
        return Err(loaded.invalid(
            "generate.reasoning_markers",
            shown,
            format!(
                "must be empty (the vocabulary's <think> and </think> tokens) or exactly two \
                 strings [open, close]; got {}",
                markers.len()
            ),
        ));
    }
    if let (Some(draft), None) = (&c.model.draft_path, &c.model.path) {
        return Err(loaded.invalid(
            "model.draft_path",
            draft.display(),
            "is set but model.path is not: a draft model drafts for a model",
        ));
    }
    if c.shutdown.grace_period_secs > crate::app::shutdown::MAX_GRACE_PERIOD_SECS {
        return Err(loaded.invalid(
            "shutdown.grace_period_secs",
            c.shutdown.grace_period_secs,
            format!(
                "must be at most {}",
                crate::app::shutdown::MAX_GRACE_PERIOD_SECS
            ),
        ));
    }
    let security: [(&str, u64); 9] = [
        (
            "limits.max_streams_per_connection",
            u64::from(c.limits.max_streams_per_connection),
        ),
        (
            "limits.max_request_duration_secs",
            c.limits.max_request_duration_secs,
        ),
        ("limits.max_chain_stages", c.limits.max_chain_stages as u64),
        ("limits.max_step_ms", c.limits.max_step_ms),
        ("limits.max_connections", c.limits.max_connections as u64),
        ("limits.handshake_timeout_ms", c.limits.handshake_timeout_ms),
        (
            "limits.idle_connection_timeout_secs",
            c.limits.idle_connection_timeout_secs,
        ),
        (
            "limits.keepalive_interval_secs",
            c.limits.keepalive_interval_secs,
        ),
        (
            "limits.keepalive_timeout_secs",
            c.limits.keepalive_timeout_secs,
        ),
    ];
    for (key, v) in security {
        if v == 0 {
            return Err(loaded.invalid(key, v, "must be > 0"));
        }
    }
    if let Err((key, message)) = c.tls.check(&c.listen) {
        let value = figment_value(&loaded.figment, key);
        return Err(loaded.invalid(key, value, message));
    }
    if tracing_subscriber::EnvFilter::try_new(&c.logging.filter).is_err() {
        return Err(loaded.invalid(
            "logging.filter",
            &c.logging.filter,
            "not a valid RUST_LOG-style filter",
        ));
    }
    Ok(())
}

/// The constraint compiler's limits: positive, and small enough that the
/// compile threads' stack (sized from depth and rules) stays under
/// [`crate::service::constraint::MAX_STACK_BYTES`].
fn validate_constraint_limits(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let l = &loaded.config.limits;
    let positive: [(&str, u64); 4] = [
        ("limits.max_constraint_depth", l.max_constraint_depth as u64),
        ("limits.max_constraint_rules", l.max_constraint_rules as u64),
        (
            "limits.constraint_compile_threads",
            l.constraint_compile_threads as u64,
        ),
        (
            "limits.max_constraint_compile_ms",
            l.max_constraint_compile_ms,
        ),
    ];
    for (key, v) in positive {
        if v == 0 {
            return Err(loaded.invalid(key, v, "must be > 0"));
        }
    }
    let stack =
        crate::service::constraint::stack_bytes(l.max_constraint_depth, l.max_constraint_rules);
    let max = crate::service::constraint::MAX_STACK_BYTES;
    if stack > max {
        return Err(loaded.invalid(
            "limits.max_constraint_rules",
            l.max_constraint_rules,
            format!(
                "with limits.max_constraint_depth = {} the compile threads would need {} MiB of \
                 stack, over the {} MiB allowed: lower one of them",
                l.max_constraint_depth,
                stack >> 20,
                max >> 20
            ),
        ));
    }
    Ok(())
}

fn figment_value(f: &Figment, key: &str) -> String {
    f.find_value(key)
        .ok()
        .and_then(|v| serde_json::to_string(&v).ok())
        .unwrap_or_else(|| "?".to_string())
}

/// The effective configuration as TOML (for `check-config`).
pub fn to_toml(config: &Config) -> String {
    toml::to_string_pretty(config).unwrap_or_else(|e| format!("# cannot render: {e}"))
}

#[cfg(test)]
mod tests {
    use samplerd_sampling::SamplingParams;

    use crate::service::defaults::SeedSetting;

    #[test]
    fn env_sections_are_exactly_the_config_sections() {
        let v = serde_json::to_value(Config::default()).unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut sections = [CONFIG_SECTIONS, CONFIG_SCALARS].concat();
        sections.sort_unstable();
        assert_eq!(keys, sections);
    }

    #[test]
    // figment::Jail's closure must return figment's own (large) error type.
    #[allow(clippy::result_large_err)]
    fn unrelated_samplerd_variables_are_not_config() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("SAMPLERD_ADDR", "http://x:1");
            jail.set_env("SAMPLERD_MODEL", "/nope.gguf");
            jail.set_env("SAMPLERD_LIMITS__MAX_VOCAB", "1000");
            let c: Config = figment(None, &CliOverrides::default()).extract().unwrap();
            assert_eq!(c.limits.max_vocab, 1000);
            assert_eq!(c.model.path, None);
            Ok(())
        });
    }

    use super::*;

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = Config::default();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.sampling.seed, SeedSetting::Fixed(42));
        assert_eq!(c.limits.max_message_bytes, 64 << 20);
        assert_eq!(c.limits.max_vocab, 262_144);
    }

    #[test]
    fn seed_random_parses() {
        let f = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string("[sampling]\nseed = \"random\"\n"));
        let c: Config = f.extract().unwrap();
        assert_eq!(c.sampling.seed, SeedSetting::Random);
    }

    /// `[sampling]` is the sampling crate's own parameters beside `seed`:
    /// every typed field is settable there, `order` is not (it is
    /// `chain.order`).
    #[test]
    fn sampling_section_is_the_sampling_params() {
        let f = Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(
            "[sampling]\nseed = 7\ntop_p = 0.5\nxtc_threshold = 0.2\n",
        ));
        let c: Config = f.extract().unwrap();
        assert_eq!(c.sampling.seed, SeedSetting::Fixed(7));
        assert_eq!(c.sampling.params.top_p, 0.5);
        assert_eq!(c.sampling.params.xtc_threshold, 0.2);
        assert_eq!(c.sampling.params.top_k, SamplingParams::default().top_k);
        let f = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string("[sampling]\norder = [\"top_k\"]\n"));
        let msg = format_figment_error(f.extract::<Config>().unwrap_err());
        assert!(msg.contains("chain.order"), "{msg}");
    }

    #[test]
    fn unknown_key_names_key_and_source() {
        let f = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string("[sampling]\ntop_kk = 3\n"));
        let msg = format_figment_error(f.extract::<Config>().unwrap_err());
        assert!(msg.contains("sampling"), "{msg}");
        assert!(msg.contains("top_kk"), "{msg}");
    }
}
