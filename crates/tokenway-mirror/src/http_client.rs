//! The HTTP client pullers and `tokenway preheat` use to talk to mirrors and peers: HTTP/1.1
//! (over TLS for `https://` mirrors, see [`crate::tls`]) with a connection pool that sends the
//! weights tier's access token (if one is configured, see [`crate::auth`]) with every request,
//! and helpers that bound how much of a body is read and how long a silent server is waited
//! for.
//!
//! Three timeouts stop a pull from stalling on a mirror or peer that accepts connections and
//! then says nothing (a hung process, a peer frozen with SIGSTOP, a forged peer address):
//! [`CONNECT_TIMEOUT`] to set up TCP (and TLS), [`HEAD_TIMEOUT`] until the response head, and
//! [`IDLE_TIMEOUT`] without a byte of the body. They are generous for a real WAN (a TCP SYN is
//! retransmitted after 1 s and 3 s) and short next to the minute a whole piece may take, so a
//! silent source costs seconds, not minutes; the pull then asks the next source (see
//! [`crate::sources`]). A piece is the exception for the idle bound ([`Timeouts::piece`]): a
//! cold mirror sends the head of a slow piece within a second
//! ([`crate::range_server::EARLY_HEAD_AFTER`]) and its body once it has the piece from its
//! origin, which from a far or busy origin can take tens of seconds, so only the head is held
//! to the short bound there.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::ClientConfig;

use crate::auth::AccessToken;

/// Longest wait for a TCP (and TLS) connection to a mirror or peer.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for the response head once the request is sent (connecting included).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest wait for the next bytes of a response body.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one request may wait: for its response head, between two pieces of its body, and
/// in all.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// Until the response head (connecting included).
    pub head: Duration,
    /// Without a body byte.
    pub idle: Duration,
    /// The whole request, body included.
    pub total: Duration,
}

impl Timeouts {
    /// [`HEAD_TIMEOUT`] and [`IDLE_TIMEOUT`], and `total` for the whole transfer.
    pub const fn transfer(total: Duration) -> Self {
        Self {
            head: HEAD_TIMEOUT,
            idle: IDLE_TIMEOUT,
            total,
        }
    }

    /// A piece: [`HEAD_TIMEOUT`] for the head, `idle` for silence within the body (a cold
    /// mirror sends the head at once and the piece when its origin has delivered it; a source
    /// stuck mid-body is left by the straggler hedge), and `total` for the whole transfer.
    pub const fn piece(idle: Duration, total: Duration) -> Self {
        Self {
            head: HEAD_TIMEOUT,
            idle,
            total,
        }
    }

    /// One bound for everything (small requests: RTT probes, announcements).
    pub const fn all(d: Duration) -> Self {
        Self {
            head: d,
            idle: d,
            total: d,
        }
    }
}

/// A pooled client and the access token it sends.
pub struct HttpClient {
    pool: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    token: Option<AccessToken>,
}

/// A new pooled client (TCP_NODELAY, [`CONNECT_TIMEOUT`], idle connections kept 30 s) that sends `token` and speaks
/// TLS to `https://` URLs with `tls` (without it, such URLs fail: no certificate is trusted).
pub fn client(token: Option<AccessToken>, tls: Option<Arc<ClientConfig>>) -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.set_connect_timeout(Some(CONNECT_TIMEOUT));
    c.enforce_http(false);
    let tls = tls.map_or_else(untrusting, |t| t.as_ref().clone());
    let https = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(c);
    HttpClient {
        pool: Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(https),
        token,
    }
}

/// A TLS configuration that trusts no certificate, for clients that never ask an `https://`
/// URL (peers are plain HTTP).
fn untrusting() -> ClientConfig {
    ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("invariant: ring supports the default protocol versions")
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth()
}

/// Whether any of `urls` is an `https://` one (and a TLS configuration is needed).
pub fn any_https(urls: &[String]) -> bool {
    urls.iter().any(|u| u.trim().starts_with("https://"))
}

