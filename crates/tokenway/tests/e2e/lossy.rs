//! Issue 5's netlab checks of the datagram layer, with real `tokenway` processes in the lab's
//! namespaces (sim and gateway on the server side, the edge and the load on the client side):
//! FEC on the `lossy` profile recovers packets and spares QUIC loss detections, and brutal holds
//! its target rate on a rate-limited link with random loss.
//! Needs root (CI runs as root); otherwise each test prints SKIP and passes.

use std::time::{Duration, Instant};

use tokenway_netlab::{Lab, LabConfig, Profile, CLIENT, SERVER};

use crate::harness::{
    chat, data_events, get, lab_stack, metric_sum, post, LabStack as Stack, Proc,
};

const TOKEN: &str = "lossy-test-token-0123456789";

/// Sim, gateway (tunnel port with `gateway_datagram` as `[tunnel.datagram]`) and edge (with
/// `edge_datagram` as `[datagram]`) in `lab`.
fn stack(lab: &Lab, sim_toml: &str, gateway_datagram: &str, edge_datagram: &str) -> Stack {
    lab_stack(
        lab,
        TOKEN,
        sim_toml,
        &format!("[tunnel.datagram]\n{gateway_datagram}"),
        &format!("[datagram]\n{edge_datagram}"),
    )
}

/// Runs `f` on a fresh current-thread runtime inside `host`'s namespace.
fn block_on_in<R: Send, F: std::future::Future<Output = R>>(
    lab: &Lab,
    host: &str,
    f: impl FnOnce() -> F + Send,
) -> R {
    lab.run_in(host, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(f())
    })
    .expect("runs inside the namespace")
}

/// The Prometheus text of `proc`'s `/metrics`, fetched from inside `host`'s namespace.
fn metrics(lab: &Lab, host: &str, proc: &Proc) -> String {
    let url = format!("{}/metrics", proc.url());
    block_on_in(lab, host, || async move { get(&url).await.body })
}

/// What one streaming run measured.
#[derive(Debug)]
struct StreamRun {
    /// Packets QUIC sent, both ends summed.
    quic_sent: f64,
    /// Packets QUIC declared lost, both ends summed.
    quic_lost: f64,
    /// Packets the FEC receivers restored, both ends summed.
    recovered: f64,
    /// Source packets the FEC receivers saw missing, both ends summed.
    layer_lost: f64,
    repair_packets: f64,
    /// How long the streams took, all workers together.
    elapsed: Duration,
}

impl StreamRun {
    /// The share of QUIC's packets it declared lost.
    fn quic_loss_rate(&self) -> f64 {
        self.quic_lost / self.quic_sent.max(1.0)
    }

    /// The binomial variance of [`Self::quic_loss_rate`].
    fn quic_loss_rate_variance(&self) -> f64 {
        let p = self.quic_loss_rate();
        p * (1.0 - p) / self.quic_sent.max(1.0)
    }
}

/// `workers` clients in the client namespace each send `per_worker` streaming chats of
/// `tokens` tokens through the edge, one after another; every stream must complete. Then both
/// ends' counters are read (after their once-a-second publication).
fn streaming_run(
    lab: &Lab,
    s: &Stack,
    workers: usize,
    per_worker: usize,
    tokens: u32,
) -> StreamRun {
    let url = format!("{}/v1/chat/completions", s.edge.url());
    let started = Instant::now();
    let done = block_on_in(lab, CLIENT, || async move {
        let mut tasks = Vec::new();
        for w in 0..workers {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                // Spread the workers' starts over one token interval so their tokens do not
                // all share packets.
                tokio::time::sleep(Duration::from_millis(2 * w as u64)).await;
                let mut complete = 0;
                for i in 0..per_worker {
                    let r = post(&url, &chat(&format!("lossy {w} {i}"), true, tokens), None).await;
                    assert_eq!(r.status, 200, "{}", r.body);
                    let events = data_events(&r.body);
                    assert_eq!(
                        events.last().map(String::as_str),
                        Some("[DONE]"),
                        "{}",
                        r.body
                    );
                    assert!(events.len() > tokens as usize, "{}", r.body);
                    complete += 1;
                }
                complete
            }));
        }
        let mut done = 0;
        for t in tasks {
            done += t.await.expect("worker finishes");
        }
        done
    });
    assert_eq!(done, workers * per_worker, "every stream completed");
    let elapsed = started.elapsed();
    // Both processes publish QUIC and layer counters once a second.
    std::thread::sleep(Duration::from_millis(2_200));
    let edge = metrics(lab, CLIENT, &s.edge);
    let gw = metrics(lab, SERVER, &s.gateway);
    let both = |name: &str| metric_sum(&edge, name) + metric_sum(&gw, name);
    StreamRun {
        quic_sent: both("tokenway_quic_sent_packets_total"),
        quic_lost: both("tokenway_quic_lost_packets_total"),
        recovered: both("tokenway_datagram_recovered_packets_total"),
        layer_lost: both("tokenway_datagram_lost_packets_total"),
        repair_packets: both("tokenway_datagram_repair_packets_total"),
        elapsed,
    }
}

