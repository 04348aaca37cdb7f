use crate::check;

#[test]
fn backfill_never_delays_the_reserved_head_job() {
    // h needs the whole node at 100 (when r ends). `long` fits now and a naive
    // backfill would start it, delaying h to 1000; only `short`, done by 50,
    // may start.
    check(
        "
        node n1
        job r gpus=4 rt=100 at=0
        sched 0
        job h gpus=8 rt=100 at=1
        job long gpus=4 rt=1000 at=2
        job short gpus=4 rt=50 at=3
        sched 0
        finish short
        sched 50
        finish r
        sched 100
        ",
        "
        @0 place r n1:0,1,2,3
        @0 place short n1:4,5,6,7
        @100 place h n1:0,1,2,3,4,5,6,7
        ",
    );
}

#[test]
fn backfill_may_use_what_the_head_job_will_not_need() {
    // h reserves all GPUs of both nodes at 100 but only half their CPUs:
    // a CPU-only job of unknown length fits beside it (packed onto the fuller
    // n1); one that eats into h's CPUs does not, though n2 has room for it now.
    check(
        "
        node n1 cpus=64
        node n2 cpus=64
        job r gpus=8 cpus=8 rt=100 at=0
        sched 0
        job h tasks=2 gpus=8 cpus=32 at=1
        job c1 cpus=16 at=2
        job c2 cpus=48 at=3
        sched 0
        finish r
        sched 100
        ",
        "
        @0 place r n1:0,1,2,3,4,5,6,7
        @0 place c1 n1
        @100 place h n1:0,1,2,3,4,5,6,7 n2:0,1,2,3,4,5,6,7
        ",
    );
}

#[test]
fn without_estimates_there_is_no_reservation() {
    // Nothing running has an expected run time: the blocked job cannot be
    // given a start time, and smaller jobs are not held back.
    check(
        "
        node n1
        job r gpus=4 at=0
        sched 0
        job h gpus=8 at=1
        job s gpus=2 at=2
        sched 1
        ",
        "
        @0 place r n1:0,1,2,3
        @1 place s n1:4,5
        ",
    );
}
