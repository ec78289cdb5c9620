//! The edge and the tunnel: edge → gateway → sim over QUIC on loopback (and over the TCP
//! fallback), as real processes.

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

const TOKEN: &str = "e2e-tunnel-token-0123456789";

/// A gateway with a tunnel port (and a TLS TCP port for the fallback) in front of `backend`.
fn tunnel_gateway(backend: &Proc, top: &str, tunnel_extra: &str) -> Proc {
    gateway(
        &[backend],
        &format!("tls_listen = \"127.0.0.1:0\"\n{top}"),
        &format!("[tunnel]\nlisten = \"127.0.0.1:0\"\ntokens = [\"{TOKEN}\"]\n{tunnel_extra}\n"),
    )
}

fn tunnel_addr(gw: &Proc) -> SocketAddr {
    gw.extra("tunnel")
        .expect("the gateway announces its tunnel port")
}

fn fingerprint(gw: &Proc) -> String {
    gw.fingerprint()
        .expect("the gateway announces its certificate fingerprint")
}

/// Edge config for one gateway: `quic` and optional `tcp` addresses, extra top-level keys
/// `top`, and extra tables `tables`.
fn edge_config(
    fp: &str,
    quic: SocketAddr,
    tcp: Option<SocketAddr>,
    top: &str,
    tables: &str,
) -> String {
    let tcp = tcp.map(|a| format!("tcp = \"{a}\"\n")).unwrap_or_default();
    format!(
        "token = \"{TOKEN}\"\n{top}\n[trust]\npin_sha256 = [\"{fp}\"]\n\
         [[gateways]]\nname = \"gw\"\nquic = \"{quic}\"\n{tcp}\n{tables}\n"
    )
}

fn edge_for(gw: &Proc, top: &str, tables: &str) -> Proc {
    edge(&edge_config(
        &fingerprint(gw),
        tunnel_addr(gw),
        gw.tls_addr,
        top,
        tables,
    ))
}

fn normalized(body: &str) -> Vec<String> {
    data_events(body).iter().map(|e| normalize(e)).collect()
}

async fn metrics(p: &Proc) -> String {
    get(&format!("{}/metrics", p.url())).await.body
}

#[tokio::test]
async fn streamed_chat_through_the_edge_over_quic_equals_the_backends_own() {
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", "");
    let edge = edge_for(&gw, "", "");
    for stream in [true, false] {
        let body = chat("tunnels and head-of-line blocking", stream, 24);
        let direct = post(
            &format!("{}/v1/chat/completions", backend.url()),
            &body,
            None,
        )
        .await;
        let via = post(&format!("{}/v1/chat/completions", edge.url()), &body, None).await;
        assert_eq!(via.status, 200, "{}", via.body);
        if stream {
            assert_eq!(
                via.headers
                    .get("content-type")
                    .and_then(|v| v.to_str().ok()),
                Some("text/event-stream")
            );
            let (d, v) = (normalized(&direct.body), normalized(&via.body));
            assert!(d.len() >= 25, "{d:?}");
            assert_eq!(d, v);
        } else {
            assert_eq!(normalize(&direct.body), normalize(&via.body));
        }
    }
    let text = metrics(&edge).await;
    assert_eq!(
        metric_sum(
            &text,
            "tokenway_ttft_seconds_count{route=\"/v1/chat/completions\",backend=\"gw\",transport=\"tunnel\","
        ),
        2.0,
        "{text}"
    );
    assert_eq!(
        metric_sum(&text, "tokenway_tcp_fallback_total"),
        0.0,
        "{text}"
    );
    assert!(
        metric_sum(&text, "tokenway_quic_rtt_seconds{peer=\"gw\"}") > 0.0,
        "{text}"
    );
    // The gateway saw tunnel requests, not plain HTTP/3 ones.
    let gw_text = metrics_reaching(
        &gw.url(),
        "tokenway_ttft_seconds_count{route=\"/v1/chat/completions\",backend=\"b0\",transport=\"tunnel\",",
        2.0,
    )
    .await;
    assert!(
        metric_sum(&gw_text, "tokenway_ttft_seconds_count{route=\"/v1/chat/completions\",backend=\"b0\",transport=\"tunnel\",") >= 2.0,
        "{gw_text}"
    );
}

/// Brutal's rate is settled both ways, as Hysteria 2 does: the gateway sends at min(edge
/// `bandwidth.down`, gateway `bandwidth.up`), the edge at min(edge `bandwidth.up`, gateway
/// `bandwidth.down`), each end's receive rate advertised in `tw-rx-rate` (the edge's on its
/// requests, the gateway's on its answers). Before, the edge sent at its own `up` whatever the
/// gateway could take. FEC off, so no repair reserve comes off the rates.
#[tokio::test]
async fn brutal_rates_are_settled_both_ways_between_edge_and_gateway() {
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(
        &backend,
        "",
        "[tunnel.datagram]\nfec = \"off\"\ncc = \"brutal\"\n\
         bandwidth.up = \"8 mbps\"\nbandwidth.down = \"4 mbps\"",
    );
    let edge = edge_for(
        &gw,
        "",
        "[datagram]\nfec = \"off\"\ncc = \"brutal\"\n\
         bandwidth.up = \"100 mbps\"\nbandwidth.down = \"2 mbps\"",
    );
    let series = "tokenway_quic_brutal_rate_bytes_per_second{peer=\"gw\"}";
    let r = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("settle the rates", true, 4),
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.headers.get("tw-rx-rate").is_none(),
        "the gateway's advertisement stays in the tunnel: {:?}",
        r.headers
    );
    // The edge samples its connection every second: 4 Mbit/s is 500,000 bytes/s.
    let settled = eventually(Duration::from_secs(5), || async {
        metric_sum(&metrics(&edge).await, series) == 500_000.0
    })
    .await;
    let text = metrics(&edge).await;
    assert!(settled, "the edge sends at the gateway's rx: {text}");
    // The gateway's side (min(2 Mbit/s, 8 Mbit/s)) is the transport tests'; its connection
    // gauges are not per peer. A second request keeps both where they are.
    let again = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("settled", false, 4),
        None,
    )
    .await;
    assert_eq!(again.status, 200, "{}", again.body);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let text = metrics(&edge).await;
    assert_eq!(metric_sum(&text, series), 500_000.0, "{text}");
}

#[tokio::test]
async fn official_openai_python_client_streams_through_the_edge() {
    if !python_has("openai") {
        return;
    }
    let backend = sim(FAST_SIM);
    // The API key travels through the tunnel untouched and the gateway checks it.
    let gw = tunnel_gateway(&backend, "api_keys = [\"sk-e2e\"]", "");
    let edge = edge_for(&gw, "", "");
    openai_check(
        &format!("{}/v1", edge.url()),
        &format!("{}/v1", backend.url()),
        "sk-e2e",
    );
}

/// A UDP port on loopback with nothing listening.
fn closed_udp_port() -> SocketAddr {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind UDP");
    s.local_addr().expect("local addr")
}

