//! Workloads that train through Shoal's parameter servers, on plain buffers: a DLRM-like recommender on click data
//! with a planted model ([`recommender`], [`clicks`]), whose embedding tables of a million rows and more move a few
//! rows at a time; and asynchronous advantage actor-critic on CartPole ([`a3c`], [`cartpole`]), whose actors are
//! the servers' workers. Each worker is a function of a connected [`shoal_ps::net::Client`], so the same code runs
//! as threads in a test and as processes under `shoal bench`.
//!
//! **Invariants:**
//! - The parameter servers are the only shared state: a worker holds a copy of what it pulled and nothing else
//!   that another worker sees.
//! - Data and starting values are derived from a seed and an index, never from a table shipped beside the code, so
//!   every process makes the same impression, episode start and starting value without talking.
//! - Every wait is the client's, with its deadline; nothing here blocks on its own.
//! - No feature flags.

pub mod a3c;
pub mod cartpole;
pub mod clicks;
pub mod error;
pub mod nn;
pub mod recommender;

pub use error::{Error, Result};
