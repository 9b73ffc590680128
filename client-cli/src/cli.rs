//! Command-line arguments: the global connection flags, the sampling flags
//! shared by `generate`, `sample` and `bench` (llama.cpp names), and one
//! struct per subcommand. Parsing only; behaviour lives in `commands/`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Default server address (also `$SAMPLERD_ADDR`).
pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

const EXAMPLES: &str = "\
Examples:
  samplerctl health
  samplerctl stages
  samplerctl info
  samplerctl tokenize \"Hello world\"
  samplerctl generate \"Tell me a story\" -n 64 --seed 1
  samplerctl sample logits.npy --greedy --n-probs 5
  samplerctl bench --rpc sample --concurrency 8 --duration 10 --json
  SAMPLERD_ADDR=http://samplerd.example:50051 samplerctl stages";

/// samplerctl: talk to a running samplerd, see what it does, measure it.
#[derive(Debug, Parser)]
#[command(
    name = "samplerctl",
    version,
    about = "Command-line client for samplerd (samplerd.v1.Sampler)",
    long_about = "Command-line client for samplerd (samplerd.v1.Sampler): generate text, \
                  sample one token from a logits file, list the loaded stages, check health \
                  and benchmark a running server.\n\n\
                  Exit codes: 0 ok, 1 server or transport error (the gRPC status is printed), \
                  2 usage error, 130 interrupted (Ctrl-C).",
    after_help = EXAMPLES
)]
pub struct Cli {
    #[command(flatten)]
    pub conn: ConnArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Connection flags, accepted by every subcommand.
#[derive(Debug, Clone, Args)]
pub struct ConnArgs {
    /// Server address; `host:port` gets `http://` prepended; `unix:/PATH`
    /// is a Unix-domain socket (the server's `--listen unix:/PATH`).
    #[arg(
        long,
        global = true,
        env = "SAMPLERD_ADDR",
        default_value = DEFAULT_ADDR,
        value_name = "URL",
        value_parser = parse_addr
    )]
    pub addr: String,

    /// Timeout in seconds for connecting and for each unary RPC (for a
    /// streaming RPC: until the stream opens; a long generation is not cut).
    #[arg(long, global = true, default_value_t = 30.0, value_name = "SECONDS", value_parser = parse_timeout)]
    pub timeout: f64,

    /// Bearer token, sent as `authorization: Bearer TOKEN` metadata.
    #[arg(
        long,
        global = true,
        env = "SAMPLERD_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub token: Option<String>,

    /// Connect with TLS (implied by an `https://` address or any of the
    /// flags below). Without `--ca-cert` the system's root certificates are
    /// trusted.
    #[arg(long, global = true, env = "SAMPLERD_TLS")]
    pub tls: bool,

    /// PEM CA certificate(s) to verify the server with.
    #[arg(long, global = true, env = "SAMPLERD_CA_CERT", value_name = "FILE")]
    pub ca_cert: Option<PathBuf>,

    /// PEM client certificate for mutual TLS (with `--client-key`).
    #[arg(
        long,
        global = true,
        env = "SAMPLERD_CLIENT_CERT",
        value_name = "FILE",
        requires = "client_key"
    )]
    pub client_cert: Option<PathBuf>,

    /// PEM private key of `--client-cert`.
    #[arg(
        long,
        global = true,
        env = "SAMPLERD_CLIENT_KEY",
        value_name = "FILE",
        requires = "client_cert"
    )]
    pub client_key: Option<PathBuf>,

    /// Name to verify the server certificate against [default: the
    /// address's host].
    #[arg(long, global = true, value_name = "NAME")]
    pub tls_server_name: Option<String>,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate text with the server's model, streamed as it arrives.
    #[command(after_help = "Examples:\n  \
        samplerctl generate \"Tell me a story\" -n 64 --seed 1\n  \
        samplerctl generate --chat --system \"You are terse.\" \"What is 2+2?\"\n  \
        samplerctl generate \"Once upon\" --samplers \"penalties;top_k;top_p;temperature\" --json")]
    Generate(GenerateArgs),
    /// Sample one token from a logits file (.npy, raw f32 LE, JSON) or stdin.
    #[command(after_help = "Examples:\n  \
        samplerctl sample logits.npy --greedy\n  \
        samplerctl sample logits.f32 --seed 7 --prev-tokens 1,2,3 --step 4 --n-probs 5\n  \
        echo '[0.1, 2.5, -1.0]' | samplerctl sample - --greedy")]
    Sample(SampleArgs),
    /// List the loaded stages, their parameters and defaults, and the default chain.
    #[command(after_help = "Example:\n  samplerctl stages")]
    Stages(StagesArgs),
    /// Check the server's health: exit 0 when SERVING, 1 otherwise.
    #[command(after_help = "Example:\n  samplerctl health && echo up")]
    Health(HealthArgs),
    /// Load generator: run Sample or Generate concurrently and report
    /// latency percentiles and throughput.
    #[command(after_help = "Examples:\n  \
        samplerctl bench --rpc sample --concurrency 4 --duration 10\n  \
        samplerctl bench --rpc sample --requests 1000 --vocab 32000 --json\n  \
        samplerctl bench --rpc generate --prompt \"Hello\" --max-tokens 32 --concurrency 2")]
    Bench(BenchArgs),
    /// Text to token ids with the server's tokenizer (the model's, or a
    /// named vocabulary's).
    #[command(after_help = "Examples:\n  \
        samplerctl tokenize \"Hello world\"\n  \
        samplerctl tokenize --vocabulary smollm2 --no-parse-special \"<|im_start|>\"\n  \
        cat prompt.txt | samplerctl tokenize - --json")]
    Tokenize(TokenizeArgs),
    /// Token ids back to text.
    #[command(after_help = "Examples:\n  \
        samplerctl detokenize 19556,905\n  \
        samplerctl detokenize 1,4093,198 --skip-special")]
    Detokenize(DetokenizeArgs),
    /// What the server is: version, build, model, vocabularies and limits.
    #[command(after_help = "Examples:\n  samplerctl info\n  samplerctl info --json")]
    Info(InfoArgs),
}

