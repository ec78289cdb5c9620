//! The cost model of a simulated inference server: how many tokens a prompt is, how much of it
//! the prefix cache already holds, how long prefill takes and how fast tokens come out under
//! batching.
//!
//! Sans-IO: nothing here reads a clock, sleeps or touches a socket. Durations are computed from
//! counts, and the caller (the server) turns them into deadlines. That keeps the model exact in
//! unit tests and keeps the server glue thin.
//!
//! The prefix cache follows vLLM's automatic prefix caching: the prompt is cut into blocks of
//! `block_tokens` tokens, each block is named by a hash chained over all blocks before it, so a
//! block hit implies the whole prefix up to it matches. Only whole blocks are cached. Eviction is
//! least recently used, and the blocks of one prompt are touched last-to-first so that, like in
//! vLLM, a prompt's tail is evicted before its head.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

/// Prompt tokens for a prompt of `prompt_bytes` bytes: `ceil(prompt_bytes / bytes_per_token)`.
///
/// With `bytes_per_token = 4` this is the usual ~4 characters per token of English text under
/// BPE tokenizers. `bytes_per_token` must be at least 1 (checked by the config).
pub fn prompt_tokens(prompt_bytes: usize, bytes_per_token: usize) -> usize {
    prompt_bytes.div_ceil(bytes_per_token.max(1))
}

/// Longest duration the model computes: a day (the config bounds every input so that real
/// settings stay far below; this only keeps arithmetic from panicking).
const MAX_DURATION: Duration = Duration::from_secs(86_400);

fn seconds(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs).map_or(MAX_DURATION, |d| d.min(MAX_DURATION))
}

/// Time to prefill `uncached_tokens` at `tokens_per_second` (at most a day).
pub fn prefill_time(uncached_tokens: usize, tokens_per_second: f64) -> Duration {
    if uncached_tokens == 0 {
        return Duration::ZERO;
    }
    seconds(uncached_tokens as f64 / tokens_per_second)
}

/// Interval before the next output token when `active` requests hold slots (the one asking
/// included): `time_per_output_token * (1 + batch_penalty * (active - 1))`.
pub fn decode_interval(
    time_per_output_token: Duration,
    batch_penalty: f64,
    active: usize,
) -> Duration {
    let others = active.saturating_sub(1) as f64;
    seconds(time_per_output_token.as_secs_f64() * (1.0 + batch_penalty * others))
}

/// Converts milliseconds (validated by the config: finite, 0 to a day) into a duration; any
/// other value is clamped to that range rather than panicking.
pub fn ms(millis: f64) -> Duration {
    let secs = if millis.is_finite() {
        millis.clamp(0.0, 86_400_000.0) / 1000.0
    } else {
        0.0
    };
    Duration::from_secs_f64(secs)
}

/// The chained hash of one prompt block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHash(u64);

/// Chained hashes of the whole blocks of `prompt`: block `i` covers bytes
/// `[i * block_bytes, (i + 1) * block_bytes)` with `block_bytes = block_tokens * bytes_per_token`,
/// and `h_i = hash(h_{i-1}, block bytes)`. A trailing partial block has no hash.
///
/// `DefaultHasher::new()` uses fixed keys, so hashes are the same in every process of one build.
pub fn block_hashes(prompt: &[u8], block_tokens: usize, bytes_per_token: usize) -> Vec<BlockHash> {
    let block_bytes = block_tokens.max(1) * bytes_per_token.max(1);
    let mut prev = 0u64;
    prompt
        .chunks_exact(block_bytes)
        .map(|block| {
            let mut h = DefaultHasher::new();
            prev.hash(&mut h);
            block.hash(&mut h);
            prev = h.finish();
            BlockHash(prev)
        })
        .collect()
}

/// A bounded LRU set of block hashes: the simulated KV-cache blocks that survive between
/// requests.
#[derive(Debug)]
pub struct PrefixCache {
    capacity_blocks: usize,
    block_tokens: usize,
    /// Block -> the stamp of its last use.
    stamps: HashMap<BlockHash, u64>,
    /// Stamp of last use -> block; the first entry is the least recently used.
    order: BTreeMap<u64, BlockHash>,
    clock: u64,
}

