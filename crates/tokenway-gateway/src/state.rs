//! The gateway's shared state: the router behind a mutex, the upstream pool, metrics.
//!
//! Router calls are short and never await while holding the lock. An [`Attempt`] is the guard
//! for one request sent to one backend: it counts in-flight work and reports exactly one outcome
//! to the router, even when the client goes away and the guard is simply dropped.

use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Uri};
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokenway_router::{
    AttemptTicket, BackendId, BackendSpec, HealthTransition, Outcome, RouteRequest, Router,
    RouterConfig,
};
use tokenway_telemetry::quic::QuicMetrics;
use tokenway_telemetry::{
    BackendLabels, BackendMetrics, Counter, Family, Gauge, Histogram, LatencyHistogram,
    MetricConstructor, Registry, RequestLabels, RequestMetrics, StreamLabels,
};
use tokenway_transport::body_budget::BodyBudget;

use crate::admission::Admission;
use crate::config::{BackendConfig, GatewayConfig};
use crate::cpu_placement::PlacementMetrics;
use crate::error::GatewayError;
use crate::tunnel::TunnelState;
use crate::upstream_h1::H1Pool;

/// The pooled HTTP/1.1 keep-alive client used for every backend.
pub type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// (backend index, route, transport, client region index) of a set of latency histograms.
type StreamKey = (usize, &'static str, &'static str, usize);

/// (route, backend name, status) of a request counter.
type RequestKey = (&'static str, Option<String>, u16);

/// One backend as the proxy sees it.
pub struct Upstream {
    /// Name in logs and metrics.
    pub name: String,
    /// `scheme://authority` of the backend.
    pub base: Uri,
    /// The path of the backend's URL, without a trailing `/` or `/v1` (`http://host/llm/v1` is
    /// `/llm`): prepended to every path sent to it, for servers behind a path-routing proxy.
    /// Empty for a URL at the root.
    pub path_prefix: Box<str>,
    /// The `host:port` to connect to (`base`'s authority, with port 80 when it names none),
    /// shared with the connections to it (no copy per request); also their pool's key.
    pub authority: Arc<str>,
    /// The `Host` header: `base`'s authority as configured (no `:80` added).
    pub host: Arc<str>,
    /// `Authorization` sent to the backend, if configured.
    pub authorization: Option<HeaderValue>,
    /// Labels of the per-backend gauges.
    pub labels: BackendLabels,
    /// The backend's own `/v1/models` entries, as last fetched.
    pub model_entries: Mutex<Vec<serde_json::Value>>,
    /// Whether the model list is known (from config or a successful fetch).
    pub models_known: AtomicBool,
    /// When it was added (at start, or by discovery).
    pub added: Instant,
    /// Whether models come from the config (then never re-learned): it names one other than
    /// the wildcard.
    pub models_configured: bool,
    /// Whether the config lists the wildcard `"*"`: the backend also takes every model no
    /// backend names (it ignores the name, as llama.cpp and TGI do).
    pub wildcard: bool,
    /// Whether the learned list should be fetched again at the next good probe: the backend
    /// was re-admitted (it may have restarted with other models) or answered 404.
    pub models_stale: AtomicBool,
    /// The name as a response header value (`x-tokenway-backend`), when it is a valid one.
    pub name_header: Option<HeaderValue>,
    /// The configured URL, as given.
    pub url: String,
    /// The whole entry it was built from (a `backends_file` edit of any key replaces it).
    pub config: BackendConfig,
    /// Where this backend came from.
    pub source: Source,
    /// Set when discovery removed it: its probe task stops, the router no longer ranks it.
    pub removed: AtomicBool,
    /// `, backend;desc="<name>"` of the `server-timing` header (quotes and backslashes in the
    /// name become `_`), formatted once.
    pub timing_desc: String,
    /// Its `tokenway_backend_inflight` gauge, resolved at the first use (a family lookup hashes
    /// the label strings every time).
    inflight_gauge: std::sync::OnceLock<Gauge>,
    /// Its own health probe path (`health_path`), if it has one.
    pub health_path: Option<String>,
    /// Its `tokenway_requests_total{status="200"}` counters per proxied route (in the order of
    /// [`crate::service::PROXIED`]), resolved at the first use: the counter of every answered
    /// request, looked up without hashing or copying the name.
    ok_counters: [std::sync::OnceLock<Counter>; crate::service::HOT_ROUTES],
}

/// Where a backend was configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The main configuration.
    Static,
    /// The watched `backends_file`.
    File,
}

