//! End-to-end tests: the real `samplerctl` binary against a real
//! `samplerd serve` on a free loopback port.
//!
//! `samplerd` must already be built next to this test's target directory
//! (`cargo test --workspace` builds every binary first; otherwise run
//! `cargo build -p samplerd`). Each test starts its own server, waits for
//! SERVING by polling `samplerctl health` within a bounded deadline, and
//! kills it on drop.
//!
//! Set `SAMPLERD_MODEL=/path/to/model.gguf` to also run the Generate tests
//! against a real model.

mod common;

use std::io::Write as _;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::{argmax, logits, samplerctl, samplerd_in, stderr, stdout, to_bytes, wait_serving};

/// Upper bound on waiting for a server to report SERVING.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// The same with a model to load (debug builds load slowly).
const MODEL_READY_TIMEOUT: Duration = Duration::from_secs(180);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind an ephemeral port")
        .local_addr()
        .unwrap()
        .port()
}

/// A `samplerctl` command aimed at `addr`, with the client env cleared.
fn ctl(addr: &str) -> Command {
    let mut c = samplerctl();
    c.arg("--addr").arg(addr);
    c
}

/// A running `samplerd serve`; killed on drop.
struct Server {
    child: Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Server {
        Server::start_with(&[])
    }

    /// Starts `samplerd serve --listen 127.0.0.1:PORT EXTRA…` in an empty
    /// directory (no stray samplerd.toml) without any SAMPLERD_* variable
    /// (the server reads its config from them), and waits for SERVING.
    fn start_with(extra: &[&str]) -> Server {
        let mut last_err = String::new();
        // A free port can be taken between probing and binding: retry.
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("temp dir");
            let port = free_port();
            let child = samplerd_in(dir.path())
                .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
                .args(extra)
                .spawn()
                .expect("spawn samplerd");
            let mut server = Server {
                child,
                addr: format!("http://127.0.0.1:{port}"),
                _dir: dir,
            };
            let limit = if extra.contains(&"--model") {
                MODEL_READY_TIMEOUT
            } else {
                READY_TIMEOUT
            };
            match server.wait_ready(limit) {
                Ok(()) => return server,
                Err(e) => last_err = e,
            }
        }
        panic!("samplerd did not become SERVING: {last_err}");
    }

    /// Polls `samplerctl health` until it exits 0, the server exits, or
    /// `limit` passes.
    fn wait_ready(&mut self, limit: Duration) -> Result<(), String> {
        let addr = self.addr.clone();
        wait_serving(&mut self.child, self._dir.path(), limit, || {
            ctl(&addr)
                .args(["--timeout", "2", "health"])
                .output()
                .expect("run samplerctl health")
        })
    }

    fn ctl(&self) -> Command {
        ctl(&self.addr)
    }

    /// Kills the server and waits for it to exit.
    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null()).output().expect("run samplerctl")
}

fn run_stdin(cmd: &mut Command, input: &[u8]) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn samplerctl");
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

#[track_caller]
fn assert_code(o: &Output, code: i32) {
    assert_eq!(
        o.status.code(),
        Some(code),
        "exit status\nstdout:\n{}\nstderr:\n{}",
        stdout(o),
        stderr(o)
    );
}

/// What `np.save` writes for a 1-D float32 array (format version 1.0).
fn npy_bytes(l: &[f32]) -> Vec<u8> {
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}",
        l.len()
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(to_bytes(l));
    out
}

fn json_array(l: &[f32]) -> String {
    let items: Vec<String> = l.iter().map(|v| format!("{v}")).collect();
    format!("[{}]", items.join(", "))
}

/// The first stdout line, parsed as a token id.
fn token_id(o: &Output) -> u32 {
    let out = stdout(o);
    let line = out.lines().next().unwrap_or_default();
    line.trim()
        .parse()
        .unwrap_or_else(|_| panic!("first line is not a token id: {out:?}"))
}

