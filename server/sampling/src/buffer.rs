//! The token buffer: the dense logits of one step plus room for the
//! candidate view, reused across steps so the hot path allocates nothing.
//! Loading validates the logits (NaN / +inf / empty / too large) in the same
//! pass that copies them.

use samplerd_plugin_sdk::abi::*;

use crate::error::LogitsError;
use crate::logits;
use crate::scan::{self, Scan};

/// Dense logits + candidate buffer + the view the stages left them in.
///
/// The ABI header (`sd_tokens`) is not kept here: it points into `dense`
/// and `cand`, so `TokenBuffer::with_abi` builds it over a mutable borrow
/// for each plugin call and reads the view back afterwards. The buffer holds
/// no raw pointers and moves between threads like any `Vec`.
pub struct TokenBuffer {
    dense: Vec<f32>,
    cand: Vec<SdCandidate>,
    /// `SD_VIEW_*` as the last stage set it: any value a plugin wrote, so
    /// the post-checks can name an unknown one.
    view: u32,
    /// Live candidates in the candidate view (the dense view's length
    /// otherwise).
    size: usize,
    /// Candidates sorted by descending logit (a stage's promise to the
    /// next).
    sorted: u32,
    /// The chosen token id, or -1.
    selected: i64,
    max_vocab: usize,
    /// The `sd_tokens` field the last stage overwrote that only the host
    /// may set (its buffer pointers, `n_vocab`, `struct_size`), if any.
    header_changed: Option<&'static str>,
    /// One flag per token id, all clear between uses: the duplicate-id
    /// check's scratch (sized on first use, then reused).
    seen: Vec<u8>,
}

impl Default for TokenBuffer {
    fn default() -> Self {
        Self::new()
    }
}

impl TokenBuffer {
    pub fn new() -> Self {
        Self::with_limit(usize::MAX)
    }

    /// A buffer that refuses vocabularies larger than `max_vocab`.
    pub fn with_limit(max_vocab: usize) -> Self {
        TokenBuffer {
            dense: Vec::new(),
            cand: Vec::new(),
            view: SD_VIEW_DENSE,
            size: 0,
            sorted: 0,
            selected: -1,
            max_vocab,
            header_changed: None,
            seen: Vec::new(),
        }
    }

    /// The vocabulary of the last load: every load sizes the dense view to
    /// it (after `load_candidates` its logits are stale, not its length).
    pub fn n_vocab(&self) -> usize {
        self.dense.len()
    }

    fn check_len(&self, len: usize) -> Result<(), LogitsError> {
        if len == 0 {
            return Err(LogitsError::Empty);
        }
        if len > self.max_vocab || len > u32::MAX as usize {
            return Err(LogitsError::TooLarge {
                len,
                limit: self.max_vocab.min(u32::MAX as usize),
            });
        }
        Ok(())
    }

    fn resize(&mut self, n: usize) {
        if self.dense.len() != n {
            self.dense.resize(n, 0.0);
        }
        if self.cand.len() < n {
            self.cand.resize(n, SdCandidate { id: 0, logit: 0.0 });
        }
    }

    /// Copies `logits` into the dense view and validates them.
    pub fn load(&mut self, logits: &[f32]) -> Result<(), LogitsError> {
        self.check_len(logits.len())?;
        self.resize(logits.len());
        self.dense.copy_from_slice(logits);
        self.finish_load()
    }

