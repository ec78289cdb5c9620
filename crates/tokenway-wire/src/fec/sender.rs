//! The sending half: QUIC datagram in, wire packets out.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::adapt::Adaptation;
use super::codec::{shard_len_for, Encoder};
use super::{
    datagram_overhead, FecConfig, FecMode, FecScope, HEAD_EXTRA_MAX_K, MAX_DATAGRAM_LEN,
    MAX_PROTECTED_LEN, SMALL_PACKET_MAX_LEN,
};
use crate::error::WireError;
use crate::loss_report::LossReport;
use crate::obfs::{Obfuscator, SALT_LEN};
use crate::packet::{self, BlockId, RepairHeader, SourceHeader, REPAIR_HEADER_LEN};

/// QUIC's path MTU before discovery raises it (RFC 9000 §14: every path carries 1200).
const QUIC_INITIAL_MTU: usize = 1200;

/// How long a QUIC MTU holds against a lower one told meanwhile (see
/// [`FecSender::set_quic_mtu`]).
pub const QUIC_MTU_HOLD: Duration = Duration::from_secs(1);

/// Most repair packets waiting for their send time; beyond it the oldest are dropped.
const MAX_PENDING_REPAIRS: usize = 4 * crate::packet::MAX_BLOCK_REPAIRS;
/// Blocks whose packet counts are kept for the peer's loss reports (which name whole blocks
/// missing by id): as far back as a receiver tracks ids.
const BLOCK_SIZE_HISTORY: usize = 512;
/// Largest buffer kept for reuse: a repair packet (a shard of at most
/// [`crate::fec::MAX_SHARD_LEN`] bytes, its header and salt) fits.
const POOLED_CAPACITY: usize = 4096;
const _: () = assert!(crate::fec::MAX_SHARD_LEN + 64 <= POOLED_CAPACITY);
/// Most unspent repair budget, in bytes: a long loss-free bulk phase must not fund a later
/// burst of repairs far above the configured ratio.
const MAX_CREDIT_BYTES: f64 = 64.0 * 1024.0;

/// Counters of an [`FecSender`]. All byte counts are UDP payload bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SenderStats {
    /// Datagrams sent without FEC (mode `off` or outside the scope).
    pub plain_packets: u64,
    /// Bytes of those datagrams.
    pub plain_bytes: u64,
    /// Source packets sent.
    pub source_packets: u64,
    /// Bytes of source packets sent.
    pub source_bytes: u64,
    /// Repair packets sent (handed out by [`FecSender::poll_transmit`]).
    pub repair_packets: u64,
    /// Bytes of repair packets sent.
    pub repair_bytes: u64,
    /// Blocks closed.
    pub blocks: u64,
    /// Blocks closed by the flush deadline rather than by filling up.
    pub blocks_flushed: u64,
    /// Sparse blocks (a token stream's packets grouped, up to the sparse flush delay).
    pub blocks_sparse: u64,
    /// Head blocks (the first packets after a pause), which get one repair beyond the budget.
    pub blocks_head: u64,
    /// Blocks of small packets only (in practice QUIC ACK-only packets), sent without repairs.
    pub blocks_small: u64,
    /// Repair bytes outside the overhead budget: head blocks' extra repairs, and sparse
    /// blocks' repairs beyond the first.
    pub extra_bytes: u64,
    /// Repair packets the overhead budget did not allow.
    pub repairs_skipped_by_budget: u64,
    /// Repair packets dropped because the pending queue was full.
    pub repairs_dropped_queue_full: u64,
    /// QUIC datagrams larger than QUIC's path MTU (MTU probes) sent padded to the length of
    /// their repairs ([`FecSender::set_quic_mtu`]).
    pub probes_padded: u64,
    /// Repair packets handed out but not sent ([`FecSender::withhold_last`]): the socket
    /// adapter holds repairs to an address that has not proved it receives to QUIC's
    /// anti-amplification bound.
    pub repairs_withheld: u64,
    /// Loss reports applied to the redundancy.
    pub reports_applied: u64,
    /// Loss reports ignored as stale (reordered or replayed).
    pub reports_stale: u64,
}

