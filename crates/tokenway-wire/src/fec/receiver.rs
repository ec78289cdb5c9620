//! The receiving half: UDP payload in, QUIC datagrams out.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::codec::Decoder;
use crate::error::WireError;
use crate::loss_report::{BurstHistogram, LossReport, MissingIds, BURST_BUCKETS};
use crate::obfs::{Obfuscator, SALT_LEN};
use crate::packet::{
    self, BlockId, Packet, RepairHeader, SourceHeader, MAX_BLOCK_SOURCES, PLAIN_HEADER_LEN,
    SOURCE_HEADER_LEN,
};

/// Finalised blocks remembered (by id modulo this) to recognise duplicates and late repairs.
const HISTORY: usize = 1024;
/// A block this many ids behind the newest is stale: not tracked (its sources still go to
/// QUIC, its repairs are dropped).
const STALE_WINDOW: i32 = 512;
/// After this many packets in a row that contradict the receiver's state (stale block ids, or
/// sources repeating an index of a finalised block) the peer has restarted its block
/// numbering (a restarted process on the same address): forget everything and follow it.
const STALE_RESYNC: u32 = 64;
/// Skipped block ids awaited at once (see [`FecReceiver::note_skipped`]); a jump over more
/// ids than this counts them missing at once.
const MAX_SKIPPED: usize = 64;
/// Packets that must agree on a new position before the receiver follows a jump over more
/// than [`MAX_SKIPPED`] ids (an outage, or a peer that renumbered): one datagram alone, a
/// stray or a replayed old one whose id reads as ahead in serial arithmetic, moved the newest
/// block so far that every genuine packet after it was stale (untracked, its repairs dropped)
/// until a resync, and counted hundreds of blocks missing. A genuine packet in between starts
/// the count again; an outage's packets all agree, so it costs the FEC of the blocks its first
/// few fell in (they are delivered untracked, and counted neither received nor lost).
const JUMP_CONFIRM: u32 = 8;
/// Most restored packets waiting for [`FecReceiver::pop_recovered`].
const MAX_RECOVERED_QUEUE: usize = 2 * MAX_BLOCK_SOURCES;

/// Largest buffer kept in the pool: a packet of a 1500-byte MTU path, with room. Buffers of
/// larger datagrams (jumbo frames, or a peer sending junk at the UDP maximum) are freed after
/// use, so the pool's memory stays at its count times this.
const POOLED_CAPACITY: usize = 2048;
// A repair shard always fits the pool, and the decoder's buffers (which keep the size of the
// largest block they decoded) stay those of the largest protected packet.
const _: () = assert!(crate::fec::MAX_SHARD_LEN <= POOLED_CAPACITY);

/// Receiver configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceiverConfig {
    /// Most blocks kept open at once; the oldest is finalised to make room (default 64).
    pub max_open_blocks: usize,
    /// A block still incomplete this long after its first packet is finalised with its
    /// losses unrecovered (default 250 ms: beyond that QUIC has retransmitted anyway).
    pub max_block_age: Duration,
    /// Most packet bytes buffered across open blocks (default 4 MiB).
    pub max_buffered_bytes: usize,
    /// Least time between two loss reports (default 100 ms).
    pub report_interval: Duration,
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        Self {
            max_open_blocks: 64,
            max_block_age: Duration::from_millis(250),
            max_buffered_bytes: 4 << 20,
            report_interval: Duration::from_millis(100),
        }
    }
}

impl ReceiverConfig {
    /// Checks every field against its allowed range, naming the bad key.
    pub fn validate(&self) -> Result<(), WireError> {
        if !(1..=4096).contains(&self.max_open_blocks) {
            return Err(WireError::InvalidConfig {
                key: "fec.receiver.max_open_blocks",
                reason: "must be in 1..=4096",
            });
        }
        if self.max_block_age.is_zero() || self.max_block_age > Duration::from_secs(10) {
            return Err(WireError::InvalidConfig {
                key: "fec.receiver.max_block_age",
                reason: "must be in (0, 10 s]",
            });
        }
        if self.max_buffered_bytes < 64 * 1024 {
            return Err(WireError::InvalidConfig {
                key: "fec.receiver.max_buffered_bytes",
                reason: "must be at least 64 KiB",
            });
        }
        if self.report_interval < Duration::from_millis(1) {
            return Err(WireError::InvalidConfig {
                key: "fec.receiver.report_interval",
                reason: "must be at least 1 ms",
            });
        }
        Ok(())
    }
}

/// Why a datagram was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Shorter than its salt or header.
    Truncated,
    /// Unknown version byte (also what a wrong obfuscation key usually looks like).
    UnknownVersion,
    /// Unknown packet type.
    UnknownType,
    /// A header field out of range or inconsistent with its block, or an empty payload.
    Malformed,
    /// A source or repair packet already seen (a network duplicate or a replay), in an open
    /// block or one finalised less than `max_block_age` ago. A source repeating an index of a
    /// block finalised earlier is delivered instead ([`ReceiverStats::untracked_sources`]), and
    /// so is the first original of a packet FEC restored.
    Duplicate,
    /// A repair packet for a block that is already complete or given up. Normal in small
    /// numbers: once a block is restored, its remaining repairs are surplus.
    LateRepair,
    /// A repair packet for a block too far behind the newest one (a source packet of such a
    /// block is still delivered, see [`ReceiverStats::untracked_sources`]).
    Stale,
}

/// Dropped datagrams by [`DropReason`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DropCounters {
    /// [`DropReason::Truncated`].
    pub truncated: u64,
    /// [`DropReason::UnknownVersion`].
    pub unknown_version: u64,
    /// [`DropReason::UnknownType`].
    pub unknown_type: u64,
    /// [`DropReason::Malformed`].
    pub malformed: u64,
    /// [`DropReason::Duplicate`].
    pub duplicate: u64,
    /// [`DropReason::LateRepair`].
    pub late_repair: u64,
    /// [`DropReason::Stale`].
    pub stale: u64,
}

impl DropCounters {
    fn count(&mut self, reason: DropReason) {
        let c = match reason {
            DropReason::Truncated => &mut self.truncated,
            DropReason::UnknownVersion => &mut self.unknown_version,
            DropReason::UnknownType => &mut self.unknown_type,
            DropReason::Malformed => &mut self.malformed,
            DropReason::Duplicate => &mut self.duplicate,
            DropReason::LateRepair => &mut self.late_repair,
            DropReason::Stale => &mut self.stale,
        };
        *c += 1;
    }

    /// All drops.
    pub fn total(&self) -> u64 {
        self.truncated
            + self.unknown_version
            + self.unknown_type
            + self.malformed
            + self.duplicate
            + self.late_repair
            + self.stale
    }
}

