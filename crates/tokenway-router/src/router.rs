//! The [`Router`]: backends, events in, ranked backends out.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::backend::{normalize, BackendId, BackendSpec, BackendState, BackendView};
use crate::error::RouteError;
use crate::health::{HealthConfig, HealthTransition, Outcome};
use crate::policy::{Candidate, Policy, Selector};

/// TTFT assumed for a backend before its first sample, so new backends get traffic (and hence
/// samples) without being preferred over every measured one.
pub const DEFAULT_TTFT_ESTIMATE: Duration = Duration::from_millis(100);

/// Sans-IO router over a set of backends. See the [crate docs](crate).
#[derive(Debug, Clone)]
pub struct Router {
    policy: Policy,
    health: HealthConfig,
    default_ttft: Duration,
    backends: Vec<BackendState>,
    selector: Selector,
}

impl Router {
    /// A router with no backends. `seed` seeds the random choices of `p2c_ewma`.
    pub fn new(policy: Policy, health: HealthConfig, seed: u64) -> Self {
        Self {
            policy,
            health,
            default_ttft: DEFAULT_TTFT_ESTIMATE,
            backends: Vec::new(),
            selector: Selector::new(seed),
        }
    }

    /// Replace the TTFT assumed for backends without samples (default
    /// [`DEFAULT_TTFT_ESTIMATE`]).
    pub fn with_default_ttft(mut self, ttft: Duration) -> Self {
        self.default_ttft = ttft;
        self
    }

    /// The policy in use.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The health thresholds in use.
    pub fn health_config(&self) -> &HealthConfig {
        &self.health
    }

    /// Add a backend; it starts healthy and idle. Ids are dense: the n-th backend added gets
    /// `BackendId(n)`.
    pub fn add_backend(&mut self, spec: BackendSpec) -> BackendId {
        self.backends.push(BackendState::new(spec));
        BackendId(self.backends.len() - 1)
    }

    /// Number of backends added.
    pub fn len(&self) -> usize {
        self.backends.len()
    }

    /// Whether no backend was added.
    pub fn is_empty(&self) -> bool {
        self.backends.is_empty()
    }

    /// Replace the models a backend serves (learned from its `/v1/models`). Unknown ids are
    /// ignored.
    pub fn set_models(&mut self, id: BackendId, mut models: Vec<String>) {
        if let Some(b) = self.backends.get_mut(id.0) {
            normalize(&mut models);
            b.spec.models = models;
        }
    }

    /// Rank the backends for a request for `model` at `now`: the first is the one to use, the
    /// rest (all other eligible backends, no duplicates) are the order for retries and hedges.
    ///
    /// Eligible means: serves `model`, not ejected, and below its `max_inflight`.
    ///
    /// # Errors
    ///
    /// [`RouteError::UnknownModel`] if no backend serves `model`,
    /// [`RouteError::NoHealthyBackend`] if all that serve it are ejected,
    /// [`RouteError::Saturated`] if all healthy ones that serve it are full.
    pub fn rank(&mut self, model: &str, _now: Instant) -> Result<Vec<BackendId>, RouteError> {
        let (mut serving, mut healthy) = (false, false);
        let mut cands = Vec::with_capacity(self.backends.len());
        for (i, b) in self.backends.iter().enumerate() {
            if !b.serves(model) {
                continue;
            }
            serving = true;
            if !b.health.is_healthy() {
                continue;
            }
            healthy = true;
            if !b.has_headroom() {
                continue;
            }
            cands.push(Candidate {
                id: BackendId(i),
                inflight: b.inflight,
                cost: b.ttft.secs_or(self.default_ttft) * (f64::from(b.inflight) + 1.0),
            });
        }
        if cands.is_empty() {
            let model = model.to_owned();
            return Err(if !serving {
                RouteError::UnknownModel { model }
            } else if !healthy {
                RouteError::NoHealthyBackend { model }
            } else {
                RouteError::Saturated { model }
            });
        }
        self.selector
            .order(self.policy, &mut cands, self.backends.len());
        Ok(cands.into_iter().map(|c| c.id).collect())
    }

