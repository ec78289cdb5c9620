//! `tokenway bench ...`: parse flags, hand over to `tokenway-bench`, print the table.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use tokenway_bench::gateway::GatewayBenchOptions;

/// Benchmarks.
#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Same streaming load directly to a `tokenway sim`, through `tokenway gateway`, and
    /// through nginx (when installed): added latency, throughput, memory.
    Gateway(GatewayBenchArgs),
}

/// Flags of `tokenway bench gateway`.
#[derive(clap::Args)]
pub struct GatewayBenchArgs {
    /// Short run (200 sequential requests, 2 s per concurrency level) for a quick look.
    #[arg(long)]
    pub quick: bool,
    /// Directory for results.json, results.md, generated configs and server logs.
    #[arg(long, default_value = "bench-out/gateway")]
    pub out: PathBuf,
    /// Sequential single-stream requests per target [default: 2000, --quick 200].
    #[arg(long)]
    pub requests: Option<usize>,
    /// Seconds per concurrency level [default: 10, --quick 2].
    #[arg(long)]
    pub duration_secs: Option<f64>,
    /// Concurrency levels of the throughput scenario.
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    pub concurrency: Vec<usize>,
    /// Streams held open at once through the gateway for the memory measurement (0 skips it).
    #[arg(long, default_value_t = 1000)]
    pub open_streams: usize,
    /// Do not compare with nginx even if it is installed.
    #[arg(long)]
    pub no_nginx: bool,
}

/// Runs a benchmark.
pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Gateway(args) => gateway(args).await,
    }
}

async fn gateway(args: GatewayBenchArgs) -> anyhow::Result<()> {
    let duration_secs = args
        .duration_secs
        .unwrap_or(if args.quick { 2.0 } else { 10.0 });
    if !(duration_secs.is_finite() && duration_secs > 0.0 && duration_secs <= 3600.0) {
        anyhow::bail!("--duration-secs must be in (0, 3600], got {duration_secs}");
    }
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        anyhow::bail!("--concurrency must list levels >= 1, e.g. 64,256");
    }
    let options = GatewayBenchOptions {
        exe: std::env::current_exe().context("cannot locate the tokenway executable")?,
        out_dir: args.out,
        sequential_requests: args.requests.unwrap_or(if args.quick { 200 } else { 2000 }),
        duration: Duration::from_secs_f64(duration_secs),
        concurrency: args.concurrency,
        open_streams: args.open_streams,
        nginx: !args.no_nginx,
        command_line: command_line(),
    };
    let report = tokenway_bench::gateway::run(&options).await?;
    println!("{}", report.to_markdown());
    println!(
        "results: {} and {}",
        options.out_dir.join("results.json").display(),
        options.out_dir.join("results.md").display()
    );
    Ok(())
}

/// The command line as typed, quoted where a shell would need it.
fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,:@".contains(c))
            {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
