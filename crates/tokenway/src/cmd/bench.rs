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
    /// h1, h2, h3, the tunnel and its TCP fallback side by side, on loopback or on emulated
    /// links (netlab profiles, root): TTFT with and without connection setup, 0-RTT, largest
    /// inter-token gap, uploads and mixes; JSON, Markdown and SVG plots.
    Transport(TransportBenchArgs),
    /// Weights distribution: a generated model (2 GB) through one `tokenway mirror` to one
    /// `tokenway pull` alone and to eight at once sharing as peers (origin egress, time of
    /// each), and one pull's throughput against curl and aria2c -x8 on the same blob.
    Weights(WeightsBenchArgs),
    /// The gateway's routing policies side by side on a multi-turn chat workload over eight
    /// simulated backends with limited prefix caches (TTFT, cache hits), a far-backend scenario,
    /// and the router's decision time with 64 backends; JSON, Markdown and SVG plots.
    Routing(RoutingBenchArgs),
}

/// Flags of `tokenway bench routing`.
#[derive(clap::Args)]
pub struct RoutingBenchArgs {
    /// Smoke run of the whole pipeline (16 conversations x 3 turns per policy); under a minute.
    #[arg(long)]
    pub quick: bool,
    /// Directory for results.json, results.md, plots/, generated configs and server logs.
    #[arg(long, default_value = "bench-out/routing")]
    pub out: PathBuf,
    /// Conversations [default: 200, --quick 16].
    #[arg(long)]
    pub conversations: Option<usize>,
    /// Turns per conversation [default: 6, --quick 3].
    #[arg(long)]
    pub turns: Option<usize>,
    /// Offered load as a fraction of the cluster capacity derived from the sim's cost model.
    #[arg(long, default_value_t = 0.7)]
    pub load: f64,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Extra network delay of the two far backends, milliseconds (0 skips that scenario).
    #[arg(long, default_value_t = 30.0)]
    pub far_ms: f64,
    /// Policies to run (the far scenario needs cost and least_inflight).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "cost,round_robin,least_inflight,p2c_ewma"
    )]
    pub policies: Vec<String>,
}

/// Flags of `tokenway bench weights`.
#[derive(clap::Args)]
pub struct WeightsBenchArgs {
    /// Smoke run: a 64 MB model and four pullers; well under 30 s.
    #[arg(long)]
    pub quick: bool,
    /// Directory for results.json, results.md, plots/, logs, the generated model (kept and
    /// reused) and scratch data (deleted at the end).
    #[arg(long, default_value = "bench-out/weights")]
    pub out: PathBuf,
    /// Model size, binary units (`2G`, `500M`) [default: 2G, --quick 64M].
    #[arg(long, value_parser = tokenway_mirror::size::parse_size)]
    pub size: Option<u64>,
    /// Pullers started at once in the crowd scenario [default: 8, --quick 4].
    #[arg(long)]
    pub pullers: Option<usize>,
    /// Pieces each pull fetches at once (`tokenway pull --parallel`).
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Piece size the model is published with, KiB.
    #[arg(long, default_value_t = 4096)]
    pub piece_size_kib: u64,
    /// Seed of the generated model.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Keep the mirror caches and pulled copies under <out>/work.
    #[arg(long)]
    pub keep_work: bool,
    /// Every pull writes to a tmpfs of its own (root; RAM for each puller's copy) instead
    /// of this machine's one disk, standing in for a disk per node; labelled in the report.
    #[arg(long)]
    pub tmpfs_per_puller: bool,
    /// Cap every mirror's uplink (`tokenway mirror --limit-rate`), e.g. `400M` bytes per
    /// second: a mirror whose network, not loopback, is the limit.
    #[arg(long, value_name = "SIZE", value_parser = tokenway_mirror::size::parse_size)]
    pub mirror_limit_rate: Option<u64>,
    /// The crowd's pulls fetch pieces in file order (`tokenway pull --sequential`) instead of
    /// each starting at a random piece.
    #[arg(long)]
    pub sequential: bool,
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
    /// Sequential single-stream requests per target [default: 10000, --quick 200].
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

/// Flags of `tokenway bench transport`.
#[derive(clap::Args)]
pub struct TransportBenchArgs {
    /// Prove the pipeline: one profile (`wifi` as root, else `loopback`), 2 requests each of
    /// four scenarios; well under a minute.
    #[arg(long)]
    pub quick: bool,
    /// Directory for results.json, results.md, plots/, generated configs and server logs.
    #[arg(long, default_value = "bench-out/transport")]
    pub out: PathBuf,
    /// One profile: `loopback` (no lab, no root) or a netlab profile name or file (root).
    #[arg(long, conflicts_with_all = ["profiles", "all_profiles"])]
    pub profile: Option<String>,
    /// Several profiles, comma-separated, run one after another.
    #[arg(long, value_delimiter = ',', conflicts_with = "all_profiles")]
    pub profiles: Vec<String>,
    /// Every built-in netlab profile: fiber, wifi, 4g, lossy, satellite, udp-blocked, handover.
    #[arg(long)]
    pub all_profiles: bool,
    /// Transports to compare; the datagram-layer variants `tunnel-fec`, `tunnel-fec-obfs` and
    /// `tunnel-brutal` are opt-in.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "h1,h2,h3,tunnel,tunnel-tcp"
    )]
    pub transports: Vec<String>,
    /// Scenarios: first, first-0rtt, first-reused, stream, stream-fresh, upload, mix
    /// [default: all; --quick: first,first-0rtt,stream,mix].
    #[arg(long, value_delimiter = ',')]
    pub scenarios: Vec<String>,
    /// Requests per transport and scenario [default: 30, --quick 2].
    #[arg(long)]
    pub requests: Option<usize>,
    /// Output tokens of a streaming request.
    #[arg(long, default_value_t = 32)]
    pub tokens: u32,
    /// The simulated backend's time per output token, milliseconds.
    #[arg(long, default_value_t = 20.0)]
    pub token_ms: f64,
    /// Prompt size of the long-prompt upload, KiB.
    #[arg(long, default_value_t = 200)]
    pub upload_kib: usize,
    /// Transport the ratios in the tables are relative to.
    #[arg(long, default_value = "h1")]
    pub baseline: String,
    /// Name prefix of the netlab lab (namespaces `NAME-client`, `NAME-server`).
    #[arg(long, default_value = "twbench")]
    pub netlab_name: String,
    /// Seed of the link emulator.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Runs a benchmark.
pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Gateway(args) => gateway(args).await,
        BenchCommand::Transport(args) => transport(args).await,
        BenchCommand::Weights(args) => weights(args).await,
        BenchCommand::Routing(args) => routing(args).await,
    }
}

async fn transport(args: TransportBenchArgs) -> anyhow::Result<()> {
    use tokenway_bench::transport::{self as tb, Scenario, Transport};
    let root = tokenway_netlab::is_root();
    let profiles = if args.all_profiles {
        tb::ALL_PROFILES.iter().map(|p| (*p).to_owned()).collect()
    } else if let Some(p) = args.profile {
        vec![p]
    } else if !args.profiles.is_empty() {
        args.profiles
    } else if args.quick && root {
        vec!["wifi".to_owned()]
    } else {
        vec![tb::LOOPBACK.to_owned()]
    };
    if !root {
        if let Some(p) = profiles.iter().find(|p| *p != tb::LOOPBACK) {
            anyhow::bail!(
                "profile {p:?} needs root (network namespaces and TUN devices); \
                 without root use --profile loopback"
            );
        }
    }
    let parse_all = |what: &str, list: &[String]| -> anyhow::Result<()> {
        if list.is_empty() {
            anyhow::bail!("--{what} must name at least one");
        }
        Ok(())
    };
    parse_all("transports", &args.transports)?;
    let scenario_names: Vec<String> = if !args.scenarios.is_empty() {
        args.scenarios
    } else if args.quick {
        vec![
            Scenario::First.name().to_owned(),
            Scenario::First0rtt.name().to_owned(),
            Scenario::Stream.name().to_owned(),
            Scenario::Mix.name().to_owned(),
        ]
    } else {
        Scenario::ALL.iter().map(|s| s.name().to_owned()).collect()
    };
    let transports = args
        .transports
        .iter()
        .map(|t| t.parse::<Transport>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("--transports: {e}"))?;
    let scenarios = scenario_names
        .iter()
        .map(|s| s.parse::<Scenario>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("--scenarios: {e}"))?;
    let baseline = args
        .baseline
        .parse::<Transport>()
        .map_err(|e| anyhow::anyhow!("--baseline: {e}"))?;
    let requests = args.requests.unwrap_or(if args.quick { 2 } else { 30 });
    if requests == 0 || requests > 100_000 {
        anyhow::bail!("--requests must be in 1..=100000, got {requests}");
    }
    if args.tokens == 0 || args.tokens > 100_000 {
        anyhow::bail!("--tokens must be in 1..=100000, got {}", args.tokens);
    }
    if !(args.token_ms.is_finite() && args.token_ms >= 0.0 && args.token_ms <= 10_000.0) {
        anyhow::bail!("--token-ms must be in 0..=10000, got {}", args.token_ms);
    }
    if args.upload_kib == 0 || args.upload_kib > 64 * 1024 {
        anyhow::bail!("--upload-kib must be in 1..=65536, got {}", args.upload_kib);
    }
    let options = tb::TransportBenchOptions {
        exe: std::env::current_exe().context("cannot locate the tokenway executable")?,
        out_dir: args.out,
        profiles,
        transports,
        scenarios,
        requests,
        tokens: args.tokens,
        token_ms: args.token_ms,
        upload_bytes: args.upload_kib * 1024,
        baseline,
        netlab_name: args.netlab_name,
        seed: args.seed,
        command_line: command_line(),
    };
    let report = tb::run(&options).await?;
    println!("{}", report.to_markdown());
    println!(
        "results: {} and {}, plots in {}",
        options.out_dir.join("results.json").display(),
        options.out_dir.join("results.md").display(),
        options.out_dir.join("plots").display()
    );
    Ok(())
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
        sequential_requests: args
            .requests
            .unwrap_or(if args.quick { 200 } else { 10_000 }),
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

async fn routing(args: RoutingBenchArgs) -> anyhow::Result<()> {
    use tokenway_bench::routing::RoutingBenchOptions;
    let exe = std::env::current_exe().context("cannot locate the tokenway executable")?;
    let mut options = if args.quick {
        RoutingBenchOptions::quick(exe, args.out, command_line())
    } else {
        RoutingBenchOptions::full(exe, args.out, command_line())
    };
    if let Some(c) = args.conversations {
        if c == 0 || c > 100_000 {
            anyhow::bail!("--conversations must be in 1..=100000, got {c}");
        }
        options.shape.conversations = c;
    }
    if let Some(t) = args.turns {
        if t == 0 || t > 100 {
            anyhow::bail!("--turns must be in 1..=100, got {t}");
        }
        options.shape.turns = t;
    }
    if !(args.load.is_finite() && args.load > 0.0 && args.load <= 2.0) {
        anyhow::bail!("--load must be in (0, 2], got {}", args.load);
    }
    if !(args.far_ms.is_finite() && (0.0..=10_000.0).contains(&args.far_ms)) {
        anyhow::bail!("--far-ms must be in 0..=10000, got {}", args.far_ms);
    }
    if let Some(p) = args
        .policies
        .iter()
        .find(|p| !tokenway_bench::routing::POLICIES.contains(&p.as_str()))
    {
        anyhow::bail!(
            "--policies: unknown policy {p:?}; expected some of {}",
            tokenway_bench::routing::POLICIES.join(",")
        );
    }
    if args.policies.is_empty() {
        anyhow::bail!("--policies must name at least one policy");
    }
    options.policies = args.policies;
    options.load = args.load;
    options.shape.seed = args.seed;
    options.far_ms = args.far_ms;
    let report = tokenway_bench::routing::run(&options).await?;
    println!("{}", report.to_markdown());
    println!(
        "results: {} and {}, plots in {}",
        options.out_dir.join("results.json").display(),
        options.out_dir.join("results.md").display(),
        options.out_dir.join("plots").display()
    );
    Ok(())
}

async fn weights(args: WeightsBenchArgs) -> anyhow::Result<()> {
    let size = args
        .size
        .unwrap_or(if args.quick { 64 << 20 } else { 2 << 30 });
    if !(1 << 20..=1 << 40).contains(&size) {
        anyhow::bail!("--size must be between 1M and 1T, got {size} bytes");
    }
    let pullers = args.pullers.unwrap_or(if args.quick { 4 } else { 8 });
    if !(1..=64).contains(&pullers) {
        anyhow::bail!("--pullers must be in 1..=64, got {pullers}");
    }
    if !(1..=256).contains(&args.parallel) {
        anyhow::bail!("--parallel must be in 1..=256, got {}", args.parallel);
    }
    if !(64..=65536).contains(&args.piece_size_kib) {
        anyhow::bail!(
            "--piece-size-kib must be in 64..=65536, got {}",
            args.piece_size_kib
        );
    }
    let options = tokenway_bench::weights::WeightsBenchOptions {
        exe: std::env::current_exe().context("cannot locate the tokenway executable")?,
        out_dir: args.out,
        size,
        pullers,
        parallel: args.parallel,
        piece_size_kib: args.piece_size_kib,
        seed: args.seed,
        keep_work: args.keep_work,
        tmpfs_per_puller: args.tmpfs_per_puller,
        mirror_limit_rate: args.mirror_limit_rate,
        sequential: args.sequential,
        command_line: command_line(),
    };
    let report = tokenway_bench::weights::run(&options).await?;
    println!("{}", report.to_markdown());
    println!(
        "results: {} and {}, plot in {}",
        options.out_dir.join("results.json").display(),
        options.out_dir.join("results.md").display(),
        options.out_dir.join("plots").display()
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
