//! When is a piece a straggler worth hedging? Sans-IO.
//!
//! Keeps the durations of the last [`WINDOW`] pieces fetched. A piece still not in after
//! [`FACTOR`] times their median (and at least [`FLOOR`]) is much slower than its peers:
//! the puller then asks a second source for it and keeps whichever verified copy lands
//! first. Until [`MIN_SAMPLES`] pieces have finished there is no baseline and no hedging.

use std::collections::VecDeque;
use std::time::Duration;

/// Pieces remembered.
pub const WINDOW: usize = 32;
/// Pieces needed before hedging starts.
pub const MIN_SAMPLES: usize = 4;
/// A straggler takes this many times the median.
pub const FACTOR: u32 = 4;
/// Never hedge sooner than this (loopback pieces take a millisecond; a hedge costs a piece).
pub const FLOOR: Duration = Duration::from_millis(250);

/// Recent piece durations.
#[derive(Debug, Default)]
pub struct Straggler {
    recent: VecDeque<Duration>,
}

impl Straggler {
    /// Records a finished piece's duration.
    pub fn record(&mut self, d: Duration) {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(d);
    }

    /// How long to wait before hedging a piece, or `None` without a baseline yet.
    pub fn hedge_after(&self) -> Option<Duration> {
        if self.recent.len() < MIN_SAMPLES {
            return None;
        }
        let mut v: Vec<Duration> = self.recent.iter().copied().collect();
        v.sort_unstable();
        Some((v[v.len() / 2] * FACTOR).max(FLOOR))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hedging_waits_for_a_baseline_then_uses_a_multiple_of_the_median() {
        let mut s = Straggler::default();
        for _ in 0..3 {
            s.record(Duration::from_millis(100));
        }
        assert_eq!(s.hedge_after(), None);
        s.record(Duration::from_secs(60)); // one outlier does not move the median
        assert_eq!(s.hedge_after(), Some(Duration::from_millis(400)));
        for _ in 0..WINDOW {
            s.record(Duration::from_millis(1));
        }
        assert_eq!(s.hedge_after(), Some(FLOOR));
    }
}