/// Sampling parameters with llama.cpp's flag names. Only flags given on the
/// command line are sent; anything unset takes the server's configured
/// default (the llama.cpp defaults quoted below unless samplerd.toml
/// changes them).
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Sampling (unset = server default)")]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy [llama.cpp default: 0.8].
    #[arg(long = "temp", visible_alias = "temperature", value_name = "T")]
    pub temp: Option<f32>,
    /// Greedy decoding (same as --temp 0).
    #[arg(long, conflicts_with = "temp")]
    pub greedy: bool,
    /// Keep the K most likely tokens; 0 disables [default: 40].
    #[arg(long, value_name = "K")]
    pub top_k: Option<i32>,
    /// Nucleus sampling threshold; 1.0 disables [default: 0.95].
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Min-p threshold relative to the top token; 0 disables [default: 0.0].
    #[arg(long, value_name = "P")]
    pub min_p: Option<f32>,
    /// Locally typical sampling; 1.0 disables [default: 1.0].
    #[arg(long = "typical", value_name = "P")]
    pub typical_p: Option<f32>,
    /// Repetition penalty; 1.0 disables [default: 1.1].
    #[arg(long, value_name = "X")]
    pub repeat_penalty: Option<f32>,
    /// Tokens of history the penalties look at; 0 disables, -1 = all [default: 64].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub repeat_last_n: Option<i32>,
    /// A token id the penalties never penalise; repeatable.
    #[arg(long = "penalty-exclude-token", value_name = "ID")]
    pub penalty_exclude_tokens: Vec<u32>,
    /// Frequency penalty; 0 disables [default: 0.0].
    #[arg(long, value_name = "X", allow_negative_numbers = true)]
    pub frequency_penalty: Option<f32>,
    /// Presence penalty; 0 disables [default: 0.0].
    #[arg(long, value_name = "X", allow_negative_numbers = true)]
    pub presence_penalty: Option<f32>,
    /// top-n-sigma: keep tokens within N standard deviations of the top logit; <= 0 disables [default: -1].
    #[arg(long = "top-nsigma", value_name = "N", allow_negative_numbers = true)]
    pub top_n_sigma: Option<f32>,
    /// XTC probability; 0 disables [default: 0.0].
    #[arg(long, value_name = "P")]
    pub xtc_probability: Option<f32>,
    /// XTC threshold [default: 0.1].
    #[arg(long, value_name = "P")]
    pub xtc_threshold: Option<f32>,
    /// adaptive-p target probability in [0, 1] (replaces the final draw);
    /// negative disables [default: -1].
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    pub adaptive_target: Option<f32>,
    /// adaptive-p decay, clamped to [0, 0.99] [default: 0.9].
    #[arg(long, value_name = "X")]
    pub adaptive_decay: Option<f32>,
    /// DRY multiplier; 0 disables [default: 0.0].
    #[arg(long, value_name = "X", allow_negative_numbers = true)]
    pub dry_multiplier: Option<f32>,
    /// DRY base: the penalty grows by this factor per repeated token [default: 1.75].
    #[arg(long, value_name = "X")]
    pub dry_base: Option<f32>,
    /// DRY: longest repeat left unpenalised [default: 2].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub dry_allowed_length: Option<i32>,
    /// DRY: tokens of history it looks at; 0 disables, -1 = all [default: -1].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub dry_penalty_last_n: Option<i32>,
    /// DRY sequence breaker, repeatable (llama.cpp style: the first replaces
    /// the defaults "\n" ":" "\"" "*"; `none` clears them; \n, \t, \", \\
    /// escapes are processed).
    #[arg(long = "dry-sequence-breaker", value_name = "STRING")]
    pub dry_sequence_breakers: Vec<String>,
    /// RNG seed [default: the server's, 42 unless configured].
    #[arg(short = 's', long, value_name = "SEED")]
    pub seed: Option<u64>,
    /// Logit bias, llama.cpp style TOKEN_ID(+|-)BIAS, e.g. `15043+1` or
    /// `15043-inf` (ban); repeatable.
    #[arg(short = 'l', long = "logit-bias", value_name = "ID(+|-)BIAS", value_parser = parse_logit_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Stage order, `;`-separated stage names (llama.cpp --samplers), e.g.
    /// "penalties;top_k;top_p;temperature"; the final draw is appended by
    /// the server [default: the server's chain order].
    #[arg(long, value_name = "NAMES")]
    pub samplers: Option<String>,
    #[command(flatten)]
    pub constraint: ConstraintArgs,
    /// Whitespace between JSON tokens under `--json-schema` or
    /// `--json-object`: `bounded` (the server's default: one space, or one
    /// or two newlines then at most 20 spaces or tabs), `compact` (none) or
    /// `free` (any).
    #[arg(long, value_enum, value_name = "MODE", requires = "constraint")]
    pub json_whitespace: Option<JsonWhitespaceArg>,
    /// A vocabulary the server loaded (`[vocabularies]`; `samplerctl
    /// stages` lists them), for `sample` with a constraint: the logits
    /// must have one entry per token of it. `generate` uses the model's.
    #[arg(long, value_name = "NAME")]
    pub vocabulary: Option<String>,
}

