//! Graceful shutdown: on SIGTERM, SIGINT or SIGQUIT the server turns
//! NOT_SERVING at once, refuses new Sampler RPCs with UNAVAILABLE (clients
//! retry on another replica), lets the requests and streams already running
//! finish for up to `shutdown.grace_period_secs`, then closes the
//! connections and returns, so the process exits 0. Kubernetes'
//! `terminationGracePeriodSeconds` must exceed the grace period plus
//! [`CLOSE_TIMEOUT`](crate::transport::drain::CLOSE_TIMEOUT). SIGHUP, SIGUSR1, SIGUSR2 and SIGALRM are logged and
//! otherwise ignored ([`ignore_other_signals`]): none of them may kill a
//! serving process.
//!
//! The admission gate and in-flight counter the request layer consults for
//! every Sampler RPC is `transport::drain`'s.

#![forbid(unsafe_code)]

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Default `shutdown.grace_period_secs`: below Kubernetes' default
/// `terminationGracePeriodSeconds` (30 s) with room for [`CLOSE_TIMEOUT`](crate::transport::drain::CLOSE_TIMEOUT).
pub const DEFAULT_GRACE_PERIOD_SECS: u64 = 25;
/// Largest accepted grace period (an hour; longer is a typo, and a huge value
/// would overflow the deadline arithmetic).
pub const MAX_GRACE_PERIOD_SECS: u64 = 3600;

/// Shutdown settings (config `[shutdown]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownConfig {
    /// How long in-flight requests and streams may run after SIGTERM
    /// before they are cut.
    pub grace_period_secs: u64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            grace_period_secs: DEFAULT_GRACE_PERIOD_SECS,
        }
    }
}

impl ShutdownConfig {
    pub fn grace_period(&self) -> Duration {
        Duration::from_secs(self.grace_period_secs)
    }
}

/// A future that resolves on the first SIGTERM, SIGINT (Ctrl-C) or
/// SIGQUIT (`Ctrl-\`): each starts the same drain, logged as one line
/// naming the signal.
///
/// The handlers are installed by this call, not when the future is first
/// polled: `serve` polls its shutdown future only after it started serving,
/// and on a loaded machine a connection task on another worker thread could
/// answer a client (who then sends SIGTERM) before that first poll — the
/// default action would then kill the process without a drain (seen on one
/// CPU: 2 of 12 runs of the shutdown tests exited by signal 15). Call it
/// before the listener is served, inside the runtime. Once installed, a
/// handler stays for the life of the process, so a second signal during the
/// drain is absorbed rather than killing it.
pub fn signal() -> impl Future<Output = ()> + Send {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut waiting = Vec::new();
        for (kind, name) in [
            (SignalKind::terminate(), "SIGTERM"),
            (SignalKind::interrupt(), "SIGINT"),
            (SignalKind::quit(), "SIGQUIT"),
        ] {
            match signal(kind) {
                Ok(mut s) => waiting.push(Box::pin(async move {
                    s.recv().await;
                    name
                })),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for {name}: it kills samplerd without a drain");
                }
            }
        }
        async move {
            if waiting.is_empty() {
                tracing::warn!(
                    "cannot listen for any stop signal: samplerd stops only when killed"
                );
                std::future::pending::<()>().await;
            }
            let (name, _, _) = futures::future::select_all(waiting).await;
            tracing::info!("{name} received");
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The signals samplerd takes no action on, and why: without a handler
/// their default action kills the process at once, with no drain and no
/// log line, cutting every stream (logrotate's `kill -HUP`, a stray
/// `kill -USR1` meant for another daemon, an `alarm` left by a wrapper).
#[cfg(unix)]
const IGNORED_SIGNALS: [(i32, &str, &str); 4] = [
    (
        libc::SIGHUP,
        "SIGHUP",
        "nothing to reopen or reload: logs go to stderr and the configuration is read only at start-up",
    ),
    (libc::SIGUSR1, "SIGUSR1", "samplerd gives it no meaning"),
    (libc::SIGUSR2, "SIGUSR2", "samplerd gives it no meaning"),
    (libc::SIGALRM, "SIGALRM", "samplerd sets no alarm"),
];

/// Handles SIGHUP, SIGUSR1, SIGUSR2 and SIGALRM for the life of the
/// process: each delivery is logged as one line and otherwise ignored.
/// Installed by this call (inside a runtime, as early as one exists); a
/// task per signal logs them.
pub fn ignore_other_signals() {
    #[cfg(unix)]
    for (number, name, why) in IGNORED_SIGNALS {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::from_raw(number)) {
            Ok(mut s) => {
                tokio::spawn(async move {
                    while s.recv().await.is_some() {
                        tracing::warn!("{name} received: ignored ({why})");
                    }
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot listen for {name}: it kills samplerd"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_grace_period_is_25_seconds() {
        assert_eq!(
            ShutdownConfig::default().grace_period(),
            Duration::from_secs(25)
        );
    }
}
