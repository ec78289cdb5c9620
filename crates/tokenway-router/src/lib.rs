//! Sans-IO request routing for the tokenway gateway.
//!
//! The [`Router`] keeps a view of the inference backends (what models they serve, whether
//! they are healthy, how much work is in flight, how far away they are, how fast they prefill,
//! what prompt prefixes they probably cache) and answers one question: for this request, now,
//! which backends should be tried, best first? The first is used; the rest are the order for
//! retries and hedging. The default policy, `cost`, ranks by expected seconds to first token
//! (see [`cost`] and `docs/routing.md`).
//!
//! The gateway feeds it events (attempt started, first token, stall, attempt ended, probe and
//! RTT results, engine load signals), each with the `Instant` it happened. This crate must
//! never do I/O, read a clock, spawn tasks or depend on tokio, so every policy and the health
//! state machine are tested with simulated time and replay exactly.
//!
//! Modules: [`backend`] (ids, specs, views), [`policy`] (cost, round robin, least in-flight,
//! p2c over peak EWMA), [`cost`] (the cost model and its learned rates), [`prefix`] (prompt
//! block hashes and the per-backend prefix index), [`affinity`] (rendezvous hashing with
//! bounded load), [`health`] (ejection, stalls, TTFT outliers, half-open trials), [`hedge`]
//! (hedging settings and budget), [`request`] (what a request tells the router, and
//! [`Held`] for a request routed again after a hold), [`snapshot`]
//! (status JSON), [`config`] (all settings), [`hash`] (the stable hash), [`ewma`] (peak EWMA),
//! [`error`] (error types). Private: `pending` (prompt blocks in prefill, for holds), `latency`
//! (recent TTFTs).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod affinity;
pub mod backend;
pub mod config;
pub mod cost;
pub mod error;
pub mod ewma;
pub mod hash;
pub mod health;
pub mod hedge;
mod latency;
mod pending;
pub mod policy;
pub mod prefix;
pub mod request;
mod router;
pub mod snapshot;

pub use affinity::AffinityConfig;
pub use backend::{BackendId, BackendSpec, BackendView};
pub use config::{RouterConfig, DEFAULT_PREFIX_CAPACITY_BLOCKS};
pub use cost::{CostConfig, LoadSignal};
pub use error::{InvalidSetting, RouteError};
pub use ewma::PeakEwma;
pub use health::{
    EjectReason, HealthConfig, HealthPhase, HealthState, HealthTransition, Outcome, OutlierConfig,
    Trial,
};
pub use hedge::{HedgeConfig, HedgeWinner};
pub use policy::Policy;
pub use prefix::{prompt_blocks, BlockHash, PrefixIndex, MAX_PROMPT_BLOCKS};
pub use request::{Held, RouteRequest, SessionKey, SessionKind};
pub use router::{
    AttemptTicket, Route, RouteReason, Router, DEFAULT_TTFT_ESTIMATE, HEDGE_EXPECTED_SLACK,
};
pub use snapshot::{BackendSnapshot, RouterSnapshot};
