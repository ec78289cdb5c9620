//! The HTTP server: accept loop, routes, admission (slots and queue), and the token generator
//! that turns the cost model into real timing on the wire.
//!
//! One request's life: parse -> faults -> admission (a free slot, or a place in the FIFO queue,
//! or 429) -> prefill wait (base latency + uncached prompt tokens / prefill rate + slow start,
//! measured from admission) -> one token per decode interval on an absolute schedule -> finish.
//! The slot (a semaphore permit) is held from admission to the last token, or until the client
//! goes away, which a streaming generator notices when its channel closes.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use prometheus_client::metrics::family::MetricConstructor;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokenway_telemetry::{
    new_registry, render, Counter, Family, Gauge, Histogram, Registry, RequestLabels,
    RequestMetrics, StreamLabels, CONTENT_TYPE,
};
use tokio::net::TcpListener;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep_until, Instant};

use crate::body::{stream_channel, SimBody, StreamTx};
use crate::choice::{Choice, Ending, Finish};
use crate::cost::{self, PrefixCache};
use crate::embeddings::EmbedJob;
use crate::openai::{self, Api, ApiError, Encoder, Job, Usage};
use crate::prefill::PrefillSchedule;
use crate::{Faults, SimConfig, SimError};

/// Largest request body accepted; larger bodies get 413.
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// How long `serve` lets open responses finish after shutdown before it drops them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

type Labels = Vec<(String, String)>;

/// vLLM's load gauges and token counters, without the `tokenway` prefix, labelled `model_name`
/// like vLLM.
struct VllmGauges {
    registry: Registry,
    labels: Labels,
    running: Family<Labels, Gauge>,
    waiting: Family<Labels, Gauge>,
    cache_usage: Family<Labels, Gauge<f64, AtomicU64>>,
    prompt_tokens: Family<Labels, Counter>,
    generation_tokens: Family<Labels, Counter>,
    prefix_queries: Family<Labels, Counter>,
    prefix_hits: Family<Labels, Counter>,
}

impl VllmGauges {
    fn new(model: &str) -> Self {
        let mut registry = Registry::default();
        let g = Self {
            registry: Registry::default(),
            labels: vec![("model_name".to_owned(), model.to_owned())],
            running: Family::default(),
            waiting: Family::default(),
            cache_usage: Family::default(),
            prompt_tokens: Family::default(),
            generation_tokens: Family::default(),
            prefix_queries: Family::default(),
            prefix_hits: Family::default(),
        };
        registry.register(
            "vllm:num_requests_running",
            "Number of requests running (holding a slot)",
            g.running.clone(),
        );
        registry.register(
            "vllm:num_requests_waiting",
            "Number of requests waiting for a slot",
            g.waiting.clone(),
        );
        // vLLM V1 renamed it; both names are served, as vLLM did while the old one was
        // deprecated.
        for name in ["vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"] {
            registry.register(
                name,
                "Fraction of the KV cache held by running requests, 0 to 1",
                g.cache_usage.clone(),
            );
        }
        let counters = [
            (
                "vllm:prompt_tokens",
                "Prefilled prompt tokens",
                &g.prompt_tokens,
            ),
            (
                "vllm:generation_tokens",
                "Generated tokens",
                &g.generation_tokens,
            ),
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                &g.prefix_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                &g.prefix_hits,
            ),
        ];
        for (name, help, family) in counters {
            registry.register(name, help, family.clone());
        }
        Self { registry, ..g }
    }

    fn add(&self, family: &Family<Labels, Counter>, n: u64) {
        family.get_or_create(&self.labels).inc_by(n);
    }
}

/// The KV-cache tokens one running request holds, returned however the request ends.
struct KvHold {
    shared: Arc<Shared>,
    tokens: u64,
}

impl KvHold {
    /// One more generated token.
    fn grow(&mut self) {
        self.tokens += 1;
        self.shared.kv_held_tokens.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for KvHold {
    fn drop(&mut self) {
        self.shared
            .kv_held_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
        self.shared.kv_freed.notify_waiters();
    }
}

/// A request waiting for room in the KV cache, counted as waiting, not running.
struct KvWait<'a>(&'a AtomicUsize);

impl Drop for KvWait<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// State shared by every connection.
struct Shared {
    config: SimConfig,
    faults: Mutex<Faults>,
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    /// KV-cache tokens held by running requests (prompt and tokens generated so far).
    kv_held_tokens: AtomicU64,
    /// With `prefill_shared`, the prefill turns of the requests in prefill.
    prefill: Mutex<PrefillSchedule>,
    /// Bumped when turns of `prefill` move earlier (a request left before its turn was done).
    prefill_moved: watch::Sender<()>,
    /// Woken whenever KV-cache tokens are given back.
    kv_freed: tokio::sync::Notify,
    /// Requests holding a slot but waiting for room in the KV cache.
    kv_waiting: AtomicUsize,
    /// The line for room in the KV cache (tokio's mutex is fair: first come, first served).
    kv_line: tokio::sync::Mutex<()>,
    cache: Mutex<PrefixCache>,
    rng: Mutex<SmallRng>,
    registry: Registry,
    metrics: RequestMetrics,
    vllm: VllmGauges,
    shutdown: watch::Receiver<bool>,
}

/// Locks a mutex; a panic elsewhere while holding it leaves plain data that is still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// vLLM's `gpu_cache_usage_perc`: the fraction of the KV cache that running requests hold.
    /// Cached prefixes of finished requests do not count: the engine evicts them on demand.
    fn kv_usage(&self) -> f64 {
        let capacity = self.config.prefix_cache_tokens;
        if capacity == 0 {
            return 0.0;
        }
        let held = self.kv_held_tokens.load(Ordering::Relaxed) as f64;
        (held / capacity as f64).min(1.0)
    }

