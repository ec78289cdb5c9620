//! The proxy core: send one client request to the ranked backends until one answers.
//!
//! Until the first byte has gone to the client every failure is retried on the next ranked
//! backend: connect errors, resets, 5xx answers, and silence past the first-byte timeout. The
//! gateway therefore holds the response head back until the backend's first body frame arrives
//! (for a stream that is its first token event, which is when a client can use it anyway).
//! The request body was read whole to route it, so a retry resends the same bytes.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use tokenway_router::{BackendId, HedgeWinner, Outcome, Route, RouteRequest};
use tokenway_wire::sse::{ErrorEventStyle, StreamErrorCause};

use crate::error::{ApiError, ResponseBody};
use crate::relay::RelayBody;
use crate::state::{Attempt, Reservation, Shared, Upstream};
use crate::upstream_h1::{encode_head, H1Body, H1Error, ResponseHead};
use tokenway_telemetry::stream_clock::{StreamClock, StreamHistograms};
use tokenway_telemetry::{Counter, Histogram};

/// Header naming the backend that served a response.
pub const BACKEND_HEADER: &str = "x-tokenway-backend";

/// What the proxy needs to know about one client request.
pub struct ProxyRequest<'a> {
    /// The client's request head.
    pub parts: &'a Parts,
    /// The client's body, forwarded unchanged.
    pub body: Bytes,
    /// Route label.
    pub route: &'static str,
    /// Transport label.
    pub transport: &'static str,
    /// When the request arrived.
    pub start: Instant,
    /// What the router knows of it.
    pub request: Arc<RouteRequest>,
}

/// Why an attempt failed before its first byte.
enum Failure {
    Connect(String),
    /// No connection within the connect timeout: a busy backend's full accept queue looks the
    /// same as a dead one's, so this ejects only as 5xx and timeouts do (three in a row), and
    /// its prefix index is kept (a refused connection ejects at once and forgets it).
    ConnectTimeout(String),
    /// This gateway could not open a connection (no health effect on the backend).
    Local(String),
    Reset(String),
    Status(StatusCode),
    /// A 200 event stream that opened with the backend's own error event.
    ErrorEvent,
    /// The request was not sent (connected and written) in time: the backend has not started
    /// on it.
    SendTimeout,
    /// No answer in time after the request was sent.
    Timeout,
    /// The same on a backend that was ejected while this attempt waited (for what other
    /// requests saw: a hung engine) or was on trial: the next backend may do better.
    TimeoutEjected,
}

/// How one attempt before the first byte ended.
enum Tried {
    /// The backend answered: its head and first frame, ready to relay.
    Answered(Box<Answer>),
    /// It failed; the next backend may be tried.
    Failed { backend: String, failure: Failure },
}

