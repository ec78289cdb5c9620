//! Recent TTFTs of one backend and their p95: the yardstick for TTFT outliers and hedging.
//!
//! A ring of the last [`WINDOW`] samples, with the p95 recomputed on insert (a selection over
//! at most 64 values, far cheaper than the request it belongs to), so reads on the routing path
//! are O(1). A window of recent samples rather than a decaying histogram keeps the estimate
//! about *this* backend's behaviour *now*, which is what both users ask: "is this first token
//! late for this backend?". Bounded memory, no clock.

use std::time::Duration;

/// Samples kept per backend.
pub const WINDOW: usize = 64;

/// The last [`WINDOW`] TTFTs of one backend.
#[derive(Debug, Clone)]
pub(crate) struct RecentTtfts {
    ring: [u64; WINDOW],
    next: usize,
    len: usize,
    p95: u64,
}

impl Default for RecentTtfts {
    fn default() -> Self {
        Self {
            ring: [0; WINDOW],
            next: 0,
            len: 0,
            p95: 0,
        }
    }
}

impl RecentTtfts {
    pub(crate) fn push(&mut self, ttft: Duration) {
        self.ring[self.next] = u64::try_from(ttft.as_nanos()).unwrap_or(u64::MAX);
        self.next = (self.next + 1) % WINDOW;
        self.len = (self.len + 1).min(WINDOW);
        let mut v = self.ring;
        let v = &mut v[..self.len];
        // Nearest-rank p95: the ceil(0.95 n)-th smallest value.
        let rank = ((0.95 * self.len as f64).ceil() as usize).clamp(1, self.len) - 1;
        let (_, p, _) = v.select_nth_unstable(rank);
        self.p95 = *p;
    }

    /// Samples held (at most [`WINDOW`]).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The p95 of the held samples, `None` while fewer than `min_samples`.
    pub(crate) fn p95(&self, min_samples: usize) -> Option<Duration> {
        (self.len >= min_samples.max(1)).then(|| Duration::from_nanos(self.p95))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn p95_of_one_to_hundred_is_ninety_five_of_the_last_sixty_four() {
        let mut r = RecentTtfts::default();
        for i in 1..=100 {
            r.push(ms(i));
        }
        // The window holds 37..=100; nearest-rank p95 of 64 values is the 61st: 97.
        assert_eq!(r.len(), WINDOW);
        assert_eq!(r.p95(1), Some(ms(97)));
    }

    #[test]
    fn p95_needs_min_samples() {
        let mut r = RecentTtfts::default();
        r.push(ms(10));
        assert_eq!(r.p95(2), None);
        r.push(ms(20));
        assert_eq!(r.p95(2), Some(ms(20)));
    }
}
