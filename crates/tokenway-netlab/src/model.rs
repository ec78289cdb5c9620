//! The link model: one direction of one emulated link, with no I/O and no clock.
//!
//! A packet goes in with its arrival time (a [`Duration`] since the lab started) and its bytes;
//! a [`Verdict`] comes out: dropped (and why), or released at a time, maybe twice (duplication).
//! The same seed and the same arrivals give the same verdicts, so every behaviour is
//! unit-tested with simulated time and a run can be reproduced.
//!
//! The stages, in the order a packet meets them:
//! 1. **blackout**: a packet arriving inside a blackout period is dropped;
//! 2. **UDP blocking**: all UDP, or UDP to/from listed ports, is dropped; TCP always passes;
//! 3. **bottleneck queue**: with a rate limit, a packet waits behind the bytes already queued
//!    and is serialised at the rate; if the queue would exceed its byte bound it is tail-dropped
//!    (so a full queue shows as delay first, then loss: bufferbloat);
//! 4. **loss** on the wire: Bernoulli and/or Gilbert-Elliott (two-state burst) loss. A lost
//!    packet has still used the bottleneck;
//! 5. **delay + jitter**: one-way delay plus a uniform offset in ±jitter. Without reordering a
//!    packet is never released before the one before it (jitter stretches, never overtakes);
//! 6. **duplication**: a copy is released at the same time.
//!
//! Conditions can change over time: the timeline is a list of (time, conditions) steps;
//! bottleneck and Gilbert-Elliott state carry over a step.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::packet::{classify, Transport};

/// Which UDP traffic a direction drops.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum UdpBlock {
    /// UDP passes.
    #[default]
    None,
    /// Every UDP packet is dropped.
    All,
    /// UDP packets whose source or destination port is listed are dropped.
    Ports(Vec<u16>),
}

/// Gilbert-Elliott burst loss: a good and a bad state, switched per packet.
///
/// In the bad state a packet is lost with `loss_bad`, in the good state with `loss_good`.
/// The mean stay in the bad state is `1/r` packets; the long-run fraction of time in it is
/// `p/(p+r)`, so with `loss_bad = 1`, `loss_good = 0` the loss rate is `p/(p+r)` and the mean
/// burst length `1/r`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GilbertElliott {
    /// Probability per packet of going from good to bad.
    pub p: f64,
    /// Probability per packet of going from bad to good.
    pub r: f64,
    /// Loss probability in the bad state.
    pub loss_bad: f64,
    /// Loss probability in the good state.
    pub loss_good: f64,
}

impl GilbertElliott {
    /// Long-run loss rate of the chain.
    pub fn mean_loss(&self) -> f64 {
        if self.p + self.r == 0.0 {
            return self.loss_good;
        }
        let bad = self.p / (self.p + self.r);
        bad * self.loss_bad + (1.0 - bad) * self.loss_good
    }
}

/// The conditions of one direction at one time.
#[derive(Debug, Clone, PartialEq)]
pub struct Conditions {
    /// Fixed one-way propagation delay.
    pub delay: Duration,
    /// Each packet gets an extra delay drawn uniformly from `[-jitter, +jitter]` (the total
    /// never goes below zero).
    pub jitter: Duration,
    /// Whether jitter may reorder packets.
    pub reorder: bool,
    /// Bernoulli loss probability per packet.
    pub loss: f64,
    /// Burst loss, applied in addition to `loss`.
    pub burst_loss: Option<GilbertElliott>,
    /// Bottleneck rate in bits per second (`None`: unlimited).
    pub rate_bps: Option<u64>,
    /// Bound of the bottleneck queue in bytes (used only with a rate).
    pub queue_bytes: u64,
    /// Probability per packet of sending a duplicate.
    pub duplicate: f64,
    /// UDP blocking.
    pub udp_block: UdpBlock,
}

impl Default for Conditions {
    fn default() -> Self {
        Self {
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            reorder: false,
            loss: 0.0,
            burst_loss: None,
            rate_bps: None,
            queue_bytes: 0,
            duplicate: 0.0,
            udp_block: UdpBlock::None,
        }
    }
}