/// Sends `req` to one backend and waits for its first body frame. A 5xx, 429 (busy) or 404
/// (no such model: the backend may have restarted with another one) answer is tried on the
/// next backend, unless none of the `later` candidates has a free slot now: then this answer,
/// with its body and `Retry-After`, goes to the client. `held` is the backend's slot, reserved
/// for this attempt.
async fn try_backend(
    shared: &Arc<Shared>,
    id: BackendId,
    held: Reservation,
    req: &ProxyRequest<'_>,
    routed: &Route,
    later: &[BackendId],
) -> Tried {
    let upstream = shared.upstream(id);
    let sent_at = Instant::now();
    let timeouts = &shared.config.timeouts;
    let wait = if req.request.whole_answer {
        timeouts.whole_answer()
    } else {
        timeouts.first_byte()
    };
    let deadline = tokio::time::Instant::now() + wait;
    let head = encode_head(
        &upstream.host,
        &upstream.path_prefix,
        req.parts,
        upstream_headers(&upstream, req.parts),
        req.body.len(),
    );
    let fail = |mut attempt: Attempt, failure: Failure| {
        attempt.finish(failure.outcome());
        tracing::info!(backend = %upstream.name, reason = %failure.describe(), "attempt failed before the first byte");
        Tried::Failed {
            backend: upstream.name.clone(),
            failure,
        }
    };
    let send = shared
        .h1
        .send(&upstream.authority, req.parts, &head, &req.body);
    let written = tokio::time::timeout_at(deadline, send).await;
    // The request is on its way: what does not depend on the answer is done while the backend
    // works on it (the router's count of the attempt, the metric handles, most of
    // `server-timing`), not between the answer's arrival and its first byte to the client.
    let mut attempt = Attempt::start_reserved(held, req.request.clone());
    let sent = match written {
        Err(_) => return fail(attempt, Failure::SendTimeout),
        Ok(Err(H1Error::Connect(e))) => return fail(attempt, Failure::Connect(e)),
        Ok(Err(H1Error::ConnectTimeout(e))) => return fail(attempt, Failure::ConnectTimeout(e)),
        Ok(Err(H1Error::Local(e))) => return fail(attempt, Failure::Local(e)),
        Ok(Err(e)) => return fail(attempt, Failure::Reset(e.to_string())),
        Ok(Ok(sent)) => sent,
    };
    let ready = Ready::new(shared, req, &upstream, id, routed);
    let (head, mut body) = match tokio::time::timeout_at(deadline, sent.response()).await {
        Err(_) => return fail(attempt, timed_out(shared, id)),
        Ok(Err(H1Error::Connect(e))) => return fail(attempt, Failure::Connect(e)),
        Ok(Err(H1Error::ConnectTimeout(e))) => return fail(attempt, Failure::ConnectTimeout(e)),
        Ok(Err(H1Error::Local(e))) => return fail(attempt, Failure::Local(e)),
        Ok(Err(e)) => return fail(attempt, Failure::Reset(e.to_string())),
        Ok(Ok(answer)) => answer,
    };
    let status = head.parts.status;
    let elsewhere = another_may_serve(status) && {
        let router = shared.router();
        later.iter().any(|&c| router.has_room(c))
    };
    if elsewhere {
        if status == StatusCode::NOT_FOUND {
            upstream.models_stale.store(true, Ordering::Relaxed);
        }
        return fail(attempt, Failure::Status(status));
    }
    let opening = first_frame_with_error_line(&mut body, status.is_success() && head.event_stream);
    let first = match tokio::time::timeout_at(deadline, opening).await {
        Err(_) => return fail(attempt, timed_out(shared, id)),
        Ok(Err(e)) => return fail(attempt, Failure::Reset(e.to_string())),
        Ok(Ok(f)) => f,
    };
    let ttfb = sent_at.elapsed();
    // A stream that opens with the backend's own error event (vLLM and SGLang fail a request
    // in prefill so, after their 200) has given the client nothing yet: it is retried like a
    // 500 when another candidate has room. One that opens with an error the backend blames on
    // the request goes to the client as it is.
    let opening_error = if status.is_success() && head.event_stream {
        first
            .as_ref()
            .and_then(Frame::data_ref)
            .and_then(|d| tokenway_wire::sse::find_error_event(d))
    } else {
        None
    };
    let opens_with_error = opening_error == Some(StreamErrorCause::Server);
    if opens_with_error && {
        let router = shared.router();
        later.iter().any(|&c| router.has_room(c))
    } {
        return fail(attempt, Failure::ErrorEvent);
    }
    // An error answer's first bytes are not a first token: they must neither feed the TTFT
    // estimates (a failing backend would look the fastest) nor pass a trial (the last
    // candidate's 5xx below fails it; an error event, whoever's fault, is settled at the end
    // of its relay: a client's is no verdict on a trial).
    if status.is_success() && opening_error.is_none() {
        attempt.first_byte(ttfb);
    }
    if status.is_server_error() {
        // The last candidate's own error answer goes to the client as it is; it still counts
        // against the backend's health.
        attempt.finish(Outcome::ServerError);
    } else if status.is_client_error() {
        // Nor is a client error an answer that passes a trial.
        attempt.finish(Outcome::Rejected);
    }
    Tried::Answered(Box::new(Answer {
        attempt,
        head,
        body,
        first,
        ttfb,
        ready,
    }))
}