/// Counters of an [`FecReceiver`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Datagrams handed to [`FecReceiver::on_datagram`].
    pub datagrams: u64,
    /// Plain packets delivered.
    pub plain_packets: u64,
    /// Source packets delivered as they arrived.
    pub source_packets: u64,
    /// Source packets that arrived after their block was finalised (still delivered).
    pub late_sources: u64,
    /// Source packets delivered to QUIC without FEC state: their block id is stale, their
    /// index was already seen in a block finalised more than `max_block_age` ago, FEC had
    /// restored them before they came, or they do not fit their block's repairs. Either a duplicate or replay (QUIC
    /// discards it by its packet number) or a peer that restarted its block numbering (its
    /// packets must get through, or a new handshake with a restarted gateway is lost).
    pub untracked_sources: u64,
    /// Repair packets accepted.
    pub repair_packets: u64,
    /// Source packets missing when their block was finalised, before recovery (losses seen).
    pub lost: u64,
    /// Missing source packets restored by FEC.
    pub recovered: u64,
    /// Missing source packets FEC could not restore (residual loss).
    pub residual: u64,
    /// Whole blocks never seen: block ids skipped by the peer's numbering whose packets did
    /// not arrive within `max_block_age` (a burst that took a block's sources and repairs, or
    /// a small block without repairs). Their packets are in neither `lost` nor `residual`,
    /// which count only what is missing from blocks that were seen.
    pub blocks_missing: u64,
    /// Runs of consecutive block ids in `blocks_missing`: each is one loss burst that took
    /// every packet of those blocks.
    pub missing_runs: u64,
    /// Loss bursts by length.
    pub bursts: BurstHistogram,
    /// Blocks finalised complete (all sources received or restored).
    pub blocks_complete: u64,
    /// Blocks finalised incomplete (too old, or evicted for room).
    pub blocks_incomplete: u64,
    /// Blocks whose shards could not be decoded (inconsistent input).
    pub decode_failures: u64,
    /// Blocks whose Reed-Solomon decode was not done because the peer had not earned it with
    /// source packets (forged repairs; see `DECODE_CREDIT_PER_SOURCE`); counted once a block.
    pub decodes_refused: u64,
    /// Restored packets dropped because [`FecReceiver::pop_recovered`] was not drained.
    pub recovered_dropped: u64,
    /// Loss reports received from the peer.
    pub reports_received: u64,
    /// Loss reports made (handed out by [`FecReceiver::poll_transmit`]). The transport's
    /// socket withholds those due before the peer proved two-way (its handshake completed).
    pub reports_sent: u64,
    /// Times the receiver followed a peer that restarted its block numbering.
    pub resyncs: u64,
    /// Dropped datagrams.
    pub dropped: DropCounters,
}

/// What [`FecReceiver::on_datagram`] did with a datagram. After every call the caller also
/// drains [`FecReceiver::pop_recovered`], since any packet can complete a block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// Hand `datagram[range]` to QUIC (a source or plain packet, de-obfuscated in place).
    Deliver(Range<usize>),
    /// A repair packet, kept for recovery.
    Repair,
    /// A loss report from the peer: pass it to the local [`super::FecSender::on_loss_report`].
    LossReport(LossReport),
    /// Dropped and counted.
    Dropped(DropReason),
}

#[derive(Debug)]
struct Block {
    id: BlockId,
    opened: Instant,
    /// `(k, r)` once a repair packet told us.
    kr: Option<(u8, u8)>,
    /// Shard length once a repair packet told us.
    shard_len: usize,
    /// Source indices that arrived.
    received: u64,
    /// Source indices restored.
    recovered: u64,
    /// One past the highest source index seen.
    seen_sources: usize,
    sources: Vec<(u8, Vec<u8>)>,
    repairs: Vec<(u8, Vec<u8>)>,
    bytes: usize,
    /// A decode was refused for want of credit (counted once).
    refused: bool,
    /// A source did not fit the shape its repairs gave the block (forged repairs, or forged
    /// sources): the block's losses are not counted, as they may be the forger's.
    misfit: bool,
}

/// Fingerprints of the packets restored lately, `(block, index, fingerprint)`, oldest first:
/// the original of a restored packet that arrives late is told from a copy of what QUIC
/// already got by this, not by its index alone (a restore made from forged repairs, which
/// anyone who knows the address pair can send without obfuscation, must not cost QUIC the
/// real packet). Originals come within a reordering window, so the most recent few suffice;
/// one whose fingerprint has gone goes to QUIC, which drops it if it has it.
const RESTORED_FINGERPRINTS: usize = 128;

/// A restored packet's fingerprint. Not keyed: the packet is QUIC's encrypted bytes, which
/// whoever forged a repair cannot know ahead.
fn packet_hash(packet: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    packet.hash(&mut h);
    h.finish()
}

#[derive(Debug, Clone, Copy, Default)]
struct Finalised {
    id: BlockId,
    valid: bool,
    /// When it was finalised, in ms since [`FecReceiver::epoch`] (wrapping, see
    /// [`FecReceiver::ms_since_epoch`]).
    at_ms: u32,
    /// Source indices received or restored.
    have: u64,
    /// Of `have`, those restored and not received since: an original that arrives after its
    /// restore is a duplicate only if it is the same packet ([`RESTORED_FINGERPRINTS`]).
    restored: u64,
    /// Closed without being tracked: the block of a packet that arrived before the receiver
    /// followed a jump to it. Its later sources are delivered untracked, not counted late.
    untracked: bool,
}

/// A jump ahead not yet followed ([`JUMP_CONFIRM`]).
#[derive(Debug)]
struct Jump {
    /// The lowest and the furthest block id of the packets that agree on it, at most
    /// [`MAX_SKIPPED`] apart.
    lowest: BlockId,
    furthest: BlockId,
    /// How many packets agreed.
    agreeing: u32,
    /// Their blocks and the source indices delivered of each (at most [`JUMP_CONFIRM`]).
    seen: Vec<(BlockId, u64)>,
}

/// `reed_solomon_simd`'s decoder has no `Debug`.
#[derive(Default)]
struct DecoderBox(Decoder);

impl std::fmt::Debug for DecoderBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Decoder")
    }
}

/// The receiving half of the datagram layer (de-obfuscation and FEC) for one peer.
///
/// Per incoming UDP datagram the socket adapter calls [`on_datagram`](Self::on_datagram) with
/// the datagram in a mutable buffer and acts on the [`Received`] outcome, then drains
/// [`pop_recovered`](Self::pop_recovered) into QUIC. It also sends what
/// [`poll_transmit`](Self::poll_transmit) yields (loss reports, to the peer) and calls
/// [`on_timeout`](Self::on_timeout) at [`next_deadline`](Self::next_deadline).
#[derive(Debug)]
pub struct FecReceiver {
    config: ReceiverConfig,
    obfs: Option<Obfuscator>,
    rng: StdRng,
    blocks: VecDeque<Block>,
    buffered: usize,
    history: Vec<Finalised>,
    /// See [`RESTORED_FINGERPRINTS`].
    restored_fps: VecDeque<(BlockId, u8, u64)>,
    newest: Option<BlockId>,
    /// Block ids jumped over by the newest, with when (ms since the epoch): missing unless a
    /// packet of theirs arrives within `max_block_age` (reordering).
    skipped: VecDeque<(BlockId, u32)>,
    /// The block last counted missing whole, to tell a run of them from separate losses.
    last_missing: Option<BlockId>,
    /// The last blocks counted missing whole, for the loss reports.
    recent_missing: MissingIds,
    /// Packets in a row that contradicted the state ([`Self::suspect`]).
    suspect_run: u32,
    /// A jump ahead not yet followed.
    jump: Option<Jump>,
    recovered_q: VecDeque<Vec<u8>>,
    pool: Vec<Vec<u8>>,
    decoder: DecoderBox,
    report_seq: u32,
    report_dirty: bool,
    last_report: Option<Instant>,
    /// The latest `now` seen, so that a due-at-once report has a deadline to give.
    last_now: Option<Instant>,
    /// The first `now` seen: finalisation times are kept as milliseconds since it.
    epoch: Option<Instant>,
    /// Version of the last well-framed packet from the peer; our loss reports use it.
    peer_version: u8,
    /// Reed-Solomon decodes this peer has earned, in quarters ([`DECODE_CREDIT_PER_SOURCE`]).
    decode_credit: u32,
    stats: ReceiverStats,
}

