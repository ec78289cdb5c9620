//! Whatever a client sends, it gets a clear OpenAI-shaped error and the gateway keeps serving.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::*;

fn error_code(body: &str) -> String {
    let v: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    assert!(v["error"]["message"].is_string(), "{body}");
    assert!(v["error"]["type"].is_string(), "{body}");
    v["error"]["code"].as_str().unwrap_or_default().to_string()
}

#[tokio::test]
async fn bad_requests_get_openai_errors_and_the_gateway_keeps_serving() {
    let backend = sim(FAST_SIM);
    let gw = gateway(
        &[&backend],
        "api_keys = [\"sk-good\"]\nmax_body_bytes = 65536",
        "",
    );
    let chat_url = format!("{}/v1/chat/completions", gw.url());
    let key = Some("sk-good");

    let r = post(&chat_url, "{\"model\": \"sim-model\", \"messages\": [", key).await;
    assert_eq!(
        (r.status, error_code(&r.body).as_str()),
        (400, "invalid_json")
    );

    let big = chat(&"x".repeat(100_000), true, 2);
    let r = post(&chat_url, &big, key).await;
    assert_eq!(
        (r.status, error_code(&r.body).as_str()),
        (413, "request_too_large")
    );

    let r = post(&chat_url, &chat("hi", true, 2), None).await;
    assert_eq!(
        (r.status, error_code(&r.body).as_str()),
        (401, "invalid_api_key")
    );
    let r = post(&chat_url, &chat("hi", true, 2), Some("sk-bad")).await;
    assert_eq!(
        (r.status, error_code(&r.body).as_str()),
        (401, "invalid_api_key")
    );

    let r = post(&format!("{}/v2/nothing", gw.url()), "{}", key).await;
    assert_eq!(
        (r.status, error_code(&r.body).as_str()),
        (404, "unknown_url")
    );

    let r = post(
        &chat_url,
        &chat("hi", true, 2).replace("sim-model", "gpt-9"),
        key,
    )
    .await;
    assert_eq!(
        (r.status, error_code(&r.body).as_str()),
        (404, "model_not_found")
    );

    let r = get(&chat_url).await;
    assert_eq!(r.status, 405);
    assert_eq!(r.headers["allow"], "POST");
    let r = post(&format!("{}/v1/models", gw.url()), "{}", key).await;
    assert_eq!(
        (r.status, error_code(&r.body).as_str()),
        (405, "method_not_allowed")
    );
    assert_eq!(r.headers["allow"], "GET, HEAD");

    // Raw garbage on the socket: an HTTP error or a closed connection, never a crash.
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"\x16\x03\x01\x00\xffGARBAGE\r\n\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;

    let r = post(&chat_url, &chat("still serving", true, 2), key).await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test]
