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
use tokenway_router::{BackendId, LoadSignal};

use crate::state::Shared;
use crate::upstream_h1::is_local_failure;

/// How often a backend's learned model list is fetched again (sooner after it was
/// re-admitted or answered 404: see `Upstream::models_stale`).
const MODELS_REFRESH: std::time::Duration = std::time::Duration::from_secs(30);

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
    let load_every =
        std::time::Duration::from_millis(shared.config.routing.load_signal_interval_ms);
    let mut last_load: Option<Instant> = None;
    let mut models_at: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        if shared.upstream(id).removed.load(Ordering::Relaxed) {
            return;
        }
        let sent = Instant::now();
        let result = probe_once(&shared, id).await;
        if result == Probe::Local {
            tracing::warn!(backend = %shared.upstream(id).name, "this gateway could not open a probe connection (out of file descriptors or ports?)");
            continue;
        }
        let ok = result == Probe::Ok;
        let now = Instant::now();
        let transition = {
            let mut router = shared.router();
            match result {
                // The probe is a tiny request on a pooled connection: its round trip is the
                // network RTT plus the backend's own scheduling, which is what a request pays.
                Probe::Ok => {
                    router.on_rtt_sample(id, now - sent, now);
                    router.on_probe(id, true, now)
                }
                Probe::TimedOut => router.on_probe_timeout(id, now),
                Probe::Failed | Probe::Local => router.on_probe(id, false, now),
            }
        };
        shared.note_transition(id, transition);
        if ok
            && shared.config.routing.load_signals
            && last_load.is_none_or(|t| now - t >= load_every)
        {
            last_load = Some(now);
            if let Some(signal) = scrape_load(&shared, id).await {
                shared.router().on_load_signal(id, signal, Instant::now());
            }
        }
        let u = shared.upstream(id);
        if ok && !u.models_configured {
            let stale = u.models_stale.swap(false, Ordering::Relaxed);
            if stale
                || !u.models_known.load(Ordering::Relaxed)
                || models_at.is_none_or(|t| now - t >= MODELS_REFRESH)
            {
                models_at = Some(now);
                learn_models(&shared, id).await;
            }
        }
    }
}

async fn get(
    shared: &Shared,
    id: BackendId,
    path: &str,
) -> Option<http::Response<hyper::body::Incoming>> {
    request(shared, id, path).await.ok()
}

/// How a health probe ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// A 2xx answer.
    Ok,
    /// Another answer, or no connection (refused, reset).
    Failed,
    /// No answer within `probe_timeout_ms` (a dead host, or an engine too busy to answer):
    /// capped by the router as passive ejections are.
    TimedOut,
    /// This host could not even try (out of descriptors or ports: see [`is_local_failure`]),
    /// which says nothing about the backend.
    Local,
}

/// `GET path` on backend `id`: the answer, or how it failed (never [`Probe::Ok`]).
async fn request(
    shared: &Shared,
    id: BackendId,
    path: &str,
) -> Result<http::Response<hyper::body::Incoming>, Probe> {
    let u = shared.upstream(id);
    let mut parts = u.base.clone().into_parts();
    parts.path_and_query = format!("{}{path}", u.path_prefix).parse().ok();
    let uri = Uri::from_parts(parts).map_err(|_| Probe::Failed)?;
    let mut req = Request::get(uri)
        .body(Full::new(Bytes::new()))
        .map_err(|_| Probe::Failed)?;
    if let Some(auth) = &u.authorization {
        req.headers_mut()
            .insert(http::header::AUTHORIZATION, auth.clone());
    }
    let timeout = std::time::Duration::from_millis(shared.config.health.probe_timeout_ms);
    match tokio::time::timeout(timeout, shared.client.request(req)).await {
        Err(_) => Err(Probe::TimedOut),
        Ok(Ok(resp)) => Ok(resp),
        Ok(Err(e)) => {
            let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(c) = cause {
                if let Some(io) = c.downcast_ref::<std::io::Error>() {
                    return Err(if is_local_failure(io) {
                        Probe::Local
                    } else {
                        Probe::Failed
                    });
                }
                cause = c.source();
            }
            Err(Probe::Failed)
        }
    }
}

