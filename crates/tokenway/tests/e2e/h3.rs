//! The gateway's HTTP/3 fronts, seen by an independent HTTP/3 client (aioquic): the public front
//! serves the API; the tunnel port shows its masquerade site to anyone without the token.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use crate::harness::*;

const TOKEN: &str = "e2e-tunnel-token-0123456789";

/// Runs tests/python/h3_client.py; `None` when aioquic is missing outside CI.
fn h3(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[&str],
) -> Option<serde_json::Value> {
    let probe = Command::new("python3")
        .args(["-c", "import aioquic"])
        .output();
    if !probe.map(|o| o.status.success()).unwrap_or(false) {
        assert!(
            std::env::var_os("TOKENWAY_REQUIRE_PYTHON").is_none(),
            "TOKENWAY_REQUIRE_PYTHON is set but `import aioquic` fails"
        );
        eprintln!("SKIP: aioquic is not installed (scripts/setup.sh installs it)");
        return None;
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/h3_client.py"
    );
    let mut cmd = Command::new("python3");
    cmd.arg(script)
        .arg(addr.ip().to_string())
        .arg(addr.port().to_string())
        .arg(method)
        .arg(path);
    if let Some(b) = body {
        cmd.arg("--body").arg(b);
    }
    for h in headers {
        cmd.arg("--header").arg(h);
    }
    let out = cmd.output().expect("python3 runs");
    assert!(
        out.status.success(),
        "h3 client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("h3 client prints JSON"))
}

fn quic_gateway(backend: &Proc, tunnel_extra: &str) -> Proc {
    gateway(
        &[backend],
        "h3_listen = \"127.0.0.1:0\"",
        &format!("[tunnel]\nlisten = \"127.0.0.1:0\"\ntokens = [\"{TOKEN}\"]\n{tunnel_extra}\n"),
    )
}

#[tokio::test]
async fn aioquic_streams_chat_over_the_public_http3_front() {
    let backend = sim(FAST_SIM);
    let gw = quic_gateway(&backend, "");
    let h3_addr = gw.extra("h3").expect("h3 front");
    let body = chat("over http/3", true, 12);
    let Some(r) = h3(h3_addr, "POST", "/v1/chat/completions", Some(&body), &[]) else {
        return;
    };
    assert_eq!(r["status"], 200, "{r}");
    let direct = post(
        &format!("{}/v1/chat/completions", backend.url()),
        &body,
        None,
    )
    .await;
    let want: Vec<_> = data_events(&direct.body)
        .iter()
        .map(|e| normalize(e))
        .collect();
    let got: Vec<_> = data_events(r["body"].as_str().unwrap_or_default())
        .iter()
        .map(|e| normalize(e))
        .collect();
    assert_eq!(got, want);
    // The front's QUIC statistics are exported.
    let m = get(&format!("{}/metrics", gw.url())).await.body;
    assert!(
        metric_sum(&m, "tokenway_quic_rtt_samples_seconds_count{peer=\"h3\"}") >= 1.0,
        "{m}"
    );
    // Every connection of the front shares its label: no gauge that would hold whichever
    // connection was sampled last.
    assert!(!m.contains("tokenway_quic_rtt_seconds{peer=\"h3\"}"), "{m}");
    assert!(!m.contains("tokenway_quic_cwnd_bytes{peer=\"h3\"}"), "{m}");
    // TCP responses advertise the HTTP/3 front.
    let health = get(&format!("{}/health", gw.url())).await;
    let alt = health
        .headers
        .get("alt-svc")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    assert_eq!(alt, format!("h3=\":{}\"; ma=86400", h3_addr.port()));
}

#[tokio::test]
async fn the_tunnel_port_shows_the_masquerade_site_and_never_proxies_without_the_token() {
    let backend = sim(FAST_SIM);
    let site = TempDir::new("site");
    std::fs::write(site.0.join("index.html"), "<h1>Bakery opening hours</h1>").expect("write");
    let gw = quic_gateway(
        &backend,
        &format!("[tunnel.masquerade]\ndir = \"{}\"\n", site.0.display()),
    );
    let tunnel = gw.extra("tunnel").expect("tunnel port");
    let body = chat("let me in", true, 4);
    for headers in [
        vec![],
        vec![
            "tw-auth:wrong-token",
            "tw-idempotency-key:00112233445566778899aabbccddeeff",
        ],
    ] {
        let Some(r) = h3(tunnel, "GET", "/", None, &headers) else {
            return;
        };
        assert_eq!(r["status"], 200);
        assert_eq!(r["body"], "<h1>Bakery opening hours</h1>");
        let text = r.to_string().to_lowercase();
        assert!(!text.contains("tokenway"), "{text}");
        let r = h3(
            tunnel,
            "POST",
            "/v1/chat/completions",
            Some(&body),
            &headers,
        )
        .expect("aioquic");
        assert_eq!(r["status"], 405, "{r}");
        assert!(!r.to_string().to_lowercase().contains("tokenway"), "{r}");
    }
    let m = get(&format!("{}/metrics", backend.url())).await.body;
    assert_eq!(
        metric_sum(&m, "tokenway_requests_total{route=\"/v1/chat/completions\""),
        0.0,
        "{m}"
    );
}

#[tokio::test]
async fn a_replayed_idempotency_key_is_refused_and_not_executed_twice() {
    let backend = sim(FAST_SIM);
    let gw = quic_gateway(&backend, "");
    let tunnel = gw.extra("tunnel").expect("tunnel port");
    let auth = format!("tw-auth:{TOKEN}");
    let headers = [
        auth.as_str(),
        "tw-idempotency-key:0123456789abcdef0123456789abcdef",
    ];
    let body = chat("once only", false, 3);
    let Some(first) = h3(
        tunnel,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        &headers,
    ) else {
        return;
    };
    assert_eq!(first["status"], 200, "{first}");
    let again = h3(
        tunnel,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        &headers,
    )
    .expect("aioquic");
    assert_eq!(again["status"], 409, "{again}");
    let m = get(&format!("{}/metrics", backend.url())).await.body;
    assert_eq!(
        metric_sum(&m, "tokenway_requests_total{route=\"/v1/chat/completions\""),
        1.0,
        "{m}"
    );
}

#[tokio::test]
async fn garbage_datagrams_do_not_disturb_live_http3_streams() {
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 20.0\n");
    let gw = quic_gateway(&backend, "");
    let h3_addr = gw.extra("h3").expect("h3 front");
    let tunnel = gw.extra("tunnel").expect("tunnel");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooder = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
            let mut i: u32 = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i = i.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let len = 1 + (i as usize % 1400);
                // Random bytes, some shaped like QUIC long-header Initials (half-open handshakes).
                let mut pkt: Vec<u8> = (0..len)
                    .map(|j| (i.rotate_left(j as u32 % 32) as u8) ^ j as u8)
                    .collect();
                if i.is_multiple_of(3) {
                    pkt[0] = 0xc0 | (pkt[0] & 0x0f);
                }
                let _ = sock.send_to(&pkt, h3_addr);
                let _ = sock.send_to(&pkt, tunnel);
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    let body = chat("despite the noise", true, 20);
    let r = h3(h3_addr, "POST", "/v1/chat/completions", Some(&body), &[]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = flooder.join();
    let Some(r) = r else { return };
    assert_eq!(r["status"], 200, "{r}");
    let events = data_events(r["body"].as_str().unwrap_or_default());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(
        events.len(),
        1 + 20 + 1 + 1,
        "role, 20 tokens, finish, [DONE]"
    );
}

/// Whether aioquic can be imported (and, when it cannot, whether that is allowed here).
fn have_aioquic() -> bool {
    if python_has("aioquic") {
        return true;
    }
    assert!(
        std::env::var_os("TOKENWAY_REQUIRE_PYTHON").is_none(),
        "TOKENWAY_REQUIRE_PYTHON is set but `import aioquic` fails"
    );
    eprintln!("SKIP: aioquic is not installed (scripts/setup.sh installs it)");
    false
}

/// An aioquic client (one QUIC connection to `addr`) that runs `body` with `cl` (the protocol,
/// whose `h3` is an `H3Connection`) and `arg` in scope; stdin and stdout are piped.
fn aioquic_client(addr: SocketAddr, body: &str, arg: &str) -> std::process::Child {
    let script = format!(
        "import asyncio, os, ssl, sys\n\
         from aioquic.asyncio.client import connect\n\
         from aioquic.asyncio.protocol import QuicConnectionProtocol\n\
         from aioquic.h3.connection import H3_ALPN, H3Connection\n\
         from aioquic.quic.configuration import QuicConfiguration\n\
         class C(QuicConnectionProtocol):\n\
         \x20   def __init__(s, *a, **k):\n\
         \x20       super().__init__(*a, **k)\n\
         \x20       s.h3 = H3Connection(s._quic)\n\
         \x20   def quic_event_received(s, e):\n\
         \x20       s.h3.handle_event(e)\n\
         def line():\n\
         \x20   return asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)\n\
         async def main(arg):\n\
         \x20   c = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)\n\
         \x20   c.verify_mode = ssl.CERT_NONE\n\
         \x20   async with connect('{}', {}, configuration=c, create_protocol=C) as cl:\n\
         {}\n\
         asyncio.run(main(sys.argv[1]))\n",
        addr.ip(),
        addr.port(),
        body.lines()
            .map(|l| format!("        {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    Command::new("python3")
        .args(["-c", &script, arg])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 starts")
}

/// Sends a chat request, says `sent`, and on a line from stdin either stops reading the answer
/// (`stop`, STOP_SENDING and RESET_STREAM, connection kept) or closes the connection (`close`).
const CANCEL_CLIENT: &str = r#"sid = cl._quic.get_next_available_stream_id()
cl.h3.send_headers(sid, [(b':method', b'POST'), (b':scheme', b'https'), (b':authority', b'localhost'), (b':path', b'/v1/chat/completions'), (b'content-type', b'application/json')])
cl.h3.send_data(sid, b'{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":50}', end_stream=True)
cl.transmit()
print('sent', flush=True)
await line()
if arg == 'stop':
    cl._quic.stop_stream(sid, 0x10c)
    cl._quic.reset_stream(sid, 0x10c)
    cl.transmit()
    await asyncio.sleep(60)"#;

#[tokio::test]
async fn a_cancelled_http3_request_releases_its_backend_slot_at_once() {
    if !have_aioquic() {
        return;
    }
    // Slow to start and slow to stream: the answer would take many seconds.
    let backend = sim("base_latency_ms = 4000.0\ntime_per_output_token_ms = 200.0\n");
    let gw = quic_gateway(&backend, "");
    let h3_addr = gw.extra("h3").expect("h3 front");
    let metrics = format!("{}/metrics", gw.url());
    let inflight = || async {
        metric_sum(
            &get(&metrics).await.body,
            "tokenway_backend_inflight{backend=\"b0\"",
        )
    };
    for how in ["stop", "close"] {
        let mut client = aioquic_client(h3_addr, CANCEL_CLIENT, how);
        assert!(
            eventually(Duration::from_secs(10), || async {
                inflight().await == 1.0
            })
            .await,
            "the request never reached the backend"
        );
        {
            use std::io::Write;
            let stdin = client.stdin.as_mut().expect("stdin is piped");
            stdin
                .write_all(b"go\n")
                .expect("the client reads its stdin");
        }
        assert!(
            eventually(Duration::from_secs(3), || async { inflight().await == 0.0 }).await,
            "an HTTP/3 request cancelled by `{how}` still holds its backend slot"
        );
        let _ = client.kill();
        let _ = client.wait();
    }
}

/// Opens a request stream whose HEADERS frame announces 2^40 bytes, sends `arg` MiB of its
/// "payload", and prints the error code the server closed the connection with (or `open`).
const BLOATED_HEAD_CLIENT: &str = r#"sid = cl._quic.get_next_available_stream_id()
cl._quic.send_stream_data(sid, bytes.fromhex('01c000010000000000'))
chunk = os.urandom(64 * 1024)
for _ in range(int(arg) * 16):
    if cl._quic._close_event is not None:
        break
    try:
        cl._quic.send_stream_data(sid, chunk)
    except RuntimeError:
        break
    cl.transmit()
    await asyncio.sleep(0)
try:
    await asyncio.wait_for(cl.wait_closed(), 10)
except asyncio.TimeoutError:
    pass
ev = cl._quic._close_event
print('open' if ev is None else ev.error_code, flush=True)"#;

#[tokio::test]
async fn a_headers_frame_announcing_more_than_the_head_limit_closes_the_connection() {
    if !have_aioquic() {
        return;
    }
    let backend = sim(FAST_SIM);
    let gw = quic_gateway(&backend, "");
    let fronts = [
        ("public", gw.extra("h3").expect("h3 front")),
        ("tunnel", gw.extra("tunnel").expect("tunnel port")),
    ];
    for (front, addr) in fronts {
        let client = aioquic_client(addr, BLOATED_HEAD_CLIENT, "8");
        let out = tokio::task::spawn_blocking(move || client.wait_with_output())
            .await
            .expect("join")
            .expect("the client runs");
        let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
        // H3_EXCESSIVE_LOAD (RFC 9114 section 8.1), without a token on the tunnel port too:
        // the frame is refused from its header, before any of its payload is kept.
        assert_eq!(
            said,
            "263",
            "{front}: the connection was not closed with H3_EXCESSIVE_LOAD: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The gateway still serves.
    let body = chat("still there", true, 4);
    let Some(r) = h3(
        fronts[0].1,
        "POST",
        "/v1/chat/completions",
        Some(&body),
        &[],
    ) else {
        return;
    };
    assert_eq!(r["status"], 200, "{r}");
}

/// Writes `arg` MiB into the client's QPACK encoder stream, and says whether the server took
/// it all (acknowledged every byte within 15 s) or left it stuck in flow control.
const QPACK_FLOOD_CLIENT: &str = r#"sid = cl.h3._local_encoder_stream_id
chunk = bytes(64 * 1024)
for _ in range(int(arg) * 16):
    cl._quic.send_stream_data(sid, chunk)
    cl.transmit()
    await asyncio.sleep(0)
s = cl._quic._streams[sid].sender
for _ in range(300):
    cl.transmit()
    if s._buffer_start == s._buffer_stop:
        break
    await asyncio.sleep(0.05)
print('taken' if s._buffer_start == s._buffer_stop else 'stuck at %d of %d' % (s._buffer_start, s._buffer_stop), flush=True)"#;

#[tokio::test]
async fn a_client_writing_into_its_qpack_encoder_stream_pins_no_server_memory() {
    if !have_aioquic() {
        return;
    }
    let backend = sim(FAST_SIM);
    let gw = quic_gateway(&backend, "");
    // 24 MiB, three times a stream's receive window: the server must read and drop what it
    // does not use (it has no dynamic table), not leave it buffered for the connection's life.
    let client = aioquic_client(gw.extra("h3").expect("h3 front"), QPACK_FLOOD_CLIENT, "24");
    let out = tokio::task::spawn_blocking(move || client.wait_with_output())
        .await
        .expect("join")
        .expect("the client runs");
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(said, "taken", "{}", String::from_utf8_lossy(&out.stderr));
}

/// A quinn-based HTTP/3 client (the edge's) connected to `gw`'s public HTTP/3 front, trusting
/// the certificate the gateway announced; with its endpoint (a quinn `Endpoint`, which this
/// crate does not name), to keep while the client is used.
async fn quinn_client(
    gw: &Proc,
) -> (
    tokenway_transport::client::QuicClient,
    Box<dyn std::any::Any>,
) {
    try_quinn_client(gw).await.expect("connected")
}

/// [`quinn_client`], or why it could not connect.
async fn try_quinn_client(
    gw: &Proc,
) -> Result<
    (
        tokenway_transport::client::QuicClient,
        Box<dyn std::any::Any>,
    ),
    tokenway_transport::TransportError,
> {
    quic_client_at(gw, gw.extra("h3").expect("h3 front")).await
}

#[tokio::test]
async fn quic_connections_past_max_connections_are_refused_until_one_closes() {
    let backend = sim(FAST_SIM);
    let gw = gateway(
        &[&backend],
        "h3_listen = \"127.0.0.1:0\"\nmax_connections = 1",
        &format!("[tunnel]\nlisten = \"127.0.0.1:0\"\ntokens = [\"{TOKEN}\"]\n"),
    );
    let first = quinn_client(&gw).await;
    let refused = try_quinn_client(&gw).await;
    assert!(refused.is_err(), "a second connection was accepted");
    // The first one goes: its slot is free again.
    first.0.close();
    drop(first);
    let mut again = None;
    for _ in 0..50 {
        if let Ok(c) = try_quinn_client(&gw).await {
            again = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        again.is_some(),
        "no connection accepted after the first closed"
    );
}

fn chat_request(body: String) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    http::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .expect("request")
}

#[tokio::test]
async fn an_http3_client_that_never_reads_is_cut_off_and_its_backend_slot_released() {
    // The answer streams far more than the stream's flow-control window: a client that reads
    // none of it leaves the gateway's writes waiting, with its QUIC connection alive (quinn
    // acknowledges packets whether or not the application reads them).
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 0.0\n");
    let gw = gateway(
        &[&backend],
        "h3_listen = \"127.0.0.1:0\"",
        &format!(
            "[timeouts]\nclient_write_ms = 500\n\
             [tunnel]\nlisten = \"127.0.0.1:0\"\ntokens = [\"{TOKEN}\"]\n"
        ),
    );
    let (client, _endpoint) = quinn_client(&gw).await;
    let req = chat_request(chat("flood me", true, 400_000));
    let unread = client.send_request(req).await.expect("response head");
    assert_eq!(unread.status(), 200);
    assert!(
        b0_released(&gw, Duration::from_secs(15)).await,
        "the never-reading HTTP/3 client still holds a backend slot"
    );
    // Only that stream was cut: the connection serves a request that is read.
    let resp = client
        .send_request(chat_request(chat("read me", true, 4)))
        .await
        .expect("a second request on the same connection");
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("the whole answer")
        .to_bytes();
    let text = String::from_utf8_lossy(&body);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    drop(unread);
}

#[tokio::test]
async fn at_shutdown_an_http3_stream_in_flight_finishes_before_the_gateway_exits() {
    use http_body_util::BodyExt;

    // 30 tokens at 40 ms: the stream is still running when the gateway is told to stop.
    let backend = sim("base_latency_ms = 1.0\ntime_per_output_token_ms = 40.0\n");
    let mut gw = quic_gateway(&backend, "");
    let (client, _endpoint) = quinn_client(&gw).await;
    let resp = client
        .send_request(chat_request(chat("drain me", true, 30)))
        .await
        .expect("response head");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = body
        .frame()
        .await
        .expect("a first frame")
        .expect("readable");
    let mut text = first.into_data().map(|d| d.to_vec()).unwrap_or_default();
    // SIGTERM, as a service manager stops it.
    let term = Command::new("kill")
        .args(["-TERM", &gw.child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(term.success());
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("the stream finishes, not reset by the shutdown");
        if let Ok(d) = frame.into_data() {
            text.extend_from_slice(&d);
        }
    }
    let text = String::from_utf8_lossy(&text);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // The gateway then exits on its own.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while gw.child.try_wait().ok().flatten().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the gateway did not exit after draining"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
