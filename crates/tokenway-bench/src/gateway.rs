//! `tokenway bench gateway`: the same load against a simulated backend directly, through
//! `tokenway gateway`, and through nginx, side by side in one run.
//!
//! Scenarios: sequential single-stream requests (time to first token), interleaved across the
//! targets, all running at once; then a closed-loop throughput level per concurrency, with one
//! connection per concurrent worker, the targets taking turns in slices of the level's time. For
//! the gateway only, a fresh gateway in front of a slow sim holds many streams open at once to
//! measure its memory per open stream.
//! The sim answers instantly (no base latency, no per-token time, effectively infinite prefill)
//! so that what is measured is the network path, not the simulated model.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::load::{self, LoadClient, Sample};
use crate::plot;
use crate::process::{self, write_file, ChildProcess};
use crate::report::{
    self, CpuUse, GatewayBenchReport, LoadResult, Machine, OpenStreamsResult, ScenarioResult,
    Settings, StealPercent, TargetKind, TargetResult,
};
use crate::stats::{LatencySummary, TailSummary};
use crate::{nginx, BenchError};

/// Output tokens per request in the sequential and throughput scenarios.
const MAX_TOKENS: u32 = 16;
/// Output tokens per open stream.
const OPEN_STREAM_TOKENS: u32 = 50;
/// The sim's time per output token for the open streams: 50 tokens live about 5 s.
const OPEN_STREAM_TPOT_MS: f64 = 100.0;
/// Slices of each throughput level: the targets take turns, `duration / LOAD_SLICES` each, the
/// first of a round rotating. A shared machine's speed drifts by ±20 % within a minute (seen on
/// a 2-core VM: the same sim's direct rate between 18k and 24k requests/s from one minute to the
/// next); run whole, one after the other, a target that met a slow spell lost to one that did
/// not. In turns, the drift falls on every target alike.
const LOAD_SLICES: u32 = 5;
/// Stolen CPU time (percent) above which the report warns that the run was noisy: in the runs
/// of docs/benchmarks.md ("The single stream's tail, and time the hypervisor stole"), the one at
/// 0.5 % passed every verdict and those at 1.8 % and 4.7 % lost the close ones.
const NOISY_STEAL_PERCENT: f64 = 1.0;
/// How long a server may take to print its address and answer a first request.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(15);

/// What to run.
#[derive(Clone, Debug)]
pub struct GatewayBenchOptions {
    /// The `tokenway` executable whose `sim` and `gateway` subcommands are measured.
    pub exe: PathBuf,
    /// Where results, generated configs and server logs go.
    pub out_dir: PathBuf,
    /// Requests in the sequential scenario.
    pub sequential_requests: usize,
    /// Length of each throughput level.
    pub duration: Duration,
    /// Concurrency levels.
    pub concurrency: Vec<usize>,
    /// Streams held open at once through the gateway (0 skips the scenario).
    pub open_streams: usize,
    /// Compare with nginx when it is installed.
    pub nginx: bool,
    /// The command line, for the report.
    pub command_line: String,
}