/// `, backend;desc="<name>"` with quotes and backslashes of `name` replaced by `_`.
fn timing_desc(name: &str) -> String {
    let quoted: String = name
        .chars()
        .map(|c| if c == '"' || c == '\\' { '_' } else { c })
        .collect();
    format!(", backend;desc=\"{quoted}\"")
}

/// The `host:port` to connect to for `base`: a URL without a port (`http://vllm.internal`)
/// means port 80, as it does for the health probes' HTTP client.
fn connect_authority(base: &Uri) -> Arc<str> {
    let authority = base.authority().map_or("", |a| a.as_str());
    if base.port_u16().is_some() {
        Arc::from(authority)
    } else {
        Arc::from(format!("{authority}:80"))
    }
}

impl Upstream {
    /// Builds the upstream of a (validated) backend entry.
    pub fn from_config(b: &BackendConfig, source: Source) -> Result<Self, GatewayError> {
        let name = b.display_name();
        let uri: Uri = b
            .url
            .parse()
            .map_err(|e| GatewayError::Config(format!("backend {name}: url {:?}: {e}", b.url)))?;
        let base = Uri::builder()
            .scheme(uri.scheme_str().unwrap_or("http"))
            .authority(uri.authority().map(|a| a.as_str()).unwrap_or_default())
            .path_and_query("/")
            .build()
            .map_err(|e| GatewayError::Config(format!("backend {name}: url: {e}")))?;
        let authorization = match &b.api_key {
            Some(k) => Some(HeaderValue::try_from(format!("Bearer {k}")).map_err(|_| {
                GatewayError::Config(format!(
                    "backends.api_key of {name} holds characters not allowed in a header"
                ))
            })?),
            None => None,
        };
        let path = uri.path().trim_end_matches('/');
        let path_prefix = path.strip_suffix("/v1").unwrap_or(path).into();
        let named = b.models.iter().any(|m| m != WILDCARD_MODEL);
        let entries = b
            .models
            .iter()
            .filter(|m| *m != WILDCARD_MODEL)
            .map(
                |m| serde_json::json!({"id": m, "object": "model", "created": 0, "owned_by": name}),
            )
            .collect();
        Ok(Upstream {
            labels: BackendLabels {
                backend: name.clone(),
                region: b.region.clone(),
            },
            name_header: HeaderValue::from_str(&name).ok(),
            timing_desc: timing_desc(&name),
            name,
            authority: connect_authority(&base),
            host: Arc::from(base.authority().map_or("", |a| a.as_str())),
            base,
            path_prefix,
            authorization,
            model_entries: Mutex::new(entries),
            models_known: AtomicBool::new(named),
            added: Instant::now(),
            models_configured: named,
            wildcard: b.models.iter().any(|m| m == WILDCARD_MODEL),
            models_stale: AtomicBool::new(false),
            url: b.url.clone(),
            config: b.clone(),
            health_path: b.health_path.clone(),
            source,
            removed: AtomicBool::new(false),
            inflight_gauge: std::sync::OnceLock::new(),
            ok_counters: Default::default(),
        })
    }

    /// The router's description of it.
    pub fn spec(&self, b: &BackendConfig) -> BackendSpec {
        BackendSpec {
            name: self.name.clone(),
            region: b.region.clone(),
            models: b.models.clone(),
            max_inflight: b.max_inflight,
            prefix_capacity_blocks: b.prefix_capacity_blocks,
        }
    }
}

