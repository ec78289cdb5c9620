//! Backend health: one state machine fed by active probes and by request outcomes.
//!
//! A backend is either [`HealthState::Healthy`] (it may be ranked) or
//! [`HealthState::Ejected`] (it must not be ranked). Three things eject:
//!
//! - `eject_after_failures` consecutive failed active probes;
//! - a [`Outcome::ConnectError`] on real traffic, at once (nothing listens: the backend is down);
//! - `passive_failures_to_eject` consecutive [`Outcome::ServerError`] / [`Outcome::Timeout`]
//!   outcomes (outlier ejection); a [`Outcome::Success`] resets that count.
//!
//! Re-admission is half-open: `readmit_after_successes` consecutive successful probes *and* at
//! least `min_ejection` since the ejection; a failed probe resets the success count. While
//! ejected, outcomes of requests that were already in flight are ignored. New backends start
//! healthy so a gateway serves at once; the probe loop (~1 s) ejects dead ones within a few
//! seconds. Thresholds of 0 behave like 1.
//!
//! This module must never read a clock or do I/O: probes and outcomes arrive with their `now`.

use std::fmt;
use std::time::{Duration, Instant};

/// Thresholds of the health state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Consecutive failed probes that eject a healthy backend (default 3).
    pub eject_after_failures: u32,
    /// Consecutive successful probes that re-admit an ejected backend (default 2).
    pub readmit_after_successes: u32,
    /// Consecutive 5xx / timeout outcomes that eject a healthy backend (default 3).
    pub passive_failures_to_eject: u32,
    /// Minimum time an ejected backend stays out, even if probes succeed (default 1 s).
    pub min_ejection: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            eject_after_failures: 3,
            readmit_after_successes: 2,
            passive_failures_to_eject: 3,
            min_ejection: Duration::from_secs(1),
        }
    }
}

/// How one attempt on a backend ended, as far as that backend's health is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The backend answered (any status below 500, or a complete stream).
    Success,
    /// The backend answered 5xx.
    ServerError,
    /// The connection could not be established (refused, unreachable, TLS failure).
    ConnectError,
    /// The backend did not answer, or stalled mid-stream, within the deadline.
    Timeout,
    /// The client went away; not the backend's fault, so no health effect.
    ClientCancelled,
}

/// Why a backend was ejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EjectReason {
    /// This many consecutive active probes failed.
    ProbeFailures {
        /// Consecutive failed probes.
        consecutive: u32,
    },
    /// This many consecutive requests ended in 5xx or timeout.
    PassiveFailures {
        /// Consecutive failed outcomes.
        consecutive: u32,
    },
    /// A connection attempt failed.
    ConnectError,
}

impl fmt::Display for EjectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ProbeFailures { consecutive } => {
                write!(f, "{consecutive} consecutive probe failures")
            }
            Self::PassiveFailures { consecutive } => {
                write!(f, "{consecutive} consecutive 5xx/timeout responses")
            }
            Self::ConnectError => f.write_str("connect error"),
        }
    }
}

/// A change of health, returned so the caller can log it and update metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HealthTransition {
    /// The backend went from healthy to ejected.
    Ejected {
        /// What caused it.
        reason: EjectReason,
    },
    /// The backend went from ejected to healthy.
    Readmitted,
}

/// The health of one backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthState {
    /// May be ranked.
    Healthy {
        /// Failed probes in a row.
        consecutive_probe_failures: u32,
        /// 5xx / timeout outcomes in a row.
        consecutive_passive_failures: u32,
    },
    /// Must not be ranked until re-admitted by probes.
    Ejected {
        /// When the ejection happened.
        since: Instant,
        /// Why.
        reason: EjectReason,
        /// Successful probes in a row since the ejection (or the last failed probe).
        consecutive_probe_successes: u32,
    },
}

impl Default for HealthState {
    fn default() -> Self {
        Self::new()
    }
}

impl HealthState {
    /// A fresh backend: healthy, no failures counted.
    pub fn new() -> Self {
        Self::Healthy {
            consecutive_probe_failures: 0,
            consecutive_passive_failures: 0,
        }
    }

    /// Whether the backend may be ranked.
    pub fn is_healthy(&self) -> bool {
        matches!(self, Self::Healthy { .. })
    }

    /// Feed the result of one active probe.
    pub fn on_probe(
        &mut self,
        ok: bool,
        now: Instant,
        cfg: &HealthConfig,
    ) -> Option<HealthTransition> {
        match self {
            Self::Healthy {
                consecutive_probe_failures,
                ..
            } => {
                if ok {
                    *consecutive_probe_failures = 0;
                    return None;
                }
                *consecutive_probe_failures = consecutive_probe_failures.saturating_add(1);
                if *consecutive_probe_failures >= cfg.eject_after_failures.max(1) {
                    let reason = EjectReason::ProbeFailures {
                        consecutive: *consecutive_probe_failures,
                    };
                    return Some(self.eject(reason, now));
                }
                None
            }
            Self::Ejected {
                since,
                consecutive_probe_successes,
                ..
            } => {
                if !ok {
                    *consecutive_probe_successes = 0;
                    return None;
                }
                *consecutive_probe_successes = consecutive_probe_successes.saturating_add(1);
                let enough = *consecutive_probe_successes >= cfg.readmit_after_successes.max(1);
                let served = now.saturating_duration_since(*since) >= cfg.min_ejection;
                if enough && served {
                    *self = Self::new();
                    return Some(HealthTransition::Readmitted);
                }
                None
            }
        }
    }

