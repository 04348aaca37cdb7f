//! Integration tests of shoal-train: DDP, ZeRO, pipeline and tensor-parallel equivalence with a single process; the spec's parameter counts.

mod equivalence;
mod param_counts;
mod pipeline;
mod tensor;
mod zero3;
