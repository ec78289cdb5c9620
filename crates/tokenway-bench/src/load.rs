//! The load generator: streaming chat completions over HTTP/1.1 keep-alive.
//!
//! Every target sees the same request bytes on the same kind of connection (TCP_NODELAY,
//! keep-alive). The closed-loop and sequential scenarios give each worker its own connection
//! ([`LoadConnection`]), so concurrency N means N connections, as with `wrk`; the open-streams
//! scenario and the demo's smoke test use hyper-util's pooled client ([`LoadClient`]), which
//! opens a connection per stream there anyway. Per request it records the time to the
//! first SSE `data:` event (the body is read chunk by chunk and the first chunk that contains
//! `data:` stops the clock), the total time, and success: status 200 and a body that ends with
//! `data: [DONE]`. The generator runs in the bench's own process; on a small machine it competes
//! for CPU with the servers under test, which is why the report also shows CPU use.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokenway_wire::sse::find_error_event;

/// Bytes kept from the end of a body to check for the `data: [DONE]` terminator.
const TAIL_BYTES: usize = 64;

/// The outcome of one request.
#[derive(Clone, Debug)]
pub struct Sample {
    /// From sending the request to the first chunk holding `data:`; `None` if none arrived.
    pub ttft: Option<Duration>,
    /// From sending the request to the end of the body (or the error).
    pub total: Duration,
    /// Gaps between consecutive body chunks that carried `data:` events (inter-token gaps).
    pub gaps: Vec<Duration>,
    /// Why the request failed, if it did.
    pub error: Option<String>,
}

impl Sample {
    /// True for status 200 and a body ending with `data: [DONE]`.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// A pooled HTTP/1.1 client aimed at one target.
#[derive(Clone)]
pub struct LoadClient {
    client: Client<HttpConnector, Full<Bytes>>,
    uri: http::Uri,
}

impl LoadClient {
    /// A client for `http://addr/v1/chat/completions`.
    pub fn new(addr: SocketAddr) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(usize::MAX)
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        Self {
            client,
            uri: chat_uri(addr),
        }
    }

    /// Sends one streaming chat completion asking for `max_tokens` tokens and reads it to the
    /// end. `first_token` is incremented when the first `data:` event arrives.
    pub async fn chat(&self, body: Bytes, first_token: Option<&AtomicUsize>) -> Sample {
        let request = chat_request(&self.uri, body);
        let start = Instant::now();
        let response = match self.client.request(request).await {
            Ok(r) => r,
            Err(e) => {
                return Sample {
                    ttft: None,
                    total: start.elapsed(),
                    gaps: Vec::new(),
                    error: Some(format!("request failed: {e}")),
                }
            }
        };
        let status = response.status();
        read_stream(start, status, response.into_body(), first_token)
            .await
            .sample
    }
}

fn chat_request(uri: &http::Uri, body: Bytes) -> Request<Full<Bytes>> {
    Request::builder()
        .method(Method::POST)
        .uri(uri.clone())
        .header(header::HOST, uri.authority().map_or("", |a| a.as_str()))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::ACCEPT, "text/event-stream")
        .body(Full::new(body))
        .expect("method, URI and static headers are valid")
}

/// One HTTP/1.1 keep-alive connection to a target, used by one worker for request after
/// request and opened again after an error.
///
/// hyper-util's pooled client, shared by all workers, starts a new connection whenever a
/// request finds none idle and keeps it when an idle one won the race: at concurrency 256 it
/// held ~500 connections to the proxy under test (measured with `ss`), which the proxy paid for
/// in memory and the generator in connects. A connection per worker keeps "concurrency N" at
/// N connections, as `wrk` does.
pub struct LoadConnection {
    addr: SocketAddr,
    uri: http::Uri,
    sender: Option<http1::SendRequest<Full<Bytes>>>,
}