    /// The prefill of `tokens` uncached prompt tokens of a request admitted at `admitted`: at
    /// `prefill_tokens_per_second` from admission, or, with `prefill_shared`, after the prefill
    /// work scheduled before it (one engine's prefill throughput, shared as chunked prefill
    /// shares it). A request that leaves before its turn is done gives the rest back to the
    /// turns after it ([`PrefillSchedule`]).
    fn prefill_turn(self: &Arc<Self>, admitted: Instant, tokens: usize) -> PrefillTurn {
        let work = cost::prefill_time(tokens, self.config.prefill_tokens_per_second);
        if !self.config.prefill_shared || work.is_zero() {
            return PrefillTurn {
                shared: None,
                id: 0,
                done: admitted + work,
            };
        }
        let (id, done) = lock(&self.prefill).schedule(admitted, work);
        PrefillTurn {
            shared: Some(self.clone()),
            id,
            done,
        }
    }

    fn running(&self) -> usize {
        (self.config.max_concurrency - self.slots.available_permits())
            .saturating_sub(self.kv_waiting.load(Ordering::Relaxed))
    }

    /// Reserves `tokens` of the KV cache (`prefix_cache_tokens`) for a request about to run,
    /// waiting while they do not fit, as vLLM schedules a waiting request only when its blocks
    /// fit. A request alone may exceed the cache (it would run on vLLM too, chunk by chunk);
    /// the tokens it generates later are not reserved ahead.
    async fn kv_admit(self: &Arc<Self>, tokens: usize) -> KvHold {
        let capacity = self.config.prefix_cache_tokens as u64;
        let need = tokens as u64;
        // Counted as waiting, not running, until it has its room (or its wait is cancelled).
        self.kv_waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = KvWait(&self.kv_waiting);
        // First come, first served: the head of the line waits for its room and the requests
        // behind it wait for the head (vLLM's scheduler stops at a request that does not fit),
        // so a long prompt is not overtaken forever by short ones.
        let _turn = self.kv_line.lock().await;
        loop {
            let freed = self.kv_freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            let mut held = self.kv_held_tokens.load(Ordering::Relaxed);
            loop {
                if capacity != 0 && held != 0 && held.saturating_add(need) > capacity {
                    break;
                }
                match self.kv_held_tokens.compare_exchange_weak(
                    held,
                    held + need,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        return KvHold {
                            shared: self.clone(),
                            tokens: need,
                        }
                    }
                    Err(now) => held = now,
                }
            }
            freed.await;
        }
    }

    fn count(&self, route: &str, status: StatusCode) {
        self.metrics
            .requests
            .get_or_create(&RequestLabels {
                route: route.to_owned(),
                backend: "self".to_owned(),
                status: status.as_u16(),
            })
            .inc();
    }

    fn metrics_text(&self) -> String {
        let running = i64::try_from(self.running()).unwrap_or(i64::MAX);
        let waiting =
            self.waiting.load(Ordering::Relaxed) + self.kv_waiting.load(Ordering::Relaxed);
        let waiting = i64::try_from(waiting).unwrap_or(i64::MAX);
        let v = &self.vllm;
        v.running.get_or_create(&v.labels).set(running);
        v.waiting.get_or_create(&v.labels).set(waiting);
        v.cache_usage.get_or_create(&v.labels).set(self.kv_usage());
        let mut out = render(&self.registry);
        // Both renders end with the OpenMetrics `# EOF` line; keep only the last one.
        if let Some(stripped) = out.strip_suffix("# EOF\n") {
            out.truncate(stripped.len());
        }
        out.push_str(&render(&v.registry));
        out
    }

    /// A free slot now, a place in the queue, or `None` when the queue is full.
    fn admit(self: &Arc<Self>) -> Option<Admission> {
        // tokio's semaphore hands released permits to queued waiters first, but a queued
        // stream joins its wait list only once its task first polls; a slot freed before
        // that went to whoever asked next. So a slot is taken at once only while nobody is
        // queued: admission stays FIFO.
        if self.waiting.load(Ordering::Relaxed) == 0 {
            if let Ok(permit) = self.slots.clone().try_acquire_owned() {
                return Some(Admission::Ready(permit));
            }
        }
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= self.config.max_queue {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Admission::Queued(QueueTicket(self.clone())))
    }
}

