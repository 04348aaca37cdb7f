use crate::check;

#[test]
fn submit_validation_names_the_field() {
    check(
        "
        node n1
        node n2
        job m tasks=3..2
        job z tasks=0
        job z2 tasks=0..2
        job g gpus=16
        job f gpus=1.5
        job q queue=nope
        job c cpus=100
        job gm gpus=1 gmem=100G
        job gx gmem=1G
        job n tasks=3 gpus=8
        job s tasks=3 spread
        job big tasks=1..70000
        job nothing cpus=0 mem=0
        job ok
        job ok
        finish ghost
        ",
        "
        error: job m: tasks_min (3) is greater than tasks_max (2)
        error: job z: tasks_max must be at least 1
        error: job z2: tasks_min must be at least 1
        error: job g: per_task.gpus_milli: can never run: asks 16 GPUs per task, the largest node has 8 GPUs
        error: job f: per_task.gpus_milli = 1500: a request of one GPU or more must be a multiple of 1000 (whole GPUs)
        error: job q: unknown queue \"nope\"
        error: job c: per_task.cpus_milli: can never run: asks 100000 milli-CPUs per task, the largest node has 64000
        error: job gm: per_task.gpu_memory_bytes: can never run: asks 107374182400 bytes per GPU, the largest GPU has 85899345920
        error: job gx: per_task.gpu_memory_bytes = 1073741824 but per_task.gpus_milli is 0
        error: job n: tasks_min: can never run: asks 3 tasks, the whole empty cluster holds fewer
        error: job s: tasks_min: can never run: asks 3 tasks on distinct nodes, the whole empty cluster holds fewer
        error: job big: tasks_max (70000) is above the limit of 65536 tasks per job
        error: job nothing: per_task asks for no CPU, memory or GPU
        error: job ok: already submitted
        error: unknown job ghost
        ",
    );
}

#[test]
fn a_queue_without_borrowing_refuses_a_gang_above_its_guarantee() {
    check(
        "
        node n1
        queue small gpus=2
        job big queue=small gpus=4
        ",
        "error: job big: queue \"small\" cannot borrow and its guaranteed gpus_milli (2000) is below the job's minimum (4000)",
    );
}
