//! How many repair packets a block gets.
//!
//! The starting point is a table by block size, chosen so that the small blocks of a sparse
//! token stream (where a lost last packet costs QUIC a whole probe timeout) are the best
//! protected: 1:1, 2:2, 4:2, 8:3, 16:4, interpolated upwards in between and `⌈k/4⌉` beyond 16.
//! In `auto` mode the table is a floor; the receiver's loss reports can raise it:
//!
//! ```text
//! needed(k) = ⌈ k·p + 2·√(k·p·b) ⌉
//! ```
//!
//! where `p` is the estimated loss rate and `b ≥ 1` the estimated mean burst length: the
//! expected losses in the block plus two standard deviations, the variance scaled by the burst
//! length because losses arrive in bursts of `b` (a compound-Poisson approximation). The
//! estimates rise fast and decay slowly: a report showing more loss than the estimate moves it
//! half-way to the sample, one showing less moves it an eighth of the way, so the redundancy
//! reacts within one report interval and relaxes over about a second of clean reports. Both
//! steps are scaled by `n / (n + 16)` for a report covering `n` packets, so that a token
//! stream's small reports (one loss in five packets is not a 20 % loss rate) do not whip the
//! estimate to two or three times the true rate. The
//! result is capped at `2k + 1` and [`MAX_BLOCK_REPAIRS`]; the sender's overhead budget caps the
//! bytes on top of that.
//!
//! The receiver sees a burst as a run of missing indices inside one block, but on a sparse
//! stream blocks hold one to three sources, and a burst that takes a whole block (sources and
//! repairs) leaves nothing to count inside it. Reports therefore also carry the blocks that never
//! arrived, with the ids of the last ones; the sender counts the packets each of those held as
//! lost, and each run of consecutive ids as one burst. Under bursty loss (mean burst
//! at least [`BURSTY`]) a head block gets enough repairs that all of its copies are rarely lost
//! in one burst ([`Adaptation::head_repairs`]).
//!
//! Sparse blocks (a token stream's) are sized for a residual instead: the fewest repairs that
//! leave a token lost for good with probability ≤ 10⁻⁴ ([`Adaptation::sparse_repairs_for`]),
//! in blocks of two once one repair per three is not enough ([`Adaptation::sparse_k_max`]).
//! A token left to QUIC costs its stream a stall of one to two RTTs; the repairs cost bytes
//! of a stream that is small anyway.

use crate::fec::SPARSE_K_MAX;
use crate::loss_report::LossReport;
use crate::packet::{BlockId, MAX_BLOCK_REPAIRS};

/// Weight of a sample above the estimate.
const RISE: f64 = 0.5;
/// Weight of a sample below the estimate.
const DECAY: f64 = 0.125;
/// A report covering this many packets moves the estimate half as far as a large one: a token
/// stream's reports cover a handful of packets each, and one loss in five is not a 20 % loss
/// rate. The weight of a sample of `n` packets is `n / (n + REPORT_HALF_WEIGHT)` times
/// [`RISE`] or [`DECAY`].
const REPORT_HALF_WEIGHT: f64 = 16.0;
/// A report of this many bursts moves the burst estimate half-way to its mean.
const BURST_HALF_WEIGHT: f64 = 16.0;
/// Loss rates below this are treated as no loss (keeps the decay from lingering forever).
const LOSS_FLOOR: f64 = 1e-4;
/// A mean burst length from which losses count as bursty: repairs are spread in time and
/// heads get [`Adaptation::head_repairs`].
pub const BURSTY: f64 = 1.5;
/// Once bursty, losses count as bursty until the mean burst falls below this. Spreading the
/// repairs hides bursts from the receiver (a run of consecutive datagrams lost then falls on
/// several blocks, each of which sees one loss), so the measured mean drops once the spreading
/// starts; without the margin the sender would turn the spreading off again and on.
pub const BURSTY_EXIT: f64 = 1.2;
/// The least mean burst the bursty rules assume while bursty. With the repairs spread the
/// receiver sees a burst of three as one to three single losses: on `4g`'s bursts of 3 the
/// simulated estimate sits at 1.3–1.5 once the spreading runs, 2.5 without it.
const BURSTY_FLOOR: f64 = 2.0;
/// The probability of losing a head block and all its repairs that
/// [`Adaptation::head_repairs`] aims for. Two heads a request, and the p99 of a few hundred
/// requests must not see one: 10⁻⁴, since the burst estimate runs low (a burst cut by a block
/// boundary is counted as two shorter ones), and so does the `r` it gives.
const HEAD_RESIDUAL_TARGET: f64 = 1e-4;
/// The probability of a packet of a sparse block being lost and not restored that
/// [`Adaptation::sparse_repairs_for`] aims for: an answer of ~32 tokens must keep a loss for
/// QUIC in well under 1 % of answers, or the p99 of the largest inter-token gap is a
/// retransmission: 32 · 10⁻⁴ = 0.3 %.
const SPARSE_RESIDUAL_TARGET: f64 = 1e-4;
/// Below this estimated loss rate heads get no extra repairs for bursts.
const HEAD_LOSS_FLOOR: f64 = 1e-3;
/// Most repairs [`Adaptation::head_repairs`] asks for.
pub const HEAD_MAX_REPAIRS: usize = 7;

