//! Gateway configuration: serde structs with defaults and a `validate()` that names the bad key
//! and the allowed range. Every key is documented in `docs/config.md`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use tokenway_router::{HealthConfig, Policy};
use tokenway_transport::{DatagramSettings, QuicSettings, TransportError};

use crate::cpu_affinity::Affinity;
use crate::error::GatewayError;

/// The whole `tokenway gateway` configuration.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Cleartext listener (HTTP/1.1 and h2c on one port); `None` disables it.
    pub listen: Option<SocketAddr>,
    /// TLS listener (HTTP/2 and HTTP/1.1 by ALPN); `None` disables it.
    pub tls_listen: Option<SocketAddr>,
    /// Certificate and key for the TLS listener, the HTTP/3 front and the tunnel port; absent
    /// means a generated self-signed one.
    pub tls: Option<TlsFiles>,
    /// Public HTTP/3 front (UDP), advertised with `Alt-Svc` on TCP responses; `None` disables it.
    pub h3_listen: Option<SocketAddr>,
    /// The authenticated tunnel port for edges; absent disables it.
    pub tunnel: Option<TunnelConfig>,
    /// QUIC settings of the HTTP/3 front and the tunnel port.
    pub quic: QuicSettings,
    /// Accepted Bearer API keys; empty means no authentication.
    pub api_keys: Vec<String>,
    /// Origins whose browser apps may call the API (CORS): `"*"` or `scheme://host[:port]`
    /// entries; empty (the default) answers no preflight and marks no answer.
    pub cors_allow_origins: Vec<String>,
    /// Largest accepted request body in bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Most bytes of request bodies held at once, all fronts and connections together (bodies
    /// are held whole until their answer's head is in, for retries and hedges); a request that
    /// finds no room gets a 503 with `Retry-After` (see `tokenway_transport::body_budget`).
    pub max_held_body_bytes: usize,
    /// Largest number of concurrently open client connections; further ones wait in the
    /// kernel's accept queue.
    pub max_connections: usize,
    /// Most requests that wait at once for a backend slot while every healthy backend of their
    /// model is at its `max_inflight` (each waits at most `timeouts.queue_ms`); beyond it, and
    /// with 0, such a request gets a 503 at once. See `admission.rs`.
    pub queue_max: usize,
    /// Threads serving the TCP fronts (HTTP/1.1, h2c, TLS), each with its own event loop
    /// accepting from the same listeners; a request is handled start to end on one thread, so
    /// no wake-up crosses cores. 0 (default) means one per CPU. The QUIC fronts, health probes
    /// and discovery run on the main thread, which is also the first front thread.
    pub front_threads: usize,
    /// Whether front thread `i` runs only on the `i`-th CPU the process may use, so that a
    /// request's thread wakes where its caches are: `auto` (default: when there is one front
    /// thread per such CPU), `on` or `off` (see `cpu_affinity.rs`).
    pub front_cpu_affinity: Affinity,
    /// Routing policy: `cost` (default), `round_robin`, `least_inflight` or `p2c_ewma`.
    pub policy: Policy,
    /// Attempts per request before the first byte (1 = no retry).
    pub max_attempts: u32,
    /// The gateway's own region: the client region of requests that do not name one.
    pub region: String,
    /// Cost model, affinity, hedging and load signals.
    pub routing: RoutingSettings,
    /// Timeouts in milliseconds.
    pub timeouts: Timeouts,
    /// Health checking.
    pub health: HealthSettings,
    /// The inference backends.
    pub backends: Vec<BackendConfig>,
    /// A TOML file of further `[[backends]]`, re-read when it changes and on SIGHUP.
    pub backends_file: Option<PathBuf>,
    /// `[discovery]`: backends found in DNS (A/AAAA and SRV records), refreshed on an interval.
    pub discovery: DiscoverySettings,
    /// `[overflow]`: peer gateways (other regions) reached through the tunnel when no local
    /// backend can take a request; the tunnel client's keys, those of an edge configuration
    /// without the edge's own `listen`, `max_body_bytes`, `address_check_ms` and `forwards`
    /// (docs/routing.md).
    pub overflow: Option<tokenway_transport::tunnel_config::TunnelClientConfig>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 8080))),
            tls_listen: None,
            tls: None,
            h3_listen: None,
            tunnel: None,
            quic: QuicSettings::default(),
            api_keys: Vec::new(),
            cors_allow_origins: Vec::new(),
            max_body_bytes: 32 * 1024 * 1024,
            max_held_body_bytes: 1 << 30,
            max_connections: 10_000,
            queue_max: 1_024,
            front_threads: 0,
            front_cpu_affinity: Affinity::Auto,
            policy: Policy::default(),
            max_attempts: 3,
            region: "local".to_string(),
            routing: RoutingSettings::default(),
            timeouts: Timeouts::default(),
            health: HealthSettings::default(),
            backends: Vec::new(),
            backends_file: None,
            discovery: DiscoverySettings::default(),
            overflow: None,
        }
    }
}

