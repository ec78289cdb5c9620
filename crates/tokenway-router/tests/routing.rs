//! Behaviour of the `cost` policy, session affinity, health additions and hedging, driven
//! through the public API with simulated time (a base `Instant` plus durations).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use tokenway_router::{
    prompt_blocks, BackendId, BackendSpec, EjectReason, HealthPhase, HealthTransition, HedgeConfig,
    HedgeWinner, LoadSignal, Outcome, Policy, RouteError, RouteReason, RouteRequest, Router,
    RouterConfig, SessionKind,
};

const M: &str = "llama-3-8b";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn spec(name: &str, region: &str, max_inflight: u32) -> BackendSpec {
    BackendSpec {
        name: name.to_owned(),
        region: region.to_owned(),
        models: vec![M.to_owned()],
        max_inflight,
        prefix_capacity_blocks: None,
    }
}

fn cost_router(names: &[&str]) -> Router {
    let mut r = Router::with_config(Policy::CostAware, RouterConfig::default(), 1);
    for n in names {
        r.add_backend(spec(n, "eu", 0));
    }
    r
}

fn session(key: &str) -> RouteRequest {
    RouteRequest::new(M)
        .with_session(SessionKind::Header, key)
        .with_prompt_tokens(200)
}

fn first(r: &mut Router, req: &RouteRequest, now: Instant) -> BackendId {
    r.route(req, now).expect("eligible backends").backends[0]
}

/// Start `n` attempts on `id` that stay in flight.
fn load(r: &mut Router, id: BackendId, n: usize, prompt_tokens: u32, now: Instant) {
    let req = RouteRequest::new(M).with_prompt_tokens(prompt_tokens);
    for _ in 0..n {
        let _in_flight = r.start_attempt(id, &req, now);
    }
}

#[test]
fn a_conversation_stays_on_its_backend_while_load_is_balanced() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a:8000", "b:8000", "c:8000", "d:8000"]);
    let home = first(&mut r, &session("conv-1"), t0);
    for turn in 0..6u64 {
        let now = t0 + ms(1000 * turn);
        // Other traffic keeps every backend equally busy.
        for i in 0..4 {
            load(&mut r, BackendId(i), 1, 100, now);
        }
        let route = r.route(&session("conv-1"), now).expect("eligible");
        assert_eq!(route.backends[0], home, "turn {turn}");
        assert_eq!(
            route.reason,
            RouteReason::Session {
                kind: SessionKind::Header,
                spilled: false
            }
        );
    }
}

#[test]
fn a_hot_session_spills_past_the_load_bound_and_comes_back() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a:8000", "b:8000", "c:8000", "d:8000"]);
    let req = session("hot");
    let home = first(&mut r, &req, t0);
    let mut tickets = Vec::new();
    let mut spilled_to = None;
    for _ in 0..10 {
        let route = r.route(&req, t0).expect("eligible");
        let id = route.backends[0];
        if id != home {
            assert!(matches!(
                route.reason,
                RouteReason::Session { spilled: true, .. }
            ));
            spilled_to = Some(id);
            break;
        }
        tickets.push(r.start_attempt(id, &req, t0));
    }
    // Bound ceil(1.25 × (in-flight + 1) / 4): the home takes one attempt, and with it in
    // flight the bound is ceil(1.25 × 2 / 4) = 1, so the next turn spills.
    let spilled_to = spilled_to.expect("the hot session spilled");
    assert_ne!(spilled_to, home);
    assert_eq!(r.backend(home).expect("home").inflight, 1);
    for t in tickets {
        let _ = r.end_attempt(t, Outcome::Success, t0 + ms(10));
    }
    assert_eq!(first(&mut r, &req, t0 + ms(10)), home);
}

#[test]
fn two_router_replicas_agree_on_session_placement() {
    let t0 = Instant::now();
    let names = [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
        "10.0.0.3:8000",
        "10.0.0.4:8000",
    ];
    let mut r1 = cost_router(&names);
    // The second replica discovered the backends in another order and has other load.
    let mut reversed = names;
    reversed.reverse();
    let mut r2 = cost_router(&reversed);
    for i in 0..4 {
        load(&mut r2, BackendId(i), 1, 0, t0);
    }
    for k in 0..200 {
        let req = session(&format!("user-{k}"));
        let a = first(&mut r1, &req, t0);
        let b = first(&mut r2, &req, t0);
        let name1 = r1.backend(a).expect("a").name.to_owned();
        let name2 = r2.backend(b).expect("b").name.to_owned();
        assert_eq!(name1, name2, "session user-{k}");
    }
}

