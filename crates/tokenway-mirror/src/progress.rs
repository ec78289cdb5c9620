//! The record of completed pieces that lets an interrupted pull resume (sans-IO encoding).
//!
//! One small JSON file per unfinished blob, beside its partial file. A piece is marked only
//! after its verified bytes are written, so the record never claims more than the partial
//! file holds; on resume the puller re-hashes the marked pieces locally anyway, which also
//! covers a crash that lost unflushed writes. The record is encoded whole once; after that a
//! newly done piece rewrites only the two hex digits holding its bit ([`PieceProgress::patch`]),
//! so keeping it current costs the same per piece at 64 KiB pieces as at 64 MiB.

use serde::{Deserialize, Serialize};

use crate::manifest::Blake3Hash;

/// Which pieces of one blob are done.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceProgress {
    /// Blob hash this record belongs to.
    pub hash: Blake3Hash,
    /// Piece size used.
    pub piece_size: u64,
    /// Number of pieces.
    pub pieces: u64,
    /// Bitset of done pieces, hex, bit `i` is byte `i / 8`, mask `1 << (i % 8)`.
    done: String,
    #[serde(skip)]
    bits: Vec<u8>,
    /// Offset of `done`'s digits in the last encoding.
    #[serde(skip)]
    hex_at: Option<usize>,
}

impl PieceProgress {
    /// An empty record.
    pub fn new(hash: Blake3Hash, piece_size: u64, pieces: u64) -> Self {
        Self {
            hash,
            piece_size,
            pieces,
            done: String::new(),
            bits: vec![0; pieces.div_ceil(8) as usize],
            hex_at: None,
        }
    }

    /// Decodes a record; `None` if it is unreadable or for another blob layout (then the
    /// pull starts that blob over).
    pub fn decode(bytes: &[u8], hash: &Blake3Hash, piece_size: u64, pieces: u64) -> Option<Self> {
        let mut p: PieceProgress = serde_json::from_slice(bytes).ok()?;
        if p.hash != *hash || p.piece_size != piece_size || p.pieces != pieces {
            return None;
        }
        p.bits = hex::decode(&p.done).ok()?;
        if p.bits.len() != pieces.div_ceil(8) as usize {
            return None;
        }
        // Bits past the last piece mean nothing (a damaged or hand-made record): cleared, so
        // that they are never counted as done pieces.
        if !pieces.is_multiple_of(8) {
            if let Some(last) = p.bits.last_mut() {
                *last &= (1u8 << (pieces % 8)) - 1;
            }
        }
        Some(p)
    }

    /// Encodes the record.
    pub fn encode(&mut self) -> Vec<u8> {
        self.done = hex::encode(&self.bits);
        let bytes = serde_json::to_vec(self).expect("invariant: PieceProgress always serializes");
        // `done` is the last field and its hex needs no escaping: the record ends `<hex>"}`.
        let at = bytes.len() - 2 - self.done.len();
        debug_assert_eq!(&bytes[at..at + self.done.len()], self.done.as_bytes());
        self.hex_at = Some(at);
        bytes
    }

    /// The bytes that bring the last encoding up to date after piece `i` changed: the offset
    /// of the two hex digits of the bitset byte holding it, and their value now. `None`
    /// before the first [`encode`](Self::encode) or for a piece past the end.
    pub fn patch(&self, i: u64) -> Option<(u64, [u8; 2])> {
        if i >= self.pieces {
            return None;
        }
        let byte = *self.bits.get(usize::try_from(i / 8).ok()?)?;
        let at = self.hex_at? + 2 * (i / 8) as usize;
        let digits = hex::encode([byte]);
        let d = digits.as_bytes();
        Some((at as u64, [d[0], d[1]]))
    }

    /// Is piece `i` done?
    pub fn is_done(&self, i: u64) -> bool {
        i < self.pieces
            && self
                .bits
                .get((i / 8) as usize)
                .is_some_and(|b| b & (1 << (i % 8)) != 0)
    }

    /// Marks piece `i` done or not done.
    pub fn set(&mut self, i: u64, done: bool) {
        if i >= self.pieces {
            return;
        }
        if let Some(b) = self.bits.get_mut((i / 8) as usize) {
            if done {
                *b |= 1 << (i % 8);
            } else {
                *b &= !(1 << (i % 8));
            }
        }
    }

    /// Number of done pieces.
    pub fn done_count(&self) -> u64 {
        self.bits.iter().map(|b| u64::from(b.count_ones())).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_round_trips_and_rejects_other_layouts() {
        let h = Blake3Hash::of(b"x");
        let mut p = PieceProgress::new(h, 1024, 20);
        p.set(0, true);
        p.set(19, true);
        p.set(7, true);
        p.set(7, false);
        let bytes = p.encode();
        let back = PieceProgress::decode(&bytes, &h, 1024, 20).unwrap();
        assert!(back.is_done(0) && back.is_done(19) && !back.is_done(7));
        assert_eq!(back.done_count(), 2);
        assert!(PieceProgress::decode(&bytes, &h, 2048, 20).is_none());
        assert!(PieceProgress::decode(&bytes, &Blake3Hash::of(b"y"), 1024, 20).is_none());
        assert!(PieceProgress::decode(b"{garbage", &h, 1024, 20).is_none());
    }

    #[test]
    fn patching_the_encoding_gives_what_encoding_again_gives() {
        let h = Blake3Hash::of(b"x");
        let mut p = PieceProgress::new(h, 1024, 70);
        assert!(p.patch(3).is_none(), "nothing encoded yet");
        let mut on_disk = p.encode();
        for i in [0, 9, 8, 69, 33, 34, 35, 9] {
            let done = !p.is_done(i);
            p.set(i, done);
            let (at, digits) = p.patch(i).unwrap();
            on_disk[at as usize..at as usize + 2].copy_from_slice(&digits);
            assert_eq!(on_disk, p.clone().encode(), "after piece {i}");
        }
        assert!(p.patch(70).is_none());
        let back = PieceProgress::decode(&on_disk, &h, 1024, 70).unwrap();
        assert_eq!(back.done_count(), p.done_count());
    }

    #[test]
    fn bits_past_the_last_piece_in_a_record_are_not_counted_as_done() {
        let h = Blake3Hash::of(b"x");
        let record = format!(r#"{{"hash":"{h}","piece_size":1024,"pieces":13,"done":"ffff"}}"#);
        let p = PieceProgress::decode(record.as_bytes(), &h, 1024, 13).unwrap();
        assert_eq!(p.done_count(), 13);
        assert!(p.is_done(12) && !p.is_done(13) && !p.is_done(15));
        let record = format!(r#"{{"hash":"{h}","piece_size":1024,"pieces":13,"done":"3fe0"}}"#);
        let mut p = PieceProgress::decode(record.as_bytes(), &h, 1024, 13).unwrap();
        assert_eq!(p.done_count(), 6);
        p.set(14, true);
        assert_eq!(p.done_count(), 6);
    }
}
