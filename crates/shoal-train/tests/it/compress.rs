//! Training with compressed gradients: under every codec every rank ends each run with identical parameters (and
//! identical saved compression state), the loss falls as it does uncompressed, ZeRO's reduce-scatter compresses
//! too, and a run resumed from its state — the error feedback included — ends bit for bit where the uninterrupted
//! run does.

use shoal_comm::{Codec, CompressConfig};
use shoal_train::Real;

use crate::equivalence::{Run, train_world_from, train_world_with_losses};

fn run(codec: Codec, zero: u8, steps: usize) -> Run {
    let compress = Some(CompressConfig { codec, warmup_steps: 2, seed: 3, ..CompressConfig::default() });
    Run { zero, compress, ..Run::mlp(steps, 60, 2) }
}

/// The same run sending AdamW's first moment past a warm-up of `warmup_steps` coded by int8.
fn moment_run(codec: Codec, warmup_steps: u64, steps: usize) -> Run {
    let cfg = CompressConfig {
        codec,
        warmup_steps,
        warmup_codec: Codec::Int8 { stochastic: false },
        seed: 3,
        ..CompressConfig::default()
    };
    Run { compress: Some(cfg), momentum: true, ..run(codec, 0, steps) }
}

const CODECS: [Codec; 8] = [
    Codec::Fp16,
    Codec::Bf16,
    Codec::Int8 { stochastic: false },
    Codec::Int8 { stochastic: true },
    Codec::TopK { ratio: 0.05 },
    // Random-k sends each value every 1/ratio steps on average: slow to converge at 5% in 40 steps.
    Codec::RandK { ratio: 0.25 },
    Codec::Sign,
    Codec::PowerSgd { rank: 2 },
];

/// The mean of the first and of the last five losses.
fn ends(losses: &[Real]) -> (Real, Real) {
    let mean = |s: &[Real]| s.iter().sum::<Real>() / s.len() as Real;
    (mean(&losses[..5]), mean(&losses[losses.len() - 5..]))
}

/// The loss falls under the codec, to near where it falls uncompressed.
fn trains_like(what: &str, plain: &[Real], got: &[Real]) {
    let ((p0, p1), (g0, g1)) = (ends(plain), ends(got));
    assert!(g1 < g0 * 0.6, "{what}: the loss fell from {g0} to {g1} only");
    assert!(g1 < p1 * 1.5 + 0.02, "{what}: final loss {g1}, uncompressed {p1} (from {p0})");
}

#[test]
fn every_codec_keeps_the_ranks_identical_and_trains_like_the_uncompressed_run() {
    let (_, plain) = train_world_with_losses(Run { compress: None, ..run(Codec::None, 0, 40) }, 3, None);
    for codec in CODECS {
        // `train_world_with_losses` checks every rank holds the same parameters and saves the same state.
        let (got, losses) = train_world_with_losses(run(codec, 0, 40), 3, None);
        if let Codec::RandK { .. } = codec {
            // Random-k sends each value about every 1/ratio steps: in 40 steps it learns, but slower (0.41 against
            // 0.20 uncompressed, here).
            let (g0, g1) = ends(&losses);
            assert!(g1 < g0 * 0.6, "randk: the loss fell from {g0} to {g1} only");
        } else {
            trains_like(codec.name(), &plain, &losses);
        }
        assert!(!got.compression.is_empty(), "{}: error feedback saved", codec.name());
    }
}

#[test]
fn sending_the_moment_keeps_the_ranks_identical_and_trains() {
    let (_, plain) = train_world_with_losses(Run { compress: None, ..run(Codec::None, 0, 40) }, 3, None);
    for codec in
        [Codec::Sign, Codec::TopK { ratio: 0.05 }, Codec::PowerSgd { rank: 2 }, Codec::Int8 { stochastic: false }]
    {
        // Half the run warms the second moment up: on this small MLP the moment pays less than on the GPT.
        let (got, losses) = train_world_with_losses(moment_run(codec, 20, 40), 3, None);
        let ((_, p1), (g0, g1)) = (ends(&plain), ends(&losses));
        let what = format!("{} sending the moment", codec.name());
        assert!(g1 < g0 * 0.5 && g1 < p1 * 2.0, "{what}: the loss fell from {g0} to {g1} (uncompressed: to {p1})");
        assert!(!got.compression.is_empty(), "{}: error feedback saved", codec.name());
        // Not the gradients' run: the moment is what went through the codec.
        let (_, sent_gradients) = train_world_with_losses(run(codec, 0, 40), 3, None);
        assert_ne!(losses, sent_gradients, "{}: sending the moment changed nothing", codec.name());
    }
}

#[test]
fn zero_reduce_scatters_compressed_and_keeps_the_ranks_identical() {
    let (_, plain) = train_world_with_losses(Run { compress: None, ..run(Codec::None, 2, 40) }, 3, None);
    for codec in [Codec::Int8 { stochastic: false }, Codec::Sign, Codec::TopK { ratio: 0.1 }, Codec::Bf16] {
        for stage in [1, 2, 3] {
            let (_, losses) = train_world_with_losses(run(codec, stage, 40), 3, None);
            trains_like(&format!("zero{stage} {}", codec.name()), &plain, &losses);
        }
    }
}

#[test]
fn a_run_resumed_with_its_error_feedback_ends_bit_for_bit_where_the_uninterrupted_one_does() {
    for (codec, zero) in [
        (Codec::TopK { ratio: 0.05 }, 0),
        (Codec::PowerSgd { rank: 2 }, 0),
        (Codec::Int8 { stochastic: true }, 0),
        (Codec::Sign, 2),
    ] {
        resumes_bit_for_bit(run(codec, zero, 12), run(codec, zero, 6), &format!("{} (zero {zero})", codec.name()));
    }
    // Sending the moment: resumed past the warm-up, and resumed within it (the second moment freezes after).
    for (codec, warmup) in [(Codec::TopK { ratio: 0.05 }, 2), (Codec::Sign, 8)] {
        let what = format!("{} sending the moment after {warmup} steps", codec.name());
        resumes_bit_for_bit(moment_run(codec, warmup, 12), moment_run(codec, warmup, 6), &what);
    }
}

/// `whole` run at once, and `half` twice (the second from what the first saved), end with the same bits; without
/// the saved error feedback they do not.
fn resumes_bit_for_bit(whole: Run, half: Run, what: &str) {
    let whole = train_world_from(whole, 2, None);
    let first = train_world_from(half.clone(), 2, None);
    assert!(!first.compression.is_empty(), "{what}: no error feedback saved");
    let resumed = train_world_from(half.clone(), 2, Some(first.clone()));
    assert_eq!(resumed.params, whole.params, "{what}: resumed parameters differ");
    assert_eq!(resumed.optimizer, whole.optimizer, "{what}: resumed optimizer state differs");
    // Without the error feedback the resumed run is another run.
    let forgot = train_world_from(half, 2, Some(crate::equivalence::Saved { compression: Vec::new(), ..first }));
    assert_ne!(forgot.params, whole.params, "{what}: the error feedback made no difference");
}
