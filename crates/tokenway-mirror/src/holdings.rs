//! What this node holds: for every blob of the pull, where its bytes are (the partial file,
//! then the final file), which pieces are verified and which are being fetched. Pull writes
//! it, the peer server and the announcer read it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::lock;
use crate::manifest::{Blake3Hash, FileEntry};
use crate::mirror::peers::MAX_ANNOUNCED_PIECES;
use crate::piece_bits::{PieceBits, PieceBitsWire};

/// Piece bitsets by blob, as announced.
pub type WireBits = HashMap<Blake3Hash, PieceBitsWire>;

struct Held {
    entry: Arc<FileEntry>,
    path: PathBuf,
    bits: PieceBits,
    /// Pieces being fetched now.
    taking: PieceBits,
}

/// Verified pieces on this node, by blob.
#[derive(Default)]
pub struct Holdings {
    blobs: Mutex<HashMap<Blake3Hash, Held>>,
}

impl Holdings {
    /// A blob whose bytes are (or will be) at `path`, with `bits` already verified.
    pub fn add(&self, entry: &FileEntry, path: PathBuf, bits: PieceBits) {
        lock(&self.blobs).insert(
            entry.hash,
            Held {
                entry: Arc::new(entry.clone()),
                path,
                taking: PieceBits::empty(bits.count()),
                bits,
            },
        );
    }

    /// Piece `i` of `hash` is verified and written.
    pub fn piece_written(&self, hash: &Blake3Hash, i: u64) {
        if let Some(h) = lock(&self.blobs).get_mut(hash) {
            h.bits.set(i);
            h.taking.clear(i);
        }
    }

    /// Piece `i` of `hash` is being fetched (`true`) or no longer (`false`: written, failed
    /// or given up).
    pub fn taking(&self, hash: &Blake3Hash, i: u64, on: bool) {
        if let Some(h) = lock(&self.blobs).get_mut(hash) {
            if on {
                h.taking.set(i);
            } else {
                h.taking.clear(i);
            }
        }
    }

    /// The blob moved to its final place, complete.
    pub fn placed(&self, hash: &Blake3Hash, path: PathBuf) {
        if let Some(h) = lock(&self.blobs).get_mut(hash) {
            h.path = path;
            h.bits = PieceBits::full(h.bits.count());
        }
    }

    /// Layout and file of `hash` if piece `i` is held.
    pub fn piece(&self, hash: &Blake3Hash, i: u64) -> Option<(Arc<FileEntry>, PathBuf)> {
        let blobs = lock(&self.blobs);
        let h = blobs.get(hash)?;
        h.bits
            .has(i)
            .then(|| (Arc::clone(&h.entry), h.path.clone()))
    }

    /// Layout of `hash`, if it is part of this node's pull.
    pub fn entry(&self, hash: &Blake3Hash) -> Option<Arc<FileEntry>> {
        lock(&self.blobs).get(hash).map(|h| Arc::clone(&h.entry))
    }

    /// What to announce: the pieces held and the pieces being fetched, together within
    /// the mirror's [`MAX_ANNOUNCED_PIECES`] bits. Every bitset is a whole blob's, so a pull
    /// fetching pieces of every blob of a large model would announce its piece count twice and
    /// be refused altogether: `taking` is left out, largest blobs first, until it fits. A
    /// model of more pieces than that (500 GB at 256 KiB pieces) cannot list even what it holds
    /// of every blob: the blobs it holds least of are left out (others learn of fewer pieces,
    /// instead of every announcement being refused and peer sharing stopping).
    pub fn wire(&self) -> (WireBits, WireBits) {
        let blobs = lock(&self.blobs);
        let mut held: Vec<_> = blobs
            .iter()
            .map(|(k, h)| (*k, h.bits.present(), h.bits.count()))
            .collect();
        let mut have_bits = held.iter().fold(0u64, |n, (_, _, c)| n.saturating_add(*c));
        if have_bits > MAX_ANNOUNCED_PIECES {
            // Most held first; ties: smaller blobs first (more of them fit).
            held.sort_by_key(|(_, present, count)| (std::cmp::Reverse(*present), *count));
            while have_bits > MAX_ANNOUNCED_PIECES {
                let Some((_, _, c)) = held.pop() else { break };
                have_bits -= c;
            }
        }
        let have: WireBits = held
            .iter()
            .filter_map(|(k, _, _)| Some((*k, blobs.get(k)?.bits.to_wire())))
            .collect();
        let mut taking: Vec<_> = blobs
            .iter()
            .filter(|(_, h)| h.taking.present() > 0)
            .map(|(k, h)| (*k, h.taking.to_wire()))
            .collect();
        let mut bits = have
            .values()
            .chain(taking.iter().map(|(_, w)| w))
            .fold(0u64, |n, w| n.saturating_add(w.count));
        taking.sort_by_key(|(_, w)| w.count);
        while bits > MAX_ANNOUNCED_PIECES {
            let Some((_, w)) = taking.pop() else { break };
            bits -= w.count;
        }
        (have, taking.into_iter().collect())
    }

