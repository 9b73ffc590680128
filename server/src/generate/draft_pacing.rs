//! Whether a speculating generation drafts at all: the measured time per
//! committed token of its rounds with drafts against its plain decode
//! steps'.
//!
//! A draft length rule ([`super::draft_length`]) picks how many tokens to
//! draft from a model of the costs; what a round really costs also holds
//! what no such model sees — the chain's verification of every row, the
//! hand-offs between the sampling, engine and draft threads, the draft
//! model catching up on the tokens it did not draft. On the project's
//! 2-core CPU a Q4_1 draft model for its own F16 requantisation drafted
//! with 98 % acceptance, and Generate still ran at 0.84× its speed without
//! speculation (0.54× for the Q8_0 target); an extract-to-JSON prompt
//! with prompt lookup, at 0.97×. A user who turns speculation on expects
//! it not to cost speed. So every round is timed from its drafting to the
//! end of its verification, and while rounds with drafts take longer per
//! committed token than plain steps, the generation decodes plainly and
//! only probes — drafts one round after [`FIRST_PROBE`] plain ones,
//! doubling the wait after each probe that still loses, up to
//! [`LAST_PROBE`] — so drafting resumes where the text turns draftable
//! (a copied passage) and a drafter that cannot pay costs a probe now and
//! then; a probe drafts at most [`PROBE_DRAFTS`] tokens. The output is the
//! same either way: pacing decides only how much to draft.
//!
//! `generate.pause_slow_drafting = false` turns pacing off (every round
//! drafts what the rule says: the behaviour to measure a drafter with).

#![forbid(unsafe_code)]

/// Plain steps before the first probe once drafting is paused.
pub const FIRST_PROBE: u32 = 8;
/// The longest wait between probes.
pub const LAST_PROBE: u32 = 128;
/// The most tokens a probe drafts: a probe that loses costs a verify row
/// per rejected draft, and prompt lookup's length may have grown to 16
/// before drafting paused.
pub const PROBE_DRAFTS: usize = 2;

/// Weight of a new round in the decayed sums: the last few rounds count
/// (a text turns draftable and back), one slow round does not decide.
const NEW_WEIGHT: f64 = 0.25;

/// Time and tokens of recent rounds, exponentially decayed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct PerToken {
    ns: f64,
    tokens: f64,
}

impl PerToken {
    fn add(&mut self, ns: u128, tokens: usize) {
        self.ns += NEW_WEIGHT * (ns as f64 - self.ns);
        self.tokens += NEW_WEIGHT * (tokens as f64 - self.tokens);
    }

    fn get(self) -> Option<f64> {
        (self.tokens > 0.0).then(|| self.ns / self.tokens)
    }
}

/// How a generation's drafting went, as its pacer measured it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Rounds with drafts took less time per committed token than plain
    /// steps.
    Paid,
    /// They took longer.
    Lost,
    /// Not both kinds of round were timed (a short generation, or one that
    /// drafted every round).
    Unknown,
}

/// One generation's pacing (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct Pacer {
    enabled: bool,
    plain: PerToken,
    drafting: PerToken,
    /// Whether a round with drafts has been seen: the first is not timed,
    /// since a draft model's first drafting also prefills its cache with
    /// the prompt.
    seen_drafting: bool,
    /// Plain rounds since the last round with drafts.
    since_drafting: u32,
    /// Plain rounds to wait before the next probe while paused.
    probe_after: u32,
}

impl Pacer {
    pub fn new(enabled: bool) -> Self {
        Pacer {
            enabled,
            plain: PerToken::default(),
            drafting: PerToken::default(),
            seen_drafting: false,
            since_drafting: 0,
            probe_after: FIRST_PROBE,
        }
    }

    /// Whether rounds with drafts have measured slower per token than
    /// plain steps.
    fn losing(&self) -> bool {
        matches!(
            (self.plain.get(), self.drafting.get()),
            (Some(plain), Some(drafting)) if drafting > plain
        )
    }

    /// How drafting went so far: [`Verdict::Unknown`] until both kinds of
    /// round have been timed.
    pub fn verdict(&self) -> Verdict {
        match (self.plain.get(), self.drafting.get()) {
            (Some(_), Some(_)) if self.losing() => Verdict::Lost,
            (Some(_), Some(_)) => Verdict::Paid,
            _ => Verdict::Unknown,
        }
    }

