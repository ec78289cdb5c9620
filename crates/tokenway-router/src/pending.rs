//! Prefills in flight: prompt blocks a backend is computing right now, and when they should
//! be done.
//!
//! The prefix index records a prompt's blocks when its attempt *starts*, so for the few hundred
//! milliseconds of a long prefill it promises blocks the engine does not hold yet. An engine
//! that prefills requests in parallel (or in separate scheduler steps) computes a second copy
//! of the same prefix for a request that arrives in that window: a new conversation that
//! arrives while its system prompt's first copy is being prefilled pays the whole prefill
//! again, wherever it goes. The `cost` policy can instead *hold* such a request until the first
//! copy is done (see `Router::route` and docs/routing.md, "Holding for a prefill in flight").
//! This module only keeps the bookkeeping: for each backend, which blocks are pending, how many
//! attempts are computing each, and the expected time the last of them is done.
//!
//! Bounded: at most [`PENDING_CAP`] blocks per backend; an attempt that would exceed it is not
//! recorded (its blocks then count as cached at once, as without this module). Never reads a
//! clock: times come from the caller.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::time::Instant;

use crate::prefix::{BlockHash, PassThroughHasher};

/// Most pending blocks recorded per backend (at 256-byte blocks, 16 MiB of prompts in flight).
pub(crate) const PENDING_CAP: usize = 65_536;

#[derive(Debug, Clone, Copy)]
struct Pending {
    /// Attempts computing this block.
    refs: u32,
    /// When the latest of them is expected to have its first token.
    ready_at: Instant,
}

/// One backend's blocks in prefill.
#[derive(Debug, Clone, Default)]
pub(crate) struct PendingPrefills {
    blocks: HashMap<BlockHash, Pending, BuildHasherDefault<PassThroughHasher>>,
}

impl PendingPrefills {
    /// An attempt started prefilling `blocks`, expected done at `ready_at`. Returns false (and
    /// records nothing) when that would exceed [`PENDING_CAP`].
    pub(crate) fn add(&mut self, blocks: &[BlockHash], ready_at: Instant) -> bool {
        if self.blocks.len() + blocks.len() > PENDING_CAP {
            return false;
        }
        for &b in blocks {
            let e = self
                .blocks
                .entry(b)
                .or_insert(Pending { refs: 0, ready_at });
            e.refs = e.refs.saturating_add(1);
            e.ready_at = e.ready_at.max(ready_at);
        }
        true
    }

    /// The attempt that [`add`](Self::add)ed `blocks` has its first token, or ended.
    pub(crate) fn remove(&mut self, blocks: &[BlockHash]) {
        for b in blocks {
            if let Some(e) = self.blocks.get_mut(b) {
                e.refs = e.refs.saturating_sub(1);
                if e.refs == 0 {
                    self.blocks.remove(b);
                }
            }
        }
    }

    /// Of the first `cached` blocks of `blocks` (the prefix index's estimate), how many lead
    /// up to the first block still in prefill (all `cached` when none is), and when the
    /// pending ones are expected done. Walks back from the end of the cached prefix, so it
    /// costs about the length of the pending part.
    pub(crate) fn done_prefix(
        &self,
        blocks: &[BlockHash],
        cached: usize,
    ) -> (usize, Option<Instant>) {
        let cached = cached.min(blocks.len());
        if self.blocks.is_empty() {
            return (cached, None);
        }
        let mut done = cached;
        let mut ready: Option<Instant> = None;
        while done > 0 {
            let Some(p) = self.blocks.get(&blocks[done - 1]) else {
                break;
            };
            ready = Some(ready.map_or(p.ready_at, |r| r.max(p.ready_at)));
            done -= 1;
        }
        (done, ready)
    }

    /// Blocks pending.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Forget everything (the backend restarted).
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn b(n: u64) -> BlockHash {
        BlockHash(n)
    }

    #[test]
    fn the_done_prefix_stops_at_the_first_block_in_prefill() {
        let t0 = Instant::now();
        let mut p = PendingPrefills::default();
        let prompt = [b(1), b(2), b(3), b(4)];
        assert_eq!(p.done_prefix(&prompt, 4), (4, None));
        let later = t0 + Duration::from_millis(300);
        assert!(p.add(&prompt[2..], later));
        assert_eq!(p.done_prefix(&prompt, 4), (2, Some(later)));
        // Only the cached part counts.
        assert_eq!(p.done_prefix(&prompt, 2), (2, None));
        p.remove(&prompt[2..]);
        assert_eq!(p.done_prefix(&prompt, 4), (4, None));
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn a_block_stays_pending_until_every_attempt_computing_it_is_done() {
        let t0 = Instant::now();
        let mut p = PendingPrefills::default();
        let prompt = [b(7), b(8)];
        assert!(p.add(&prompt, t0));
        assert!(p.add(&prompt, t0 + Duration::from_millis(50)));
        p.remove(&prompt);
        assert_eq!(
            p.done_prefix(&prompt, 2),
            (0, Some(t0 + Duration::from_millis(50)))
        );
        p.remove(&prompt);
        assert_eq!(p.done_prefix(&prompt, 2), (2, None));
        // Removing what is not there is harmless.
        p.remove(&prompt);
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn pending_blocks_are_bounded() {
        let t0 = Instant::now();
        let mut p = PendingPrefills::default();
        let many: Vec<BlockHash> = (0..PENDING_CAP as u64).map(b).collect();
        assert!(p.add(&many, t0));
        assert!(!p.add(&[b(u64::MAX)], t0));
        assert_eq!(p.len(), PENDING_CAP);
    }
}
