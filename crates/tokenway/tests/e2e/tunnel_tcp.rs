//! The tunnel's own TLS port (`tunnel.tcp_listen`): edges on their TCP fallback reach the
//! gateway through it; a probe without the tunnel token sees the masquerade site there, as on
//! the tunnel's UDP port, and nothing that names the gateway.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::harness::*;

const TOKEN: &str = "e2e-tunnel-tcp-token-0123456789";

/// `curl -sk` over `http` (`--http1.1` or `--http2`) with `args`: status line and headers, then
/// the body.
fn curl(http: &str, args: &[&str]) -> String {
    let out = Command::new("curl")
        .args(["-sk", "-D", "-", "--max-time", "20", http])
        .args(args)
        .output()
        .expect("curl runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn probes_of_the_tunnels_tcp_port_see_the_masquerade_and_edges_get_through() {
    if !command_has("curl") {
        eprintln!("skipped: curl is not installed (scripts/setup.sh installs it)");
        return;
    }
    let backend = sim(FAST_SIM);
    let gw = gateway(
        &[&backend],
        "tls_listen = \"127.0.0.1:0\"\napi_keys = [\"sk-e2e\"]",
        &format!(
            "[tunnel]\nlisten = \"127.0.0.1:0\"\ntcp_listen = \"127.0.0.1:0\"\ntokens = [\"{TOKEN}\"]\n"
        ),
    );
    let port: SocketAddr = gw
        .extra("tunnel-tcp")
        .expect("the gateway announces its tunnel TCP port");

    // Every path, over HTTP/1.1 and HTTP/2: the site's page, never the gateway's API.
    for http in ["--http1.1", "--http2"] {
        for path in ["/", "/metrics", "/status", "/admin/backends", "/v1/models"] {
            let answer = curl(http, &[&format!("https://{port}{path}")]);
            let lower = answer.to_ascii_lowercase();
            assert!(answer.contains(" 200"), "{http} {path}: {answer}");
            assert!(lower.contains("text/html"), "{http} {path}: {answer}");
            for tell in ["tokenway", "alt-svc", "\"error\"", "backend"] {
                assert!(
                    !lower.contains(tell),
                    "{http} {path} shows {tell:?}: {answer}"
                );
            }
        }
    }

    // A POST with a large body is answered from its head: the body is not read, and the answer
    // is the site's, not an API error.
    let dir = TempDir::new("tunnel-tcp");
    let big = dir.0.join("body");
    std::fs::write(&big, vec![b'x'; 24 << 20]).expect("write body");
    let answer = curl(
        "--http1.1",
        &[
            "-H",
            "expect: 100-continue",
            "-H",
            "content-type: application/json",
            "--data-binary",
            &format!("@{}", big.display()),
            &format!("https://{port}/v1/chat/completions"),
        ],
    );
    assert!(answer.contains(" 405"), "{answer}");
    assert!(!answer.contains(" 100 Continue"), "{answer}");
    assert!(!answer.to_ascii_lowercase().contains("api_key"), "{answer}");

    // An edge with no usable UDP falls back to this port and is served.
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind UDP");
    let closed = udp.local_addr().expect("addr");
    drop(udp);
    let fingerprint = gw.fingerprint().expect("fingerprint");
    let edge = edge(&format!(
        "token = \"{TOKEN}\"\n[trust]\npin_sha256 = [\"{fingerprint}\"]\n\
         [[gateways]]\nname = \"gw\"\nquic = \"{closed}\"\ntcp = \"{port}\"\n"
    ));
    let reply = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("over the tunnel's own TCP port", true, 6),
        Some("sk-e2e"),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("[DONE]"), "{}", reply.body);
    let text = metrics_reaching(
        &gw.url(),
        "tokenway_ttft_seconds_count{route=\"/v1/chat/completions\",backend=\"b0\",transport=\"tunnel-tcp\",",
        1.0,
    )
    .await;
    assert!(
        metric_sum(
            &text,
            "tokenway_ttft_seconds_count{route=\"/v1/chat/completions\",backend=\"b0\",transport=\"tunnel-tcp\","
        ) >= 1.0,
        "{text}"
    );
}

/// A web site for `tunnel.masquerade.proxy`: answers every request with a small page and
/// collects the request lines it was asked.
async fn counting_site() -> (SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the site");
    let addr = listener.local_addr().expect("site address");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut head = Vec::new();
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&head);
                let line = text.lines().next().unwrap_or_default().to_string();
                log.lock().expect("log").push(line);
                let page = "<html>a site</html>";
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\n\
                     connection: close\r\n\r\n{page}",
                    page.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
            });
        }
    });
    (addr, seen)
}

