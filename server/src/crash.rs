//! The fatal-signal report: a plugin is native code in the server's
//! address space, so when one crashes the process dies with it. Before it
//! does, one line on stderr says what was running, e.g.
//!
//! ```text
//! samplerd: fatal signal SIGSEGV in plugin stage `crash` (library libcrash.so) while serving request 17
//! ```
//!
//! or `… while loading plugin library /path/libcrash.so` when its
//! initialisers or entry point crash at start-up, or `… outside any plugin
//! call` when the thread was in host code. The
//! stage, library and request come from the thread's record in
//! [`samplerd_sampling::activity`], which the chain updates around every
//! plugin call and the service before every step.
//!
//! The handler runs in the state the crash left behind (heap or locks may
//! be corrupt), so it does only async-signal-safe things: it reads two
//! thread-local words, formats into a stack buffer by hand and makes one
//! write(2). It is installed with SA_RESETHAND, so re-raising the signal
//! gets the default action (the process dies by that signal and dumps core
//! where core dumps are enabled), and with SA_ONSTACK: sampling threads get
//! an alternate signal stack ([`prepare_this_thread`]) so a stage that
//! overflows its stack is reported too.

use std::ffi::c_int;

use samplerd_sampling::activity;

/// The signals that end the process and are reported, with their names.
const SIGNALS: [(c_int, &[u8]); 5] = [
    (libc::SIGSEGV, b"SIGSEGV"),
    (libc::SIGBUS, b"SIGBUS"),
    (libc::SIGILL, b"SIGILL"),
    (libc::SIGFPE, b"SIGFPE"),
    (libc::SIGABRT, b"SIGABRT"),
];

/// Size of each sampling thread's alternate signal stack: the handler
/// needs well under a page; this leaves room for the dynamic loader's lazy
/// binding of write(2)/raise(3) on first use.
const ALT_STACK_BYTES: usize = 64 * 1024;

/// The report's longest line: fixed text, a signal name, a stage name and
/// a file name (each cut at [`NAME_MAX`]) and a u64.
const LINE_MAX: usize = 512;
/// Longest stage or library name written (longer ones are cut).
const NAME_MAX: usize = 160;

