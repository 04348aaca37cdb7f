//! Integration tests of shoal-train: DDP, ZeRO and pipeline equivalence with a single process; the spec's parameter counts.

mod equivalence;
mod param_counts;
mod pipeline;
mod zero3;
