//! A client's shared-memory file, mapped read-only, that the client cannot
//! use to crash the server.
//!
//! The danger: a file on tmpfs (`/dev/shm`, a `medium: Memory` emptyDir)
//! can be truncated by its owner at any time — it cannot be sealed; only a
//! memfd can — and a read of a mapped page past the new end of the file
//! raises SIGBUS, which kills the process. Two ways out were weighed:
//!
//! - **A copy that cannot fault** (`pread(2)` of each row into a buffer of
//!   the server's): simple and signal-free, but it copies every row once
//!   more. One row of 151,936 f32 logits is 608 KB: the copy costs about
//!   what the fused scan itself costs (both are one pass over the row at
//!   memory bandwidth), so it would halve the rows/s that reading the
//!   mapping in place gives — the whole point of shared rows is not to
//!   move the bytes.
//! - **Reading the mapping in place, with a SIGBUS handler** (chosen):
//!   no cost on the path at all (one relaxed load of a flag after the
//!   read). When a fault hits an address inside a registered mapping, the
//!   handler maps anonymous zero pages over that whole mapping
//!   (`MAP_FIXED`), marks it poisoned and returns: the faulting load is
//!   retried and reads zeros, the read completes, and the request that
//!   read it fails naming the region (which is then dropped). A fault
//!   anywhere else is not ours: the handler puts back the disposition it
//!   replaced (samplerd's crash report, see `crate::crash`) and lets the
//!   fault recur into it.
//!
//! The table the handler searches is a fixed array of atomics
//! ([`MAX_REGIONS`] slots), so the handler takes no lock and allocates
//! nothing; a slot is cleared before its mapping is unmapped, and a
//! mapping is unmapped only once no request holds its region.
//!
//! Rewrites while the server reads are the client's business: the values
//! of its own row may be torn (they are still checked — NaN and +inf are
//! refused — by the one fused pass that copies the row into the server's
//! buffer before any stage sees it), and nothing outside the client's row
//! is read.

use std::ffi::c_int;
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

/// Most mappings at once (the handler's table size);
/// `limits.max_shared_regions` is at most this.
pub const MAX_REGIONS: usize = 1024;

/// One mapping the SIGBUS handler knows: its address range (start 0: the
/// slot is free) and whether a fault zeroed it.
struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    poisoned: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)] // only the array's initialiser
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    poisoned: AtomicBool::new(false),
};

static SLOTS: [Slot; MAX_REGIONS] = [FREE; MAX_REGIONS];
/// Serialises taking and freeing slots (never taken by the handler).
static SLOTS_LOCK: Mutex<()> = Mutex::new(());
/// The SIGBUS disposition before ours: set once, before ours is installed.
static PREVIOUS: OnceLock<PreviousAction> = OnceLock::new();

struct PreviousAction(libc::sigaction);

// SAFETY: a sigaction is plain data (a handler address, flags and a
// signal mask); it is written once and only read afterwards.
unsafe impl Sync for PreviousAction {}
// SAFETY: as above.
unsafe impl Send for PreviousAction {}

/// Installs the handler once per process (before the first mapping).
fn install() -> io::Result<()> {
    static INSTALLED: OnceLock<Result<(), i32>> = OnceLock::new();
    let r = INSTALLED.get_or_init(|| {
        // SAFETY: all-zero is a valid sigaction to be filled in by the
        // kernel.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: reads the current action into `old`.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) } != 0 {
            return Err(io::Error::last_os_error().raw_os_error().unwrap_or(0));
        }
        let _ = PREVIOUS.set(PreviousAction(old));
        // SAFETY: all-zero is a valid start (no flags, empty mask).
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_sigbus
            as extern "C" fn(c_int, *mut libc::siginfo_t, *mut libc::c_void)
            as libc::sighandler_t;
        // SA_ONSTACK: sampling threads have an alternate stack
        // (`crate::crash`); others run it on their own.
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: `action.sa_mask` is a valid sigset_t to initialise.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: a valid action whose handler does only async-signal-safe
        // work (atomics, mmap, sigaction, raise).
        if unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) } != 0 {
            return Err(io::Error::last_os_error().raw_os_error().unwrap_or(0));
        }
        Ok(())
    });
    r.map_err(io::Error::from_raw_os_error)
}