#[test]
fn adding_or_removing_a_backend_moves_only_the_sessions_it_takes_or_held() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a", "b", "c", "d"]);
    let keys: Vec<String> = (0..400).map(|k| format!("s{k}")).collect();
    let place = |r: &mut Router| -> Vec<String> {
        keys.iter()
            .map(|k| {
                let id = first(r, &session(k), t0);
                r.backend(id).expect("placed").name.to_owned()
            })
            .collect()
    };
    let before = place(&mut r);
    let e = r.add_backend(spec("e", "eu", 0));
    let added = place(&mut r);
    let mut moved = 0;
    for (b, a) in before.iter().zip(&added) {
        if b != a {
            assert_eq!(a, "e", "a session moved between old backends");
            moved += 1;
        }
    }
    // About 1/5 of the sessions move to the new backend.
    assert!((40..=120).contains(&moved), "{moved} moved");
    assert!(r.remove_backend(e));
    assert_eq!(place(&mut r), before);
    assert!(r.remove_backend(BackendId(0)));
    let removed = place(&mut r);
    for (b, a) in before.iter().zip(&removed) {
        if b != "a" {
            assert_eq!(a, b);
        }
    }
}

#[test]
fn a_near_backend_beats_a_far_one_unless_it_is_saturated() {
    let t0 = Instant::now();
    let mut r = Router::with_config(Policy::CostAware, RouterConfig::default(), 1);
    let near = r.add_backend(spec("near", "eu", 0));
    let far = r.add_backend(spec("far", "us", 0));
    r.on_rtt_sample(near, ms(2), t0);
    r.on_rtt_sample(far, ms(60), t0);
    let req = RouteRequest::new(M)
        .with_client_region("eu")
        .with_prompt_tokens(300);
    for _ in 0..5 {
        assert_eq!(first(&mut r, &req, t0), near);
    }
    // Saturate the near one with long requests.
    load(&mut r, near, 8, 2000, t0);
    assert_eq!(first(&mut r, &req, t0), far);
}

/// The share bound spreads new conversations over backends that serve them about as fast; it
/// does not send a fixed share to one many times slower (here 400 ms away: before, it took
/// about 3 in 8 of a steady single-turn load that the near one served at once).
#[test]
fn the_share_bound_does_not_send_traffic_to_a_backend_many_times_slower() {
    let t0 = Instant::now();
    let mut r = Router::with_config(Policy::CostAware, RouterConfig::default(), 1);
    let fast = r.add_backend(spec("fast", "eu", 0));
    let slow = r.add_backend(spec("slow", "eu", 0));
    r.on_rtt_sample(fast, ms(1), t0);
    r.on_rtt_sample(slow, ms(400), t0);
    let req = RouteRequest::new(M)
        .with_client_region("eu")
        .with_prompt_tokens(100);
    let mut to_slow = 0;
    for i in 0..100u64 {
        let now = t0 + ms(100 * i);
        let id = first(&mut r, &req, now);
        to_slow += usize::from(id == slow);
        let mut t = r.start_attempt(id, &req, now);
        let _ = r.first_token(&mut t, ms(20), now + ms(20));
        let _ = r.end_attempt(t, Outcome::Success, now + ms(50));
    }
    assert!(to_slow < 10, "{to_slow} of 100 went to the slow backend");
}

/// Sessions are placed in the client's region while that region's backend is within the load
/// bound of the whole fleet; a busy region spills them to the others (before, the only eu
/// backend took every eu session up to its `max_inflight`, the others idle).
#[test]
fn sessions_leave_a_busy_region_for_the_rest_of_the_fleet() {
    let t0 = Instant::now();
    let mut r = Router::with_config(Policy::CostAware, RouterConfig::default(), 1);
    let eu = r.add_backend(spec("eu-1", "eu", 0));
    let _us1 = r.add_backend(spec("us-1", "us", 0));
    let _us2 = r.add_backend(spec("us-2", "us", 0));
    let alice = session("alice").with_client_region("eu");
    assert_eq!(
        first(&mut r, &alice, t0),
        eu,
        "an idle region keeps its sessions"
    );
    load(&mut r, eu, 40, 200, t0);
    let routed = r.route(&alice, t0).expect("eligible backends");
    assert_ne!(routed.backends[0], eu, "{:?}", routed.reason);
}

