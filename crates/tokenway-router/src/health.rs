//! Backend health: one state machine fed by active probes, request outcomes, stalls and TTFTs.
//!
//! A backend is [`HealthState::Healthy`] (it may be ranked) or [`HealthState::Ejected`] (it
//! must not be ranked, except for one trial request, below). These eject a healthy backend:
//!
//! - `eject_after_failures` consecutive failed active probes;
//! - a [`Outcome::ConnectError`] on real traffic, at once (nothing listens: the backend is down);
//! - `passive_failures_to_eject` consecutive [`Outcome::ServerError`] / [`Outcome::Timeout`]
//!   outcomes (outlier ejection); a [`Outcome::Success`] resets that count;
//! - `stalls_to_eject` consecutive stalls: an open stream that produced no token for the
//!   gateway's stall timeout (a hung engine often still answers `/health`); a success resets it;
//! - `ttft_outliers_to_eject` consecutive TTFT outliers: a first token later than
//!   `ttft_outlier_factor` × the backend's own recent p95 (and × the cost model's prediction for
//!   that request, and above `ttft_outlier_floor`), judged only once `ttft_outlier_min_samples`
//!   TTFTs are known; a TTFT within bounds resets it. This catches a backend that answers,
//!   slowly, long before timeouts would. The router judges outliers only while another
//!   healthy backend serves the same model: a slow answer beats a 503, and when every backend
//!   is slow at once the cause is elsewhere.
//!
//! Re-admission happens two ways, whichever comes first:
//!
//! - probes: `readmit_after_successes` consecutive successful probes *and* at least
//!   `min_ejection` since the ejection; a failed probe resets the success count;
//! - half-open trial: once `min_ejection` has passed (and no probe failed within the last
//!   `min_ejection`), the router lets exactly one live request through as a trial. Its first
//!   token or success re-admits; its failure (5xx, timeout, connect error, stall) re-ejects
//!   with [`EjectReason::TrialFailed`] and restarts the clock; a client cancel before the answer
//!   says nothing and frees the trial slot for the next request.
//!
//! While ejected, outcomes of requests that were already in flight are ignored. New backends
//! start healthy so a gateway serves at once; the probe loop (~1 s) ejects dead ones within a
//! few seconds. Thresholds of 0 behave like 1.
//!
//! This module must never read a clock or do I/O: every event arrives with its `now`.

use std::fmt;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::InvalidSetting;

/// Thresholds of the probe and error parts of the state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Consecutive failed probes that eject a healthy backend (default 3).
    pub eject_after_failures: u32,
    /// Consecutive successful probes that re-admit an ejected backend (default 2).
    pub readmit_after_successes: u32,
    /// Consecutive 5xx / timeout outcomes that eject a healthy backend (default 3).
    pub passive_failures_to_eject: u32,
    /// Minimum time an ejected backend stays out, even if probes succeed (default 1 s); also
    /// the wait before a half-open trial.
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

/// Thresholds of stall detection, TTFT outliers and half-open trials.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutlierConfig {
    /// Consecutive stalls that eject (default 1: a stream silent for the whole stall timeout
    /// is strong evidence of a hung engine).
    pub stalls_to_eject: u32,
    /// A TTFT above this multiple of the backend's recent p95 is an outlier (default 3).
    pub ttft_outlier_factor: f64,
    /// Consecutive TTFT outliers that eject (default 3).
    pub ttft_outliers_to_eject: u32,
    /// TTFT samples needed before outliers are judged (default 20).
    pub ttft_outlier_min_samples: usize,
    /// A TTFT at or below this is never an outlier (default 250 ms).
    pub ttft_outlier_floor: Duration,
    /// Let one live request through as a trial after `min_ejection` (default true).
    pub half_open_trial: bool,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        Self {
            stalls_to_eject: 1,
            ttft_outlier_factor: 3.0,
            ttft_outliers_to_eject: 3,
            ttft_outlier_min_samples: 20,
            ttft_outlier_floor: Duration::from_millis(250),
            half_open_trial: true,
        }
    }
}

