//! Sans-IO request routing for the tokenway gateway.
//!
//! The [`Router`] keeps a view of the inference backends (what models they serve, whether
//! they are healthy, how many attempts are in flight, how fast their first tokens come) and
//! answers one question: for this model, now, which backends should be tried, best first?
//! The first is used; the rest are the order for retries and hedging.
//!
//! The gateway feeds it events (attempt started, first byte, attempt ended, probe result),
//! each with the `Instant` it happened. This crate must never do I/O, read a clock, spawn tasks
//! or depend on tokio, so every policy and the health state machine are tested with simulated
//! time and replay exactly.
//!
//! Modules: [`backend`] (ids, specs, snapshots), [`policy`] (round robin, least in-flight,
//! p2c over peak EWMA), [`health`] (ejection and re-admission), [`ewma`] (peak EWMA),
//! [`error`] (the crate's error type).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod backend;
pub mod error;
pub mod ewma;
pub mod health;
pub mod policy;
mod router;

pub use backend::{BackendId, BackendSpec, BackendView};
pub use error::RouteError;
pub use ewma::PeakEwma;
pub use health::{EjectReason, HealthConfig, HealthState, HealthTransition, Outcome};
pub use policy::Policy;
pub use router::{Router, DEFAULT_TTFT_ESTIMATE};
