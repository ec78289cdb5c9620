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
//! Each entry also counts its *branches*: how often a block that was not held was inserted right
//! after it while it was. A conversation's own block is continued at most once (the next turn turns
//! the trailing partial block into a full one); a block continued more often is a prefix several
//! prompts share, such as a system prompt. [`PrefixIndex::shared_prefix`] uses that to tell a
//! conversation's home (it holds private history) from a backend that merely holds the shared
//! system prompt, which the `cost` policy's load bounds treat differently.
//!
//! Estimates can be wrong in both directions (the engine evicts under its own memory
//! pressure; 64-bit hashes can collide); they only steer ranking, never correctness.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use serde::Serialize;

use crate::hash::stable_hash_chained;

/// Most blocks tracked of one prompt: 2 MiB of prompt text at the default 256-byte blocks,
/// more than an engine's KV cache holds for one request. Every block is inserted into the
/// chosen backend's index under the router's lock, so a 32 MiB prompt would otherwise hold it
/// for 131 072 insertions and flush the index of every other conversation.
pub const MAX_PROMPT_BLOCKS: usize = 8192;

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
///
/// At most [`MAX_PROMPT_BLOCKS`] blocks: the rest of a longer prompt is not tracked.
pub fn prompt_blocks(text: &[u8], block_bytes: usize) -> Vec<BlockHash> {
    if block_bytes == 0 {
        return Vec::new();
    }
    let mut prev = CHAIN_SEED;
    text.chunks(block_bytes)
        .take(MAX_PROMPT_BLOCKS)
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

/// Distinct continuations after which a block counts as shared (see
/// [`PrefixIndex::shared_prefix`]): the first continuation is the prompt that created it, the
/// second may be the same conversation's next turn (its previous trailing partial block became a
/// full one), a third can only be another prompt.
const SHARED_AFTER_BRANCHES: u8 = 2;

/// One indexed block: its last touch and how often a new continuation was added after it.
#[derive(Debug, Clone, Copy)]
struct Entry {
    stamp: u64,
    branches: u8,
}

/// One backend's LRU set of block hashes, bounded to `capacity` entries.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    capacity: usize,
    clock: u64,
    /// Block → its last touch and branch count.
    stamps: BlockMap<Entry>,
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
        // Last to first: leading blocks end up the most recent (see the module docs). A block
        // that was already held and is followed by a block that was not gains a branch.
        let mut next_is_new = false;
        for &b in blocks.iter().rev() {
            self.clock += 1;
            let stamp = self.clock;
            let was_new = match self.stamps.get_mut(&b) {
                Some(e) => {
                    self.order.remove(&e.stamp);
                    e.stamp = stamp;
                    if next_is_new {
                        e.branches = e.branches.saturating_add(1);
                    }
                    false
                }
                None => {
                    self.stamps.insert(b, Entry { stamp, branches: 0 });
                    true
                }
            };
            self.order.insert(stamp, b);
            next_is_new = was_new;
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

    /// Of the first `cached` blocks of `blocks` (its [cached prefix](Self::cached_prefix)),
    /// how many lead up to and include the deepest *shared* block: one after which the index
    /// saw at least two new continuations besides the prompt that created it. That is a
    /// prefix several prompts use (a system prompt, a few-shot preamble); the cached blocks
    /// beyond it are private to one conversation (its history). Walks back from the end of
    /// the cached prefix, so it costs about the length of the private part. Does not change
    /// recency.
    pub fn shared_prefix(&self, blocks: &[BlockHash], cached: usize) -> usize {
        let cached = cached.min(blocks.len());
        blocks[..cached]
            .iter()
            .rposition(|b| {
                self.stamps
                    .get(b)
                    .is_some_and(|e| e.branches >= SHARED_AFTER_BRANCHES)
            })
            .map_or(0, |i| i + 1)
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
        let huge = vec![b'x'; 4 * MAX_PROMPT_BLOCKS];
        let blocks = prompt_blocks(&huge, 2);
        assert_eq!(blocks.len(), MAX_PROMPT_BLOCKS);
        assert_eq!(blocks, prompt_blocks(&huge[..2 * MAX_PROMPT_BLOCKS], 2));
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
    fn a_prefix_continued_by_several_prompts_is_shared_and_a_history_is_not() {
        let mut idx = PrefixIndex::new(1_000);
        let system = [b's'; 32]; // 4 blocks of 8
        let conv = |c: u8, turns: usize| {
            let mut text = system.to_vec();
            for t in 0..turns {
                text.extend_from_slice(&[c + t as u8; 12]); // 1.5 blocks per turn
            }
            prompt_blocks(&text, 8)
        };
        // One conversation, two turns: its blocks were extended once, none is shared.
        idx.insert(&conv(b'a', 1));
        idx.insert(&conv(b'a', 2));
        let second = conv(b'a', 2);
        let cached = idx.cached_prefix(&second);
        assert_eq!(cached, second.len());
        assert_eq!(idx.shared_prefix(&second, cached), 0);
        // Two more conversations continue the system prompt: its last block is shared, the
        // first conversation's history beyond it stays private.
        idx.insert(&conv(b'k', 1));
        idx.insert(&conv(b'p', 1));
        assert_eq!(idx.shared_prefix(&second, cached), 4);
        let third = conv(b'a', 3);
        assert_eq!(idx.shared_prefix(&third, idx.cached_prefix(&third)), 4);
        // A prompt cached only up to the system prompt has no private part.
        let new = conv(b'z', 1);
        assert_eq!(idx.cached_prefix(&new), 4);
        assert_eq!(idx.shared_prefix(&new, 4), 4);
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
