//! Routing with several sim backends: failures stay invisible to clients, hung backends are
//! ejected, sessions stick, and the gateway explains its choices.

use std::time::{Duration, Instant};

use crate::harness::*;

fn backend_of(r: &Reply) -> String {
    r.headers
        .get("x-tokenway-backend")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// The gateway's view of its first backend (`/admin/backends`).
async fn first_backend(gw: &Proc) -> serde_json::Value {
    let body = get(&format!("{}/admin/backends", gw.url())).await.body;
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    v["backends"][0].clone()
}

/// Sends requests (round robin, the second backend answering) until the first backend, which
/// fails with 500s, is ejected for them.
async fn eject_the_first_by_its_500s(gw: &Proc) {
    let url = format!("{}/v1/chat/completions", gw.url());
    for i in 0..8 {
        let r = post(&url, &chat(&format!("e{i}"), true, 2), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
        if first_backend(gw).await["state"] != "healthy" {
            break;
        }
    }
    let b = first_backend(gw).await;
    assert_eq!(b["eject_reason"], "passive_failures", "{b}");
}

#[tokio::test]
async fn with_one_of_four_backends_killed_clients_see_no_error() {
    let mut sims: Vec<Proc> = (0..4).map(|_| sim(FAST_SIM)).collect();
    let refs: Vec<&Proc> = sims.iter().collect();
    let gw = gateway(&refs, "", "[health]\nprobe_interval_ms = 200\n");
    drop(refs);
    sims[2].kill();
    let url = format!("{}/v1/chat/completions", gw.url());
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, &chat(&format!("q{i}"), true, 4), None).await })
        })
        .collect();
    for t in tasks {
        let r = t.await.expect("task");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_ne!(backend_of(&r), "b2");
        assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
    }
}

