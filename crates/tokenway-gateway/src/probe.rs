//! Active health probes: `GET /health` to every backend on an interval, and `GET /v1/models` to
//! learn what a backend serves when the config does not say.
//!
//! One task per backend, so a slow or hung backend never delays the probing of the others.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use tokenway_router::BackendId;

use crate::state::Shared;

/// Largest `/v1/models` answer read from a backend.
const MODELS_BODY_LIMIT: usize = 1 << 20;

/// Probes backend `id` until `shutdown` fires.
pub async fn run(
    shared: Arc<Shared>,
    id: BackendId,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let interval = std::time::Duration::from_millis(shared.config.health.probe_interval_ms);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        let ok = probe_once(&shared, id).await;
        let transition = shared.router().on_probe(id, ok, Instant::now());
        shared.note_transition(id, transition);
        let u = shared.upstream(id);
        if ok && !u.models_configured && !u.models_known.load(Ordering::Relaxed) {
            learn_models(&shared, id).await;
        }
    }
}

async fn get(
    shared: &Shared,
    id: BackendId,
    path: &str,
) -> Option<http::Response<hyper::body::Incoming>> {
    let u = shared.upstream(id);
    let mut parts = u.base.clone().into_parts();
    parts.path_and_query = path.parse().ok();
    let uri = Uri::from_parts(parts).ok()?;
    let mut req = Request::get(uri).body(Full::new(Bytes::new())).ok()?;
    if let Some(auth) = &u.authorization {
        req.headers_mut()
            .insert(http::header::AUTHORIZATION, auth.clone());
    }
    let timeout = std::time::Duration::from_millis(shared.config.health.probe_timeout_ms);
    tokio::time::timeout(timeout, shared.client.request(req))
        .await
        .ok()?
        .ok()
}

async fn probe_once(shared: &Shared, id: BackendId) -> bool {
    let timeout = std::time::Duration::from_millis(shared.config.health.probe_timeout_ms);
    let Some(resp) = get(shared, id, "/health").await else {
        return false;
    };
    let ok = resp.status().is_success();
    // Drain the (small) body so the pooled connection can be reused.
    let _ =
        tokio::time::timeout(timeout, Limited::new(resp.into_body(), 64 * 1024).collect()).await;
    ok
}

/// Fetches the backend's `/v1/models` and hands the ids to the router.
async fn learn_models(shared: &Shared, id: BackendId) {
    let timeout = std::time::Duration::from_millis(shared.config.health.probe_timeout_ms);
    let Some(resp) = get(shared, id, "/v1/models").await else {
        return;
    };
    if !resp.status().is_success() {
        return;
    }
    let Ok(Ok(body)) = tokio::time::timeout(
        timeout,
        Limited::new(resp.into_body(), MODELS_BODY_LIMIT).collect(),
    )
    .await
    else {
        return;
    };
    let u = shared.upstream(id);
    let entries: Vec<serde_json::Value> =
        match serde_json::from_slice::<serde_json::Value>(&body.to_bytes()) {
            Ok(v) => v
                .get("data")
                .and_then(|d| d.as_array())
                .cloned()
                .unwrap_or_default(),
            Err(e) => {
                tracing::warn!(backend = %u.name, error = %e, "backend /v1/models is not JSON");
                return;
            }
        };
    let ids: Vec<String> = entries
        .iter()
        .filter_map(|e| e.get("id").and_then(|v| v.as_str()).map(str::to_string))
        .collect();
    tracing::info!(backend = %u.name, models = ?ids, "learned models");
    shared.router().set_models(id, ids);
    *u.model_entries.lock().unwrap_or_else(|p| p.into_inner()) = entries;
    u.models_known.store(true, Ordering::Relaxed);
}
