//! Fuzzes the streaming stop-string filter (`samplerd::generate::stop_filter::StopFilter`)
//! against a direct reference: stop strings and token chunks are arbitrary
//! bytes (multi-byte characters split anywhere).
//!
//! Oracle: the streamed bytes are always a prefix of the text; without a
//! match, stream + `finish()` is the whole text and no stop string occurs in
//! it; with a match, generation stops at the first chunk that completes an
//! occurrence and the stream is the text before the earliest-starting
//! completed occurrence. `match_stop_suffix` agrees with a naive check.

#![no_main]

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use samplerd::generate::stop_filter::{StopFilter, match_stop_suffix};

/// Smallest start of an occurrence of any stop that ends within `text`.
fn earliest_match(text: &[u8], stops: &[Vec<u8>]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty() && s.len() <= text.len())
        .filter_map(|s| text.windows(s.len()).position(|w| w == s.as_slice()))
        .min()
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    // A small alphabet makes matches likely; raw bytes cover the rest.
    let small: bool = u.arbitrary()?;
    let byte = |u: &mut Unstructured<'_>| -> Result<u8> {
        let b: u8 = u.arbitrary()?;
        Ok(if small {
            b"ab\xe4\xb8"[usize::from(b % 4)]
        } else {
            b
        })
    };
    let n_stops = u.int_in_range(0u8..=4)?;
    let mut stops = Vec::new();
    for _ in 0..n_stops {
        let len = u.int_in_range(0u8..=6)?;
        stops.push((0..len).map(|_| byte(u)).collect::<Result<Vec<u8>>>()?);
    }
    let n_chunks = u.int_in_range(0u8..=32)?;
    let mut chunks = Vec::new();
    for _ in 0..n_chunks {
        let len = u.int_in_range(0u8..=5)?;
        chunks.push((0..len).map(|_| byte(u)).collect::<Result<Vec<u8>>>()?);
    }

    let mut filter = StopFilter::new(&stops);
    let mut text = Vec::new();
    let mut streamed = Vec::new();
    for chunk in &chunks {
        text.extend_from_slice(chunk);
        let step = filter.push(chunk);
        streamed.extend_from_slice(&step.emit);
        assert!(
            text.starts_with(&streamed),
            "streamed bytes are not a prefix of the text"
        );
        let expected = earliest_match(&text, &stops);
        if step.stopped {
            assert_eq!(Some(streamed.len()), expected, "stopped at the wrong place");
            return Ok(());
        }
        assert_eq!(
            expected, None,
            "a stop string completed but was not reported"
        );
        // The suffix matcher agrees with a naive check on the text so far.
        let refs: Vec<&[u8]> = stops.iter().map(Vec::as_slice).collect();
        let naive = stops
            .iter()
            .filter(|s| !s.is_empty() && text.ends_with(s))
            .map(|s| text.len() - s.len())
            .min();
        assert_eq!(match_stop_suffix(&text, &refs), naive);
    }
    streamed.extend(filter.finish());
    assert_eq!(streamed, text, "stream + finish is not the whole text");
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