#[tokio::test]
async fn with_udp_unusable_the_edge_falls_back_to_tcp_and_requests_succeed() {
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", "");
    let edge = edge(&edge_config(
        &fingerprint(&gw),
        closed_udp_port(),
        gw.tls_addr,
        "",
        "",
    ));
    let body = chat("over tcp", true, 8);
    let start = Instant::now();
    let via = post(&format!("{}/v1/chat/completions", edge.url()), &body, None).await;
    let took = start.elapsed();
    assert_eq!(via.status, 200, "{}", via.body);
    assert!(took < Duration::from_secs(2), "fallback took {took:?}");
    let direct = post(
        &format!("{}/v1/chat/completions", backend.url()),
        &body,
        None,
    )
    .await;
    assert_eq!(normalized(&direct.body), normalized(&via.body));
    let text = metrics(&edge).await;
    assert!(
        metric_sum(&text, "tokenway_tcp_fallback_total") >= 1.0,
        "{text}"
    );
    assert_eq!(
        metric_sum(
            &text,
            "tokenway_ttft_seconds_count{route=\"/v1/chat/completions\",backend=\"gw\",transport=\"tunnel-tcp\","
        ),
        1.0,
        "{text}"
    );
    // A head of 20 KiB goes through as it does over QUIC (HTTP/2's default limit is 16 KiB);
    // after the metrics above, which count one answer.
    let small = chat("big head over tcp", false, 4);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         x-big: {}\r\ncontent-length: {}\r\n\r\n{small}",
        "a".repeat(20 << 10),
        small.len(),
    );
    let answer = answer_to_head(edge.addr, head.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// The tunnel's own TCP port (`tunnel.tcp_listen`) counts its connections apart from the
/// API's fronts: with the API's `max_connections` taken (a flood of public connections), an
/// edge still gets its fallback. Before, one count for every TCP front left the edge's
/// connection in the accept queue.
#[tokio::test]
async fn public_connections_at_the_limit_do_not_lock_an_edge_out_of_its_tcp_fallback() {
    let backend = sim(FAST_SIM);
    let gw = gateway(
        &[&backend],
        "max_connections = 1",
        &format!(
            "[tunnel]\nlisten = \"127.0.0.1:0\"\ntcp_listen = \"127.0.0.1:0\"\n\
             tokens = [\"{TOKEN}\"]\n"
        ),
    );
    let tunnel_tcp: SocketAddr = gw
        .extra("tunnel-tcp")
        .expect("the gateway announces its tunnel TCP port");
    let _flood = tokio::net::TcpStream::connect(gw.addr)
        .await
        .expect("connect");
    let edge = edge(&edge_config(
        &fingerprint(&gw),
        closed_udp_port(),
        Some(tunnel_tcp),
        "",
        "",
    ));
    let via = tokio::time::timeout(
        Duration::from_secs(10),
        post(
            &format!("{}/v1/chat/completions", edge.url()),
            &chat("fallback while the API is full", true, 4),
            None,
        ),
    )
    .await
    .expect("the edge's fallback connection was let in");
    assert_eq!(via.status, 200, "{}", via.body);
}

/// An edge whose QUIC path goes silent sends the requests that had no answer yet again (over
/// TCP, or on a fresh connection), naming the first attempt's idempotency key: the gateway
/// stops that attempt if it still runs it. Before, it ran on until the gateway's idle timeout
/// closed the dead connection, and a long answer was generated twice.
#[tokio::test]
async fn a_retry_naming_an_attempt_that_still_runs_stops_it() {
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 50.0\n");
    let gw = tunnel_gateway(&backend, "", "");
    let (quic, _endpoint) = quic_client_at(&gw, tunnel_addr(&gw))
        .await
        .expect("connected to the tunnel port");
    const FIRST: &str = "0123456789abcdef0123456789abcdef";
    const RETRY: &str = "fedcba9876543210fedcba9876543210";
    let request = |key: &str, supersedes: Option<&str>, tokens: u32| {
        let mut req = http::Request::post("/v1/chat/completions")
            .header("content-type", "application/json")
            .header("tw-auth", TOKEN)
            .header("tw-idempotency-key", key);
        if let Some(k) = supersedes {
            req = req.header("tw-supersedes", k);
        }
        req.body(Full::new(Bytes::from(chat("a long answer", false, tokens))))
            .expect("request")
    };
    // The first attempt: a whole answer of 200 tokens, 10 s of the backend's time.
    let first = request(FIRST, None, 200);
    let first = tokio::spawn(async move {
        match quic.send_request(first).await {
            Ok(resp) => resp.into_body().collect().await.is_ok(),
            Err(_) => false,
        }
    });
    let busy = eventually(Duration::from_secs(5), || async {
        metric_sum(
            &metrics(&gw).await,
            "tokenway_backend_inflight{backend=\"b0\"",
        ) == 1.0
    })
    .await;
    assert!(busy, "the first attempt never reached the backend");
    // Its retry, over TCP, names it.
    let mut retry = request(RETRY, Some(FIRST), 2);
    *retry.uri_mut() = format!("{}/v1/chat/completions", gw.url())
        .parse()
        .expect("uri");
    let answer = client().request(retry).await.expect("the retry answered");
    assert_eq!(answer.status(), 200);
    let whole = tokio::time::timeout(Duration::from_secs(3), first)
        .await
        .expect("the first attempt was stopped, not run to its end")
        .expect("task");
    assert!(!whole, "the first attempt's answer came whole");
    assert!(b0_released(&gw, Duration::from_secs(3)).await);
}

#[tokio::test]
async fn a_second_connection_resumes_with_0rtt() {
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", "");
    let edge = edge_for(&gw, "", "");
    let url = format!("{}/v1/chat/completions", edge.url());
    assert_eq!(post(&url, &chat("first", true, 4), None).await.status, 200);
    // A web page's POST (a browser names its origin) cannot drop the edge's connections.
    let from_page = answer_to_head(
        edge.addr,
        b"POST /admin/reconnect HTTP/1.1\r\nhost: 127.0.0.1\r\n\
          origin: https://page.example\r\ncontent-length: 0\r\n\r\n",
    )
    .await;
    assert!(from_page.starts_with("HTTP/1.1 403"), "{from_page}");
    let r = post(&format!("{}/admin/reconnect", edge.url()), "", None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(post(&url, &chat("second", true, 4), None).await.status, 200);
    let resumed = eventually(Duration::from_secs(5), || async {
        metric_sum(
            &metrics(&edge).await,
            "tokenway_quic_0rtt_total{result=\"accepted\"}",
        ) >= 1.0
    })
    .await;
    assert!(resumed, "{}", metrics(&edge).await);
    let text = metrics(&edge).await;
    assert!(
        metric_sum(
            &text,
            "tokenway_tunnel_connections_total{peer=\"gw\",transport=\"quic\"}"
        ) >= 2.0,
        "{text}"
    );
    // An accepted early request is executed once: the backend saw exactly the two requests.
    let backend_text = metrics(&backend).await;
    assert_eq!(
        metric_sum(
            &backend_text,
            "tokenway_requests_total{route=\"/v1/chat/completions\""
        ),
        2.0,
        "{backend_text}"
    );
}

#[tokio::test]
async fn gateways_sharing_a_server_name_each_resume_with_their_own_tickets() {
    // Both gateways answer to the default server name, "localhost".
    let backends = [sim(FAST_SIM), sim(FAST_SIM)];
    let gws = [
        tunnel_gateway(&backends[0], "", ""),
        tunnel_gateway(&backends[1], "", ""),
    ];
    let edge = edge_for_two(&gws, "");
    let url = format!("{}/v1/chat/completions", edge.url());
    let connections = |text: &str| {
        metric_sum(
            text,
            "tokenway_tunnel_connections_total{peer=\"gw-a\",transport=\"quic\"}",
        ) + metric_sum(
            text,
            "tokenway_tunnel_connections_total{peer=\"gw-b\",transport=\"quic\"}",
        )
    };
    let zero_rtt = |text: &str, result: &str| {
        metric_sum(
            text,
            &format!("tokenway_quic_0rtt_total{{result=\"{result}\""),
        )
    };
    let mut expected = 2.0;
    for round in 0..4 {
        // Both links up (each gateway issued its tickets), then both redial at once.
        let up = eventually(Duration::from_secs(10), || async {
            connections(&metrics(&edge).await) >= expected
        })
        .await;
        assert!(up, "round {round}: {}", metrics(&edge).await);
        assert_eq!(post(&url, &chat("hi", true, 2), None).await.status, 200);
        let r = post(&format!("{}/admin/reconnect", edge.url()), "", None).await;
        assert_eq!(r.status, 200, "{}", r.body);
        expected += 2.0;
    }
    let settled = eventually(Duration::from_secs(10), || async {
        let text = metrics(&edge).await;
        zero_rtt(&text, "accepted") + zero_rtt(&text, "rejected") >= 8.0
    })
    .await;
    let text = metrics(&edge).await;
    assert!(settled, "{text}");
    assert_eq!(zero_rtt(&text, "rejected"), 0.0, "{text}");
}

/// Opens a streaming chat through `base` and returns the response body.
async fn open_stream(base: &str, prompt: &str, tokens: u32) -> hyper::body::Incoming {
    let req = http::Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(chat(prompt, true, tokens))))
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
        .await
        .expect("response head in time")
        .expect("response");
    assert_eq!(resp.status(), 200);
    resp.into_body()
}