    /// An attempt was sent to `id`: one more in flight.
    pub fn on_attempt_start(&mut self, id: BackendId, _now: Instant) {
        if let Some(b) = self.backends.get_mut(id.0) {
            b.inflight = b.inflight.saturating_add(1);
        }
    }

    /// The first response byte of an attempt on `id` arrived `ttft` after it was sent.
    pub fn on_first_byte(&mut self, id: BackendId, ttft: Duration, now: Instant) {
        if let Some(b) = self.backends.get_mut(id.0) {
            b.ttft.observe(ttft, now);
        }
    }

    /// An attempt on `id` ended: one fewer in flight, and passive health sees the outcome.
    /// Returns the health transition it caused, if any.
    pub fn on_attempt_end(
        &mut self,
        id: BackendId,
        outcome: Outcome,
        now: Instant,
    ) -> Option<HealthTransition> {
        let b = self.backends.get_mut(id.0)?;
        b.inflight = b.inflight.saturating_sub(1);
        b.health.on_outcome(outcome, now, &self.health)
    }

    /// An active probe of `id` finished. Returns the health transition it caused, if any.
    pub fn on_probe(&mut self, id: BackendId, ok: bool, now: Instant) -> Option<HealthTransition> {
        let b = self.backends.get_mut(id.0)?;
        b.health.on_probe(ok, now, &self.health)
    }

