//! `tokenway bench transport`: the same streaming chat requests over every way tokenway can
//! carry them, on emulated networks, side by side.
//!
//! Transports: `h1` (HTTP/1.1 over TCP to the gateway), `h2` (HTTP/2 over TLS), `h3` (HTTP/3
//! over QUIC to the gateway's public front), `tunnel` (HTTP/1.1 to a local `tokenway edge`,
//! HTTP/3 through the tunnel to the gateway) and `tunnel-tcp` (the same edge forced onto its
//! TCP fallback by a QUIC address that nobody answers). The datagram-layer variants (issue 5)
//! go through edges and gateways with generated `[datagram]` / `[tunnel.datagram]` sections:
//! `tunnel-fec` (FEC `auto`), `tunnel-fec-obfs` (FEC and obfuscation, its own gateway, since
//! both ends must agree on obfuscation) and `tunnel-brutal` (FEC and brutal at
//! [`stack::BRUTAL_RATE`]; the edge advertises its receive rate, so the gateway sends with
//! brutal too).
//!
//! Placement: on a netlab profile the sim and the gateway run in the lab's server namespace,
//! the edges and the load generator in its client namespace ([`stack`]); the load generator is
//! a single-threaded runtime on a thread that entered the client namespace, so all its sockets
//! live there. `loopback` runs everything on 127.0.0.1 without a lab (no root needed).
//!
//! Scenarios ([`Scenario`]) are run round-robin across transports (request *i* of every
//! transport, then request *i + 1*), so conditions that change over time (handover blackouts,
//! machine load) hit every transport alike. Nothing here asserts on time: the output is
//! `results.json`, `results.md` and SVG plots ([`crate::plot`]).

pub mod clients;
pub mod datagram;
pub mod report;
pub mod stack;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;

use self::clients::{Clients, Record};
use self::report::{ProfileResult, RunResult, Settings, TransportReport};
use self::stack::{LabGuard, Placement, StackSpec, Targets};
use crate::BenchError;

/// A way to carry a request from the client side to the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Transport {
    /// HTTP/1.1 over TCP, straight to the gateway.
    #[serde(rename = "h1")]
    H1,
    /// HTTP/2 over TLS over TCP, straight to the gateway.
    #[serde(rename = "h2")]
    H2,
    /// HTTP/3 over QUIC, straight to the gateway's HTTP/3 front.
    #[serde(rename = "h3")]
    H3,
    /// Through `tokenway edge` and the QUIC tunnel.
    #[serde(rename = "tunnel")]
    Tunnel,
    /// Through `tokenway edge` on its TCP fallback (HTTP/2 over TLS).
    #[serde(rename = "tunnel-tcp")]
    TunnelTcp,
    /// The tunnel with FEC (`auto`) in the datagram layer.
    #[serde(rename = "tunnel-fec")]
    TunnelFec,
    /// The tunnel with FEC and obfuscation.
    #[serde(rename = "tunnel-fec-obfs")]
    TunnelFecObfs,
    /// The tunnel with FEC and brutal congestion control both ways.
    #[serde(rename = "tunnel-brutal")]
    TunnelBrutal,
}

impl Transport {
    /// Every transport, in table order.
    pub const ALL: [Transport; 8] = [
        Self::H1,
        Self::H2,
        Self::H3,
        Self::Tunnel,
        Self::TunnelTcp,
        Self::TunnelFec,
        Self::TunnelFecObfs,
        Self::TunnelBrutal,
    ];

    /// The datagram-layer variants of the tunnel.
    pub const LAYERED: [Transport; 3] = [Self::TunnelFec, Self::TunnelFecObfs, Self::TunnelBrutal];

    /// Whether this goes through an edge (and so has edge metrics).
    pub fn via_edge(self) -> bool {
        !matches!(self, Self::H1 | Self::H2 | Self::H3)
    }

    /// Whether this runs the datagram layer.
    pub fn layered(self) -> bool {
        Self::LAYERED.contains(&self)
    }

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::H1 => "h1",
            Self::H2 => "h2",
            Self::H3 => "h3",
            Self::Tunnel => "tunnel",
            Self::TunnelTcp => "tunnel-tcp",
            Self::TunnelFec => "tunnel-fec",
            Self::TunnelFecObfs => "tunnel-fec-obfs",
            Self::TunnelBrutal => "tunnel-brutal",
        }
    }
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown transport {s:?}; one of h1, h2, h3, tunnel, tunnel-tcp, \
                     tunnel-fec, tunnel-fec-obfs, tunnel-brutal"
                )
            })
    }
}

