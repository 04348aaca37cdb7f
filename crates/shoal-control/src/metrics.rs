//! The control plane's own metrics that accumulate (API requests, scheduling passes), for `/metrics`; the rest of
//! `/metrics` is computed at each scrape from the store.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

/// Process-wide metrics that accumulate (the rest is computed at each scrape).
#[derive(Debug, Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub api_requests: IntCounterVec,
    pub api_latency: HistogramVec,
    pub scheduler_pass: HistogramVec,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let api_requests = IntCounterVec::new(
            Opts::new("shoal_api_requests_total", "HTTP requests served, by method, route and status"),
            &["method", "route", "status"],
        )
        .expect("valid metric");
        let api_latency = HistogramVec::new(
            HistogramOpts::new("shoal_api_request_duration_seconds", "HTTP request latency, by route")
                .buckets(vec![0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
            &["route"],
        )
        .expect("valid metric");
        let scheduler_pass = HistogramVec::new(
            HistogramOpts::new("shoal_scheduler_pass_seconds", "Duration of one scheduling pass")
                .buckets(vec![0.00001, 0.0001, 0.001, 0.01, 0.1, 1.0]),
            &[],
        )
        .expect("valid metric");
        for c in [
            Box::new(api_requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(api_latency.clone()),
            Box::new(scheduler_pass.clone()),
        ] {
            registry.register(c).expect("distinct metric names");
        }
        Metrics { registry, api_requests, api_latency, scheduler_pass }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
