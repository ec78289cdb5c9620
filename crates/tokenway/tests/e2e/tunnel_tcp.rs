//! The tunnel's own TLS port (`tunnel.tcp_listen`): edges on their TCP fallback reach the
//! gateway through it; a probe without the tunnel token sees the masquerade site there, as on
//! the tunnel's UDP port, and nothing that names the gateway.

use std::net::SocketAddr;
use std::process::Command;

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
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
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
