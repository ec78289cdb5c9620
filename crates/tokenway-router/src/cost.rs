//! The `cost` policy's model: expected seconds to first token on a backend.
//!
//! ```text
//! cost = rtt + overhead + queue + prefill + region_penalty + kv_penalty          (seconds)
//! queue   = in-flight token work (tokens) / throughput (tokens/s)
//! prefill = uncached prompt tokens (tokens) / prefill rate (tokens/s)
//! ```
//!
//! - `rtt`: EWMA of the gateway's active RTT probes to the backend (0 before the first sample).
//! - In-flight token work: for every attempt on the backend that has not ended, its uncached
//!   prompt tokens until its first token arrives, plus its expected output tokens until it
//!   ends. When a fresh external load signal (the engine's own `/metrics`) shows more requests
//!   than this gateway has in flight (other gateways share the backend), each extra request adds
//!   the backend's average attempt work.
//! - Uncached prompt tokens: the prompt's token estimate times the fraction of its blocks that
//!   the backend's [prefix index](crate::prefix) does not hold.
//! - `overhead`, `1 / prefill rate` and `1 / throughput` are learned per backend, online, from
//!   every first token: each sample is `y = ttft − rtt` against `x = (1, uncached kilotokens,
//!   work ahead in kilotokens)`, fitted by ridge regression with directional forgetting
//!   towards configured priors (a recursive least-squares variant; the ridge term keeps the fit
//!   defined when requests look alike and holds it at the priors in directions no sample has
//!   measured; each sample forgets old data only along its own direction). The
//!   results are clamped to configured ranges, so one odd sample cannot make a backend look free.
//! - `region_penalty`: configured seconds added when the client's region is known and differs
//!   from the backend's.
//! - `kv_penalty`: when the engine reports KV-cache usage above the high-water mark, new requests
//!   there are likely to queue or preempt others; the penalty grows linearly to its maximum at
//!   100 % usage.
//!
//! This module must never read a clock: signals carry the `Instant` they were observed at.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::InvalidSetting;

/// Cost model settings. Rates are tokens per second, times are durations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostConfig {
    /// Added when the client's region is known and differs from the backend's (default 25 ms).
    pub cross_region_penalty: Duration,
    /// Prior of the fixed part of TTFT (scheduling, first decode step), default 50 ms.
    pub prior_overhead: Duration,
    /// Prior prefill rate, default 10 000 tokens/s.
    pub prior_prefill_rate: f64,
    /// Prior throughput for draining in-flight work, default 10 000 tokens/s.
    pub prior_throughput: f64,
    /// Learned rates are clamped to `[min_rate, max_rate]` (default 100 and 1 000 000 tokens/s).
    pub min_rate: f64,
    /// Upper clamp of learned prefill rates.
    pub max_rate: f64,
    /// Upper clamp of the learned throughput (default 50 000 tokens/s). It keeps a minimum price
    /// on in-flight work even on engines whose TTFT does not yet react to load (continuous
    /// batching below capacity), so traffic does not herd onto one backend until it saturates.
    pub max_throughput: f64,
    /// Output tokens assumed when the request gives no limit (default 256); a given limit is
    /// capped at 4 × this, since clients often ask for far more than they get.
    pub default_output_tokens: u32,
    /// Weight of the priors, in samples (default 2): how much data it takes to move away.
    pub prior_weight: f64,
    /// Per-sample forgetting factor in (0, 1] (default 0.97, an effective window of ~33).
    pub forgetting: f64,
    /// An external load signal older than this is ignored (default 5 s).
    pub load_signal_max_age: Duration,
    /// KV-cache usage above which the KV penalty starts (default 0.9).
    pub kv_high_water: f64,
    /// The KV penalty at 100 % usage (default 1 s).
    pub kv_full_penalty: Duration,
    /// Slack ε of the cost policy's load bound (default 0.5; `None` disables the bound): the
    /// cheapest backend goes first only while its attempts in flight are below
    /// `max(load_bound_floor, ceil((1 + ε) × (total in flight + 1) / eligible backends))`;
    /// otherwise the cheapest backend within the bound does. Prefix affinity alone herds every
    /// conversation that shares a cached prefix (a system prompt) onto the backends that hold it,
    /// and the learned queue price lags a queue that builds faster than it is sampled.
    pub load_bound_epsilon: Option<f64>,
    /// Slack of the load bound for a request whose cheapest backend also holds a private part
    /// of its prompt (its conversation's history, beyond any prefix other prompts share): the
    /// conversation's home. Default 4.0; `None` never moves a conversation off its home for
    /// load. Values below `load_bound_epsilon` act as `load_bound_epsilon`.
    pub load_bound_home_epsilon: Option<f64>,
    /// A conversation's home goes first only while its expected TTFT is at most this many
    /// times the cheapest backend's (default 4.0, at least 1): beyond it the home counts as
    /// overloaded whatever the attempt counts say. The share bound sends a new conversation
    /// past the cheapest backend only to one within the same ratio.
    pub home_max_cost_ratio: f64,
    /// Attempts in flight that never count as over the load bound (default 2), so that at low
    /// load a conversation is not moved off its cached backend for one concurrent request.
    pub load_bound_floor: u32,
    /// Slack of the share bound (default 0.25; `None` places new conversations by the load
    /// bound of `load_bound_epsilon` instead). A request without a home (a new conversation)
    /// goes to the cheapest backend whose recent attempts (a count decaying over
    /// `share_window`) are below `(1 + ε) × the mean` with this request added, and whose
    /// attempts in flight are within the home bound. A conversation's later turns follow it to
    /// its home, so the attempts in flight when it starts say little about the load it brings;
    /// the recent share does, and balancing it replicates each shared system prompt to about
    /// as many backends as its traffic needs rather than to every backend that is momentarily
    /// idle.
    pub share_epsilon: Option<f64>,
    /// Time constant of each backend's decaying count of attempts started (default 10 s).
    pub share_window: Duration,
    /// Longest a request may be held for a prefill in flight (default 500 ms; zero never
    /// holds). When the longest cached prefix of a prompt is still being prefilled on a
    /// backend by another attempt, and waiting for it is expected to be shorter than
    /// prefilling that part again anywhere, the router answers "hold" and the gateway routes
    /// the request again when the prefill should be done, at most this long in all.
    pub prefill_hold_max: Duration,
    /// Requests each engine runs at once, when the operator knows it (vLLM
    /// `--max-num-seqs`, SGLang `--max-running-requests`); `None` (default) learns each
    /// backend's from its load reports (the most it reported running while others waited),
    /// which takes a report that caught the engine full. The `cost` policy keeps a
    /// conversation home while home has a free slot, and when home is full compares the wait
    /// for its first slot with another backend that has one.
    pub batch_slots: Option<u32>,
}

