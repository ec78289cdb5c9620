//! `tokenway bench transport --quick`: the whole pipeline (lab, servers in namespaces, every
//! transport, report, plots) runs and writes its files. Never asserts on time.

use std::path::Path;
use std::process::Command;

use crate::harness::TempDir;

const TRANSPORTS: [&str; 5] = ["h1", "h2", "h3", "tunnel", "tunnel-tcp"];

fn non_empty(path: &Path) -> String {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{} is readable: {e}", path.display()));
    assert!(!text.trim().is_empty(), "{} is empty", path.display());
    text
}

/// Runs `tokenway bench <args> --out <out>`, asserts that it succeeded, and returns its
/// `results.json`.
fn run_bench(args: &[&str], out: &Path) -> serde_json::Value {
    let run = Command::new(env!("CARGO_BIN_EXE_tokenway"))
        .arg("bench")
        .args(args)
        .arg("--out")
        .arg(out)
        .env("RUST_LOG", "warn")
        .output()
        .expect("tokenway runs");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "bench {args:?} failed ({}):\nstdout: {stdout}\nstderr: {stderr}",
        run.status
    );
    serde_json::from_str(&non_empty(&out.join("results.json"))).expect("results.json is JSON")
}

#[test]
fn bench_transport_quick_writes_json_markdown_and_plots_for_every_transport() {
    let _turn = crate::harness::HEAVY.blocking_lock();
    if !tokenway_netlab::is_root() {
        eprintln!("SKIP: bench transport --quick runs on a netlab profile, which needs root");
        return;
    }
    let dir = TempDir::new("bench-transport");
    let out = dir.0.join("out");
    let json = run_bench(&["transport", "--quick", "--netlab-name", "twbtest"], &out);
    for key in [
        "machine",
        "command_line",
        "timestamp",
        "settings",
        "profiles",
    ] {
        assert!(json.get(key).is_some(), "results.json lacks {key}: {json}");
    }
    assert!(
        json["machine"].get("kernel").is_some(),
        "{}",
        json["machine"]
    );
    let profiles = json["profiles"].as_array().expect("profiles is a list");
    assert_eq!(profiles.len(), 1, "--quick runs one profile");
    let runs = profiles[0]["runs"].as_array().expect("runs is a list");
    for t in TRANSPORTS {
        let mine: Vec<&serde_json::Value> = runs.iter().filter(|r| r["transport"] == t).collect();
        assert!(!mine.is_empty(), "no run of {t} in {}", profiles[0]);
        let ok: u64 = mine
            .iter()
            .map(|r| r["requests"].as_u64().unwrap_or(0) - r["errors"].as_u64().unwrap_or(0))
            .sum();
        assert!(ok > 0, "every request over {t} failed: {mine:?}");
    }

    let md = non_empty(&out.join("results.md"));
    for t in TRANSPORTS {
        assert!(
            md.contains(&format!("| {t} |")),
            "results.md has no row for {t}:\n{md}"
        );
    }

    let plots = json["plots"].as_array().expect("plots is a list");
    assert!(plots.len() >= 2, "a TTFT and a gap plot: {plots:?}");
    for p in plots {
        let svg = non_empty(&out.join(p.as_str().expect("plot paths are strings")));
        assert!(svg.contains("<svg"), "{p} is not an SVG");
        for t in TRANSPORTS {
            assert!(svg.contains(t), "{p} has no line for {t}");
        }
    }
    // The lab is gone.
    let (namespaces, links) = tokenway_netlab::leftovers("twbtest");
    assert!(
        namespaces.is_empty() && links.is_empty(),
        "{namespaces:?} {links:?}"
    );
}

/// `tokenway bench routing --quick`: every policy and both scenarios run on loopback sims, and
/// the report, the verdict table and the plots are written. Never asserts on time.
#[test]
fn bench_routing_quick_writes_every_policy_the_targets_and_plots() {
    let _turn = crate::harness::HEAVY.blocking_lock();
    let dir = TempDir::new("bench-routing");
    let out = dir.0.join("out");
    let json = run_bench(&["routing", "--quick"], &out);
    let runs = json["runs"].as_array().expect("runs is a list");
    for (scenario, policy) in [
        ("main", "cost"),
        ("main", "round_robin"),
        ("main", "least_inflight"),
        ("main", "p2c_ewma"),
        ("far", "cost"),
        ("far", "least_inflight"),
    ] {
        let r = runs
            .iter()
            .find(|r| r["scenario"] == scenario && r["policy"] == policy)
            .unwrap_or_else(|| panic!("no {scenario}/{policy} run in {json}"));
        let ok = r["requests"].as_u64().unwrap_or(0) - r["errors"].as_u64().unwrap_or(0);
        assert!(ok > 0, "every request of {scenario}/{policy} failed: {r}");
        assert!(r["cache_hit_rate"].is_number(), "{r}");
    }
    assert!(
        json["decision"]["calls"].as_u64().unwrap_or(0) > 0,
        "{json}"
    );
    assert_eq!(json["verdicts"].as_array().map(Vec::len), Some(4), "{json}");
    let md = non_empty(&out.join("results.md"));
    assert!(md.contains("PASS") || md.contains("FAIL"), "{md}");
    for file in ["routing-ttft-cdf.svg", "routing-far-ttft-cdf.svg"] {
        let svg = non_empty(&out.join("plots").join(file));
        assert!(
            svg.contains("<svg") && svg.contains("least_inflight"),
            "{file}"
        );
    }
}