/// A period during which every packet arriving is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blackout {
    /// First start, since the lab started.
    pub start: Duration,
    /// Length of each blackout.
    pub duration: Duration,
    /// Repeat period (`None`: once).
    pub every: Option<Duration>,
}

impl Blackout {
    /// Whether `t` falls inside this blackout.
    pub fn contains(&self, t: Duration) -> bool {
        if t < self.start {
            return false;
        }
        let since = t - self.start;
        let phase = match self.every {
            Some(every) if !every.is_zero() => {
                Duration::from_nanos((since.as_nanos() % every.as_nanos()) as u64)
            }
            _ => since,
        };
        phase < self.duration
    }
}

/// A change of conditions at a time.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// When the new conditions start, since the lab started.
    pub at: Duration,
    /// The conditions from then on.
    pub conditions: Conditions,
}

/// Everything that describes one direction of a link over the lab's lifetime.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DirectionSpec {
    /// Conditions from the start.
    pub conditions: Conditions,
    /// Blackout periods.
    pub blackouts: Vec<Blackout>,
    /// Later changes of conditions, sorted by time.
    pub timeline: Vec<Step>,
}

/// Why a packet was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Arrived during a blackout.
    Blackout,
    /// UDP blocking.
    UdpBlocked,
    /// The bottleneck queue was full (tail drop).
    QueueFull,
    /// Bernoulli loss.
    RandomLoss,
    /// Gilbert-Elliott loss.
    BurstLoss,
}

impl DropReason {
    /// Every reason, for reports.
    pub const ALL: [DropReason; 5] = [
        DropReason::Blackout,
        DropReason::UdpBlocked,
        DropReason::QueueFull,
        DropReason::RandomLoss,
        DropReason::BurstLoss,
    ];

    /// Short name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::Blackout => "blackout",
            DropReason::UdpBlocked => "udp_blocked",
            DropReason::QueueFull => "queue_full",
            DropReason::RandomLoss => "random_loss",
            DropReason::BurstLoss => "burst_loss",
        }
    }
}

/// What happens to one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Dropped.
    Drop(DropReason),
    /// Released once, at this time.
    Deliver(Duration),
    /// Released twice, both at this time.
    Duplicate(Duration),
}

/// One direction of a link: feed it packets in arrival order.
#[derive(Debug)]
pub struct LinkModel {
    spec: DirectionSpec,
    current: Conditions,
    next_step: usize,
    rng: SmallRng,
    ge_bad: bool,
    /// When the bottleneck finishes serialising what is queued.
    busy_until: Duration,
    /// Release time of the previous packet (for no-reorder jitter).
    last_release: Duration,
}

impl LinkModel {
    /// A model for `spec`, deterministic for `seed`.
    pub fn new(spec: DirectionSpec, seed: u64) -> Self {
        let mut spec = spec;
        spec.timeline.sort_by_key(|s| s.at);
        Self {
            current: spec.conditions.clone(),
            spec,
            next_step: 0,
            rng: SmallRng::seed_from_u64(seed),
            ge_bad: false,
            busy_until: Duration::ZERO,
            last_release: Duration::ZERO,
        }
    }

    /// The conditions in force after the last packet seen.
    pub fn conditions(&self) -> &Conditions {
        &self.current
    }