#[test]
fn sample_greedy_from_every_format_gives_the_argmax() {
    let server = Server::start();
    let dir = tempfile::tempdir().unwrap();
    let l = logits(1000, 7);
    let want = argmax(&l);

    let files = [
        ("logits.npy", npy_bytes(&l)),
        ("logits.f32", to_bytes(&l)),
        ("logits.bin", to_bytes(&l)),
        ("logits.json", json_array(&l).into_bytes()),
    ];
    for (name, bytes) in &files {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let o = run(server.ctl().arg("sample").arg(&path).arg("--greedy"));
        assert_code(&o, 0);
        assert_eq!(token_id(&o), want, "{name}");
        assert_eq!(stdout(&o).trim(), want.to_string(), "{name}: only the id");
    }

    // --format overrides the extension.
    let odd = dir.path().join("logits.dat");
    std::fs::write(&odd, to_bytes(&l)).unwrap();
    let o = run(server
        .ctl()
        .arg("sample")
        .arg(&odd)
        .args(["--format", "raw", "--greedy"]));
    assert_code(&o, 0);
    assert_eq!(token_id(&o), want);

    // stdin: JSON (sniffed), raw (sniffed and explicit).
    let o = run_stdin(
        server.ctl().args(["sample", "-", "--greedy"]),
        json_array(&l).as_bytes(),
    );
    assert_code(&o, 0);
    assert_eq!(token_id(&o), want, "stdin json");

    let o = run_stdin(
        server
            .ctl()
            .args(["sample", "-", "--format", "raw", "--greedy"]),
        &to_bytes(&l),
    );
    assert_code(&o, 0);
    assert_eq!(token_id(&o), want, "stdin raw");

    // Seeded sampling is reproducible and honours --prev-tokens/--step.
    let path = dir.path().join("logits.f32");
    let seeded = |step: &str| {
        let o = run(server.ctl().arg("sample").arg(&path).args([
            "--seed",
            "3",
            "--prev-tokens",
            "1,2,3",
            "--step",
            step,
        ]));
        assert_code(&o, 0);
        token_id(&o)
    };
    assert_eq!(seeded("5"), seeded("5"));
}

#[test]
fn sample_n_probs_shows_raw_and_post_chain_tables() {
    let server = Server::start();
    let dir = tempfile::tempdir().unwrap();
    let l = logits(500, 11);
    let want = argmax(&l);
    let path = dir.path().join("l.json");
    std::fs::write(&path, json_array(&l)).unwrap();

    let o = run(server.ctl().arg("sample").arg(&path).args([
        "--top-k",
        "3",
        "--n-probs",
        "5",
        "--seed",
        "1",
    ]));
    assert_code(&o, 0);
    let out = stdout(&o);
    assert!(out.contains("Top 5 of the raw logits"), "{out}");
    assert!(out.contains("Top 5 after the chain"), "{out}");
    // The raw table's first row is the argmax.
    let raw_first = out
        .lines()
        .skip_while(|l| !l.starts_with("Top 5 of the raw"))
        .nth(2)
        .expect("raw table row");
    let cols: Vec<&str> = raw_first.split_whitespace().collect();
    assert_eq!(cols[0], "1", "{raw_first}");
    assert_eq!(cols[1], want.to_string(), "{raw_first}");
    // The raw table has 5 rows; after top_k(3) only 3 candidates survive.
    let rows_after = |title: &str| {
        out.lines()
            .skip_while(|l| !l.starts_with(title))
            .skip(2)
            .take_while(|l| !l.trim().is_empty())
            .count()
    };
    assert_eq!(rows_after("Top 5 of the raw"), 5, "{out}");
    assert_eq!(rows_after("Top 5 after the chain"), 3, "{out}");

    // --json carries both lists.
    let o =
        run(server
            .ctl()
            .arg("sample")
            .arg(&path)
            .args(["--greedy", "--n-probs", "2", "--json"]));
    assert_code(&o, 0);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["token_id"], want);
    assert_eq!(v["probs"].as_array().unwrap().len(), 2);
    assert!(v["post_sampling_probs"].is_array());
}

#[test]
fn stages_lists_top_k_and_the_default_chain() {
    let server = Server::start();
    let o = run(server.ctl().arg("stages"));
    assert_code(&o, 0);
    let out = stdout(&o);
    assert!(out.lines().any(|l| l.starts_with("top_k ")), "{out}");
    assert!(out.contains("top_k parameters"), "{out}");
    assert!(out.contains("Default chain"), "{out}");
    assert!(out.contains("top_k k=40"), "{out}");
    assert!(
        out.contains("penalties → top_k → top_p → temperature → dist"),
        "{out}"
    );

    let o = run(server.ctl().args(["stages", "--json"]));
    assert_code(&o, 0);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let names: Vec<&str> = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"top_k"), "{names:?}");
    assert!(!v["default_chain"].as_array().unwrap().is_empty());
}

