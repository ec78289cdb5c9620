//! Where a puller gets bytes: the origin object store, a mirror, or a peer. Mirrors and
//! peers speak the same HTTP API (`docs/weights.md`); the origin is read with
//! `object_store`. Nothing here trusts what it receives: callers verify every piece.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::http_client::{get, send, send_watched, HttpClient, HttpError, Timeouts};
use crate::http_range::range_header;
use crate::manifest::{blob_key, FileEntry, Manifest, ModelRef, Selector};
use crate::origin::small_get::{get_small, Small};
use crate::MirrorError;

/// How long one piece request may go without bytes, and take in all besides its size's worth
/// at [`MIN_PIECE_RATE`] (hedging reacts much sooner to a slow one; a mirror or peer that sends
/// no response head fails after [`crate::http_client::HEAD_TIMEOUT`]).
pub const PIECE_TIMEOUT: Duration = Duration::from_secs(60);
/// The slowest link a pull is given time for: 256 KiB/s, shared by the pieces it fetches at
/// once. With one fixed minute per piece whatever its size, 64 MiB pieces over a slow link (or
/// queued behind a capped mirror) were cut at 45 MiB every time, and the pull never finished.
pub const MIN_PIECE_RATE: u64 = 256 << 10;

/// The longest a piece of `len` bytes may take in all when `sharing` pieces are fetched at
/// once over the same link. A deadline for the whole link per piece cut every piece of a
/// pull with 8 at a time on a link under ~3.5 Mbit/s at 85 % (4 MiB pieces): all restarted
/// together, none ever finished, and the pull gave up hours later.
pub fn piece_deadline(len: u64, sharing: u64) -> Duration {
    let bytes = len.saturating_mul(sharing.max(1));
    PIECE_TIMEOUT + Duration::from_secs_f64(bytes as f64 / MIN_PIECE_RATE as f64)
}
/// How long one RTT probe may take; a mirror that misses one is not probed again.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest manifest accepted from a mirror.
pub const MAX_MANIFEST_BYTES: usize = 64 << 20;

/// What kind of source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceKind {
    /// The origin object store.
    Origin,
    /// A mirror.
    Mirror,
    /// Another puller.
    Peer,
}

impl SourceKind {
    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Origin => "origin",
            Self::Mirror => "mirror",
            Self::Peer => "peer",
        }
    }
}

/// Why a source gave no piece or manifest.
#[derive(Clone, Debug)]
pub enum FetchError {
    /// The source says it does not exist (404): authoritative for mirrors and the origin.
    NotFound(String),
    /// The request was refused as invalid (400).
    BadRequest(String),
    /// No usable answer (timeout, 5xx, short body).
    Unavailable(String),
    /// The source is at its serving bound (503): alive, asked to come back shortly.
    Busy(String),
    /// No connection could be made (refused, unreachable, connect timeout).
    Unreachable(String),
}

impl std::fmt::Display for FetchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotFound(m)
            | Self::BadRequest(m)
            | Self::Unavailable(m)
            | Self::Busy(m)
            | Self::Unreachable(m) => f.write_str(m),
        }
    }
}

fn from_http(e: HttpError) -> FetchError {
    match e {
        HttpError::Status(StatusCode::NOT_FOUND, m) => FetchError::NotFound(m),
        HttpError::Status(StatusCode::BAD_REQUEST, m) => FetchError::BadRequest(m),
        HttpError::Status(StatusCode::SERVICE_UNAVAILABLE, m) => FetchError::Busy(m),
        HttpError::Connect(m) => FetchError::Unreachable(m),
        other => FetchError::Unavailable(other.to_string()),
    }
}

/// One place to fetch from.
pub enum Source {
    /// An object store.
    Origin(Arc<dyn ObjectStore>),
    /// A mirror or a peer at `base` (`http://HOST:PORT`).
    Http {
        /// Mirror or peer.
        kind: SourceKind,
        /// Base URL.
        base: String,
        /// The pull's pooled client, shared by all its HTTP sources.
        client: Arc<HttpClient>,
    },
}

