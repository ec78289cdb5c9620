//! `tokenway bench ...`.

/// Benchmarks.
#[derive(clap::Subcommand)]
pub enum BenchCommand {}

/// Runs a benchmark.
pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {}
}