#[test]
fn health_is_zero_when_serving_and_one_when_gone() {
    let mut server = Server::start();
    let o = run(server.ctl().arg("health"));
    assert_code(&o, 0);
    assert!(stdout(&o).contains("SERVING"), "{}", stdout(&o));

    let addr = server.addr.clone();
    server.stop();
    let o = run(ctl(&addr).args(["--timeout", "5", "health"]));
    assert_code(&o, 1);
    assert!(stderr(&o).contains(&addr), "{}", stderr(&o));
}

#[test]
fn bench_reports_sane_json() {
    let server = Server::start();
    let o = run(server.ctl().args([
        "bench",
        "--rpc",
        "sample",
        "--concurrency",
        "2",
        "--duration",
        "2",
        "--vocab",
        "32000",
        "--json",
    ]));
    assert_code(&o, 0);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim())
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(&o)));
    assert_eq!(v["rpc"], "sample");
    assert_eq!(v["concurrency"], 2);
    let requests = v["requests"].as_u64().unwrap();
    assert!(requests > 0, "{v}");
    assert_eq!(v["errors"], 0, "{v}");
    let duration = v["duration_s"].as_f64().unwrap();
    assert!((1.5..30.0).contains(&duration), "{v}");
    assert!(v["rps"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    let p = |k: &str| v["latency_ms"][k].as_f64().unwrap();
    assert!(
        p("p50") > 0.0 && p("p50") <= p("p90") && p("p90") <= p("p99"),
        "{v}"
    );

    // --requests runs exactly that many.
    let o = run(server.ctl().args([
        "bench",
        "--requests",
        "7",
        "-c",
        "3",
        "--vocab",
        "1000",
        "--json",
    ]));
    assert_code(&o, 0);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["requests"], 7, "{v}");
}

#[test]
fn bad_flags_exit_2_with_a_helpful_message() {
    // Usage errors never need a server.
    let addr = "http://127.0.0.1:9";
    let cases: [&[&str]; 6] = [
        &["sample", "x.json", "--top-k", "many"],
        &["generate", "hi", "-n", "0"],
        &["sample", "x.json", "--greedy", "--temp", "0.5"],
        &["bench", "--rpc", "nope"],
        &["bench", "--duration", "1", "--requests", "5"],
        &["frobnicate"],
    ];
    for args in cases {
        let o = run(ctl(addr).args(args));
        assert_code(&o, 2);
        let err = stderr(&o);
        assert!(err.starts_with("error:"), "{args:?}: {err}");
        assert!(
            err.contains("--help") || err.contains("Usage"),
            "{args:?}: {err}"
        );
    }
    // --help explains the flags and shows an example.
    let o = run(ctl(addr).args(["generate", "--help"]));
    assert_code(&o, 0);
    let out = stdout(&o);
    for flag in [
        "--temp",
        "--top-k",
        "--top-p",
        "--seed",
        "--samplers",
        "--max-tokens",
        "Example",
    ] {
        assert!(out.contains(flag), "help lacks {flag}: {out}");
    }
}

