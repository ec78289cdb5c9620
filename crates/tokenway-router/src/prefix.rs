//! Prefix index: which prompt blocks a backend probably still holds in its KV cache.
//!
//! Engines with automatic prefix caching (vLLM, SGLang) keep the KV blocks of recent prompts
//! and skip the prefill of a prompt's longest cached prefix. The router cannot see their
//! caches, so it keeps its own estimate: the prompt is cut into fixed-size byte blocks, block
//! `i` is named by a chained hash `h_i = H(h_{i-1}, block_i)` (so a hash names the whole prefix
//! up to and including its block, as in vLLM's block hashing), and every request routed to a
//! backend inserts its hashes into that backend's index.
//!
//! The index is an LRU set with a bound on entries. Within one insert the blocks are touched
//! from last to first, so a block is always at least as recent as every block that extends it.
//! LRU therefore evicts the deepest blocks of the least recent prompts first and never leaves a
//! hole in a chain: "block `i` present" implies "blocks `0..i` present". That monotonicity lets
//! [`PrefixIndex::cached_prefix`] binary-search the prompt (O(log n) lookups per backend, which
//! keeps ranking 64 backends within the decision budget) instead of walking it.
//!
//! Estimates can be wrong in both directions (the engine evicts under its own memory
//! pressure; 64-bit hashes can collide); they only steer ranking, never correctness.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use serde::Serialize;

use crate::hash::stable_hash_chained;

/// Chain seed of the first block, so that `h_0` differs from a hash of the bare block.
const CHAIN_SEED: u64 = 0x746f_6b65_6e77_6179; // "tokenway"

/// The chained hash of one prompt block (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct BlockHash(pub u64);

/// Cut `text` into blocks of `block_bytes` bytes (the last one may be shorter) and return
/// their chained hashes: `h_0 = H(seed, block_0)`, `h_i = H(h_{i-1}, block_i)`, with the stable
/// hash of [`crate::hash`], so every gateway replica and release computes the same values.
///
/// A `block_bytes` of 0 yields no blocks. A trailing partial block is included: two prompts
/// that share it share that prefix too, and a prompt that extends it gets a different hash for
/// its (longer) block, which is exactly "not cached". Use the same `block_bytes` everywhere.
pub fn prompt_blocks(text: &[u8], block_bytes: usize) -> Vec<BlockHash> {
    if block_bytes == 0 {
        return Vec::new();
    }
    let mut prev = CHAIN_SEED;
    text.chunks(block_bytes)
        .map(|block| {
            prev = stable_hash_chained(prev, block);
            BlockHash(prev)
        })
        .collect()
}

/// A hasher for keys that already are well-mixed 64-bit hashes: it passes them through.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys; fold the bytes so the hasher stays correct.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type BlockMap<V> = HashMap<BlockHash, V, BuildHasherDefault<PassThroughHasher>>;

/// One backend's LRU set of block hashes, bounded to `capacity` entries.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    capacity: usize,
    clock: u64,
    /// Block → the clock value of its last touch.
    stamps: BlockMap<u64>,
    /// Clock value → block, oldest first: the eviction order.
    order: BTreeMap<u64, BlockHash>,
}

