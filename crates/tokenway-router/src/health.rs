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
//! - probes, for a backend ejected by probes or a refused connection (what a probe can see
//!   again): `readmit_after_successes` consecutive successful probes *and* the ejection's hold
//!   served; a failed probe resets the success count. A backend ejected by its live traffic
//!   (5xx, timeouts, stalls, slow first tokens, a failed trial) is re-admitted only by live
//!   traffic, its trial: a hung engine that still answers `/health` was re-admitted by two
//!   probes every 2 s and took a share of the traffic into its 60 s first-byte timeout, over
//!   and over. (With trials off, probes re-admit whatever the reason.)
//! - half-open trial: once the hold has passed (and no probe failed within the last
//!   `min_ejection`), the router lets exactly one live request through as a trial. Its first
//!   token or success re-admits (its whole answer, for a backend ejected for stalls); its
//!   failure (5xx, timeout, connect error, stall) re-ejects with [`EjectReason::TrialFailed`]
//!   and restarts the clock; a client cancel before the answer says nothing and frees the
//!   trial slot for the next request.
//!
//! The hold of an ejection doubles with each ejection that follows another within
//! [`STRIKES_FORGIVEN_AFTER`] of healthy service: `min_ejection`, twice that, four times, up
//! to [`MAX_HOLD`] (or `min_ejection` if larger), so a backend that keeps failing its trials
//! costs ever fewer requests.
//!
//! Passive ejections (5xx and timeouts, stalls, TTFT outliers) take a `may_eject` from the
//! router, which says no when the backend is the last healthy one of a model it serves or when
//! half the backends are out already: a fleet-wide slowdown (queues longer than the first-byte
//! timeout everywhere) otherwise ejected backends one after another, each pushing its load onto
//! the rest, until every request got a 503. The failures still count, and eject once the
//! guard allows it.
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