/// A request's place in the prefill schedule (see [`Shared::prefill_turn`]).
struct PrefillTurn {
    /// Set while the turn holds a place in the shared schedule.
    shared: Option<Arc<Shared>>,
    id: u64,
    done: Instant,
}

impl PrefillTurn {
    /// Waits until the prefill is done (the turn is then used up) and `then` more. In the
    /// shared schedule the end moves earlier when a request before this one leaves.
    async fn wait(mut self, then: Duration) {
        if let Some(shared) = self.shared.clone() {
            // Subscribed before the first read: a move after it wakes the wait.
            let mut moved = shared.prefill_moved.subscribe();
            loop {
                if let Some(done) = lock(&shared.prefill).done(self.id) {
                    self.done = done;
                }
                tokio::select! {
                    () = wait_until(self.done) => break,
                    changed = moved.changed() => {
                        if changed.is_err() {
                            wait_until(self.done).await;
                            break;
                        }
                    }
                }
            }
            lock(&shared.prefill).leave(self.id, Instant::now());
            self.shared = None;
        } else {
            wait_until(self.done).await;
        }
        wait_until(self.done + then).await;
    }
}

impl Drop for PrefillTurn {
    fn drop(&mut self) {
        let Some(shared) = self.shared.take() else {
            return;
        };
        let moved = lock(&shared.prefill).leave(self.id, Instant::now());
        if moved {
            shared.prefill_moved.send_replace(());
        }
    }
}

enum Admission {
    Ready(OwnedSemaphorePermit),
    Queued(QueueTicket),
}

/// A place in the queue; leaving (admitted or gone) decrements the waiting count.
struct QueueTicket(Arc<Shared>);

