//! The [`Router`]: backends, events in, ranked backends out.
//!
//! Two ways to report attempts exist. The ticket API ([`Router::start_attempt`] →
//! [`Router::first_token`] / [`Router::stalled`] → [`Router::end_attempt`]) carries the request's
//! size and the half-open trial flag from start to end, which the `cost` policy needs to learn
//! rates and which makes trial verdicts exact. The id API ([`Router::on_attempt_start`],
//! [`Router::on_first_byte`], [`Router::on_attempt_end`], [`Router::on_stall`]) is the older,
//! size-blind form, kept so existing callers work: it counts load and health but teaches the
//! cost model nothing, and it attributes a trial verdict to whichever attempt on that backend
//! ends first.

use std::collections::BTreeSet;
use std::fmt;
use std::time::{Duration, Instant};

use crate::affinity::{self, Slot};
use crate::backend::{
    normalize, BackendId, BackendSpec, BackendState, BackendView, MAX_TRACKED_ENDS,
};
use crate::config::RouterConfig;
use crate::cost::{kv_penalty, LoadSignal, TimedSignal};
use crate::error::RouteError;
use crate::health::{HealthConfig, HealthTransition, Outcome};
use crate::hedge::{HedgeBudget, HedgeWinner};
use crate::policy::{Candidate, Policy, Selector};
use crate::prefix::BlockHash;
use crate::request::{RouteRequest, SessionKind};
use crate::snapshot::{BackendSnapshot, RouterSnapshot};

/// TTFT assumed for a backend before its first sample, so new backends get traffic (and hence
/// samples) without being preferred over every measured one.
pub const DEFAULT_TTFT_ESTIMATE: Duration = Duration::from_millis(100);

/// Shortest hold the router asks for: when a prefill in flight is already later than
/// predicted, the gateway looks again after this long (until `cost.prefill_hold_max`).
pub const HOLD_POLL: Duration = Duration::from_millis(10);

/// A hedge waits at least this many times the cost model's expected TTFT of its request
/// ([`Router::hedge_delay`]): the estimate is a mean, and a first token a little later than
/// it is not yet a late one.
pub const HEDGE_EXPECTED_SLACK: f64 = 1.5;

/// Why the first backend of a [`Route`] was chosen (for logs and the `server-timing` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteReason {
    /// Lowest expected time to first token (`cost` policy).
    LowestCost,
    /// The conversation's home: the backend holding its history (`cost` policy).
    Home,
    /// The conversation's home was over its load bound or cost ratio; this is the cheapest
    /// backend within the home bound (`cost` policy).
    LeftHome,
    /// The cheapest backend was over the load bound; this is the cheapest within it (`cost`
    /// policy).
    LoadBound,
    /// A request without a home (a new conversation) whose cheapest backend had more than its
    /// share of recent attempts; this is the cheapest within the share bound (`cost` policy).
    ShareBound,
    /// The first backend is prefilling this prompt's longest cached prefix for another
    /// attempt right now: hold the request until it is done ([`Route::hold`] is set), or,
    /// routed again after a hold, that prefill is done and the backend goes first (`cost`
    /// policy).
    PrefillHold,
    /// The session's rendezvous backend (`spilled`: its home backend was over the load bound,
    /// this is the next one in rendezvous order).
    Session {
        /// Where the key came from.
        kind: SessionKind,
        /// Not the session's first choice because of the load bound.
        spilled: bool,
    },
    /// An ejected backend's half-open trial request.
    HalfOpenTrial,
    /// A baseline policy's pick.
    Policy(Policy),
}

impl fmt::Display for RouteReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LowestCost => f.write_str("cost"),
            Self::Home => f.write_str("cost-home"),
            Self::LeftHome => f.write_str("cost-left-home"),
            Self::LoadBound => f.write_str("cost-load-bound"),
            Self::ShareBound => f.write_str("cost-share-bound"),
            Self::PrefillHold => f.write_str("cost-prefill-hold"),
            Self::Session {
                kind,
                spilled: false,
            } => write!(f, "session-{kind}"),
            Self::Session {
                kind,
                spilled: true,
            } => write!(f, "session-{kind}-spilled"),
            Self::HalfOpenTrial => f.write_str("trial"),
            Self::Policy(p) => f.write_str(p.as_str()),
        }
    }
}

/// The answer of [`Router::route`]: backends best first and why the first.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Every eligible backend, no duplicates, best first; the rest are the retry and hedge
    /// order.
    pub backends: Vec<BackendId>,
    /// Why the first one.
    pub reason: RouteReason,
    /// The `cost` model's expected time to first token on the first backend (also computed
    /// under the baselines, for comparison).
    pub expected_ttft: Duration,
    /// Leading prompt blocks the first backend is estimated to hold.
    pub cached_blocks: usize,
    /// `Some(d)`: do not send the request yet. The first backend is prefilling the prompt's
    /// longest cached prefix for another attempt and should be done in about `d`; route the
    /// request again after `d` with [`RouteRequest::with_held`] (the first backend and the
    /// total time held), which goes there once the prefill is done. Only the `cost` policy
    /// holds, never longer than `cost.prefill_hold_max` in all.
    pub hold: Option<Duration>,
}

/// One attempt in flight, from [`Router::start_attempt`] to [`Router::end_attempt`]. It
/// carries what the router needs to learn from the attempt; end every ticket exactly once.
#[derive(Debug, PartialEq)]
#[must_use = "end the attempt with Router::end_attempt, or in-flight counts leak"]
pub struct AttemptTicket {
    id: BackendId,
    prefill_tokens: u64,
    output_tokens: u64,
    work_ahead: f64,
    predicted: f64,
    trial: bool,
    first_token: bool,
    stalled: bool,
    /// Blocks this attempt prefills that no attempt had cached or started before it; pending
    /// on its backend until its first token (see [`crate::pending`]).
    pending: Vec<BlockHash>,
    /// Identifies its expected end in its backend's `ends`.
    serial: u64,
    first_token_at: Option<Instant>,
    /// Its answer comes whole ([`RouteRequest::whole_answer`]).
    whole_answer: bool,
}

impl AttemptTicket {
    /// The backend of the attempt.
    pub fn backend(&self) -> BackendId {
        self.id
    }

    /// Whether this attempt is its (ejected) backend's half-open trial.
    pub fn is_trial(&self) -> bool {
        self.trial
    }

    /// The cost model's expected time to first token for it, RTT included.
    pub fn expected_ttft(&self) -> Duration {
        Duration::try_from_secs_f64(self.predicted).unwrap_or(Duration::MAX)
    }

    /// Uncached prompt tokens it was estimated to prefill.
    pub fn uncached_tokens(&self) -> u64 {
        self.prefill_tokens
    }
}

/// The parts of a cost estimate, seconds.
#[derive(Debug, Clone, Copy)]
struct Estimate {
    /// Expected TTFT (RTT + overhead + queue + prefill + KV penalty).
    ttft: f64,
    /// `ttft` plus the region penalty: what ranking compares.
    score: f64,
    cached_blocks: usize,
    uncached_tokens: f64,
    work_ahead: f64,
}

/// Sans-IO router over a set of backends. See the [crate docs](crate).
#[derive(Debug, Clone)]
pub struct Router {
    policy: Policy,
    cfg: RouterConfig,
    backends: Vec<BackendState>,
    selector: Selector,
    hedge_budget: HedgeBudget,
    hedges_sent: u64,
    /// Serial of the next attempt ticket.
    next_serial: u64,
}

impl Router {
    /// A router with no backends and default settings apart from `health`. `seed` seeds the
    /// random choices of `p2c_ewma`.
    pub fn new(policy: Policy, health: HealthConfig, seed: u64) -> Self {
        Self::with_config(policy, RouterConfig::with_health(health), seed)
    }

    /// A router with no backends and the given settings (validate them first with
    /// [`RouterConfig::validate`]; out-of-range values are used as given).
    pub fn with_config(policy: Policy, cfg: RouterConfig, seed: u64) -> Self {
        Self {
            policy,
            hedge_budget: HedgeBudget::new(&cfg.hedge),
            cfg,
            backends: Vec::new(),
            selector: Selector::new(seed),
            hedges_sent: 0,
            next_serial: 0,
        }
    }

    /// Replace the TTFT assumed for backends without samples (default
    /// [`DEFAULT_TTFT_ESTIMATE`]).
    pub fn with_default_ttft(mut self, ttft: Duration) -> Self {
        self.cfg.default_ttft = ttft;
        self
    }

    /// The policy in use.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The health thresholds in use.
    pub fn health_config(&self) -> &HealthConfig {
        &self.cfg.health
    }

    /// All settings in use.
    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// Add a backend; it starts healthy and idle. Ids are dense and never reused: the n-th
    /// backend added gets `BackendId(n)`.
    pub fn add_backend(&mut self, spec: BackendSpec) -> BackendId {
        let capacity = spec
            .prefix_capacity_blocks
            .unwrap_or(self.cfg.prefix_capacity_blocks);
        self.backends
            .push(BackendState::new(spec, &self.cfg.cost, capacity));
        BackendId(self.backends.len() - 1)
    }

    /// Remove a backend (discovery dropped it): it is never ranked again and disappears from
    /// [`Router::backends`] and [`Router::backend`]. Attempts already in flight may still be
    /// ended. Returns false for an unknown or already removed id.
    pub fn remove_backend(&mut self, id: BackendId) -> bool {
        match self.backends.get_mut(id.0) {
            Some(b) if !b.removed => {
                b.removed = true;
                // Replaced, not cleared: a cleared map keeps its allocation (~800 KiB for the
                // default index), and discovery churn adds a backend per pod replacement.
                b.prefix = crate::prefix::PrefixIndex::new(0);
                b.pending = crate::pending::PendingPrefills::default();
                b.ends = Vec::new();
                true
            }
            _ => false,
        }
    }

    /// Number of backends added (removed ones included: ids are never reused).
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
    /// Same as [`Router::route`] with a request that carries only the model.
    ///
    /// # Errors
    ///
    /// As [`Router::route`].
    pub fn rank(&mut self, model: &str, now: Instant) -> Result<Vec<BackendId>, RouteError> {
        self.route(&RouteRequest::new(model), now)
            .map(|r| r.backends)
    }

