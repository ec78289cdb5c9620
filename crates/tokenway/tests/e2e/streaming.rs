//! Streaming through the gateway is the backend's stream, unchanged and unbuffered.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use crate::harness::*;

#[tokio::test]
async fn streamed_events_through_the_gateway_equal_the_backends_own() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "");
    let body = chat("tell me about head-of-line blocking", true, 24);
    let direct = post(
        &format!("{}/v1/chat/completions", backend.url()),
        &body,
        None,
    )
    .await;
    let via = post(&format!("{}/v1/chat/completions", gw.url()), &body, None).await;
    assert_eq!(direct.status, 200, "{}", direct.body);
    assert_eq!(via.status, 200, "{}", via.body);
    assert_eq!(
        via.headers
            .get("content-type")
            .map(|v| v.to_str().unwrap_or("")),
        Some("text/event-stream")
    );
    let d: Vec<_> = data_events(&direct.body)
        .iter()
        .map(|e| normalize(e))
        .collect();
    let v: Vec<_> = data_events(&via.body)
        .iter()
        .map(|e| normalize(e))
        .collect();
    assert!(
        d.len() >= 25,
        "24 tokens, role chunk, finish and [DONE]: {d:?}"
    );
    assert_eq!(d, v);
    assert_eq!(v.last().map(String::as_str), Some("[DONE]"));
}

#[tokio::test]
async fn non_streaming_and_completions_answers_pass_through_unchanged() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "");
    let chat_body = chat("a whole answer at once", false, 12);
    let completion =
        r#"{"model":"sim-model","prompt":"Once upon a time","max_tokens":8,"stream":true}"#;
    for (path, body) in [
        ("/v1/chat/completions", chat_body.as_str()),
        ("/v1/completions", completion),
    ] {
        let direct = post(&format!("{}{path}", backend.url()), body, None).await;
        let via = post(&format!("{}{path}", gw.url()), body, None).await;
        assert_eq!(via.status, 200, "{}", via.body);
        let d: Vec<_> = data_events(&direct.body)
            .iter()
            .map(|e| normalize(e))
            .collect();
        let v: Vec<_> = data_events(&via.body)
            .iter()
            .map(|e| normalize(e))
            .collect();
        if d.is_empty() {
            assert_eq!(normalize(&direct.body), normalize(&via.body), "{path}");
        } else {
            assert_eq!(d, v, "{path}");
        }
    }
}

/// Arrival times of the body frames of a streaming request.
async fn arrivals(url: &str, body: &str) -> Vec<Instant> {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = client().request(req).await.expect("response");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut times = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("frame");
        if let Some(d) = frame.data_ref() {
            let events = d.windows(5).filter(|w| w == b"data:").count();
            for _ in 0..events {
                times.push(Instant::now());
            }
        }
    }
    times
}

fn gaps(times: &[Instant]) -> Vec<Duration> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

#[tokio::test]
async fn event_spacing_through_the_gateway_matches_the_backends() {
    // 40 ms between tokens: a buffering proxy would deliver several events together.
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 40.0\n");
    let gw = gateway(&[&backend], "", "");
    let body = chat("spacing", true, 10);
    let direct = arrivals(&format!("{}/v1/chat/completions", backend.url()), &body).await;
    let via = arrivals(&format!("{}/v1/chat/completions", gw.url()), &body).await;
    assert_eq!(direct.len(), via.len());
    let (dg, vg) = (gaps(&direct), gaps(&via));
    // Token events (between the first content event and the finish event) arrive one by one.
    let token_gaps_via: Vec<_> = vg[1..vg.len() - 2].to_vec();
    let spaced = token_gaps_via
        .iter()
        .filter(|g| **g >= Duration::from_millis(20))
        .count();
    assert!(
        spaced * 10 >= token_gaps_via.len() * 8,
        "events through the gateway were coalesced: direct gaps {dg:?}, via {vg:?}"
    );
    let mut d_sorted = dg[1..dg.len() - 2].to_vec();
    let mut v_sorted = token_gaps_via.clone();
    d_sorted.sort();
    v_sorted.sort();
    let (dm, vm) = (d_sorted[d_sorted.len() / 2], v_sorted[v_sorted.len() / 2]);
    assert!(
        vm.abs_diff(dm) < Duration::from_millis(15),
        "median gap direct {dm:?} vs via gateway {vm:?}"
    );
}

#[tokio::test]
async fn gateway_metrics_count_requests_and_measure_ttft() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "");
    for i in 0..3 {
        let r = post(
            &format!("{}/v1/chat/completions", gw.url()),
            &chat(&format!("metrics {i}"), true, 4),
            None,
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let text = metrics_reaching(
        &gw.url(),
        "tokenway_request_duration_seconds_count{route=\"/v1/chat/completions\"",
        3.0,
    )
    .await;
    assert_eq!(
        metric_sum(
            &text,
            "tokenway_requests_total{route=\"/v1/chat/completions\",backend=\"b0\",status=\"200\"}"
        ),
        3.0,
        "{text}"
    );
    assert_eq!(
        metric_sum(&text, "tokenway_ttft_seconds_count{route=\"/v1/chat/completions\",backend=\"b0\",transport=\"h1\","),
        3.0,
        "{text}"
    );
    assert!(
        metric_sum(&text, "tokenway_inter_token_seconds_count") >= 6.0,
        "{text}"
    );
    assert_eq!(
        metric_sum(&text, "tokenway_backend_healthy{backend=\"b0\""),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric_sum(&text, "tokenway_backend_inflight{backend=\"b0\""),
        0.0,
        "{text}"
    );

    // Two non-streaming answers (a body of known length, which the client connection does
    // not poll past its last byte) and an error answer from the backend: every one has a
    // duration, only the two real answers have a first token.
    for (body, status) in [
        (chat("whole 1", false, 4), 200),
        (chat("whole 2", false, 4), 200),
        (
            r#"{"model":"sim-model","max_tokens":0,"messages":[{"role":"user","content":"x"}]}"#
                .to_string(),
            400,
        ),
    ] {
        let r = post(&format!("{}/v1/chat/completions", gw.url()), &body, None).await;
        assert_eq!(r.status, status, "{}", r.body);
    }
    let text = metrics_reaching(
        &gw.url(),
        "tokenway_request_duration_seconds_count{route=\"/v1/chat/completions\"",
        6.0,
    )
    .await;
    let series = |name: &str| {
        metric_sum(
            &text,
            &format!("{name}{{route=\"/v1/chat/completions\",backend=\"b0\",transport=\"h1\","),
        )
    };
    assert_eq!(
        series("tokenway_request_duration_seconds_count"),
        6.0,
        "{text}"
    );
    assert_eq!(series("tokenway_ttft_seconds_count"), 5.0, "{text}");
}