/// A repair packet waiting for its send time.
#[derive(Debug)]
struct Pending {
    at: Instant,
    bytes: Vec<u8>,
}

/// What a block carries, decided by the packet that opens it (`auto` mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    /// A burst: the flush delay, the table's redundancy raised by the loss estimate.
    Ordinary,
    /// A packet of a sparse stream (a token stream): a longer deadline that follows the
    /// stream, at most [`Adaptation::sparse_k_max`] packets,
    /// [`Adaptation::sparse_repairs_for`].
    Sparse,
    /// The first packet after a pause (a request, an answer's headers and first token): an
    /// ordinary block plus one repair outside the budget while it holds at most
    /// [`HEAD_EXTRA_MAX_K`] packets.
    Head,
    /// Opened by a small packet (an ACK) with no block open: no repairs. A larger packet
    /// closes it and opens a block of its own.
    Small,
}

/// The block being filled.
#[derive(Debug, Clone, Copy)]
struct OpenBlock {
    id: BlockId,
    deadline: Instant,
    /// The latest the deadline may move to (a sparse block's deadline follows its packets).
    latest: Instant,
    kind: BlockKind,
}

/// The sending half of the datagram layer (FEC and obfuscation) for one peer.
///
/// Per outgoing QUIC datagram the socket adapter calls [`send`](Self::send), which writes one
/// UDP payload to send at once; then it drains [`poll_transmit`](Self::poll_transmit) (repair
/// packets that are due) and arms a timer for [`next_deadline`](Self::next_deadline), calling
/// [`on_timeout`](Self::on_timeout) when it fires. Loss reports from the peer go to
/// [`on_loss_report`](Self::on_loss_report).
#[derive(Debug)]
pub struct FecSender {
    config: FecConfig,
    obfs: Option<Obfuscator>,
    rng: StdRng,
    srtt: Option<Duration>,
    /// QUIC's path MTU (its largest datagram) as last told, and when the value last held: a
    /// larger datagram is an MTU probe ([`Self::set_quic_mtu`]).
    quic_mtu: usize,
    quic_mtu_at: Option<Instant>,
    interactive: bool,
    next_block: BlockId,
    open: Option<OpenBlock>,
    /// Copies of the open block's packets; `sources[..count]` are live, the rest reused.
    sources: Vec<Vec<u8>>,
    count: usize,
    encoder: EncoderBox,
    pending: VecDeque<Pending>,
    pool: Vec<Vec<u8>>,
    adapt: Adaptation,
    /// Packets (sources and repairs) of recent blocks by id, `(id, packets)` at
    /// `id % BLOCK_SIZE_HISTORY`.
    block_sizes: Vec<(u16, u8)>,
    credit: f64,
    /// When the last source packet larger than [`SMALL_PACKET_MAX_LEN`] went out (sparse
    /// streams and pauses are told from these; ACKs do not count).
    last_source: Option<Instant>,
    /// Layer version written and obfuscated with (the peer's, see [`Self::set_version`]).
    version: u8,
    stats: SenderStats,
}

/// `reed_solomon_simd`'s encoder has no `Debug`.
#[derive(Default)]
struct EncoderBox(Encoder);

impl std::fmt::Debug for EncoderBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Encoder")
    }
}

