//! The proof that a chain's outcome does not depend on a sparse row's
//! unsent logits: a bound `m` on every unsent logit and an interval for
//! their log-sum-exp, carried through the stages before the first one that
//! decides (docs/SAMPLING.md, "Sparse rows", has the rule per stage). The
//! stages before it only lower logits one token at a time or scale them
//! (`rules`), so the bound is known before the step runs; the deciding
//! stage is checked against the sent entries' values as the earlier stages
//! left them, just before it runs ([`StageGate`]). If it cuts the row down
//! to sent entries, everything after runs on exactly the candidates the
//! dense row would give, and needs no proof.

use samplerd_plugin_sdk::abi::SdCandidate;

use super::nucleus::{self, Nucleus};
use super::row::{REST_SLACK, SparseRow};
use super::rules::{self, Rule, StageRule};
use crate::buffer::TokenBuffer;
use crate::chain::Chain;
use crate::error::{SampleError, SparseRefusal};
use crate::sequence::StageGate;

/// How the sent entries are laid out in the token buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// The sent entries alone, as a candidate view in id order: what the
    /// dense view's stages see of them, since every stage before the cut
    /// treats tokens one at a time and keeps their order, and the cutting
    /// stage ranks ties by id in the dense view and by position here.
    Candidates,
    /// The whole row: the sent logits in place and every unsent one at a
    /// single value consistent with the row (a row the proof covers).
    /// `top_p` with unsent tokens still live needs their mass in its
    /// normaliser; a row with nothing unsent, or nothing unsent above −∞,
    /// is the dense row itself.
    Dense,
}

/// What is known of the unsent tokens before a stage.
#[derive(Clone, Copy, Debug)]
struct Bound {
    /// Every unsent logit is at most this.
    m: f32,
    /// Their log-sum-exp lies in [lo, hi].
    lo: f64,
    hi: f64,
    unsent: usize,
}

impl Bound {
    /// After a stage that lowers or removes up to `at_most` tokens (any
    /// number: `None`): the bound stays; the mass may shrink by that many
    /// tokens of at most `e^m` each.
    fn lower(&mut self, at_most: Option<u64>) {
        if self.lo == f64::NEG_INFINITY {
            return;
        }
        self.lo = match at_most {
            None => f64::NEG_INFINITY,
            Some(0) => self.lo,
            Some(w) => {
                // ln(e^lo − w·e^m), −∞ once w·e^m can take it all
                let d = (w as f64).ln() + self.m as f64 - self.lo;
                if d >= 0.0 {
                    f64::NEG_INFINITY
                } else {
                    self.lo + (-d.exp()).ln_1p()
                }
            }
        };
    }

    /// After `logit / t` (saturated, as `temperature` writes it): the
    /// bound moves with the division (monotone, rounding included); of the
    /// mass only what `unsent` tokens at the new bound can hold is known.
    fn scale(&mut self, t: f32) {
        if self.m == f32::NEG_INFINITY {
            return;
        }
        self.m = (self.m / t).clamp(-f32::MAX, f32::MAX);
        self.lo = f64::NEG_INFINITY;
        self.hi = (self.unsent as f64).ln() + self.m as f64;
    }
}

/// The proof for one step: the layout, and the check at the deciding
/// stage.
pub(crate) struct Proof<'a> {
    rules: Vec<StageRule>,
    /// The deciding stage; `None` when the row is the dense row.
    cut_at: Option<usize>,
    bound: Bound,
    layout: Layout,
    /// The sent entries by ascending id.
    by_id: &'a [SdCandidate],
    sent: usize,
    n_vocab: usize,
    /// The live sent logits at the deciding stage (reused).
    scratch: Vec<f32>,
}