/// How backend `id` answered its health probe.
async fn probe_once(shared: &Shared, id: BackendId) -> Probe {
    let timeout = std::time::Duration::from_millis(shared.config.health.probe_timeout_ms);
    let u = shared.upstream(id);
    let path = u
        .health_path
        .as_deref()
        .unwrap_or(&shared.config.health.probe_path);
    let resp = match request(shared, id, path).await {
        Ok(resp) => resp,
        Err(failed) => return failed,
    };
    let ok = if resp.status().is_success() {
        Probe::Ok
    } else {
        Probe::Failed
    };
    // Drain the (small) body so the pooled connection can be reused.
    let _ =
        tokio::time::timeout(timeout, Limited::new(resp.into_body(), 64 * 1024).collect()).await;
    ok
}

/// Largest `/metrics` answer read from a backend.
const METRICS_BODY_LIMIT: usize = 4 << 20;

/// Reads the engine's own load gauges from its `/metrics` (vLLM or SGLang names).
async fn scrape_load(shared: &Shared, id: BackendId) -> Option<LoadSignal> {
    let timeout = std::time::Duration::from_millis(shared.config.health.probe_timeout_ms);
    let resp = get(shared, id, "/metrics").await?;
    if !resp.status().is_success() {
        return None;
    }
    let body = tokio::time::timeout(
        timeout,
        Limited::new(resp.into_body(), METRICS_BODY_LIMIT).collect(),
    )
    .await
    .ok()?
    .ok()?
    .to_bytes();
    parse_load(std::str::from_utf8(&body).ok()?)
}

/// Sums the load gauges of vLLM (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
/// `vllm:gpu_cache_usage_perc` or `vllm:kv_cache_usage_perc`) or SGLang
/// (`sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage`) over their label
/// sets. `None` when the text has none of them.
pub fn parse_load(text: &str) -> Option<LoadSignal> {
    let (mut waiting, mut running, mut kv, mut seen, mut kv_seen) =
        (0f64, 0f64, 0f64, false, false);
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((name_labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = name_labels.split('{').next().unwrap_or(name_labels);
        // Only the few gauges read here are parsed: an engine's /metrics is mostly histogram
        // buckets, and this runs on a front thread every `load_signal_interval_ms`.
        let gauge = match name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => 0,
            "vllm:num_requests_running" | "sglang:num_running_reqs" => 1,
            "vllm:gpu_cache_usage_perc" | "vllm:kv_cache_usage_perc" | "sglang:token_usage" => 2,
            _ => continue,
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        if !v.is_finite() {
            continue;
        }
        match gauge {
            0 => waiting += v,
            1 => running += v,
            _ => {
                kv = kv.max(v);
                kv_seen = true;
                continue;
            }
        }
        seen = true;
    }
    (seen || kv_seen).then(|| LoadSignal {
        waiting: waiting.clamp(0.0, u32::MAX as f64) as u32,
        running: running.clamp(0.0, u32::MAX as f64) as u32,
        kv_cache_usage: kv_seen.then_some(kv.clamp(0.0, 1.0)),
    })
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
    let mut ids: Vec<String> = entries
        .iter()
        .filter_map(|e| e.get("id").and_then(|v| v.as_str()).map(str::to_string))
        .collect();
    tracing::info!(backend = %u.name, models = ?ids, "learned models");
    if u.wildcard {
        ids.push(crate::state::WILDCARD_MODEL.to_owned());
    }
    shared.router().set_models(id, ids);
    *u.model_entries.lock().unwrap_or_else(|p| p.into_inner()) = entries;
    u.models_known.store(true, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_sglang_load_gauges_are_read() {
        let vllm = "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{model_name=\"a\"} 3.0\nvllm:num_requests_waiting{model_name=\"b\"} 2\n\
            vllm:num_requests_running{model_name=\"a\"} 7\nvllm:gpu_cache_usage_perc{model_name=\"a\"} 0.5\n";
        let s = parse_load(vllm).expect("signal");
        assert_eq!((s.waiting, s.running, s.kv_cache_usage), (5, 7, Some(0.5)));
        let sglang = "sglang:num_queue_reqs{m=\"x\"} 4\nsglang:num_running_reqs{m=\"x\"} 1\n";
        let s = parse_load(sglang).expect("signal");
        assert_eq!((s.waiting, s.running, s.kv_cache_usage), (4, 1, None));
        assert!(parse_load("tokenway_requests_total 3\nnonsense\n").is_none());
        assert!(parse_load("vllm:num_requests_waiting NaN\n").is_none());
    }
}