/// `--json-whitespace`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum JsonWhitespaceArg {
    Bounded,
    Compact,
    Free,
}

/// Structured output: at most one of these.
#[derive(Debug, Clone, Default, Args)]
#[group(id = "constraint", multiple = false)]
pub struct ConstraintArgs {
    /// Hold the output to one JSON value valid under the JSON Schema in
    /// FILE, e.g. `--json-schema person.schema.json`.
    #[arg(long, value_name = "FILE", value_parser = read_text_file)]
    pub json_schema: Option<String>,
    /// The whole output matches this regular expression, e.g.
    /// `--regex '[0-9]{3}-[0-9]{4}'`.
    #[arg(long, value_name = "REGEX")]
    pub regex: Option<String>,
    /// A grammar file: llama.cpp GBNF (`.gbnf`, root rule `root`), or
    /// llguidance's Lark syntax when the file ends in `.lark`.
    #[arg(long, value_name = "FILE", value_parser = read_grammar_file)]
    pub grammar: Option<GrammarFile>,
    /// Any JSON object.
    #[arg(long)]
    pub json_object: bool,
    /// Exactly one of these `;`-separated strings, e.g. `--choice "yes;no"`.
    #[arg(long, value_name = "A;B")]
    pub choice: Option<String>,
}

/// A grammar file's syntax and text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrammarFile {
    Gbnf(String),
    Lark(String),
}

/// A flag's FILE argument, read (clap reports a failure naming the flag).
fn read_text_file(path: &str) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {path:?}: {e}"))
}