    /// Rank the backends for `req` at `now`.
    ///
    /// Eligible means: serves the model, not removed, below its `max_inflight`, and either
    /// healthy or an ejected backend whose half-open trial is due (at most one such backend
    /// is included, first, and its trial is reserved for this request). Under the `cost`
    /// policy the rest are ordered by expected time to first token, and a session key puts its
    /// rendezvous backend (bounded load) first.
    ///
    /// # Errors
    ///
    /// [`RouteError::UnknownModel`] if no backend serves the model,
    /// [`RouteError::NoHealthyBackend`] if all that serve it are ejected (and none is due a
    /// trial), [`RouteError::Saturated`] if all healthy ones that serve it are full.
    pub fn route(&mut self, req: &RouteRequest, now: Instant) -> Result<Route, RouteError> {
        let model = req.model.as_str();
        let (mut serving, mut healthy) = (false, false);
        let mut trial: Option<BackendId> = None;
        let mut cands = Vec::with_capacity(self.backends.len());
        for (i, b) in self.backends.iter().enumerate() {
            if !b.serves(model) {
                continue;
            }
            serving = true;
            let due_trial = trial.is_none()
                && !b.health.is_healthy()
                && b.health.trial_available(now, &self.cfg.outlier);
            if !b.health.is_healthy() && !due_trial {
                continue;
            }
            healthy = true;
            if !b.has_headroom() {
                continue;
            }
            if due_trial {
                trial = Some(BackendId(i));
                continue;
            }
            let (cost, cached_blocks, share, (done_blocks, ready_at), ttft) = match self.policy {
                Policy::CostAware => {
                    let est = self.estimate(b, req, now);
                    let share = b.starts.get(now, self.cfg.cost.share_window);
                    let done = b.pending.done_prefix(&req.blocks, est.cached_blocks);
                    (est.score, est.cached_blocks, share, done, Some(est.ttft))
                }
                Policy::P2cEwma => (
                    b.ttft.secs_at(now, self.cfg.default_ttft) * (f64::from(b.occupied()) + 1.0),
                    0,
                    0.0,
                    (0, None),
                    None,
                ),
                Policy::RoundRobin | Policy::LeastInflight => (0.0, 0, 0.0, (0, None), None),
            };
            cands.push(Candidate {
                id: BackendId(i),
                inflight: b.occupied(),
                cost,
                cached_blocks,
                share,
                done_blocks,
                ready_at,
                ttft,
            });
        }
        if cands.is_empty() && trial.is_none() {
            let model = model.to_owned();
            return Err(if !serving {
                RouteError::UnknownModel { model }
            } else if !healthy {
                RouteError::NoHealthyBackend { model }
            } else {
                RouteError::Saturated { model }
            });
        }
        let mut reason = match self.policy {
            Policy::CostAware => RouteReason::LowestCost,
            p => RouteReason::Policy(p),
        };
        let mut hold = None;
        if !cands.is_empty() {
            self.selector
                .order(self.policy, &mut cands, self.backends.len());
            if self.policy == Policy::CostAware {
                let (pos, r) = self.cost_pick(req, &cands, now);
                if let Some(pos) = pos {
                    cands[..=pos].rotate_right(1);
                }
                reason = r;
            }
            if let Some((pos, r)) = self.session_pick(req, &cands) {
                cands[..=pos].rotate_right(1);
                reason = r;
            } else if self.policy == Policy::CostAware && trial.is_none() {
                if let Some((pos, h)) = self.hold_pick(req, &cands, now) {
                    cands[..=pos].rotate_right(1);
                    reason = RouteReason::PrefillHold;
                    hold = h;
                }
            }
        }
        let mut ranked: Vec<BackendId> = Vec::with_capacity(cands.len() + 1);
        if let Some(t) = trial {
            let b = &mut self.backends[t.0];
            if b.health
                .reserve_trial(now, &self.cfg.health, &self.cfg.outlier)
            {
                ranked.push(t);
                reason = RouteReason::HalfOpenTrial;
            }
        }
        ranked.extend(cands.iter().map(|c| c.id));
        let Some(&first) = ranked.first() else {
            // Only reachable if the due trial could not be reserved, which the filter above
            // rules out; answer as if it were not due.
            return Err(RouteError::NoHealthyBackend {
                model: model.to_owned(),
            });
        };
        // The first candidate's estimate was made above under `cost`; the state it read has not
        // changed since.
        let (ttft, cached_blocks) = match cands.first() {
            Some(&Candidate {
                id,
                ttft: Some(ttft),
                cached_blocks,
                ..
            }) if id == first => (ttft, cached_blocks),
            _ => {
                let est = self.estimate(&self.backends[first.0], req, now);
                (est.ttft, est.cached_blocks)
            }
        };
        Ok(Route {
            backends: ranked,
            reason,
            expected_ttft: Duration::try_from_secs_f64(ttft).unwrap_or(Duration::MAX),
            cached_blocks,
            hold: hold.filter(|_| reason == RouteReason::PrefillHold),
        })
    }

    /// Under the `cost` policy, whether to hold the request for a prefill in flight: the
    /// position of the backend to wait for (or, after a hold, to go to) and the hold
    /// (`None`: go now). See [`crate::pending`].
    ///
    /// A backend *B* whose cached prefix of the prompt is longer than any backend has
    /// finished prefilling, but partly still in prefill for another attempt, saves this
    /// request the prefill of that part if it waits. It waits when that prefill (at *B*'s
    /// learned rate) would take longer than *B*'s remaining time, *B* is within the loose
    /// (home) load bound, and the request has been held less than `prefill_hold_max`. Routed
    /// again with [`RouteRequest::with_held`], the request goes to *B* once its prefill is
    /// done, whatever the share bound says (waiting was for that); if *B* lost the prefix or
    /// went over the bound, it is ranked as usual.
    fn hold_pick(
        &self,
        req: &RouteRequest,
        cands: &[Candidate],
        now: Instant,
    ) -> Option<(usize, Option<Duration>)> {
        let cost = &self.cfg.cost;
        let max = cost.prefill_hold_max;
        if max.is_zero() || req.blocks.is_empty() {
            return None;
        }
        let waited = req.held.map_or(Duration::ZERO, |h| h.waited);
        let total: u64 = cands.iter().map(|c| u64::from(c.inflight)).sum();
        let eps = cost.load_bound_epsilon.unwrap_or(0.0);
        // The loose (home) bound relative to the *other* candidates' mean, as a home's: with
        // the holder's own attempts in the mean, among five backends or fewer it never bound
        // (x < ceil(5(x + 1)/n)), and every request held for a prefill went to the holder.
        let others = (cands.len() - 1).max(1) as f64;
        let within = |c: &Candidate| {
            let others_mean = (total - u64::from(c.inflight) + 1) as f64 / others;
            let loose = cost.load_bound_home_epsilon.map_or(f64::INFINITY, |e| {
                ((1.0 + e.max(eps)) * others_mean)
                    .ceil()
                    .max(f64::from(cost.load_bound_floor))
            });
            f64::from(c.inflight) < loose
        };
        let step = |ready: Option<Instant>| {
            let left = max.saturating_sub(waited);
            ready
                .map_or(HOLD_POLL, |r| r.saturating_duration_since(now))
                .clamp(HOLD_POLL.min(left), left)
        };
        if let Some(h) = req.held {
            if let Some(pos) = cands.iter().position(|c| c.id == h.backend) {
                let c = &cands[pos];
                if c.cached_blocks > 0 && within(c) {
                    if c.done_blocks == c.cached_blocks {
                        return Some((pos, None));
                    }
                    if waited < max {
                        return Some((pos, Some(step(c.ready_at))));
                    }
                }
            }
            return None;
        }
        // The pick itself may be prefilling the prompt's prefix (the load rules chose it over
        // a backend that has it done); otherwise a backend with a longer prefix in prefill
        // than any backend has done.
        let first = cands.first()?;
        let (pos, b, done) = if first.done_blocks < first.cached_blocks {
            (0, first, first.done_blocks)
        } else {
            let best_done = cands.iter().map(|c| c.done_blocks).max().unwrap_or(0);
            let (pos, b) = cands
                .iter()
                .enumerate()
                .filter(|(_, c)| c.cached_blocks > best_done && c.done_blocks < c.cached_blocks)
                .max_by_key(|(pos, c)| (c.cached_blocks, std::cmp::Reverse(*pos)))?;
            (pos, b, best_done)
        };
        if !within(b) {
            return None;
        }
        // A prefill predicted done by now that is not done: the prediction failed (its request
        // is stuck in a queue), and a hold would only poll until `prefill_hold_max` for every
        // request with this prefix until that one gets its first token.
        if b.ready_at.is_some_and(|r| r <= now) {
            return None;
        }
        // Tokens per tracked block: the untracked tail is never cached anywhere.
        let tracked = f64::from(req.prompt_tokens - req.untracked_tokens.min(req.prompt_tokens));
        let saved_tokens = tracked * (b.cached_blocks - done) as f64 / req.blocks.len() as f64;
        let saved = saved_tokens * self.backends[b.id.0].rates.secs_per_prefill_token();
        let remaining = b
            .ready_at
            .map_or(0.0, |r| r.saturating_duration_since(now).as_secs_f64());
        (saved > remaining).then(|| (pos, Some(step(b.ready_at))))
    }

