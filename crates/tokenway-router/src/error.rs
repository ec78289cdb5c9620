//! The router's one error type.
//!
//! Messages name the model or value involved and say what to check, because the gateway turns
//! them into HTTP error bodies and log lines. This module must never hold routing logic.

/// Why a request could not be routed, or a routing setting could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No backend lists the model (yet): check the model name, or wait for `/v1/models`
    /// discovery to finish.
    #[error("no backend serves model `{model}`; check the model name against GET /v1/models")]
    UnknownModel {
        /// The requested model.
        model: String,
    },
    /// Backends serve the model but every one of them is ejected by health checks.
    #[error("every backend serving model `{model}` is ejected by health checks")]
    NoHealthyBackend {
        /// The requested model.
        model: String,
    },
    /// Healthy backends serve the model but all are at their `max_inflight` limit.
    #[error("every healthy backend serving model `{model}` is at its max_inflight limit")]
    Saturated {
        /// The requested model.
        model: String,
    },
    /// A policy name that is not one of the allowed values.
    #[error("unknown routing policy `{given}`; allowed: round_robin, least_inflight, p2c_ewma")]
    UnknownPolicy {
        /// The name that was given.
        given: String,
    },
}