impl OutlierConfig {
    /// Check ranges.
    ///
    /// # Errors
    ///
    /// [`InvalidSetting`] naming `outlier.ttft_outlier_factor` when it is not a finite number
    /// > 1.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if !(self.ttft_outlier_factor.is_finite() && self.ttft_outlier_factor > 1.0) {
            return Err(InvalidSetting::new(
                "outlier.ttft_outlier_factor",
                "a number > 1 (3 is typical)",
                self.ttft_outlier_factor,
            ));
        }
        Ok(())
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

impl Outcome {
    /// Whether this outcome says the backend failed (as opposed to succeeded or no verdict).
    pub fn is_failure(self) -> bool {
        matches!(self, Self::ServerError | Self::ConnectError | Self::Timeout)
    }
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
    /// This many consecutive streams stalled (no token for the stall timeout).
    Stalls {
        /// Consecutive stalls.
        consecutive: u32,
    },
    /// This many consecutive first tokens were far later than the backend's recent p95.
    TtftOutliers {
        /// Consecutive outliers.
        consecutive: u32,
    },
    /// The half-open trial request failed.
    TrialFailed,
}

impl EjectReason {
    /// A short machine-readable label for metrics and JSON.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::ProbeFailures { .. } => "probe_failures",
            Self::PassiveFailures { .. } => "passive_failures",
            Self::ConnectError => "connect_error",
            Self::Stalls { .. } => "stalls",
            Self::TtftOutliers { .. } => "ttft_outliers",
            Self::TrialFailed => "trial_failed",
        }
    }

    /// Whether the backend probably lost its state (restart): its prefix cache is forgotten.
    pub(crate) fn suggests_restart(&self) -> bool {
        matches!(self, Self::ProbeFailures { .. } | Self::ConnectError)
    }
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
            Self::Stalls { consecutive } => {
                write!(f, "{consecutive} consecutive stalled streams")
            }
            Self::TtftOutliers { consecutive } => {
                write!(f, "{consecutive} consecutive time-to-first-token outliers")
            }
            Self::TrialFailed => f.write_str("half-open trial request failed"),
        }
    }
}

/// A change of health, returned so the caller can log it and update metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HealthTransition {
    /// The backend went from healthy to ejected, or a half-open trial failed and it was
    /// ejected again.
    Ejected {
        /// What caused it.
        reason: EjectReason,
    },
    /// The backend went from ejected to healthy.
    Readmitted,
}

/// The half-open trial of an ejected backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trial {
    /// No trial running; one may start at `not_before`.
    Waiting {
        /// Earliest start of the trial.
        not_before: Instant,
    },
    /// A ranking put this backend first as its trial; the attempt has not started yet. The
    /// reservation lapses at `until` if no attempt starts (the request failed before that).
    Reserved {
        /// When the reservation lapses.
        until: Instant,
    },
    /// The trial request is in flight.
    InFlight,
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
        /// Stalled streams in a row.
        consecutive_stalls: u32,
        /// TTFT outliers in a row.
        consecutive_ttft_outliers: u32,
    },
    /// Must not be ranked until re-admitted, except for one half-open trial.
    Ejected {
        /// When the ejection happened.
        since: Instant,
        /// Why.
        reason: EjectReason,
        /// Successful probes in a row since the ejection (or the last failed probe).
        consecutive_probe_successes: u32,
        /// The half-open trial.
        trial: Trial,
    },
}

/// The coarse phase of a backend's health at an instant, for status pages and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthPhase {
    /// Ranked normally.
    Healthy,
    /// Out; no trial allowed yet.
    Ejected,
    /// Out, but the next request may go there as its trial.
    HalfOpen,
    /// Out, with its trial request in flight.
    Trial,
}

