//! `tokenway edge`: load the TOML config, apply flag overrides, bind, serve until a signal.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use tokenway_edge::EdgeConfig;

/// Flags of `tokenway edge`. Flags override the config file.
#[derive(clap::Args)]
pub struct EdgeArgs {
    /// TOML configuration file (see docs/edge.md and examples/edge.toml).
    #[arg(long, short)]
    pub config: PathBuf,
    /// Local OpenAI-compatible endpoint, HTTP/1.1 and h2c (overrides `listen`).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
}

/// Reads the config file and applies the flags on top.
pub fn load(args: &EdgeArgs) -> anyhow::Result<EdgeConfig> {
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("cannot read config file {}", args.config.display()))?;
    let mut config: EdgeConfig = toml::from_str(&text)
        .with_context(|| format!("invalid config file {}", args.config.display()))?;
    if let Some(a) = args.listen {
        config.listen = a;
    }
    config
        .validate()
        .with_context(|| format!("in config file {}", args.config.display()))?;
    Ok(config)
}

/// Runs `tokenway edge`.
pub async fn run(args: EdgeArgs) -> anyhow::Result<()> {
    let config = load(&args)?;
    // The edge adds the tunnel token to whatever it relays: reachable from elsewhere, it is an
    // authenticated way into the gateway for anyone who can reach the port.
    for (what, addr) in std::iter::once(("listen", config.listen)).chain(
        config
            .forwards
            .iter()
            .map(|f| ("forwards[].listen", f.listen)),
    ) {
        if !addr.ip().is_loopback() {
            tracing::warn!(%addr, key = what, "the edge listens beyond this machine: anyone who reaches this address uses the tunnel with the edge's token (and its /admin routes); bind a loopback address unless that is intended");
        }
    }
    let edge = tokenway_edge::bind(config).await?;
    if let Some(a) = edge.local_addr() {
        println!("tokenway edge listening on http://{a}");
    }
    for (local, target) in edge.forwards() {
        println!("tokenway edge forwarding tcp://{local} to {target}");
    }
    edge.serve(super::signal::shutdown()).await;
    Ok(())
}
