//! The datagram layer's socket adapter: a `quinn::AsyncUdpSocket` that puts FEC and
//! obfuscation (the sans-IO core in `tokenway_wire::fec` and `tokenway_wire::obfs`) between
//! QUIC and the UDP socket. See docs/datagram-layer.md for the wire format.
//!
//! ```text
//! send:    quinn ─try_send─► FecSender (per peer) ─► obfuscation ─► UDP
//!          timer task ─► due repair packets, loss reports ─► UDP
//! receive: UDP ─► de-obfuscation ─► FecReceiver (per peer) ─► quinn (poll_recv)
//!                                    └► restored packets ─► quinn, as if they had arrived
//!                                    └► peer's loss reports ─► our FecSender
//! ```
//!
//! **Peers.** Layer state (an `FecSender` and an `FecReceiver`) is kept per remote address, in
//! a map bounded at [`MAX_PEERS`] and swept of peers idle for [`PEER_IDLE`]; at the bound the
//! oldest peer that has not proved two-way (a QUIC handshake with it completed, as the
//! connection's RTT follower sees) is evicted for
//! a new one (found in amortised O(1): a spoofed source costs no scan of the map), else the
//! least recently seen of all, so spoofed addresses churn through their own entries before
//! live connections' and nobody is locked out. A datagram from an
//! address without state is first checked on a copy (de-obfuscate and parse the framing): only
//! a well-framed packet that carries QUIC data (plain or source; not a lone repair or loss
//! report) creates state, so a prober or a scanner without the key costs one parse and no
//! memory. Its datagrams are dropped and counted (`stranger`); QUIC never sees them, so it
//! never answers: a prober sees silence.
//!
//! **Timers.** A task per socket sleeps until the earliest deadline of any peer (a block's
//! flush deadline, a spaced repair packet, a receiver's block expiry or loss report), or until
//! a send or receive sets an earlier one, and at least once a second for housekeeping and
//! metrics. It holds only a weak reference, and ends when the socket is dropped.
//!
//! **Locks.** The peers' senders and the map of peers are under one state lock, which every
//! send takes. Each peer's receiver has a lock of its own, and the receive path works on a GRO
//! batch in three steps: under the state lock it finds (or makes) the peer and takes pooled
//! buffers, under the receiver's lock alone it de-obfuscates, restores and decodes, and under
//! the state lock again it queues the packets for quinn and hands loss reports to the sender.
//! So a Reed-Solomon decode (100-250 µs, more under forged repairs) keeps no sender waiting.
//! The order is the state, then a receiver; the timer task only tries a receiver's lock while
//! it holds the state (a busy one gets its turn on the next wake), and the send path, the
//! metrics and the peer bound read a receiver's deadline and counters from copies the state
//! keeps, taken after each batch and each timer turn.
//!
//! **GSO/GRO.** The adapter reports the inner socket's `max_transmit_segments()`: quinn hands
//! over a GSO batch of equal-sized QUIC datagrams (the last may be shorter), each is framed
//! (header, salt, key stream) into one buffer whose stride is the framed size, and the batch
//! leaves in one GSO call as quinn would have sent it. The framing adds the same bytes to every
//! segment, except when the FEC sender switches between plain and source packets inside a
//! transmit; then the batch is split there. `max_receive_segments()` is 1: quinn gets one
//! datagram per `RecvMeta`; the inner socket may still coalesce received datagrams (GRO), which
//! are split by their stride before the layer sees them. (Before, GSO was off on send: one
//! `sendmsg` per datagram cost a fifth of the tunnel's loopback throughput.)
//!
//! **Back-pressure.** When the inner socket would block, the framed transmit is kept and
//! quinn is told `WouldBlock`; quinn retries the same transmit and the kept bytes go out, so a
//! source packet is framed exactly once (a transmit split in parts drops a refused part).
//! Repair packets and loss reports are best effort: if the socket would block they are dropped
//! and counted (`send_failed`).
//!
//! **MTU.** QUIC's payload must shrink by [`DatagramSettings::overhead`] (18 bytes with FEC
//! and obfuscation); `QuicSettings::transport_config` lowers MTU discovery's ceiling
//! accordingly.
//!
//! **RTT.** The FEC flush delay is min(5 ms, sRTT/8), so the sender towards a peer wants that
//! connection's smoothed RTT, which only quinn knows. [`LayerSlot::follow_rtt`] feeds it: a
//! task per connection copies `Connection::rtt()` into the sender of its current peer address
//! every [`RTT_FOLLOW_INTERVAL`], until the connection closes. The slot is shared by the clones
//! of the [`DatagramSettings`](crate::settings::DatagramSettings) the layer was built from and
//! always points at the endpoint's current socket, so it follows a rebind.
//!
//! **Interactive scope.** With `fec_scope = "interactive"`, a peer counts as interactive while
//! what is sent to it stays below `fec_bulk_above` (measured over 100 ms windows, leaving the
//! bulk state only below half of it): token streams and short requests get FEC, a bulk upload
//! or download goes out plain.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use quinn::udp::{EcnCodepoint, RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use tokenway_telemetry::datagram::{DatagramMetrics, SideLabels};
use tokenway_wire::fec::{
    FecConfig, FecReceiver, FecSender, Received, ReceiverConfig, ReceiverStats, SenderStats,
};
use tokenway_wire::loss_report::LossReport;
use tokenway_wire::obfs::Obfuscator;
use tokenway_wire::packet::{Packet, VERSION, VERSION_1};
use tokio::sync::Notify;

use crate::error::TransportError;
use crate::settings::DatagramSettings;

/// Most peers with layer state; the least recently seen is evicted beyond it.
pub const MAX_PEERS: usize = 1024;
/// A peer silent for this long loses its layer state.
pub const PEER_IDLE: Duration = Duration::from_secs(120);
/// New peers per second whose FEC receivers get the starting allowance of Reed-Solomon decodes;
/// later ones in the same second earn theirs from source packets, so a flood of forged
/// addresses (each a source packet and forged repairs) buys at most this many allowances (8
/// decodes of 100-250 µs each) a second, not one per address.
const FUNDED_NEW_PEERS_PER_SEC: u32 = 32;
/// How often idle peers are swept and metrics published.
const HOUSEKEEPING: Duration = Duration::from_secs(1);
/// Datagrams read from the inner socket per call.
const RECV_BATCH: usize = 4;
/// Reads from the inner socket in one `poll_recv` that yield nothing for quinn (every datagram
/// dropped, or a repair or report) before the task yields: a flood of junk must not keep quinn's
/// endpoint driver, and the tasks sharing its thread, in this loop for as long as it lasts.
const RECV_ROUNDS: usize = 32;
/// Size of each receive buffer (a GRO batch or the largest UDP payload).
const RECV_BUF: usize = 65_536;
/// Most datagrams waiting for quinn to read them; beyond it they are dropped and counted.
const MAX_READY: usize = 256;
/// Largest buffer kept for reuse: a datagram of a 1500-byte MTU path, with room.
const POOLED_CAPACITY: usize = 2048;
/// How often [`LayerSlot::follow_rtt`] copies a connection's RTT into the layer.
pub const RTT_FOLLOW_INTERVAL: Duration = Duration::from_millis(100);

/// How often the RTT follower looks until the connection's handshake has completed (at most
/// [`CONFIRM_POLL_FOR`]): repairs to a peer that spoke first are bounded until then, and the
/// answer that follows the handshake should not wait out a whole follow interval for its own.
const CONFIRM_POLL: Duration = Duration::from_millis(5);
/// How long the follower polls at [`CONFIRM_POLL`].
const CONFIRM_POLL_FOR: Duration = Duration::from_secs(2);
/// Window over which a peer's send rate is measured (interactive scope).
const RATE_WINDOW: Duration = Duration::from_millis(100);

/// The layer's runtime configuration.
#[derive(Debug, Clone)]
pub struct LayerConfig {
    /// FEC sender configuration.
    pub fec: FecConfig,
    /// FEC receiver configuration.
    pub receiver: ReceiverConfig,
    /// Obfuscation, if any.
    pub obfs: Option<Obfuscator>,
    /// Interactive scope: above this send rate (bytes/s) a peer counts as bulk.
    pub bulk_above: u64,
    /// Where counters are published (once a second).
    pub metrics: Option<DatagramMetrics>,
    /// `server` or `client`, the metrics' `side` label.
    pub side: &'static str,
    /// Where the wrapped socket is published (for [`LayerSlot::follow_rtt`]).
    pub slot: Option<LayerSlot>,
}

impl LayerConfig {
    /// From the config-file settings.
    pub fn from_settings(
        s: &DatagramSettings,
        side: &'static str,
        metrics: Option<DatagramMetrics>,
    ) -> Result<Self, TransportError> {
        s.validate("datagram")?;
        let obfs = match &s.obfs {
            Some(o) => Some(
                Obfuscator::new(o.psk.as_bytes())
                    .map_err(|e| TransportError::Config(format!("datagram.{e}")))?,
            ),
            None => None,
        };
        Ok(Self {
            fec: s.fec_config(),
            receiver: ReceiverConfig::default(),
            obfs,
            bulk_above: s.fec_bulk_above.bytes_per_sec(),
            metrics,
            side,
            slot: Some(s.layer.clone()),
        })
    }
}

/// Where an endpoint's current datagram layer is: shared by the clones of the settings it was
/// built from, set each time a socket is wrapped with them (so it follows a rebind). Holds no
/// strong reference: the layer ends with its endpoint.
#[derive(Clone, Default)]
pub struct LayerSlot(Arc<Mutex<Weak<DatagramSocket>>>);

impl std::fmt::Debug for LayerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let live = lock(&self.0).strong_count() > 0;
        f.debug_struct("LayerSlot").field("live", &live).finish()
    }
}

impl LayerSlot {
    fn set(&self, socket: &Arc<DatagramSocket>) {
        *lock(&self.0) = Arc::downgrade(socket);
    }

    /// A handle on the current layer, if one is alive.
    pub fn handle(&self) -> Option<DatagramHandle> {
        lock(&self.0)
            .upgrade()
            .map(|socket| DatagramHandle { socket })
    }