#[test]
fn the_cross_region_penalty_alone_keeps_traffic_in_region() {
    let t0 = Instant::now();
    let mut r = Router::with_config(Policy::CostAware, RouterConfig::default(), 1);
    let us = r.add_backend(spec("us", "us", 0));
    let eu = r.add_backend(spec("eu", "eu", 0));
    let req = RouteRequest::new(M).with_client_region("eu");
    for _ in 0..4 {
        assert_eq!(first(&mut r, &req, t0), eu);
    }
    let req = RouteRequest::new(M).with_client_region("us");
    assert_eq!(first(&mut r, &req, t0), us);
}

#[test]
fn a_prefix_cached_backend_wins_long_prompts_but_not_when_overloaded() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a", "b", "c"]);
    let system = vec![b'x'; 32_000];
    let blocks = prompt_blocks(&system, 256);
    let long = RouteRequest::new(M)
        .with_blocks(blocks.clone())
        .with_prompt_tokens(8_000);
    // The first request warms backend a's cache.
    let t = r.start_attempt(BackendId(0), &long, t0);
    let _ = r.end_attempt(t, Outcome::Success, t0 + ms(900));
    assert_eq!(r.cached_prefix(BackendId(0), &blocks), blocks.len());
    let route = r.route(&long, t0 + ms(1000)).expect("eligible");
    assert_eq!(route.backends[0], BackendId(0));
    assert_eq!(route.cached_blocks, blocks.len());
    // Overloaded: forty long requests in flight outweigh the 8000 cached tokens.
    load(&mut r, BackendId(0), 40, 1_000, t0 + ms(1000));
    assert_ne!(first(&mut r, &long, t0 + ms(1000)), BackendId(0));
}

#[test]
fn a_partly_matching_prompt_prefers_the_backend_holding_the_longer_prefix() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a", "b"]);
    let mut text = vec![b's'; 8_192];
    let short = prompt_blocks(&text, 256);
    text.extend(vec![b't'; 8_192]);
    let full = prompt_blocks(&text, 256);
    r.on_routed(BackendId(0), &short);
    r.on_routed(BackendId(1), &full);
    let req = RouteRequest::new(M)
        .with_blocks(full.clone())
        .with_prompt_tokens(4_096);
    assert_eq!(first(&mut r, &req, t0), BackendId(1));
    assert_eq!(r.cached_prefix(BackendId(0), &full), short.len());
}

#[test]
fn fresh_engine_load_signals_steer_away_and_stale_ones_are_ignored() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a", "b"]);
    let req = RouteRequest::new(M).with_prompt_tokens(100);
    // Other gateways keep backend a busy.
    let busy = LoadSignal {
        waiting: 30,
        running: 16,
        kv_cache_usage: Some(0.97),
    };
    r.on_load_signal(BackendId(0), busy, t0);
    for k in 0..4 {
        assert_eq!(first(&mut r, &req, t0 + ms(100 * k)), BackendId(1));
    }
    let later = t0 + Duration::from_secs(60);
    let firsts: BTreeSet<BackendId> = (0..4).map(|_| first(&mut r, &req, later)).collect();
    assert!(firsts.contains(&BackendId(0)), "stale signal still used");
}

#[test]
fn prefill_rate_and_overhead_are_learned_from_first_tokens() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a"]);
    r.on_rtt_sample(BackendId(0), ms(10), t0);
    // The engine: 30 ms fixed + prompt tokens at 4000 tokens/s, plus the 10 ms RTT.
    for i in 0..200u64 {
        let tokens = (i * 997) % 6_000 + 100;
        let req = RouteRequest::new(M).with_prompt_tokens(tokens as u32);
        let now = t0 + ms(100 * i);
        let mut t = r.start_attempt(BackendId(0), &req, now);
        let ttft = Duration::from_secs_f64(0.010 + 0.030 + tokens as f64 / 4000.0);
        let _ = r.first_token(&mut t, ttft, now + ttft);
        let _ = r.end_attempt(t, Outcome::Success, now + ttft);
    }
    let s = r.snapshot(t0 + Duration::from_secs(30));
    let b = &s.backends[0];
    assert!(
        (3_600.0..4_400.0).contains(&b.prefill_tokens_per_s),
        "{}",
        b.prefill_tokens_per_s
    );
    assert!((10.0..50.0).contains(&b.overhead_ms), "{}", b.overhead_ms);
    assert_eq!(b.inflight, 0);
    assert_eq!(b.inflight_work_tokens, 0);
}

