//! The whole receive path driven by one byte string: what the fuzz target
//! (`fuzz/fuzz_targets/receive_path.rs`) and the corpus regression test run.
//!
//! The input is a little script of datagrams as they would come off the UDP socket:
//!
//! ```text
//! input    = mode (1 byte) ‖ record*
//! mode     : bit 0 set = obfuscated under [`FUZZ_PSK`]
//! record   = delay_ms (1 byte) ‖ len (u16, big-endian) ‖ datagram (len bytes, fewer at the end)
//! ```
//!
//! Each datagram goes through de-obfuscation, the packet parser and the FEC receiver at a clock
//! advanced by its delay; restored packets and due loss reports are drained, timers run, and a
//! peer's loss report is applied to a sender. Nothing may panic, and the receiver's bounds must
//! hold after every step. [`encode`] builds such an input from real datagrams (seed corpus).

use std::time::{Duration, Instant};

use super::{FecReceiver, FecSender, Received, ReceiverConfig};
use crate::obfs::Obfuscator;

/// The pre-shared key of obfuscated inputs.
pub const FUZZ_PSK: &[u8] = b"tokenway fuzz pre-shared key";

/// Largest datagram a record may carry (the largest IPv4 UDP payload).
const MAX_DATAGRAM: usize = 65_507;

/// What a run saw, for tests that want more than "did not panic".
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Datagrams fed to the receiver.
    pub datagrams: u64,
    /// Packets handed to QUIC as they arrived.
    pub delivered: u64,
    /// Packets restored by FEC.
    pub recovered: u64,
    /// Loss reports from the "peer" applied to the local sender.
    pub reports: u64,
    /// Datagrams dropped by the receiver.
    pub dropped: u64,
}

/// Runs `input` (see the module docs) through the receive path.
pub fn run(input: &[u8]) -> Outcome {
    let Some((&mode, mut rest)) = input.split_first() else {
        return Outcome::default();
    };
    let obfs = (mode & 1 == 1).then(|| Obfuscator::new(FUZZ_PSK).expect("FUZZ_PSK is long enough"));
    let config = ReceiverConfig::default();
    let mut rx = FecReceiver::new(config.clone(), obfs.clone(), [7; 32])
        .expect("the default receiver configuration is valid");
    let mut tx = FecSender::new(super::FecConfig::default(), obfs, [9; 32])
        .expect("the default sender configuration is valid");
    let mut now = Instant::now();
    let mut out = Outcome::default();
    let mut scratch = Vec::with_capacity(2048);
    let mut buf = Vec::with_capacity(2048);
    while let [delay, hi, lo, tail @ ..] = rest {
        let len = usize::from(u16::from_be_bytes([*hi, *lo])).min(tail.len());
        let (datagram, next) = tail.split_at(len);
        rest = next;
        now += Duration::from_millis(u64::from(*delay));
        buf.clear();
        buf.extend_from_slice(&datagram[..datagram.len().min(MAX_DATAGRAM)]);
        out.datagrams += 1;
        match rx.on_datagram(now, &mut buf) {
            Received::Deliver(range) => {
                assert!(
                    range.end <= buf.len(),
                    "delivered range inside the datagram"
                );
                out.delivered += 1;
            }
            Received::LossReport(r) => {
                tx.on_loss_report(&r);
                out.reports += 1;
            }
            Received::Repair => {}
            Received::Dropped(_) => out.dropped += 1,
        }
        while rx.pop_recovered(&mut scratch) {
            out.recovered += 1;
        }
        rx.on_timeout(now);
        while rx.poll_transmit(now, &mut scratch) {}
        assert!(
            rx.open_blocks() <= config.max_open_blocks,
            "open blocks stay bounded"
        );
        assert!(
            rx.buffered_bytes() <= config.max_buffered_bytes,
            "buffered bytes stay bounded"
        );
    }
    // Let every block expire.
    now += config.max_block_age + Duration::from_millis(1);
    rx.on_timeout(now);
    while rx.pop_recovered(&mut scratch) {
        out.recovered += 1;
    }
    while rx.poll_transmit(now, &mut scratch) {}
    // The sender's redundancy after the reports stays within its limits (at most 2k + 1
    // repairs for a block of k; the format's own cap, 64, would always hold).
    assert!(tx.planned_repairs(16) <= 2 * 16 + 1, "redundancy bounded");
    out
}

/// Builds an input (see the module docs) from datagrams and the delay before each.
pub fn encode(obfuscated: bool, datagrams: &[(u8, Vec<u8>)]) -> Vec<u8> {
    let mut v = vec![u8::from(obfuscated)];
    for (delay, d) in datagrams {
        let len = u16::try_from(d.len()).unwrap_or(u16::MAX);
        v.push(*delay);
        v.extend_from_slice(&len.to_be_bytes());
        v.extend_from_slice(&d[..usize::from(len)]);
    }
    v
}
