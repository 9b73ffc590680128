//! A small pool of [`TokenBuffer`]s, so a request reuses the ~0.6 MB
//! dense + candidate buffers of an earlier one instead of allocating.

#![forbid(unsafe_code)]

use std::sync::Mutex;

use samplerd_sampling::TokenBuffer;

/// Keeps up to `capacity` idle buffers.
pub struct BufferPool {
    idle: Mutex<Vec<TokenBuffer>>,
    capacity: usize,
    max_vocab: usize,
}

impl BufferPool {
    pub fn new(capacity: usize, max_vocab: usize) -> Self {
        BufferPool {
            idle: Mutex::new(Vec::with_capacity(capacity)),
            capacity,
            max_vocab,
        }
    }

    /// An idle buffer, or a fresh one refusing vocabularies over the limit.
    pub fn take(&self) -> TokenBuffer {
        self.idle
            .lock()
            .ok()
            .and_then(|mut v| v.pop())
            .unwrap_or_else(|| TokenBuffer::with_limit(self.max_vocab))
    }

    /// Returns a buffer for reuse (dropped when the pool is full).
    pub fn put(&self, buf: TokenBuffer) {
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < self.capacity
        {
            idle.push(buf);
        }
    }

    /// Idle buffers right now.
    pub fn idle(&self) -> usize {
        self.idle.lock().map(|v| v.len()).unwrap_or(0)
    }
}