/// Table redundancy for a block of `k` source packets (`k ≥ 1`).
pub fn table_repairs(k: usize) -> usize {
    const POINTS: [(usize, usize); 5] = [(1, 1), (2, 2), (4, 2), (8, 3), (16, 4)];
    if k <= 1 {
        return 1;
    }
    if k > 16 {
        return k.div_ceil(4);
    }
    for w in POINTS.windows(2) {
        let ((k0, r0), (k1, r1)) = (w[0], w[1]);
        if k <= k1 {
            // r0 + (r1 - r0)·(k - k0)/(k1 - k0), rounded up; r is non-decreasing in k.
            return r0 + ((r1 - r0) * (k - k0)).div_ceil(k1 - k0);
        }
    }
    4
}

/// Loss and burst estimates built from the peer receiver's reports.
#[derive(Debug, Clone, Default)]
pub struct Adaptation {
    loss: f64,
    burst: f64,
    /// Whether losses count as bursty ([`BURSTY`], [`BURSTY_EXIT`]).
    bursty: bool,
    last: Option<LossReport>,
    /// A report that looked like a restarted receiver's, waiting for a second one to agree
    /// (a replayed old report looks the same, and alone it reset the baseline).
    restart: Option<LossReport>,
}

impl Adaptation {
    /// Feeds one loss report; `block_packets` tells how many packets (sources and repairs)
    /// the sender put in the block of an id, if it still knows (the receiver cannot know it of
    /// a block it never saw). Returns `false` (and changes nothing) for a report that is not
    /// newer than the last one (reordered or replayed). The first report only sets the
    /// baseline, since its counters cover an unknown period.
    ///
    /// Whole blocks missing count as lost packets, as many as each held; a run of consecutive
    /// ids is one burst of all their packets. The burst estimate is a mean over bursts, not
    /// reports: it moves only on reports that show a loss (most reports of a sparse stream show
    /// none, and they say nothing about burst lengths), by `m / (m + 16)` of the way for a report
    /// of `m` bursts, up or down alike.
    pub fn on_report(
        &mut self,
        report: &LossReport,
        block_packets: impl Fn(BlockId) -> Option<usize>,
    ) -> bool {
        let Some(prev) = self.last else {
            self.last = Some(*report);
            return true;
        };
        if restarted(report, &prev) {
            // The peer's receiver started over (its process or its state for this peer): its
            // counters began again from zero, so the difference from `prev` would be garbage
            // (wrapped to billions). Its next report is measured from this one, once a second
            // report follows it consistently: one old report replayed looks restarted too,
            // and taken alone it set the baseline back so that the next genuine report was
            // measured over a past window (again at each replay).
            let confirmed = self
                .restart
                .is_some_and(|first| report.is_newer_than(&first) && !restarted(report, &first));
            if confirmed {
                self.last = Some(*report);
                self.restart = None;
                return true;
            }
            self.restart = Some(*report);
            return false;
        }
        if !report.is_newer_than(&prev) {
            // Not newer than the old receiver's last: a reordered or replayed report, or the
            // restarted receiver's second one, which agrees with the first although its
            // counters have already passed the old receiver's (and its sequence will not pass
            // the old one's for a long while: without this, adaptation stood still till then).
            // (An old report arriving late has counters behind the baseline's: not this.)
            let confirms = !counters_back(report, &prev)
                && self.restart.is_some_and(|first| {
                    report.is_newer_than(&first) && !restarted(report, &first)
                });
            if confirms {
                self.last = Some(*report);
                self.restart = None;
                return true;
            }
            return false;
        }
        self.restart = None;
        self.last = Some(*report);
        let sample = report.since(&prev);
        let (whole, whole_bursts) =
            Self::whole_blocks(report, &prev, sample.blocks_missing, block_packets);
        let lost = f64::from(sample.lost) + whole;
        let n = f64::from(sample.received) + lost;
        if n <= 0.0 {
            return true;
        }
        let weight = n / (n + REPORT_HALF_WEIGHT);
        self.loss = blend(self.loss, lost / n, weight);
        if self.loss < LOSS_FLOOR {
            self.loss = 0.0;
        }
        let in_block = sample.burst_count() as f64;
        let bursts = in_block + whole_bursts;
        if bursts > 0.0 {
            let in_block_len = sample.mean_burst().map_or(0.0, |b| b * in_block);
            let b = ((in_block_len + whole) / bursts).max(1.0);
            let burst = self.burst.max(1.0);
            self.burst = burst + bursts / (bursts + BURST_HALF_WEIGHT) * (b - burst);
        }
        let b = self.burst_estimate();
        self.bursty = b >= if self.bursty { BURSTY_EXIT } else { BURSTY };
        true
    }

