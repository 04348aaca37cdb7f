//! Integration tests of `shoal-data`: the loader over real samplers and datasets, end to end.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use shoal_data::{
    Batch, Dataset, DatasetInfo, DistributedSampler, Error, Kind, Loader, LoaderConfig, Options, Partition, Sample,
    SamplerConfig, SamplerState, Split, Tail, builtin, catalogue,
};

/// A dataset whose sample `i` is `[i]`, with an optional delay per `get`, a failing index, and a count of live
/// `get` calls.
#[derive(Debug, Default)]
struct Probe {
    len: usize,
    delay: Duration,
    fail_at: Option<usize>,
    calls: AtomicUsize,
}

impl Dataset for Probe {
    fn info(&self) -> DatasetInfo {
        DatasetInfo {
            name: "probe".into(),
            kind: Kind::Tabular,
            len: self.len,
            features: 1,
            classes: 1,
            description: String::new(),
        }
    }
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self, index: usize) -> shoal_data::Result<Sample> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        if self.fail_at == Some(index) {
            return Err(Error::Malformed { what: "probe".into(), reason: "bad record".into() });
        }
        Ok(Sample::class(vec![index as f32], 0))
    }
}

fn wait_for_calls(data: &Probe, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while data.calls.load(Ordering::SeqCst) < n {
        assert!(Instant::now() < deadline, "only {} calls", data.calls.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn ids(b: &Batch) -> Vec<usize> {
    b.samples.iter().map(|s| s.features.as_dense().expect("dense")[0] as usize).collect()
}

#[test]
fn loader_yields_the_plan_in_order_with_any_thread_count() {
    let data = Arc::new(Probe { len: 103, delay: Duration::from_micros(200), ..Probe::default() });
    let sampler = DistributedSampler::new(SamplerConfig::new(103, 10), 1, 0).expect("valid");
    let want: Vec<Vec<usize>> = sampler.epoch_batches().map(|b| b.indices).collect();
    for threads in [1, 3] {
        for prefetch in [1, 4] {
            let cfg = LoaderConfig { threads, prefetch, ..LoaderConfig::default() };
            let loader = Loader::new(data.clone(), sampler.epoch_batches(), cfg).expect("starts");
            let got: Vec<Batch> = loader.map(|b| b.expect("no error")).collect();
            assert_eq!(got.iter().map(|b| b.indices.clone()).collect::<Vec<_>>(), want);
            assert!(got.iter().all(|b| ids(b) == b.indices), "samples follow indices");
            assert_eq!(got.iter().map(|b| b.seq).collect::<Vec<_>>(), (0..11).collect::<Vec<_>>());
            assert_eq!(got.last().expect("batches").next, SamplerState { epoch: 0, position: 103 });
        }
    }
}

#[test]
fn loader_prefetches_at_most_k_batches_ahead() {
    let data = Arc::new(Probe { len: 1000, ..Probe::default() });
    let sampler = DistributedSampler::new(SamplerConfig::new(1000, 10), 1, 0).expect("valid");
    let cfg = LoaderConfig { threads: 2, prefetch: 3, ..LoaderConfig::default() };
    let mut loader = Loader::new(data.clone(), sampler.epoch_batches(), cfg).expect("starts");
    // Three batches of ten fetched ahead, then no more until one is taken.
    wait_for_calls(&data, 30);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(data.calls.load(Ordering::SeqCst), 30);
    loader.next_batch().expect("ok").expect("batch");
    wait_for_calls(&data, 40);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(data.calls.load(Ordering::SeqCst), 40);
}

#[test]
fn loader_measures_data_wait() {
    let data = Arc::new(Probe { len: 40, delay: Duration::from_millis(5), ..Probe::default() });
    let sampler = DistributedSampler::new(SamplerConfig::new(40, 10), 1, 0).expect("valid");
    let mut loader = Loader::new(data, sampler.epoch_batches(), LoaderConfig::default()).expect("starts");
    // The first batch needs at least one 5 ms fetch, and the consumer waits for it.
    loader.next_batch().expect("ok").expect("batch");
    let first = loader.stats().last_wait;
    assert!(first >= Duration::from_millis(5), "{first:?}");
    // With the consumer slower than the fetcher, the next batch is ready: less wait.
    std::thread::sleep(Duration::from_millis(300));
    loader.next_batch().expect("ok").expect("batch");
    assert!(loader.stats().last_wait < first, "{:?}", loader.stats());
    assert_eq!(loader.stats().batches, 2);
    assert!(loader.stats().total_wait >= first);
}

#[test]
fn loader_errors_name_the_index_and_later_batches_still_come() {
    let data = Arc::new(Probe { len: 30, fail_at: Some(17), ..Probe::default() });
    let cfg = SamplerConfig { shuffle: false, ..SamplerConfig::new(30, 10) };
    let sampler = DistributedSampler::new(cfg, 1, 0).expect("valid");
    let mut loader = Loader::new(data, sampler.epoch_batches(), LoaderConfig::default()).expect("starts");
    assert!(loader.next_batch().expect("ok").is_some());
    let err = loader.next_batch().expect_err("index 17 fails");
    assert!(matches!(err, Error::Load { index: 17, seq: 1, .. }), "{err}");
    assert!(err.to_string().contains("sample 17"), "{err}");
    assert_eq!(ids(&loader.next_batch().expect("ok").expect("batch")), (20..30).collect::<Vec<_>>());
    assert!(loader.next_batch().expect("ok").is_none());
    assert!(loader.next_batch().expect("still ok").is_none());
}

#[test]
fn loader_times_out_instead_of_hanging() {
    let data = Arc::new(Probe { len: 4, delay: Duration::from_millis(300), ..Probe::default() });
    let sampler = DistributedSampler::new(SamplerConfig::new(4, 4), 1, 0).expect("valid");
    let cfg = LoaderConfig { timeout: Duration::from_millis(100), ..LoaderConfig::default() };
    let mut loader = Loader::new(data, sampler.epoch_batches(), cfg).expect("starts");
    let err = loader.next_batch().expect_err("slow");
    assert!(matches!(err, Error::Timeout { seq: 0, .. }), "{err}");
}

#[test]
fn dropping_the_loader_stops_its_threads() {
    let data = Arc::new(Probe { len: 100_000, delay: Duration::from_millis(1), ..Probe::default() });
    let sampler = DistributedSampler::new(SamplerConfig::new(100_000, 8), 1, 0).expect("valid");
    let cfg = LoaderConfig { threads: 4, prefetch: 2, ..LoaderConfig::default() };
    let loader = Loader::new(data.clone(), sampler.cycling_batches(), cfg).expect("starts");
    std::thread::sleep(Duration::from_millis(50));
    drop(loader);
    let calls = data.calls.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(data.calls.load(Ordering::SeqCst), calls, "threads kept fetching after drop");
    // Only the loader's clones were dropped: we hold the last reference again.
    assert_eq!(Arc::strong_count(&data), 1);
}

#[test]
fn bad_loader_configs_are_errors() {
    let data = Arc::new(Probe { len: 4, ..Probe::default() });
    let sampler = DistributedSampler::new(SamplerConfig::new(4, 4), 1, 0).expect("valid");
    for cfg in [
        LoaderConfig { prefetch: 0, ..LoaderConfig::default() },
        LoaderConfig { threads: 0, ..LoaderConfig::default() },
    ] {
        assert!(Loader::new(data.clone(), sampler.epoch_batches(), cfg).is_err());
    }
}

/// Every rank of a 3-rank run loads its batches of digits; together they see each image once per epoch, and a
/// checkpoint taken by them resumes at 2 ranks with the same global batches.
#[test]
fn ranks_load_digits_once_per_epoch_and_resume_at_another_world_size() {
    let digits: Arc<dyn Dataset> = Arc::from(builtin("digits", &Options::default()).expect("digits"));
    let cfg = SamplerConfig { seed: 11, tail: Tail::Partial, ..SamplerConfig::new(digits.len(), 96) };
    let mut seen = vec![0u32; digits.len()];
    let mut global: Vec<Vec<usize>> = Vec::new();
    for rank in 0..3 {
        let sampler = DistributedSampler::new(cfg, 3, rank).expect("valid");
        let loader = Loader::new(digits.clone(), sampler.epoch_batches(), LoaderConfig::default()).expect("starts");
        for (step, batch) in loader.enumerate() {
            let batch = batch.expect("loads");
            let (pixels, width) = batch.dense().expect("dense");
            assert_eq!(pixels.len(), width * batch.indices.len());
            assert_eq!(batch.classes().expect("classes").len(), batch.indices.len());
            for &i in &batch.indices {
                seen[i] += 1;
            }
            if global.len() <= step {
                global.push(Vec::new());
            }
            global[step].extend(&batch.indices);
        }
    }
    assert!(seen.iter().all(|&n| n == 1));
    // Resume after 7 steps at world size 2.
    let state = SamplerState { epoch: 0, position: 7 * 96 };
    for (step, want) in global.iter().enumerate().skip(7) {
        let mut got = Vec::new();
        for rank in 0..2 {
            let mut s = DistributedSampler::new(cfg, 2, rank).expect("valid");
            s.restore(state).expect("restores");
            got.extend(s.epoch_batches().nth(step - 7).expect("step exists").indices);
        }
        assert_eq!(&got, want, "step {step}");
    }
}

#[test]
fn text_batches_are_token_windows() {
    let o = Options { split: Split::Train, context: Some(32), ..Options::default() };
    let text: Arc<dyn Dataset> = Arc::from(builtin("cicero", &o).expect("cicero"));
    let sampler = DistributedSampler::new(SamplerConfig::new(text.len(), 16), 2, 0).expect("valid");
    let mut loader = Loader::new(text, sampler.epoch_batches(), LoaderConfig::default()).expect("starts");
    let batch = loader.next_batch().expect("ok").expect("batch");
    let (xs, ys, width) = batch.tokens().expect("tokens");
    assert_eq!((width, xs.len(), ys.len()), (32, 8 * 32, 8 * 32));
    assert!(xs.iter().chain(&ys).all(|&t| t < 256));
    for row in 0..8 {
        assert_eq!(xs[row * 32 + 1..(row + 1) * 32], ys[row * 32..(row + 1) * 32 - 1], "target = next byte");
    }
    assert!(batch.dense().is_none() && batch.classes().is_none());
}

#[test]
fn feature_partition_slices_samples_for_model_parallel_ranks() {
    let data = builtin("synthetic", &Options { features: Some(10), samples: Some(5), ..Options::default() })
        .expect("synthetic");
    let full = data.get(3).expect("ok");
    let full = full.features.as_dense().expect("dense");
    let mut joined = Vec::new();
    for rank in 0..3 {
        let cols = Partition::FeatureColumns.columns(data.info().features, 3, rank).expect("valid");
        assert_eq!(Partition::FeatureColumns.indices(data.len(), 3, rank).expect("valid").len(), 5);
        joined.extend_from_slice(&full[cols]);
    }
    assert_eq!(joined, full);
}

#[test]
fn catalogue_serialises_for_the_cli() {
    let json = serde_json::to_string(&catalogue()).expect("json");
    let back: Vec<serde_json::Value> = serde_json::from_str(&json).expect("array");
    let kinds: Vec<(&str, &str)> =
        back.iter().map(|o| (o["name"].as_str().expect("name"), o["kind"].as_str().expect("kind"))).collect();
    assert_eq!(kinds, vec![("digits", "image"), ("cicero", "text"), ("synthetic", "synthetic")]);
}