/// A Reed-Solomon decode costs 100-250 µs whatever the shards (two transforms over 2^16
/// elements), and a sender decides how many it causes: two forged repair packets of a few
/// bytes force one. So decodes are earned by source packets received from the peer, a quarter
/// of one each (real traffic needs one per damaged block: below 0.1 per source packet even at
/// 5 % loss on token streams), with a starting allowance and a cap that absorb a burst of
/// losses. XOR (r = 1) and copy (k = 1) recoveries cost microseconds and are free.
const DECODE_CREDIT_PER_SOURCE: u32 = 1;
/// Quarters one decode costs.
const DECODE_COST: u32 = 4;
/// The starting allowance and the cap, in quarters (8 and 64 decodes).
const DECODE_CREDIT_START: u32 = 8 * DECODE_COST;
const DECODE_CREDIT_MAX: u32 = 64 * DECODE_COST;

impl FecReceiver {
    /// A receiver with `config`, de-obfuscating with `obfs` if given. `seed` seeds the CSPRNG
    /// for the salts of the loss reports it sends.
    pub fn new(
        config: ReceiverConfig,
        obfs: Option<Obfuscator>,
        seed: [u8; 32],
    ) -> Result<Self, WireError> {
        config.validate()?;
        Ok(Self {
            config,
            obfs,
            rng: StdRng::from_seed(seed),
            blocks: VecDeque::new(),
            buffered: 0,
            history: vec![Finalised::default(); HISTORY],
            restored_fps: VecDeque::with_capacity(RESTORED_FINGERPRINTS),
            newest: None,
            skipped: VecDeque::new(),
            last_missing: None,
            recent_missing: MissingIds::default(),
            suspect_run: 0,
            jump: None,
            recovered_q: VecDeque::new(),
            pool: Vec::new(),
            decoder: DecoderBox::default(),
            report_seq: 0,
            report_dirty: false,
            last_report: None,
            last_now: None,
            epoch: None,
            peer_version: packet::VERSION,
            decode_credit: DECODE_CREDIT_START,
            stats: ReceiverStats::default(),
        })
    }

    /// Takes away the starting allowance of Reed-Solomon decodes: this receiver decodes only
    /// what its peer's source packets earn. For a peer whose state a caller cannot afford to
    /// fund (many new peers at once: a spoofed flood would otherwise be handed eight decodes,
    /// 1-2 ms of CPU, per forged address).
    pub fn forgo_starting_decodes(&mut self) {
        self.decode_credit = 0;
    }

    /// The counters.
    pub fn stats(&self) -> &ReceiverStats {
        &self.stats
    }

    /// The layer version the peer speaks (that of its last well-framed packet;
    /// [`packet::VERSION`] until one arrived). The sender towards it should use the same
    /// ([`super::FecSender::set_version`]).
    pub fn peer_version(&self) -> u8 {
        self.peer_version
    }

    /// Takes `version` for the version the peer speaks until a datagram says otherwise: for a
    /// new peer whose first datagram the caller already opened (under that version's key
    /// stream), so that this receiver opens it under the same stream first. Under the other
    /// one its first byte shows a version one time in 256, and it would be lost. Unknown
    /// versions are ignored.
    pub fn assume_peer_version(&mut self, version: u8) {
        if version == packet::VERSION || version == packet::VERSION_1 {
            self.peer_version = version;
        }
    }

    /// Number of blocks currently open (for metrics and tests).
    pub fn open_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Bytes currently buffered in open blocks.
    pub fn buffered_bytes(&self) -> usize {
        self.buffered
    }

    /// Processes one UDP datagram, de-obfuscating it in place. Never panics, whatever the bytes.
    pub fn on_datagram(&mut self, now: Instant, datagram: &mut [u8]) -> Received {
        self.stats.datagrams += 1;
        self.expire(now);
        let outcome = self.classify(now, datagram);
        if let Received::Dropped(reason) = outcome {
            self.stats.dropped.count(reason);
        }
        outcome
    }

    fn classify(&mut self, now: Instant, datagram: &mut [u8]) -> Received {
        let (offset, inner) = match &self.obfs {
            Some(o) => match o.open_in_place_as(self.peer_version, datagram) {
                Ok(inner) => (SALT_LEN, &*inner),
                Err(e) => return Received::Dropped(drop_reason(&e)),
            },
            None => (0, &*datagram),
        };
        let packet = match packet::parse(inner) {
            Ok(p) => p,
            Err(e) => return Received::Dropped(drop_reason(&e)),
        };
        self.peer_version = inner[0];
        let end = offset + inner.len();
        match packet {
            Packet::Plain(p) if !p.is_empty() => {
                self.stats.plain_packets += 1;
                Received::Deliver(offset + PLAIN_HEADER_LEN..end)
            }
            Packet::PaddedPlain(p) if !p.is_empty() => {
                self.stats.plain_packets += 1;
                let start = offset + packet::PADDED_PLAIN_HEADER_LEN;
                Received::Deliver(start..start + p.len())
            }
            Packet::Source(h, p) if !p.is_empty() => {
                let p = pooled_copy(&mut self.pool, p);
                self.on_source(now, h, p, offset + SOURCE_HEADER_LEN..end)
            }
            Packet::Repair(h, shard) => {
                let shard = pooled_copy(&mut self.pool, shard);
                self.on_repair(now, h, shard)
            }
            Packet::LossReport(r) => {
                self.stats.reports_received += 1;
                Received::LossReport(r)
            }
            Packet::Plain(_) | Packet::PaddedPlain(_) | Packet::Source(..) => {
                Received::Dropped(DropReason::Malformed)
            }
        }
    }

