//! What the workers of `samplerctl bench` share, whichever RPC they
//! drive: the run's state ([`Shared`]: stop, request count, deadline),
//! one worker's measurements ([`WorkerStats`]), the random logits they
//! send, and one request on a long-lived stream ([`stream_step`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use crate::output::status_line;

/// What one worker measured.
#[derive(Default)]
pub(super) struct WorkerStats {
    /// Latency of each successful request, microseconds.
    pub latencies_us: Vec<u64>,
    pub tokens: u64,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl WorkerStats {
    /// Counts one request that took `us` microseconds: its tokens, or its
    /// error. Says whether it succeeded (a stream worker reopens after an
    /// error).
    pub fn record(&mut self, us: u64, result: Result<u64, tonic::Status>) -> bool {
        match result {
            Ok(tokens) => {
                self.latencies_us.push(us);
                self.tokens += tokens;
                true
            }
            Err(s) => {
                self.errors += 1;
                self.first_error.get_or_insert_with(|| status_line(&s));
                false
            }
        }
    }
}

/// Deterministic pseudo-random logits in [-4, 4) as raw LE f32.
pub(super) fn random_logits(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = Vec::with_capacity(n * 4);
    for _ in 0..n {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let v = ((x >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0;
        out.extend(v.to_le_bytes());
    }
    out
}

/// The run's state, shared by every worker.
pub(super) struct Shared {
    stop: AtomicBool,
    /// Requests started (for --requests).
    started: AtomicU64,
    /// Requests finished, ok or not (for the progress bar).
    pub done: AtomicU64,
    limit: Option<u64>,
    deadline: Option<Instant>,
}

impl Shared {
    /// A run of at most `limit` requests, until `deadline`.
    pub fn new(limit: Option<u64>, deadline: Option<Instant>) -> Self {
        Shared {
            stop: AtomicBool::new(false),
            started: AtomicU64::new(0),
            done: AtomicU64::new(0),
            limit,
            deadline,
        }
    }

    /// Ends the run: no request starts after this.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Claims the next request, or None when the run is over.
    pub fn next(&self) -> Option<u64> {
        if self.stop.load(Ordering::Relaxed) {
            return None;
        }
        if let Some(d) = self.deadline
            && Instant::now() >= d
        {
            return None;
        }
        let n = self.started.fetch_add(1, Ordering::Relaxed);
        match self.limit {
            Some(l) if n >= l => None,
            _ => Some(n),
        }
    }
}

/// An open bidirectional stream: the request sender and the responses.
pub(super) type OpenStream<Req, Resp> = (tokio::sync::mpsc::Sender<Req>, tonic::Streaming<Resp>);

/// Sends one message on the worker's stream (opening it first with
/// `call`, e.g. `|rx| client.sample_stream(rx)`) and waits for its
/// response.
pub(super) async fn stream_step<Req, Resp, Call, Fut>(
    open: &mut Option<OpenStream<Req, Resp>>,
    msg: Req,
    call: Call,
) -> Result<Resp, tonic::Status>
where
    Call: FnOnce(tokio_stream::wrappers::ReceiverStream<Req>) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<tonic::Streaming<Resp>>, tonic::Status>>,
{
    let gone = || tonic::Status::unavailable("the server closed the stream");
    let (tx, rx) = match open {
        Some(o) => o,
        None => {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            // Queued before the call so the server sees a message at once.
            tx.send(msg).await.map_err(|_| gone())?;
            let responses = call(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await?
                .into_inner();
            let o = open.insert((tx, responses));
            return o.1.message().await?.ok_or_else(gone);
        }
    };
    tx.send(msg).await.map_err(|_| gone())?;
    rx.message().await?.ok_or_else(gone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_are_deterministic() {
        let a = random_logits(8, 1);
        assert_eq!(a.len(), 32);
        assert_eq!(a, random_logits(8, 1));
        assert_ne!(a, random_logits(8, 2));
    }
}
