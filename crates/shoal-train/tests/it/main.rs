//! Integration tests of shoal-train: DDP, ZeRO, pipeline, tensor-parallel and composed-layout equivalence with a single process; the spec's parameter counts.
// In an f64 build the widenings of a `Real` to f64 are identities.
#![cfg_attr(feature = "f64", allow(clippy::useless_conversion, clippy::unnecessary_cast))]

mod composed;
mod compress;
mod equivalence;
mod param_counts;
mod pipeline;
mod ps;
mod robust;
mod tensor;
mod zero3;
