//! `tokenway demo`: three simulated backends, a gateway and an edge on loopback, ready for
//! requests.
//!
//! The backends differ on purpose (one fast, one average, one slow and busy) so that routing has
//! something to decide. `--smoke` sends a batch of streaming requests through the gateway, prints
//! time-to-first-token and inter-token percentiles, and exits non-zero if any request failed.

use std::net::SocketAddr;

use anyhow::Context;
use tokenway_edge::EdgeConfig;
use tokenway_gateway::config::TunnelConfig;
use tokenway_gateway::{BackendConfig, GatewayConfig};
use tokenway_sim::SimConfig;

/// Flags of `tokenway demo`.
#[derive(clap::Args)]
pub struct DemoArgs {
    /// Gateway listen address (HTTP/1.1 and h2c).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Gateway TLS listen address (HTTP/2 and HTTP/1.1, self-signed certificate); the same port
    /// number serves HTTP/3 over UDP.
    #[arg(long, default_value = "127.0.0.1:8443")]
    pub tls_listen: SocketAddr,
    /// Gateway tunnel port (UDP) that the demo edge connects to.
    #[arg(long, default_value = "127.0.0.1:4433")]
    pub tunnel_listen: SocketAddr,
    /// The demo edge's local OpenAI endpoint (requests reach the gateway through the tunnel).
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub edge_listen: SocketAddr,
    /// Send a batch of streaming requests, print latency percentiles, and exit (0 only if every
    /// request succeeded). Uses free ports instead of the listen addresses.
    #[arg(long)]
    pub smoke: bool,
    /// Requests sent by `--smoke` (at least 1).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub smoke_requests: u32,
}

/// The three demo backends: (name, base latency ms, time per output token ms, slots).
const BACKENDS: [(&str, f64, f64, usize); 3] = [
    ("sim-fast", 20.0, 15.0, 16),
    ("sim-mid", 40.0, 20.0, 16),
    ("sim-slow", 120.0, 35.0, 4),
];

/// Runs `tokenway demo`.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut backends = Vec::new();
    for (i, (name, base, tpot, slots)) in BACKENDS.into_iter().enumerate() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot bind a loopback port for a demo backend")?;
        let addr = listener.local_addr()?;
        let config = SimConfig {
            seed: i as u64,
            base_latency_ms: base,
            time_per_output_token_ms: tpot,
            max_concurrency: slots,
            ..SimConfig::default()
        };
        config.validate()?;
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = stop.changed().await;
            };
            if let Err(e) = tokenway_sim::serve(config, listener, shutdown).await {
                tracing::error!(backend = name, error = %e, "demo backend stopped");
            }
        });
        backends.push(BackendConfig {
            name: Some(name.to_string()),
            url: format!("http://{addr}"),
            region: "local".into(),
            models: vec!["sim-model".into()],
            max_inflight: 256,
            api_key: None,
            prefix_capacity_blocks: None,
            health_path: None,
        });
        println!(
            "backend  {name:<9} http://{addr}  (base {base} ms, {tpot} ms/token, {slots} slots)"
        );
    }
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let (listen, tls_listen, tunnel_listen, edge_listen) = if args.smoke {
        (any, any, any, any)
    } else {
        (
            args.listen,
            args.tls_listen,
            args.tunnel_listen,
            args.edge_listen,
        )
    };
    let token = tunnel_token();
    let config = GatewayConfig {
        listen: Some(listen),
        tls_listen: Some(tls_listen),
        // HTTP/3 on the TLS port's number, over UDP, as clients expect from Alt-Svc.
        h3_listen: Some(tls_listen),
        tunnel: Some(TunnelConfig {
            listen: tunnel_listen,
            // The edge's TCP fallback: probes without the token see the masquerade site.
            tcp_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            tokens: vec![token.clone()],
            replay_window_ms: 10_000,
            max_replay_keys: 100_000,
            forward_allow: Vec::new(),
            masquerade: Default::default(),
            datagram: Default::default(),
        }),
        backends,
        ..GatewayConfig::default()
    };
    let gateway = tokenway_gateway::bind(config).await?;
    let plain = gateway
        .plain_addr()
        .context("the demo gateway has no cleartext listener")?;
    let tls = gateway
        .tls_addr()
        .context("the demo gateway has no TLS listener")?;
    let tunnel = gateway
        .tunnel_addr()
        .context("the demo gateway has no tunnel port")?;
    let tunnel_tcp = gateway
        .tunnel_tcp_addr()
        .context("the demo gateway has no tunnel TCP port")?;
    let fingerprint = gateway
        .fingerprint()
        .context("the demo gateway has no certificate")?
        .to_string();
    let mut stop = stop_rx.clone();
    let serving = tokio::spawn(gateway.serve(async move {
        let _ = stop.changed().await;
    }));
    println!("gateway  http://{plain}  (HTTP/1.1, h2c)");
    println!("         https://{tls}  (HTTP/2 over TLS and HTTP/3 over UDP; self-signed)");
    println!("tunnel   udp://{tunnel}, tcp://{tunnel_tcp}  (certificate {fingerprint})");

    let edge_config: EdgeConfig = toml::from_str(&format!(
        "listen = \"{edge_listen}\"\ntoken = \"{token}\"\n[trust]\npin_sha256 = [\"{fingerprint}\"]\n\
         [[gateways]]\nname = \"demo-gateway\"\nquic = \"{tunnel}\"\ntcp = \"{tunnel_tcp}\"\n"
    ))
    .context("demo edge configuration")?;
    let edge = tokenway_edge::bind(edge_config).await?;
    let edge_addr = edge.local_addr().context("the demo edge has no listener")?;
    let mut stop = stop_rx.clone();
    let edge_serving = tokio::spawn(edge.serve(async move {
        let _ = stop.changed().await;
    }));
    println!("edge     http://{edge_addr}  (OpenAI endpoint; requests tunnelled over QUIC to the gateway)");
    println!("metrics  http://{plain}/metrics   http://{edge_addr}/metrics");

    let result = if args.smoke {
        super::smoke::run(
            &[("gateway", plain), ("edge", edge_addr)],
            args.smoke_requests as usize,
        )
        .await
    } else {
        print_usage(plain, edge_addr);
        super::signal::shutdown().await;
        Ok(())
    };
    let _ = stop_tx.send(true);
    let _ = serving.await;
    let _ = edge_serving.await;
    result
}

/// A fresh random tunnel token for this demo run.
fn tunnel_token() -> String {
    let bytes: [u8; 16] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn print_usage(addr: SocketAddr, edge: SocketAddr) {
    println!(
        r#"
Try it:

  curl -N http://{addr}/v1/chat/completions -H 'content-type: application/json' \
    -d '{{"model":"sim-model","stream":true,"messages":[{{"role":"user","content":"Hello!"}}]}}'

  # the same through the edge and the QUIC tunnel:
  curl -N http://{edge}/v1/chat/completions -H 'content-type: application/json' \
    -d '{{"model":"sim-model","stream":true,"messages":[{{"role":"user","content":"Hello!"}}]}}'

  python3 - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="http://{addr}/v1", api_key="unused")
stream = client.chat.completions.create(
    model="sim-model", stream=True,
    messages=[{{"role": "user", "content": "Hello!"}}])
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
PY

Serving until Ctrl-C."#
    );
}