extern "C" fn on_sigbus(signal: c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // si_code > 0: raised by the kernel for a fault (not sent by kill).
    if code > 0 {
        for slot in &SLOTS {
            let start = slot.start.load(Ordering::Acquire);
            let len = slot.len.load(Ordering::Acquire);
            if start != 0 && addr >= start && addr - start < len {
                // SAFETY: replaces exactly the pages of a live mapping of
                // ours (its slot is set while it is mapped) with zero
                // pages; nothing else is touched.
                let p = unsafe {
                    libc::mmap(
                        start as *mut libc::c_void,
                        len,
                        libc::PROT_READ,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                        -1,
                        0,
                    )
                };
                if p != libc::MAP_FAILED {
                    slot.poisoned.store(true, Ordering::Release);
                    return; // the load is retried and reads zeros
                }
            }
        }
    }
    // Not a fault in our mappings: the previous disposition takes it (a
    // fault recurs on return; a sent signal is raised again, delivered on
    // return).
    let previous = PREVIOUS
        .get()
        .map_or(std::ptr::null(), |p| &p.0 as *const libc::sigaction);
    if previous.is_null() {
        // SAFETY: resets SIGBUS to its default action.
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
    } else {
        // SAFETY: restores the action saved at install.
        unsafe { libc::sigaction(libc::SIGBUS, previous, std::ptr::null_mut()) };
    }
    if code <= 0 {
        // SAFETY: raise(3) is async-signal-safe.
        unsafe { libc::raise(signal) };
    }
}

/// A read-only mapping of the first `len` bytes of a file, guarded against
/// SIGBUS (see the module docs).
pub struct SharedMapping {
    map: memmap2::Mmap,
    slot: usize,
}

impl std::fmt::Debug for SharedMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedMapping({} bytes)", self.map.len())
    }
}

/// Why a file could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("{0} regions are mapped (the most the server's table holds)")]
    Full(usize),
    #[error("{0}")]
    Io(#[from] io::Error),
}

impl SharedMapping {
    /// Maps `len` (> 0) bytes of `file`, shared and read-only.
    pub fn map(file: &File, len: usize) -> Result<Self, MapError> {
        install()?;
        // SAFETY: the file is a client's, which may change or truncate it
        // while it is mapped; changes are only garbage values in that
        // client's rows (every bit pattern is a valid byte), and a
        // truncation's SIGBUS is turned into zero pages by the handler
        // installed above once the slot below is set.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map(file)? };
        let _lock = SLOTS_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = SLOTS
            .iter()
            .position(|s| s.start.load(Ordering::Acquire) == 0)
            .ok_or(MapError::Full(MAX_REGIONS))?;
        let s = &SLOTS[slot];
        s.poisoned.store(false, Ordering::Release);
        s.len.store(map.len(), Ordering::Release);
        s.start.store(map.as_ptr() as usize, Ordering::Release);
        Ok(SharedMapping { map, slot })
    }

    /// The mapped bytes. Read them, then ask [`poisoned`](Self::poisoned):
    /// zeros read after a truncation are not the client's data.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Whether a truncation's fault replaced the mapping with zeros.
    pub fn poisoned(&self) -> bool {
        SLOTS[self.slot].poisoned.load(Ordering::Acquire)
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        let _lock = SLOTS_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        let s = &SLOTS[self.slot];
        // Cleared before `map` is unmapped (after this body).
        s.start.store(0, Ordering::Release);
        s.len.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn a_truncated_file_reads_as_zeros_and_poisons_only_its_mapping() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 3 * 4096]).unwrap();
        let m = SharedMapping::map(&f, 3 * 4096).unwrap();
        let other = SharedMapping::map(&f, 4096).unwrap();
        assert_eq!(m.bytes()[3 * 4096 - 1], 7);
        f.set_len(4096).unwrap();
        // Past the new end: SIGBUS without the handler.
        let sum: u64 = m.bytes().iter().map(|&b| u64::from(b)).sum();
        assert!(m.poisoned(), "the fault poisoned the mapping");
        assert!(sum <= 7 * 2 * 4096, "{sum}: past the fault only zeros");
        assert_eq!(
            m.bytes()[0],
            0,
            "the whole mapping reads as zeros after the fault"
        );
        assert!(!other.poisoned(), "another mapping is not touched");
        assert_eq!(other.bytes()[0], 7);
    }
}
