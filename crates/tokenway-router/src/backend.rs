//! Backends as the router sees them: identity, static description and live state.
//!
//! The router owns one private state record per backend (health, in-flight work, latency and
//! rate estimates, prefix index) and hands out read-only [`BackendView`]s for metrics and
//! [`snapshots`](crate::snapshot) for status pages. This module must never do I/O: what it
//! knows about a backend arrives through the [`Router`](crate::Router) event methods.

use std::fmt;
use std::time::{Duration, Instant};

use crate::affinity::backend_hash;
use crate::cost::{CostConfig, RateModel, TimedSignal};
use crate::ewma::{DecayingCount, PeakEwma};
use crate::health::HealthState;
use crate::latency::RecentTtfts;
use crate::pending::PendingPrefills;
use crate::prefix::PrefixIndex;

/// Index of a backend inside one [`Router`](crate::Router), as returned by
/// [`Router::add_backend`](crate::Router::add_backend).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendId(pub usize);

impl fmt::Display for BackendId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "backend#{}", self.0)
    }
}

/// The static description of a backend, from configuration or discovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendSpec {
    /// Name used in logs and metrics, and the backend's identity for session placement: it
    /// must be the same on every gateway replica (use its configured address).
    pub name: String,
    /// Region label, for metrics, the cross-region penalty and in-region session placement.
    pub region: String,
    /// Models it serves. Empty means "not known yet": the backend serves nothing until
    /// [`Router::set_models`](crate::Router::set_models) fills it in.
    pub models: Vec<String>,
    /// Most concurrent attempts the router will send to it; 0 means no limit.
    pub max_inflight: u32,
    /// Blocks its prefix index holds (sized like this engine's KV cache); `None` takes
    /// [`RouterConfig::prefix_capacity_blocks`](crate::RouterConfig::prefix_capacity_blocks).
    pub prefix_capacity_blocks: Option<usize>,
}

/// Most attempts whose expected end one backend tracks.
pub(crate) const MAX_TRACKED_ENDS: usize = 4096;

/// Smoothing of the RTT EWMA: weight of a new sample.
const RTT_ALPHA: f64 = 0.3;

/// Live state of one backend, owned by the router.
#[derive(Debug, Clone)]
pub(crate) struct BackendState {
    pub(crate) spec: BackendSpec,
    pub(crate) name_hash: u64,
    pub(crate) removed: bool,
    pub(crate) health: HealthState,
    pub(crate) inflight: u32,
    /// Slots held for attempts about to start ([`crate::Router::reserve`]): counted against
    /// `max_inflight` with `inflight`, nowhere else.
    pub(crate) reserved: u32,
    /// Of those, attempts started with their size (ticket API); the others are priced at
    /// `avg_attempt_work` each.
    pub(crate) sized_inflight: u32,
    /// Token work of the attempts in flight (see [`crate::cost`]).
    pub(crate) work_tokens: u64,
    /// EWMA of the token work of one attempt, to price requests other gateways sent.
    pub(crate) avg_attempt_work: f64,
    pub(crate) ttft: PeakEwma,
    /// Attempts started recently (decaying over `cost.share_window`): the backend's share of
    /// the traffic, which the `cost` policy balances when it places a new conversation.
    pub(crate) starts: DecayingCount,
    pub(crate) recent: RecentTtfts,
    /// The p95 that TTFT outliers are judged against during a streak.
    pub(crate) outlier_baseline: Option<Duration>,
    pub(crate) rates: RateModel,
    /// RTT EWMA in seconds and the time of the last sample.
    pub(crate) rtt: Option<(f64, Instant)>,
    pub(crate) load: Option<TimedSignal>,
    /// Requests the engine runs at once (its batch limit, the knee of its TTFT curve): the
    /// most it reported running while others waited in its queue. `None` until a load signal
    /// showed a queue.
    pub(crate) batch_slots: Option<u32>,
    /// Expected end of each sized attempt in flight, by ticket serial (at most
    /// [`MAX_TRACKED_ENDS`]): when the batch is full, a new request starts when the earliest
    /// of them ends.
    pub(crate) ends: Vec<(u64, Instant)>,
    /// EWMA of seconds per output token from first token to end (`None` before a sample).
    pub(crate) decode_secs_per_token: Option<f64>,
    pub(crate) prefix: PrefixIndex,
    /// Blocks of the prefix index still being prefilled by attempts in flight.
    pub(crate) pending: PendingPrefills,
    pub(crate) cache_lookup_blocks: u64,
    pub(crate) cache_hit_blocks: u64,
    pub(crate) hedges_won: u64,
    pub(crate) hedges_lost: u64,
}