    /// Finds the open block `id`, or where it was finalised; opens it if new.
    /// [`Slot::Stale`] for a stale id (counted towards a resync, which then tracks it),
    /// [`Slot::Ahead`] for one far ahead (counted towards following the jump). `bit` is the
    /// source index's bit of a source packet, 0 for a repair.
    fn locate(&mut self, now: Instant, id: BlockId, bit: u64) -> Slot {
        if let Some(newest) = self.newest {
            let d = id.distance_from(newest);
            if d < -STALE_WINDOW {
                if !self.suspect() {
                    return Slot::Stale;
                }
            } else if d > MAX_SKIPPED as i32 + 1 {
                let Some(jump) = self.confirm_jump(id, bit) else {
                    return Slot::Ahead;
                };
                self.follow_jump(now, newest, jump);
            } else {
                self.jump = None;
                if d > 0 {
                    self.note_skipped(now, newest, d);
                    self.newest = Some(id);
                }
            }
        }
        if self.newest.is_none() {
            self.newest = Some(id);
        }
        if let Some(i) = self.blocks.iter().position(|b| b.id == id) {
            return Slot::Open(i);
        }
        let h = &self.history[usize::from(id.0) % HISTORY];
        if h.valid && h.id == id {
            return Slot::Finalised;
        }
        // A block opening behind the newest may be one that was jumped over: it was late,
        // not missing.
        if let Some(j) = self.skipped.iter().position(|(s, _)| *s == id) {
            self.skipped.remove(j);
        }
        while self.blocks.len() >= self.config.max_open_blocks {
            self.finalise(0);
        }
        self.blocks.push_back(Block {
            id,
            opened: now,
            kr: None,
            shard_len: 0,
            received: 0,
            recovered: 0,
            seen_sources: 0,
            sources: Vec::new(),
            repairs: Vec::new(),
            bytes: 0,
            refused: false,
            misfit: false,
        });
        Slot::Open(self.blocks.len() - 1)
    }

    /// Notes the `d - 1` block ids between `newest` and the block `d` ahead of it that just
    /// arrived: each is missing unless one of its packets arrives within `max_block_age`
    /// (see [`Self::expire`]). More than [`MAX_SKIPPED`] at once (an outage) count at once,
    /// unless the jump is beyond [`STALE_WINDOW`] (a renumbered peer).
    fn note_skipped(&mut self, now: Instant, newest: BlockId, d: i32) {
        if d <= 1 {
            return;
        }
        let gap = (d - 1) as usize;
        if gap > MAX_SKIPPED {
            // An outage counts its blocks; a jump further than the stale window is a peer
            // that renumbered (a restart), not a loss, and counts nothing.
            if d <= STALE_WINDOW {
                self.stats.blocks_missing += gap as u64;
                self.stats.missing_runs += 1;
                self.last_missing = None;
                self.report_dirty = true;
            }
            return;
        }
        let at = self.ms_since_epoch(now);
        let mut id = newest;
        for _ in 0..gap {
            id = id.next();
            self.await_skipped(id, at);
        }
    }

    /// Awaits block `id`, jumped over at `at`; the longest awaited is missing if there are
    /// [`MAX_SKIPPED`] already.
    fn await_skipped(&mut self, id: BlockId, at: u32) {
        if self.skipped.len() >= MAX_SKIPPED {
            if let Some((old, _)) = self.skipped.pop_front() {
                self.confirm_missing(old);
            }
        }
        self.skipped.push_back((id, at));
    }

    /// Counts a packet `id` far ahead of the newest block towards following it there: the
    /// jump once [`JUMP_CONFIRM`] such packets in a row, within [`MAX_SKIPPED`] ids of each
    /// other, agree (the packet is then tracked). `bit` as in [`Self::locate`].
    fn confirm_jump(&mut self, id: BlockId, bit: u64) -> Option<Jump> {
        let earlier = |a: BlockId, b: BlockId| if a.distance_from(b) < 0 { a } else { b };
        let later = |a: BlockId, b: BlockId| if a.distance_from(b) > 0 { a } else { b };
        let agreeing = self.jump.take().and_then(|j| {
            let (lowest, furthest) = (earlier(j.lowest, id), later(j.furthest, id));
            (furthest.distance_from(lowest) <= MAX_SKIPPED as i32).then(|| Jump {
                lowest,
                furthest,
                agreeing: j.agreeing + 1,
                seen: j.seen,
            })
        });
        let mut jump = agreeing.unwrap_or_else(|| Jump {
            lowest: id,
            furthest: id,
            agreeing: 1,
            seen: Vec::with_capacity(JUMP_CONFIRM as usize),
        });
        if jump.agreeing >= JUMP_CONFIRM {
            // This packet is placed by the caller, as any tracked one.
            return Some(jump);
        }
        if bit != 0 {
            match jump.seen.iter_mut().find(|(b, _)| *b == id) {
                Some((_, have)) => *have |= bit,
                None => jump.seen.push((id, bit)),
            }
        }
        self.jump = Some(jump);
        None
    }

    /// Follows a confirmed jump from `newest`: the ids up to its lowest are an outage (counted
    /// missing), those between its lowest and its furthest are awaited as any jumped over, and
    /// the blocks whose sources were delivered while it was unconfirmed are closed untracked
    /// (counting what they missed would count as lost the packets delivered before).
    fn follow_jump(&mut self, now: Instant, newest: BlockId, jump: Jump) {
        self.note_skipped(now, newest, jump.lowest.distance_from(newest));
        let at_ms = self.ms_since_epoch(now);
        let mut id = jump.lowest;
        for _ in 1..jump.furthest.distance_from(jump.lowest) {
            id = id.next();
            if !jump.seen.iter().any(|(b, _)| *b == id) {
                self.await_skipped(id, at_ms);
            }
        }
        for (id, have) in jump.seen {
            self.history[usize::from(id.0) % HISTORY] = Finalised {
                id,
                valid: true,
                at_ms,
                have,
                restored: 0,
                untracked: true,
            };
        }
        self.newest = Some(jump.furthest);
    }

    /// Counts a packet that contradicts the receiver's state; after [`STALE_RESYNC`] in a
    /// row, resyncs and returns `true` (the packet is then tracked afresh).
    fn suspect(&mut self) -> bool {
        self.suspect_run += 1;
        if self.suspect_run < STALE_RESYNC {
            return false;
        }
        self.resync();
        true
    }