/// State shared by every connection and task of one gateway.
pub struct Shared {
    /// The configuration it was started with.
    pub config: GatewayConfig,
    router: Mutex<Router>,
    /// Backends, indexed by `BackendId.0` (removed ones stay as tombstones: ids are never
    /// reused).
    upstreams: RwLock<Vec<Arc<Upstream>>>,
    /// Pooled hyper client (probes, masquerade proxy).
    pub client: UpstreamClient,
    /// Streaming HTTP/1.1 connections to backends (the proxy path).
    pub h1: Arc<H1Pool>,
    /// Request metrics.
    pub metrics: RequestMetrics,
    /// Backend gauges.
    pub backend_metrics: BackendMetrics,
    /// QUIC connection statistics of the HTTP/3 front and the tunnel port (peer label `h3` or
    /// `tunnel`: one series per front, not per client, to keep cardinality bounded).
    pub quic_metrics: QuicMetrics,
    /// Front threads pinned and unpinned (`front_cpu_affinity`).
    pub placement_metrics: PlacementMetrics,
    /// Everything above, for `/metrics`.
    pub registry: Registry,
    /// Latency histogram handles by (backend, route, transport), resolved once: looking them up
    /// in the metric families per request would allocate label strings every time.
    /// (Fx hashing: the keys are the gateway's own, not a client's, and SipHash cost ~250
    /// instructions a lookup.)
    stream_histograms: std::sync::RwLock<FxHashMap<StreamKey, [Histogram; 3]>>,
    /// `tokenway_requests_total` handles by (route, backend, status), for the same reason.
    /// Bounded by the label set itself: routes and backends are configured, statuses are three
    /// digits.
    request_counters: std::sync::RwLock<FxHashMap<RequestKey, Counter>>,
    /// Known regions; the last entry is `other`.
    regions: Vec<String>,
    /// `routing.session_header` and `routing.client_region_header`, parsed once: a lookup by
    /// a string name parses it on every request.
    pub routing_headers: [HeaderName; 2],
    /// `cors_allow_origins`, when set.
    pub cors: Option<crate::cors::Cors>,
    /// The tunnel port's gatekeeping, when the tunnel is configured.
    pub tunnel: Option<TunnelState>,
    /// `Alt-Svc` value advertising the HTTP/3 front on TCP responses.
    pub alt_svc: std::sync::OnceLock<HeaderValue>,
    /// The tunnel to peer gateways, when `[overflow]` is configured (set once at bind).
    pub overflow: std::sync::OnceLock<Arc<tokenway_transport::tunnel::Tunnel>>,
    /// Requests waiting for a slot while every backend of their model is full.
    pub admission: Admission,
    /// The bound on request bodies held, all fronts together (`max_held_body_bytes`).
    pub bodies: BodyBudget,
    /// `api_keys`, hashed for a comparison that times nothing of them.
    pub api_keys: crate::secret::Secrets,
}

