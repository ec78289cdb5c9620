//! Forward error correction for the datagram layer, below QUIC.
//!
//! QUIC recovers a lost packet only after loss detection (a reordering threshold or a probe
//! timeout, ≥ 1 RTT); for a sparse token stream the lost packet is often the last one, which
//! costs a whole PTO. FEC repairs such losses within a few milliseconds, independent of the RTT.
//!
//! [`FecSender`] groups outgoing QUIC datagrams into *blocks* of whole packets. Every packet is
//! sent at once with a 5-byte source header, never held back. A block closes when it holds
//! `k_max` packets or when its flush deadline passes (first packet + min(5 ms, sRTT/8)); then
//! `r` repair packets follow (see [`adapt`] for how `r` is chosen and `codec.rs` for the shard
//! layout and the codes). [`FecReceiver`] delivers source packets as they arrive, keeps a copy
//! per open block, and restores missing ones as soon as any `k` of the `k + r` shards are in;
//! restored packets are handed to QUIC as if they had arrived. Its loss reports travel back to
//! the peer's sender, whose redundancy follows them.
//!
//! Both objects are sans-IO state machines in the style of `quinn-proto`: packets and `now`
//! go in, bytes to send and packets to deliver come out, and the caller owns the socket and
//! the timer ([`FecSender::next_deadline`], [`FecSender::on_timeout`]). Both include the
//! obfuscation step ([`crate::obfs`]) so that what they emit is exactly the UDP payload.
//!
//! Bounds: a block holds at most [`crate::packet::MAX_BLOCK_SOURCES`] packets; the sender keeps
//! one open block and a bounded repair queue; the receiver keeps at most
//! [`ReceiverConfig::max_open_blocks`] blocks and [`ReceiverConfig::max_buffered_bytes`] bytes,
//! evicting the oldest, and forgets a block after [`ReceiverConfig::max_block_age`].

pub mod adapt;
pub(crate) mod codec;
pub mod receive_path;
mod receiver;
mod sender;

use std::time::Duration;

pub use receiver::{
    DropCounters, DropReason, FecReceiver, Received, ReceiverConfig, ReceiverStats,
};
pub use sender::{FecSender, SenderStats, QUIC_MTU_HOLD};

use crate::error::WireError;
use crate::packet::{MAX_BLOCK_REPAIRS, MAX_BLOCK_SOURCES};

/// How FEC runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FecMode {
    /// No FEC: every QUIC datagram goes out as a plain packet.
    Off,
    /// Blocks of up to `k_max` packets, redundancy from the table raised by loss reports,
    /// repair bytes capped by `max_overhead`.
    #[default]
    Auto,
    /// Blocks of up to `k` packets, each followed by exactly `r` repair packets (no cap).
    Fixed {
        /// Block size, 1..=64.
        k: u8,
        /// Repair packets per block, 1..=64.
        r: u8,
    },
}

/// Which packets FEC covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FecScope {
    /// Every packet.
    All,
    /// Only while the connection is in the interactive class
    /// ([`FecSender::set_interactive`]); bulk transfers go out plain.
    #[default]
    Interactive,
}

/// Sender configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct FecConfig {
    /// `off`, `auto` or `fixed(k, r)`.
    pub mode: FecMode,
    /// Which packets FEC covers.
    pub scope: FecScope,
    /// Most source packets per block in `auto` mode (1..=64, default 16).
    pub k_max: u8,
    /// Longest a block stays open (default 5 ms); the flush delay is
    /// `min(max_flush_delay, sRTT/8)`.
    pub max_flush_delay: Duration,
    /// Cap on repair bytes / source bytes in `auto` mode (0..=4, default 0.5), enforced as a
    /// byte budget: at every moment the repair bytes sent are at most this times the source
    /// bytes sent.
    pub max_overhead: f64,
    /// Gap between a block's repair packets when the peer reports loss bursts longer than
    /// 1.5 packets, so one burst does not take the repairs too (default 1 ms; 0 sends them
    /// back to back).
    pub repair_spacing: Duration,
    /// Longest a *sparse* block stays open in `auto` mode (default 50 ms), on every path: a
    /// block opened by a packet that follows the previous one by more than the flush delay
    /// and less than this (a token stream) stays open this long (less once its stream is
    /// overdue) or until it holds
    /// [`Adaptation::sparse_k_max`](adapt::Adaptation::sparse_k_max) packets, and gets the
    /// repairs of [`Adaptation::sparse_repairs_for`](adapt::Adaptation::sparse_repairs_for)
    /// instead of a duplicate per packet. Without a known sRTT there are no sparse blocks.
    /// The same delay is the pause after which a packet opens a *head* block
    /// ([`HEAD_EXTRA_MAX_K`]). Zero disables both. Not scaled down on short paths: there a
    /// token stream's packets would all be heads, each sent three times whatever the loss
    /// (docs/datagram-layer.md, "Short paths").
    pub max_sparse_flush_delay: Duration,
}