/// Reads frames until `body` has at least `events` data events; returns the text so far.
async fn read_events(body: &mut hyper::body::Incoming, text: &mut String, events: usize) {
    while text.matches("data:").count() < events {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("a frame in time");
        match frame {
            Some(Ok(f)) => {
                if let Some(d) = f.data_ref() {
                    text.push_str(&String::from_utf8_lossy(d));
                }
            }
            _ => return,
        }
    }
}

async fn read_to_end(body: &mut hyper::body::Incoming, text: &mut String) {
    read_events(body, text, usize::MAX).await
}

#[tokio::test]
async fn rebinding_the_edges_socket_mid_stream_loses_no_events() {
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 25.0\n");
    let gw = tunnel_gateway(&backend, "", "");
    let edge = edge_for(&gw, "", "");
    let prompt = "migrate me";
    let mut body = open_stream(&edge.url(), prompt, 40).await;
    let mut text = String::new();
    read_events(&mut body, &mut text, 3).await;
    let r = post(&format!("{}/admin/rebind", edge.url()), "", None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    read_to_end(&mut body, &mut text).await;
    let direct = post(
        &format!("{}/v1/chat/completions", backend.url()),
        &chat(prompt, true, 40),
        None,
    )
    .await;
    assert_eq!(normalized(&text), normalized(&direct.body));
    // New requests use the migrated connection.
    let after = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("after", true, 4),
        None,
    )
    .await;
    assert_eq!(after.status, 200);
    let text = metrics(&edge).await;
    assert_eq!(
        metric_sum(
            &text,
            "tokenway_tunnel_connections_total{peer=\"gw\",transport=\"quic\"}"
        ),
        1.0,
        "the connection migrated instead of reconnecting: {text}"
    );
}

/// A self-signed certificate and key in `dir`, made with openssl; `None` without openssl.
fn cert_files(dir: &TempDir) -> Option<(String, String)> {
    let cert = dir.0.join("cert.pem");
    let key = dir.0.join("key.pem");
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .args(["-days", "2", "-subj", "/CN=localhost"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| (cert.display().to_string(), key.display().to_string()))
}

#[tokio::test]
async fn after_a_gateway_restart_the_edge_reconnects_and_in_flight_streams_end_cleanly() {
    let dir = TempDir::new("restart-cert");
    let Some((cert, key)) = cert_files(&dir) else {
        eprintln!("SKIP: openssl is not installed");
        return;
    };
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 20.0\n");
    let tls = format!("[tls]\ncert = \"{cert}\"\nkey = \"{key}\"\n");
    let start_gw = |listen: &str| {
        gateway(
            &[&backend],
            "",
            &format!("{tls}[tunnel]\nlisten = \"{listen}\"\ntokens = [\"{TOKEN}\"]\n"),
        )
    };
    let mut gw = start_gw("127.0.0.1:0");
    let tunnel = tunnel_addr(&gw);
    let edge = edge(&edge_config(
        &fingerprint(&gw),
        tunnel,
        None,
        "",
        "[quic]\nidle_timeout_ms = 1500\nkeep_alive_ms = 300\n",
    ));
    let url = format!("{}/v1/chat/completions", edge.url());
    assert_eq!(post(&url, &chat("before", true, 4), None).await.status, 200);

    // A stream in flight when the gateway dies ends with an error event, not a hang.
    let mut body = open_stream(&edge.url(), "in flight", 200).await;
    let mut text = String::new();
    read_events(&mut body, &mut text, 2).await;
    gw.kill();
    let ended =
        tokio::time::timeout(Duration::from_secs(10), read_to_end(&mut body, &mut text)).await;
    assert!(ended.is_ok(), "the in-flight stream did not end");
    let last = data_events(&text).last().cloned().unwrap_or_default();
    assert!(last.contains("\"error\""), "last event: {last}");

    let _gw2 = start_gw(&tunnel.to_string());
    let after = post(&url, &chat("after restart", true, 4), None).await;
    assert_eq!(after.status, 200, "{}", after.body);
    assert_eq!(
        data_events(&after.body).last().map(String::as_str),
        Some("[DONE]")
    );
}

/// A gateway restarted on the same address numbers its FEC blocks from 0 again. The edge's
/// datagram layer used to drop the new gateway's packets (stale block ids, or ids it had
/// finalised before) until 64 in a row made it follow, so the new handshake was lost and
/// the first request after the restart failed with `gateway_unreachable`.
#[tokio::test]
async fn after_a_gateway_restart_under_fec_and_obfuscation_the_next_request_succeeds() {
    let dir = TempDir::new("restart-layer-cert");
    let Some((cert, key)) = cert_files(&dir) else {
        eprintln!("SKIP: openssl is not installed");
        return;
    };
    let backend = sim(FAST_SIM);
    let layer = "fec = \"auto\"\nobfs.psk = \"e2e-restart-psk-0123456789\"\n";
    let tls = format!("[tls]\ncert = \"{cert}\"\nkey = \"{key}\"\n");
    let start_gw = |listen: &str| {
        gateway(
            &[&backend],
            "",
            &format!(
                "{tls}[tunnel]\nlisten = \"{listen}\"\ntokens = [\"{TOKEN}\"]\n\
                 [tunnel.datagram]\n{layer}"
            ),
        )
    };
    let mut gw = start_gw("127.0.0.1:0");
    let tunnel = tunnel_addr(&gw);
    let edge = edge(&edge_config(
        &fingerprint(&gw),
        tunnel,
        None,
        "",
        &format!("[quic]\nidle_timeout_ms = 1500\nkeep_alive_ms = 300\n[datagram]\n{layer}"),
    ));
    let url = format!("{}/v1/chat/completions", edge.url());
    for i in 0..20 {
        let r = post(&url, &chat(&format!("before {i}"), true, 32), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // QUIC's MTU discovery works through the layer: its probes go padded to the size of their
    // repairs (a padded-plain packet) and arrive; loopback carries the whole upper bound.
    let mtu = "tokenway_quic_path_mtu_bytes{peer=\"gw\"}";
    let raised = eventually(Duration::from_secs(10), || async {
        metric_sum(&metrics(&edge).await, mtu) > 1200.0
    })
    .await;
    assert!(raised, "{}", metrics(&edge).await);
    for round in 0..2 {
        gw.kill();
        gw = start_gw(&tunnel.to_string());
        let models = get(&format!("{}/v1/models", edge.url())).await;
        assert_eq!(
            models.status, 200,
            "first request after restart {round}: {}",
            models.body
        );
        let after = post(&url, &chat("after restart", true, 4), None).await;
        assert_eq!(after.status, 200, "{}", after.body);
    }
}

async fn echo_server() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// A target that answers "partial" to whatever comes, then resets the connection (a service
/// that crashed mid-answer).
async fn resetting_server() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 64];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(b"partial").await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                let _ = s.set_zero_linger();
            });
        }
    });
    addr
}