impl LoadConnection {
    /// A connection (opened on first use) for `http://addr/v1/chat/completions`.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            uri: chat_uri(addr),
            sender: None,
        }
    }

    async fn connect(&self) -> Result<http1::SendRequest<Full<Bytes>>, String> {
        let stream = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::TcpStream::connect(self.addr),
        )
        .await
        .map_err(|_| format!("connect to {} timed out", self.addr))?
        .map_err(|e| format!("connect to {}: {e}", self.addr))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("TCP_NODELAY: {e}"))?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }

    /// Sends one streaming chat completion on this connection and reads it to the end, as
    /// [`LoadClient::chat`] does. The clock includes a reconnect, if one was needed.
    pub async fn chat(&mut self, body: Bytes, first_token: Option<&AtomicUsize>) -> Sample {
        let start = Instant::now();
        let failed = |error: String| Sample {
            ttft: None,
            total: start.elapsed(),
            gaps: Vec::new(),
            error: Some(error),
        };
        let mut sender = match self.sender.take() {
            Some(s) if !s.is_closed() => s,
            _ => match self.connect().await {
                Ok(s) => s,
                Err(e) => return failed(format!("request failed: {e}")),
            },
        };
        if let Err(e) = sender.ready().await {
            return failed(format!("request failed: {e}"));
        }
        let response = match sender.send_request(chat_request(&self.uri, body)).await {
            Ok(r) => r,
            Err(e) => return failed(format!("request failed: {e}")),
        };
        let status = response.status();
        let sample = read_stream(start, status, response.into_body(), first_token)
            .await
            .sample;
        if sample.ok() {
            self.sender = Some(sender);
        }
        sample
    }
}

fn chat_uri(addr: SocketAddr) -> http::Uri {
    format!("http://{addr}/v1/chat/completions")
        .parse()
        .expect("a socket address always forms a valid URI")
}

/// A response body read to the end by [`read_stream`].
#[derive(Clone, Debug)]
pub struct StreamRead {
    /// Timings and success, as for [`LoadClient::chat`].
    pub sample: Sample,
    /// Body bytes received (before an error, if one ended the body).
    pub body_bytes: u64,
}