    /// Feeds `conn`'s smoothed RTT to the FEC sender towards its peer (see the module docs),
    /// on a task of the current tokio runtime, until the connection closes. Without a runtime
    /// or a layer it does nothing.
    pub fn follow_rtt(&self, conn: &quinn::Connection) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let slot = self.clone();
        let conn = conn.clone();
        runtime.spawn(async move {
            let mut share = RepairShare::default();
            let started = tokio::time::Instant::now();
            let mut confirmed = false;
            let mut first = true;
            loop {
                let period = if confirmed || started.elapsed() >= CONFIRM_POLL_FOR {
                    RTT_FOLLOW_INTERVAL
                } else {
                    CONFIRM_POLL
                };
                if !std::mem::take(&mut first) {
                    tokio::select! {
                        _ = conn.closed() => return,
                        _ = tokio::time::sleep(period) => {}
                    }
                }
                // Upgraded only for the update: the task never keeps a layer alive.
                if let Some(h) = slot.handle() {
                    let peer = conn.remote_address();
                    h.set_srtt(peer, conn.rtt());
                    let stats = conn.stats();
                    // Datagrams above QUIC's path MTU are probes: padded to their repairs' size.
                    h.set_quic_mtu(peer, stats.path.current_mtu);
                    // The repairs' share of the congestion window (see `cc`).
                    if let Some(sent) = h.sender_stats(peer) {
                        if let Some(s) = share.update(peer, &sent) {
                            if let Some(rate) = crate::cc::rate_handle(&conn) {
                                rate.set_repair_share(s);
                            }
                        }
                    }
                    // A completed handshake (HANDSHAKE_DONE sent, or received) proves the
                    // peer's address two-way: it read what QUIC sent there.
                    if stats.frame_tx.handshake_done > 0 || stats.frame_rx.handshake_done > 0 {
                        h.confirm(peer);
                        confirmed = true;
                    }
                }
            }
        });
    }
}

/// The repair bytes a connection's FEC sender sent per QUIC byte, over the RTT follower's
/// ticks: what the congestion window shares with the repairs (`cc`).
#[derive(Debug, Default)]
struct RepairShare {
    /// The peer and its sender's (QUIC bytes, repair bytes) at the last update.
    last: Option<(SocketAddr, u64, u64)>,
    /// The share, smoothed (half old, half new per interval with traffic).
    share: Option<f64>,
}

/// Least QUIC bytes in an interval that update the share (a few packets say nothing).
const REPAIR_SHARE_MIN_BYTES: u64 = 16 * 1024;

impl RepairShare {
    /// Takes the sender's counters; returns the share when it changed.
    fn update(&mut self, peer: SocketAddr, s: &SenderStats) -> Option<f64> {
        let quic = s.source_bytes + s.plain_bytes;
        let repair = s.repair_bytes;
        // A new peer (the connection migrated, or the layer's state was evicted) counts again
        // from its own counters.
        let (q0, r0) = match self.last {
            Some((p, q, r)) if p == peer && q <= quic && r <= repair => (q, r),
            _ => {
                self.last = Some((peer, quic, repair));
                return None;
            }
        };
        if quic - q0 < REPAIR_SHARE_MIN_BYTES {
            return None;
        }
        self.last = Some((peer, quic, repair));
        let now = (repair - r0) as f64 / (quic - q0) as f64;
        let share = self.share.map_or(now, |old| (old + now) / 2.0);
        self.share = Some(share);
        Some(share)
    }
}

/// Cumulative counters of a datagram socket, over all peers it has had.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DatagramStats {
    /// FEC senders' counters, summed.
    pub sent: SenderStats,
    /// FEC receivers' counters, summed.
    pub received: ReceiverStats,
    /// Datagrams from addresses without state that were not valid layer packets carrying QUIC
    /// data.
    pub stranger_drops: u64,
    /// Datagrams (repairs, loss reports) the inner socket refused, and framed datagrams that
    /// quinn did not retry.
    pub send_failed: u64,
    /// Received datagrams dropped because quinn did not read them in time, or too large.
    pub deliver_dropped: u64,
    /// Peers currently with state.
    pub peers: usize,
    /// Peers evicted (for room or idleness).
    pub peers_evicted: u64,
}

impl DatagramStats {
    /// Every datagram dropped on receipt (framing, duplicates, strangers).
    pub fn dropped(&self) -> u64 {
        self.received.dropped.total() + self.stranger_drops
    }
}

fn add_sender(a: &mut SenderStats, b: &SenderStats) {
    a.plain_packets += b.plain_packets;
    a.plain_bytes += b.plain_bytes;
    a.source_packets += b.source_packets;
    a.source_bytes += b.source_bytes;
    a.repair_packets += b.repair_packets;
    a.repair_bytes += b.repair_bytes;
    a.blocks += b.blocks;
    a.blocks_flushed += b.blocks_flushed;
    a.blocks_sparse += b.blocks_sparse;
    a.blocks_head += b.blocks_head;
    a.blocks_small += b.blocks_small;
    a.extra_bytes += b.extra_bytes;
    a.repairs_skipped_by_budget += b.repairs_skipped_by_budget;
    a.repairs_dropped_queue_full += b.repairs_dropped_queue_full;
    a.repairs_withheld += b.repairs_withheld;
    a.probes_padded += b.probes_padded;
    a.reports_applied += b.reports_applied;
    a.reports_stale += b.reports_stale;
}

fn add_receiver(a: &mut ReceiverStats, b: &ReceiverStats) {
    a.datagrams += b.datagrams;
    a.plain_packets += b.plain_packets;
    a.source_packets += b.source_packets;
    a.late_sources += b.late_sources;
    a.untracked_sources += b.untracked_sources;
    a.repair_packets += b.repair_packets;
    a.lost += b.lost;
    a.recovered += b.recovered;
    a.residual += b.residual;
    a.blocks_missing += b.blocks_missing;
    a.missing_runs += b.missing_runs;
    for (x, y) in a.bursts.0.iter_mut().zip(b.bursts.0.iter()) {
        *x += y;
    }
    a.blocks_complete += b.blocks_complete;
    a.blocks_incomplete += b.blocks_incomplete;
    a.decode_failures += b.decode_failures;
    a.decodes_refused += b.decodes_refused;
    a.recovered_dropped += b.recovered_dropped;
    a.reports_received += b.reports_received;
    a.reports_sent += b.reports_sent;
    a.resyncs += b.resyncs;
    let (d, e) = (&mut a.dropped, &b.dropped);
    d.truncated += e.truncated;
    d.unknown_version += e.unknown_version;
    d.unknown_type += e.unknown_type;
    d.malformed += e.malformed;
    d.duplicate += e.duplicate;
    d.late_repair += e.late_repair;
    d.stale += e.stale;
}

/// Sends a part of a transmit's GSO batch and clears it. If the socket would block, the part
/// is dropped and counted, like a datagram lost on the way (QUIC recovers it): only a whole
/// transmit can be kept for quinn's retry.
fn flush_batch(
    send: &impl Fn(&[u8], Option<usize>) -> io::Result<()>,
    batch: &mut Vec<u8>,
    stride: usize,
    send_failed: &mut u64,
) -> io::Result<()> {
    if batch.is_empty() {
        return Ok(());
    }
    let r = send(batch, Some(stride));
    batch.clear();
    match r {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            *send_failed += 1;
            Ok(())
        }
        r => r,
    }
}

/// A framed transmit the inner socket refused, kept for quinn's retry of the same transmit.
struct Stalled {
    original: Vec<u8>,
    framed: Vec<u8>,
    /// GSO segment size of `framed`, if it holds more than one datagram.
    segment: Option<usize>,
}

/// A peer's receiving half, locked on its own: the receive path de-obfuscates, restores and
/// decodes under this lock, not under the socket's state lock, so senders (which take the
/// state) never wait for a Reed-Solomon decode. Lock order: the state, then a peer's receiver;
/// the receive path never takes the state while it holds a receiver.
type SharedRx = Arc<Mutex<FecReceiver>>;

struct Peer {
    tx: FecSender,
    rx: SharedRx,
    /// `rx`'s next deadline as of the last time the state saw it (after the receive path's
    /// batch, or the timer's turn): the send path reads this instead of locking `rx`.
    rx_deadline: Option<Instant>,
    /// `rx`'s counters as of the same moments: metrics and retirement read these, so they
    /// never wait for a decode either (a batch in flight is counted once it is settled).
    rx_stats: ReceiverStats,
    last_seen: Instant,
    /// Local address to send from (multi-homed servers).
    src_ip: Option<IpAddr>,
    stalled: Option<Stalled>,
    window_start: Instant,
    window_bytes: u64,
    interactive: bool,
    /// A QUIC handshake with this address completed ([`DatagramHandle::confirm`], from the
    /// connection's RTT follower): a two-way peer, not an address someone spoofed. Sending
    /// again after QUIC answered is no proof: QUIC answers a forged Initial. Loss reports go
    /// only to such peers.
    confirmed: bool,
    /// A peer that spoke first (its datagram made its state), until it is confirmed: what it
    /// sent and what went to it, for the anti-amplification bound on repairs
    /// ([`Peer::may_send_repair`]). `None` for a peer this end spoke to first.
    unproven: Option<Unproven>,
    /// The ECN codepoint of QUIC's last transmit to this peer: its repairs carry it too, so
    /// that a packet they restore reaches the peer's QUIC with the mark its original had (see
    /// [`State::settle`]).
    ecn: Option<EcnCodepoint>,
}

/// Bytes exchanged with a peer that spoke first, before its handshake completed.
#[derive(Debug, Default, Clone, Copy)]
struct Unproven {
    received: u64,
    sent: u64,
}

/// QUIC's anti-amplification factor (RFC 9000 §8.1): a server sends an address it has not
/// validated at most this many times the bytes it received from it.
const AMPLIFICATION_FACTOR: u64 = 3;

impl Peer {
    /// Whether a repair of `len` bytes may go to this peer, counting it if so. QUIC keeps its
    /// own bytes to an unvalidated address within 3× what it received, but cannot see the
    /// layer's repairs: to an address that spoke first and has not completed a handshake
    /// (possibly spoofed: a forged Initial gets QUIC's answer), QUIC's bytes and the repairs
    /// together stay within that bound. Without it one forged datagram reflected ~5× its
    /// size (QUIC's 3× plus a head block's repairs). A peer this end dialled, or one whose
    /// handshake completed, is not bounded.
    fn may_send_repair(&mut self, len: usize) -> bool {
        match self.unproven.as_mut() {
            Some(u) if !self.confirmed => {
                let after = u.sent + len as u64;
                if after > AMPLIFICATION_FACTOR * u.received {
                    return false;
                }
                u.sent = after;
                true
            }
            _ => true,
        }
    }

