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

use crate::loss_report::LossReport;
use crate::packet::MAX_BLOCK_REPAIRS;

/// Weight of a sample above the estimate.
const RISE: f64 = 0.5;
/// Weight of a sample below the estimate.
const DECAY: f64 = 0.125;
/// A report covering this many packets moves the estimate half as far as a large one: a token
/// stream's reports cover a handful of packets each, and one loss in five is not a 20 % loss
/// rate. The weight of a sample of `n` packets is `n / (n + REPORT_HALF_WEIGHT)` times
/// [`RISE`] or [`DECAY`].
const REPORT_HALF_WEIGHT: f64 = 16.0;
/// Loss rates below this are treated as no loss (keeps the decay from lingering forever).
const LOSS_FLOOR: f64 = 1e-4;

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
    last: Option<LossReport>,
}

impl Adaptation {
    /// Feeds one loss report. Returns `false` (and changes nothing) for a report that is not
    /// newer than the last one (reordered or replayed). The first report only sets the
    /// baseline, since its counters cover an unknown period.
    pub fn on_report(&mut self, report: &LossReport) -> bool {
        let Some(prev) = self.last else {
            self.last = Some(*report);
            return true;
        };
        if !report.is_newer_than(&prev) {
            return false;
        }
        self.last = Some(*report);
        let sample = report.since(&prev);
        if let Some(p) = sample.loss_rate() {
            let n = f64::from(sample.received) + f64::from(sample.lost);
            let weight = n / (n + REPORT_HALF_WEIGHT);
            self.loss = blend(self.loss, p, weight);
            if self.loss < LOSS_FLOOR {
                self.loss = 0.0;
            }
            let b = sample.mean_burst().unwrap_or(1.0);
            self.burst = blend(self.burst.max(1.0), b, weight);
        }
        true
    }

    /// The estimated loss rate (0 until a report shows loss).
    pub fn loss_estimate(&self) -> f64 {
        self.loss
    }

    /// The estimated mean loss-burst length (at least 1).
    pub fn burst_estimate(&self) -> f64 {
        self.burst.max(1.0)
    }

    /// Repair packets for a block of `k` source packets: the table, raised by the estimates.
    pub fn repairs_for(&self, k: usize) -> usize {
        table_repairs(k.max(1))
            .max(self.needed(k))
            .min(2 * k.max(1) + 1)
            .min(MAX_BLOCK_REPAIRS)
    }

    /// Repair packets for a *sparse* block of `k` packets (a few packets of a token stream,
    /// grouped over a fraction of the RTT): `1 + ⌊k·p·b⌋`, one XOR parity until a block expects
    /// a whole lost packet of its own, without the table's floor. The table gives small blocks a
    /// duplicate per packet; a token stream would then pay 50–100 % overhead, and one repair per
    /// few tokens restores all single losses. Not the `2·√` margin of ordinary blocks: with it a
    /// block of 3 gets a second repair once the estimate passes 0.057, and netlab runs measured
    /// repair bytes pinned at the 0.5 cap (docs/datagram-layer.md, "Token streams: the
    /// arithmetic", for why one repair per block is what a 30 % overhead target allows).
    pub fn sparse_repairs_for(&self, k: usize) -> usize {
        let expected = k.max(1) as f64 * self.loss * self.burst_estimate();
        (1 + expected.floor() as usize)
            .min(2 * k.max(1) + 1)
            .min(MAX_BLOCK_REPAIRS)
    }

    /// `⌈k·p + 2·√(k·p·b)⌉`: expected losses plus two standard deviations.
    fn needed(&self, k: usize) -> usize {
        let kp = k.max(1) as f64 * self.loss;
        (kp + 2.0 * (kp * self.burst_estimate()).sqrt()).ceil() as usize
    }
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

    #[test]
    fn sparse_blocks_get_one_repair_until_a_whole_loss_is_expected() {
        let mut a = Adaptation::default();
        assert_eq!(a.sparse_repairs_for(3), 1);
        // A noisy estimate at 15 %: still one repair for a block of 3.
        a.on_report(&report(1, 0, 0, 0));
        a.on_report(&report(2, 85, 15, 15));
        // Half-way, weighted by the 100 packets the report covers.
        assert!((a.loss_estimate() - 0.15 * 0.5 * 100.0 / 116.0).abs() < 1e-9);
        a.on_report(&report(3, 170, 45, 45));
        assert!(a.loss_estimate() > 0.14, "{}", a.loss_estimate());
        assert_eq!(a.sparse_repairs_for(3), 1);
        assert!(a.repairs_for(3) >= 2, "ordinary blocks keep their margin");
        // Heavy loss: two.
        a.on_report(&report(4, 220, 195, 195));
        assert_eq!(a.sparse_repairs_for(3), 2, "{}", a.loss_estimate());
    }

    #[test]
    fn a_report_of_a_few_packets_moves_the_estimate_less_than_a_large_one() {
        // One loss in five packets (a token stream's report) against 200 in 1000.
        let mut small = Adaptation::default();
        small.on_report(&report(1, 0, 0, 0));
        small.on_report(&report(2, 4, 1, 1));
        let mut large = Adaptation::default();
        large.on_report(&report(1, 0, 0, 0));
        large.on_report(&report(2, 800, 200, 200));
        assert!((small.loss_estimate() - 0.2 * 0.5 * 5.0 / 21.0).abs() < 1e-9);
        assert!(large.loss_estimate() > 0.09, "{}", large.loss_estimate());
        assert!(small.loss_estimate() < 0.3 * large.loss_estimate());
    }

    #[test]
    fn stale_reports_are_ignored() {
        let mut a = Adaptation::default();
        assert!(a.on_report(&report(5, 0, 0, 0)));
        assert!(a.on_report(&report(6, 80, 20, 20)));
        let before = a.loss_estimate();
        assert!(!a.on_report(&report(6, 80, 20, 20)));
        assert!(!a.on_report(&report(4, 0, 0, 0)));
        assert_eq!(a.loss_estimate(), before);
    }
}