/// Reads a streaming chat response `body` (status `status`) to the end, timing from `start`:
/// the first chunk holding `data:` stops the TTFT clock (and increments `first_token`), later
/// chunks holding `data:` give the inter-token gaps. Success means status 200, a body that
/// ends with `data: [DONE]`, and no error event in it. Works for any transport's body (HTTP/1.1, HTTP/2, HTTP/3).
pub async fn read_stream<B>(
    start: Instant,
    status: StatusCode,
    body: B,
    first_token: Option<&AtomicUsize>,
) -> StreamRead
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let mut ttft = None;
    let mut gaps = Vec::new();
    let mut last_event: Option<Instant> = None;
    let mut body_bytes = 0u64;
    let mut body = std::pin::pin!(body);
    let fail = |ttft, body_bytes, error: String| StreamRead {
        sample: Sample {
            ttft,
            total: start.elapsed(),
            gaps: Vec::new(),
            error: Some(error),
        },
        body_bytes,
    };
    let mut tail: Vec<u8> = Vec::with_capacity(TAIL_BYTES * 2);
    let mut errored = false;
    loop {
        match body.frame().await {
            None => break,
            Some(Err(e)) => return fail(ttft, body_bytes, format!("body error: {e}")),
            Some(Ok(frame)) => {
                let Ok(chunk) = frame.into_data() else {
                    continue;
                };
                body_bytes += chunk.len() as u64;
                errored = errored || error_event(&tail, &chunk);
                if contains(&chunk, b"data:") {
                    let now = Instant::now();
                    if let Some(prev) = last_event.replace(now) {
                        gaps.push(now - prev);
                    }
                    if ttft.is_none() {
                        ttft = Some(now - start);
                        if let Some(counter) = first_token {
                            counter.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                tail.extend_from_slice(&chunk[chunk.len().saturating_sub(TAIL_BYTES)..]);
                if tail.len() > TAIL_BYTES {
                    tail.drain(..tail.len() - TAIL_BYTES);
                }
            }
        }
    }
    if status != StatusCode::OK {
        return fail(ttft, body_bytes, format!("status {status}"));
    }
    // vLLM, SGLang and the sim's `error_after_tokens` fail a stream with an error event and
    // then still send `[DONE]`.
    if errored {
        return fail(
            ttft,
            body_bytes,
            "the stream carried an error event".to_owned(),
        );
    }
    if !trim_end(&tail).ends_with(b"data: [DONE]") {
        return fail(
            ttft,
            body_bytes,
            "stream did not end with data: [DONE]".to_owned(),
        );
    }
    StreamRead {
        sample: Sample {
            ttft,
            total: start.elapsed(),
            gaps,
            error: None,
        },
        body_bytes,
    }
}

/// The request body: a streaming chat completion for `sim-model`.
pub fn chat_body(max_tokens: u32) -> Bytes {
    Bytes::from(format!(
        r#"{{"model":"sim-model","stream":true,"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"Say something short about networks and latency."}}]}}"#
    ))
}

/// Whether an error event (`tokenway_wire::sse::find_error_event`) starts in `chunk`, or
/// across the seam with the previous chunk, whose last bytes are `tail`. An error event starts
/// a line, and a chunk that goes on with a line the tail began does not start one: token text
/// that reads `error: {` there is no event.
fn error_event(tail: &[u8], chunk: &[u8]) -> bool {
    if tail.is_empty() || tail.ends_with(b"\n") {
        return find_error_event(chunk).is_some();
    }
    let first_break = chunk.iter().position(|&b| b == b'\n');
    if let Some(i) = first_break {
        if find_error_event(&chunk[i + 1..]).is_some() {
            return true;
        }
    }
    // The line the chunk goes on with, from its start in the tail (if that is near enough to
    // the seam for an error line's start to straddle it; one further back was seen whole).
    const SIDE: usize = 24;
    let recent = &tail[tail.len().saturating_sub(SIDE)..];
    let Some(start) = recent.iter().rposition(|&b| b == b'\n') else {
        return false;
    };
    let before = &recent[start + 1..];
    let after = &chunk[..first_break.unwrap_or(chunk.len()).min(SIDE)];
    let mut seam = [0u8; 2 * SIDE];
    seam[..before.len()].copy_from_slice(before);
    seam[before.len()..before.len() + after.len()].copy_from_slice(after);
    find_error_event(&seam[..before.len() + after.len()]).is_some()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn trim_end(b: &[u8]) -> &[u8] {
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    &b[..end]
}

/// `rounds` rounds of one request to each target after another, each target on its own
/// connection; the first target of a round rotates. Interleaved, the targets share whatever
/// else the machine is doing during the scenario, which run one after another do not: a
/// single stream's latency is tens of microseconds here. Samples are returned per target.
pub async fn interleaved(
    connections: &mut [LoadConnection],
    rounds: usize,
    max_tokens: u32,
) -> Vec<Vec<Sample>> {
    let body = chat_body(max_tokens);
    let n = connections.len();
    let mut samples: Vec<Vec<Sample>> = (0..n).map(|_| Vec::with_capacity(rounds)).collect();
    for round in 0..rounds {
        for k in 0..n {
            let target = (round + k) % n;
            samples[target].push(connections[target].chat(body.clone(), None).await);
        }
    }
    samples
}

/// `concurrency` closed-loop workers, each on its own connection to `addr`, sending requests
/// back to back for `duration`; returns every sample and the wall time until the last
/// in-flight request finished. `connections` are the workers' connections: kept from one call
/// to the next (a warm-up's connections serve the measurement), opened where missing.
pub async fn closed_loop(
    connections: &mut Vec<LoadConnection>,
    addr: SocketAddr,
    concurrency: usize,
    duration: Duration,
    max_tokens: u32,
) -> (Vec<Sample>, Duration) {
    let body = chat_body(max_tokens);
    connections.truncate(concurrency);
    while connections.len() < concurrency {
        connections.push(LoadConnection::new(addr));
    }
    let start = Instant::now();
    let deadline = start + duration;
    let mut workers = tokio::task::JoinSet::new();
    for mut connection in connections.drain(..) {
        let body = body.clone();
        workers.spawn(async move {
            let mut samples = Vec::new();
            while Instant::now() < deadline {
                samples.push(connection.chat(body.clone(), None).await);
            }
            (connection, samples)
        });
    }
    let mut all = Vec::new();
    while let Some(joined) = workers.join_next().await {
        match joined {
            Ok((connection, samples)) => {
                connections.push(connection);
                all.extend(samples);
            }
            Err(e) => all.push(Sample {
                ttft: None,
                total: Duration::ZERO,
                gaps: Vec::new(),
                error: Some(format!("worker task failed: {e}")),
            }),
        }
    }
    (all, start.elapsed())
}

/// `n` requests started at once; `first_token` counts the streams that have begun.
pub fn open_streams(
    client: &LoadClient,
    n: usize,
    max_tokens: u32,
    first_token: Arc<AtomicUsize>,
) -> tokio::task::JoinSet<Sample> {
    let body = chat_body(max_tokens);
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let client = client.clone();
        let body = body.clone();
        let counter = first_token.clone();
        set.spawn(async move { client.chat(body, Some(&counter)).await });
    }
    set
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stream_with_an_error_event_fails_even_when_it_ends_with_done() {
        let read = |frames: Vec<&'static [u8]>| async move {
            let frames = frames.iter().map(|f| {
                Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(Bytes::from_static(f)))
            });
            let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
            read_stream(Instant::now(), StatusCode::OK, body, None)
                .await
                .sample
                .error
        };
        let token: &'static [u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let done: &'static [u8] = b"data: [DONE]\n\n";
        assert_eq!(read(vec![token, token, done]).await, None);
        let error: &'static [u8] = b"data: {\"error\":{\"message\":\"stalled\",\"code\":500}}\n\n";
        assert!(read(vec![token, error, done]).await.is_some());
        // An error line split between two frames.
        let (a, b): (&'static [u8], &'static [u8]) =
            (b"data: {\"err", b"or\":{\"message\":\"x\"}}\n\n");
        assert!(read(vec![token, a, b, done]).await.is_some());
        // A frame that starts inside a line whose token text reads like an error field is no
        // error.
        let (a, b): (&'static [u8], &'static [u8]) = (
            b"data: {\"choices\":[{\"delta\":{\"content\":\"",
            b"error: {x}\"}}]}\n\n",
        );
        assert_eq!(read(vec![token, a, b, done]).await, None);
        // llama.cpp's SSE `error` field.
        let field: &'static [u8] = b"error: {\"code\":500,\"message\":\"x\"}\n\n";
        assert!(read(vec![token, field, done]).await.is_some());
    }

    #[test]
    fn done_terminator_is_found_after_trailing_blank_lines() {
        assert!(trim_end(b"data: {}\n\ndata: [DONE]\n\n").ends_with(b"data: [DONE]"));
        assert!(!trim_end(b"data: {}\n\n").ends_with(b"data: [DONE]"));
        assert_eq!(trim_end(b"  \n"), b"");
    }

    #[test]
    fn chat_body_is_valid_json_asking_for_a_stream() {
        let v: serde_json::Value = serde_json::from_slice(&chat_body(16)).expect("valid JSON");
        assert_eq!(v["stream"], true);
        assert_eq!(v["max_tokens"], 16);
        assert_eq!(v["model"], "sim-model");
    }
}