    fn deadline(&self) -> Option<Instant> {
        match (self.tx.next_deadline(), self.rx_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Accounts `bytes` sent at `now` and moves between interactive and bulk.
    fn on_send(&mut self, now: Instant, bytes: usize, bulk_above: u64) {
        if let Some(interactive) = classify(
            &mut self.window_start,
            &mut self.window_bytes,
            self.interactive,
            now,
            bytes,
            bulk_above,
        ) {
            self.interactive = interactive;
            self.tx.set_interactive(now, interactive);
        }
    }
}

/// The interactive/bulk decision of one peer: the send rate over windows of [`RATE_WINDOW`],
/// bulk above `bulk_above` bytes/s, back to interactive below half of it. An interactive peer
/// turns bulk as soon as the current window holds more than `bulk_above` × the window, not
/// only at its end: on a fast path a bulk transfer would otherwise put a whole window of
/// data through FEC (on loopback 100 ms is ~10 MB, which measured 8 % repair overhead on a
/// 50 MB upload). Returns the new state when it changes.
fn classify(
    window_start: &mut Instant,
    window_bytes: &mut u64,
    interactive: bool,
    now: Instant,
    bytes: usize,
    bulk_above: u64,
) -> Option<bool> {
    let elapsed = now.saturating_duration_since(*window_start);
    let mut next = interactive;
    if elapsed >= RATE_WINDOW {
        let rate = *window_bytes as f64 / elapsed.as_secs_f64();
        let limit = bulk_above as f64;
        next = if interactive {
            rate <= limit
        } else {
            rate < limit / 2.0
        };
        *window_start = now;
        *window_bytes = 0;
    }
    *window_bytes += bytes as u64;
    let budget = bulk_above as f64 * RATE_WINDOW.as_secs_f64();
    if next && *window_bytes as f64 > budget {
        next = false;
        *window_start = now;
        *window_bytes = 0;
    }
    (next != interactive).then_some(next)
}

struct Ready {
    addr: SocketAddr,
    buf: Vec<u8>,
    ecn: Option<EcnCodepoint>,
    dst_ip: Option<IpAddr>,
}

/// One GRO batch of a peer's datagrams on its way through the receive path: admitted under
/// the state lock ([`State::admit`]), taken in under the peer's receiver lock alone
/// ([`Intake::take_in`]), settled under the state lock ([`State::settle`]).
struct Intake {
    addr: SocketAddr,
    rx: SharedRx,
    ecn: Option<EcnCodepoint>,
    dst_ip: Option<IpAddr>,
    /// Leading datagrams of the batch dropped as a stranger's.
    skip: usize,
    /// Empty buffers from the pool (a decode that restores more packets allocates).
    spare: Vec<Vec<u8>>,
    /// Packets for quinn, arrived or restored.
    packets: Vec<Vec<u8>>,
    /// Loss reports from the peer, for its sender (at most one per datagram of the batch).
    reports: Vec<LossReport>,
    /// The version the peer speaks, once a datagram was well framed.
    peer_version: Option<u8>,
    /// The receiver's next deadline after the batch.
    deadline: Option<Instant>,
    /// The receiver's counters after the batch.
    stats: ReceiverStats,
}

impl Intake {
    /// The middle step, without the state lock: `datagrams` through the peer's receiver
    /// (de-obfuscated in place, restored, decoded), what it delivers copied out.
    fn take_in<'a>(&mut self, now: Instant, datagrams: impl Iterator<Item = &'a mut [u8]>) {
        let mut rx = lock(&self.rx);
        for datagram in datagrams.skip(self.skip) {
            match rx.on_datagram(now, datagram) {
                Received::Deliver(range) => {
                    if let Some(d) = datagram.get(range) {
                        let mut buf = self.spare.pop().unwrap_or_default();
                        buf.clear();
                        buf.extend_from_slice(d);
                        self.packets.push(buf);
                    }
                }
                Received::LossReport(r) => self.reports.push(r),
                Received::Repair | Received::Dropped(_) => {}
            }
            loop {
                let mut buf = self.spare.pop().unwrap_or_default();
                if rx.pop_recovered(&mut buf) {
                    self.packets.push(buf);
                } else {
                    // A buffer made for the question goes, not to the pool.
                    if buf.capacity() > 0 {
                        self.spare.push(buf);
                    }
                    break;
                }
            }
        }
        self.peer_version = Some(rx.peer_version());
        self.deadline = rx.next_deadline();
        self.stats = *rx.stats();
    }
}

struct State {
    config: LayerConfig,
    peers: HashMap<SocketAddr, Peer>,
    /// Addresses in the order their state was made, for eviction at the bound: the front is
    /// the oldest entry that may still be one-way. Entries of peers since confirmed or retired
    /// are stale and dropped when they reach the front (or at housekeeping).
    newcomers: VecDeque<SocketAddr>,
    /// Scratch buffers: framed output, repairs, stranger checks, restored packets; a GSO
    /// batch of framed datagrams.
    out: Vec<u8>,
    extra: Vec<u8>,
    batch: Vec<u8>,
    ready: VecDeque<Ready>,
    pool: Vec<Vec<u8>>,
    retired_sent: SenderStats,
    retired_received: ReceiverStats,
    stranger_drops: u64,
    send_failed: u64,
    deliver_dropped: u64,
    peers_evicted: u64,
    /// The current second of new peers, and how many of them got the starting decodes.
    funded_since: Option<Instant>,
    funded: u32,
    /// When the timer task will next wake.
    timer_at: Option<Instant>,
    published: DatagramStats,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn send_raw(
    inner: &dyn AsyncUdpSocket,
    destination: SocketAddr,
    src_ip: Option<IpAddr>,
    ecn: Option<EcnCodepoint>,
    contents: &[u8],
) -> io::Result<()> {
    send_segments(inner, destination, src_ip, ecn, contents, None)
}

/// Sends `contents`, several datagrams of `segment` bytes (the last may be shorter) in one
/// GSO call when `segment` is given.
fn send_segments(
    inner: &dyn AsyncUdpSocket,
    destination: SocketAddr,
    src_ip: Option<IpAddr>,
    ecn: Option<EcnCodepoint>,
    contents: &[u8],
    segment: Option<usize>,
) -> io::Result<()> {
    inner.try_send(&Transmit {
        destination,
        ecn,
        contents,
        segment_size: segment.filter(|s| *s < contents.len()),
        src_ip,
    })
}

impl State {
    fn new(config: LayerConfig) -> Self {
        State {
            config,
            peers: HashMap::new(),
            newcomers: VecDeque::new(),
            out: Vec::with_capacity(2048),
            extra: Vec::with_capacity(2048),
            batch: Vec::with_capacity(16 * 2048),
            ready: VecDeque::new(),
            pool: Vec::new(),
            retired_sent: SenderStats::default(),
            retired_received: ReceiverStats::default(),
            stranger_drops: 0,
            send_failed: 0,
            deliver_dropped: 0,
            peers_evicted: 0,
            funded_since: None,
            funded: 0,
            timer_at: None,
            published: DatagramStats::default(),
        }
    }

    fn new_peer(&mut self, now: Instant) -> Result<Peer, TransportError> {
        let err = |e: tokenway_wire::WireError| TransportError::Config(format!("datagram.{e}"));
        let mut tx = FecSender::new(
            self.config.fec.clone(),
            self.config.obfs.clone(),
            rand::random(),
        )
        .map_err(err)?;
        tx.set_interactive(now, true);
        let mut rx = FecReceiver::new(
            self.config.receiver.clone(),
            self.config.obfs.clone(),
            rand::random(),
        )
        .map_err(err)?;
        if self
            .funded_since
            .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1))
        {
            self.funded_since = Some(now);
            self.funded = 0;
        }
        if self.funded < FUNDED_NEW_PEERS_PER_SEC {
            self.funded += 1;
        } else {
            rx.forgo_starting_decodes();
        }
        Ok(Peer {
            tx,
            rx: Arc::new(Mutex::new(rx)),
            rx_deadline: None,
            rx_stats: ReceiverStats::default(),
            last_seen: now,
            src_ip: None,
            stalled: None,
            window_start: now,
            window_bytes: 0,
            interactive: true,
            confirmed: false,
            // On the answering side every peer spoke first (a server never dials), whether its
            // state was made by its datagram or, after an eviction, by QUIC's answer to it.
            unproven: (self.config.side == "server").then(Unproven::default),
            ecn: None,
        })
    }

    /// Makes sure `addr` has state. At the bound the oldest entry that is not confirmed
    /// (two-way) makes room, or, when all are, the least recently seen of all: a flood of
    /// well-framed datagrams from spoofed addresses (possible without an obfuscation key)
    /// churns through its own entries before it touches a live connection's FEC state, and
    /// never locks a newcomer out. Finding the oldest one-way entry is amortised O(1) (the
    /// front of `newcomers`), so each spoofed source costs the same at the bound as below it;
    /// only a map full of two-way peers, which a spoofer cannot make, costs a scan.
    fn ensure_peer(&mut self, addr: SocketAddr, now: Instant) -> bool {
        if self.peers.contains_key(&addr) {
            return true;
        }
        if self.peers.len() >= MAX_PEERS {
            let victim = self.oldest_one_way().or_else(|| {
                self.peers
                    .iter()
                    .min_by_key(|(_, p)| p.last_seen)
                    .map(|(a, _)| *a)
            });
            if let Some(a) = victim {
                self.retire(a);
            }
        }
        match self.new_peer(now) {
            Ok(p) => {
                self.peers.insert(addr, p);
                if self.newcomers.len() >= 2 * MAX_PEERS {
                    self.prune_newcomers();
                }
                self.newcomers.push_back(addr);
                true
            }
            Err(e) => {
                // Unreachable with validated settings; never panic on the data path.
                tracing::warn!(error = %e, "datagram layer: cannot create peer state");
                false
            }
        }
    }

    /// Pops `newcomers` down to the oldest entry whose peer is still one-way; stale entries
    /// (confirmed or retired peers) go on the way.
    fn oldest_one_way(&mut self) -> Option<SocketAddr> {
        while let Some(a) = self.newcomers.pop_front() {
            if self.peers.get(&a).is_some_and(|p| !p.confirmed) {
                return Some(a);
            }
        }
        None
    }

    /// Drops stale `newcomers` entries, keeping one per one-way peer: its length stays within
    /// twice the peer bound.
    fn prune_newcomers(&mut self) {
        let peers = &self.peers;
        let mut seen = HashSet::with_capacity(self.newcomers.len());
        self.newcomers
            .retain(|a| peers.get(a).is_some_and(|p| !p.confirmed) && seen.insert(*a));
    }

