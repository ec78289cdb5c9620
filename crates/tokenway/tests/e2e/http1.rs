//! The gateway's own HTTP/1.1 front on a raw socket: pipelining, chunked request bodies,
//! HTTP/1.0, and clients that leave before their answer is done.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::*;

/// Everything the gateway sends until it closes the connection.
async fn read_until_closed(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .expect("the gateway closes the connection in time")
        .expect("read");
    String::from_utf8_lossy(&buf).into_owned()
}

fn post_head(body_len: usize, extra: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {body_len}\r\n{extra}\r\n"
    )
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order_on_one_connection() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "");
    let stream = chat("first", true, 3);
    let plain = chat("second", false, 3);
    let wire = format!(
        "GET /health HTTP/1.1\r\nhost: x\r\n\r\n{}{stream}{}{plain}\
         GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        post_head(stream.len(), ""),
        post_head(plain.len(), ""),
    );
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(wire.as_bytes()).await.expect("write");
    let text = read_until_closed(&mut s).await;
    let heads: Vec<usize> = text
        .match_indices("HTTP/1.1 200 OK\r\n")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(heads.len(), 4, "four answers: {text}");
    let (health, events, completion, models) = (
        &text[heads[0]..heads[1]],
        &text[heads[1]..heads[2]],
        &text[heads[2]..heads[3]],
        &text[heads[3]..],
    );
    assert!(health.ends_with("ok\n"), "{health}");
    assert!(
        events.contains("transfer-encoding: chunked\r\n"),
        "{events}"
    );
    assert!(events.contains("data: [DONE]"), "{events}");
    assert!(completion.contains("\"chat.completion\""), "{completion}");
    assert!(models.contains("sim-model"), "{models}");
    assert!(models.contains("connection: close\r\n"), "{models}");
}

#[tokio::test]
async fn a_chunked_request_body_and_an_http10_request_are_served() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "");
    let body = chat("sent in chunks", false, 2);
    let (a, b) = body.split_at(body.len() / 2);
    let wire = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n\
         {:x}\r\n{a}\r\n{:x};ext=1\r\n{b}\r\n0\r\n\r\n",
        a.len(),
        b.len()
    );
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    // In two writes, split inside a chunk: the body is reassembled across reads.
    let (w1, w2) = wire.split_at(wire.len() - 20);
    s.write_all(w1.as_bytes()).await.expect("write");
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.write_all(w2.as_bytes()).await.expect("write");
    let text = read_until_closed(&mut s).await;
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("\"chat.completion\""), "{text}");

    // HTTP/1.0: answered with a length, then closed (no keep-alive asked for).
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"GET /health HTTP/1.0\r\n\r\n")
        .await
        .expect("write");
    let text = read_until_closed(&mut s).await;
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("content-length: 3\r\n"), "{text}");
    assert!(text.ends_with("\r\n\r\nok\n"), "{text}");
}

#[tokio::test]
async fn a_client_that_leaves_releases_its_backend_slot_at_once() {
    // Slow to start and slow to stream: the answer would take many seconds.
    let backend = sim("base_latency_ms = 4000.0\ntime_per_output_token_ms = 200.0\n");
    let gw = gateway(&[&backend], "", "");
    let metrics = format!("{}/metrics", gw.url());
    let inflight = || async {
        metric_sum(
            &get(&metrics).await.body,
            "tokenway_backend_inflight{backend=\"b0\"",
        )
    };
    let body = chat("never mind", true, 50);
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(format!("{}{body}", post_head(body.len(), "")).as_bytes())
        .await
        .expect("write");
    assert!(
        eventually(Duration::from_secs(3), || async { inflight().await == 1.0 }).await,
        "the request never reached the backend"
    );
    // Gone before the first token: the gateway notices the closed socket, not the next write.
    drop(s);
    assert!(
        eventually(Duration::from_secs(2), || async { inflight().await == 0.0 }).await,
        "a client that left before its first token still holds a backend slot"
    );
    let url = format!("{}/v1/chat/completions", gw.url());
    let still = chat("still serving", false, 1);
    let r = tokio::time::timeout(Duration::from_secs(10), post(&url, &still, None))
        .await
        .expect("answered");
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test]
async fn head_and_one_model_are_answered_as_the_openai_api_does() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "");
    let listed = get(&format!("{}/v1/models", gw.url())).await;
    assert!(listed.body.contains("sim-model"), "{}", listed.body);
    // The id raw or percent-encoded (an id with a slash, `org/model`, may come either way).
    for path in ["/v1/models/sim-model", "/v1/models/sim%2Dmodel"] {
        let r = get(&format!("{}{path}", gw.url())).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
        assert_eq!(
            (v["id"].as_str(), v["object"].as_str()),
            (Some("sim-model"), Some("model"))
        );
    }
    let r = get(&format!("{}/v1/models/gpt-9", gw.url())).await;
    assert_eq!(r.status, 404, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
    assert_eq!(
        (v["error"]["code"].as_str(), v["error"]["param"].as_str()),
        (Some("model_not_found"), Some("model"))
    );

    // HEAD: the GET's head and length, no body; the next answer follows right after it.
    let wire = "HEAD /v1/models HTTP/1.1\r\nhost: x\r\n\r\nGET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(wire.as_bytes()).await.expect("write");
    let text = read_until_closed(&mut s).await;
    let (head, rest) = text.split_once("\r\n\r\n").expect("a head");
    assert!(head.starts_with("HTTP/1.1 200"), "{text}");
    assert!(head.contains("application/json"), "{head}");
    assert!(
        head.contains(&format!("content-length: {}\r\n", listed.body.len()))
            || head.ends_with(&format!("content-length: {}", listed.body.len())),
        "{head}"
    );
    assert!(
        rest.starts_with("HTTP/1.1 200"),
        "no body after HEAD: {rest}"
    );
}

#[tokio::test]
async fn the_servers_other_routes_and_sloppy_paths_are_proxied() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "");
    // vLLM's /tokenize, outside the OpenAI API.
    let r = post(
        &format!("{}/tokenize", gw.url()),
        r#"{"model":"sim-model","prompt":"eight by"}"#,
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
    assert_eq!(v["count"], 2, "{v}");
    // A trailing slash or a doubled one reaches the route, with the query kept.
    for path in ["/v1/chat/completions/", "//v1//chat/completions?x=1"] {
        let r = post(
            &format!("{}{path}", gw.url()),
            &chat("slash", false, 2),
            None,
        )
        .await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
    // No other path reaches a backend (it would carry the gateway's backend key): not a
    // server's admin route, not one that a path-routing proxy would resolve elsewhere.
    for path in [
        "/v1/load_lora_adapter",
        "/v1/../admin/x",
        "/v1/./chat/completions",
        "/v1/chat%2Fcompletions",
    ] {
        let r = post(
            &format!("{}{path}", gw.url()),
            r#"{"model":"sim-model"}"#,
            None,
        )
        .await;
        assert_eq!(r.status, 404, "{path}: {}", r.body);
        assert!(
            r.body.contains("unknown_url"),
            "the gateway's own 404: {}",
            r.body
        );
    }
    // Such a request's body is not read: its 404 comes from the head, before any `100`.
    let head = answer_to_head(
        gw.addr,
        b"POST /v1/nothing HTTP/1.1\r\nhost: x\r\ncontent-length: 30000000\r\n\
          expect: 100-continue\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    let metrics = get(&format!("{}/metrics", gw.url())).await.body;
    assert!(metrics.contains("route=\"/tokenize\""), "{metrics}");
}