/// An answer another backend may do better on: a 5xx, 429 (busy) or 404 (no such model: the
/// backend may have restarted with another one).
fn another_may_serve(status: StatusCode) -> bool {
    status.is_server_error()
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::NOT_FOUND
}

/// Whether `tried` is an answer that [`another_may_serve`] on: in a race, the other leg's
/// answer is awaited before it is taken.
fn error_answer(tried: &Tried) -> bool {
    matches!(tried, Tried::Answered(a) if another_may_serve(a.head.parts.status))
}

/// What [`forward`] answers the client with.
pub struct Forwarded {
    /// The response to send.
    pub response: Response<ResponseBody>,
    /// The backend it came from, for `tokenway_requests_total` (`None`: no backend, or
    /// already `counted`).
    pub backend: Option<String>,
    /// Already counted in `tokenway_requests_total` (a 200 answer, with the counter looked up
    /// while the backend worked).
    pub counted: bool,
}

impl Forwarded {
    /// A response not counted yet, from `backend` if one.
    pub fn uncounted(response: Response<ResponseBody>, backend: Option<String>) -> Self {
        Self {
            response,
            backend,
            counted: false,
        }
    }

    /// Whether a backend (or a peer) answered, rather than the gateway with an error.
    pub fn from_backend(&self) -> bool {
        self.counted || self.backend.is_some()
    }
}

