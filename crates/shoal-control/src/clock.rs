//! Where the control plane reads the time: the system's clock, or one that a simulation moves.
//!
//! Every timestamp the store records (a job's submission, start and end, its events) and every time the loop
//! decides by (the scheduler's `now`, a restart's backoff, resource samples) is read from the [`Clock`] the
//! store holds, so a trace replayed through the server's own loop (`shoal sim --engine control`) runs in
//! simulated time. How long a real process takes to answer (the kill grace, heartbeats' freshness, a requeue's
//! wait for processes to be gone) is measured on the monotonic clock, never on this one.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// Milliseconds since the Unix epoch, from the system or from a simulation. Clones share the time.
#[derive(Debug, Clone, Default)]
pub struct Clock {
    /// `None`: the system's clock.
    manual: Option<Arc<AtomicI64>>,
}

impl Clock {
    /// The system's clock.
    pub fn system() -> Clock {
        Clock { manual: None }
    }

    /// A clock that stands at `start_ms` until [`Clock::set`] moves it.
    pub fn manual(start_ms: i64) -> Clock {
        Clock { manual: Some(Arc::new(AtomicI64::new(start_ms))) }
    }

    /// The time now, in milliseconds since the epoch.
    pub fn now_ms(&self) -> i64 {
        match &self.manual {
            Some(t) => t.load(Ordering::SeqCst),
            None => {
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
            }
        }
    }

    /// Moves a manual clock to `ms` (never back: an earlier time is ignored); the system's clock is not moved.
    pub fn set(&self, ms: i64) {
        if let Some(t) = &self.manual {
            t.fetch_max(ms, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_forward_and_is_shared_by_its_clones() {
        let c = Clock::manual(1_000);
        let twin = c.clone();
        c.set(5_000);
        assert_eq!(twin.now_ms(), 5_000);
        twin.set(4_000);
        assert_eq!(c.now_ms(), 5_000, "a manual clock never goes back");
        let sys = Clock::system();
        sys.set(1);
        assert!(sys.now_ms() > 1_700_000_000_000, "the system clock is not moved: {}", sys.now_ms());
    }
}
