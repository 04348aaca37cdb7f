use crate::check;

#[test]
fn gang_is_all_or_nothing() {
    // Two of three nodes are free: a three-node gang places no task at all,
    // and starts whole once the third node frees up.
    check(
        "
        node n1
        node n2
        node n3
        job x gpus=8 rt=1000
        job a tasks=3 gpus=8 at=1
        sched 0
        finish x
        sched 5
        ",
        "
        @0 place x n1:0,1,2,3,4,5,6,7
        @5 place a n1:0,1,2,3,4,5,6,7 n2:0,1,2,3,4,5,6,7 n3:0,1,2,3,4,5,6,7
        ",
    );
}

#[test]
fn gang_spanning_nodes_when_it_must() {
    check(
        "
        node n1
        node n2
        job a tasks=3 gpus=4
        sched 0
        ",
        "@0 place a n1:0,1,2,3 n1:4,5,6,7 n2:0,1,2,3",
    );
}

#[test]
fn packing_versus_spread() {
    check(
        "
        node n1
        node n2
        node n3
        job p tasks=4 gpus=1 at=0
        job s tasks=3 gpus=1 spread at=1
        sched 0
        ",
        "
        @0 place p n1:0 n1:1 n1:2 n1:3
        @0 place s n1:4 n2:0 n3:0
        ",
    );
}

#[test]
fn packing_prefers_the_fullest_node_that_fits() {
    // n2 is half used: the 4-GPU job goes there, leaving n1 whole.
    check(
        "
        node n1
        node n2
        job filler gpus=2 at=0
        job other gpus=8 at=1
        job small gpus=4 at=2
        sched 0
        ",
        "
        @0 place filler n1:0,1
        @0 place other n2:0,1,2,3,4,5,6,7
        @0 place small n1:2,3,4,5
        ",
    );
}

#[test]
fn fractional_gpus_share_one_gpu() {
    check(
        "
        node n1 gpus=2
        job f1 gpus=0.5 at=0
        job f2 gpus=0.5 at=1
        job f3 gpus=0.25 at=2
        job f4 gpus=0.75 at=3
        job w gpus=1 at=4
        sched 0
        ",
        "
        @0 place f1 n1:0@500
        @0 place f2 n1:0@500
        @0 place f3 n1:1@250
        @0 place f4 n1:1@750
        ",
    );
}

#[test]
fn gpu_memory_is_respected() {
    // GPU 0 has 10G: a half-GPU task asking 20G skips it; two 30G halves do
    // not share an 40G GPU; a whole GPU asking 40G skips the small one.
    check(
        "
        node n1 gpus=4 gmem=40G gpu_gmem=0:10G
        job a gpus=0.5 gmem=20G at=0
        job b gpus=0.25 gmem=20G at=1
        job c gpus=0.25 gmem=30G at=2
        job d gpus=1 gmem=40G at=3
        job e gpus=0.1 gmem=10G at=4
        sched 0
        ",
        "
        @0 place a n1:1@500
        @0 place b n1:1@250
        @0 place c n1:2@250
        @0 place d n1:3
        @0 place e n1:2@100
        ",
    );
}

#[test]
fn a_job_is_placed_away_from_the_nodes_it_avoids_while_it_fits_elsewhere() {
    // Packing would put b on n1 beside a; avoiding n1 it goes to n2. c avoids n2 too, but only n2 has room for a
    // whole node's gang: it goes there all the same rather than wait.
    check(
        "
        node n1 gpus=8
        node n2 gpus=8
        job a gpus=4
        job b gpus=2 avoid=n1 at=1
        job c gpus=2 avoid=n1,n2 at=2
        job d gpus=4 avoid=n2 at=3
        sched 0
        ",
        "
        @0 place a n1:0,1,2,3
        @0 place b n2:0,1
        @0 place c n1:4,5
        @0 place d n2:2,3,4,5
        ",
    );
}