/// How the connection a request travels on came to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A new connection, full handshake (for the tunnel: the edge redials its gateway).
    Fresh,
    /// A new connection resumed with 0-RTT early data.
    ZeroRtt,
    /// An existing, warm connection.
    Reused,
}

/// What is measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// First request (1 token) on a fresh connection: TTFT includes the handshake.
    First,
    /// First request (1 token) on a 0-RTT resumed connection (h3, tunnel).
    #[serde(rename = "first-0rtt")]
    First0rtt,
    /// A 1-token request on an existing connection.
    FirstReused,
    /// Streaming chat (N tokens) on an existing connection.
    Stream,
    /// Streaming chat (N tokens) on a fresh connection per request.
    StreamFresh,
    /// Streaming chat after a long prompt upload, on an existing connection.
    Upload,
    /// A short streaming request started together with a long upload on the same connection
    /// (on HTTP/1.1: a second pooled connection); the short one is measured.
    Mix,
}

impl Scenario {
    /// Every scenario, in run and table order.
    pub const ALL: [Scenario; 7] = [
        Self::First,
        Self::First0rtt,
        Self::FirstReused,
        Self::Stream,
        Self::StreamFresh,
        Self::Upload,
        Self::Mix,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::First => "first",
            Self::First0rtt => "first-0rtt",
            Self::FirstReused => "first-reused",
            Self::Stream => "stream",
            Self::StreamFresh => "stream-fresh",
            Self::Upload => "upload",
            Self::Mix => "mix",
        }
    }

    /// One line for the report.
    pub fn description(self) -> &'static str {
        match self {
            Self::First => "1-token request on a fresh connection (handshake included)",
            Self::First0rtt => "1-token request on a 0-RTT resumed connection",
            Self::FirstReused => "1-token request on an existing connection",
            Self::Stream => "streaming chat on an existing connection",
            Self::StreamFresh => "streaming chat, fresh connection per request",
            Self::Upload => "streaming chat with a long prompt upload, existing connection",
            Self::Mix => "short streaming chat started together with a long upload; the short one",
        }
    }

    fn mode(self) -> Mode {
        match self {
            Self::First | Self::StreamFresh => Mode::Fresh,
            Self::First0rtt => Mode::ZeroRtt,
            _ => Mode::Reused,
        }
    }

    /// Whether `transport` has this scenario (0-RTT exists only for QUIC).
    pub fn applies_to(self, transport: Transport) -> bool {
        self != Self::First0rtt
            || matches!(transport, Transport::H3 | Transport::Tunnel)
            || transport.layered()
    }
}

impl std::str::FromStr for Scenario {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown scenario {s:?}; one of first, first-0rtt, first-reused, stream, \
                     stream-fresh, upload, mix"
                )
            })
    }
}

/// The built-in profiles `--all-profiles` runs (netlab profiles; `loopback` is separate).
pub const ALL_PROFILES: [&str; 7] = [
    "fiber",
    "wifi",
    "4g",
    "lossy",
    "satellite",
    "udp-blocked",
    "handover",
];

/// The profile without a lab: everything on 127.0.0.1.
pub const LOOPBACK: &str = "loopback";

/// `lossy` without its loss (100 ms RTT, nothing else): the reference of issue 5's "p99 TTFT
/// within 1.25 × its own p99 on the same link without loss". Generated into the output
/// directory when named.
pub const LOSSY_NOLOSS: &str = "lossy-noloss";

/// The profile file of [`LOSSY_NOLOSS`].
fn lossy_noloss_file(out_dir: &std::path::Path) -> Result<String, BenchError> {
    let path = out_dir.join(format!("{LOSSY_NOLOSS}.toml"));
    std::fs::write(
        &path,
        "description = \"lossy without loss: 100 ms RTT, no loss\"\n\
         [conditions]\ndelay_ms = 50.0\n",
    )
    .map_err(|source| BenchError::Io {
        context: format!("cannot write {}", path.display()),
        source,
    })?;
    Ok(path.display().to_string())
}

