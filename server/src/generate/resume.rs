//! Resuming a Generate (`GenerateRequest.resume`): the tokens a client
//! received before its stream was cut are replayed, so that the
//! generation goes on exactly as if it had not been.
//!
//! What they determine is rebuilt from them, each part as the
//! uninterrupted run built it:
//!
//! - **the sampler's state**: the prompt's window as history, then each
//!   token `accept`ed (penalty and DRY windows, the grammar) — a token the
//!   chain refuses (a bad word, an end token before `min_tokens`), or one
//!   that ends a run (the end-of-generation token without `ignore_eos`, a
//!   stop token id), was never sent by a real run;
//! - **the text state**: each token's bytes through the stop-string filter
//!   and the UTF-8 streamer, their output dropped (the client has it), and
//!   after each one the checks that end a generation — a generation that
//!   ended at the last token gets only its `Finished`, one that ended
//!   before it is refused;
//! - **the step counter**: the next step is the number of tokens;
//! - **the KV cache**: the model host runs the prompt as one prefill and
//!   then each token as one decode step (`ModelHost::run`), never as part
//!   of a longer step, because a step's arithmetic order depends on how
//!   many tokens it runs (`samplerd_model::prefix`) and the next logits
//!   must be the interrupted run's bits. The prompt cache serves what it
//!   holds of exactly that ([`super::prompt_cache::PromptCache::take`]).

#![forbid(unsafe_code)]

use samplerd_api::v1::FinishReason;
use samplerd_model::Utf8Streamer;
use samplerd_sampling::Sequence;

use super::stop_filter::StopFilter;
use crate::request::errors::RequestError;

/// Feeds the resumed tokens to the sequence as the decode loop did (after
/// the prompt's history): `ends` says which tokens would have ended the
/// generation instead of being accepted.
pub(super) fn accept(
    seq: &mut Sequence,
    tokens: &[u32],
    ends: impl Fn(u32) -> bool,
) -> Result<(), RequestError> {
    for (i, &t) in tokens.iter().enumerate() {
        if ends(t) {
            return Err(RequestError::invalid(
                format!("resume.token_ids[{i}]"),
                format!(
                    "token {t} ends a run without being sent (the model's end of generation \
                     unless ignore_eos, or one of stop_token_ids): the generation had finished \
                     before it"
                ),
            ));
        }
        seq.accept(t).map_err(|e| {
            RequestError::invalid(
                format!("resume.token_ids[{i}]"),
                format!("token {t} is not one the request's chain accepts there: {e}"),
            )
        })?;
    }
    Ok(())
}

/// Where a generation stands after a token: the checks of the decode loop,
/// in its order. `generated` counts that token; `position` is the tokens
/// in the session before it is decoded (prompt + earlier tokens).
pub(super) fn ends_after(
    stopped: bool,
    generated: u32,
    max_tokens: u32,
    position: usize,
    capacity: usize,
) -> Option<FinishReason> {
    if stopped {
        Some(FinishReason::StopString)
    } else if generated >= max_tokens {
        Some(FinishReason::MaxTokens)
    } else if position >= capacity {
        Some(FinishReason::ContextFull)
    } else {
        None
    }
}

/// Replays the resumed tokens' bytes (`bytes(t)`) through the stop filter
/// and the UTF-8 streamer; returns how the generation ended if it did at
/// the last of them. A generation that ended earlier is refused: the
/// tokens after that one were never sent.
pub(super) fn replay_text<B: AsRef<[u8]>>(
    tokens: &[u32],
    bytes: impl Fn(u32) -> B,
    filter: &mut StopFilter,
    utf8: &mut Utf8Streamer,
    max_tokens: u32,
    prompt_len: usize,
    capacity: usize,
) -> Result<Option<FinishReason>, RequestError> {
    for (i, &t) in tokens.iter().enumerate() {
        let step = filter.push(bytes(t).as_ref());
        // The client has this text already.
        let _ = utf8.push(&step.emit);
        let generated = i as u32 + 1;
        if let Some(reason) = ends_after(
            step.stopped,
            generated,
            max_tokens,
            prompt_len + i,
            capacity,
        ) {
            if i + 1 == tokens.len() {
                return Ok(Some(reason));
            }
            return Err(RequestError::invalid(
                format!("resume.token_ids[{}]", i + 1),
                format!(
                    "the generation ended at token {i} ({}), so none followed it: {} tokens given",
                    reason.as_str_name(),
                    tokens.len()
                ),
            ));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(t: u32) -> Vec<u8> {
        match t {
            0 => b"Hel".to_vec(),
            1 => b"lo ".to_vec(),
            2 => b"wor".to_vec(),
            3 => b"ld".to_vec(),
            4 => "\u{e9}".as_bytes()[..1].to_vec(),
            _ => "\u{e9}".as_bytes()[1..].to_vec(),
        }
    }

    fn replay(
        tokens: &[u32],
        stop: &[&str],
        max_tokens: u32,
        capacity: usize,
    ) -> Result<Option<FinishReason>, RequestError> {
        let stop: Vec<String> = stop.iter().map(|s| s.to_string()).collect();
        replay_text(
            tokens,
            text,
            &mut StopFilter::new(&stop),
            &mut Utf8Streamer::new(),
            max_tokens,
            10,
            capacity,
        )
    }

    #[test]
    fn a_replay_ends_where_the_run_ended_and_refuses_tokens_after_it() {
        assert_eq!(replay(&[0, 1], &["wor"], 100, 100).unwrap(), None);
        assert_eq!(
            replay(&[0, 1, 2], &["wor"], 100, 100).unwrap(),
            Some(FinishReason::StopString)
        );
        let err = replay(&[0, 1, 2, 3], &["wor"], 100, 100).unwrap_err();
        assert!(err.to_string().contains("resume.token_ids[3]"), "{err}");
        assert_eq!(
            replay(&[0, 1], &[], 2, 100).unwrap(),
            Some(FinishReason::MaxTokens)
        );
        // 10 prompt tokens and a context of 12: the run decodes the first
        // token (11 in the cache) and ends after sending the third.
        assert_eq!(replay(&[0, 1], &[], 100, 12).unwrap(), None);
        assert_eq!(
            replay(&[0, 1, 2], &[], 100, 12).unwrap(),
            Some(FinishReason::ContextFull)
        );
    }

    #[test]
    fn the_replay_leaves_the_text_state_the_run_had() {
        // A stop string's possible beginning and half a character are held
        // back: the next token's text is what the run would have sent.
        let stop = ["world!"];
        let next_text = |replayed: &[u32], next: u32| {
            let mut filter = StopFilter::new(stop);
            let mut utf8 = Utf8Streamer::new();
            replay_text(replayed, text, &mut filter, &mut utf8, 100, 10, 100).unwrap();
            let step = filter.push(&text(next));
            utf8.push(&step.emit)
        };
        // "wor" could begin "world!": held back, then sent with the next
        // token's text (whose half character is in turn held back).
        assert_eq!(next_text(&[0, 1, 2], 4), "wor");
        assert_eq!(next_text(&[0, 1, 2, 4], 5), "\u{e9}");
    }
}