impl Drop for QueueTicket {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Admission {
    async fn slot(self) -> Option<OwnedSemaphorePermit> {
        match self {
            Self::Ready(p) => Some(p),
            // The semaphore is never closed, so this only fails if that invariant breaks.
            Self::Queued(ticket) => ticket.0.slots.clone().acquire_owned().await.ok(),
        }
    }
}

/// Serves the simulator on `listener` until `shutdown` resolves, then lets open responses
/// finish for up to a few seconds and returns.
pub async fn serve(
    config: SimConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), SimError> {
    config.validate()?;
    let mut registry = new_registry();
    let metrics = RequestMetrics::register(&mut registry);
    let (stop_tx, stop_rx) = watch::channel(false);
    let shared = Arc::new(Shared {
        faults: Mutex::new(config.faults.clone()),
        slots: Arc::new(Semaphore::new(config.max_concurrency)),
        waiting: AtomicUsize::new(0),
        kv_held_tokens: AtomicU64::new(0),
        prefill: Mutex::new(PrefillSchedule::default()),
        prefill_moved: watch::Sender::new(()),
        kv_freed: tokio::sync::Notify::new(),
        kv_waiting: AtomicUsize::new(0),
        kv_line: tokio::sync::Mutex::new(()),
        cache: Mutex::new(PrefixCache::new(
            config.prefix_cache_tokens,
            config.block_tokens,
        )),
        rng: Mutex::new(SmallRng::seed_from_u64(config.seed)),
        registry,
        metrics,
        vllm: VllmGauges::new(&config.model_names[0]),
        shutdown: stop_rx,
        config,
    });

    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Usually EMFILE or a connection reset before accept; back off briefly.
                        tracing::warn!(error = %e, "sim: accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let refusing = lock(&shared.faults).refuse_connections;
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let builder = builder.clone();
                let watcher = graceful.watcher();
                connections.spawn(async move {
                    if refusing && !is_admin_request(&stream).await {
                        // SO_LINGER 0 makes close() send RST instead of FIN.
                        let _ = stream.set_zero_linger();
                        return;
                    }
                    let service = service_fn(move |req| handle(shared.clone(), req));
                    let conn = builder.serve_connection(TokioIo::new(stream), service);
                    if let Err(e) = watcher.watch(conn).await {
                        tracing::debug!(%peer, error = %e, "sim: connection ended with an error");
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::debug!("sim: open connections did not finish in time; dropping them");
    }
    connections.shutdown().await;
    Ok(())
}

/// Whether a connection accepted while refusing connections carries a request to
/// `/admin/faults` (looked at without reading it, for up to a second): the fault must stay
/// switchable off, so that one route is served; every other connection is reset.
async fn is_admin_request(stream: &tokio::net::TcpStream) -> bool {
    const ADMIN: [&[u8]; 2] = [b"GET /admin/faults", b"POST /admin/faults"];
    let mut head = [0u8; 18];
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut head)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return false,
        };
        let seen = &head[..n];
        if ADMIN
            .iter()
            .any(|a| seen.len() >= a.len() && seen.starts_with(a))
        {
            return true;
        }
        if !ADMIN.iter().any(|a| a.starts_with(seen)) {
            return false;
        }
        // A prefix of an admin request so far: wait for more bytes.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn json_response(status: StatusCode, body: Bytes) -> Response<SimBody> {
    let mut resp = Response::new(SimBody::full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn text_response(
    status: StatusCode,
    content_type: &'static str,
    body: String,
) -> Response<SimBody> {
    let mut resp = Response::new(SimBody::full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    resp
}

/// Waits for `deadline` unless it has passed. A timer always waits for the runtime's next
/// millisecond tick, so a zero-cost setting (`base_latency_ms = 0`, `time_per_output_token_ms =
/// 0`) would otherwise still cost up to a millisecond per step, and the benches that use such a
/// sim would measure the timer instead of the network path.
///
/// A deadline already past still spends one unit of the task's cooperative budget: a zero-cost
/// decode of two million tokens has no other await, and without it held its worker thread for
/// about a second while every other connection on that thread waited.
async fn wait_until(deadline: Instant) {
    if deadline > Instant::now() {
        sleep_until(deadline).await;
    } else {
        tokio::task::coop::consume_budget().await;
    }
}

fn error_response(err: &ApiError) -> Response<SimBody> {
    json_response(err.status, err.body())
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, Infallible> {
    if shared.config.network_rtt_ms > 0.0 {
        tokio::time::sleep(cost::ms(shared.config.network_rtt_ms)).await;
    }
    let route: &'static str = match req.uri().path() {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/embeddings" => "/v1/embeddings",
        "/tokenize" => "/tokenize",
        "/v1/models" => "/v1/models",
        "/health" => "/health",
        "/metrics" => "/metrics",
        "/admin/faults" => "/admin/faults",
        _ => "other",
    };
    // HEAD is GET without a body (hyper leaves the body out), as Starlette serves it.
    let method = if req.method() == Method::HEAD {
        Method::GET
    } else {
        req.method().clone()
    };
    let resp = match (&method, route) {
        (&Method::POST, "/v1/chat/completions") => completion(&shared, Api::Chat, req).await,
        (&Method::POST, "/v1/completions") => completion(&shared, Api::Completions, req).await,
        (&Method::POST, "/v1/embeddings") => embeddings(&shared, req).await,
        (&Method::POST, "/tokenize") => tokenize(&shared, req).await,
        (&Method::GET, "/v1/models") => models(&shared),
        (&Method::GET, "/health") if lock(&shared.faults).unhealthy => text_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "engine unhealthy (injected fault)".into(),
        ),
        (&Method::GET, "/health") => text_response(StatusCode::OK, "text/plain", "ok".into()),
        (&Method::GET, "/metrics") => {
            text_response(StatusCode::OK, CONTENT_TYPE, shared.metrics_text())
        }
        (&Method::GET, "/admin/faults") => faults_response(&lock(&shared.faults)),
        (&Method::POST, "/admin/faults") => set_faults(&shared, req).await,
        // A known path asked with another method: 405 with the methods it takes, as vLLM's
        // FastAPI answers, not "unknown route".
        (_, known) if known != "other" => {
            let allow = match known {
                "/admin/faults" => "GET, HEAD, POST",
                "/v1/models" | "/health" | "/metrics" => "GET, HEAD",
                _ => "POST",
            };
            let mut resp = error_response(
                &ApiError::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "invalid_request_error",
                    format!("Method Not Allowed: {} {known} takes {allow}", req.method()),
                )
                .with_code("method_not_allowed"),
            );
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allow));
            resp
        }
        (method, _) => error_response(
            &ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("Unknown route: {method} {}", req.uri().path()),
            )
            .with_code("not_found"),
        ),
    };
    shared.count(route, resp.status());
    Ok(resp)
}

fn models(shared: &Shared) -> Response<SimBody> {
    let created = unix_now();
    let data: Vec<_> = shared
        .config
        .model_names
        .iter()
        .map(|id| {
            serde_json::json!({"id": id, "object": "model", "created": created,
                "owned_by": "tokenway-sim", "root": id, "parent": null,
                "max_model_len": shared.config.max_model_len})
        })
        .collect();
    let body = serde_json::json!({"object": "list", "data": data});
    json_response(StatusCode::OK, Bytes::from(body.to_string()))
}

fn faults_response(faults: &Faults) -> Response<SimBody> {
    let body = serde_json::to_vec(faults).expect("serializing plain structs cannot fail");
    json_response(StatusCode::OK, Bytes::from(body))
}