/// A sim that answers at once (no base latency, instant prefill, no prefix cache), then one
/// token every `token_ms`.
fn sim_toml(token_ms: f64) -> String {
    format!(
        "model_names = [\"sim-model\"]\nbase_latency_ms = 0.0\n\
         time_per_output_token_ms = {token_ms:?}\nprefill_tokens_per_second = 1.0e12\n\
         batch_penalty = 0.0\nprefix_cache_tokens = 0\n"
    )
}

fn lab_up(prefix: &str, profile: &Profile, seed: u64) -> Lab {
    let _ = tokenway_netlab::down(prefix);
    Lab::up(LabConfig::from_profile(prefix, profile, seed)).expect("lab comes up")
}

/// `lossy`: 100 ms RTT, 5 % random loss both ways. 160 streams of 64 tokens at 10 ms (sixteen
/// at a time, ten rounds) with FEC on (defaults: `auto`, 0.5 overhead cap, scope
/// `interactive`), then the same with FEC off on a fresh lab with the same seed. The assertion
/// is on QUIC's loss *rate* (both ends' packets declared lost over packets sent), which must be
/// lower with FEC by more than three standard deviations of the two binomial rates. Counts of
/// lost packets are not comparable between the runs: without FEC every loss stalls the streams
/// behind it and tokens pile up into fewer, fuller packets (about 3,000 QUIC packets against
/// up to 14,000 with FEC, where each token leaves in its own).
#[test]
fn fec_on_the_lossy_profile_recovers_packets_and_spares_quic_losses() {
    if !tokenway_netlab::is_root() {
        eprintln!("SKIP: netlab tests create network namespaces: needs root");
        return;
    }
    let _turn = crate::harness::HEAVY.blocking_lock();
    let profile = Profile::builtin("lossy").expect("built-in profile");
    let sim = sim_toml(10.0);
    let mut runs = Vec::new();
    for fec in ["auto", "off"] {
        let started = Instant::now();
        let lab = lab_up("twlossy", &profile, 5);
        let datagram = format!("fec = \"{fec}\"");
        let s = stack(&lab, &sim, &datagram, &datagram);
        // One warm-up request opens the tunnel connection before the counted ones.
        block_on_in(&lab, CLIENT, || {
            let url = format!("{}/v1/chat/completions", s.edge.url());
            async move { post(&url, &chat("warm", true, 1), None).await.status }
        });
        let run = streaming_run(&lab, &s, 16, 10, 64);
        eprintln!(
            "fec {fec}: {run:?}, QUIC loss rate {:.2} %, streams done in {:?}, lab up to down {:?}",
            100.0 * run.quic_loss_rate(),
            run.elapsed,
            started.elapsed()
        );
        drop(s);
        std::thread::sleep(Duration::from_millis(100));
        lab.down().expect("clean down");
        runs.push(run);
    }
    let (on, off) = (&runs[0], &runs[1]);
    assert!(
        on.repair_packets > 0.0,
        "FEC sent no repair packets: {on:?}"
    );
    assert!(on.recovered > 0.0, "FEC recovered nothing: {on:?}");
    assert!(
        on.layer_lost > 0.0 && off.quic_lost > 0.0,
        "the link lost nothing: {on:?} {off:?}"
    );
    assert_eq!(off.recovered, 0.0, "FEC off recovers nothing: {off:?}");
    // A lower QUIC loss rate with FEC, by more than the noise.
    let (p_on, p_off) = (on.quic_loss_rate(), off.quic_loss_rate());
    let sigma = (on.quic_loss_rate_variance() + off.quic_loss_rate_variance()).sqrt();
    assert!(
        p_off - p_on > 3.0 * sigma,
        "QUIC lost {:.2} % of its packets with FEC and {:.2} % without (σ of the difference \
         {:.2} points): {on:?} {off:?}",
        100.0 * p_on,
        100.0 * p_off,
        100.0 * sigma,
    );
}