#[test]
fn a_stalled_backend_is_ejected_at_the_first_stall_and_readmitted_after_a_good_trial() {
    let t0 = Instant::now();
    let mut r = cost_router(&["hung", "ok"]);
    let hung = BackendId(0);
    let req = RouteRequest::new(M).with_prompt_tokens(10);
    let mut t = r.start_attempt(hung, &req, t0);
    // The gateway's stall timeout (say 2 s) passes with no token.
    assert_eq!(
        r.stalled(&mut t, t0 + ms(2000)),
        Some(HealthTransition::Ejected {
            reason: EjectReason::Stalls { consecutive: 1 }
        })
    );
    // The Timeout the gateway then reports is not a second failure, nor a re-admission.
    assert_eq!(r.end_attempt(t, Outcome::Timeout, t0 + ms(2000)), None);
    assert_eq!(r.rank(M, t0 + ms(2500)), Ok(vec![BackendId(1)]));
    // After min_ejection (1 s) the next request is its trial.
    let route = r.route(&req, t0 + ms(3000)).expect("eligible");
    assert_eq!(route.backends, vec![hung, BackendId(1)]);
    assert_eq!(route.reason, RouteReason::HalfOpenTrial);
    let mut trial = r.start_attempt(hung, &req, t0 + ms(3000));
    assert!(trial.is_trial());
    // Ejected for a stall, its trial passes with the whole answer, not its first token.
    assert_eq!(r.first_token(&mut trial, ms(40), t0 + ms(3040)), None);
    assert_eq!(r.backend(hung).map(|v| v.healthy), Some(false));
    assert_eq!(
        r.end_attempt(trial, Outcome::Success, t0 + ms(3100)),
        Some(HealthTransition::Readmitted)
    );
    assert_eq!(r.backend(hung).map(|v| v.healthy), Some(true));
}

#[test]
fn half_open_lets_exactly_one_trial_through() {
    let t0 = Instant::now();
    let mut r = cost_router(&["down", "ok"]);
    let down = BackendId(0);
    r.on_attempt_end(down, Outcome::ConnectError, t0);
    let req = RouteRequest::new(M);
    let at = t0 + ms(1000);
    let ranks: Vec<Vec<BackendId>> = (0..5)
        .map(|_| r.route(&req, at).expect("eligible").backends)
        .collect();
    let with_down = ranks.iter().filter(|v| v.contains(&down)).count();
    assert_eq!(with_down, 1, "{ranks:?}");
    assert_eq!(ranks[0][0], down);
    let trial = r.start_attempt(down, &req, at);
    assert!(trial.is_trial());
    assert_eq!(r.snapshot(at).backends[0].state, HealthPhase::Trial,);
    // While the trial runs, nothing else goes there.
    for k in 1..5 {
        assert_eq!(r.rank(M, at + ms(500 * k)), Ok(vec![BackendId(1)]));
    }
    // It fails: ejected again, a new trial after twice min_ejection (a second strike).
    assert_eq!(
        r.end_attempt(trial, Outcome::ConnectError, at + ms(100)),
        Some(HealthTransition::Ejected {
            reason: EjectReason::TrialFailed
        })
    );
    // Its trial could not connect either (an engine still loading): probes may still re-admit
    // it once it answers, after the doubled hold, where it used to wait for the next trial.
    {
        let mut probed = r.clone();
        assert_eq!(probed.on_probe(down, true, at + ms(2_200)), None);
        assert_eq!(
            probed.on_probe(down, true, at + ms(2_300)),
            Some(HealthTransition::Readmitted)
        );
    }
    assert_eq!(r.rank(M, at + ms(2099)), Ok(vec![BackendId(1)]));
    assert_eq!(r.rank(M, at + ms(2100)), Ok(vec![down, BackendId(1)]));
}

#[test]
fn passive_ejection_spares_the_last_healthy_backend_and_half_the_fleet() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a", "b", "c", "d"]);
    // A fleet-wide slowdown: every backend's requests time out.
    let mut ejected = 0;
    for round in 0..3 {
        for id in 0..4 {
            let at = t0 + ms(10 * round);
            if r.on_attempt_end(BackendId(id), Outcome::Timeout, at)
                .is_some()
            {
                ejected += 1;
            }
        }
    }
    assert_eq!(ejected, 2, "at most half the fleet is ejected passively");
    // Two backends serving the model: the second is never ejected passively.
    let mut r = cost_router(&["a", "b"]);
    for round in 0..5 {
        r.on_attempt_end(BackendId(0), Outcome::ServerError, t0 + ms(round));
    }
    assert_eq!(r.backend(BackendId(0)).map(|v| v.healthy), Some(false));
    for round in 0..5 {
        assert_eq!(
            r.on_attempt_end(BackendId(1), Outcome::ServerError, t0 + ms(round)),
            None
        );
    }
    assert_eq!(r.backend(BackendId(1)).map(|v| v.healthy), Some(true));
}