    fn retire(&mut self, addr: SocketAddr) {
        if let Some(p) = self.peers.remove(&addr) {
            add_sender(&mut self.retired_sent, p.tx.stats());
            add_receiver(&mut self.retired_received, &p.rx_stats);
            self.peers_evicted += 1;
        }
    }

    /// Whether a datagram from an address without state is a well-framed layer packet that
    /// carries QUIC data (checked on a copy, so the real receiver sees it untouched). A repair
    /// or a loss report alone creates no state: a new peer's first datagram is a QUIC packet.
    /// Returns the version that opened it (the version byte, without obfuscation).
    fn is_layer_packet(&mut self, datagram: &[u8]) -> Option<u8> {
        let Some(obfs) = &self.config.obfs else {
            return is_quic_carrier(datagram).then(|| datagram[0]);
        };
        // A new peer's version is unknown: under the other version's key stream the first
        // byte shows a version one time in 256, so a datagram opened under the wrong one is
        // opened again under the other before it counts as a stranger's.
        [VERSION, VERSION_1].into_iter().find_map(|likely| {
            self.extra.clear();
            self.extra.extend_from_slice(datagram);
            let inner = obfs.open_in_place_as(likely, &mut self.extra).ok()?;
            is_quic_carrier(inner).then(|| inner[0])
        })
    }

    fn push_ready(&mut self, r: Ready) {
        if self.ready.len() >= MAX_READY {
            self.deliver_dropped += 1;
            self.pool_put(r.buf);
        } else {
            self.ready.push_back(r);
        }
    }

    /// Keeps a delivered buffer for reuse, unless a large datagram grew it past
    /// [`POOLED_CAPACITY`]: the pool (at most [`MAX_READY`] buffers) stays small.
    fn pool_put(&mut self, buf: Vec<u8>) {
        if buf.capacity() <= POOLED_CAPACITY && self.pool.len() < MAX_READY {
            self.pool.push(buf);
        }
    }

    /// The first of the three steps of receiving a GRO batch (`batch`, datagrams of `stride`
    /// bytes, all from `meta.addr`), under the state lock: the peer's receiver, with pooled
    /// buffers for what it will deliver. A peer without state gets it from its first
    /// well-framed layer packet that carries QUIC data; datagrams before that are strangers'
    /// (dropped and counted), and `None` if all are. The batch's datagrams from `skip` on go to
    /// [`Intake::take_in`].
    fn admit(
        &mut self,
        now: Instant,
        meta: &RecvMeta,
        batch: &[u8],
        stride: usize,
    ) -> Option<Intake> {
        let addr = meta.addr;
        let count = batch.chunks(stride).count();
        let mut skip = 0;
        if !self.peers.contains_key(&addr) {
            let mut version = None;
            skip = batch
                .chunks(stride)
                .position(|d| {
                    version = self.is_layer_packet(d);
                    version.is_some()
                })
                .unwrap_or(count);
            self.stranger_drops += skip as u64;
            if skip == count || !self.ensure_peer(addr, now) {
                return None;
            }
            // Its receiver opens that datagram again: under the stream that opened it here.
            if let (Some(v), Some(p)) = (version, self.peers.get_mut(&addr)) {
                lock(&p.rx).assume_peer_version(v);
                p.unproven = Some(Unproven::default());
            }
        }
        let peer = self.peers.get_mut(&addr)?;
        peer.last_seen = now;
        if let Some(u) = peer.unproven.as_mut().filter(|_| !peer.confirmed) {
            u.received += batch.len().saturating_sub(skip * stride) as u64;
        }
        if meta.dst_ip.is_some() {
            peer.src_ip = meta.dst_ip;
        }
        let rx = peer.rx.clone();
        let wanted = count - skip;
        let keep = self.pool.len().saturating_sub(wanted);
        Some(Intake {
            addr,
            rx,
            ecn: meta.ecn,
            dst_ip: meta.dst_ip,
            skip,
            spare: self.pool.split_off(keep),
            packets: Vec::with_capacity(wanted),
            reports: Vec::new(),
            peer_version: None,
            deadline: None,
            stats: ReceiverStats::default(),
        })
    }

    /// The last step, under the state lock again: queues what the receiver delivered for
    /// quinn, and hands the peer's loss reports and version to its sender. Returns the peer's
    /// next deadline. A peer retired (or replaced) meanwhile still gets its packets delivered,
    /// but its old receiver's outcome touches no sender.
    fn settle(&mut self, intake: Intake) -> Option<Instant> {
        let Intake {
            addr,
            rx,
            ecn,
            dst_ip,
            spare,
            packets,
            reports,
            peer_version,
            deadline,
            stats,
            ..
        } = intake;
        // A restored packet takes the mark of the datagram that completed it (the sender's
        // repairs carry its QUIC packets' codepoint): delivered unmarked, it made the peer's
        // ECN counts fall short of the ECT packets QUIC had sent, which QUIC reads as a path
        // that clears ECN marks, and it stopped using ECN for good.
        for buf in packets {
            self.push_ready(Ready {
                addr,
                buf,
                ecn,
                dst_ip,
            });
        }
        for buf in spare {
            self.pool_put(buf);
        }
        let peer = self
            .peers
            .get_mut(&addr)
            .filter(|p| Arc::ptr_eq(&p.rx, &rx))?;
        for r in &reports {
            peer.tx.on_loss_report(r);
        }
        // Answer in the version the peer speaks (an older build reads only version 1).
        if let Some(v) = peer_version.filter(|v| *v != peer.tx.version()) {
            peer.tx.set_version(v);
        }
        peer.rx_deadline = deadline;
        peer.rx_stats = stats;
        peer.deadline()
    }

    /// The three steps of receiving one datagram, for tests.
    #[cfg(test)]
    fn on_datagram(
        &mut self,
        now: Instant,
        meta: &RecvMeta,
        datagram: &mut [u8],
    ) -> Option<Instant> {
        let mut intake = self.admit(now, meta, datagram, datagram.len().max(1))?;
        intake.take_in(now, std::iter::once(datagram));
        self.settle(intake)
    }

    /// Moves ready datagrams into quinn's buffers; returns how many.
    fn deliver(&mut self, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta]) -> usize {
        let mut n = 0;
        while n < bufs.len().min(meta.len()) {
            let Some(r) = self.ready.pop_front() else {
                break;
            };
            let len = r.buf.len();
            if len > bufs[n].len() {
                self.deliver_dropped += 1;
            } else {
                bufs[n][..len].copy_from_slice(&r.buf);
                meta[n] = RecvMeta {
                    addr: r.addr,
                    len,
                    stride: len,
                    ecn: r.ecn,
                    dst_ip: r.dst_ip,
                };
                n += 1;
            }
            self.pool_put(r.buf);
        }
        n
    }

    /// Runs the timers of the peers that have one due and sends what is due; returns the
    /// earliest deadline left, of any peer. One pass under the lock, and a peer with nothing
    /// due costs only its deadline (with many edges the task wakes every millisecond, and it
    /// used to run every peer's timers and then scan them all again for the next deadline).
    fn service(&mut self, now: Instant, inner: &dyn AsyncUdpSocket) -> Option<Instant> {
        let mut failed = 0;
        let mut next: Option<Instant> = None;
        let out = &mut self.out;
        for (addr, p) in self.peers.iter_mut() {
            // The deadlines cover every timer and every queued transmit of both halves.
            if p.deadline().is_some_and(|d| d <= now) {
                p.tx.on_timeout(now);
                while p.tx.poll_transmit(now, out) {
                    if !p.may_send_repair(out.len()) {
                        p.tx.withhold_last(out.len());
                    } else if send_raw(inner, *addr, p.src_ip, p.ecn, out).is_err() {
                        failed += 1;
                    }
                }
                // The receive path may be decoding under this lock: then the receiver's turn
                // is skipped, not waited for (this task holds the state, and senders would
                // wait behind it); the receive path reschedules once its batch is settled.
                let mut rx = match p.rx.try_lock() {
                    Ok(rx) => rx,
                    Err(TryLockError::Poisoned(e)) => e.into_inner(),
                    Err(TryLockError::WouldBlock) => {
                        if let Some(d) = p.deadline() {
                            next = Some(next.map_or(d, |n| n.min(d)));
                        }
                        continue;
                    }
                };
                rx.on_timeout(now);
                while rx.poll_transmit(now, out) {
                    // Loss reports go only to a peer proved two-way (its handshake completed):
                    // an address named by forged packets gets no answer, even once QUIC has
                    // answered its forged Initial (no reflection; a prober sees silence). A
                    // report withheld is not missed: the next one carries the same counters.
                    if p.confirmed && send_raw(inner, *addr, p.src_ip, None, out).is_err() {
                        failed += 1;
                    }
                }
                p.rx_deadline = rx.next_deadline();
                p.rx_stats = *rx.stats();
            }
            if let Some(d) = p.deadline() {
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        self.send_failed += failed;
        next
    }

    /// Sweeps idle peers and publishes metrics.
    fn housekeeping(&mut self, now: Instant) {
        let idle: Vec<SocketAddr> = self
            .peers
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.last_seen) > PEER_IDLE)
            .map(|(a, _)| *a)
            .collect();
        for a in idle {
            self.retire(a);
        }
        self.prune_newcomers();
        if tracing::enabled!(tracing::Level::DEBUG) {
            // The FEC senders' block counters are not metrics; this is how a run is diagnosed
            // (`RUST_LOG=tokenway_transport::datagram=debug`).
            let s = self.stats().sent;
            tracing::debug!(
                side = self.config.side,
                blocks = s.blocks,
                blocks_sparse = s.blocks_sparse,
                blocks_flushed = s.blocks_flushed,
                source_packets = s.source_packets,
                repair_packets = s.repair_packets,
                skipped_by_budget = s.repairs_skipped_by_budget,
                "datagram layer: FEC sender counters"
            );
        }
        self.publish();
    }

    fn stats(&self) -> DatagramStats {
        let mut s = DatagramStats {
            sent: self.retired_sent,
            received: self.retired_received,
            stranger_drops: self.stranger_drops,
            send_failed: self.send_failed,
            deliver_dropped: self.deliver_dropped,
            peers: self.peers.len(),
            peers_evicted: self.peers_evicted,
        };
        for p in self.peers.values() {
            add_sender(&mut s.sent, p.tx.stats());
            add_receiver(&mut s.received, &p.rx_stats);
        }
        s
    }

    fn publish(&mut self) {
        let Some(m) = self.config.metrics.clone() else {
            return;
        };
        let t = self.stats();
        let p = self.published;
        let side = self.config.side;
        let labels = SideLabels {
            side: side.to_string(),
        };
        let inc = |f: &tokenway_telemetry::Family<SideLabels, tokenway_telemetry::Counter>,
                   now: u64,
                   before: u64| {
            if now > before {
                f.get_or_create(&labels).inc_by(now - before);
            }
        };
        inc(
            &m.source_packets,
            t.sent.source_packets,
            p.sent.source_packets,
        );
        inc(&m.source_bytes, t.sent.source_bytes, p.sent.source_bytes);
        inc(&m.plain_packets, t.sent.plain_packets, p.sent.plain_packets);
        inc(
            &m.repair_packets,
            t.sent.repair_packets,
            p.sent.repair_packets,
        );
        inc(&m.repair_bytes, t.sent.repair_bytes, p.sent.repair_bytes);
        inc(&m.recovered, t.received.recovered, p.received.recovered);
        inc(&m.lost, t.received.lost, p.received.lost);
        inc(&m.residual, t.received.residual, p.received.residual);
        inc(
            &m.decodes_refused,
            t.received.decodes_refused,
            p.received.decodes_refused,
        );
        inc(
            &m.blocks_missing,
            t.received.blocks_missing,
            p.received.blocks_missing,
        );
        const BURST_VALUES: [f64; 8] = [1.0, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0, 64.0];
        let hist = m.bursts.get_or_create(&labels);
        for (i, v) in BURST_VALUES.iter().enumerate() {
            let d = t.received.bursts.0[i].saturating_sub(p.received.bursts.0[i]);
            for _ in 0..d.min(100_000) {
                hist.observe(*v);
            }
        }
        drop(hist);
        let (d, e) = (&t.received.dropped, &p.received.dropped);
        for (reason, now, before) in [
            ("truncated", d.truncated, e.truncated),
            ("unknown_version", d.unknown_version, e.unknown_version),
            ("unknown_type", d.unknown_type, e.unknown_type),
            ("malformed", d.malformed, e.malformed),
            ("duplicate", d.duplicate, e.duplicate),
            ("late_repair", d.late_repair, e.late_repair),
            ("stale", d.stale, e.stale),
            ("stranger", t.stranger_drops, p.stranger_drops),
            ("send_failed", t.send_failed, p.send_failed),
            ("deliver_dropped", t.deliver_dropped, p.deliver_dropped),
        ] {
            m.add_dropped(side, reason, now.saturating_sub(before));
        }
        m.peers
            .get_or_create(&labels)
            .set(i64::try_from(t.peers).unwrap_or(i64::MAX));
        self.published = t;
    }
}