/// What to run.
#[derive(Clone, Debug)]
pub struct TransportBenchOptions {
    /// The `tokenway` executable (sim, gateway, edge, netlab).
    pub exe: PathBuf,
    /// Where results, plots, configs and logs go.
    pub out_dir: PathBuf,
    /// Profiles in order: `loopback` or netlab profile names or files.
    pub profiles: Vec<String>,
    /// Transports to compare.
    pub transports: Vec<Transport>,
    /// Scenarios to run.
    pub scenarios: Vec<Scenario>,
    /// Requests per transport and scenario.
    pub requests: usize,
    /// Output tokens of a streaming request.
    pub tokens: u32,
    /// The sim's time per output token, milliseconds.
    pub token_ms: f64,
    /// Prompt size of the upload, bytes.
    pub upload_bytes: usize,
    /// Transport the ratios are relative to.
    pub baseline: Transport,
    /// Name prefix of the netlab lab.
    pub netlab_name: String,
    /// Seed of the link emulator.
    pub seed: u64,
    /// The command line, for the report.
    pub command_line: String,
}

/// Request bodies of one run.
#[derive(Clone)]
struct Bodies {
    one_token: Bytes,
    stream: Bytes,
    upload: Bytes,
}

fn chat_body(max_tokens: u32, prompt: &str) -> Bytes {
    let body = serde_json::json!({
        "model": "sim-model",
        "stream": true,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": prompt}],
    });
    Bytes::from(body.to_string())
}

impl Bodies {
    fn new(tokens: u32, upload_bytes: usize) -> Self {
        let short = "Say something short about networks and latency.";
        let filler = "The quick brown fox measures the round trip time of a lossy link. ";
        let mut long = String::with_capacity(upload_bytes + filler.len());
        while long.len() < upload_bytes {
            long.push_str(filler);
        }
        long.truncate(upload_bytes);
        Self {
            one_token: chat_body(1, short),
            stream: chat_body(tokens, short),
            upload: chat_body(tokens, &long),
        }
    }
}

fn progress(message: impl std::fmt::Display) {
    eprintln!("[bench transport] {message}");
}

/// Runs every profile, writes `results.json`, `results.md` and the plots into `out_dir`
/// (rewritten after each profile, so an interrupted run keeps what it measured), and returns
/// the report.
pub async fn run(opts: &TransportBenchOptions) -> Result<TransportReport, BenchError> {
    let timestamp = crate::report::rfc3339(SystemTime::now());
    std::fs::create_dir_all(&opts.out_dir).map_err(|source| BenchError::Io {
        context: format!("cannot create {}", opts.out_dir.display()),
        source,
    })?;
    let mut descriptions = Vec::new();
    let mut profiles = Vec::new();
    for p in &opts.profiles {
        if p == LOSSY_NOLOSS {
            profiles.push(lossy_noloss_file(&opts.out_dir)?);
        } else {
            profiles.push(p.clone());
        }
    }
    for p in &profiles {
        if p == LOOPBACK {
            descriptions.push("everything on 127.0.0.1, no emulated link".to_owned());
            continue;
        }
        if !tokenway_netlab::is_root() {
            return Err(BenchError::Child {
                name: format!("netlab profile {p}"),
                message: "needs root (network namespaces and TUN devices); \
                          use --profile loopback without root"
                    .into(),
            });
        }
        let profile = tokenway_netlab::Profile::load(p).map_err(|e| BenchError::Child {
            name: format!("netlab profile {p}"),
            message: e.to_string(),
        })?;
        descriptions.push(profile.description.clone());
    }
    let mut report = TransportReport::new(opts, timestamp);
    for (profile, description) in profiles.iter().zip(descriptions) {
        let started = Instant::now();
        progress(format_args!("profile {profile}: starting"));
        let result = run_profile(opts, profile, description).await?;
        progress(format_args!(
            "profile {profile}: done in {:.0} s",
            started.elapsed().as_secs_f64()
        ));
        report.profiles.push(result);
        report.write(&opts.out_dir)?;
    }
    Ok(report)
}

