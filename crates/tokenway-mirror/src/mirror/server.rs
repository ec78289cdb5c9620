//! The mirror's HTTP API (hyper 1.x, HTTP/1.1 and h2c).
//!
//! | route | answer |
//! |---|---|
//! | `GET /v1/models/{model}/tags/{tag}` | the manifest the tag points at (`no-cache`) |
//! | `GET /v1/models/{model}/revisions/{rev}` | the manifest (immutable) |
//! | `GET/HEAD /v1/blobs/{hash}?model=M&revision=R` | blob bytes, `Range` → 206 |
//! | `GET /v1/outboards/{hash}-{group}?model=M&revision=R` | the blob's outboard (format 3, immutable) |
//! | `POST /v1/preheat` `{"model": "M:T"}` | pulls the model into the cache |
//! | `POST /v1/peers/announce` | records a peer, answers with peers holding wanted pieces |
//! | `GET /v1/peers?blob=H&piece=I[&region=R]` | addresses of peers holding that piece |
//! | `GET /metrics`, `GET /healthz` | Prometheus text, `ok` |
//!
//! Errors are JSON `{"error": {"kind", "message"}}`; an unreachable origin is 502 for what
//! is not cached, and everything cached keeps being served.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::net::TcpListener;

use super::peers::Announce;
use super::preheat::{preheat, PreheatRequest};
use super::Mirror;
use crate::http_error::ServeError;
use crate::manifest::{
    validate_model_name, validate_name, Blake3Hash, FileEntry, Manifest, ModelRef, Selector,
};
use crate::range_server::{blob_response, error_response, full, Body, PieceFetch};

/// Largest request body accepted (announcements, preheat requests).
pub const MAX_BODY: usize = 4 << 20;
/// Connections served at once; more are closed at accept (each may hold a piece in memory).
pub const MAX_CONNECTIONS: usize = 4096;
/// How long open responses may finish after shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Serves `mirror` on `listener` (HTTPS with `tls`) until `shutdown` resolves.
pub async fn serve(
    mirror: Arc<Mirror>,
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let handler = move |req| route(Arc::clone(&mirror), req);
    crate::http_serve::serve(
        listener,
        tls,
        "mirror",
        crate::http_serve::Limits {
            max_connections: MAX_CONNECTIONS,
            grace: SHUTDOWN_GRACE,
            idle: crate::http_serve::IDLE_TIMEOUT,
        },
        handler,
        shutdown,
    )
    .await;
    Ok(())
}

/// Query parameter `name`, percent-decoded; a malformed escape or a value that does not
/// decode to UTF-8 is a 400 (never a panic: the request target may hold raw UTF-8 bytes).
pub fn query_param(query: Option<&str>, name: &str) -> Result<Option<String>, ServeError> {
    let Some(query) = query else {
        return Ok(None);
    };
    for kv in query.split('&') {
        if let Some((k, v)) = kv.split_once('=') {
            if k == name {
                return percent_decode(v).map(Some).ok_or_else(|| {
                    ServeError::bad_request(format!(
                        "query parameter {name}: {v:?} is not valid percent-encoded UTF-8"
                    ))
                });
            }
        }
    }
    Ok(None)
}

/// Decodes `%XX` escapes and `+` on bytes; `None` for a `%` not followed by two hex digits
/// or a result that is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hi = hex_digit(*b.get(i + 1)?)?;
                let lo = hex_digit(*b.get(i + 2)?)?;
                out.push(hi << 4 | lo);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn hex_digit(c: u8) -> Option<u8> {
    char::from(c)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
}

fn json_response(status: StatusCode, value: &impl serde::Serialize) -> Response<Body> {
    let body = serde_json::to_vec(value).expect("invariant: API answers always serialize");
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

async fn read_json<T: serde::de::DeserializeOwned>(
    req: Request<Incoming>,
) -> Result<T, ServeError> {
    let body = Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| {
            ServeError::bad_request(format!("reading the body (at most {MAX_BODY} bytes): {e}"))
        })?
        .to_bytes();
    serde_json::from_slice(&body)
        .map_err(|e| ServeError::bad_request(format!("invalid JSON body: {e}")))
}

