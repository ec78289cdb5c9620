//! Serializable snapshots of the router for the status page and the admin JSON endpoint.
//!
//! Plain owned data with units in the field names (milliseconds, tokens per second), so the
//! gateway can serve `serde_json::to_string(&router.snapshot(now))` without knowing router
//! internals. Building one allocates; it is for humans and scrapers, not the request path.

use std::time::Instant;

use serde::Serialize;

use crate::backend::{BackendId, BackendState};
use crate::config::RouterConfig;
use crate::cost::LoadSignal;
use crate::health::{HealthPhase, HealthState};

/// The whole router at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RouterSnapshot {
    /// The policy's configuration name.
    pub policy: &'static str,
    /// Whether hedging is on.
    pub hedging: bool,
    /// Hedges sent since start.
    pub hedges_sent: u64,
    /// Hedge tokens left in the budget.
    pub hedge_budget: f64,
    /// Every backend not removed, in id order.
    pub backends: Vec<BackendSnapshot>,
}

/// One backend at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BackendSnapshot {
    /// Its id.
    pub id: usize,
    /// Its name.
    pub name: String,
    /// Its region.
    pub region: String,
    /// Models it serves.
    pub models: Vec<String>,
    /// Health phase: `healthy`, `ejected`, `half_open` or `trial`.
    pub state: HealthPhase,
    /// Why it is out (`probe_failures`, `passive_failures`, `connect_error`, `stalls`,
    /// `ttft_outliers`, `trial_failed`), if it is.
    pub eject_reason: Option<&'static str>,
    /// How long it has been out, milliseconds.
    pub ejected_for_ms: Option<f64>,
    /// RTT EWMA from active probes, milliseconds.
    pub rtt_ms: Option<f64>,
    /// Attempts in flight.
    pub inflight: u32,
    /// Its concurrency limit (0: none).
    pub max_inflight: u32,
    /// Token work of the attempts in flight.
    pub inflight_work_tokens: u64,
    /// The engine's own load report, if fresh.
    pub load: Option<LoadSignal>,
    /// Peak-EWMA TTFT, milliseconds.
    pub ewma_ttft_ms: Option<f64>,
    /// p95 of the last 64 TTFTs, milliseconds.
    pub p95_ttft_ms: Option<f64>,
    /// TTFT samples in the recent window.
    pub ttft_samples: usize,
    /// Learned fixed part of TTFT, milliseconds.
    pub overhead_ms: f64,
    /// Learned prefill rate, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Learned throughput for in-flight work, tokens per second.
    pub throughput_tokens_per_s: f64,
    /// First tokens the rates were learned from.
    pub rate_samples: u64,
    /// Prompt blocks found cached / blocks looked up, over all attempts (the cache-hit
    /// estimate); `None` before any lookup.
    pub cache_hit_ratio: Option<f64>,
    /// Blocks looked up.
    pub cache_lookup_blocks: u64,
    /// Blocks held in its prefix index.
    pub prefix_index_blocks: usize,
    /// Of those, blocks attempts in flight are still prefilling (see `cost-prefill-hold`).
    pub pending_prefill_blocks: usize,
    /// Requests the engine runs at once: `routing.batch_slots`, or learned from its load
    /// reports; `None` while unknown.
    pub batch_slots: Option<u32>,
    /// Learned decode time per output token, milliseconds; `None` before an attempt ended.
    pub decode_ms_per_token: Option<f64>,
    /// Hedged races it won.
    pub hedges_won: u64,
    /// Hedged races it lost.
    pub hedges_lost: u64,
}

fn ms(secs: f64) -> f64 {
    secs * 1000.0
}

impl BackendSnapshot {
    pub(crate) fn of(id: BackendId, b: &BackendState, now: Instant, cfg: &RouterConfig) -> Self {
        let (eject_reason, ejected_for_ms) = match b.health {
            HealthState::Ejected { since, reason, .. } => (
                Some(reason.as_str()),
                Some(ms(now.saturating_duration_since(since).as_secs_f64())),
            ),
            HealthState::Healthy { .. } => (None, None),
        };
        Self {
            id: id.0,
            name: b.spec.name.clone(),
            region: b.spec.region.clone(),
            models: b.spec.models.clone(),
            state: b.health.phase(now, &cfg.outlier),
            eject_reason,
            ejected_for_ms,
            rtt_ms: b.rtt.map(|(v, _)| ms(v)),
            inflight: b.inflight,
            max_inflight: b.spec.max_inflight,
            inflight_work_tokens: b.work_tokens,
            load: b
                .load
                .as_ref()
                .and_then(|l| l.fresh(now, &cfg.cost))
                .copied(),
            ewma_ttft_ms: b.ttft.get().map(|d| ms(d.as_secs_f64())),
            p95_ttft_ms: b.recent.p95(1).map(|d| ms(d.as_secs_f64())),
            ttft_samples: b.recent.len(),
            overhead_ms: ms(b.rates.overhead()),
            prefill_tokens_per_s: b.rates.prefill_rate(),
            throughput_tokens_per_s: b.rates.throughput(),
            rate_samples: b.rates.samples(),
            cache_hit_ratio: (b.cache_lookup_blocks > 0)
                .then(|| b.cache_hit_blocks as f64 / b.cache_lookup_blocks as f64),
            cache_lookup_blocks: b.cache_lookup_blocks,
            prefix_index_blocks: b.prefix.len(),
            pending_prefill_blocks: b.pending.len(),
            batch_slots: cfg.cost.batch_slots.or(b.batch_slots),
            decode_ms_per_token: b.decode_secs_per_token.map(ms),
            hedges_won: b.hedges_won,
            hedges_lost: b.hedges_lost,
        }
    }
}