async fn run_profile(
    opts: &TransportBenchOptions,
    profile: &str,
    description: String,
) -> Result<ProfileResult, BenchError> {
    let placement = if profile == LOOPBACK {
        Placement::Loopback
    } else {
        Placement::Netlab {
            prefix: opts.netlab_name.clone(),
        }
    };
    let lab = match &placement {
        Placement::Loopback => None,
        Placement::Netlab { prefix } => {
            Some(LabGuard::up(&opts.exe, prefix, profile, opts.seed).await?)
        }
    };
    let profile_name = std::path::Path::new(profile)
        .file_stem()
        .map_or(profile.to_owned(), |s| s.to_string_lossy().into_owned());
    let dir = stack::profile_dir(&opts.out_dir, &profile_name);
    let stack = stack::start(&StackSpec {
        exe: &opts.exe,
        dir: &dir,
        placement: &placement,
        token_ms: opts.token_ms,
        layered: opts.transports.iter().any(|t| t.layered()),
    })
    .await?;
    let targets = stack.targets.clone();
    let namespace = placement.client_namespace();
    let plan = Plan {
        transports: opts.transports.clone(),
        scenarios: opts.scenarios.clone(),
        requests: opts.requests,
        bodies: Bodies::new(opts.tokens, opts.upload_bytes),
    };
    let measured = tokio::task::spawn_blocking(move || -> Result<Measured, String> {
        let work = move || -> Result<Measured, String> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("cannot build the load generator's runtime: {e}"))?;
            rt.block_on(measure(targets, plan))
        };
        match namespace {
            None => work(),
            Some(ns) => {
                tokenway_netlab::netns::run_in_namespace(&ns, work).map_err(|e| e.to_string())?
            }
        }
    })
    .await
    .map_err(|e| BenchError::Child {
        name: "load generator".into(),
        message: format!("task failed: {e}"),
    })?
    .map_err(|message| BenchError::Child {
        name: "load generator".into(),
        message,
    })?;
    drop(stack);
    drop(lab);
    Ok(ProfileResult {
        profile: profile_name,
        description,
        unavailable: measured.unavailable,
        runs: measured.runs,
        notes: edge_log_notes(&dir.join("logs")),
    })
}

/// Counts, per edge, the retries and redials its log (at info) recorded: the edge re-sends a
/// request refused before its first byte, which a client cannot see but pays for in TTFT.
fn edge_log_notes(logs: &std::path::Path) -> Vec<String> {
    let mut notes = Vec::new();
    for (edge, carries) in [
        ("edge", "tunnel (except fresh)"),
        ("edge-full", "tunnel fresh"),
        ("edge-tcp", "tunnel-tcp"),
    ] {
        let Ok(log) = std::fs::read_to_string(logs.join(format!("{edge}.log"))) else {
            continue;
        };
        let count = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
        let refused = count("refused before the first byte; retrying");
        let rejected = count("0-RTT early data was rejected");
        let fresh = count("retrying on a fresh connection");
        let connected = count("tunnel connected");
        notes.push(format!(
            "{edge} ({carries}): {connected} tunnel connections, {refused} requests re-sent on \
             the same connection ({rejected} after \"0-RTT early data was rejected\"), {fresh} \
             re-sent on a fresh connection"
        ));
    }
    notes
}

struct Plan {
    transports: Vec<Transport>,
    scenarios: Vec<Scenario>,
    requests: usize,
    bodies: Bodies,
}

struct Measured {
    runs: Vec<RunResult>,
    unavailable: Vec<(Transport, String)>,
}

/// A transport that fails this many requests in a row at the start of a scenario is given up
/// for that scenario (e.g. `h3` when UDP is blocked), so a dead transport does not cost
/// `requests × timeout`.
const GIVE_UP_AFTER: usize = 3;