/// Over QUIC. (Over the TCP fallback a target's reset still arrives as a clean end: hyper
/// resets an upgraded HTTP/2 stream it drops with CANCEL, and reads CANCEL as the end of the
/// stream, so neither side can tell; docs/edge.md.)
#[tokio::test]
async fn a_target_that_resets_reaches_the_forwarding_application_as_a_reset() {
    let target = resetting_server().await;
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", &format!("forward_allow = [\"{target}\"]"));
    let local = free_tcp_port();
    let _edge = edge_for(
        &gw,
        "",
        &format!("[[forwards]]\nlisten = \"{local}\"\ntarget = \"{target}\"\n"),
    );
    let mut s = tokio::net::TcpStream::connect(local)
        .await
        .expect("connect");
    s.write_all(b"hello").await.expect("write");
    let mut got = Vec::new();
    let end = loop {
        let mut buf = [0u8; 64];
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf))
            .await
            .expect("the forwarded connection ends in time")
        {
            Ok(0) => break Ok(()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => break Err(e.kind()),
        }
    };
    assert_eq!(got, b"partial");
    assert_eq!(
        end,
        Err(std::io::ErrorKind::ConnectionReset),
        "the target's reset became a clean end"
    );
}

fn free_tcp_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr")
}

#[tokio::test]
async fn port_forwarding_reaches_an_allowed_echo_server_and_refuses_other_targets() {
    port_forwarding(false).await;
}

#[tokio::test]
async fn port_forwarding_works_over_the_tcp_fallback_too() {
    port_forwarding(true).await;
}

#[tokio::test]
async fn an_application_reset_reaches_the_forward_target_as_a_reset() {
    // The target notes how its connection ended.
    let target = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the target");
    let target_addr = target.local_addr().expect("target address");
    let (ended_tx, ended) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let Ok((mut c, _)) = target.accept().await else {
            return;
        };
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        let end = loop {
            match c.read(&mut buf).await {
                Ok(0) => break Ok(got),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => break Err(e.kind()),
            }
        };
        let _ = ended_tx.send(end);
    });
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(
        &backend,
        "",
        &format!("forward_allow = [\"{target_addr}\"]"),
    );
    let local = free_tcp_port();
    let _edge = edge(&edge_config(
        &fingerprint(&gw),
        tunnel_addr(&gw),
        gw.tls_addr,
        "",
        &format!("[[forwards]]\nlisten = \"{local}\"\ntarget = \"{target_addr}\"\n"),
    ));
    let mut app = tokio::net::TcpStream::connect(local)
        .await
        .expect("connect");
    app.write_all(b"a half-sent upload").await.expect("write");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The application crashes: its connection is reset, not closed.
    app.set_zero_linger().expect("SO_LINGER 0");
    drop(app);
    let end = tokio::time::timeout(Duration::from_secs(10), ended)
        .await
        .expect("the target's connection ends in time")
        .expect("an end");
    // Before, the edge took the reset for an end of stream and the target saw a clean FIN: a
    // cut upload that looked complete.
    assert_eq!(end, Err(std::io::ErrorKind::ConnectionReset));
}

/// An echo server reached through the tunnel, a non-allow-listed one refused; with
/// `udp_unusable` the edge's QUIC address is a closed port, so everything rides the HTTP/2
/// over TLS fallback (CONNECT on the gateway's TCP front).
async fn port_forwarding(udp_unusable: bool) {
    let echo = echo_server().await;
    let other = echo_server().await;
    let backend = sim(FAST_SIM);
    let mut gw = tunnel_gateway(&backend, "", &format!("forward_allow = [\"{echo}\"]"));
    let (allowed, refused) = (free_tcp_port(), free_tcp_port());
    let quic = if udp_unusable {
        closed_udp_port()
    } else {
        tunnel_addr(&gw)
    };
    let edge = edge(&edge_config(
        &fingerprint(&gw),
        quic,
        gw.tls_addr,
        "",
        &format!(
            "[[forwards]]\nlisten = \"{allowed}\"\ntarget = \"{echo}\"\n\
             [[forwards]]\nlisten = \"{refused}\"\ntarget = \"{other}\"\n"
        ),
    ));
    let mut s = tokio::net::TcpStream::connect(allowed)
        .await
        .expect("connect");
    for msg in [&b"hello through the tunnel"[..], &b"and again"[..]] {
        s.write_all(msg).await.expect("write");
        let mut got = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
            .await
            .expect("echo in time")
            .expect("echo");
        assert_eq!(got, msg);
    }
    let mut open = s;
    // The edge resets a refused forward's connection; the reset may come before the connect
    // returns (the refusal is one loopback round trip away), which is a refusal too.
    match tokio::net::TcpStream::connect(refused).await {
        Ok(mut s) => {
            let _ = s.write_all(b"let me in").await;
            let mut buf = [0u8; 16];
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .expect("closed in time")
                .unwrap_or(0);
            assert_eq!(n, 0, "a refused target must not answer");
        }
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    if udp_unusable {
        let text = metrics(&edge).await;
        assert!(
            metric_sum(&text, "tokenway_tcp_fallback_total") >= 1.0,
            "the forward did not ride the TCP fallback: {text}"
        );
    }

    // The tunnel breaks under the open forwarded connection: the application is told with a
    // reset, not a FIN that would make a cut stream look finished.
    // (The kernel reports a reset once, to the first call after it: the write when it has
    // come already, else the read.)
    gw.kill();
    let wrote = open.write_all(b"anyone there?").await;
    let ended = match wrote {
        Err(e) => Err(e.kind()),
        Ok(()) => {
            let mut buf = [0u8; 16];
            tokio::time::timeout(Duration::from_secs(20), open.read(&mut buf))
                .await
                .expect("the forwarded connection ends in time")
                .map_err(|e| e.kind())
        }
    };
    assert_eq!(
        ended,
        Err(std::io::ErrorKind::ConnectionReset),
        "a broken tunnel must reset the forwarded connection"
    );
}

#[tokio::test]
async fn an_http11_connect_with_the_token_is_spliced_to_an_allowed_target() {
    let echo = echo_server().await;
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", &format!("forward_allow = [\"{echo}\"]"));
    let connect = |target: SocketAddr, key: &str| {
        format!(
            "CONNECT {target} HTTP/1.1\r\nhost: {target}\r\ntw-auth: {TOKEN}\r\n\
             tw-idempotency-key: {key}\r\n\r\n"
        )
    };
    let mut s = tokio::net::TcpStream::connect(gw.addr)
        .await
        .expect("connect");
    // The first bytes for the target ride in the same write as the CONNECT itself.
    let wire = connect(echo, &"a".repeat(32)) + "early bytes";
    s.write_all(wire.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let want_tail = b"\r\n\r\nearly bytes";
    while !got.ends_with(want_tail) {
        let mut buf = [0u8; 256];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("answer in time")
            .expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 200 OK\r\n"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    s.write_all(b"and more").await.expect("write");
    let mut more = [0u8; 8];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut more))
        .await
        .expect("echo in time")
        .expect("echo");
    assert_eq!(&more, b"and more");

    // A target outside `forward_allow` is refused, and nothing is spliced.
    let other = echo_server().await;
    let mut s = tokio::net::TcpStream::connect(gw.addr)
        .await
        .expect("connect");
    s.write_all(connect(other, &"b".repeat(32)).as_bytes())
        .await
        .expect("write");
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("answer in time")
        .expect("read");
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 403"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
}

