//! Receiver loss reports: what the FEC receiver saw, sent back to the peer's FEC sender.
//!
//! A report carries *cumulative* counters (wrapping `u32`s) and a sequence number, not
//! per-interval deltas: a lost report then loses no information (the next one covers it), and
//! a reordered or replayed older report is recognised by its sequence number and ignored. The
//! sender turns two consecutive reports into a [`LossSample`] with [`LossReport::since`].
//!
//! Losses are counted per FEC block from the source indices that never arrived, *before*
//! recovery; `residual` counts those that recovery could not restore either. A burst is a run
//! of consecutive missing indices inside one block; its length is counted in
//! [`BurstHistogram`]'s fixed buckets. Blocks of which nothing arrived at all (a burst that
//! took a block's sources and its repairs) are counted apart, as `blocks_missing`: the
//! receiver cannot tell how many packets they held, the sender can (see
//! [`crate::fec::adapt`]).
//!
//! After the burst histogram come `blocks_missing` (cumulative) and the ids of the last
//! [`MAX_MISSING_IDS`] blocks confirmed missing, oldest first (a count byte, then `u16`s): the
//! sender knows how many packets each of its blocks held and so how long the bursts were.
//! Reports of builds before them end after the histogram and are still read (as no whole block
//! missing); a build before them drops the longer report as malformed, so against such a peer
//! the sender keeps its table redundancy.

use crate::error::WireError;

/// Number of buckets in a [`BurstHistogram`].
pub const BURST_BUCKETS: usize = 8;

/// Upper bound (inclusive) of each burst-length bucket; the last bucket is open-ended.
pub const BURST_BUCKET_BOUNDS: [u32; BURST_BUCKETS] = [1, 2, 3, 4, 8, 16, 32, u32::MAX];

/// The length used for a bucket when averaging burst lengths (midpoint-ish of the bucket).
const BURST_BUCKET_WEIGHT: [f64; BURST_BUCKETS] = [1.0, 2.0, 3.0, 4.0, 6.0, 12.0, 24.0, 48.0];

/// Most ids of whole missing blocks a report lists.
pub const MAX_MISSING_IDS: usize = 16;

/// Encoded length of a report body (after the 2-byte version and type) listing no missing
/// block; each listed id adds 2 bytes.
pub const LOSS_REPORT_BODY_LEN: usize = 4 * (6 + BURST_BUCKETS) + 1;

/// Length of a report body from a build before `blocks_missing`, still read.
pub const LOSS_REPORT_BODY_LEN_SHORT: usize = 4 * (5 + BURST_BUCKETS);

/// The ids of the last blocks a receiver confirmed missing whole, oldest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MissingIds {
    ids: [u16; MAX_MISSING_IDS],
    len: u8,
}

impl MissingIds {
    /// The ids, oldest first.
    pub fn as_slice(&self) -> &[u16] {
        &self.ids[..usize::from(self.len)]
    }

    /// Appends `id`, dropping the oldest when full.
    pub fn push(&mut self, id: u16) {
        if usize::from(self.len) == MAX_MISSING_IDS {
            self.ids.copy_within(1.., 0);
            self.ids[MAX_MISSING_IDS - 1] = id;
        } else {
            self.ids[usize::from(self.len)] = id;
            self.len += 1;
        }
    }
}

/// Counts of loss bursts by length: buckets 1, 2, 3, 4, 5–8, 9–16, 17–32, 33+.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BurstHistogram(pub [u64; BURST_BUCKETS]);

impl BurstHistogram {
    /// The bucket a burst of `len` (≥ 1) missing packets falls in.
    pub fn bucket(len: u32) -> usize {
        BURST_BUCKET_BOUNDS
            .iter()
            .position(|&bound| len <= bound)
            .unwrap_or(BURST_BUCKETS - 1)
    }

    /// Counts one burst of `len` missing packets.
    pub fn record(&mut self, len: u32) {
        self.0[Self::bucket(len)] += 1;
    }

