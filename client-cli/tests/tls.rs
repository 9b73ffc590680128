//! The real `samplerctl` against a real `samplerd serve` with TLS, mutual
//! TLS and bearer tokens: the connection flags (`--tls`, `--ca-cert`,
//! `--client-cert`, `--client-key`, `--token`) work, and what is missing is
//! reported. Certificates are made at test time (rcgen).
//!
//! `samplerd` must be built next to this test's target directory (as for
//! `tests/cli.rs`: `cargo test --workspace` builds it first).

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::{samplerctl, samplerd_in, samplerd_log, stderr, wait_serving};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// Upper bound on waiting for the server to report SERVING.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// The bearer token of these tests.
const TOKEN: &str = "tls-test-token-1";

struct Ca(CertifiedIssuer<'static, KeyPair>);

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Ca(CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap())
    }

    /// Writes `<stem>.pem` and `<stem>.key` for `names`; returns their paths.
    fn issue(&self, dir: &Path, stem: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &self.0)
            .unwrap();
        let (c, k) = (
            dir.join(format!("{stem}.pem")),
            dir.join(format!("{stem}.key")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }

    fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.0.pem()).unwrap();
        p
    }
}

/// A `samplerd serve` with TLS (+ mutual TLS) and tokens; killed on drop.
struct Server {
    child: Child,
    addr: String,
    dir: tempfile::TempDir,
    ca: PathBuf,
    client: (PathBuf, PathBuf),
}

impl Server {
    fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let server_ca = Ca::new("server CA");
        let client_ca = Ca::new("client CA");
        let (cert, key) = server_ca.issue(dir.path(), "server", &["localhost"]);
        let client = client_ca.issue(dir.path(), "client", &["client.test"]);
        let ca = server_ca.write(dir.path(), "ca.pem");
        let client_ca_file = client_ca.write(dir.path(), "client-ca.pem");
        let tokens = dir.path().join("tokens");
        std::fs::write(&tokens, format!("# test\n{TOKEN}\n")).unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.path().join("samplerd.toml");
        std::fs::write(
            &config,
            format!(
                "listen = \"127.0.0.1:{port}\"\n[tls]\ncert_file = {:?}\nkey_file = {:?}\nclient_ca_file = {:?}\n[auth]\ntokens_file = {:?}\n",
                cert, key, client_ca_file, tokens
            ),
        )
        .unwrap();
        let child = samplerd_in(dir.path())
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .spawn()
            .expect("spawn samplerd");
        let mut s = Server {
            child,
            // The certificate names localhost; connect by that name.
            addr: format!("localhost:{port}"),
            dir,
            ca,
            client,
        };
        s.wait_ready();
        s
    }

    /// samplerctl with the full set of TLS flags and the token.
    fn ctl(&self) -> Command {
        let mut c = self.bare(&["--tls"]);
        c.arg("--ca-cert")
            .arg(&self.ca)
            .arg("--client-cert")
            .arg(&self.client.0)
            .arg("--client-key")
            .arg(&self.client.1)
            .args(["--token", TOKEN]);
        c
    }

    /// samplerctl with only the given flags (no TLS/token defaults).
    fn bare(&self, flags: &[&str]) -> Command {
        let mut c = samplerctl();
        c.args(["--addr", &self.addr, "--timeout", "5"]).args(flags);
        c
    }

    fn wait_ready(&mut self) {
        // One command, run again at every poll.
        let mut health = self.ctl();
        health.arg("health");
        wait_serving(&mut self.child, self.dir.path(), READY_TIMEOUT, || {
            run(&mut health)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    }

    fn log(&self) -> String {
        samplerd_log(self.dir.path())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null()).output().expect("run samplerctl")
}

#[test]
fn samplerctl_speaks_mutual_tls_with_a_token() {
    let s = Server::start();
    let o = run(s.ctl().arg("stages"));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("top_k"));

    // Without the token: UNAUTHENTICATED, said so.
    let ca = s.ca.display().to_string();
    let (cert, key) = (
        s.client.0.display().to_string(),
        s.client.1.display().to_string(),
    );
    let no_token = [
        "--ca-cert",
        &ca,
        "--client-cert",
        &cert,
        "--client-key",
        &key,
    ];
    let o = run(s.bare(&no_token).arg("stages"));
    assert!(!o.status.success());
    let e = stderr(&o).to_lowercase();
    assert!(e.contains("unauthenticated") || e.contains("bearer"), "{e}");

    // Without a client certificate the handshake fails.
    let o = run(s.bare(&["--ca-cert", &ca, "--token", TOKEN]).arg("stages"));
    assert!(
        !o.status.success(),
        "stdout {} stderr {} log {}",
        String::from_utf8_lossy(&o.stdout),
        stderr(&o),
        s.log()
    );

    // Plaintext to the TLS port fails (an HTTP/2 protocol error).
    let o = run(s.bare(&["--token", TOKEN]).arg("stages"));
    assert!(!o.status.success());
    assert!(stderr(&o).contains("error"), "{}", stderr(&o));

    // A missing CA file is named.
    let o = run(s.bare(&["--ca-cert", "/nonexistent/ca.pem"]).arg("stages"));
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/nonexistent/ca.pem"), "{}", stderr(&o));
}