    /// Under the `cost` policy, the position of the candidate that should go first when it is
    /// not the cheapest (`None`: the cheapest stays first). Two rules, both the bounded-load
    /// rule of session affinity ((1 + ε) × mean in flight, Mirrokni et al. 2018):
    ///
    /// - **Home.** The candidate holding the longest cached prefix of the prompt, when part of
    ///   that prefix is private (beyond any prefix other prompts share, see
    ///   [`crate::PrefixIndex::shared_prefix`]: this conversation's history), is the
    ///   conversation's home. It goes first while its attempts in flight are below
    ///   `max(load_bound_floor, ceil((1 + load_bound_home_epsilon) × mean))`, the mean being
    ///   that of the *other* candidates with this request added (so a loaded home among few
    ///   backends does not raise its own bound), even when the cost model ranks another backend
    ///   slightly cheaper: moving costs the prefill of the whole history elsewhere, the learned
    ///   rates of backends that are in fact alike differ by noise, and a conversation that
    ///   wanders leaves dead copies of its history that push live ones out of the caches. It
    ///   also has to stay within `home_max_cost_ratio` × the cheapest backend's expected TTFT,
    ///   so a home with a long queue (by the model) is left even where the count bound is weak
    ///   (few backends, one of them loaded).
    /// - **Share bound.** Otherwise (no home: a new conversation) the cheapest goes first only
    ///   while its recent share of attempts (a count decaying over `share_window`) is below
    ///   `(1 + share_epsilon) × the mean share` with this request added, and its attempts in
    ///   flight are within the home bound; else the cheapest that is and whose expected TTFT is
    ///   within `home_max_cost_ratio` × the cheapest's. A conversation's later turns follow it
    ///   home, so the load it brings shows in the shares, not in the attempts in flight at the
    ///   instant it starts.
    /// - **Load bound.** Without a share bound, or when no backend is within it, the cheapest
    ///   goes first only while its attempts in flight are below the bound with slack
    ///   `load_bound_epsilon`; else the cheapest within that bound.
    ///   Prefix affinity is a strong pull (a cached system prompt saves its whole prefill), and
    ///   without a bound every new conversation that shares a cached prefix queues on the few
    ///   backends holding it; with it, a shared prefix is replicated to a few backends.
    fn cost_pick(
        &self,
        req: &RouteRequest,
        cands: &[Candidate],
        now: Instant,
    ) -> (Option<usize>, RouteReason) {
        let cost = &self.cfg.cost;
        let (Some(eps), Some(first)) = (cost.load_bound_epsilon, cands.first()) else {
            return (None, RouteReason::LowestCost);
        };
        let total: u64 = cands.iter().map(|c| u64::from(c.inflight)).sum();
        let mean_after = (total + 1) as f64 / cands.len() as f64;
        let bound = |eps: f64| {
            ((1.0 + eps) * mean_after)
                .ceil()
                .max(f64::from(cost.load_bound_floor))
        };
        let within = |c: &Candidate, bound: f64| f64::from(c.inflight) < bound;
        if let Some((pos, home)) = cands
            .iter()
            .enumerate()
            .filter(|(_, c)| c.cached_blocks > 0)
            .max_by_key(|(pos, c)| (c.cached_blocks, std::cmp::Reverse(*pos)))
        {
            let index = &self.backends[home.id.0].prefix;
            if home.cached_blocks > index.shared_prefix(&req.blocks, home.cached_blocks) {
                // Relative to the other backends' mean, so that with few backends a loaded
                // home does not raise its own bound.
                let others = (cands.len() - 1).max(1) as f64;
                let others_mean = (total - u64::from(home.inflight) + 1) as f64 / others;
                let home_bound = cost.load_bound_home_epsilon.map(|e| {
                    ((1.0 + e.max(eps)) * others_mean)
                        .ceil()
                        .max(f64::from(cost.load_bound_floor))
                });
                let home_ok = (home_bound.is_none_or(|b| within(home, b))
                    || self.has_free_slot(home.id, now))
                    && home.cost <= cost.home_max_cost_ratio * first.cost;
                let limit = home_bound.unwrap_or(f64::INFINITY);
                if home_ok {
                    // A full home: the turn waits for the earliest of its batch to end. A
                    // backend with a free slot may be sooner even with the history to prefill.
                    if let Some(wait) = self.queue_wait(home.id, now).filter(|w| *w > 0.0) {
                        let alt = cands
                            .iter()
                            .enumerate()
                            .filter(|(i, c)| {
                                *i != pos && within(c, limit) && self.has_free_slot(c.id, now)
                            })
                            .min_by(|a, b| a.1.cost.total_cmp(&b.1.cost));
                        if let Some((alt, c)) = alt {
                            if c.cost < home.cost + wait {
                                return ((alt > 0).then_some(alt), RouteReason::LeftHome);
                            }
                        }
                    }
                    return ((pos > 0).then_some(pos), RouteReason::Home);
                }
                // Leave for the cheapest backend that is not overloaded itself: the home
                // bound, not the tight one, so the history's system prompt is usually still
                // cached there rather than prefilled on an idle stranger.
                let alt = cands
                    .iter()
                    .enumerate()
                    .position(|(i, c)| i != pos && within(c, limit));
                if let Some(alt) = alt {
                    return ((alt > 0).then_some(alt), RouteReason::LeftHome);
                }
            }
        }
        let tight = bound(eps);
        if let Some(se) = cost.share_epsilon {
            // A new conversation brings its later turns with it: place it by the backends'
            // recent shares of attempts rather than by the attempts in flight at this instant,
            // within the loose bound so a burst cannot pile onto one backend.
            let total: f64 = cands.iter().map(|c| c.share).sum();
            let limit = (1.0 + se) * (total + 1.0) / cands.len() as f64;
            let loose = cost
                .load_bound_home_epsilon
                .map_or(f64::INFINITY, |e| bound(e.max(eps)));
            // Only to a backend within `home_max_cost_ratio` of the cheapest: the share bound
            // spreads new conversations over backends that serve them about as fast, not onto
            // a far or slow one (with two backends, one 400 ms away took 3 in 8 of them).
            let affordable = |c: &Candidate| c.cost <= cost.home_max_cost_ratio * first.cost;
            let ok = |c: &Candidate| c.share < limit && within(c, loose) && affordable(c);
            if ok(first) {
                return (None, RouteReason::LowestCost);
            }
            if let Some(p) = cands.iter().position(ok) {
                return (Some(p), RouteReason::ShareBound);
            }
        }
        if within(first, tight) {
            return (None, RouteReason::LowestCost);
        }
        match cands.iter().position(|c| within(c, tight)) {
            Some(p) if p > 0 => (Some(p), RouteReason::LoadBound),
            _ => (None, RouteReason::LowestCost),
        }
    }

    /// Whether `id` runs fewer requests than its learned batch limit: a request sent there now
    /// starts at once, so however loaded it is relative to the others, nothing queues (an
    /// engine's TTFT is flat until its batch is full, then jumps by a whole service time).
    /// The count is this router's attempts in flight plus, from a fresh engine report, the
    /// requests other gateways had there.
    fn has_free_slot(&self, id: BackendId, now: Instant) -> bool {
        let b = &self.backends[id.0];
        let Some(slots) = self.cfg.cost.batch_slots.or(b.batch_slots) else {
            return false;
        };
        let others = b
            .load
            .as_ref()
            .filter(|l| l.fresh(now, &self.cfg.cost).is_some())
            .map_or(0, TimedSignal::others);
        b.occupied().saturating_add(others) < slots
    }

    /// Expected seconds a request sent to `id` now waits for a batch slot: 0 with a free
    /// slot; when the batch is full (this gateway's attempts in flight plus other gateways'
    /// from a fresh report, at or over the learned batch limit), the time until as many
    /// attempts have ended as it takes to free one, from each attempt's expected end (its
    /// expected first token, then its output tokens at the learned decode time). `None`
    /// without a learned batch limit or decode time, or when attempts of unknown end are
    /// among those it waits for.
    fn queue_wait(&self, id: BackendId, now: Instant) -> Option<f64> {
        let b = &self.backends[id.0];
        let slots = self.cfg.cost.batch_slots.or(b.batch_slots)?;
        b.decode_secs_per_token?;
        let others = b
            .load
            .as_ref()
            .filter(|l| l.fresh(now, &self.cfg.cost).is_some())
            .map_or(0, TimedSignal::others);
        let n = b.occupied().saturating_add(others);
        if n < slots {
            return Some(0.0);
        }
        let k = (n - slots) as usize;
        if k >= b.ends.len() {
            return None;
        }
        let mut left: Vec<f64> = b
            .ends
            .iter()
            .map(|e| e.1.saturating_duration_since(now).as_secs_f64())
            .collect();
        let (_, kth, _) = left.select_nth_unstable_by(k, f64::total_cmp);
        Some(*kth)
    }

    /// The position in `cands` of the session's rendezvous backend, and the reason.
    fn session_pick(
        &self,
        req: &RouteRequest,
        cands: &[Candidate],
    ) -> Option<(usize, RouteReason)> {
        let session = req.session.as_ref()?;
        if self.policy != Policy::CostAware || !self.cfg.affinity.enabled {
            return None;
        }
        let slot = |c: &Candidate| Slot {
            id: c.id,
            name_hash: self.backends[c.id.0].name_hash,
            inflight: c.inflight,
        };
        let mut slots: Vec<Slot> = Vec::new();
        if let (true, Some(region)) = (
            self.cfg.affinity.prefer_client_region,
            req.client_region.as_deref(),
        ) {
            slots.extend(
                cands
                    .iter()
                    .filter(|c| self.backends[c.id.0].spec.region == region)
                    .map(slot),
            );
        }
        let key = affinity::key_hash(&session.key);
        let eps = self.cfg.affinity.epsilon;
        let mut placed = None;
        if !slots.is_empty() && slots.len() < cands.len() {
            // In the client's region while the backend placed there is within the bound of
            // the whole fleet: a region of one or two busy backends spills to the others
            // rather than taking every session up to its `max_inflight`.
            let total: u64 = cands.iter().map(|c| u64::from(c.inflight)).sum();
            let fleet_bound = affinity::load_bound(total, cands.len(), eps);
            placed = affinity::place(key, &slots, eps).filter(|p| {
                cands
                    .iter()
                    .find(|c| c.id == p.id)
                    .is_some_and(|c| u64::from(c.inflight) < fleet_bound)
            });
            slots.clear();
        }
        if placed.is_none() {
            slots.extend(cands.iter().map(slot));
            placed = affinity::place(key, &slots, eps);
        }
        let placed = placed?;
        let pos = cands.iter().position(|c| c.id == placed.id)?;
        Some((
            pos,
            RouteReason::Session {
                kind: session.kind,
                spilled: placed.rank > 0,
            },
        ))
    }

    /// The cost model for `req` on `b` at `now` (see [`crate::cost`]).
    fn estimate(&self, b: &BackendState, req: &RouteRequest, now: Instant) -> Estimate {
        let cfg = &self.cfg.cost;
        let cached_blocks = b.prefix.cached_prefix(&req.blocks);
        let prompt = f64::from(req.prompt_tokens);
        // The tracked part is cached in proportion to its blocks; an untracked tail never is.
        let untracked = f64::from(req.untracked_tokens.min(req.prompt_tokens));
        let uncached_tokens = if req.blocks.is_empty() {
            prompt
        } else {
            (prompt - untracked) * (req.blocks.len() - cached_blocks) as f64
                / req.blocks.len() as f64
                + untracked
        };
        let work_ahead = b.effective_work(now, cfg);
        let kv = b
            .load
            .as_ref()
            .and_then(|l| l.fresh(now, cfg))
            .and_then(|s| s.kv_cache_usage)
            .map_or(0.0, |u| kv_penalty(u, cfg));
        let ttft = b.rtt_secs()
            + b.rates.overhead()
            + work_ahead * b.rates.secs_per_queued_token()
            + uncached_tokens * b.rates.secs_per_prefill_token()
            + kv;
        let away = match req.client_region.as_deref() {
            Some(r) => !b.spec.region.is_empty() && b.spec.region != r,
            None => false,
        };
        let penalty = if away {
            cfg.cross_region_penalty.as_secs_f64()
        } else {
            0.0
        };
        Estimate {
            ttft,
            score: ttft + penalty,
            cached_blocks,
            uncached_tokens,
            work_ahead,
        }
    }