/// PEM files of the TLS listener.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// Certificate chain, PEM.
    pub cert: PathBuf,
    /// Private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Routing settings (`[routing]`).
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingSettings {
    /// Prompt bytes per block of the prefix index (chained block hashes).
    pub block_bytes: usize,
    /// Request header carrying an explicit session key.
    pub session_header: String,
    /// Request header naming the client's region (else `region`).
    pub client_region_header: String,
    /// Use the client's source address as its session key when nothing else identifies it.
    pub source_affinity: bool,
    /// Added to the expected TTFT of a backend outside the client's region, milliseconds.
    pub cross_region_penalty_ms: u64,
    /// Slack ε of session affinity's bounded load `(1 + ε) × mean in-flight`.
    pub affinity_epsilon: f64,
    /// Hedge a request to the next backend when its first token is later than the backend's
    /// recent p95.
    pub hedge: bool,
    /// Read vLLM / SGLang load gauges from each backend's `/metrics`.
    pub load_signals: bool,
    /// Interval of load-signal scrapes, milliseconds.
    pub load_signal_interval_ms: u64,
    /// Blocks (of `block_bytes` prompt bytes) each backend's prefix index holds; size it like
    /// the engine's KV cache: cached tokens × 4 / `block_bytes`. 0 turns prefix affinity off.
    pub prefix_capacity_blocks: usize,
    /// Slack ε of the `cost` policy's load bound for new conversations: the cheapest backend
    /// goes first only while its attempts in flight are below
    /// `max(load_bound_floor, ceil((1 + ε) × mean in flight))`.
    pub load_bound_epsilon: f64,
    /// Attempts in flight that never count as over the load bound.
    pub load_bound_floor: u32,
    /// Slack of the load bound for a conversation's home (the backend holding its history).
    pub load_bound_home_epsilon: f64,
    /// A conversation leaves its home when the home's expected TTFT exceeds this many times
    /// the cheapest backend's.
    pub home_max_cost_ratio: f64,
    /// Longest a request waits, in all, for a backend that is prefilling the request's
    /// prompt prefix for another request right now (`cost` policy), milliseconds; 0 never
    /// waits.
    pub prefill_hold_max_ms: u64,
    /// Requests each backend engine runs at once (vLLM `--max-num-seqs`, SGLang
    /// `--max-running-requests`); 0 learns it per backend from its load reports.
    pub batch_slots: u32,
}

impl Default for RoutingSettings {
    fn default() -> Self {
        Self {
            block_bytes: 256,
            session_header: "x-session-id".to_string(),
            client_region_header: "x-client-region".to_string(),
            source_affinity: false,
            cross_region_penalty_ms: 25,
            affinity_epsilon: 0.25,
            hedge: false,
            load_signals: true,
            load_signal_interval_ms: 2_000,
            prefix_capacity_blocks: tokenway_router::DEFAULT_PREFIX_CAPACITY_BLOCKS,
            load_bound_epsilon: 0.5,
            load_bound_floor: 2,
            load_bound_home_epsilon: 4.0,
            home_max_cost_ratio: 4.0,
            prefill_hold_max_ms: 500,
            batch_slots: 0,
        }
    }
}

/// The tunnel port (see docs/tunnel.md).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TunnelConfig {
    /// UDP address of the tunnel's HTTP/3 endpoint.
    pub listen: SocketAddr,
    /// TCP address of the tunnel's own TLS port (HTTP/2 and HTTP/1.1 by ALPN) for edges that
    /// fall back to TCP: a request without a valid tunnel token sees the masquerade site, as on
    /// the UDP port, where `tls_listen` answers it as the gateway's API (and names tokenway in
    /// `/metrics`). The same port number as `listen` makes the pair look like any HTTPS site
    /// that also serves HTTP/3. Absent: edges fall back to `tls_listen`.
    #[serde(default)]
    pub tcp_listen: Option<SocketAddr>,
    /// Accepted tunnel tokens (the `tw-auth` header); at least one.
    pub tokens: Vec<String>,
    /// How long an idempotency key is remembered, milliseconds.
    #[serde(default = "default_replay_window_ms")]
    pub replay_window_ms: u64,
    /// Most idempotency keys remembered at once.
    #[serde(default = "default_max_replay_keys")]
    pub max_replay_keys: usize,
    /// `host:port` targets that edges may reach with CONNECT (port forwarding).
    #[serde(default)]
    pub forward_allow: Vec<String>,
    /// What unauthenticated visitors see.
    #[serde(default)]
    pub masquerade: MasqueradeConfig,
    /// `[tunnel.datagram]`: the datagram layer under the tunnel's QUIC (FEC, obfuscation) and
    /// the tunnel's congestion control (docs/datagram-layer.md); absent means plain QUIC.
    /// Edges must use the same `fec` (off or not) and `obfs.psk`.
    #[serde(default)]
    pub datagram: Option<DatagramSettings>,
}

fn default_replay_window_ms() -> u64 {
    10_000
}

fn default_max_replay_keys() -> usize {
    100_000
}

/// The site shown to requests that fail tunnel authentication: a static directory, a
/// reverse-proxied `http://` site, or (neither set) a plain default page.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MasqueradeConfig {
    /// Directory of static files (`index.html` for `/`).
    pub dir: Option<PathBuf>,
    /// Base URL of a site to reverse-proxy.
    pub proxy: Option<String>,
}

/// Timeouts, all in milliseconds.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect to a backend.
    pub connect_ms: u64,
    /// From sending a streamed request to a backend to its response head and first body bytes;
    /// past it the attempt counts as a timeout and the next backend is tried.
    pub first_byte_ms: u64,
    /// The same for a request whose answer comes whole (not streamed): its first byte comes
    /// only when the generation has ended.
    pub whole_answer_ms: u64,
    /// Longest silence inside a streaming response before it is ended with an error event.
    pub stream_idle_ms: u64,
    /// Reading a client's request head and body.
    pub client_read_ms: u64,
    /// Longest time a client may leave response data unread before its stream is closed.
    pub client_write_ms: u64,
    /// Longest wait for a backend slot while every backend of the model is full (`queue_max`).
    pub queue_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect_ms: 2_000,
            first_byte_ms: 60_000,
            // The official OpenAI clients' own default request timeout.
            whole_answer_ms: 600_000,
            stream_idle_ms: 60_000,
            client_read_ms: 30_000,
            client_write_ms: 30_000,
            queue_ms: 10_000,
        }
    }
}