/// Sends `req` to the backends in `routed` order (at most `max_attempts` of them), hedging to
/// the next one when the router says the first token is late, and returns the response to send
/// to the client.
pub async fn forward(
    shared: &Arc<Shared>,
    req: ProxyRequest<'_>,
    routed: Route,
    reservation: Option<Reservation>,
) -> Forwarded {
    let mut reservation = reservation;
    // Every ranked backend is a candidate; `max_attempts` bounds the attempts made, so a
    // backend skipped because it is full does not use one up (cutting the list first ended a
    // request with a 502 while backends further down had room).
    let candidates: Vec<BackendId> = routed.backends.clone();
    let max_attempts = (shared.config.max_attempts as usize).max(1);
    let mut attempts = 0;
    let mut next = 0;
    let mut last_failure = None;
    while next < candidates.len() && attempts < max_attempts {
        let id = candidates[next];
        next += 1;
        // The slot reserved when the request was routed is the first candidate's; a retry
        // takes one of its own, and skips a backend that has filled up since.
        let held = match reservation.take().filter(|r| r.backend() == Some(id)) {
            Some(held) => held,
            None => match Reservation::try_take(shared, id) {
                Some(held) => held,
                None => continue,
            },
        };
        attempts += 1;
        // The candidates still to try after this one, as far as attempts are left for them.
        let later = if attempts < max_attempts {
            &candidates[next..]
        } else {
            &candidates[next..next]
        };
        let primary = try_backend(shared, id, held, &req, &routed, later);
        // A whole answer is not hedged: its wait is the whole generation, not a late first
        // token, and a hedge would run it twice.
        let delay = if !later.is_empty() && !req.request.whole_answer {
            shared
                .router()
                .hedge_delay(id, &req.request, Instant::now())
        } else {
            None
        };
        let tried = match delay {
            None => primary.await,
            // Boxed: the hedging states hold the primary attempt pinned and then a second one,
            // and inline they would make every request's future (allocated and copied whole per
            // request) larger by both, hedged or not.
            Some(delay) => {
                // Only to a backend with a free slot, and within the hedge budget: the slot
                // first, then the budget, so that a hedge that cannot go spends none. A backend
                // that is full, or that the budget keeps from being hedged to, stays a
                // candidate for a retry (`next` moves past it only when the hedge goes).
                let hedge = || {
                    let hedge_id = candidates[next];
                    let held = Reservation::try_take(shared, hedge_id)?;
                    if !shared.router().on_hedge_sent(Instant::now()) {
                        // `held` gives its slot back here.
                        return None;
                    }
                    next += 1;
                    attempts += 1;
                    let later = if attempts < max_attempts {
                        &candidates[next..]
                    } else {
                        &candidates[next..next]
                    };
                    Some((
                        hedge_id,
                        try_backend(shared, hedge_id, held, &req, &routed, later),
                    ))
                };
                Box::pin(hedged(shared, id, primary, delay, hedge, &mut last_failure)).await
            }
        };
        match tried {
            // A whole answer that did not come in `whole_answer_ms` is not tried again: its
            // wait is the generation's length, which the next backend would take as long over
            // (three backends made a client wait half an hour for a 504, each generation
            // thrown away). The 504 says `x-should-retry: false` for the same reason. Unless
            // the backend was ejected meanwhile (`TimeoutEjected`): then it was hung
            // (accepting, never answering), not slow, and the next one may well answer in time.
            Tried::Failed {
                backend,
                failure: Failure::Timeout,
            } if req.request.whole_answer => {
                note_failure(&mut last_failure, backend, Failure::Timeout);
                break;
            }
            Tried::Failed { backend, failure } => note_failure(&mut last_failure, backend, failure),
            Tried::Answered(answer) => {
                let counted = answer.head.parts.status == StatusCode::OK;
                let backend = if counted {
                    answer.ready.ok_counter.inc();
                    None
                } else {
                    Some(answer.attempt.backend_name())
                };
                return Forwarded {
                    response: respond(shared, &req, *answer),
                    backend,
                    counted,
                };
            }
        }
    }
    let error = match last_failure {
        Some((backend, Failure::Timeout | Failure::TimeoutEjected | Failure::SendTimeout)) => {
            ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "upstream_timeout",
            format!("no backend answered in time (last tried: {backend})"),
            )
        }
        // A busy answer set aside for a backend that then filled up, or failed too: the client
        // is told to come back, as the busy backend would have told it, not given a 502.
        Some((backend, f @ Failure::Status(StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE))) => {
            ApiError {
                retry_after: Some(1),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "upstream_error",
                    "backends_busy",
                    format!(
                        "the backends that serve the model are busy (last tried: {backend}: {}); retry shortly",
                        f.describe()
                    ),
                )
            }
        }
        Some((backend, f @ Failure::Status(StatusCode::NOT_FOUND))) => ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "no backend serves the model now (last tried: {backend}: {})",
                f.describe()
            ),
        ),
        Some((backend, f)) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_unavailable",
            format!(
                "no backend could serve the request (last tried: {backend}: {})",
                f.describe()
            ),
        ),
        // No attempt was made: every candidate filled up between the routing and the send.
        None => ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "upstream_error",
                "backends_busy",
                "every backend that serves the model is at its max_inflight; retry shortly",
            )
        },
    };
    Forwarded::uncounted(error.into_response(), None)
}

/// Keeps `failure` as the one the client hears about, unless a backend already answered busy
/// (429 or 503) and this one is not: a busy cluster answers 503 with `Retry-After` even when
/// the attempt after the busy answer failed otherwise.
fn note_failure(last: &mut Option<(String, Failure)>, backend: String, failure: Failure) {
    let busy = |f: &Failure| {
        matches!(
            f,
            Failure::Status(StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE)
        )
    };
    if last.as_ref().is_some_and(|(_, f)| busy(f)) && !busy(&failure) {
        return;
    }
    *last = Some((backend, failure));
}

/// A backend's answer, ready to relay.
struct Answer {
    attempt: Attempt,
    head: ResponseHead,
    body: H1Body,
    first: Option<Frame<Bytes>>,
    ttfb: Duration,
    ready: Ready,
}