impl Default for CostConfig {
    fn default() -> Self {
        Self {
            cross_region_penalty: Duration::from_millis(25),
            prior_overhead: Duration::from_millis(50),
            prior_prefill_rate: 10_000.0,
            prior_throughput: 10_000.0,
            min_rate: 100.0,
            max_rate: 1_000_000.0,
            max_throughput: 50_000.0,
            default_output_tokens: 256,
            prior_weight: 2.0,
            forgetting: 0.97,
            load_signal_max_age: Duration::from_secs(5),
            kv_high_water: 0.9,
            kv_full_penalty: Duration::from_secs(1),
            load_bound_epsilon: Some(0.5),
            load_bound_home_epsilon: Some(4.0),
            home_max_cost_ratio: 4.0,
            load_bound_floor: 2,
            share_epsilon: Some(0.25),
            share_window: Duration::from_secs(10),
            prefill_hold_max: Duration::from_millis(500),
            batch_slots: None,
        }
    }
}

impl CostConfig {
    /// Check ranges.
    ///
    /// # Errors
    ///
    /// [`InvalidSetting`] naming the first key out of range.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let pos = |v: f64| v.is_finite() && v > 0.0;
        if !pos(self.min_rate) {
            return Err(InvalidSetting::new("cost.min_rate", "> 0", self.min_rate));
        }
        if !(pos(self.max_rate) && self.max_rate >= self.min_rate) {
            return Err(InvalidSetting::new(
                "cost.max_rate",
                ">= cost.min_rate",
                self.max_rate,
            ));
        }
        if !(pos(self.max_throughput) && self.max_throughput >= self.min_rate) {
            return Err(InvalidSetting::new(
                "cost.max_throughput",
                ">= cost.min_rate",
                self.max_throughput,
            ));
        }
        if !(pos(self.prior_prefill_rate)
            && (self.min_rate..=self.max_rate).contains(&self.prior_prefill_rate))
        {
            return Err(InvalidSetting::new(
                "cost.prior_prefill_rate",
                "within [cost.min_rate, cost.max_rate]",
                self.prior_prefill_rate,
            ));
        }
        if !(pos(self.prior_throughput)
            && (self.min_rate..=self.max_throughput).contains(&self.prior_throughput))
        {
            return Err(InvalidSetting::new(
                "cost.prior_throughput",
                "within [cost.min_rate, cost.max_throughput]",
                self.prior_throughput,
            ));
        }
        if let Some(e) = self.load_bound_epsilon {
            if !(e.is_finite() && (0.0..=100.0).contains(&e)) {
                return Err(InvalidSetting::new(
                    "cost.load_bound_epsilon",
                    "in [0, 100]",
                    e,
                ));
            }
        }
        if let Some(e) = self.load_bound_home_epsilon {
            if !(e.is_finite() && (0.0..=100.0).contains(&e)) {
                return Err(InvalidSetting::new(
                    "cost.load_bound_home_epsilon",
                    "in [0, 100]",
                    e,
                ));
            }
        }
        if let Some(e) = self.share_epsilon {
            if !(e.is_finite() && (0.0..=100.0).contains(&e)) {
                return Err(InvalidSetting::new("cost.share_epsilon", "in [0, 100]", e));
            }
        }
        if !(Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&self.share_window) {
            return Err(InvalidSetting::new(
                "cost.share_window",
                "in [0.1, 3600] seconds",
                self.share_window.as_secs_f64(),
            ));
        }
        if let Some(n) = self.batch_slots {
            if !(1..=1_000_000).contains(&n) {
                return Err(InvalidSetting::new(
                    "cost.batch_slots",
                    "in [1, 1000000]",
                    f64::from(n),
                ));
            }
        }
        if self.prefill_hold_max > Duration::from_secs(10) {
            return Err(InvalidSetting::new(
                "cost.prefill_hold_max",
                "in [0, 10] seconds",
                self.prefill_hold_max.as_secs_f64(),
            ));
        }
        if !(self.home_max_cost_ratio.is_finite() && self.home_max_cost_ratio >= 1.0) {
            return Err(InvalidSetting::new(
                "cost.home_max_cost_ratio",
                ">= 1",
                self.home_max_cost_ratio,
            ));
        }
        if !pos(self.prior_weight) {
            return Err(InvalidSetting::new(
                "cost.prior_weight",
                "> 0",
                self.prior_weight,
            ));
        }
        if !(self.forgetting > 0.0 && self.forgetting <= 1.0) {
            return Err(InvalidSetting::new(
                "cost.forgetting",
                "in (0, 1]",
                self.forgetting,
            ));
        }
        if !(0.0..1.0).contains(&self.kv_high_water) {
            return Err(InvalidSetting::new(
                "cost.kv_high_water",
                "in [0, 1)",
                self.kv_high_water,
            ));
        }
        Ok(())
    }

    /// Output tokens expected of an attempt: its limit capped at 4 × the default, or the default.
    pub(crate) fn output_estimate(&self, max_output_tokens: Option<u32>) -> u32 {
        let cap = self.default_output_tokens.saturating_mul(4);
        max_output_tokens.map_or(self.default_output_tokens, |m| m.min(cap))
    }
}

