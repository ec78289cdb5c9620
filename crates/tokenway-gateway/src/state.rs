//! The gateway's shared state: the router behind a mutex, the upstream pool, metrics.
//!
//! Router calls are short and never await while holding the lock. An [`Attempt`] is the guard
//! for one request sent to one backend: it counts in-flight work and reports exactly one outcome
//! to the router, even when the client goes away and the guard is simply dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Uri};
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokenway_router::{BackendId, BackendSpec, HealthTransition, Outcome, Router};
use tokenway_telemetry::quic::QuicMetrics;
use tokenway_telemetry::{
    BackendLabels, BackendMetrics, Histogram, Registry, RequestMetrics, StreamLabels,
};

use crate::config::GatewayConfig;
use crate::error::GatewayError;
use crate::tunnel::TunnelState;

/// The pooled HTTP/1.1 keep-alive client used for every backend.
pub type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// (backend index, route, transport) of a set of latency histograms.
type StreamKey = (usize, &'static str, &'static str);

/// One backend as the proxy sees it.
pub struct Upstream {
    /// Name in logs and metrics.
    pub name: String,
    /// `scheme://authority` of the backend.
    pub base: Uri,
    /// `Authorization` sent to the backend, if configured.
    pub authorization: Option<HeaderValue>,
    /// Labels of the per-backend gauges.
    pub labels: BackendLabels,
    /// The backend's own `/v1/models` entries, as last fetched.
    pub model_entries: Mutex<Vec<serde_json::Value>>,
    /// Whether the model list is known (from config or a successful fetch).
    pub models_known: AtomicBool,
    /// Whether models come from the config (then never re-learned).
    pub models_configured: bool,
    /// The name as a response header value (`x-tokenway-backend`), when it is a valid one.
    pub name_header: Option<HeaderValue>,
}

/// State shared by every connection and task of one gateway.
pub struct Shared {
    /// The configuration it was started with.
    pub config: GatewayConfig,
    router: Mutex<Router>,
    /// Backends, indexed by `BackendId.0`.
    pub upstreams: Vec<Upstream>,
    /// Pooled client.
    pub client: UpstreamClient,
    /// Request metrics.
    pub metrics: RequestMetrics,
    /// Backend gauges.
    pub backend_metrics: BackendMetrics,
    /// QUIC connection statistics of the HTTP/3 front and the tunnel port (peer label `h3` or
    /// `tunnel`: one series per front, not per client, to keep cardinality bounded).
    pub quic_metrics: QuicMetrics,
    /// Everything above, for `/metrics`.
    pub registry: Registry,
    /// Latency histogram handles by (backend, route, transport), resolved once: looking them up
    /// in the metric families per request would allocate label strings every time.
    stream_histograms: std::sync::RwLock<HashMap<StreamKey, [Histogram; 3]>>,
    /// The tunnel port's gatekeeping, when the tunnel is configured.
    pub tunnel: Option<TunnelState>,
    /// `Alt-Svc` value advertising the HTTP/3 front on TCP responses.
    pub alt_svc: std::sync::OnceLock<HeaderValue>,
}