async fn route(m: Arc<Mirror>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if path.starts_with("/v1/") {
        if let Err(e) = crate::auth::check(m.token(), req.headers()) {
            return error_response(&e);
        }
    }
    let res = match (method.clone(), path.as_str()) {
        (Method::GET, "/healthz") => Ok(Response::new(full("ok\n"))),
        (Method::GET, "/metrics") => {
            let mut r = Response::new(full(m.metrics_text()));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(tokenway_telemetry::CONTENT_TYPE),
            );
            Ok(r)
        }
        (Method::POST, "/v1/preheat") => match read_json::<PreheatRequest>(req).await {
            Ok(p) => preheat(&m, &p.model)
                .await
                .map(|r| json_response(StatusCode::OK, &r)),
            Err(e) => Err(e),
        },
        (Method::POST, "/v1/peers/announce") => {
            let source = req
                .extensions()
                .get::<crate::http_serve::RemoteAddr>()
                .map(|r| r.0.ip());
            match read_json::<Announce>(req).await {
                Ok(a) => announce(&m, a, source),
                Err(e) => Err(e),
            }
        }
        (Method::GET, "/v1/peers") => holders(&m, req.uri().query()),
        (Method::GET | Method::HEAD, p) if p.starts_with("/v1/blobs/") => {
            return blob(m, &req).await;
        }
        (Method::GET, p) if p.starts_with("/v1/models/") => model_route(&m, p).await,
        (Method::GET, p) if p.starts_with("/v1/outboards/") => {
            outboard(&m, &p["/v1/outboards/".len()..], req.uri().query()).await
        }
        (_, p) if p.starts_with("/v1/") || p == "/metrics" || p == "/healthz" => {
            Err(ServeError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{method} is not allowed on {p}"),
            ))
        }
        _ => Err(ServeError::not_found(format!(
            "no route {path}; see docs/weights.md for the mirror API"
        ))),
    };
    res.unwrap_or_else(|e| error_response(&e))
}

fn manifest_response(manifest: &Manifest, immutable: bool, stale: bool) -> Response<Body> {
    let bytes = manifest.to_json();
    let etag = format!("\"{}\"", Blake3Hash::of(&bytes));
    let mut r = Response::new(full(bytes));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = HeaderValue::from_str(&etag) {
        h.insert(header::ETAG, v);
    }
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static(if immutable {
            crate::range_server::IMMUTABLE
        } else {
            "no-cache"
        }),
    );
    if let Ok(v) = HeaderValue::from_str(&manifest.revision) {
        h.insert("x-tokenway-revision", v);
    }
    if stale {
        h.insert(
            "x-tokenway-stale",
            HeaderValue::from_static("origin-unreachable"),
        );
    }
    r
}

async fn model_route(m: &Arc<Mirror>, path: &str) -> Result<Response<Body>, ServeError> {
    let rest = &path["/v1/models/".len()..];
    let (model, selector) = if let Some((model, tag)) = rest.rsplit_once("/tags/") {
        validate_name("tag", tag).map_err(|e| ServeError::bad_request(e.to_string()))?;
        (model, Selector::Tag(tag.to_string()))
    } else if let Some((model, rev)) = rest.rsplit_once("/revisions/") {
        validate_name("revision", rev).map_err(|e| ServeError::bad_request(e.to_string()))?;
        (model, Selector::Revision(rev.to_string()))
    } else {
        return Err(ServeError::not_found(
            "expected /v1/models/{model}/tags/{tag} or /v1/models/{model}/revisions/{rev}",
        ));
    };
    validate_model_name("model", model).map_err(|e| ServeError::bad_request(e.to_string()))?;
    let immutable = matches!(selector, Selector::Revision(_));
    let mref = ModelRef {
        model: model.to_string(),
        selector,
    };
    let r = m.manifests.resolve(m.origin.as_ref(), &mref).await?;
    Ok(manifest_response(&r.manifest, immutable, r.stale_tag))
}

/// The layout of a requested blob: from the manifest named in the query, else from any
/// manifest the mirror has in memory.
async fn blob_entry(
    m: &Arc<Mirror>,
    hash: &Blake3Hash,
    query: Option<&str>,
) -> Result<Arc<FileEntry>, ServeError> {
    if let (Some(model), Some(rev)) = (
        query_param(query, "model")?,
        query_param(query, "revision")?,
    ) {
        validate_model_name("model", &model).map_err(|e| ServeError::bad_request(e.to_string()))?;
        validate_name("revision", &rev).map_err(|e| ServeError::bad_request(e.to_string()))?;
        let manifest = m
            .manifests
            .revision(m.origin.as_ref(), &model, &rev)
            .await?;
        return manifest
            .files
            .iter()
            .find(|f| f.hash == *hash)
            .map(|f| Arc::new(f.clone()))
            .ok_or_else(|| {
                ServeError::not_found(format!("blob {hash} is not part of {model}@{rev}"))
            });
    }
    m.manifests.find_blob(hash).ok_or_else(|| {
        ServeError::not_found(format!(
            "blob {hash} is not in any manifest this mirror knows; add ?model=NAME&revision=REV"
        ))
    })
}