impl Shared {
    /// Builds the state from a validated configuration.
    pub fn new(config: GatewayConfig) -> Result<Arc<Self>, GatewayError> {
        config.validate()?;
        let r = &config.routing;
        let mut router_config = RouterConfig {
            health: config.health.router_config(),
            ..RouterConfig::default()
        };
        router_config.cost.cross_region_penalty = Duration::from_millis(r.cross_region_penalty_ms);
        router_config.affinity.epsilon = r.affinity_epsilon;
        router_config.prefix_capacity_blocks = r.prefix_capacity_blocks;
        router_config.cost.load_bound_epsilon = Some(r.load_bound_epsilon);
        router_config.cost.load_bound_floor = r.load_bound_floor;
        router_config.cost.load_bound_home_epsilon = Some(r.load_bound_home_epsilon);
        router_config.cost.home_max_cost_ratio = r.home_max_cost_ratio;
        router_config.cost.prefill_hold_max = Duration::from_millis(r.prefill_hold_max_ms);
        router_config.cost.batch_slots = (r.batch_slots > 0).then_some(r.batch_slots);
        router_config.hedge.enabled = r.hedge;
        let mut router = Router::with_config(config.policy, router_config, rand::random());
        let mut upstreams = Vec::with_capacity(config.backends.len());
        for b in &config.backends {
            let upstream = Upstream::from_config(b, Source::Static)?;
            let id = router.add_backend(upstream.spec(b));
            debug_assert_eq!(id.0, upstreams.len());
            upstreams.push(Arc::new(upstream));
        }

        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.timeouts.connect()));
        connector.set_keepalive(Some(Duration::from_secs(30)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(512)
            .build(connector);

        let mut registry = tokenway_telemetry::new_registry();
        let metrics = RequestMetrics::register(&mut registry);
        let backend_metrics = BackendMetrics::register(&mut registry);
        let quic_metrics = QuicMetrics::register(&mut registry);
        let admission = Admission::new(config.queue_max, &mut registry);
        let placement_metrics = PlacementMetrics::register(&mut registry);
        for u in upstreams.iter() {
            backend_metrics.healthy.get_or_create(&u.labels).set(1);
            backend_metrics.inflight.get_or_create(&u.labels).set(0);
        }
        let tunnel = config.tunnel.as_ref().map(TunnelState::new);
        let mut regions = vec![config.region.clone()];
        for b in &config.backends {
            if !regions.contains(&b.region) {
                regions.push(b.region.clone());
            }
        }
        regions.push("other".to_string());
        let h1 = H1Pool::new(config.timeouts.connect(), config.front_thread_count());
        let header = |key: &str, v: &str| {
            HeaderName::from_bytes(v.as_bytes()).map_err(|_| {
                GatewayError::Config(format!(
                    "{key} must be a valid HTTP header name (got {v:?})"
                ))
            })
        };
        let routing_headers = [
            header("routing.session_header", &r.session_header)?,
            header("routing.client_region_header", &r.client_region_header)?,
        ];
        let config_bodies = config.max_held_body_bytes;
        Ok(Arc::new(Self {
            api_keys: crate::secret::Secrets::new(&config.api_keys),
            routing_headers,
            cors: crate::cors::Cors::new(&config.cors_allow_origins),
            h1,
            tunnel,
            config,
            router: Mutex::new(router),
            upstreams: RwLock::new(upstreams),
            client,
            metrics,
            backend_metrics,
            quic_metrics,
            registry,
            stream_histograms: std::sync::RwLock::new(FxHashMap::default()),
            request_counters: std::sync::RwLock::new(FxHashMap::default()),
            regions,
            alt_svc: std::sync::OnceLock::new(),
            overflow: std::sync::OnceLock::new(),
            admission,
            placement_metrics,
            bodies: BodyBudget::of_bytes(config_bodies),
        }))
    }

    /// The TTFT, inter-token and duration histograms of responses from `id` on `route` over
    /// `transport`.
    pub fn stream_histograms(
        &self,
        id: BackendId,
        route: &'static str,
        transport: &'static str,
        client_region: &str,
    ) -> [Histogram; 3] {
        let region = self.region_index(client_region);
        let key = (id.0, route, transport, region);
        if let Some(h) = self
            .stream_histograms
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return h.clone();
        }
        let u = self.upstream(id);
        // Under the lock `remove_backend` takes after marking the backend removed: a stream
        // of a removed backend that ends later gets handles of no series, instead of adding
        // its series back for good.
        let mut cache = self
            .stream_histograms
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if u.removed.load(Ordering::Relaxed) {
            return std::array::from_fn(|_| LatencyHistogram.new_metric());
        }
        let labels = StreamLabels {
            route: route.to_string(),
            backend: u.name.clone(),
            transport: transport.to_string(),
            client_region: self.regions[region].clone(),
            backend_region: u.labels.region.clone(),
        };
        let handles = [
            self.metrics.ttft.get_or_create(&labels).clone(),
            self.metrics.inter_token.get_or_create(&labels).clone(),
            self.metrics.duration.get_or_create(&labels).clone(),
        ];
        cache.insert(key, handles.clone());
        handles
    }

    /// The index of `region` among the known regions (the gateway's, the backends', and a
    /// last `other` for anything else, so a client-chosen header cannot grow the label set).
    pub fn region_index(&self, region: &str) -> usize {
        self.regions
            .iter()
            .position(|r| r == region)
            .unwrap_or(self.regions.len() - 1)
    }

    /// Locks the router. A poisoned lock means a router call panicked, which is a bug; the state
    /// is still usable since every router call leaves it consistent.
    pub fn router(&self) -> MutexGuard<'_, Router> {
        self.router.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The upstream of `id`.
    pub fn upstream(&self, id: BackendId) -> Arc<Upstream> {
        self.upstreams.read().unwrap_or_else(|p| p.into_inner())[id.0].clone()
    }

    /// Every backend not removed, with its id.
    pub fn live_upstreams(&self) -> Vec<(BackendId, Arc<Upstream>)> {
        self.upstreams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .enumerate()
            .filter(|(_, u)| !u.removed.load(Ordering::Relaxed))
            .map(|(i, u)| (BackendId(i), u.clone()))
            .collect()
    }

    /// Adds a backend (from discovery); the caller starts its probes.
    pub fn add_backend(
        &self,
        b: &BackendConfig,
        source: Source,
    ) -> Result<BackendId, GatewayError> {
        let upstream = Upstream::from_config(b, source)?;
        let mut upstreams = self.upstreams.write().unwrap_or_else(|p| p.into_inner());
        let id = self.router().add_backend(upstream.spec(b));
        debug_assert_eq!(id.0, upstreams.len());
        self.backend_metrics
            .healthy
            .get_or_create(&upstream.labels)
            .set(1);
        self.backend_metrics
            .inflight
            .get_or_create(&upstream.labels)
            .set(0);
        upstreams.push(Arc::new(upstream));
        Ok(id)
    }

    /// Removes a backend: no new requests go to it; requests in flight finish.
    pub fn remove_backend(&self, id: BackendId) {
        let u = self.upstream(id);
        u.removed.store(true, Ordering::Relaxed);
        self.router().remove_backend(id);
        self.backend_metrics.healthy.remove(&u.labels);
        self.backend_metrics.inflight.remove(&u.labels);
        for cause in STREAM_ERROR_CAUSES {
            self.backend_metrics
                .stream_errors
                .remove(&tokenway_telemetry::StreamErrorLabels {
                    backend: u.labels.backend.clone(),
                    region: u.labels.region.clone(),
                    cause,
                });
        }
        // Its latency and request series go too: discovery names a backend by its address, so
        // every pod replacement added series that were never removed, without bound.
        let gone: Vec<StreamKey> = {
            let mut h = self
                .stream_histograms
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let keys: Vec<StreamKey> = h.keys().filter(|k| k.0 == id.0).copied().collect();
            for k in &keys {
                h.remove(k);
            }
            keys
        };
        for (_, route, transport, region) in gone {
            let labels = StreamLabels {
                route: route.to_string(),
                backend: u.name.clone(),
                transport: transport.to_string(),
                client_region: self.regions[region].clone(),
                backend_region: u.labels.region.clone(),
            };
            self.metrics.ttft.remove(&labels);
            self.metrics.inter_token.remove(&labels);
            self.metrics.duration.remove(&labels);
        }
        let mut counters = self
            .request_counters
            .write()
            .unwrap_or_else(|p| p.into_inner());
        counters.retain(|(route, backend, status), _| {
            if backend.as_deref() != Some(u.name.as_str()) {
                return true;
            }
            self.metrics.requests.remove(&RequestLabels {
                route: route.to_string(),
                backend: u.name.clone(),
                status: *status,
            });
            false
        });
    }

    /// Records a health change in logs and gauges.
    pub fn note_transition(&self, id: BackendId, t: Option<HealthTransition>) {
        let Some(t) = t else { return };
        let u = self.upstream(id);
        let healthy = match t {
            HealthTransition::Ejected { reason } => {
                tracing::warn!(backend = %u.name, ?reason, "backend ejected");
                0
            }
            HealthTransition::Readmitted => {
                tracing::info!(backend = %u.name, "backend re-admitted");
                u.models_stale.store(true, Ordering::Relaxed);
                1
            }
        };
        // A removed backend's requests still in flight may end in failures that eject it:
        // its gauge, gone with it, is not set again.
        self.backend_series(&u, &self.backend_metrics.healthy, &u.labels, |g| {
            g.set(healthy);
        });
    }

    /// Applies `f` to `family`'s series of `labels` for backend `u`, unless `u` is removed
    /// (its series went with it and are not added back by what its last requests report).
    pub fn backend_series<L, M, C>(
        &self,
        u: &Upstream,
        family: &Family<L, M, C>,
        labels: &L,
        f: impl FnOnce(&M),
    ) where
        L: Clone + std::hash::Hash + Eq,
        C: MetricConstructor<M>,
    {
        if u.removed.load(Ordering::Relaxed) {
            return;
        }
        f(&family.get_or_create(labels));
        // Removed meanwhile: `remove_backend` may have removed the series before it was
        // created here. Unless a backend of the same name took its place (discovery replaces
        // a changed backend by removing and adding it): the series is the newcomer's then.
        if u.removed.load(Ordering::Relaxed) && !self.names_live_backend(&u.name) {
            family.remove(labels);
        }
    }

    /// Whether a backend named `name` is configured and not removed.
    fn names_live_backend(&self, name: &str) -> bool {
        self.upstreams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|u| u.name == name && !u.removed.load(Ordering::Relaxed))
    }

    /// The in-flight gauge of `id` (`None` once it is removed: its gauge went with it). Set it
    /// under the router's lock, with the count read there: set after the lock, two attempts
    /// ending on two threads could set their counts in the other order and leave the gauge
    /// showing a request that is gone, on an idle backend until its next request.
    pub fn inflight_gauge(&self, id: BackendId) -> Option<Gauge> {
        let u = self.upstream(id);
        if u.removed.load(Ordering::Relaxed) {
            return None;
        }
        Some(
            u.inflight_gauge
                .get_or_init(|| {
                    self.backend_metrics
                        .inflight
                        .get_or_create(&u.labels)
                        .clone()
                })
                .clone(),
        )
    }

    /// Counts a finished request in `tokenway_requests_total` (`backend` `None`: `none`).
    pub fn count_request(&self, route: &'static str, backend: Option<String>, status: u16) {
        self.request_counter(route, backend, status).inc();
    }

    /// The `tokenway_requests_total` counter of these labels (`backend` `None`: `none`).
    pub fn request_counter(
        &self,
        route: &'static str,
        backend: Option<String>,
        status: u16,
    ) -> Counter {
        let key = (route, backend, status);
        if let Some(c) = self
            .request_counters
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return c.clone();
        }
        // Under the lock `remove_backend` takes after marking the backend removed: the answers
        // of a removed backend still in flight count in no series, instead of adding theirs
        // back for good.
        let mut cache = self
            .request_counters
            .write()
            .unwrap_or_else(|p| p.into_inner());
        // A label that names no backend at all (an overflow to a peer region, `overflow:<peer>`)
        // is counted as usual.
        if let Some(name) = &key.1 {
            let upstreams = self.upstreams.read().unwrap_or_else(|p| p.into_inner());
            let mut named = upstreams.iter().filter(|u| u.name == *name).peekable();
            let removed =
                named.peek().is_some() && named.all(|u| u.removed.load(Ordering::Relaxed));
            if removed {
                return Counter::default();
            }
        }
        let counter = self
            .metrics
            .requests
            .get_or_create(&RequestLabels {
                route: route.to_string(),
                backend: key.1.clone().unwrap_or_else(|| "none".to_string()),
                status,
            })
            .clone();
        cache.insert(key, counter.clone());
        counter
    }

    /// The `tokenway_requests_total` counter of 200 answers from `upstream` on `route`.
    pub fn ok_counter(&self, upstream: &Upstream, route: &'static str) -> Counter {
        let hot = &crate::service::PROXIED[..crate::service::HOT_ROUTES];
        match hot.iter().position(|r| *r == route) {
            Some(i) => upstream.ok_counters[i]
                .get_or_init(|| self.request_counter(route, Some(upstream.name.clone()), 200))
                .clone(),
            None => self.request_counter(route, Some(upstream.name.clone()), 200),
        }
    }

    /// Whether a backend that may serve a model not known yet is still being discovered: its
    /// model list is neither configured nor fetched, and it was added less than
    /// [`MODEL_DISCOVERY_GRACE`] ago. Past that, a backend that never answered (down since the
    /// gateway started) no longer turns every unknown model into a 503 that clients retry.
    pub fn models_being_discovered(&self) -> bool {
        self.live_upstreams().iter().any(|(_, u)| {
            !u.models_known.load(Ordering::Relaxed) && u.added.elapsed() < MODEL_DISCOVERY_GRACE
        })
    }
}

