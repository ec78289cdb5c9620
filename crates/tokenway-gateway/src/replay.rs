//! The replay window: idempotency keys seen recently, so a tunnel request replayed (0-RTT early
//! data can be captured and resent by anyone on the path, RFC 9001 §9.2) is refused instead of
//! executed twice.
//!
//! Sans-IO: time is passed in. Bounded: at most `capacity` keys; when full the oldest key is
//! forgotten early (and counted), which only weakens protection for requests older than every
//! remembered one.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// A 128-bit idempotency key.
pub type Key = [u8; 16];

/// Why a key was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Not 32 hexadecimal characters.
    Malformed,
    /// Seen inside the window.
    Replayed,
}

/// Keys seen in the last `window`.
#[derive(Debug)]
pub struct ReplayWindow {
    window: Duration,
    capacity: usize,
    seen: HashMap<Key, Instant>,
    order: VecDeque<(Key, Instant)>,
    forgotten_early: u64,
}

impl ReplayWindow {
    /// A window of `window` holding at most `capacity` keys.
    pub fn new(window: Duration, capacity: usize) -> Self {
        Self {
            window,
            capacity: capacity.max(1),
            seen: HashMap::new(),
            order: VecDeque::new(),
            forgotten_early: 0,
        }
    }

    /// Parses `key` and records it; refuses a malformed or already-seen key.
    pub fn admit(&mut self, key: &str, now: Instant) -> Result<(), Refusal> {
        let key = parse(key).ok_or(Refusal::Malformed)?;
        self.expire(now);
        if self.seen.contains_key(&key) {
            return Err(Refusal::Replayed);
        }
        if self.seen.len() >= self.capacity {
            if let Some((old, _)) = self.order.pop_front() {
                self.seen.remove(&old);
                self.forgotten_early += 1;
            }
        }
        self.seen.insert(key, now);
        self.order.push_back((key, now));
        Ok(())
    }

    /// Keys remembered now.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// Keys dropped before their window ended because the window was full.
    pub fn forgotten_early(&self) -> u64 {
        self.forgotten_early
    }

    fn expire(&mut self, now: Instant) {
        while let Some((key, at)) = self.order.front().copied() {
            if now.saturating_duration_since(at) < self.window {
                break;
            }
            self.order.pop_front();
            self.seen.remove(&key);
        }
    }
}

fn parse(key: &str) -> Option<Key> {
    let mut out = [0u8; 16];
    hex::decode_to_slice(key, &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "00112233445566778899aabbccddeeff";
    const B: &str = "ffeeddccbbaa99887766554433221100";

    #[test]
    fn a_key_seen_inside_the_window_is_refused() {
        let t0 = Instant::now();
        let mut w = ReplayWindow::new(Duration::from_secs(10), 100);
        assert_eq!(w.admit(A, t0), Ok(()));
        assert_eq!(
            w.admit(A, t0 + Duration::from_secs(9)),
            Err(Refusal::Replayed)
        );
        assert_eq!(w.admit(B, t0 + Duration::from_secs(9)), Ok(()));
    }

    #[test]
    fn a_key_is_forgotten_after_the_window() {
        let t0 = Instant::now();
        let mut w = ReplayWindow::new(Duration::from_secs(10), 100);
        w.admit(A, t0).expect("fresh");
        assert_eq!(w.admit(A, t0 + Duration::from_secs(10)), Ok(()));
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn malformed_keys_are_refused() {
        let mut w = ReplayWindow::new(Duration::from_secs(1), 10);
        for k in [
            "",
            "abc",
            "zz112233445566778899aabbccddeeff",
            &format!("{A}00"),
        ] {
            assert_eq!(w.admit(k, Instant::now()), Err(Refusal::Malformed), "{k}");
        }
    }

    #[test]
    fn the_window_never_holds_more_than_its_capacity() {
        let t0 = Instant::now();
        let mut w = ReplayWindow::new(Duration::from_secs(60), 8);
        for i in 0..100u32 {
            let key = format!("{:032x}", i);
            w.admit(&key, t0).expect("distinct keys");
            assert!(w.len() <= 8);
        }
        assert_eq!(w.forgotten_early(), 92);
    }
}