    /// Packets and bursts of the whole blocks missing that `report` adds after `prev`: the
    /// ids it lists after the last one `prev` listed (all of them if that one is gone: more
    /// went missing in between than a report lists, or the receiver started over), sized by
    /// `block_packets`, consecutive ids joined into one burst (also across the two reports).
    /// New ids are told by position, not by comparing ids, which wrap. Blocks counted but not
    /// listed count one packet and one burst each.
    fn whole_blocks(
        report: &LossReport,
        prev: &LossReport,
        missing: u32,
        block_packets: impl Fn(BlockId) -> Option<usize>,
    ) -> (f64, f64) {
        let ids = report.missing_ids.as_slice();
        let start = prev
            .missing_ids
            .as_slice()
            .last()
            .and_then(|last| ids.iter().rposition(|id| id == last))
            .map_or(0, |i| i + 1);
        let (mut packets, mut bursts) = (0.0, 0.0);
        let mut before = start.checked_sub(1).map(|i| BlockId(ids[i]));
        for id in ids[start..].iter().copied().map(BlockId) {
            packets += block_packets(id).unwrap_or(1).max(1) as f64;
            if before.is_none_or(|b| b.next() != id) {
                bursts += 1.0;
            }
            before = Some(id);
        }
        let listed = (ids.len() - start) as u32;
        let unlisted = f64::from(missing.saturating_sub(listed));
        (packets + unlisted, bursts + unlisted)
    }

    /// The estimated loss rate (0 until a report shows loss).
    pub fn loss_estimate(&self) -> f64 {
        self.loss
    }

    /// The estimated mean loss-burst length (at least 1).
    pub fn burst_estimate(&self) -> f64 {
        self.burst.max(1.0)
    }

    /// Whether losses count as bursty: the mean burst reached [`BURSTY`] and has not fallen
    /// below [`BURSTY_EXIT`] since. Repairs are then spread in time.
    pub fn is_bursty(&self) -> bool {
        self.bursty
    }

    /// The mean burst the bursty rules work with: at least [`BURSTY_FLOOR`] while bursty,
    /// since the measured mean runs low once repairs are spread.
    fn rule_burst(&self) -> f64 {
        let b = self.burst_estimate();
        if self.bursty {
            b.max(BURSTY_FLOOR)
        } else {
            b
        }
    }

    /// Repair packets for a block of `k` source packets: the table, raised by the estimates.
    pub fn repairs_for(&self, k: usize) -> usize {
        table_repairs(k.max(1))
            .max(self.needed(k))
            .min(2 * k.max(1) + 1)
            .min(MAX_BLOCK_REPAIRS)
    }