    /// The drafts the next round may make of the `k` its rule asks for:
    /// none while paused, at most [`PROBE_DRAFTS`] in a probe.
    pub fn limit(&self, k: usize) -> usize {
        if !self.enabled || !self.losing() {
            k
        } else if self.since_drafting >= self.probe_after {
            k.min(PROBE_DRAFTS)
        } else {
            0
        }
    }

    /// A round that verified `drafted` drafts and committed `tokens` took
    /// `ns`, from its drafting to the end of its verification.
    pub fn round(&mut self, drafted: usize, tokens: usize, ns: u128) {
        if tokens == 0 {
            return;
        }
        if drafted == 0 {
            self.plain.add(ns, tokens);
            self.since_drafting = self.since_drafting.saturating_add(1);
            return;
        }
        let probe = self.losing();
        self.since_drafting = 0;
        if !self.seen_drafting {
            self.seen_drafting = true;
            return;
        }
        self.drafting.add(ns, tokens);
        if probe {
            self.probe_after = if self.losing() {
                (self.probe_after * 2).min(LAST_PROBE)
            } else {
                FIRST_PROBE
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u128 = 1_000_000;

    impl Pacer {
        /// Whether the next round may draft (pacing on and drafting
        /// paused: only a probe may).
        fn may_draft(&self) -> bool {
            self.limit(1) > 0
        }

        /// Whether the next round is held back by pacing.
        fn paused(&self) -> bool {
            !self.may_draft()
        }
    }

    /// Plain steps of 10 ms and rounds with drafts at `per_token` ms per
    /// committed token (2 tokens a round), `n` of each, alternated.
    fn paced(enabled: bool, per_token: u128, n: usize) -> Pacer {
        let mut p = Pacer::new(enabled);
        for _ in 0..n {
            p.round(0, 1, 10 * MS);
            p.round(1, 2, 2 * per_token * MS);
        }
        p
    }

    #[test]
    fn drafting_that_pays_is_never_paused() {
        let p = paced(true, 6, 20);
        assert!(p.may_draft());
        assert!(!p.paused());
        assert_eq!(p.limit(16), 16);
    }

    #[test]
    fn drafting_slower_than_plain_steps_pauses_until_a_probe() {
        let mut p = paced(true, 14, 2);
        assert!(p.paused(), "{p:?}");
        // Probes after FIRST_PROBE plain steps, then after twice as many
        // while probes lose, up to LAST_PROBE.
        let mut waits = Vec::new();
        for _ in 0..7 {
            let mut wait = 0;
            while !p.may_draft() {
                p.round(0, 1, 10 * MS);
                wait += 1;
            }
            waits.push(wait);
            assert_eq!(p.limit(16), PROBE_DRAFTS, "a probe drafts little");
            p.round(2, 2, 28 * MS);
        }
        assert_eq!(waits, [FIRST_PROBE, 16, 32, 64, 128, 128, 128]);
        assert_eq!(p.limit(16), 0, "paused");
    }

    #[test]
    fn probes_that_win_resume_drafting() {
        let mut p = paced(true, 14, 2);
        let mut rounds = 0;
        while p.paused() {
            while !p.may_draft() {
                p.round(0, 1, 10 * MS);
            }
            // The text turned draftable: 5 tokens for 12 ms.
            p.round(4, 5, 12 * MS);
            rounds += 1;
            assert!(rounds < 10, "{p:?}");
        }
        // Drafting again every round, probes back to the shortest wait.
        assert!(p.may_draft());
        assert_eq!(p.probe_after, FIRST_PROBE);
    }

    #[test]
    fn the_first_drafting_is_not_timed_and_pacing_off_always_drafts() {
        let mut p = Pacer::new(true);
        p.round(0, 1, 10 * MS);
        // A draft model's first drafting prefills its cache: 500 ms.
        p.round(1, 2, 500 * MS);
        assert!(p.may_draft(), "{p:?}");
        let off = paced(false, 50, 20);
        assert!(off.may_draft());
        assert_eq!(off.limit(16), 16);
        assert_eq!(p.verdict(), Verdict::Unknown, "no drafting timed yet");
        assert_eq!(paced(true, 14, 2).verdict(), Verdict::Lost);
        assert_eq!(paced(true, 6, 2).verdict(), Verdict::Paid);
        // Nothing committed: nothing learnt.
        let before = p.clone();
        p.round(3, 0, MS);
        assert_eq!(p, before);
    }
}
