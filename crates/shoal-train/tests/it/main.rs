//! Integration tests of shoal-train: DDP equivalence with a single process; the spec's parameter counts.

mod equivalence;
mod param_counts;
