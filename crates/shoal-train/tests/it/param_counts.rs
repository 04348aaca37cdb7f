//! The spec's parameter counts (what admission and memory estimates use, with no model built) are the models'
//! own: every example job's model, and variations of each kind, built here and counted.

use shoal_train::worker::build_model;
use shoal_train::{SeededRng, spec};

fn examples() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

fn check(job: &spec::JobSpec, what: &str) {
    let shape = job.train.data_shape().expect("data shape");
    let (params, _model) = build_model(job, &mut SeededRng::new(1)).expect("model");
    assert_eq!(
        job.train.model.param_count(shape.features, shape.classes),
        params.count() as u64,
        "{what}: the spec's count differs from the built model's"
    );
}

#[test]
fn the_specs_parameter_counts_are_the_built_models() {
    let mut seen = 0;
    for entry in std::fs::read_dir(examples()).expect("examples") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let job = spec::load_job(&path).expect("example parses");
        // The 100M-parameter checkpoint example is counted without being built.
        if job.train.model.param_count(64, 10) > 20_000_000 {
            continue;
        }
        check(&job, &path.display().to_string());
        seen += 1;
    }
    assert!(seen >= 5, "only {seen} examples checked");
    let base = "name = \"x\"\n[train]\nglobal_batch = 8\nsteps = 1\nlr = 0.1\n";
    for (dataset, model) in [
        ("digits", "kind = \"mlp\"\nhidden = []"),
        ("digits", "kind = \"mlp\"\nhidden = [7, 5, 3]"),
        ("synthetic", "kind = \"mlp\"\nhidden = [16]"),
        ("digits", "kind = \"cnn\"\nchannels = [4]"),
        ("digits", "kind = \"cnn\"\nchannels = [3, 6]"),
        ("cicero", "kind = \"gpt\"\nlayers = 1\nheads = 2\nwidth = 16\ncontext = 8"),
        ("cicero", "kind = \"gpt\"\nlayers = 3\nheads = 4\nwidth = 32\ncontext = 24"),
        ("digits", "kind = \"vit\""),
        ("digits", "kind = \"vit\"\npatch = 2\nlayers = 1\nheads = 2\nwidth = 16"),
    ] {
        let text = format!("{base}dataset = \"{dataset}\"\n[train.model]\n{model}\n");
        let job = spec::parse_job(&text, "variation").unwrap_or_else(|e| panic!("{text}: {e}"));
        check(&job, &text);
    }
}