#[test]
fn the_only_backend_gets_its_trial_instead_of_no_healthy_backend() {
    let t0 = Instant::now();
    let mut r = cost_router(&["solo"]);
    r.on_attempt_end(BackendId(0), Outcome::ConnectError, t0);
    assert!(matches!(
        r.rank(M, t0 + ms(10)),
        Err(RouteError::NoHealthyBackend { .. })
    ));
    assert_eq!(r.rank(M, t0 + ms(1000)), Ok(vec![BackendId(0)]));
    assert!(matches!(
        r.rank(M, t0 + ms(1001)),
        Err(RouteError::NoHealthyBackend { .. })
    ));
}

#[test]
fn sustained_ttft_outliers_against_the_backends_own_history_eject_it() {
    let t0 = Instant::now();
    let mut r = cost_router(&["slow", "ok"]);
    let id = BackendId(0);
    let req = RouteRequest::new(M).with_prompt_tokens(10);
    let mut now = t0;
    let attempt = |r: &mut Router, ttft: Duration, now: Instant| {
        let mut t = r.start_attempt(id, &req, now);
        let tr = r.first_token(&mut t, ttft, now + ttft);
        let _ = r.end_attempt(t, Outcome::Success, now + ttft);
        tr
    };
    for i in 0..40 {
        now += ms(100);
        assert_eq!(attempt(&mut r, ms(80 + i % 20), now), None);
    }
    // One slow first token is not enough, and a normal one resets the count.
    now += ms(100);
    assert_eq!(attempt(&mut r, ms(2_000), now), None);
    assert_eq!(attempt(&mut r, ms(90), now), None);
    assert_eq!(attempt(&mut r, ms(2_000), now), None);
    assert_eq!(attempt(&mut r, ms(2_000), now), None);
    assert_eq!(
        attempt(&mut r, ms(2_000), now),
        Some(HealthTransition::Ejected {
            reason: EjectReason::TtftOutliers { consecutive: 3 }
        })
    );
    // Its trial with another slow first token fails (before, it re-admitted the backend,
    // which its own outliers then kept from being ejected again); a normal one re-admits.
    // (The ejection came with the first token, 2 s after its request; the hold is 1 s.)
    now += ms(3_100);
    let route = r.route(&req, now).expect("eligible");
    assert_eq!(route.reason, RouteReason::HalfOpenTrial);
    assert_eq!(
        attempt(&mut r, ms(2_000), now),
        Some(HealthTransition::Ejected {
            reason: EjectReason::TrialFailed
        })
    );
    // A second strike: the next trial waits twice the hold, after that failure.
    now += ms(4_100);
    let route = r.route(&req, now).expect("eligible");
    assert_eq!(route.reason, RouteReason::HalfOpenTrial);
    assert_eq!(
        attempt(&mut r, ms(90), now),
        Some(HealthTransition::Readmitted)
    );
}

#[test]
fn a_whole_answer_is_no_first_token_nor_an_outlier_but_ends_a_trial() {
    // A request that is not streamed gets its first byte when the generation is done: minutes
    // for a long one. That must not read as a slow first token (an outlier ejection, a peak
    // EWMA that steers streams away), nor corrupt the decode estimate.
    let t0 = Instant::now();
    let mut r = cost_router(&["busy", "ok"]);
    let id = BackendId(0);
    let streamed = RouteRequest::new(M).with_prompt_tokens(10);
    let whole = streamed
        .clone()
        .with_whole_answer(true)
        .with_max_output_tokens(4000);
    let mut now = t0;
    for i in 0..40 {
        now += ms(100);
        let mut t = r.start_attempt(id, &streamed, now);
        assert_eq!(r.first_token(&mut t, ms(80 + i % 20), now), None);
        let _ = r.end_attempt(t, Outcome::Success, now + ms(50));
    }
    let ewma = r.backend(id).and_then(|v| v.ewma_ttft);
    let before = r.snapshot(now).backends[0].clone();
    for _ in 0..10 {
        now += ms(100);
        let mut t = r.start_attempt(id, &whole, now);
        assert_eq!(r.first_token(&mut t, ms(90_000), now + ms(90_000)), None);
        assert_eq!(r.end_attempt(t, Outcome::Success, now + ms(90_001)), None);
    }
    let after = r.snapshot(now).backends[0].clone();
    assert_eq!(r.backend(id).map(|v| v.healthy), Some(true));
    assert_eq!(r.backend(id).and_then(|v| v.ewma_ttft), ewma);
    assert_eq!(after.prefill_tokens_per_s, before.prefill_tokens_per_s);
    assert_eq!(after.overhead_ms, before.overhead_ms);
    assert_eq!(after.decode_ms_per_token, before.decode_ms_per_token);
    assert!(before.decode_ms_per_token.is_some_and(|d| d > 0.0));
    assert_eq!(after.inflight_work_tokens, 0);

    // Ejected, its trial may be a whole answer: the answer re-admits it.
    r.on_attempt_end(id, Outcome::ConnectError, now);
    let at = now + ms(1000);
    let mut trial = r.start_attempt(id, &whole, at);
    assert!(trial.is_trial());
    assert_eq!(
        r.first_token(&mut trial, ms(30_000), at + ms(30_000)),
        Some(HealthTransition::Readmitted)
    );
    assert_eq!(
        r.end_attempt(trial, Outcome::Success, at + ms(30_001)),
        None
    );
    assert_eq!(r.backend(id).map(|v| v.healthy), Some(true));
}