impl Timeouts {
    /// Connect timeout.
    pub fn connect(&self) -> Duration {
        Duration::from_millis(self.connect_ms)
    }
    /// First-byte timeout of a streamed request.
    pub fn first_byte(&self) -> Duration {
        Duration::from_millis(self.first_byte_ms)
    }
    /// First-byte timeout of a request answered whole.
    pub fn whole_answer(&self) -> Duration {
        Duration::from_millis(self.whole_answer_ms)
    }
    /// Stream idle timeout.
    pub fn stream_idle(&self) -> Duration {
        Duration::from_millis(self.stream_idle_ms)
    }
    /// Longest wait for a backend slot.
    pub fn queue(&self) -> Duration {
        Duration::from_millis(self.queue_ms)
    }
    /// Client read timeout.
    pub fn client_read(&self) -> Duration {
        Duration::from_millis(self.client_read_ms)
    }
    /// Client write (stalled reader) timeout.
    pub fn client_write(&self) -> Duration {
        Duration::from_millis(self.client_write_ms)
    }
}

/// Active and passive health checking.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthSettings {
    /// Interval between health probes (`GET probe_path`) to each backend, milliseconds.
    pub probe_interval_ms: u64,
    /// Path of the health probe: `/health` (vLLM, SGLang, TGI, llama.cpp); Ollama answers `/`.
    /// A backend's own `health_path` overrides it.
    pub probe_path: String,
    /// Timeout of one probe, milliseconds.
    pub probe_timeout_ms: u64,
    /// Consecutive failed probes that eject a backend.
    pub eject_after_failures: u32,
    /// Consecutive successful probes that re-admit an ejected backend.
    pub readmit_after_successes: u32,
    /// Consecutive 5xx answers or timeouts that eject a backend.
    pub passive_failures_to_eject: u32,
    /// Shortest time a backend stays ejected, milliseconds.
    pub min_ejection_ms: u64,
}

impl Default for HealthSettings {
    fn default() -> Self {
        let h = HealthConfig::default();
        Self {
            probe_interval_ms: 1_000,
            probe_path: "/health".to_string(),
            probe_timeout_ms: 1_000,
            eject_after_failures: h.eject_after_failures,
            readmit_after_successes: h.readmit_after_successes,
            passive_failures_to_eject: h.passive_failures_to_eject,
            min_ejection_ms: h.min_ejection.as_millis() as u64,
        }
    }
}

impl HealthSettings {
    /// The router's view of these settings.
    pub fn router_config(&self) -> HealthConfig {
        HealthConfig {
            eject_after_failures: self.eject_after_failures,
            readmit_after_successes: self.readmit_after_successes,
            passive_failures_to_eject: self.passive_failures_to_eject,
            min_ejection: Duration::from_millis(self.min_ejection_ms),
        }
    }
}

/// One inference backend (vLLM, SGLang, llama.cpp server, TGI, Ollama, `tokenway sim`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Name used in logs and metrics; defaults to the URL's host:port.
    #[serde(default)]
    pub name: Option<String>,
    /// Base URL, `http://host:port` (a path prefix such as `/v1` is not included).
    pub url: String,
    /// Region label.
    #[serde(default = "default_region")]
    pub region: String,
    /// Models served; empty means learn them from the backend's `GET /v1/models`. `"*"` (alone:
    /// the rest is learned, or with names) also takes every model no backend names: for
    /// servers that ignore the name (llama.cpp, TGI).
    #[serde(default)]
    pub models: Vec<String>,
    /// Most requests in flight to this backend at once.
    #[serde(default = "default_max_inflight")]
    pub max_inflight: u32,
    /// Bearer key sent to the backend (the client's key is never forwarded).
    #[serde(default)]
    pub api_key: Option<String>,
    /// Blocks of `routing.block_bytes` this backend's prefix index holds: its engine's KV-cache
    /// capacity in prompt bytes / `routing.block_bytes`; absent means
    /// `routing.prefix_capacity_blocks`.
    #[serde(default)]
    pub prefix_capacity_blocks: Option<usize>,
    /// Path of this backend's health probe; absent means `health.probe_path`.
    #[serde(default)]
    pub health_path: Option<String>,
}

/// Whether `path` can be a probe's path: absolute, and a valid request target.
fn valid_probe_path(path: &str) -> bool {
    path.starts_with('/') && path.parse::<http::uri::PathAndQuery>().is_ok()
}

/// Largest prefix-index capacity in blocks (`routing.prefix_capacity_blocks` and per backend).
const MAX_PREFIX_CAPACITY_BLOCKS: usize = 1 << 24;

fn default_region() -> String {
    "local".to_string()
}

fn default_max_inflight() -> u32 {
    256
}

impl GatewayConfig {
    /// How many threads serve the TCP fronts: `front_threads`, or one per CPU when it is 0.
    pub fn front_thread_count(&self) -> usize {
        match self.front_threads {
            0 => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            n => n,
        }
    }