/// Runs the benchmark, writes `results.json` and `results.md` into `out_dir`, and returns the
/// report.
pub async fn run(opts: &GatewayBenchOptions) -> Result<GatewayBenchReport, BenchError> {
    let timestamp = report::rfc3339(SystemTime::now());
    let loadavg_before = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.trim().to_owned());
    let logs = opts.out_dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(|source| BenchError::Io {
        context: format!("cannot create {}", logs.display()),
        source,
    })?;
    let mut notes = Vec::new();
    let nginx_binary = if opts.nginx {
        let found = nginx::find();
        if found.is_none() {
            let note = "nginx not found on PATH: nginx comparison skipped \
                        (scripts/setup.sh installs it)";
            println!("note: {note}");
            notes.push(note.to_owned());
        }
        found
    } else {
        notes.push("nginx comparison disabled with --no-nginx".to_owned());
        None
    };

    let sim_config = sim_toml(0.0, opts.concurrency.iter().copied().max().unwrap_or(1) * 4);
    let (sim, sim_addr) = start_sim(opts, "sim", &sim_config).await?;
    progress("direct: sim at", sim_addr);
    let (gateway, gateway_addr) = start_gateway(opts, "gateway", sim_addr).await?;
    progress("gateway at", gateway_addr);
    let mut nginx_version = None;
    let mut nginx_proxy = None;
    if let Some(binary) = &nginx_binary {
        nginx_version = command_output(Command::new(binary).arg("-v"), true);
        // A broken nginx installation costs the comparison, not the gateway's results.
        match nginx::start(binary, &opts.out_dir.join("nginx"), sim_addr).await {
            Ok((proxy, addr)) => {
                progress("nginx at", addr);
                nginx_proxy = Some((proxy, addr));
            }
            Err(e) => {
                let note = format!("nginx comparison skipped: {e}");
                println!("note: {note}");
                notes.push(note);
            }
        }
    }
    let mut live = vec![
        (TargetKind::Direct, sim_addr, None),
        (TargetKind::Gateway, gateway_addr, Some(&gateway)),
    ];
    if let Some((proxy, addr)) = &nginx_proxy {
        live.push((TargetKind::Nginx, *addr, Some(proxy)));
    }

    // Single streams, interleaved across the targets (see `load::interleaved`).
    let mut connections: Vec<_> = live
        .iter()
        .map(|(_, addr, _)| load::LoadConnection::new(*addr))
        .collect();
    // Warm up: connections, allocator arenas, the gateway's backend view.
    let _ = load::interleaved(
        &mut connections,
        opts.sequential_requests.min(200),
        MAX_TOKENS,
    )
    .await;
    eprintln!(
        "[bench gateway] {} sequential requests per target, interleaved",
        opts.sequential_requests
    );
    let ticks = process::machine_cpu_ticks();
    let sequential =
        load::interleaved(&mut connections, opts.sequential_requests, MAX_TOKENS).await;
    let steal_sequential = process::steal_percent(ticks, process::machine_cpu_ticks());
    drop(connections);

    let ttfts: Vec<Vec<Duration>> = sequential.iter().map(|s| ok_ttfts(s)).collect();
    write_ttft_cdf(opts, &live, &ttfts);

    let ticks = process::machine_cpu_ticks();
    let levels = run_levels(opts, &live, &sim).await;
    let steal_load = process::steal_percent(ticks, process::machine_cpu_ticks());
    for (phase, steal) in [
        ("sequential requests", steal_sequential),
        ("throughput levels", steal_load),
    ] {
        if let Some(p) = steal.filter(|&p| p > NOISY_STEAL_PERCENT) {
            notes.push(format!(
                "the hypervisor stole {p:.1} % of the CPU time during the {phase}: on this \
                 machine's runs, that much came with the targets' gaps of a few µs and a few \
                 percent turning either way; rerun at a calmer time before reading a verdict \
                 decided by that little"
            ));
        }
    }
    let targets = live
        .iter()
        .zip(sequential)
        .zip(ttfts)
        .zip(levels)
        .map(|((((kind, _, proxy), samples), ttft), load)| TargetResult {
            target: *kind,
            sequential: summarize(&samples),
            sequential_ttft_tail: TailSummary::from_durations(&ttft),
            load,
            proxy_memory: proxy.and_then(ChildProcess::memory),
        })
        .collect();
    drop(live);
    drop(nginx_proxy);
    drop(gateway);
    drop(sim);

    let open_streams = if opts.open_streams > 0 {
        Some(run_open_streams(opts).await?)
    } else {
        None
    };

    let mut report = GatewayBenchReport {
        machine: Machine {
            nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
            kernel: command_output(Command::new("uname").arg("-r"), false).or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/osrelease")
                    .ok()
                    .map(|s| s.trim().to_owned())
            }),
            git_commit: command_output(
                Command::new("git").args(["rev-parse", "--short", "HEAD"]),
                false,
            ),
            nginx_version,
            loadavg_before,
            steal_percent: StealPercent {
                sequential: steal_sequential,
                load: steal_load,
            },
        },
        command_line: opts.command_line.clone(),
        timestamp,
        settings: Settings {
            sequential_requests: opts.sequential_requests,
            duration_secs: opts.duration.as_secs_f64(),
            concurrency: opts.concurrency.clone(),
            max_tokens: MAX_TOKENS,
            open_streams: opts.open_streams,
            open_stream_tokens: OPEN_STREAM_TOKENS,
            open_stream_tpot_ms: OPEN_STREAM_TPOT_MS,
        },
        targets,
        open_streams,
        notes,
        verdicts: Vec::new(),
    };
    report.verdicts = report.compute_verdicts();
    report.write(&opts.out_dir)?;
    Ok(report)
}

