//! Hedging decisions: when to send a second copy of a request whose first token is late.
//!
//! "The Tail at Scale" (Dean & Barroso, CACM 2013): send the request to a second replica once
//! the first has been outstanding longer than the p95 of its kind, keep whichever answers first
//! and cancel the other. Only ~5 % of requests wait that long, so the extra load is small, and
//! a budget caps it anyway: every attempt started earns `budget_ratio` of a hedge token, a hedge
//! spends one, and at most `budget_burst` tokens are saved up. A backend that turns slow for
//! everyone therefore cannot double the cluster's load through hedges.
//!
//! The router only decides *how long to wait* ([`Router::hedge_delay`](crate::Router::hedge_delay))
//! and keeps the score; the gateway owns the timers, the second request and the cancellation.
//! Off by default: hedging duplicates prefill work on the engines.

use std::time::Duration;

use serde::Serialize;

use crate::error::InvalidSetting;

/// Hedging settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HedgeConfig {
    /// Hedge at all (default false).
    pub enabled: bool,
    /// TTFT samples a backend needs before its p95 is trusted (default 20).
    pub min_samples: usize,
    /// The delay is never shorter than this (default 20 ms), so jitter alone does not hedge.
    pub min_delay: Duration,
    /// Nor longer than this (default 10 s).
    pub max_delay: Duration,
    /// Hedge tokens earned per attempt started (default 0.1: at most ~10 % extra requests).
    pub budget_ratio: f64,
    /// Most hedge tokens saved up (default 10).
    pub budget_burst: f64,
}

impl Default for HedgeConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            min_samples: 20,
            min_delay: Duration::from_millis(20),
            max_delay: Duration::from_secs(10),
            budget_ratio: 0.1,
            budget_burst: 10.0,
        }
    }
}

impl HedgeConfig {
    /// Check ranges.
    ///
    /// # Errors
    ///
    /// [`InvalidSetting`] naming the first key out of range.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.min_delay > self.max_delay {
            return Err(InvalidSetting::new(
                "hedge.min_delay",
                "<= hedge.max_delay",
                format!("{:?}", self.min_delay),
            ));
        }
        if !(0.0..=1.0).contains(&self.budget_ratio) {
            return Err(InvalidSetting::new(
                "hedge.budget_ratio",
                "in [0, 1]",
                self.budget_ratio,
            ));
        }
        if !(self.budget_burst.is_finite() && self.budget_burst >= 1.0) {
            return Err(InvalidSetting::new(
                "hedge.budget_burst",
                ">= 1",
                self.budget_burst,
            ));
        }
        Ok(())
    }
}

/// Which copy of a hedged request answered first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HedgeWinner {
    /// The original attempt.
    Primary,
    /// The hedge.
    Hedge,
}

/// The token bucket that caps hedges.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HedgeBudget {
    tokens: f64,
}

impl HedgeBudget {
    pub(crate) fn new(cfg: &HedgeConfig) -> Self {
        Self {
            tokens: cfg.budget_burst,
        }
    }

    /// A request was routed: earn a fraction of a hedge.
    pub(crate) fn earn(&mut self, cfg: &HedgeConfig) {
        self.tokens = (self.tokens + cfg.budget_ratio).min(cfg.budget_burst);
    }

    pub(crate) fn available(&self) -> bool {
        self.tokens >= 1.0
    }

    /// A hedge was sent: spend one token. Returns false if none was left.
    pub(crate) fn spend(&mut self) -> bool {
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    pub(crate) fn tokens(&self) -> f64 {
        self.tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_allows_a_burst_then_one_hedge_per_ten_requests() {
        let cfg = HedgeConfig {
            budget_burst: 2.0,
            ..HedgeConfig::default()
        };
        let mut b = HedgeBudget::new(&cfg);
        assert!(b.spend());
        assert!(b.spend());
        assert!(!b.spend());
        for _ in 0..9 {
            b.earn(&cfg);
        }
        assert!(!b.available());
        b.earn(&cfg);
        b.earn(&cfg);
        assert!(b.spend());
    }

    #[test]
    fn defaults_validate() {
        assert_eq!(HedgeConfig::default().validate(), Ok(()));
        assert!(!HedgeConfig::default().enabled);
    }
}