    /// Parses a TOML document and validates it.
    pub fn from_toml_str(text: &str) -> Result<Self, GatewayError> {
        let config: Self =
            toml::from_str(text).map_err(|e| GatewayError::Config(format!("{e}")))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and cross-field rules; the error names the key.
    pub fn validate(&self) -> Result<(), GatewayError> {
        fn bad(key: &str, rule: &str, got: impl std::fmt::Display) -> GatewayError {
            GatewayError::Config(format!("{key} must be {rule} (got {got})"))
        }
        if let Some(peers) = &self.overflow {
            peers.validate().map_err(|e| match e {
                TransportError::Config(m) => GatewayError::Config(format!("[overflow]: {m}")),
                other => GatewayError::Config(format!("[overflow]: {other}")),
            })?;
        }
        if self.listen.is_none()
            && self.tls_listen.is_none()
            && self.h3_listen.is_none()
            && self.tunnel.is_none()
        {
            return Err(GatewayError::Config(
                "at least one of `listen`, `tls_listen`, `h3_listen` or `tunnel.listen` must be set"
                    .into(),
            ));
        }
        self.quic
            .validate("quic")
            .map_err(|e| GatewayError::Config(e.to_string()))?;
        if let Some(t) = &self.tunnel {
            if t.tokens.is_empty() || t.tokens.iter().any(|k| k.len() < 16) {
                return Err(GatewayError::Config(
                    "tunnel.tokens must list at least one token of 16 or more characters".into(),
                ));
            }
            if t.replay_window_ms == 0 || t.replay_window_ms > 3_600_000 {
                return Err(bad(
                    "tunnel.replay_window_ms",
                    "in 1..=3600000",
                    t.replay_window_ms,
                ));
            }
            if t.max_replay_keys == 0 || t.max_replay_keys > 10_000_000 {
                return Err(bad(
                    "tunnel.max_replay_keys",
                    "in 1..=10000000",
                    t.max_replay_keys,
                ));
            }
            for (i, target) in t.forward_allow.iter().enumerate() {
                let ok = target
                    .rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
                if !ok {
                    return Err(bad(
                        &format!("tunnel.forward_allow[{i}]"),
                        "host:port",
                        format!("{target:?}"),
                    ));
                }
            }
            if let Some(d) = &t.datagram {
                d.validate("tunnel.datagram")
                    .map_err(|e| GatewayError::Config(e.to_string()))?;
            }
            let m = &t.masquerade;
            if m.dir.is_some() && m.proxy.is_some() {
                return Err(GatewayError::Config(
                    "tunnel.masquerade: set `dir` or `proxy`, not both".into(),
                ));
            }
            if let Some(p) = &m.proxy {
                let uri: Result<http::Uri, _> = p.parse();
                if !uri.is_ok_and(|u| u.scheme_str() == Some("http") && u.authority().is_some()) {
                    return Err(bad(
                        "tunnel.masquerade.proxy",
                        "an http://host[:port] URL",
                        format!("{p:?}"),
                    ));
                }
            }
            if let Some(d) = &m.dir {
                if !d.is_dir() {
                    return Err(bad(
                        "tunnel.masquerade.dir",
                        "an existing directory",
                        d.display(),
                    ));
                }
            }
        }
        if self.max_body_bytes == 0 || self.max_body_bytes > 1 << 30 {
            return Err(bad(
                "max_body_bytes",
                "in 1..=1073741824",
                self.max_body_bytes,
            ));
        }
        if self.max_held_body_bytes < self.max_body_bytes
            || self.max_held_body_bytes > u32::MAX as usize
        {
            return Err(bad(
                "max_held_body_bytes",
                "in max_body_bytes..=4294967295",
                self.max_held_body_bytes,
            ));
        }
        if self.max_connections == 0 {
            return Err(bad("max_connections", ">= 1", self.max_connections));
        }
        if self.front_threads > 1024 {
            return Err(bad(
                "front_threads",
                "in 0..=1024 (0: one per CPU)",
                self.front_threads,
            ));
        }
        if !(1..=10).contains(&self.max_attempts) {
            return Err(bad("max_attempts", "in 1..=10", self.max_attempts));
        }
        let r = &self.routing;
        if !(16..=1 << 20).contains(&r.block_bytes) {
            return Err(bad("routing.block_bytes", "in 16..=1048576", r.block_bytes));
        }
        for (key, v) in [
            ("routing.session_header", &r.session_header),
            ("routing.client_region_header", &r.client_region_header),
        ] {
            if http::HeaderName::from_bytes(v.as_bytes()).is_err() {
                return Err(bad(key, "a valid HTTP header name", format!("{v:?}")));
            }
        }
        if !(r.affinity_epsilon > 0.0 && r.affinity_epsilon <= 10.0) {
            return Err(bad(
                "routing.affinity_epsilon",
                "in (0, 10]",
                r.affinity_epsilon,
            ));
        }
        if r.cross_region_penalty_ms > 60_000 {
            return Err(bad(
                "routing.cross_region_penalty_ms",
                "in 0..=60000",
                r.cross_region_penalty_ms,
            ));
        }
        if !(100..=3_600_000).contains(&r.load_signal_interval_ms) {
            return Err(bad(
                "routing.load_signal_interval_ms",
                "in 100..=3600000",
                r.load_signal_interval_ms,
            ));
        }
        if r.prefix_capacity_blocks > MAX_PREFIX_CAPACITY_BLOCKS {
            return Err(bad(
                "routing.prefix_capacity_blocks",
                "in 0..=16777216 (0 turns prefix affinity off)",
                r.prefix_capacity_blocks,
            ));
        }
        for (key, v) in [
            ("routing.load_bound_epsilon", r.load_bound_epsilon),
            ("routing.load_bound_home_epsilon", r.load_bound_home_epsilon),
        ] {
            if !(0.0..=100.0).contains(&v) {
                return Err(bad(key, "a number in [0, 100]", v));
            }
        }
        if r.load_bound_floor > 1_000_000 {
            return Err(bad(
                "routing.load_bound_floor",
                "in 0..=1000000",
                r.load_bound_floor,
            ));
        }
        if !(1.0..=1000.0).contains(&r.home_max_cost_ratio) {
            return Err(bad(
                "routing.home_max_cost_ratio",
                "a number in [1, 1000]",
                r.home_max_cost_ratio,
            ));
        }
        if r.batch_slots > 1_000_000 {
            return Err(bad(
                "routing.batch_slots",
                "in 0..=1000000 (0 learns it from the engines' load reports)",
                r.batch_slots,
            ));
        }
        if r.prefill_hold_max_ms > 10_000 {
            return Err(bad(
                "routing.prefill_hold_max_ms",
                "in 0..=10000 (0 never holds)",
                r.prefill_hold_max_ms,
            ));
        }
        if self.region.is_empty() {
            return Err(bad("region", "a non-empty string", "\"\""));
        }
        if let Some(why) = tokenway_telemetry::label_value_problem(&self.region) {
            return Err(bad(
                "region",
                &format!("a name without {why} (it labels metrics)"),
                format!("{:?}", self.region),
            ));
        }
        if self.queue_max > 1_000_000 {
            return Err(bad(
                "queue_max",
                "in 0..=1000000 (0: no request waits for a full backend)",
                self.queue_max,
            ));
        }
        if !valid_probe_path(&self.health.probe_path) {
            return Err(bad(
                "health.probe_path",
                "a path starting with `/`",
                format!("{:?}", self.health.probe_path),
            ));
        }
        let t = &self.timeouts;
        for (key, v) in [
            ("timeouts.connect_ms", t.connect_ms),
            ("timeouts.first_byte_ms", t.first_byte_ms),
            ("timeouts.whole_answer_ms", t.whole_answer_ms),
            ("timeouts.stream_idle_ms", t.stream_idle_ms),
            ("timeouts.client_read_ms", t.client_read_ms),
            ("timeouts.client_write_ms", t.client_write_ms),
            ("timeouts.queue_ms", t.queue_ms),
            ("health.probe_interval_ms", self.health.probe_interval_ms),
            ("health.probe_timeout_ms", self.health.probe_timeout_ms),
            ("health.min_ejection_ms", self.health.min_ejection_ms),
        ] {
            if !(1..=3_600_000).contains(&v) {
                return Err(bad(key, "in 1..=3600000 milliseconds", v));
            }
        }
        for (key, v) in [
            (
                "health.eject_after_failures",
                self.health.eject_after_failures,
            ),
            (
                "health.readmit_after_successes",
                self.health.readmit_after_successes,
            ),
            (
                "health.passive_failures_to_eject",
                self.health.passive_failures_to_eject,
            ),
        ] {
            if !(1..=1000).contains(&v) {
                return Err(bad(key, "in 1..=1000", v));
            }
        }
        for o in &self.cors_allow_origins {
            crate::cors::validate_origin(o).map_err(GatewayError::Config)?;
        }
        if self.api_keys.iter().any(|k| k.is_empty()) {
            return Err(GatewayError::Config(
                "api_keys must not contain an empty key".into(),
            ));
        }
        if self.backends.is_empty() && self.backends_file.is_none() && self.discovery.dns.is_empty()
        {
            return Err(GatewayError::Config(
                "backends must list at least one backend ([[backends]] url = \"http://host:port\"), \
                 or backends_file must name a file of them, or [[discovery.dns]] a DNS name"
                    .into(),
            ));
        }
        self.discovery.validate()?;
        validate_backends(&self.backends, "backends")
    }
}

/// DNS discovery (`[discovery]`): every `refresh_ms` each `[[discovery.dns]]` name is resolved
/// and the backends it names are added or removed (see `docs/routing.md`, Discovery).
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoverySettings {
    /// Interval between resolutions of every name, milliseconds.
    pub refresh_ms: u64,
    /// Shortest time an answer is cached, milliseconds: record TTLs below it are raised to it
    /// (a TTL of 0 would otherwise send a query on every refresh of every gateway).
    pub min_ttl_ms: u64,
    /// The DNS server to ask (`ip:port`, UDP with TCP fallback); absent means the system's
    /// (`/etc/resolv.conf`, with its search domains, which Kubernetes pods rely on).
    pub nameserver: Option<SocketAddr>,
    /// Timeout of one DNS query, milliseconds.
    pub timeout_ms: u64,
    /// The names to resolve.
    pub dns: Vec<DnsBackends>,
}

impl Default for DiscoverySettings {
    fn default() -> Self {
        Self {
            refresh_ms: 5_000,
            min_ttl_ms: 1_000,
            nameserver: None,
            timeout_ms: 2_000,
            dns: Vec::new(),
        }
    }
}

/// Which records name the backends of a `[[discovery.dns]]` entry.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DnsRecord {
    /// A and AAAA records: one backend per address, all on the entry's `port`.
    #[default]
    A,
    /// SRV records: one backend per (target, port); the target is resolved to its address.
    Srv,
}