/// The parts of the client's response that do not depend on the backend's answer, made while
/// the backend works on the request.
struct Ready {
    /// The stream's time to first token, inter-token gap and duration histograms.
    histograms: [Histogram; 3],
    /// The end of `server-timing` after the gateway's and the backend's times: the expected
    /// time to first token, the backend, and the route's reason.
    timing_tail: String,
    /// `tokenway_requests_total` of a 200 answer from this backend.
    ok_counter: Counter,
    /// The value of [`BACKEND_HEADER`], if the gateway names its backends.
    name_header: Option<HeaderValue>,
}

impl Ready {
    fn new(
        shared: &Shared,
        req: &ProxyRequest<'_>,
        upstream: &Upstream,
        id: BackendId,
        routed: &Route,
    ) -> Self {
        let client_region = req
            .request
            .client_region
            .as_deref()
            .unwrap_or(&shared.config.region);
        let histograms = shared.stream_histograms(id, req.route, req.transport, client_region);
        let mut timing_tail = String::with_capacity(96 + upstream.timing_desc.len());
        timing_tail.push_str(", expected;dur=");
        push_millis(&mut timing_tail, routed.expected_ttft);
        timing_tail.push_str(&upstream.timing_desc);
        timing_tail.push_str(", route;desc=\"");
        if upstream_is_first(routed, id) {
            push_reason(&mut timing_tail, &routed.reason);
        } else {
            timing_tail.push_str("retry");
        }
        timing_tail.push('"');
        Self {
            histograms,
            timing_tail,
            ok_counter: shared.ok_counter(upstream, req.route),
            name_header: upstream.name_header.clone(),
        }
    }
}

/// Awaits the primary attempt to `primary_id`; if it has not answered after `delay`, starts
/// the hedge that `hedge` makes (none when no backend or no budget allows one) and races the
/// two.
async fn hedged<P, H>(
    shared: &Arc<Shared>,
    primary_id: BackendId,
    primary: P,
    delay: Duration,
    hedge: impl FnOnce() -> Option<(BackendId, H)>,
    last_failure: &mut Option<(String, Failure)>,
) -> Tried
where
    P: std::future::Future<Output = Tried>,
    H: std::future::Future<Output = Tried>,
{
    tokio::pin!(primary);
    tokio::select! {
        // The primary first: when its answer and the delay are ready in the same poll, the
        // answer wins and no hedge spends the budget.
        biased;
        t = &mut primary => t,
        _ = tokio::time::sleep(delay) => {
            match hedge() {
                Some((hedge_id, hedge)) => {
                    tracing::debug!(primary = %shared.upstream(primary_id).name, hedge = %shared.upstream(hedge_id).name, "first token late: hedging");
                    race(shared, primary, hedge, primary_id, hedge_id, last_failure).await
                }
                None => primary.await,
            }
        }
    }
}

/// Runs a primary attempt and its hedge side by side: the first to answer wins and the other
/// is cancelled (dropped, which closes its upstream connection and frees its backend slot). If
/// one fails the other is awaited, and so it is when one answers with an error another backend
/// may not give (a 5xx, 429 or 404, which each leg takes as its answer when no later candidate
/// has room, and the other leg holds one): that error goes to the client only if the other leg
/// does no better.
async fn race<P, H>(
    shared: &Arc<Shared>,
    mut primary: std::pin::Pin<&mut P>,
    hedge: H,
    primary_id: BackendId,
    hedge_id: BackendId,
    last_failure: &mut Option<(String, Failure)>,
) -> Tried
where
    P: std::future::Future<Output = Tried>,
    H: std::future::Future<Output = Tried>,
{
    tokio::pin!(hedge);
    let (first, from_primary) = tokio::select! {
        t = &mut primary => (t, true),
        t = &mut hedge => (t, false),
    };
    let outcome = match first {
        answered @ Tried::Answered(_) if !error_answer(&answered) => (answered, from_primary),
        Tried::Failed { backend, failure } => {
            note_failure(last_failure, backend, failure);
            if from_primary {
                (hedge.await, false)
            } else {
                (primary.await, true)
            }
        }
        error => {
            let other = if from_primary {
                hedge.await
            } else {
                primary.await
            };
            match other {
                good @ Tried::Answered(_) if !error_answer(&good) => (good, !from_primary),
                // Both failed: the error answer (with its body and `Retry-After`) is the
                // client's; the other's failure is dropped.
                _ => (error, from_primary),
            }
        }
    };
    if matches!(outcome.0, Tried::Answered(_)) && !error_answer(&outcome.0) {
        let winner = if outcome.1 {
            HedgeWinner::Primary
        } else {
            HedgeWinner::Hedge
        };
        shared
            .router()
            .on_hedge_result(primary_id, hedge_id, winner, Instant::now());
    }
    outcome.0
}

