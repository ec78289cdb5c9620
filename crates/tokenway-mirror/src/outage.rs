//! Riding out an outage of every source of a pull.
//!
//! A piece gets three attempts at the authoritative sources, which is right for a source that
//! fails this piece (a bad range, a mirror whose origin lost the blob) but wrong when every
//! source is away at once: a mirror restarting for two minutes refuses connections in under a
//! millisecond, and the pull's slots then failed some forty pieces a second until the pull
//! ended with thousands of failed pieces to rerun. So a piece whose attempts ran out on
//! failures that say nothing about the piece (no connection, no answer, a 5xx, busy) waits
//! and starts over, as long as the pull as a whole has verified a piece within
//! [`OUTAGE_GRACE`]; past that the pull stops with the last error, instead of waiting for days
//! on a source that answers 503 forever. The pauses grow from 1 s to 16 s, and the first says
//! why once per outage.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::lock;

/// How long a pull waits without verifying any piece before it gives up on its sources.
pub const OUTAGE_GRACE: Duration = Duration::from_secs(120);

/// The longest pause between a piece's rounds during an outage.
const MAX_PAUSE: Duration = Duration::from_secs(16);

/// The pull's last verified piece, shared by its pieces.
#[derive(Debug)]
pub struct Outage {
    last_piece: Mutex<Instant>,
    warned: AtomicBool,
}

impl Outage {
    /// A pull starting at `now` (which counts as progress: sources down at the start get the
    /// same grace).
    pub fn new(now: Instant) -> Self {
        Self {
            last_piece: Mutex::new(now),
            warned: AtomicBool::new(false),
        }
    }

    /// A piece was verified at `now`.
    pub fn piece_done(&self, now: Instant) {
        let mut last = lock(&self.last_piece);
        *last = (*last).max(now);
        self.warned.store(false, Ordering::Relaxed);
    }

    /// How long a piece whose attempts ran out without an answer should wait before it starts
    /// over, after `waits` such pauses; `None` once no piece has been verified for
    /// [`OUTAGE_GRACE`] (the pull stops).
    pub fn pause(&self, waits: u32, now: Instant) -> Option<Duration> {
        let quiet = now.saturating_duration_since(*lock(&self.last_piece));
        let left = OUTAGE_GRACE.checked_sub(quiet).filter(|d| !d.is_zero())?;
        let backoff = Duration::from_secs(1u64 << waits.min(4)).min(MAX_PAUSE);
        Some(backoff.min(left))
    }

    /// True for the first caller since the last verified piece (to say it once).
    pub fn first_to_wait(&self) -> bool {
        !self.warned.swap(true, Ordering::Relaxed)
    }

    /// Time since the last verified piece.
    pub fn quiet(&self, now: Instant) -> Duration {
        now.saturating_duration_since(*lock(&self.last_piece))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_wait_with_backoff_until_the_pull_has_been_quiet_for_the_grace() {
        let t0 = Instant::now();
        let o = Outage::new(t0);
        let s = Duration::from_secs(1);
        assert_eq!(o.pause(0, t0), Some(s));
        assert_eq!(o.pause(1, t0), Some(2 * s));
        assert_eq!(o.pause(9, t0), Some(16 * s));
        // Near the end of the grace the pause ends with it; past it, nothing more.
        assert_eq!(o.pause(9, t0 + OUTAGE_GRACE - 3 * s), Some(3 * s));
        assert_eq!(o.pause(0, t0 + OUTAGE_GRACE), None);
        // A piece verified meanwhile: the grace starts over.
        o.piece_done(t0 + 100 * s);
        assert_eq!(o.pause(9, t0 + OUTAGE_GRACE), Some(16 * s));
        assert_eq!(o.quiet(t0 + OUTAGE_GRACE), OUTAGE_GRACE - 100 * s);
    }

    #[test]
    fn the_outage_is_told_once_until_a_piece_comes() {
        let t0 = Instant::now();
        let o = Outage::new(t0);
        assert!(o.first_to_wait());
        assert!(!o.first_to_wait());
        o.piece_done(t0);
        assert!(o.first_to_wait());
    }
}
