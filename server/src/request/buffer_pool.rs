//! A small pool of [`TokenBuffer`]s, so a request reuses the ~0.6 MB
//! dense + candidate buffers of an earlier one instead of allocating
//! (Sample and SampleStream take and give back; Generate leases one for its
//! whole decode loop, which moves it to the sampling pool and back).

#![forbid(unsafe_code)]

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

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

    /// A buffer for a model's `n_vocab` logits, given back when the lease
    /// is dropped. A vocabulary over the pool's limit (a client's logits
    /// never are; a loaded model may be) gets a fresh buffer without one,
    /// which is not kept.
    pub fn lease(self: &Arc<Self>, n_vocab: usize) -> Lease {
        let buf = if n_vocab <= self.max_vocab {
            self.take()
        } else {
            TokenBuffer::new()
        };
        Lease {
            pool: (n_vocab <= self.max_vocab).then(|| Arc::clone(self)),
            buf: Some(buf),
        }
    }

    /// Idle buffers right now.
    pub fn idle(&self) -> usize {
        self.idle.lock().map(|v| v.len()).unwrap_or(0)
    }
}

/// A leased buffer ([`BufferPool::lease`]).
pub struct Lease {
    pool: Option<Arc<BufferPool>>,
    /// Always `Some` until dropped.
    buf: Option<TokenBuffer>,
}

impl Deref for Lease {
    type Target = TokenBuffer;

    fn deref(&self) -> &TokenBuffer {
        self.buf.as_ref().expect("leased until dropped")
    }
}

impl DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut TokenBuffer {
        self.buf.as_mut().expect("leased until dropped")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let (Some(pool), Some(buf)) = (&self.pool, self.buf.take()) {
            pool.put(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_goes_back_to_the_pool_unless_over_its_limit() {
        let pool = Arc::new(BufferPool::new(2, 1000));
        drop(pool.lease(1000));
        assert_eq!(pool.idle(), 1, "given back when dropped");
        let held = pool.lease(10);
        assert_eq!(pool.idle(), 0, "taken from the pool");
        drop(held);
        drop(pool.lease(1001));
        assert_eq!(pool.idle(), 1, "a buffer over the limit is not kept");
    }
}
