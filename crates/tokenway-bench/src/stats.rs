//! Percentiles over sorted samples.
//!
//! Latency is summarised by percentiles only, never by averages: a mean hides the tail that a
//! user of a streaming API actually feels. The method is nearest-rank (the smallest sample such
//! that at least p% of the samples are <= it), so every reported value is a real measurement.

use std::time::Duration;

use serde::Serialize;

/// The nearest-rank `p`-th percentile (0 < p <= 100) of `sorted` (ascending), or `None` when
/// there are no samples.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let p = p.clamp(0.0, 100.0);
    // Less a hair, so that a rank like 99.9 % of 1,000, which is 999.000…01 in floating point,
    // stays 999.
    let rank = ((p / 100.0) * sorted.len() as f64 - 1e-9).ceil() as usize;
    let index = rank.clamp(1, sorted.len()) - 1;
    Some(sorted[index])
}

/// A distribution-free 95 % confidence interval of the `p`-th percentile of the population that
/// `sorted` (ascending) was drawn from: the samples at the ranks `n·p/100 ∓ 1.96·√(n·p/100·(1 −
/// p/100))` (the normal approximation of the binomial count of samples below the percentile).
/// With 2,000 samples the p99 interval spans the samples at p98.6 and p99.5; with 10,000, those at
/// p98.8 and p99.2. `None` when there are no samples.
pub fn percentile_interval(sorted: &[f64], p: f64) -> Option<(f64, f64)> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len() as f64;
    let q = p.clamp(0.0, 100.0) / 100.0;
    let half = 1.96 * (n * q * (1.0 - q)).sqrt();
    let at = |rank: f64| sorted[(rank.ceil().max(1.0) as usize).min(sorted.len()) - 1];
    Some((at(n * q - half), at(n * q + half + 1.0)))
}

/// The tail of a set of durations in milliseconds: where two proxies differ by a few
/// microseconds at the p99, the interval says whether the run can tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TailSummary {
    /// Number of samples.
    pub count: usize,
    /// 90th percentile, milliseconds.
    pub p90_ms: f64,
    /// 99th percentile, milliseconds.
    pub p99_ms: f64,
    /// Lower end of the p99's 95 % confidence interval ([`percentile_interval`]).
    pub p99_low_ms: f64,
    /// Upper end of that interval.
    pub p99_high_ms: f64,
    /// 99.9th percentile, milliseconds.
    pub p999_ms: f64,
}

impl TailSummary {
    /// Summarises `samples` (any order); `None` when empty.
    pub fn from_durations(samples: &[Duration]) -> Option<Self> {
        let ms = sorted_ms(samples);
        let (p99_low_ms, p99_high_ms) = percentile_interval(&ms, 99.0)?;
        Some(Self {
            count: ms.len(),
            p90_ms: percentile(&ms, 90.0)?,
            p99_ms: percentile(&ms, 99.0)?,
            p99_low_ms,
            p99_high_ms,
            p999_ms: percentile(&ms, 99.9)?,
        })
    }
}

/// `samples` in milliseconds, ascending.
pub fn sorted_ms(samples: &[Duration]) -> Vec<f64> {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    ms
}

/// p50, p99 and max of a set of durations, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub count: usize,
    /// Median, milliseconds.
    pub p50_ms: f64,
    /// 99th percentile, milliseconds.
    pub p99_ms: f64,
    /// Largest sample, milliseconds.
    pub max_ms: f64,
}

impl LatencySummary {
    /// Summarises `samples` (any order); `None` when empty.
    pub fn from_durations(samples: &[Duration]) -> Option<Self> {
        let ms = sorted_ms(samples);
        Some(Self {
            count: ms.len(),
            p50_ms: percentile(&ms, 50.0)?,
            p99_ms: percentile(&ms, 99.0)?,
            max_ms: *ms.last()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_of_nothing_is_none() {
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn percentile_uses_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        let w = [1.0, 2.0, 3.0];
        assert_eq!(percentile(&w, 50.0), Some(2.0));
        assert_eq!(percentile(&w, 99.0), Some(3.0));
        let k: Vec<f64> = (1..=1_000).map(f64::from).collect();
        assert_eq!(percentile(&k, 99.9), Some(999.0));
    }

    #[test]
    fn single_sample_is_every_percentile() {
        assert_eq!(percentile(&[7.0], 1.0), Some(7.0));
        assert_eq!(percentile(&[7.0], 99.9), Some(7.0));
    }

    #[test]
    fn summary_sorts_unsorted_durations() {
        let d = [
            Duration::from_millis(3),
            Duration::from_millis(1),
            Duration::from_millis(2),
        ];
        let s = LatencySummary::from_durations(&d).expect("three samples");
        assert_eq!(s.count, 3);
        assert_eq!(s.p50_ms, 2.0);
        assert_eq!(s.p99_ms, 3.0);
        assert_eq!(s.max_ms, 3.0);
        assert_eq!(LatencySummary::from_durations(&[]), None);
    }
    #[test]
    fn the_p99_interval_spans_the_ranks_a_rerun_could_land_on() {
        // 10,000 samples 1..=10,000: the p99 is 9,900; 1.96·√99 ≈ 19.5 ranks either side.
        let v: Vec<f64> = (1..=10_000).map(f64::from).collect();
        assert_eq!(percentile_interval(&v, 99.0), Some((9_881.0, 9_921.0)));
        // 2,000 samples: 1,980 ± 8.7 ranks.
        let w: Vec<f64> = (1..=2_000).map(f64::from).collect();
        assert_eq!(percentile_interval(&w, 99.0), Some((1_972.0, 1_990.0)));
        // Few samples: the interval is clamped to the samples there are.
        assert_eq!(
            percentile_interval(&[1.0, 2.0, 3.0], 99.0),
            Some((3.0, 3.0))
        );
        assert_eq!(percentile_interval(&[], 99.0), None);
    }

    #[test]
    fn the_tail_summary_brackets_its_p99() {
        let d: Vec<Duration> = (1..=1_000u64).rev().map(Duration::from_micros).collect();
        let t = TailSummary::from_durations(&d).expect("samples");
        assert_eq!(t.count, 1_000);
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(near(t.p90_ms, 0.9) && near(t.p99_ms, 0.99) && near(t.p999_ms, 0.999));
        assert!(t.p99_low_ms < t.p99_ms && t.p99_ms < t.p99_high_ms);
        assert_eq!(TailSummary::from_durations(&[]), None);
    }
}
