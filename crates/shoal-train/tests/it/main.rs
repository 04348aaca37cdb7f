//! Integration tests of shoal-train: DDP and ZeRO equivalence with a single process; the spec's parameter counts.

mod equivalence;
mod param_counts;
mod zero3;