    /// An attempt for `req` is sent to `id` at `now`: counts it in flight with its token work,
    /// records its prompt blocks in the backend's prefix index, and starts the backend's
    /// half-open trial if this is it. End the ticket with [`Router::end_attempt`].
    ///
    /// An unknown id gives a ticket whose later events are ignored.
    pub fn start_attempt(
        &mut self,
        id: BackendId,
        req: &RouteRequest,
        now: Instant,
    ) -> AttemptTicket {
        let output_tokens = u64::from(self.cfg.cost.output_estimate(req.max_output_tokens));
        let mut ticket = AttemptTicket {
            id,
            prefill_tokens: 0,
            output_tokens,
            work_ahead: 0.0,
            predicted: 0.0,
            trial: false,
            first_token: false,
            stalled: false,
            pending: Vec::new(),
            serial: self.next_serial,
            first_token_at: None,
            whole_answer: req.whole_answer,
        };
        self.next_serial = self.next_serial.wrapping_add(1);
        let Some(b) = self.backends.get(id.0) else {
            return ticket;
        };
        let est = self.estimate(b, req, now);
        ticket.prefill_tokens = est.uncached_tokens.round() as u64;
        ticket.work_ahead = est.work_ahead;
        ticket.predicted = est.ttft;
        let outlier_cfg = self.cfg.outlier;
        // Earned per attempt started, not per `route`: a request held for a prefill or queued
        // for a slot is routed again and again, and earned a share of a hedge each time.
        self.hedge_budget.earn(&self.cfg.hedge);
        let b = &mut self.backends[id.0];
        b.inflight = b.inflight.saturating_add(1);
        b.sized_inflight = b.sized_inflight.saturating_add(1);
        b.starts.add(now, self.cfg.cost.share_window);
        let work = ticket.prefill_tokens + ticket.output_tokens;
        b.work_tokens = b.work_tokens.saturating_add(work);
        b.avg_attempt_work += 0.1 * (work as f64 - b.avg_attempt_work);
        b.cache_lookup_blocks += req.blocks.len() as u64;
        b.cache_hit_blocks += est.cached_blocks as u64;
        b.prefix.insert(&req.blocks);
        if b.ends.len() < MAX_TRACKED_ENDS {
            let decode = b.decode_secs_per_token.unwrap_or(0.0) * output_tokens as f64;
            let end = Duration::try_from_secs_f64(est.ttft + decode).unwrap_or(Duration::MAX);
            b.ends
                .push((ticket.serial, now + end.min(Duration::from_secs(3600))));
        }
        let new = &req.blocks[est.cached_blocks.min(req.blocks.len())..];
        // A whole answer's first byte comes when its generation ends, long after its prefill:
        // its blocks must not stay pending that long, holding other requests for them.
        if !self.cfg.cost.prefill_hold_max.is_zero() && !new.is_empty() && !req.whole_answer {
            let ready_at = now + ticket.expected_ttft().min(Duration::from_secs(3600));
            if b.pending.add(new, ready_at) {
                ticket.pending = new.to_vec();
            }
        }
        ticket.trial = b.health.begin_trial(now, &outlier_cfg);
        ticket
    }

    /// The first token of `ticket`'s attempt arrived `ttft` after it was sent (at `now`):
    /// feeds the TTFT estimates and the cost model's rates, judges TTFT outliers, and
    /// re-admits a backend whose trial this was. Later calls for the same ticket are ignored.
    pub fn first_token(
        &mut self,
        ticket: &mut AttemptTicket,
        ttft: Duration,
        now: Instant,
    ) -> Option<HealthTransition> {
        if ticket.first_token {
            return None;
        }
        ticket.first_token = true;
        let cfg = self.cfg;
        if ticket.whole_answer {
            // The generation has ended: its prefill is done, and a trial has succeeded, but
            // the time is not a time to first token, nor the rest a decode time. (Its blocks
            // were never pending: see `start_attempt`.)
            let b = self.backends.get_mut(ticket.id.0)?;
            b.work_tokens = b.work_tokens.saturating_sub(ticket.prefill_tokens);
            if !std::mem::take(&mut ticket.trial) {
                return None;
            }
            let t = b.health.end_trial(Some(true), now, &cfg.health);
            return after_transition(b, t);
        }
        let alternative = self.may_judge_outlier(ticket.id, ttft);
        let b = self.backends.get_mut(ticket.id.0)?;
        b.work_tokens = b.work_tokens.saturating_sub(ticket.prefill_tokens);
        b.pending.remove(&std::mem::take(&mut ticket.pending));
        ticket.first_token_at = Some(now);
        if let Some(e) = b.ends.iter_mut().find(|e| e.0 == ticket.serial) {
            let decode = b.decode_secs_per_token.unwrap_or(0.0) * ticket.output_tokens as f64;
            let left = Duration::try_from_secs_f64(decode).unwrap_or(Duration::MAX);
            e.1 = now + left.min(Duration::from_secs(3600));
        }
        b.rates.observe(
            ttft.as_secs_f64() - b.rtt_secs(),
            ticket.prefill_tokens as f64,
            ticket.work_ahead,
            &cfg.cost,
        );
        let transition = observe_ttft(
            b,
            ttft,
            ticket.predicted,
            ticket.trial,
            alternative,
            now,
            &cfg,
        );
        if ticket.trial && transition.is_some() {
            ticket.trial = false;
        }
        transition
    }

    /// `ticket`'s stream produced no token for the gateway's stall timeout: a failure (see
    /// [`crate::health`]). End the attempt afterwards as usual; a [`Outcome::Timeout`] after
    /// a stall is not counted twice.
    pub fn stalled(
        &mut self,
        ticket: &mut AttemptTicket,
        now: Instant,
    ) -> Option<HealthTransition> {
        if ticket.stalled {
            return None;
        }
        ticket.stalled = true;
        let cfg = self.cfg;
        let may_eject = self.may_eject_passively(ticket.id);
        let b = self.backends.get_mut(ticket.id.0)?;
        let t = if std::mem::take(&mut ticket.trial) {
            b.health.end_trial(Some(false), now, &cfg.health)
        } else {
            b.health.on_stall(now, &cfg.health, &cfg.outlier, may_eject)
        };
        after_transition(b, t)
    }

    /// Holds a slot of `id` for an attempt that is about to start: until [`Router::unreserve`],
    /// routes count it against the backend's `max_inflight` as if the attempt were in flight.
    /// A caller that routes and then awaits (a connect, a write) before
    /// [`Router::start_attempt`] reserves under the same lock as the route, so that requests
    /// arriving meanwhile cannot all take the same last slot.
    pub fn reserve(&mut self, id: BackendId) {
        if let Some(b) = self.backends.get_mut(id.0) {
            b.reserved = b.reserved.saturating_add(1);
        }
    }

    /// Reserves a slot of `id` if it has one free (a retry or a hedge, which go to backends
    /// ranked when the request was routed, perhaps full or ejected by now); says whether it
    /// did.
    pub fn try_reserve(&mut self, id: BackendId) -> bool {
        match self.backends.get_mut(id.0) {
            Some(b) if b.takes_more() => {
                b.reserved = b.reserved.saturating_add(1);
                true
            }
            _ => false,
        }
    }

    /// Whether backend `id` could take one more request now (not removed, not ejected, below
    /// its `max_inflight`), without reserving. A backend ejected since the request was ranked
    /// is no candidate for its retry or hedge any more: a request whose first backend failed
    /// went on to one found hung meanwhile, and waited its first-byte timeout there too.
    pub fn has_room(&self, id: BackendId) -> bool {
        self.backends.get(id.0).is_some_and(|b| b.takes_more())
    }

    /// Gives back a slot held by [`Router::reserve`] (the attempt started, or never will).
    pub fn unreserve(&mut self, id: BackendId) {
        if let Some(b) = self.backends.get_mut(id.0) {
            b.reserved = b.reserved.saturating_sub(1);
        }
    }

    /// `ticket`'s attempt ended with `outcome` at `now`: its work leaves the queue and health
    /// sees the outcome (as the trial's verdict if it was the trial).
    pub fn end_attempt(
        &mut self,
        ticket: AttemptTicket,
        outcome: Outcome,
        now: Instant,
    ) -> Option<HealthTransition> {
        let cfg = self.cfg;
        let may_eject = self.may_eject_passively(ticket.id);
        let b = self.backends.get_mut(ticket.id.0)?;
        b.inflight = b.inflight.saturating_sub(1);
        b.sized_inflight = b.sized_inflight.saturating_sub(1);
        let mut work = ticket.output_tokens;
        if !ticket.first_token {
            work += ticket.prefill_tokens;
        }
        b.pending.remove(&ticket.pending);
        if let Some(i) = b.ends.iter().position(|e| e.0 == ticket.serial) {
            b.ends.swap_remove(i);
        }
        if let (Outcome::Success, Some(first), true) =
            (outcome, ticket.first_token_at, ticket.output_tokens > 0)
        {
            let per_token =
                now.saturating_duration_since(first).as_secs_f64() / ticket.output_tokens as f64;
            b.decode_secs_per_token = Some(match b.decode_secs_per_token {
                None => per_token,
                Some(v) => v + 0.2 * (per_token - v),
            });
        }
        b.work_tokens = b.work_tokens.saturating_sub(work);
        let t = if ticket.trial {
            let verdict = match outcome {
                Outcome::Success => Some(true),
                Outcome::ClientCancelled | Outcome::Rejected => None,
                Outcome::ConnectError => {
                    let t = b.health.end_trial_unreachable(now, &cfg.health);
                    return after_transition(b, t);
                }
                _ => Some(false),
            };
            b.health.end_trial(verdict, now, &cfg.health)
        } else if ticket.stalled && outcome == Outcome::Timeout {
            None
        } else {
            b.health.on_outcome(outcome, now, &cfg.health, may_eject)
        };
        after_transition(b, t)
    }

