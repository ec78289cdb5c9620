//! Requests that wait for a backend slot.
//!
//! When every healthy backend that serves a model is at its `max_inflight`, a request waits here
//! instead of being refused at once. A 503 with `Retry-After: 1` costs the client at least a
//! second, while a slot on a busy GPU usually frees within a fraction of one. The wait is bounded
//! twice: at most `queue_max` requests wait at once, and each waits at most `timeouts.queue_ms`.
//! Past either bound the request gets the 503 as before.
//!
//! A waiting request is routed again when a slot frees ([`Admission::slot_freed`], called where
//! an attempt ends or a reserved slot goes unused). It then goes to whichever backend the router ranks best at that
//! moment: late binding, not a place in one backend's line. Wake-ups go to the longest-waiting
//! request first (`tokio::sync::Notify` wakes its waiters in the order they came). A request
//! that arrives while others wait is still routed at once if a slot is free. A slot can free
//! on a backend that serves only other models than the one the woken request needs, and the
//! request for that backend then sleeps on. So every waiter also looks again every
//! [`RECHECK`], which bounds how long such a slot stays unused; it keeps its place in line
//! while it does.
//!
//! Nothing here costs a request that does not wait: [`Admission::slot_freed`] is one atomic load
//! while nobody waits.

use std::time::Duration;

use tokenway_telemetry::{Counter, Gauge, Registry};
use tokio::sync::Notify;
use tokio::time::Instant;

/// How often a waiting request looks for a slot without being woken.
pub const RECHECK: Duration = Duration::from_millis(100);

/// Why a request stopped waiting without a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// `queue_max` requests were already waiting (or the queue is off: `queue_max = 0`).
    Full,
    /// It waited `timeouts.queue_ms` and no slot came.
    TimedOut,
}

/// The requests waiting for a slot, and their metrics.
pub struct Admission {
    notify: Notify,
    /// `tokenway_queue_waiting`: requests waiting now. It is also the count the bound and
    /// [`Admission::slot_freed`] read.
    waiting: Gauge,
    max: i64,
    /// `tokenway_queue_admitted_total`: requests that waited and then were routed.
    admitted: Counter,
    /// `tokenway_queue_refused_total`: requests refused because the queue was full or their
    /// wait ran out.
    refused: Counter,
}

impl Admission {
    /// A queue for at most `max` waiting requests (0: none wait), its metrics registered in
    /// `registry`.
    pub fn new(max: usize, registry: &mut Registry) -> Self {
        let a = Self {
            notify: Notify::new(),
            waiting: Gauge::default(),
            max: i64::try_from(max).unwrap_or(i64::MAX),
            admitted: Counter::default(),
            refused: Counter::default(),
        };
        registry.register(
            "queue_waiting",
            "Requests waiting for a backend slot (every backend of their model at max_inflight)",
            a.waiting.clone(),
        );
        registry.register(
            "queue_admitted",
            "Requests that waited for a backend slot and then were routed",
            a.admitted.clone(),
        );
        registry.register(
            "queue_refused",
            "Requests refused with a 503 because the wait queue was full or their wait ran out",
            a.refused.clone(),
        );
        a
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        usize::try_from(self.waiting.get()).unwrap_or(0)
    }

    /// A slot freed on some backend: wakes the longest-waiting request, if any.
    pub fn slot_freed(&self) {
        if self.waiting.get() > 0 {
            self.notify.notify_one();
        }
    }

    /// Calls `attempt` until it returns `Some` (it found a slot, or failed for a reason other
    /// than a full backend), once at once and then each time a slot frees or [`RECHECK`]
    /// passes, for at most `timeout`. `attempt` returns `None` while every backend is full.
    pub async fn wait_for<R>(
        &self,
        timeout: Duration,
        mut attempt: impl FnMut() -> Option<R>,
    ) -> Result<R, Refused> {
        if self.waiting.inc() >= self.max {
            self.waiting.dec();
            self.refused.inc();
            return Err(Refused::Full);
        }
        let _place = Place(&self.waiting);
        let deadline = Instant::now() + timeout;
        // In the line before the first look, so that a slot freed between a look and the wait
        // still wakes this request. The place is kept through rechecks and given up only for
        // a wake-up this request used: taking a new one would send it to the back of the line.
        let notified = self.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        loop {
            if let Some(r) = attempt() {
                self.admitted.inc();
                return Ok(r);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.refused.inc();
                return Err(Refused::TimedOut);
            }
            if tokio::time::timeout(left.min(RECHECK), notified.as_mut())
                .await
                .is_ok()
            {
                // Woken: a new place (at the back) before looking again.
                notified.set(self.notify.notified());
                notified.as_mut().enable();
            }
        }
    }
}