    fn on_source(
        &mut self,
        now: Instant,
        h: SourceHeader,
        packet: Vec<u8>,
        range: Range<usize>,
    ) -> Received {
        // A source packet the FEC state cannot place (stale id, or an index its finalised
        // block already had) still goes to QUIC, untracked: QUIC authenticates it and drops
        // a duplicate by its packet number, while withholding it would lose every packet of
        // a restarted peer (a new handshake) until the receiver resyncs. No state grows.
        let bit = 1u64 << h.index;
        let slot = self.locate(now, h.block, bit);
        let i = match slot {
            Slot::Stale | Slot::Ahead => {
                self.pool_put(packet);
                self.stats.untracked_sources += 1;
                return Received::Deliver(range);
            }
            Slot::Finalised => {
                let slot = usize::from(h.block.0) % HISTORY;
                // Only the original of a restored packet is fingerprinted (rare).
                let fp = (self.history[slot].restored & bit != 0).then(|| packet_hash(&packet));
                self.pool_put(packet);
                let now_ms = self.ms_since_epoch(now);
                let f = &mut self.history[slot];
                if let Some(fp) = fp {
                    // The original of a packet FEC restored: a duplicate of what QUIC got if it
                    // is the same packet. Else (restored from forged repairs, or not
                    // fingerprinted) it goes to QUIC, which drops it if it has it. Once: a copy
                    // of it after this is a duplicate.
                    f.restored &= !bit;
                    let same = self
                        .restored_fps
                        .iter()
                        .position(|&(b, i, _)| b == h.block && i == h.index)
                        .and_then(|at| self.restored_fps.remove(at))
                        .is_some_and(|(_, _, restored)| restored == fp);
                    if same {
                        return Received::Dropped(DropReason::Duplicate);
                    }
                    self.stats.untracked_sources += 1;
                    return Received::Deliver(range);
                }
                if f.have & bit != 0 {
                    // Soon after the block closed: a network duplicate, or the original of a
                    // restored packet. Later: a replay, or a restarted peer reusing the id.
                    // The timer may have finalised the block with a later `now` than this
                    // packet's: a negative age is no age, not 49 days.
                    let age = Duration::from_millis(
                        (now_ms.wrapping_sub(f.at_ms) as i32)
                            .max(0)
                            .unsigned_abs()
                            .into(),
                    );
                    if age < self.config.max_block_age {
                        return Received::Dropped(DropReason::Duplicate);
                    }
                    self.suspect();
                    self.stats.untracked_sources += 1;
                    return Received::Deliver(range);
                }
                f.have |= bit;
                self.suspect_run = 0;
                if f.untracked {
                    self.stats.untracked_sources += 1;
                } else {
                    self.stats.late_sources += 1;
                }
                return Received::Deliver(range);
            }
            Slot::Open(i) => i,
        };
        self.suspect_run = 0;
        let b = &mut self.blocks[i];
        if b.received & bit != 0 {
            self.pool_put(packet);
            return Received::Dropped(DropReason::Duplicate);
        }
        // The original of a restored packet, or a source its block's repairs say cannot be
        // in it (an index past their `k`, longer than their shards): it still goes to QUIC,
        // untracked, with the block's state left as it is. The repairs came first and fixed
        // the block's shape; they may be forged (without obfuscation anyone who knows the
        // address pair can send some), and a source withheld for them would be lost to QUIC
        // as no plain QUIC packet can be (QUIC authenticates what it gets).
        let misfit =
            b.kr.is_some_and(|(k, _)| h.index >= k || packet.len() + 2 > b.shard_len);
        if b.recovered & bit != 0 || misfit {
            b.misfit |= misfit;
            self.pool_put(packet);
            self.stats.untracked_sources += 1;
            return Received::Deliver(range);
        }
        b.received |= bit;
        b.seen_sources = b.seen_sources.max(usize::from(h.index) + 1);
        b.bytes += packet.len();
        self.buffered += packet.len();
        b.sources.push((h.index, packet));
        self.stats.source_packets += 1;
        self.decode_credit = (self.decode_credit + DECODE_CREDIT_PER_SOURCE).min(DECODE_CREDIT_MAX);
        self.progress(i);
        self.enforce_byte_bound();
        Received::Deliver(range)
    }

    fn on_repair(&mut self, now: Instant, h: RepairHeader, shard: Vec<u8>) -> Received {
        let i = match self.locate(now, h.block, 0) {
            Slot::Stale | Slot::Ahead => {
                self.pool_put(shard);
                return Received::Dropped(DropReason::Stale);
            }
            Slot::Finalised => {
                self.pool_put(shard);
                return Received::Dropped(DropReason::LateRepair);
            }
            Slot::Open(i) => i,
        };
        self.suspect_run = 0;
        let b = &mut self.blocks[i];
        let consistent = match b.kr {
            Some(kr) => kr == (h.k, h.r) && b.shard_len == shard.len(),
            None => {
                b.seen_sources <= usize::from(h.k)
                    && b.sources.iter().all(|(_, p)| p.len() + 2 <= shard.len())
            }
        };
        if !consistent {
            self.pool_put(shard);
            return Received::Dropped(DropReason::Malformed);
        }
        if b.repairs.iter().any(|(j, _)| *j == h.index) {
            self.pool_put(shard);
            return Received::Dropped(DropReason::Duplicate);
        }
        b.kr = Some((h.k, h.r));
        b.shard_len = shard.len();
        b.bytes += shard.len();
        self.buffered += shard.len();
        b.repairs.push((h.index, shard));
        self.stats.repair_packets += 1;
        self.progress(i);
        self.enforce_byte_bound();
        Received::Repair
    }

    /// Restores what can be restored in block `i` and finalises it once complete.
    fn progress(&mut self, i: usize) {
        let b = &mut self.blocks[i];
        let Some((k, r)) = b.kr else { return };
        let (k, r) = (usize::from(k), usize::from(r));
        let all = low_bits(k);
        let have = (b.received | b.recovered) & all;
        if have == all {
            self.finalise(i);
            return;
        }
        if b.sources.len() + b.repairs.len() < k {
            return;
        }
        if k >= 2 && r >= 2 {
            if self.decode_credit < DECODE_COST {
                // Not earned: the block waits (a late source may complete it) or expires.
                // Counted once per block, not at each shard that arrives while it waits.
                if !b.refused {
                    b.refused = true;
                    self.stats.decodes_refused += 1;
                }
                return;
            }
            self.decode_credit -= DECODE_COST;
        }
        let q = &mut self.recovered_q;
        let pool = &mut self.pool;
        let stats = &mut self.stats;
        // Restored and queued for QUIC; restored but dropped (the queue was full). A dropped
        // one is not marked restored: its original, if it comes late, must still go to QUIC,
        // not be dropped as a duplicate of a copy QUIC never saw.
        let (mut restored, mut dropped) = (0u64, 0u64);
        let (block, fps) = (b.id, &mut self.restored_fps);
        let result = self.decoder.0.decode(
            k,
            r,
            b.shard_len,
            &b.sources,
            &b.repairs,
            |index, packet| {
                let bit = 1u64 << index;
                if (have | restored | dropped) & bit != 0 {
                    return;
                }
                if q.len() >= MAX_RECOVERED_QUEUE {
                    dropped |= bit;
                    stats.recovered_dropped += 1;
                    return;
                }
                if fps.len() >= RESTORED_FINGERPRINTS {
                    fps.pop_front();
                }
                fps.push_back((block, index as u8, packet_hash(packet)));
                restored |= bit;
                q.push_back(pooled_copy(pool, packet));
            },
        );
        b.recovered |= restored;
        self.stats.recovered += u64::from(restored.count_ones());
        if result.is_err() {
            self.stats.decode_failures += 1;
        }
        self.finalise(i);
    }

