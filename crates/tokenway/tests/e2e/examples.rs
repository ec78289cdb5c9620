//! Every configuration in `examples/` starts and serves (ports replaced by free ones).

use crate::harness::*;

fn example(name: &str) -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/").to_string() + name
}

#[tokio::test]
async fn the_example_configs_start_and_serve() {
    let sim_cfg = example("sim.toml");
    let sim = start_args(
        &["sim", "--config", &sim_cfg, "--listen", "127.0.0.1:0"],
        false,
    );
    let r = post(
        &format!("{}/v1/chat/completions", sim.url()),
        &chat("example", true, 3),
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);

    let gw_cfg = example("gateway.toml");
    let gw = start_args(
        &[
            "gateway",
            "--config",
            &gw_cfg,
            "--listen",
            "127.0.0.1:0",
            "--tls-listen",
            "127.0.0.1:0",
            "--h3-listen",
            "127.0.0.1:0",
            "--tunnel-listen",
            "127.0.0.1:0",
            "--tunnel-tcp-listen",
            "127.0.0.1:0",
        ],
        true,
    );
    assert_eq!(get(&format!("{}/health", gw.url())).await.status, 200);
    assert!(gw.extra("tunnel").is_some());
    assert!(gw.extra("tunnel-tcp").is_some());
    assert!(gw.extra("h3").is_some());

    // The edge starts even while its gateway is unreachable, and keeps answering locally.
    let edge_cfg = example("edge.toml");
    let edge = start_args(
        &["edge", "--config", &edge_cfg, "--listen", "127.0.0.1:0"],
        false,
    );
    assert_eq!(get(&format!("{}/metrics", edge.url())).await.status, 200);
}

#[test]
fn the_demo_smoke_run_succeeds_through_gateway_and_edge() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenway"))
        .args(["demo", "--smoke", "--smoke-requests", "16"])
        .env("RUST_LOG", "warn")
        .output()
        .expect("tokenway demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo --smoke failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for entry in ["smoke gateway", "smoke edge"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(entry))
            .unwrap_or_else(|| panic!("no `{entry}` line in:\n{stdout}"));
        assert!(line.contains("16 requests, 0 failed"), "{line}");
    }
}