/// Builds the client's response around a relay of the backend's body.
fn respond(shared: &Arc<Shared>, req: &ProxyRequest<'_>, answer: Answer) -> Response<ResponseBody> {
    let Answer {
        attempt,
        head,
        body,
        first,
        ttfb,
        ready,
    } = answer;
    let [ttft, gap, duration] = ready.histograms;
    let mut clock = StreamClock::new(
        StreamHistograms {
            ttft,
            gap,
            duration,
        },
        req.start,
        head.event_stream,
    );
    let parts = head.parts;
    if !parts.status.is_success() {
        clock = clock.error_answer();
    }
    let body = RelayBody::new(
        first,
        body,
        attempt,
        clock,
        shared.config.timeouts.stream_idle(),
    )
    .with_error_style(ErrorEventStyle::for_path(req.route));
    let mut resp = Response::new(BodyExt::boxed(body));
    *resp.status_mut() = parts.status;
    // The backend's headers move over as they are (their values share the response head's
    // bytes); the hop-by-hop ones were left out as the head was parsed.
    *resp.headers_mut() = parts.headers;
    let h = resp.headers_mut();
    if let Some(v) = ready.name_header {
        h.insert(HeaderName::from_static(BACKEND_HEADER), v);
    }
    // server-timing (W3C): time in the gateway before the backend answered, the backend's time
    // to first byte, then what `Ready` prepared (the expected time, the backend, why it was
    // chosen).
    let gateway = req.start.elapsed().saturating_sub(ttfb);
    let mut timing = String::with_capacity(48 + ready.timing_tail.len());
    timing.push_str("gateway;dur=");
    push_millis(&mut timing, gateway);
    timing.push_str(", ttfb;dur=");
    push_millis(&mut timing, ttfb);
    timing.push_str(&ready.timing_tail);
    if let Ok(v) = http::HeaderValue::try_from(timing) {
        h.append(header::HeaderName::from_static("server-timing"), v);
    }
    resp
}

/// The failure of an attempt on `id` that did not answer in time: told before the attempt's
/// own end is reported, so that its own timeout, ejecting the backend, does not count.
fn timed_out(shared: &Shared, id: BackendId) -> Failure {
    if shared.router().backend(id).is_some_and(|b| b.healthy) {
        Failure::Timeout
    } else {
        Failure::TimeoutEjected
    }
}

fn upstream_is_first(routed: &Route, id: BackendId) -> bool {
    routed.backends.first() == Some(&id)
}

impl Failure {
    fn outcome(&self) -> Outcome {
        match self {
            Failure::Connect(_) => Outcome::ConnectError,
            Failure::ConnectTimeout(_) => Outcome::Timeout,
            Failure::Local(_) => Outcome::ClientCancelled,
            Failure::Reset(_) => Outcome::ServerError,
            Failure::Status(s) if s.is_server_error() => Outcome::ServerError,
            // A busy or model-less backend answered; that says nothing about its health.
            Failure::Status(_) => Outcome::Rejected,
            Failure::ErrorEvent => Outcome::ServerError,
            Failure::SendTimeout | Failure::Timeout | Failure::TimeoutEjected => Outcome::Timeout,
        }
    }