    /// Repair packets for a *sparse* block of `k` packets (a few packets of a token stream,
    /// grouped over a fraction of the RTT): the fewest that leave a packet of the block lost
    /// with probability at most [`SPARSE_RESIDUAL_TARGET`] ([`Self::sparse_residual`]), at
    /// least one and at most one per packet of the block. A token lost for good costs its
    /// stream QUIC's loss recovery, a stall of one to two RTTs that the user sees; a repair per
    /// token costs ~13 kB/s of a token stream's bytes. Without loss reported a block gets
    /// one XOR parity. Without the table's floor (a duplicate per packet for small blocks).
    /// docs/datagram-layer.md, "Token streams: the arithmetic", for the numbers.
    pub fn sparse_repairs_for(&self, k: usize) -> usize {
        let k = k.max(1);
        let most = (k + 1).min(SPARSE_K_MAX).min(MAX_BLOCK_REPAIRS);
        (1..=most)
            .find(|&r| self.sparse_residual(k, r) <= SPARSE_RESIDUAL_TARGET)
            .unwrap_or(most)
    }

    /// Most packets of a sparse block: [`SPARSE_K_MAX`] while one repair per block meets the
    /// residual target, else 2. A block's repairs go out when it closes, so its first packet,
    /// if lost, is restored `k − 1` packet intervals late: at 20 ms a token, 40 ms in a block of
    /// three, which with the stream's own jitter (±25 ms on `lossy-noloss`) made 80–100 ms gaps
    /// at the p99; in a block of two it is 20 ms. Light loss keeps blocks of three and their
    /// one parity, since few answers then have a restored token at all.
    pub fn sparse_k_max(&self) -> usize {
        if self.sparse_repairs_for(SPARSE_K_MAX) > 1 {
            2
        } else {
            SPARSE_K_MAX
        }
    }

    /// The estimated probability that a packet of a block of `k` sources and `r` repairs is
    /// lost and not restored: it is lost (`p`) and so are at least `r` of the other
    /// `k + r − 1`. Under random loss that is a binomial tail; under bursty loss (mean burst
    /// `b` ≥ [`BURSTY`]) the packets after a lost one are lost with probability `1 − 1/b`
    /// each, so about `p·(1 − 1/b)^r`.
    pub fn sparse_residual(&self, k: usize, r: usize) -> f64 {
        let p = self.loss;
        if self.bursty {
            p * (1.0 - 1.0 / self.rule_burst()).powi(r as i32)
        } else {
            p * binomial_tail(k + r - 1, r, p)
        }
    }

    /// Repairs a head block (a request, or an answer's first packets, after a pause) needs
    /// under bursty loss, or 0 when losses are not bursty (mean burst below [`BURSTY`]).
    ///
    /// Copies sent back to back fall into the burst that took the first one: after a lost
    /// packet the next is lost with probability `1 − 1/b` for bursts of mean length `b`
    /// (geometric), so a packet and `r` repairs are all lost with probability about
    /// `p·(1 − 1/b)^r`. The fewest `r` that bring that to [`HEAD_RESIDUAL_TARGET`], at most
    /// [`HEAD_MAX_REPAIRS`]. Heads are one or two per request, so this is bounded by the
    /// requests, not by the bytes.
    pub fn head_repairs(&self) -> usize {
        if !self.bursty || self.loss <= HEAD_LOSS_FLOOR {
            return 0;
        }
        let follow = 1.0 - 1.0 / self.rule_burst();
        let r = ((HEAD_RESIDUAL_TARGET / self.loss).ln() / follow.ln()).ceil();
        (r.max(1.0) as usize).min(HEAD_MAX_REPAIRS)
    }

    /// `⌈k·p + 2·√(k·p·b)⌉`: expected losses plus two standard deviations.
    fn needed(&self, k: usize) -> usize {
        let kp = k.max(1) as f64 * self.loss;
        (kp + 2.0 * (kp * self.burst_estimate()).sqrt()).ceil() as usize
    }
}

/// How far behind the last report a report may be and still be one that arrived out of order
/// rather than one of a receiver that started over.
const REORDER_REPORTS: u32 = 64;

/// Whether `report` comes from a receiver that started over since `prev`: its cumulative
/// counters went back, and it is not an old report that arrived late (a few behind `prev`).
fn restarted(report: &LossReport, prev: &LossReport) -> bool {
    let reordered =
        !report.is_newer_than(prev) && prev.seq.wrapping_sub(report.seq) <= REORDER_REPORTS;
    counters_back(report, prev) && !reordered
}