/// `tokenway bench weights --quick`: a 64 MB model through real mirror and pull processes,
/// one pull alone, one through the warm mirror, curl on the largest blob, and four pullers at
/// once; the report, the verdicts and the plot are written and the scratch data deleted.
/// Asserts what the counters must say (each cold mirror fetched exactly one copy from the
/// origin), never time.
#[test]
fn bench_weights_quick_reports_one_origin_copy_and_every_target() {
    let _turn = crate::harness::HEAVY.blocking_lock();
    let dir = TempDir::new("bench-weights");
    let out = dir.0.join("out");
    let json = run_bench(&["weights", "--quick"], &out);
    let size = json["settings"]["model_bytes"]
        .as_u64()
        .expect("model size");
    assert!(size >= 60 << 20, "{json}");
    assert_eq!(
        json["alone_mirror"]["bytes_from_origin"].as_u64(),
        Some(size)
    );
    assert_eq!(
        json["crowd"]["mirror"]["bytes_from_origin"].as_u64(),
        Some(size)
    );
    let pulls = json["crowd"]["pulls"].as_array().expect("crowd pulls");
    assert_eq!(pulls.len(), 4, "{json}");
    for p in pulls.iter().chain([&json["alone"], &json["warm"]]) {
        let got = p["bytes_from_mirrors"].as_u64().unwrap_or(0)
            + p["bytes_from_peers"].as_u64().unwrap_or(0);
        assert_eq!(got, size, "every pull got the whole model: {p}");
    }
    if !json["machine"]["curl_version"].is_null() {
        assert_eq!(
            json["curl"]["bytes"].as_u64(),
            json["settings"]["largest_file_bytes"].as_u64(),
            "{json}"
        );
    }
    let verdicts = json["verdicts"].as_array().map_or(0, Vec::len);
    assert!((4..=5).contains(&verdicts), "{json}");
    let md = non_empty(&out.join("results.md"));
    assert!(
        md.contains("### Verdict") && md.contains("origin egress"),
        "{md}"
    );
    let svg = non_empty(&out.join("plots").join("weights-pull-times.svg"));
    assert!(svg.contains("<svg"), "plot written");
    assert!(!out.join("work").exists(), "scratch data is deleted");
}

/// `tokenway bench gateway` on a short run: direct, through the gateway and (when installed)
/// through nginx, interleaved single streams, one connection per closed-loop worker, open
/// streams; every request succeeds and the report has every target. Never asserts on time.
#[test]
fn bench_gateway_short_run_has_every_target_without_errors() {
    let _turn = crate::harness::HEAVY.blocking_lock();
    let dir = TempDir::new("bench-gateway");
    let out = dir.0.join("out");
    let json = run_bench(
        &[
            "gateway",
            "--requests",
            "100",
            "--duration-secs",
            "1",
            "--concurrency",
            "8,32",
            "--open-streams",
            "50",
        ],
        &out,
    );
    let targets = json["targets"].as_array().expect("targets is a list");
    let kinds: Vec<&str> = targets
        .iter()
        .filter_map(|t| t["target"].as_str())
        .collect();
    assert_eq!(kinds[..2], ["direct", "gateway"], "{json}");
    // nginx is compared when it is installed; a broken installation
    // is skipped with a note, not a failure.
    let skipped = json["notes"]
        .to_string()
        .contains("nginx comparison skipped");
    if tokenway_bench::nginx::find().is_some() && !skipped {
        assert_eq!(kinds, ["direct", "gateway", "nginx"], "{json}");
    }
    for t in targets {
        // The interleaved single streams: every target got every request, none failed.
        assert_eq!(t["sequential"]["requests"], 100, "{t}");
        assert_eq!(t["sequential"]["errors"], 0, "{t}");
        // The tail of those 100: its p99 lies inside its interval, under its p99.9.
        let tail = &t["sequential_ttft_tail"];
        assert_eq!(tail["count"], 100, "{t}");
        let at = |k: &str| tail[k].as_f64().unwrap_or_else(|| panic!("no {k}: {t}"));
        assert!(
            at("p99_low_ms") <= at("p99_ms") && at("p99_ms") <= at("p99_high_ms"),
            "{t}"
        );
        assert!(
            at("p90_ms") <= at("p99_ms") && at("p99_ms") <= at("p999_ms"),
            "{t}"
        );
        let levels = t["load"].as_array().expect("load is a list");
        assert_eq!(levels.len(), 2, "{t}");
        for l in levels {
            assert!(l["scenario"]["requests"].as_u64().unwrap_or(0) > 0, "{l}");
            assert_eq!(l["scenario"]["errors"], 0, "{l}");
        }
    }
    // How much of the run's noise came from outside: read from /proc/stat for both phases.
    let steal = &json["machine"]["steal_percent"];
    for phase in ["sequential", "load"] {
        let p = steal[phase].as_f64().unwrap_or(-1.0);
        assert!((0.0..=100.0).contains(&p), "{steal}");
    }
    let open = &json["open_streams"];
    assert_eq!(open["streams"], 50, "{open}");
    assert_eq!(open["scenario"]["errors"], 0, "{open}");
    let md = non_empty(&out.join("results.md"));
    assert!(md.contains("| tokenway gateway |"), "{md}");
    assert!(md.contains("### The single stream's tail"), "{md}");
    let svg = non_empty(&out.join("ttft-cdf.svg"));
    assert!(
        svg.contains("<svg") && svg.contains("tokenway gateway"),
        "{svg}"
    );
}