/// Checks a base URL (`http://host:port` or `https://host[:port]`, no path) and returns it
/// without a trailing `/`.
pub fn base_url(url: &str) -> Result<String, String> {
    let u = url.trim().trim_end_matches('/');
    let rest = u
        .strip_prefix("http://")
        .or_else(|| u.strip_prefix("https://"))
        .ok_or_else(|| format!("{url:?}: expected http://HOST:PORT or https://HOST[:PORT]"))?;
    if rest.is_empty() || rest.contains('/') || rest.contains('?') {
        return Err(format!(
            "{url:?}: expected http://HOST:PORT or https://HOST[:PORT] without a path"
        ));
    }
    u.parse::<http::Uri>()
        .map_err(|e| format!("{url:?}: {e}"))?;
    Ok(u.to_string())
}

/// Why a request failed.
#[derive(Debug)]
pub enum HttpError {
    /// No connection could be made (refused, unreachable, connect timeout).
    Connect(String),
    /// No answer (timeout, reset, cut body).
    Transport(String),
    /// An error status, with the server's message.
    Status(StatusCode, String),
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Connect(m) | Self::Transport(m) => write!(f, "{m}"),
            Self::Status(s, m) => write!(f, "HTTP {}: {m}", s.as_u16()),
        }
    }
}

/// The most of an error response's body read for its message.
pub const MAX_ERROR_BODY: usize = 64 << 10;

/// Sends `req` (with the client's token) and reads at most `limit` body bytes (of a success;
/// an error's up to [`MAX_ERROR_BODY`]), within `timeouts`.
pub async fn send(
    client: &HttpClient,
    req: Request<Full<Bytes>>,
    limit: usize,
    timeouts: Timeouts,
) -> Result<(Response<()>, Bytes), HttpError> {
    send_watched(client, req, limit, timeouts, None).await
}

/// [`send`], setting `heard` once the response head has arrived (so a caller waiting on it can
/// tell a silent server from a slow transfer).
pub async fn send_watched(
    client: &HttpClient,
    mut req: Request<Full<Bytes>>,
    limit: usize,
    timeouts: Timeouts,
    heard: Option<&AtomicBool>,
) -> Result<(Response<()>, Bytes), HttpError> {
    let uri = req.uri().clone();
    if let Some(t) = &client.token {
        req.headers_mut()
            .insert(http::header::AUTHORIZATION, t.header_value().clone());
    }
    let fut = async {
        let resp: Response<Incoming> =
            tokio::time::timeout(timeouts.head, client.pool.request(req))
                .await
                .map_err(|_| {
                    HttpError::Transport(format!(
                        "{uri}: no response within {:?} (the server accepts connections but does \
                     not answer)",
                        timeouts.head
                    ))
                })?
                .map_err(|e| {
                    let m = format!("{uri}: {}", with_causes(&e));
                    if e.is_connect() {
                        HttpError::Connect(m)
                    } else {
                        HttpError::Transport(m)
                    }
                })?;
        if let Some(h) = heard {
            h.store(true, Ordering::Relaxed);
        }
        let (parts, mut body) = resp.into_parts();
        // An error's body is read for its message whatever the caller's limit (a piece of a
        // 13-byte file took a mirror's 150-byte "busy" answer for an overlong body, and so for
        // a failure), and cut, not refused, past its own bound: the status is the answer.
        let failed = !parts.status.is_success();
        let limit = if failed {
            limit.max(MAX_ERROR_BODY)
        } else {
            limit
        };
        // Read into one buffer sized from Content-Length (from the pool: pieces are large
        // and many, see `piece_buffers`), instead of collecting frames and copying them.
        let expected = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
            .unwrap_or(0);
        let mut buf = crate::piece_buffers::take(expected.min(limit));
        loop {
            let Some(frame) = tokio::time::timeout(timeouts.idle, body.frame())
                .await
                .map_err(|_| {
                    HttpError::Transport(format!(
                        "{uri}: reading the body: no bytes for {:?} after {} received",
                        timeouts.idle,
                        buf.len()
                    ))
                })?
            else {
                break;
            };
            let frame =
                frame.map_err(|e| HttpError::Transport(format!("{uri}: reading the body: {e}")))?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > limit {
                    if failed {
                        break;
                    }
                    return Err(HttpError::Transport(format!(
                        "{uri}: reading the body: length limit of {limit} bytes exceeded"
                    )));
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok::<_, HttpError>((Response::from_parts(parts, ()), buf.freeze()))
    };
    let (resp, body) = tokio::time::timeout(timeouts.total, fut)
        .await
        .map_err(|_| {
            HttpError::Transport(format!("{uri}: not complete within {:?}", timeouts.total))
        })??;
    if !resp.status().is_success() {
        return Err(HttpError::Status(resp.status(), error_message(&body)));
    }
    Ok((resp, body))
}

/// `e` and its causes, `: `-separated (hyper's own text says only "client error (Connect)"; the
/// cause says which: refused, timed out, a certificate not trusted).
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let s = c.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        cur = c.source();
    }
    text
}