/// The `cause` labels of `tokenway_stream_errors_total`.
pub const STREAM_ERROR_CAUSES: [&str; 4] = [
    "backend_error_event",
    "backend_rejected",
    "upstream_failed",
    "upstream_stalled",
];

/// The model name a backend lists to take every model no backend names.
pub const WILDCARD_MODEL: &str = "*";

/// How long a backend without a configured model list may take to report it before an
/// unknown model is a 404 rather than a 503 (see [`Shared::models_being_discovered`]).
pub const MODEL_DISCOVERY_GRACE: Duration = Duration::from_secs(30);

/// One request in flight to one backend. Reports its outcome to the router exactly once: by
/// [`Attempt::finish`], or as `ClientCancelled` when dropped unfinished.
pub struct Attempt {
    shared: Arc<Shared>,
    id: BackendId,
    request: Arc<RouteRequest>,
    ticket: Option<AttemptTicket>,
    /// A first token noted but not yet reported (time to it, when it came); see
    /// [`Attempt::first_byte`].
    first: Option<(Duration, Instant)>,
}

impl Attempt {
    /// Counts a new attempt of `request` on `id`.
    pub fn start(shared: Arc<Shared>, id: BackendId, request: Arc<RouteRequest>) -> Self {
        Self::start_with(shared, id, request, false)
    }

