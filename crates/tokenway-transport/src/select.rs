//! Gateway selection: the reachable gateway with the lowest smoothed RTT, sticky.
//!
//! Sans-IO: time is a parameter. The current gateway is kept between re-evaluations (every
//! `reevaluate`), and even then it is replaced only when another one is clearly better
//! (its smoothed RTT below [`HYSTERESIS`] of the current one's and at least [`MIN_GAIN`] lower),
//! so two gateways at similar distance do not make requests flap between them. A gateway that
//! goes down is left at once.

use std::time::{Duration, Instant};

/// A candidate must have at most this fraction of the current gateway's smoothed RTT.
pub const HYSTERESIS: f64 = 0.8;
/// ... and be at least this much faster.
pub const MIN_GAIN: Duration = Duration::from_micros(500);
/// EWMA weight of a new RTT sample (RFC 6298's α = 1/8).
const ALPHA: f64 = 0.125;

#[derive(Clone, Copy, Debug, Default)]
struct Gateway {
    srtt: Option<Duration>,
    up: bool,
}

/// The selection state over `n` gateways, indexed as configured.
#[derive(Debug)]
pub struct Selector {
    gateways: Vec<Gateway>,
    current: Option<usize>,
    evaluated_at: Option<Instant>,
    reevaluate: Duration,
}

impl Selector {
    /// A selector over `n` gateways, all down and unmeasured.
    pub fn new(n: usize, reevaluate: Duration) -> Self {
        Self {
            gateways: vec![Gateway::default(); n],
            current: None,
            evaluated_at: None,
            reevaluate,
        }
    }

    /// Records an RTT sample of gateway `i`.
    pub fn observe_rtt(&mut self, i: usize, rtt: Duration) {
        if let Some(g) = self.gateways.get_mut(i) {
            g.srtt = Some(match g.srtt {
                None => rtt,
                Some(s) => s.mul_f64(1.0 - ALPHA) + rtt.mul_f64(ALPHA),
            });
        }
    }

    /// Marks gateway `i` reachable (it has a live connection) or not.
    pub fn set_up(&mut self, i: usize, up: bool) {
        if let Some(g) = self.gateways.get_mut(i) {
            g.up = up;
        }
        if !up && self.current == Some(i) {
            self.current = None;
        }
    }

    /// Whether any gateway is reachable.
    pub fn any_up(&self) -> bool {
        self.gateways.iter().any(|g| g.up)
    }

    /// The smoothed RTT of gateway `i`.
    pub fn srtt(&self, i: usize) -> Option<Duration> {
        self.gateways.get(i).and_then(|g| g.srtt)
    }

    /// The gateway to use now. With gateways to `avoid` (a retry after failures or refusals
    /// there) the best other reachable gateway is returned, without moving the sticky choice.
    pub fn pick(&mut self, now: Instant, avoid: &[usize]) -> Option<usize> {
        let best = |avoid: &[usize]| {
            self.gateways
                .iter()
                .enumerate()
                .filter(|(i, g)| g.up && !avoid.contains(i))
                .min_by_key(|(i, g)| (g.srtt.unwrap_or(Duration::MAX), *i))
                .map(|(i, _)| i)
        };
        if !avoid.is_empty() {
            return best(avoid);
        }
        let best = best(&[]);
        let current = self.current.filter(|&c| self.gateways[c].up);
        let due = self
            .evaluated_at
            .is_none_or(|t| now.saturating_duration_since(t) >= self.reevaluate);
        let chosen = match (current, best) {
            (Some(c), _) if !due => Some(c),
            (Some(c), Some(b)) => match (self.gateways[c].srtt, self.gateways[b].srtt) {
                (Some(cs), Some(bs))
                    if bs.as_secs_f64() < cs.as_secs_f64() * HYSTERESIS
                        && cs.saturating_sub(bs) >= MIN_GAIN =>
                {
                    Some(b)
                }
                (None, Some(_)) => Some(b),
                _ => Some(c),
            },
            (c, b) => c.or(b),
        };
        if chosen != current || due {
            self.evaluated_at = Some(now);
        }
        self.current = chosen;
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn two(now: Instant) -> Selector {
        let mut s = Selector::new(2, Duration::from_secs(10));
        s.set_up(0, true);
        s.set_up(1, true);
        s.observe_rtt(0, 40 * MS);
        s.observe_rtt(1, 10 * MS);
        let _ = now;
        s
    }

    #[test]
    fn picks_the_lowest_rtt_and_sticks_until_reevaluation() {
        let t0 = Instant::now();
        let mut s = two(t0);
        assert_eq!(s.pick(t0, &[]), Some(1));
        // Gateway 0 becomes much faster, but the choice is sticky until re-evaluation.
        for _ in 0..40 {
            s.observe_rtt(0, MS);
            s.observe_rtt(1, 10 * MS);
        }
        assert_eq!(s.pick(t0 + Duration::from_secs(5), &[]), Some(1));
        assert_eq!(s.pick(t0 + Duration::from_secs(10), &[]), Some(0));
    }

    #[test]
    fn a_slightly_better_gateway_does_not_take_over() {
        let t0 = Instant::now();
        let mut s = two(t0);
        assert_eq!(s.pick(t0, &[]), Some(1));
        for _ in 0..40 {
            s.observe_rtt(0, 9 * MS);
        }
        assert_eq!(s.pick(t0 + Duration::from_secs(11), &[]), Some(1));
    }

    #[test]
    fn fails_over_at_once_when_the_current_gateway_goes_down() {
        let t0 = Instant::now();
        let mut s = two(t0);
        assert_eq!(s.pick(t0, &[]), Some(1));
        s.set_up(1, false);
        assert_eq!(s.pick(t0 + MS, &[]), Some(0));
        s.set_up(0, false);
        assert_eq!(s.pick(t0 + 2 * MS, &[]), None);
    }

    #[test]
    fn a_retry_avoids_the_failed_gateway_without_moving_the_sticky_choice() {
        let t0 = Instant::now();
        let mut s = two(t0);
        assert_eq!(s.pick(t0, &[]), Some(1));
        assert_eq!(s.pick(t0 + MS, &[1]), Some(0));
        assert_eq!(s.pick(t0 + 2 * MS, &[]), Some(1));
        // Two avoided of three: the third, however far.
        let mut three = Selector::new(3, Duration::from_secs(10));
        for i in 0..3 {
            three.set_up(i, true);
        }
        assert_eq!(three.pick(t0, &[0, 1]), Some(2));
        assert_eq!(three.pick(t0, &[1, 0, 2]), None);
        let mut one = Selector::new(1, Duration::from_secs(10));
        one.set_up(0, true);
        assert_eq!(one.pick(t0, &[0]), None);
    }
}
