//! Integration tests of shoal-train: DDP, ZeRO, pipeline, tensor-parallel and composed-layout equivalence with a single process; the spec's parameter counts.

mod composed;
mod compress;
mod equivalence;
mod param_counts;
mod pipeline;
mod ps;
mod robust;
mod tensor;
mod zero3;