/// Most of a refused body read and dropped so that its 413 reaches the client ([`drain`]).
const DRAIN_BYTES: usize = 64 << 20;
/// Longest the drain of a refused body takes.
const DRAIN_TIME: Duration = Duration::from_secs(10);

async fn read_body(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("Request body exceeds {MAX_BODY_BYTES} bytes."),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // A client that asked before sending gets its answer without being invited to send.
    let asked = req
        .headers()
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let mut body = req.into_body();
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        if !asked {
            drain(&mut body).await;
        }
        return Err(too_large());
    }
    // Room for a declared length up to 1 MiB at once; past that it grows with what arrives (a
    // head alone reserves no more).
    let mut got = bytes::BytesMut::with_capacity(declared.unwrap_or(0).min(1 << 20) as usize);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            ApiError::invalid_request(format!("Could not read the request body: {e}"))
        })?;
        if let Ok(data) = frame.into_data() {
            if got.len() + data.len() > MAX_BODY_BYTES {
                drain(&mut body).await;
                return Err(too_large());
            }
            got.extend_from_slice(&data);
        }
    }
    Ok(got.freeze())
}

/// Reads and drops the rest of a body refused as too large, up to [`DRAIN_BYTES`] within
/// [`DRAIN_TIME`]: a client that writes its whole body before reading (the `openai` package
/// sends no `Expect`) otherwise finds the connection reset, its 413 lost, when the server
/// closes with its bytes unread.
async fn drain(body: &mut Incoming) {
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        let mut seen = 0;
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, Bytes::len);
            if seen > DRAIN_BYTES {
                break;
            }
        }
    })
    .await;
}

async fn set_faults(shared: &Shared, req: Request<Incoming>) -> Response<SimBody> {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    // serde would also read the struct from a JSON array (`[]` clearing every fault).
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return error_response(&ApiError::invalid_request(
            "invalid faults JSON: expected a JSON object".to_string(),
        ));
    }
    let faults: Faults = match serde_json::from_slice(&body) {
        Ok(f) => f,
        Err(e) => {
            return error_response(&ApiError::invalid_request(format!(
                "invalid faults JSON: {e}"
            )))
        }
    };
    if let Err(e) = faults.validate() {
        return error_response(&ApiError::invalid_request(e.to_string()));
    }
    tracing::info!(?faults, "sim: faults replaced");
    let resp = faults_response(&faults);
    *lock(&shared.faults) = faults;
    resp
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn completion(shared: &Arc<Shared>, api: Api, req: Request<Incoming>) -> Response<SimBody> {
    let start = Instant::now();
    let transport = match req.version() {
        Version::HTTP_2 => "h2",
        _ => "h1",
    };
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let mut job = match Job::parse(api, &body, shared.config.bytes_per_token) {
        Ok(j) => j,
        Err(e) => return error_response(&e),
    };
    // The raw body is not needed any more: a queued or hung request holds only its prompts.
    drop(body);
    let c = &shared.config;
    let model = job.model.get_or_insert_with(|| c.model_names[0].clone());
    if let Some(resp) = unknown_model(shared, model) {
        return resp;
    }
    if let Err(e) = job.check_context(c.max_model_len, c.default_max_tokens, c.bytes_per_token) {
        return error_response(&e);
    }
    let (faults, admission) = match gate(shared).await {
        Ok(g) => g,
        Err(resp) => return resp,
    };
    let gen = Generator {
        shared: shared.clone(),
        encoder: Encoder::new(&job, unix_now()),
        job,
        faults,
        start,
        labels: StreamLabels {
            route: api.route().to_owned(),
            backend: "self".to_owned(),
            transport: transport.to_owned(),
            client_region: "local".to_owned(),
            backend_region: "local".to_owned(),
        },
    };
    if gen.job.stream {
        let (tx, body) = stream_channel();
        tokio::spawn(gen.stream(admission, tx));
        let mut resp = Response::new(body);
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("text/event-stream"),
        );
        h.insert(
            header::CACHE_CONTROL,
            header::HeaderValue::from_static("no-cache"),
        );
        resp
    } else {
        gen.full(admission).await
    }
}