#[test]
fn the_last_healthy_backend_of_a_model_is_not_ejected_for_slow_first_tokens() {
    // A burst that slows every first token (here: the only backend) must not turn slow answers
    // into 503s; once another backend serves the model, the same streak ejects.
    let t0 = Instant::now();
    let mut r = cost_router(&["solo"]);
    let id = BackendId(0);
    let req = RouteRequest::new(M).with_prompt_tokens(10);
    let attempt = |r: &mut Router, ttft: Duration, now: Instant| {
        let mut t = r.start_attempt(id, &req, now);
        let tr = r.first_token(&mut t, ttft, now + ttft);
        let _ = r.end_attempt(t, Outcome::Success, now + ttft);
        tr
    };
    let mut now = t0;
    for i in 0..60 {
        now += ms(100);
        assert_eq!(attempt(&mut r, ms(80 + i % 20), now), None);
    }
    // Three in a row would eject it if another backend served the model.
    for _ in 0..3 {
        now += ms(100);
        assert_eq!(attempt(&mut r, ms(2_000), now), None);
    }
    assert!(r.rank(M, now).is_ok());
    r.add_backend(spec("other", "eu", 0));
    let mut last = None;
    for _ in 0..3 {
        now += ms(100);
        last = attempt(&mut r, ms(2_000), now);
    }
    assert_eq!(
        last,
        Some(HealthTransition::Ejected {
            reason: EjectReason::TtftOutliers { consecutive: 3 }
        })
    );
}

/// A `cost` router with hedging on and two backends, `a` and `b`.
fn hedging_router() -> (Router, BackendId, BackendId) {
    let cfg = RouterConfig {
        hedge: HedgeConfig {
            enabled: true,
            ..HedgeConfig::default()
        },
        ..RouterConfig::default()
    };
    let mut r = Router::with_config(Policy::CostAware, cfg, 1);
    let a = r.add_backend(spec("a", "eu", 0));
    let b = r.add_backend(spec("b", "eu", 0));
    (r, a, b)
}

#[test]
fn hedge_delay_tracks_the_backends_recent_p95() {
    let t0 = Instant::now();
    let (mut r, a, b) = hedging_router();
    let plain = RouteRequest::new(M);
    assert_eq!(r.hedge_delay(a, &plain, t0), None, "no samples yet");
    for i in 1..=100u64 {
        r.on_first_byte(a, ms(i), t0 + ms(i));
    }
    // The last 64 samples are 37..=100 ms; nearest-rank p95 is the 61st: 97 ms.
    assert_eq!(r.hedge_delay(a, &plain, t0), Some(ms(97)));
    // A lasting change of regime is learned (240 ms stays under the outlier floor).
    for _ in 0..64 {
        r.on_first_byte(a, ms(240), t0 + ms(200));
    }
    assert_eq!(r.hedge_delay(a, &plain, t0), Some(ms(240)));
    // The budget caps hedges: 10 saved up, then one per ten routed requests.
    let sent = (0..20).filter(|_| r.on_hedge_sent(t0)).count();
    assert_eq!(sent, 10);
    assert_eq!(r.hedge_delay(a, &plain, t0), None);
    // Earned by attempts started, not by routing (a held request is routed many times).
    for _ in 0..20 {
        r.rank(M, t0).expect("eligible");
    }
    assert_eq!(r.hedge_delay(a, &plain, t0), None);
    for _ in 0..11 {
        let t = r.start_attempt(a, &plain, t0);
        r.end_attempt(t, Outcome::ClientCancelled, t0);
    }
    assert!(r.hedge_delay(a, &plain, t0).is_some());
    r.on_hedge_result(a, b, HedgeWinner::Hedge, t0);
    let s = r.snapshot(t0);
    assert_eq!(
        (s.backends[0].hedges_lost, s.backends[1].hedges_won),
        (1, 1)
    );
    assert_eq!(s.hedges_sent, 10);
}