impl HealthPhase {
    /// The label used in JSON and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Healthy => "healthy",
            Self::Ejected => "ejected",
            Self::HalfOpen => "half_open",
            Self::Trial => "trial",
        }
    }
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
            consecutive_stalls: 0,
            consecutive_ttft_outliers: 0,
        }
    }

    /// Whether the backend may be ranked normally.
    pub fn is_healthy(&self) -> bool {
        matches!(self, Self::Healthy { .. })
    }

    /// The phase at `now` (half-open trials enabled or not per `ocfg`).
    pub fn phase(&self, now: Instant, ocfg: &OutlierConfig) -> HealthPhase {
        match self {
            Self::Healthy { .. } => HealthPhase::Healthy,
            Self::Ejected { .. } if self.trial_available(now, ocfg) => HealthPhase::HalfOpen,
            Self::Ejected {
                trial: Trial::InFlight | Trial::Reserved { .. },
                ..
            } => HealthPhase::Trial,
            Self::Ejected { .. } => HealthPhase::Ejected,
        }
    }

    /// Whether an ejected backend may take a trial request at `now`.
    pub fn trial_available(&self, now: Instant, ocfg: &OutlierConfig) -> bool {
        match self {
            Self::Ejected {
                trial: Trial::Waiting { not_before: t } | Trial::Reserved { until: t },
                ..
            } => ocfg.half_open_trial && now >= *t,
            _ => false,
        }
    }

    /// Reserve the trial for a request being ranked at `now` (it lapses after `min_ejection`
    /// if no attempt starts); returns whether it was reserved.
    pub fn reserve_trial(
        &mut self,
        now: Instant,
        cfg: &HealthConfig,
        ocfg: &OutlierConfig,
    ) -> bool {
        if !self.trial_available(now, ocfg) {
            return false;
        }
        if let Self::Ejected { trial, .. } = self {
            *trial = Trial::Reserved {
                until: now + cfg.min_ejection.max(Duration::from_millis(1)),
            };
        }
        true
    }

    /// Start the trial at `now`: takes a reservation, or an available trial. Returns whether
    /// this attempt is the trial.
    pub fn begin_trial(&mut self, now: Instant, ocfg: &OutlierConfig) -> bool {
        let Self::Ejected { trial, .. } = self else {
            return false;
        };
        let ok = match *trial {
            Trial::Reserved { .. } => ocfg.half_open_trial,
            Trial::Waiting { not_before } => ocfg.half_open_trial && now >= not_before,
            Trial::InFlight => false,
        };
        if ok {
            *trial = Trial::InFlight;
        }
        ok
    }

    /// TTFT outliers in a row (0 when ejected).
    pub fn ttft_outlier_streak(&self) -> u32 {
        match self {
            Self::Healthy {
                consecutive_ttft_outliers,
                ..
            } => *consecutive_ttft_outliers,
            Self::Ejected { .. } => 0,
        }
    }

    /// Whether a trial request is in flight.
    pub fn trial_in_flight(&self) -> bool {
        matches!(
            self,
            Self::Ejected {
                trial: Trial::InFlight,
                ..
            }
        )
    }

    /// The verdict on the trial request: `Some(true)` passed (re-admit), `Some(false)` failed
    /// (eject again), `None` no verdict (the slot frees for another trial). Ignored unless a
    /// trial is in flight.
    pub fn end_trial(
        &mut self,
        verdict: Option<bool>,
        now: Instant,
        cfg: &HealthConfig,
    ) -> Option<HealthTransition> {
        let Self::Ejected {
            trial: trial @ Trial::InFlight,
            ..
        } = self
        else {
            return None;
        };
        match verdict {
            Some(true) => {
                *self = Self::new();
                Some(HealthTransition::Readmitted)
            }
            Some(false) => Some(self.eject(EjectReason::TrialFailed, now, cfg)),
            None => {
                *trial = Trial::Waiting { not_before: now };
                None
            }
        }
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
                    return Some(self.eject(reason, now, cfg));
                }
                None
            }
            Self::Ejected {
                since,
                consecutive_probe_successes,
                trial,
                ..
            } => {
                if !ok {
                    *consecutive_probe_successes = 0;
                    // A failing probe says "still down": no trial for another min_ejection.
                    match trial {
                        Trial::Waiting { not_before } => {
                            *not_before = (*not_before).max(now + cfg.min_ejection);
                        }
                        Trial::Reserved { .. } => {
                            *trial = Trial::Waiting {
                                not_before: now + cfg.min_ejection,
                            };
                        }
                        Trial::InFlight => {}
                    }
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

    /// Feed the outcome of one ordinary (non-trial) request attempt (passive health).
    pub fn on_outcome(
        &mut self,
        outcome: Outcome,
        now: Instant,
        cfg: &HealthConfig,
    ) -> Option<HealthTransition> {
        let Self::Healthy {
            consecutive_passive_failures,
            consecutive_stalls,
            ..
        } = self
        else {
            // Late outcomes of requests started before the ejection say nothing new.
            return None;
        };
        match outcome {
            Outcome::Success => {
                *consecutive_passive_failures = 0;
                *consecutive_stalls = 0;
                None
            }
            Outcome::ClientCancelled => None,
            Outcome::ConnectError => Some(self.eject(EjectReason::ConnectError, now, cfg)),
            Outcome::ServerError | Outcome::Timeout => {
                *consecutive_passive_failures = consecutive_passive_failures.saturating_add(1);
                if *consecutive_passive_failures >= cfg.passive_failures_to_eject.max(1) {
                    let reason = EjectReason::PassiveFailures {
                        consecutive: *consecutive_passive_failures,
                    };
                    return Some(self.eject(reason, now, cfg));
                }
                None
            }
        }
    }

    /// An open stream on this backend produced no token for the stall timeout.
    pub fn on_stall(
        &mut self,
        now: Instant,
        cfg: &HealthConfig,
        ocfg: &OutlierConfig,
    ) -> Option<HealthTransition> {
        let Self::Healthy {
            consecutive_stalls, ..
        } = self
        else {
            return None;
        };
        *consecutive_stalls = consecutive_stalls.saturating_add(1);
        if *consecutive_stalls >= ocfg.stalls_to_eject.max(1) {
            let reason = EjectReason::Stalls {
                consecutive: *consecutive_stalls,
            };
            return Some(self.eject(reason, now, cfg));
        }
        None
    }

    /// A first token arrived; `outlier` says whether it was a TTFT outlier.
    pub fn on_ttft(
        &mut self,
        outlier: bool,
        now: Instant,
        cfg: &HealthConfig,
        ocfg: &OutlierConfig,
    ) -> Option<HealthTransition> {
        let Self::Healthy {
            consecutive_ttft_outliers,
            ..
        } = self
        else {
            return None;
        };
        if !outlier {
            *consecutive_ttft_outliers = 0;
            return None;
        }
        *consecutive_ttft_outliers = consecutive_ttft_outliers.saturating_add(1);
        if *consecutive_ttft_outliers >= ocfg.ttft_outliers_to_eject.max(1) {
            let reason = EjectReason::TtftOutliers {
                consecutive: *consecutive_ttft_outliers,
            };
            return Some(self.eject(reason, now, cfg));
        }
        None
    }

    fn eject(&mut self, reason: EjectReason, now: Instant, cfg: &HealthConfig) -> HealthTransition {
        *self = Self::Ejected {
            since: now,
            reason,
            consecutive_probe_successes: 0,
            trial: Trial::Waiting {
                not_before: now + cfg.min_ejection,
            },
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

    #[test]
    fn a_stall_ejects_at_once_by_default_and_success_resets_the_count() {
        let cfg = HealthConfig::default();
        let two = OutlierConfig {
            stalls_to_eject: 2,
            ..OutlierConfig::default()
        };
        let t0 = Instant::now();
        let mut h = HealthState::new();
        assert_eq!(h.on_stall(t0, &cfg, &two), None);
        h.on_outcome(Outcome::Success, t0, &cfg);
        assert_eq!(h.on_stall(t0, &cfg, &two), None);
        assert_eq!(
            h.on_stall(t0, &cfg, &two),
            Some(HealthTransition::Ejected {
                reason: EjectReason::Stalls { consecutive: 2 }
            })
        );
        let mut h = HealthState::new();
        assert!(h.on_stall(t0, &cfg, &OutlierConfig::default()).is_some());
    }

    #[test]
    fn sustained_ttft_outliers_eject_but_interrupted_ones_do_not() {
        let cfg = HealthConfig::default();
        let ocfg = OutlierConfig::default();
        let t0 = Instant::now();
        let mut h = HealthState::new();
        h.on_ttft(true, t0, &cfg, &ocfg);
        h.on_ttft(true, t0, &cfg, &ocfg);
        h.on_ttft(false, t0, &cfg, &ocfg);
        h.on_ttft(true, t0, &cfg, &ocfg);
        assert_eq!(h.on_ttft(true, t0, &cfg, &ocfg), None);
        assert_eq!(
            h.on_ttft(true, t0, &cfg, &ocfg),
            Some(HealthTransition::Ejected {
                reason: EjectReason::TtftOutliers { consecutive: 3 }
            })
        );
    }

    #[test]
    fn half_open_allows_exactly_one_trial_after_min_ejection() {
        let cfg = HealthConfig::default();
        let ocfg = OutlierConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert_eq!(h.phase(t0 + ms(999), &ocfg), HealthPhase::Ejected);
        assert!(!h.begin_trial(t0 + ms(999), &ocfg));
        assert_eq!(h.phase(t0 + ms(1000), &ocfg), HealthPhase::HalfOpen);
        assert!(h.begin_trial(t0 + ms(1000), &ocfg));
        assert!(!h.begin_trial(t0 + ms(1001), &ocfg));
        assert_eq!(h.phase(t0 + ms(1001), &ocfg), HealthPhase::Trial);
        assert_eq!(
            h.end_trial(Some(true), t0 + ms(1100), &cfg),
            Some(HealthTransition::Readmitted)
        );
        assert!(h.is_healthy());
    }

    #[test]
    fn a_failed_trial_reejects_and_restarts_the_clock() {
        let cfg = HealthConfig::default();
        let ocfg = OutlierConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert!(h.begin_trial(t0 + ms(1000), &ocfg));
        assert_eq!(
            h.end_trial(Some(false), t0 + ms(1500), &cfg),
            Some(HealthTransition::Ejected {
                reason: EjectReason::TrialFailed
            })
        );
        assert!(!h.trial_available(t0 + ms(2499), &ocfg));
        assert!(h.trial_available(t0 + ms(2500), &ocfg));
    }

    #[test]
    fn a_cancelled_trial_frees_the_slot_and_a_failed_probe_delays_it() {
        let cfg = HealthConfig::default();
        let ocfg = OutlierConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert!(h.begin_trial(t0 + ms(1000), &ocfg));
        assert_eq!(h.end_trial(None, t0 + ms(1200), &cfg), None);
        assert!(h.trial_available(t0 + ms(1200), &ocfg));
        h.on_probe(false, t0 + ms(1300), &cfg);
        assert!(!h.trial_available(t0 + ms(2299), &ocfg));
        assert!(h.trial_available(t0 + ms(2300), &ocfg));
        let off = OutlierConfig {
            half_open_trial: false,
            ..ocfg
        };
        assert!(!h.trial_available(t0 + ms(9000), &off));
    }

    #[test]
    fn a_reservation_blocks_other_trials_until_it_lapses() {
        let cfg = HealthConfig::default();
        let ocfg = OutlierConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert!(h.reserve_trial(t0 + ms(1000), &cfg, &ocfg));
        assert!(!h.reserve_trial(t0 + ms(1001), &cfg, &ocfg));
        assert_eq!(h.phase(t0 + ms(1001), &ocfg), HealthPhase::Trial);
        // Never started: after min_ejection the slot is free again.
        assert!(h.reserve_trial(t0 + ms(2000), &cfg, &ocfg));
        assert!(h.begin_trial(t0 + ms(2001), &ocfg));
        assert!(h.trial_in_flight());
        assert!(!h.begin_trial(t0 + ms(2002), &ocfg));
    }

    #[test]
    fn probes_still_readmit_while_half_open() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        h.on_probe(true, t0 + ms(1000), &cfg);
        assert_eq!(
            h.on_probe(true, t0 + ms(2000), &cfg),
            Some(HealthTransition::Readmitted)
        );
        // A trial verdict arriving after that is ignored.
        assert_eq!(h.end_trial(Some(false), t0 + ms(2100), &cfg), None);
        assert!(h.is_healthy());
    }
}