fn read_grammar_file(path: &str) -> Result<GrammarFile, String> {
    let text = read_text_file(path)?;
    Ok(if path.ends_with(".lark") {
        GrammarFile::Lark(text)
    } else {
        GrammarFile::Gbnf(text)
    })
}

/// `samplerctl generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The prompt (with --chat: the user message).
    #[arg(value_name = "PROMPT")]
    pub prompt: String,
    /// Send the prompt as a chat conversation (rendered with the model's
    /// chat template) instead of a raw prompt.
    #[arg(long)]
    pub chat: bool,
    /// A system message before the prompt (implies --chat).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Extra user messages after the prompt (implies --chat); repeatable.
    #[arg(long, value_name = "TEXT")]
    pub user: Vec<String>,
    /// Maximum tokens to generate, >= 1 [default: the server's
    /// `model.default_max_tokens`; above the server's cap is refused].
    #[arg(
        short = 'n',
        long = "max-tokens",
        visible_alias = "n-predict",
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub max_tokens: Option<u32>,
    /// Stop string; repeatable.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Keep generating after the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Generate at least this many tokens before an end token or a stop
    /// string may end the generation.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub min_tokens: u32,
    /// A token id that ends the generation like end-of-sequence; repeatable.
    #[arg(long = "stop-token-id", value_name = "ID")]
    pub stop_token_ids: Vec<u32>,
    /// A word the generation must not contain; repeatable.
    #[arg(long = "bad-word", value_name = "TEXT")]
    pub bad_words: Vec<String>,
    /// Leave the prompt out of the penalties' window (only generated
    /// tokens are penalised).
    #[arg(long)]
    pub no_penalize_prompt: bool,
    /// Most tokens inside a thinking model's reasoning block before its
    /// close is forced.
    #[arg(long, value_name = "N")]
    pub reasoning_budget: Option<u32>,
    /// Text forced before the close when the reasoning budget is spent.
    #[arg(long, value_name = "TEXT", default_value = "")]
    pub reasoning_budget_message: String,
    /// Return this many top candidates with each token (shown with --json).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub n_probs: u32,
    /// With --n-probs: the candidates that survive the chain, with their
    /// post-chain probabilities, instead of the raw softmax's top N.
    #[arg(long)]
    pub post_sampling_probs: bool,
    /// Print one JSON object per streamed message (stdout) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Completions of the prompt from one prefill (`GenerateRequest.n`);
    /// choice i uses seed + i. With more than one, each choice's text is
    /// printed once it finishes, under a `--- choice i ---` line.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub choices: u32,
    /// Speculative decoding: the server drafts tokens and checks them in
    /// one forward pass; the output is the same bytes as without it.
    #[arg(long, value_enum, value_name = "SOURCE")]
    pub speculate: Option<DraftSourceArg>,
    /// With --speculate: most draft tokens per pass [default: the
    /// server's `limits.max_draft_tokens`].
    #[arg(long, value_name = "N", requires = "speculate")]
    pub max_draft: Option<u32>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// Where a speculating Generate's drafts come from (`DraftSource`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DraftSourceArg {
    /// Tokens that followed the text's last n-gram earlier in the prompt
    /// or output.
    PromptLookup,
    /// The server's draft model (`model.draft_path`).
    Model,
}

/// Logits file formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogitsFormat {
    /// NumPy .npy, float32 (or float64, converted), one row.
    Npy,
    /// Raw little-endian f32, no header (.f32, .bin).
    Raw,
    /// A JSON array of numbers (.json).
    Json,
}

