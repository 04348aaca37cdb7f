use crate::check;

#[test]
fn grow_into_free_capacity_and_shrink_for_a_higher_priority_job() {
    check(
        "
        node n1
        job x gpus=4 at=0
        job e tasks=2..8 gpus=1 at=1
        sched 0
        finish x
        sched 10
        job p gpus=2 prio=1 at=20
        sched 30
        ",
        "
        @0 place x n1:0,1,2,3
        @0 place e n1:4 n1:5
        @0 grow e n1:6 n1:7
        @10 grow e n1:0 n1:1 n1:2 n1:3
        @30 shrink e by 2 for p
        @30 place p n1:2,3
        ",
    );
}

#[test]
fn shrink_stops_at_min_then_preemption_takes_over() {
    check(
        "
        node n1
        grace 0
        job e tasks=6..8 gpus=1 at=0
        sched 0
        job p gpus=4 prio=1 at=1
        sched 10
        sched 10
        ",
        "
        @0 place e n1:0 n1:1 n1:2 n1:3 n1:4 n1:5 n1:6 n1:7
        @10 preempt e priority by p grace 0
        @10 requeue e
        @10 place p n1:0,1,2,3
        ",
    );
}

#[test]
fn no_growth_while_a_job_waits() {
    check(
        "
        node n1
        job e tasks=1..8 gpus=1 at=0 rt=100
        job w gpus=8 at=1
        sched 0
        ",
        "
        @0 place e n1:0 n1:1 n1:2 n1:3 n1:4 n1:5 n1:6 n1:7
        ",
    );
}

#[test]
fn a_large_max_grows_only_as_far_as_capacity() {
    check(
        "
        node n1 gpus=2
        node n2 gpus=2
        job e tasks=1..60000 gpus=1 spread
        job f tasks=1..60000 gpus=0.5
        sched 0
        ",
        "
        @0 place e n1:0
        @0 place f n1:1@500
        @0 grow e n2:0
        @0 grow f n1:1@500 n2:1@500 n2:1@500
        ",
    );
}

#[test]
fn a_spread_job_grows_one_task_per_node_onto_nodes_it_has_none_on() {
    // e holds n1 and, spread, may grow only onto n2 and n3: one task each, though n1 has room for more.
    check(
        "
        node n1 gpus=4
        node n2 gpus=1
        node n3 gpus=1
        job e tasks=1..8 gpus=1 spread
        sched 0
        ",
        "
        @0 place e n1:0
        @0 grow e n2:0 n3:0
        ",
    );
}
