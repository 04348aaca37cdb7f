use crate::check;

#[test]
fn teams_of_equal_priority_take_turns_by_dominant_share() {
    check(
        "
        node n1 gpus=4
        job a1 team=A gpus=1 at=0
        job a2 team=A gpus=1 at=1
        job a3 team=A gpus=1 at=2
        job a4 team=A gpus=1 at=3
        job b1 team=B gpus=1 at=4
        job b2 team=B gpus=1 at=5
        sched 0
        ",
        "
        @0 place a1 n1:0
        @0 place b1 n1:1
        @0 place a2 n1:2
        @0 place b2 n1:3
        ",
    );
}

#[test]
fn a_team_already_using_more_waits_behind_a_lighter_one() {
    // A runs 3 GPUs; when one frees up, B's later job goes before A's earlier one.
    check(
        "
        node n1 gpus=4
        job a1 team=A gpus=1 at=0
        job a2 team=A gpus=1 at=1
        job a3 team=A gpus=1 at=2
        job b0 team=B gpus=1 at=3
        sched 0
        job a4 team=A gpus=1 at=4
        job b1 team=B gpus=1 at=5
        finish a1
        sched 10
        ",
        "
        @0 place a1 n1:0
        @0 place b0 n1:1
        @0 place a2 n1:2
        @0 place a3 n1:3
        @10 place b1 n1:0
        ",
    );
}

#[test]
fn priority_comes_before_fair_share() {
    check(
        "
        node n1 gpus=2
        job b1 team=B gpus=1 at=0
        sched 0
        job b2 team=B gpus=1 prio=1 at=1
        job a1 team=A gpus=1 at=2
        sched 1
        ",
        "
        @0 place b1 n1:0
        @1 place b2 n1:1
        ",
    );
}
