//! `tokenway mirror`: a regional cache of model weights in front of an origin (see
//! `docs/weights.md`).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use tokenway_mirror::mirror::{server, Mirror, MirrorConfig};
use tokenway_mirror::size::parse_size;

/// Flags of `tokenway mirror`.
#[derive(clap::Args)]
pub struct MirrorArgs {
    /// Origin object store, e.g. `file:///srv/models`.
    #[arg(long, value_name = "URL")]
    pub origin: String,
    /// Directory of the piece cache (and copies of manifests and tags).
    #[arg(long, value_name = "DIR")]
    pub cache: PathBuf,
    /// Bound of the piece cache, e.g. `50G` (binary units).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub max_size: u64,
    /// Address to listen on (port 0 picks a free port; the real one is printed).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8700")]
    pub listen: SocketAddr,
    /// Region this mirror serves; pullers are pointed at peers of the same region.
    #[arg(long, value_name = "NAME", default_value = "default")]
    pub region: String,
    /// Pieces a preheat fetches from the origin at once.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub preheat_parallel: usize,
    /// Cap on blob bytes served per second to all clients together, e.g. `500M`: the uplink
    /// this mirror may use (pullers sharing as peers take the rest from each other).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub limit_rate: Option<u64>,
    #[command(flatten)]
    pub token: crate::cmd::weights_access::TokenArg,
    #[command(flatten)]
    pub tls: crate::cmd::weights_access::ServerTlsArgs,
    /// TESTING ONLY: corrupt one byte of every Nth piece served (0 = off).
    #[arg(long, value_name = "N", default_value_t = 0, hide = true)]
    pub test_corrupt_every: u64,
    /// TESTING ONLY: hold back every Nth piece served (at most 3 times) by --test-stall-ms.
    #[arg(long, value_name = "N", default_value_t = 0, hide = true)]
    pub test_stall_every: u64,
    /// TESTING ONLY: length of a stall, milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 30_000, hide = true)]
    pub test_stall_ms: u64,
}

/// Runs `tokenway mirror`.
pub async fn run(args: MirrorArgs) -> anyhow::Result<()> {
    let config = MirrorConfig {
        origin: args.origin,
        cache_dir: args.cache,
        max_size: args.max_size,
        region: args.region,
        preheat_parallel: args.preheat_parallel,
        limit_rate: args.limit_rate,
        token: args.token.get()?,
        test_corrupt_every: args.test_corrupt_every,
        test_stall_every: args.test_stall_every,
        test_stall_ms: args.test_stall_ms,
    };
    let tls = args.tls.get()?;
    let mirror = Mirror::open(&config).context("starting the mirror")?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    if config.test_corrupt_every > 0 || config.test_stall_every > 0 {
        eprintln!("warning: --test-* flags inject faults on purpose (testing only)");
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    println!("tokenway mirror listening on {scheme}://{addr}");
    server::serve(mirror, listener, tls, crate::cmd::signal::shutdown()).await?;
    Ok(())
}