/// Load reported by the engine itself (vLLM `vllm:num_requests_waiting`,
/// `vllm:num_requests_running`, `vllm:gpu_cache_usage_perc`; SGLang `num_queue_reqs`,
/// `num_running_reqs`, `token_usage`), scraped by the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct LoadSignal {
    /// Requests waiting for a batch slot.
    pub waiting: u32,
    /// Requests running (prefilling or decoding).
    pub running: u32,
    /// KV-cache usage as a fraction in [0, 1], if exposed.
    pub kv_cache_usage: Option<f64>,
}

/// The learned part of one backend's cost: overhead, prefill rate, throughput.
#[derive(Debug, Clone)]
pub(crate) struct RateModel {
    /// Exponentially weighted `Σ x xᵀ` (symmetric 3×3) and `Σ x y`.
    xx: [[f64; 3]; 3],
    xy: [f64; 3],
    samples: u64,
    /// Current fit: seconds, seconds per kilotoken (prefill), seconds per kilotoken (queue).
    theta: [f64; 3],
}

impl RateModel {
    pub(crate) fn new(cfg: &CostConfig) -> Self {
        Self {
            xx: [[0.0; 3]; 3],
            xy: [0.0; 3],
            samples: 0,
            theta: prior(cfg),
        }
    }

    /// Fixed part of TTFT, seconds.
    pub(crate) fn overhead(&self) -> f64 {
        self.theta[0]
    }

    /// Seconds per uncached prompt token.
    pub(crate) fn secs_per_prefill_token(&self) -> f64 {
        self.theta[1] / 1000.0
    }

