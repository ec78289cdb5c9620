//! The servers of one profile's run and where they live.
//!
//! On a netlab profile the simulated backend and the gateway run in the lab's server namespace
//! and the edges in its client namespace (started through `ip netns exec`); the emulated link
//! is the only path between them. On `loopback` everything runs in the root namespace on
//! 127.0.0.1. The lab is brought up with `tokenway netlab up --detach` (the emulator then runs
//! in its own process, not competing with the load generator for this process's threads) and a
//! [`LabGuard`] takes it down again however the run ends.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::process::ChildProcess;
use crate::BenchError;

/// The tunnel token shared by the bench's gateway and edges.
pub const TUNNEL_TOKEN: &str = "tokenway-bench-transport-token";
/// The brutal rate of `tunnel-brutal`, both ways (the edge's `bandwidth.up` and `.down`, the
/// gateway's `bandwidth.up`): 4g's bottleneck.
pub const BRUTAL_RATE: &str = "20 mbps";
/// The obfuscation key of `tunnel-fec-obfs`.
const OBFS_PSK: &str = "tokenway-bench-obfuscation-key";
/// Request bodies the bench's gateways and edges accept (the bulk upload is 50 MB).
const MAX_BODY_BYTES: usize = 100 << 20;
/// How long a server may take to announce its addresses.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);

/// Where the processes run.
#[derive(Clone, Debug)]
pub enum Placement {
    /// Everything on 127.0.0.1 in the root namespace.
    Loopback,
    /// Server side and client side in the namespaces of the lab named `prefix`.
    Netlab {
        /// The lab's name prefix (`{prefix}-client`, `{prefix}-server`).
        prefix: String,
    },
}

impl Placement {
    /// The server side's address as the client side reaches it.
    pub fn server_ip(&self) -> Ipv4Addr {
        match self {
            Self::Loopback => Ipv4Addr::LOCALHOST,
            Self::Netlab { .. } => tokenway_netlab::SERVER_ADDR,
        }
    }

    /// The client-side namespace, if any.
    pub fn client_namespace(&self) -> Option<String> {
        match self {
            Self::Loopback => None,
            Self::Netlab { prefix } => Some(format!("{prefix}-{}", tokenway_netlab::CLIENT)),
        }
    }

    fn server_namespace(&self) -> Option<String> {
        match self {
            Self::Loopback => None,
            Self::Netlab { prefix } => Some(format!("{prefix}-{}", tokenway_netlab::SERVER)),
        }
    }

    /// `exe` as a command, inside `namespace` when there is one.
    fn command(namespace: Option<String>, exe: &Path) -> Command {
        match namespace {
            None => Command::new(exe),
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns]).arg(exe);
                c
            }
        }
    }
}

/// A netlab lab brought up for the run; taken down on drop (also after an error or a panic).
pub struct LabGuard {
    prefix: String,
}

impl LabGuard {
    /// Removes leftovers of an earlier crashed run with the same name, then runs
    /// `tokenway netlab up --detach --name PREFIX --profile PROFILE --seed SEED`.
    pub async fn up(
        exe: &Path,
        prefix: &str,
        profile: &str,
        seed: u64,
    ) -> Result<Self, BenchError> {
        let _ = tokenway_netlab::down(prefix);
        let mut command = Command::new(exe);
        command
            .args([
                "netlab",
                "up",
                "--detach",
                "--name",
                prefix,
                "--profile",
                profile,
            ])
            .arg("--seed")
            .arg(seed.to_string())
            .stdin(Stdio::null());
        let output = tokio::task::spawn_blocking(move || command.output())
            .await
            .map_err(|e| BenchError::Child {
                name: "netlab".into(),
                message: format!("the task starting the lab failed: {e}"),
            })?
            .map_err(|source| BenchError::Io {
                context: "cannot run tokenway netlab up".into(),
                source,
            })?;
        let guard = Self {
            prefix: prefix.to_owned(),
        };
        if !output.status.success() {
            return Err(BenchError::Child {
                name: format!("netlab {prefix} ({profile})"),
                message: format!(
                    "`tokenway netlab up` failed ({}): {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim()
                ),
            });
        }
        Ok(guard)
    }
}

impl Drop for LabGuard {
    fn drop(&mut self) {
        if let Err(e) = tokenway_netlab::down(&self.prefix) {
            eprintln!("[bench transport] netlab down {}: {e}", self.prefix);
        }
    }
}

