//! Whether the draft model drafts for a generation at all: its record over
//! the server's recent generations.
//!
//! Pacing ([`super::draft_pacing`]) stops a generation's drafting once its
//! rounds with drafts measure slower than its plain steps, but a draft
//! model has paid a fixed price by then: its first drafting prefills the
//! prompt into its own KV cache, and every probe catches that cache up on
//! the tokens decoded since the last. On the project's 2-core CPU (an F16
//! target, its Q4_1 requantisation drafting) that price held a paced
//! generation at 0.76× the speed without speculation while the loop itself
//! ran plain steps. How fast a draft model is against its target is a
//! property of the machine and the two files more than of one prompt, so
//! the server keeps a record: after a generation whose drafting ended up
//! losing, the next `2^losses − 1` choices that ask for the draft model
//! (at most [`MOST_SKIPPED`]) decode without it — no prefill, no probes —
//! and the one after tries again; a generation where drafting paid clears
//! the record. The output is the same either way (speculation never
//! changes the text); `Usage.draft_tokens` shows 0 for a skipped choice
//! and `samplerd_generate_speculation_skipped_total` counts them.
//!
//! Applies with `generate.pause_slow_drafting` (the switch for pacing as a
//! whole); prompt lookup, whose drafting costs no prefill and whose worth
//! depends on each prompt's text, is paced per generation only.

#![forbid(unsafe_code)]

use std::sync::{Mutex, PoisonError};

use super::draft_pacing::{Pacer, Verdict};

/// The most choices skipped in a row: a draft model that keeps losing is
/// still tried once in `MOST_SKIPPED + 1`, so a change (a quieter machine,
/// more draftable prompts) is found.
pub const MOST_SKIPPED: u32 = 31;

#[derive(Debug, Default)]
struct State {
    /// Generations in a row whose drafting lost.
    losses: u32,
    /// Choices still to decode without the draft model.
    skip: u32,
}

/// The draft model's record (see the module doc).
#[derive(Debug, Default)]
pub struct DraftRecord {
    state: Mutex<State>,
}

impl DraftRecord {
    /// Whether the choice about to decode drafts with the draft model
    /// (false: it decodes plainly, one of the skipped).
    pub fn take_turn(&self) -> bool {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if s.skip == 0 {
            return true;
        }
        s.skip -= 1;
        false
    }

    /// A drafting choice ended with `verdict`.
    pub fn finished(&self, verdict: Verdict) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match verdict {
            Verdict::Paid => *s = State::default(),
            Verdict::Lost => {
                s.losses = s.losses.saturating_add(1);
                s.skip = 1u32
                    .checked_shl(s.losses)
                    .map_or(MOST_SKIPPED, |n| (n - 1).min(MOST_SKIPPED));
            }
            Verdict::Unknown => {}
        }
    }
}

/// A drafting choice's pacer, which reports its [`Pacer::verdict`] to the
/// draft model's record when the choice ends, however it ends.
pub struct Recorded<'a> {
    pub pacer: Pacer,
    record: Option<&'a DraftRecord>,
}

impl<'a> Recorded<'a> {
    /// `pacer`, reporting to `record` (none: nothing to report to).
    pub fn new(pacer: Pacer, record: Option<&'a DraftRecord>) -> Self {
        Recorded { pacer, record }
    }
}

impl Drop for Recorded<'_> {
    fn drop(&mut self) {
        if let Some(record) = self.record {
            record.finished(self.pacer.verdict());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which of `n` choices draft, each drafting one reporting `verdict`.
    fn turns(record: &DraftRecord, n: usize, verdict: Verdict) -> String {
        (0..n)
            .map(|_| {
                if record.take_turn() {
                    record.finished(verdict);
                    'D'
                } else {
                    '.'
                }
            })
            .collect()
    }

    #[test]
    fn a_losing_draft_model_is_skipped_for_doubling_runs_of_choices() {
        let r = DraftRecord::default();
        assert_eq!(
            turns(&r, 16, Verdict::Lost),
            "D.D...D.......D.",
            "skips 1, 3, 7, … choices after each loss"
        );
        // Capped: once in MOST_SKIPPED + 1 choices at worst.
        turns(&r, 200, Verdict::Lost);
        let run = turns(&r, 2 * (MOST_SKIPPED as usize + 1), Verdict::Lost);
        assert_eq!(run.matches('D').count(), 2, "{run}");
    }

    #[test]
    fn a_generation_that_paid_clears_the_record_and_unknown_keeps_it() {
        let r = DraftRecord::default();
        assert_eq!(turns(&r, 4, Verdict::Lost), "D.D.");
        assert_eq!(turns(&r, 4, Verdict::Unknown), "..DD");
        // The record still holds 2 losses: one more loss skips 7.
        assert_eq!(turns(&r, 9, Verdict::Lost), "D.......D");
        let r = DraftRecord::default();
        assert_eq!(turns(&r, 3, Verdict::Lost), "D.D");
        assert!((0..3).all(|_| !r.take_turn()), "3 skipped after 2 losses");
        assert!(r.take_turn());
        r.finished(Verdict::Paid);
        assert_eq!(turns(&r, 8, Verdict::Paid), "DDDDDDDD");
        // The losses before are forgotten: a new loss skips 1, not 7.
        assert_eq!(turns(&r, 3, Verdict::Lost), "D.D");
    }
}