impl Source {
    /// A mirror or peer at `base` (already checked with [`crate::http_client::base_url`]),
    /// asked through `client`.
    pub fn http(kind: SourceKind, base: String, client: Arc<HttpClient>) -> Self {
        Self::Http { kind, base, client }
    }

    /// Its kind.
    pub fn kind(&self) -> SourceKind {
        match self {
            Self::Origin(_) => SourceKind::Origin,
            Self::Http { kind, .. } => *kind,
        }
    }

    /// Piece `i` of `entry` (of `manifest`), unverified. `heard` is set once the source
    /// answered (the response head arrived; at once for the origin, whose client does not say).
    pub async fn piece(
        &self,
        manifest: &Manifest,
        entry: &FileEntry,
        i: u64,
        heard: &AtomicBool,
        sharing: u64,
    ) -> Result<Bytes, FetchError> {
        let range = entry.piece_range(i);
        let want = range.end - range.start;
        let bytes = match self {
            Self::Origin(store) => {
                heard.store(true, Ordering::Relaxed);
                let key = StorePath::from(blob_key(&entry.hash));
                origin_get(
                    &key,
                    store.get_range(&key, range.clone()),
                    piece_deadline(want, sharing),
                )
                .await?
            }
            Self::Http { base, client, .. } => {
                let url = format!(
                    "{base}/v1/blobs/{}?model={}&revision={}",
                    entry.hash, manifest.model, manifest.revision
                );
                let mut req = get(&url).map_err(from_http)?;
                let h = http::HeaderValue::from_str(&range_header(&range))
                    .expect("invariant: a numeric range is a valid header value");
                req.headers_mut().insert(http::header::RANGE, h);
                let (resp, body) = send_watched(
                    client,
                    req,
                    want as usize + 1,
                    Timeouts::piece(PIECE_TIMEOUT, piece_deadline(want, sharing)),
                    Some(heard),
                )
                .await
                .map_err(from_http)?;
                let whole =
                    resp.status() == StatusCode::OK && range.start == 0 && range.end == entry.size;
                if resp.status() != StatusCode::PARTIAL_CONTENT && !whole {
                    return Err(FetchError::Unavailable(format!(
                        "{url}: expected 206 Partial Content, got {}",
                        resp.status()
                    )));
                }
                body
            }
        };
        if bytes.len() as u64 != want {
            return Err(FetchError::Unavailable(format!(
                "piece {i}: {} bytes received, {want} expected",
                bytes.len()
            )));
        }
        Ok(bytes)
    }

    /// The outboard of `entry` (format 3) of `manifest`, unverified but of the right length.
    /// Peers keep none: they answer 404 and the next source is asked.
    pub async fn outboard(
        &self,
        manifest: &Manifest,
        entry: &FileEntry,
    ) -> Result<Bytes, FetchError> {
        let (Some(key), Some(want)) = (entry.outboard_key(), entry.outboard_len()) else {
            return Err(FetchError::BadRequest(format!(
                "{} has no outboard (format {})",
                entry.path, manifest.format
            )));
        };
        let bytes = match self {
            Self::Origin(store) => {
                let path = StorePath::from(key.as_str());
                origin_get(
                    &path,
                    async {
                        match get_small(store.as_ref(), &path, want).await? {
                            Small::Bytes(b) => Ok(b),
                            Small::TooLarge(n) => Err(object_store::Error::Generic {
                                store: "origin",
                                source: format!(
                                    "{key} holds {n} bytes or more; the outboard is {want}"
                                )
                                .into(),
                            }),
                        }
                    },
                    piece_deadline(want, 1),
                )
                .await?
            }
            Self::Http { base, client, .. } => {
                let url = format!(
                    "{base}/v1/{key}?model={}&revision={}",
                    manifest.model, manifest.revision
                );
                let req = get(&url).map_err(from_http)?;
                send(
                    client,
                    req,
                    want as usize + 1,
                    Timeouts::transfer(piece_deadline(want, 1)),
                )
                .await
                .map_err(from_http)?
                .1
            }
        };
        if bytes.len() as u64 != want {
            return Err(FetchError::Unavailable(format!(
                "outboard of {}: {} bytes received, {want} expected",
                entry.path,
                bytes.len()
            )));
        }
        Ok(bytes)
    }