async fn measure(targets: Targets, plan: Plan) -> Result<Measured, String> {
    let clients = Clients::new(targets)?;
    let bodies = &plan.bodies;
    let mut available = Vec::new();
    let mut unavailable = Vec::new();
    for &t in &plan.transports {
        match ready(&clients, t, bodies).await {
            Ok(()) => available.push(t),
            Err(e) => {
                progress(format_args!("{}: unavailable: {e}", t.name()));
                unavailable.push((t, e));
            }
        }
    }
    let mut runs = Vec::new();
    for &scenario in &plan.scenarios {
        let transports: Vec<Transport> = available
            .iter()
            .copied()
            .filter(|t| scenario.applies_to(*t))
            .collect();
        if transports.is_empty() {
            continue;
        }
        progress(format_args!(
            "{}: {} requests per transport",
            scenario.name(),
            plan.requests
        ));
        let mut before = Vec::new();
        let mut layer_before = Vec::new();
        for &t in &transports {
            before.push(edge_counters(&clients, t, scenario).await);
            layer_before.push(clients.layer_counters(t).await);
        }
        let mut records: Vec<Vec<Record>> = vec![Vec::new(); transports.len()];
        for _ in 0..plan.requests {
            for (i, &t) in transports.iter().enumerate() {
                let so_far = &records[i];
                if so_far.len() >= GIVE_UP_AFTER && so_far.iter().all(|r| r.error.is_some()) {
                    continue;
                }
                let record = one(&clients, t, scenario, bodies).await;
                records[i].push(record);
            }
        }
        for (i, &t) in transports.iter().enumerate() {
            let after = edge_counters(&clients, t, scenario).await;
            let counters = after.map(|(z, f)| {
                let (z0, f0) = before[i].unwrap_or_default();
                ((z - z0).max(0.0) as u64, (f - f0).max(0.0) as u64)
            });
            let mut run =
                RunResult::from_records(t, scenario, plan.requests, &records[i], counters);
            if let (Some(a), Some(b)) = (clients.layer_counters(t).await, layer_before[i]) {
                run.layer = Some(a.since(&b));
            }
            runs.push(run);
        }
    }
    clients.close();
    Ok(Measured { runs, unavailable })
}

/// (0-RTT accepted, TCP fallbacks) of the edge a tunnel scenario uses.
async fn edge_counters(clients: &Clients, t: Transport, s: Scenario) -> Option<(f64, f64)> {
    if !t.via_edge() {
        return None;
    }
    let mode = s.mode();
    let zero = clients
        .edge_metric(t, mode, "tokenway_quic_0rtt_total{result=\"accepted\"}")
        .await;
    let fallbacks = clients
        .edge_metric(t, mode, "tokenway_tcp_fallback_total")
        .await;
    Some((zero, fallbacks))
}

async fn one(clients: &Clients, t: Transport, s: Scenario, bodies: &Bodies) -> Record {
    match s {
        Scenario::First | Scenario::First0rtt | Scenario::FirstReused => {
            clients.send(t, s.mode(), bodies.one_token.clone()).await
        }
        Scenario::Stream | Scenario::StreamFresh => {
            clients.send(t, s.mode(), bodies.stream.clone()).await
        }
        Scenario::Upload => clients.send(t, Mode::Reused, bodies.upload.clone()).await,
        Scenario::Mix => {
            let upload = clients.send(t, Mode::Reused, bodies.upload.clone());
            let short = async {
                // Let the upload take the connection (and start sending) first.
                tokio::task::yield_now().await;
                clients.send(t, Mode::Reused, bodies.stream.clone()).await
            };
            let (_upload, short) = tokio::join!(upload, short);
            short
        }
    }
}

/// Waits until `t` answers a request (the gateway may still be probing its backend, the
/// fallback edge has to lose its QUIC race first), then warms it up: a few requests, and two
/// at once so that HTTP/1.1 pools hold two connections for the mixed scenario.
async fn ready(clients: &Clients, t: Transport, bodies: &Bodies) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let r = clients
            .send(t, Mode::Reused, bodies.one_token.clone())
            .await;
        match r.error {
            None => break,
            Some(e) if Instant::now() > deadline || attempts >= 2 && t == Transport::H3 => {
                return Err(e)
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    for _ in 0..3 {
        let _ = clients
            .send(t, Mode::Reused, bodies.one_token.clone())
            .await;
    }
    let _ = tokio::join!(
        clients.send(t, Mode::Reused, bodies.stream.clone()),
        clients.send(t, Mode::Reused, bodies.one_token.clone()),
    );
    if Scenario::First0rtt.applies_to(t) {
        // A first resumption so that the 0-RTT scenario starts with a ticket in hand.
        let _ = clients
            .send(t, Mode::ZeroRtt, bodies.one_token.clone())
            .await;
    }
    Ok(())
}

/// Settings for the report.
pub fn settings(opts: &TransportBenchOptions) -> Settings {
    Settings {
        profiles: opts.profiles.clone(),
        transports: opts
            .transports
            .iter()
            .map(|t| t.name().to_owned())
            .collect(),
        scenarios: opts.scenarios.iter().map(|s| s.name().to_owned()).collect(),
        requests: opts.requests,
        tokens: opts.tokens,
        token_ms: opts.token_ms,
        upload_bytes: opts.upload_bytes,
        baseline: opts.baseline.name().to_owned(),
        seed: opts.seed,
    }
}