/// `n` with thousands separators (1,024), as messages print counts.
pub(crate) fn count(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

impl<'a> Proof<'a> {
    /// The bound carried to the first deciding stage of `chain` (refused
    /// here when that stage can never decide for a sparse row), and the
    /// layout that stage needs. `by_id` holds the row's entries by id.
    pub(crate) fn plan(
        chain: &Chain,
        row: SparseRow<'_>,
        by_id: &'a [SdCandidate],
    ) -> Result<Self, SparseRefusal> {
        let rules = rules::rules(chain);
        let r = row.rest_lse();
        let unsent = row.unsent();
        let m = row.unsent_bound();
        let mut proof = Proof {
            rules,
            cut_at: None,
            bound: Bound {
                m,
                lo: r,
                hi: r,
                unsent,
            },
            layout: Layout::Dense,
            by_id,
            sent: row.len(),
            n_vocab: row.n_vocab(),
            scratch: Vec::new(),
        };
        if m == f32::NEG_INFINITY {
            // Nothing unsent, or every unsent logit −∞: the dense row is
            // known whole.
            return Ok(proof);
        }
        // The dense layout stands the unsent tokens at f32(r − ln c)
        // (capped at m): the interval covers that row and the client's.
        let ln_c = (unsent as f64).ln();
        let widen = (r.abs() + ln_c) / 8_388_608.0 + REST_SLACK * (1.0 + (m as f64).abs() + ln_c);
        proof.bound.lo -= widen;
        proof.bound.hi += widen;
        for i in 0..proof.rules.len() {
            let rule = proof.rules[i].rule.clone();
            match rule {
                Rule::NoOp => {}
                Rule::Lowers { at_most } => proof.bound.lower(at_most),
                Rule::Scale { t } => proof.bound.scale(t),
                Rule::LogitBias(map) => {
                    let lowered = proof.check_bias(i, &map)?;
                    proof.bound.lower(Some(lowered));
                }
                Rule::Raises { why } => {
                    let shown = &proof.rules[i].shown;
                    return Err(proof.refuse(
                        i,
                        format!("{shown}: {why}; send the dense row"),
                        None,
                    ));
                }
                Rule::NeedsRow { why } => {
                    let shown = &proof.rules[i].shown;
                    return Err(proof.refuse(
                        i,
                        format!(
                            "{shown}: {why}, and no stage before it cuts the row down to the \
                             sent entries; put top_k or min_p before it, or send the dense row"
                        ),
                        None,
                    ));
                }
                Rule::Opaque { selects } => {
                    let shown = &proof.rules[i].shown;
                    let what = if selects {
                        "draws from every live token"
                    } else {
                        "needs every logit of the row"
                    };
                    return Err(proof.refuse(
                        i,
                        format!(
                            "{shown} {what}, and the chain never cuts the row down to the sent \
                             entries before it; add top_k (k below the {} entries sent) or min_p \
                             before it, or send the dense row",
                            count(proof.sent)
                        ),
                        None,
                    ));
                }
                Rule::TopP { .. } => {
                    proof.cut_at = Some(i);
                    return Ok(proof);
                }
                Rule::TopK { .. } | Rule::MinP { .. } | Rule::ArgMax => {
                    proof.cut_at = Some(i);
                    proof.layout = Layout::Candidates;
                    return Ok(proof);
                }
            }
        }
        // A built chain ends with a selecting stage, which decides above.
        Err(proof.refuse(
            proof.rules.len().saturating_sub(1),
            "the chain never cuts the row down to the sent entries; send the dense row".into(),
            None,
        ))
    }

    pub(crate) fn layout(&self) -> Layout {
        self.layout
    }

    fn refuse(&self, stage: usize, message: String, needed: Option<usize>) -> SparseRefusal {
        SparseRefusal {
            stage: self.rules.get(stage).map(|r| r.name.clone()),
            field: None,
            message,
            sent: self.sent,
            entries_needed: needed,
        }
    }

    fn is_sent(&self, id: u32) -> bool {
        self.by_id.binary_search_by_key(&id, |c| c.id).is_ok()
    }

    /// `logit_bias` before the cut: a positive bias on an unsent token
    /// could lift it over the sent ones (refused); the negative ones lower
    /// (their count is returned).
    fn check_bias(&self, i: usize, map: &[(u32, f32)]) -> Result<u64, SparseRefusal> {
        let mut lowered = 0u64;
        for &(id, b) in map {
            if id as usize >= self.n_vocab || self.is_sent(id) {
                continue;
            }
            if b > 0.0 {
                return Err(self.refuse(
                    i,
                    format!(
                        "stage `logit_bias`: a bias of +{b} on token {id}, which was not sent, may \
                         lift it above the sent entries; send token {id}'s logit or leave the bias out"
                    ),
                    None,
                ));
            }
            lowered += (b < 0.0) as u64;
        }
        Ok(lowered)
    }

    /// The live sent logits as the stages so far left them.
    fn read_sent(&mut self, buf: &TokenBuffer) {
        self.scratch.clear();
        if buf.is_dense() {
            let dense = buf.dense();
            self.scratch
                .extend(self.by_id.iter().map(|c| dense[c.id as usize]));
        } else if self.layout == Layout::Candidates {
            // Only sent entries were ever loaded.
            self.scratch
                .extend(buf.candidates().iter().map(|c| c.logit));
        } else {
            let by_id = self.by_id;
            self.scratch.extend(
                buf.candidates()
                    .iter()
                    .filter(|c| by_id.binary_search_by_key(&c.id, |s| s.id).is_ok())
                    .map(|c| c.logit),
            );
        }
        self.scratch.retain(|&l| l > f32::NEG_INFINITY);
    }

    /// The deciding stage `i` against the sent entries in `buf`: `Ok` when
    /// it keeps only sent entries, and the same ones in the same order as
    /// over the dense row.
    fn decide(&mut self, i: usize, buf: &TokenBuffer) -> Result<(), SparseRefusal> {
        self.read_sent(buf);
        let m = self.bound.m;
        let vals = &self.scratch;
        let above = vals.iter().filter(|&&l| l > m).count();
        let best = vals.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let shown = self.rules[i].shown.clone();
        let sent = count(self.sent);
        let insufficient_top = |k: usize| {
            format!(
                "{shown}: only {} of the {sent} sent entries lie above {m}, the bound on every \
                 unsent logit (the smallest sent value, or the rest's log-sum-exp, as the stages \
                 before left it), so the {} best may include unsent tokens; send more entries",
                count(above),
                count(k)
            )
        };
        match self.rules[i].rule.clone() {
            Rule::TopK { k } => {
                if above >= k {
                    return Ok(());
                }
                let needed = (self.sent <= k).then_some(k + 1);
                Err(self.refuse(i, insufficient_top(k), needed))
            }
            Rule::ArgMax => {
                if best > m {
                    return Ok(());
                }
                Err(self.refuse(
                    i,
                    format!(
                        "{shown}: the best sent logit ({best}) does not lie above {m}, the bound on \
                         every unsent logit, so an unsent token may be the maximum; send more entries"
                    ),
                    None,
                ))
            }
            Rule::MinP { p, min_keep } => {
                let keep = min_keep.max(1);
                if best == f32::NEG_INFINITY || best < m {
                    return Err(self.refuse(
                        i,
                        format!(
                            "{shown}: no sent entry lies above {m}, the bound on every unsent \
                             logit, so the row's largest logit may be unsent; send more entries"
                        ),
                        None,
                    ));
                }
                // `min_p::apply`: the threshold in f32, as the stage has it.
                let threshold = best + p.ln();
                if threshold <= m {
                    return Err(self.refuse(
                        i,
                        format!(
                            "{shown}: its threshold (max + ln p = {threshold}) does not lie above \
                             {m}, the bound on every unsent logit, so unsent tokens may pass it; \
                             send every entry whose logit is at least {threshold}"
                        ),
                        None,
                    ));
                }
                let passing = vals.iter().filter(|&&l| l >= threshold).count();
                // Fewer than min_keep pass: the stage keeps the min_keep best.
                if passing >= keep || above >= keep {
                    return Ok(());
                }
                Err(self.refuse(i, insufficient_top(keep), None))
            }
            Rule::TopP { p, min_keep } => {
                let found = nucleus::prove(&nucleus::Inputs {
                    sent: vals,
                    m,
                    rest_lo: self.bound.lo,
                    rest_hi: self.bound.hi,
                    unsent: self.bound.unsent,
                    n_vocab: self.n_vocab,
                    p,
                    min_keep,
                });
                let message = match found {
                    Nucleus::Kept(_) => return Ok(()),
                    Nucleus::Open { share } => format!(
                        "{shown}: the nucleus does not close inside the {} sent entries above {m}, \
                         the bound on every unsent logit (they hold {share:.2} of the mass); send \
                         more entries",
                        count(above)
                    ),
                    Nucleus::Uncertain { first, last } => format!(
                        "{shown}: whether the nucleus ends after {} or {} entries depends on the \
                         unsent tokens' mass (log-sum-exp in [{:.4}, {:.4}]) and the rounding of a \
                         sum over all {} logits; send more entries",
                        count(first),
                        count(last),
                        self.bound.lo,
                        self.bound.hi,
                        count(self.n_vocab)
                    ),
                    Nucleus::NoMax => format!(
                        "{shown}: no sent entry lies above {m}, the bound on every unsent logit, \
                         so the row's largest logit may be unsent; send more entries"
                    ),
                    Nucleus::TooLarge => format!(
                        "{shown}: a vocabulary of {} is too large for the proof's rounding bound; \
                         send the dense row",
                        count(self.n_vocab)
                    ),
                };
                Err(self.refuse(i, message, None))
            }
            // Never the deciding stage (`plan`).
            _ => Ok(()),
        }
    }
}

impl StageGate for Proof<'_> {
    fn before(&mut self, stage: usize, buf: &TokenBuffer) -> Result<(), SampleError> {
        if self.cut_at == Some(stage) {
            self.decide(stage, buf)?;
        }
        Ok(())
    }
}
