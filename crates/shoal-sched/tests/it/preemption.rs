use crate::check;

#[test]
fn lowest_priority_is_preempted_first_and_requeued_after_grace() {
    check(
        "
        node n1
        grace 500
        job low0 gpus=4 prio=0 at=0
        job low1 gpus=4 prio=1 at=1
        sched 0
        job hi gpus=4 prio=5 at=10
        sched 100
        sched 300
        sched 600
        ",
        "
        @0 place low1 n1:0,1,2,3
        @0 place low0 n1:4,5,6,7
        @100 preempt low0 priority by hi grace 500
        @600 requeue low0
        @600 place hi n1:4,5,6,7
        ",
    );
}

#[test]
fn among_equal_priorities_least_progress_is_lost() {
    // a has run 2000 ms, b 1000 ms: b is preempted even though it is the
    // older submission.
    check(
        "
        node n1
        grace 0
        job a gpus=4 at=5
        sched 0
        job b gpus=4 at=0
        sched 1000
        job hi gpus=4 prio=1 at=10
        sched 2000
        sched 2000
        ",
        "
        @0 place a n1:0,1,2,3
        @1000 place b n1:4,5,6,7
        @2000 preempt b priority by hi grace 0
        @2000 requeue b
        @2000 place hi n1:4,5,6,7
        ",
    );
}

#[test]
fn equal_or_higher_priority_is_never_preempted() {
    check(
        "
        node n1
        job a gpus=8 prio=3
        sched 0
        job b gpus=8 prio=3 at=1
        sched 10
        ",
        "@0 place a n1:0,1,2,3,4,5,6,7",
    );
}

#[test]
fn only_as_many_victims_as_needed() {
    check(
        "
        node n1
        grace 100
        job a gpus=2 at=0
        job b gpus=2 at=1
        job c gpus=2 at=2
        job d gpus=2 at=3
        sched 0
        job hi gpus=4 prio=1 at=4
        sched 10
        sched 20
        sched 110
        ",
        "
        @0 place a n1:0,1
        @0 place b n1:2,3
        @0 place c n1:4,5
        @0 place d n1:6,7
        @10 preempt d priority by hi grace 100
        @10 preempt c priority by hi grace 100
        @110 requeue c
        @110 requeue d
        @110 place hi n1:4,5,6,7
        ",
    );
}
