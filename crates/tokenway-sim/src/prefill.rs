//! The engine's shared prefill schedule (`prefill_shared`): requests in prefill take their
//! turns one after another, as chunked prefill shares a step's token budget among them.
//!
//! A request that leaves before its turn is done (a client that went away, the loser of a
//! hedged pair, a request that timed out) gives back what it had not used, and every turn
//! after it moves earlier, as vLLM frees an aborted request's prefill. Before, only the last
//! turn scheduled could give time back: a cancelled 10 s prefill in front of another still
//! held the second's first token 10 s. Free of I/O; the server waits on the instants it hands
//! out and is told when they move.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// One request's place in the schedule.
#[derive(Debug, Clone, Copy)]
struct Turn {
    id: u64,
    admitted: Instant,
    work: Duration,
    start: Instant,
    done: Instant,
}

/// The turns scheduled and not yet left, in order. Each starts when the one before it is done,
/// or when its request was admitted if that is later. Bounded by the requests in prefill (at
/// most the engine's slots): a turn is removed when its request leaves it, done or not.
#[derive(Debug, Default)]
pub(crate) struct PrefillSchedule {
    turns: VecDeque<Turn>,
    next_id: u64,
}

impl PrefillSchedule {
    /// Schedules `work` of prefill for a request admitted at `admitted`; its id and when its
    /// turn is done (for now: it moves earlier when a turn before it is left).
    pub(crate) fn schedule(&mut self, admitted: Instant, work: Duration) -> (u64, Instant) {
        let start = self
            .turns
            .back()
            .map_or(admitted, |last| last.done.max(admitted));
        let id = self.next_id;
        self.next_id += 1;
        let done = start + work;
        self.turns.push_back(Turn {
            id,
            admitted,
            work,
            start,
            done,
        });
        (id, done)
    }

    /// When turn `id` is done, while it is scheduled.
    pub(crate) fn done(&self, id: u64) -> Option<Instant> {
        self.turns.iter().find(|t| t.id == id).map(|t| t.done)
    }

    /// Removes turn `id` at `now`. When it was not done, the turns after it that have not
    /// started move up into the time it leaves; returns whether any moved.
    pub(crate) fn leave(&mut self, id: u64, now: Instant) -> bool {
        let Some(at) = self.turns.iter().position(|t| t.id == id) else {
            return false;
        };
        let Some(left) = self.turns.remove(at) else {
            return false;
        };
        if left.done <= now {
            return false;
        }
        let mut prev_done = at
            .checked_sub(1)
            .and_then(|i| self.turns.get(i))
            .map_or(now, |t| t.done);
        let mut moved = false;
        for t in self.turns.iter_mut().skip(at) {
            if t.start > now {
                let start = t.admitted.max(prev_done).max(now);
                if start < t.start {
                    t.start = start;
                    t.done = start + t.work;
                    moved = true;
                }
            }
            prev_done = t.done;
        }
        moved
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.turns.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    #[test]
    fn turns_follow_each_other_and_start_no_earlier_than_their_admission() {
        let t0 = Instant::now();
        let mut p = PrefillSchedule::default();
        let (_, a) = p.schedule(t0, s(10));
        let (_, b) = p.schedule(t0 + s(1), s(5));
        assert_eq!(a, t0 + s(10));
        assert_eq!(b, t0 + s(15));
        // Admitted after the schedule ran dry: starts at its admission.
        let (_, c) = p.schedule(t0 + s(20), s(2));
        assert_eq!(c, t0 + s(22));
    }

    #[test]
    fn a_turn_left_early_gives_its_time_to_the_turns_behind_it() {
        let t0 = Instant::now();
        let mut p = PrefillSchedule::default();
        let (a, _) = p.schedule(t0, s(10));
        let (b, _) = p.schedule(t0, s(10));
        let (c, _) = p.schedule(t0, s(10));
        // The first leaves 1 s into its turn: the second starts then, the third after it.
        assert!(p.leave(a, t0 + s(1)));
        assert_eq!(p.done(b), Some(t0 + s(11)));
        assert_eq!(p.done(c), Some(t0 + s(21)));
        // The middle one leaves before its turn: the third moves up by all of it.
        assert!(p.leave(b, t0 + s(2)));
        assert_eq!(p.done(c), Some(t0 + s(12)));
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn a_turn_behind_a_gap_keeps_its_admission() {
        let t0 = Instant::now();
        let mut p = PrefillSchedule::default();
        let (a, _) = p.schedule(t0, s(10));
        let (b, _) = p.schedule(t0 + s(8), s(4));
        let (c, _) = p.schedule(t0 + s(30), s(1));
        assert!(p.leave(a, t0 + s(2)));
        // Admitted at 8 s, it cannot have started before.
        assert_eq!(p.done(b), Some(t0 + s(12)));
        assert_eq!(p.done(c), Some(t0 + s(31)));
    }

    #[test]
    fn a_finished_turn_moves_nothing_and_leaves_no_trace() {
        let t0 = Instant::now();
        let mut p = PrefillSchedule::default();
        let (a, _) = p.schedule(t0, s(1));
        let (b, _) = p.schedule(t0, s(1));
        assert!(!p.leave(a, t0 + s(1)));
        assert_eq!(p.done(b), Some(t0 + s(2)));
        assert!(!p.leave(a, t0 + s(1)));
        assert!(!p.leave(b, t0 + s(3)));
        assert_eq!(p.len(), 0);
        // Empty again: the next turn starts at its admission.
        let (_, c) = p.schedule(t0 + s(5), s(1));
        assert_eq!(c, t0 + s(6));
    }

    #[test]
    fn a_turn_already_running_is_not_moved() {
        let t0 = Instant::now();
        let mut p = PrefillSchedule::default();
        let (a, _) = p.schedule(t0, s(2));
        let (b, _) = p.schedule(t0, s(10));
        let (c, _) = p.schedule(t0, s(10));
        // At 5 s the second is running (2..12 s); the first is done. The third leaves.
        assert!(!p.leave(a, t0 + s(5)));
        assert!(!p.leave(c, t0 + s(5)));
        assert_eq!(p.done(b), Some(t0 + s(12)));
    }
}
