//! Single flight: concurrent requests for one key share one execution.
//!
//! The first caller for a key (the leader) starts the work on its own task, so the work
//! finishes for everyone even if the leader's client goes away; later callers (followers)
//! wait for the same result. The entry is removed when the work ends, after its result is
//! published, so a caller arriving later starts afresh (the mirror's work first looks in the
//! cache, so that is a cache hit, not a second origin fetch). The number of keys in flight
//! is bounded; past the bound callers get [`FlightError::Busy`].

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::lock;

/// Why a call got no result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlightError {
    /// Too many keys in flight.
    Busy,
    /// The work panicked or was cancelled.
    Lost,
}

/// Who did the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// This call started the work.
    Leader,
    /// This call joined work already running.
    Follower,
}

struct Flight<V> {
    rx: watch::Receiver<Option<V>>,
    joined: usize,
}

/// Shares one execution per key among concurrent callers.
pub struct SingleFlight<K, V> {
    inflight: Mutex<HashMap<K, Flight<V>>>,
    max_keys: usize,
}

/// Removes the key when the work ends, however it ends.
struct Remove<K: Hash + Eq, V> {
    owner: Arc<SingleFlight<K, V>>,
    key: Option<K>,
}

impl<K: Hash + Eq, V> Drop for Remove<K, V> {
    fn drop(&mut self) {
        if let Some(k) = self.key.take() {
            lock(&self.owner.inflight).remove(&k);
        }
    }
}

impl<K, V> SingleFlight<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// At most `max_keys` keys in flight at once.
    pub fn new(max_keys: usize) -> Arc<Self> {
        Arc::new(Self {
            inflight: Mutex::new(HashMap::new()),
            max_keys: max_keys.max(1),
        })
    }

    /// Runs `work()` for `key` unless it is already running, and returns its result.
    pub async fn run<F, Fut>(self: &Arc<Self>, key: K, work: F) -> Result<(V, Role), FlightError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = V> + Send + 'static,
    {
        let (mut rx, role) = {
            let mut map = lock(&self.inflight);
            if let Some(f) = map.get_mut(&key) {
                f.joined += 1;
                (f.rx.clone(), Role::Follower)
            } else {
                if map.len() >= self.max_keys {
                    return Err(FlightError::Busy);
                }
                let (tx, rx) = watch::channel(None);
                map.insert(
                    key.clone(),
                    Flight {
                        rx: rx.clone(),
                        joined: 1,
                    },
                );
                let fut = work();
                let guard = Remove {
                    owner: Arc::clone(self),
                    key: Some(key),
                };
                tokio::spawn(async move {
                    let v = fut.await;
                    // Publish, then remove (the guard): a caller joining in between still
                    // sees the value at once.
                    let _ = tx.send(Some(v));
                    drop(guard);
                });
                (rx, Role::Leader)
            }
        };
        let v = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| FlightError::Lost)?;
        let v = v.clone().expect("invariant: wait_for returned a Some");
        Ok((v, role))
    }

    /// Callers waiting on `key` (leader included), 0 if it is not in flight.
    pub fn joined(&self, key: &K) -> usize {
        lock(&self.inflight).get(key).map_or(0, |f| f.joined)
    }

    /// Keys in flight.
    pub fn in_flight(&self) -> usize {
        lock(&self.inflight).len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    async fn until(mut cond: impl FnMut() -> bool) {
        while !cond() {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn concurrent_callers_for_one_key_run_the_work_once() {
        let sf = SingleFlight::<u32, u64>::new(16);
        let runs = Arc::new(AtomicUsize::new(0));
        let (gate_tx, gate_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let (sf, runs, mut gate) = (Arc::clone(&sf), Arc::clone(&runs), gate_rx.clone());
            tasks.push(tokio::spawn(async move {
                sf.run(7, move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.wait_for(|open| *open).await;
                    42
                })
                .await
            }));
        }
        until(|| sf.joined(&7) == 10).await;
        gate_tx.send(true).unwrap();
        let mut leaders = 0;
        for t in tasks {
            let (v, role) = t.await.unwrap().unwrap();
            assert_eq!(v, 42);
            leaders += usize::from(role == Role::Leader);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(leaders, 1);
        until(|| sf.in_flight() == 0).await;
        // Once finished, the next call runs the work again.
        let (v, role) = sf.run(7, || async { 43 }).await.unwrap();
        assert_eq!((v, role), (43, Role::Leader));
    }

    #[tokio::test]
    async fn the_work_finishes_for_followers_when_the_leader_goes_away() {
        let sf = SingleFlight::<u32, u64>::new(16);
        let (gate_tx, gate_rx) = watch::channel(false);
        let leader = {
            let (sf, mut gate) = (Arc::clone(&sf), gate_rx.clone());
            tokio::spawn(async move {
                sf.run(1, move || async move {
                    let _ = gate.wait_for(|open| *open).await;
                    5
                })
                .await
            })
        };
        until(|| sf.joined(&1) == 1).await;
        let follower = {
            let sf = Arc::clone(&sf);
            tokio::spawn(async move { sf.run(1, || async { 99 }).await })
        };
        until(|| sf.joined(&1) == 2).await;
        leader.abort();
        gate_tx.send(true).unwrap();
        assert_eq!(follower.await.unwrap().unwrap(), (5, Role::Follower));
    }

    #[tokio::test]
    async fn keys_in_flight_are_bounded() {
        let sf = SingleFlight::<u32, u64>::new(1);
        let (gate_tx, gate_rx) = watch::channel(false);
        let first = {
            let (sf, mut gate) = (Arc::clone(&sf), gate_rx.clone());
            tokio::spawn(async move {
                sf.run(1, move || async move {
                    let _ = gate.wait_for(|open| *open).await;
                    1
                })
                .await
            })
        };
        until(|| sf.in_flight() == 1).await;
        assert_eq!(sf.run(2, || async { 2 }).await, Err(FlightError::Busy));
        gate_tx.send(true).unwrap();
        assert_eq!(first.await.unwrap().unwrap().0, 1);
    }

    #[tokio::test]
    async fn a_panicking_work_is_reported_lost_and_the_key_freed() {
        let sf = SingleFlight::<u32, u64>::new(4);
        let r = sf.run(3, || async { panic!("boom") }).await;
        assert_eq!(r, Err(FlightError::Lost));
        until(|| sf.in_flight() == 0).await;
        assert_eq!(sf.run(3, || async { 8 }).await.unwrap().0, 8);
    }
}