    /// Decodes raw little-endian f32 bytes into the dense view.
    pub fn load_f32le(&mut self, bytes: &[u8]) -> Result<(), LogitsError> {
        if !bytes.len().is_multiple_of(4) {
            return Err(LogitsError::ByteLength { len: bytes.len() });
        }
        let n = bytes.len() / 4;
        self.check_len(n)?;
        self.resize(n);
        if cfg!(target_endian = "little") {
            // The wire format is the memory format: one memcpy.
            bytemuck::cast_slice_mut::<f32, u8>(&mut self.dense).copy_from_slice(bytes);
        } else {
            for (d, c) in self.dense.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        self.finish_load()
    }

    /// As [`Self::load`], fused with the raw logits' max and log-sum-exp
    /// (one pass over memory, see [`crate::scan`]).
    pub fn load_scan(&mut self, logits: &[f32]) -> Result<Scan, LogitsError> {
        self.load_scanned(logits.len(), |dense| scan::copy_scan(dense, logits))
    }

    /// As [`Self::load_f32le`], fused with the raw logits' max and
    /// log-sum-exp (one pass over memory, see [`crate::scan`]).
    pub fn load_f32le_scan(&mut self, bytes: &[u8]) -> Result<Scan, LogitsError> {
        if !bytes.len().is_multiple_of(4) {
            return Err(LogitsError::ByteLength { len: bytes.len() });
        }
        self.load_scanned(bytes.len() / 4, |dense| scan::copy_scan_f32le(dense, bytes))
    }

    /// As [`Self::load_f32le_scan`] without the log-sum-exp (returns the
    /// max): for a caller that has the exps summed elsewhere
    /// ([`scan::chunk_lse_f32le`] on another core).
    pub fn load_f32le_checked(&mut self, bytes: &[u8]) -> Result<f32, LogitsError> {
        if !bytes.len().is_multiple_of(4) {
            return Err(LogitsError::ByteLength { len: bytes.len() });
        }
        self.load_scanned(bytes.len() / 4, |dense| {
            scan::copy_check_f32le(dense, bytes)
        })
    }

    /// Loads a candidate view directly (the survivors of a device sampling
    /// prefix, `device_prefix.rs`): `cands` in their order over a
    /// vocabulary of `n_vocab`, `sorted` when they are sorted descending.
    /// The dense view is left stale: stages never read it in the candidate
    /// view. The caller checks ids and logits.
    pub fn load_candidates(
        &mut self,
        n_vocab: usize,
        cands: &[SdCandidate],
        sorted: bool,
    ) -> Result<(), LogitsError> {
        self.check_len(n_vocab)?;
        if cands.len() > n_vocab {
            return Err(LogitsError::TooLarge {
                len: cands.len(),
                limit: n_vocab,
            });
        }
        self.resize(n_vocab);
        self.cand[..cands.len()].copy_from_slice(cands);
        self.view = SD_VIEW_CANDIDATES;
        self.size = cands.len();
        self.sorted = sorted as u32;
        self.selected = -1;
        Ok(())
    }

    /// Loads `n` logits that `fill` writes, every one of them, in the dense
    /// view; the caller vouches for them (finite or −∞, not all −∞): a
    /// sparse row's dense layout ([`crate::sparse`]).
    pub(crate) fn load_with(
        &mut self,
        n: usize,
        fill: impl FnOnce(&mut [f32]),
    ) -> Result<(), LogitsError> {
        self.load_scanned(n, |dense| {
            fill(dense);
            Ok(())
        })
    }

    /// Loads `n` logits through `fill`, which writes and checks them itself.
    fn load_scanned<T>(
        &mut self,
        n: usize,
        fill: impl FnOnce(&mut [f32]) -> Result<T, LogitsError>,
    ) -> Result<T, LogitsError> {
        self.check_len(n)?;
        self.resize(n);
        let scanned = fill(&mut self.dense);
        self.reset_view();
        scanned
    }

    fn finish_load(&mut self) -> Result<(), LogitsError> {
        self.reset_view();
        logits::validate(&self.dense)
    }

    /// Back to the dense view with nothing selected (keeps the logits).
    pub(crate) fn reset_view(&mut self) {
        self.view = SD_VIEW_DENSE;
        self.size = self.dense.len();
        self.sorted = 0;
        self.selected = -1;
    }

    /// Keeps the view, forgets any earlier selection.
    pub(crate) fn clear_selection(&mut self) {
        self.selected = -1;
    }

    /// Lends the buffer to one plugin call: `f` gets the ABI header over
    /// the current view, with pointers into `dense` and `cand` that are
    /// valid (and exclusively borrowed) for the call only; the view, size,
    /// sorted flag and selection the stage set are read back afterwards.
    /// Whatever else it wrote into the header (pointers, `n_vocab`) dies
    /// with it — the host never uses a pointer a stage handed back — but a
    /// stage that wrote them is recorded ([`Self::header_changed`]) so the
    /// post-checks refuse it: it was aiming the rest of the chain, or its
    /// own later writes, at memory the host does not own.
    #[inline(always)]
    pub(crate) fn with_abi<R>(&mut self, f: impl FnOnce(&mut SdTokens) -> R) -> R {
        let host = SdTokens {
            struct_size: size_of::<SdTokens>() as u32,
            // Fits: check_len caps every load at u32::MAX entries.
            n_vocab: self.dense.len() as u32,
            dense: self.dense.as_mut_ptr(),
            cand: self.cand.as_mut_ptr(),
            size: self.size,
            view: self.view,
            sorted: self.sorted,
            selected: self.selected,
        };
        let mut raw = SdTokens { ..host };
        let out = f(&mut raw);
        let changed = (raw.dense != host.dense)
            | (raw.cand != host.cand)
            | (raw.n_vocab != host.n_vocab)
            | (raw.struct_size != host.struct_size);
        self.header_changed = if changed {
            Some(changed_field(&host, &raw))
        } else {
            None
        };
        self.view = raw.view;
        self.size = raw.size;
        self.sorted = raw.sorted;
        self.selected = raw.selected;
        out
    }

    /// The host-owned `sd_tokens` field the last stage overwrote, if any.
    pub(crate) fn header_changed(&self) -> Option<&'static str> {
        self.header_changed
    }

