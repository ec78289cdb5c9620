//! Deterministic generated text: the same seed and prompt always give the same tokens.
//!
//! Token `i` is a word of a fixed vocabulary picked by a hash of (seed, prompt, i). Each token is
//! one word with a leading space, so a completion reads like (nonsense) English and every token
//! is one SSE event.

use std::hash::{DefaultHasher, Hash, Hasher};

const VOCABULARY: [&str; 32] = [
    " the", " model", " token", " stream", " latency", " network", " packet", " route", " cache",
    " prefix", " batch", " queue", " gateway", " edge", " tunnel", " window", " signal", " river",
    " stone", " light", " quick", " quiet", " north", " green", " and", " of", " to", " in", " is",
    " with", " a", " on",
];

/// The token sequence of one request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenSource {
    base: u64,
}

impl TokenSource {
    /// Tokens of choice `choice` (of a request's `n`) for `prompt` under `seed`; choices differ
    /// from each other. `DefaultHasher::new()` has fixed keys, so this is stable across processes
    /// of one build.
    pub(crate) fn choice(seed: u64, prompt: &[u8], choice: u32) -> Self {
        let mut h = DefaultHasher::new();
        seed.hash(&mut h);
        prompt.hash(&mut h);
        if choice > 0 {
            choice.hash(&mut h);
        }
        Self { base: h.finish() }
    }

    /// Token number `index` (0-based).
    pub(crate) fn token(&self, index: u32) -> &'static str {
        let mut h = DefaultHasher::new();
        self.base.hash(&mut h);
        index.hash(&mut h);
        VOCABULARY[(h.finish() % VOCABULARY.len() as u64) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_and_prompt_give_the_same_tokens_and_seed_changes_them() {
        let a: Vec<_> = (0..32)
            .map(|i| TokenSource::choice(1, b"hi", 0).token(i))
            .collect();
        let b: Vec<_> = (0..32)
            .map(|i| TokenSource::choice(1, b"hi", 0).token(i))
            .collect();
        let c: Vec<_> = (0..32)
            .map(|i| TokenSource::choice(2, b"hi", 0).token(i))
            .collect();
        let d: Vec<_> = (0..32)
            .map(|i| TokenSource::choice(1, b"hi", 1).token(i))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        assert!(a.iter().all(|t| t.starts_with(' ')));
    }
}