    fn describe(&self) -> String {
        match self {
            Failure::Connect(e) | Failure::ConnectTimeout(e) => format!("connect failed: {e}"),
            Failure::Local(e) => e.clone(),
            Failure::Reset(e) => format!("connection failed: {e}"),
            Failure::Status(s) => format!("answered {s}"),
            Failure::ErrorEvent => "its stream opened with an error event".to_string(),
            Failure::SendTimeout => "timed out sending the request".to_string(),
            Failure::Timeout | Failure::TimeoutEjected => {
                "timed out before the first byte".to_string()
            }
        }
    }
}

/// Reads up to the first non-empty data frame (or trailers, or the end of the body).
async fn first_frame(body: &mut H1Body) -> Result<Option<Frame<Bytes>>, H1Error> {
    loop {
        match body.frame().await {
            None => return Ok(None),
            Some(Err(e)) => return Err(e),
            Some(Ok(f)) => {
                if f.data_ref().is_some_and(|d| d.is_empty()) {
                    continue;
                }
                return Ok(Some(f));
            }
        }
    }
}

/// Most bytes read past a stream's first frame to finish the line of an error event it opens
/// with (see [`first_frame_with_error_line`]).
const MAX_OPENING_ERROR_LINE: usize = 64 << 10;

/// Longest silence of a backend in the middle of the error event a stream opens with before
/// what came of it is judged (see [`first_frame_with_error_line`]).
const OPENING_ERROR_LINE_WAIT: Duration = Duration::from_secs(1);

/// The first frame of a body; of an event stream (`event_stream`) that opens with an error
/// event whose line is still arriving (a long message split across reads), joined with the
/// frames that finish that line, up to [`MAX_OPENING_ERROR_LINE`]: whose fault it is (`code`,
/// `type`) may come after the message, and whether another backend is asked depends on it.
async fn first_frame_with_error_line(
    body: &mut H1Body,
    event_stream: bool,
) -> Result<Option<Frame<Bytes>>, H1Error> {
    let Some(first) = first_frame(body).await? else {
        return Ok(None);
    };
    let Some(data) = first
        .data_ref()
        .filter(|d| event_stream && tokenway_wire::sse::error_event_unfinished(d))
    else {
        return Ok(Some(first));
    };
    let mut joined = bytes::BytesMut::from(&data[..]);
    // Until the line ends (only the bytes that arrive are searched), the bound, or a backend
    // silent for `OPENING_ERROR_LINE_WAIT`: then what came is judged as it is.
    while joined.len() < MAX_OPENING_ERROR_LINE {
        match tokio::time::timeout(OPENING_ERROR_LINE_WAIT, body.frame()).await {
            Err(_) | Ok(None) => break,
            Ok(Some(Err(e))) => return Err(e),
            // An H1 body yields data frames only (trailers are consumed with the last chunk).
            Ok(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    joined.extend_from_slice(d);
                    if d.iter().any(|&b| b == b'\n' || b == b'\r') {
                        break;
                    }
                }
            }
        }
    }
    Ok(Some(Frame::data(joined.freeze())))
}

/// Whether a response is a Server-Sent-Events stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}

/// Hop-by-hop headers (RFC 9110 §7.6.1): not passed on.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    crate::h1_head::is_hop_by_hop(name.as_str())
}

/// Appends a duration as milliseconds with three decimals (`12.345`), from integers: the
/// float formatting this replaced cost more than the rest of the response head.
fn push_millis(out: &mut String, d: Duration) {
    let micros = d.as_micros();
    let mut digits = itoa::Buffer::new();
    out.push_str(digits.format(micros / 1000));
    out.push('.');
    // 1000 + the remainder has four digits: the last three are the zero-padded fraction.
    out.push_str(&digits.format(1000 + micros % 1000)[1..]);
}

