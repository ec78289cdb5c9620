//! Load-balancing policies: which eligible backend goes first, and the order of the rest.
//!
//! - `cost` (default): lowest expected seconds to first token first (the model of
//!   [`crate::cost`]), ties broken by rotation; the router then moves a session's rendezvous
//!   backend to the front. The others are baselines for comparison:
//! - `round_robin`: a cursor over backend ids; each decision takes the next eligible backend
//!   after the previous pick, so picks rotate fairly even when model sets differ.
//! - `least_inflight`: fewest in-flight attempts first, ties broken by that same rotation.
//! - `p2c_ewma`: power of two choices (Mitzenmacher 2001) over the Finagle / linkerd cost
//!   `peak_ewma_ttft × (inflight + 1)`: two distinct backends drawn at random, the cheaper goes
//!   first, the rest follow by cost. Random choice between two avoids the herding of
//!   "always the cheapest" when many gateways act on the same stale signal.
//!
//! This module only orders candidates it is given; it must never filter for health or
//! headroom (the router does) and never read a clock or a global random source (the rng is
//! seeded by the caller, so decisions replay exactly in tests).

use std::fmt;
use std::str::FromStr;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::backend::BackendId;
use crate::error::RouteError;

/// A load-balancing policy. Parsed from `cost`, `round_robin`, `least_inflight` or `p2c_ewma`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Lowest expected time to first token (RTT, queue, uncached prefill, region), with
    /// session affinity.
    #[default]
    #[serde(rename = "cost")]
    CostAware,
    /// Rotate over eligible backends.
    RoundRobin,
    /// Fewest in-flight attempts first.
    LeastInflight,
    /// Power of two choices over peak-EWMA TTFT × (in-flight + 1).
    P2cEwma,
}

impl Policy {
    /// Every policy, in documentation order.
    pub const ALL: [Policy; 4] = [
        Policy::CostAware,
        Policy::RoundRobin,
        Policy::LeastInflight,
        Policy::P2cEwma,
    ];

    /// The configuration name.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::CostAware => "cost",
            Policy::RoundRobin => "round_robin",
            Policy::LeastInflight => "least_inflight",
            Policy::P2cEwma => "p2c_ewma",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Policy {
    type Err = RouteError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Policy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| RouteError::UnknownPolicy {
                given: s.to_owned(),
            })
    }
}

/// One eligible backend with what the policies need to know about it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Candidate {
    pub(crate) id: BackendId,
    /// Attempts in flight plus slots reserved for attempts about to start.
    pub(crate) inflight: u32,
    /// The policy's cost: expected seconds to first token for `cost`, peak-EWMA TTFT ×
    /// (in-flight + 1) for `p2c_ewma`, unused otherwise.
    pub(crate) cost: f64,
    /// Leading prompt blocks its prefix index holds (`cost` only; 0 otherwise).
    pub(crate) cached_blocks: usize,
    /// Recent attempts started (the `cost` policy's share; 0 under the baselines).
    pub(crate) share: f64,
    /// Of `cached_blocks`, the leading ones not still being prefilled by an attempt in flight.
    pub(crate) done_blocks: usize,
    /// When the pending part of `cached_blocks` is expected done (`None`: nothing pending).
    pub(crate) ready_at: Option<std::time::Instant>,
    /// The `cost` policy's expected time to first token, seconds (without the region penalty
    /// that `cost` includes); `None` under the other policies.
    pub(crate) ttft: Option<f64>,
}

/// The mutable part of a policy decision: the rotation cursor and the seeded rng.
#[derive(Debug, Clone)]
pub(crate) struct Selector {
    cursor: usize,
    rng: SmallRng,
}

impl Selector {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            cursor: 0,
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    /// Reorder `cands` best first. `n_backends` is the size of the id space (for rotation).
    pub(crate) fn order(&mut self, policy: Policy, cands: &mut [Candidate], n_backends: usize) {
        if cands.is_empty() {
            return;
        }
        let n = n_backends.max(1);
        let cursor = self.cursor % n;
        // Distance of an id after the cursor, wrapping: the rotation order.
        let rot = |c: &Candidate| (c.id.0 % n + n - cursor) % n;
        match policy {
            Policy::CostAware => {
                cands.sort_by(|a, b| a.cost.total_cmp(&b.cost).then(rot(a).cmp(&rot(b))));
            }
            Policy::RoundRobin => cands.sort_by_key(rot),
            Policy::LeastInflight => cands.sort_by_key(|c| (c.inflight, rot(c))),
            Policy::P2cEwma => {
                cands.sort_by(|a, b| a.cost.total_cmp(&b.cost).then(a.id.cmp(&b.id)));
                if cands.len() >= 2 {
                    let i = self.rng.random_range(0..cands.len());
                    let mut j = self.rng.random_range(0..cands.len() - 1);
                    if j >= i {
                        j += 1;
                    }
                    // Sorted by cost, so the lower index of the two is the cheaper one.
                    let pick = i.min(j);
                    cands[..=pick].rotate_right(1);
                }
            }
        }
        self.cursor = cands[0].id.0.wrapping_add(1);
    }
}