/// Whether any of `report`'s cumulative counters is behind `prev`'s.
fn counters_back(report: &LossReport, prev: &LossReport) -> bool {
    let back = |now: u32, before: u32| (now.wrapping_sub(before) as i32) < 0;
    // The burst counts too: a restarted receiver's `received` and `lost` may have passed the
    // old ones by the time its reports are newer, while a burst bucket has not (a delta
    // wrapped to billions made the sender take every loss for a burst of 48).
    back(report.received, prev.received)
        || back(report.lost, prev.lost)
        || back(report.blocks_missing, prev.blocks_missing)
        || report
            .bursts
            .iter()
            .zip(&prev.bursts)
            .any(|(&now, &before)| back(now, before))
}

/// `P(X ≥ m)` for `X ~ Binomial(n, p)` (`n` is small: a block's packets).
fn binomial_tail(n: usize, m: usize, p: f64) -> f64 {
    let p = p.clamp(0.0, 1.0);
    let mut choose = 1.0; // C(n, i), built up from C(n, 0)
    let mut tail = 0.0;
    for i in 0..=n {
        if i > 0 {
            choose = choose * (n + 1 - i) as f64 / i as f64;
        }
        if i >= m {
            tail += choose * p.powi(i as i32) * (1.0 - p).powi((n - i) as i32);
        }
    }
    tail
}