struct RecvBufs {
    bufs: [Vec<u8>; RECV_BATCH],
    meta: [RecvMeta; RECV_BATCH],
}

/// The `AsyncUdpSocket` with the datagram layer; wraps quinn's own socket.
pub struct DatagramSocket {
    inner: Arc<dyn AsyncUdpSocket>,
    state: Mutex<State>,
    recv: Mutex<RecvBufs>,
    wake: Arc<Notify>,
}

impl std::fmt::Debug for DatagramSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatagramSocket")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// A handle on a datagram socket, for counters and tests.
#[derive(Clone, Debug)]
pub struct DatagramHandle {
    socket: Arc<DatagramSocket>,
}

impl DatagramHandle {
    /// The cumulative counters.
    pub fn stats(&self) -> DatagramStats {
        lock(&self.socket.state).stats()
    }

    /// Tells the FEC sender towards `peer` the connection's smoothed RTT (the flush delay is
    /// min(5 ms, sRTT/8)); without it the flush delay is 5 ms.
    pub fn set_srtt(&self, peer: SocketAddr, srtt: Duration) {
        if let Some(p) = lock(&self.socket.state).peers.get_mut(&peer) {
            p.tx.set_srtt(srtt);
        }
    }

    /// Tells the FEC sender towards `peer` QUIC's current path MTU: larger datagrams are MTU
    /// probes, sent padded to the size of their repairs ([`FecSender::set_quic_mtu`]).
    pub fn set_quic_mtu(&self, peer: SocketAddr, mtu: u16) {
        if let Some(p) = lock(&self.socket.state).peers.get_mut(&peer) {
            p.tx.set_quic_mtu(Instant::now(), mtu);
        }
    }

    /// Marks `peer` two-way (a QUIC handshake with it completed): at the peer bound it is
    /// evicted only after every entry that is not.
    pub fn confirm(&self, peer: SocketAddr) {
        if let Some(p) = lock(&self.socket.state).peers.get_mut(&peer) {
            p.confirmed = true;
        }
    }

    /// Whether `peer` is marked two-way.
    pub fn confirmed(&self, peer: SocketAddr) -> bool {
        lock(&self.socket.state)
            .peers
            .get(&peer)
            .is_some_and(|p| p.confirmed)
    }

    /// The counters of the FEC sender towards `peer`, if it has state.
    pub fn sender_stats(&self, peer: SocketAddr) -> Option<SenderStats> {
        lock(&self.socket.state)
            .peers
            .get(&peer)
            .map(|p| *p.tx.stats())
    }

    /// The smoothed RTT the FEC sender towards `peer` was last told, if any.
    pub fn srtt(&self, peer: SocketAddr) -> Option<Duration> {
        lock(&self.socket.state)
            .peers
            .get(&peer)
            .and_then(|p| p.tx.srtt())
    }
}

impl DatagramSocket {
    /// Wraps `inner` (quinn's socket over a bound UDP socket) with the layer, and starts the
    /// timer task on the current tokio runtime.
    pub fn wrap(
        inner: Arc<dyn AsyncUdpSocket>,
        config: LayerConfig,
    ) -> Result<(Arc<dyn AsyncUdpSocket>, DatagramHandle), TransportError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            TransportError::Config("the datagram layer needs a tokio runtime".into())
        })?;
        let socket = Arc::new(DatagramSocket {
            inner,
            state: Mutex::new(State::new(config)),
            recv: Mutex::new(RecvBufs {
                bufs: std::array::from_fn(|_| vec![0u8; RECV_BUF]),
                meta: [RecvMeta::default(); RECV_BATCH],
            }),
            wake: Arc::new(Notify::new()),
        });
        if let Some(slot) = &lock(&socket.state).config.slot {
            slot.set(&socket);
        }
        runtime.spawn(timer_task(Arc::downgrade(&socket), socket.wake.clone()));
        let handle = DatagramHandle {
            socket: socket.clone(),
        };
        let dyn_socket: Arc<dyn AsyncUdpSocket> = Arc::new(Outer(socket));
        Ok((dyn_socket, handle))
    }

    /// Wakes the timer task if `deadline` is earlier than its current one.
    fn schedule(&self, st: &mut State, deadline: Option<Instant>) {
        if let Some(d) = deadline {
            if st.timer_at.is_none_or(|t| d < t) {
                st.timer_at = Some(d);
                self.wake.notify_one();
            }
        }
    }

    fn send(&self, t: &Transmit<'_>) -> io::Result<()> {
        let now = Instant::now();
        let mut guard = lock(&self.state);
        let st = &mut *guard;
        if !st.ensure_peer(t.destination, now) {
            st.send_failed += 1;
            return Ok(());
        }
        let bulk_above = st.config.bulk_above;
        let State {
            peers,
            out,
            extra,
            batch,
            send_failed,
            ..
        } = st;
        let Some(peer) = peers.get_mut(&t.destination) else {
            return Ok(());
        };
        peer.last_seen = now;
        if t.src_ip.is_some() {
            peer.src_ip = t.src_ip;
        }
        peer.ecn = t.ecn;
        if let Some(u) = peer.unproven.as_mut().filter(|_| !peer.confirmed) {
            // QUIC's own bytes, within its bound; the layer's framing adds a few per datagram.
            u.sent += t.contents.len() as u64;
        }
        let inner = self.inner.as_ref();
        let segment = t.segment_size.unwrap_or(t.contents.len()).max(1);
        let send = |framed: &[u8], seg: Option<usize>| {
            send_segments(inner, t.destination, t.src_ip, t.ecn, framed, seg)
        };
        // Whatever becomes of the transmit (sent, refused by a full socket, an error), the
        // timer is set for the block it opened or filled: its repairs are due then.
        let mut framed = || -> io::Result<()> {
            if let Some(s) = peer.stalled.take() {
                if s.original == t.contents {
                    return match send(&s.framed, s.segment) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            peer.stalled = Some(s);
                            Err(e)
                        }
                        r => r,
                    };
                }
                *send_failed += 1;
            }
            // Every segment is framed (header, salt, key stream) into one batch with a stride of
            // the framed segment size, and the batch goes out in one GSO call, as quinn would have
            // sent it. The framing adds the same bytes to every segment unless the FEC sender
            // switches between plain and source packets mid-transmit: then the batch is split.
            batch.clear();
            let mut stride = 0;
            let mut flushed = false;
            let mut chunks = t.contents.chunks(segment).peekable();
            while let Some(quic) = chunks.next() {
                peer.on_send(now, quic.len(), bulk_above);
                if peer.tx.send(now, quic, out).is_err() {
                    // Larger than the layer can frame: dropped, like an oversized datagram.
                    *send_failed += 1;
                    continue;
                }
                if !batch.is_empty() && out.len() > stride {
                    flushed = true;
                    flush_batch(&send, batch, stride, send_failed)?;
                }
                if batch.is_empty() {
                    stride = out.len();
                }
                batch.extend_from_slice(out);
                if out.len() < stride && chunks.peek().is_some() {
                    // A shorter datagram ends a GSO batch.
                    flushed = true;
                    flush_batch(&send, batch, stride, send_failed)?;
                }
            }
            if flushed {
                flush_batch(&send, batch, stride, send_failed)?;
            } else if !batch.is_empty() {
                // The whole transmit in one call: if the socket would block, keep it for quinn's
                // retry of the same transmit (framed once, sent once).
                match send(batch, Some(stride)) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        peer.stalled = Some(Stalled {
                            original: t.contents.to_vec(),
                            framed: std::mem::take(batch),
                            segment: Some(stride),
                        });
                        return Err(e);
                    }
                    r => r?,
                }
            }
            Ok(())
        };
        let result = framed();
        if result.is_ok() {
            while peer.tx.poll_transmit(now, extra) {
                if !peer.may_send_repair(extra.len()) {
                    peer.tx.withhold_last(extra.len());
                } else if send_raw(inner, t.destination, peer.src_ip, t.ecn, extra).is_err() {
                    *send_failed += 1;
                }
            }
        }
        let deadline = peer.deadline();
        self.schedule(st, deadline);
        result
    }

    fn recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        for _ in 0..RECV_ROUNDS {
            {
                let mut st = lock(&self.state);
                if !st.ready.is_empty() {
                    let n = st.deliver(bufs, meta);
                    if n > 0 {
                        return Poll::Ready(Ok(n));
                    }
                }
            }
            let mut guard = lock(&self.recv);
            let RecvBufs {
                bufs: ours,
                meta: metas,
            } = &mut *guard;
            let n = {
                let mut slices = ours.each_mut().map(|b| IoSliceMut::new(b.as_mut_slice()));
                match self.inner.poll_recv(cx, &mut slices, metas) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Ready(Ok(n)) => n,
                }
            };
            let now = Instant::now();
            // Admitted under the state lock, taken in under each peer's receiver lock alone
            // (de-obfuscation and decodes keep no sender waiting), settled under the state.
            let mut intakes: [Option<Intake>; RECV_BATCH] = Default::default();
            {
                let mut st = lock(&self.state);
                for ((buf, m), intake) in ours.iter().zip(metas.iter()).zip(&mut intakes).take(n) {
                    let (len, stride) = gro_layout(buf, m);
                    *intake = st.admit(now, m, &buf[..len], stride);
                }
            }
            for ((buf, m), intake) in ours.iter_mut().zip(metas.iter()).zip(&mut intakes).take(n) {
                if let Some(intake) = intake {
                    let (len, stride) = gro_layout(buf, m);
                    intake.take_in(now, buf[..len].chunks_mut(stride));
                }
            }
            let mut st = lock(&self.state);
            let mut earliest: Option<Instant> = None;
            for intake in intakes.into_iter().flatten() {
                if let Some(d) = st.settle(intake) {
                    earliest = Some(earliest.map_or(d, |e| e.min(d)));
                }
            }
            self.schedule(&mut st, earliest);
        }
        let n = lock(&self.state).deliver(bufs, meta);
        if n > 0 {
            return Poll::Ready(Ok(n));
        }
        // More may be waiting: come back after the other tasks had their turn.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// Whether `packet` (de-obfuscated) is a plain or source packet of the layer: one that
