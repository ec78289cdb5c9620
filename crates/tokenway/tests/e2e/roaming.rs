//! The edge roams: the client machine's address changes under a live stream (netlab namespaces,
//! a real address flip every 1.5 s, each inside a 300 ms blackout as in a cellular handover)
//! and the stream goes on over the same QUIC connection, the edge having rebound on its own.
//! (Whether a stream would stall without the rebind depends on whether the client happens to
//! have a packet in flight at the change, so the test asserts the rebind and the outcome; the
//! stall it prevents is measured in docs/benchmarks.md, handover profile.)
//! Needs root (CI runs as root); otherwise prints SKIP and passes.

use std::process::Command;
use std::time::Duration;

use tokenway_netlab::{Lab, LabConfig, Profile, CLIENT};

use crate::harness::{chat, data_events, lab_stack, metric_sum, LabStack};

/// `curl` inside namespace `ns`; its stdout, or a panic with stderr.
fn curl_in(ns: &str, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "curl", "-sS"])
        .args(args)
        .output()
        .expect("ip netns exec curl runs");
    assert!(
        out.status.success(),
        "curl {args:?} in {ns} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_stream_survives_the_client_address_changing_under_it() {
    let _turn = crate::harness::HEAVY.blocking_lock();
    if !tokenway_netlab::is_root() {
        eprintln!("SKIP: the roaming test changes addresses inside network namespaces: needs root");
        return;
    }
    let profile = Profile::from_toml_str(
        "roam",
        r#"
        description = "address flips every 1.5 s in the middle of a 300 ms blackout"
        [conditions]
        delay_ms = 5.0
        [[blackout]]
        start_ms = 1350.0
        duration_ms = 300.0
        every_ms = 1500.0
        [address_change]
        host = "client"
        addresses = ["198.18.0.1", "198.18.0.5"]
        first_ms = 1500.0
        every_ms = 1500.0
        "#,
    )
    .expect("valid profile");
    let prefix = "twroam";
    let _ = tokenway_netlab::down(prefix);
    let lab = Lab::up(LabConfig::from_profile(prefix, &profile, 11)).expect("lab comes up");
    let client_ns = lab.namespace(CLIENT);
    // Keep-alives far beyond the test's length, so they cannot be what carries the migration.
    let LabStack { sim, gateway, edge } = lab_stack(
        &lab,
        "roaming-test-token-0123",
        "base_latency_ms = 1.0\ntime_per_output_token_ms = 25.0\n",
        "",
        "[quic]\nkeep_alive_ms = 60000\nidle_timeout_ms = 120000",
    );

    // 160 tokens at 25 ms: about 4 s, across two or three address changes.
    let body = curl_in(
        &client_ns,
        &[
            "-N",
            "--max-time",
            "45",
            "-H",
            "content-type: application/json",
            "-d",
            &chat("roam with me", true, 160),
            &format!("{}/v1/chat/completions", edge.url()),
        ],
    );
    let events = data_events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    assert!(events.len() >= 160, "{} events: {body}", events.len());

    let metrics = curl_in(&client_ns, &[&format!("{}/metrics", edge.url())]);
    assert!(
        metric_sum(
            &metrics,
            "tokenway_edge_rebinds_total{reason=\"address_change\"}"
        ) >= 1.0,
        "the edge noticed no address change: {metrics}"
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "tokenway_tunnel_connections_total{peer=\"gw\",transport=\"quic\"}"
        ),
        1.0,
        "the connection migrated instead of being replaced: {metrics}"
    );
    drop((edge, gateway, sim));
    std::thread::sleep(Duration::from_millis(100));
    lab.down().expect("clean down");
}
