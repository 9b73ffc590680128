//! How many tokens to draft next round: the rule of each draft source.
//!
//! - Prompt lookup drafts for free (a search of the text so far), and its
//!   matches come in runs (a copied passage is accepted whole, a paraphrase
//!   not at all): [`DraftLength`] follows the runs, +2 after a round whose
//!   drafts were all accepted, −1 after one with a rejection (between 1 and
//!   the request's `max_draft_tokens`), the schedule of Hugging Face
//!   transformers' assisted generation (`AssistedCandidateGenerator`,
//!   `num_assistant_tokens_schedule = "heuristic"`).
//! - A draft model's drafts cost a decode step of the draft model each, and
//!   on a CPU that step is no small part of the target's (the default
//!   model's Q4_1 step is about half its F16 requantisation's: ~8.6 against
//!   ~17 ms). Growing the draft on acceptance alone then loses: at 87 %
//!   acceptance the schedule above reached K = 8–16 and Generate ran at
//!   0.68× its speed without speculation. [`MeasuredLength`] instead times
//!   the generation's own rounds — a draft token, the target's one-row
//!   step, each further row of a verify pass — estimates the acceptance
//!   rate α, and drafts the K that maximises the expected tokens per unit
//!   of time, (1 − α^(K+1)) / (1 − α) tokens for K·draft + step +
//!   K·row. It drafts at least one token a round: a configured draft model
//!   is always consulted, and a K of 0 would stop the timings that could
//!   show drafting paying again.

#![forbid(unsafe_code)]

/// The acceptance-following draft length (prompt lookup; see the module
/// doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftLength {
    k: usize,
    max: usize,
}

impl DraftLength {
    /// Starts at half of `max` (rounded up).
    pub fn new(max: usize) -> Self {
        let max = max.max(1);
        DraftLength {
            k: max.div_ceil(2),
            max,
        }
    }

    pub fn get(self) -> usize {
        self.k
    }

    /// After a round that drafted `drafted` tokens and accepted `accepted`.
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.k = if accepted == drafted {
            (self.k + 2).min(self.max)
        } else {
            self.k.saturating_sub(1).max(1)
        };
    }
}

/// The rule of a request's draft source.
#[derive(Clone, Debug, PartialEq)]
pub enum DraftRule {
    /// Prompt lookup: [`DraftLength`].
    Lookup(DraftLength),
    /// A draft model: [`MeasuredLength`].
    Measured(MeasuredLength),
}

impl DraftRule {
    pub fn get(&self) -> usize {
        match self {
            DraftRule::Lookup(l) => l.get(),
            DraftRule::Measured(l) => l.get(),
        }
    }

    /// After a round that drafted `drafted` tokens and accepted `accepted`.
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        match self {
            DraftRule::Lookup(l) => l.update(drafted, accepted),
            DraftRule::Measured(l) => l.update(drafted, accepted),
        }
    }

    /// Drafting `k` tokens took `ns`.
    pub fn drafted(&mut self, k: usize, ns: u128) {
        if let DraftRule::Measured(l) = self {
            l.drafted(k, ns);
        }
    }

    /// The target's pass of `rows` rows took `ns`.
    pub fn passed(&mut self, rows: usize, ns: u128) {
        if let DraftRule::Measured(l) = self {
            l.passed(rows, ns);
        }
    }
}

/// Weight of a new timing in the running means: the last few rounds
/// count (a generation's costs drift as its context grows), one slow
/// round does not decide.
const NEW_WEIGHT: f64 = 0.25;

/// A running mean of one cost, in nanoseconds (None until measured).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Mean(Option<f64>);

impl Mean {
    fn add(&mut self, ns: f64) {
        self.0 = Some(match self.0 {
            None => ns,
            Some(m) => m + NEW_WEIGHT * (ns - m),
        });
    }
}

/// The cost-measuring draft length (a draft model; see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredLength {
    max: usize,
    /// One draft token.
    draft: Mean,
    /// The target's pass of one row (a plain decode step).
    step: Mean,
    /// Each row of a verify pass after its first.
    row: Mean,
    /// Whether a draft has been timed: the first is not, since it also
    /// prefills the draft model's cache with the prompt (hundreds of
    /// milliseconds, not a draft's cost).
    first_drafted: bool,
    /// Drafts accepted and drafts judged (a rejected draft is judged; the
    /// drafts after it are not), with a prior of one of each: α starts at
    /// ½.
    accepted: f64,
    judged: f64,
}

impl MeasuredLength {
    pub fn new(max: usize) -> Self {
        MeasuredLength {
            max: max.max(1),
            draft: Mean::default(),
            step: Mean::default(),
            row: Mean::default(),
            first_drafted: false,
            accepted: 1.0,
            judged: 2.0,
        }
    }

