//! `shoal checkpoint inspect` and `shoal checkpoint consolidate` on the checkpoints of real runs: a ZeRO-2 run on
//! 2 ranks and a DDP run on 1, described and consolidated into safetensors files read back with the safetensors
//! crate; a corrupt checkpoint refused naming its file; bad paths refused without a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::SafeTensors;

use crate::train::run_json;

fn shoal(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shoal")).args(args).output().expect("run shoal")
}

/// Runs `shoal args`, which must fail; returns its stderr.
fn fails(args: &[&str]) -> String {
    let out = shoal(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "shoal {args:?} succeeded: {}", String::from_utf8_lossy(&out.stdout));
    assert!(!err.contains("panicked"), "shoal {args:?} panicked: {err}");
    err
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Trains 8 steps with checkpoints at 4 and 8 under `strategy` on `ranks` ranks; returns the run's directory.
fn train(dir: &Path, strategy: &str, ranks: &str) -> PathBuf {
    let job = dir.join(format!("{strategy}.toml"));
    let text = format!(
        "name = \"ck\"\n[train]\ndataset = \"digits\"\nglobal_batch = 32\nsteps = 8\nseed = 0\noptimizer = \"adamw\"\n\
         lr = 3e-3\nstrategy = \"{strategy}\"\n[train.model]\nkind = \"mlp\"\nhidden = [16]\n[checkpoint]\nevery = 4\n"
    );
    std::fs::write(&job, text).expect("write job");
    let out = dir.join(strategy);
    run_json(&["run", "-n", ranks, "--json", "--output", s(&out), s(&job)]);
    out
}

/// Name, shape and raw bytes of every tensor of a safetensors file, sorted by name.
fn tensors(bytes: &[u8]) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let st = SafeTensors::deserialize(bytes).expect("safetensors");
    let mut out: Vec<_> = st.tensors().into_iter().map(|(n, t)| (n, t.shape().to_vec(), t.data().to_vec())).collect();
    out.sort();
    out
}