    /// Total number of bursts counted.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

/// A receiver's cumulative loss counters, as carried on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LossReport {
    /// Report sequence number; a report whose `seq` is not newer than the last one is stale.
    pub seq: u32,
    /// Source packets that arrived (not counting recovered ones or duplicates).
    pub received: u32,
    /// Source packets missing when their block was finalised, before recovery.
    pub lost: u32,
    /// Missing source packets restored by FEC.
    pub recovered: u32,
    /// Missing source packets FEC could not restore.
    pub residual: u32,
    /// Loss bursts by length (see [`BurstHistogram`]), wrapping.
    pub bursts: [u32; BURST_BUCKETS],
    /// Whole blocks of which no packet arrived (not in `lost`, `residual` or `bursts`).
    pub blocks_missing: u32,
    /// The last of those, by block id (not cumulative: the sender takes the ones it has not
    /// seen yet).
    pub missing_ids: MissingIds,
}

/// What happened between two reports.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LossSample {
    /// Source packets that arrived.
    pub received: u32,
    /// Source packets lost before recovery.
    pub lost: u32,
    /// Source packets lost after recovery.
    pub residual: u32,
    /// Loss bursts by bucket.
    pub bursts: [u32; BURST_BUCKETS],
    /// Whole blocks of which no packet arrived.
    pub blocks_missing: u32,
}

impl LossSample {
    /// Fraction of source packets lost before recovery, or `None` if no packet was accounted.
    pub fn loss_rate(&self) -> Option<f64> {
        let total = u64::from(self.received) + u64::from(self.lost);
        (total > 0).then(|| f64::from(self.lost) / total as f64)
    }

    /// Loss bursts counted inside blocks.
    pub fn burst_count(&self) -> u64 {
        self.bursts.iter().map(|&c| u64::from(c)).sum()
    }

    /// Mean loss-burst length, or `None` if there was no loss.
    pub fn mean_burst(&self) -> Option<f64> {
        let n: u64 = self.bursts.iter().map(|&c| u64::from(c)).sum();
        if n == 0 {
            return None;
        }
        let sum: f64 = self
            .bursts
            .iter()
            .zip(BURST_BUCKET_WEIGHT)
            .map(|(&c, w)| f64::from(c) * w)
            .sum();
        Some(sum / n as f64)
    }
}

impl LossReport {
    /// `true` if `self` is newer than `other` (serial arithmetic on `seq`).
    pub fn is_newer_than(&self, other: &LossReport) -> bool {
        (self.seq.wrapping_sub(other.seq) as i32) > 0
    }

    /// The counts between `prev` and `self` (both cumulative; wrapping-safe).
    pub fn since(&self, prev: &LossReport) -> LossSample {
        let mut bursts = [0; BURST_BUCKETS];
        for (i, b) in bursts.iter_mut().enumerate() {
            *b = self.bursts[i].wrapping_sub(prev.bursts[i]);
        }
        LossSample {
            received: self.received.wrapping_sub(prev.received),
            lost: self.lost.wrapping_sub(prev.lost),
            residual: self.residual.wrapping_sub(prev.residual),
            bursts,
            blocks_missing: self.blocks_missing.wrapping_sub(prev.blocks_missing),
        }
    }

