//! `tokenway gateway`: load the TOML config, apply flag overrides, bind, serve until a signal.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use tokenway_gateway::{BackendConfig, GatewayConfig};

/// Flags of `tokenway gateway`. Flags override the config file.
#[derive(clap::Args)]
pub struct GatewayArgs {
    /// TOML configuration file (see docs/config.md and examples/gateway.toml).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Cleartext HTTP/1.1 + h2c listen address (overrides `listen`).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// TLS (HTTP/2, HTTP/1.1) listen address (overrides `tls_listen`).
    #[arg(long)]
    pub tls_listen: Option<SocketAddr>,
    /// Public HTTP/3 listen address, UDP (overrides `h3_listen`).
    #[arg(long)]
    pub h3_listen: Option<SocketAddr>,
    /// Tunnel port listen address, UDP (overrides `tunnel.listen`; needs a `[tunnel]` section).
    #[arg(long)]
    pub tunnel_listen: Option<SocketAddr>,
    /// The tunnel's own TLS port, TCP (overrides `tunnel.tcp_listen`; needs a `[tunnel]`
    /// section).
    #[arg(long)]
    pub tunnel_tcp_listen: Option<SocketAddr>,
    /// A backend base URL, e.g. http://127.0.0.1:8000 (repeatable; replaces the config's list).
    #[arg(long = "backend", value_name = "URL")]
    pub backends: Vec<String>,
    /// An accepted API key (repeatable; adds to `api_keys`). Prefer the config file: flags are
    /// visible in the process list.
    #[arg(long = "api-key", value_name = "KEY", env = "TOKENWAY_API_KEY")]
    pub api_keys: Vec<String>,
    /// Routing policy: cost, round_robin, least_inflight, p2c_ewma.
    #[arg(long)]
    pub policy: Option<String>,
}

/// Reads the config file (if any) and applies the flags on top.
pub fn load(args: &GatewayArgs) -> anyhow::Result<GatewayConfig> {
    let mut config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read config file {}", path.display()))?;
            toml::from_str::<GatewayConfig>(&text)
                .with_context(|| format!("invalid config file {}", path.display()))?
        }
        None => GatewayConfig::default(),
    };
    if let Some(a) = args.listen {
        config.listen = Some(a);
    }
    if let Some(a) = args.tls_listen {
        config.tls_listen = Some(a);
    }
    if let Some(a) = args.h3_listen {
        config.h3_listen = Some(a);
    }
    if let Some(a) = args.tunnel_listen {
        match config.tunnel.as_mut() {
            Some(t) => t.listen = a,
            None => anyhow::bail!(
                "--tunnel-listen needs a [tunnel] section (tokens) in the config file"
            ),
        }
    }
    if let Some(a) = args.tunnel_tcp_listen {
        match config.tunnel.as_mut() {
            Some(t) => t.tcp_listen = Some(a),
            None => anyhow::bail!(
                "--tunnel-tcp-listen needs a [tunnel] section (tokens) in the config file"
            ),
        }
    }
    if !args.backends.is_empty() {
        config.backends = args
            .backends
            .iter()
            .map(|url| BackendConfig {
                name: None,
                url: url.clone(),
                region: "local".into(),
                models: Vec::new(),
                max_inflight: 256,
                api_key: None,
                prefix_capacity_blocks: None,
                health_path: None,
            })
            .collect();
    }
    config.api_keys.extend(args.api_keys.iter().cloned());
    if let Some(p) = &args.policy {
        config.policy = p.parse().map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    }
    config.validate()?;
    Ok(config)
}

/// Runs `tokenway gateway`.
pub async fn run(args: GatewayArgs) -> anyhow::Result<()> {
    let config = load(&args)?;
    let gateway = tokenway_gateway::bind(config).await?;
    if let Some(a) = gateway.plain_addr() {
        println!("tokenway gateway listening on http://{a}");
    }
    if let Some(a) = gateway.tls_addr() {
        println!("tokenway gateway listening on https://{a}");
    }
    if let Some(a) = gateway.h3_addr() {
        println!("tokenway gateway h3 on udp://{a}");
    }
    if let Some(a) = gateway.tunnel_addr() {
        println!(
            "tokenway gateway tunnel on udp://{a} fingerprint {}",
            gateway.fingerprint().unwrap_or("-")
        );
    }
    if let Some(a) = gateway.tunnel_tcp_addr() {
        println!("tokenway gateway tunnel-tcp on tcp://{a}");
    }
    gateway.serve(super::signal::shutdown()).await;
    Ok(())
}
