//! The router on the multi-turn chat workload of `tokenway bench routing`, in simulated time:
//! eight simulated engines (slots, FIFO queue, LRU prefix cache, prefill that does not contend
//! across slots, as `tokenway sim` models them) and 200 conversations × 6 turns arriving as a
//! Poisson process at ~70 % of the cluster's capacity. A discrete-event loop drives the public
//! API (`route`, `start_attempt`, `first_token`, `end_attempt`) exactly as the gateway does, so
//! a policy change is judged here in milliseconds, with no machine noise, before the real
//! benchmark confirms it.
//!
//! The ignored reports print mean, p50, p99, hit rate, backend changes and the requests over
//! 325 ms by cause; with `MT_SLOW=1`, `MT_MOVES=1`, `MT_RATES=1`, `MT_HOLDS=1` or `MT_COLD=1`
//! they also list each slow request, each backend change (with both backends' learned rates),
//! the final rates, the number of holds, and every first turn of the first 3 s with where each
//! backend stands. `report_tail` lists the 20 slowest requests per seed (`MT_SEEDS`, and
//! `MT_CAP` / `MT_HOLD_MS` / `MT_SHARE_EPS` / `MT_SCRAPE_MS` / `MT_KNEE` to vary the index
//! size, the hold, the share slack, the load-report interval (0: none) and whether the
//! engines' batch limit is known from the start).
//!
//! A request the router holds ([`tokenway_router::Route::hold`]) is routed again after the
//! hold, as the gateway does; its TTFT counts from its first arrival.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokenway_router::{
    prompt_blocks, AttemptTicket, BackendId, BackendSpec, LoadSignal, Outcome, Policy, RouteReason,
    RouteRequest, Router, RouterConfig,
};

const M: &str = "sim-model";

/// The bench's sim: base 20 ms, 5,000 tokens/s prefill, 10 ms/token, batch penalty 0.05,
/// 4 slots, 32,768 cached tokens in blocks of 16 tokens, 4 bytes per token.
const BASE_SECS: f64 = 0.020;
const PREFILL_RATE: f64 = 5_000.0;
const TPOT_SECS: f64 = 0.010;
const BATCH_PENALTY: f64 = 0.05;
const SLOTS: usize = 4;
const CACHE_TOKENS: usize = 32_768;
const SIM_BLOCK_TOKENS: usize = 16;
const BYTES_PER_TOKEN: usize = 4;
const MAX_TOKENS: u32 = 32;
/// The gateway's default `routing.block_bytes`.
const ROUTER_BLOCK_BYTES: usize = 256;

/// LRU set of chained block hashes, touched last to first (the sim's `PrefixCache`).
struct SimCache {
    cap: usize,
    clock: u64,
    stamps: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl SimCache {
    fn new() -> Self {
        Self {
            cap: CACHE_TOKENS / SIM_BLOCK_TOKENS,
            clock: 0,
            stamps: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    fn blocks(prompt: &[u8]) -> Vec<u64> {
        let mut prev = 0u64;
        prompt
            .chunks_exact(SIM_BLOCK_TOKENS * BYTES_PER_TOKEN)
            .map(|b| {
                let mut h = DefaultHasher::new();
                prev.hash(&mut h);
                b.hash(&mut h);
                prev = h.finish();
                prev
            })
            .collect()
    }

    fn cached_tokens(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.stamps.contains_key(b))
            .count()
            * SIM_BLOCK_TOKENS
    }

    fn insert(&mut self, blocks: &[u64]) {
        for &b in blocks.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.stamps.insert(b, self.clock) {
                self.order.remove(&old);
            }
            self.order.insert(self.clock, b);
            while self.stamps.len() > self.cap {
                let Some((_, v)) = self.order.pop_first() else {
                    break;
                };
                self.stamps.remove(&v);
            }
        }
    }
}

/// One request of the workload, with its prompt hashed both ways.
struct Turn {
    req: RouteRequest,
    sim_blocks: Vec<u64>,
    tokens: usize,
}

struct Conversation {
    start: f64,
    think: Vec<f64>,
    turns: Vec<Turn>,
}

fn words(rng: &mut SmallRng, bytes: usize) -> String {
    const W: [&str; 12] = [
        "latency", "token", "prefix", "cache", "gateway", "backend", "route", "stream", "model",
        "queue", "prefill", "decode",
    ];
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        s.push_str(W[rng.random_range(0..W.len())]);
        s.push(' ');
    }
    s.truncate(bytes);
    s
}