#[test]
fn inspect_and_consolidate_zero_and_ddp_checkpoints() {
    let dir = std::env::temp_dir().join(format!("shoal-ckpt-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let zero = train(&dir, "zero2", "2");
    let ddp = train(&dir, "ddp", "1");

    let mut shapes = Vec::new();
    for (run, strategy, world) in [(&zero, "zero2", 2), (&ddp, "ddp", 1)] {
        let last = run.join("checkpoints/step-000008");
        // The run's directory leads to its newest checkpoint, with every step listed.
        let i = run_json(&["checkpoint", "inspect", "--json", s(run)]);
        assert_eq!(i["step"], 8, "{i}");
        assert_eq!(i["strategy"], strategy, "{i}");
        assert_eq!(i["world_size"], world, "{i}");
        assert_eq!(i["optimizer_t"], 8, "{i}");
        assert!(i["sampler"]["position"].as_u64().is_some(), "{i}");
        let steps: Vec<_> =
            i["steps"].as_array().expect("steps").iter().map(|s| (s["step"].clone(), s["valid"].clone())).collect();
        assert_eq!(steps, [(4.into(), true.into()), (8.into(), true.into())], "{i}");
        // Its model tensors are those of model.safetensors, each one whole shard.
        let model = tensors(&std::fs::read(last.join("model.safetensors")).expect("model"));
        let listed = i["tensors"].as_array().expect("tensors");
        let mut got: Vec<(String, Vec<usize>)> = listed
            .iter()
            .filter(|t| t["part"] == "model")
            .map(|t| {
                (
                    t["name"].as_str().unwrap_or("").to_string(),
                    serde_json::from_value(t["shape"].clone()).expect("shape"),
                )
            })
            .collect();
        got.sort();
        let want: Vec<_> = model.iter().map(|(n, sh, _)| (n.clone(), sh.clone())).collect();
        assert_eq!(got, want, "{i}");
        for t in listed {
            assert_eq!(t["dtype"], "F32");
            assert_eq!(t["layout"], "whole");
            let shards = t["shards"].as_array().expect("shards");
            assert_eq!(shards.len(), 1, "{t}");
            assert_eq!(shards[0]["shape"], t["shape"], "{t}");
            assert!(shards[0]["offsets"].as_array().is_some_and(|o| o.iter().all(|x| x == 0)), "{t}");
            let elements: u64 = t["shape"].as_array().expect("shape").iter().map(|d| d.as_u64().unwrap_or(0)).product();
            assert_eq!(t["bytes"].as_u64(), Some(4 * elements), "{t}");
        }
        shapes.push(got);
        // The human form says the same.
        let text = shoal(&["checkpoint", "inspect", s(&last)]);
        let text = String::from_utf8_lossy(&text.stdout);
        assert!(text.contains(&format!("saved by {world} rank(s) under {strategy}")), "{text}");

        // Consolidated: the model's tensors as saved, with the step, strategy and world size.
        let out = dir.join(format!("{strategy}.safetensors"));
        let c = run_json(&["checkpoint", "consolidate", s(run), "--out", s(&out), "--json"]);
        assert_eq!(c["step"], 8, "{c}");
        let bytes = std::fs::read(&out).expect("consolidated file");
        assert_eq!(c["bytes"].as_u64(), Some(bytes.len() as u64));
        assert_eq!(tensors(&bytes), model, "{strategy}: consolidated tensors differ from model.safetensors");
        let (_, meta) = SafeTensors::read_metadata(&bytes).expect("header");
        let meta = meta.metadata().clone().expect("__metadata__");
        assert_eq!(meta.get("step").map(String::as_str), Some("8"));
        assert_eq!(meta.get("strategy").map(String::as_str), Some(strategy));
        assert_eq!(meta.get("world_size"), Some(&world.to_string()));

        // With the optimizer's state, under `optimizer.`.
        let c = run_json(&["checkpoint", "consolidate", s(&last), "--out", s(&out), "--optimizer", "--json"]);
        let bytes = std::fs::read(&out).expect("consolidated file");
        let opt = tensors(&std::fs::read(last.join("optimizer.safetensors")).expect("optimizer"));
        let all = tensors(&bytes);
        assert_eq!(all.len(), model.len() + opt.len(), "{c}");
        for (n, sh, data) in &opt {
            assert!(all.iter().any(|(m, s2, d2)| *m == format!("optimizer.{n}") && s2 == sh && d2 == data), "{n}");
        }
    }
    // The same model under both strategies.
    assert_eq!(shapes[0], shapes[1]);

    // A corrupt file: refused naming it when named, skipped (and named) for the run.
    let last = zero.join("checkpoints/step-000008");
    let bad = last.join("model.safetensors");
    let mut b = std::fs::read(&bad).expect("model");
    let end = b.len() - 1;
    b[end] ^= 0x40;
    std::fs::write(&bad, b).expect("corrupt model");
    let out = dir.join("refused.safetensors");
    let err = fails(&["checkpoint", "consolidate", s(&last), "--out", s(&out)]);
    assert!(err.contains(s(&bad)) && err.contains("checksum mismatch"), "{err}");
    assert!(!out.exists(), "nothing written for a corrupt checkpoint");
    let err = fails(&["checkpoint", "inspect", s(&last)]);
    assert!(err.contains(s(&bad)), "{err}");
    let i = run_json(&["checkpoint", "inspect", "--json", s(&zero)]);
    assert_eq!(i["step"], 4, "{i}");
    assert_eq!(i["steps"][1]["valid"], false, "{i}");
    assert_eq!(i["steps"][1]["file"], s(&bad), "{i}");
    let c = run_json(&["checkpoint", "consolidate", s(&zero), "--out", s(&out), "--json"]);
    assert_eq!(c["step"], 4, "{c}");

    // Bad paths: errors naming them, no panic.
    let missing = dir.join("no-such-run");
    assert!(fails(&["checkpoint", "inspect", s(&missing)]).contains(s(&missing)));
    let err = fails(&["checkpoint", "inspect", s(&dir)]);
    assert!(err.contains(s(&dir)) && err.contains("not a checkpoint"), "{err}");
    let manifest = ddp.join("checkpoints/step-000004/manifest.json");
    std::fs::write(&manifest, b"{\"format\": 1,").expect("break manifest");
    let err = fails(&["checkpoint", "consolidate", s(&ddp.join("checkpoints/step-000004")), "--out", s(&out)]);
    assert!(err.contains(s(&manifest)), "{err}");
    let trunc = ddp.join("checkpoints/step-000008/optimizer.safetensors");
    std::fs::OpenOptions::new().write(true).open(&trunc).and_then(|f| f.set_len(10)).expect("truncate");
    let err = fails(&["checkpoint", "inspect", s(&ddp)]);
    assert!(err.contains(s(&trunc)) && err.contains(s(&manifest)), "{err}");
    let nowhere = dir.join("nowhere/x.safetensors");
    assert!(fails(&["checkpoint", "consolidate", s(&zero), "--out", s(&nowhere)]).contains(s(&dir.join("nowhere"))));
    let _ = std::fs::remove_dir_all(dir);
}
