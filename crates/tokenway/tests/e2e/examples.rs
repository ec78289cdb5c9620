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
        ],
        true,
    );
    assert_eq!(get(&format!("{}/health", gw.url())).await.status, 200);
    assert!(gw.extra("tunnel").is_some());
    assert!(gw.extra("h3").is_some());
}