#[test]
fn a_request_expected_late_is_not_hedged_before_its_expected_first_token() {
    let t0 = Instant::now();
    let (mut r, a, _) = hedging_router();
    // Recent first tokens of short chat turns: p95 97 ms.
    for i in 1..=100u64 {
        r.on_first_byte(a, ms(i), t0 + ms(i));
    }
    let short = RouteRequest::new(M).with_prompt_tokens(100);
    assert_eq!(r.hedge_delay(a, &short, t0), Some(ms(97)));
    // 20,000 uncached prompt tokens at the prior 10,000 tokens/s, plus the 50 ms prior
    // overhead: expected at 2.05 s; hedged only past 1.5 times that, not at the p95.
    let long = RouteRequest::new(M).with_prompt_tokens(20_000);
    let delay = r.hedge_delay(a, &long, t0).expect("armed");
    assert!(
        (ms(3_000)..=ms(3_200)).contains(&delay),
        "{delay:?} for a first token expected at ~2.05 s"
    );
    // Never past max_delay (10 s), however long the prompt.
    let huge = RouteRequest::new(M).with_prompt_tokens(1_000_000);
    assert_eq!(r.hedge_delay(a, &huge, t0), Some(Duration::from_secs(10)));
}

#[test]
fn hedging_is_off_by_default() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a"]);
    for i in 0..50 {
        r.on_first_byte(BackendId(0), ms(10 + i), t0);
    }
    assert_eq!(r.hedge_delay(BackendId(0), &RouteRequest::new(M), t0), None);
    assert!(!r.on_hedge_sent(t0));
}

#[test]
fn the_snapshot_serializes_state_rtt_load_and_cache_hits() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a", "b"]);
    r.on_rtt_sample(BackendId(0), ms(12), t0);
    r.on_load_signal(
        BackendId(0),
        LoadSignal {
            waiting: 1,
            running: 3,
            kv_cache_usage: Some(0.5),
        },
        t0,
    );
    let blocks = prompt_blocks(&[1u8; 1024], 256);
    let req = RouteRequest::new(M)
        .with_blocks(blocks)
        .with_prompt_tokens(256);
    let t = r.start_attempt(BackendId(0), &req, t0);
    let t2 = r.start_attempt(BackendId(0), &req, t0);
    r.on_attempt_end(BackendId(1), Outcome::ConnectError, t0);
    let json = serde_json::to_value(r.snapshot(t0 + ms(500))).expect("serializes");
    let a = &json["backends"][0];
    assert_eq!(json["policy"], "cost");
    assert_eq!(a["state"], "healthy");
    assert_eq!(a["rtt_ms"], 12.0);
    assert_eq!(a["inflight"], 2);
    assert_eq!(a["load"]["waiting"], 1);
    assert_eq!(a["cache_hit_ratio"], 0.5);
    assert_eq!(json["backends"][1]["state"], "ejected");
    assert_eq!(json["backends"][1]["eject_reason"], "connect_error");
    assert_eq!(json["backends"][1]["ejected_for_ms"], 500.0);
    let _ = r.end_attempt(t, Outcome::Success, t0);
    let _ = r.end_attempt(t2, Outcome::Success, t0);
}

#[test]
fn the_cost_policy_sees_load_through_the_id_api_too() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a", "b"]);
    for _ in 0..3 {
        r.on_attempt_start(BackendId(0), t0);
    }
    for _ in 0..4 {
        assert_eq!(r.rank(M, t0).expect("eligible")[0], BackendId(1));
    }
}

#[test]
fn the_id_api_still_counts_load_and_health() {
    let t0 = Instant::now();
    let mut r = cost_router(&["a", "b"]);
    r.on_attempt_start(BackendId(0), t0);
    r.on_first_byte(BackendId(0), ms(50), t0);
    assert_eq!(r.backend(BackendId(0)).map(|v| v.inflight), Some(1));
    assert_eq!(r.on_attempt_end(BackendId(0), Outcome::Success, t0), None);
    assert!(r.on_stall(BackendId(1), t0).is_some());
    assert_eq!(r.rank(M, t0), Ok(vec![BackendId(0)]));
}