#[test]
fn server_invalid_argument_exits_1_with_the_message() {
    let server = Server::start();
    let o = run_stdin(
        server.ctl().args(["sample", "-", "--top-p", "1.5"]),
        b"[1.0, 2.0, 3.0]",
    );
    assert_code(&o, 1);
    let err = stderr(&o);
    assert!(err.starts_with("error: INVALID_ARGUMENT: "), "{err}");
    assert!(err.contains("top_p"), "{err}");
    assert!(err.contains("1.5"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[test]
fn unreachable_server_names_the_address() {
    let port = free_port();
    let addr = format!("http://127.0.0.1:{port}");
    for args in [&["health"][..], &["stages"][..]] {
        let o = run(ctl(&addr).args(["--timeout", "5"]).args(args));
        assert_code(&o, 1);
        let err = stderr(&o);
        assert!(
            err.starts_with(&format!("error: cannot reach samplerd at {addr}: ")),
            "{err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    }
    // SAMPLERD_ADDR is honoured (host:port form).
    let o = run(samplerctl()
        .env("SAMPLERD_ADDR", format!("127.0.0.1:{port}"))
        .arg("health"));
    assert_code(&o, 1);
    assert!(stderr(&o).contains(&addr), "{}", stderr(&o));
}

#[test]
fn generate_without_a_model_is_failed_precondition() {
    let server = Server::start();
    let o = run(server
        .ctl()
        .args(["generate", "Tell me a story", "-n", "4"]));
    assert_code(&o, 1);
    let err = stderr(&o);
    assert!(err.starts_with("error: FAILED_PRECONDITION: "), "{err}");
    assert!(err.contains("model"), "{err}");
}

/// Runs only when `SAMPLERD_MODEL` names an existing GGUF file.
#[test]
fn generate_with_a_model_streams_deterministically() {
    let Some(model) = std::env::var_os("SAMPLERD_MODEL").map(PathBuf::from) else {
        eprintln!("skipped: set SAMPLERD_MODEL=/path/to/model.gguf to run");
        return;
    };
    if !model.is_file() {
        eprintln!("skipped: SAMPLERD_MODEL={} is not a file", model.display());
        return;
    }
    let model = model.to_str().expect("UTF-8 model path").to_string();
    let server = Server::start_with(&["--model", &model]);
    let gen_once = || {
        let o = run(server.ctl().args([
            "--timeout",
            "120",
            "generate",
            "Tell me a story",
            "-n",
            "16",
            "--seed",
            "1",
        ]));
        assert_code(&o, 0);
        o
    };
    let a = gen_once();
    assert!(!stdout(&a).trim().is_empty(), "no text streamed");
    let summary = stderr(&a);
    assert!(
        summary.contains("tokens/s") && summary.contains("finish:") && summary.contains("seed: 1"),
        "summary line: {summary}"
    );
    let b = gen_once();
    assert_eq!(a.stdout, b.stdout, "same seed, different text");
}

/// Runs only when `SAMPLERD_MODEL` names an existing GGUF file.
#[test]
fn tokenize_detokenize_and_info_talk_to_the_model() {
    let Some(model) = std::env::var_os("SAMPLERD_MODEL").map(PathBuf::from) else {
        eprintln!("skipped: set SAMPLERD_MODEL=/path/to/model.gguf to run");
        return;
    };
    if !model.is_file() {
        eprintln!("skipped: SAMPLERD_MODEL={} is not a file", model.display());
        return;
    }
    let model = model.to_str().expect("UTF-8 model path").to_string();
    let server = Server::start_with(&["--model", &model]);
    // SmolLM2's ids for these, as llama.cpp gives them.
    let o = run(server.ctl().args(["tokenize", "<|im_start|>Hello world"]));
    assert_code(&o, 0);
    assert_eq!(stdout(&o), "1,19556,905\n");
    let o = run(server
        .ctl()
        .args(["tokenize", "--json", "--no-parse-special", "<|im_start|>"]));
    assert_code(&o, 0);
    let ids: Vec<u32> = serde_json::from_str(&stdout(&o)).expect("JSON array");
    assert!(ids.len() > 1 && !ids.contains(&1), "{ids:?}");
    let o = run(server.ctl().args(["detokenize", "1,19556,905"]));
    assert_code(&o, 0);
    assert_eq!(stdout(&o), "<|im_start|>Hello world");
    let o = run(server
        .ctl()
        .args(["detokenize", "--skip-special", "1,19556,905"]));
    assert_eq!(stdout(&o), "Hello world");
    let o = run(server.ctl().args(["detokenize", "49152"]));
    assert_code(&o, 1);
    assert!(stderr(&o).contains("tokens[0]"), "{}", stderr(&o));
    let o = run(server.ctl().args(["info", "--json"]));
    assert_code(&o, 0);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    assert_eq!(v["model"]["n_vocab"], 49152);
    assert_eq!(v["request_id_header"], "x-request-id");
    assert!(v["limits"]["max_message_bytes"].as_u64().unwrap() > 0);
    let o = run(server.ctl().arg("info"));
    assert_code(&o, 0);
    assert!(
        stdout(&o).contains("SmolLM2-135M-Instruct"),
        "{}",
        stdout(&o)
    );
}