/// Addresses of the servers under test, as the client side reaches them.
#[derive(Clone, Debug)]
pub struct Targets {
    /// Gateway, cleartext HTTP/1.1.
    pub gateway_plain: SocketAddr,
    /// Gateway, HTTP/2 over TLS.
    pub gateway_tls: SocketAddr,
    /// Gateway, HTTP/3 front (UDP).
    pub gateway_h3: SocketAddr,
    /// SHA-256 fingerprint of the gateway's self-signed certificate (pinned by every client).
    pub fingerprint: String,
    /// Edge with 0-RTT on (the `tunnel` transport).
    pub edge: SocketAddr,
    /// Edge with 0-RTT off: its reconnects do a full handshake (fresh `tunnel` connections).
    pub edge_full: SocketAddr,
    /// Edge whose QUIC address is a closed port, so it falls back to TCP (`tunnel-tcp`).
    pub edge_tcp: SocketAddr,
    /// Edges of the datagram-layer variants, with the cleartext address of their gateway (for
    /// its `/metrics`).
    pub layered: Vec<(crate::transport::Transport, SocketAddr, SocketAddr)>,
}

/// The running servers of one profile; killed on drop.
pub struct Stack {
    _processes: Vec<ChildProcess>,
    /// Their addresses.
    pub targets: Targets,
}

/// What a stack is made of.
pub struct StackSpec<'a> {
    /// The `tokenway` executable.
    pub exe: &'a Path,
    /// Configs and logs go here.
    pub dir: &'a Path,
    /// Where to run.
    pub placement: &'a Placement,
    /// The sim's time per output token.
    pub token_ms: f64,
    /// Start the datagram-layer variants' gateways and edges too.
    pub layered: bool,
}

fn write(path: &Path, text: &str) -> Result<(), BenchError> {
    std::fs::write(path, text).map_err(|source| BenchError::Io {
        context: format!("cannot write {}", path.display()),
        source,
    })
}

fn parse_addr(name: &str, text: &str) -> Result<SocketAddr, BenchError> {
    let addr = text
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .trim_end_matches('/');
    addr.parse().map_err(|e| BenchError::Child {
        name: name.to_owned(),
        message: format!("announced an unparsable address {addr:?}: {e}"),
    })
}