/// `samplerctl sample`.
#[derive(Debug, Args)]
pub struct SampleArgs {
    /// Logits file (.npy, .f32/.bin raw little-endian f32, .json), or `-` for stdin.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// File format; by default from the extension (stdin: sniffed, JSON or raw).
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub format: Option<LogitsFormat>,
    /// Penalty window, oldest first, comma-separated token ids.
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub prev_tokens: Vec<u32>,
    /// Position of this step in the seeded random stream.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub step: u64,
    /// Show the top N candidates before (raw logits) and after the chain.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub n_probs: u32,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// `samplerctl stages`.
#[derive(Debug, Args)]
pub struct StagesArgs {
    /// Print the raw response as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `samplerctl tokenize`.
#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// The text; `-` reads it from stdin.
    pub text: String,
    /// Add the tokens the vocabulary puts around a text (BOS when the
    /// model asks for one).
    #[arg(long)]
    pub add_special: bool,
    /// Tokenize special-token text (`<|im_start|>`) as plain text.
    #[arg(long)]
    pub no_parse_special: bool,
    /// A vocabulary loaded by the server (`samplerctl info` lists them)
    /// [default: the model's].
    #[arg(long, value_name = "NAME")]
    pub vocabulary: Option<String>,
    /// Print the ids as a JSON array.
    #[arg(long)]
    pub json: bool,
}

/// `samplerctl detokenize`.
#[derive(Debug, Args)]
pub struct DetokenizeArgs {
    /// Token ids, comma-separated.
    #[arg(value_delimiter = ',', required = true, value_name = "IDS")]
    pub tokens: Vec<u32>,
    /// Leave out control tokens (`<|im_end|>`).
    #[arg(long)]
    pub skip_special: bool,
    /// As `tokenize --vocabulary`.
    #[arg(long, value_name = "NAME")]
    pub vocabulary: Option<String>,
    /// Print the text as a JSON string.
    #[arg(long)]
    pub json: bool,
}

/// `samplerctl info`.
#[derive(Debug, Args)]
pub struct InfoArgs {
    /// Print the response as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `samplerctl health`.
#[derive(Debug, Args)]
pub struct HealthArgs {
    /// Service name to check ("" = the server as a whole).
    #[arg(long, default_value = "", value_name = "NAME")]
    pub service: String,
}

/// Which RPC `bench` drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchRpc {
    /// Sample with random logits (one token per request).
    Sample,
    /// SampleStream: one long-lived stream per worker, one message (random
    /// logits) per request.
    SampleStream,
    /// Generate with the server's model (completion tokens per request).
    Generate,
    /// SampleBatch: `--batch` rows of random logits per call (tokens count
    /// rows).
    SampleBatch,
    /// SampleBatchStream: one stream of `--batch` sequences per worker, one
    /// message of `--batch` rows per request (tokens count rows: compare
    /// with `--rpc sample-stream --concurrency B`).
    SampleBatchStream,
}

/// `--dtype`: how batch logits travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WireDtype {
    /// Little-endian f32, 4 bytes per logit.
    F32,
    /// Little-endian IEEE half, 2 bytes per logit.
    F16,
    /// Little-endian bfloat16, 2 bytes per logit.
    Bf16,
}

/// `--compression`: the message encoding both ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl BenchRpc {
    /// The lower-case name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            BenchRpc::Sample => "sample",
            BenchRpc::SampleStream => "sample-stream",
            BenchRpc::Generate => "generate",
            BenchRpc::SampleBatch => "sample-batch",
            BenchRpc::SampleBatchStream => "sample-batch-stream",
        }
    }
}

/// `samplerctl bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// RPC to benchmark.
    #[arg(long, value_enum, default_value = "sample")]
    pub rpc: BenchRpc,
    /// Requests in flight at once.
    #[arg(short = 'c', long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency: u32,
    /// Run for this many seconds [default: 10 unless --requests is given].
    #[arg(short = 'd', long, value_name = "SECONDS", conflicts_with = "requests", value_parser = parse_timeout)]
    pub duration: Option<f64>,
    /// Run exactly this many requests in total.
    #[arg(short = 'r', long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,
    /// Vocabulary size of the random logits (sample, sample-stream).
    #[arg(long, default_value_t = 151_936, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub vocab: u32,
    /// Rows per request (sample-batch, sample-batch-stream).
    #[arg(long, default_value_t = 32, value_name = "B", value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: u32,
    /// Wire encoding of the batch logits (sample-batch, sample-batch-stream).
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: WireDtype,
    /// Send each batch row as a sparse row instead (sample-batch,
    /// sample-batch-stream): its N largest logits plus the log-sum-exp of
    /// the rest; 0 = the whole row in `--dtype`.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub sparse: u32,
    /// Compress every request with this encoding and ask for compressed
    /// responses (the server accepts gzip and zstd).
    #[arg(long, value_enum, default_value = "none")]
    pub compression: Compression,
    /// Prompt (generate).
    #[arg(long, default_value = "Tell me a story", value_name = "TEXT")]
    pub prompt: String,
    /// Tokens per request (generate).
    #[arg(short = 'n', long, default_value_t = 32, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens: u32,
    /// Print one JSON object (rpc, concurrency, requests, errors, duration_s,
    /// rps, tokens_per_s, latency_ms {p50, p90, p99}) instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// The socket path of a `unix:/path` (or `unix:///path`) address.