/// vLLM's `POST /tokenize`: the prompt (`prompt`, or chat `messages`) as the sim counts it,
/// `{"count", "max_model_len", "tokens"}`; a token id is a hash of its bytes.
async fn tokenize(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<SimBody> {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let c = &shared.config;
    // A tokenize request is a chat or completion request's input part.
    let job = match Job::parse(Api::Chat, &body, c.bytes_per_token)
        .or_else(|_| Job::parse(Api::Completions, &body, c.bytes_per_token))
    {
        Ok(j) => j,
        Err(e) => return error_response(&e),
    };
    // A prompt longer than the model takes is refused as completions refuse it, before its
    // token list is built (a 32 MiB prompt is 8 M of them).
    if let Err(e) = job.check_context(c.max_model_len, 1, c.bytes_per_token) {
        return error_response(&e);
    }
    let tokens: Vec<u64> = job
        .prompts
        .iter()
        .flat_map(|p| p.chunks(c.bytes_per_token))
        .map(|t| {
            use std::hash::{Hash, Hasher};
            let mut h = std::hash::DefaultHasher::new();
            t.hash(&mut h);
            h.finish() % 100_000
        })
        .collect();
    // Serialized from the list itself: a `serde_json::Value` array costs 32 bytes a token.
    #[derive(serde::Serialize)]
    struct Tokenized<'a> {
        count: usize,
        max_model_len: u32,
        tokens: &'a [u64],
    }
    let answer = serde_json::to_vec(&Tokenized {
        count: tokens.len(),
        max_model_len: c.max_model_len,
        tokens: &tokens,
    })
    .expect("invariant: numbers serialize");
    json_response(StatusCode::OK, Bytes::from(answer))
}

/// The `error_after_tokens` fault's error.
fn engine_failure() -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "Injected fault: the engine failed while generating.".into(),
    )
}

/// `POST /v1/embeddings`: a prefill-only request. It takes a slot like a completion, waits
/// `base_latency_ms` plus its tokens at the prefill rate (embedding models cache no prefixes),
/// holds their KV meanwhile, and answers the vectors whole.
async fn embeddings(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<SimBody> {
    let start = Instant::now();
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let c = &shared.config;
    let mut job = match EmbedJob::parse(&body, c.bytes_per_token, c.embedding_dimensions) {
        Ok(j) => j,
        Err(e) => return error_response(&e),
    };
    drop(body);
    let model = job.model.get_or_insert_with(|| c.model_names[0].clone());
    if let Some(resp) = unknown_model(shared, model) {
        return resp;
    }
    if let Err(e) = job.check_context(c.max_model_len, c.bytes_per_token) {
        return error_response(&e);
    }
    let (faults, admission) = match gate(shared).await {
        Ok(g) => g,
        Err(resp) => return resp,
    };
    // If the client goes away, hyper drops this future and with it the slot.
    let Some(_permit) = admission.slot().await else {
        return error_response(&ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "The server is shutting down.".into(),
        ));
    };
    let tokens: usize = job
        .inputs
        .iter()
        .map(|i| cost::prompt_tokens(i.len(), c.bytes_per_token))
        .sum();
    let _kv = shared.kv_admit(tokens).await;
    shared.vllm.add(&shared.vllm.prompt_tokens, tokens as u64);
    let then = cost::ms(c.base_latency_ms) + cost::ms(faults.slow_start_ms);
    shared.prefill_turn(Instant::now(), tokens).wait(then).await;
    let resp = json_response(
        StatusCode::OK,
        job.answer(c.seed, c.embedding_dimensions, tokens, unix_now()),
    );
    let labels = StreamLabels {
        route: "/v1/embeddings".to_owned(),
        backend: "self".to_owned(),
        transport: "h1".to_owned(),
        client_region: "local".to_owned(),
        backend_region: "local".to_owned(),
    };
    observe(&shared.metrics.duration, &labels, start.elapsed());
    resp
}

/// The 404 of a model the sim does not serve (checked first, as vLLM does, before the
/// request's other fields).
fn unknown_model(shared: &Shared, model: &str) -> Option<Response<SimBody>> {
    // Ollama's rule too: a name without a tag is the served `name:latest`.
    let served = |m: &String| {
        m == model || m.strip_suffix(":latest") == Some(model).filter(|m| !m.contains(':'))
    };
    (!shared.config.model_names.iter().any(served)).then(|| {
        error_response(
            &ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("The model `{model}` does not exist."),
            )
            .with_param("model")
            .with_code("model_not_found"),
        )
    })
}

/// What every model request passes before it may run: the injected faults (hang, error rate)
/// let it through, and the queue has room. The answer is the request's faults and its
/// admission, or the response that ends it.
async fn gate(shared: &Arc<Shared>) -> Result<(Faults, Admission), Response<SimBody>> {
    let faults = lock(&shared.faults).clone();
    if faults.hang {
        // Never answer; end only when the server shuts down.
        let mut stop = shared.shutdown.clone();
        let _ = stop.wait_for(|s| *s).await;
        return Err(error_response(&ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "The server is shutting down.".into(),
        )));
    }
    if faults.error_rate > 0.0 && lock(&shared.rng).random::<f64>() < faults.error_rate {
        return Err(error_response(&ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "Injected fault: internal server error.".into(),
        )));
    }
    let Some(admission) = shared.admit() else {
        return Err(error_response(
            &ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "requests",
                format!(
                    "Too many requests: {} running and {} waiting.",
                    shared.config.max_concurrency, shared.config.max_queue
                ),
            )
            .with_code("rate_limit_exceeded"),
        ));
    };
    Ok((faults, admission))
}