impl FecSender {
    /// A sender with `config`, obfuscating with `obfs` if given. `seed` seeds the CSPRNG that
    /// draws the obfuscation salts: take it from the OS (`getrandom`) in production, a fixed
    /// value in tests.
    pub fn new(
        config: FecConfig,
        obfs: Option<Obfuscator>,
        seed: [u8; 32],
    ) -> Result<Self, WireError> {
        config.validate()?;
        let mut rng = StdRng::from_seed(seed);
        // Block ids start anywhere: a sender made afresh for a peer whose receiver kept its
        // state (our state was evicted, or we restarted on the same address) does not reuse
        // the ids that receiver just closed, whose sources it would drop as duplicates.
        let first_block = BlockId(rng.random());
        Ok(Self {
            config,
            obfs,
            rng,
            srtt: None,
            quic_mtu: QUIC_INITIAL_MTU,
            quic_mtu_at: None,
            interactive: false,
            next_block: first_block,
            open: None,
            sources: Vec::new(),
            count: 0,
            encoder: EncoderBox::default(),
            pending: VecDeque::new(),
            pool: Vec::new(),
            adapt: Adaptation::default(),
            block_sizes: Vec::new(),
            credit: 0.0,
            last_source: None,
            version: packet::VERSION,
            stats: SenderStats::default(),
        })
    }

    /// Bytes this sender adds at most to a QUIC datagram (see [`datagram_overhead`]).
    pub fn overhead(&self) -> usize {
        datagram_overhead(self.config.mode != FecMode::Off, self.obfs.is_some())
    }

    /// The counters.
    pub fn stats(&self) -> &SenderStats {
        &self.stats
    }

    /// The redundancy state, for metrics and tests.
    pub fn adaptation(&self) -> &Adaptation {
        &self.adapt
    }

    /// Repair packets a block of `k` packets would get now (before the byte budget).
    pub fn planned_repairs(&self, k: usize) -> usize {
        match self.config.mode {
            FecMode::Off => 0,
            FecMode::Fixed { r, .. } => usize::from(r),
            FecMode::Auto => self.adapt.repairs_for(k),
        }
    }

    /// The layer version this sender writes ([`packet::VERSION`] unless told otherwise).
    pub fn version(&self) -> u8 {
        self.version
    }

    /// Writes packets of `version` from now on, if this build knows it (the socket adapter
    /// answers a peer in the version it speaks, [`super::FecReceiver::peer_version`]).
    pub fn set_version(&mut self, version: u8) {
        if packet::is_known_version(version) {
            self.version = version;
        }
    }

    /// The smoothed RTT last given to [`set_srtt`](Self::set_srtt), if any.
    pub fn srtt(&self) -> Option<Duration> {
        self.srtt
    }

    /// Updates the smoothed RTT, which sets the flush delay of blocks opened from now on.
    pub fn set_srtt(&mut self, srtt: Duration) {
        self.srtt = Some(srtt);
    }

    /// Tells the sender QUIC's current path MTU (its largest UDP payload). A QUIC datagram
    /// larger than that is an MTU probe: with FEC on it goes out padded to the size a repair
    /// packet of it would have ([`packet::PacketType::PaddedPlain`]), so that QUIC's discovery,
    /// which probes through the layer, settles on a size whose repairs fit the path too. Sent
    /// as a source packet (5 bytes of header where a repair has 9 or 10), a probe could pass
    /// where its repairs could not: on a WireGuard path (1420-byte MTU) with obfuscation,
    /// discovery settled at 1375 and every repair of a full-size packet was 1 byte too long.
    /// Until told, the MTU is QUIC's initial 1200.
    ///
    /// Two connections to one peer (one replacing the other) share this sender and report
    /// their own MTUs in turn: a lower value is taken only once no higher one has been told
    /// for [`QUIC_MTU_HOLD`], so the old connection's full-size packets are not taken for
    /// probes while the new one discovers its MTU.
    pub fn set_quic_mtu(&mut self, now: Instant, mtu: u16) {
        let mtu = usize::from(mtu).max(QUIC_INITIAL_MTU);
        let held = self
            .quic_mtu_at
            .is_some_and(|at| now.saturating_duration_since(at) < QUIC_MTU_HOLD);
        if mtu >= self.quic_mtu || !held {
            self.quic_mtu = mtu;
            self.quic_mtu_at = Some(now);
        }
    }