/// brutal at 20 Mbit/s on a link limited to 20 Mbit/s with 3 % random loss (10 ms RTT): a bulk
/// upload through the tunnel holds at least 90 % of the target (measured as request body per
/// second against what 20 Mbit/s on this link can carry, see the ceiling below). Cubic on the
/// same link backs off on every loss; brutal compensates the loss and keeps the rate. Before
/// the window gain (`brutal.rs`) this measured 16.1–16.5 Mbit/s, about 88 %.
#[test]
fn brutal_holds_its_rate_on_a_lossy_20_mbit_link() {
    if !tokenway_netlab::is_root() {
        eprintln!("SKIP: netlab tests create network namespaces: needs root");
        return;
    }
    let _turn = crate::harness::HEAVY.blocking_lock();
    let profile = Profile::from_toml_str(
        "brutal20",
        r#"
        description = "20 Mbit/s bottleneck, 3 % random loss, 10 ms RTT"
        [conditions]
        delay_ms = 5.0
        loss = 0.03
        rate_mbit = 20.0
        "#,
    )
    .expect("valid profile");
    let lab = lab_up("twbrutal", &profile, 7);
    let s = stack(
        &lab,
        &sim_toml(0.0),
        "fec = \"off\"\ncc = \"brutal\"\nbandwidth.up = \"20 mbps\"",
        "fec = \"off\"\ncc = \"brutal\"\nbandwidth.up = \"20 mbps\"\nbandwidth.down = \"20 mbps\"",
    );
    let url = format!("{}/v1/chat/completions", s.edge.url());
    // Two uploads, 1 MB and 13 MB: the difference of their times is what 12 MB cost on the
    // link, without the per-request costs (round trips, the processes parsing the request) that
    // would otherwise count against the rate. 12 MB at 20 Mbit/s is about 5 s of sending.
    let (small, large) = (1_000_000usize, 13_000_000usize);
    let times = block_on_in(&lab, CLIENT, || async move {
        // Warm-up: the connection is up and brutal is on before the clock starts.
        let warm = post(&url, &chat("warm", true, 1), None).await;
        assert_eq!(warm.status, 200, "{}", warm.body);
        let mut times = Vec::new();
        for bytes in [small, large] {
            // The bytes ride in a field no one reads: as a prompt they would be hashed into
            // prefix blocks by the gateway and the sim, which in this unoptimized test build
            // costs ~0.4 s per 12 MB and would be counted against the link.
            let body = serde_json::json!({
                "model": "sim-model",
                "stream": false,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "upload"}],
                "padding": "x".repeat(bytes),
            })
            .to_string();
            let t = Instant::now();
            let r = post(&url, &body, None).await;
            assert_eq!(r.status, 200, "{}", r.body);
            times.push(t.elapsed());
        }
        times
    });
    let link = times[1].saturating_sub(times[0]);
    let mbit = (large - small) as f64 * 8.0 / link.as_secs_f64() / 1e6;
    let stats = lab.stats();
    eprintln!(
        "brutal upload: {small} B in {:?}, {large} B in {:?}: {mbit:.2} Mbit/s; link {:?}",
        times[0], times[1], stats.directions
    );
    let edge = metrics(&lab, CLIENT, &s.edge);
    drop(s);
    std::thread::sleep(Duration::from_millis(100));
    lab.down().expect("clean down");
    // What the 20 Mbit/s target means on this link: the link counts whole IP packets (1,480
    // bytes for a full QUIC packet: 1,450 of QUIC, 2 of layer header, 28 of UDP and IP), of
    // which at most about 1,412 are request body (QUIC short header, AEAD tag, STREAM frame
    // header), and 3 % are lost after the bottleneck. So a sender holding exactly 20 Mbit/s
    // on the wire moves at most this much body; the issue's 90 % applies to it.
    let ceiling = 20.0 * 0.97 * 1412.0 / 1480.0;
    assert!(
        mbit >= 0.9 * ceiling,
        "brutal at 20 Mbit/s moved {mbit:.2} Mbit/s of body, {:.0} % of the {ceiling:.2} Mbit/s \
         a sender holding 20 Mbit/s on this link would; edge QUIC counters:\n{}",
        100.0 * mbit / ceiling,
        edge.lines()
            .filter(|l| l.starts_with("tokenway_quic_"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    eprintln!(
        "brutal: {:.0} % of the 20 Mbit/s target in wire terms",
        100.0 * mbit / ceiling
    );
}