fn blend(estimate: f64, sample: f64, weight: f64) -> f64 {
    let w = if sample > estimate { RISE } else { DECAY };
    estimate + weight * w * (sample - estimate)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_the_anchor_points_and_interpolates_upwards() {
        let r: Vec<usize> = (1..=20).map(table_repairs).collect();
        assert_eq!(
            r,
            vec![1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5]
        );
    }

    fn report(seq: u32, received: u32, lost: u32, bursts: u32) -> LossReport {
        LossReport {
            seq,
            received,
            lost,
            bursts: [bursts, 0, 0, 0, 0, 0, 0, 0],
            ..Default::default()
        }
    }

    fn at(loss: f64, burst: f64) -> Adaptation {
        Adaptation {
            loss,
            burst,
            bursty: burst >= BURSTY,
            last: None,
            restart: None,
        }
    }

    #[test]
    fn binomial_tail_matches_hand_computed_values() {
        assert!((binomial_tail(4, 0, 0.3) - 1.0).abs() < 1e-12);
        assert_eq!(binomial_tail(2, 3, 0.3), 0.0);
        // P(X ≥ 2), X ~ B(4, 0.05) = 1 − 0.95⁴ − 4·0.05·0.95³.
        let want = 1.0 - 0.95f64.powi(4) - 4.0 * 0.05 * 0.95f64.powi(3);
        assert!((binomial_tail(4, 2, 0.05) - want).abs() < 1e-12);
        assert!((binomial_tail(5, 5, 0.5) - 1.0 / 32.0).abs() < 1e-12);
        assert!((binomial_tail(3, 1, 1.0) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn sparse_blocks_get_the_fewest_repairs_that_meet_the_residual_target() {
        // No loss reported: one XOR parity.
        assert_eq!(Adaptation::default().sparse_repairs_for(3), 1);
        // 0.5 % random: one repair leaves 0.005 · P(≥1 of 3 lost) ≈ 7.5·10⁻⁵.
        assert_eq!(at(0.005, 1.0).sparse_repairs_for(3), 1);
        // 2 %: one leaves 1.2·10⁻³, two 4.7·10⁻⁵.
        assert_eq!(at(0.02, 1.0).sparse_repairs_for(3), 2);
        // 5 % (`lossy`): two leave 7·10⁻⁴, three 5.8·10⁻⁵.
        let lossy = at(0.05, 1.0);
        assert!(lossy.sparse_residual(3, 2) > SPARSE_RESIDUAL_TARGET);
        assert!(lossy.sparse_residual(3, 3) <= SPARSE_RESIDUAL_TARGET);
        assert_eq!(lossy.sparse_repairs_for(3), 3);
        // At most one more than the block's packets and at most three, however heavy the
        // loss or long the bursts: a lone packet (an answer's last, which closes its block
        // early) goes out three times at 5 %.
        assert_eq!(at(0.3, 1.0).sparse_repairs_for(3), 3);
        assert_eq!(at(0.05, 1.0).sparse_repairs_for(2), 3);
        assert_eq!(at(0.05, 1.0).sparse_repairs_for(1), 2);
        assert_eq!(at(0.005, 1.0).sparse_repairs_for(1), 1);
        assert_eq!(at(0.02, 3.0).sparse_repairs_for(3), 3);
        // Bursty loss: a packet's neighbours go with it, so more repairs than random loss at
        // the same rate asks for.
        assert!(at(0.01, 2.0).sparse_repairs_for(3) > at(0.01, 1.0).sparse_repairs_for(3));
        // Ordinary blocks keep the table and its margin.
        assert!(at(0.14, 1.0).repairs_for(3) >= 2);
    }

    #[test]
    fn bursty_is_entered_at_1_5_and_left_below_1_2() {
        // Reports of 1000 packets with ten bursts of `len` each (cumulative counters).
        let mut a = Adaptation::default();
        let mut cum = report(1, 0, 0, 0);
        a.on_report(&cum, |_| None);
        let mut feed = |a: &mut Adaptation, len: u32, n: usize| {
            for _ in 0..n {
                cum.seq += 1;
                cum.received += 1000;
                cum.lost += 10 * len;
                cum.bursts[(len - 1) as usize] += 10;
                a.on_report(&cum, |_| None);
            }
        };
        assert!(!a.is_bursty());
        feed(&mut a, 3, 20);
        assert!(
            a.burst_estimate() > 1.5 && a.is_bursty(),
            "{}",
            a.burst_estimate()
        );
        let head = a.head_repairs();
        // Single losses pull the mean down; between 1.5 and 1.2 it stays bursty, and the
        // rules keep assuming bursts of at least 2.
        while a.burst_estimate() >= 1.45 {
            feed(&mut a, 1, 1);
        }
        assert!(a.burst_estimate() > 1.2);
        assert!(a.is_bursty());
        assert!(a.head_repairs() >= 5, "{}", a.head_repairs());
        assert!(a.head_repairs() <= head);
        feed(&mut a, 1, 40);
        assert!(a.burst_estimate() < 1.2, "{}", a.burst_estimate());
        assert!(!a.is_bursty());
        assert_eq!(a.head_repairs(), 0);
    }

    #[test]
    fn sparse_blocks_shrink_to_two_packets_once_one_repair_is_not_enough() {
        assert_eq!(Adaptation::default().sparse_k_max(), SPARSE_K_MAX);
        assert_eq!(at(0.005, 1.0).sparse_k_max(), SPARSE_K_MAX);
        assert_eq!(at(0.02, 1.0).sparse_k_max(), 2);
        assert_eq!(at(0.05, 1.0).sparse_k_max(), 2);
        assert_eq!(at(0.02, 3.0).sparse_k_max(), 2);
        // At 5 %, a block of two gets three repairs: 2.4·10⁻⁵ left.
        let lossy = at(0.05, 1.0);
        assert_eq!(lossy.sparse_repairs_for(2), 3);
        assert!(lossy.sparse_residual(2, 3) < 3e-5);
    }

    #[test]
    fn a_report_of_a_few_packets_moves_the_estimate_less_than_a_large_one() {
        // One loss in five packets (a token stream's report) against 200 in 1000.
        let mut small = Adaptation::default();
        small.on_report(&report(1, 0, 0, 0), |_| None);
        small.on_report(&report(2, 4, 1, 1), |_| None);
        let mut large = Adaptation::default();
        large.on_report(&report(1, 0, 0, 0), |_| None);
        large.on_report(&report(2, 800, 200, 200), |_| None);
        assert!((small.loss_estimate() - 0.2 * 0.5 * 5.0 / 21.0).abs() < 1e-9);
        assert!(large.loss_estimate() > 0.09, "{}", large.loss_estimate());
        assert!(small.loss_estimate() < 0.3 * large.loss_estimate());
    }

    #[test]
    fn whole_blocks_missing_count_their_packets_and_clean_reports_keep_the_burst_length() {
        // Blocks 10 and 11 held 3 packets each (a head and two repairs), 20 one (an ACK).
        let size = |id: BlockId| match id.0 {
            10 | 11 => Some(3),
            20 => Some(1),
            _ => None,
        };
        let mut a = Adaptation::default();
        a.on_report(&report(1, 0, 0, 0), size);
        // 1000 packets through, 4 single losses inside blocks, blocks 10, 11 and 20 gone
        // whole: one burst of 6 and one of 1, so 11 of 1011 packets lost in 6 bursts.
        let mut r = report(2, 1000, 4, 4);
        r.blocks_missing = 3;
        for id in [10, 11, 20] {
            r.missing_ids.push(id);
        }
        assert!(a.on_report(&r, size));
        let w = 1011.0 / (1011.0 + REPORT_HALF_WEIGHT) * RISE;
        assert!((a.loss_estimate() - w * 11.0 / 1011.0).abs() < 1e-9);
        let b = 1.0 + 6.0 / (6.0 + BURST_HALF_WEIGHT) * (11.0 / 6.0 - 1.0);
        assert!(
            (a.burst_estimate() - b).abs() < 1e-9,
            "{}",
            a.burst_estimate()
        );
        // The same ids listed again are not counted again; a block of unknown size counts one
        // packet; and reports without loss leave the burst length where it is.
        for seq in 3..40 {
            let mut clean = report(seq, 1000 + 100 * (seq - 2), 4, 4);
            clean.blocks_missing = 3;
            clean.missing_ids = r.missing_ids;
            a.on_report(&clean, size);
        }
        assert!(a.loss_estimate() < 1e-3, "{}", a.loss_estimate());
        assert!((a.burst_estimate() - b).abs() < 1e-9);
        assert_eq!(a.head_repairs(), 0, "no loss left to guard against");
    }

    #[test]
    fn a_run_of_missing_blocks_across_two_reports_is_one_burst() {
        let size = |_: BlockId| Some(2);
        let mut a = Adaptation::default();
        a.on_report(&report(1, 0, 0, 0), size);
        let mut r = report(2, 100, 0, 0);
        r.blocks_missing = 1;
        r.missing_ids.push(7);
        a.on_report(&r, size);
        let after_one = a.burst_estimate();
        let w = 1.0 / (1.0 + BURST_HALF_WEIGHT);
        assert!((after_one - (1.0 + w * 1.0)).abs() < 1e-9, "{after_one}");
        // Block 8 follows 7: the same burst goes on (4 packets, still one burst).
        let mut r = report(3, 200, 0, 0);
        r.blocks_missing = 2;
        r.missing_ids.push(7);
        r.missing_ids.push(8);
        a.on_report(&r, size);
        // Block 8 adds its packets to the loss rate but no new burst, so the burst estimate
        // stays.
        assert_eq!(a.burst_estimate(), after_one);
        assert!(a.loss_estimate() > 0.0);
        // More missing than listed: the rest count one packet and one burst each.
        let mut r = report(4, 300, 0, 0);
        r.blocks_missing = 2 + 20;
        a.on_report(&r, size);
        assert!(a.burst_estimate() < after_one);
    }

    #[test]
    fn new_missing_ids_are_told_by_position_across_the_id_wrap() {
        // A long connection: the last block counted missing was 100, the next ones are more
        // than half the id space later, so an id comparison would call them old.
        let size = |_: BlockId| Some(3);
        let mut a = Adaptation::default();
        let mut r = report(1, 0, 0, 0);
        r.missing_ids.push(100);
        a.on_report(&r, size);
        let mut r2 = report(2, 1000, 0, 0);
        r2.blocks_missing = 2;
        r2.missing_ids = r.missing_ids;
        r2.missing_ids.push(40_000);
        r2.missing_ids.push(40_001);
        a.on_report(&r2, size);
        // One burst of the two blocks' 6 packets.
        let b = 1.0 + 1.0 / (1.0 + BURST_HALF_WEIGHT) * (6.0 - 1.0);
        assert!(
            (a.burst_estimate() - b).abs() < 1e-9,
            "{}",
            a.burst_estimate()
        );
        assert!((a.loss_estimate() - 1006.0 / 1022.0 * RISE * 6.0 / 1006.0).abs() < 1e-9);
    }

    #[test]
    fn heads_get_enough_copies_for_bursts_and_none_extra_for_random_loss() {
        let mut a = Adaptation {
            loss: 0.02,
            burst: 1.0,
            ..Default::default()
        };
        assert_eq!(
            a.head_repairs(),
            0,
            "random loss: the table and one extra do"
        );
        // Bursty from a mean of 1.5, and then the rule assumes bursts of at least 2: each copy
        // after a lost one is lost with probability 1/2; 0.002 · (1/2)^r ≤ 10⁻⁴ from r = 5.
        a = at(0.002, 1.5);
        assert_eq!(a.head_repairs(), 5);
        // Bursts of 3 (4g): 0.002 · (2/3)^r ≤ 10⁻⁴ needs r = 8, capped; at 2 %, r = 14.
        assert_eq!(at(0.002, 3.0).head_repairs(), HEAD_MAX_REPAIRS);
        assert_eq!(at(0.02, 1.5).head_repairs(), HEAD_MAX_REPAIRS);
    }

    #[test]
    fn stale_reports_are_ignored() {
        let mut a = Adaptation::default();
        assert!(a.on_report(&report(5, 0, 0, 0), |_| None));
        assert!(a.on_report(&report(6, 80, 20, 20), |_| None));
        let before = a.loss_estimate();
        assert!(!a.on_report(&report(6, 80, 20, 20), |_| None));
        assert!(!a.on_report(&report(4, 0, 0, 0), |_| None));
        assert_eq!(a.loss_estimate(), before);
    }

    #[test]
    fn a_peer_receiver_that_started_over_is_followed_from_its_first_report() {
        // Well into a clean stream, the peer restarts: its reports begin again at seq 0 with
        // counters from zero. They are neither stale (ignored for 2³¹ reports) nor measured
        // against the old counters (wrapped: billions lost).
        let mut a = Adaptation::default();
        assert!(a.on_report(&report(1_000, 50_000, 0, 0), |_| None));
        assert!(a.on_report(&report(1_001, 50_100, 0, 0), |_| None));
        // Its first report waits for a second to agree; the second is the new baseline.
        assert!(!a.on_report(&report(0, 100, 0, 0), |_| None));
        assert!(a.on_report(&report(1, 200, 0, 0), |_| None));
        assert_eq!(a.loss_estimate(), 0.0);
        // 2 % loss after the restart is measured as such.
        for seq in 2..40 {
            let r = report(seq, 100 + seq * 98, seq * 2, seq * 2);
            assert!(a.on_report(&r, |_| None));
        }
        let loss = a.loss_estimate();
        assert!((0.015..0.025).contains(&loss), "{loss}");
        // The same when the restart happens within a few reports of the start (its seq
        // passes the old one soon): the counters tell.
        let mut b = Adaptation::default();
        assert!(b.on_report(&report(3, 300, 0, 0), |_| None));
        assert!(b.on_report(&report(4, 400, 0, 0), |_| None));
        assert!(!b.on_report(&report(5, 10, 0, 0), |_| None));
        assert!(b.on_report(&report(6, 110, 0, 0), |_| None));
        assert!(b.on_report(&report(7, 210, 0, 0), |_| None));
        assert_eq!(b.loss_estimate(), 0.0);
    }

    #[test]
    fn a_restarted_receiver_whose_counters_pass_the_old_ones_is_followed() {
        let mut a = Adaptation::default();
        assert!(a.on_report(&report(1_000, 50_000, 0, 0), |_| None));
        // The restarted receiver's first report: behind the old one's counters, a candidate.
        assert!(!a.on_report(&report(0, 100, 0, 0), |_| None));
        // A late report of the old receiver's, its counters behind the baseline, is no
        // second report of the new one.
        assert!(!a.on_report(&report(999, 49_900, 0, 0), |_| None));
        // Its second, after a burst of traffic, has passed the old counters but not the old
        // sequence: it agrees with the first, so it is the baseline now.
        assert!(a.on_report(&report(1, 60_000, 600, 600), |_| None));
        assert!(a.on_report(&report(2, 70_000, 1_600, 1_600), |_| None));
        assert!(
            a.loss_estimate() > 0.01,
            "the new receiver's losses are heard: {}",
            a.loss_estimate()
        );
    }

    #[test]
    fn a_replayed_old_report_does_not_reset_the_baseline() {
        let mut a = Adaptation::default();
        let old = report(10, 1_000, 0, 0);
        assert!(a.on_report(&old, |_| None));
        // 5 % loss for a while, then a long clean stretch: the estimate decays.
        let mut received = 1_000;
        let mut lost = 0;
        for seq in 11..400 {
            received += 100;
            if seq < 60 {
                lost += 5;
            }
            assert!(a.on_report(&report(seq, received, lost, lost), |_| None));
        }
        let clean = a.loss_estimate();
        // The old report replayed before each genuine one: ignored, and the genuine reports
        // are measured from their predecessors, not from the past window.
        for seq in 400..420 {
            assert!(!a.on_report(&old, |_| None));
            received += 100;
            assert!(a.on_report(&report(seq, received, lost, lost), |_| None));
        }
        assert!(
            a.loss_estimate() <= clean,
            "{} > {clean}",
            a.loss_estimate()
        );
    }
}