    /// Tells the sender whether the connection is in the interactive class. With
    /// [`FecScope::Interactive`], leaving it closes the open block (its repairs follow) and
    /// sends further packets plain.
    pub fn set_interactive(&mut self, now: Instant, interactive: bool) {
        self.interactive = interactive;
        if !self.fec_active() {
            self.close_block(now, false);
        }
    }

    /// Applies a loss report from the peer's receiver to the redundancy.
    pub fn on_loss_report(&mut self, report: &LossReport) {
        let sizes = &self.block_sizes;
        let block_packets = |id: BlockId| {
            let (at, packets) = sizes.get(usize::from(id.0) % BLOCK_SIZE_HISTORY)?;
            (*at == id.0).then_some(usize::from(*packets))
        };
        if self.adapt.on_report(report, block_packets) {
            self.stats.reports_applied += 1;
        } else {
            self.stats.reports_stale += 1;
        }
    }

    fn fec_active(&self) -> bool {
        self.config.mode != FecMode::Off && (self.config.scope == FecScope::All || self.interactive)
    }

    fn k_max(&self) -> usize {
        match self.config.mode {
            FecMode::Fixed { k, .. } => usize::from(k),
            _ => usize::from(self.config.k_max),
        }
    }

    fn flush_delay(&self) -> Duration {
        match self.srtt {
            Some(srtt) => self.config.max_flush_delay.min(srtt / 8),
            None => self.config.max_flush_delay,
        }
    }

    /// The flush delay of a sparse block, if sparse blocks are on (auto mode, sRTT known):
    /// `max_sparse_flush_delay` on every path. It is not cut to a fraction of the sRTT: on a
    /// path shorter than twice a token interval every token would then open a head block of its
    /// own and go out three times, loss or not, where a block of two or three tokens (whose
    /// first is restored one or two intervals late) still beats QUIC's own recovery, which
    /// waits for a later packet's acknowledgement and then 1.5 RTT more.
    fn sparse_flush_delay(&self) -> Option<Duration> {
        if self.config.mode != FecMode::Auto || self.config.max_sparse_flush_delay.is_zero() {
            return None;
        }
        self.srtt?;
        let d = self.config.max_sparse_flush_delay;
        (d > self.flush_delay()).then_some(d)
    }

    /// Whether a block opened at `now` is sparse: the previous source packet left more than a
    /// flush delay ago (not a burst) but less than a sparse flush delay ago (not the first
    /// packet after a pause, which opens an ordinary, better protected block: the request or
    /// the first token, whose loss costs the time to first token).
    fn opens_sparse(&self, now: Instant) -> Option<Duration> {
        let d = self.sparse_flush_delay()?;
        let gap = now.saturating_duration_since(self.last_source?);
        (gap >= self.flush_delay() && gap < d).then_some(d)
    }

    /// Moves the open sparse block's deadline to one and a half of the stream's last packet
    /// interval after `now` (within the block's sparse flush delay): a stream's next packet
    /// is due one interval on, so a block whose stream paused or ended (an answer's last
    /// token) closes then, and its repairs restore a lost last packet 1.5 intervals late
    /// rather than a whole sparse flush delay.
    fn follow_stream(&mut self, now: Instant) {
        let flush = self.flush_delay();
        let (Some(b), Some(last)) = (self.open.as_mut(), self.last_source) else {
            return;
        };
        let wait = (now.saturating_duration_since(last) * 3 / 2).max(flush);
        b.deadline = b.latest.min(now + wait);
    }

    /// The pause after which a packet opens a head block: the sparse flush delay, whether or
    /// not the sRTT is known. `None` outside `auto` mode or with sparse blocks disabled.
    fn head_pause(&self) -> Option<Duration> {
        (self.config.mode == FecMode::Auto && !self.config.max_sparse_flush_delay.is_zero())
            .then_some(self.config.max_sparse_flush_delay)
    }