/// Appends the route reason of the `server-timing` header.
fn push_reason(out: &mut String, reason: &tokenway_router::RouteReason) {
    use std::fmt::Write;
    let _ = write!(out, "{reason}");
}

pub(crate) fn copy_end_to_end_headers(from: &HeaderMap, to: &mut HeaderMap) {
    let named = names_headers(from);
    for (name, value) in from {
        if !(is_hop_by_hop(name) || (named && named_by_connection(from, name))) {
            to.append(name.clone(), value.clone());
        }
    }
}

/// Whether a `connection` header of `headers` names other headers, which are then hop-by-hop
/// for this connection too (RFC 9110 §7.6.1).
fn names_headers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .any(|v| crate::h1_head::names_headers(v.as_bytes()))
}

fn named_by_connection(headers: &HeaderMap, name: &HeaderName) -> bool {
    let values = headers
        .get_all(header::CONNECTION)
        .iter()
        .map(|v| v.as_bytes());
    crate::h1_head::named_by_connection(values, name.as_str())
}

/// The headers sent to `upstream`: the client's end-to-end headers, with the client's credentials
/// replaced by the backend's own (`host` and `content-length` are set by the connection).
fn upstream_headers<'a>(
    upstream: &'a Upstream,
    parts: &'a Parts,
) -> impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)> {
    static AUTHORIZATION: HeaderName = header::AUTHORIZATION;
    let named = names_headers(&parts.headers);
    let forwarded = parts.headers.iter().filter(move |(name, _)| {
        !(is_hop_by_hop(name)
            || (named && named_by_connection(&parts.headers, name))
            || name == &header::HOST
            || name == &header::AUTHORIZATION
            || name == &header::CONTENT_LENGTH
            // The whole body is already here: the backend must not wait for a go-ahead.
            || name == &header::EXPECT
            // The tunnel's rate advertisement (consumed on the QUIC tunnel port; meaningless
            // to a backend from any other front), and the overflow mark between gateways.
            || name.as_str() == tokenway_transport::cc::RX_RATE_HEADER
            || name.as_str() == tokenway_transport::tunnel::OVERFLOW_HEADER
            || name.as_str() == tokenway_transport::tunnel::SUPERSEDES_HEADER)
    });
    let own = upstream
        .authorization
        .as_ref()
        .map(|auth| (&AUTHORIZATION, auth));
    forwarded.chain(own)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_have_three_zero_padded_decimals() {
        let cases = [
            (Duration::ZERO, "0.000"),
            (Duration::from_micros(412), "0.412"),
            (Duration::from_micros(93_100), "93.100"),
            (Duration::from_micros(7_005), "7.005"),
            (Duration::from_nanos(182_000_999), "182.000"),
        ];
        for (d, want) in cases {
            let mut out = String::new();
            push_millis(&mut out, d);
            assert_eq!(out, want, "{d:?}");
        }
    }

    #[test]
    fn a_busy_answer_is_what_the_client_hears_when_every_attempt_failed() {
        let mut last = None;
        note_failure(&mut last, "a".into(), Failure::Timeout);
        note_failure(
            &mut last,
            "b".into(),
            Failure::Status(StatusCode::TOO_MANY_REQUESTS),
        );
        // A connect error after the busy answer does not hide it.
        note_failure(&mut last, "c".into(), Failure::Connect("refused".into()));
        let Some((backend, failure)) = &last else {
            panic!("a failure is kept");
        };
        assert_eq!(backend, "b");
        assert!(matches!(
            failure,
            Failure::Status(StatusCode::TOO_MANY_REQUESTS)
        ));
        // A later busy answer replaces an earlier one.
        note_failure(
            &mut last,
            "d".into(),
            Failure::Status(StatusCode::SERVICE_UNAVAILABLE),
        );
        assert_eq!(last.as_ref().map(|(b, _)| b.as_str()), Some("d"));
    }
}