    /// An attempt was sent to `id` (size unknown): one more in flight. Prefer
    /// [`Router::start_attempt`].
    pub fn on_attempt_start(&mut self, id: BackendId, now: Instant) {
        let ocfg = self.cfg.outlier;
        let window = self.cfg.cost.share_window;
        if let Some(b) = self.backends.get_mut(id.0) {
            b.inflight = b.inflight.saturating_add(1);
            b.starts.add(now, window);
            b.health.begin_trial(now, &ocfg);
        }
    }

    /// The first response byte of an attempt on `id` arrived `ttft` after it was sent. Feeds
    /// the TTFT estimates and outlier detection; re-admits the backend if its trial is in
    /// flight (use [`Router::first_token`] to see that transition).
    pub fn on_first_byte(&mut self, id: BackendId, ttft: Duration, now: Instant) {
        let cfg = self.cfg;
        let alternative = self.may_judge_outlier(id, ttft);
        if let Some(b) = self.backends.get_mut(id.0) {
            let trial = b.health.trial_in_flight();
            observe_ttft(b, ttft, 0.0, trial, alternative, now, &cfg);
        }
    }

    /// Whether a first token after `ttft` on `id` may count as a TTFT outlier: only above the
    /// outlier floor, and only while another healthy backend serves one of `id`'s models. A
    /// slow first token is still a first token: ejecting the last backend that can answer
    /// turns every slow answer into a 503, and when all of a model's backends slow down at
    /// once (a burst of load, an overloaded gateway host) the cause is not the backend.
    fn may_judge_outlier(&self, id: BackendId, ttft: Duration) -> bool {
        ttft > self.cfg.outlier.ttft_outlier_floor && self.may_eject_passively(id)
    }

    /// Whether `id` may be ejected for what its live traffic shows (5xx and timeouts, stalls,
    /// slow first tokens): only while another healthy backend serves one of its models, and
    /// while fewer than half the backends (rounded up) are out. See [`crate::health`].
    fn may_eject_passively(&self, id: BackendId) -> bool {
        let Some(b) = self.backends.get(id.0) else {
            return false;
        };
        let live = self.backends.iter().filter(|o| !o.removed).count();
        // The others that are out: a backend on trial, out itself, is kept out by a failed
        // trial without one more backend going out.
        let out = self
            .backends
            .iter()
            .enumerate()
            .filter(|(i, o)| *i != id.0 && !o.removed && !o.health.is_healthy())
            .count();
        // Every model it serves must have another healthy backend: one shared model was
        // enough before, and a backend serving a base model and an adapter that no other
        // backend has left every request for the adapter a 503 for the hold.
        let served_elsewhere = |m: &String| {
            self.backends.iter().enumerate().any(|(i, other)| {
                i != id.0
                    && !other.removed
                    && other.health.is_healthy()
                    && other.spec.models.contains(m)
            })
        };
        out < live.div_ceil(2)
            && !b.spec.models.is_empty()
            && b.spec.models.iter().all(served_elsewhere)
    }

    /// An attempt on `id` ended: one fewer in flight, and passive health sees the outcome (as
    /// the trial's verdict if the backend's trial is in flight). Returns the health transition
    /// it caused, if any.
    pub fn on_attempt_end(
        &mut self,
        id: BackendId,
        outcome: Outcome,
        now: Instant,
    ) -> Option<HealthTransition> {
        let cfg = self.cfg;
        let may_eject = self.may_eject_passively(id);
        let b = self.backends.get_mut(id.0)?;
        b.inflight = b.inflight.saturating_sub(1);
        let t = if b.health.trial_in_flight() {
            let verdict = match outcome {
                Outcome::Success => Some(true),
                Outcome::ClientCancelled | Outcome::Rejected => None,
                Outcome::ConnectError => {
                    let t = b.health.end_trial_unreachable(now, &cfg.health);
                    return after_transition(b, t);
                }
                _ => Some(false),
            };
            b.health.end_trial(verdict, now, &cfg.health)
        } else {
            b.health.on_outcome(outcome, now, &cfg.health, may_eject)
        };
        after_transition(b, t)
    }

    /// An open stream on `id` had no token for the stall timeout (id form of
    /// [`Router::stalled`]; the later `Timeout` outcome of that attempt counts too).
    pub fn on_stall(&mut self, id: BackendId, now: Instant) -> Option<HealthTransition> {
        let cfg = self.cfg;
        let may_eject = self.may_eject_passively(id);
        let b = self.backends.get_mut(id.0)?;
        let t = if b.health.trial_in_flight() {
            b.health.end_trial(Some(false), now, &cfg.health)
        } else {
            b.health.on_stall(now, &cfg.health, &cfg.outlier, may_eject)
        };
        after_transition(b, t)
    }

    /// An active probe of `id` finished. Returns the health transition it caused, if any.
    pub fn on_probe(&mut self, id: BackendId, ok: bool, now: Instant) -> Option<HealthTransition> {
        let health = self.cfg.health;
        let trials = self.cfg.outlier.half_open_trial;
        let b = self.backends.get_mut(id.0)?;
        let t = b.health.on_probe(ok, now, &health, trials);
        after_transition(b, t)
    }

    /// An active health probe of `id` got no answer in time: a failed probe, capped as passive
    /// ejections are (see [`crate::health::HealthState::on_probe_timeout`]).
    pub fn on_probe_timeout(&mut self, id: BackendId, now: Instant) -> Option<HealthTransition> {
        let health = self.cfg.health;
        let trials = self.cfg.outlier.half_open_trial;
        let may_eject = self.may_eject_passively(id);
        let b = self.backends.get_mut(id.0)?;
        let t = b.health.on_probe_timeout(now, &health, trials, may_eject);
        after_transition(b, t)
    }

    /// An active RTT probe of `id` measured `rtt` (network only, for example a TCP connect or
    /// an HTTP/2 ping) at `now`.
    pub fn on_rtt_sample(&mut self, id: BackendId, rtt: Duration, now: Instant) {
        if let Some(b) = self.backends.get_mut(id.0) {
            b.observe_rtt(rtt, now);
        }
    }

    /// The engine's own load metrics for `id`, scraped at `now`; used by the cost model while
    /// fresh (`cost.load_signal_max_age`).
    pub fn on_load_signal(&mut self, id: BackendId, signal: LoadSignal, now: Instant) {
        if let Some(b) = self.backends.get_mut(id.0) {
            b.load = Some(TimedSignal {
                signal,
                at: now,
                inflight_then: b.inflight,
            });
            if signal.waiting > 0 && signal.running > 0 {
                b.batch_slots = Some(b.batch_slots.unwrap_or(0).max(signal.running));
            }
        }
    }

    /// Record that `id` now holds `blocks` (already done by [`Router::start_attempt`]; use this
    /// only with the id API).
    pub fn on_routed(&mut self, id: BackendId, blocks: &[BlockHash]) {
        if let Some(b) = self.backends.get_mut(id.0) {
            b.prefix.insert(blocks);
        }
    }

    /// Leading blocks of `blocks` that `id` is estimated to hold (0 for an unknown id).
    pub fn cached_prefix(&self, id: BackendId, blocks: &[BlockHash]) -> usize {
        self.backends
            .get(id.0)
            .map_or(0, |b| b.prefix.cached_prefix(blocks))
    }

    /// How long to wait for the first token of `req` on `id` before hedging to the next ranked
    /// backend: the backend's recent p95 TTFT, or [`HEDGE_EXPECTED_SLACK`] times the cost
    /// model's expected TTFT of this request there if that is later, clamped to
    /// `[hedge.min_delay, hedge.max_delay]`. Call it before the attempt starts. `None` when
    /// hedging is off, the backend has fewer than `hedge.min_samples` TTFTs, or the hedge
    /// budget is spent.
    ///
    /// The p95 is of the backend's recent requests, mostly short chat turns; a request with a
    /// long uncached prompt, or one behind a long queue, is expected later than that, and
    /// hedged on the p95 alone every such request was sent twice and its long prefill run on
    /// two engines.
    pub fn hedge_delay(&self, id: BackendId, req: &RouteRequest, now: Instant) -> Option<Duration> {
        let h = &self.cfg.hedge;
        if !h.enabled || !self.hedge_budget.available() {
            return None;
        }
        let b = self.backends.get(id.0)?;
        let p95 = b.recent.p95(h.min_samples)?;
        let expected = self.estimate(b, req, now).ttft * HEDGE_EXPECTED_SLACK;
        let delay = Duration::try_from_secs_f64(expected).map_or(h.max_delay, |e| e.max(p95));
        Some(delay.clamp(h.min_delay, h.max_delay.max(h.min_delay)))
    }

    /// The gateway is about to send a hedge (the delay passed without a first token): spends
    /// one hedge from the budget. Returns false, and the hedge must not be sent, when hedging
    /// is off or the budget is empty.
    pub fn on_hedge_sent(&mut self, _now: Instant) -> bool {
        if !self.cfg.hedge.enabled || !self.hedge_budget.spend() {
            return false;
        }
        self.hedges_sent += 1;
        true
    }

    /// Which of a hedged pair answered first (the gateway cancels the other and ends both
    /// tickets, the loser as [`Outcome::ClientCancelled`]).
    pub fn on_hedge_result(
        &mut self,
        primary: BackendId,
        hedge: BackendId,
        winner: HedgeWinner,
        _now: Instant,
    ) {
        let (won, lost) = match winner {
            HedgeWinner::Primary => (primary, hedge),
            HedgeWinner::Hedge => (hedge, primary),
        };
        if let Some(b) = self.backends.get_mut(won.0) {
            b.hedges_won += 1;
        }
        if let Some(b) = self.backends.get_mut(lost.0) {
            b.hedges_lost += 1;
        }
    }

    /// A snapshot of one backend, `None` for an unknown or removed id.
    pub fn backend(&self, id: BackendId) -> Option<BackendView<'_>> {
        self.backends
            .get(id.0)
            .filter(|b| !b.removed)
            .map(|b| b.view(id))
    }

    /// Snapshots of every backend not removed, in id order, for metrics and status.
    pub fn backends(&self) -> impl Iterator<Item = (BackendId, BackendView<'_>)> + '_ {
        self.backends
            .iter()
            .enumerate()
            .filter(|(_, b)| !b.removed)
            .map(|(i, b)| {
                let id = BackendId(i);
                (id, b.view(id))
            })
    }

    /// Everything the status page and admin JSON show, at `now`.
    pub fn snapshot(&self, now: Instant) -> RouterSnapshot {
        RouterSnapshot {
            policy: self.policy.as_str(),
            hedging: self.cfg.hedge.enabled,
            hedges_sent: self.hedges_sent,
            hedge_budget: self.hedge_budget.tokens(),
            backends: self
                .backends
                .iter()
                .enumerate()
                .filter(|(_, b)| !b.removed)
                .map(|(i, b)| BackendSnapshot::of(BackendId(i), b, now, &self.cfg))
                .collect(),
        }
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
            .filter(|b| !b.removed)
            .flat_map(|b| b.spec.models.iter().map(String::as_str))
            .collect();
        set.into_iter().map(str::to_owned).collect()
    }
}