/// Records `d` in the histogram of `labels` (generic over the family's constructor type).
fn observe<C: MetricConstructor<Histogram>>(
    family: &Family<StreamLabels, Histogram, C>,
    labels: &StreamLabels,
    d: Duration,
) {
    family.get_or_create(labels).observe(d.as_secs_f64());
}

/// Produces the tokens of one admitted request on the cost model's schedule.
struct Generator {
    shared: Arc<Shared>,
    job: Job,
    encoder: Encoder,
    faults: Faults,
    start: Instant,
    labels: StreamLabels,
}

/// Timing of one request once it holds a slot.
struct Plan {
    prompt_tokens: usize,
    cached_tokens: usize,
    /// The choices: `n` for each prompt, prompt-major.
    choices: Vec<Choice>,
}

impl Plan {
    fn usage(&self) -> Usage {
        let generated = self.choices.iter().map(|c| c.generated()).sum();
        Usage::new(self.prompt_tokens, self.cached_tokens, generated)
    }
}

impl Generator {
    /// Waits for the prefill deadline (measured from admission) and records the prompts' blocks
    /// in the prefix cache. The prompts of a batch are prefilled together: their uncached tokens
    /// add up.
    async fn prefill(&self) -> Plan {
        let admitted = Instant::now();
        let c = &self.shared.config;
        let (mut prompt_tokens, mut cached_tokens) = (0, 0);
        let mut blocks = Vec::with_capacity(self.job.prompts.len());
        let mut choices = Vec::with_capacity(self.job.choices() as usize);
        let ending = Ending {
            seed: c.seed,
            max_tokens: self.job.output_limit().unwrap_or_else(|| {
                // What the context leaves after the longest prompt (check_context: at least 1).
                let left = u64::from(c.max_model_len)
                    .saturating_sub(self.job.longest_prompt(c.bytes_per_token));
                c.default_max_tokens
                    .min(u32::try_from(left).unwrap_or(u32::MAX))
            }),
            // A limit the request set, or the context's (vLLM ends both with `length`).
            limit_requested: self.job.max_tokens.is_some()
                || u64::from(c.default_max_tokens)
                    > u64::from(c.max_model_len)
                        .saturating_sub(self.job.longest_prompt(c.bytes_per_token)),
            eos_mean_tokens: c.eos_mean_tokens,
            ignore_eos: self.job.ignore_eos,
            min_tokens: self.job.min_tokens,
        };
        for prompt in &self.job.prompts {
            let total = cost::prompt_tokens(prompt.len(), c.bytes_per_token);
            let hashes = cost::block_hashes(prompt, c.block_tokens, c.bytes_per_token);
            cached_tokens += lock(&self.shared.cache).cached_tokens(&hashes, total);
            prompt_tokens += total;
            blocks.push(hashes);
            choices.extend((0..self.job.n).map(|i| Choice::new(&ending, prompt, i)));
        }
        let then = cost::ms(c.base_latency_ms) + cost::ms(self.faults.slow_start_ms);
        self.shared
            .prefill_turn(admitted, prompt_tokens - cached_tokens)
            .wait(then)
            .await;
        // The KV blocks exist once prefill is done: a prompt that arrives meanwhile pays its
        // own prefill of them, as on vLLM, where prefills in flight are not shared (the
        // gateway's router holds such a request instead, docs/routing.md).
        let mut cache = lock(&self.shared.cache);
        for hashes in &blocks {
            cache.insert(hashes);
        }
        drop(cache);
        let v = &self.shared.vllm;
        v.add(&v.prompt_tokens, prompt_tokens as u64);
        v.add(&v.prefix_queries, prompt_tokens as u64);
        v.add(&v.prefix_hits, cached_tokens as u64);
        Plan {
            prompt_tokens,
            cached_tokens,
            choices,
        }
    }

    /// Tokens of all the request's prompts.
    fn prompt_tokens(&self) -> usize {
        let c = &self.shared.config;
        self.job
            .prompts
            .iter()
            .map(|p| cost::prompt_tokens(p.len(), c.bytes_per_token))
            .sum()
    }

    /// The deadline of the token after one produced at `prev`.
    fn next_deadline(&self, prev: Instant) -> Instant {
        let c = &self.shared.config;
        prev + cost::decode_interval(
            cost::ms(c.time_per_output_token_ms),
            c.batch_penalty,
            self.shared.running().max(1),
        )
    }

    /// One step's tokens (one per choice) are out at `now`.
    fn observe_token(&self, index: u32, now: Instant, last: Instant, choices: usize) {
        let v = &self.shared.vllm;
        v.add(&v.generation_tokens, choices as u64);
        let m = &self.shared.metrics;
        if index == 0 {
            observe(&m.ttft, &self.labels, now - self.start);
        } else {
            observe(&m.inter_token, &self.labels, now - last);
        }
    }