async fn blob(m: Arc<Mirror>, req: &Request<Incoming>) -> Response<Body> {
    let hex = &req.uri().path()["/v1/blobs/".len()..];
    let hash = match Blake3Hash::from_hex(hex) {
        Ok(h) => h,
        Err(e) => {
            return error_response(&ServeError::bad_request(format!("blob name {hex:?}: {e}")))
        }
    };
    let entry = match blob_entry(&m, &hash, req.uri().query()).await {
        Ok(e) => e,
        Err(e) => return error_response(&e),
    };
    let range = req
        .headers()
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok());
    let head = req.method() == Method::HEAD;
    let m2 = Arc::clone(&m);
    let e2 = Arc::clone(&entry);
    let fetch: PieceFetch = Arc::new(move |i, wait| {
        let (m, e) = (Arc::clone(&m2), Arc::clone(&e2));
        Box::pin(async move { m.piece_for_client(e, i, wait).await })
    });
    let served = m.metrics.bytes_served.clone();
    blob_response(
        entry,
        range,
        head,
        fetch,
        Arc::new(move |n| {
            served.inc_by(n);
        }),
    )
    .await
}

/// `GET /v1/outboards/{hash}-{group}`: immutable, named by the blob hash like the blob.
async fn outboard(
    m: &Arc<Mirror>,
    name: &str,
    query: Option<&str>,
) -> Result<Response<Body>, ServeError> {
    let bad = || {
        ServeError::bad_request(format!(
            "outboard name {name:?}: expected <64 hex characters>-<group size in bytes>"
        ))
    };
    let (hex, group) = name.split_once('-').ok_or_else(bad)?;
    let hash = Blake3Hash::from_hex(hex).map_err(|_| bad())?;
    let group: u64 = group.parse().map_err(|_| bad())?;
    let entry = blob_entry(m, &hash, query).await?;
    if entry.group_size != Some(group) {
        return Err(ServeError::not_found(format!(
            "blob {hash} has no outboard at groups of {group} bytes (its manifest says {:?})",
            entry.group_size
        )));
    }
    let ob = m.manifests.outboard(m.origin.as_ref(), &entry).await?;
    m.metrics.outboard_bytes_served.inc_by(ob.len() as u64);
    let ob = m.held_for_client(ob).await?;
    let mut r = Response::new(full(ob));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=31536000, immutable"),
    );
    if let Ok(v) = HeaderValue::from_str(&format!("\"{hash}-{group}\"")) {
        h.insert(header::ETAG, v);
    }
    Ok(r)
}

fn announce(
    m: &Arc<Mirror>,
    a: Announce,
    source: Option<std::net::IpAddr>,
) -> Result<Response<Body>, ServeError> {
    let counts = m
        .manifests
        .piece_counts(a.have.keys().chain(a.taking.keys()));
    let (reply, delta, listed) = {
        let mut dir = m
            .peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (reply, delta) = dir
            .announce(a, source, &counts, Instant::now())
            .map_err(|e| ServeError::bad_request(format!("announcement refused: {e}")))?;
        (reply, delta, dir.len())
    };
    m.metrics.bytes_from_peers.inc_by(delta);
    m.metrics
        .peers
        .set(i64::try_from(listed).unwrap_or(i64::MAX));
    // Serialized after the directory's lock is released.
    Ok(json_response(StatusCode::OK, &reply))
}

fn holders(m: &Arc<Mirror>, query: Option<&str>) -> Result<Response<Body>, ServeError> {
    let blob =
        query_param(query, "blob")?.ok_or_else(|| ServeError::bad_request("missing ?blob=HASH"))?;
    let blob =
        Blake3Hash::from_hex(&blob).map_err(|e| ServeError::bad_request(format!("blob: {e}")))?;
    let piece: u64 = query_param(query, "piece")?
        .ok_or_else(|| ServeError::bad_request("missing &piece=INDEX"))?
        .parse()
        .map_err(|_| ServeError::bad_request("piece must be an integer"))?;
    let region = query_param(query, "region")?.unwrap_or_default();
    let dir = m
        .peers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let peers = dir.holders(&region, &blob, piece, Instant::now());
    let region = if region.is_empty() {
        m.region.clone()
    } else {
        region
    };
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({"blob": blob, "piece": piece, "region": region, "peers": peers}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_params_are_found_and_decoded() {
        let q = Some("model=org%2Ftiny&revision=r1&x&r=a+b%C3%A9");
        assert_eq!(
            query_param(q, "model").unwrap().as_deref(),
            Some("org/tiny")
        );
        assert_eq!(query_param(q, "revision").unwrap().as_deref(), Some("r1"));
        assert_eq!(query_param(q, "r").unwrap().as_deref(), Some("a bé"));
        assert_eq!(query_param(q, "nope").unwrap(), None);
        assert_eq!(query_param(None, "model").unwrap(), None);
    }

    #[test]
    fn percent_then_non_ascii_in_query_is_a_400_not_a_panic() {
        for q in [
            "model=%aé&revision=r1",
            "model=%é",
            "model=a%2",
            "model=%",
            "model=%ff",
        ] {
            let e = query_param(Some(q), "model").unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{q}");
            assert!(e.message.contains("model"), "{}", e.message);
        }
    }
}