    /// Of `blobs`, those not yet held whole (those this node still wants from others); a blob
    /// this node does not track counts as wanted.
    pub fn missing(&self, blobs: &[Blake3Hash]) -> Vec<Blake3Hash> {
        let held = lock(&self.blobs);
        blobs
            .iter()
            .filter(|h| {
                held.get(h)
                    .is_none_or(|b| b.bits.present() < b.bits.count())
            })
            .copied()
            .collect()
    }

    /// Blob hashes.
    pub fn hashes(&self) -> Vec<Blake3Hash> {
        lock(&self.blobs).keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::PieceHashing;

    /// A blob named `name` of `pieces` pieces (their hashes do not matter here).
    fn entry(name: &str, pieces: u64) -> FileEntry {
        FileEntry {
            path: name.into(),
            size: pieces * 1024,
            hash: Blake3Hash::of(name.as_bytes()),
            piece_size: 1024,
            pieces: (0..pieces)
                .map(|i| Blake3Hash::of(&i.to_le_bytes()))
                .collect(),
            group_size: None,
            piece_hashing: PieceHashing::Standalone,
        }
    }

    #[test]
    fn a_blob_held_whole_is_no_longer_wanted() {
        let a = entry("a", 3);
        let b = entry("b", 2);
        let h = Holdings::default();
        h.add(&a, "a".into(), PieceBits::empty(3));
        h.add(&b, "b".into(), PieceBits::full(2));
        let unknown = Blake3Hash::of(b"not tracked");
        assert_eq!(h.missing(&[a.hash, b.hash, unknown]), vec![a.hash, unknown]);
        for i in 0..3 {
            h.piece_written(&a.hash, i);
        }
        assert_eq!(h.missing(&[a.hash, b.hash]), Vec::<Blake3Hash>::new());
    }

    #[test]
    fn what_is_being_fetched_is_left_out_before_the_announcement_grows_past_the_limit() {
        // Two blobs of a quarter of the limit each (one a piece larger), a piece of each in
        // flight: held and taken together would be a little over the limit.
        let n = MAX_ANNOUNCED_PIECES / 4;
        let a = entry("a", 4);
        let b = entry("b", 4);
        let h = Holdings::default();
        h.add(&a, "a".into(), PieceBits::empty(n));
        h.add(&b, "b".into(), PieceBits::empty(n + 1));
        h.taking(&a.hash, 0, true);
        h.taking(&b.hash, 0, true);
        let (have, taking) = h.wire();
        assert_eq!(have.len(), 2);
        // One bitset of `taking` fits beside `have`; the larger one is left out.
        assert_eq!(taking.keys().collect::<Vec<_>>(), vec![&a.hash]);
        let announced: u64 = have.values().chain(taking.values()).map(|w| w.count).sum();
        assert!(announced <= MAX_ANNOUNCED_PIECES);
    }

    #[test]
    fn a_model_of_more_pieces_than_an_announcement_takes_lists_the_blobs_it_holds_most_of() {
        // Three blobs of half the limit each: all three are over it.
        let n = MAX_ANNOUNCED_PIECES / 2;
        let (a, b, c) = (entry("a", 4), entry("b", 4), entry("c", 4));
        let h = Holdings::default();
        let mut some = PieceBits::empty(n);
        some.set(0);
        some.set(1);
        let mut one = PieceBits::empty(n);
        one.set(5);
        h.add(&a, "a".into(), one);
        h.add(&b, "b".into(), some);
        h.add(&c, "c".into(), PieceBits::empty(n));
        h.taking(&c.hash, 3, true);
        let (have, taking) = h.wire();
        let mut listed: Vec<_> = have.keys().copied().collect();
        listed.sort();
        let mut want = vec![a.hash, b.hash];
        want.sort();
        assert_eq!(listed, want, "the blob held least of is left out");
        assert!(taking.is_empty());
        let announced: u64 = have.values().chain(taking.values()).map(|w| w.count).sum();
        assert!(announced <= MAX_ANNOUNCED_PIECES, "{announced}");
    }
}
