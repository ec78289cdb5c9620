//! Session affinity: rendezvous hashing with bounded load.
//!
//! A session key is placed on the eligible backend with the highest rendezvous weight
//! `w(key, backend) = H(H(key), H(backend name))` (highest random weight; Thaler & Ravishankar
//! 1998). Every gateway replica that sees the same backends computes the same order with no
//! shared state, and adding or removing a backend only moves the sessions whose top choice
//! changed (about 1/n of them). Weights use the backend's *name*, not its index, so replicas that
//! discovered backends in a different order still agree.
//!
//! Load is bounded as in "Consistent Hashing with Bounded Loads" (Mirrokni, Thorup, Zadimoghaddam
//! 2018): a backend may take the session only while its in-flight count stays within
//! `ceil((1 + ε) × (total in-flight + 1) / n)` over the n candidates; otherwise the next backend
//! in rendezvous order is tried. Such a backend always exists (not every candidate can be above
//! the mean), so a hot session spills to its second choice instead of pinning an overloaded
//! backend, and comes back once the load evens out, again identically on every replica
//! whose load view is similar.
//!
//! This module must never read a clock or keep per-session state: placement is a pure function
//! of the key and the candidates.

use crate::backend::BackendId;
use crate::error::InvalidSetting;
use crate::hash::{combine, stable_hash};

/// Session affinity settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AffinityConfig {
    /// Use session keys at all (default true). Only the `cost` policy honours them.
    pub enabled: bool,
    /// Load slack ε of the bound `(1 + ε) × mean in-flight` (default 0.25; > 0).
    pub epsilon: f64,
    /// Place a session among the backends in the client's region when any is eligible
    /// (default true), so affinity does not send a client across the world.
    pub prefer_client_region: bool,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            epsilon: 0.25,
            prefer_client_region: true,
        }
    }
}

impl AffinityConfig {
    /// Check ranges.
    ///
    /// # Errors
    ///
    /// [`InvalidSetting`] naming `affinity.epsilon` when it is not a finite number > 0.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return Err(InvalidSetting::new(
                "affinity.epsilon",
                "a number > 0 (0.25 is typical)",
                self.epsilon,
            ));
        }
        Ok(())
    }
}

/// The stable hash of a session key string.
pub(crate) fn key_hash(key: &str) -> u64 {
    stable_hash(key.as_bytes())
}

/// The stable hash of a backend name (cached per backend by the router).
pub(crate) fn backend_hash(name: &str) -> u64 {
    stable_hash(name.as_bytes())
}

/// The rendezvous weight of a key on a backend.
pub(crate) fn weight(key_hash: u64, backend_hash: u64) -> u64 {
    combine(key_hash, backend_hash)
}

/// One candidate for placement.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot {
    pub(crate) id: BackendId,
    pub(crate) name_hash: u64,
    pub(crate) inflight: u32,
}

/// Where a session went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) id: BackendId,
    /// Its position in rendezvous order (0: the session's home backend; > 0: spilled).
    pub(crate) rank: usize,
}

/// The in-flight bound `ceil((1 + ε) × (total + 1) / n)` for `n` candidates (n ≥ 1).
pub(crate) fn load_bound(total_inflight: u64, n: usize, epsilon: f64) -> u64 {
    let mean = (total_inflight as f64 + 1.0) / n.max(1) as f64;
    ((1.0 + epsilon) * mean).ceil().max(1.0) as u64
}

/// Place `key_hash` on the highest-weight slot whose load stays within the bound. `None` only
/// when `slots` is empty.
pub(crate) fn place(key_hash: u64, slots: &[Slot], epsilon: f64) -> Option<Placement> {
    let total: u64 = slots.iter().map(|s| u64::from(s.inflight)).sum();
    let bound = load_bound(total, slots.len(), epsilon);
    let mut order: Vec<(u64, BackendId, u32)> = slots
        .iter()
        .map(|s| (weight(key_hash, s.name_hash), s.id, s.inflight))
        .collect();
    // Highest weight first; ids break (astronomically unlikely) ties deterministically.
    order.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let fits = |&(_, _, inflight): &(u64, BackendId, u32)| u64::from(inflight) < bound;
    order
        .iter()
        .position(fits)
        .or(if order.is_empty() { None } else { Some(0) })
        .map(|rank| Placement {
            id: order[rank].1,
            rank,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(names: &[&str], inflight: &[u32]) -> Vec<Slot> {
        names
            .iter()
            .zip(inflight)
            .enumerate()
            .map(|(i, (n, &f))| Slot {
                id: BackendId(i),
                name_hash: backend_hash(n),
                inflight: f,
            })
            .collect()
    }

    #[test]
    fn bound_is_one_plus_epsilon_times_the_mean_with_the_new_request() {
        assert_eq!(load_bound(0, 4, 0.25), 1);
        assert_eq!(load_bound(7, 4, 0.25), 3); // 1.25 × 2 = 2.5 → 3
        assert_eq!(load_bound(39, 4, 0.25), 13); // 1.25 × 10 = 12.5 → 13
    }

    #[test]
    fn keys_spread_over_backends_roughly_evenly() {
        let s = slots(&["a:8000", "b:8000", "c:8000", "d:8000"], &[0; 4]);
        let mut counts = [0u32; 4];
        for k in 0..4000 {
            let p = place(key_hash(&format!("session-{k}")), &s, 0.25).expect("slots");
            counts[p.id.0] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
    }

    #[test]
    fn placement_ignores_the_order_backends_were_listed_in() {
        let names = ["a:1", "b:1", "c:1", "d:1", "e:1"];
        let fwd = slots(&names, &[0; 5]);
        let mut rev: Vec<Slot> = fwd.clone();
        rev.reverse();
        for k in 0..200 {
            let h = key_hash(&format!("k{k}"));
            assert_eq!(place(h, &fwd, 0.25), place(h, &rev, 0.25));
        }
    }

    #[test]
    fn an_overloaded_home_backend_spills_to_the_next_in_rendezvous_order() {
        let s = slots(&["a", "b", "c"], &[0, 0, 0]);
        let h = key_hash("hot");
        let home = place(h, &s, 0.25).expect("slots");
        assert_eq!(home.rank, 0);
        let mut loaded = s.clone();
        loaded[home.id.0].inflight = 10;
        let spilled = place(h, &loaded, 0.25).expect("slots");
        assert_ne!(spilled.id, home.id);
        assert_eq!(spilled.rank, 1);
    }
}
