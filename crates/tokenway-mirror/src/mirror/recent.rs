//! Pieces the mirror fetched from the origin moments ago, kept in memory for the requests
//! that arrive just after the single flight that fetched them ended.
//!
//! Nodes that scale up together ask for the same pieces within a short time of each other:
//! the requests that overlap a piece's origin fetch share it ([`super::single_flight`]), and
//! those that come a little later would otherwise read it back from the disk cache, which
//! is written around the page cache ([`super::cache`]). A few dozen pieces in memory cover
//! that window, so a crowd costs the disk one write per piece and no reads. Bounded by
//! bytes; oldest out first; a piece is only ever inserted after it was verified. The same
//! structure keeps the outboards verified last ([`super::manifests`]).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use bytes::Bytes;

use super::cache::PieceKey;

/// Bytes of recently fetched pieces kept in memory (64 pieces of 4 MiB).
pub const RECENT_BYTES: usize = 256 << 20;

/// The most recently fetched pieces.
pub type RecentPieces = Recent<PieceKey>;

/// The most recently inserted verified byte strings, at most `max_bytes` of them.
#[derive(Debug)]
pub struct Recent<K> {
    pieces: HashMap<K, Bytes>,
    /// Insertion order, oldest first (a map lookup per request, not a scan: with 64 KiB
    /// pieces the bound holds thousands).
    order: VecDeque<K>,
    bytes: usize,
    max_bytes: usize,
}

impl<K: Clone + Eq + Hash> Recent<K> {
    /// Empty, holding at most `max_bytes`.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            pieces: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            max_bytes,
        }
    }

    /// The piece, if it is still here (a cheap clone of the same bytes).
    pub fn get(&self, k: &K) -> Option<Bytes> {
        self.pieces.get(k).cloned()
    }

    /// Keeps a verified piece, dropping the oldest to stay within the bound.
    pub fn insert(&mut self, k: K, piece: Bytes) {
        if piece.len() > self.max_bytes || self.pieces.contains_key(&k) {
            return;
        }
        self.bytes += piece.len();
        self.pieces.insert(k.clone(), piece);
        self.order.push_back(k);
        while self.bytes > self.max_bytes {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(b) = self.pieces.remove(&old) {
                self.bytes -= b.len();
            }
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::Blake3Hash;

    fn key(index: u64) -> PieceKey {
        PieceKey {
            hash: Blake3Hash::of(b"blob"),
            piece_size: 100,
            index,
        }
    }

    #[test]
    fn recent_pieces_stay_within_their_bound_oldest_out_first() {
        let mut r = RecentPieces::new(250);
        for i in 0..4 {
            r.insert(key(i), Bytes::from(vec![i as u8; 100]));
            assert!(r.bytes() <= 250);
        }
        assert!(r.get(&key(0)).is_none());
        assert!(r.get(&key(1)).is_none());
        assert_eq!(r.get(&key(3)).unwrap(), vec![3u8; 100]);
        assert_eq!(r.bytes(), 200);
        // Larger than the bound: never kept, nothing evicted for it.
        r.insert(key(9), Bytes::from(vec![0u8; 300]));
        assert!(r.get(&key(9)).is_none());
        assert_eq!(r.bytes(), 200);
    }
}