/// Per backend: (serves the model, max_inflight, attempts started, ejected, region is eu).
fn fleet() -> impl Strategy<Value = Vec<(bool, u32, u32, bool, bool)>> {
    proptest::collection::vec(
        (
            any::<bool>(),
            0u32..4,
            0u32..5,
            any::<bool>(),
            any::<bool>(),
        ),
        0..10,
    )
}

proptest! {
    #[test]
    fn route_is_a_permutation_of_the_eligible_backends(
        backends in fleet(),
        policy in prop::sample::select(Policy::ALL.to_vec()),
        seed in any::<u64>(),
        rtts in proptest::collection::vec(0u64..200, 10),
        key in proptest::option::of(0u32..50),
        prompt in proptest::collection::vec(any::<u8>(), 0..2000),
        prompt_tokens in 0u32..50_000,
        rounds in 1usize..4,
    ) {
        let t0 = Instant::now();
        let mut r = Router::with_config(policy, RouterConfig::default(), seed);
        let blocks = prompt_blocks(&prompt, 64);
        for (i, &(serves, max, started, ejected, eu)) in backends.iter().enumerate() {
            let mut s = spec(&format!("b{i}"), if eu { "eu" } else { "us" }, max);
            if !serves {
                s.models = vec!["other".into()];
            }
            let id = r.add_backend(s);
            r.on_rtt_sample(id, ms(rtts[i]), t0);
            if i % 2 == 0 {
                r.on_routed(id, &blocks[..blocks.len() / 2]);
            }
            for _ in 0..started {
                let _in_flight = r.start_attempt(id, &RouteRequest::new(M), t0);
            }
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
        let mut req = RouteRequest::new(M)
            .with_blocks(blocks.clone())
            .with_prompt_tokens(prompt_tokens)
            .with_client_region("eu");
        if let Some(k) = key {
            req = req.with_session(SessionKind::User, format!("u{k}"));
        }
        for _ in 0..rounds {
            // Before min_ejection no trial is due: exactly the healthy, non-full backends.
            match r.route(&req, t0 + ms(500)) {
                Ok(route) => {
                    let set: BTreeSet<BackendId> = route.backends.iter().copied().collect();
                    prop_assert_eq!(set.len(), route.backends.len(), "duplicates");
                    prop_assert_eq!(&set, &eligible);
                }
                Err(RouteError::UnknownModel { .. }) => {
                    prop_assert!(backends.iter().all(|b| !b.0));
                }
                Err(RouteError::NoHealthyBackend { .. } | RouteError::Saturated { .. }) => {
                    prop_assert!(eligible.is_empty());
                }
                Err(e) => prop_assert!(false, "unexpected error {}", e),
            }
        }
        // After min_ejection at most one ejected backend appears, first, as a trial.
        if let Ok(route) = r.route(&req, t0 + ms(1500)) {
            let extra: Vec<BackendId> = route
                .backends
                .iter()
                .copied()
                .filter(|id| !eligible.contains(id))
                .collect();
            prop_assert!(extra.len() <= 1);
            if let Some(t) = extra.first() {
                prop_assert_eq!(route.backends[0], *t);
                prop_assert_eq!(route.reason, RouteReason::HalfOpenTrial);
            }
        }
    }

    #[test]
    fn replicas_agree_on_every_session_whatever_the_backend_order(
        n in 1usize..12,
        perm_seed in any::<u64>(),
        key in "[a-z0-9-]{1,24}",
    ) {
        let t0 = Instant::now();
        let names: Vec<String> = (0..n).map(|i| format!("10.1.0.{i}:8000")).collect();
        let mut shuffled = names.clone();
        // A deterministic shuffle from the seed.
        let mut s = perm_seed;
        for i in (1..shuffled.len()).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            shuffled.swap(i, (s >> 33) as usize % (i + 1));
        }
        let build = |ns: &[String]| {
            let mut r = Router::with_config(Policy::CostAware, RouterConfig::default(), 0);
            for n in ns {
                r.add_backend(spec(n, "eu", 0));
            }
            r
        };
        let (mut r1, mut r2) = (build(&names), build(&shuffled));
        let req = RouteRequest::new(M).with_session(SessionKind::Header, key);
        let a = first(&mut r1, &req, t0);
        let b = first(&mut r2, &req, t0);
        prop_assert_eq!(
            r1.backend(a).map(|v| v.name.to_owned()),
            r2.backend(b).map(|v| v.name.to_owned())
        );
    }
}