/// Installs the handler for every signal in `SIGNALS` (once, at start-up,
/// before any plugin is loaded).
pub fn install() -> std::io::Result<()> {
    for &(signal, _) in &SIGNALS {
        // SAFETY: sigaction is plain old data; all-zero is a valid start
        // (no flags, empty mask), filled in below.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_fatal_signal as extern "C" fn(c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_ONSTACK | libc::SA_RESETHAND;
        // SAFETY: `action.sa_mask` is a valid sigset_t to initialise.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: a valid action for a signal number from the list; the
        // handler only does async-signal-safe work (see the module docs).
        if unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// This thread's alternate signal stack, unmapped when the thread exits.
struct AltStack {
    base: *mut libc::c_void,
}

impl Drop for AltStack {
    fn drop(&mut self) {
        let off = libc::stack_t {
            ss_sp: std::ptr::null_mut(),
            ss_flags: libc::SS_DISABLE,
            ss_size: 0,
        };
        // SAFETY: disabling this thread's alternate stack before unmapping
        // it; no handler can be running on it (the thread is exiting).
        unsafe {
            libc::sigaltstack(&off, std::ptr::null_mut());
            libc::munmap(self.base, ALT_STACK_BYTES);
        }
    }
}

thread_local! {
    static ALT_STACK: std::cell::RefCell<Option<AltStack>> = const { std::cell::RefCell::new(None) };
}

/// Gives this thread its own alternate signal stack (sampling threads call
/// it once when they start), so the report also works when a plugin
/// overflowed the thread's stack. Failing to map one only loses that.
pub fn prepare_this_thread() {
    ALT_STACK.with(|slot| {
        if slot.borrow().is_some() {
            return;
        }
        // SAFETY: an anonymous private mapping; the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                ALT_STACK_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            tracing::warn!("no alternate signal stack for a sampling thread: a stack overflow in a plugin will not be reported");
            return;
        }
        let stack = libc::stack_t {
            ss_sp: base,
            ss_flags: 0,
            ss_size: ALT_STACK_BYTES,
        };
        // SAFETY: `stack` describes the mapping just made, which lives
        // until this thread exits (AltStack's drop disables it first).
        if unsafe { libc::sigaltstack(&stack, std::ptr::null_mut()) } != 0 {
            // SAFETY: the mapping was never handed to the kernel as a stack.
            unsafe { libc::munmap(base, ALT_STACK_BYTES) };
            return;
        }
        *slot.borrow_mut() = Some(AltStack { base });
    });
}

/// A line built in a fixed stack buffer: no allocation.
struct Line {
    buf: [u8; LINE_MAX],
    len: usize,
}

impl Line {
    const fn new() -> Self {
        Line {
            buf: [0; LINE_MAX],
            len: 0,
        }
    }

    /// Appends as much of `bytes` as fits.
    fn push(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(LINE_MAX - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    /// Appends `bytes` cut at [`NAME_MAX`].
    fn push_name(&mut self, bytes: &[u8]) {
        self.push(&bytes[..bytes.len().min(NAME_MAX)]);
    }

    /// Appends `n` in decimal, formatted by hand.
    fn push_u64(&mut self, mut n: u64) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }

    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// The report for `signal` given the thread's record.
fn report(signal: c_int, site: Option<&activity::CallSite>, request: u64) -> Line {
    let mut line = Line::new();
    line.push(b"samplerd: fatal signal ");
    match SIGNALS.iter().find(|(s, _)| *s == signal) {
        Some((_, name)) => line.push(name),
        None => line.push_u64(signal as u64),
    }
    match site {
        Some(site) if site.is_loading() => {
            line.push(b" while loading plugin library ");
            line.push_name(site.library.to_bytes());
        }
        Some(site) => {
            line.push(b" in plugin stage `");
            line.push_name(site.stage.to_bytes());
            line.push(b"` (library ");
            line.push_name(site.library.to_bytes());
            line.push(b")");
        }
        None => line.push(b" outside any plugin call"),
    }
    if request != 0 {
        line.push(b" while serving request ");
        line.push_u64(request);
    }
    line.push(b"\n");
    line
}

/// The handler: one line with write(2), then the signal again, now with
/// its default action (SA_RESETHAND reset it on entry). Async-signal-safe
/// throughout: no allocation, no lock, no formatting machinery.
extern "C" fn on_fatal_signal(signal: c_int) {
    let (site, request) = activity::crash_context();
    let line = report(signal, site, request);
    let bytes = line.as_bytes();
    let mut done = 0;
    while done < bytes.len() {
        // SAFETY: write(2) is async-signal-safe; the range is inside
        // `bytes`.
        let n = unsafe {
            libc::write(
                libc::STDERR_FILENO,
                bytes[done..].as_ptr().cast(),
                bytes.len() - done,
            )
        };
        if n <= 0 {
            break;
        }
        done += n as usize;
    }
    // A fault (SIGSEGV, SIGBUS, …) would recur on return anyway; a raised
    // or sent signal would not, so raise it. It is blocked while this
    // handler runs and delivered, with the default action, on return.
    // SAFETY: raise(3) is async-signal-safe.
    unsafe { libc::raise(signal) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_names_stage_library_and_request() {
        let site = activity::CallSite::leak(c"crash", c"libcrash.so");
        let line = report(libc::SIGSEGV, Some(site), 17);
        assert_eq!(
            std::str::from_utf8(line.as_bytes()).unwrap(),
            "samplerd: fatal signal SIGSEGV in plugin stage `crash` (library libcrash.so) while serving request 17\n"
        );
        let loading = activity::CallSite::loading(c"/opt/plugins/libcrash.so");
        let line = report(libc::SIGSEGV, Some(loading), 0);
        assert_eq!(
            std::str::from_utf8(line.as_bytes()).unwrap(),
            "samplerd: fatal signal SIGSEGV while loading plugin library /opt/plugins/libcrash.so\n"
        );
        let line = report(libc::SIGABRT, None, 0);
        assert_eq!(
            std::str::from_utf8(line.as_bytes()).unwrap(),
            "samplerd: fatal signal SIGABRT outside any plugin call\n"
        );
        let line = report(99, None, u64::MAX);
        assert!(std::str::from_utf8(line.as_bytes()).unwrap().ends_with(
            "signal 99 outside any plugin call while serving request 18446744073709551615\n"
        ));
    }

    #[test]
    fn long_names_are_cut_and_the_line_never_overflows() {
        let long: &'static std::ffi::CStr = Box::leak(
            std::ffi::CString::new("x".repeat(4000))
                .unwrap()
                .into_boxed_c_str(),
        );
        let site = activity::CallSite::leak(long, long);
        let line = report(libc::SIGBUS, Some(site), 1);
        assert!(line.as_bytes().len() <= LINE_MAX);
        assert!(line.as_bytes().len() > 2 * NAME_MAX);
    }
}