    /// Counts a new attempt of `request` on the backend `held` reserved, taking its slot over.
    pub fn start_reserved(held: Reservation, request: Arc<RouteRequest>) -> Self {
        let (shared, id) = held.into_parts();
        Self::start_with(shared, id, request, true)
    }

    fn start_with(
        shared: Arc<Shared>,
        id: BackendId,
        request: Arc<RouteRequest>,
        reserved: bool,
    ) -> Self {
        let gauge = shared.inflight_gauge(id);
        let ticket = {
            let mut r = shared.router();
            if reserved {
                r.unreserve(id);
            }
            let t = r.start_attempt(id, &request, Instant::now());
            if let Some(g) = &gauge {
                g.set(i64::from(r.backend(id).map_or(0, |b| b.inflight)));
            }
            t
        };
        Self {
            shared,
            id,
            request,
            ticket: Some(ticket),
            first: None,
        }
    }

    /// The backend of this attempt.
    pub fn backend(&self) -> BackendId {
        self.id
    }

    /// The shared state.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The backend's name.
    pub fn backend_name(&self) -> String {
        self.shared.upstream(self.id).name.clone()
    }

    /// Counts an answer that failed after its first byte (`tokenway_stream_errors_total`);
    /// `cause` is one of [`STREAM_ERROR_CAUSES`].
    pub fn count_stream_error(&self, cause: &'static str) {
        debug_assert!(STREAM_ERROR_CAUSES.contains(&cause), "{cause}");
        let u = self.shared.upstream(self.id);
        self.shared.backend_series(
            &u,
            &self.shared.backend_metrics.stream_errors,
            &tokenway_telemetry::StreamErrorLabels {
                backend: u.labels.backend.clone(),
                region: u.labels.region.clone(),
                cause,
            },
            |c| {
                c.inc();
            },
        );
    }

