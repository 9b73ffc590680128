//! The next mask computed ahead (after an accept that follows an apply)
//! is the mask computed inline (after a replay of accepts), at every step
//! of random walks, in forks taken while it is being computed, and after a
//! refused token.

mod common;

use common::{Buffer, P, Rng, TestVocab, tiny_config};

const SCHEMA: &str = r#"{"type":"object","properties":{
    "n":{"type":"integer","minimum":-5,"maximum":500},
    "s":{"type":"string","maxLength":6},
    "b":{"type":"boolean"}},
    "required":["n","b"],"additionalProperties":false}"#;

/// Names of this process's threads the stage's pool runs (`constraint-mask-N`).
fn mask_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("constraint-mask"))
        .count()
}

/// The survivors of a dense apply over `logits`.
fn survivors(st: &mut common::State<'_>, buf: &mut Buffer, logits: &[f32]) -> Vec<u32> {
    buf.load_dense(logits);
    st.apply(buf).unwrap();
    buf.survivors()
}

fn best_non_eog(v: &TestVocab, buf: &Buffer, alive: &[u32]) -> Option<u32> {
    alive
        .iter()
        .copied()
        .filter(|&i| !v.is_eog(i))
        .max_by(|&a, &b| buf.dense[a as usize].total_cmp(&buf.dense[b as usize]))
}

// One test, not several: the thread checks need to see the pool before any
// other test of this binary has started it.
#[test]
fn masks_computed_ahead_equal_masks_computed_inline() {
    // Always ahead: the tiny vocabulary's masks take less than the default
    // threshold.
    let (v, cfg) = tiny_config(&[P::Str("json_schema", SCHEMA), P::Num("ahead_min_us", 0.0)]);
    let mut buf = Buffer::new(v.len());
    let zeros = vec![0.0f32; v.len()];

    // A replay (accepts, no apply between) computes nothing ahead.
    let mut replay = cfg.state();
    for &t in &[v.id(b"{"), v.id(b"\"")] {
        replay.accept(t).unwrap();
    }
    assert_eq!(mask_threads(), 0, "a replay started the mask threads");
    let after_replay = survivors(&mut replay, &mut buf, &zeros);
    assert!(!after_replay.is_empty());

    for seed in 0..24u64 {
        let mut rng = Rng(seed);
        let mut walked = cfg.state();
        let mut tokens = Vec::new();
        for step in 0..80 {
            let logits: Vec<f32> = (0..v.len()).map(|_| (rng.next() >> 40) as f32).collect();
            // `walked` has applied and accepted every step: its mask was
            // computed ahead (from the second step on).
            let ahead = survivors(&mut walked, &mut buf, &logits);
            let tok = best_non_eog(&v, &buf, &ahead);
            let mut inline = cfg.state();
            for &t in &tokens {
                inline.accept(t).unwrap();
            }
            assert_eq!(
                survivors(&mut inline, &mut buf, &logits),
                ahead,
                "seed {seed}, step {step}, after {tokens:?}"
            );
            let Some(tok) = tok else { break };
            walked.accept(tok).unwrap();
            tokens.push(tok);
            // A fork taken now, while the next mask is being computed,
            // has that mask too, and goes on independently.
            if step % 5 == 0 {
                let mut fork = walked.fork();
                let mut inline = cfg.state();
                for &t in &tokens {
                    inline.accept(t).unwrap();
                }
                assert_eq!(
                    survivors(&mut fork, &mut buf, &zeros),
                    survivors(&mut inline, &mut buf, &zeros),
                    "fork: seed {seed}, step {step}"
                );
            }
        }
    }
    assert!(mask_threads() > 0, "no mask was computed ahead");

    // A token refused after a mask was computed ahead leaves the state
    // as it was.
    let mut st = cfg.state();
    st.allowed(v.len()).unwrap();
    st.accept(v.id(b"{")).unwrap();
    st.allowed(v.len()).unwrap();
    st.accept(v.id(b" ")).unwrap();
    assert!(st.accept(v.id(b"}")).is_err());
    let mut inline = cfg.state();
    inline.accept(v.id(b"{")).unwrap();
    inline.accept(v.id(b" ")).unwrap();
    assert_eq!(
        st.allowed(v.len()).unwrap(),
        inline.allowed(v.len()).unwrap()
    );
}