/// One DNS name whose records are backends (`[[discovery.dns]]`). The fields after `port` apply
/// to every backend the name yields, like the same keys of `[[backends]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsBackends {
    /// The name, e.g. `vllm.inference.svc.cluster.local` (A) or
    /// `_http._tcp.vllm.inference.svc.cluster.local` (SRV).
    pub name: String,
    /// `a` (A and AAAA, default) or `srv`.
    #[serde(default)]
    pub record: DnsRecord,
    /// The backends' port; required for `a`, not allowed for `srv` (the records carry it).
    #[serde(default)]
    pub port: Option<u16>,
    /// Region label.
    #[serde(default = "default_region")]
    pub region: String,
    /// Models served; empty means learn them from each backend's `GET /v1/models`; `"*"` as
    /// for a listed backend.
    #[serde(default)]
    pub models: Vec<String>,
    /// Most requests in flight to each backend at once.
    #[serde(default = "default_max_inflight")]
    pub max_inflight: u32,
    /// Bearer key sent to the backends.
    #[serde(default)]
    pub api_key: Option<String>,
    /// Prefix-index capacity of each backend found, as `backends.prefix_capacity_blocks`.
    #[serde(default)]
    pub prefix_capacity_blocks: Option<usize>,
}

impl DiscoverySettings {
    /// The refresh interval.
    pub fn refresh(&self) -> Duration {
        Duration::from_millis(self.refresh_ms)
    }