async fn the_request_bodies_held_are_bounded_across_connections_and_fronts() {
    let backend = sim(FAST_SIM);
    // Room for one 60 000-byte body and a bit: the second large body, from any front, waits.
    let gw = gateway(
        &[&backend],
        "max_body_bytes = 65536\nmax_held_body_bytes = 100000",
        "",
    );
    let chat_url = format!("{}/v1/chat/completions", gw.url());
    let big = chat_of_len(60_000);
    assert_eq!(big.len(), 60_000);
    // HTTP/1.1: a declaration alone holds nothing. A client that declares a large body and
    // sends none of it (or trickles it) does not keep the next request out. (It waits for
    // `100 Continue`, so that its head is known to have passed the check before the next
    // request: invited, it sends nothing.)
    let liar = invited_to_send(gw.addr, big.len(), "").await;
    let second = chat_of_len(50_000);
    let r = post(&chat_url, &second, None).await;
    assert_eq!(
        r.status, 200,
        "a declared body held its bytes before they came: {}",
        r.body
    );
    // The bytes that did arrive are held: the holder is invited (room is left) and sends 55 000
    // of its 60 000 bytes, which the gateway reads as they come.
    let mut holder = invited_to_send(gw.addr, big.len(), "connection: close\r\n").await;
    holder
        .write_all(&big.as_bytes()[..55_000])
        .await
        .expect("write");
    // HTTP/1.1 with `Expect: 100-continue`: a body that does not fit the room left is refused
    // before the client is invited to send it. Such a probe takes nothing while it waits (a
    // body taking its bytes first would race the holder's for them), so it also tells when
    // the gateway has read the holder's bytes.
    let probe = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\
         expect: 100-continue\r\n\r\n",
        second.len()
    );
    let mut refused = None;
    for _ in 0..100 {
        let answer = answer_to_head(gw.addr, probe.as_bytes()).await;
        if !answer.starts_with("HTTP/1.1 100 Continue") {
            refused = Some(answer);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let answer = refused.expect("a second large body refused while the first holds the budget");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(!answer.contains("100 Continue"), "{answer}");
    // The same body sent at once.
    let r = post(&chat_url, &second, None).await;
    assert_eq!(
        (r.status, error_code(&r.body).as_str()),
        (503, "gateway_busy"),
        "a second large body was taken while the first held the budget"
    );
    assert_eq!(r.headers["retry-after"], "1");
    // A small body still fits.
    let r = post(&chat_url, &chat("small", false, 2), None).await;
    assert_eq!(r.status, 200, "{}", r.body);

    // HTTP/2, a body of no declared length: refused once what arrived passes the room left.
    let tcp = TcpStream::connect(gw.addr).await.expect("connect");
    let (mut send, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .handshake::<_, http_body_util::channel::Channel<bytes::Bytes>>(
                hyper_util::rt::TokioIo::new(tcp),
            )
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let (mut tx, body) = http_body_util::channel::Channel::<bytes::Bytes>::new(4);
    let streamed = tokio::spawn(async move {
        for piece in second.as_bytes().chunks(10_000) {
            if tx
                .send_data(bytes::Bytes::copy_from_slice(piece))
                .await
                .is_err()
            {
                break;
            }
        }
        // The sender is kept until the answer is in: the body never ends by itself.
        tokio::time::sleep(Duration::from_secs(10)).await;
    });
    let resp = send
        .send_request(
            http::Request::post(&chat_url)
                .header("content-type", "application/json")
                .body(body)
                .expect("request"),
        )
        .await
        .expect("an answer before the body's end");
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    streamed.abort();
    // Every refusal is counted, the HTTP/1.1 front's own (the first two) as well.
    let metrics = get(&format!("{}/metrics", gw.url())).await.body;
    assert_eq!(
        metric_sum(
            &metrics,
            "tokenway_requests_total{route=\"/v1/chat/completions\",backend=\"none\",status=\"503\"}"
        ),
        3.0,
        "{metrics}"
    );

    // HTTP/2: a request's head is held with its body. 45 000 bytes are left; a small body
    // under 48 000 bytes of header fields does not fit (one connection could hold 1024 such
    // heads waiting for their bodies), the same body under a few fields does.
    let tcp = TcpStream::connect(gw.addr).await.expect("connect");
    let (mut send, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .max_header_list_size(1 << 20)
            .handshake::<_, http_body_util::Full<bytes::Bytes>>(hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let small = chat("small", false, 2);
    for (fields, want) in [(40, 503), (1, 200)] {
        let mut req = http::Request::post(&chat_url).header("content-type", "application/json");
        for i in 0..fields {
            req = req.header(format!("x-pad-{i}"), "p".repeat(1_200));
        }
        let resp = send
            .send_request(
                req.body(http_body_util::Full::new(bytes::Bytes::from(small.clone())))
                    .expect("request"),
            )
            .await
            .expect("answer");
        assert_eq!(resp.status().as_u16(), want, "{fields} fields of padding");
    }

    drop(liar);
    holder_completes(holder, &big.as_bytes()[55_000..], &chat_url).await;
}

#[tokio::test]
async fn a_client_that_never_reads_is_cut_off_and_others_are_served_meanwhile() {
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 0.0\n");
    let gw = gateway(&[&backend], "", "[timeouts]\nclient_write_ms = 500\n");
    let body = chat("flood me", true, 400_000);
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("write");
    // Never read from `s`. Others keep being served meanwhile.
    for i in 0..5 {
        let r = post(
            &format!("{}/v1/chat/completions", gw.url()),
            &chat(&format!("other {i}"), true, 4),
            None,
        )
        .await;
        assert_eq!(r.status, 200);
    }
    // The stalled stream is closed, releasing its backend slot.
    assert!(
        b0_released(&gw, Duration::from_secs(15)).await,
        "the never-reading client still holds a backend slot"
    );
    drop(s);
}

#[tokio::test]
async fn an_http2_stream_whose_client_stops_reading_gives_back_its_slot_and_the_connection_lives() {
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 0.0\n");
    let gw = gateway(&[&backend], "", "[timeouts]\nclient_write_ms = 500\n");
    // HTTP/2 with prior knowledge, and a 1 KiB stream window: the stream stops as soon as the
    // client stops reading, while the connection (PINGs, other streams) goes on.
    let tcp = TcpStream::connect(gw.addr).await.expect("connect");
    let (mut send, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(1024)
            .handshake::<_, http_body_util::Full<bytes::Bytes>>(hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let request = |prompt: &str, tokens: u32| {
        http::Request::post(format!("{}/v1/chat/completions", gw.url()))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(chat(
                prompt, true, tokens,
            ))))
            .expect("request")
    };
    let stalled = send
        .send_request(request("flood me", 400_000))
        .await
        .expect("response head");
    assert_eq!(stalled.status(), 200);
    // Never read `stalled`'s body. Its backend slot is given back after the write deadline.
    assert!(
        b0_released(&gw, Duration::from_secs(15)).await,
        "the stalled HTTP/2 stream still holds a backend slot"
    );
    // The same connection still serves.
    let other = send
        .send_request(request("other", 4))
        .await
        .expect("a second stream");
    assert_eq!(other.status(), 200);
    let body = http_body_util::BodyExt::collect(other.into_body())
        .await
        .expect("whole body")
        .to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("data: [DONE]"));
    // The stalled stream was reset, not ended as if complete.
    let rest = http_body_util::BodyExt::collect(stalled.into_body()).await;
    assert!(rest.is_err(), "the stalled stream ended cleanly");
}

#[tokio::test]
async fn a_client_that_sends_its_request_too_slowly_is_timed_out() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "[timeouts]\nclient_read_ms = 500\n");
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "the gateway kept a half-sent request open");

    // A connection that sends nothing at all is closed too (else a few of them fill
    // `max_connections`), and so is one left idle after a request.
    let mut silent = TcpStream::connect(gw.addr).await.expect("connect");
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), silent.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "the gateway kept a silent connection open");
    // The request is followed by an empty line, as some clients send after a body (RFC 9112
    // §2.2): still an idle connection, closed quietly, not answered with a 408 for a request
    // never sent.
    let mut idle = TcpStream::connect(gw.addr).await.expect("connect");
    idle.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), idle.read_to_end(&mut buf)).await;
    assert!(
        closed.is_ok(),
        "the gateway kept an idle keep-alive connection open"
    );
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(text.matches("HTTP/1.1 ").count(), 1, "{text}");
    // An HTTP/2 connection left idle after a request is closed too (GOAWAY), although it
    // answers the gateway's PINGs; and so is one whose request carried the tunnel's header
    // with no valid token (only an edge's fallback connection is kept: before, any `tw-auth`
    // header kept a connection open for good).
    for tunnel_header in [None, Some("not-a-token")] {
        let tcp = TcpStream::connect(gw.addr).await.expect("connect");
        let (mut send, conn) =
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .timer(hyper_util::rt::TokioTimer::new())
                .keep_alive_interval(Duration::from_millis(200))
                .keep_alive_while_idle(true)
                .handshake::<_, http_body_util::Full<bytes::Bytes>>(hyper_util::rt::TokioIo::new(
                    tcp,
                ))
                .await
                .expect("h2 handshake");
        let conn = tokio::spawn(conn);
        let mut req = http::Request::get(format!("{}/health", gw.url()));
        if let Some(token) = tunnel_header {
            req = req.header(tokenway_transport::tunnel::AUTH_HEADER, token);
        }
        let health = send
            .send_request(
                req.body(http_body_util::Full::new(bytes::Bytes::new()))
                    .expect("request"),
            )
            .await
            .expect("answer");
        assert_eq!(health.status(), 200);
        drop(health);
        let closed = tokio::time::timeout(Duration::from_secs(5), conn).await;
        assert!(
            closed.is_ok(),
            "the gateway kept an idle HTTP/2 connection open (tunnel header {tunnel_header:?})"
        );
    }

    // A body that never completes gets 408.
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"model\"",
    )
    .await
    .expect("write");
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");

    let r = post(
        &format!("{}/v1/chat/completions", gw.url()),
        &chat("fine", true, 2),
        None,
    )
    .await;
    assert_eq!(r.status, 200);

    // A body that keeps coming, slower in all than the timeout but never silent for long (a
    // large upload on a slow link), is read to its end.
    let body = chat(&"slow uplink ".repeat(40), false, 2);
    let mut s = TcpStream::connect(gw.addr).await.expect("connect");
    s.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .expect("write");
    for piece in body.as_bytes().chunks(body.len() / 6 + 1) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s.write_all(piece).await.expect("write");
    }
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}