fn progress(what: &str, addr: impl std::fmt::Display) {
    eprintln!("[bench gateway] {what} {addr}");
}

/// The sim configuration: instant answers unless `tpot_ms` > 0, no batching slow-down, no
/// prefix cache (nothing to route on here), room for `slots` concurrent requests.
fn sim_toml(tpot_ms: f64, slots: usize) -> String {
    format!(
        "# Generated by tokenway bench gateway.\n\
         model_names = [\"sim-model\"]\n\
         base_latency_ms = 0.0\n\
         time_per_output_token_ms = {tpot_ms:?}\n\
         prefill_tokens_per_second = 1.0e12\n\
         batch_penalty = 0.0\n\
         max_concurrency = {slots}\n\
         max_queue = {slots}\n\
         prefix_cache_tokens = 0\n"
    )
}

async fn start_sim(
    opts: &GatewayBenchOptions,
    name: &str,
    config: &str,
) -> Result<(ChildProcess, std::net::SocketAddr), BenchError> {
    let path = opts.out_dir.join(format!("{name}.toml"));
    write_file(&path, config)?;
    let mut command = Command::new(&opts.exe);
    command
        .arg("sim")
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--config")
        .arg(&path);
    let log = opts.out_dir.join("logs").join(format!("{name}.log"));
    let (child, addr) = ChildProcess::spawn_with_banner(
        name,
        command,
        "tokenway sim listening on",
        &log,
        STARTUP_TIMEOUT,
    )
    .await?;
    wait_serving(name, &LoadClient::new(addr)).await?;
    Ok((child, addr))
}

async fn start_gateway(
    opts: &GatewayBenchOptions,
    name: &str,
    backend: std::net::SocketAddr,
) -> Result<(ChildProcess, std::net::SocketAddr), BenchError> {
    let path = opts.out_dir.join(format!("{name}.toml"));
    write_file(
        &path,
        &format!(
            "# Generated by tokenway bench gateway.\n\
             listen = \"127.0.0.1:0\"\n\n\
             [[backends]]\n\
             url = \"http://{backend}\"\n\
             models = [\"sim-model\"]\n\
             max_inflight = 4096\n"
        ),
    )?;
    let mut command = Command::new(&opts.exe);
    command.arg("gateway").arg("--config").arg(&path);
    let log = opts.out_dir.join("logs").join(format!("{name}.log"));
    let (child, addr) = ChildProcess::spawn_with_banner(
        name,
        command,
        "tokenway gateway listening on",
        &log,
        STARTUP_TIMEOUT,
    )
    .await?;
    wait_serving(name, &LoadClient::new(addr)).await?;
    Ok((child, addr))
}

