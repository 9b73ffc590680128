//! The `samplerd` binary: `serve` (default), `check-config` and
//! `bench-chain`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use samplerd::app::config::{self, CliOverrides};
use samplerd::app::server;
use samplerd::service::defaults::Defaults;

/// Default vocabulary of `bench-chain` (Qwen's).
const BENCH_VOCAB: usize = 151_936;
/// Default iterations of `bench-chain`.
const BENCH_ITERATIONS: usize = 1000;
/// After `serve` returns, how long tasks still running (connections cut at
/// the end of the grace period) get to stop before the process exits.
const RUNTIME_SHUTDOWN: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Parser)]
#[command(
    name = "samplerd",
    version,
    about = "gRPC sampling server: logits in, next token out"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the samplerd.v1.Sampler gRPC API (the default).
    Serve(ServeArgs),
    /// Print the effective configuration and the default chain; exit
    /// non-zero naming the key and its source on anything invalid.
    CheckConfig(ServeArgs),
    /// Time the default chain on random logits (plugins loaded as `serve`).
    BenchChain(BenchArgs),
}

#[derive(Args, Default)]
struct ConfigArgs {
    /// Configuration file (default: $SAMPLERD_CONFIG, else ./samplerd.toml if present).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

#[derive(Args, Default)]
struct ServeArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Listen address: HOST:PORT or unix:/path/samplerd.sock; repeatable
    /// (config `listen`, env SAMPLERD_LISTEN).
    #[arg(long, value_name = "ADDR")]
    listen: Vec<samplerd::transport::listen::ListenAddr>,
    /// Plugin directory; repeatable (config `plugins.dirs`).
    #[arg(long = "plugin-dir", value_name = "DIR")]
    plugin_dirs: Vec<PathBuf>,
    /// GGUF model for Generate (config `model.path`).
    #[arg(long, value_name = "PATH")]
    model: Option<PathBuf>,
    /// Bearer-token file, one token per line; enables authentication
    /// (config `auth.tokens_file`, env SAMPLERD_AUTH__TOKENS_FILE).
    #[arg(long, value_name = "FILE")]
    auth_tokens_file: Option<PathBuf>,
}

impl ServeArgs {
    fn overrides(&self) -> CliOverrides {
        CliOverrides {
            listen: self.listen.clone(),
            plugin_dirs: self.plugin_dirs.clone(),
            model: self.model.clone(),
            auth_tokens_file: self.auth_tokens_file.clone(),
        }
    }
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    config: ConfigArgs,
    /// Vocabulary size (number of logits).
    #[arg(long, default_value_t = BENCH_VOCAB)]
    vocab: usize,
    /// Timed iterations.
    #[arg(long, default_value_t = BENCH_ITERATIONS)]
    iterations: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// glibc malloc arenas for the whole process. glibc gives busy threads
/// their own arena (up to 8 per core); with ~100 runtime/blocking threads
/// each copying 0.2–0.6 MB logits messages, the arenas fragment and RSS
/// creeps up (soak: 487 → 540 MiB in 9 min, still rising). Two arenas kept
/// it at ~220 MiB and flat, at the same throughput (docs/RELIABILITY.md).
#[cfg(target_env = "gnu")]
const MALLOC_ARENAS: libc::c_int = 2;

/// Caps glibc's malloc arenas unless the operator set `MALLOC_ARENA_MAX`.
/// Runs first in `main`, before any thread exists.
#[cfg(target_env = "gnu")]
fn limit_malloc_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets an allocator tunable; called before any
        // other thread is spawned, so nothing is allocating concurrently.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS);
        }
    }
}