    /// The next round's draft length: first a plain step and a one-token
    /// draft (to time them), then the best K ≥ 1 by the costs so far.
    pub fn get(&self) -> usize {
        let (Some(step), Some(draft), Some(row)) = (self.step.0, self.draft.0, self.row.0) else {
            return usize::from(self.step.0.is_some());
        };
        let alpha = (self.accepted / self.judged).clamp(0.0, 0.999);
        let (draft, row) = (draft / step, row / step);
        let mut best = (1, 0.0);
        let mut expected = 1.0;
        let mut power = 1.0;
        for k in 1..=self.max {
            power *= alpha;
            expected += power;
            let rate = expected / (k as f64 * (draft + row) + 1.0);
            if rate > best.1 {
                best = (k, rate);
            }
        }
        best.0
    }

    /// After a round that drafted `drafted` tokens and accepted `accepted`.
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.accepted += accepted as f64;
        self.judged += (accepted + usize::from(accepted < drafted)) as f64;
    }

    /// Drafting `k` tokens took `ns` (the generation's first drafting is
    /// not counted: it includes the draft model's prefill).
    pub fn drafted(&mut self, k: usize, ns: u128) {
        if k == 0 {
            return;
        }
        if !self.first_drafted {
            self.first_drafted = true;
            return;
        }
        self.draft.add(ns as f64 / k as f64);
    }

    /// The target's pass of `rows` rows took `ns`.
    pub fn passed(&mut self, rows: usize, ns: u128) {
        let ns = ns as f64;
        match (rows, self.step.0) {
            (0, _) => {}
            (1, _) => self.step.add(ns),
            (_, Some(step)) => self.row.add(((ns - step) / (rows - 1) as f64).max(0.0)),
            (_, None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_length_grows_on_full_acceptance_and_shrinks_on_a_rejection() {
        let mut l = DraftLength::new(8);
        assert_eq!(l.get(), 4);
        l.update(4, 4);
        assert_eq!(l.get(), 6);
        l.update(6, 6);
        l.update(8, 8);
        assert_eq!(l.get(), 8);
        l.update(8, 3);
        assert_eq!(l.get(), 7);
        for _ in 0..10 {
            l.update(1, 0);
        }
        assert_eq!(l.get(), 1);
        // A round without drafts changes nothing.
        l.update(0, 0);
        assert_eq!(l.get(), 1);
    }

    /// A measured length after `rounds` rounds of `k` drafts with the
    /// costs given in units of a step, accepting a fraction `alpha`.
    fn measured(draft: f64, row: f64, alpha: f64) -> MeasuredLength {
        let mut l = MeasuredLength::new(16);
        assert_eq!(l.get(), 0, "a plain step first");
        l.passed(1, 1_000_000);
        assert_eq!(l.get(), 1, "then one draft");
        // The first drafting prefills the draft model: not a draft's cost.
        l.drafted(1, 300_000_000);
        assert_eq!(l.draft, Mean(None));
        l.drafted(1, (draft * 1e6) as u128);
        assert_eq!(l.get(), 1, "until a pass of two rows is timed");
        for _ in 0..50 {
            l.drafted(4, (4.0 * draft * 1e6) as u128);
            l.passed(5, ((1.0 + 4.0 * row) * 1e6) as u128);
        }
        // 1,000 one-draft rounds, `alpha` of them accepted.
        let accepted = (1000.0 * alpha) as usize;
        for i in 0..1000 {
            l.update(1, usize::from(i < accepted));
        }
        l
    }

    /// The measured costs decide: this CPU's same-size drafter (a Q4_1
    /// step ≈ 0.5 of the F16 target's, a verify row ≈ 0.24) at 87 %
    /// acceptance drafts one token (≈ 1.07 tokens per step's time, where
    /// K = 8 would give 0.80); a cheap drafter and cheap rows (a GPU)
    /// draft long; a drafter that is rarely right drafts the least, one.
    #[test]
    fn the_measured_length_maximises_tokens_per_unit_of_time() {
        assert_eq!(measured(0.5, 0.24, 0.87).get(), 1);
        let gpu = measured(0.3, 0.02, 0.87).get();
        assert!((4..=8).contains(&gpu), "{gpu}");
        assert_eq!(measured(0.5, 0.24, 0.2).get(), 1);
        assert_eq!(measured(0.3, 0.02, 0.7).get(), 2);
        assert_eq!(measured(0.05, 0.05, 0.99).get(), 16);
    }

    #[test]
    fn rounds_without_drafts_or_rows_change_nothing() {
        let mut l = MeasuredLength::new(8);
        let before = l.clone();
        l.update(0, 0);
        l.drafted(0, 5);
        assert_eq!(l, before, "no drafts, no first drafting");
        l.passed(0, 5);
        // A pass of several rows before any one-row step is not a row's
        // cost yet.
        l.passed(3, 5);
        assert_eq!(l, before);
    }
}
