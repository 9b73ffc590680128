//! Harness for tests that run the real `samplerd serve` process: a config
//! file with ephemeral gRPC and metrics ports and JSON logs, the addresses
//! read from the server's own log lines (no port probing), a bounded wait
//! for SERVING, SIGTERM, and a bounded wait for the exit status.
#![allow(dead_code, unused_imports)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tonic::transport::Channel;

use crate::common::core_plugin;

/// Upper bound on start-up (plugins, and the model when configured).
pub const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How often `wait_exit` looks at the child (a bounded poll of its status).
const EXIT_POLL: Duration = Duration::from_millis(20);

pub use crate::common::model_path;

/// A running `samplerd serve`.
pub struct Process {
    pub child: Child,
    pub grpc: SocketAddr,
    pub metrics: Option<SocketAddr>,
    /// Log lines (JSON) not yet consumed.
    pub logs: mpsc::Receiver<String>,
    /// The lines read while waiting for the addresses (start-up warnings).
    pub startup_logs: Vec<String>,
    dir: PathBuf,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A TOML string literal for a path.
pub fn toml_path(p: &std::path::Path) -> String {
    format!("{:?}", p.display().to_string())
}

/// Starts `samplerd serve` with the core plugin, ephemeral ports, JSON logs
/// and `extra_toml` appended (more keys or tables), and waits until it
/// logs its gRPC address (and metrics address unless disabled).
pub fn start(extra_toml: &str) -> Process {
    start_limited(extra_toml, None)
}

/// [`start`], with the process's open-file limit (`RLIMIT_NOFILE`) set to
/// `max_open_files` (by the shell's `ulimit -n`, which then `exec`s
/// samplerd, so the child is samplerd itself).
pub fn start_limited(extra_toml: &str, max_open_files: Option<u32>) -> Process {
    start_full("info", extra_toml, max_open_files)
}

/// [`start`] with the log filter `filter` (`logging.filter`: `info`,
/// `debug`, …).
pub fn start_logging(filter: &str, extra_toml: &str) -> Process {
    start_full(filter, extra_toml, None)
}

fn start_full(filter: &str, extra_toml: &str, max_open_files: Option<u32>) -> Process {
    let (dir, file, config) = write_config(filter, extra_toml);
    let metrics_enabled = !extra_toml.contains("enabled = false");
    let bin = env!("CARGO_BIN_EXE_samplerd");
    let mut cmd = match max_open_files {
        None => Command::new(bin),
        Some(n) => {
            let mut sh = Command::new("sh");
            sh.arg("-c")
                .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                .arg(bin);
            sh
        }
    };
    clean_env(&mut cmd);
    let mut child = cmd
        .current_dir(&dir)
        .arg("serve")
        .arg("--config")
        .arg(&file)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn samplerd");
    let rx = stderr_lines(&mut child);
    let mut p = Process {
        child,
        grpc: "0.0.0.0:0".parse().unwrap(),
        metrics: None,
        logs: rx,
        startup_logs: Vec::new(),
        dir,
    };
    let deadline = Instant::now() + START_TIMEOUT;
    let mut grpc = None;
    while grpc.is_none() || (metrics_enabled && p.metrics.is_none()) {
        let line = p.next_log(deadline).unwrap_or_else(|| {
            panic!(
                "samplerd did not log its addresses in time (config:\n{config}); its lines:\n{}",
                p.startup_logs.join("\n")
            )
        });
        match log_message(&line).as_deref() {
            // `addr` lists every listener: the first is a TCP one.
            Some("samplerd serving") => grpc = first_addr(&line),
            Some("metrics listening") => p.metrics = log_field(&line, "addr"),
            _ => {}
        }
        p.startup_logs.push(line);
    }
    p.grpc = grpc.unwrap();
    p
}

/// How a `samplerd` run that was expected to end by itself ended.
#[derive(Debug)]
pub struct Exited {
    pub status: ExitStatus,
    /// Its stdout, whole.
    pub stdout: String,
    /// Its stderr, line by line.
    pub stderr: Vec<String>,
}

/// Runs `samplerd <subcommand> --config FILE` (the config as [`start`]
/// writes it, `extra_toml` appended) with the extra environment `env`,
/// to its exit: killed (and the test failed) if it has not exited within
/// `timeout`.
pub fn run_to_exit(
    subcommand: &str,
    extra_toml: &str,
    env: &[(&str, &str)],
    timeout: Duration,
) -> Exited {
    let (dir, file, config) = write_config("info", extra_toml);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_samplerd"));
    clean_env(&mut cmd);
    cmd.envs(env.iter().copied());
    let mut child = cmd
        .current_dir(&dir)
        .arg(subcommand)
        .arg("--config")
        .arg(&file)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn samplerd");
    let mut stdout = child.stdout.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        text
    });
    let rx = stderr_lines(&mut child);
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let lines: Vec<String> = rx.try_iter().collect();
            let _ = std::fs::remove_dir_all(&dir);
            panic!(
                "samplerd {subcommand} did not exit within {timeout:?} (config:\n{config}); its stderr:\n{}",
                lines.join("\n")
            );
        }
        std::thread::sleep(EXIT_POLL);
    };
    // Both pipes end with the process; the bound only guards the test.
    let mut stderr = Vec::new();
    while let Ok(line) = rx.recv_timeout(timeout) {
        stderr.push(line);
    }
    let stdout = out.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    Exited {
        status,
        stdout,
        stderr,
    }
}

