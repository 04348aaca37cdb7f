//! Plots comparing policies on one trace, as SVG: the JCT CDF, GPU allocation, queue length and fragmentation
//! over time. Long series are averaged into at most [`POINTS`] time buckets.

use plotters::prelude::*;

use crate::error::{Result, SimError};
use crate::outcome::{Outcome, Sample};

/// The most points a line of a time series has.
pub const POINTS: usize = 800;

/// A line: its label and points.
type Line = (String, Vec<(f64, f64)>);

/// Averages `(t, v)` samples held until the next one into at most [`POINTS`] buckets of equal time.
fn buckets(series: &[Sample], value: impl Fn(&Sample) -> f64) -> Vec<(f64, f64)> {
    let (Some(first), Some(last)) = (series.first(), series.last()) else { return Vec::new() };
    let (t0, t1) = (first.t_ms as f64, last.t_ms as f64);
    if t1 <= t0 {
        return vec![(t0 / 3.6e6, value(first))];
    }
    let width = (t1 - t0) / POINTS as f64;
    let mut sums = vec![(0.0f64, 0.0f64); POINTS];
    for (s, next) in series.iter().zip(series.iter().skip(1)) {
        // Spread the sample's value over the buckets its interval covers.
        let (mut a, b) = (s.t_ms as f64, next.t_ms as f64);
        let v = value(s);
        while a < b {
            let k = (((a - t0) / width) as usize).min(POINTS - 1);
            let end = (t0 + (k + 1) as f64 * width).min(b);
            let dt = (end - a).max(0.0);
            sums[k].0 += v * dt;
            sums[k].1 += dt;
            if end <= a {
                break;
            }
            a = end;
        }
    }
    sums.iter()
        .enumerate()
        .filter(|(_, (_, w))| *w > 0.0)
        .map(|(k, (s, w))| ((t0 + (k as f64 + 0.5) * width) / 3.6e6, s / w))
        .collect()
}

fn draw(path: &std::path::Path, title: &str, x_desc: &str, y_desc: &str, lines: &[Line], log_x: bool) -> Result<()> {
    let file = path.display().to_string();
    let err = |e: &dyn std::fmt::Display| SimError::Plot { file: file.clone(), message: e.to_string() };
    let pts = lines.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let y1 = if y1 > 0.0 { y1 * 1.05 } else { 1.0 };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 540)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut builder = ChartBuilder::on(&root);
        builder.caption(title, ("sans-serif", 22)).margin(14).x_label_area_size(44).y_label_area_size(64);
        let colour = |i: usize| Palette99::pick(i).to_rgba();
        if log_x {
            let x0 = x0.max(1e-3);
            let mut chart =
                builder.build_cartesian_2d((x0..x1.max(x0 * 10.0)).log_scale(), 0f64..y1).map_err(|e| err(&e))?;
            chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).draw().map_err(|e| err(&e))?;
            for (i, (label, p)) in lines.iter().enumerate() {
                let c = colour(i);
                chart
                    .draw_series(LineSeries::new(p.iter().map(|&(x, y)| (x.max(x0), y)), c.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(label.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(&e))?;
        } else {
            let mut chart = builder.build_cartesian_2d(x0..x1, 0f64..y1).map_err(|e| err(&e))?;
            chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).draw().map_err(|e| err(&e))?;
            for (i, (label, p)) in lines.iter().enumerate() {
                let c = colour(i);
                chart
                    .draw_series(LineSeries::new(p.iter().copied(), c.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(label.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(&e))?;
        }
        root.present().map_err(|e| err(&e))?;
    }
    crate::error::write(path, svg.as_bytes())
}

/// The JCT CDF: for each policy, the fraction of completed jobs within each JCT (seconds, log scale).
fn jct_cdf(o: &Outcome) -> Vec<(f64, f64)> {
    let mut jct: Vec<f64> =
        o.jobs.iter().filter_map(|j| j.end_ms.map(|e| e.saturating_sub(j.submit_ms) as f64 / 1000.0)).collect();
    jct.sort_by(f64::total_cmp);
    let n = jct.len();
    let step = (n / POINTS).max(1);
    let mut out: Vec<(f64, f64)> =
        jct.iter().enumerate().step_by(step).map(|(i, &x)| (x, (i + 1) as f64 / n as f64)).collect();
    if let Some(&x) = jct.last() {
        out.push((x, 1.0));
    }
    out
}

/// Writes `jct_cdf.svg`, `allocation.svg`, `queue.svg` and `fragmentation.svg` into `dir`; returns their paths.
pub fn write_plots(dir: &std::path::Path, outcomes: &[Outcome]) -> Result<Vec<std::path::PathBuf>> {
    let label = |o: &Outcome| o.policy.to_string();
    let mut written = Vec::new();
    let mut one = |name: &str, title: &str, x: &str, y: &str, lines: Vec<Line>, log_x: bool| -> Result<()> {
        let p = dir.join(name);
        draw(&p, title, x, y, &lines, log_x)?;
        written.push(p);
        Ok(())
    };
    one(
        "jct_cdf.svg",
        "Job completion time CDF",
        "JCT (s, log scale)",
        "fraction of jobs",
        outcomes.iter().map(|o| (label(o), jct_cdf(o))).collect(),
        true,
    )?;
    one(
        "allocation.svg",
        "GPU allocation over time",
        "time (h)",
        "GPUs allocated (%)",
        outcomes
            .iter()
            .map(|o| {
                let total = o.total_gpu_milli.max(1) as f64;
                (label(o), buckets(&o.series, |s| 100.0 * s.allocated_gpu_milli as f64 / total))
            })
            .collect(),
        false,
    )?;
    one(
        "queue.svg",
        "Queue length over time",
        "time (h)",
        "jobs waiting",
        outcomes.iter().map(|o| (label(o), buckets(&o.series, |s| s.pending as f64))).collect(),
        false,
    )?;
    one(
        "fragmentation.svg",
        "Fragmentation over time (FGD's, for the head of the queue)",
        "time (h)",
        "fragmented GPUs",
        outcomes.iter().map(|o| (label(o), buckets(&o.series, |s| s.fragmentation_milli as f64 / 1000.0))).collect(),
        false,
    )?;
    Ok(written)
}