fn exponential(rng: &mut SmallRng, mean: f64) -> f64 {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    -u.ln() * mean
}

/// 200 conversations × 6 turns, 4 shared system prompts of 8,000 B, user messages of 800 B,
/// replies of 600 B, think time mean 3 s, `rate` conversations per second.
fn workload(seed: u64, conversations: usize, rate: f64) -> Vec<Conversation> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let systems: Vec<String> = (0..4).map(|_| words(&mut rng, 8_000)).collect();
    let mut at = 0.0;
    (0..conversations)
        .map(|c| {
            at += exponential(&mut rng, 1.0 / rate);
            let mut prompt = format!("system{}", systems[c % systems.len()]);
            let mut turns = Vec::new();
            let mut think = Vec::new();
            for t in 0..6 {
                prompt.push_str("user");
                prompt.push_str(&words(&mut rng, 800));
                let bytes = prompt.as_bytes();
                turns.push(Turn {
                    req: RouteRequest::new(M)
                        .with_blocks(prompt_blocks(bytes, ROUTER_BLOCK_BYTES))
                        .with_prompt_tokens((bytes.len() / BYTES_PER_TOKEN) as u32)
                        .with_max_output_tokens(MAX_TOKENS),
                    sim_blocks: SimCache::blocks(bytes),
                    tokens: bytes.len().div_ceil(BYTES_PER_TOKEN),
                });
                prompt.push_str("assistant");
                prompt.push_str(&words(&mut rng, 600));
                think.push(if t == 0 {
                    0.0
                } else {
                    exponential(&mut rng, 3.0)
                });
            }
            Conversation {
                start: at,
                think,
                turns,
            }
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// Conversation, turn.
    Arrive(usize, usize),
    /// Request slot index.
    FirstToken(usize),
    End(usize),
    /// The gateway scrapes every engine's `/metrics` (running and waiting requests).
    Scrape,
}

struct InFlight {
    conv: usize,
    turn: usize,
    backend: usize,
    arrived: f64,
    moved: bool,
    queued: bool,
    /// Set at admission: seconds waited for a slot, uncached tokens prefilled.
    wait: f64,
    uncached: usize,
    /// At arrival: the most any engine's cache held of the prompt (tokens), and how many
    /// engines held at least 2,000 tokens of it (its system prompt).
    best_cached: usize,
    holders: usize,
    ticket: Option<AttemptTicket>,
}

struct Engine {
    cache: SimCache,
    running: usize,
    queue: VecDeque<usize>,
}

/// One slow request: (TTFT ms, turn, moved, wait for a slot ms, uncached tokens, the most any
/// engine held of it at arrival, engines holding its system prompt, time of its first token).
type Slow = (f64, usize, bool, f64, usize, usize, usize, f64);

/// What one run measured.
#[derive(Debug)]
struct Outcomes {
    mean_ms: f64,
    p50_ms: f64,
    p99_ms: f64,
    hit_rate: f64,
    moves: usize,
    per_backend: Vec<usize>,
    /// Requests over 325 ms: (all, first turns, moved, queued for a slot).
    slow: (usize, usize, usize, usize),
    /// The 13th slowest TTFT (the p99 of 1,200), ms.
    thirteenth_ms: f64,
    /// The 20 slowest: (TTFT ms, turn, moved, wait for a slot ms, uncached tokens).
    tail: Vec<Slow>,
}

fn run(policy: Policy, cfg: RouterConfig, seed: u64) -> Outcomes {
    let conversations = 200;
    // 70 % of 8 × 4 slots / 0.614 s (the bench's derivation), over 6 turns.
    let rate = 0.7 * 8.0 * 4.0 / 0.614 / 6.0;
    let convs = workload(seed, conversations, rate);
    let t0 = Instant::now();
    let at = |s: f64| t0 + Duration::from_secs_f64(s);
    let mut router = Router::with_config(policy, cfg, seed);
    for i in 0..8 {
        router.add_backend(BackendSpec {
            name: format!("sim{i}"),
            region: "local".into(),
            models: vec![M.into()],
            max_inflight: 1024,
            prefix_capacity_blocks: None,
        });
    }
    let mut engines: Vec<Engine> = (0..8)
        .map(|_| Engine {
            cache: SimCache::new(),
            running: 0,
            queue: VecDeque::new(),
        })
        .collect();
    let mut heap: BinaryHeap<Reverse<(u64, u64, Event)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |heap: &mut BinaryHeap<_>, t: f64, e: Event| {
        seq += 1;
        heap.push(Reverse(((t * 1e9) as u64, seq, e)));
    };
    for (c, conv) in convs.iter().enumerate() {
        push(&mut heap, conv.start, Event::Arrive(c, 0));
    }
    // With `MT_KNEE`, every backend's batch limit is known from the start (an old report of
    // a full batch), as if the operator had configured it.
    if std::env::var_os("MT_KNEE").is_some() {
        for i in 0..8 {
            let full = LoadSignal {
                waiting: 1,
                running: SLOTS as u32,
                kv_cache_usage: None,
            };
            let long_ago = at(0.0).checked_sub(Duration::from_secs(60)).unwrap_or(t0);
            router.on_load_signal(BackendId(i), full, long_ago);
        }
    }
    let scrape = std::env::var("MT_SCRAPE_MS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(2000.0)
        / 1e3;
    if scrape > 0.0 {
        push(&mut heap, scrape, Event::Scrape);
    }
    let mut reqs: Vec<InFlight> = Vec::new();
    let mut ttfts = Vec::new();
    let mut tail: Vec<Slow> = Vec::new();
    let (mut prompt_tokens, mut cached_tokens) = (0usize, 0usize);
    let mut last_backend: HashMap<usize, usize> = HashMap::new();
    let mut moves = 0;
    // Requests the router said to hold: (conversation, turn) -> (arrival, backend, held so far).
    let mut holding: HashMap<(usize, usize), (f64, BackendId, Duration)> = HashMap::new();
    let mut holds = 0usize;
    let mut slow = (0, 0, 0, 0);
    let mut per_backend = vec![0; 8];
    // Admit request `r` on its engine at `now`: prefill, then the first token.
    let admit = |r: usize,
                 now: f64,
                 reqs: &mut Vec<InFlight>,
                 engines: &mut Vec<Engine>,
                 heap: &mut BinaryHeap<Reverse<(u64, u64, Event)>>,
                 push: &mut dyn FnMut(&mut BinaryHeap<_>, f64, Event),
                 prompt_tokens: &mut usize,
                 cached_tokens: &mut usize| {
        let q = &mut reqs[r];
        let turn = &convs[q.conv].turns[q.turn];
        let e = &mut engines[q.backend];
        e.running += 1;
        let cached = e.cache.cached_tokens(&turn.sim_blocks).min(turn.tokens);
        q.wait = now - q.arrived;
        q.uncached = turn.tokens - cached;
        *prompt_tokens += turn.tokens;
        *cached_tokens += cached;
        let first = now + BASE_SECS + (turn.tokens - cached) as f64 / PREFILL_RATE;
        push(heap, first, Event::FirstToken(r));
    };
    while let Some(Reverse((t_ns, _, ev))) = heap.pop() {
        let now = t_ns as f64 / 1e9;
        match ev {
            Event::Arrive(c, t) => {
                let held = holding.remove(&(c, t));
                let again;
                let req = match held {
                    Some((_, b, waited)) => {
                        again = convs[c].turns[t].req.clone().with_held(b, waited);
                        &again
                    }
                    None => &convs[c].turns[t].req,
                };
                let arrived = held.map_or(now, |h| h.0);
                let route = router.route(req, at(now)).expect("eight healthy backends");
                if let Some(d) = route.hold {
                    assert_eq!(route.reason, RouteReason::PrefillHold);
                    holds += 1;
                    let waited = held.map_or(Duration::ZERO, |h| h.2) + d;
                    holding.insert((c, t), (arrived, route.backends[0], waited));
                    push(&mut heap, now + d.as_secs_f64(), Event::Arrive(c, t));
                    continue;
                }
                let b = route.backends[0].0;
                if std::env::var_os("MT_COLD").is_some() && t == 0 && now < 3.0 {
                    let snap = router.snapshot(at(now));
                    let info: Vec<String> = (0..8)
                        .map(|i| {
                            format!(
                                "b{i}:{}c/{}if",
                                router.cached_prefix(BackendId(i), &req.blocks),
                                snap.backends[i].inflight
                            )
                        })
                        .collect();
                    println!(
                        "  cold at {now:.2} conv {c} (sys {}) turn {t} -> b{b} {} [{}]",
                        c % 4,
                        route.reason,
                        info.join(" ")
                    );
                }
                per_backend[b] += 1;
                let prev = last_backend.get(&c).copied();
                if let (Some(p), true) = (prev, std::env::var_os("MT_MOVES").is_some()) {
                    if p != b {
                        let home = BackendId(p);
                        let inflight = |id| router.backend(id).map_or(0, |v| v.inflight);
                        let total: u32 = (0..8).map(|i| inflight(BackendId(i))).sum();
                        println!(
                            "  move conv {c} turn {t}: home b{p} cached {} / {} blocks, in flight {} (total {total}); to b{b} cached {} in flight {}",
                            router.cached_prefix(home, &req.blocks),
                            req.blocks.len(),
                            inflight(home),
                            router.cached_prefix(BackendId(b), &req.blocks),
                            inflight(BackendId(b)),
                        );
                        let snap = router.snapshot(at(now));
                        for id in [p, b] {
                            let x = &snap.backends[id];
                            println!(
                                "     b{id}: overhead {:.0} ms prefill {:.0}/s throughput {:.0}/s work {} tokens",
                                x.overhead_ms,
                                x.prefill_tokens_per_s,
                                x.throughput_tokens_per_s,
                                x.inflight_work_tokens
                            );
                        }
                    }
                }
                let moved = last_backend.insert(c, b).is_some_and(|prev| prev != b);
                moves += usize::from(moved);
                let ticket = router.start_attempt(BackendId(b), req, at(now));
                let r = reqs.len();
                reqs.push(InFlight {
                    conv: c,
                    turn: t,
                    backend: b,
                    arrived,
                    moved,
                    queued: engines[b].running >= SLOTS,
                    wait: 0.0,
                    uncached: 0,
                    best_cached: engines
                        .iter()
                        .map(|e| e.cache.cached_tokens(&convs[c].turns[t].sim_blocks))
                        .max()
                        .unwrap_or(0),
                    holders: engines
                        .iter()
                        .filter(|e| e.cache.cached_tokens(&convs[c].turns[t].sim_blocks) >= 2000)
                        .count(),
                    ticket: Some(ticket),
                });
                if engines[b].running < SLOTS {
                    admit(
                        r,
                        now,
                        &mut reqs,
                        &mut engines,
                        &mut heap,
                        &mut push,
                        &mut prompt_tokens,
                        &mut cached_tokens,
                    );
                } else {
                    engines[b].queue.push_back(r);
                }
            }
            Event::FirstToken(r) => {
                let q = &mut reqs[r];
                let ttft = now - q.arrived;
                ttfts.push(ttft * 1e3);
                tail.push((
                    ttft * 1e3,
                    q.turn,
                    q.moved,
                    q.wait * 1e3,
                    q.uncached,
                    q.best_cached,
                    q.holders,
                    now,
                ));
                if std::env::var_os("MT_SLOW").is_some() && ttft > 0.3 {
                    println!(
                        "  slow {:.0} ms at {now:.2} conv {} turn {} moved {} queued {} backend {}",
                        ttft * 1e3,
                        q.conv,
                        q.turn,
                        q.moved,
                        q.queued,
                        q.backend
                    );
                }
                if ttft > 0.325 {
                    slow.0 += 1;
                    slow.1 += usize::from(q.turn == 0);
                    slow.2 += usize::from(q.moved);
                    slow.3 += usize::from(q.queued);
                }
                if let Some(ticket) = q.ticket.as_mut() {
                    router.first_token(ticket, Duration::from_secs_f64(ttft), at(now));
                }
                let e = &mut engines[q.backend];
                e.cache.insert(&convs[q.conv].turns[q.turn].sim_blocks);
                let decode = f64::from(MAX_TOKENS)
                    * TPOT_SECS
                    * (1.0 + BATCH_PENALTY * (e.running.max(1) - 1) as f64);
                push(&mut heap, now + decode, Event::End(r));
            }
            Event::Scrape => {
                for (i, e) in engines.iter().enumerate() {
                    let signal = LoadSignal {
                        waiting: e.queue.len() as u32,
                        running: e.running as u32,
                        kv_cache_usage: None,
                    };
                    router.on_load_signal(BackendId(i), signal, at(now));
                }
                if !heap.is_empty() {
                    push(&mut heap, now + scrape, Event::Scrape);
                }
            }
            Event::End(r) => {
                let (conv, turn, b) = (reqs[r].conv, reqs[r].turn, reqs[r].backend);
                if let Some(ticket) = reqs[r].ticket.take() {
                    router.end_attempt(ticket, Outcome::Success, at(now));
                }
                engines[b].running -= 1;
                if let Some(next) = engines[b].queue.pop_front() {
                    admit(
                        next,
                        now,
                        &mut reqs,
                        &mut engines,
                        &mut heap,
                        &mut push,
                        &mut prompt_tokens,
                        &mut cached_tokens,
                    );
                }
                if turn + 1 < 6 {
                    push(
                        &mut heap,
                        now + convs[conv].think[turn + 1],
                        Event::Arrive(conv, turn + 1),
                    );
                }
            }
        }
    }
    if std::env::var_os("MT_HOLDS").is_some() {
        println!("  holds: {holds}");
    }
    if std::env::var_os("MT_RATES").is_some() {
        for b in router.snapshot(at(0.0)).backends {
            println!(
                "  {} overhead {:.1} ms prefill {:.0} tok/s throughput {:.0} tok/s",
                b.name, b.overhead_ms, b.prefill_tokens_per_s, b.throughput_tokens_per_s
            );
        }
    }
    ttfts.sort_by(f64::total_cmp);
    tail.sort_by(|a, b| b.0.total_cmp(&a.0));
    tail.truncate(20);
    let pct = |p: f64| ttfts[((ttfts.len() as f64 * p).ceil() as usize).clamp(1, ttfts.len()) - 1];
    Outcomes {
        mean_ms: ttfts.iter().sum::<f64>() / ttfts.len() as f64,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        hit_rate: cached_tokens as f64 / prompt_tokens as f64,
        moves,
        per_backend,
        slow,
        thirteenth_ms: ttfts[ttfts.len().saturating_sub(13)],
        tail,
    }
}

/// The bench's settings for the router: default config with the prefix index sized like the
/// sims' caches plus a quarter (32,768 tokens × 4 B / 256 B blocks × 5 / 4), as
/// docs/config.md tells operators to size it, and the engines' batch limit (4 slots), as an
/// operator sets it from the engine's flags (`MT_LEARN_SLOTS=1` leaves it to be learned).
fn bench_config() -> RouterConfig {
    let mut cfg = RouterConfig {
        prefix_capacity_blocks: CACHE_TOKENS * BYTES_PER_TOKEN / ROUTER_BLOCK_BYTES * 5 / 4,
        ..RouterConfig::default()
    };
    if std::env::var_os("MT_LEARN_SLOTS").is_none() {
        cfg.cost.batch_slots = Some(SLOTS as u32);
    }
    cfg
}

#[test]
#[ignore = "a report, not a check: cargo test -p tokenway-router --test multi_turn -- --ignored --nocapture"]
fn report_policies_on_the_multi_turn_workload() {
    for seed in 1..=3 {
        for (name, policy, cfg) in [
            ("cost", Policy::CostAware, bench_config()),
            (
                "cost/default index",
                Policy::CostAware,
                RouterConfig::default(),
            ),
            ("round_robin", Policy::RoundRobin, bench_config()),
            ("least_inflight", Policy::LeastInflight, bench_config()),
        ] {
            let o = run(policy, cfg, seed);
            print_outcome(seed, name, &o);
        }
    }
}

fn print_outcome(seed: u64, name: &str, o: &Outcomes) {
    println!(
        "seed {seed} {name:20} mean {:6.1} p50 {:6.1} p99 {:6.1} hit {:4.1}% moves {:3} slow(all,t0,moved,queued) {:?} per backend {:?}",
        o.mean_ms,
        o.p50_ms,
        o.p99_ms,
        o.hit_rate * 100.0,
        o.moves,
        o.slow,
        o.per_backend
    );
}

#[test]
#[ignore = "a report: the cost policy's load-bound slack"]
fn report_load_bound_epsilon() {
    for seed in 1..=3 {
        for (eps, home) in [
            (Some(0.5), Some(2.0)),
            (Some(1.0), Some(2.0)),
            (Some(1.5), Some(2.0)),
        ] {
            let mut cfg = bench_config();
            cfg.cost.load_bound_epsilon = eps;
            cfg.cost.load_bound_home_epsilon = home;
            let o = run(Policy::CostAware, cfg, seed);
            print_outcome(seed, &format!("cost eps {eps:?}/{home:?}"), &o);
        }
    }
}

#[test]
fn the_cost_policy_keeps_conversations_home_and_beats_round_robin() {
    let cost = run(Policy::CostAware, bench_config(), 1);
    let rr = run(Policy::RoundRobin, bench_config(), 1);
    assert!(
        cost.mean_ms <= 0.6 * rr.mean_ms,
        "mean {cost:?} vs round robin {rr:?}"
    );
    assert!(cost.p99_ms <= rr.p99_ms, "{cost:?} vs {rr:?}");
    // Of the 1,000 later turns, few change backend (round robin: ~880).
    assert!(cost.moves <= 60, "{cost:?}");
    assert!(cost.hit_rate >= 0.85, "{cost:?}");
    // Spread: no backend idles while another takes twice the average.
    assert!(
        cost.per_backend.iter().all(|&n| (50..=300).contains(&n)),
        "{cost:?}"
    );
}

/// Sums over seeds of what decides the p99 of the 1,200 requests.
#[derive(Debug, Default)]
struct Totals {
    mean_ms: f64,
    thirteenth_ms: f64,
    slow: usize,
    first_turns: usize,
    moved: usize,
    queued: usize,
    moves: usize,
}

fn totals(cfg: RouterConfig, seeds: u64) -> Totals {
    let mut t = Totals::default();
    for seed in 1..=seeds {
        let o = run(Policy::CostAware, cfg, seed);
        t.mean_ms += o.mean_ms / seeds as f64;
        t.thirteenth_ms += o.thirteenth_ms / seeds as f64;
        t.slow += o.slow.0;
        t.first_turns += o.slow.1;
        t.moved += o.slow.2;
        t.queued += o.slow.3;
        t.moves += o.moves;
    }
    t
}

#[test]
#[ignore = "a report: cargo test -p tokenway-router --release --test multi_turn -- --ignored --nocapture report_new_conversation_placement"]
fn report_new_conversation_placement() {
    let seeds = 6;
    let with = |f: &dyn Fn(&mut RouterConfig)| {
        let mut c = bench_config();
        f(&mut c);
        c
    };
    for (name, cfg) in [
        (
            "in-flight bound, home eps 2 (before)",
            with(&|c| {
                c.cost.share_epsilon = None;
                c.cost.load_bound_home_epsilon = Some(2.0);
            }),
        ),
        (
            "in-flight bound, home eps 4",
            with(&|c| c.cost.share_epsilon = None),
        ),
        (
            "share 0.25, home eps 2",
            with(&|c| c.cost.load_bound_home_epsilon = Some(2.0)),
        ),
        ("share 0.25, home eps 4 (default)", bench_config()),
        (
            "share 0.25, no home bound",
            with(&|c| c.cost.load_bound_home_epsilon = None),
        ),
        (
            "share 0.1, home eps 4",
            with(&|c| c.cost.share_epsilon = Some(0.1)),
        ),
        (
            "share 0.5, home eps 4",
            with(&|c| c.cost.share_epsilon = Some(0.5)),
        ),
        (
            "share 0.25 over 5 s, home eps 4",
            with(&|c| c.cost.share_window = Duration::from_secs(5)),
        ),
        (
            "share 0.25 over 20 s, home eps 4",
            with(&|c| c.cost.share_window = Duration::from_secs(20)),
        ),
    ] {
        let t = totals(cfg, seeds);
        println!(
            "{name:36} mean {:6.1} 13th slowest {:6.1} | over 325 ms, {seeds} seeds: {:3} (first turns {:3}, moved {:3}, queued {:3}) | backend changes {:4}",
            t.mean_ms, t.thirteenth_ms, t.slow, t.first_turns, t.moved, t.queued, t.moves
        );
    }
}

#[test]
#[ignore = "a report: the 20 slowest requests per seed (MT_SEEDS, default 3)"]
fn report_tail() {
    let seeds: u64 = std::env::var("MT_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let mut cfg = bench_config();
    if let Some(f) = std::env::var("MT_CAP")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
    {
        cfg.prefix_capacity_blocks = (cfg.prefix_capacity_blocks as f64 * f) as usize;
    }
    if let Some(f) = std::env::var("MT_HOLD_MS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        cfg.cost.prefill_hold_max = Duration::from_millis(f);
    }
    if let Some(f) = std::env::var("MT_SHARE_EPS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
    {
        cfg.cost.share_epsilon = Some(f);
    }
    let (mut sum13, mut slow) = (0.0, 0);
    for seed in 1..=seeds {
        let o = run(Policy::CostAware, cfg, seed);
        sum13 += o.thirteenth_ms / seeds as f64;
        slow += o.slow.0;
        print_outcome(seed, "cost", &o);
        if std::env::var_os("MT_QUIET").is_some() {
            continue;
        }
        for (i, (ttft, turn, moved, wait, uncached, best, holders, at)) in o.tail.iter().enumerate()
        {
            println!(
                "  #{:2} {ttft:6.1} ms at {at:6.2} turn {turn} moved {moved:5} wait {wait:6.1} ms uncached {uncached:5} best cached {best:5} holders {holders}",
                i + 1
            );
        }
    }
    println!("13th slowest, mean over {seeds} seeds: {sum13:.1} ms; over 325 ms: {slow}");
}