/// Record a TTFT on `b`: estimates, outlier judgement, trial verdict.
fn observe_ttft(
    b: &mut BackendState,
    ttft: Duration,
    predicted: f64,
    trial: bool,
    may_be_outlier: bool,
    now: Instant,
    cfg: &RouterConfig,
) -> Option<HealthTransition> {
    b.ttft.observe(ttft, now);
    let o = &cfg.outlier;
    // During a streak of outliers, judge against the p95 from before the streak: otherwise a
    // sustained slowdown raises its own yardstick before it counts as sustained (with few
    // samples the p95 is the third-largest). Every sample still enters the window, so the
    // hedge delay sees the real tail and a lasting change of regime is learned.
    // Ejected for slow first tokens, the yardstick stays the one from before: the outliers in
    // the window would otherwise let its trial pass with another.
    if b.health.ttft_outlier_streak() == 0 && !b.health.ejected_for_slow_first_tokens() {
        b.outlier_baseline = b.recent.p95(o.ttft_outlier_min_samples);
    }
    let outlier = may_be_outlier
        && b.outlier_baseline.is_some_and(|p95| {
            let base = p95.as_secs_f64().max(predicted);
            ttft > o.ttft_outlier_floor && ttft.as_secs_f64() > o.ttft_outlier_factor * base
        });
    b.recent.push(ttft);
    let t = if trial {
        // A backend ejected for stalls passes its trial with the whole answer (at its end);
        // one ejected for slow first tokens fails it with another (before, any first token
        // re-admitted it, and with the outliers in its window it was never ejected again).
        let passed = !(outlier && b.health.ejected_for_slow_first_tokens());
        (!b.health.trial_needs_whole_answer())
            .then(|| b.health.end_trial(Some(passed), now, &cfg.health))
            .flatten()
    } else {
        b.health.on_ttft(outlier, now, &cfg.health, o)
    };
    after_transition(b, t)
}