#[tokio::test]
async fn an_edge_pinning_another_certificate_never_sends_the_request() {
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", "");
    let wrong = format!("sha256:{}", "ab".repeat(32));
    let edge = edge(&edge_config(
        &wrong,
        tunnel_addr(&gw),
        gw.tls_addr,
        "connect_timeout_ms = 500",
        "",
    ));
    let r = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("should not arrive", true, 4),
        None,
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(r.body.contains("gateway_unreachable"), "{}", r.body);
    let gw_text = metrics(&gw).await;
    assert_eq!(
        metric_sum(
            &gw_text,
            "tokenway_requests_total{route=\"/v1/chat/completions\""
        ),
        0.0,
        "{gw_text}"
    );
}

/// The names [`edge_for_two`] gives its gateways.
const GATEWAY_NAMES: [&str; 2] = ["gw-a", "gw-b"];

/// An edge in front of two gateways (`gw-a`, `gw-b`), with extra top-level keys and tables
/// `top`.
fn edge_for_two(gws: &[Proc; 2], top: &str) -> Proc {
    let mut toml = format!(
        "token = \"{TOKEN}\"\n{top}\n[trust]\npin_sha256 = [\"{}\", \"{}\"]\n",
        fingerprint(&gws[0]),
        fingerprint(&gws[1])
    );
    for (gw, name) in gws.iter().zip(GATEWAY_NAMES) {
        toml.push_str(&format!(
            "[[gateways]]\nname = \"{name}\"\nquic = \"{}\"\n",
            tunnel_addr(gw)
        ));
    }
    edge(&toml)
}

/// First tokens the edge saw from gateway `name`, in the edge's `/metrics` text.
fn served_by(text: &str, name: &str) -> f64 {
    metric_sum(
        text,
        &format!("tokenway_ttft_seconds_count{{route=\"/v1/chat/completions\",backend=\"{name}\""),
    )
}

