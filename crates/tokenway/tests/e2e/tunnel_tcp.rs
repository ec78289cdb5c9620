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