/// The longest hold of an ejection reached by doubling (unless `min_ejection` is longer).
pub const MAX_HOLD: Duration = Duration::from_secs(60);
/// Healthy service after a re-admission that forgets earlier ejections (the next hold is
/// `min_ejection` again).
pub const STRIKES_FORGIVEN_AFTER: Duration = Duration::from_secs(300);

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
    /// The backend answered (2xx, or a complete stream).
    Success,
    /// The backend answered with a client error (a 4xx, a 429 included, or an error event it
    /// says the request caused): it is up, but that says nothing of how it serves. No verdict:
    /// it neither resets the failures counted nor passes a trial (one request that provoked a
    /// quick 400 from a hung engine's front end re-admitted it).
    Rejected,
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

    /// Whether probes see what caused it (unreachable, or `/health` failing), so that
    /// probes succeeding again may re-admit.
    pub fn probes_can_clear(&self) -> bool {
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
        /// Ejections not yet forgiven (see the module docs).
        strikes: u32,
        /// When it was last re-admitted, if ever.
        readmitted: Option<Instant>,
    },
    /// Must not be ranked until re-admitted, except for one half-open trial.
    Ejected {
        /// When the ejection happened.
        since: Instant,
        /// Why.
        reason: EjectReason,
        /// The least time it stays out (doubled per strike).
        hold: Duration,
        /// Ejections not yet forgiven, this one included.
        strikes: u32,
        /// Successful probes in a row since the ejection (or the last failed probe).
        consecutive_probe_successes: u32,
        /// Whether probes succeeding again may re-admit: the reason is one they see
        /// ([`EjectReason::probes_can_clear`]), or a trial failed to connect after one.
        probes_clear: bool,
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
            strikes: 0,
            readmitted: None,
        }
    }

    /// Healthy again at `now`, remembering the strikes of the ejection that ends.
    fn readmit(&mut self, now: Instant) -> HealthTransition {
        let strikes = match self {
            Self::Ejected { strikes, .. } => *strikes,
            Self::Healthy { strikes, .. } => *strikes,
        };
        *self = Self::Healthy {
            consecutive_probe_failures: 0,
            consecutive_passive_failures: 0,
            consecutive_stalls: 0,
            consecutive_ttft_outliers: 0,
            strikes,
            readmitted: Some(now),
        };
        HealthTransition::Readmitted
    }

    /// Whether it was ejected for slow first tokens: its trial's must not be one.
    pub fn ejected_for_slow_first_tokens(&self) -> bool {
        matches!(
            self,
            Self::Ejected {
                reason: EjectReason::TtftOutliers { .. },
                ..
            }
        )
    }

    /// Whether a trial passes only with its whole answer (the backend was ejected for
    /// stalls: a first token says nothing of the next ones).
    pub fn trial_needs_whole_answer(&self) -> bool {
        matches!(
            self,
            Self::Ejected {
                reason: EjectReason::Stalls { .. },
                ..
            }
        )
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
                until: later(now, cfg.min_ejection.max(Duration::from_millis(1))),
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

    /// The trial request could not connect: it fails as [`Self::end_trial`] with `Some(false)`
    /// does, but a backend ejected for what probes see (unreachable, `/health` failing) stays
    /// one probes may re-admit. An engine still loading refuses its trial's connection, and
    /// once it is up two good probes bring it back, where it waited for the next trial, up to
    /// the doubled hold.
    pub fn end_trial_unreachable(
        &mut self,
        now: Instant,
        cfg: &HealthConfig,
    ) -> Option<HealthTransition> {
        let was_clear = matches!(
            self,
            Self::Ejected {
                probes_clear: true,
                trial: Trial::InFlight,
                ..
            }
        );
        let t = self.end_trial(Some(false), now, cfg);
        if let Self::Ejected { probes_clear, .. } = self {
            *probes_clear |= was_clear;
        }
        t
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
            Some(true) => Some(self.readmit(now)),
            Some(false) => Some(self.eject(EjectReason::TrialFailed, now, cfg)),
            // No verdict (the client left, or the answer was a client error): the next trial
            // waits `min_ejection`, as after a failed probe. At once, a hung engine whose
            // clients give up before its timeout took every next request as its trial.
            None => {
                *trial = Trial::Waiting {
                    not_before: later(now, cfg.min_ejection),
                };
                None
            }
        }
    }

    /// Feed an active probe that got no answer in time: a failed probe, except that while
    /// healthy it ejects only as passive failures do (`may_eject`, the router's guard). An
    /// overloaded engine answers `/health` late (its event loop is busy), and under a
    /// fleet-wide load every probe timed out together: every backend was ejected, every
    /// request got a 503, the load fell, the backends came back, and again. A refused probe
    /// still ejects regardless (nothing listens).
    pub fn on_probe_timeout(
        &mut self,
        now: Instant,
        cfg: &HealthConfig,
        trials: bool,
        may_eject: bool,
    ) -> Option<HealthTransition> {
        match self {
            Self::Healthy {
                consecutive_probe_failures,
                ..
            } if !may_eject => {
                // Counted: it ejects once the guard allows.
                *consecutive_probe_failures = consecutive_probe_failures.saturating_add(1);
                None
            }
            _ => self.on_probe(false, now, cfg, trials),
        }
    }

    /// Feed the result of one active probe; `trials` says whether half-open trials are on
    /// (without them, probes re-admit whatever the ejection's reason).
    pub fn on_probe(
        &mut self,
        ok: bool,
        now: Instant,
        cfg: &HealthConfig,
        trials: bool,
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
                hold,
                consecutive_probe_successes,
                probes_clear,
                trial,
                ..
            } => {
                if !ok {
                    *consecutive_probe_successes = 0;
                    // A failing probe says "still down": no trial for another min_ejection.
                    match trial {
                        Trial::Waiting { not_before } => {
                            *not_before = (*not_before).max(later(now, cfg.min_ejection));
                        }
                        Trial::Reserved { .. } => {
                            *trial = Trial::Waiting {
                                not_before: later(now, cfg.min_ejection),
                            };
                        }
                        Trial::InFlight => {}
                    }
                    return None;
                }
                *consecutive_probe_successes = consecutive_probe_successes.saturating_add(1);
                let enough = *consecutive_probe_successes >= cfg.readmit_after_successes.max(1);
                let served = now.saturating_duration_since(*since) >= *hold;
                if enough && served && (*probes_clear || !trials) {
                    return Some(self.readmit(now));
                }
                None
            }
        }
    }

    /// Feed the outcome of one ordinary (non-trial) request attempt (passive health);
    /// `may_eject` is the router's guard on passive ejections (see the module docs; a refused
    /// connection ejects regardless: nothing listens).
    pub fn on_outcome(
        &mut self,
        outcome: Outcome,
        now: Instant,
        cfg: &HealthConfig,
        may_eject: bool,
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
            Outcome::ClientCancelled | Outcome::Rejected => None,
            Outcome::ConnectError => Some(self.eject(EjectReason::ConnectError, now, cfg)),
            Outcome::ServerError | Outcome::Timeout => {
                *consecutive_passive_failures = consecutive_passive_failures.saturating_add(1);
                if may_eject
                    && *consecutive_passive_failures >= cfg.passive_failures_to_eject.max(1)
                {
                    let reason = EjectReason::PassiveFailures {
                        consecutive: *consecutive_passive_failures,
                    };
                    return Some(self.eject(reason, now, cfg));
                }
                None
            }
        }
    }

    /// An open stream on this backend produced no token for the stall timeout (`may_eject`:
    /// the router's guard).
    pub fn on_stall(
        &mut self,
        now: Instant,
        cfg: &HealthConfig,
        ocfg: &OutlierConfig,
        may_eject: bool,
    ) -> Option<HealthTransition> {
        let Self::Healthy {
            consecutive_stalls, ..
        } = self
        else {
            return None;
        };
        *consecutive_stalls = consecutive_stalls.saturating_add(1);
        if may_eject && *consecutive_stalls >= ocfg.stalls_to_eject.max(1) {
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
        let earlier = match *self {
            Self::Ejected { strikes, .. } => strikes,
            Self::Healthy {
                strikes,
                readmitted,
                ..
            } => {
                let forgiven = readmitted
                    .is_some_and(|t| now.saturating_duration_since(t) >= STRIKES_FORGIVEN_AFTER);
                if forgiven {
                    0
                } else {
                    strikes
                }
            }
        };
        let strikes = earlier.saturating_add(1);
        let hold = hold_for(cfg.min_ejection, strikes);
        *self = Self::Ejected {
            since: now,
            reason,
            hold,
            strikes,
            consecutive_probe_successes: 0,
            probes_clear: reason.probes_can_clear(),
            trial: Trial::Waiting {
                not_before: later(now, hold),
            },
        };
        HealthTransition::Ejected { reason }
    }
}

