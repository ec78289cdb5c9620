//! Router decision time: `Router::route` called in-process with many backends and realistic
//! state (RTT samples, engine load signals, learned rates, filled prefix indexes, hundreds of
//! attempts in flight), timed per call with the monotonic clock.
//!
//! The router itself reads no clock; here simulated time advances 1 ms per request, and the
//! attempts it starts end a fixed number of requests later, so in-flight counts stay steady.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokenway_router::{
    prompt_blocks, BackendId, BackendSpec, LoadSignal, Outcome, Policy, RouteRequest, Router,
    RouterConfig,
};

use crate::routing::workload;

/// Prompt bytes per block, as the gateway's default `routing.block_bytes`.
const BLOCK_BYTES: usize = 256;

/// Result of the decision-time measurement.
#[derive(Clone, Debug, Serialize)]
pub struct DecisionResult {
    /// Backends in the router.
    pub backends: usize,
    /// Timed `route` calls.
    pub calls: usize,
    /// Attempts in flight while timing.
    pub inflight: usize,
    /// Mean prompt blocks per request.
    pub mean_blocks: f64,
    /// `route` time p50, microseconds.
    pub p50_us: f64,
    /// `route` time p99, microseconds.
    pub p99_us: f64,
    /// `route` time max, microseconds.
    pub max_us: f64,
    /// `prompt_blocks` (hashing the prompt, done by the gateway before `route`) p50, µs.
    pub hash_p50_us: f64,
    /// `prompt_blocks` p99, microseconds.
    pub hash_p99_us: f64,
}

/// Times `calls` route decisions over `backends` backends under the `cost` policy.
pub fn measure(backends: usize, calls: usize, shape: &workload::WorkloadShape) -> DecisionResult {
    let mut rng = SmallRng::seed_from_u64(shape.seed ^ 0x5eed);
    let mut router = Router::with_config(Policy::CostAware, RouterConfig::default(), shape.seed);
    let ids: Vec<BackendId> = (0..backends)
        .map(|i| {
            router.add_backend(BackendSpec {
                name: format!("10.1.{}.{}:8000", i / 250, i % 250),
                region: if i % 4 == 0 { "far" } else { "local" }.to_owned(),
                models: vec!["sim-model".to_owned()],
                max_inflight: 256,
                prefix_capacity_blocks: None,
            })
        })
        .collect();
    let mut now = Instant::now();
    for (i, &id) in ids.iter().enumerate() {
        for _ in 0..5 {
            let rtt =
                Duration::from_micros(200 + (i as u64 % 8) * 4_000 + rng.random_range(0..500));
            router.on_rtt_sample(id, rtt, now);
        }
        router.on_probe(id, true, now);
    }
    // The requests: a large multi-turn workload's bodies, hashed like the gateway does.
    let gen_shape = workload::WorkloadShape {
        conversations: 400,
        ..shape.clone()
    };
    let w = workload::generate(&gen_shape, 10.0);
    let mut requests = Vec::new();
    let mut hash_times = Vec::new();
    for c in &w.conversations {
        for body in &c.bodies {
            let v: serde_json::Value = serde_json::from_str(body).expect("generated JSON");
            let messages = v["messages"].to_string();
            let t0 = Instant::now();
            let blocks = prompt_blocks(messages.as_bytes(), BLOCK_BYTES);
            hash_times.push(t0.elapsed());
            let tokens = u32::try_from(messages.len() / 4).unwrap_or(u32::MAX);
            requests.push(
                RouteRequest::new("sim-model")
                    .with_blocks(blocks)
                    .with_prompt_tokens(tokens)
                    .with_max_output_tokens(shape.max_tokens)
                    .with_client_region("local"),
            );
        }
    }
    let mean_blocks =
        requests.iter().map(|r| r.blocks.len()).sum::<usize>() as f64 / requests.len() as f64;
    let inflight = backends * 4;
    let mut open = VecDeque::with_capacity(inflight + 1);
    let mut times = Vec::with_capacity(calls);
    let warmup = requests.len().max(2_000);
    for i in 0..warmup + calls {
        let req = &requests[(i * 7919) % requests.len()];
        now += Duration::from_millis(1);
        let t0 = Instant::now();
        let route = router.route(req, now);
        let dt = t0.elapsed();
        if i >= warmup {
            times.push(dt);
        }
        let Ok(route) = route else { continue };
        let Some(&id) = route.backends.first() else {
            continue;
        };
        let mut ticket = router.start_attempt(id, req, now);
        let ttft = route.expected_ttft.mul_f64(rng.random_range(0.8..1.25));
        router.first_token(&mut ticket, ttft, now);
        open.push_back(ticket);
        if open.len() > inflight {
            if let Some(t) = open.pop_front() {
                router.end_attempt(t, Outcome::Success, now);
            }
        }
        if i % 500 == 0 {
            for &id in &ids {
                let running = router.backend(id).map_or(0, |b| b.inflight);
                router.on_load_signal(
                    id,
                    LoadSignal {
                        waiting: 0,
                        running,
                        kv_cache_usage: Some(0.5),
                    },
                    now,
                );
            }
        }
    }
    while let Some(t) = open.pop_front() {
        router.end_attempt(t, Outcome::Success, now);
    }
    let us = |d: &[Duration], p: f64| {
        let mut v: Vec<f64> = d.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        v.sort_by(f64::total_cmp);
        crate::stats::percentile(&v, p).unwrap_or(f64::NAN)
    };
    DecisionResult {
        backends,
        calls: times.len(),
        inflight,
        mean_blocks,
        p50_us: us(&times, 50.0),
        p99_us: us(&times, 99.0),
        max_us: us(&times, 100.0),
        hash_p50_us: us(&hash_times, 50.0),
        hash_p99_us: us(&hash_times, 99.0),
    }
}