    /// Closes block `i`: counts its losses and bursts, remembers what it had, frees its buffers.
    fn finalise(&mut self, i: usize) {
        let Some(b) = self.blocks.remove(i) else {
            return;
        };
        if b.misfit {
            // Its shape may be a forger's (a repair claiming 64 sources): neither its sources
            // nor the ones it misses count as received or lost, or one forged repair per block
            // id would report 64 losses each and drive the peer's redundancy to its cap. Its
            // later sources go to QUIC untracked.
            self.remember(b, true);
            return;
        }
        let k = b.kr.map_or(b.seen_sources, |(k, _)| usize::from(k));
        let all = low_bits(k);
        let lost = u64::from((all & !b.received).count_ones());
        let residual = u64::from((all & !(b.received | b.recovered)).count_ones());
        self.stats.lost += lost;
        self.stats.residual += residual;
        if residual == 0 {
            self.stats.blocks_complete += 1;
        } else {
            self.stats.blocks_incomplete += 1;
        }
        let mut run = 0u32;
        for idx in 0..=k {
            if idx < k && b.received & (1 << idx) == 0 {
                run += 1;
            } else if run > 0 {
                self.stats.bursts.record(run);
                run = 0;
            }
        }
        self.remember(b, false);
    }

    /// Notes finalised block `b` in the history (`untracked`: see [`Finalised`]) and frees its
    /// buffers.
    fn remember(&mut self, b: Block, untracked: bool) {
        let at_ms = self.last_now.map_or(0, |t| self.ms_since_epoch(t));
        self.history[usize::from(b.id.0) % HISTORY] = Finalised {
            id: b.id,
            valid: true,
            at_ms,
            have: b.received | b.recovered,
            restored: b.recovered & !b.received,
            untracked,
        };
        self.buffered -= b.bytes;
        for (_, buf) in b.sources.into_iter().chain(b.repairs) {
            self.pool_put(buf);
        }
        self.report_dirty = true;
    }

    /// Returns a buffer to the pool, unless the pool is full or the buffer grew past
    /// [`POOLED_CAPACITY`]: one large datagram must not leave a pool of large buffers behind.
    fn pool_put(&mut self, mut buf: Vec<u8>) {
        if self.pool.len() < 2 * MAX_BLOCK_SOURCES && buf.capacity() <= POOLED_CAPACITY {
            buf.clear();
            self.pool.push(buf);
        }
    }

    fn enforce_byte_bound(&mut self) {
        while self.buffered > self.config.max_buffered_bytes && !self.blocks.is_empty() {
            self.finalise(0);
        }
    }

    /// Milliseconds since the first packet, in 32 bits that wrap every 49.7 days: only ages
    /// are taken from them (`wrapping_sub`), and every age that matters is far shorter (a
    /// finalised block's history slot is reused within 1024 blocks, a skipped id is settled
    /// within `max_block_age`). Saturating instead stopped every clock after 49.7 days of a
    /// tunnel, and tunnels run for months.
    fn ms_since_epoch(&self, t: Instant) -> u32 {
        let since = self
            .epoch
            .map_or(Duration::ZERO, |e| t.saturating_duration_since(e));
        (since.as_millis() % (1u128 << 32)) as u32
    }

    fn expire(&mut self, now: Instant) {
        self.epoch.get_or_insert(now);
        self.last_now = Some(self.last_now.map_or(now, |t| t.max(now)));
        while let Some(b) = self.blocks.front() {
            if now.saturating_duration_since(b.opened) < self.config.max_block_age {
                break;
            }
            self.finalise(0);
        }
        let now_ms = self.ms_since_epoch(now);
        let age_ms = u32::try_from(self.config.max_block_age.as_millis()).unwrap_or(u32::MAX);
        while let Some(&(_, at)) = self.skipped.front() {
            if now_ms.wrapping_sub(at) < age_ms {
                break;
            }
            if let Some((id, _)) = self.skipped.pop_front() {
                self.confirm_missing(id);
            }
        }
    }

    /// Counts block `id` as missing whole; it extends the run of the last one confirmed if it
    /// follows it.
    fn confirm_missing(&mut self, id: BlockId) {
        if self.last_missing.is_none_or(|last| last.next() != id) {
            self.stats.missing_runs += 1;
        }
        self.last_missing = Some(id);
        self.recent_missing.push(id.0);
        self.stats.blocks_missing += 1;
        self.report_dirty = true;
    }

    fn resync(&mut self) {
        while !self.blocks.is_empty() {
            self.finalise(0);
        }
        self.history.iter_mut().for_each(|h| h.valid = false);
        self.newest = None;
        self.skipped.clear();
        // The ids were the old numbering's; the peer's new sender would size them wrongly.
        self.last_missing = None;
        self.recent_missing = MissingIds::default();
        self.suspect_run = 0;
        self.jump = None;
        self.stats.resyncs += 1;
    }

    /// Moves the next restored QUIC datagram into `out` (replacing its contents) and returns
    /// `true`, or returns `false` if there is none.
    pub fn pop_recovered(&mut self, out: &mut Vec<u8>) -> bool {
        let Some(mut p) = self.recovered_q.pop_front() else {
            return false;
        };
        std::mem::swap(out, &mut p);
        self.pool_put(p);
        true
    }

    /// The cumulative loss report as it stands.
    pub fn loss_report(&self) -> LossReport {
        let s = &self.stats;
        let mut bursts = [0u32; BURST_BUCKETS];
        for (o, &c) in bursts.iter_mut().zip(s.bursts.0.iter()) {
            *o = c as u32;
        }
        LossReport {
            seq: self.report_seq,
            received: s.source_packets as u32,
            lost: s.lost as u32,
            recovered: s.recovered as u32,
            residual: s.residual as u32,
            bursts,
            blocks_missing: s.blocks_missing as u32,
            missing_ids: self.recent_missing,
        }
    }

    /// Writes a loss report to send to the peer into `out` (cleared first) and returns `true`
    /// if one is due at `now`: at most one per report interval, and only after a block was
    /// finalised since the last one.
    pub fn poll_transmit(&mut self, now: Instant, out: &mut Vec<u8>) -> bool {
        self.expire(now);
        if !self.report_dirty {
            return false;
        }
        if let Some(t) = self.last_report {
            if now < t + self.config.report_interval {
                return false;
            }
        }
        self.report_seq = self.report_seq.wrapping_add(1);
        let report = self.loss_report();
        out.clear();
        if self.obfs.is_some() {
            out.resize(SALT_LEN, 0);
        }
        let at = out.len();
        packet::write_loss_report(out, &report);
        out[at] = self.peer_version;
        if let Some(o) = &self.obfs {
            o.seal_in_place_as(self.peer_version, &mut self.rng, out);
        }
        self.report_dirty = false;
        self.last_report = Some(now);
        self.stats.reports_sent += 1;
        true
    }