/// The `message` of a JSON error body, or the body itself.
pub fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned())
}

/// A GET request.
pub fn get(url: &str) -> Result<Request<Full<Bytes>>, HttpError> {
    Request::get(url)
        .body(Full::new(Bytes::new()))
        .map_err(|e| HttpError::Transport(format!("{url}: {e}")))
}

/// A POST of JSON.
pub fn post_json(url: &str, body: Vec<u8>) -> Result<Request<Full<Bytes>>, HttpError> {
    Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| HttpError::Transport(format!("{url}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_are_checked() {
        assert_eq!(
            base_url("http://127.0.0.1:80/").unwrap(),
            "http://127.0.0.1:80"
        );
        assert_eq!(
            base_url("https://mirror.example:8443/").unwrap(),
            "https://mirror.example:8443"
        );
        assert!(base_url("ftp://x:1").is_err());
        assert!(base_url("127.0.0.1:80").is_err());
        assert!(base_url("http://x:1/path").is_err());
    }

    /// A server that answers every connection's request with `answer`, then closes it.
    async fn answering(status: &str, body: &str) -> String {
        let answer = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n{body}",
            body.len()
        );
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        tokio::spawn(async move {
            while let Ok((mut c, _)) = listener.accept().await {
                let mut buf = [0u8; 4096];
                let _ = c.read(&mut buf).await;
                let _ = c.write_all(answer.as_bytes()).await;
            }
        });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn an_error_answer_longer_than_the_limit_keeps_its_status_and_message() {
        let base = answering(
            "503 Service Unavailable",
            r#"{"error":{"message":"at the bound","type":"busy"}}"#,
        )
        .await;
        let c = client(None, None);
        // A 13-byte file's piece: the limit is far below the error's body.
        let r = send(
            &c,
            get(&format!("{base}/v1/blobs/x")).expect("request"),
            13,
            Timeouts::all(Duration::from_secs(5)),
        )
        .await;
        match r {
            Err(HttpError::Status(StatusCode::SERVICE_UNAVAILABLE, m)) => {
                assert_eq!(m, "at the bound");
            }
            other => panic!("expected the 503, got {other:?}"),
        }
        // A success's body past the limit is still refused.
        let base = answering("200 OK", "01234567890123456789").await;
        let r = send(
            &c,
            get(&format!("{base}/x")).expect("request"),
            13,
            Timeouts::all(Duration::from_secs(5)),
        )
        .await;
        assert!(
            matches!(&r, Err(HttpError::Transport(m)) if m.contains("length limit of 13")),
            "{r:?}"
        );
    }
}