/// QUIC datagrams of at most this many bytes get no repairs in `auto` mode. In practice these
/// are ACK-only packets (a short header, an ACK frame and the AEAD tag: ~40 bytes with
/// quinn's 8-byte connection ids; a token is ~280). ACKs are cumulative, so the next one
/// supersedes a lost one; protecting them cost the edge half its bytes again. They do not end
/// a pause either: the packet after an ACK still opens a head block.
pub const SMALL_PACKET_MAX_LEN: usize = 64;

/// A head block (opened by the first packet after a pause: a request, an answer's headers and
/// first token) of at most this many packets gets one repair beyond the table and beyond the
/// overhead budget: a 1-packet head is sent three times (residual loss p³ instead of p²), a
/// 2-packet head gets 3 repairs.
pub const HEAD_EXTRA_MAX_K: usize = 4;

/// Most packets in a sparse block (see [`FecConfig::max_sparse_flush_delay`]; two under heavy
/// loss, [`adapt::Adaptation::sparse_k_max`]), and most repairs one gets.
pub const SPARSE_K_MAX: usize = 3;

impl Default for FecConfig {
    fn default() -> Self {
        Self {
            mode: FecMode::Auto,
            scope: FecScope::Interactive,
            k_max: 16,
            max_flush_delay: Duration::from_millis(5),
            max_overhead: 0.5,
            repair_spacing: Duration::from_millis(1),
            max_sparse_flush_delay: Duration::from_millis(50),
        }
    }
}

impl FecConfig {
    /// Checks every field against its allowed range, naming the bad key.
    pub fn validate(&self) -> Result<(), WireError> {
        let blocks = 1..=MAX_BLOCK_SOURCES;
        if !blocks.contains(&usize::from(self.k_max)) {
            return Err(WireError::InvalidConfig {
                key: "fec.k_max",
                reason: "must be in 1..=64",
            });
        }
        if let FecMode::Fixed { k, r } = self.mode {
            if !blocks.contains(&usize::from(k)) {
                return Err(WireError::InvalidConfig {
                    key: "fec.mode.fixed.k",
                    reason: "must be in 1..=64",
                });
            }
            if !(1..=MAX_BLOCK_REPAIRS).contains(&usize::from(r)) {
                return Err(WireError::InvalidConfig {
                    key: "fec.mode.fixed.r",
                    reason: "must be in 1..=64",
                });
            }
        }
        if self.max_flush_delay > Duration::from_secs(1) {
            return Err(WireError::InvalidConfig {
                key: "fec.max_flush_delay",
                reason: "must be at most 1 s",
            });
        }
        if !(0.0..=4.0).contains(&self.max_overhead) {
            return Err(WireError::InvalidConfig {
                key: "fec.max_overhead",
                reason: "must be in 0.0..=4.0 (repair bytes per source byte)",
            });
        }
        if self.max_sparse_flush_delay > Duration::from_secs(1) {
            return Err(WireError::InvalidConfig {
                key: "fec.max_sparse_flush_delay",
                reason: "must be at most 1 s",
            });
        }
        if self.repair_spacing > Duration::from_millis(100) {
            return Err(WireError::InvalidConfig {
                key: "fec.repair_spacing",
                reason: "must be at most 100 ms",
            });
        }
        Ok(())
    }
}

/// Bytes the datagram layer adds at most to a QUIC datagram: QUIC's maximum UDP payload must
/// be lowered by this so that every layer packet, repair packets included, fits the path MTU.
///
/// Plain packets add 2 bytes, source packets 5 and repair packets up to 10 (7 of header and
/// the shard's 2-byte length prefix and one pad byte); obfuscation adds the 8-byte salt.
pub fn datagram_overhead(fec: bool, obfuscated: bool) -> usize {
    let layer = if fec {
        crate::packet::REPAIR_HEADER_LEN + codec::SHARD_OVERHEAD
    } else {
        crate::packet::PLAIN_HEADER_LEN
    };
    layer + if obfuscated { crate::obfs::SALT_LEN } else { 0 }
}

/// The largest QUIC datagram the layer accepts (the largest IPv4 UDP payload, 65 507 bytes,
/// less the worst-case overhead).
pub const MAX_DATAGRAM_LEN: usize = 65_507 - 18;

/// The longest repair shard, on the wire and in a receiver: the shard of a QUIC packet of a
/// 1500-byte path with room to spare (tokenway's QUIC stops MTU discovery at 1452 bytes).
/// Without a bound, two forged repair packets of 64 KiB shards made a decoder allocate
/// megabytes and work for milliseconds.
pub const MAX_SHARD_LEN: usize = 2048;

/// The largest QUIC datagram FEC protects (its shard is at most [`MAX_SHARD_LEN`]); a larger
/// one is sent plain.
pub const MAX_PROTECTED_LEN: usize = MAX_SHARD_LEN - codec::SHARD_OVERHEAD;