/// The hold of an ejection with `strikes` (1 for the first): `min_ejection` doubled per
/// strike after the first, up to [`MAX_HOLD`] (or `min_ejection` if longer).
fn hold_for(min_ejection: Duration, strikes: u32) -> Duration {
    let doubled = min_ejection.saturating_mul(1u32 << strikes.saturating_sub(1).min(16));
    doubled.min(MAX_HOLD.max(min_ejection))
}

/// `now + d`, or as late as an `Instant` goes (a configured hold of years must not panic).
fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn ejected_at(t0: Instant, cfg: &HealthConfig) -> HealthState {
        let mut h = HealthState::new();
        assert!(h.on_outcome(Outcome::ConnectError, t0, cfg, true).is_some());
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
        assert_eq!(h.on_probe(false, t0, &cfg, true), None);
        assert_eq!(h.on_probe(false, t0 + ms(1000), &cfg, true), None);
        assert!(h.is_healthy());
        assert_eq!(
            h.on_probe(false, t0 + ms(2000), &cfg, true),
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
        h.on_probe(false, t0, &cfg, true);
        h.on_probe(false, t0, &cfg, true);
        h.on_probe(true, t0, &cfg, true);
        h.on_probe(false, t0, &cfg, true);
        h.on_probe(false, t0, &cfg, true);
        assert!(h.is_healthy());
    }

    #[test]
    fn connect_error_ejects_at_once() {
        let cfg = HealthConfig::default();
        let mut h = HealthState::new();
        assert_eq!(
            h.on_outcome(Outcome::ConnectError, Instant::now(), &cfg, true),
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
        assert_eq!(h.on_outcome(Outcome::ServerError, t0, &cfg, true), None);
        assert_eq!(h.on_outcome(Outcome::Timeout, t0, &cfg, true), None);
        assert_eq!(
            h.on_outcome(Outcome::ServerError, t0, &cfg, true),
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
        h.on_outcome(Outcome::ServerError, t0, &cfg, true);
        h.on_outcome(Outcome::ServerError, t0, &cfg, true);
        h.on_outcome(Outcome::Success, t0, &cfg, true);
        h.on_outcome(Outcome::ServerError, t0, &cfg, true);
        for _ in 0..10 {
            assert_eq!(h.on_outcome(Outcome::ClientCancelled, t0, &cfg, true), None);
        }
        assert_eq!(h.on_outcome(Outcome::Timeout, t0, &cfg, true), None);
        assert!(h.is_healthy());
    }

    #[test]
    fn readmit_needs_two_consecutive_successes() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert_eq!(h.on_probe(true, t0 + ms(2000), &cfg, true), None);
        // A failure in between resets the count.
        assert_eq!(h.on_probe(false, t0 + ms(3000), &cfg, true), None);
        assert_eq!(h.on_probe(true, t0 + ms(4000), &cfg, true), None);
        assert!(!h.is_healthy());
        assert_eq!(
            h.on_probe(true, t0 + ms(5000), &cfg, true),
            Some(HealthTransition::Readmitted)
        );
        assert!(h.is_healthy());
    }

    #[test]
    fn readmission_waits_for_min_ejection() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert_eq!(h.on_probe(true, t0 + ms(200), &cfg, true), None);
        assert_eq!(h.on_probe(true, t0 + ms(400), &cfg, true), None);
        assert_eq!(h.on_probe(true, t0 + ms(999), &cfg, true), None);
        assert_eq!(
            h.on_probe(true, t0 + ms(1000), &cfg, true),
            Some(HealthTransition::Readmitted)
        );
    }

    #[test]
    fn outcomes_while_ejected_do_not_readmit_or_reeject() {
        let cfg = HealthConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert_eq!(
            h.on_outcome(Outcome::Success, t0 + ms(5000), &cfg, true),
            None
        );
        assert_eq!(
            h.on_outcome(Outcome::ConnectError, t0 + ms(5000), &cfg, true),
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
        assert_eq!(h.on_stall(t0, &cfg, &two, true), None);
        h.on_outcome(Outcome::Success, t0, &cfg, true);
        assert_eq!(h.on_stall(t0, &cfg, &two, true), None);
        assert_eq!(
            h.on_stall(t0, &cfg, &two, true),
            Some(HealthTransition::Ejected {
                reason: EjectReason::Stalls { consecutive: 2 }
            })
        );
        let mut h = HealthState::new();
        assert!(h
            .on_stall(t0, &cfg, &OutlierConfig::default(), true)
            .is_some());
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
        // The second ejection in a row holds twice as long: 2 s.
        assert!(!h.trial_available(t0 + ms(3499), &ocfg));
        assert!(h.trial_available(t0 + ms(3500), &ocfg));
    }

    #[test]
    fn probes_readmit_only_what_they_can_see_and_repeat_ejections_hold_longer() {
        let cfg = HealthConfig::default();
        let ocfg = OutlierConfig::default();
        let t0 = Instant::now();
        // A hung engine: its requests time out, but `/health` answers.
        let mut h = HealthState::new();
        for _ in 0..3 {
            h.on_outcome(Outcome::Timeout, t0, &cfg, true);
        }
        assert!(!h.is_healthy());
        for s in 1..10 {
            assert_eq!(h.on_probe(true, t0 + ms(1000 * s), &cfg, true), None);
        }
        assert!(
            !h.is_healthy(),
            "probes do not clear what live traffic showed"
        );
        // Its trial times out: ejected again, for 2 s, then 4 s, ... up to MAX_HOLD.
        let mut at = t0 + ms(10_000);
        let mut holds = Vec::new();
        for _ in 0..8 {
            assert!(h.begin_trial(at, &ocfg));
            h.end_trial(Some(false), at + ms(60_000), &cfg);
            let HealthState::Ejected { hold, .. } = h else {
                panic!("ejected")
            };
            holds.push(hold.as_secs());
            at += ms(60_000) + hold;
        }
        assert_eq!(holds, [2, 4, 8, 16, 32, 60, 60, 60]);
        // Its trial answers: healthy, and after five healthy minutes the strikes are forgotten.
        assert!(h.begin_trial(at, &ocfg));
        assert_eq!(
            h.end_trial(Some(true), at, &cfg),
            Some(HealthTransition::Readmitted)
        );
        h.on_outcome(Outcome::ConnectError, at + ms(1000), &cfg, true);
        let HealthState::Ejected { hold, .. } = h else {
            panic!("ejected")
        };
        assert_eq!(hold, MAX_HOLD, "soon after: the strikes stand");
        let mut h2 = HealthState::new();
        h2.on_outcome(Outcome::ConnectError, t0, &cfg, true);
        h2.on_probe(true, t0 + ms(1000), &cfg, true);
        h2.on_probe(true, t0 + ms(2000), &cfg, true);
        assert!(h2.is_healthy(), "a refused connection is cleared by probes");
        h2.on_outcome(
            Outcome::ConnectError,
            t0 + ms(2000) + STRIKES_FORGIVEN_AFTER,
            &cfg,
            true,
        );
        let HealthState::Ejected { hold, .. } = h2 else {
            panic!("ejected")
        };
        assert_eq!(
            hold, cfg.min_ejection,
            "forgiven after five healthy minutes"
        );
        // Without trials, probes re-admit whatever the reason.
        let mut h3 = HealthState::new();
        for _ in 0..3 {
            h3.on_outcome(Outcome::ServerError, t0, &cfg, true);
        }
        h3.on_probe(true, t0 + ms(1000), &cfg, false);
        assert_eq!(
            h3.on_probe(true, t0 + ms(2000), &cfg, false),
            Some(HealthTransition::Readmitted)
        );
    }

    #[test]
    fn the_router_may_forbid_a_passive_ejection_but_the_failures_still_count() {
        let cfg = HealthConfig::default();
        let ocfg = OutlierConfig::default();
        let t0 = Instant::now();
        let mut h = HealthState::new();
        for _ in 0..5 {
            assert_eq!(h.on_outcome(Outcome::Timeout, t0, &cfg, false), None);
        }
        assert_eq!(h.on_stall(t0, &cfg, &ocfg, false), None);
        assert!(h.is_healthy());
        assert!(h.on_outcome(Outcome::Timeout, t0, &cfg, true).is_some());
        // A refused connection ejects regardless: nothing listens.
        let mut h = HealthState::new();
        assert!(h
            .on_outcome(Outcome::ConnectError, t0, &cfg, false)
            .is_some());
    }

    #[test]
    fn a_cancelled_trial_frees_the_slot_and_a_failed_probe_delays_it() {
        let cfg = HealthConfig::default();
        let ocfg = OutlierConfig::default();
        let t0 = Instant::now();
        let mut h = ejected_at(t0, &cfg);
        assert!(h.begin_trial(t0 + ms(1000), &ocfg));
        assert_eq!(h.end_trial(None, t0 + ms(1200), &cfg), None);
        assert!(!h.trial_available(t0 + ms(2199), &ocfg));
        assert!(h.trial_available(t0 + ms(2200), &ocfg));
        h.on_probe(false, t0 + ms(1300), &cfg, true);
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
        h.on_probe(true, t0 + ms(1000), &cfg, true);
        assert_eq!(
            h.on_probe(true, t0 + ms(2000), &cfg, true),
            Some(HealthTransition::Readmitted)
        );
        // A trial verdict arriving after that is ignored.
        assert_eq!(h.end_trial(Some(false), t0 + ms(2100), &cfg), None);
        assert!(h.is_healthy());
    }
}
