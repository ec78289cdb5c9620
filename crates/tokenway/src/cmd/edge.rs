//! `tokenway edge`.

/// Flags of `tokenway edge`.
#[derive(clap::Args)]
pub struct EdgeArgs {}

/// Runs `tokenway edge`.
pub async fn run(_args: EdgeArgs) -> anyhow::Result<()> {
    anyhow::bail!("the edge is being built")
}
