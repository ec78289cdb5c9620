//! The HTTP client pullers and `tokenway preheat` use to talk to mirrors and peers: plain
//! HTTP/1.1 with a connection pool that sends the weights tier's access token (if one is
//! configured, see [`crate::auth`]) with every request, and helpers that bound how much of a
//! body is read.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::auth::AccessToken;

/// A pooled client and the access token it sends.
pub struct HttpClient {
    pool: Client<HttpConnector, Full<Bytes>>,
    token: Option<AccessToken>,
}

/// A new pooled client (TCP_NODELAY, idle connections kept 30 s) that sends `token`.
pub fn client(token: Option<AccessToken>) -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.set_connect_timeout(Some(Duration::from_secs(5)));
    HttpClient {
        pool: Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(c),
        token,
    }
}

/// Checks a base URL (`http://host:port`, no path) and returns it without a trailing `/`.
pub fn base_url(url: &str) -> Result<String, String> {
    let u = url.trim().trim_end_matches('/');
    let rest = u.strip_prefix("http://").ok_or_else(|| {
        if u.starts_with("https://") {
            format!(
                "{url:?}: https is not supported for mirrors and peers in this build; use http://"
            )
        } else {
            format!("{url:?}: expected http://HOST:PORT")
        }
    })?;
    if rest.is_empty() || rest.contains('/') || rest.contains('?') {
        return Err(format!("{url:?}: expected http://HOST:PORT without a path"));
    }
    u.parse::<http::Uri>()
        .map_err(|e| format!("{url:?}: {e}"))?;
    Ok(u.to_string())
}

/// Why a request failed.
#[derive(Debug)]
pub enum HttpError {
    /// No answer (connect, timeout, reset, cut body).
    Transport(String),
    /// An error status, with the server's message.
    Status(StatusCode, String),
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Transport(m) => write!(f, "{m}"),
            Self::Status(s, m) => write!(f, "HTTP {}: {m}", s.as_u16()),
        }
    }
}

/// Sends `req` (with the client's token) and reads at most `limit` body bytes, all within
/// `timeout`.
pub async fn send(
    client: &HttpClient,
    mut req: Request<Full<Bytes>>,
    limit: usize,
    timeout: Duration,
) -> Result<(Response<()>, Bytes), HttpError> {
    let uri = req.uri().clone();
    if let Some(t) = &client.token {
        req.headers_mut()
            .insert(http::header::AUTHORIZATION, t.header_value().clone());
    }
    let fut = async {
        let resp: Response<Incoming> = client
            .pool
            .request(req)
            .await
            .map_err(|e| HttpError::Transport(format!("{uri}: {e}")))?;
        let (parts, mut body) = resp.into_parts();
        // Read into one buffer sized from Content-Length (from the pool: pieces are large
        // and many, see `piece_buffers`), instead of collecting frames and copying them.
        let expected = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
            .unwrap_or(0);
        let mut buf = crate::piece_buffers::take(expected.min(limit));
        while let Some(frame) = body.frame().await {
            let frame =
                frame.map_err(|e| HttpError::Transport(format!("{uri}: reading the body: {e}")))?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > limit {
                    return Err(HttpError::Transport(format!(
                        "{uri}: reading the body: length limit of {limit} bytes exceeded"
                    )));
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok::<_, HttpError>((Response::from_parts(parts, ()), buf.freeze()))
    };
    let (resp, body) = tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| HttpError::Transport(format!("{uri}: no answer within {timeout:?}")))??;
    if !resp.status().is_success() {
        return Err(HttpError::Status(resp.status(), error_message(&body)));
    }
    Ok((resp, body))
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
        assert!(base_url("https://x:1").unwrap_err().contains("https"));
        assert!(base_url("127.0.0.1:80").is_err());
        assert!(base_url("http://x:1/path").is_err());
    }
}