/// carries QUIC data.
fn is_quic_carrier(packet: &[u8]) -> bool {
    matches!(
        tokenway_wire::packet::parse(packet),
        Ok(Packet::Plain(_) | Packet::PaddedPlain(_) | Packet::Source(..))
    )
}

/// The length and stride of a received GRO batch in `buf` (a stride of 0 means one datagram).
fn gro_layout(buf: &[u8], m: &RecvMeta) -> (usize, usize) {
    let len = m.len.min(buf.len());
    let stride = if m.stride == 0 { len } else { m.stride };
    (len, stride.max(1))
}

/// What quinn holds: dropping it (the endpoint closing) wakes the timer task so it ends.
#[derive(Debug)]
struct Outer(Arc<DatagramSocket>);

impl Drop for Outer {
    fn drop(&mut self) {
        self.0.wake.notify_one();
    }
}

impl AsyncUdpSocket for Outer {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.0.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        self.0.send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.0.recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.0.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.0.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        1
    }

    fn may_fragment(&self) -> bool {
        self.0.inner.may_fragment()
    }
}

/// Sleeps until the earliest deadline of any peer (or the next housekeeping), then runs the
/// peers' timers. Ends when the socket is gone (quinn dropped it and no handle is left).
async fn timer_task(socket: Weak<DatagramSocket>, wake: Arc<Notify>) {
    let mut housekeeping = Instant::now() + HOUSEKEEPING;
    loop {
        let deadline = {
            let Some(socket) = socket.upgrade() else {
                return;
            };
            if Arc::strong_count(&socket) == 1 {
                // Only this task holds it: the endpoint is gone.
                return;
            }
            let mut st = lock(&socket.state);
            let now = Instant::now();
            let next = st.service(now, socket.inner.as_ref());
            if now >= housekeeping {
                // Retires idle peers, whose deadlines then no longer matter (a later one is
                // at worst a wake for nothing).
                st.housekeeping(now);
                housekeeping = now + HOUSEKEEPING;
            }
            let d = next
                .map_or(housekeeping, |d| d.min(housekeeping))
                .max(now + Duration::from_millis(1));
            st.timer_at = Some(d);
            d
        };
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep_until(deadline.into()) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::Identity;
    use crate::settings::{DatagramSettings, QuicSettings};
    use crate::trust::{client_tls, Trust};

    fn layered() -> QuicSettings {
        QuicSettings {
            zero_rtt: false,
            datagram: Some(DatagramSettings::default()),
            ..QuicSettings::default()
        }
    }

    #[test]
    fn a_bulk_burst_turns_bulk_within_its_first_window_and_a_trickle_stays_interactive() {
        let t0 = Instant::now();
        let (mut start, mut bytes) = (t0, 0u64);
        // 250 kB/s limit: a window of 100 ms holds 25 kB. A burst at wire speed turns bulk
        // after 25 kB, not after 100 ms of it.
        let mut state = true;
        let mut sent = 0;
        for i in 0..100u32 {
            let now = t0 + Duration::from_micros(10 * u64::from(i));
            if let Some(s) = classify(&mut start, &mut bytes, state, now, 1_200, 250_000) {
                state = s;
                break;
            }
            sent += 1_200;
        }
        assert!(!state, "the burst is bulk");
        assert!(sent <= 25_200, "{sent} bytes went out as interactive");
        // A token stream: 200 bytes every 20 ms stays interactive.
        let (mut start, mut bytes) = (t0, 0u64);
        for i in 0..200u64 {
            let now = t0 + Duration::from_millis(20 * i);
            assert_eq!(
                classify(&mut start, &mut bytes, true, now, 200, 250_000),
                None
            );
        }
        // A bulk peer goes back to interactive once a window is below half the limit.
        let (mut start, mut bytes) = (t0, 0u64);
        let later = t0 + Duration::from_millis(150);
        assert_eq!(
            classify(&mut start, &mut bytes, false, later, 200, 250_000),
            Some(true)
        );
    }

    /// A packet FEC restores reaches QUIC with the ECN mark of the datagram that completed it
    /// (the sender's repairs carry its QUIC packets' mark). Delivered unmarked, restored
    /// packets made the peer's ECN counts fall short of the ECT packets QUIC sent, and QUIC
    /// took the path for one that clears ECN and stopped using it.
    #[test]
    fn a_restored_packet_keeps_the_ecn_mark_of_the_datagram_that_completed_it() {
        let config = LayerConfig::from_settings(&DatagramSettings::default(), "server", None)
            .expect("layer config");
        let mut st = State::new(config);
        let t0 = Instant::now();
        let fec = FecConfig {
            mode: tokenway_wire::fec::FecMode::Fixed { k: 2, r: 1 },
            scope: tokenway_wire::fec::FecScope::All,
            ..FecConfig::default()
        };
        let mut tx = FecSender::new(fec, None, [7; 32]).expect("sender");
        let mut wire = Vec::new();
        for n in [1u8, 2] {
            let mut out = Vec::new();
            tx.send(t0, &[0x40 | n; 100], &mut out).expect("framed");
            wire.push(out);
        }
        tx.on_timeout(t0 + Duration::from_secs(1));
        let mut repair = Vec::new();
        assert!(tx.poll_transmit(t0 + Duration::from_secs(1), &mut repair));
        let meta = RecvMeta {
            addr: SocketAddr::from(([198, 18, 0, 1], 4433)),
            ecn: Some(EcnCodepoint::Ect0),
            ..RecvMeta::default()
        };
        // The first source arrives, the second is lost, the repair restores it.
        st.on_datagram(t0, &meta, &mut wire[0]);
        st.on_datagram(t0, &meta, &mut repair);
        let delivered: Vec<_> = st.ready.iter().map(|r| (r.buf[0], r.ecn)).collect();
        assert_eq!(
            delivered,
            [
                (0x41, Some(EcnCodepoint::Ect0)),
                (0x42, Some(EcnCodepoint::Ect0))
            ]
        );
    }

    #[test]
    fn spoofed_strangers_evict_each_other_before_two_way_peers_and_a_loss_report_makes_no_state() {
        let config = LayerConfig::from_settings(&DatagramSettings::default(), "server", None)
            .expect("layer config");
        let mut st = State::new(config);
        let t0 = Instant::now();
        let meta = |i: usize| RecvMeta {
            addr: SocketAddr::from(([198, 18, (i >> 8) as u8, i as u8], 4433)),
            ..RecvMeta::default()
        };
        let quic = |st: &State| {
            let mut tx = FecSender::new(st.config.fec.clone(), st.config.obfs.clone(), [7; 32])
                .expect("sender");
            let mut out = Vec::new();
            tx.send(t0, &[0x40; 40], &mut out).expect("framed");
            out
        };
        let receive = |st: &mut State, i: usize, at: Instant| {
            let mut d = quic(st);
            st.on_datagram(at, &meta(i), &mut d);
        };
        let (t1, later) = (t0 + Duration::from_secs(1), t0 + Duration::from_secs(2));
        for i in 0..MAX_PEERS {
            receive(&mut st, i, t1);
        }
        assert_eq!(st.peers.len(), MAX_PEERS);
        // They all came within one second: only the first few got the starting decodes.
        assert_eq!(st.funded, FUNDED_NEW_PEERS_PER_SEC);
        // Every one sent again: no proof of anything (QUIC answers a forged Initial, and a
        // spoofer can send again). Then the handshakes of all but peer 7 completed: two-way
        // peers.
        for i in 0..MAX_PEERS {
            receive(&mut st, i, later);
        }
        assert!(st.peers.values().all(|p| !p.confirmed));
        for i in (0..MAX_PEERS).filter(|&i| i != 7) {
            st.peers.get_mut(&meta(i).addr).expect("peer").confirmed = true;
        }
        // Peer 0 (two-way) has been quiet longest; still a newcomer takes the one-way entry.
        st.peers.get_mut(&meta(0).addr).expect("peer 0").last_seen = t0;
        receive(&mut st, MAX_PEERS, later);
        assert!(st.peers.contains_key(&meta(MAX_PEERS).addr));
        assert!(
            !st.peers.contains_key(&meta(7).addr),
            "the one-way entry goes first"
        );
        assert!(st.peers.contains_key(&meta(0).addr), "two-way peers stay");
        // With every entry two-way, a newcomer still gets in (nobody is locked out): the least
        // recently seen makes room.
        st.peers
            .get_mut(&meta(MAX_PEERS).addr)
            .expect("newcomer")
            .confirmed = true;
        receive(&mut st, MAX_PEERS + 1, later);
        assert!(st.peers.contains_key(&meta(MAX_PEERS + 1).addr));
        assert!(!st.peers.contains_key(&meta(0).addr));
        assert_eq!(st.peers_evicted, 2);
        // Half the two-way peers leave, then a flood of spoofed sources, three times the bound,
        // fills the free half and cycles through it, oldest first, while the two-way half
        // stays; the eviction queue stays within twice the bound.
        let two_way: Vec<SocketAddr> = st
            .peers
            .iter()
            .filter(|(_, p)| p.confirmed)
            .map(|(a, _)| *a)
            .take(MAX_PEERS / 2)
            .collect();
        let gone: Vec<SocketAddr> = st
            .peers
            .keys()
            .filter(|a| !two_way.contains(a))
            .copied()
            .collect();
        for a in gone {
            st.retire(a);
        }
        for i in 0..3 * MAX_PEERS {
            receive(&mut st, 10_000 + i, later);
            assert!(st.newcomers.len() <= 2 * MAX_PEERS);
        }
        assert_eq!(st.peers.len(), MAX_PEERS);
        assert!(two_way.iter().all(|a| st.peers.contains_key(a)));
        let newest = (3 * MAX_PEERS - MAX_PEERS / 2..3 * MAX_PEERS).map(|i| meta(10_000 + i).addr);
        assert!(
            newest.into_iter().all(|a| st.peers.contains_key(&a)),
            "the newest stay"
        );
        // A loss report from an address without state creates none.
        let mut report = Vec::new();
        tokenway_wire::packet::write_loss_report(
            &mut report,
            &tokenway_wire::loss_report::LossReport::default(),
        );
        let stranger = meta(MAX_PEERS + 2);
        st.on_datagram(later, &stranger, &mut report);
        assert!(!st.peers.contains_key(&stranger.addr));
        assert_eq!(st.stranger_drops, 1);
    }

    #[test]
    fn the_receive_paths_buffers_are_reused_not_piled_up() {
        let config = LayerConfig::from_settings(&DatagramSettings::default(), "server", None)
            .expect("layer config");
        let mut st = State::new(config);
        let mut tx = FecSender::new(st.config.fec.clone(), None, [7; 32]).expect("sender");
        let meta = RecvMeta {
            addr: SocketAddr::from(([198, 18, 0, 1], 443)),
            ..RecvMeta::default()
        };
        let (t0, mut out) = (Instant::now(), Vec::new());
        for i in 0..5000u64 {
            let at = t0 + Duration::from_millis(i);
            tx.send(at, &[0x40; 200], &mut out).expect("framed");
            st.on_datagram(at, &meta, &mut out);
            // Quinn reads them (the buffers go back to the pool).
            while let Some(r) = st.ready.pop_front() {
                st.pool_put(r.buf);
            }
        }
        // One buffer goes round; none is made per batch and left in the pool.
        assert!(st.pool.len() <= 2, "{} pooled buffers", st.pool.len());
    }

    #[test]
    fn a_new_version_1_peers_first_datagrams_are_never_taken_for_a_strangers() {
        let mut config = LayerConfig::from_settings(&DatagramSettings::default(), "server", None)
            .expect("layer config");
        let obfs = Obfuscator::new(b"a pre-shared key of the test").expect("key");
        config.obfs = Some(obfs.clone());
        let mut st = State::new(config);
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (mut strangers, mut lost) = (0, 0);
        for i in 0..2048u32 {
            // A version-1 plain packet (an older build's), sealed under version 1's stream.
            let mut d = vec![0u8; tokenway_wire::obfs::SALT_LEN];
            d.extend_from_slice(&[VERSION_1, 0]);
            d.extend_from_slice(&i.to_be_bytes());
            d.extend_from_slice(&[0x40; 40]);
            obfs.seal_in_place_as(VERSION_1, &mut rng, &mut d);
            strangers += usize::from(st.is_layer_packet(&d) != Some(VERSION_1));
            // From a new address each: the peer made for it reads it in the same version and
            // hands it to QUIC.
            let meta = RecvMeta {
                addr: SocketAddr::from(([198, 18, (i >> 8) as u8, i as u8], 443)),
                ..RecvMeta::default()
            };
            st.ready.clear();
            st.on_datagram(Instant::now(), &meta, &mut d);
            lost += usize::from(st.ready.len() != 1);
        }
        // Read under version 2's stream first, one in 256 showed a 2 and failed to parse:
        // about eight of 2048 first datagrams were dropped as a stranger's, or, once let in,
        // by the new peer's receiver.
        assert_eq!((strangers, lost), (0, 0));
        // Random bytes still are a stranger's.
        let junk: Vec<u8> = (0..64).map(|_| rng.random()).collect();
        assert!(st.is_layer_packet(&junk).is_none());
    }

    #[tokio::test]
    async fn sends_and_the_timer_do_not_wait_for_a_receiver_that_is_busy_decoding() {
        let config = LayerConfig::from_settings(&DatagramSettings::default(), "client", None)
            .expect("layer config");
        let ours = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let theirs = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let peer = theirs.local_addr().expect("bound");
        let inner = crate::socket::async_socket(ours).expect("socket");
        let (socket, handle) = DatagramSocket::wrap(inner, config).expect("layer");
        let transmit = move |socket: &Arc<dyn AsyncUdpSocket>| {
            socket.try_send(&Transmit {
                destination: peer,
                ecn: None,
                contents: &[0x40; 300],
                segment_size: None,
                src_ip: None,
            })
        };
        // Tokio's socket knows it is writable only once polled.
        let mut poller = socket.clone().create_io_poller();
        std::future::poll_fn(|cx| poller.as_mut().poll_writable(cx))
            .await
            .expect("writable");
        transmit(&socket).expect("first send makes the peer");
        let rx = lock(&handle.socket.state).peers[&peer].rx.clone();
        // Another thread holds the peer's receiver, as the receive path does while it decodes.
        let (held_tx, held) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _busy = lock(&rx);
            held_tx.send(()).expect("held");
            let _ = release_rx.recv();
        });
        held.recv().expect("the receiver is held");
        let (done_tx, done) = std::sync::mpsc::channel();
        let sender = {
            let socket = socket.clone();
            let state = handle.socket.clone();
            std::thread::spawn(move || {
                let sent = (0..20).all(|_| transmit(&socket).is_ok());
                // The timer's turn with every deadline due: the busy receiver is skipped.
                let later = Instant::now() + Duration::from_secs(1);
                let next = lock(&state.state).service(later, state.inner.as_ref());
                done_tx.send((sent, next)).expect("done");
            })
        };
        // A sender that waited for the receiver would still be waiting (and is let go below,
        // so the test fails instead of hanging).
        let outcome = done.recv_timeout(Duration::from_secs(10));
        release.send(()).expect("release");
        holder.join().expect("holder");
        sender.join().expect("sender");
        let (sent, next) =
            outcome.expect("sends and the timer went on while the receiver was busy");
        assert!(sent, "every send went out");
        // The timer's turn closed the open block and sent its repairs (the sender's side of
        // the peer, which the busy receiver did not hold up).
        let stats = handle.stats();
        eprintln!("{:?} next {next:?}", stats.sent);
        assert_eq!(stats.sent.source_packets, 21);
        assert!(stats.sent.repair_packets > 0, "{:?}", stats.sent);
    }

    #[test]
    fn the_repair_share_follows_the_senders_counters_per_peer() {
        let (a, b) = (
            SocketAddr::from(([198, 18, 0, 1], 443)),
            SocketAddr::from(([198, 18, 0, 2], 443)),
        );
        let sent = |source, plain, repair| SenderStats {
            source_bytes: source,
            plain_bytes: plain,
            repair_bytes: repair,
            ..SenderStats::default()
        };
        let mut share = RepairShare::default();
        assert_eq!(
            share.update(a, &sent(1_000, 0, 500)),
            None,
            "a baseline first"
        );
        // Too few bytes since: nothing yet, and they count with the next interval's.
        assert_eq!(share.update(a, &sent(5_000, 0, 2_500)), None);
        assert_eq!(share.update(a, &sent(41_000, 0, 20_500)), Some(0.5));
        // Plain (bulk) bytes count as QUIC's, and the share is smoothed: (0.5 + 0) / 2.
        assert_eq!(share.update(a, &sent(41_000, 40_000, 20_500)), Some(0.25));
        // Another peer (the connection moved): a new baseline from its own counters.
        assert_eq!(share.update(b, &sent(100, 0, 100)), None);
        assert_eq!(share.update(b, &sent(40_100, 0, 100)), Some(0.125));
    }

    /// A server-side layer on a loopback socket, ready to send; a peer's socket (reads time
    /// out after 300 ms), and an FEC sender playing that peer, interactive from `t0`.
    struct ServerLayer {
        socket: Arc<dyn AsyncUdpSocket>,
        handle: DatagramHandle,
        theirs: std::net::UdpSocket,
        peer: SocketAddr,
        sender: FecSender,
    }

    async fn server_layer(t0: Instant) -> ServerLayer {
        let config = LayerConfig::from_settings(&DatagramSettings::default(), "server", None)
            .expect("layer config");
        let fec = config.fec.clone();
        let ours = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let theirs = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        theirs
            .set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        let peer = theirs.local_addr().expect("bound");
        let inner = crate::socket::async_socket(ours).expect("socket");
        let (socket, handle) = DatagramSocket::wrap(inner, config).expect("layer");
        let mut poller = socket.clone().create_io_poller();
        std::future::poll_fn(|cx| poller.as_mut().poll_writable(cx))
            .await
            .expect("writable");
        let mut sender = FecSender::new(fec, None, [9; 32]).expect("sender");
        sender.set_interactive(t0, true);
        ServerLayer {
            socket,
            handle,
            theirs,
            peer,
            sender,
        }
    }

    /// QUIC sends an unvalidated address at most 3× what it received from it; the layer's
    /// repairs, which QUIC cannot see, must not take that past 3× (one forged datagram, with
    /// a spoofed source, reflected ~5× its size in QUIC's answer and its head block's
    /// repairs). A peer whose handshake completed gets its repairs.
    #[tokio::test]
    async fn repairs_to_an_address_that_spoke_first_keep_quics_amplification_bound() {
        let t0 = Instant::now();
        let ServerLayer {
            socket,
            handle,
            theirs,
            peer,
            mut sender,
        } = server_layer(t0).await;
        // One datagram from `peer` (a QUIC Initial, maybe from a spoofed address), QUIC's
        // answer of three datagrams, and the layer's timers past the answer's block.
        let round = |sender: &mut FecSender, at: Instant| {
            let mut out = Vec::new();
            sender.send(at, &[0xc0; 1190], &mut out).expect("framed");
            let meta = RecvMeta {
                addr: peer,
                len: out.len(),
                stride: out.len(),
                ..RecvMeta::default()
            };
            let received = out.len();
            lock(&handle.socket.state).on_datagram(at, &meta, &mut out);
            socket
                .try_send(&Transmit {
                    destination: peer,
                    ecn: None,
                    contents: &[0xc0; 3300],
                    segment_size: Some(1100),
                    src_ip: None,
                })
                .expect("QUIC answers");
            let later = at + Duration::from_secs(2);
            lock(&handle.socket.state).service(later, handle.socket.inner.as_ref());
            let (mut sent, mut repairs) = (0, 0);
            let mut buf = [0u8; 2048];
            while let Ok(n) = theirs.recv(&mut buf) {
                sent += n;
                let packet = tokenway_wire::packet::parse(&buf[..n]).expect("a layer packet");
                repairs += usize::from(matches!(packet, Packet::Repair(..)));
            }
            (received, sent, repairs)
        };
        let (received, sent, repairs) = round(&mut sender, t0);
        assert!(
            sent <= 3 * received,
            "{sent} bytes went to an address that sent {received}"
        );
        assert_eq!(repairs, 0);
        let withheld = handle.sender_stats(peer).expect("state").repairs_withheld;
        assert!(withheld >= 1, "the head block's repairs were withheld");
        // An address whose state QUIC's answer made (its own was evicted by a flood of
        // others, or it never had any here) is bounded too: it sent nothing this end knows.
        let other = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        other
            .set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        let to = other.local_addr().expect("bound");
        socket
            .try_send(&Transmit {
                destination: to,
                ecn: None,
                contents: &[0xc0; 3300],
                segment_size: Some(1100),
                src_ip: None,
            })
            .expect("QUIC answers");
        lock(&handle.socket.state)
            .service(t0 + Duration::from_secs(2), handle.socket.inner.as_ref());
        let mut buf = [0u8; 2048];
        while let Ok(n) = other.recv(&mut buf) {
            let packet = tokenway_wire::packet::parse(&buf[..n]).expect("a layer packet");
            assert!(
                !matches!(packet, Packet::Repair(..)),
                "a repair went to {to}"
            );
        }
        // Its handshake completed: the next answer gets its repairs.
        handle.confirm(peer);
        let (_, _, repairs) = round(&mut sender, t0 + Duration::from_secs(3));
        assert!(repairs >= 1, "a confirmed peer got no repairs");
    }

    #[tokio::test]
    async fn loss_reports_go_only_to_a_peer_whose_handshake_completed() {
        let t0 = Instant::now();
        let ServerLayer {
            socket,
            handle,
            theirs,
            peer,
            mut sender,
        } = server_layer(t0).await;
        // `peer` sends a few QUIC packets through the layer (one block, whole), QUIC answers it,
        // and the layer's timers run past the block's expiry: a loss report is due.
        let round = |sender: &mut FecSender, at: Instant| {
            let mut out = Vec::new();
            for _ in 0..4 {
                sender.send(at, &[0x40; 100], &mut out).expect("framed");
                let meta = RecvMeta {
                    addr: peer,
                    len: out.len(),
                    stride: out.len(),
                    ..RecvMeta::default()
                };
                lock(&handle.socket.state).on_datagram(at, &meta, &mut out);
            }
            socket
                .try_send(&Transmit {
                    destination: peer,
                    ecn: None,
                    contents: &[0x40; 300],
                    segment_size: None,
                    src_ip: None,
                })
                .expect("QUIC answers");
            let later = at + Duration::from_secs(2);
            lock(&handle.socket.state).service(later, handle.socket.inner.as_ref());
            // What reached `peer`: QUIC's answer and its repairs, and loss reports, if any.
            let mut reports = 0;
            let mut buf = [0u8; 2048];
            while let Ok(n) = theirs.recv(&mut buf) {
                let packet = tokenway_wire::packet::parse(&buf[..n]).expect("a layer packet");
                reports += usize::from(matches!(packet, Packet::LossReport(_)));
            }
            reports
        };
        // A forged source address looks the same until a handshake completes: QUIC answered
        // and the address sent again. No report goes there.
        assert_eq!(
            round(&mut sender, t0),
            0,
            "a report went to a one-way address"
        );
        assert_eq!(
            lock(&handle.socket.state).peers[&peer]
                .rx_stats
                .reports_sent,
            1,
            "a report was due and withheld"
        );
        handle.confirm(peer);
        assert_eq!(round(&mut sender, t0 + Duration::from_secs(3)), 1);
    }

    /// A client connection to a server, both on endpoints with a datagram layer of `settings`
    /// (the client's is `settings` itself, whose slot it publishes).
    struct LayeredPair {
        server_addr: SocketAddr,
        conn: quinn::Connection,
        server_conn: quinn::Connection,
        _endpoints: (quinn::Endpoint, quinn::Endpoint),
    }

    async fn layered_pair(settings: &QuicSettings) -> LayeredPair {
        let identity = Identity::self_signed(&["localhost"]).expect("identity");
        let server_settings = QuicSettings {
            datagram: settings.datagram.as_ref().map(|d| DatagramSettings {
                layer: Default::default(),
                ..d.clone()
            }),
            ..settings.clone()
        };
        let (server, _) = crate::endpoint::server_endpoint_with_layer(
            "127.0.0.1:0".parse().expect("addr"),
            &identity,
            &server_settings,
        )
        .expect("server endpoint");
        let server_addr = server.local_addr().expect("bound");
        let accept = tokio::spawn(async move {
            let conn = server.accept().await.expect("incoming").await;
            (server, conn)
        });
        let client =
            crate::endpoint::client_endpoint("127.0.0.1:0".parse().expect("addr"), settings)
                .expect("client endpoint");
        let tls = client_tls(
            &Trust::Pinned(vec![identity.fingerprint()]),
            &[crate::ALPN_H3],
            false,
        )
        .expect("tls");
        let config = crate::endpoint::client_config(tls, settings, None).expect("config");
        let conn = client
            .connect_with(config, server_addr, "localhost")
            .expect("connect")
            .await
            .expect("handshake");
        let (server, server_conn) = accept.await.expect("accept task");
        LayeredPair {
            server_addr,
            conn,
            server_conn: server_conn.expect("server side of the handshake"),
            _endpoints: (server, client),
        }
    }

    #[tokio::test]
    async fn the_rtt_follower_gives_a_cubic_connections_window_a_share_for_its_repairs() {
        // Blocks of two with one repair each, on every packet: repairs are about half the bytes
        // of QUIC's.
        let mut settings = layered();
        if let Some(d) = settings.datagram.as_mut() {
            d.fec = crate::settings::FecSetting(tokenway_wire::fec::FecMode::Fixed { k: 2, r: 1 });
            d.fec_scope = crate::settings::FecScopeSetting::All;
        }
        let pair = layered_pair(&settings).await;
        let slot = &settings.datagram.as_ref().expect("layer settings").layer;
        slot.follow_rtt(&pair.conn);
        let rate = crate::cc::rate_handle(&pair.conn).expect("a tunnel connection");
        assert_eq!(rate.repair_share(), 0.0);
        let reader = {
            let server_conn = pair.server_conn.clone();
            tokio::spawn(async move {
                let mut recv = server_conn.accept_uni().await.expect("stream");
                recv.read_to_end(usize::MAX).await.expect("read").len()
            })
        };
        let mut send = pair.conn.open_uni().await.expect("stream");
        // 2 MB over about a second: several of the follower's intervals.
        for _ in 0..20 {
            send.write_all(&[7u8; 100_000]).await.expect("write");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        send.finish().expect("finish");
        assert_eq!(reader.await.expect("reader"), 2_000_000);
        let deadline = Instant::now() + Duration::from_secs(5);
        while rate.repair_share() < 0.3 {
            assert!(
                Instant::now() < deadline,
                "share {} never reached the repairs' half",
                rate.repair_share()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(rate.repair_share() <= 0.7, "share {}", rate.repair_share());
    }

    #[tokio::test]
    async fn follow_rtt_feeds_the_connections_rtt_to_the_fec_sender_towards_its_peer() {
        let settings = layered();
        let pair = layered_pair(&settings).await;
        let (server_addr, conn) = (pair.server_addr, pair.conn.clone());

        let slot = &settings.datagram.as_ref().expect("layer settings").layer;
        let layer = slot
            .handle()
            .expect("the endpoint published its layer in the slot");
        assert_eq!(layer.srtt(server_addr), None, "nothing told the sender yet");
        slot.follow_rtt(&conn);
        let deadline = Instant::now() + Duration::from_secs(5);
        let fed = loop {
            if let Some(srtt) = layer.srtt(server_addr) {
                break srtt;
            }
            assert!(Instant::now() < deadline, "no RTT reached the FEC sender");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // The handshake completed: the gateway's address is two-way.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !layer.confirmed(server_addr) {
            assert!(Instant::now() < deadline, "the peer was never confirmed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The connection's RTT (loopback: well under the 100 ms initial guess once sampled).
        assert!(fed < Duration::from_millis(100), "fed {fed:?}");
        assert!(
            fed.abs_diff(conn.rtt()) < Duration::from_millis(20),
            "fed {fed:?}, connection {:?}",
            conn.rtt()
        );

        // The task ends with the connection and keeps nothing alive.
        conn.close(0u32.into(), b"done");
        drop((conn, layer, pair));
        let deadline = Instant::now() + Duration::from_secs(5);
        while slot.handle().is_some() {
            assert!(
                Instant::now() < deadline,
                "something keeps the layer of a closed endpoint alive"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
