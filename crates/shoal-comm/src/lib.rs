//! `shoal-comm`: Shoal's collectives — the hot path every distributed strategy
//! stands on.
//!
//! A [`Communicator`] links `size` ranks through the best transport for each pair
//! (shared memory on one host, TCP across hosts, the heap between threads) and runs
//! all-reduce (ring, recursive doubling, hierarchical), broadcast, reduce,
//! all-gather, reduce-scatter, barrier and send/recv over any of them, blocking or
//! non-blocking, on f32, f64, f16, bf16, i32 and i64.
//!
//! ```
//! use shoal_comm::{CommConfig, Communicator, ReduceOp};
//! let comms = Communicator::local_world(3, CommConfig::default()).unwrap();
//! let handles: Vec<_> = comms
//!     .into_iter()
//!     .map(|c| std::thread::spawn(move || {
//!         let mut v = vec![c.rank() as f32 + 1.0; 5];
//!         c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
//!         v
//!     }))
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap(), vec![6.0; 5]);
//! }
//! ```
//!
//! Invariants:
//! - This crate knows nothing of tensors, candle, async runtimes or the control
//!   plane: it moves and reduces byte buffers of a known element type.
//! - Nothing waits without a deadline. A failed operation reports its name, its
//!   sequence number, the ranks that had entered it and those that had not, and
//!   the bytes moved; the communicator is then closed rather than left out of step.
//! - Every TCP connection proves it holds the job secret (HMAC challenge-response)
//!   before any data moves; every frame length is bounded; bad input from the wire
//!   is an error, never a panic.
//! - The data path allocates nothing per operation in steady state: scratch
//!   buffers are kept and reused.
//!
//! Feature flags: none yet (the default build is CPU-only).

pub mod algo;
pub mod arrival;
pub mod auth;
pub mod chunk;
pub mod comm;
pub mod compress;
pub mod dtype;
pub mod env;
pub mod error;
pub mod frame;
pub mod ring;
pub mod store;
pub mod tcp;
pub mod transport;

pub use arrival::ArrivalStats;
pub use comm::{Activity, Algo, CommConfig, Communicator, Pending, TransportChoice};
pub use compress::{Codec, CompressConfig, Compressor, Matrix};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{Error, Participation, Result};
pub use store::{MemStore, Store, StoreServer, TcpStore};
pub use transport::{Transport, TransportKind};
