//! Time-weighted averages: the peak EWMA of time to first token (the latency signal of the
//! `p2c_ewma` policy) and a decaying event count (the `cost` policy's share of recent attempts).
//!
//! "Peak" EWMA (Finagle's `PeakEwma`, also used by linkerd2-proxy and tower's `p2c`): a sample
//! above the current estimate replaces it at once, so a backend that turns slow is avoided
//! immediately; a sample below it pulls the estimate down with weight `1 - exp(-Δt/τ)`, where
//! `Δt` is the time since the previous sample and `τ` the time constant, so recovery is judged
//! over time rather than over a number of requests. This module must never read a clock:
//! every update is given its `now`.

use std::time::{Duration, Instant};

/// Time constant of the decay towards lower samples.
pub const DEFAULT_TAU: Duration = Duration::from_secs(10);

/// A peak-sensitive, time-weighted moving average of a duration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeakEwma {
    tau: Duration,
    /// `(estimate in seconds, time of last update)`; `None` until the first sample.
    state: Option<(f64, Instant)>,
}

impl Default for PeakEwma {
    fn default() -> Self {
        Self::new(DEFAULT_TAU)
    }
}

impl PeakEwma {
    /// An empty average with time constant `tau`.
    pub fn new(tau: Duration) -> Self {
        Self { tau, state: None }
    }

    /// Add a sample observed at `now`. A `now` earlier than the last update counts as no
    /// elapsed time.
    pub fn observe(&mut self, sample: Duration, now: Instant) {
        let s = sample.as_secs_f64();
        let value = match self.state {
            None => s,
            Some((v, _)) if s >= v => s,
            Some((v, last)) => {
                let elapsed = now.saturating_duration_since(last).as_secs_f64();
                let tau = self.tau.as_secs_f64();
                let w = if tau > 0.0 {
                    (-elapsed / tau).exp()
                } else {
                    0.0
                };
                v * w + s * (1.0 - w)
            }
        };
        self.state = Some((value, now));
    }

    /// The current estimate, `None` before the first sample.
    pub fn get(&self) -> Option<Duration> {
        self.state
            .map(|(v, _)| Duration::try_from_secs_f64(v).unwrap_or(Duration::MAX))
    }

    /// The current estimate in seconds, or `default` before the first sample.
    pub fn secs_or(&self, default: Duration) -> f64 {
        self.state.map_or(default.as_secs_f64(), |(v, _)| v)
    }

    /// The estimate at `now`: it drifts back towards `default` with time constant `τ` while
    /// no sample comes (`default` before the first sample). Without the drift one slow first
    /// token (a long prompt's) froze a backend's estimate, the policy sent it nothing, and no
    /// sample came to bring the estimate down: it starved.
    pub fn secs_at(&self, now: Instant, default: Duration) -> f64 {
        let d = default.as_secs_f64();
        let Some((v, last)) = self.state else {
            return d;
        };
        let tau = self.tau.as_secs_f64();
        if tau <= 0.0 {
            return v;
        }
        let w = (-now.saturating_duration_since(last).as_secs_f64() / tau).exp();
        d + (v - d) * w
    }
}

/// An exponentially decaying count of events: each event adds one, and the count decays by
/// `exp(-Δt/τ)` over time, so it approximates the events of the last `τ` (a rate × `τ`). Like
/// the rest of the crate it never reads a clock.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DecayingCount {
    /// `(count, time of the last event)`; `None` before the first event.
    state: Option<(f64, Instant)>,
}

impl DecayingCount {
    /// The count at `now` with time constant `tau` (a `now` before the last event counts as no
    /// elapsed time).
    pub fn get(&self, now: Instant, tau: Duration) -> f64 {
        match self.state {
            None => 0.0,
            Some((v, at)) => {
                let tau = tau.as_secs_f64();
                if tau <= 0.0 {
                    return 0.0;
                }
                v * (-now.saturating_duration_since(at).as_secs_f64() / tau).exp()
            }
        }
    }

    /// One event at `now`.
    pub fn add(&mut self, now: Instant, tau: Duration) {
        let v = self.get(now, tau) + 1.0;
        let at = match self.state {
            Some((_, at)) if at > now => at,
            _ => now,
        };
        self.state = Some((v, at));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_stale_estimate_drifts_back_to_the_default_when_no_sample_comes() {
        let t0 = Instant::now();
        let mut e = PeakEwma::new(Duration::from_secs(10));
        assert_eq!(e.secs_at(t0, ms(100)), 0.1);
        // One long prompt's 20 s first token.
        e.observe(Duration::from_secs(20), t0);
        assert!((e.secs_at(t0, ms(100)) - 20.0).abs() < 1e-9);
        let later = e.secs_at(t0 + Duration::from_secs(30), ms(100));
        assert!(later < 1.2, "{later}");
        assert!(e.secs_at(t0 + Duration::from_secs(300), ms(100)) - 0.1 < 1e-6);
        // What is stored is unchanged: the next sample still weighs against it.
        assert_eq!(e.secs_or(ms(100)), 20.0);
    }

    #[test]
    fn peak_ewma_jumps_up_and_decays() {
        let t0 = Instant::now();
        let mut e = PeakEwma::default();
        assert_eq!(e.get(), None);
        e.observe(ms(100), t0);
        assert_eq!(e.get(), Some(ms(100)));
        // A higher sample replaces the estimate at once.
        e.observe(ms(900), t0 + ms(10));
        assert_eq!(e.get(), Some(ms(900)));
        // A lower sample after one time constant moves it 1 - 1/e of the way down.
        e.observe(ms(100), t0 + ms(10) + DEFAULT_TAU);
        let expected = 0.1 + 0.8 * (-1.0f64).exp();
        let got = e.get().expect("has samples").as_secs_f64();
        assert!((got - expected).abs() < 1e-6, "{got} vs {expected}");
    }

    #[test]
    fn lower_sample_with_no_elapsed_time_does_not_move_the_peak() {
        let t0 = Instant::now();
        let mut e = PeakEwma::default();
        e.observe(ms(500), t0);
        e.observe(ms(10), t0);
        assert_eq!(e.get(), Some(ms(500)));
    }

    #[test]
    fn long_quiet_period_lets_a_low_sample_take_over() {
        let t0 = Instant::now();
        let mut e = PeakEwma::default();
        e.observe(ms(2000), t0);
        e.observe(ms(50), t0 + Duration::from_secs(300));
        let got = e.get().expect("has samples");
        assert!(got < ms(51), "{got:?}");
    }

    #[test]
    fn decaying_count_adds_one_per_event_and_decays_with_its_time_constant() {
        let t0 = Instant::now();
        let tau = Duration::from_secs(10);
        let mut c = DecayingCount::default();
        assert_eq!(c.get(t0, tau), 0.0);
        c.add(t0, tau);
        c.add(t0, tau);
        assert!((c.get(t0, tau) - 2.0).abs() < 1e-9);
        let later = t0 + Duration::from_secs(10);
        assert!((c.get(later, tau) - 2.0 / std::f64::consts::E).abs() < 1e-9);
        c.add(later, tau);
        assert!((c.get(later, tau) - (1.0 + 2.0 / std::f64::consts::E)).abs() < 1e-9);
        // An event stamped before the last one counts at the later time.
        c.add(t0, tau);
        assert!(c.get(later, tau) > 2.0);
    }
}
