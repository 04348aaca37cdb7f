//! A stop asked from outside — SIGTERM from the platform (preemption, a resize, a cancel), from Slurm or the kubelet,
//! or `kill` — taken at a step boundary: while the step loop runs, the signal only raises a flag; every rank adds its
//! flag to the step's summed scalars (no extra collective), so all of them see the same sum after the same step,
//! write a checkpoint there together and end with [`crate::error::Error::Stopped`]. Outside the step loop (setup,
//! rendezvous, resume, the final report) nothing is lost by ending at once, and the signal does that, as it would
//! without a handler (exit status 143).

use crate::Real;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether the step loop takes a stop at its next boundary (else a SIGTERM ends the process at once).
static ARMED: AtomicBool = AtomicBool::new(false);
/// Whether a stop was asked for while armed.
static ASKED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    if ARMED.load(Ordering::SeqCst) {
        ASKED.store(true, Ordering::SeqCst);
    } else {
        // SAFETY: `_exit` is async-signal-safe.
        unsafe { libc::_exit(128 + libc::SIGTERM) };
    }
}

/// The step loop's hold on SIGTERM: armed while it lives.
#[derive(Debug)]
pub(super) struct Graceful(());

impl Graceful {
    /// Installs the handler (once per process; a failure is logged and SIGTERM keeps its default) and arms it.
    pub(super) fn arm() -> Graceful {
        static INSTALLED: std::sync::Once = std::sync::Once::new();
        INSTALLED.call_once(|| {
            // SAFETY: sigaction with a handler that touches only atomics and `_exit`.
            let r = unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_term as *const () as libc::sighandler_t;
                sa.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut())
            };
            if r != 0 {
                tracing::warn!(error = %std::io::Error::last_os_error(), "SIGTERM handler not installed: a stop ends the rank at once");
            }
        });
        ARMED.store(true, Ordering::SeqCst);
        Graceful(())
    }

    /// This rank's part of the step's stop vote: 1 when a stop was asked for, else 0.
    pub(super) fn vote(&self) -> Real {
        if ASKED.load(Ordering::SeqCst) { 1.0 } else { 0.0 }
    }
}

impl Drop for Graceful {
    /// A stop asked for during the run's last step is moot (the run ends there anyway); a SIGTERM from now on ends
    /// the process at once.
    fn drop(&mut self) {
        ARMED.store(false, Ordering::SeqCst);
    }
}
