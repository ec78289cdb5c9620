//! A byte-rate cap (`--limit-rate` of a pull, or of a mirror's uplink), so a transfer can leave
//! room for other traffic. [`RateLimit`] is sans-IO pacing: each transfer reserves its bytes
//! on a virtual clock that advances at the allowed rate; the caller sleeps until its slot.
//! [`Pacer`] is the queue in front of it for a server, whose waiters may leave.

use std::sync::{Mutex, PoisonError};
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

    /// When a transfer asked for at `now` could start.
    pub fn free_at(&self, now: Instant) -> Instant {
        self.next_free.map_or(now, |t| t.max(now))
    }
}

/// A FIFO queue in front of a [`RateLimit`] whose waiters take their slot only when their
/// turn comes. Reserving on arrival would let every waiter that leaves the queue keep its
/// slot: on a server, a puller that hedged the piece elsewhere, timed out or was stopped; in a
/// pull, a hedge dropped because the first source answered. The link then idles through slots
/// nobody uses (a server's queue grew past the pullers' patience and almost nothing got
/// through; a pull ran below its `--limit-rate` by the share of hedges it lost).
#[derive(Debug)]
pub struct Pacer {
    turn: tokio::sync::Mutex<()>,
    clock: Mutex<RateLimit>,
}

impl Pacer {
    /// At most `rate` bytes per second.
    pub fn new(rate: u64) -> Self {
        Self {
            turn: tokio::sync::Mutex::new(()),
            clock: Mutex::new(RateLimit::new(rate)),
        }
    }

    /// Waits until `bytes` may be sent (the waiters before it have had their time), then
    /// takes their time. Dropped before that, it has taken nothing.
    pub async fn pace(&self, bytes: u64) {
        // tokio's Mutex serves its waiters in order.
        let _turn = self.turn.lock().await;
        let free = self
            .clock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .free_at(tokio::time::Instant::now().into_std());
        tokio::time::sleep_until(free.into()).await;
        self.clock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .reserve(bytes, tokio::time::Instant::now().into_std());
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

    #[tokio::test(start_paused = true)]
    async fn waiters_that_leave_the_queue_cost_the_uplink_nothing() {
        let t0 = tokio::time::Instant::now();
        let pacer = std::sync::Arc::new(Pacer::new(1000));
        // One transfer now (0..1 s), then five that give up after 1.5 s: the first of them
        // gets its turn at 1 s (1..2 s), the others leave while waiting.
        pacer.pace(1000).await;
        let waiters: Vec<_> = (0..5)
            .map(|_| {
                let p = pacer.clone();
                tokio::spawn(async move {
                    tokio::time::timeout(Duration::from_millis(1500), p.pace(1000))
                        .await
                        .is_ok()
                })
            })
            .collect();
        let mut served = 0;
        for w in waiters {
            served += usize::from(w.await.unwrap());
        }
        assert_eq!(served, 1);
        // The next transfer starts when the one served is done (2 s), not after the slots of
        // the four that left (6 s).
        pacer.pace(1000).await;
        let started = t0.elapsed();
        assert!(
            started >= Duration::from_secs(2) && started < Duration::from_millis(2100),
            "{started:?}"
        );
    }
}