    /// Notes the first token (the first body frame) `ttft` after the request was sent. The
    /// router hears of it at [`Attempt::settle`] or at the next report, whichever comes first:
    /// the relay settles once that frame is on its way to the client, so the router's
    /// bookkeeping (a lock, rate and health estimates) is not in the token's way.
    pub fn first_byte(&mut self, ttft: Duration) {
        if self.first.is_none() {
            self.first = Some((ttft, Instant::now()));
        }
    }

    /// Reports a first token noted by [`Attempt::first_byte`], with the time it came.
    pub fn settle(&mut self) {
        let Some((ttft, at)) = self.first.take() else {
            return;
        };
        let Some(ticket) = self.ticket.as_mut() else {
            return;
        };
        let t = self.shared.router().first_token(ticket, ttft, at);
        self.shared.note_transition(self.id, t);
    }

    /// Reports that the stream went silent past the stall timeout.
    pub fn stalled(&mut self) {
        self.settle();
        let Some(ticket) = self.ticket.as_mut() else {
            return;
        };
        let t = self.shared.router().stalled(ticket, Instant::now());
        self.shared.note_transition(self.id, t);
    }

    /// Reports the outcome; later calls and the drop do nothing.
    pub fn finish(&mut self, outcome: Outcome) {
        self.settle();
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let gauge = self.shared.inflight_gauge(self.id);
        let transition = {
            let mut r = self.shared.router();
            let t = r.end_attempt(ticket, outcome, Instant::now());
            if let Some(g) = &gauge {
                g.set(i64::from(r.backend(self.id).map_or(0, |b| b.inflight)));
            }
            t
        };
        self.shared.note_transition(self.id, transition);
        self.shared.admission.slot_freed();
    }

    /// The request this attempt carries.
    pub fn request(&self) -> &RouteRequest {
        &self.request
    }
}

/// A slot of a backend held from the moment a request is routed to it until its attempt starts
/// (the request is written first, which may wait on a connect): without it, requests that
/// arrive meanwhile see the slot free, and a burst overshoots the backend's `max_inflight`.
/// Dropped unused, it gives the slot back and wakes a request waiting for one.
pub struct Reservation {
    held: Option<(Arc<Shared>, BackendId)>,
}

impl Reservation {
    /// Takes a slot of `id`; the caller holds the router's lock as `router` (the lock it routed
    /// under, so that nobody routes between the two).
    pub fn take(shared: &Arc<Shared>, router: &mut Router, id: BackendId) -> Self {
        router.reserve(id);
        Self {
            held: Some((shared.clone(), id)),
        }
    }

    /// Takes a slot of `id` if one is free.
    pub fn try_take(shared: &Arc<Shared>, id: BackendId) -> Option<Self> {
        let taken = shared.router().try_reserve(id);
        taken.then(|| Self {
            held: Some((shared.clone(), id)),
        })
    }

    /// The backend whose slot it holds.
    pub fn backend(&self) -> Option<BackendId> {
        self.held.as_ref().map(|(_, id)| *id)
    }