    /// Decides the fate of `packet` arriving at `arrival`. Arrivals must not go backwards.
    pub fn on_packet(&mut self, arrival: Duration, packet: &[u8]) -> Verdict {
        while let Some(step) = self.spec.timeline.get(self.next_step) {
            if step.at > arrival {
                break;
            }
            self.current = step.conditions.clone();
            self.next_step += 1;
        }
        if self.spec.blackouts.iter().any(|b| b.contains(arrival)) {
            return Verdict::Drop(DropReason::Blackout);
        }
        if self.current.udp_block != UdpBlock::None {
            if let Transport::Udp(ports) = classify(packet).transport {
                let blocked = match (&self.current.udp_block, ports) {
                    (UdpBlock::All, _) => true,
                    (UdpBlock::Ports(list), Some((src, dst))) => {
                        list.contains(&src) || list.contains(&dst)
                    }
                    _ => false,
                };
                if blocked {
                    return Verdict::Drop(DropReason::UdpBlocked);
                }
            }
        }
        let c = &self.current;
        let mut sent = arrival;
        if let Some(rate) = c.rate_bps.filter(|r| *r > 0) {
            let backlog_ns = self.busy_until.saturating_sub(arrival).as_nanos();
            let backlog_bytes = backlog_ns * u128::from(rate) / 8 / 1_000_000_000;
            if backlog_bytes + packet.len() as u128 > u128::from(c.queue_bytes) {
                return Verdict::Drop(DropReason::QueueFull);
            }
            let serialise_ns = packet.len() as u128 * 8 * 1_000_000_000 / u128::from(rate);
            self.busy_until =
                self.busy_until.max(arrival) + Duration::from_nanos(serialise_ns as u64);
            sent = self.busy_until;
        }
        if let Some(ge) = c.burst_loss {
            let lose = if self.ge_bad {
                ge.loss_bad
            } else {
                ge.loss_good
            };
            let lost = lose > 0.0 && self.rng.random::<f64>() < lose;
            let flip = if self.ge_bad { ge.r } else { ge.p };
            if self.rng.random::<f64>() < flip {
                self.ge_bad = !self.ge_bad;
            }
            if lost {
                return Verdict::Drop(DropReason::BurstLoss);
            }
        }
        if c.loss > 0.0 && self.rng.random::<f64>() < c.loss {
            return Verdict::Drop(DropReason::RandomLoss);
        }
        let mut release = sent + c.delay;
        if !c.jitter.is_zero() {
            let j = c.jitter.as_nanos() as i128;
            let offset = self.rng.random_range(-j..=j);
            let ns = (release.as_nanos() as i128 + offset).max(sent.as_nanos() as i128);
            release = Duration::from_nanos(ns as u64);
        }
        if !c.reorder {
            release = release.max(self.last_release);
        }
        self.last_release = self.last_release.max(release);
        if c.duplicate > 0.0 && self.rng.random::<f64>() < c.duplicate {
            Verdict::Duplicate(release)
        } else {
            Verdict::Deliver(release)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::tests::ipv4;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1000.0)
    }

    fn model(c: Conditions, seed: u64) -> LinkModel {
        LinkModel::new(
            DirectionSpec {
                conditions: c,
                ..Default::default()
            },
            seed,
        )
    }

    /// Feeds `n` UDP packets of `len` bytes every `gap` and returns the verdicts.
    fn run(m: &mut LinkModel, n: usize, gap: Duration, len: usize) -> Vec<(Duration, Verdict)> {
        let p = ipv4(17, 1000, 2000, len);
        (0..n)
            .map(|i| {
                let t = gap * i as u32;
                (t, m.on_packet(t, &p))
            })
            .collect()
    }

    fn loss_fraction(v: &[(Duration, Verdict)]) -> f64 {
        v.iter()
            .filter(|(_, v)| matches!(v, Verdict::Drop(_)))
            .count() as f64
            / v.len() as f64
    }

    #[test]
    fn fixed_delay_releases_every_packet_exactly_that_late() {
        let mut m = model(
            Conditions {
                delay: ms(20.0),
                ..Default::default()
            },
            1,
        );
        for (t, v) in run(&mut m, 1000, ms(0.1), 100) {
            assert_eq!(v, Verdict::Deliver(t + ms(20.0)));
        }
    }

    #[test]
    fn jitter_stays_within_its_bounds_and_keeps_the_mean() {
        let mut m = model(
            Conditions {
                delay: ms(30.0),
                jitter: ms(5.0),
                reorder: true,
                ..Default::default()
            },
            2,
        );
        let mut sum = 0.0;
        let out = run(&mut m, 20_000, ms(1.0), 100);
        for (t, v) in &out {
            let Verdict::Deliver(r) = v else {
                panic!("no loss configured")
            };
            let d = (*r - *t).as_secs_f64() * 1000.0;
            assert!((25.0..=35.0).contains(&d), "delay {d} ms out of 30±5");
            sum += d;
        }
        let mean = sum / out.len() as f64;
        assert!((mean - 30.0).abs() < 0.1, "mean {mean}");
    }