/// Side effects of a health transition on the rest of the backend's state.
fn after_transition(b: &mut BackendState, t: Option<HealthTransition>) -> Option<HealthTransition> {
    if let Some(HealthTransition::Ejected { reason }) = t {
        if reason.suggests_restart() {
            b.prefix.clear();
            b.pending.clear();
            // The engine that comes back may run a different batch limit (a restart is when
            // `--max-num-seqs` changes), and what it reported before is about the old one:
            // the slots are learned again, never kept from a larger past.
            b.batch_slots = None;
            b.load = None;
        }
    }
    t
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

    #[test]
    fn a_backend_s_own_prefix_capacity_overrides_the_routers_default() {
        let cfg = RouterConfig {
            prefix_capacity_blocks: 100,
            ..RouterConfig::default()
        };
        let mut r = Router::with_config(Policy::CostAware, cfg, 1);
        let a = r.add_backend(spec("a", &["m"], 0));
        let b = r.add_backend(BackendSpec {
            prefix_capacity_blocks: Some(7),
            ..spec("b", &["m"], 0)
        });
        assert_eq!(r.backends[a.0].prefix.capacity(), 100);
        assert_eq!(r.backends[b.0].prefix.capacity(), 7);
    }

    fn spec(name: &str, models: &[&str], max_inflight: u32) -> BackendSpec {
        BackendSpec {
            name: name.to_owned(),
            region: "eu".to_owned(),
            models: models.iter().map(|m| (*m).to_owned()).collect(),
            max_inflight,
            prefix_capacity_blocks: None,
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

    /// Conversation `i`'s first turn: a 30-block system prompt shared by every conversation,
    /// then 10 blocks of its own.
    fn first_turn(i: u8) -> RouteRequest {
        let mut text = vec![b'x'; 256 * 30];
        text.extend_from_slice(&[b'a'.wrapping_add(i); 256 * 10]);
        RouteRequest::new(M)
            .with_blocks(crate::prompt_blocks(&text, 256))
            .with_prompt_tokens(2_560)
            .with_max_output_tokens(32)
    }

    /// Requests held for one backend's prefill are not all sent there once it is done, ahead of
    /// the cost ranking: only while the holder is within the home bound relative to the other
    /// backends (before, among five backends or fewer that bound never held, and all six held
    /// first turns went to the holder by the hold rule). Past it they are ranked as usual.
    #[test]
    fn requests_held_for_a_prefill_do_not_all_pile_onto_its_backend() {
        let t0 = Instant::now();
        let mut r = router(Policy::CostAware, 4);
        let first = first_turn(0);
        let b = r.route(&first, t0).expect("routable").backends[0];
        let mut ticket = r.start_attempt(b, &first, t0);
        let t1 = t0 + ms(150);
        let held: Vec<RouteRequest> = (1..=6)
            .map(|i| {
                let req = first_turn(i);
                let route = r.route(&req, t1).expect("routable");
                assert_eq!(
                    (route.backends[0], route.reason),
                    (b, RouteReason::PrefillHold),
                    "conversation {i}"
                );
                req.with_held(b, ms(250))
            })
            .collect();
        let t2 = t0 + ms(400);
        r.first_token(&mut ticket, ms(400), t2);
        let mut tickets = Vec::new();
        let mut by_the_hold = 0;
        for req in &held {
            let route = r.route(req, t2).expect("routable");
            by_the_hold += usize::from(route.reason == RouteReason::PrefillHold);
            tickets.push(r.start_attempt(route.backends[0], req, t2));
        }
        // The bound is the home one, x < ceil(5 × (others' attempts + 1) / 3): it lets the
        // holder take more as the others take some (here 4 of the 6).
        assert!(by_the_hold < 6, "all 6 went by the hold rule");
        let elsewhere: u32 = (0..4)
            .filter(|&i| i != b.0)
            .map(|i| r.snapshot(t2).backends[i].inflight)
            .sum();
        assert!(elsewhere >= 1, "none went to another backend");
        for t in tickets {
            r.end_attempt(t, Outcome::Success, t2);
        }
        r.end_attempt(ticket, Outcome::Success, t2);
    }

    /// Route three other conversations' first turns to `id`, so it holds the system prompt as
    /// a shared prefix.
    fn share_system_prompt(r: &mut Router, id: BackendId, now: Instant) {
        for i in 100..103 {
            let t = r.start_attempt(id, &first_turn(i), now);
            r.end_attempt(t, Outcome::Success, now);
        }
    }

    #[test]
    fn a_new_conversation_waits_for_its_system_prompt_in_prefill_instead_of_prefilling_it_again() {
        let t0 = Instant::now();
        let mut r = router(Policy::CostAware, 4);
        // Conversation 0 starts: b? prefills the system prompt cold.
        let first = first_turn(0);
        let route = r.route(&first, t0).expect("routable");
        assert_eq!(route.hold, None);
        let b = route.backends[0];
        let mut ticket = r.start_attempt(b, &first, t0);
        // 150 ms later conversation 1 arrives: its system prompt is still in prefill on b
        // (expected done at 306 ms: 50 ms + 2,560 tokens at the prior 10,000 tokens/s), and
        // nobody has it done; waiting (156 ms) beats prefilling those 30 blocks again
        // (192 ms), so it is held for b.
        let t1 = t0 + ms(150);
        let second = first_turn(1);
        let route = r.route(&second, t1).expect("routable");
        assert_eq!(route.reason, RouteReason::PrefillHold);
        assert_eq!(route.backends[0], b);
        let hold = route.hold.expect("held");
        assert!(
            hold >= HOLD_POLL && hold <= r.cfg.cost.prefill_hold_max,
            "{hold:?}"
        );
        // Early in the prefill (10 ms in: 296 ms left against 192 ms) it goes at once.
        assert_eq!(r.route(&second, t0 + ms(10)).expect("routable").hold, None);
        assert!(r
            .route(&second, t0 + ms(140))
            .expect("routable")
            .hold
            .is_some());
        // Routed again before the prefill is done: held again, never past the maximum.
        let again = second.clone().with_held(b, hold);
        let route = r.route(&again, t1 + hold).expect("routable");
        assert_eq!(
            (route.backends[0], route.reason),
            (b, RouteReason::PrefillHold)
        );
        assert!(route.hold.is_some());
        let spent = second.clone().with_held(b, r.cfg.cost.prefill_hold_max);
        assert_eq!(r.route(&spent, t1 + hold).expect("routable").hold, None);
        // Past its predicted end (306 ms) with no first token the prediction failed (the first
        // request is stuck in a queue): a new request is not held for it, where it used to be
        // held for the whole `prefill_hold_max`.
        assert_eq!(r.route(&second, t0 + ms(350)).expect("routable").hold, None);
        // The first token arrives: the prefix is done and the held request goes to b now.
        let t2 = t0 + ms(400);
        r.first_token(&mut ticket, ms(400), t2);
        let route = r.route(&again, t2).expect("routable");
        assert_eq!(route.backends[0], b);
        assert_eq!(route.hold, None);
        r.end_attempt(ticket, Outcome::Success, t2);
        // With holding off, the second start is sent at once.
        let mut r = router(Policy::CostAware, 4);
        r.cfg.cost.prefill_hold_max = Duration::ZERO;
        let b = r.route(&first, t0).expect("routable").backends[0];
        let t = r.start_attempt(b, &first, t0);
        assert_eq!(r.route(&second, t1).expect("routable").hold, None);
        r.end_attempt(t, Outcome::Success, t1);
        // A first turn answered whole holds nobody: its first byte comes only when its whole
        // generation has ended, long after the prefill others would wait for.
        let mut r = router(Policy::CostAware, 4);
        let whole = first.clone().with_whole_answer(true);
        let b = r.route(&whole, t0).expect("routable").backends[0];
        let t = r.start_attempt(b, &whole, t0);
        assert_eq!(r.route(&second, t1).expect("routable").hold, None);
        r.end_attempt(t, Outcome::Success, t1);
    }

    #[test]
    fn a_failed_prefill_leaves_nothing_pending() {
        let t0 = Instant::now();
        let mut r = router(Policy::CostAware, 2);
        let first = first_turn(0);
        let b = r.route(&first, t0).expect("routable").backends[0];
        let t = r.start_attempt(b, &first, t0);
        r.end_attempt(t, Outcome::ServerError, t0 + ms(10));
        assert_eq!(
            r.route(&first_turn(1), t0 + ms(20)).expect("routable").hold,
            None
        );
    }

    #[test]
    fn a_shared_cached_prefix_does_not_pin_a_backend_beyond_the_load_bound() {
        let now = Instant::now();
        for bounded in [true, false] {
            let mut r = router(Policy::CostAware, 4);
            // The in-flight bound for new conversations (the share bound off).
            r.cfg.cost.share_epsilon = None;
            if !bounded {
                r.cfg.cost.load_bound_epsilon = None;
            }
            share_system_prompt(&mut r, BackendId(2), now);
            let mut open = Vec::new();
            // Below the floor the backend holding the system prompt goes first.
            for i in 0..2 {
                let req = first_turn(i);
                let route = r.route(&req, now).expect("routable");
                assert_eq!(route.backends[0], BackendId(2), "bounded {bounded}");
                open.push(r.start_attempt(BackendId(2), &req, now));
            }
            // Two in flight on b2, none elsewhere: max(2, ceil(1.5 x 3 / 4)) = 2, so b2 is at
            // the bound and the new conversation goes elsewhere; b2 stays in the retry order.
            let route = r.route(&first_turn(2), now).expect("routable");
            if bounded {
                assert_eq!(route.reason, RouteReason::LoadBound);
                assert_ne!(route.backends[0], BackendId(2));
                assert!(route.backends.contains(&BackendId(2)));
            } else {
                assert_eq!(route.backends[0], BackendId(2), "unbounded affinity pins");
            }
            for t in open {
                r.end_attempt(t, Outcome::Success, now);
            }
        }
    }

    #[test]
    fn the_load_bound_grows_with_the_clusters_load() {
        let now = Instant::now();
        let mut r = router(Policy::CostAware, 4);
        r.cfg.cost.share_epsilon = None;
        share_system_prompt(&mut r, BackendId(1), now);
        // Eight other attempts in flight elsewhere and three on b1: mean after this one is
        // (11 + 1) / 4 = 3, bound ceil(1.5 x 3) = 5 > 3, so b1 takes the new conversation.
        let other = RouteRequest::new(M).with_prompt_tokens(10);
        let mut open = Vec::new();
        for i in [0, 0, 0, 2, 2, 2, 3, 3] {
            open.push(r.start_attempt(BackendId(i), &other, now));
        }
        for i in 0..3 {
            open.push(r.start_attempt(BackendId(1), &first_turn(i), now));
        }
        let route = r.route(&first_turn(3), now).expect("routable");
        assert_eq!(route.backends[0], BackendId(1));
        for t in open {
            r.end_attempt(t, Outcome::Success, now);
        }
    }

    #[test]
    fn a_new_conversation_goes_where_the_recent_share_is_below_the_bound() {
        let now = Instant::now();
        let mut r = router(Policy::CostAware, 4);
        // b2 holds the system prompt and took the last three attempts, all ended: nothing is
        // in flight, but its recent share, 3 of 3, is above 1.25 x (3 + 1) / 4.
        share_system_prompt(&mut r, BackendId(2), now);
        let route = r.route(&first_turn(0), now).expect("routable");
        assert_eq!(route.reason, RouteReason::ShareBound);
        assert_ne!(route.backends[0], BackendId(2));
        assert!(route.backends.contains(&BackendId(2)));
        // Thirty seconds (three share windows) later its share has decayed to ~0.15, below
        // 1.25 x 1.15 / 4: the cached system prompt wins again.
        let later = now + Duration::from_secs(30);
        let route = r.route(&first_turn(0), later).expect("routable");
        assert_eq!(route.backends[0], BackendId(2));
        assert_eq!(route.reason, RouteReason::LowestCost);
        // The share bound never moves a conversation off its home.
        let t = r.start_attempt(BackendId(2), &first_turn(0), later);
        r.end_attempt(t, Outcome::Success, later);
        let route = r.route(&second_turn(), later).expect("routable");
        assert_eq!(route.backends[0], BackendId(2));
        assert_eq!(route.reason, RouteReason::Home);
    }

    #[test]
    fn a_prompt_tail_past_the_tracked_blocks_is_never_counted_as_cached() {
        let now = Instant::now();
        let mut r = router(Policy::CostAware, 1);
        let text = vec![b'x'; 256 * 16];
        let req = RouteRequest::new(M)
            .with_blocks(crate::prompt_blocks(&text, 256))
            .with_prompt_tokens(10_000)
            .with_untracked_tokens(6_000);
        let t = r.start_attempt(BackendId(0), &req, now);
        assert_eq!(t.uncached_tokens(), 10_000);
        r.first_token(&mut { t }, Duration::from_millis(50), now);
        // Every tracked block is cached now; the untracked 6 000 tokens still need a prefill.
        let again = r.start_attempt(BackendId(0), &req, now);
        assert_eq!(again.uncached_tokens(), 6_000);
    }

    /// Conversation 0's second turn: its first turn, a reply and a new message.
    fn second_turn() -> RouteRequest {
        let mut text = vec![b'x'; 256 * 30];
        text.extend_from_slice(&[b'a'; 256 * 10]);
        text.extend_from_slice(&[b'r'; 256 * 5]);
        RouteRequest::new(M)
            .with_blocks(crate::prompt_blocks(&text, 256))
            .with_prompt_tokens(2_880)
            .with_max_output_tokens(32)
    }

    #[test]
    fn a_conversation_stays_home_though_another_backend_looks_slightly_cheaper() {
        let now = Instant::now();
        let mut r = router(Policy::CostAware, 4);
        // b0 and b3 hold the system prompt; conversation 0's first turn ran on b0.
        share_system_prompt(&mut r, BackendId(0), now);
        share_system_prompt(&mut r, BackendId(3), now);
        let t = r.start_attempt(BackendId(0), &first_turn(0), now);
        r.end_attempt(t, Outcome::Success, now);
        // b0 is 100 ms away: by the model b3 (50 ms + 15 uncached blocks at 10,000 tokens/s,
        // 146 ms) is cheaper than b0 (100 + 50 + 5 blocks, 182 ms), but within the home's cost
        // ratio of 4, and the home holds the history and is idle.
        r.on_rtt_sample(BackendId(0), ms(100), now);
        let route = r.route(&second_turn(), now).expect("routable");
        assert_eq!(route.backends[0], BackendId(0));
        assert_eq!(route.backends[1], BackendId(3));
        assert_eq!(route.reason, RouteReason::Home);
        // 700 ms away the home costs more than four times as much: it is left.
        for _ in 0..20 {
            r.on_rtt_sample(BackendId(0), ms(700), now);
        }
        let route = r.route(&second_turn(), now).expect("routable");
        assert_eq!(route.backends[0], BackendId(3));
        assert_eq!(route.reason, RouteReason::LeftHome);
        // Without the load bounds the plain cost order applies.
        r.on_rtt_sample(BackendId(0), ms(100), now);
        r.cfg.cost.load_bound_epsilon = None;
        let route = r.route(&second_turn(), now).expect("routable");
        assert_eq!(route.backends[0], BackendId(3));
    }

    #[test]
    fn a_conversation_leaves_home_only_beyond_the_home_bound() {
        let now = Instant::now();
        let mut r = router(Policy::CostAware, 4);
        r.cfg.cost.load_bound_home_epsilon = Some(2.0);
        share_system_prompt(&mut r, BackendId(0), now);
        let t = r.start_attempt(BackendId(0), &first_turn(0), now);
        r.end_attempt(t, Outcome::Success, now);
        let other = RouteRequest::new(M).with_prompt_tokens(10);
        let mut open = Vec::new();
        // Six in flight at home, two on each other backend: the tight bound
        // max(2, ceil(1.5 x 13 / 4)) = 5 is passed, the home bound, 3 x the others' mean with
        // this request, ceil(3 x 7 / 3) = 7, is not.
        for _ in 0..6 {
            open.push(r.start_attempt(BackendId(0), &other, now));
        }
        for i in [1, 1, 2, 2, 3, 3] {
            open.push(r.start_attempt(BackendId(i), &other, now));
        }
        let route = r.route(&second_turn(), now).expect("routable");
        assert_eq!(route.backends[0], BackendId(0));
        assert_eq!(route.reason, RouteReason::Home);
        // One more at home reaches it.
        open.push(r.start_attempt(BackendId(0), &other, now));
        let route = r.route(&second_turn(), now).expect("routable");
        assert_ne!(route.backends[0], BackendId(0));
        assert_eq!(route.reason, RouteReason::LeftHome);
        // With no home bound, home always goes first.
        r.cfg.cost.load_bound_home_epsilon = None;
        let route = r.route(&second_turn(), now).expect("routable");
        assert_eq!(route.backends[0], BackendId(0));
        for t in open {
            r.end_attempt(t, Outcome::Success, now);
        }
    }

    #[test]
    fn a_home_with_a_free_batch_slot_keeps_its_conversation_at_any_relative_load() {
        let now = Instant::now();
        let mut r = router(Policy::CostAware, 4);
        share_system_prompt(&mut r, BackendId(0), now);
        let t = r.start_attempt(BackendId(0), &first_turn(0), now);
        r.end_attempt(t, Outcome::Success, now);
        let other = RouteRequest::new(M).with_prompt_tokens(10);
        // Low load: two at home, nothing elsewhere; the home bound (floor 2) is reached.
        let mut open = vec![
            r.start_attempt(BackendId(0), &other, now),
            r.start_attempt(BackendId(0), &other, now),
        ];
        assert_eq!(
            r.route(&second_turn(), now).expect("routable").reason,
            RouteReason::LeftHome
        );
        // The engine once reported 4 running with a queue: it runs 4 at once, so with 2 in
        // flight a turn sent home starts at once.
        let signal = LoadSignal {
            waiting: 1,
            running: 4,
            kv_cache_usage: None,
        };
        r.on_load_signal(BackendId(0), signal, now);
        assert_eq!(r.backends[0].batch_slots, Some(4));
        // A signal without a queue teaches nothing: the slots stay.
        let idle = LoadSignal {
            waiting: 0,
            running: 1,
            kv_cache_usage: None,
        };
        r.on_load_signal(BackendId(0), idle, now);
        assert_eq!(r.backends[0].batch_slots, Some(4));
        let full = r.start_attempt(BackendId(0), &other, now);
        let t1 = now + Duration::from_secs(6);
        let route = r.route(&second_turn(), t1).expect("routable");
        assert_eq!(
            (route.backends[0], route.reason),
            (BackendId(0), RouteReason::Home)
        );
        // Full (4 in flight): the relative bound decides again.
        open.push(full);
        open.push(r.start_attempt(BackendId(0), &other, t1));
        assert_eq!(
            r.route(&second_turn(), t1).expect("routable").reason,
            RouteReason::LeftHome
        );
        for t in open {
            r.end_attempt(t, Outcome::Success, t1);
        }
    }

    #[test]
    fn a_full_home_is_left_for_a_free_slot_only_when_its_wait_is_longer_than_the_move() {
        let t0 = Instant::now();
        let mut r = router(Policy::CostAware, 4);
        r.cfg.cost.batch_slots = Some(2);
        share_system_prompt(&mut r, BackendId(0), t0);
        share_system_prompt(&mut r, BackendId(1), t0);
        // Teach b0 its decode time: 32 tokens in 320 ms, 10 ms per token.
        let short = RouteRequest::new(M)
            .with_prompt_tokens(10)
            .with_max_output_tokens(32);
        let mut t = r.start_attempt(BackendId(0), &short, t0);
        r.first_token(&mut t, ms(20), t0 + ms(20));
        r.end_attempt(t, Outcome::Success, t0 + ms(340));
        assert_eq!(r.backends[0].decode_secs_per_token, Some(0.01));
        let t = r.start_attempt(BackendId(0), &first_turn(0), t0);
        r.end_attempt(t, Outcome::Success, t0);
        // Home b0 is full: two attempts that started just now (each ends in ~0.35 s). The
        // others are as loaded (b1 with one slot free), so the relative home bound holds.
        let t1 = t0 + ms(400);
        let mut open = vec![
            r.start_attempt(BackendId(0), &short, t1),
            r.start_attempt(BackendId(0), &short, t1),
        ];
        for i in [1, 2, 2, 3, 3] {
            open.push(r.start_attempt(BackendId(i), &short, t1));
        }
        let route = r.route(&second_turn(), t1).expect("routable");
        assert_eq!(route.reason, RouteReason::LeftHome);
        assert_eq!(
            route.backends[0],
            BackendId(1),
            "b1 holds the system prompt"
        );
        // Nearly done (350 ms later, a few ms left): waiting at home beats prefilling the
        // 640 more uncached tokens on b1.
        let t2 = t1 + ms(350);
        let route = r.route(&second_turn(), t2).expect("routable");
        assert_eq!(
            (route.backends[0], route.reason),
            (BackendId(0), RouteReason::Home)
        );
        // With a free slot at home, home goes first.
        let t = open.swap_remove(0);
        r.end_attempt(t, Outcome::Success, t2);
        let route = r.route(&second_turn(), t2).expect("routable");
        assert_eq!(
            (route.backends[0], route.reason),
            (BackendId(0), RouteReason::Home)
        );
        for t in open {
            r.end_attempt(t, Outcome::Success, t2);
        }
    }

    #[test]
    fn an_engine_report_counts_only_other_gateways_requests() {
        let now = Instant::now();
        let mut r = router(Policy::CostAware, 2);
        let req = RouteRequest::new(M).with_prompt_tokens(100);
        let mine: Vec<_> = (0..3)
            .map(|_| r.start_attempt(BackendId(0), &req, now))
            .collect();
        // The engine runs our three and two from another gateway.
        let signal = LoadSignal {
            waiting: 0,
            running: 5,
            kv_cache_usage: None,
        };
        r.on_load_signal(BackendId(0), signal, now);
        for t in mine {
            r.end_attempt(t, Outcome::Success, now);
        }
        // Ours ended since the scrape; the other gateway's two still count while the report
        // is fresh, ours do not.
        let b = &r.backends[0];
        let work = b.effective_work(now, &r.cfg.cost);
        assert!(
            (work - 2.0 * b.avg_attempt_work).abs() < 1e-9,
            "{work} vs {}",
            b.avg_attempt_work
        );
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
            assert_eq!(r.rank(M, t0 + ms(2500)), Ok(vec![ok]), "{policy}");
            r.on_attempt_end(full, Outcome::Success, t0 + ms(2500));
            let ranked = r.rank(M, t0 + ms(2500)).expect("eligible backends");
            assert_eq!(ranked.len(), 2);
            assert!(!ranked.contains(&down));
        }
    }

    #[test]
    fn a_backend_is_not_ejected_for_its_traffic_while_the_last_healthy_one_of_any_of_its_models() {
        let t0 = Instant::now();
        let mut r = Router::new(Policy::RoundRobin, HealthConfig::default(), 1);
        let both = r.add_backend(spec("both", &[M, "lora-x"], 8));
        // The base model has another backend; the adapter has none.
        r.add_backend(spec("base", &[M], 8));
        for k in 0..5 {
            r.on_attempt_start(both, t0);
            r.on_attempt_end(both, Outcome::ServerError, t0 + ms(10 * k));
        }
        assert!(
            r.backend(both).expect("known").healthy,
            "the adapter's only backend"
        );
        assert_eq!(r.rank("lora-x", t0 + ms(100)), Ok(vec![both]));
        // Once another backend serves the adapter too, the failures eject it.
        let also = r.add_backend(spec("also", &["lora-x"], 8));
        r.on_attempt_start(both, t0);
        r.on_attempt_end(both, Outcome::ServerError, t0 + ms(100));
        assert!(!r.backend(both).expect("known").healthy);
        assert_eq!(r.rank("lora-x", t0 + ms(200)), Ok(vec![also]));
    }

    #[test]
    fn probes_that_time_out_everywhere_eject_no_more_than_half_the_backends() {
        let t0 = Instant::now();
        let mut r = router(Policy::RoundRobin, 4);
        for k in 0..5 {
            for i in 0..4 {
                r.on_probe_timeout(BackendId(i), t0 + ms(1000 * k));
            }
        }
        let healthy = r.backends().filter(|(_, b)| b.healthy).count();
        assert_eq!(healthy, 2, "an overloaded fleet keeps half its backends");
        assert_eq!(r.rank(M, t0 + ms(4500)).map(|v| v.len()), Ok(2));
        // A refused probe is no overload: it ejects whatever the guard says.
        let t1 = t0 + ms(6000);
        for k in 0..3 {
            let up: Vec<BackendId> = r
                .backends()
                .filter(|(_, b)| b.healthy)
                .map(|(id, _)| id)
                .collect();
            for id in up {
                r.on_probe(id, false, t1 + ms(k));
            }
        }
        assert_eq!(r.backends().filter(|(_, b)| b.healthy).count(), 0);
    }

    #[test]
    fn a_backend_ejected_after_the_ranking_takes_no_retry_or_hedge() {
        let t0 = Instant::now();
        let mut r = router(Policy::RoundRobin, 3);
        let ranked = r.rank(M, t0).expect("ranked");
        assert_eq!(ranked.len(), 3);
        let gone = ranked[2];
        for k in 0..3 {
            r.on_probe(gone, false, t0 + ms(k));
        }
        assert!(!r.has_room(gone));
        assert!(!r.try_reserve(gone));
        assert!(r.has_room(ranked[1]));
        assert!(r.try_reserve(ranked[1]));
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
    fn a_reserved_slot_counts_against_max_inflight_until_given_back() {
        let mut r = Router::new(Policy::RoundRobin, HealthConfig::default(), 0);
        let b = r.add_backend(spec("b", &[M], 2));
        let now = Instant::now();
        let req = RouteRequest::new(M);
        r.reserve(b);
        let t = r.start_attempt(b, &req, now);
        // One in flight and one reserved: the two slots are taken.
        assert_eq!(
            r.route(&req, now).map(|_| ()),
            Err(RouteError::Saturated { model: M.into() })
        );
        r.unreserve(b);
        assert!(r.route(&req, now).is_ok());
        // A retry takes the last slot only while it is free.
        assert!(r.try_reserve(b));
        assert!(!r.try_reserve(b));
        r.unreserve(b);
        r.end_attempt(t, Outcome::Success, now);
        // Giving back more than was held does not wrap.
        r.unreserve(b);
        r.unreserve(b);
        r.reserve(b);
        r.reserve(b);
        assert!(r.route(&req, now).is_err());
    }

    #[test]
    fn a_burst_routed_before_its_attempts_start_spreads_over_the_backends() {
        // Each request reserves the slot of its first backend and starts its attempt only once
        // its request is written (a connect away): the reservations are load like attempts.
        let now = Instant::now();
        for policy in [Policy::LeastInflight, Policy::P2cEwma, Policy::CostAware] {
            let mut r = router(policy, 2);
            let req = RouteRequest::new(M).with_prompt_tokens(1000);
            let mut first = Vec::new();
            for _ in 0..4 {
                let route = r.route(&req, now).expect("routable");
                r.reserve(route.backends[0]);
                first.push(route.backends[0]);
            }
            let on = |b: BackendId| first.iter().filter(|&&f| f == b).count();
            assert_eq!(
                (on(BackendId(0)), on(BackendId(1))),
                (2, 2),
                "{policy:?}: {first:?}"
            );
        }
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
    fn a_restarted_engine_learns_its_batch_slots_again() {
        let t0 = Instant::now();
        let mut r = router(Policy::CostAware, 2);
        let queued = LoadSignal {
            waiting: 3,
            running: 8,
            kv_cache_usage: None,
        };
        r.on_load_signal(BackendId(1), queued, t0);
        assert_eq!(r.backends[1].batch_slots, Some(8));
        // Unreachable: probably restarting. It comes back with a smaller batch limit.
        assert!(matches!(
            r.on_attempt_end(BackendId(1), Outcome::ConnectError, t0),
            Some(HealthTransition::Ejected { .. })
        ));
        assert_eq!(r.backends[1].batch_slots, None);
        assert!(r.backends[1].load.is_none());
        r.on_probe(BackendId(1), true, t0 + ms(1000));
        r.on_probe(BackendId(1), true, t0 + ms(2000));
        let smaller = LoadSignal {
            waiting: 1,
            running: 4,
            kv_cache_usage: None,
        };
        r.on_load_signal(BackendId(1), smaller, t0 + ms(3000));
        assert_eq!(r.backends[1].batch_slots, Some(4), "not the old engine's 8");
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
        assert_eq!("cost".parse(), Ok(Policy::CostAware));
        assert_eq!(Policy::default(), Policy::CostAware);
        let p: Policy = serde_json::from_str("\"cost\"").expect("config name");
        assert_eq!(p, Policy::CostAware);
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