    fn into_parts(mut self) -> (Arc<Shared>, BackendId) {
        self.held.take().expect("a reservation is used once")
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some((shared, id)) = self.held.take() {
            shared.router().unreserve(id);
            shared.admission.slot_freed();
        }
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        self.finish(Outcome::ClientCancelled);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_backend_takes_its_series_with_it() {
        let c = crate::config::GatewayConfig::from_toml_str(
            "[[backends]]\nname = \"gone-pod\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n\
             [[backends]]\nname = \"kept\"\nurl = \"http://127.0.0.1:10\"\nmodels = [\"m\"]\n",
        )
        .expect("config");
        let shared = Shared::new(c).expect("state");
        for (id, _) in shared.live_upstreams() {
            let name = shared.upstream(id).name.clone();
            shared
                .request_counter("/v1/chat/completions", Some(name), 200)
                .inc();
            shared.stream_histograms(id, "/v1/chat/completions", "h1", "local")[0].observe(0.1);
        }
        let text = tokenway_telemetry::render(&shared.registry);
        assert!(text.contains("backend=\"gone-pod\""), "{text}");
        shared.remove_backend(BackendId(0));
        let text = tokenway_telemetry::render(&shared.registry);
        assert!(!text.contains("gone-pod"), "{text}");
        assert!(text.contains("backend=\"kept\""), "{text}");
        // Its requests still in flight end (the pod is killed after its grace period): what
        // they report does not bring its series back.
        let gone = BackendId(0);
        shared
            .request_counter("/v1/chat/completions", Some("gone-pod".into()), 502)
            .inc();
        shared.stream_histograms(gone, "/v1/completions", "h2", "local")[1].observe(0.2);
        shared.note_transition(
            gone,
            Some(HealthTransition::Ejected {
                reason: tokenway_router::EjectReason::ConnectError,
            }),
        );
        assert!(shared.inflight_gauge(gone).is_none());
        let text = tokenway_telemetry::render(&shared.registry);
        assert!(!text.contains("gone-pod"), "{text}");
        // The live backend's still are.
        shared
            .request_counter("/v1/chat/completions", Some("kept".into()), 502)
            .inc();
        shared.note_transition(BackendId(1), Some(HealthTransition::Readmitted));
        // An answer through a peer region is labelled with no backend of this gateway's.
        shared
            .request_counter("/v1/chat/completions", Some("overflow:peer".into()), 200)
            .inc();
        let text = tokenway_telemetry::render(&shared.registry);
        assert!(text.contains("status=\"502\""), "{text}");
        assert!(text.contains("backend=\"overflow:peer\""), "{text}");
        assert!(
            text.contains("tokenway_backend_healthy{backend=\"kept\""),
            "{text}"
        );
    }

    #[test]
    fn a_backend_url_without_a_port_connects_to_port_80() {
        let cases = [
            ("http://vllm.internal/", "vllm.internal:80"),
            ("http://10.0.0.7:8000/", "10.0.0.7:8000"),
            ("http://[fd00::7]/", "[fd00::7]:80"),
            ("http://[fd00::7]:30000/", "[fd00::7]:30000"),
        ];
        for (url, want) in cases {
            let base: Uri = url.parse().expect("URL");
            assert_eq!(&*connect_authority(&base), want, "{url}");
        }
    }

    #[test]
    fn a_backend_url_path_is_prefixed_to_every_path_sent_and_v1_is_not_doubled() {
        let cases = [
            ("http://h:8000", ""),
            ("http://h:8000/", ""),
            ("http://h:8000/v1", ""),
            ("http://h:8000/v1/", ""),
            ("http://h/llm", "/llm"),
            ("http://h/llm/v1", "/llm"),
            ("http://h/a/b/", "/a/b"),
        ];
        for (url, want) in cases {
            let c = crate::config::GatewayConfig::from_toml_str(&format!(
                "[[backends]]\nurl = \"{url}\"\nmodels = [\"m\"]\n"
            ))
            .expect("config");
            let u = Upstream::from_config(&c.backends[0], Source::Static).expect("upstream");
            assert_eq!(&*u.path_prefix, want, "{url}");
            let parts = http::Request::post("/v1/chat/completions?x=1")
                .body(())
                .expect("request")
                .into_parts()
                .0;
            let head =
                crate::upstream_h1::encode_head("h", &u.path_prefix, &parts, std::iter::empty(), 0);
            let line = String::from_utf8_lossy(&head)
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned();
            assert_eq!(
                line,
                format!("POST {want}/v1/chat/completions?x=1 HTTP/1.1"),
                "{url}"
            );
        }
    }
}