    /// Seconds per token of in-flight work ahead.
    pub(crate) fn secs_per_queued_token(&self) -> f64 {
        self.theta[2] / 1000.0
    }

    /// Learned prefill rate, tokens/s.
    pub(crate) fn prefill_rate(&self) -> f64 {
        1000.0 / self.theta[1]
    }

    /// Learned throughput, tokens/s.
    pub(crate) fn throughput(&self) -> f64 {
        1000.0 / self.theta[2]
    }

    /// Samples seen.
    pub(crate) fn samples(&self) -> u64 {
        self.samples
    }

    /// Learn from one first token: `ttft_minus_rtt` seconds for an attempt with
    /// `uncached_tokens` to prefill and `work_ahead` tokens of in-flight work at its start.
    pub(crate) fn observe(
        &mut self,
        ttft_minus_rtt: f64,
        uncached_tokens: f64,
        work_ahead: f64,
        cfg: &CostConfig,
    ) {
        if !ttft_minus_rtt.is_finite() {
            return;
        }
        let x = [1.0, uncached_tokens / 1000.0, work_ahead / 1000.0];
        let y = ttft_minus_rtt.max(0.0);
        let g = cfg.forgetting;
        // Directional forgetting (Kulhavý 1987): discount the old information only along the
        // direction the new sample measures. Most first tokens look alike (a short uncached
        // tail, little work ahead); uniform forgetting let those wash out the rare samples
        // that tell the prefill rate from the overhead (a cold system prompt), and the fit
        // sat at its priors. Along `v = R x` a fraction `1 − g` of the information `R`
        // goes, and `r` is discounted consistently (`r' = R' θ` for the old least-squares
        // `θ`), so the step alone does not move the fit.
        let v: [f64; 3] = std::array::from_fn(|i| (0..3).map(|j| self.xx[i][j] * x[j]).sum());
        let s: f64 = (0..3).map(|i| x[i] * v[i]).sum();
        let xr: f64 = (0..3).map(|i| x[i] * self.xy[i]).sum();
        if s > 1e-12 && s.is_finite() {
            let k = (1.0 - g) / s;
            for i in 0..3 {
                for j in 0..3 {
                    self.xx[i][j] -= k * v[i] * v[j];
                }
                self.xy[i] -= k * v[i] * xr;
            }
        }
        for i in 0..3 {
            for j in 0..3 {
                self.xx[i][j] += x[i] * x[j];
            }
            self.xy[i] += x[i] * y;
        }
        self.samples += 1;
        self.refit(cfg);
    }

    /// Solve `(XᵀX + λI) θ = Xᵀy + λ θ₀` and clamp.
    fn refit(&mut self, cfg: &CostConfig) {
        let p = prior(cfg);
        let lambda = cfg.prior_weight;
        let mut a = self.xx;
        let mut b = self.xy;
        for i in 0..3 {
            a[i][i] += lambda;
            b[i] += lambda * p[i];
        }
        let theta = solve3(a, b).unwrap_or(p);
        self.theta = [
            theta[0].clamp(0.0, 60.0),
            theta[1].clamp(1000.0 / cfg.max_rate, 1000.0 / cfg.min_rate),
            theta[2].clamp(1000.0 / cfg.max_throughput, 1000.0 / cfg.min_rate),
        ];
    }
}

fn prior(cfg: &CostConfig) -> [f64; 3] {
    [
        cfg.prior_overhead.as_secs_f64(),
        1000.0 / cfg.prior_prefill_rate,
        1000.0 / cfg.prior_throughput,
    ]
}

/// Gaussian elimination with partial pivoting; `None` if (numerically) singular.
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..3 {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (dst, src) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *dst -= f * src;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let mut s = b[row];
        for k in row + 1..3 {
            s -= a[row][k] * x[k];
        }
        x[row] = s / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// A load signal with the time it was observed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TimedSignal {
    pub(crate) signal: LoadSignal,
    pub(crate) at: Instant,
    /// This router's attempts in flight on the backend when the signal arrived.
    pub(crate) inflight_then: u32,
}

impl TimedSignal {
    /// Requests the engine reported (running and waiting) beyond this router's own attempts
    /// at the time: other gateways' load, which lasts while the signal is fresh. Comparing
    /// the report with the attempts in flight *now* would count this router's own requests
    /// that have ended since the scrape as someone else's.
    pub(crate) fn others(&self) -> u32 {
        self.signal
            .waiting
            .saturating_add(self.signal.running)
            .saturating_sub(self.inflight_then)
    }

    pub(crate) fn fresh(&self, now: Instant, cfg: &CostConfig) -> Option<&LoadSignal> {
        (now.saturating_duration_since(self.at) <= cfg.load_signal_max_age).then_some(&self.signal)
    }
}