#[tokio::test]
async fn a_browser_app_from_an_allowed_origin_passes_cors_and_others_do_not() {
    let backend = sim(FAST_SIM);
    let gw = gateway(
        &[&backend],
        "api_keys = [\"sk-web\"]\ncors_allow_origins = [\"https://chat.example.com\"]",
        "",
    );
    let url = format!("{}/v1/chat/completions", gw.url());
    let send = |origin: &'static str, method: http::Method, key: Option<&'static str>| {
        let url = url.clone();
        async move {
            let mut req = http::Request::builder()
                .method(method)
                .uri(&url)
                .header("origin", origin)
                .header("content-type", "application/json")
                .header("access-control-request-method", "POST")
                .header(
                    "access-control-request-headers",
                    "authorization, content-type",
                );
            if let Some(k) = key {
                req = req.header("authorization", format!("Bearer {k}"));
            }
            let req = req
                .body(http_body_util::Full::new(bytes::Bytes::from(chat(
                    "cors", false, 2,
                ))))
                .expect("request");
            client().request(req).await.expect("answer")
        }
    };
    // The preflight carries no key and is answered by the gateway.
    let pre = send("https://chat.example.com", http::Method::OPTIONS, None).await;
    assert_eq!(pre.status(), 204);
    assert_eq!(
        pre.headers()["access-control-allow-origin"],
        "https://chat.example.com"
    );
    assert!(pre.headers()["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .contains("authorization"));
    // The gateway's own 401 and a proxied 200 are both readable by the page.
    let denied = send("https://chat.example.com", http::Method::POST, None).await;
    assert_eq!(denied.status(), 401);
    assert_eq!(
        denied.headers()["access-control-allow-origin"],
        "https://chat.example.com"
    );
    let ok = send(
        "https://chat.example.com",
        http::Method::POST,
        Some("sk-web"),
    )
    .await;
    assert_eq!(ok.status(), 200);
    assert_eq!(
        ok.headers()["access-control-allow-origin"],
        "https://chat.example.com"
    );
    // Without a key, an Origin does not get a body read: the 401 comes from the head, before
    // any `100 Continue`, and the page can read it.
    let head = answer_to_head(
        gw.addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\norigin: https://chat.example.com\r\n\
          content-type: application/json\r\ncontent-length: 30000000\r\nexpect: 100-continue\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    assert!(
        head.contains("access-control-allow-origin: https://chat.example.com"),
        "{head}"
    );
    // The HTTP/1.1 front's own refusal of a body (here 413, past `max_body_bytes`) is readable
    // by the page too.
    let head = answer_to_head(
        gw.addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\norigin: https://chat.example.com\r\n\
          authorization: Bearer sk-web\r\ncontent-type: application/json\r\n\
          transfer-encoding: chunked\r\n\r\n2000001\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(
        head.contains("access-control-allow-origin: https://chat.example.com"),
        "{head}"
    );
    // Another origin gets no CORS answer: its preflight is the route's 405.
    let other = send("https://evil.example", http::Method::OPTIONS, None).await;
    assert_eq!(other.status(), 405);
    assert!(!other.headers().contains_key("access-control-allow-origin"));
}

/// `Max open files` of process `pid`: (soft, hard).
fn open_files_limit(pid: u32) -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let mut n = line["Max open files".len()..].split_whitespace();
    Some((n.next()?.parse().ok()?, n.next()?.parse().ok()?))
}

#[tokio::test]
async fn a_process_started_with_a_low_open_files_limit_raises_it_to_the_hard_one() {
    // A shell lowers the soft limit (a common default is 1024), then becomes the sim.
    let mut child = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -Sn 256 && exec {} sim --listen 127.0.0.1:0",
            bin()
        ))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("sh runs");
    let pid = child.id();
    let hard = open_files_limit(std::process::id())
        .expect("this process's limits")
        .1;
    let want = hard.min(1 << 20);
    // Once the shell has become the sim and the sim is serving (its limit is set first thing).
    let comm = || std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    let serving = eventually(Duration::from_secs(10), || async {
        comm().trim() == "tokenway"
            && std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count()) > 1
    })
    .await;
    assert!(serving, "the sim did not start: {}", comm());
    let raised = open_files_limit(pid).is_some_and(|(soft, _)| soft == want);
    let seen = open_files_limit(pid);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        raised,
        "soft limit {seen:?}, hard {hard}: not raised to {want}"
    );
}

