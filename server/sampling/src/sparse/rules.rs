//! What the sparse proof knows about each stage of a built chain: the core
//! stages by name (checked to come from the core library) with the
//! parameters the chain was built with, any other stage by its
//! `SD_STAGE_SPARSE_LOWERS_ONLY` flag. Each stage's behaviour here is that
//! of its implementation in `plugins/core/src` (see docs/SAMPLING.md,
//! "Sparse rows", for the rule per stage and the llama.cpp function each
//! follows).

use crate::chain::{CORE_LIBRARY, Chain};
use crate::spec::{ParamValue, StageSpec, show_number};
use crate::stage::StageInfo;

/// The largest window `penalties` keeps (`repeat_last_n = -1`), as
/// `plugins/core/src/penalties.rs` caps it.
const PENALTIES_MAX_WINDOW: u64 = 65_536;

/// A stage as the proof sees it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Rule {
    /// Changes nothing at these parameters (a stage at its "off" value).
    NoOp,
    /// Lowers or removes tokens one at a time, never above their logit
    /// (`penalties` with repeat >= 1, `dry` with a positive multiplier, a
    /// flagged plugin): every unsent logit stays under the bound; the
    /// rest's mass may lose up to `at_most` tokens' worth (`None`: any).
    Lowers { at_most: Option<u64> },
    /// `logit_bias` with its map: positive entries on unsent ids refuse,
    /// negative ones lower.
    LogitBias(Vec<(u32, f32)>),
    /// Raises some tokens it cannot tell apart by the row (refused while
    /// unsent tokens are live): `why` says which parameter does.
    Raises { why: String },
    /// Needs the whole row's distribution (dynamic temperature).
    NeedsRow { why: &'static str },
    /// Divides every logit by `t > 0` (saturated): monotone.
    Scale { t: f32 },
    /// Keeps the `k` best, sorted (top_k; top_p with p <= 0).
    TopK { k: usize },
    /// Keeps logits >= max + ln p, or the `min_keep` best.
    MinP { p: f32, min_keep: usize },
    /// The nucleus, 0 < p < 1.
    TopP { p: f32, min_keep: usize },
    /// Keeps (greedy: selects) the first maximum only.
    ArgMax,
    /// Anything else: its result may depend on every logit.
    Opaque { selects: bool },
}

/// One stage's rule, with the words a refusal uses for it.
#[derive(Clone, Debug)]
pub(crate) struct StageRule {
    /// The stage's name.
    pub name: String,
    /// "stage `top_k` (k = 40)".
    pub shown: String,
    pub rule: Rule,
}

/// Every stage of `chain`, in order.
pub(crate) fn rules(chain: &Chain) -> Vec<StageRule> {
    chain
        .links()
        .iter()
        .zip(&chain.spec().stages)
        .map(|(link, spec)| rule(&link.stage.info, spec))
        .collect()
}

/// A number parameter as the stage was built with it (its default when the
/// spec leaves it out).
fn number(info: &StageInfo, spec: &StageSpec, name: &str) -> f64 {
    match spec.params.get(name) {
        Some(ParamValue::Number(n)) => *n,
        _ => info
            .params
            .iter()
            .find(|p| p.name == name)
            .map_or(f64::NAN, |p| p.default),
    }
}

