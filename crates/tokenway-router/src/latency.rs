//! Recent TTFTs of one backend and their p95: the yardstick for TTFT outliers and hedging.
//!
//! A ring of the last [`WINDOW`] samples beside the same samples kept sorted (an insert and a
//! removal by binary search and a shift of at most 64 values per sample, cheaper than selecting
//! over a copy), so the p95 is an index and reads on the routing path are O(1). A window of
//! recent samples rather than a decaying histogram keeps the estimate
//! about *this* backend's behaviour *now*, which is what both users ask: "is this first token
//! late for this backend?". Bounded memory, no clock.

use std::time::Duration;

/// Samples kept per backend.
pub const WINDOW: usize = 64;

/// The last [`WINDOW`] TTFTs of one backend.
#[derive(Debug, Clone)]
pub(crate) struct RecentTtfts {
    /// Samples in arrival order; `next` is overwritten next.
    ring: [u64; WINDOW],
    /// The same `len` samples, ascending.
    sorted: [u64; WINDOW],
    next: usize,
    len: usize,
}

impl Default for RecentTtfts {
    fn default() -> Self {
        Self {
            ring: [0; WINDOW],
            sorted: [0; WINDOW],
            next: 0,
            len: 0,
        }
    }
}

impl RecentTtfts {
    pub(crate) fn push(&mut self, ttft: Duration) {
        let sample = u64::try_from(ttft.as_nanos()).unwrap_or(u64::MAX);
        if self.len == WINDOW {
            // The oldest sample leaves the sorted copy (any equal value will do).
            let evicted = self.ring[self.next];
            let sorted = &mut self.sorted[..self.len];
            if let Ok(at) = sorted.binary_search(&evicted) {
                sorted.copy_within(at + 1.., at);
            }
            self.len -= 1;
        }
        let sorted = &mut self.sorted[..=self.len];
        let at = sorted[..sorted.len() - 1].partition_point(|&v| v <= sample);
        sorted.copy_within(at..sorted.len() - 1, at + 1);
        sorted[at] = sample;
        self.len += 1;
        self.ring[self.next] = sample;
        self.next = (self.next + 1) % WINDOW;
    }

    /// Samples held (at most [`WINDOW`]).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The p95 of the held samples, `None` while fewer than `min_samples`.
    pub(crate) fn p95(&self, min_samples: usize) -> Option<Duration> {
        // Nearest-rank p95: the ceil(0.95 n)-th smallest value.
        let rank = ((0.95 * self.len as f64).ceil() as usize).clamp(1, self.len.max(1)) - 1;
        (self.len >= min_samples.max(1)).then(|| Duration::from_nanos(self.sorted[rank]))
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

    proptest::proptest! {
        #[test]
        fn p95_equals_the_nearest_rank_of_the_last_samples(
            samples in proptest::collection::vec(0u64..500, 1..200)
        ) {
            let mut r = RecentTtfts::default();
            for (i, &s) in samples.iter().enumerate() {
                r.push(ms(s));
                let start = (i + 1).saturating_sub(WINDOW);
                let mut window: Vec<u64> = samples[start..=i].to_vec();
                window.sort_unstable();
                let rank = ((0.95 * window.len() as f64).ceil() as usize).clamp(1, window.len()) - 1;
                proptest::prop_assert_eq!(r.p95(1), Some(ms(window[rank])));
                proptest::prop_assert_eq!(r.len(), window.len());
            }
        }
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