impl BackendState {
    pub(crate) fn new(mut spec: BackendSpec, cost: &CostConfig, prefix_capacity: usize) -> Self {
        normalize(&mut spec.models);
        Self {
            name_hash: backend_hash(&spec.name),
            spec,
            removed: false,
            health: HealthState::new(),
            inflight: 0,
            reserved: 0,
            sized_inflight: 0,
            work_tokens: 0,
            avg_attempt_work: f64::from(cost.default_output_tokens) + 512.0,
            ttft: PeakEwma::default(),
            starts: DecayingCount::default(),
            recent: RecentTtfts::default(),
            outlier_baseline: None,
            rates: RateModel::new(cost),
            rtt: None,
            load: None,
            batch_slots: None,
            ends: Vec::new(),
            decode_secs_per_token: None,
            prefix: PrefixIndex::new(prefix_capacity),
            pending: PendingPrefills::default(),
            cache_lookup_blocks: 0,
            cache_hit_blocks: 0,
            hedges_won: 0,
            hedges_lost: 0,
        }
    }

    pub(crate) fn serves(&self, model: &str) -> bool {
        !self.removed
            && self
                .spec
                .models
                .binary_search_by(|m| m.as_str().cmp(model))
                .is_ok()
    }

    pub(crate) fn has_headroom(&self) -> bool {
        self.spec.max_inflight == 0 || self.occupied() < self.spec.max_inflight
    }

    /// Whether a retry or a hedge may go here: not removed, not ejected, with headroom.
    pub(crate) fn takes_more(&self) -> bool {
        !self.removed && self.health.is_healthy() && self.has_headroom()
    }

    /// Attempts in flight and slots reserved for attempts about to start (routed, their
    /// request being written): what every load measure counts, so that a burst routed while
    /// connections open does not all see the same idle backend.
    pub(crate) fn occupied(&self) -> u32 {
        self.inflight.saturating_add(self.reserved)
    }

    pub(crate) fn observe_rtt(&mut self, rtt: Duration, now: Instant) {
        let s = rtt.as_secs_f64();
        let v = match self.rtt {
            None => s,
            Some((v, _)) => v + RTT_ALPHA * (s - v),
        };
        self.rtt = Some((v, now));
    }

    pub(crate) fn rtt_secs(&self) -> f64 {
        self.rtt.map_or(0.0, |(v, _)| v)
    }

    /// In-flight token work: the known work of sized attempts, the average work for each
    /// attempt of unknown size, and, when a fresh load signal shows more requests than this
    /// router has in flight, the average work of each extra one.
    pub(crate) fn effective_work(&self, now: Instant, cfg: &CostConfig) -> f64 {
        // A reserved attempt's size is not known yet: it is priced as an average one.
        let unsized_attempts = self.occupied().saturating_sub(self.sized_inflight);
        let mut w = self.work_tokens as f64 + f64::from(unsized_attempts) * self.avg_attempt_work;
        if let Some(l) = self.load.as_ref().filter(|l| l.fresh(now, cfg).is_some()) {
            w += f64::from(l.others()) * self.avg_attempt_work;
        }
        w
    }

    pub(crate) fn view(&self, id: BackendId) -> BackendView<'_> {
        BackendView {
            id,
            name: &self.spec.name,
            region: &self.spec.region,
            models: &self.spec.models,
            healthy: self.health.is_healthy(),
            health: self.health,
            inflight: self.inflight,
            max_inflight: self.spec.max_inflight,
            ewma_ttft: self.ttft.get(),
            rtt: self.rtt.map(|(v, _)| Duration::from_secs_f64(v)),
            work_tokens: self.work_tokens,
        }
    }
}

/// Sort and deduplicate a model list so lookups can binary-search it.
pub(crate) fn normalize(models: &mut Vec<String>) {
    models.sort_unstable();
    models.dedup();
}

/// A read-only snapshot of one backend, for metrics and status.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BackendView<'a> {
    /// Its id.
    pub id: BackendId,
    /// Its name from the spec.
    pub name: &'a str,
    /// Its region from the spec.
    pub region: &'a str,
    /// Models it serves, sorted and deduplicated.
    pub models: &'a [String],
    /// Not ejected by health checks.
    pub healthy: bool,
    /// The full health state (counters, ejection time and reason, trial).
    pub health: HealthState,
    /// Attempts started and not yet ended.
    pub inflight: u32,
    /// Its concurrency limit; 0 means no limit.
    pub max_inflight: u32,
    /// Peak-EWMA time to first token, `None` before the first sample.
    pub ewma_ttft: Option<Duration>,
    /// EWMA of the active RTT probes, `None` before the first sample.
    pub rtt: Option<Duration>,
    /// Token work of the attempts in flight.
    pub work_tokens: u64,
}
