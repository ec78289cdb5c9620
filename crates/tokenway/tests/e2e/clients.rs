//! Real clients: curl over HTTP/1.1, h2c and HTTP/2 over TLS, and the official `openai` package.

use std::process::Command;

use crate::harness::*;

fn curl(args: &[&str]) -> (String, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20"])
        .args(args)
        .output()
        .expect("curl is installed (the project's .ci/run installs it)");
    assert!(
        out.status.success(),
        "curl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn curl_post(url: &str, body: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "-N",
        "-H",
        "content-type: application/json",
        "-d",
        body,
        "-w",
        "\n%{http_version} %{http_code}\n",
    ];
    args.extend_from_slice(extra);
    args.push(url);
    curl(&args).0
}

/// Splits curl's output into the body and the `http_version http_code` trailer line.
fn split_trailer(out: &str) -> (&str, &str) {
    let trimmed = out.trim_end();
    let cut = trimmed.rfind('\n').expect("trailer line");
    (&trimmed[..cut], &trimmed[cut + 1..])
}

#[tokio::test]
async fn curl_over_http1_h2c_tls_http1_and_tls_h2_streams_the_backends_events() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "tls_listen = \"127.0.0.1:0\"", "");
    let tls = gw.tls_addr.expect("TLS listener");
    for stream in [true, false] {
        let body = chat("curl says hello", stream, 16);
        let direct = curl_post(
            &format!("{}/v1/chat/completions", backend.url()),
            &body,
            &[],
        );
        let (direct_body, _) = split_trailer(&direct);
        let expect: Vec<_> = data_events(direct_body)
            .iter()
            .map(|e| normalize(e))
            .collect();
        let cases: [(String, Vec<&str>, &str); 4] = [
            (
                format!("{}/v1/chat/completions", gw.url()),
                vec!["--http1.1"],
                "1.1 200",
            ),
            (
                format!("{}/v1/chat/completions", gw.url()),
                vec!["--http2-prior-knowledge"],
                "2 200",
            ),
            (
                format!("https://{tls}/v1/chat/completions"),
                vec!["--http1.1", "-k"],
                "1.1 200",
            ),
            (
                format!("https://{tls}/v1/chat/completions"),
                vec!["--http2", "-k"],
                "2 200",
            ),
        ];
        for (url, flags, want) in cases {
            let out = curl_post(&url, &body, &flags);
            let (got_body, trailer) = split_trailer(&out);
            assert_eq!(trailer, want, "{url} {flags:?}: {out}");
            if stream {
                let got: Vec<_> = data_events(got_body).iter().map(|e| normalize(e)).collect();
                assert_eq!(got, expect, "{url} {flags:?}");
            } else {
                assert_eq!(
                    normalize(got_body),
                    normalize(direct_body),
                    "{url} {flags:?}"
                );
            }
        }
    }
}

#[tokio::test]
async fn official_openai_python_client_streams_through_the_gateway() {
    if !python_has("openai") {
        return;
    }
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "api_keys = [\"sk-e2e\"]", "");
    openai_check(
        &format!("{}/v1", gw.url()),
        &format!("{}/v1", backend.url()),
        "sk-e2e",
    );
}

#[tokio::test]
async fn curl_with_expect_100_continue_and_a_large_prompt_is_served() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "");
    let body = chat(&"a long prompt ".repeat(2_000), true, 4);
    let out = curl_post(
        &format!("{}/v1/chat/completions", gw.url()),
        &body,
        &["--http1.1", "-H", "Expect: 100-continue"],
    );
    let (got, trailer) = split_trailer(&out);
    assert_eq!(trailer, "1.1 200", "{out}");
    assert_eq!(
        data_events(got).last().map(String::as_str),
        Some("[DONE]"),
        "{out}"
    );
}

#[tokio::test]
async fn an_answer_that_ends_its_tls_connection_ends_it_with_close_notify() {
    if !python_has("ssl") {
        return;
    }
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "tls_listen = \"127.0.0.1:0\"", "");
    let tls = gw.tls_addr.expect("TLS listener");
    let body = chat("to the end", true, 8);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/tls_close.py"
    );
    // HTTP/1.0 streaming: the answer ends with the connection, so only close_notify tells a
    // complete answer from a cut one. HTTP/1.1 `connection: close`, and a request behind it
    // that is never read, end the same way.
    for request in [
        format!(
            "POST /v1/chat/completions HTTP/1.0\\r\\ncontent-type: application/json\\r\\n\
             content-length: {}\\r\\n\\r\\n{body}",
            body.len()
        ),
        format!(
            "POST /v1/chat/completions HTTP/1.1\\r\\nhost: x\\r\\ncontent-type: application/json\\r\\n\
             content-length: {}\\r\\nconnection: close\\r\\n\\r\\n{body}GET /health HTTP/1.1\\r\\n\\r\\n",
            body.len()
        ),
    ] {
        let out = tokio::task::spawn_blocking({
            let (script, port) = (script, tls.port().to_string());
            move || {
                Command::new("python3")
                    .args([script, "127.0.0.1", &port, &request])
                    .output()
                    .expect("python3 runs")
            }
        })
        .await
        .expect("joined");
        let answer = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{answer}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("data: [DONE]"), "{answer}");
        assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "{answer}");
    }
}