    /// The sorted flag as the last stage left it.
    pub(crate) fn sorted_flag(&self) -> u32 {
        self.sorted
    }

    /// The first candidate id that appears twice in the candidate view
    /// (ids must already be known to be below `n_vocab`). One pass setting
    /// a flag per id in a reused byte map, branch-free; the map is cleared
    /// again by the same ids, or wholesale when they are many.
    pub(crate) fn duplicate_candidate(&mut self) -> Option<u32> {
        let n = self.dense.len();
        if self.is_dense() || self.size < 2 {
            return None;
        }
        if self.seen.len() < n {
            self.seen.resize(n, 0);
        }
        let cands = &self.cand[..self.size.min(self.cand.len())];
        let seen = &mut self.seen[..n];
        let mut twice = 0u8;
        for c in cands {
            let flag = &mut seen[c.id as usize];
            twice |= *flag;
            *flag = 1;
        }
        if cands.len() < n / 8 {
            for c in cands {
                seen[c.id as usize] = 0;
            }
        } else {
            seen.fill(0);
        }
        if twice == 0 {
            return None;
        }
        first_repeat(cands)
    }

    /// The view as the last stage left it (`SD_VIEW_*`, or whatever
    /// unknown value it wrote).
    pub(crate) fn view(&self) -> u32 {
        self.view
    }

    /// The candidate count as the last stage left it (unchecked: see
    /// [`Self::len`] for the live entries).
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The token id the last stage selected, or -1 (unchecked).
    pub(crate) fn selected(&self) -> i64 {
        self.selected
    }

    /// Converts the dense view into a full, unsorted candidate list.
    pub(crate) fn materialize(&mut self) {
        if self.view == SD_VIEW_DENSE {
            for (i, (c, &l)) in self.cand.iter_mut().zip(&self.dense).enumerate() {
                *c = SdCandidate {
                    id: i as u32,
                    logit: l,
                };
            }
            self.size = self.dense.len();
            self.view = SD_VIEW_CANDIDATES;
            self.sorted = 0;
        }
    }

    /// The dense logits (after a chain ran, as the stages left them).
    pub fn dense(&self) -> &[f32] {
        &self.dense
    }

    pub(crate) fn is_dense(&self) -> bool {
        self.view == SD_VIEW_DENSE
    }

    /// The live candidates in the candidate view (empty in the dense view).
    pub fn candidates(&self) -> &[SdCandidate] {
        if self.is_dense() {
            &[]
        } else {
            &self.cand[..self.size.min(self.cand.len())]
        }
    }

    /// Number of live entries of the current view.
    pub fn len(&self) -> usize {
        if self.is_dense() {
            self.dense.len()
        } else {
            self.size
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Iterates the survivors (finite logits) of the current view as
    /// (token id, logit), in the view's order.
    pub fn survivors(&self) -> impl Iterator<Item = (u32, f32)> + '_ {
        let dense = self
            .is_dense()
            .then(|| self.dense.iter().enumerate().map(|(i, &l)| (i as u32, l)))
            .into_iter()
            .flatten();
        let cand = self.candidates().iter().map(|c| (c.id, c.logit));
        dense.chain(cand).filter(|&(_, l)| l > f32::NEG_INFINITY)
    }

    /// The post-chain distribution: softmax over the survivors (sum in
    /// f64). Returns (id, probability) of the `n` most probable, descending
    /// (ties by id), and the probability of `chosen`.
    pub fn distribution(&self, n: usize, chosen: u32) -> (Vec<(u32, f32)>, f32) {
        let max = self
            .survivors()
            .fold(f32::NEG_INFINITY, |m, (_, l)| m.max(l));
        if max == f32::NEG_INFINITY {
            return (Vec::new(), 0.0);
        }
        let sum: f64 = self
            .survivors()
            .map(|(_, l)| logits::exp_f32(l - max) as f64)
            .sum();
        let prob = |l: f32| (logits::exp_f32(l - max) as f64 / sum) as f32;
        let mut chosen_p = 0.0;
        let mut top: Vec<(u32, f32)> = Vec::new();
        for (id, l) in self.survivors() {
            if id == chosen {
                chosen_p = prob(l);
            }
            if n > 0 {
                top.push((id, l));
            }
        }
        if n > 0 {
            let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
            if top.len() > n {
                top.select_nth_unstable_by(n - 1, by_logit);
                top.truncate(n);
            }
            top.sort_by(by_logit);
            for e in &mut top {
                e.1 = prob(e.1);
            }
        }
        (top, chosen_p)
    }
}

/// Which host-owned field of `raw` differs from `host` (cold: a stage broke
/// the ABI).
#[cold]
fn changed_field(host: &SdTokens, raw: &SdTokens) -> &'static str {
    if raw.dense != host.dense {
        "dense"
    } else if raw.cand != host.cand {
        "cand"
    } else if raw.n_vocab != host.n_vocab {
        "n_vocab"
    } else {
        "struct_size"
    }
}

