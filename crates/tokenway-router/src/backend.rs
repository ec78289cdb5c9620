//! Backends as the router sees them: identity, static description and live state.
//!
//! The router owns one private state record per backend (health, in-flight count,
//! latency estimate) and hands out read-only [`BackendView`]s for metrics and status pages.
//! This module must never do I/O: what it knows about a backend arrives through the
//! [`Router`](crate::Router) event methods.

use std::fmt;
use std::time::Duration;

use crate::ewma::PeakEwma;
use crate::health::HealthState;

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
    /// Human-readable name used in logs and metrics (for example its address).
    pub name: String,
    /// Region label, for metrics and, later, cross-region penalties.
    pub region: String,
    /// Models it serves. Empty means "not known yet": the backend serves nothing until
    /// [`Router::set_models`](crate::Router::set_models) fills it in.
    pub models: Vec<String>,
    /// Most concurrent attempts the router will send to it; 0 means no limit.
    pub max_inflight: u32,
}

/// Live state of one backend, owned by the router.
#[derive(Debug, Clone)]
pub(crate) struct BackendState {
    pub(crate) spec: BackendSpec,
    pub(crate) health: HealthState,
    pub(crate) inflight: u32,
    pub(crate) ttft: PeakEwma,
}

impl BackendState {
    pub(crate) fn new(mut spec: BackendSpec) -> Self {
        normalize(&mut spec.models);
        Self {
            spec,
            health: HealthState::new(),
            inflight: 0,
            ttft: PeakEwma::default(),
        }
    }

    pub(crate) fn serves(&self, model: &str) -> bool {
        self.spec
            .models
            .binary_search_by(|m| m.as_str().cmp(model))
            .is_ok()
    }

    pub(crate) fn has_headroom(&self) -> bool {
        self.spec.max_inflight == 0 || self.inflight < self.spec.max_inflight
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
    /// The full health state (counters, ejection time and reason).
    pub health: HealthState,
    /// Attempts started and not yet ended.
    pub inflight: u32,
    /// Its concurrency limit; 0 means no limit.
    pub max_inflight: u32,
    /// Peak-EWMA time to first token, `None` before the first sample.
    pub ewma_ttft: Option<Duration>,
}