/// The KV penalty in seconds for a usage fraction.
pub(crate) fn kv_penalty(usage: f64, cfg: &CostConfig) -> f64 {
    if !usage.is_finite() || usage <= cfg.kv_high_water {
        return 0.0;
    }
    let over = ((usage.min(1.0) - cfg.kv_high_water) / (1.0 - cfg.kv_high_water)).clamp(0.0, 1.0);
    over * cfg.kv_full_penalty.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_model_starts_at_the_priors() {
        let cfg = CostConfig::default();
        let m = RateModel::new(&cfg);
        assert!((m.prefill_rate() - 10_000.0).abs() < 1e-6);
        assert!((m.throughput() - 10_000.0).abs() < 1e-6);
        assert!((m.overhead() - 0.05).abs() < 1e-9);
    }

    #[test]
    fn rate_model_learns_prefill_rate_and_overhead_from_varied_prompts() {
        let cfg = CostConfig::default();
        let mut m = RateModel::new(&cfg);
        // True engine: 20 ms + tokens / 4000 tok/s, no queueing.
        for i in 0..200u32 {
            let tokens = f64::from((i * 733) % 4000 + 100);
            m.observe(0.02 + tokens / 4000.0, tokens, 0.0, &cfg);
        }
        let rate = m.prefill_rate();
        assert!((3600.0..4400.0).contains(&rate), "{rate}");
        assert!((0.0..0.05).contains(&m.overhead()), "{}", m.overhead());
    }

    #[test]
    fn rate_model_keeps_the_rare_long_prefills_that_separate_rate_from_overhead() {
        let cfg = CostConfig::default();
        let mut m = RateModel::new(&cfg);
        // True engine: 20 ms + tokens / 5000 tok/s. Nearly every request prefills ~360
        // tokens (a conversation's new turn); one in 40 prefills a 2,200-token system prompt.
        for i in 0..2000u32 {
            let tokens = if i % 40 == 0 {
                2200.0
            } else {
                f64::from(340 + (i * 7) % 40)
            };
            m.observe(0.02 + tokens / 5000.0, tokens, 0.0, &cfg);
        }
        // Uniform forgetting (0.97 per sample) forgot each long prefill within ~30 samples,
        // and the fit sat near its priors (10,000 tokens/s, 50 ms).
        let rate = m.prefill_rate();
        assert!((4500.0..5600.0).contains(&rate), "{rate}");
        assert!((0.01..0.03).contains(&m.overhead()), "{}", m.overhead());
    }

    #[test]
    fn rate_model_learns_queue_throughput_from_work_ahead() {
        let cfg = CostConfig::default();
        let mut m = RateModel::new(&cfg);
        // 10 ms + 500 tokens at 8000 tok/s + work ahead at 2000 tok/s.
        for i in 0..300u32 {
            let ahead = f64::from((i * 389) % 8000);
            m.observe(0.01 + 500.0 / 8000.0 + ahead / 2000.0, 500.0, ahead, &cfg);
        }
        let t = m.throughput();
        assert!((1800.0..2200.0).contains(&t), "{t}");
    }

    #[test]
    fn absurd_samples_are_clamped_not_trusted() {
        let cfg = CostConfig::default();
        let mut m = RateModel::new(&cfg);
        for _ in 0..100 {
            m.observe(0.0, 100_000.0, 0.0, &cfg);
        }
        assert!(m.prefill_rate() <= cfg.max_rate * (1.0 + 1e-9));
        m.observe(f64::NAN, 1.0, 1.0, &cfg);
        assert!(m.prefill_rate().is_finite());
    }

    #[test]
    fn kv_penalty_grows_linearly_above_high_water() {
        let cfg = CostConfig::default();
        assert_eq!(kv_penalty(0.5, &cfg), 0.0);
        assert!((kv_penalty(0.95, &cfg) - 0.5).abs() < 1e-9);
        assert!((kv_penalty(1.2, &cfg) - 1.0).abs() < 1e-9);
        assert_eq!(kv_penalty(f64::NAN, &cfg), 0.0);
    }

    #[test]
    fn defaults_validate_and_bad_values_name_their_key() {
        assert_eq!(CostConfig::default().validate(), Ok(()));
        let bad = CostConfig {
            forgetting: 0.0,
            ..CostConfig::default()
        };
        let err = bad.validate().expect_err("forgetting 0 is out of range");
        assert!(err.to_string().contains("cost.forgetting"), "{err}");
    }
}
