//! Preheat: pull every piece of a model revision into the mirror's cache before nodes ask,
//! through the same single flight as requests (a preheat and a puller never fetch one piece
//! twice).

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::stream::{self, StreamExt};
use serde::{Deserialize, Serialize};

use super::Mirror;
use crate::http_error::ServeError;
use crate::manifest::ModelRef;

/// Body of `POST /v1/preheat`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PreheatRequest {
    /// `NAME`, `NAME:TAG` or `NAME@REVISION`.
    pub model: String,
}

/// Answer of a preheat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreheatReport {
    /// Model.
    pub model: String,
    /// Revision resolved.
    pub revision: String,
    /// Distinct blobs.
    pub blobs: usize,
    /// Pieces of those blobs.
    pub pieces: u64,
    /// Pieces that were already cached.
    pub pieces_already_cached: u64,
    /// Pieces fetched from the origin (or joined from a request in flight).
    pub pieces_fetched: u64,
    /// Bytes of the distinct blobs.
    pub bytes: u64,
    /// The cache bound; a model larger than it cannot stay whole in the cache.
    pub cache_max_bytes: u64,
}

/// Preheats `model` (a [`ModelRef`] string).
pub async fn preheat(mirror: &Arc<Mirror>, model: &str) -> Result<PreheatReport, ServeError> {
    let mref = ModelRef::parse(model).map_err(|e| ServeError::bad_request(e.to_string()))?;
    let _slot = Arc::clone(&mirror.preheats)
        .try_acquire_owned()
        .map_err(|_| {
            ServeError::busy(format!("{} preheats already running", super::MAX_PREHEATS))
        })?;
    let resolved = mirror
        .manifests
        .resolve(mirror.origin.as_ref(), &mref)
        .await?;
    let m = resolved.manifest;
    let blobs: BTreeMap<_, _> = m
        .files
        .iter()
        .map(|f| (f.hash, Arc::new(f.clone())))
        .collect();
    let jobs: Vec<_> = blobs
        .values()
        .flat_map(|e| (0..e.pieces.len() as u64).map(move |i| (Arc::clone(e), i)))
        .collect();
    let mut report = PreheatReport {
        model: m.model.clone(),
        revision: m.revision.clone(),
        blobs: blobs.len(),
        pieces: jobs.len() as u64,
        pieces_already_cached: 0,
        pieces_fetched: 0,
        bytes: blobs.values().map(|e| e.size).sum(),
        cache_max_bytes: mirror.cache.max_bytes(),
    };
    let mut results = stream::iter(jobs)
        .map(|(e, i)| {
            let mirror = Arc::clone(mirror);
            async move { mirror.ensure_piece(e, i).await }
        })
        .buffer_unordered(mirror.preheat_parallel);
    while let Some(r) = results.next().await {
        match r? {
            true => report.pieces_already_cached += 1,
            false => report.pieces_fetched += 1,
        }
    }
    Ok(report)
}

/// Asks the mirror at `mirror_url` (`http://HOST:PORT`) to preheat `model` and waits for it,
/// sending `token` if the mirror needs one and checking an `https://` mirror against `trust`.
pub async fn preheat_remote(
    mirror_url: &str,
    model: &str,
    token: Option<crate::auth::AccessToken>,
    trust: &crate::tls::ClientTrust,
    timeout: std::time::Duration,
) -> Result<PreheatReport, crate::MirrorError> {
    use crate::http_client::{base_url, client, post_json, send, Timeouts, IDLE_TIMEOUT};
    ModelRef::parse(model)?;
    let remote = |reason: String| crate::MirrorError::Remote {
        url: mirror_url.to_string(),
        reason,
    };
    let base = base_url(mirror_url).map_err(remote)?;
    let tls = base
        .starts_with("https://")
        .then(|| trust.client_config())
        .transpose()?;
    let url = format!("{base}/v1/preheat");
    let body = serde_json::to_vec(&PreheatRequest {
        model: model.to_string(),
    })
    .expect("invariant: a preheat request serializes");
    let req = post_json(&url, body).map_err(|e| remote(e.to_string()))?;
    // The mirror answers when the preheat is done: the head may take up to `timeout`.
    let timeouts = Timeouts {
        head: timeout,
        idle: IDLE_TIMEOUT,
        total: timeout,
    };
    let (_, bytes) = send(&client(token, tls), req, 1 << 20, timeouts)
        .await
        .map_err(|e| remote(format!("preheat of {model}: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| remote(format!("unexpected preheat answer: {e}")))
}