    /// The manifest `mref` names, validated (mirrors only; the origin uses
    /// [`crate::pull::resolve`]).
    pub async fn manifest(&self, mref: &ModelRef) -> Result<Manifest, FetchError> {
        let Self::Http { base, client, .. } = self else {
            return Err(FetchError::Unavailable("not an HTTP source".into()));
        };
        let url = match &mref.selector {
            Selector::Tag(t) => format!("{base}/v1/models/{}/tags/{t}", mref.model),
            Selector::Revision(r) => format!("{base}/v1/models/{}/revisions/{r}", mref.model),
        };
        let (_, body) = send(
            client,
            get(&url).map_err(from_http)?,
            MAX_MANIFEST_BYTES,
            Timeouts::transfer(Duration::from_secs(60)),
        )
        .await
        .map_err(from_http)?;
        let m = Manifest::from_json(&body)
            .map_err(|e| FetchError::Unavailable(format!("{url}: {e}")))?;
        let rev_ok = match &mref.selector {
            Selector::Revision(r) => m.revision == *r,
            Selector::Tag(_) => true,
        };
        if m.model != mref.model || !rev_ok {
            return Err(FetchError::Unavailable(format!(
                "{url}: answered with {}@{}, not {mref}",
                m.model, m.revision
            )));
        }
        Ok(m)
    }

    /// Round-trip time: the fastest of `probes` small requests, `None` if one went unanswered
    /// (within [`PROBE_TIMEOUT`]) before any answered: a mirror that is down or hung costs the
    /// pull one probe, not `probes`.
    pub async fn rtt(&self, probes: u32) -> Option<Duration> {
        let Self::Http { base, client, .. } = self else {
            return None;
        };
        let url = format!("{base}/healthz");
        let mut best: Option<Duration> = None;
        for _ in 0..probes.max(1) {
            let t = Instant::now();
            let Ok(req) = get(&url) else { return None };
            if send(client, req, 1024, Timeouts::all(PROBE_TIMEOUT))
                .await
                .is_ok()
            {
                let d = t.elapsed();
                best = Some(best.map_or(d, |b| b.min(d)));
            } else if best.is_none() {
                break;
            }
        }
        best
    }
}

/// Awaits an origin read of `key` for at most `within`, mapping its failures.
async fn origin_get(
    key: &StorePath,
    read: impl std::future::Future<Output = object_store::Result<Bytes>>,
    within: Duration,
) -> Result<Bytes, FetchError> {
    match tokio::time::timeout(within, read).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e @ object_store::Error::NotFound { .. })) => Err(FetchError::NotFound(format!(
            "{key} missing in the origin: {e}"
        ))),
        Ok(Err(e)) => Err(FetchError::Unavailable(format!("origin: {e}"))),
        Err(_) => Err(FetchError::Unavailable(format!(
            "origin: no answer within {within:?}"
        ))),
    }
}

/// Maps a manifest failure from a mirror to the crate error.
pub fn manifest_error(url: &str, mref: &ModelRef, e: FetchError) -> MirrorError {
    match e {
        FetchError::NotFound(m) => MirrorError::NotFound {
            what: format!("{mref} ({m})"),
            key: url.to_string(),
        },
        FetchError::BadRequest(m)
        | FetchError::Unavailable(m)
        | FetchError::Busy(m)
        | FetchError::Unreachable(m) => MirrorError::Remote {
            url: url.to_string(),
            reason: m,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_gets_a_minute_plus_its_size_at_the_slowest_rate() {
        assert_eq!(piece_deadline(0, 1), PIECE_TIMEOUT);
        assert_eq!(piece_deadline(64 << 20, 1), Duration::from_secs(60 + 256));
        assert_eq!(piece_deadline(4 << 20, 1), Duration::from_secs(60 + 16));
        // Eight at once share the link: each is given the time of all eight.
        assert_eq!(piece_deadline(4 << 20, 8), Duration::from_secs(60 + 128));
        assert_eq!(piece_deadline(4 << 20, 0), piece_deadline(4 << 20, 1));
    }
}