impl PrefixIndex {
    /// An empty index holding at most `capacity` blocks (0 disables it).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            clock: 0,
            stamps: BlockMap::default(),
            order: BTreeMap::new(),
        }
    }

    /// Record that the backend now holds `blocks` (a prompt routed to it), evicting the least
    /// recently touched blocks beyond the capacity.
    pub fn insert(&mut self, blocks: &[BlockHash]) {
        if self.capacity == 0 {
            return;
        }
        // Last to first: leading blocks end up the most recent (see the module docs).
        for &b in blocks.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.stamps.insert(b, self.clock) {
                self.order.remove(&old);
            }
            self.order.insert(self.clock, b);
        }
        while self.stamps.len() > self.capacity {
            let Some((_, b)) = self.order.pop_first() else {
                break;
            };
            self.stamps.remove(&b);
        }
    }

    /// How many leading blocks of `blocks` the index holds. Does not change recency.
    pub fn cached_prefix(&self, blocks: &[BlockHash]) -> usize {
        // Binary search for the first missing block; valid because presence is monotone
        // along a chain (module docs).
        let (mut lo, mut hi) = (0, blocks.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.stamps.contains_key(&blocks[mid]) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.stamps.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }

    /// The entry bound.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forget everything (the backend restarted and lost its cache).
    pub fn clear(&mut self) {
        self.stamps.clear();
        self.order.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_chained_so_a_shared_prefix_shares_hashes() {
        let a = prompt_blocks(b"system prompt...user: hello", 8);
        let b = prompt_blocks(b"system prompt...user: bye!!", 8);
        assert_eq!(a.len(), 4);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Same block content at a different position gets a different hash.
        let c = prompt_blocks(b"abcdabcd", 4);
        assert_ne!(c[0], c[1]);
    }

    #[test]
    fn block_hashes_are_stable_values() {
        // Pinned: replicas and releases must compute the same hashes.
        let h = prompt_blocks(b"hello world", 4);
        assert_eq!(h, prompt_blocks(b"hello world", 4));
        assert_eq!(h.len(), 3);
        assert_eq!(h[0], BlockHash(stable_hash_chained(CHAIN_SEED, b"hell")));
        assert_eq!(h[1], BlockHash(stable_hash_chained(h[0].0, b"o wo")));
    }

    #[test]
    fn zero_block_size_or_empty_text_gives_no_blocks() {
        assert!(prompt_blocks(b"abc", 0).is_empty());
        assert!(prompt_blocks(b"", 16).is_empty());
    }

    #[test]
    fn cached_prefix_counts_leading_blocks_only() {
        let mut idx = PrefixIndex::new(100);
        let conv = prompt_blocks(&[7u8; 64], 8);
        idx.insert(&conv[..5]);
        assert_eq!(idx.cached_prefix(&conv), 5);
        assert_eq!(idx.cached_prefix(&conv[..3]), 3);
        let other = prompt_blocks(&[9u8; 64], 8);
        assert_eq!(idx.cached_prefix(&other), 0);
        assert_eq!(idx.cached_prefix(&[]), 0);
    }

    #[test]
    fn lru_bound_evicts_the_deepest_blocks_of_the_oldest_prompt_first() {
        let mut idx = PrefixIndex::new(6);
        let old = prompt_blocks(&[1u8; 32], 8); // 4 blocks
        let new = prompt_blocks(&[2u8; 32], 8); // 4 blocks
        idx.insert(&old);
        idx.insert(&new);
        assert_eq!(idx.len(), 6);
        assert_eq!(idx.cached_prefix(&new), 4);
        // The old prompt lost its two deepest blocks, and its prefix is still intact.
        assert_eq!(idx.cached_prefix(&old), 2);
    }

    #[test]
    fn touching_a_prefix_again_protects_it_from_eviction() {
        let mut idx = PrefixIndex::new(3);
        let a = prompt_blocks(&[1u8; 16], 8); // 2 blocks
        let b = prompt_blocks(&[2u8; 16], 8);
        let c = prompt_blocks(&[3u8; 16], 8);
        idx.insert(&a);
        idx.insert(&b);
        idx.insert(&a[..1]);
        idx.insert(&c);
        assert_eq!(idx.cached_prefix(&a), 1);
        assert_eq!(idx.cached_prefix(&b), 0);
        assert_eq!(idx.cached_prefix(&c), 2);
    }

    #[test]
    fn zero_capacity_holds_nothing_and_clear_forgets() {
        let blocks = prompt_blocks(b"abcdefgh", 2);
        let mut off = PrefixIndex::new(0);
        off.insert(&blocks);
        assert!(off.is_empty());
        let mut idx = PrefixIndex::new(10);
        idx.insert(&blocks);
        assert_eq!(idx.cached_prefix(&blocks), 4);
        idx.clear();
        assert_eq!(idx.cached_prefix(&blocks), 0);
    }
}