/// A waiting request's place: given back however the wait ends (a slot, a refusal, or the
/// client going away, which drops the request's future).
struct Place<'a>(&'a Gauge);

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use super::*;

    /// `slots` free slots; `take` takes one if there is one.
    struct Slots(AtomicUsize);

    impl Slots {
        fn take(&self) -> Option<()> {
            self.0
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .ok()
                .map(|_| ())
        }
        fn free(&self, admission: &Admission) {
            self.0.fetch_add(1, Ordering::AcqRel);
            admission.slot_freed();
        }
    }

    fn admission(max: usize) -> Arc<Admission> {
        Arc::new(Admission::new(max, &mut Registry::default()))
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_get_freed_slots_in_the_order_they_came() {
        let a = admission(8);
        let slots = Arc::new(Slots(AtomicUsize::new(0)));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..4 {
            let (a, slots, order) = (a.clone(), slots.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let got = a.wait_for(Duration::from_secs(60), || slots.take()).await;
                order.lock().expect("order").push(i);
                got
            }));
            // Each is in the line before the next comes.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(a.waiting(), 4);
        let start = Instant::now();
        for i in 0..4 {
            slots.free(&a);
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
            // The wake-up, not a recheck, handed the slot on: no time passed.
            assert_eq!(*order.lock().expect("order"), (0..=i).collect::<Vec<_>>());
            assert_eq!(Instant::now(), start);
        }
        for t in tasks {
            assert_eq!(t.await.expect("task"), Ok(()));
        }
        assert_eq!(a.waiting(), 0);
        assert_eq!(a.admitted.get(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_recheck_keeps_the_waiters_place_in_line() {
        let a = admission(8);
        let slots = Arc::new(Slots(AtomicUsize::new(0)));
        let spawn = |tag: &'static str| {
            let (a, slots) = (a.clone(), slots.clone());
            tokio::spawn(async move {
                a.wait_for(Duration::from_secs(60), || slots.take())
                    .await
                    .map(|()| tag)
            })
        };
        let first = spawn("first");
        tokio::time::sleep(RECHECK * 6 / 10).await;
        let second = spawn("second");
        // The first has looked again once meanwhile; it is still first in line.
        tokio::time::sleep(RECHECK * 6 / 10).await;
        slots.free(&a);
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        assert!(first.is_finished() && !second.is_finished());
        assert_eq!(first.await.expect("task"), Ok("first"));
        slots.free(&a);
        assert_eq!(second.await.expect("task"), Ok("second"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_at_once_and_a_wait_that_runs_out_is_refused() {
        let a = admission(1);
        let never = || None::<()>;
        let first = {
            let a = a.clone();
            tokio::spawn(async move { a.wait_for(Duration::from_millis(300), never).await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(a.waiting(), 1);
        // The one place is taken.
        assert_eq!(
            a.wait_for(Duration::from_secs(1), never).await,
            Err(Refused::Full)
        );
        assert_eq!(first.await.expect("task"), Err(Refused::TimedOut));
        assert_eq!(a.waiting(), 0);
        assert_eq!(a.refused.get(), 2);
        // No queue at all: refused without waiting.
        let none = admission(0);
        assert_eq!(
            none.wait_for(Duration::from_secs(1), never).await,
            Err(Refused::Full)
        );
        assert_eq!(none.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_that_frees_without_a_wake_up_is_found_by_the_recheck() {
        let a = admission(4);
        let slots = Arc::new(Slots(AtomicUsize::new(0)));
        let waiter = {
            let (a, slots) = (a.clone(), slots.clone());
            tokio::spawn(async move { a.wait_for(Duration::from_secs(10), || slots.take()).await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        // Freed where the queue does not hear of it (another model's backend, say).
        slots.0.fetch_add(1, Ordering::AcqRel);
        tokio::time::sleep(RECHECK * 2).await;
        assert!(waiter.is_finished());
        assert_eq!(waiter.await.expect("task"), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_goes_away_gives_its_place_back() {
        let a = admission(1);
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.wait_for(Duration::from_secs(10), || None::<()>).await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(a.waiting(), 1);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(a.waiting(), 0);
        let slots = Slots(AtomicUsize::new(1));
        assert_eq!(
            a.wait_for(Duration::from_secs(1), || slots.take()).await,
            Ok(())
        );
    }
}
