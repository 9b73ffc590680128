//! Telling the host whose fault a failure is.
//!
//! A stage's `apply` and `try_accept` fail with a `String`. Most failures
//! are the stage's own (a bug, a resource it could not get): the host
//! reports them as internal errors (`SD_ERR`). Some are the request's: a
//! grammar that outgrows its parser's limits partway through a row, a token
//! the grammar does not allow. Wrapping the message in [`input_error`]
//! makes the callback return `SD_ERR_INPUT`, and the client gets
//! INVALID_ARGUMENT naming the stage instead of an internal error.
//!
//! The mark travels inside the message (a leading tag the export glue
//! strips), so `Stage`'s signatures stay as they were for every plugin
//! written against them, and an error built on another thread (a mask
//! computed ahead) keeps its mark. The tag starts with a NUL byte: no
//! message a stage means to send can begin with one, since the ABI's
//! messages are NUL-terminated and it would arrive empty.

/// The tag [`input_error`] puts in front of a message.
const INPUT_TAG: &str = "\0input\0";

/// `message`, marked as caused by the request's input: returned from
/// `apply` or `try_accept`, the callback fails with `SD_ERR_INPUT`.
pub fn input_error(message: impl Into<String>) -> String {
    let message = message.into();
    if is_input_error(&message) {
        return message;
    }
    let mut out = String::with_capacity(INPUT_TAG.len() + message.len());
    out.push_str(INPUT_TAG);
    out.push_str(&message);
    out
}

/// Whether `message` was made by [`input_error`].
pub fn is_input_error(message: &str) -> bool {
    message.starts_with(INPUT_TAG)
}

/// The message without the mark, and whether it had one.
pub fn split_input_error(message: &str) -> (bool, &str) {
    match message.strip_prefix(INPUT_TAG) {
        Some(rest) => (true, rest),
        None => (false, message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_survives_rewrapping_and_is_stripped_whole() {
        let e = input_error("constraint: too many items");
        assert!(is_input_error(&e));
        assert_eq!(input_error(e.clone()), e);
        assert_eq!(split_input_error(&e), (true, "constraint: too many items"));
        assert_eq!(split_input_error("plain"), (false, "plain"));
        assert!(!is_input_error("input: not marked"));
    }
}
