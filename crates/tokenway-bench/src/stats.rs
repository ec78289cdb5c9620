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
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let index = rank.clamp(1, sorted.len()) - 1;
    Some(sorted[index])
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
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
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
}