fn main() -> ExitCode {
    #[cfg(target_env = "gnu")]
    limit_malloc_arenas();
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or(Command::Serve(ServeArgs::default())) {
        Command::Serve(args) => serve(args),
        Command::CheckConfig(args) => check(args),
        Command::BenchChain(args) => bench(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("samplerd: {}", describe(&e));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, each cause once: the library
/// errors already quote their source in their own message (`loading
/// plugins: plugin X: …`), so a cause already in the text is not repeated
/// (anyhow's `{:#}` would print it a second time).
fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // First: a plugin that crashes, even while loading, is named on stderr.
    samplerd::crash::install().context("installing the fatal-signal report")?;
    let loaded = config::load(args.config.config.as_deref(), &args.overrides())?;
    let cfg = loaded.config;
    samplerd::app::telemetry::init(&cfg.logging);
    // Before plugins and the model load, so their series are recorded.
    let metrics = if cfg.metrics.enabled {
        let handle = samplerd::transport::metrics::install()?;
        samplerd::generate::describe_metrics();
        samplerd::service::shared_memory::describe_metrics();
        Some(handle)
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // Before plugins and the model load (which can take minutes): a SIGHUP
    // from logrotate then must not kill the start-up either.
    {
        let _runtime = rt.enter();
        samplerd::app::shutdown::ignore_other_signals();
    }
    let registry = server::load_registry(&cfg).context("loading plugins")?;
    let generator: Option<std::sync::Arc<dyn samplerd::generate::generator::Generator>> =
        match &cfg.model.path {
            Some(path) => {
                let started = std::time::Instant::now();
                let placement = samplerd::generate::generator::resolve_device(cfg.model.device)?;
                let host = samplerd::generate::ModelHost::load_on(
                    path,
                    cfg.generate.clone(),
                    &placement,
                    cfg.model.numerics,
                )?;
                let host = match &cfg.model.draft_path {
                    Some(draft) => host.with_draft(draft, &placement)?,
                    None => host,
                };
                metrics::gauge!(samplerd::generate::MODEL_LOAD_METRIC)
                    .set(started.elapsed().as_secs_f64());
                Some(std::sync::Arc::new(host))
            }
            None => None,
        };
    let state = server::build_state(&cfg, registry, generator)?;
    let result = rt.block_on(async move {
        if let Some(handle) = metrics {
            match samplerd::transport::metrics::bind(&cfg.metrics).await {
                Ok(listener) => {
                    tokio::spawn(async move {
                        if let Err(e) = samplerd::transport::metrics::serve(listener, handle).await {
                            tracing::error!(error = %e, "metrics endpoint failed");
                        }
                    });
                }
                // A second local instance on the default port keeps serving
                // gRPC; an explicitly configured address must work.
                Err(e) if cfg.metrics.listen == samplerd::transport::metrics::MetricsConfig::default().listen => {
                    tracing::warn!(error = %e, "metrics endpoint disabled: set metrics.listen to a free address");
                }
                Err(e) => return Err(e.into()),
            }
        }
        // Listening for SIGTERM/SIGINT/SIGQUIT from here on (see
        // `shutdown::signal`).
        let shutdown = samplerd::app::shutdown::signal();
        let bound =
            samplerd::transport::listen::bind(&cfg.listen, cfg.transport.unix_socket_mode).await?;
        server::serve(state, &cfg, bound, shutdown).await?;
        tracing::info!("samplerd stopped");
        Ok(())
    });
    rt.shutdown_timeout(RUNTIME_SHUTDOWN);
    result
}

fn check(args: ServeArgs) -> anyhow::Result<()> {
    let checked =
        samplerd::app::check::check_config(args.config.config.as_deref(), &args.overrides())?;
    for warning in &checked.warnings {
        eprintln!("samplerd: warning: {warning}");
    }
    print!("{}", checked.report);
    Ok(())
}

fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let loaded = config::load(args.config.config.as_deref(), &CliOverrides::default())?;
    let cfg = loaded.config;
    let registry = server::load_registry(&cfg).context("loading plugins")?;
    let defaults = Defaults::build(
        &cfg.chain,
        &cfg.sampling,
        cfg.limits.max_chain_stages,
        &registry,
    )?;
    let report =
        samplerd_sampling::bench::run(&registry, &defaults.spec, args.vocab, args.iterations)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    Ok(())
}
