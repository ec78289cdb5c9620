//! When is a piece a straggler worth hedging? Sans-IO.
//!
//! Keeps the durations of the last [`WINDOW`] pieces fetched. A piece still not in after
//! [`FACTOR`] times their median (and at least [`FLOOR`]) is much slower than its peers:
//! the puller then asks a second source for it and keeps whichever verified copy lands
//! first. Until [`MIN_SAMPLES`] pieces have finished there is no baseline; then only a
//! *silent* piece is hedged: one whose source has not even sent its response head after
//! [`SILENT_AFTER`] (a hung mirror, a frozen peer), so the first pieces of a pull do not wait
//! out [`crate::http_client::HEAD_TIMEOUT`] on such a source.

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

/// A piece whose source has not answered (no response head) for this long is hedged, with or
/// without a baseline. A live mirror or peer sends the head within
/// [`crate::range_server::EARLY_HEAD_AFTER`] (1 s) even when the piece is still on its way
/// from the origin, so this hedges sources that are hung or unreachable, not cold ones.
pub const SILENT_AFTER: Duration = Duration::from_secs(2);

/// When to hedge a piece that has been in flight for `elapsed`, given `hedge_after` (the
/// straggler threshold, if there is a baseline) and whether its source has answered yet.
pub fn should_hedge(hedge_after: Option<Duration>, elapsed: Duration, answered: bool) -> bool {
    hedge_after.is_some_and(|d| elapsed >= d) || (!answered && elapsed >= SILENT_AFTER)
}

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

    #[test]
    fn a_silent_source_is_hedged_without_a_baseline_and_a_slow_answering_one_is_not() {
        let early = SILENT_AFTER - Duration::from_millis(1);
        assert!(!should_hedge(None, early, false));
        assert!(should_hedge(None, SILENT_AFTER, false));
        // Answered and sending: without a baseline it is never a straggler.
        assert!(!should_hedge(None, Duration::from_secs(600), true));
        // With a baseline, slowness alone counts.
        let after = Some(Duration::from_millis(400));
        assert!(!should_hedge(after, Duration::from_millis(399), true));
        assert!(should_hedge(after, Duration::from_millis(400), true));
    }
}
