//! Dynamic sharding on the platform: two workers take a Parquet table's row groups from the job's coordinator as
//! they need them; one is killed with `kill -9` in the middle of the first epoch, the gang restarts from the newest
//! checkpoint (whose ledger says what each worker had trained on), and the rows every step trained on — recorded by
//! the ranks themselves — hold every row of the table exactly once in each epoch.

use std::collections::BTreeMap;
use std::path::Path;

use crate::faults::{kill, training, worker_pid};
use crate::lake::{Res, names, parquet_in_groups};
use crate::platform::Platform;

/// Rows of the training table, in row groups of [`GROUP`]; a global batch of [`BATCH`].
const ROWS: u64 = 3000;
const GROUP: usize = 100;
const BATCH: u64 = 32;

fn spec(dir: &Path, steps: u64) -> String {
    let cols: Vec<String> = names().iter().map(|n| format!("\"{n}\"")).collect();
    format!(
        r#"
name = "shards"
[workers]
count = 2
[resources]
cpus = 1
memory = "1GiB"
[fault_tolerance]
policy = "restart"
max_restarts = 2
backoff = "1s"
[env]
SHOAL_FAULT_DATA_DELAY = "50ms"
SHOAL_RECORD_SAMPLES = "1"
[train]
dataset = "{train}"
global_batch = {BATCH}
steps = {steps}
lr = 0.01
log_every = 50
[train.model]
kind = "mlp"
hidden = [32]
[train.data]
feature_columns = [{cols}]
label_column = "label"
classes = 4
eval = "{eval}"
sharding = "dynamic"
[checkpoint]
every = 20
keep = 2
"#,
        train = dir.join("train.parquet").display(),
        eval = dir.join("eval.parquet").display(),
        cols = cols.join(", "),
    )
}

/// How many times each row was trained on in each epoch, from every rank's `samples-rank-R.jsonl`.
fn counts(run: &Path, ranks: usize) -> Res<BTreeMap<u64, Vec<u32>>> {
    let mut by_epoch: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for r in 0..ranks {
        let path = run.join(format!("samples-rank-{r}.jsonl"));
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("{line}: {e}"))?;
            let (Some(rows), Some(epochs)) = (v["rows"].as_array(), v["epochs"].as_array()) else {
                return Err(format!("{}: no rows or epochs in {line}", path.display()));
            };
            for (row, epoch) in rows.iter().zip(epochs) {
                let (Some(row), Some(epoch)) = (row.as_u64(), epoch.as_u64()) else {
                    return Err(format!("{}: not a row and an epoch: {row} {epoch}", path.display()));
                };
                let c = by_epoch.entry(epoch).or_insert_with(|| vec![0; ROWS as usize]);
                *c.get_mut(row as usize).ok_or_else(|| format!("row {row} is not in the table"))? += 1;
            }
        }
    }
    Ok(by_epoch)
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn dynamic_sharding_trains_on_every_row_once_an_epoch_through_a_killed_worker() -> Res<()> {
    let p = Platform::new("shards-kill");
    let dir = p.data().join("table");
    parquet_in_groups(&dir.join("train.parquet"), 0..ROWS, GROUP)?;
    parquet_in_groups(&dir.join("eval.parquet"), ROWS..ROWS + 600, GROUP)?;
    // About 94 steps an epoch: two epochs and a part.
    let steps = 2 * ROWS / BATCH + 20;
    let id = p.submit("shards", &spec(&dir, steps));
    // Past the checkpoint at step 20, well inside the first epoch.
    let v = training(&p, &id, 1, 30);
    let step_killed = v["last_metrics"]["step"].as_u64().unwrap_or(0);
    kill(worker_pid(&v, 1), libc::SIGKILL);
    let v = p.wait_state(&id, "succeeded");
    assert_eq!((v["restarts"].as_i64(), v["attempt"].as_i64()), (Some(1), Some(2)), "{v}");
    let sum = &v["summary"];
    assert_eq!(sum["steps"].as_u64(), Some(steps), "{sum}");
    let resumed = sum["resumed_from"].as_u64().ok_or_else(|| format!("not resumed: {sum}"))?;
    assert!((20..ROWS / BATCH).contains(&resumed), "resumed in the first epoch, from step {resumed}: {sum}");
    eprintln!("killed rank 1 at step {step_killed}; attempt 2 resumed from step {resumed}");

    let by_epoch = counts(&p.job_dir(&id).join("run"), 2)?;
    for epoch in [0, 1] {
        let c = by_epoch.get(&epoch).ok_or_else(|| format!("no rows of epoch {epoch}"))?;
        let wrong: Vec<(usize, u32)> = c.iter().copied().enumerate().filter(|(_, n)| *n != 1).collect();
        assert!(
            wrong.is_empty(),
            "epoch {epoch}: {} rows not trained on exactly once (row, times): {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(10)]
        );
    }
    let trained: u32 = by_epoch.values().flatten().sum();
    assert_eq!(u64::from(trained), steps * BATCH, "every step trained on a whole global batch");
    let acc = sum["eval_accuracy"].as_f64().ok_or_else(|| format!("no eval_accuracy: {sum}"))?;
    assert!(acc > 0.8, "the model learns the planted classes: held-out accuracy {acc}");
    Ok(())
}
