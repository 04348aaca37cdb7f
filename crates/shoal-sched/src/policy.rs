//! Scheduling policies: the order in which pending jobs are tried ([`Ordering`]) and how a task chooses its node
//! and GPUs ([`Packing`]), combined as a [`Policy`] and named as `ORDERING`, `PACKING` or `ORDERING+PACKING`.

use std::fmt;
use std::str::FromStr;

/// The order in which one pass tries the pending jobs. User priority always comes first; within one priority,
/// jobs that fit their queue's guarantee come before jobs that would borrow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Ordering {
    /// First come, first served, strictly: once a job cannot start, no later job starts in that pass.
    Fifo,
    /// First come, first served with EASY backfill: the first job that cannot start gets a reservation at its
    /// earliest start (from the running jobs' expected run times) and later jobs start now only if they do not
    /// delay it.
    Backfill,
    /// Shortest expected run time first (an oracle when the run times are exact), with EASY backfill.
    Sjf,
    /// Least attained service, Tiresias-style: a job's attained service is the GPU time it has held so far; the
    /// thresholds of [`crate::Config::las_thresholds_gpu_ms`] cut it into levels, lower levels first, first come
    /// first served within one; a waiting job preempts running jobs of a higher level (through the same
    /// preemption path as priorities). It knows nothing of run times: no reservation, every job that fits starts.
    Las,
    /// Teams take turns by dominant share (lowest first), first come first served within a team, with EASY
    /// backfill: what the scheduler has always done, the default.
    #[default]
    Drf,
    /// [`Ordering::Backfill`], and a waiting job may also shrink running elastic jobs of its own priority (down to
    /// their minimum, never preempting them); elastic jobs grow into what is idle when nothing waits.
    Elastic,
}

/// How a task's node and GPUs are chosen among those where it fits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Packing {
    /// The fullest node that still holds the gang (fewest nodes when it needs several), and for a fraction of a
    /// GPU the busiest GPU with room: the default.
    #[default]
    BestFit,
    /// Fragmentation gradient descent (Weng et al., ATC'23): each task goes where the cluster's expected
    /// fragmentation grows least, measured against the distribution of recently submitted task shapes
    /// ([`crate::Config::shape_window`]).
    Fgd,
}

/// An ordering with a packing. Written `fifo`, `fgd`, `las+fgd`...: a missing half is the default's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Policy {
    /// Which pending job is tried first.
    pub ordering: Ordering,
    /// Where its tasks go.
    pub packing: Packing,
}

impl Ordering {
    /// Every ordering, in the order of its name in [`Ordering::name`].
    pub const ALL: [Ordering; 6] =
        [Ordering::Fifo, Ordering::Backfill, Ordering::Sjf, Ordering::Las, Ordering::Drf, Ordering::Elastic];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Ordering::Fifo => "fifo",
            Ordering::Backfill => "backfill",
            Ordering::Sjf => "sjf",
            Ordering::Las => "las",
            Ordering::Drf => "drf",
            Ordering::Elastic => "elastic",
        }
    }

    /// Whether the first job that cannot start gets a backfill reservation.
    pub fn reserves(self) -> bool {
        matches!(self, Ordering::Backfill | Ordering::Sjf | Ordering::Drf | Ordering::Elastic)
    }
}

impl Packing {
    /// Every packing.
    pub const ALL: [Packing; 2] = [Packing::BestFit, Packing::Fgd];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Packing::BestFit => "bestfit",
            Packing::Fgd => "fgd",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{}", self.ordering.name(), self.packing.name())
    }
}

/// A policy name that is none of the known ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown policy {name:?}: expected an ordering (fifo, backfill, sjf, las, drf, elastic), a packing (bestfit, fgd) or ORDERING+PACKING"
)]
pub struct UnknownPolicy {
    /// What was given.
    pub name: String,
}

impl FromStr for Policy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Policy, UnknownPolicy> {
        let bad = || UnknownPolicy { name: s.to_owned() };
        let ordering = |w: &str| Ordering::ALL.into_iter().find(|o| o.name() == w);
        let packing = |w: &str| Packing::ALL.into_iter().find(|p| p.name() == w);
        let w = s.trim().to_ascii_lowercase();
        match w.split_once('+') {
            Some((o, p)) => Ok(Policy { ordering: ordering(o).ok_or_else(bad)?, packing: packing(p).ok_or_else(bad)? }),
            None => match (ordering(&w), packing(&w)) {
                (Some(ordering), _) => Ok(Policy { ordering, packing: Packing::default() }),
                (_, Some(packing)) => Ok(Policy { ordering: Ordering::default(), packing }),
                _ => Err(bad()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_halves_default() -> Result<(), UnknownPolicy> {
        for (text, want) in [
            ("fifo", "fifo+bestfit"),
            ("fgd", "drf+fgd"),
            ("las+fgd", "las+fgd"),
            ("Backfill+BestFit", "backfill+bestfit"),
            ("elastic", "elastic+bestfit"),
        ] {
            assert_eq!(text.parse::<Policy>()?.to_string(), want);
        }
        for bad in ["", "lifo", "las+", "+fgd", "fgd+las", "las+fgd+x"] {
            assert!(bad.parse::<Policy>().is_err(), "{bad}");
        }
        Ok(())
    }
}