impl PrefixCache {
    /// A cache of `capacity_tokens / block_tokens` blocks (0 blocks disables caching).
    pub fn new(capacity_tokens: usize, block_tokens: usize) -> Self {
        let block_tokens = block_tokens.max(1);
        Self {
            capacity_blocks: capacity_tokens / block_tokens,
            block_tokens,
            stamps: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Tokens of a prompt of `prompt_tokens` tokens already cached: the number of leading
    /// blocks present times `block_tokens`, short of the whole prompt. As on vLLM, at least
    /// the last token is computed again to get the logits of the first output token, so a
    /// prompt cached whole, a whole number of blocks long, recomputes its last block (vLLM
    /// caps a hit at `prompt_tokens - 1` tokens and rounds it down to whole blocks). Does not
    /// change recency (the caller inserts after prefill).
    pub fn cached_tokens(&self, blocks: &[BlockHash], prompt_tokens: usize) -> usize {
        let most = prompt_tokens.saturating_sub(1) / self.block_tokens;
        blocks
            .iter()
            .take(most)
            .take_while(|b| self.stamps.contains_key(b))
            .count()
            * self.block_tokens
    }

    /// Inserts or touches every block of a prompt, evicting the least recently used blocks
    /// beyond capacity. Blocks are touched last-to-first so the prompt's head is the freshest.
    pub fn insert(&mut self, blocks: &[BlockHash]) {
        if self.capacity_blocks == 0 {
            return;
        }
        for &block in blocks.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.stamps.insert(block, self.clock) {
                self.order.remove(&old);
            }
            self.order.insert(self.clock, block);
            while self.stamps.len() > self.capacity_blocks {
                let Some((_, victim)) = self.order.pop_first() else {
                    break;
                };
                self.stamps.remove(&victim);
            }
        }
    }

    /// Blocks held now.
    pub fn len_blocks(&self) -> usize {
        self.stamps.len()
    }

    /// Whether the cache holds no block.
    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }

    /// Fraction of capacity filled with cached blocks, 0.0 to 1.0 (0.0 when caching is
    /// disabled). Not vLLM's `gpu_cache_usage_perc`, which counts only blocks that running
    /// requests hold (the server exports that).
    pub fn usage(&self) -> f64 {
        if self.capacity_blocks == 0 {
            0.0
        } else {
            self.stamps.len() as f64 / self.capacity_blocks as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_tokens_round_bytes_up_to_whole_tokens() {
        assert_eq!(prompt_tokens(0, 4), 0);
        assert_eq!(prompt_tokens(1, 4), 1);
        assert_eq!(prompt_tokens(4, 4), 1);
        assert_eq!(prompt_tokens(5, 4), 2);
        assert_eq!(prompt_tokens(400, 4), 100);
        assert_eq!(prompt_tokens(7, 1), 7);
    }

    #[test]
    fn prefill_time_is_uncached_tokens_over_rate() {
        assert_eq!(prefill_time(0, 1000.0), Duration::ZERO);
        assert_eq!(prefill_time(2000, 1000.0), Duration::from_secs(2));
        assert_eq!(prefill_time(10, 20_000.0), Duration::from_micros(500));
    }

    #[test]
    fn decode_interval_grows_with_batch_penalty_per_other_request() {
        let tpot = Duration::from_millis(20);
        assert_eq!(decode_interval(tpot, 0.05, 1), tpot);
        assert_eq!(decode_interval(tpot, 0.05, 0), tpot);
        assert_eq!(decode_interval(tpot, 0.05, 11), Duration::from_millis(30));
        assert_eq!(decode_interval(tpot, 0.0, 100), tpot);
        // Past a day, the model saturates instead of panicking.
        assert_eq!(decode_interval(tpot, 1e300, 3), MAX_DURATION);
        assert_eq!(prefill_time(usize::MAX, 1e-20), MAX_DURATION);
    }

    #[test]
    fn only_whole_blocks_are_hashed_and_hashes_chain_over_the_prefix() {
        let a = block_hashes(&[b'a'; 64 * 2 + 10], 16, 4);
        assert_eq!(a.len(), 2);
        // Same second block after a different first block: different hash.
        let mut other = vec![b'b'; 64];
        other.extend_from_slice(&[b'a'; 64]);
        let b = block_hashes(&other, 16, 4);
        assert_ne!(a[1], b[1]);
        // Deterministic.
        assert_eq!(a, block_hashes(&[b'a'; 64 * 2 + 10], 16, 4));
    }

    #[test]
    fn repeated_prompt_hits_every_whole_block() {
        let prompt = vec![b'x'; 64 * 5 + 3];
        let blocks = block_hashes(&prompt, 16, 4);
        let mut cache = PrefixCache::new(100_000, 16);
        assert_eq!(cache.cached_tokens(&blocks, usize::MAX), 0);
        cache.insert(&blocks);
        assert_eq!(cache.cached_tokens(&blocks, usize::MAX), 5 * 16);
    }

    #[test]
    fn a_prompt_cached_whole_computes_its_last_block_again() {
        // Five whole blocks of 16 tokens, 80 tokens: at most 79 may hit, so four blocks do.
        let prompt = vec![b'x'; 64 * 5];
        let blocks = block_hashes(&prompt, 16, 4);
        let mut cache = PrefixCache::new(100_000, 16);
        cache.insert(&blocks);
        assert_eq!(cache.cached_tokens(&blocks, 80), 4 * 16);
        // One token more and every whole block hits.
        assert_eq!(cache.cached_tokens(&blocks, 81), 5 * 16);
        assert_eq!(cache.cached_tokens(&blocks, 0), 0);
    }

    #[test]
    fn shared_prefix_hits_only_the_leading_common_blocks() {
        let mut p1 = vec![b's'; 64 * 3];
        p1.extend_from_slice(&[b'1'; 64 * 2]);
        let mut p2 = vec![b's'; 64 * 3];
        p2.extend_from_slice(&[b'2'; 64 * 2]);
        let mut cache = PrefixCache::new(100_000, 16);
        cache.insert(&block_hashes(&p1, 16, 4));
        assert_eq!(
            cache.cached_tokens(&block_hashes(&p2, 16, 4), usize::MAX),
            3 * 16
        );
    }

    #[test]
    fn lru_evicts_least_recently_used_blocks_at_capacity() {
        // Capacity: 4 blocks of 16 tokens.
        let mut cache = PrefixCache::new(64, 16);
        let a = block_hashes(&[b'a'; 64 * 2], 16, 4);
        let b = block_hashes(&[b'b'; 64 * 2], 16, 4);
        let c = block_hashes(&[b'c'; 64 * 2], 16, 4);
        cache.insert(&a);
        cache.insert(&b);
        assert_eq!(cache.len_blocks(), 4);
        assert_eq!(cache.usage(), 1.0);
        cache.insert(&a); // touch a: b is now least recently used
        cache.insert(&c);
        assert_eq!(cache.len_blocks(), 4);
        assert_eq!(cache.cached_tokens(&a, usize::MAX), 32);
        assert_eq!(cache.cached_tokens(&c, usize::MAX), 32);
        assert_eq!(cache.cached_tokens(&b, usize::MAX), 0);
    }

    #[test]
    fn eviction_takes_a_prompts_tail_before_its_head() {
        // Capacity 3 blocks; a 3-block prompt, then a 1-block prompt evicts one block.
        let mut cache = PrefixCache::new(48, 16);
        let long = block_hashes(&[b'l'; 64 * 3], 16, 4);
        cache.insert(&long);
        cache.insert(&block_hashes(&[b'z'; 64], 16, 4));
        // The head two blocks survive, so the prefix still hits 2 blocks.
        assert_eq!(cache.cached_tokens(&long, usize::MAX), 32);
    }

    #[test]
    fn zero_capacity_disables_caching() {
        let mut cache = PrefixCache::new(0, 16);
        let blocks = block_hashes(&[b'a'; 640], 16, 4);
        cache.insert(&blocks);
        assert!(cache.is_empty());
        assert_eq!(cache.cached_tokens(&blocks, usize::MAX), 0);
        assert_eq!(cache.usage(), 0.0);
    }
}