    /// A snapshot of one backend, `None` for an unknown id.
    pub fn backend(&self, id: BackendId) -> Option<BackendView<'_>> {
        self.backends.get(id.0).map(|b| b.view(id))
    }

    /// Snapshots of every backend, in id order, for metrics and status.
    pub fn backends(&self) -> impl Iterator<Item = (BackendId, BackendView<'_>)> + '_ {
        self.backends.iter().enumerate().map(|(i, b)| {
            let id = BackendId(i);
            (id, b.view(id))
        })
    }

    /// Whether any backend (healthy or not) serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        self.backends.iter().any(|b| b.serves(model))
    }

    /// Every model some backend serves, sorted, without duplicates (for `/v1/models`).
    pub fn models(&self) -> Vec<String> {
        let set: BTreeSet<&str> = self
            .backends
            .iter()
            .flat_map(|b| b.spec.models.iter().map(String::as_str))
            .collect();
        set.into_iter().map(str::to_owned).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::EjectReason;
    use proptest::prelude::*;

    const M: &str = "llama-3-8b";

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn spec(name: &str, models: &[&str], max_inflight: u32) -> BackendSpec {
        BackendSpec {
            name: name.to_owned(),
            region: "eu".to_owned(),
            models: models.iter().map(|m| (*m).to_owned()).collect(),
            max_inflight,
        }
    }

    fn router(policy: Policy, n: usize) -> Router {
        let mut r = Router::new(policy, HealthConfig::default(), 7);
        for i in 0..n {
            r.add_backend(spec(&format!("b{i}"), &[M], 8));
        }
        r
    }

    fn ids(v: &[usize]) -> Vec<BackendId> {
        v.iter().map(|&i| BackendId(i)).collect()
    }

    #[test]
    fn round_robin_rotates_over_healthy_backends() {
        let t0 = Instant::now();
        let mut r = router(Policy::RoundRobin, 3);
        assert_eq!(r.rank(M, t0), Ok(ids(&[0, 1, 2])));
        assert_eq!(r.rank(M, t0), Ok(ids(&[1, 2, 0])));
        r.on_attempt_end(BackendId(2), Outcome::ConnectError, t0);
        assert_eq!(r.rank(M, t0), Ok(ids(&[0, 1])));
        assert_eq!(r.rank(M, t0), Ok(ids(&[1, 0])));
        assert_eq!(r.rank(M, t0), Ok(ids(&[0, 1])));
    }

    #[test]
    fn least_inflight_prefers_idle_backend() {
        let t0 = Instant::now();
        let mut r = router(Policy::LeastInflight, 3);
        r.on_attempt_start(BackendId(0), t0);
        r.on_attempt_start(BackendId(0), t0);
        r.on_attempt_start(BackendId(1), t0);
        assert_eq!(r.rank(M, t0), Ok(ids(&[2, 1, 0])));
    }

    #[test]
    fn least_inflight_breaks_ties_by_rotation() {
        let t0 = Instant::now();
        let mut r = router(Policy::LeastInflight, 3);
        let firsts: Vec<BackendId> = (0..6)
            .map(|_| r.rank(M, t0).expect("eligible backends")[0])
            .collect();
        assert_eq!(firsts, ids(&[0, 1, 2, 0, 1, 2]));
    }

    #[test]
    fn p2c_prefers_lower_ewma_ttft() {
        let t0 = Instant::now();
        let mut r = router(Policy::P2cEwma, 2);
        r.on_first_byte(BackendId(0), ms(50), t0);
        r.on_first_byte(BackendId(1), ms(500), t0);
        // With two backends both are always drawn, so the cheaper one always wins.
        for _ in 0..50 {
            assert_eq!(r.rank(M, t0), Ok(ids(&[0, 1])));
        }
    }

    #[test]
    fn p2c_cost_grows_with_inflight() {
        let t0 = Instant::now();
        let mut r = router(Policy::P2cEwma, 2);
        r.on_first_byte(BackendId(0), ms(100), t0);
        r.on_first_byte(BackendId(1), ms(200), t0);
        for _ in 0..3 {
            r.on_attempt_start(BackendId(0), t0);
        }
        // 100 ms × 4 in flight beats 200 ms × 1.
        assert_eq!(r.rank(M, t0), Ok(ids(&[1, 0])));
    }

    #[test]
    fn p2c_never_picks_the_most_expensive_of_many_and_spreads_the_rest() {
        let t0 = Instant::now();
        let mut r = router(Policy::P2cEwma, 4);
        for (i, t) in [100, 100, 100, 900].into_iter().enumerate() {
            r.on_first_byte(BackendId(i), ms(t), t0);
        }
        let mut firsts = [0u32; 4];
        for _ in 0..400 {
            let ranked = r.rank(M, t0).expect("eligible backends");
            assert_eq!(ranked.len(), 4);
            firsts[ranked[0].0] += 1;
        }
        assert_eq!(firsts[3], 0);
        assert!(firsts[..3].iter().all(|&n| n > 50), "{firsts:?}");
    }

    #[test]
    fn p2c_decisions_replay_from_the_seed() {
        let t0 = Instant::now();
        let run = || {
            let mut r = router(Policy::P2cEwma, 5);
            (0..20)
                .map(|_| r.rank(M, t0).expect("eligible backends"))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn first_byte_feeds_peak_ewma_visible_in_view() {
        let t0 = Instant::now();
        let mut r = router(Policy::P2cEwma, 1);
        assert_eq!(r.backend(BackendId(0)).map(|v| v.ewma_ttft), Some(None));
        r.on_first_byte(BackendId(0), ms(300), t0);
        r.on_first_byte(BackendId(0), ms(900), t0 + ms(5));
        assert_eq!(
            r.backend(BackendId(0)).and_then(|v| v.ewma_ttft),
            Some(ms(900))
        );
    }

    #[test]
    fn rank_never_includes_ejected_or_full_backends() {
        let t0 = Instant::now();
        for policy in Policy::ALL {
            let mut r = Router::new(policy, HealthConfig::default(), 1);
            let full = r.add_backend(spec("full", &[M], 1));
            let down = r.add_backend(spec("down", &[M], 8));
            let ok = r.add_backend(spec("ok", &[M], 8));
            r.on_attempt_start(full, t0);
            for k in 0..3 {
                r.on_probe(down, false, t0 + ms(1000 * k));
            }
            assert_eq!(r.rank(M, t0 + ms(3000)), Ok(vec![ok]), "{policy}");
            r.on_attempt_end(full, Outcome::Success, t0 + ms(3000));
            let ranked = r.rank(M, t0 + ms(3000)).expect("eligible backends");
            assert_eq!(ranked.len(), 2);
            assert!(!ranked.contains(&down));
        }
    }

    #[test]
    fn unknown_model_vs_no_healthy_backend() {
        let t0 = Instant::now();
        let mut r = router(Policy::RoundRobin, 1);
        assert_eq!(
            r.rank("gpt-9", t0),
            Err(RouteError::UnknownModel {
                model: "gpt-9".into()
            })
        );
        r.on_attempt_end(BackendId(0), Outcome::ConnectError, t0);
        assert_eq!(
            r.rank(M, t0),
            Err(RouteError::NoHealthyBackend { model: M.into() })
        );
    }

    #[test]
    fn all_healthy_backends_full_is_saturated() {
        let t0 = Instant::now();
        let mut r = Router::new(Policy::LeastInflight, HealthConfig::default(), 0);
        let a = r.add_backend(spec("a", &[M], 1));
        let b = r.add_backend(spec("b", &[M], 8));
        r.on_attempt_start(a, t0);
        r.on_attempt_end(b, Outcome::ConnectError, t0);
        assert_eq!(
            r.rank(M, t0),
            Err(RouteError::Saturated { model: M.into() })
        );
    }

    #[test]
    fn zero_max_inflight_means_no_limit() {
        let t0 = Instant::now();
        let mut r = Router::new(Policy::RoundRobin, HealthConfig::default(), 0);
        let a = r.add_backend(spec("a", &[M], 0));
        for _ in 0..1000 {
            r.on_attempt_start(a, t0);
        }
        assert_eq!(r.rank(M, t0), Ok(vec![a]));
    }

    #[test]
    fn backend_with_no_models_serves_nothing_until_set_models() {
        let t0 = Instant::now();
        let mut r = Router::new(Policy::RoundRobin, HealthConfig::default(), 0);
        let a = r.add_backend(spec("a", &[], 4));
        assert!(!r.serves(M));
        assert!(matches!(
            r.rank(M, t0),
            Err(RouteError::UnknownModel { .. })
        ));
        r.set_models(a, vec![M.into(), "b".into(), M.into()]);
        assert!(r.serves(M));
        assert_eq!(r.rank(M, t0), Ok(vec![a]));
    }

    #[test]
    fn models_is_the_sorted_unique_union() {
        let mut r = Router::new(Policy::RoundRobin, HealthConfig::default(), 0);
        r.add_backend(spec("a", &["z", "a"], 1));
        r.add_backend(spec("b", &["m", "a"], 1));
        r.add_backend(spec("c", &[], 1));
        assert_eq!(r.models(), vec!["a", "m", "z"]);
    }

    #[test]
    fn probes_readmit_an_ejected_backend_into_the_ranking() {
        let t0 = Instant::now();
        let mut r = router(Policy::RoundRobin, 2);
        assert_eq!(
            r.on_attempt_end(BackendId(1), Outcome::ConnectError, t0),
            Some(HealthTransition::Ejected {
                reason: EjectReason::ConnectError
            })
        );
        assert_eq!(r.backend(BackendId(1)).map(|v| v.healthy), Some(false));
        assert_eq!(r.on_probe(BackendId(1), true, t0 + ms(1000)), None);
        assert_eq!(
            r.on_probe(BackendId(1), true, t0 + ms(2000)),
            Some(HealthTransition::Readmitted)
        );
        let ranked = r.rank(M, t0 + ms(2000)).expect("eligible backends");
        assert!(ranked.contains(&BackendId(1)));
    }

    #[test]
    fn attempt_end_never_underflows_inflight() {
        let t0 = Instant::now();
        let mut r = router(Policy::RoundRobin, 1);
        r.on_attempt_end(BackendId(0), Outcome::ClientCancelled, t0);
        assert_eq!(r.backend(BackendId(0)).map(|v| v.inflight), Some(0));
    }

    #[test]
    fn unknown_ids_are_ignored() {
        let t0 = Instant::now();
        let mut r = router(Policy::RoundRobin, 1);
        let ghost = BackendId(42);
        r.on_attempt_start(ghost, t0);
        r.on_first_byte(ghost, ms(1), t0);
        r.set_models(ghost, vec![M.into()]);
        assert_eq!(r.on_attempt_end(ghost, Outcome::ConnectError, t0), None);
        assert_eq!(r.on_probe(ghost, false, t0), None);
        assert!(r.backend(ghost).is_none());
        assert_eq!(r.backends().count(), 1);
    }

    #[test]
    fn policy_parses_its_names_and_lists_them_on_error() {
        assert_eq!("round_robin".parse(), Ok(Policy::RoundRobin));
        assert_eq!("least_inflight".parse(), Ok(Policy::LeastInflight));
        assert_eq!("p2c_ewma".parse(), Ok(Policy::P2cEwma));
        assert_eq!(Policy::default(), Policy::P2cEwma);
        let err = "random".parse::<Policy>().expect_err("not a policy");
        let msg = err.to_string();
        for p in Policy::ALL {
            assert!(msg.contains(p.as_str()), "{msg}");
        }
        let p: Policy = serde_json::from_str("\"least_inflight\"").expect("snake_case name");
        assert_eq!(p, Policy::LeastInflight);
        assert!(serde_json::from_str::<Policy>("\"LeastInflight\"").is_err());
    }

    #[test]
    fn backend_id_displays_its_index() {
        assert_eq!(BackendId(3).to_string(), "backend#3");
    }

    /// Per backend: (serves the model, max_inflight, attempts started, ejected).
    fn fleet() -> impl Strategy<Value = Vec<(bool, u32, u32, bool)>> {
        proptest::collection::vec((any::<bool>(), 0u32..4, 0u32..5, any::<bool>()), 0..10)
    }

    proptest! {
        #[test]
        fn rank_is_a_permutation_of_the_eligible_backends(
            backends in fleet(),
            policy in prop::sample::select(Policy::ALL.to_vec()),
            seed in any::<u64>(),
            ttfts in proptest::collection::vec(1u64..2000, 10),
            rounds in 1usize..5,
        ) {
            let t0 = Instant::now();
            let mut r = Router::new(policy, HealthConfig::default(), seed);
            for (i, &(serves, max, started, ejected)) in backends.iter().enumerate() {
                let models: &[&str] = if serves { &[M, "other"] } else { &["other"] };
                let id = r.add_backend(spec(&format!("b{i}"), models, max));
                for _ in 0..started {
                    r.on_attempt_start(id, t0);
                }
                r.on_first_byte(id, ms(ttfts[i]), t0);
                if ejected {
                    r.on_attempt_end(id, Outcome::ConnectError, t0);
                }
            }
            let eligible: BTreeSet<BackendId> = r
                .backends()
                .filter(|(_, v)| {
                    v.models.iter().any(|m| m == M)
                        && v.healthy
                        && (v.max_inflight == 0 || v.inflight < v.max_inflight)
                })
                .map(|(id, _)| id)
                .collect();
            for _ in 0..rounds {
                match r.rank(M, t0) {
                    Ok(ranked) => {
                        let set: BTreeSet<BackendId> = ranked.iter().copied().collect();
                        prop_assert_eq!(set.len(), ranked.len(), "duplicates in {:?}", ranked);
                        prop_assert_eq!(&set, &eligible);
                    }
                    Err(RouteError::UnknownModel { .. }) => {
                        prop_assert!(backends.iter().all(|b| !b.0));
                    }
                    Err(RouteError::NoHealthyBackend { .. }) => {
                        prop_assert!(eligible.is_empty());
                        prop_assert!(backends.iter().all(|b| !b.0 || b.3));
                    }
                    Err(RouteError::Saturated { .. }) => {
                        prop_assert!(eligible.is_empty());
                        prop_assert!(backends.iter().any(|b| b.0 && !b.3));
                    }
                    Err(e) => prop_assert!(false, "unexpected error {e}"),
                }
            }
        }
    }
}