    #[test]
    fn jitter_without_reordering_never_releases_before_the_previous_packet() {
        let mut m = model(
            Conditions {
                delay: ms(10.0),
                jitter: ms(5.0),
                reorder: false,
                ..Default::default()
            },
            3,
        );
        let mut last = Duration::ZERO;
        for (t, v) in run(&mut m, 10_000, ms(0.05), 100) {
            let Verdict::Deliver(r) = v else { panic!() };
            assert!(r >= last);
            assert!(r >= t + ms(5.0));
            last = r;
        }
    }

    #[test]
    fn jitter_with_reordering_does_reorder() {
        let mut m = model(
            Conditions {
                delay: ms(10.0),
                jitter: ms(5.0),
                reorder: true,
                ..Default::default()
            },
            4,
        );
        let out = run(&mut m, 1000, ms(0.05), 100);
        let reordered = out
            .windows(2)
            .filter(|w| match (w[0].1, w[1].1) {
                (Verdict::Deliver(a), Verdict::Deliver(b)) => b < a,
                _ => false,
            })
            .count();
        assert!(reordered > 100, "only {reordered} reorderings");
    }

    #[test]
    fn bernoulli_loss_rate_is_within_statistical_tolerance() {
        for (loss, seed) in [(0.01, 5), (0.05, 6), (0.10, 7), (0.5, 8)] {
            let mut m = model(
                Conditions {
                    loss,
                    ..Default::default()
                },
                seed,
            );
            let n = 100_000;
            let f = loss_fraction(&run(&mut m, n, ms(0.01), 100));
            // 5 standard deviations of a binomial proportion.
            let tol = 5.0 * (loss * (1.0 - loss) / n as f64).sqrt();
            assert!((f - loss).abs() < tol, "loss {loss}: measured {f}");
        }
    }

    #[test]
    fn gilbert_elliott_gives_its_mean_loss_and_burst_length() {
        let ge = GilbertElliott {
            p: 0.01,
            r: 0.25,
            loss_bad: 1.0,
            loss_good: 0.0,
        };
        let mut m = model(
            Conditions {
                burst_loss: Some(ge),
                ..Default::default()
            },
            9,
        );
        let out = run(&mut m, 400_000, ms(0.01), 100);
        let f = loss_fraction(&out);
        assert!((f - ge.mean_loss()).abs() < 0.004, "loss {f}");
        let mut bursts = Vec::new();
        let mut current = 0usize;
        for (_, v) in &out {
            if matches!(v, Verdict::Drop(DropReason::BurstLoss)) {
                current += 1;
            } else if current > 0 {
                bursts.push(current);
                current = 0;
            }
        }
        let mean = bursts.iter().sum::<usize>() as f64 / bursts.len() as f64;
        assert!((mean - 4.0).abs() < 0.2, "mean burst {mean}, want 1/r = 4");
    }

    #[test]
    fn rate_limit_spaces_packets_at_the_rate() {
        // 1500-byte packets at 12 Mbit/s: one per millisecond.
        let mut m = model(
            Conditions {
                rate_bps: Some(12_000_000),
                queue_bytes: 1_000_000,
                ..Default::default()
            },
            10,
        );
        let out = run(&mut m, 100, Duration::ZERO, 1500);
        for (i, (_, v)) in out.iter().enumerate() {
            assert_eq!(*v, Verdict::Deliver(ms(i as f64 + 1.0)));
        }
    }

    #[test]
    fn full_queue_tail_drops_and_delay_grows_first() {
        // 10 Mbit/s, 15 kB queue, offered 20 Mbit/s: half the packets go once the queue is full.
        let mut m = model(
            Conditions {
                rate_bps: Some(10_000_000),
                queue_bytes: 15_000,
                ..Default::default()
            },
            11,
        );
        let out = run(&mut m, 10_000, Duration::from_micros(600), 1500);
        let queue_drops = out
            .iter()
            .filter(|(_, v)| *v == Verdict::Drop(DropReason::QueueFull))
            .count();
        let f = queue_drops as f64 / out.len() as f64;
        assert!((f - 0.5).abs() < 0.02, "queue drops {f}");
        assert!(out[..10]
            .iter()
            .all(|(_, v)| matches!(v, Verdict::Deliver(_))));
        // The standing queue adds about 15 kB / 10 Mbit/s = 12 ms of delay.
        let last_delay = out
            .iter()
            .rev()
            .find_map(|(t, v)| match v {
                Verdict::Deliver(r) => Some(*r - *t),
                _ => None,
            })
            .expect("some packets pass");
        assert!(last_delay > ms(10.0), "queueing delay {last_delay:?}");
    }