#[tokio::test]
async fn the_edge_fails_over_to_another_gateway_when_its_gateway_dies() {
    let backends = [sim(FAST_SIM), sim(FAST_SIM)];
    let mut gws = [
        tunnel_gateway(&backends[0], "", ""),
        tunnel_gateway(&backends[1], "", ""),
    ];
    let names = GATEWAY_NAMES;
    let edge = edge_for_two(
        &gws,
        "reevaluate_ms = 500\n[quic]\nidle_timeout_ms = 1500\nkeep_alive_ms = 300\n",
    );
    let url = format!("{}/v1/chat/completions", edge.url());
    let served = served_by;
    for i in 0..4 {
        let r = post(&url, &chat(&format!("before {i}"), true, 4), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let text = metrics(&edge).await;
    let in_use = if served(&text, "gw-a") >= served(&text, "gw-b") {
        0
    } else {
        1
    };
    let other = 1 - in_use;
    let before_other = served(&text, names[other]);
    gws[in_use].kill();
    for i in 0..6 {
        let r = post(&url, &chat(&format!("after {i}"), true, 4), None).await;
        assert_eq!(
            r.status, 200,
            "request {i} after the gateway died: {}",
            r.body
        );
        assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
    }
    let text = metrics(&edge).await;
    assert!(
        served(&text, names[other]) >= before_other + 6.0,
        "the surviving gateway did not take over:\n{text}"
    );
}

#[tokio::test]
async fn a_gateway_stopped_with_sigterm_finishes_the_edges_streams_and_the_next_go_elsewhere() {
    // 30 tokens at 40 ms: the stream is under way when its gateway is told to stop.
    let slow = "base_latency_ms = 1.0\ntime_per_output_token_ms = 40.0\n";
    let backends = [sim(slow), sim(slow)];
    let gws = [
        tunnel_gateway(&backends[0], "", ""),
        tunnel_gateway(&backends[1], "", ""),
    ];
    let names = GATEWAY_NAMES;
    let edge = edge_for_two(&gws, "");
    let served = served_by;
    let mut body = open_stream(&edge.url(), "under way", 30).await;
    let mut text = String::new();
    read_events(&mut body, &mut text, 2).await;
    let m = metrics(&edge).await;
    let in_use = if served(&m, names[0]) > 0.0 { 0 } else { 1 };
    assert_eq!(served(&m, names[in_use]), 1.0, "{m}");
    let other = 1 - in_use;
    // SIGTERM, as a service manager stops a gateway for a rolling restart.
    let term = Command::new("kill")
        .args(["-TERM", &gws[in_use].child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(term.success());
    let ended =
        tokio::time::timeout(Duration::from_secs(10), read_to_end(&mut body, &mut text)).await;
    assert!(ended.is_ok(), "the stream did not end");
    assert_eq!(
        data_events(&text).last().map(String::as_str),
        Some("[DONE]"),
        "the stream under way was cut by the shutdown: {text}"
    );
    // The next requests go to the other gateway, none refused on the draining connection.
    let url = format!("{}/v1/chat/completions", edge.url());
    for i in 0..4 {
        let r = post(&url, &chat(&format!("next {i}"), true, 2), None).await;
        assert_eq!(r.status, 200, "request {i} after the SIGTERM: {}", r.body);
        assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
    }
    let m = metrics(&edge).await;
    assert_eq!(served(&m, names[other]), 4.0, "{m}");
}

/// The gateway's in-flight count on backend `b0`.
async fn backend_inflight(gw: &Proc) -> f64 {
    metric_sum(
        &metrics(gw).await,
        "tokenway_backend_inflight{backend=\"b0\"",
    )
}

#[tokio::test]
async fn an_app_that_leaves_mid_request_through_the_tunnel_releases_the_backend_slot() {
    // Slow to start and slow to stream: the answer would take many seconds.
    let backend = sim("base_latency_ms = 4000.0\ntime_per_output_token_ms = 200.0\n");
    let gw = tunnel_gateway(&backend, "", "");
    let edge = edge_for(&gw, "", "");
    for stream in [true, false] {
        let body = chat("never mind", stream, 50);
        let mut s = tokio::net::TcpStream::connect(edge.addr)
            .await
            .expect("connect to the edge");
        let wire = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(wire.as_bytes()).await.expect("write");
        assert!(
            eventually(Duration::from_secs(10), || async {
                backend_inflight(&gw).await == 1.0
            })
            .await,
            "the request never reached the backend"
        );
        // Gone before the first byte: the edge drops its HTTP/3 stream, and the gateway must
        // cancel the upstream request then, not when the answer would have been written.
        drop(s);
        assert!(
            eventually(Duration::from_secs(3), || async {
                backend_inflight(&gw).await == 0.0
            })
            .await,
            "a cancelled tunnel request (stream = {stream}) still holds its backend slot"
        );
    }
    let r = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("still serving", false, 1),
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A UDP relay for one client in front of `to`, dropping every datagram both ways while the
/// returned flag is set (UDP blocked on the path, TCP untouched).
async fn udp_relay(to: SocketAddr) -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    use std::sync::atomic::Ordering;
    let front = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("bind the relay");
    let back = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("bind the relay's upstream socket");
    back.connect(to).await.expect("connect the relay upstream");
    let addr = front.local_addr().expect("relay address");
    let blocked = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = blocked.clone();
    tokio::spawn(async move {
        let (mut up, mut down) = (vec![0u8; 65536], vec![0u8; 65536]);
        let mut client = None;
        loop {
            tokio::select! {
                r = front.recv_from(&mut up) => if let Ok((n, from)) = r {
                    client = Some(from);
                    if !flag.load(Ordering::Relaxed) {
                        let _ = back.send(&up[..n]).await;
                    }
                },
                r = back.recv(&mut down) => if let (Ok(n), Some(c)) = (r, client) {
                    if !flag.load(Ordering::Relaxed) {
                        let _ = front.send_to(&down[..n], c).await;
                    }
                },
            }
        }
    });
    (addr, blocked)
}

#[tokio::test]
async fn with_udp_blocked_a_resumption_ticket_does_not_keep_the_edge_off_tcp() {
    let backend = sim(FAST_SIM);
    let mut gw = tunnel_gateway(&backend, "", "");
    let (relay, blocked) = udp_relay(tunnel_addr(&gw)).await;
    let edge = edge(&edge_config(
        &fingerprint(&gw),
        relay,
        gw.tls_addr,
        "connect_timeout_ms = 1000",
        "",
    ));
    let url = format!("{}/v1/chat/completions", edge.url());
    let reconnect = format!("{}/admin/reconnect", edge.url());
    // Over QUIC, then once more on a resumed connection: the edge holds resumption tickets.
    for i in 0..2 {
        let r = post(&url, &chat(&format!("quic {i}"), true, 4), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(post(&reconnect, "", None).await.status, 200);
    }
    let text = metrics(&edge).await;
    assert_eq!(
        metric_sum(&text, "tokenway_tcp_fallback_total"),
        0.0,
        "{text}"
    );

    // UDP now goes nowhere; the edge redials with a ticket, so its QUIC connection is usable at
    // once (0-RTT) but nothing ever answers it. TCP must still join the race and carry the
    // requests.
    blocked.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(post(&reconnect, "", None).await.status, 200);
    for i in 0..3 {
        let r = post(&url, &chat(&format!("blocked {i}"), true, 4), None).await;
        assert_eq!(r.status, 200, "request {i} with UDP blocked: {}", r.body);
    }
    let text = metrics(&edge).await;
    assert!(
        metric_sum(&text, "tokenway_tcp_fallback_total") >= 1.0,
        "{text}"
    );

    // The gateway gone as well: the answer says nothing answered, not that 0-RTT was rejected.
    gw.kill();
    assert_eq!(post(&reconnect, "", None).await.status, 200);
    let r = post(&url, &chat("nobody there", true, 4), None).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(!r.body.contains("0-RTT rejected"), "{}", r.body);
}

/// A tunnel gateway in front of `backend` and an edge whose QUIC packets pass through a
/// relay that drops everything once its flag is set (TCP to the gateway stays open).
async fn edge_behind_a_udp_relay(
    backend: &Proc,
) -> (Proc, Proc, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    let gw = tunnel_gateway(backend, "", "");
    let (relay, blocked) = udp_relay(tunnel_addr(&gw)).await;
    let edge = edge(&edge_config(
        &fingerprint(&gw),
        relay,
        gw.tls_addr,
        "connect_timeout_ms = 1000",
        "",
    ));
    (gw, edge, blocked)
}

#[tokio::test]
async fn a_quic_path_that_goes_silent_is_left_for_tcp_long_before_the_idle_timeout() {
    let backend = sim(FAST_SIM);
    let (_gw, edge, blocked) = edge_behind_a_udp_relay(&backend).await;
    let url = format!("{}/v1/chat/completions", edge.url());
    let r = post(&url, &chat("over quic", true, 4), None).await;
    assert_eq!(r.status, 200, "{}", r.body);

    // UDP starts going nowhere under an established connection (no reconnect): quinn alone
    // would keep it for its 30 s idle timeout, past this client's 20 s patience.
    blocked.store(true, std::sync::atomic::Ordering::Relaxed);
    let start = std::time::Instant::now();
    let r = post(&url, &chat("path gone", true, 4), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    eprintln!(
        "answered over TCP {:?} after UDP was blocked",
        start.elapsed()
    );
    let text = metrics(&edge).await;
    assert_eq!(
        metric_sum(&text, "tokenway_tunnel_dead_paths_total"),
        1.0,
        "{text}"
    );
    assert!(
        metric_sum(&text, "tokenway_tcp_fallback_total") >= 1.0,
        "{text}"
    );
    let over_tcp = "tokenway_ttft_seconds_count{route=\"/v1/chat/completions\",backend=\"gw\",\
                    transport=\"tunnel-tcp\",";
    assert_eq!(metric_sum(&text, over_tcp), 1.0, "{text}");
}

#[tokio::test]
async fn a_stream_rides_out_a_blackout_that_moves_new_requests_to_tcp() {
    // 30 tokens at 200 ms: a 6 s answer, with a 4 s blackout in its middle.
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 200.0\n");
    let (_gw, edge, blocked) = edge_behind_a_udp_relay(&backend).await;
    let url = format!("{}/v1/chat/completions", edge.url());
    let r = post(&url, &chat("warm up", true, 2), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let long = tokio::spawn({
        let url = url.clone();
        async move { post(&url, &chat("a long answer", true, 30), None).await }
    });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // Coverage drops. A new request finds the path silent: after 3 s it is set aside and the
    // request goes over TCP.
    blocked.store(true, std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = post(&url, &chat("during the blackout", true, 4), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // Coverage is back: the long answer carries on over its QUIC connection, to the end
    // (before, the silent connection was closed, and the answer cut with an error event).
    blocked.store(false, std::sync::atomic::Ordering::Relaxed);
    let r = long.await.expect("the long request");
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(!r.body.contains("\"error\""), "{}", r.body);
    assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
    let text = metrics(&edge).await;
    assert_eq!(
        metric_sum(&text, "tokenway_tunnel_dead_paths_total"),
        1.0,
        "{text}"
    );
}

#[tokio::test]
async fn an_edge_with_a_token_shorter_than_the_gateway_accepts_does_not_start() {
    let dir = TempDir::new("short-token");
    let path = dir.0.join("edge.toml");
    let pin = format!("sha256:{}", "0".repeat(64));
    std::fs::write(
        &path,
        format!(
            "token = \"t\"\n[trust]\npin_sha256 = [\"{pin}\"]\n\
             [[gateways]]\nname = \"gw\"\nquic = \"127.0.0.1:4433\"\n"
        ),
    )
    .expect("write the config");
    let out = Command::new(env!("CARGO_BIN_EXE_tokenway"))
        .args(["edge", "--config"])
        .arg(&path)
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .expect("tokenway runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("token must be at least 16"), "{stderr}");
}

#[tokio::test]
async fn an_edge_whose_token_the_gateway_refuses_says_so_instead_of_passing_the_masquerade_on() {
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", "");
    let config = edge_config(&fingerprint(&gw), tunnel_addr(&gw), None, "", "")
        .replace(TOKEN, "a-wrong-token-of-enough-length");
    let edge = edge(&config);
    let chat_url = format!("{}/v1/chat/completions", edge.url());
    let refused = |r: &Reply| {
        r.status == 502
            && r.body.contains("\"tunnel_auth_failed\"")
            && r.headers
                .get("x-should-retry")
                .is_some_and(|v| v == "false")
    };
    // The very first request already: it must not see the masquerade site either.
    let r = post(&chat_url, &chat("hello", true, 4), None).await;
    assert!(refused(&r), "{} {}", r.status, r.body);
    let r = get(&format!("{}/v1/models", edge.url())).await;
    assert!(refused(&r), "{} {}", r.status, r.body);
    assert!(!r.body.contains("<html"), "{}", r.body);
    // Nothing reached the backend.
    let backend_text = metrics(&backend).await;
    assert_eq!(
        metric_sum(
            &backend_text,
            "tokenway_requests_total{route=\"/v1/chat/completions\""
        ),
        0.0,
        "{backend_text}"
    );
}

#[tokio::test]
async fn a_gateway_that_refuses_the_token_is_passed_over_for_one_that_accepts_it() {
    // A token rotation half done: gateway `a` still has the old list, `b` the new one.
    let backends = [sim(FAST_SIM), sim(FAST_SIM)];
    let old = gateway(
        &[&backends[0]],
        "",
        "[tunnel]\nlisten = \"127.0.0.1:0\"\ntokens = [\"the-old-token-0123456789\"]\n",
    );
    let new = tunnel_gateway(&backends[1], "", "");
    // `b` is out of reach at first, so the edge's (sticky) choice is `a`.
    let (relay, blocked) = udp_relay(tunnel_addr(&new)).await;
    blocked.store(true, std::sync::atomic::Ordering::Relaxed);
    let edge = edge(&format!(
        "token = \"{TOKEN}\"\nreevaluate_ms = 3600000\nconnect_timeout_ms = 500\n\
         [trust]\npin_sha256 = [\"{}\", \"{}\"]\n\
         [[gateways]]\nname = \"a\"\nquic = \"{}\"\n[[gateways]]\nname = \"b\"\nquic = \"{relay}\"\n",
        fingerprint(&old),
        fingerprint(&new),
        tunnel_addr(&old),
    ));
    let url = format!("{}/v1/chat/completions", edge.url());
    let r = post(&url, &chat("only a", true, 4), None).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(r.body.contains("tunnel_auth_failed"), "{}", r.body);

    // `b` comes within reach: requests go there, although `a` stays the RTT choice.
    blocked.store(false, std::sync::atomic::Ordering::Relaxed);
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let r = post(&url, &chat("b is back", true, 4), None).await;
        if r.status == 200 {
            break;
        }
        assert!(r.body.contains("tunnel_auth_failed"), "{}", r.body);
        assert!(
            Instant::now() < end,
            "b never took the requests: {}",
            r.body
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for i in 0..4 {
        let r = post(&url, &chat(&format!("to b {i}"), true, 4), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
    }
    let text = metrics(&edge).await;
    assert!(served_by(&text, "b") >= 5.0, "{text}");
    assert_eq!(served_by(&text, "a"), 0.0, "{text}");
}

#[tokio::test]
async fn with_two_gateways_refusing_the_token_a_request_ends_at_the_third() {
    // Two gateways still on the old token list, one on the new: a request refused by the first
    // must not go back and forth between the two that refuse (it spun there, never waiting).
    let backends = [sim(FAST_SIM), sim(FAST_SIM), sim(FAST_SIM)];
    let old_tunnel =
        "[tunnel]\nlisten = \"127.0.0.1:0\"\ntokens = [\"the-old-token-0123456789\"]\n";
    let old = [
        gateway(&[&backends[0]], "", old_tunnel),
        gateway(&[&backends[1]], "", old_tunnel),
    ];
    let new = tunnel_gateway(&backends[2], "", "");
    let edge = edge(&format!(
        "token = \"{TOKEN}\"\nreevaluate_ms = 3600000\n\
         [trust]\npin_sha256 = [\"{}\", \"{}\", \"{}\"]\n\
         [[gateways]]\nname = \"old-1\"\nquic = \"{}\"\n\
         [[gateways]]\nname = \"old-2\"\nquic = \"{}\"\n\
         [[gateways]]\nname = \"new\"\nquic = \"{}\"\n",
        fingerprint(&old[0]),
        fingerprint(&old[1]),
        fingerprint(&new),
        tunnel_addr(&old[0]),
        tunnel_addr(&old[1]),
        tunnel_addr(&new),
    ));
    let url = format!("{}/v1/chat/completions", edge.url());
    let mut ok = 0;
    let end = Instant::now() + Duration::from_secs(20);
    while ok < 6 {
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            post(&url, &chat(&format!("to the new one {ok}"), true, 4), None),
        )
        .await
        .expect("an answer, not a request going round the refusing gateways");
        if r.status == 200 {
            ok += 1;
        } else {
            // Before every gateway's token check has answered, a refusal may be the answer.
            assert!(r.body.contains("tunnel_auth_failed"), "{}", r.body);
            assert!(Instant::now() < end, "never served: {}", r.body);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let text = metrics(&edge).await;
    assert!(served_by(&text, "new") >= 6.0, "{text}");
}

#[tokio::test]
async fn with_every_path_to_the_gateway_dead_the_error_says_why_in_the_openai_shape() {
    let fp = format!("sha256:{}", "0".repeat(64));
    let tcp = free_tcp_port();
    let edge = edge(&edge_config(
        &fp,
        closed_udp_port(),
        Some(tcp),
        "connect_timeout_ms = 300\nfallback_head_start_ms = 0",
        "",
    ));
    let r = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("anyone?", true, 4),
        None,
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("a JSON error");
    let e = &v["error"];
    assert!(e["param"].is_null() && e.get("param").is_some(), "{v}");
    assert_eq!(e["code"], "gateway_unreachable", "{v}");
    let message = e["message"].as_str().unwrap_or_default();
    // The cause, not just "unreachable": the TCP fallback's refusal is named.
    assert!(message.contains(&tcp.to_string()), "{message}");
}

#[tokio::test]
async fn an_edge_refuses_a_declared_oversized_body_before_reading_it() {
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", "");
    let edge = edge_for(&gw, "max_body_bytes = 4096", "");
    let mut s = tokio::net::TcpStream::connect(edge.addr)
        .await
        .expect("connect to the edge");
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          content-length: 100000000\r\nexpect: 100-continue\r\n\r\n",
    )
    .await
    .expect("write");
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("an answer in time")
        .expect("read");
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
}

#[tokio::test]
async fn the_request_bodies_an_edge_holds_are_bounded_and_a_declaration_alone_holds_nothing() {
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", "");
    // Room for one 60 000-byte body and a bit: a second large body waits.
    let edge = edge_for(
        &gw,
        "max_body_bytes = 65536\nmax_held_body_bytes = 100000",
        "",
    );
    let chat_url = format!("{}/v1/chat/completions", edge.url());
    let busy = |r: &Reply| {
        let v: serde_json::Value = serde_json::from_str(&r.body).expect("a JSON error");
        r.status == 503 && v["error"]["code"] == "edge_busy" && r.headers["retry-after"] == "1"
    };
    // A client that declares a large body and sends none of it keeps no one out.
    let liar = invited_to_send(edge.addr, 60_000, "").await;
    let r = post(&chat_url, &chat_of_len(50_000), None).await;
    assert_eq!(r.status, 200, "a declaration held bytes: {}", r.body);
    // The bytes that did arrive are held: 55 000 of the holder's 60 000.
    let big = chat_of_len(60_000);
    let mut holder = invited_to_send(edge.addr, big.len(), "connection: close\r\n").await;
    holder
        .write_all(&big.as_bytes()[..55_000])
        .await
        .expect("write");
    // A declared body that does not fit the room left is refused before it is invited (and
    // such a probe takes nothing while it waits, so it also tells when the edge has read the
    // holder's bytes).
    let probe = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 50000\r\n\
                 expect: 100-continue\r\n\r\n";
    let mut refused = None;
    for _ in 0..100 {
        let answer = answer_to_head(edge.addr, probe.as_bytes()).await;
        if !answer.starts_with("HTTP/1.1 100 Continue") {
            refused = Some(answer);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let answer = refused.expect("a large body refused while another holds the budget");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    // The same body sent at once, over HTTP/1.1 and over h2c.
    let r = post(&chat_url, &chat_of_len(50_000), None).await;
    assert!(busy(&r), "{} {:?}", r.status, r.body);
    let r = post_h2c(&chat_url, &chat_of_len(50_000)).await;
    assert!(busy(&r), "{} {:?}", r.status, r.body);
    // A small body still fits.
    let r = post(&chat_url, &chat("small", false, 2), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    drop(liar);
    holder_completes(holder, &big.as_bytes()[55_000..], &chat_url).await;
}

#[tokio::test]
async fn at_shutdown_the_edge_finishes_a_stream_in_flight_then_exits() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // 30 tokens at 40 ms: the stream is still running when the edge is told to stop.
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 40.0\n");
    let gw = tunnel_gateway(&backend, "", "");
    let mut edge = edge_for(&gw, "", "");
    let body = chat("drain the edge", true, 30);
    let mut conn = tokio::net::TcpStream::connect(edge.addr)
        .await
        .expect("connect");
    conn.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .expect("write");
    let mut answer = vec![0u8; 64 << 10];
    let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut answer))
        .await
        .expect("a first frame in time")
        .expect("read");
    let mut text = answer[..n].to_vec();
    assert!(
        text.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&text)
    );
    // SIGTERM, as a service manager stops it.
    let term = std::process::Command::new("kill")
        .args(["-TERM", &edge.child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(term.success());
    // The answer finishes, and then the edge closes the connection (keep-alive ends).
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut text))
        .await
        .expect("the connection closes after the answer")
        .expect("read");
    let text = String::from_utf8_lossy(&text);
    assert!(text.contains("data: [DONE]"), "{text}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = edge.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the edge did not exit after draining"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn a_request_head_larger_than_the_gateway_takes_is_a_431_not_a_retried_502() {
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", "");
    let edge = edge_for(&gw, "", "");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         x-big: {}\r\ncontent-length: {}\r\n\r\n{}",
        "a".repeat(70_000),
        chat("big head", true, 4).len(),
        chat("big head", true, 4)
    );
    let answer = answer_to_head(edge.addr, head.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    assert!(
        answer.contains("request_header_fields_too_large"),
        "{answer}"
    );
    // The edge's connections are untouched: the next request goes through.
    let r = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("small head", true, 4),
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let text = metrics(&edge).await;
    assert_eq!(
        metric_sum(&text, "tokenway_tunnel_connections_total"),
        1.0,
        "{text}"
    );
}

#[tokio::test]
async fn an_edge_starts_with_a_gateway_whose_name_does_not_resolve_and_uses_the_others() {
    let backend = sim(FAST_SIM);
    let gw = tunnel_gateway(&backend, "", "");
    // `.invalid` never resolves (RFC 6761): a gateway named before the network is up, or one
    // gone from DNS. The edge still starts, and serves through the gateway it can reach.
    let toml = format!(
        "token = \"{TOKEN}\"\n[trust]\npin_sha256 = [\"{}\"]\n\
         [[gateways]]\nname = \"gone\"\nquic = \"gateway.invalid:4433\"\n\
         [[gateways]]\nname = \"gw\"\nquic = \"{}\"\n",
        fingerprint(&gw),
        tunnel_addr(&gw)
    );
    let edge = edge(&toml);
    let r = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("hello", true, 4),
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // With only such a gateway, the edge starts too and says why nothing is reachable.
    let alone = edge_config(
        &fingerprint(&gw),
        tunnel_addr(&gw),
        None,
        "connect_timeout_ms = 300\nfallback_head_start_ms = 0",
        "",
    )
    .replace(&tunnel_addr(&gw).to_string(), "gateway.invalid:4433");
    let edge = crate::harness::edge(&alone);
    let r = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("anyone?", true, 4),
        None,
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(r.body.contains("gateway.invalid"), "{}", r.body);
}
