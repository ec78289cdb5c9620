//! `tokenway preheat`: ask a mirror to pull a whole model into its cache (see
//! `docs/weights.md`).

use std::time::Duration;

use anyhow::Context as _;
use tokenway_mirror::mirror::preheat::preheat_remote;

/// Flags of `tokenway preheat`.
#[derive(clap::Args)]
pub struct PreheatArgs {
    /// What to preheat: `NAME` (tag latest), `NAME:TAG` or `NAME@REVISION`.
    #[arg(value_name = "MODEL")]
    pub model: String,
    /// The mirror, `http://HOST:PORT` or `https://HOST[:PORT]`.
    #[arg(long, value_name = "URL")]
    pub mirror: String,
    /// Give up after this many seconds.
    #[arg(long, value_name = "SECS", default_value_t = 3600)]
    pub timeout_secs: u64,
    #[command(flatten)]
    pub token: crate::cmd::weights_access::TokenArg,
    #[command(flatten)]
    pub tls: crate::cmd::weights_access::ClientTlsArgs,
}

/// Runs `tokenway preheat`.
pub async fn run(args: PreheatArgs) -> anyhow::Result<()> {
    let r = preheat_remote(
        &args.mirror,
        &args.model,
        args.token.get()?,
        &args.tls.trust(),
        Duration::from_secs(args.timeout_secs.max(1)),
    )
    .await
    .with_context(|| format!("preheating {}", args.model))?;
    eprintln!(
        "preheated {}@{} in {}: {} blobs, {} pieces ({} fetched, {} already cached), {} bytes",
        r.model,
        r.revision,
        args.mirror,
        r.blobs,
        r.pieces,
        r.pieces_fetched,
        r.pieces_already_cached,
        r.bytes
    );
    if r.bytes > r.cache_max_bytes {
        eprintln!(
            "warning: the model ({} bytes) is larger than the mirror's cache ({} bytes); not all of it stays cached",
            r.bytes, r.cache_max_bytes
        );
    }
    Ok(())
}