    #[test]
    fn duplication_rate_is_within_tolerance() {
        let mut m = model(
            Conditions {
                duplicate: 0.2,
                ..Default::default()
            },
            12,
        );
        let out = run(&mut m, 50_000, ms(0.01), 100);
        let d = out
            .iter()
            .filter(|(_, v)| matches!(v, Verdict::Duplicate(_)))
            .count() as f64
            / out.len() as f64;
        assert!((d - 0.2).abs() < 0.01, "dup {d}");
    }

    #[test]
    fn udp_blocking_drops_udp_and_passes_tcp() {
        let mut all = model(
            Conditions {
                udp_block: UdpBlock::All,
                ..Default::default()
            },
            13,
        );
        assert_eq!(
            all.on_packet(Duration::ZERO, &ipv4(17, 1, 2, 50)),
            Verdict::Drop(DropReason::UdpBlocked)
        );
        assert!(matches!(
            all.on_packet(Duration::ZERO, &ipv4(6, 1, 2, 50)),
            Verdict::Deliver(_)
        ));
        let mut some = model(
            Conditions {
                udp_block: UdpBlock::Ports(vec![443]),
                ..Default::default()
            },
            14,
        );
        assert_eq!(
            some.on_packet(Duration::ZERO, &ipv4(17, 5000, 443, 50)),
            Verdict::Drop(DropReason::UdpBlocked)
        );
        assert_eq!(
            some.on_packet(Duration::ZERO, &ipv4(17, 443, 5000, 50)),
            Verdict::Drop(DropReason::UdpBlocked)
        );
        assert!(matches!(
            some.on_packet(Duration::ZERO, &ipv4(17, 5000, 53, 50)),
            Verdict::Deliver(_)
        ));
    }

    #[test]
    fn periodic_blackouts_drop_exactly_inside_their_windows() {
        let mut m = LinkModel::new(
            DirectionSpec {
                blackouts: vec![Blackout {
                    start: ms(100.0),
                    duration: ms(30.0),
                    every: Some(ms(200.0)),
                }],
                ..Default::default()
            },
            15,
        );
        for (t, v) in run(&mut m, 1000, ms(1.0), 100) {
            let phase = (t.as_secs_f64() * 1000.0).round() as u64;
            let inside = phase >= 100 && (phase - 100) % 200 < 30;
            assert_eq!(
                matches!(v, Verdict::Drop(DropReason::Blackout)),
                inside,
                "{t:?}"
            );
        }
    }

    #[test]
    fn timeline_switches_conditions_at_its_steps() {
        let mut m = LinkModel::new(
            DirectionSpec {
                conditions: Conditions {
                    delay: ms(10.0),
                    ..Default::default()
                },
                timeline: vec![Step {
                    at: ms(50.0),
                    conditions: Conditions {
                        delay: ms(100.0),
                        ..Default::default()
                    },
                }],
                ..Default::default()
            },
            16,
        );
        let p = ipv4(17, 1, 2, 100);
        assert_eq!(m.on_packet(ms(49.0), &p), Verdict::Deliver(ms(59.0)));
        assert_eq!(m.on_packet(ms(50.0), &p), Verdict::Deliver(ms(150.0)));
    }

    #[test]
    fn same_seed_gives_same_verdicts_and_another_seed_does_not() {
        let c = Conditions {
            delay: ms(35.0),
            jitter: ms(15.0),
            loss: 0.05,
            burst_loss: Some(GilbertElliott {
                p: 0.01,
                r: 0.3,
                loss_bad: 0.8,
                loss_good: 0.001,
            }),
            rate_bps: Some(20_000_000),
            queue_bytes: 50_000,
            duplicate: 0.01,
            ..Default::default()
        };
        let a = run(&mut model(c.clone(), 42), 5000, ms(0.3), 1200);
        let b = run(&mut model(c.clone(), 42), 5000, ms(0.3), 1200);
        let other = run(&mut model(c, 43), 5000, ms(0.3), 1200);
        assert_eq!(a, b);
        assert_ne!(a, other);
    }
}
