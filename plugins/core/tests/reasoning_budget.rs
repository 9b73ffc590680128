//! `reasoning_budget`: after `open` and `budget` tokens, `message` then
//! `close` are forced one per step (every other token at −inf, in both
//! views); a block the model closes itself is not forced; a replayed token
//! other than the forced one is refused.

mod common;

use common::*;
use samplerd_core_stages::reasoning_budget::ReasoningBudget;
use samplerd_plugin_sdk::Stage;

const N: usize = 12;

fn build(budget: f64, message: &str) -> ReasoningBudget {
    OwnedParams::new()
        .string("open", "1 2")
        .string("close", "3")
        .number("budget", budget)
        .string("message", message)
        .build::<ReasoningBudget>()
        .unwrap()
}

/// The one token left finite, if the stage forced one (both views agree).
fn forced(stage: &ReasoningBudget, st: &mut <ReasoningBudget as Stage>::State) -> Option<u32> {
    let mut out = Vec::new();
    for mut t in both_views(&[0.5; N]) {
        apply(stage, st, &mut t, &mut TestRng::constant(0)).unwrap();
        let live: Vec<u32> = t
            .entries()
            .into_iter()
            .filter(|e| e.1 != f32::NEG_INFINITY)
            .map(|e| e.0)
            .collect();
        out.push(if live.len() == N { None } else { Some(live) });
    }
    assert_eq!(out[0], out[1]);
    out[0].clone().map(|l| {
        assert_eq!(l.len(), 1);
        l[0]
    })
}

#[test]
fn a_spent_budget_forces_message_then_close() {
    let stage = build(2.0, "9 8");
    let mut st = stage.new_state();
    // Before the open marker (its first token alone does not open).
    for t in [5, 1, 5, 1] {
        assert_eq!(forced(&stage, &mut st), None);
        stage.try_accept(&mut st, t).unwrap();
    }
    stage.try_accept(&mut st, 2).unwrap(); // "1 2": open
    for t in [7, 7] {
        assert_eq!(forced(&stage, &mut st), None);
        stage.try_accept(&mut st, t).unwrap();
    }
    for want in [9, 8, 3] {
        assert_eq!(forced(&stage, &mut st), Some(want));
        assert!(stage.try_accept(&mut st, 4).is_err());
        stage.try_accept(&mut st, want).unwrap();
    }
    assert_eq!(forced(&stage, &mut st), None);
    stage.try_accept(&mut st, 1).unwrap();
    stage.try_accept(&mut st, 2).unwrap();
    assert_eq!(forced(&stage, &mut st), None, "one block only");
}

#[test]
fn a_block_closed_in_budget_is_left_alone_and_zero_closes_at_once() {
    let stage = build(3.0, "");
    let mut st = stage.new_state();
    for t in [1, 2, 7, 3, 7, 7, 7] {
        assert_eq!(forced(&stage, &mut st), None);
        stage.try_accept(&mut st, t).unwrap();
    }
    let stage = build(0.0, "");
    let mut st = stage.new_state();
    stage.try_accept(&mut st, 1).unwrap();
    stage.try_accept(&mut st, 2).unwrap();
    assert_eq!(forced(&stage, &mut st), Some(3));
}

#[test]
fn bad_parameters_name_the_parameter() {
    let err = |p: OwnedParams| p.build::<ReasoningBudget>().err().unwrap();
    assert_eq!(
        err(OwnedParams::new().string("open", "1").number("budget", 1.0)),
        "reasoning_budget: open and close must each hold at least one token id"
    );
    assert_eq!(
        err(OwnedParams::new().string("open", "1").string("close", "x")),
        "reasoning_budget: close holds \"x\", which is not a token id (a decimal u32)"
    );
    assert_eq!(
        err(OwnedParams::new()
            .string("open", "1")
            .string("close", "2")
            .number("budget", -1.0)),
        "reasoning_budget: budget must be in [0, 4294967295], got -1"
    );
}