#[tokio::test]
async fn a_hung_backend_is_ejected_within_five_seconds_and_its_requests_go_elsewhere() {
    let sims: Vec<Proc> = (0..3).map(|_| sim(FAST_SIM)).collect();
    let hung = sim("[faults]\nhang = true\n");
    let mut refs: Vec<&Proc> = sims.iter().collect();
    refs.push(&hung);
    let gw = gateway(
        &refs,
        "policy = \"round_robin\"",
        "[timeouts]\nfirst_byte_ms = 1500\n[health]\nprobe_interval_ms = 200\n",
    );
    let started = Instant::now();
    let url = format!("{}/v1/chat/completions", gw.url());
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, &chat(&format!("h{i}"), true, 4), None).await })
        })
        .collect();
    for t in tasks {
        let r = t.await.expect("task");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_ne!(backend_of(&r), "b3");
    }
    let metrics = format!("{}/metrics", gw.url());
    let ejected = eventually(Duration::from_secs(5), || async {
        metric_sum(
            &get(&metrics).await.body,
            "tokenway_backend_healthy{backend=\"b3\"",
        ) == 0.0
    })
    .await;
    assert!(
        ejected,
        "the hung backend (its /health still answers) was not ejected"
    );
    assert!(started.elapsed() < Duration::from_secs(8));
    // Once ejected, nothing waits on it.
    let r = post(&url, &chat("after", true, 2), None).await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn a_request_whose_first_token_is_late_is_hedged_to_the_next_backend() {
    let mut slow = sim(FAST_SIM);
    let addr = slow.addr;
    let fast = sim(FAST_SIM);
    // Without the hedge a request to the hung backend would wait a minute for its first byte,
    // longer than `post` waits.
    let gw = gateway(
        &[&slow, &fast],
        "policy = \"round_robin\"",
        "[routing]\nhedge = true\n[timeouts]\nfirst_byte_ms = 60000\n",
    );
    let url = format!("{}/v1/chat/completions", gw.url());
    // Enough answers from b0 for its recent time to first token to count (20 samples).
    for i in 0..50 {
        let r = post(&url, &chat(&format!("warm {i}"), true, 2), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // Hedges the warm-up already caused (a FAST_SIM answer can take longer than the 20 ms
    // floor of the hedge delay on a busy machine) are not this test's.
    let admin_url = format!("{}/admin/backends", gw.url());
    let before: serde_json::Value =
        serde_json::from_str(&get(&admin_url).await.body).expect("JSON");
    // b0 comes back hung: it accepts and its /health answers, but no request ever does.
    slow.kill();
    let _hung = sim_at(addr, "[faults]\nhang = true\n");
    for i in 0..4 {
        let r = post(&url, &chat(&format!("late {i}"), true, 2), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(backend_of(&r), "b1");
        assert!(r.body.contains("data: [DONE]"), "{}", r.body);
    }
    let after: serde_json::Value = serde_json::from_str(&get(&admin_url).await.body).expect("JSON");
    let count = |v: &serde_json::Value, key: &str| v.pointer(key).and_then(|n| n.as_u64());
    let sent = |v| count(v, "/hedges_sent").expect("hedges_sent");
    let won = |v| count(v, "/backends/1/hedges_won").expect("b1's hedges_won");
    assert!(sent(&after) > sent(&before), "no hedge sent: {after}");
    assert!(won(&after) > won(&before), "b1 won no hedge: {after}");
}

#[tokio::test]
async fn a_hedge_answered_with_an_error_does_not_cancel_a_primary_that_then_answers() {
    let mut b0 = sim(FAST_SIM);
    let mut b1 = sim(FAST_SIM);
    let (a0, a1) = (b0.addr, b1.addr);
    let gw = gateway(
        &[&b0, &b1],
        "policy = \"round_robin\"",
        "[routing]\nhedge = true\n",
    );
    let url = format!("{}/v1/chat/completions", gw.url());
    // Enough fast answers from both for their recent times to first token to count.
    for i in 0..60 {
        let r = post(&url, &chat(&format!("warm {i}"), true, 2), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // b0 turns slow (its first token is late: hedged), b1 fails every request with a 500.
    b0.kill();
    b1.kill();
    let _slow = sim_at(
        a0,
        "base_latency_ms = 400.0\ntime_per_output_token_ms = 2.0\n",
    );
    let _failing = sim_at(a1, "base_latency_ms = 1.0\n[faults]\nerror_rate = 1.0\n");
    // Two requests: one has b0 as its primary and b1 as its hedge, the other b1 first (its
    // 500 is retried on b0). Both get b0's answer.
    for i in 0..2 {
        let r = post(&url, &chat(&format!("late {i}"), true, 2), None).await;
        assert_eq!(r.status, 200, "request {i}: {}", r.body);
        assert_eq!(backend_of(&r), "b0");
        assert!(r.body.contains("data: [DONE]"), "{}", r.body);
    }
    let admin: serde_json::Value =
        serde_json::from_str(&get(&format!("{}/admin/backends", gw.url())).await.body)
            .expect("JSON");
    assert!(
        admin.pointer("/hedges_sent").and_then(|n| n.as_u64()) > Some(0),
        "no hedge was sent: {admin}"
    );
}

#[tokio::test]
async fn a_session_stays_on_its_backend_and_the_gateway_says_why() {
    let sims: Vec<Proc> = (0..4).map(|_| sim(FAST_SIM)).collect();
    let refs: Vec<&Proc> = sims.iter().collect();
    let gw = gateway(&refs, "", "");
    let url = format!("{}/v1/chat/completions", gw.url());
    let mut seen = std::collections::HashSet::new();
    for turn in 0..6 {
        let req = http::Request::post(&url)
            .header("content-type", "application/json")
            .header("x-session-id", "conversation-42")
            .body(http_body_util::Full::new(bytes::Bytes::from(chat(
                &format!("turn {turn}"),
                false,
                2,
            ))))
            .expect("request");
        let resp = client().request(req).await.expect("response");
        assert_eq!(resp.status(), 200);
        let timing = resp
            .headers()
            .get("server-timing")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        assert!(timing.contains("route;desc=\"session-header"), "{timing}");
        assert!(timing.contains("ttfb;dur="), "{timing}");
        seen.insert(
            resp.headers()
                .get("x-tokenway-backend")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string(),
        );
    }
    assert_eq!(seen.len(), 1, "a session moved between backends: {seen:?}");

    let status = get(&format!("{}/status", gw.url())).await;
    assert_eq!(status.status, 200);
    assert!(status.body.contains("<table>") && status.body.contains("b0"));
    let admin = get(&format!("{}/admin/backends", gw.url())).await;
    let v: serde_json::Value = serde_json::from_str(&admin.body).expect("JSON");
    assert_eq!(v["backends"].as_array().map(Vec::len), Some(4), "{v}");
    assert_eq!(v["policy"], "cost");
}

#[tokio::test]
async fn discovery_picks_up_added_and_removed_backends_from_a_changed_file() {
    let a = sim(FAST_SIM);
    let b = sim(FAST_SIM);
    let dir = TempDir::new("discovery");
    let file = dir.0.join("backends.toml");
    let entry = |name: &str, p: &Proc| {
        format!(
            "[[backends]]\nname = \"{name}\"\nurl = \"{}\"\nmodels = [\"sim-model\"]\n",
            p.url()
        )
    };
    std::fs::write(&file, entry("file-a", &a)).expect("write");
    let gw = start_args_with_config(
        "gateway",
        &format!(
            "listen = \"127.0.0.1:0\"\nbackends_file = \"{}\"\n[health]\nprobe_interval_ms = 200\n",
            file.display()
        ),
    );
    let url = format!("{}/v1/chat/completions", gw.url());
    let served_by = |url: String| async move {
        let mut names = std::collections::BTreeSet::new();
        for i in 0..8 {
            let r = post(&url, &chat(&format!("d{i}"), false, 1), None).await;
            if r.status == 200 {
                names.insert(backend_of(&r));
            } else {
                names.insert(format!("status {}", r.status));
            }
        }
        names
    };
    assert!(
        eventually(Duration::from_secs(5), || async {
            served_by(url.clone()).await.into_iter().collect::<Vec<_>>() == ["file-a"]
        })
        .await
    );
    // Add b (and give the mtime a chance to differ).
    tokio::time::sleep(Duration::from_millis(20)).await;
    std::fs::write(&file, entry("file-a", &a) + &entry("file-b", &b)).expect("write");
    let admin = format!("{}/admin/backends", gw.url());
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(&admin).await.body.contains("file-b")
        })
        .await,
        "file-b was not added"
    );
    // Remove a: only b serves afterwards.
    std::fs::write(&file, entry("file-b", &b)).expect("write");
    assert!(
        eventually(Duration::from_secs(5), || async {
            served_by(url.clone()).await.into_iter().collect::<Vec<_>>() == ["file-b"]
        })
        .await,
        "file-a was not removed"
    );
    // An edit of another key than the URL applies too (the entry is replaced).
    std::fs::write(&file, entry("file-b", &b) + "max_inflight = 7\n").expect("write");
    assert!(
        eventually(Duration::from_secs(5), || async {
            let v: serde_json::Value = serde_json::from_str(&get(&admin).await.body).expect("JSON");
            v["backends"]
                .as_array()
                .expect("backends")
                .iter()
                .any(|b| b["name"] == "file-b" && b["max_inflight"] == 7)
        })
        .await,
        "the new max_inflight of file-b was not applied"
    );
    assert_eq!(
        served_by(url.clone()).await.into_iter().collect::<Vec<_>>(),
        ["file-b"]
    );
    // A broken edit keeps the current set.
    std::fs::write(&file, "[[backends]]\nurl = 42\n").expect("write");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        served_by(url.clone()).await.into_iter().collect::<Vec<_>>(),
        ["file-b"]
    );
}

#[tokio::test]
async fn an_answer_that_is_not_streamed_may_take_longer_than_the_first_byte_timeout() {
    // 25 tokens at 40 ms: a whole answer comes after about a second, past `first_byte_ms`,
    // which bounds the wait for a stream's first token only.
    let slow = "base_latency_ms = 1.0\ntime_per_output_token_ms = 40.0\n";
    let sims = [sim(slow), sim(slow)];
    let gw = gateway(
        &[&sims[0], &sims[1]],
        "policy = \"round_robin\"",
        "[timeouts]\nfirst_byte_ms = 300\n",
    );
    let url = format!("{}/v1/chat/completions", gw.url());
    for i in 0..2 {
        let r = post(&url, &chat(&format!("whole {i}"), false, 25), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.body.contains("\"chat.completion\""), "{}", r.body);
        let timing = r
            .headers
            .get("server-timing")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        assert!(!timing.contains("retry"), "retried: {timing}");
    }
    // A stream's first token still has to come within it.
    let r = post(&url, &chat("streamed", true, 25), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let admin: serde_json::Value =
        serde_json::from_str(&get(&format!("{}/admin/backends", gw.url())).await.body)
            .expect("JSON");
    for b in admin["backends"].as_array().expect("backends") {
        assert_eq!(b["state"], "healthy", "{admin}");
        // The whole answers' second did not enter the time-to-first-token estimate.
        let ewma = b["ewma_ttft_ms"].as_f64().unwrap_or(0.0);
        assert!(ewma < 500.0, "{admin}");
    }
}

#[tokio::test]
async fn a_whole_answer_past_its_timeout_gets_a_504_and_is_not_run_again_elsewhere() {
    // 25 tokens at 40 ms: a whole answer takes about a second, past `whole_answer_ms`.
    let slow = "base_latency_ms = 1.0\ntime_per_output_token_ms = 40.0\n";
    let sims = [sim(slow), sim(slow), sim(slow)];
    let gw = gateway(
        &[&sims[0], &sims[1], &sims[2]],
        "policy = \"round_robin\"",
        "[timeouts]\nwhole_answer_ms = 300\n",
    );
    let r = post(
        &format!("{}/v1/chat/completions", gw.url()),
        &chat("a long generation", false, 25),
        None,
    )
    .await;
    assert_eq!(r.status, 504, "{}", r.body);
    assert!(r.body.contains("upstream_timeout"), "{}", r.body);
    assert_eq!(r.headers["x-should-retry"], "false");
    // One backend was asked to generate it, not each in turn.
    let mut asked = 0;
    for s in &sims {
        let metrics = get(&format!("{}/metrics", s.url())).await.body;
        if metric_sum(&metrics, "vllm:prompt_tokens") > 0.0 {
            asked += 1;
        }
    }
    assert_eq!(asked, 1, "the whole answer was tried on {asked} backends");
}

#[tokio::test]
async fn a_whole_answer_on_a_backend_found_hung_meanwhile_is_tried_on_the_next() {
    let hung = sim("[faults]\nhang = true\n");
    let ok = sim(FAST_SIM);
    // No probe judges the hung backend (its /health answers anyway): only requests do.
    let gw = gateway(
        &[&hung, &ok],
        "policy = \"round_robin\"",
        "[timeouts]\nfirst_byte_ms = 200\nwhole_answer_ms = 3000\n\
         [health]\nprobe_interval_ms = 3600000\n",
    );
    let url = format!("{}/v1/chat/completions", gw.url());
    // The first request is ranked first on b0, the hung one.
    let whole = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, &chat("whole", false, 4), None).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Streamed requests meanwhile: every other one waits 200 ms on b0 for a first byte and is
    // retried on b1; three such timeouts eject b0.
    for i in 0..8 {
        let r = post(&url, &chat(&format!("s{i}"), true, 2), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(backend_of(&r), "b1");
    }
    let admin: serde_json::Value =
        serde_json::from_str(&get(&format!("{}/admin/backends", gw.url())).await.body)
            .expect("JSON");
    assert_ne!(admin["backends"][0]["state"], "healthy", "{admin}");
    // When its wait ends the whole answer's backend has been ejected: it was hung, not slow,
    // so the next backend is asked instead of the client getting a 504.
    let r = whole.await.expect("task");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(backend_of(&r), "b1");
}

#[tokio::test]
async fn a_trial_answered_with_a_client_or_server_error_keeps_the_backend_ejected() {
    // Its context length is checked before its faults: a request too long for it is a 400.
    let failing = sim("max_model_len = 1000\n[faults]\nerror_rate = 1.0\n");
    // A healthy second backend: the last healthy backend of a model is never ejected for its
    // answers, and it takes the retries of the failing one's.
    let ok = sim(FAST_SIM);
    // No probe re-admits it during the test: only requests judge it.
    let gw = gateway(
        &[&failing, &ok],
        "policy = \"round_robin\"",
        "[health]\nprobe_interval_ms = 3600000\n",
    );
    let url = format!("{}/v1/chat/completions", gw.url());
    let state = || first_backend(&gw);
    // Three 500s in a row eject it; each of them is retried on the other backend.
    eject_the_first_by_its_500s(&gw).await;
    // After the hold its next request is a trial. One answered with a client error (the
    // request's fault, passed to the client) is no verdict: the backend stays ejected.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let r = post(&url, &chat("too long for it", true, 5_000), None).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let b = state().await;
    assert_ne!(b["state"], "healthy", "a 400 re-admitted it: {b}");
    assert_eq!(b["eject_reason"], "passive_failures", "{b}");
    // The next trial comes `min_ejection` later; its 500 fails it (and the request is
    // answered by the other backend).
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let r = post(&url, &chat("trial", true, 2), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let b = state().await;
    assert_ne!(b["state"], "healthy", "{b}");
    assert_eq!(b["eject_reason"], "trial_failed", "{b}");
}

#[tokio::test]
async fn model_names_are_matched_as_the_backends_behind_would_match_them() {
    // An Ollama-style tagged name learned from the backend, and a backend that takes any name.
    let ollama = sim(&format!("{FAST_SIM}model_names = [\"llama3.2:latest\"]\n"));
    let anything = sim(&format!("{FAST_SIM}model_names = [\"tgi\", \"gpt-4o\"]\n"));
    let gw = start_args_with_config(
        "gateway",
        &format!(
            "listen = \"127.0.0.1:0\"\n\
             [[backends]]\nname = \"ollama\"\nurl = \"{}\"\n\
             [[backends]]\nname = \"any\"\nurl = \"{}\"\nmodels = [\"tgi\", \"*\"]\n",
            ollama.url(),
            anything.url()
        ),
    );
    let url = format!("{}/v1/chat/completions", gw.url());
    let learned = eventually(Duration::from_secs(10), || async {
        get(&format!("{}/v1/models", gw.url()))
            .await
            .body
            .contains("llama3.2:latest")
    })
    .await;
    assert!(learned, "the gateway never learned the tagged name");
    // `llama3.2` is Ollama's `llama3.2:latest`; the body goes on unchanged.
    let r = post(
        &url,
        &chat("hi", false, 2).replace("sim-model", "llama3.2"),
        None,
    )
    .await;
    assert_eq!(
        (r.status, backend_of(&r).as_str()),
        (200, "ollama"),
        "{}",
        r.body
    );
    // A name nobody lists goes to the backend that takes any (the sim answers it as "gpt-4o").
    let r = post(
        &url,
        &chat("hi", false, 2).replace("sim-model", "gpt-4o"),
        None,
    )
    .await;
    assert_eq!(
        (r.status, backend_of(&r).as_str()),
        (200, "any"),
        "{}",
        r.body
    );
    // The wildcard is no listed model.
    let listed = get(&format!("{}/v1/models", gw.url())).await.body;
    assert!(!listed.contains("\"*\""), "{listed}");
    // No name: the backend that takes any (llama.cpp and TGI serve such requests).
    let r = post(
        &url,
        r#"{"messages":[{"role":"user","content":"x"}]}"#,
        None,
    )
    .await;
    assert_eq!(
        (r.status, backend_of(&r).as_str()),
        (200, "any"),
        "{}",
        r.body
    );
}

#[tokio::test]
async fn a_request_without_a_model_goes_to_the_only_model_served() {
    let backend = sim(FAST_SIM);
    let gw = gateway(&[&backend], "", "");
    let r = post(
        &format!("{}/v1/chat/completions", gw.url()),
        r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":2}"#,
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);

    // Several models and no name: the 400 OpenAI answers.
    let two = start_args_with_config(
        "gateway",
        &format!(
            "listen = \"127.0.0.1:0\"\n\
             [[backends]]\nname = \"a\"\nurl = \"{0}\"\nmodels = [\"sim-model\"]\n\
             [[backends]]\nname = \"b\"\nurl = \"{0}\"\nmodels = [\"other-model\"]\n",
            backend.url()
        ),
    );
    let r = post(
        &format!("{}/v1/chat/completions", two.url()),
        r#"{"messages":[{"role":"user","content":"x"}]}"#,
        None,
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("missing_model"), "{}", r.body);
}

/// A backend that answers its first `fail_first` chat requests with a 500 and every later one
/// with a 200 event stream opening with an error event the backend blames on the request
/// (vLLM-style `BadRequestError`, code 400), its message long and the event split across two
/// writes 50 ms apart. `/health` answers 200. Returns its address and its count of chat
/// requests.
async fn client_error_stream_backend(
    fail_first: usize,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let chats = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = chats.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // One request: its head, then its content-length of body.
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    while buf.len() < head_end + len {
                        let mut chunk = [0u8; 4096];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..head_end + len);
                    if !head.starts_with("post") {
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if s.write_all(ok).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    if counter.fetch_add(1, Ordering::SeqCst) < fail_first {
                        let body = r#"{"error":{"message":"down","type":"server_error"}}"#;
                        let answer = format!(
                            "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n\
                             content-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if s.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let first = format!(r#"data: {{"error":{{"message":"{}"#, "x".repeat(3000));
                    let rest = "\",\"type\":\"BadRequestError\",\"code\":400}}\n\ndata: [DONE]\n\n";
                    let chunk = |piece: &str| format!("{:x}\r\n{piece}\r\n", piece.len());
                    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                                transfer-encoding: chunked\r\n\r\n";
                    if s.write_all(format!("{head}{}", chunk(&first)).as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let end = format!("{}0\r\n\r\n", chunk(rest));
                    if s.write_all(end.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, chats)
}

/// A stream that opens with an error event the backend blames on the request goes to the
/// client as it is, even when the event arrives in pieces (its `code` after a long message),
/// and it is no verdict on a trial. Before, the first piece alone read as the server's failure
/// (the request was retried on the next backend, and the backend charged), and a whole one
/// counted as a first token that re-admitted a backend on trial.
#[tokio::test]
async fn a_stream_opening_with_the_requests_own_error_is_passed_on_and_passes_no_trial() {
    use std::sync::atomic::Ordering;
    let (fake, chats) = client_error_stream_backend(3).await;
    let ok = sim(FAST_SIM);
    let gw = start_args_with_config(
        "gateway",
        &format!(
            "listen = \"127.0.0.1:0\"\npolicy = \"round_robin\"\n\
             [health]\nprobe_interval_ms = 3600000\n\
             [[backends]]\nname = \"b0\"\nurl = \"http://{fake}\"\nmodels = [\"sim-model\"]\n\
             [[backends]]\nname = \"b1\"\nurl = \"{}\"\nmodels = [\"sim-model\"]\n",
            ok.url()
        ),
    );
    let url = format!("{}/v1/chat/completions", gw.url());
    let state = || first_backend(&gw);
    // Three 500s eject it (each retried on the sim).
    eject_the_first_by_its_500s(&gw).await;
    assert_eq!(chats.load(Ordering::SeqCst), 3);
    // After the hold its next request is a trial: answered with the request's own error, which
    // the client gets whole, not a retry elsewhere; and the backend stays ejected.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let r = post(&url, &chat("trial", true, 2), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        chats.load(Ordering::SeqCst),
        4,
        "the trial went to the fake"
    );
    assert_eq!(backend_of(&r), "b0", "{}", r.body);
    assert!(
        r.body.contains("BadRequestError") && r.body.contains(&"x".repeat(3000)),
        "{}",
        r.body
    );
    let b = state().await;
    assert_ne!(
        b["state"], "healthy",
        "an error event passed the trial: {b}"
    );
    assert_eq!(b["eject_reason"], "passive_failures", "{b}");
}
