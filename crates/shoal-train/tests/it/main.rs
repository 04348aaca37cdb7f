//! Integration tests of shoal-train: DDP equivalence with a single process.

mod equivalence;