/// Removes every `SAMPLERD_*` and `RUST_LOG` variable, so only the config
/// file configures the child.
fn clean_env(cmd: &mut Command) {
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("SAMPLERD_") {
            cmd.env_remove(&k);
        }
    }
    cmd.env_remove("RUST_LOG");
}

/// The child's stderr, line by line, through a channel fed by a thread of
/// its own (the channel ends when stderr closes).
fn stderr_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// A fresh directory holding `samplerd.toml`: ephemeral ports, JSON logs
/// at `filter`, the core plugin unless `extra_toml` has `[plugins]`,
/// metrics on an ephemeral port unless it has `[metrics]`. Returns the
/// directory, the file and its text.
fn write_config(filter: &str, extra_toml: &str) -> (PathBuf, PathBuf, String) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "samplerd-proc-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    // A caller's own top-level `listen` (its first line) replaces the
    // default one.
    let (listen, extra_toml) = match extra_toml.split_once('\n') {
        Some((first, rest)) if first.starts_with("listen = ") => (first.to_string(), rest),
        _ => ("listen = \"127.0.0.1:0\"".to_string(), extra_toml),
    };
    let config = format!(
        "{listen}\n\
         [logging]\nformat = \"json\"\nfilter = \"{filter}\"\n\
         {extra_toml}\n"
    );
    // [metrics] and [plugins] may be given by the caller; default them.
    let mut config = config;
    if !config.contains("[metrics]") {
        config.push_str("[metrics]\nlisten = \"127.0.0.1:0\"\n");
    }
    if !config.contains("[plugins]") {
        config.push_str(&format!(
            "[plugins]\nfiles = [{}]\n",
            toml_path(&core_plugin())
        ));
    }
    let file = dir.join("samplerd.toml");
    std::fs::write(&file, &config).unwrap();
    (dir, file, config)
}

/// The `fields.message` of a JSON log line.
pub fn log_message(line: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    v["fields"]["message"].as_str().map(str::to_string)
}

/// The first address of the `addr` field ("A, unix:/B, …") of a log line.
fn first_addr(line: &str) -> Option<SocketAddr> {
    let all: String = log_field(line, "addr")?;
    all.split(", ").next()?.parse().ok()
}

fn log_field<T: std::str::FromStr>(line: &str, field: &str) -> Option<T> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    v["fields"][field].as_str()?.parse().ok()
}

impl Process {
    /// The next log line, or `None` at `deadline` or when stderr closes.
    pub fn next_log(&self, deadline: Instant) -> Option<String> {
        let left = deadline.checked_duration_since(Instant::now())?;
        self.logs.recv_timeout(left).ok()
    }

    /// Waits (bounded) for a log line whose message is `message`.
    pub fn wait_log(&self, message: &str, timeout: Duration) -> String {
        self.wait_log_where(message, timeout, |m| m == message)
    }

    /// Waits (bounded) for a log line whose message starts with `prefix`.
    pub fn wait_log_starting(&self, prefix: &str, timeout: Duration) -> String {
        self.wait_log_where(prefix, timeout, |m| m.starts_with(prefix))
    }

    fn wait_log_where(
        &self,
        message: &str,
        timeout: Duration,
        wanted: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        loop {
            match self.next_log(deadline) {
                Some(l) if log_message(&l).is_some_and(|m| wanted(&m)) => return l,
                Some(l) => seen.push(l),
                None => panic!(
                    "no log line {message:?} within {timeout:?} (or before stderr closed); \
                     process state {:?}; the lines read meanwhile:\n{}",
                    std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())),
                    seen.join("\n")
                ),
            }
        }
    }

    /// A connected channel to the gRPC port, after SERVING.
    pub async fn channel(&self) -> Channel {
        let ch = Channel::from_shared(format!("http://{}", self.grpc))
            .unwrap()
            .connect()
            .await
            .expect("connect");
        crate::common::wait_serving(ch.clone()).await;
        ch
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends the signal `name` as kill(1) spells it (`TERM`, `HUP`, …).
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(ok.success(), "kill -{name} failed");
    }

    /// Waits (bounded) for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "samplerd did not exit within {timeout:?}"
            );
            std::thread::sleep(EXIT_POLL);
        }
    }

    /// `GET /metrics` as text (a plain HTTP/1.1 request; no client crate).
    pub fn scrape(&self) -> String {
        use std::io::{Read, Write};
        let addr = self.metrics.expect("metrics enabled");
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .expect("connect to metrics");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).expect("read metrics response");
        let (head, body) = resp.split_once("\r\n\r\n").expect("HTTP response");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: text/plain; version=0.0.4"),
            "{head}"
        );
        body.to_string()
    }
}
