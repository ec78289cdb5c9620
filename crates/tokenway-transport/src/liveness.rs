//! Path liveness of a tunnel QUIC connection: a path that stopped carrying packets is noticed
//! within seconds instead of at the idle timeout.
//!
//! quinn gives up on a connection only when nothing has arrived for its idle timeout (30 s by
//! default, `[quic] idle_timeout_ms`). Until then a connection whose path became a black hole
//! (a firewall that starts dropping UDP, a NAT binding lost, a middlebox restart) looks up, and
//! every request sent on it waits out those 30 s before its retry: the long stall the tunnel
//! exists to remove. The TCP fallback has its RTT probe for this; QUIC's counterpart needs no
//! probe of its own, because QUIC acknowledges every ack-eliciting packet within an RTT plus
//! the peer's `max_ack_delay`, and quinn retransmits unacknowledged ones on its probe timeout
//! (PTO) with backoff. So the connection's own counters answer the question: when datagrams
//! went out and nothing at all came back for [`silence_limit`], the path is dead.
//!
//! The limit is [`MIN_SILENCE`] or [`SILENCE_RTTS`] smoothed RTTs, whichever is longer: at
//! least the first send and two PTO rounds (quinn sends two probe packets per round) go
//! unanswered, which random loss alone does a few times in 10⁴ at 10 % loss each way (an
//! exchange fails with p = 0.19; 0.19 × 0.19² × 0.19²), and far more rarely with the FEC below
//! QUIC recovering most losses.
//! Silence counts from the first unanswered send seen, not from the last packet received: an
//! idle connection hears nothing between keep-alives and must not look dead the moment its
//! next keep-alive leaves.
//!
//! Sans-IO: the caller passes the time and the counters (`udp_rx`/`udp_tx` datagrams of
//! `quinn::Connection::stats`), sampled every few hundred milliseconds.

use std::time::{Duration, Instant};

/// The shortest silence that makes a path dead.
pub const MIN_SILENCE: Duration = Duration::from_secs(3);
/// ... or this many smoothed RTTs, on a long path.
pub const SILENCE_RTTS: u32 = 12;

/// How long sent datagrams may go unanswered before the path counts as dead, at `srtt`.
pub fn silence_limit(srtt: Duration) -> Duration {
    srtt.saturating_mul(SILENCE_RTTS).max(MIN_SILENCE)
}

/// What the counters say about the path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Packets arrive, or nothing sent has been waiting for an answer for long.
    Alive,
    /// Datagrams went out and nothing has arrived for this long.
    Dead(Duration),
}

/// One connection's receive and send counters over time.
#[derive(Clone, Debug)]
pub struct Liveness {
    /// Datagrams received at the last sample.
    rx: u64,
    /// Datagrams sent when the last datagram was received (or at the start).
    tx_answered: u64,
    /// When a send after the last received datagram was first seen.
    unanswered_since: Option<Instant>,
}

impl Liveness {
    /// Starts from the connection's counters now.
    pub fn new(rx: u64, tx: u64) -> Self {
        Self {
            rx,
            tx_answered: tx,
            unanswered_since: None,
        }
    }

    /// Takes a sample of the counters at `now`, with the connection's smoothed RTT.
    pub fn observe(&mut self, now: Instant, rx: u64, tx: u64, srtt: Duration) -> Verdict {
        if rx != self.rx {
            // Something arrived: whatever was sent before may be answered by it.
            self.rx = rx;
            self.tx_answered = tx;
            self.unanswered_since = None;
            return Verdict::Alive;
        }
        if tx == self.tx_answered {
            return Verdict::Alive;
        }
        let since = *self.unanswered_since.get_or_insert(now);
        let silent = now.saturating_duration_since(since);
        if silent >= silence_limit(srtt) {
            Verdict::Dead(silent)
        } else {
            Verdict::Alive
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const RTT: Duration = Duration::from_millis(20);

    #[test]
    fn an_idle_connection_is_alive_however_long_it_hears_nothing() {
        let t0 = Instant::now();
        let mut l = Liveness::new(10, 10);
        for s in 1..100 {
            assert_eq!(
                l.observe(t0 + Duration::from_secs(s), 10, 10, RTT),
                Verdict::Alive
            );
        }
    }

    #[test]
    fn a_keep_alive_after_a_quiet_spell_is_not_mistaken_for_silence() {
        let t0 = Instant::now();
        let mut l = Liveness::new(10, 10);
        assert_eq!(l.observe(t0 + 4_900 * MS, 10, 10, RTT), Verdict::Alive);
        // The keep-alive leaves at 5 s; its ACK is back before the next sample.
        assert_eq!(l.observe(t0 + 5_400 * MS, 10, 11, RTT), Verdict::Alive);
        assert_eq!(l.observe(t0 + 5_900 * MS, 11, 11, RTT), Verdict::Alive);
        // Nothing has been waiting since: still alive much later.
        assert_eq!(l.observe(t0 + 20_000 * MS, 11, 11, RTT), Verdict::Alive);
    }

    #[test]
    fn sends_unanswered_for_the_limit_make_the_path_dead() {
        let t0 = Instant::now();
        let mut l = Liveness::new(10, 10);
        assert_eq!(l.observe(t0, 10, 12, RTT), Verdict::Alive);
        // Retransmissions go out, nothing comes back.
        assert_eq!(l.observe(t0 + 1_000 * MS, 10, 14, RTT), Verdict::Alive);
        assert_eq!(l.observe(t0 + 2_999 * MS, 10, 15, RTT), Verdict::Alive);
        assert_eq!(
            l.observe(t0 + 3_000 * MS, 10, 15, RTT),
            Verdict::Dead(3_000 * MS)
        );
    }

    #[test]
    fn one_arrival_resets_the_silence() {
        let t0 = Instant::now();
        let mut l = Liveness::new(10, 10);
        assert_eq!(l.observe(t0, 10, 12, RTT), Verdict::Alive);
        assert_eq!(l.observe(t0 + 2_500 * MS, 11, 13, RTT), Verdict::Alive);
        // The send after that arrival is new: its silence starts when it is first seen.
        assert_eq!(l.observe(t0 + 3_000 * MS, 11, 14, RTT), Verdict::Alive);
        assert_eq!(l.observe(t0 + 5_500 * MS, 11, 14, RTT), Verdict::Alive);
        assert_eq!(
            l.observe(t0 + 6_000 * MS, 11, 14, RTT),
            Verdict::Dead(3_000 * MS)
        );
    }

    #[test]
    fn a_long_path_gets_a_limit_in_rtts() {
        assert_eq!(silence_limit(RTT), MIN_SILENCE);
        assert_eq!(silence_limit(500 * MS), 6_000 * MS);
        let t0 = Instant::now();
        let mut l = Liveness::new(0, 0);
        assert_eq!(l.observe(t0, 0, 1, 500 * MS), Verdict::Alive);
        assert_eq!(l.observe(t0 + 5_000 * MS, 0, 3, 500 * MS), Verdict::Alive);
        assert_eq!(
            l.observe(t0 + 6_000 * MS, 0, 3, 500 * MS),
            Verdict::Dead(6_000 * MS)
        );
    }
}