#[tokio::test]
async fn a_body_on_a_route_that_takes_none_is_refused_unread_and_an_early_error_survives_a_big_upload(
) {
    let backend = sim(FAST_SIM);
    let gw = gateway(
        &[&backend],
        "api_keys = [\"sk-good\"]\nmax_body_bytes = 65536",
        "",
    );
    // A body declared to a route that takes none, without a key: refused from the head, never
    // invited (nor held while it trickles in).
    for (head, status) in [
        (
            "GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 60000\r\nexpect: 100-continue\r\n\r\n",
            "HTTP/1.1 400",
        ),
        (
            "PUT /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 60000\r\n\
             expect: 100-continue\r\n\r\n",
            "HTTP/1.1 405",
        ),
        (
            "DELETE /metrics HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\
             expect: 100-continue\r\n\r\n",
            "HTTP/1.1 400",
        ),
    ] {
        let answer = answer_to_head(gw.addr, head.as_bytes()).await;
        assert!(answer.starts_with(status), "{head}: {answer}");
        assert!(!answer.contains("100 Continue"), "{answer}");
    }
    // A small one is read and ignored.
    let answer = answer_to_head(
        gw.addr,
        b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // A client that writes its whole body before reading (the `openai` SDK sends no `Expect`)
    // gets its early answer, not a reset, even for a body past what used to be drained.
    for (extra, status) in [
        ("authorization: Bearer sk-good\r\n", "HTTP/1.1 413"),
        ("authorization: Bearer sk-bad\r\n", "HTTP/1.1 401"),
    ] {
        let body = chat_of_len(3 << 20);
        let mut s = TcpStream::connect(gw.addr).await.expect("connect");
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n{extra}\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.expect("head");
        s.write_all(body.as_bytes())
            .await
            .expect("the whole body is taken, not reset");
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer))
            .await
            .expect("answered and closed in time")
            .expect("no reset");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with(status), "{answer}");
    }
    // Still serving.
    let r = post(
        &format!("{}/v1/chat/completions", gw.url()),
        &chat("hi", true, 2),
        Some("sk-good"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}