/// The first id seen twice in `cands` (cold: only once a repeat is known).
#[cold]
fn first_repeat(cands: &[SdCandidate]) -> Option<u32> {
    let mut seen = std::collections::HashSet::with_capacity(cands.len());
    cands.iter().map(|c| c.id).find(|&id| !seen.insert(id))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Checked at compile time: no unsafe impl needed to move or share it.
    const _: fn() = || {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<TokenBuffer>();
    };

    #[test]
    fn a_stage_writes_through_the_header_and_its_view_comes_back() {
        let mut buf = TokenBuffer::new();
        buf.load(&[1.0, 3.0, 2.0]).unwrap();
        buf.with_abi(|t| {
            assert_eq!((t.n_vocab, t.size, t.view), (3, 3, SD_VIEW_DENSE));
            // SAFETY: the header points at this buffer's 3 dense logits.
            unsafe { *t.dense.add(2) = f32::NEG_INFINITY };
        });
        assert_eq!(buf.dense(), &[1.0, 3.0, f32::NEG_INFINITY]);

        buf.materialize();
        buf.with_abi(|t| {
            assert_eq!((t.size, t.view, t.sorted), (3, SD_VIEW_CANDIDATES, 0));
            // SAFETY: the header points at this buffer's 3 candidates.
            unsafe { std::ptr::swap(t.cand, t.cand.add(1)) };
            t.size = 2;
            t.sorted = 1;
            t.selected = 1;
            // Only the view is read back: these die with the header, and
            // are recorded for the post-checks.
            t.n_vocab = 99;
            t.dense = std::ptr::null_mut();
            t.cand = std::ptr::null_mut();
        });
        assert_eq!(buf.header_changed(), Some("dense"));
        let c = |id, logit| SdCandidate { id, logit };
        assert_eq!(buf.candidates(), &[c(1, 3.0), c(0, 1.0)]);
        assert_eq!((buf.len(), buf.selected(), buf.n_vocab()), (2, 1, 3));
        buf.with_abi(|t| {
            assert_eq!((t.n_vocab, t.size, t.sorted, t.selected), (3, 2, 1, 1));
            assert!(!t.dense.is_null() && !t.cand.is_null());
        });
        assert_eq!(buf.header_changed(), None);
        buf.with_abi(|t| t.n_vocab = 2);
        assert_eq!(buf.header_changed(), Some("n_vocab"));

        buf.reset_view();
        assert!(buf.is_dense());
        assert_eq!((buf.len(), buf.selected()), (3, -1));
    }

    #[test]
    fn duplicate_ids_are_found_and_the_scratch_is_left_clear() {
        let c = |id| SdCandidate { id, logit: 0.0 };
        let mut buf = TokenBuffer::new();
        buf.load(&[0.0; 64]).unwrap();
        // Few ids (cleared one by one) and many (cleared wholesale).
        for ids in [vec![5, 9, 5], (0..63).chain([17]).collect::<Vec<u32>>()] {
            let cands: Vec<SdCandidate> = ids.iter().map(|&i| c(i)).collect();
            buf.load_candidates(64, &cands[..cands.len() - 1], false)
                .unwrap();
            assert_eq!(buf.duplicate_candidate(), None);
            buf.load_candidates(64, &cands, false).unwrap();
            let want = if ids.len() == 3 { 5 } else { 17 };
            assert_eq!(buf.duplicate_candidate(), Some(want));
            assert!(buf.seen.iter().all(|&f| f == 0));
        }
    }
}