    /// Appends the report body (without version and type) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        for v in [
            self.seq,
            self.received,
            self.lost,
            self.recovered,
            self.residual,
        ]
        .iter()
        .chain(self.bursts.iter())
        .chain([self.blocks_missing].iter())
        {
            out.extend_from_slice(&v.to_be_bytes());
        }
        let ids = self.missing_ids.as_slice();
        out.push(ids.len() as u8);
        for id in ids {
            out.extend_from_slice(&id.to_be_bytes());
        }
    }

    /// Parses a report body (without version and type): [`LOSS_REPORT_BODY_LEN`] bytes plus 2
    /// per listed id, or [`LOSS_REPORT_BODY_LEN_SHORT`] from an older build (no whole block
    /// missing). Any other length is rejected, so that a report is exactly one encoding.
    pub fn decode(body: &[u8]) -> Result<Self, WireError> {
        let short = body.len() == LOSS_REPORT_BODY_LEN_SHORT;
        if !short && body.len() < LOSS_REPORT_BODY_LEN {
            return Err(WireError::Truncated {
                need: LOSS_REPORT_BODY_LEN + 2,
                got: body.len() + 2,
            });
        }
        let word = |i: usize| {
            let b = &body[4 * i..4 * i + 4];
            u32::from_be_bytes([b[0], b[1], b[2], b[3]])
        };
        let mut bursts = [0; BURST_BUCKETS];
        for (i, b) in bursts.iter_mut().enumerate() {
            *b = word(5 + i);
        }
        let mut report = Self {
            seq: word(0),
            received: word(1),
            lost: word(2),
            recovered: word(3),
            residual: word(4),
            bursts,
            ..Self::default()
        };
        if short {
            return Ok(report);
        }
        report.blocks_missing = word(5 + BURST_BUCKETS);
        let n = usize::from(body[LOSS_REPORT_BODY_LEN - 1]);
        if n > MAX_MISSING_IDS {
            return Err(WireError::Malformed(
                "a loss report lists too many missing blocks",
            ));
        }
        if body.len() != LOSS_REPORT_BODY_LEN + 2 * n {
            return Err(WireError::Malformed(
                "a loss report's length does not match its missing-block count",
            ));
        }
        for id in body[LOSS_REPORT_BODY_LEN..].chunks_exact(2) {
            report.missing_ids.push(u16::from_be_bytes([id[0], id[1]]));
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_lengths_fall_in_their_buckets() {
        let b: Vec<usize> = [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 1000]
            .iter()
            .map(|&l| BurstHistogram::bucket(l))
            .collect();
        assert_eq!(b, vec![0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 7]);
    }

    #[test]
    fn loss_report_round_trips_and_rejects_wrong_lengths() {
        let r = LossReport {
            seq: 9,
            received: 1000,
            lost: 50,
            recovered: 45,
            residual: 5,
            bursts: [30, 5, 2, 1, 0, 0, 0, 1],
            blocks_missing: 7,
            missing_ids: MissingIds::default(),
        };
        let mut out = Vec::new();
        r.encode(&mut out);
        assert_eq!(out.len(), LOSS_REPORT_BODY_LEN);
        assert_eq!(LossReport::decode(&out), Ok(r));
        let mut listed = r;
        for id in [3, 4, 9] {
            listed.missing_ids.push(id);
        }
        let mut long = Vec::new();
        listed.encode(&mut long);
        assert_eq!(long.len(), LOSS_REPORT_BODY_LEN + 6);
        assert_eq!(LossReport::decode(&long), Ok(listed));
        assert!(LossReport::decode(&long[..long.len() - 1]).is_err());
        let mut too_many = long.clone();
        too_many[LOSS_REPORT_BODY_LEN - 1] = MAX_MISSING_IDS as u8 + 1;
        too_many.resize(LOSS_REPORT_BODY_LEN + 2 * (MAX_MISSING_IDS + 1), 0);
        assert!(LossReport::decode(&too_many).is_err());
        // An older build's report, one word shorter: read as no whole block missing.
        assert_eq!(
            LossReport::decode(&out[..LOSS_REPORT_BODY_LEN_SHORT]),
            Ok(LossReport {
                blocks_missing: 0,
                ..r
            })
        );
        for len in [0, LOSS_REPORT_BODY_LEN_SHORT - 1, LOSS_REPORT_BODY_LEN - 1] {
            assert!(LossReport::decode(&out[..len]).is_err(), "{len}");
        }
        out.push(0);
        assert!(LossReport::decode(&out).is_err());
    }

    #[test]
    fn missing_ids_keep_the_last_ones_oldest_first() {
        let mut m = MissingIds::default();
        for id in 0..20u16 {
            m.push(id);
        }
        let want: Vec<u16> = (4..20).collect();
        assert_eq!(m.as_slice(), &want[..]);
    }

    #[test]
    fn samples_are_deltas_across_counter_wrap() {
        let prev = LossReport {
            seq: u32::MAX,
            received: u32::MAX - 9,
            lost: 0,
            ..Default::default()
        };
        let next = LossReport {
            seq: 0,
            received: 10,
            lost: 5,
            bursts: [5, 0, 0, 0, 0, 0, 0, 0],
            ..Default::default()
        };
        assert!(next.is_newer_than(&prev));
        let s = next.since(&prev);
        assert_eq!(s.received, 20);
        assert_eq!(s.lost, 5);
        assert_eq!(s.loss_rate(), Some(0.2));
        assert_eq!(s.mean_burst(), Some(1.0));
    }
}