#[tokio::test]
async fn an_edge_on_the_tcp_fallback_measures_the_gateway_not_the_masquerade_site() {
    let (site, seen) = counting_site().await;
    let backend = sim(FAST_SIM);
    let gw = gateway(
        &[&backend],
        "tls_listen = \"127.0.0.1:0\"",
        &format!(
            "[tunnel]\nlisten = \"127.0.0.1:0\"\ntcp_listen = \"127.0.0.1:0\"\n\
             tokens = [\"{TOKEN}\"]\n[tunnel.masquerade]\nproxy = \"http://{site}\"\n"
        ),
    );
    let port: SocketAddr = gw
        .extra("tunnel-tcp")
        .expect("the gateway announces its tunnel TCP port");
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind UDP");
    let closed = udp.local_addr().expect("addr");
    drop(udp);
    let fingerprint = gw.fingerprint().expect("fingerprint");
    let edge = edge(&format!(
        "token = \"{TOKEN}\"\n[trust]\npin_sha256 = [\"{fingerprint}\"]\n\
         [[gateways]]\nname = \"gw\"\nquic = \"{closed}\"\ntcp = \"{port}\"\n"
    ));
    let reply = post(
        &format!("{}/v1/chat/completions", edge.url()),
        &chat("on the fallback", true, 4),
        None,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    // The link measures its RTT with `GET /health` every half second; with the token, the
    // gateway answers it, and the site behind the masquerade is never asked.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let seen = seen.lock().expect("log").clone();
    assert!(seen.is_empty(), "the masquerade site was asked: {seen:?}");
    // The site does answer a probe without the token (curl blocks: off this runtime's thread,
    // which serves the site).
    if command_has("curl") {
        let url = format!("https://{port}/health");
        let answer = tokio::task::spawn_blocking(move || curl("--http1.1", &[&url]))
            .await
            .expect("curl ran");
        assert!(answer.contains("a site"), "{answer}");
    }
}

/// A TCP relay in front of `to`, and how many connections it has accepted. Connections
/// numbered (from 1) up to the value of the returned flag are black holes: held open, nothing
/// forwarded either way, as when the path died under them; later ones are relayed.
async fn freezable_tcp_relay(to: SocketAddr) -> (SocketAddr, Arc<AtomicU64>, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the relay");
    let addr = listener.local_addr().expect("relay address");
    let frozen_upto = Arc::new(AtomicU64::new(0));
    let accepted = Arc::new(AtomicU64::new(0));
    let (flag, count) = (frozen_upto.clone(), accepted.clone());
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let id = count.fetch_add(1, Ordering::Relaxed) + 1;
            let flag = flag.clone();
            tokio::spawn(async move {
                let Ok(upstream) = tokio::net::TcpStream::connect(to).await else {
                    return;
                };
                let (cr, cw) = client.into_split();
                let (ur, uw) = upstream.into_split();
                let pump = |mut r: tokio::net::tcp::OwnedReadHalf,
                            mut w: tokio::net::tcp::OwnedWriteHalf,
                            flag: Arc<AtomicU64>| async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buf = vec![0u8; 16384];
                    loop {
                        match r.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) if id <= flag.load(Ordering::Relaxed) => {
                                // A dead path: the sockets stay, the bytes go nowhere.
                                std::future::pending::<()>().await;
                            }
                            Ok(k) => {
                                if w.write_all(&buf[..k]).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                };
                let up = tokio::spawn(pump(cr, uw, flag.clone()));
                pump(ur, cw, flag).await;
                let _ = up.await;
            });
        }
    });
    (addr, frozen_upto, accepted)
}

#[tokio::test]
async fn a_tcp_fallback_connection_that_stops_answering_is_redialed() {
    let backend = sim(FAST_SIM);
    let gw = gateway(
        &[&backend],
        "tls_listen = \"127.0.0.1:0\"",
        &format!(
            "[tunnel]\nlisten = \"127.0.0.1:0\"\ntcp_listen = \"127.0.0.1:0\"\ntokens = [\"{TOKEN}\"]\n"
        ),
    );
    let port: SocketAddr = gw
        .extra("tunnel-tcp")
        .expect("the gateway announces its tunnel TCP port");
    let (relay, frozen_upto, accepted) = freezable_tcp_relay(port).await;
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind UDP");
    let closed = udp.local_addr().expect("addr");
    drop(udp);
    let fingerprint = gw.fingerprint().expect("fingerprint");
    let edge = edge(&format!(
        "token = \"{TOKEN}\"\n[trust]\npin_sha256 = [\"{fingerprint}\"]\n\
         [[gateways]]\nname = \"gw\"\nquic = \"{closed}\"\ntcp = \"{relay}\"\n"
    ));
    let url = format!("{}/v1/chat/completions", edge.url());
    let reply = post(&url, &chat("before", true, 4), None).await;
    assert_eq!(reply.status, 200, "{}", reply.body);

    // The path dies under the open connection (no FIN, no RST): its RTT probes go unanswered
    // and the edge dials a new one within three probes (~7.5 s), where HTTP/2's keep-alive
    // alone would take 20 s.
    let open = accepted.load(Ordering::Relaxed);
    frozen_upto.store(open, Ordering::Relaxed);
    let end = Instant::now() + Duration::from_secs(15);
    while accepted.load(Ordering::Relaxed) == open && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        accepted.load(Ordering::Relaxed) > open,
        "the edge kept its dead TCP connection"
    );
    let reply = post(&url, &chat("after", true, 4), None).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("[DONE]"), "{}", reply.body);
}
