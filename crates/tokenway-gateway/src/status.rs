//! The operator's view: `/admin/backends` (the router's snapshot as JSON) and `/status` (the same
//! as a small HTML page: state, RTT, load, TTFT, cache-hit estimate per backend).

use std::fmt::Write as _;
use std::time::Instant;

use http::{header, HeaderValue, Response};
use tokenway_router::RouterSnapshot;

use crate::error::{full, ResponseBody};
use crate::state::Shared;

/// `GET /admin/backends`.
pub fn backends_json(shared: &Shared) -> Response<ResponseBody> {
    let snapshot = shared.router().snapshot(Instant::now());
    let body = serde_json::to_vec_pretty(&snapshot).unwrap_or_else(|e| {
        format!("{{\"error\":\"cannot encode the router snapshot: {e}\"}}").into_bytes()
    });
    let mut r = Response::new(full(body));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// `GET /status`.
pub fn page(shared: &Shared) -> Response<ResponseBody> {
    let snapshot = shared.router().snapshot(Instant::now());
    let mut r = Response::new(full(render(&snapshot)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    r
}

fn ms(v: Option<f64>) -> String {
    v.map_or("–".to_string(), |v| format!("{v:.1} ms"))
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn render(s: &RouterSnapshot) -> String {
    let mut out = String::with_capacity(4096);
    out.push_str(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"2\">\
         <title>gateway status</title><style>body{font-family:sans-serif;margin:2em}\
         table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}\
         td:first-child,th:first-child{text-align:left}.ejected{background:#fdd}</style></head><body>\n",
    );
    let _ = writeln!(
        out,
        "<h1>Backends</h1><p>policy <b>{}</b>, hedging {}, hedges sent {}</p>",
        escape(s.policy),
        if s.hedging { "on" } else { "off" },
        s.hedges_sent
    );
    out.push_str(
        "<table><tr><th>backend</th><th>region</th><th>state</th><th>RTT</th><th>in flight</th>\
         <th>engine waiting / running</th><th>KV cache</th><th>TTFT ewma</th><th>TTFT p95</th>\
         <th>prefill tok/s</th><th>cache-hit estimate</th></tr>\n",
    );
    for b in &s.backends {
        let state = format!("{:?}", b.state).to_lowercase();
        let class = if state.contains("eject") {
            " class=\"ejected\""
        } else {
            ""
        };
        let (load, kv) = match &b.load {
            Some(l) => (
                format!("{} / {}", l.waiting, l.running),
                l.kv_cache_usage
                    .map_or("–".to_string(), |k| format!("{:.0}%", k * 100.0)),
            ),
            None => ("–".to_string(), "–".to_string()),
        };
        let _ = writeln!(
            out,
            "<tr{class}><td>{}</td><td>{}</td><td>{}{}</td><td>{}</td><td>{} / {}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{:.0}</td><td>{}</td></tr>",
            escape(&b.name),
            escape(&b.region),
            escape(&state),
            b.eject_reason
                .map_or(String::new(), |r| format!(" ({})", escape(r))),
            ms(b.rtt_ms),
            b.inflight,
            b.max_inflight,
            load,
            kv,
            ms(b.ewma_ttft_ms),
            ms(b.p95_ttft_ms),
            b.prefill_tokens_per_s,
            b.cache_hit_ratio
                .map_or("–".to_string(), |r| format!("{:.0}%", r * 100.0)),
        );
    }
    out.push_str("</table><p><a href=\"/admin/backends\">JSON</a> · <a href=\"/metrics\">metrics</a></p></body></html>\n");
    out
}
