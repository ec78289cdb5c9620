//! The router's one error type.
//!
//! Messages name the model or value involved and say what to check, because the gateway turns
//! them into HTTP error bodies and log lines. This module must never hold routing logic.
//!
//! [`InvalidSetting`] is separate from [`RouteError`] so that adding it did not change the set
//! of routing errors the gateway matches on; it is a configuration error, raised at startup.

use std::fmt;

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
    #[error(
        "unknown routing policy `{given}`; allowed: cost, round_robin, least_inflight, p2c_ewma"
    )]
    UnknownPolicy {
        /// The name that was given.
        given: String,
    },
}

/// A router setting outside its allowed range, found by a `validate()`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("routing setting `{key}` must be {allowed} (got {got})")]
pub struct InvalidSetting {
    /// The setting's key, as written in the configuration (for example `affinity.epsilon`).
    pub key: &'static str,
    /// What is allowed, in words.
    pub allowed: &'static str,
    /// The value given.
    pub got: String,
}

impl InvalidSetting {
    pub(crate) fn new(key: &'static str, allowed: &'static str, got: impl fmt::Display) -> Self {
        Self {
            key,
            allowed,
            got: got.to_string(),
        }
    }
}