    /// Whether a block opened at `now` by a packet that is not small is a head block: no such
    /// packet went out for a pause (or ever).
    fn opens_head(&self, now: Instant) -> bool {
        let Some(pause) = self.head_pause() else {
            return false;
        };
        self.last_source
            .is_none_or(|t| now.saturating_duration_since(t) >= pause)
    }

    /// Frames one outgoing QUIC datagram and writes the UDP payload to send *now* into `out`
    /// (cleared first). The packet is never held back; if it fills its block, the block's
    /// repair packets become available from [`poll_transmit`](Self::poll_transmit).
    pub fn send(&mut self, now: Instant, quic: &[u8], out: &mut Vec<u8>) -> Result<(), WireError> {
        if quic.is_empty() || quic.len() > MAX_DATAGRAM_LEN {
            return Err(WireError::TooLarge {
                len: quic.len(),
                max: MAX_DATAGRAM_LEN,
            });
        }
        self.on_timeout(now);
        out.clear();
        self.reserve_salt(out);
        // Not to a version-1 peer: it predates the type, and would drop every probe.
        if self.config.mode != FecMode::Off
            && self.version == packet::VERSION
            && quic.len() > self.quic_mtu
            && quic.len() <= MAX_PROTECTED_LEN
        {
            // An MTU probe: as long on the wire as a repair of it (see `set_quic_mtu`).
            let repair = REPAIR_HEADER_LEN + shard_len_for(quic.len());
            let pad = repair - packet::PADDED_PLAIN_HEADER_LEN - quic.len();
            packet::write_padded_plain(out, quic, pad as u8);
            self.seal(out);
            self.stats.plain_packets += 1;
            self.stats.plain_bytes += out.len() as u64;
            self.stats.probes_padded += 1;
            return Ok(());
        }
        if !self.fec_active() || quic.len() > MAX_PROTECTED_LEN {
            packet::write_plain_header(out);
            out.extend_from_slice(quic);
            self.seal(out);
            self.stats.plain_packets += 1;
            self.stats.plain_bytes += out.len() as u64;
            return Ok(());
        }
        let small = self.config.mode == FecMode::Auto && quic.len() <= SMALL_PACKET_MAX_LEN;
        if !small && self.open.is_some_and(|b| b.kind == BlockKind::Small) {
            self.close_block(now, false);
        }
        let block = match self.open {
            Some(b) => b,
            None => {
                let (kind, delay) = if small {
                    (BlockKind::Small, self.flush_delay())
                } else if self.opens_head(now) {
                    (BlockKind::Head, self.flush_delay())
                } else if let Some(d) = self.opens_sparse(now) {
                    (BlockKind::Sparse, d)
                } else {
                    (BlockKind::Ordinary, self.flush_delay())
                };
                let b = OpenBlock {
                    id: self.next_block,
                    deadline: now + delay,
                    latest: now + delay,
                    kind,
                };
                self.next_block = self.next_block.next();
                self.open = Some(b);
                b
            }
        };
        packet::write_source_header(
            out,
            SourceHeader {
                block: block.id,
                index: self.count as u8,
            },
        );
        out.extend_from_slice(quic);
        self.seal(out);
        if self.sources.len() <= self.count {
            self.sources.push(Vec::new());
        }
        let slot = &mut self.sources[self.count];
        slot.clear();
        slot.extend_from_slice(quic);
        self.count += 1;
        if !small {
            if block.kind == BlockKind::Sparse {
                self.follow_stream(now);
            }
            self.last_source = Some(now);
        }
        self.stats.source_packets += 1;
        self.stats.source_bytes += out.len() as u64;
        self.credit =
            (self.credit + self.config.max_overhead * out.len() as f64).min(MAX_CREDIT_BYTES);
        if self.count >= self.k_max()
            || (block.kind == BlockKind::Sparse && self.count >= self.adapt.sparse_k_max())
        {
            self.close_block(now, false);
        }
        Ok(())
    }

