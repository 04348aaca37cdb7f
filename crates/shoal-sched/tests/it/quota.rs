use crate::check;

#[test]
fn borrow_idle_quota_then_reclaim_it() {
    check(
        "
        node n1
        queue qa gpus=4 borrow
        queue qb gpus=4 borrow
        grace 100
        job a1 queue=qa gpus=4 at=0
        job a2 queue=qa gpus=4 at=1
        sched 0
        job b1 queue=qb gpus=4 at=2
        sched 10
        sched 200
        ",
        "
        @0 place a1 n1:0,1,2,3
        @0 place a2 n1:4,5,6,7
        @10 preempt a2 reclaim for qb by b1 grace 100
        @200 requeue a2
        @200 place b1 n1:4,5,6,7
        ",
    );
}

#[test]
fn a_queue_within_its_guarantee_is_not_reclaimed_from() {
    check(
        "
        node n1
        queue qa gpus=4 borrow
        queue qb gpus=4 borrow
        job a1 queue=qa gpus=4 at=0
        job b1 queue=qb gpus=4 at=1
        sched 0
        job b2 queue=qb gpus=4 at=2
        sched 10
        ",
        "
        @0 place a1 n1:0,1,2,3
        @0 place b1 n1:4,5,6,7
        ",
    );
}

#[test]
fn a_queue_that_cannot_borrow_stops_at_its_guarantee() {
    check(
        "
        node n1
        queue qc gpus=2
        queue other gpus=6 borrow
        job c1 queue=qc gpus=2 at=0
        job c2 queue=qc gpus=2 at=1
        job o1 queue=other gpus=1 at=2
        sched 0
        finish c1
        sched 10
        ",
        "
        @0 place c1 n1:0,1
        @0 place o1 n1:2
        @10 place c2 n1:0,1
        ",
    );
}

#[test]
fn reclaim_stops_once_the_borrower_is_back_within_its_guarantee() {
    // qa is guaranteed 4 GPUs and runs 6: only its 2 borrowed GPUs are
    // reclaimable, not enough for b1's 4, so nothing is preempted.
    check(
        "
        node n1 gpus=6
        queue qa gpus=4 borrow
        queue qb gpus=4 borrow
        job a1 queue=qa gpus=2 at=0
        job a2 queue=qa gpus=2 at=1
        job a3 queue=qa gpus=2 at=2
        sched 0
        job b1 queue=qb gpus=4 at=3
        sched 10
        job b2 queue=qb gpus=2 at=4
        sched 20
        ",
        "
        @0 place a1 n1:0,1
        @0 place a2 n1:2,3
        @0 place a3 n1:4,5
        @20 preempt a3 reclaim for qb by b2 grace 30000
        ",
    );
}