/// Starts sim, gateway and the three edges.
pub async fn start(spec: &StackSpec<'_>) -> Result<Stack, BenchError> {
    let dir = spec.dir;
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(|source| BenchError::Io {
        context: format!("cannot create {}", logs.display()),
        source,
    })?;
    let server_ip = spec.placement.server_ip();
    let mut processes = Vec::new();

    let sim_config = dir.join("sim.toml");
    write(
        &sim_config,
        &format!(
            "# Generated by tokenway bench transport.\n\
             model_names = [\"sim-model\"]\n\
             base_latency_ms = 0.0\n\
             time_per_output_token_ms = {:?}\n\
             prefill_tokens_per_second = 1.0e12\n\
             batch_penalty = 0.0\n\
             max_concurrency = 256\n\
             max_queue = 256\n\
             prefix_cache_tokens = 0\n\
             # A prompt of up to the gateway's 32 MiB body limit fits the context\n\
             # (2^21 tokens): `--upload-kib 30720` measures the transports, not a 400.\n\
             bytes_per_token = 64\n",
            spec.token_ms
        ),
    )?;
    let mut command = Placement::command(spec.placement.server_namespace(), spec.exe);
    command
        .args(["sim", "--listen", "127.0.0.1:0", "--config"])
        .arg(&sim_config)
        .env("RUST_LOG", "warn");
    let (sim, lines) = ChildProcess::spawn_with_lines(
        "sim",
        command,
        &["tokenway sim listening on http://"],
        &logs.join("sim.log"),
        STARTUP_TIMEOUT,
    )
    .await?;
    processes.push(sim);
    let sim_addr = parse_addr("sim", &lines[0])?;

    let gateway_config = dir.join("gateway.toml");
    write(
        &gateway_config,
        &format!(
            "# Generated by tokenway bench transport.\n\
             listen = \"{server_ip}:0\"\n\
             max_body_bytes = {MAX_BODY_BYTES}\n\
             tls_listen = \"{server_ip}:0\"\n\
             h3_listen = \"{server_ip}:0\"\n\n\
             [tunnel]\n\
             listen = \"{server_ip}:0\"\n\
             tokens = [\"{TUNNEL_TOKEN}\"]\n\n\
             [[backends]]\n\
             name = \"sim\"\n\
             url = \"http://{sim_addr}\"\n\
             models = [\"sim-model\"]\n\
             max_inflight = 1024\n"
        ),
    )?;
    let mut command = Placement::command(spec.placement.server_namespace(), spec.exe);
    command
        .args(["gateway", "--config"])
        .arg(&gateway_config)
        .env("RUST_LOG", "warn");
    let (gateway, lines) = ChildProcess::spawn_with_lines(
        "gateway",
        command,
        &[
            "tokenway gateway listening on http://",
            "tokenway gateway listening on https://",
            "tokenway gateway h3 on udp://",
            "tokenway gateway tunnel on udp://",
        ],
        &logs.join("gateway.log"),
        STARTUP_TIMEOUT,
    )
    .await?;
    processes.push(gateway);
    let gateway_plain = parse_addr("gateway", &lines[0])?;
    let gateway_tls = parse_addr("gateway", &lines[1])?;
    let gateway_h3 = parse_addr("gateway", &lines[2])?;
    let tunnel = parse_addr("gateway", &lines[3])?;
    let fingerprint = lines[3]
        .split_whitespace()
        .skip_while(|w| *w != "fingerprint")
        .nth(1)
        .filter(|f| f.starts_with("sha256:"))
        .ok_or_else(|| BenchError::Child {
            name: "gateway".into(),
            message: format!(
                "no certificate fingerprint in its tunnel line {:?}",
                lines[3]
            ),
        })?
        .to_owned();

    // A UDP port nothing listens on: in a lab the server namespace runs nothing but the
    // gateway and the sim, so the discard port is closed; on loopback take an ephemeral port
    // and release it.
    let closed_udp = match spec.placement {
        Placement::Netlab { .. } => SocketAddr::from((server_ip, 9)),
        Placement::Loopback => std::net::UdpSocket::bind("127.0.0.1:0")
            .and_then(|s| s.local_addr())
            .map_err(|source| BenchError::Io {
                context: "cannot find a closed UDP port".into(),
                source,
            })?,
    };
    let mut edges = Vec::new();
    for (name, quic, zero_rtt) in [
        ("edge", tunnel, true),
        ("edge-full", tunnel, false),
        ("edge-tcp", closed_udp, true),
    ] {
        let path = dir.join(format!("{name}.toml"));
        write(
            &path,
            &format!(
                "# Generated by tokenway bench transport.\n\
                 token = \"{TUNNEL_TOKEN}\"\n\
                 max_body_bytes = {MAX_BODY_BYTES}\n\n\
                 [trust]\n\
                 pin_sha256 = [\"{fingerprint}\"]\n\n\
                 [quic]\n\
                 zero_rtt = {zero_rtt}\n\n\
                 [[gateways]]\n\
                 name = \"gw\"\n\
                 quic = \"{quic}\"\n\
                 tcp = \"{gateway_tls}\"\n"
            ),
        )?;
        let mut command = Placement::command(spec.placement.client_namespace(), spec.exe);
        command
            .args(["edge", "--listen", "127.0.0.1:0", "--config"])
            .arg(&path)
            // The edge logs its retries and redials at info: kept for the post-mortem.
            .env("RUST_LOG", "warn,tokenway_edge=info");
        let (edge, lines) = ChildProcess::spawn_with_lines(
            name,
            command,
            &["tokenway edge listening on http://"],
            &logs.join(format!("{name}.log")),
            STARTUP_TIMEOUT,
        )
        .await?;
        processes.push(edge);
        edges.push(parse_addr(name, &lines[0])?);
    }
    let layered = if spec.layered {
        start_layered(spec, sim_addr, &logs, &mut processes).await?
    } else {
        Vec::new()
    };
    Ok(Stack {
        _processes: processes,
        targets: Targets {
            gateway_plain,
            gateway_tls,
            gateway_h3,
            fingerprint,
            edge: edges[0],
            edge_full: edges[1],
            edge_tcp: edges[2],
            layered,
        },
    })
}