    /// Checks ranges; errors name `discovery.key` or `discovery.dns[i].key`.
    pub fn validate(&self) -> Result<(), GatewayError> {
        fn bad(key: &str, rule: &str, got: impl std::fmt::Display) -> GatewayError {
            GatewayError::Config(format!("{key} must be {rule} (got {got})"))
        }
        if !(100..=3_600_000).contains(&self.refresh_ms) {
            return Err(bad(
                "discovery.refresh_ms",
                "in 100..=3600000",
                self.refresh_ms,
            ));
        }
        if self.min_ttl_ms > 3_600_000 {
            return Err(bad(
                "discovery.min_ttl_ms",
                "in 0..=3600000",
                self.min_ttl_ms,
            ));
        }
        if !(1..=60_000).contains(&self.timeout_ms) {
            return Err(bad("discovery.timeout_ms", "in 1..=60000", self.timeout_ms));
        }
        if self.nameserver.is_some_and(|a| a.port() == 0) {
            return Err(bad(
                "discovery.nameserver",
                "an ip:port with a non-zero port",
                "port 0",
            ));
        }
        for (i, d) in self.dns.iter().enumerate() {
            let key = |k: &str| format!("discovery.dns[{i}].{k}");
            let labels_ok = !d.name.is_empty()
                && d.name.len() <= 253
                && d.name.trim_end_matches('.').split('.').all(|l| {
                    !l.is_empty()
                        && l.len() <= 63
                        && l.bytes()
                            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
                });
            if !labels_ok {
                return Err(bad(&key("name"), "a DNS name", format!("{:?}", d.name)));
            }
            match (d.record, d.port) {
                (DnsRecord::A, None | Some(0)) => {
                    return Err(bad(
                        &key("port"),
                        "in 1..=65535 for record = \"a\"",
                        d.port.unwrap_or(0),
                    ))
                }
                (DnsRecord::Srv, Some(p)) => {
                    return Err(bad(
                        &key("port"),
                        "absent for record = \"srv\" (SRV records carry the port)",
                        p,
                    ))
                }
                _ => {}
            }
            if d.max_inflight == 0 {
                return Err(bad(&key("max_inflight"), ">= 1", d.max_inflight));
            }
            if let Some(n) = d
                .prefix_capacity_blocks
                .filter(|n| *n > MAX_PREFIX_CAPACITY_BLOCKS)
            {
                return Err(bad(
                    &key("prefix_capacity_blocks"),
                    &format!("in 0..={MAX_PREFIX_CAPACITY_BLOCKS}"),
                    n,
                ));
            }
            if d.region.is_empty() {
                return Err(bad(&key("region"), "a non-empty string", "\"\""));
            }
        }
        Ok(())
    }
}

/// The `[[backends]]` of a discovery file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendsFile {
    /// The backends.
    #[serde(default)]
    pub backends: Vec<BackendConfig>,
}

impl BackendsFile {
    /// Parses and validates a discovery file's text.
    pub fn parse(text: &str) -> Result<Self, GatewayError> {
        let file: Self = toml::from_str(text).map_err(|e| GatewayError::Config(format!("{e}")))?;
        validate_backends(&file.backends, "backends")?;
        Ok(file)
    }
}

/// Checks URLs, limits and name uniqueness of a list of backends; errors name `key[i].field`.
pub fn validate_backends(backends: &[BackendConfig], key: &str) -> Result<(), GatewayError> {
    fn bad(key: &str, rule: &str, got: impl std::fmt::Display) -> GatewayError {
        GatewayError::Config(format!("{key} must be {rule} (got {got})"))
    }
    let mut names = std::collections::HashSet::new();
    for (i, b) in backends.iter().enumerate() {
        let uri: http::Uri = b.url.parse().map_err(|e| {
            bad(
                &format!("{key}[{i}].url"),
                "an http:// URL",
                format!("{:?}: {e}", b.url),
            )
        })?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err(bad(
                &format!("{key}[{i}].url"),
                "an http://host[:port] URL",
                format!("{:?}", b.url),
            ));
        }
        if let Some(p) = b.health_path.as_deref().filter(|p| !valid_probe_path(p)) {
            return Err(bad(
                &format!("{key}[{i}].health_path"),
                "a path starting with `/`",
                format!("{p:?}"),
            ));
        }
        if b.max_inflight == 0 {
            return Err(bad(
                &format!("{key}[{i}].max_inflight"),
                ">= 1",
                b.max_inflight,
            ));
        }
        if let Some(n) = b
            .prefix_capacity_blocks
            .filter(|n| *n > MAX_PREFIX_CAPACITY_BLOCKS)
        {
            return Err(bad(
                &format!("{key}[{i}].prefix_capacity_blocks"),
                &format!("in 0..={MAX_PREFIX_CAPACITY_BLOCKS}"),
                n,
            ));
        }
        let name = b.display_name();
        for (field, v) in [("name", &name), ("region", &b.region)] {
            if let Some(why) = tokenway_telemetry::label_value_problem(v) {
                return Err(bad(
                    &format!("{key}[{i}].{field}"),
                    &format!("a name without {why} (it labels metrics)"),
                    format!("{v:?}"),
                ));
            }
        }
        if !names.insert(name.clone()) {
            return Err(GatewayError::Config(format!(
                "{key}[{i}].name {name:?} is used twice; names must be unique"
            )));
        }
    }
    Ok(())
}

