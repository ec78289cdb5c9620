//! Test-only fault injection for mirrors and peers: corrupt one byte of every Nth piece
//! served, so the end-to-end tests can prove that pullers detect, discard, refetch and
//! penalise. Off unless a `--test-corrupt-every N` flag is given; documented in
//! `docs/weights.md` as a testing aid, never for production.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};

/// Fault settings and their counter.
#[derive(Debug, Default)]
pub struct Faults {
    corrupt_every: u64,
    served: AtomicU64,
    injected: AtomicU64,
}

impl Faults {
    /// Corrupt every `n`th piece served (0 = never).
    pub fn corrupt_every(n: u64) -> Self {
        Self {
            corrupt_every: n,
            ..Self::default()
        }
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
}
