//! Backends that die: retries before the first byte, clean error events after it, ejection.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use crate::harness::*;

const FAST_PROBES: &str = "[health]\nprobe_interval_ms = 100\nprobe_timeout_ms = 300\n";

#[tokio::test]
async fn a_request_whose_backend_dies_before_the_first_byte_is_retried_on_another() {
    // b0 holds its first token back for 3 s; b1 answers at once.
    let mut slow = sim(
        "base_latency_ms = 1.0\ntime_per_output_token_ms = 2.0\n[faults]\nslow_start_ms = 3000.0\n",
    );
    let fast = sim(FAST_SIM);
    let gw = gateway(&[&slow, &fast], "policy = \"round_robin\"", "");
    let url = format!("{}/v1/chat/completions", gw.url());
    // Round robin sends one of two concurrent requests to each backend.
    let requests: Vec<_> = (0..2)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(
                async move { post(&url, &chat(&format!("retry me {i}"), true, 8), None).await },
            )
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    slow.kill();
    for r in requests {
        let reply = r.await.expect("task");
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(
            reply
                .headers
                .get("x-tokenway-backend")
                .and_then(|v| v.to_str().ok()),
            Some("b1"),
            "served by the surviving backend"
        );
        let events = data_events(&reply.body);
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{}",
            reply.body
        );
        assert!(!reply.body.contains("\"error\""), "{}", reply.body);
    }
    // Requests that start after the death succeed too.
    for i in 0..6 {
        let r = post(&url, &chat(&format!("after {i}"), true, 4), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

#[tokio::test]
async fn a_stream_cut_after_its_first_byte_ends_with_an_error_event_not_a_hang() {
    let mut backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 50.0\n");
    let gw = gateway(&[&backend], "", "");
    let req = http::Request::post(format!("{}/v1/chat/completions", gw.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(chat("cut me", true, 200))))
        .expect("request");
    let resp = client().request(req).await.expect("response");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut seen = String::new();
    while data_events(&seen).len() < 3 {
        let frame = body.frame().await.expect("more frames").expect("frame");
        if let Some(d) = frame.data_ref() {
            seen.push_str(&String::from_utf8_lossy(d));
        }
    }
    backend.kill();
    let rest = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("the stream ends instead of hanging")
        .expect("the stream ends cleanly");
    seen.push_str(&String::from_utf8_lossy(&rest.to_bytes()));
    let events = data_events(&seen);
    let last = events.last().expect("events");
    let v: serde_json::Value = serde_json::from_str(last).expect("the last event is JSON");
    assert_eq!(v["error"]["type"], "upstream_error", "{seen}");
    assert!(!seen.contains("[DONE]"));
    metric_is(
        &gw,
        "tokenway_stream_errors_total{backend=\"b0\",region=\"local\",cause=\"upstream_failed\"}",
        1.0,
    )
    .await;
}

#[tokio::test]
async fn a_backends_own_error_event_is_relayed_and_counted_as_its_failure() {
    let backend = sim(&format!("{FAST_SIM}[faults]\nerror_after_tokens = 2\n"));
    let gw = gateway(&[&backend], "", "");
    let r = post(
        &format!("{}/v1/chat/completions", gw.url()),
        &chat("fail after two", true, 8),
        None,
    )
    .await;
    assert_eq!(r.status, 200);
    let events = data_events(&r.body);
    // The role chunk, two tokens, vLLM's error event and [DONE], as the backend sent them.
    assert_eq!(events.len(), 5, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&events[3]).expect("JSON");
    assert_eq!(v["error"]["type"], "server_error", "{}", r.body);
    assert_eq!(events[4], "[DONE]");
    metric_is(&gw, "tokenway_stream_errors_total{backend=\"b0\",region=\"local\",cause=\"backend_error_event\"}", 1.0).await;
}

#[tokio::test]
async fn a_stream_that_opens_with_the_backends_error_event_is_retried_on_another_backend() {
    // b0 fails every request in prefill as vLLM does: a 200, then only an error event.
    let failing = sim(&format!("{FAST_SIM}[faults]\nerror_after_tokens = 0\n"));
    let good = sim(FAST_SIM);
    let gw = gateway(&[&failing, &good], "policy = \"round_robin\"", "");
    for i in 0..4 {
        let r = post(
            &format!("{}/v1/chat/completions", gw.url()),
            &chat(&format!("prefill fails {i}"), true, 4),
            None,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(!r.body.contains("\"error\""), "request {i}: {}", r.body);
        assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
        assert_eq!(
            r.headers
                .get("x-tokenway-backend")
                .and_then(|v| v.to_str().ok()),
            Some("b1")
        );
    }
    // The failures count against b0, and its instant errors never passed for first tokens.
    let text = get(&format!("{}/metrics", gw.url())).await.body;
    assert_eq!(
        metric_sum(
            &text,
            "tokenway_ttft_seconds_count{route=\"/v1/chat/completions\",backend=\"b0\""
        ),
        0.0,
        "{text}"
    );
}

#[tokio::test]
async fn probes_eject_a_dead_backend_and_readmit_it_when_it_returns() {
    let mut a = sim(FAST_SIM);
    let addr = a.addr;
    let b = sim(FAST_SIM);
    let gw = gateway(&[&a, &b], "", FAST_PROBES);
    let metrics = format!("{}/metrics", gw.url());
    let healthy = |text: &str| metric_sum(text, "tokenway_backend_healthy{backend=\"b0\"");
    a.kill();
    let ejected = eventually(Duration::from_secs(5), || async {
        healthy(&get(&metrics).await.body) == 0.0
    })
    .await;
    assert!(ejected, "b0 was not ejected after its death");
    // With b0 ejected every request goes to b1, without a failed attempt first.
    for i in 0..5 {
        let r = post(
            &format!("{}/v1/chat/completions", gw.url()),
            &chat(&format!("e{i}"), false, 2),
            None,
        )
        .await;
        assert_eq!(r.status, 200);
        assert_eq!(
            r.headers
                .get("x-tokenway-backend")
                .and_then(|v| v.to_str().ok()),
            Some("b1")
        );
    }
    let _back = sim_at(addr, FAST_SIM);
    let readmitted = eventually(Duration::from_secs(5), || async {
        healthy(&get(&metrics).await.body) == 1.0
    })
    .await;
    assert!(readmitted, "b0 was not re-admitted after it came back");
}

#[tokio::test]
async fn no_healthy_backend_is_a_503_with_retry_after() {
    let mut a = sim(FAST_SIM);
    let gw = gateway(&[&a], "", FAST_PROBES);
    a.kill();
    let metrics = format!("{}/metrics", gw.url());
    assert!(
        eventually(Duration::from_secs(5), || async {
            metric_sum(
                &get(&metrics).await.body,
                "tokenway_backend_healthy{backend=\"b0\"",
            ) == 0.0
        })
        .await
    );
    let r = post(
        &format!("{}/v1/chat/completions", gw.url()),
        &chat("x", true, 2),
        None,
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.headers.contains_key("retry-after"));
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("OpenAI error JSON");
    assert_eq!(v["error"]["code"], "no_healthy_backend");
}

/// A gateway with one backend of `max_inflight = 1`, the top-level keys `top` and the
/// `[timeouts]` lines `timeouts`, in front of a sim whose answers take `tpot_ms` per token.
fn one_slot_gateway(tpot_ms: u32, top: &str, timeouts: &str) -> (Proc, Proc) {
    let backend = sim(&format!(
        "base_latency_ms = 1.0\ntime_per_output_token_ms = {tpot_ms}.0\n"
    ));
    let gw = start_args_with_config(
        "gateway",
        &format!(
            "listen = \"127.0.0.1:0\"\n{top}\n[timeouts]\n{timeouts}\n\n\
             [[backends]]\nname = \"b0\"\nurl = \"{}\"\nmodels = [\"sim-model\"]\nmax_inflight = 1\n",
            backend.url()
        ),
    );
    (backend, gw)
}

#[tokio::test]
async fn requests_beyond_a_full_backend_wait_for_its_slot_instead_of_a_503() {
    // One slot, answers of ~400 ms: three at once means two wait their turn.
    let (_backend, gw) = one_slot_gateway(50, "", "");
    let url = format!("{}/v1/chat/completions", gw.url());
    let requests: Vec<_> = (0..3)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(
                async move { post(&url, &chat(&format!("queued {i}"), true, 8), None).await },
            )
        })
        .collect();
    for r in requests {
        let reply = r.await.expect("task");
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(
            data_events(&reply.body).last().map(String::as_str),
            Some("[DONE]"),
            "{}",
            reply.body
        );
    }
    let metrics = get(&format!("{}/metrics", gw.url())).await.body;
    assert!(
        metric_sum(&metrics, "tokenway_queue_admitted_total") >= 2.0,
        "{metrics}"
    );
    assert_eq!(metric_sum(&metrics, "tokenway_queue_refused_total"), 0.0);
    assert_eq!(metric_sum(&metrics, "tokenway_queue_waiting"), 0.0);
}

/// Waits until the gateway's metric `series` (a prefix of its lines) sums to `value`.
async fn metric_is(gw: &Proc, series: &str, value: f64) {
    let url = format!("{}/metrics", gw.url());
    let reached = eventually(Duration::from_secs(10), || async {
        metric_sum(&get(&url).await.body, series) == value
    })
    .await;
    assert!(
        reached,
        "{series} never reached {value}: {}",
        get(&url).await.body
    );
}

#[tokio::test]
async fn the_wait_for_a_slot_is_bounded_in_places_and_in_time() {
    // One slot, held ~6 s by the first request; room for one waiter, for 2 s.
    let (_backend, gw) = one_slot_gateway(200, "queue_max = 1", "queue_ms = 2000");
    let url = format!("{}/v1/chat/completions", gw.url());
    let send = |tag: &'static str| {
        let url = url.clone();
        tokio::spawn(async move { post(&url, &chat(tag, true, 30), None).await })
    };
    let holder = send("holds the slot");
    metric_is(&gw, "tokenway_backend_inflight{backend=\"b0\"", 1.0).await;
    let waiter = send("waits");
    metric_is(&gw, "tokenway_queue_waiting", 1.0).await;
    let saturated = |r: &Reply, why: &str| {
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(r.headers.contains_key("retry-after"), "{:?}", r.headers);
        let v: serde_json::Value = serde_json::from_str(&r.body).expect("OpenAI error JSON");
        assert_eq!(v["error"]["code"], "backends_saturated", "{}", r.body);
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(why), "{message}");
    };
    // The one place in the queue is taken: refused at once.
    let full = send("finds the queue full").await.expect("task");
    saturated(&full, "queue_max");
    // The waiter's two seconds are up long before the slot frees.
    saturated(&waiter.await.expect("task"), "timeouts.queue_ms");
    let held = holder.await.expect("task");
    assert_eq!(held.status, 200, "{}", held.body);
    // The slot is free again, and nobody waits.
    let after = post(&url, &chat("after", true, 2), None).await;
    assert_eq!(after.status, 200, "{}", after.body);
    let metrics = get(&format!("{}/metrics", gw.url())).await.body;
    assert_eq!(
        metric_sum(&metrics, "tokenway_queue_refused_total"),
        2.0,
        "{metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "tokenway_queue_waiting"),
        0.0,
        "{metrics}"
    );
}

#[tokio::test]
async fn without_a_queue_a_full_backend_is_a_503_at_once() {
    let (_backend, gw) = one_slot_gateway(100, "queue_max = 0", "");
    let url = format!("{}/v1/chat/completions", gw.url());
    let holder = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, &chat("holds the slot", true, 20), None).await })
    };
    metric_is(&gw, "tokenway_backend_inflight{backend=\"b0\"", 1.0).await;
    let r = post(&url, &chat("refused", true, 2), None).await;
    assert_eq!(r.status, 503, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("OpenAI error JSON");
    assert_eq!(v["error"]["code"], "backends_saturated", "{}", r.body);
    let metrics = get(&format!("{}/metrics", gw.url())).await.body;
    assert_eq!(
        metric_sum(&metrics, "tokenway_queue_refused_total"),
        1.0,
        "{metrics}"
    );
    assert_eq!(holder.await.expect("task").status, 200);
}
