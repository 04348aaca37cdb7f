//! What a rank's memory holds, from the real buffers: a counting allocator (installed by the `shoal` binary as its
//! global allocator) that keeps the heap's current and peak size, so the step loop can measure the peak of what a
//! step allocates beyond what it started with (activations and the temporaries of forward and backward); the
//! parameters', gradients' and optimizer state's sizes come from the trainer and its strategy.
//!
//! Without the allocator installed (a library user's own program), [`heap`] says so (`None`) and nothing is
//! measured.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting.
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

fn grew(by: usize) {
    let now = CURRENT.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is passed on to the system allocator unchanged; only counters are updated beside it.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as `alloc`.
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                CURRENT.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

/// Bytes on the heap now, when the counting allocator is installed.
pub fn heap() -> Option<usize> {
    INSTALLED.load(Ordering::Relaxed).then(|| CURRENT.load(Ordering::Relaxed))
}

/// Starts a new peak from the heap's size now.
pub fn reset_peak() {
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// The heap's peak since [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Measures the peak a span of work allocates beyond what was held when it began (all threads of the process
/// count: a rank's process runs one rank).
#[derive(Debug, Clone, Copy)]
pub struct PeakOver {
    base: Option<usize>,
}

impl PeakOver {
    pub fn start() -> PeakOver {
        reset_peak();
        PeakOver { base: heap() }
    }

    /// Bytes above the start's heap at the highest point since (`None` without the allocator).
    pub fn end(self) -> Option<usize> {
        self.base.map(|b| peak().saturating_sub(b))
    }
}