impl Shared {
    /// Builds the state from a validated configuration.
    pub fn new(config: GatewayConfig) -> Result<Arc<Self>, GatewayError> {
        config.validate()?;
        let mut router = Router::new(config.policy, config.health.router_config(), rand::random());
        let mut upstreams = Vec::with_capacity(config.backends.len());
        for b in &config.backends {
            let name = b.display_name();
            let uri: Uri = b.url.parse().map_err(|e| {
                GatewayError::Config(format!("backend {name}: url {:?}: {e}", b.url))
            })?;
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
            let id = router.add_backend(BackendSpec {
                name: name.clone(),
                region: b.region.clone(),
                models: b.models.clone(),
                max_inflight: b.max_inflight,
            });
            debug_assert_eq!(id.0, upstreams.len());
            let entries = b
                .models
                .iter()
                .map(|m| serde_json::json!({"id": m, "object": "model", "created": 0, "owned_by": name}))
                .collect();
            upstreams.push(Upstream {
                labels: BackendLabels {
                    backend: name.clone(),
                    region: b.region.clone(),
                },
                name_header: HeaderValue::from_str(&name).ok(),
                name,
                base,
                authorization,
                model_entries: Mutex::new(entries),
                models_known: AtomicBool::new(!b.models.is_empty()),
                models_configured: !b.models.is_empty(),
            });
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
        for u in &upstreams {
            backend_metrics.healthy.get_or_create(&u.labels).set(1);
            backend_metrics.inflight.get_or_create(&u.labels).set(0);
        }
        let tunnel = config.tunnel.as_ref().map(TunnelState::new);
        Ok(Arc::new(Self {
            tunnel,
            config,
            router: Mutex::new(router),
            upstreams,
            client,
            metrics,
            backend_metrics,
            quic_metrics,
            registry,
            stream_histograms: std::sync::RwLock::new(HashMap::new()),
            alt_svc: std::sync::OnceLock::new(),
        }))
    }

    /// The TTFT, inter-token and duration histograms of responses from `id` on `route` over
    /// `transport`.
    pub fn stream_histograms(
        &self,
        id: BackendId,
        route: &'static str,
        transport: &'static str,
    ) -> [Histogram; 3] {
        let key = (id.0, route, transport);
        if let Some(h) = self
            .stream_histograms
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return h.clone();
        }
        let labels = StreamLabels {
            route: route.to_string(),
            backend: self.upstream(id).name.clone(),
            transport: transport.to_string(),
        };
        let handles = [
            self.metrics.ttft.get_or_create(&labels).clone(),
            self.metrics.inter_token.get_or_create(&labels).clone(),
            self.metrics.duration.get_or_create(&labels).clone(),
        ];
        self.stream_histograms
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, handles.clone());
        handles
    }

    /// Locks the router. A poisoned lock means a router call panicked, which is a bug; the state
    /// is still usable since every router call leaves it consistent.
    pub fn router(&self) -> MutexGuard<'_, Router> {
        self.router.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The upstream of `id`.
    pub fn upstream(&self, id: BackendId) -> &Upstream {
        &self.upstreams[id.0]
    }

    /// Records a health change in logs and gauges.
    pub fn note_transition(&self, id: BackendId, t: Option<HealthTransition>) {
        let Some(t) = t else { return };
        let u = self.upstream(id);
        match t {
            HealthTransition::Ejected { reason } => {
                tracing::warn!(backend = %u.name, ?reason, "backend ejected");
                self.backend_metrics.healthy.get_or_create(&u.labels).set(0);
            }
            HealthTransition::Readmitted => {
                tracing::info!(backend = %u.name, "backend re-admitted");
                self.backend_metrics.healthy.get_or_create(&u.labels).set(1);
            }
        }
    }

    /// Whether every backend has reported (or been configured with) its models.
    pub fn all_models_known(&self) -> bool {
        self.upstreams
            .iter()
            .all(|u| u.models_known.load(Ordering::Relaxed))
    }
}

/// One request in flight to one backend. Reports its outcome to the router exactly once: by
/// [`Attempt::finish`], or as `ClientCancelled` when dropped unfinished.
pub struct Attempt {
    shared: Arc<Shared>,
    id: BackendId,
    done: bool,
}

impl Attempt {
    /// Counts a new attempt on `id`.
    pub fn start(shared: Arc<Shared>, id: BackendId) -> Self {
        let inflight = {
            let mut r = shared.router();
            r.on_attempt_start(id, Instant::now());
            r.backend(id).map_or(0, |b| b.inflight)
        };
        let u = shared.upstream(id);
        shared
            .backend_metrics
            .inflight
            .get_or_create(&u.labels)
            .set(i64::from(inflight));
        Self {
            shared,
            id,
            done: false,
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
    pub fn backend_name(&self) -> &str {
        &self.shared.upstream(self.id).name
    }

    /// Reports the time to first byte.
    pub fn first_byte(&self, ttft: Duration) {
        self.shared
            .router()
            .on_first_byte(self.id, ttft, Instant::now());
    }

    /// Reports the outcome; later calls and the drop do nothing.
    pub fn finish(&mut self, outcome: Outcome) {
        if self.done {
            return;
        }
        self.done = true;
        let (transition, inflight) = {
            let mut r = self.shared.router();
            let t = r.on_attempt_end(self.id, outcome, Instant::now());
            (t, r.backend(self.id).map_or(0, |b| b.inflight))
        };
        let u = self.shared.upstream(self.id);
        self.shared
            .backend_metrics
            .inflight
            .get_or_create(&u.labels)
            .set(i64::from(inflight));
        self.shared.note_transition(self.id, transition);
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        self.finish(Outcome::ClientCancelled);
    }
}