/// The datagram-layer variants: a gateway with FEC (and brutal for edges that advertise a
/// receive rate), one with FEC and obfuscation, and an edge per variant.
async fn start_layered(
    spec: &StackSpec<'_>,
    sim_addr: SocketAddr,
    logs: &Path,
    processes: &mut Vec<ChildProcess>,
) -> Result<Vec<(crate::transport::Transport, SocketAddr, SocketAddr)>, BenchError> {
    use crate::transport::Transport;
    let dir = spec.dir;
    let server_ip = spec.placement.server_ip();
    // An experiment knob, not a flag: `TOKENWAY_BENCH_FEC_MAX_OVERHEAD=1.0` runs the layered
    // variants with that `fec_max_overhead` on both ends (default: the layer's default, 0.5).
    // The generated configs in the run directory show what ran.
    let overhead = std::env::var("TOKENWAY_BENCH_FEC_MAX_OVERHEAD")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(String::new(), |o| format!("fec_max_overhead = {o:?}\n"));
    let mut gateways = Vec::new();
    for (name, datagram) in [
        (
            "gateway-fec",
            format!("fec = \"auto\"\ncc = \"brutal\"\nbandwidth.up = \"{BRUTAL_RATE}\"\n"),
        ),
        (
            "gateway-fec-obfs",
            format!("fec = \"auto\"\nobfs.psk = \"{OBFS_PSK}\"\n"),
        ),
    ] {
        let path = dir.join(format!("{name}.toml"));
        write(
            &path,
            &format!(
                "# Generated by tokenway bench transport.\n\
                 listen = \"{server_ip}:0\"\n\
                 max_body_bytes = {MAX_BODY_BYTES}\n\n\
                 [tunnel]\n\
                 listen = \"{server_ip}:0\"\n\
                 tokens = [\"{TUNNEL_TOKEN}\"]\n\n\
                 [tunnel.datagram]\n\
                 {datagram}{overhead}\n\
                 [[backends]]\n\
                 name = \"sim\"\n\
                 url = \"http://{sim_addr}\"\n\
                 models = [\"sim-model\"]\n\
                 max_inflight = 1024\n"
            ),
        )?;
        let mut command = Placement::command(spec.placement.server_namespace(), spec.exe);
        command
            .args(["gateway", "--config"])
            .arg(&path)
            .env("RUST_LOG", "warn");
        let (gateway, lines) = ChildProcess::spawn_with_lines(
            name,
            command,
            &[
                "tokenway gateway listening on http://",
                "tokenway gateway tunnel on udp://",
            ],
            &logs.join(format!("{name}.log")),
            STARTUP_TIMEOUT,
        )
        .await?;
        processes.push(gateway);
        let plain = parse_addr(name, &lines[0])?;
        let tunnel = parse_addr(name, &lines[1])?;
        let fingerprint = lines[1]
            .split_whitespace()
            .skip_while(|w| *w != "fingerprint")
            .nth(1)
            .filter(|f| f.starts_with("sha256:"))
            .ok_or_else(|| BenchError::Child {
                name: name.into(),
                message: format!(
                    "no certificate fingerprint in its tunnel line {:?}",
                    lines[1]
                ),
            })?
            .to_owned();
        gateways.push((plain, tunnel, fingerprint));
    }
    let mut edges = Vec::new();
    for (transport, gw, datagram) in [
        (Transport::TunnelFec, 0, "fec = \"auto\"\n".to_owned()),
        (
            Transport::TunnelFecObfs,
            1,
            format!("fec = \"auto\"\nobfs.psk = \"{OBFS_PSK}\"\n"),
        ),
        (
            Transport::TunnelBrutal,
            0,
            format!(
                "fec = \"auto\"\ncc = \"brutal\"\nbandwidth.up = \"{BRUTAL_RATE}\"\n\
                 bandwidth.down = \"{BRUTAL_RATE}\"\n"
            ),
        ),
    ] {
        let name = format!("edge-{}", &transport.name()["tunnel-".len()..]);
        let (plain, tunnel, fingerprint) = &gateways[gw];
        let path = dir.join(format!("{name}.toml"));
        write(
            &path,
            &format!(
                "# Generated by tokenway bench transport.\n\
                 token = \"{TUNNEL_TOKEN}\"\n\
                 max_body_bytes = {MAX_BODY_BYTES}\n\n\
                 [trust]\n\
                 pin_sha256 = [\"{fingerprint}\"]\n\n\
                 [[gateways]]\n\
                 name = \"gw\"\n\
                 quic = \"{tunnel}\"\n\n\
                 [datagram]\n\
                 {datagram}{overhead}"
            ),
        )?;
        let mut command = Placement::command(spec.placement.client_namespace(), spec.exe);
        command
            .args(["edge", "--listen", "127.0.0.1:0", "--config"])
            .arg(&path)
            .env("RUST_LOG", "warn,tokenway_edge=info");
        let (edge, lines) = ChildProcess::spawn_with_lines(
            &name,
            command,
            &["tokenway edge listening on http://"],
            &logs.join(format!("{name}.log")),
            STARTUP_TIMEOUT,
        )
        .await?;
        processes.push(edge);
        edges.push((transport, parse_addr(&name, &lines[0])?, *plain));
    }
    Ok(edges)
}

/// The run directory of one profile.
pub fn profile_dir(out: &Path, profile: &str) -> PathBuf {
    out.join("runs").join(profile)
}
