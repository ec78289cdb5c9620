//! Test-only fault injection for mirrors and peers: corrupt one byte of every Nth piece
//! served, so the end-to-end tests can prove that pullers detect, discard, refetch and
//! penalise; and stall every Nth piece (a bounded number of times), so they can prove that
//! stragglers are hedged. Off unless a `--test-corrupt-every N` / `--test-stall-every N`
//! flag is given; documented in `docs/weights.md` as a testing aid, never for production.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};

/// Fault settings and their counter.
#[derive(Debug, Default)]
pub struct Faults {
    corrupt_every: u64,
    served: AtomicU64,
    injected: AtomicU64,
    stall_every: u64,
    stall_for: Duration,
    stall_max: u64,
    stall_seen: AtomicU64,
    stalled: AtomicU64,
}

impl Faults {
    /// Corrupt every `n`th piece served (0 = never).
    pub fn corrupt_every(n: u64) -> Self {
        Self {
            corrupt_every: n,
            ..Self::default()
        }
    }

    /// Also stall every `n`th piece served for `d`, at most `max` times (0 = off).
    pub fn with_stalls(mut self, n: u64, d: Duration, max: u64) -> Self {
        self.stall_every = n;
        self.stall_for = d;
        self.stall_max = max;
        self
    }

    /// How long to hold the next piece back, if it is due a stall.
    pub fn stall(&self) -> Option<Duration> {
        if self.stall_every == 0 {
            return None;
        }
        let n = self.stall_seen.fetch_add(1, Ordering::Relaxed) + 1;
        if !n.is_multiple_of(self.stall_every) {
            return None;
        }
        let k = self.stalled.fetch_add(1, Ordering::Relaxed);
        (k < self.stall_max).then_some(self.stall_for)
    }

    /// Passes `piece` through, or a copy with its middle byte flipped when it is due.
    pub fn apply(&self, piece: Bytes) -> Bytes {
        if self.corrupt_every == 0 || piece.is_empty() {
            return piece;
        }
        let n = self.served.fetch_add(1, Ordering::Relaxed) + 1;
        if !n.is_multiple_of(self.corrupt_every) {
            return piece;
        }
        self.injected.fetch_add(1, Ordering::Relaxed);
        let mut b = BytesMut::from(&piece[..]);
        let mid = b.len() / 2;
        b[mid] ^= 0x5a;
        b.freeze()
    }

    /// Pieces corrupted so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nth_piece_is_corrupted_once() {
        let f = Faults::corrupt_every(3);
        let p = Bytes::from_static(b"abcdef");
        let out: Vec<bool> = (0..6).map(|_| f.apply(p.clone()) != p).collect();
        assert_eq!(out, [false, false, true, false, false, true]);
        assert_eq!(f.injected(), 2);
        assert_eq!(Faults::default().apply(p.clone()), p);
    }

    #[test]
    fn stalls_are_every_nth_and_bounded() {
        let f = Faults::default().with_stalls(2, Duration::from_millis(5), 2);
        let out: Vec<bool> = (0..8).map(|_| f.stall().is_some()).collect();
        assert_eq!(out, [false, true, false, true, false, false, false, false]);
        assert_eq!(Faults::default().stall(), None);
    }
}