    /// Feed the outcome of one request attempt (passive health).
    pub fn on_outcome(
        &mut self,
        outcome: Outcome,
        now: Instant,
        cfg: &HealthConfig,
    ) -> Option<HealthTransition> {
        let Self::Healthy {
            consecutive_passive_failures,
            ..
        } = self
        else {
            // Late outcomes of requests started before the ejection say nothing new.
            return None;
        };
        match outcome {
            Outcome::Success => {
                *consecutive_passive_failures = 0;
                None
            }
            Outcome::ClientCancelled => None,
            Outcome::ConnectError => Some(self.eject(EjectReason::ConnectError, now)),
            Outcome::ServerError | Outcome::Timeout => {
                *consecutive_passive_failures = consecutive_passive_failures.saturating_add(1);
                if *consecutive_passive_failures >= cfg.passive_failures_to_eject.max(1) {
                    let reason = EjectReason::PassiveFailures {
                        consecutive: *consecutive_passive_failures,
                    };
                    return Some(self.eject(reason, now));
                }
                None
            }
        }
    }

    fn eject(&mut self, reason: EjectReason, now: Instant) -> HealthTransition {
        *self = Self::Ejected {
            since: now,
            reason,
            consecutive_probe_successes: 0,
        };
        HealthTransition::Ejected { reason }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn ejected_at(t0: Instant, cfg: &HealthConfig) -> HealthState {
        let mut h = HealthState::new();
        assert!(h.on_outcome(Outcome::ConnectError, t0, cfg).is_some());
        h
    }

    #[test]
    fn new_backends_start_healthy() {
        assert!(HealthState::new().is_healthy());
    }

    #[test]
    fn probe_failures_eject_after_three() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = HealthState::new();
        assert_eq!(h.on_probe(false, t0, &cfg), None);
        assert_eq!(h.on_probe(false, t0 + ms(1000), &cfg), None);
        assert!(h.is_healthy());
        assert_eq!(
            h.on_probe(false, t0 + ms(2000), &cfg),
            Some(HealthTransition::Ejected {
                reason: EjectReason::ProbeFailures { consecutive: 3 }
            })
        );
        assert!(!h.is_healthy());
    }

    #[test]
    fn a_successful_probe_resets_the_failure_count() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = HealthState::new();
        h.on_probe(false, t0, &cfg);
        h.on_probe(false, t0, &cfg);
        h.on_probe(true, t0, &cfg);
        h.on_probe(false, t0, &cfg);
        h.on_probe(false, t0, &cfg);
        assert!(h.is_healthy());
    }

    #[test]
    fn connect_error_ejects_at_once() {
        let cfg = HealthConfig::default();
        let mut h = HealthState::new();
        assert_eq!(
            h.on_outcome(Outcome::ConnectError, Instant::now(), &cfg),
            Some(HealthTransition::Ejected {
                reason: EjectReason::ConnectError
            })
        );
        assert!(!h.is_healthy());
    }

    #[test]
    fn three_consecutive_server_errors_or_timeouts_eject() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = HealthState::new();
        assert_eq!(h.on_outcome(Outcome::ServerError, t0, &cfg), None);
        assert_eq!(h.on_outcome(Outcome::Timeout, t0, &cfg), None);
        assert_eq!(
            h.on_outcome(Outcome::ServerError, t0, &cfg),
            Some(HealthTransition::Ejected {
                reason: EjectReason::PassiveFailures { consecutive: 3 }
            })
        );
    }

    #[test]
    fn success_resets_passive_failures_and_cancel_is_neutral() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = HealthState::new();
        h.on_outcome(Outcome::ServerError, t0, &cfg);
        h.on_outcome(Outcome::ServerError, t0, &cfg);
        h.on_outcome(Outcome::Success, t0, &cfg);
        h.on_outcome(Outcome::ServerError, t0, &cfg);
        for _ in 0..10 {
            assert_eq!(h.on_outcome(Outcome::ClientCancelled, t0, &cfg), None);
        }
        assert_eq!(h.on_outcome(Outcome::Timeout, t0, &cfg), None);
        assert!(h.is_healthy());
    }

    #[test]
    fn readmit_needs_two_consecutive_successes() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert_eq!(h.on_probe(true, t0 + ms(2000), &cfg), None);
        // A failure in between resets the count.
        assert_eq!(h.on_probe(false, t0 + ms(3000), &cfg), None);
        assert_eq!(h.on_probe(true, t0 + ms(4000), &cfg), None);
        assert!(!h.is_healthy());
        assert_eq!(
            h.on_probe(true, t0 + ms(5000), &cfg),
            Some(HealthTransition::Readmitted)
        );
        assert_eq!(h, HealthState::new());
    }

    #[test]
    fn readmission_waits_for_min_ejection() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert_eq!(h.on_probe(true, t0 + ms(200), &cfg), None);
        assert_eq!(h.on_probe(true, t0 + ms(400), &cfg), None);
        assert_eq!(h.on_probe(true, t0 + ms(999), &cfg), None);
        assert_eq!(
            h.on_probe(true, t0 + ms(1000), &cfg),
            Some(HealthTransition::Readmitted)
        );
    }

    #[test]
    fn outcomes_while_ejected_do_not_readmit_or_reeject() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert_eq!(h.on_outcome(Outcome::Success, t0 + ms(5000), &cfg), None);
        assert_eq!(
            h.on_outcome(Outcome::ConnectError, t0 + ms(5000), &cfg),
            None
        );
        assert!(!h.is_healthy());
    }
}