/// Retries one short request until it succeeds (a gateway may still be probing its backends).
async fn wait_serving(name: &str, client: &LoadClient) -> Result<(), BenchError> {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        let sample = client.chat(load::chat_body(1), None).await;
        match sample.error {
            None => return Ok(()),
            Some(message) if Instant::now() > deadline => {
                return Err(BenchError::NotServing {
                    target: name.to_owned(),
                    message,
                })
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// First line of a command's stdout (or stderr), trimmed; `None` if it fails.
fn command_output(command: &mut Command, stderr: bool) -> Option<String> {
    let out = command.output().ok()?;
    if !out.status.success() {
        return None;
    }
    let bytes = if stderr { out.stderr } else { out.stdout };
    let line = String::from_utf8_lossy(&bytes)
        .lines()
        .next()?
        .trim()
        .to_owned();
    (!line.is_empty()).then_some(line)
}

/// The times to first token of the successful requests among `samples`.
fn ok_ttfts(samples: &[Sample]) -> Vec<Duration> {
    samples
        .iter()
        .filter(|s| s.ok())
        .filter_map(|s| s.ttft)
        .collect()
}

/// `ttft-cdf.svg` in the output directory: the sequential requests' time to first token per
/// target. A plot that cannot be written is reported and skipped; the numbers are in the report.
fn write_ttft_cdf(
    opts: &GatewayBenchOptions,
    live: &[(TargetKind, std::net::SocketAddr, Option<&ChildProcess>)],
    ttfts: &[Vec<Duration>],
) {
    let series: Vec<plot::Series> = live
        .iter()
        .zip(ttfts)
        .map(|((kind, _, _), ttft)| plot::Series {
            label: kind.label().to_owned(),
            values: ttft.iter().map(|d| d.as_secs_f64() * 1e3).collect(),
        })
        .collect();
    let path = opts.out_dir.join("ttft-cdf.svg");
    let title = "single stream: time to first token";
    if let Err(e) = plot::cdf_svg(&path, title, "TTFT (ms)", &series) {
        eprintln!("[bench gateway] {e}");
    }
}

/// Counts, latencies and the first error of a set of samples.
pub fn summarize(samples: &[Sample]) -> ScenarioResult {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok()).collect();
    let ttft: Vec<Duration> = ok.iter().filter_map(|s| s.ttft).collect();
    let total: Vec<Duration> = ok.iter().map(|s| s.total).collect();
    ScenarioResult {
        requests: samples.len(),
        errors: samples.len() - ok.len(),
        ttft: LatencySummary::from_durations(&ttft),
        total: LatencySummary::from_durations(&total),
        first_error: samples.iter().find_map(|s| s.error.clone()),
    }
}

/// The throughput levels, all targets in turns (see [`LOAD_SLICES`]): per target, its levels.
async fn run_levels(
    opts: &GatewayBenchOptions,
    live: &[(TargetKind, std::net::SocketAddr, Option<&ChildProcess>)],
    sim: &ChildProcess,
) -> Vec<Vec<LoadResult>> {
    let warmup = (opts.duration / 4).min(Duration::from_secs(1));
    let slice = opts.duration / LOAD_SLICES;
    let mut connections: Vec<Vec<load::LoadConnection>> = live.iter().map(|_| Vec::new()).collect();
    let mut levels: Vec<Vec<LoadResult>> = live.iter().map(|_| Vec::new()).collect();
    for &c in &opts.concurrency {
        eprintln!(
            "[bench gateway] concurrency {c}: {:?} per target, in {LOAD_SLICES} turns",
            opts.duration
        );
        for (conns, (_, addr, _)) in connections.iter_mut().zip(live) {
            let _ = load::closed_loop(conns, *addr, c, warmup, MAX_TOKENS).await;
        }
        let mut turns: Vec<Turns> = live.iter().map(|_| Turns::new()).collect();
        for round in 0..LOAD_SLICES as usize {
            for k in 0..live.len() {
                let i = (round + k) % live.len();
                let (_, addr, proxy) = live[i];
                let before = cpu_snapshot(sim, proxy);
                let (samples, wall) =
                    load::closed_loop(&mut connections[i], addr, c, slice, MAX_TOKENS).await;
                turns[i].add(samples, wall, before, cpu_snapshot(sim, proxy));
            }
        }
        for (level, turns) in levels.iter_mut().zip(turns) {
            level.push(turns.result(c));
        }
    }
    levels
}

/// One target's turns at one throughput level, added up.
struct Turns {
    samples: Vec<Sample>,
    wall: Duration,
    /// CPU seconds of the load generator, the sim and the proxy while the turns ran.
    cpu: [Option<f64>; 3],
}

impl Turns {
    fn new() -> Self {
        Turns {
            samples: Vec::new(),
            wall: Duration::ZERO,
            cpu: [Some(0.0); 3],
        }
    }

    /// Adds a turn; a CPU figure that cannot be read in one turn is unknown for the level.
    fn add(
        &mut self,
        samples: Vec<Sample>,
        wall: Duration,
        before: CpuSnapshot,
        after: CpuSnapshot,
    ) {
        self.samples.extend(samples);
        self.wall += wall;
        let deltas = [
            (before.0, after.0),
            (before.1, after.1),
            (before.2, after.2),
        ];
        for (sum, (b, a)) in self.cpu.iter_mut().zip(deltas) {
            *sum = sum.zip(a.zip(b)).map(|(s, (a, b))| s + a - b);
        }
    }

    fn result(self, concurrency: usize) -> LoadResult {
        let scenario = summarize(&self.samples);
        let secs = self.wall.as_secs_f64();
        let pct = |cpu: Option<f64>| cpu.map(|c| c / secs * 100.0);
        LoadResult {
            concurrency,
            wall_secs: secs,
            rps: (scenario.requests - scenario.errors) as f64 / secs,
            scenario,
            cpu: CpuUse {
                load_generator: pct(self.cpu[0]),
                sim: pct(self.cpu[1]),
                proxy: pct(self.cpu[2]),
            },
        }
    }
}

type CpuSnapshot = (Option<f64>, Option<f64>, Option<f64>);

fn cpu_snapshot(sim: &ChildProcess, proxy: Option<&ChildProcess>) -> CpuSnapshot {
    (
        process::own_cpu_seconds(),
        sim.cpu_seconds(),
        proxy.and_then(ChildProcess::cpu_seconds),
    )
}

/// Many streams open at once through a fresh gateway in front of a slow sim; the gateway's
/// RSS is sampled while all of them are open.
async fn run_open_streams(opts: &GatewayBenchOptions) -> Result<OpenStreamsResult, BenchError> {
    let n = opts.open_streams;
    let config = sim_toml(OPEN_STREAM_TPOT_MS, n * 2);
    let (_sim, sim_addr) = start_sim(opts, "sim-slow", &config).await?;
    let (gateway, addr) = start_gateway(opts, "gateway-open-streams", sim_addr).await?;
    eprintln!("[bench gateway] gateway: {n} open streams");
    let client = LoadClient::new(addr);
    let started = Arc::new(AtomicUsize::new(0));
    let mut streams = load::open_streams(&client, n, OPEN_STREAM_TOKENS, started.clone());
    // Every stream lives OPEN_STREAM_TOKENS * OPEN_STREAM_TPOT_MS (5 s); sample once all have
    // begun, or give up waiting after half that time and sample what is open.
    let lifetime =
        Duration::from_secs_f64(f64::from(OPEN_STREAM_TOKENS) * OPEN_STREAM_TPOT_MS / 1e3);
    let give_up = Instant::now() + lifetime / 2;
    while started.load(Ordering::Relaxed) < n && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut rss_open_kib = 0;
    let mut open_when_sampled = 0;
    for _ in 0..5 {
        if let Some(m) = gateway.memory() {
            rss_open_kib = rss_open_kib.max(m.rss_kib);
        }
        open_when_sampled = open_when_sampled.max(started.load(Ordering::Relaxed));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut samples = Vec::with_capacity(n);
    while let Some(joined) = streams.join_next().await {
        samples.push(joined.unwrap_or_else(|e| Sample {
            ttft: None,
            total: Duration::ZERO,
            gaps: Vec::new(),
            error: Some(format!("stream task failed: {e}")),
        }));
    }
    let hwm_kib = gateway.memory().map_or(0, |m| m.hwm_kib);
    Ok(OpenStreamsResult {
        streams: n,
        open_when_sampled,
        rss_open_kib,
        hwm_kib,
        scenario: summarize(&samples),
    })
}