    /// When [`on_timeout`](Self::on_timeout) or [`poll_transmit`](Self::poll_transmit) has
    /// work next: the oldest block's expiry, the oldest skipped id's (then counted missing,
    /// which the next report tells the sender), or the next loss report, if any.
    pub fn next_deadline(&self) -> Option<Instant> {
        let age = self.config.max_block_age;
        let block = self.blocks.front().map(|b| b.opened + age);
        // Skipped ids carry their time in wrapping milliseconds (`ms_since_epoch`): their
        // expiry is found from the latest `now` seen, whose millisecond count is known.
        let skipped = self
            .skipped
            .front()
            .zip(self.last_now)
            .map(|(&(_, at), now)| {
                let waited =
                    Duration::from_millis(u64::from(self.ms_since_epoch(now).wrapping_sub(at)));
                now + age.saturating_sub(waited)
            });
        let expiry = match (block, skipped) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let report = match (self.report_dirty, self.last_report) {
            (false, _) => None,
            (true, Some(t)) => Some(t + self.config.report_interval),
            // Never reported yet: due at once.
            (true, None) => self.last_now,
        };
        match (expiry, report) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Finalises blocks that have grown too old (their losses become residual).
    pub fn on_timeout(&mut self, now: Instant) {
        self.expire(now);
    }
}

enum Slot {
    Open(usize),
    Finalised,
    /// More than [`STALE_WINDOW`] ids behind the newest.
    Stale,
    /// Far ahead of it, in a jump not yet confirmed ([`JUMP_CONFIRM`]).
    Ahead,
}

fn low_bits(k: usize) -> u64 {
    if k >= 64 {
        u64::MAX
    } else {
        (1u64 << k) - 1
    }
}

fn drop_reason(e: &WireError) -> DropReason {
    match e {
        WireError::Truncated { .. } => DropReason::Truncated,
        WireError::UnknownVersion(_) => DropReason::UnknownVersion,
        WireError::UnknownType(_) => DropReason::UnknownType,
        _ => DropReason::Malformed,
    }
}

/// Copies `bytes` into a buffer from `pool` (no allocation once the pool is warm).
fn pooled_copy(pool: &mut Vec<Vec<u8>>, bytes: &[u8]) -> Vec<u8> {
    let mut v = pool.pop().unwrap_or_default();
    v.clear();
    v.extend_from_slice(bytes);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fec::{FecConfig, FecMode, FecScope, FecSender};

    #[test]
    fn forged_repairs_without_source_packets_earn_only_a_few_decodes() {
        let now = Instant::now();
        // Pairs of repairs of fresh blocks of two 2-byte sources, nothing else: each pair
        // would make a Reed-Solomon decode.
        let forge = |rx: &mut FecReceiver, blocks: u16| {
            for block in 0..blocks {
                for index in 0..2u8 {
                    let mut d = Vec::new();
                    packet::write_repair_header(
                        &mut d,
                        packet::RepairHeader {
                            block: packet::BlockId(block),
                            k: 2,
                            r: 2,
                            index,
                        },
                    );
                    d.extend_from_slice(&[0, 0]);
                    let _ = rx.on_datagram(now, &mut d);
                }
            }
        };
        let mut rx = FecReceiver::new(ReceiverConfig::default(), None, [2; 32]).expect("receiver");
        forge(&mut rx, 100);
        let s = rx.stats();
        assert_eq!(s.decode_failures + s.recovered / 2, 8, "{s:?}");
        assert_eq!(s.decodes_refused, 92, "{s:?}");
        // Without the starting allowance, none.
        let mut unfunded =
            FecReceiver::new(ReceiverConfig::default(), None, [3; 32]).expect("receiver");
        unfunded.forgo_starting_decodes();
        forge(&mut unfunded, 10);
        let u = unfunded.stats();
        assert_eq!(
            (u.decode_failures, u.recovered, u.decodes_refused),
            (0, 0, 10),
            "{u:?}"
        );
        // A shard longer than any protected packet's is refused as malformed.
        let mut d = Vec::new();
        packet::write_repair_header(
            &mut d,
            packet::RepairHeader {
                block: packet::BlockId(500),
                k: 2,
                r: 2,
                index: 0,
            },
        );
        d.extend_from_slice(&vec![0u8; crate::fec::MAX_SHARD_LEN + 2]);
        assert!(matches!(rx.on_datagram(now, &mut d), Received::Dropped(_)));
    }

    /// The datagrams of `blocks` blocks of two 100-byte sources and one repair each (the
    /// second source of block `b` is `[b; 100]`), sent at `now`.
    fn blocks_of_two(blocks: u8, now: Instant) -> Vec<Vec<Vec<u8>>> {
        let config = FecConfig {
            mode: FecMode::Fixed { k: 2, r: 1 },
            scope: FecScope::All,
            ..FecConfig::default()
        };
        let mut tx = FecSender::new(config, None, [1; 32]).expect("sender");
        (0..blocks)
            .map(|b| {
                let mut wire = Vec::new();
                for n in [200, b] {
                    let mut out = Vec::new();
                    tx.send(now, &[n; 100], &mut out).expect("send");
                    wire.push(out);
                }
                tx.on_timeout(now + Duration::from_secs(1));
                let mut out = Vec::new();
                while tx.poll_transmit(now + Duration::from_secs(1), &mut out) {
                    wire.push(std::mem::take(&mut out));
                }
                assert_eq!(wire.len(), 3);
                wire
            })
            .collect()
    }

    /// Without obfuscation anyone who knows the address pair can send repair packets. Forged
    /// ones must never cost QUIC a genuine source packet: not one that does not fit the shape
    /// they gave its block, nor the original of a packet they "restored". Before, the first
    /// was dropped as malformed and the second as a duplicate.
    #[test]
    fn forged_repairs_never_cost_quic_a_genuine_source() {
        let now = Instant::now();
        let mut wire = blocks_of_two(3, now);
        let mut rx = FecReceiver::new(ReceiverConfig::default(), None, [2; 32]).expect("receiver");
        for d in &mut wire[0] {
            let _ = rx.on_datagram(now, d);
        }
        // The forger knows (or guesses) the block ids the sender uses next.
        let block_of = |d: &[u8]| match crate::packet::parse(d) {
            Ok(Packet::Source(h, _)) => h.block,
            other => panic!("not a source: {other:?}"),
        };
        let forged = |block: BlockId, k: u8, shard: &[u8]| {
            let mut out = Vec::new();
            crate::packet::write_repair_header(
                &mut out,
                RepairHeader {
                    block,
                    k,
                    r: 1,
                    index: 0,
                },
            );
            out.extend_from_slice(shard);
            out
        };
        // Block 1: a repair claiming 64 sources of 0 bytes comes first.
        let mut fake = forged(block_of(&wire[1][0]), 64, &[0, 0]);
        assert_eq!(rx.on_datagram(now, &mut fake), Received::Repair);
        for d in &mut wire[1][..2] {
            assert!(matches!(rx.on_datagram(now, d), Received::Deliver(_)));
        }
        assert_eq!(
            rx.stats().untracked_sources,
            2,
            "both went to QUIC untracked"
        );
        // Nor does the forged shape count as 64 losses once the block is given up.
        let later = now + Duration::from_secs(5);
        rx.on_timeout(later);
        let s = rx.stats();
        assert_eq!((s.lost, s.residual), (0, 0), "{s:?}");
        let now = later;
        // Block 2: a repair of one source "restores" a 1-byte packet; the real one still goes
        // to QUIC, once.
        let mut fake = forged(block_of(&wire[2][0]), 1, &[0, 1, b'J', 0]);
        let _ = rx.on_datagram(now, &mut fake);
        let mut junk = Vec::new();
        while rx.pop_recovered(&mut junk) {}
        assert_eq!(junk, b"J");
        let mut copy = wire[2][0].clone();
        assert!(matches!(
            rx.on_datagram(now, &mut wire[2][0]),
            Received::Deliver(_)
        ));
        assert!(matches!(
            rx.on_datagram(now, &mut copy),
            Received::Dropped(DropReason::Duplicate)
        ));
    }

    /// Every honest source reaches QUIC once: the originals of packets FEC restored before
    /// they came (reordered, not lost) are duplicates, however many one block restored.
    #[test]
    fn originals_of_restored_packets_are_duplicates_however_many_were_restored() {
        let now = Instant::now();
        let config = FecConfig {
            mode: FecMode::Fixed { k: 8, r: 4 },
            scope: FecScope::All,
            ..FecConfig::default()
        };
        let mut tx = FecSender::new(config, None, [1; 32]).expect("sender");
        let mut wire = Vec::new();
        for n in 0..8u8 {
            let mut out = Vec::new();
            tx.send(now, &[n; 100], &mut out).expect("send");
            wire.push(out);
        }
        let later = now + Duration::from_secs(1);
        tx.on_timeout(later);
        let mut out = Vec::new();
        while tx.poll_transmit(later, &mut out) {
            wire.push(std::mem::take(&mut out));
        }
        assert_eq!(wire.len(), 12);
        let mut rx = FecReceiver::new(ReceiverConfig::default(), None, [2; 32]).expect("receiver");
        // Sources 1, 3 and 5 come after the repairs, which restore them.
        for i in [0, 2, 4, 6, 7, 8, 9, 10] {
            let _ = rx.on_datagram(now, &mut wire[i]);
        }
        let mut restored = Vec::new();
        let mut count = 0;
        while rx.pop_recovered(&mut restored) {
            count += 1;
        }
        assert_eq!(count, 3);
        for i in [1, 3, 5] {
            assert_eq!(
                rx.on_datagram(now, &mut wire[i]),
                Received::Dropped(DropReason::Duplicate),
                "source {i}"
            );
        }
    }

    #[test]
    fn a_restored_packet_dropped_for_a_full_queue_still_takes_its_late_original() {
        let now = Instant::now();
        let count = u8::try_from(MAX_RECOVERED_QUEUE + 1).expect("fits");
        let mut wire = blocks_of_two(count, now);
        let mut rx = FecReceiver::new(ReceiverConfig::default(), None, [2; 32]).expect("receiver");
        // Every block loses its second source, restored from the first and the repair; nobody
        // pops the restored packets, so the last block's finds the queue full.
        for block in &mut wire {
            for d in [0, 2] {
                let _ = rx.on_datagram(now, &mut block[d]);
            }
        }
        let s = rx.stats();
        assert_eq!(
            (s.recovered, s.recovered_dropped),
            (u64::from(count) - 1, 1)
        );
        // The dropped one's original arrives late: QUIC gets it. (One restored and queued is a
        // duplicate, as before.)
        let last = wire.last_mut().expect("blocks");
        assert!(matches!(
            rx.on_datagram(now, &mut last[1]),
            Received::Deliver(_)
        ));
        assert!(matches!(
            rx.on_datagram(now, &mut wire[0][1]),
            Received::Dropped(DropReason::Duplicate)
        ));
    }

    #[test]
    fn a_skipped_block_is_counted_missing_on_time_without_more_traffic() {
        let now = Instant::now();
        let mut wire = blocks_of_two(4, now);
        let mut rx = FecReceiver::new(ReceiverConfig::default(), None, [2; 32]).expect("receiver");
        // Blocks 0 and 3 arrive whole; 1 and 2 not at all.
        for b in [0, 3] {
            for d in &mut wire[b] {
                let _ = rx.on_datagram(now, d);
            }
        }
        let mut report = Vec::new();
        assert!(rx.poll_transmit(now, &mut report));
        assert_eq!(rx.stats().blocks_missing, 0);
        // Nothing more arrives: the timer must still come when the skipped ids expire.
        let due = rx.next_deadline().expect("the skipped ids' expiry");
        assert_eq!(due, now + rx.config.max_block_age);
        rx.on_timeout(due);
        assert_eq!(rx.stats().blocks_missing, 2);
        // And the report telling the sender is due next.
        let due = rx.next_deadline().expect("a report");
        assert!(rx.poll_transmit(due, &mut report));
        assert_eq!(rx.next_deadline(), None);
    }

    #[test]
    fn large_datagrams_leave_no_large_buffers_behind() {
        let config = FecConfig {
            mode: FecMode::Fixed { k: 3, r: 2 },
            scope: FecScope::All,
            ..FecConfig::default()
        };
        let mut tx = FecSender::new(config, None, [1; 32]).expect("sender");
        let now = Instant::now();
        // QUIC's MTU covers them (else they are probes, sent padded outside FEC).
        tx.set_quic_mtu(now, u16::MAX);
        let mut rx = FecReceiver::new(ReceiverConfig::default(), None, [2; 32]).expect("receiver");
        let later = now + Duration::from_secs(1);
        for size in [1200usize, crate::fec::MAX_PROTECTED_LEN] {
            let mut wire = Vec::new();
            for n in 0..3u8 {
                let mut out = Vec::new();
                tx.send(now, &vec![n; size], &mut out).expect("send");
                wire.push(out);
            }
            tx.on_timeout(later);
            let mut out = Vec::new();
            while tx.poll_transmit(later, &mut out) {
                wire.push(std::mem::take(&mut out));
            }
            // The first source is lost: Reed-Solomon restores it from the rest.
            for d in &mut wire[1..] {
                let _ = rx.on_datagram(now, d);
            }
            let mut restored = Vec::new();
            assert!(rx.pop_recovered(&mut restored), "size {size}");
            assert_eq!(restored, vec![0u8; size]);
        }
        assert_eq!(rx.stats().recovered, 2);
        // A datagram over what FEC protects goes plain, and arrives whole.
        let mut out = Vec::new();
        tx.send(later, &vec![9u8; 60_000], &mut out).expect("send");
        assert_eq!(tx.stats().plain_packets, 1);
        match rx.on_datagram(later, &mut out) {
            Received::Deliver(range) => assert_eq!(&out[range], &vec![9u8; 60_000][..]),
            other => panic!("{other:?}"),
        }
        assert!(!rx.pool.is_empty());
        assert!(
            rx.pool.iter().all(|b| b.capacity() <= POOLED_CAPACITY),
            "{:?}",
            rx.pool.iter().map(Vec::capacity).collect::<Vec<_>>()
        );
    }
}