pub fn unix_path(addr: &str) -> Option<&str> {
    let rest = addr.strip_prefix("unix:")?;
    Some(rest.strip_prefix("//").unwrap_or(rest))
}

/// `--addr`: accepts `host:port`, a full http(s) URL or `unix:/PATH`.
fn parse_addr(s: &str) -> Result<String, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty address".into());
    }
    if let Some(path) = unix_path(s) {
        if !path.starts_with('/') {
            return Err(format!(
                "{s:?}: a Unix socket needs an absolute path (unix:/run/samplerd.sock)"
            ));
        }
        return Ok(format!("unix:{path}"));
    }
    let url = if s.contains("://") {
        s.to_string()
    } else {
        format!("http://{s}")
    };
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(format!(
            "unsupported scheme in {url:?} (use http://HOST:PORT or unix:/PATH)"
        ));
    }
    tonic::transport::Endpoint::from_shared(url.clone())
        .map_err(|e| format!("invalid address {url:?}: {e}"))?;
    Ok(url.trim_end_matches('/').to_string())
}

/// Positive, finite seconds.
fn parse_timeout(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("not a number of seconds: {s:?}"))?;
    if v.is_finite() && v > 0.0 && v < 1e9 {
        Ok(v)
    } else {
        Err(format!("must be a positive number of seconds, got {s}"))
    }
}

/// llama.cpp's `--logit-bias TOKEN_ID(+|-)BIAS`; also accepts `ID=BIAS`.
fn parse_logit_bias(s: &str) -> Result<(u32, f32), String> {
    let bad = || format!("expected TOKEN_ID(+|-)BIAS such as 15043+1 or 15043-inf, got {s:?}");
    let (id, bias) = if let Some((id, b)) = s.split_once('=') {
        (id, b.to_string())
    } else {
        let pos = s.find(['+', '-']).ok_or_else(bad)?;
        (&s[..pos], s[pos..].to_string())
    };
    let id: u32 = id.trim().parse().map_err(|_| bad())?;
    let bias: f32 = bias.trim().parse().map_err(|_| bad())?;
    Ok((id, bias))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_whitespace_needs_a_constraint_flag() {
        let parse = |args: &[&str]| Cli::try_parse_from(args.iter().copied());
        let ok = parse(&[
            "samplerctl",
            "generate",
            "hi",
            "--json-object",
            "--json-whitespace",
            "compact",
        ]);
        let args = ok.expect("with --json-object");
        let Command::Generate(g) = args.command else {
            panic!("generate")
        };
        assert_eq!(g.sampling.json_whitespace, Some(JsonWhitespaceArg::Compact));
        let e = parse(&["samplerctl", "generate", "hi", "--json-whitespace", "free"]).unwrap_err();
        assert_eq!(
            e.kind(),
            clap::error::ErrorKind::MissingRequiredArgument,
            "{e}"
        );
    }

    #[test]
    fn logit_bias_forms() {
        assert_eq!(parse_logit_bias("15043+1").unwrap(), (15043, 1.0));
        assert_eq!(parse_logit_bias("7-0.5").unwrap(), (7, -0.5));
        assert_eq!(parse_logit_bias("7=2").unwrap(), (7, 2.0));
        let (id, b) = parse_logit_bias("3-inf").unwrap();
        assert_eq!(id, 3);
        assert!(b.is_infinite() && b < 0.0);
        assert!(parse_logit_bias("abc").is_err());
    }

    #[test]
    fn addr_forms() {
        assert_eq!(parse_addr("127.0.0.1:1").unwrap(), "http://127.0.0.1:1");
        assert_eq!(parse_addr("http://h:2/").unwrap(), "http://h:2");
        assert!(parse_addr("ftp://h:2").is_err());
        assert_eq!(parse_addr("unix:/run/s.sock").unwrap(), "unix:/run/s.sock");
        assert_eq!(
            parse_addr("unix:///run/s.sock").unwrap(),
            "unix:/run/s.sock"
        );
        let e = parse_addr("unix:run/s.sock").unwrap_err();
        assert!(e.contains("absolute path"), "{e}");
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