impl BackendConfig {
    /// The configured name, or host:port of the URL.
    pub fn display_name(&self) -> String {
        if let Some(n) = &self.name {
            return n.clone();
        }
        self.url
            .parse::<http::Uri>()
            .ok()
            .and_then(|u| u.authority().map(|a| a.to_string()))
            .unwrap_or_else(|| self.url.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config_parses_with_defaults() {
        let c = GatewayConfig::from_toml_str("[[backends]]\nurl = \"http://127.0.0.1:8000\"\n")
            .expect("valid");
        assert_eq!(c.max_body_bytes, 32 * 1024 * 1024);
        assert_eq!(c.backends[0].display_name(), "127.0.0.1:8000");
        assert_eq!(c.health.probe_interval_ms, 1000);
    }

    #[test]
    fn bad_values_name_their_key() {
        let e = GatewayConfig::from_toml_str(
            "max_attempts = 0\n[[backends]]\nurl = \"http://127.0.0.1:8000\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("max_attempts"), "{e}");
        let e = GatewayConfig::from_toml_str("[[backends]]\nurl = \"ftp://x\"\n").unwrap_err();
        assert!(e.to_string().contains("backends[0].url"), "{e}");
        let e = GatewayConfig::from_toml_str("policy = \"fastest\"\n").unwrap_err();
        assert!(e.to_string().contains("policy"), "{e}");
        let e = GatewayConfig::from_toml_str("lisen = \"1.2.3.4:5\"\n").unwrap_err();
        assert!(e.to_string().contains("lisen"), "{e}");
        // Names label metrics, written unescaped: a quote would break the whole page.
        let e = GatewayConfig::from_toml_str(
            "[[backends]]\nname = 'gpu \"a\"'\nurl = \"http://127.0.0.1:8000\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("backends[0].name"), "{e}");
        let e = GatewayConfig::from_toml_str(
            "[[backends]]\nregion = \"eu\\\\west\"\nurl = \"http://127.0.0.1:8000\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("backends[0].region"), "{e}");
    }

    #[test]
    fn overflow_takes_the_tunnel_clients_keys_and_names_a_bad_one() {
        let peers = "[[backends]]\nurl = \"http://127.0.0.1:8000\"\n[overflow]\n\
                     token = \"0123456789abcdef\"\nquic_retry_ms = 500\n\
                     [overflow.trust]\npin_sha256 = [\"sha256:{}\"]\n\
                     [[overflow.gateways]]\nname = \"eu\"\nquic = \"127.0.0.1:4433\"\n";
        let peers = peers.replace("{}", &"0".repeat(64));
        let c = GatewayConfig::from_toml_str(&peers).expect("valid");
        let o = c.overflow.expect("overflow configured");
        assert_eq!((o.gateways[0].name.as_str(), o.quic_retry_ms), ("eu", 500));
        for (text, key) in [
            // An edge's own keys mean nothing to a gateway's overflow.
            (
                peers.replace("quic_retry_ms", "listen = \"127.0.0.1:1\"\nx"),
                "listen",
            ),
            (
                peers.replace("0123456789abcdef", "short"),
                "[overflow]: token",
            ),
            (
                peers.replace("127.0.0.1:4433", "nowhere"),
                "gateways[0].quic",
            ),
        ] {
            let e = GatewayConfig::from_toml_str(&text)
                .map(|_| "accepted".to_string())
                .unwrap_or_else(|e| e.to_string());
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn dns_discovery_alone_is_a_valid_backend_source_and_bad_entries_name_their_key() {
        let c = GatewayConfig::from_toml_str(
            "[discovery]\nnameserver = \"127.0.0.1:5353\"\n\
             [[discovery.dns]]\nname = \"_http._tcp.vllm.test\"\nrecord = \"srv\"\n\
             [[discovery.dns]]\nname = \"vllm.test\"\nport = 8000\n",
        )
        .expect("valid");
        assert_eq!(c.discovery.refresh_ms, 5_000);
        assert_eq!(c.discovery.dns[0].record, DnsRecord::Srv);
        assert_eq!(c.discovery.dns[1].record, DnsRecord::A);
        assert_eq!(c.discovery.dns[1].max_inflight, 256);
        for (toml, key) in [
            (
                "[[discovery.dns]]\nname = \"vllm.test\"\n",
                "discovery.dns[0].port",
            ),
            (
                "[[discovery.dns]]\nname = \"s.test\"\nrecord = \"srv\"\nport = 1\n",
                "discovery.dns[0].port",
            ),
            (
                "[[discovery.dns]]\nname = \"a..b\"\nport = 1\n",
                "discovery.dns[0].name",
            ),
            (
                "[discovery]\nrefresh_ms = 5\n[[discovery.dns]]\nname = \"a\"\nport = 1\n",
                "discovery.refresh_ms",
            ),
            ("[[discovery.dns]]\nname = \"a\"\nrecord = \"mx\"\n", "mx"),
            // No room for one largest body, or more than a semaphore counts.
            ("max_held_body_bytes = 1000\n", "max_held_body_bytes"),
            ("max_held_body_bytes = 4294967296\n", "max_held_body_bytes"),
        ] {
            let e = GatewayConfig::from_toml_str(toml).unwrap_err();
            assert!(e.to_string().contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn a_backend_may_size_its_own_prefix_index_and_a_bad_size_names_its_key() {
        let c = GatewayConfig::from_toml_str(
            "[[backends]]\nurl = \"http://127.0.0.1:8000\"\nprefix_capacity_blocks = 300\n\
             [[backends]]\nurl = \"http://127.0.0.1:8001\"\n\
             [[discovery.dns]]\nname = \"vllm.test\"\nport = 8000\nprefix_capacity_blocks = 9\n",
        )
        .expect("valid");
        assert_eq!(c.backends[0].prefix_capacity_blocks, Some(300));
        assert_eq!(c.backends[1].prefix_capacity_blocks, None);
        assert_eq!(c.discovery.dns[0].prefix_capacity_blocks, Some(9));
        for (toml, key) in [
            (
                "[[backends]]\nurl = \"http://127.0.0.1:8000\"\nprefix_capacity_blocks = 99999999\n",
                "backends[0].prefix_capacity_blocks must be in 0..=16777216",
            ),
            (
                "[[discovery.dns]]\nname = \"a\"\nport = 1\nprefix_capacity_blocks = 99999999\n",
                "discovery.dns[0].prefix_capacity_blocks",
            ),
        ] {
            let e = GatewayConfig::from_toml_str(toml).unwrap_err();
            assert!(e.to_string().contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn routing_load_bound_and_prefix_capacity_keys_parse_and_bad_values_name_their_key() {
        const B: &str = "[[backends]]\nurl = \"http://127.0.0.1:8000\"\n";
        let c = GatewayConfig::from_toml_str(&format!(
            "[routing]\nprefix_capacity_blocks = 512\nload_bound_epsilon = 1.0\n\
             load_bound_floor = 3\nload_bound_home_epsilon = 4\nhome_max_cost_ratio = 1.5\n\
             prefill_hold_max_ms = 250\nbatch_slots = 8\n{B}"
        ))
        .expect("valid");
        let r = &c.routing;
        assert_eq!(r.prefix_capacity_blocks, 512);
        assert_eq!(r.load_bound_epsilon, 1.0);
        assert_eq!(r.load_bound_floor, 3);
        assert_eq!(r.load_bound_home_epsilon, 4.0);
        assert_eq!(r.home_max_cost_ratio, 1.5);
        assert_eq!(r.prefill_hold_max_ms, 250);
        assert_eq!(r.batch_slots, 8);
        let d = RoutingSettings::default();
        assert_eq!(d.prefill_hold_max_ms, 500);
        assert_eq!(
            d.prefix_capacity_blocks,
            tokenway_router::DEFAULT_PREFIX_CAPACITY_BLOCKS
        );
        for (line, key) in [
            (
                "prefix_capacity_blocks = 99999999",
                "routing.prefix_capacity_blocks must be in 0..=16777216",
            ),
            (
                "load_bound_epsilon = -1",
                "routing.load_bound_epsilon must be a number in [0, 100]",
            ),
            (
                "load_bound_home_epsilon = nan",
                "routing.load_bound_home_epsilon",
            ),
            ("load_bound_floor = 2000000", "routing.load_bound_floor"),
            (
                "home_max_cost_ratio = 0.5",
                "routing.home_max_cost_ratio must be a number in [1, 1000]",
            ),
            ("load_bound_epsilon = \"wide\"", "load_bound_epsilon"),
            (
                "batch_slots = 1000001",
                "routing.batch_slots must be in 0..=1000000",
            ),
            (
                "prefill_hold_max_ms = 10001",
                "routing.prefill_hold_max_ms must be in 0..=10000",
            ),
        ] {
            let e = GatewayConfig::from_toml_str(&format!("[routing]\n{line}\n{B}")).unwrap_err();
            assert!(e.to_string().contains(key), "{key}: {e}");
        }
    }

    const TUNNEL: &str = "[[backends]]\nurl = \"http://127.0.0.1:8000\"\n[tunnel]\n\
        listen = \"127.0.0.1:0\"\ntokens = [\"0123456789abcdef\"]\n[tunnel.datagram]\n";

    #[test]
    fn tunnel_datagram_section_parses_and_names_bad_keys() {
        let c = GatewayConfig::from_toml_str(&format!(
            "{TUNNEL}fec = \"fixed:8:3\"\nobfs.psk = \"0123456789abcdef\"\ncc = \"brutal\"\n\
             bandwidth.up = \"100 mbps\"\n"
        ))
        .expect("valid");
        let d = c.tunnel.and_then(|t| t.datagram).expect("datagram section");
        assert_eq!(d.bandwidth.up.map(|b| b.bytes_per_sec()), Some(12_500_000));
        assert_eq!(d.overhead(), 18);
        for (extra, key) in [
            ("cc = \"brutal\"\n", "tunnel.datagram.bandwidth.up"),
            ("obfs.psk = \"short\"\n", "tunnel.datagram.obfs.psk"),
            ("fec = \"fixed:0:3\"\n", "tunnel.datagram.fec"),
            ("fec = \"sometimes\"\n", "fec"),
            ("bandwidth.up = \"fast\"\n", "bandwidth"),
            ("fec_k_max = 65\n", "tunnel.datagram.fec_k_max"),
        ] {
            let e = GatewayConfig::from_toml_str(&format!("{TUNNEL}{extra}")).unwrap_err();
            assert!(e.to_string().contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn the_health_probe_path_is_set_globally_or_per_backend_and_checked() {
        let b = "[[backends]]\nurl = \"http://ollama.internal:11434\"\n";
        let c = GatewayConfig::from_toml_str(&format!("{b}health_path = \"/\"\n")).expect("valid");
        assert_eq!(c.health.probe_path, "/health");
        assert_eq!(c.backends[0].health_path.as_deref(), Some("/"));
        let c =
            GatewayConfig::from_toml_str(&format!("[health]\nprobe_path = \"/v1/models\"\n{b}"))
                .expect("valid");
        assert_eq!(c.health.probe_path, "/v1/models");
        for (toml, key) in [
            (
                format!("[health]\nprobe_path = \"health\"\n{b}"),
                "health.probe_path",
            ),
            (
                format!("{b}health_path = \"x y\"\n"),
                "backends[0].health_path",
            ),
        ] {
            let e = GatewayConfig::from_toml_str(&toml).unwrap_err();
            assert!(e.to_string().contains(key), "{key}: {e}");
        }
        // A URL without a port is port 80.
        GatewayConfig::from_toml_str("[[backends]]\nurl = \"http://vllm.internal\"\n")
            .expect("valid");
    }
}