    /// Writes the next repair packet that is due at `now` into `out` (cleared first) and
    /// returns `true`, or returns `false` if none is due.
    pub fn poll_transmit(&mut self, now: Instant, out: &mut Vec<u8>) -> bool {
        match self.pending.front() {
            Some(p) if p.at <= now => {}
            _ => return false,
        }
        let Some(mut p) = self.pending.pop_front() else {
            return false;
        };
        std::mem::swap(out, &mut p.bytes);
        self.pool_put(p.bytes);
        self.stats.repair_packets += 1;
        self.stats.repair_bytes += out.len() as u64;
        true
    }

    /// Counts the repair packet last handed out by [`poll_transmit`](Self::poll_transmit)
    /// (`len` bytes) as withheld, not sent.
    pub fn withhold_last(&mut self, len: usize) {
        self.stats.repair_packets = self.stats.repair_packets.saturating_sub(1);
        self.stats.repair_bytes = self.stats.repair_bytes.saturating_sub(len as u64);
        self.stats.repairs_withheld += 1;
    }

    /// When [`on_timeout`](Self::on_timeout) must be called next (a block's flush deadline)
    /// or [`poll_transmit`](Self::poll_transmit) has a packet due, if ever.
    pub fn next_deadline(&self) -> Option<Instant> {
        let flush = self.open.map(|b| b.deadline);
        let repair = self.pending.front().map(|p| p.at);
        match (flush, repair) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Closes the open block if its flush deadline has passed; its repair packets become
    /// available from [`poll_transmit`](Self::poll_transmit).
    pub fn on_timeout(&mut self, now: Instant) {
        if let Some(b) = self.open {
            if now >= b.deadline {
                self.close_block(now, true);
            }
        }
    }

    /// Makes room for the salt at the start of an empty `out` when obfuscating.
    fn reserve_salt(&self, out: &mut Vec<u8>) {
        if self.obfs.is_some() {
            out.resize(SALT_LEN, 0);
        }
    }

    /// Obfuscates `out` (salt room reserved by [`Self::reserve_salt`]) when configured.
    fn seal(&mut self, out: &mut [u8]) {
        let at = self.obfs.as_ref().map_or(0, |_| SALT_LEN);
        if let Some(v) = out.get_mut(at) {
            *v = self.version;
        }
        if let Some(o) = &self.obfs {
            o.seal_in_place_as(self.version, &mut self.rng, out);
        }
    }

    fn close_block(&mut self, now: Instant, by_deadline: bool) {
        let Some(block) = self.open.take() else {
            return;
        };
        let k = self.count;
        self.count = 0;
        if k == 0 {
            return;
        }
        self.stats.blocks += 1;
        if by_deadline {
            self.stats.blocks_flushed += 1;
        }
        match block.kind {
            BlockKind::Sparse => self.stats.blocks_sparse += 1,
            BlockKind::Head => self.stats.blocks_head += 1,
            BlockKind::Small => {
                self.stats.blocks_small += 1;
                self.note_block_size(block.id, k);
                return;
            }
            BlockKind::Ordinary => {}
        }
        let max_len = self.sources[..k].iter().map(Vec::len).max().unwrap_or(0);
        let shard_len = shard_len_for(max_len);
        let wire_len = REPAIR_HEADER_LEN + shard_len + self.obfs.as_ref().map_or(0, |_| SALT_LEN);
        // A sparse block pays its first repair from the budget; the rest that its loss
        // estimate asks for (at most two more) go outside it, like a head's extras: bounded
        // by the sparse packets, which are at least a flush delay apart.
        let (planned, sparse_extra) = if block.kind == BlockKind::Sparse {
            let r = self.adapt.sparse_repairs_for(k);
            (r.min(1), r.saturating_sub(1))
        } else {
            (self.planned_repairs(k), 0)
        };
        let r = if self.config.mode == FecMode::Auto {
            let affordable = (self.credit / wire_len as f64).floor() as usize;
            let r = planned.min(affordable);
            self.credit -= (r * wire_len) as f64;
            r
        } else {
            planned
        };
        self.stats.repairs_skipped_by_budget += (planned - r) as u64;
        self.stats.extra_bytes += (sparse_extra * wire_len) as u64;
        let r = r + sparse_extra;
        // A head block's loss costs the time to first token (and, as the last packet before a
        // pause, QUIC's probe timeout): one more repair, outside the budget, and under bursty
        // loss as many as keep its copies out of one burst. At most one head per pause, so
        // bounded by the pauses, not by the bytes.
        let r = if block.kind == BlockKind::Head && k <= HEAD_EXTRA_MAX_K {
            let head = (r + 1)
                .max(self.adapt.head_repairs())
                .min(crate::packet::MAX_BLOCK_REPAIRS);
            self.stats.extra_bytes += ((head - r) * wire_len) as u64;
            head
        } else {
            r
        };
        self.note_block_size(block.id, k + r);
        if r == 0 {
            return;
        }
        // Under bursty loss repairs are spread so that one burst does not take a block's
        // repairs with its sources. A sparse block's go out over the next two sparse flush
        // delays, between the stream's next packets (a burst is a run of consecutive
        // datagrams as much as a stretch of time): a loss is restored within ~100 ms, before
        // QUIC's own recovery on paths of 70 ms and more (on shorter ones whichever comes
        // first; docs/datagram-layer.md, "Short paths").
        let spacing = if !self.adapt.is_bursty() {
            Duration::ZERO
        } else if let (BlockKind::Sparse, Some(d)) = (block.kind, self.sparse_flush_delay()) {
            (2 * d / r as u32).max(self.config.repair_spacing)
        } else {
            self.config.repair_spacing
        };
        let header = |index: usize| RepairHeader {
            block: block.id,
            k: k as u8,
            r: r as u8,
            index: index as u8,
        };
        let salt_len = self.obfs.as_ref().map_or(0, |_| SALT_LEN);
        let mut made = Vec::with_capacity(r);
        let pool = &mut self.pool;
        let encoded = self
            .encoder
            .0
            .encode(&self.sources[..k], r, shard_len, |i, shard| {
                let mut buf = pool.pop().unwrap_or_default();
                buf.resize(salt_len, 0);
                packet::write_repair_header(&mut buf, header(i));
                buf.extend_from_slice(shard);
                made.push(buf);
            });
        debug_assert!(
            encoded.is_ok(),
            "block parameters are validated: k, r in 1..=64"
        );
        for (i, mut bytes) in made.into_iter().enumerate() {
            self.seal(&mut bytes);
            self.enqueue(Pending {
                at: now + spacing * i as u32,
                bytes,
            });
        }
    }

    fn note_block_size(&mut self, id: BlockId, packets: usize) {
        if self.block_sizes.is_empty() {
            self.block_sizes = vec![(0, 0); BLOCK_SIZE_HISTORY];
        }
        self.block_sizes[usize::from(id.0) % BLOCK_SIZE_HISTORY] = (id.0, packets.min(255) as u8);
    }

    /// Keeps a buffer for reuse, unless it grew past [`POOLED_CAPACITY`] (`poll_transmit`
    /// swaps in the caller's buffer, which may have held a large datagram) or the pool already
    /// holds as many as can be pending.
    fn pool_put(&mut self, mut buf: Vec<u8>) {
        if self.pool.len() < MAX_PENDING_REPAIRS && buf.capacity() <= POOLED_CAPACITY {
            buf.clear();
            self.pool.push(buf);
        }
    }

    fn enqueue(&mut self, p: Pending) {
        if self.pending.len() >= MAX_PENDING_REPAIRS {
            if let Some(old) = self.pending.pop_front() {
                self.pool_put(old.bytes);
            }
            self.stats.repairs_dropped_queue_full += 1;
        }
        let pos = self.pending.partition_point(|q| q.at <= p.at);
        self.pending.insert(pos, p);
    }
}