fn rule(info: &StageInfo, spec: &StageSpec) -> StageRule {
    let num = |name: &str| number(info, spec, name);
    let shown = |params: &[(&str, f64)]| {
        let mut s = format!("stage `{}`", info.name);
        if !params.is_empty() {
            let list: Vec<String> = params
                .iter()
                .map(|(k, v)| format!("{k} = {}", show_number(*v)))
                .collect();
            s.push_str(&format!(" ({})", list.join(", ")));
        }
        s
    };
    let plain = || shown(&[]);
    if info.library != CORE_LIBRARY.0 {
        let rule = if info.sparse_lowers_only {
            Rule::Lowers { at_most: None }
        } else {
            Rule::Opaque {
                selects: info.selects,
            }
        };
        return StageRule {
            name: info.name.clone(),
            shown: plain(),
            rule,
        };
    }
    // The core stages convert their parameters as written here
    // (`plugins/core/src/<stage>.rs`, `new`): f32 for probabilities and
    // temperatures, integers for counts.
    let (shown, rule) = match info.name.as_str() {
        "logit_bias" => {
            let map = match spec.params.get("bias") {
                Some(ParamValue::TokenMap(m)) => m.clone(),
                _ => Vec::new(),
            };
            let rule = if map.is_empty() {
                Rule::NoOp
            } else {
                Rule::LogitBias(map)
            };
            (plain(), rule)
        }
        "penalties" => {
            let (last_n, repeat) = (num("repeat_last_n"), num("repeat_penalty"));
            let (freq, presence) = (num("frequency_penalty"), num("presence_penalty"));
            let window = if last_n < 0.0 {
                PENALTIES_MAX_WINDOW
            } else {
                last_n as u64
            };
            let (r, f, p) = (repeat as f32, freq as f32, presence as f32);
            let rule = if window == 0 || (r == 1.0 && f == 0.0 && p == 0.0) {
                Rule::NoOp
            } else if r < 1.0 {
                Rule::Raises {
                    why: "a repeat_penalty below 1 raises the logits of repeated tokens, which \
                          may be unsent"
                        .into(),
                }
            } else {
                // repeat >= 1 divides a positive logit and multiplies a
                // non-positive one by at least 1; frequency and presence
                // are >= 0 (the stage refuses less): each only lowers.
                Rule::Lowers {
                    at_most: Some(window),
                }
            };
            (
                shown(&[
                    ("repeat_last_n", last_n),
                    ("repeat_penalty", repeat),
                    ("frequency_penalty", freq),
                    ("presence_penalty", presence),
                ]),
                rule,
            )
        }
        "dry" => {
            let (mult, base, last_n) = (num("multiplier"), num("base"), num("penalty_last_n"));
            let rule = if mult as f32 == 0.0 || (base as f32) < 1.0 || last_n == 0.0 {
                Rule::NoOp
            } else if mult < 0.0 {
                Rule::Raises {
                    why: "a negative multiplier raises the logits of tokens that continue a \
                          repeat, which may be unsent"
                        .into(),
                }
            } else {
                // multiplier · base^e with base >= 1 is >= 0: subtracted.
                Rule::Lowers { at_most: None }
            };
            (shown(&[("multiplier", mult)]), rule)
        }
        "top_n_sigma" => {
            let n = num("n");
            let rule = if n as f32 <= 0.0 {
                Rule::NoOp
            } else {
                Rule::Opaque { selects: false }
            };
            (shown(&[("n", n)]), rule)
        }
        "top_k" => {
            let k = num("k");
            let rule = if k == 0.0 {
                Rule::NoOp
            } else {
                Rule::TopK { k: k as usize }
            };
            (shown(&[("k", k)]), rule)
        }
        "typical_p" => {
            let p = num("p");
            let rule = if p as f32 >= 1.0 {
                Rule::NoOp
            } else {
                Rule::Opaque { selects: false }
            };
            (shown(&[("p", p)]), rule)
        }
        "top_p" => {
            let (p, min_keep) = (num("p"), num("min_keep"));
            let (pf, mk) = (p as f32, min_keep as usize);
            let rule = if pf >= 1.0 {
                Rule::NoOp
            } else if pf <= 0.0 {
                // `top_p::apply`: p <= 0 is a top-k of max(1, min_keep).
                Rule::TopK { k: mk.max(1) }
            } else {
                Rule::TopP {
                    p: pf,
                    min_keep: mk,
                }
            };
            (shown(&[("p", p)]), rule)
        }
        "min_p" => {
            let (p, min_keep) = (num("p"), num("min_keep"));
            let rule = if p as f32 <= 0.0 {
                Rule::NoOp
            } else {
                Rule::MinP {
                    p: p as f32,
                    min_keep: min_keep as usize,
                }
            };
            (shown(&[("p", p)]), rule)
        }
        "xtc" => {
            let (prob, threshold) = (num("probability"), num("threshold"));
            let rule = if prob as f32 <= 0.0 || threshold as f32 > 0.5 {
                Rule::NoOp
            } else {
                Rule::Opaque { selects: false }
            };
            (shown(&[("probability", prob)]), rule)
        }
        "temperature" => {
            let (t, range) = (num("t"), num("dynatemp_range"));
            let rule = if range as f32 > 0.0 {
                Rule::NeedsRow {
                    why: "dynamic temperature follows the entropy of the whole row",
                }
            } else if t as f32 == 1.0 {
                Rule::NoOp
            } else if t as f32 <= 0.0 {
                Rule::ArgMax
            } else {
                Rule::Scale { t: t as f32 }
            };
            (shown(&[("t", t)]), rule)
        }
        "greedy" => (plain(), Rule::ArgMax),
        _ => (
            plain(),
            Rule::Opaque {
                selects: info.selects,
            },
        ),
    };
    StageRule {
        name: info.name.clone(),
        shown,
        rule,
    }
}
