//! A byte-rate cap for pulls (`--limit-rate`), so a pull can leave room for other traffic.
//! Sans-IO pacing: each request reserves its bytes on a virtual clock that advances at the
//! allowed rate; the caller sleeps until its slot.

use std::time::{Duration, Instant};

/// Paces byte transfers to `rate` bytes per second.
#[derive(Debug)]
pub struct RateLimit {
    rate: u64,
    next_free: Option<Instant>,
}

impl RateLimit {
    /// At most `rate` bytes per second (at least 1).
    pub fn new(rate: u64) -> Self {
        Self {
            rate: rate.max(1),
            next_free: None,
        }
    }

    /// Reserves `bytes` at `now`; returns when the transfer may start.
    pub fn reserve(&mut self, bytes: u64, now: Instant) -> Instant {
        let start = self.next_free.map_or(now, |t| t.max(now));
        let cost = Duration::from_secs_f64(bytes as f64 / self.rate as f64);
        self.next_free = Some(start + cost);
        start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_spaced_by_their_size_over_the_rate() {
        let t0 = Instant::now();
        let mut r = RateLimit::new(1000);
        assert_eq!(r.reserve(500, t0), t0);
        assert_eq!(r.reserve(500, t0), t0 + Duration::from_millis(500));
        assert_eq!(r.reserve(1, t0), t0 + Duration::from_secs(1));
        // Idle time is not banked beyond now.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(r.reserve(1, later), later);
    }
}