    fn observe_end(&self) {
        observe(
            &self.shared.metrics.duration,
            &self.labels,
            self.start.elapsed(),
        );
    }

    async fn stream(mut self, admission: Admission, tx: StreamTx) {
        let permit = tokio::select! {
            p = admission.slot() => p,
            () = tx.closed() => None,
        };
        let Some(permit) = permit else { return };
        let mut kv = tokio::select! {
            kv = self.shared.kv_admit(self.prompt_tokens()) => kv,
            () = tx.closed() => return,
        };
        let mut plan = tokio::select! {
            p = self.prefill() => p,
            () = tx.closed() => return,
        };
        let mut deadline = Instant::now();
        let mut last = deadline;
        for i in 0.. {
            if i > 0 {
                deadline = self.next_deadline(deadline);
                // A client that leaves between tokens frees its slot then, not at the next
                // send (a decode interval can be long under a large batch penalty).
                tokio::select! {
                    () = wait_until(deadline) => {}
                    () = tx.closed() => return,
                }
            }
            if self.faults.stall_after_tokens == Some(i) {
                // Keep the connection (and the slot) until the client leaves or we shut down.
                let mut stop = self.shared.shutdown.clone();
                tokio::select! {
                    () = tx.closed() => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
                return;
            }
            if self.faults.error_after_tokens == Some(i) {
                // vLLM's in-stream error: an error event, then the stream's usual end.
                let event = openai::error_event(&engine_failure());
                for e in [event, Bytes::from_static(openai::DONE)] {
                    if !tx.send(e).await {
                        return;
                    }
                }
                return;
            }
            let mut produced = 0;
            for (index, choice) in (0..).zip(plan.choices.iter_mut()) {
                if i == 0 {
                    if let Some(role) = self.encoder.role(index) {
                        if !tx.send(role).await {
                            return;
                        }
                    }
                }
                let Some(text) = choice.next(&self.job.stop) else {
                    continue;
                };
                produced += 1;
                kv.grow();
                if !text.is_empty() && !tx.send(self.encoder.token(index, &text)).await {
                    return;
                }
                // A choice's end goes out as it ends (each choice of `n` has its own).
                if let Some(finish) = choice.finish() {
                    if !tx.send(self.encoder.finish(index, finish)).await {
                        return;
                    }
                }
            }
            let now = Instant::now();
            self.observe_token(i, now, last, produced);
            last = now;
            if plan.choices.iter().all(|c| c.finish().is_some()) {
                break;
            }
        }
        drop(kv);
        drop(permit);
        let mut tail = Vec::with_capacity(2);
        if self.job.include_usage {
            tail.push(self.encoder.usage(&plan.usage()));
        }
        tail.push(Bytes::from_static(openai::DONE));
        for event in tail {
            if !tx.send(event).await {
                return;
            }
        }
        self.observe_end();
    }

    async fn full(self, admission: Admission) -> Response<SimBody> {
        // If the client goes away, hyper drops this future and with it the slot.
        let Some(permit) = admission.slot().await else {
            return error_response(&ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "The server is shutting down.".into(),
            ));
        };
        let mut kv = self.shared.kv_admit(self.prompt_tokens()).await;
        let mut plan = self.prefill().await;
        let mut texts = vec![String::new(); plan.choices.len()];
        let mut deadline = Instant::now();
        let mut last = deadline;
        for i in 0.. {
            if i > 0 {
                deadline = self.next_deadline(deadline);
                wait_until(deadline).await;
            }
            if self.faults.error_after_tokens == Some(i) {
                return error_response(&engine_failure());
            }
            if self.faults.stall_after_tokens == Some(i) {
                let mut stop = self.shared.shutdown.clone();
                let _ = stop.wait_for(|s| *s).await;
                return error_response(&ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "The server is shutting down.".into(),
                ));
            }
            let mut produced = 0;
            for (text, choice) in texts.iter_mut().zip(plan.choices.iter_mut()) {
                let Some(token) = choice.next(&self.job.stop) else {
                    continue;
                };
                produced += 1;
                kv.grow();
                text.push_str(&token);
            }
            let now = Instant::now();
            self.observe_token(i, now, last, produced);
            last = now;
            if plan.choices.iter().all(|c| c.finish().is_some()) {
                break;
            }
        }
        drop(kv);
        drop(permit);
        let answers: Vec<_> = texts
            .into_iter()
            .zip(&plan.choices)
            .map(|(text, c)| {
                let finish = c.finish().cloned().unwrap_or(Finish {
                    reason: "length",
                    stop: None,
                });
                (text, finish)
            })
            .collect();
        let resp = json_response(StatusCode::OK, self.encoder.full(&answers, &plan.usage()));
        self.observe_end();
        resp
    }
}
