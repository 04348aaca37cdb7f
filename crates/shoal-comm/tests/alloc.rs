//! The data path allocates nothing per operation in steady state: after a
//! warm-up, 50 rounds of every collective on a rank's thread make zero heap
//! allocations on that thread, over every transport.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use shoal_comm::{Algo, CommConfig, Communicator, ReduceOp, TransportChoice};

struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCS.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCS.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn steady_state_allocations(t: TransportChoice) -> u64 {
    let cfg =
        CommConfig { transport: t, timeout: Duration::from_secs(60), secret: b"a".to_vec(), ..CommConfig::default() };
    let comms = Communicator::local_world(3, cfg).expect("world");
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let mut big = vec![1.0f32; 1 << 20];
                let mut small = vec![1i64; 100];
                let gather_in = vec![2.0f64; 1000];
                let mut gather_out = vec![0.0f64; 3000];
                let rs_in = vec![1.0f32; 3001];
                let mut rs_out = vec![0.0f32; shoal_comm::chunk::segment(3001, 3, c.rank()).len()];
                let mut round = |count: bool| {
                    COUNTING.with(|k| k.set(count));
                    c.all_reduce_with(&mut big, ReduceOp::Avg, Algo::Ring).expect("ring");
                    c.all_reduce_with(&mut small, ReduceOp::Max, Algo::Tree).expect("tree");
                    c.all_reduce_with(&mut big, ReduceOp::Sum, Algo::HalvingDoubling).expect("rhd");
                    c.broadcast(&mut big, 1).expect("broadcast");
                    c.broadcast(&mut small, 2).expect("small broadcast");
                    c.reduce(&mut big, ReduceOp::Sum, 0).expect("reduce");
                    c.all_gather(&gather_in, &mut gather_out).expect("all_gather");
                    c.reduce_scatter(&rs_in, &mut rs_out, ReduceOp::Sum).expect("reduce_scatter");
                    c.barrier().expect("barrier");
                    COUNTING.with(|k| k.set(false));
                };
                for _ in 0..3 {
                    round(false);
                }
                for _ in 0..50 {
                    round(true);
                }
            })
        })
        .collect();
    for h in hs {
        h.join().expect("rank thread");
    }
    ALLOCS.swap(0, Ordering::SeqCst)
}

#[test]
fn no_allocation_per_operation_in_steady_state() {
    // One test function, so the transports do not share the counter concurrently.
    for t in [TransportChoice::InProc, TransportChoice::Shm, TransportChoice::Tcp] {
        assert_eq!(steady_state_allocations(t), 0, "{t:?}: allocations in 50 steady-state rounds");
    }
}
