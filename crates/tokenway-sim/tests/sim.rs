//! End-to-end tests of the simulator over real HTTP on loopback.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokenway_sim::{serve, Faults, SimConfig};
use tokio::sync::oneshot;

struct Sim {
    addr: SocketAddr,
    client: Client<HttpConnector, Full<Bytes>>,
    _stop: oneshot::Sender<()>,
}

fn fast_config() -> SimConfig {
    SimConfig {
        base_latency_ms: 1.0,
        time_per_output_token_ms: 1.0,
        prefill_tokens_per_second: 1_000_000.0,
        ..SimConfig::default()
    }
}

async fn start(config: SimConfig) -> Sim {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        serve(config, listener, async move {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    let client = Client::builder(TokioExecutor::new()).build_http();
    Sim {
        addr,
        client,
        _stop: stop,
    }
}

impl Sim {
    fn request(&self, method: Method, path: &str, body: impl Into<Bytes>) -> Request<Full<Bytes>> {
        Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json")
            .body(Full::new(body.into()))
            .unwrap()
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: impl Into<Bytes>,
    ) -> (StatusCode, Bytes) {
        let resp = self
            .client
            .request(self.request(method, path, body))
            .await
            .unwrap();
        let status = resp.status();
        (status, resp.into_body().collect().await.unwrap().to_bytes())
    }

    async fn post_json(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let (status, bytes) = self.call(Method::POST, path, body.to_string()).await;
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    async fn get(&self, path: &str) -> (StatusCode, String) {
        let (status, bytes) = self.call(Method::GET, path, Bytes::new()).await;
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    async fn set_faults(&self, faults: Value) {
        let (status, _) = self.post_json("/admin/faults", faults).await;
        assert_eq!(status, StatusCode::OK);
    }

    /// Streams a request; returns the SSE events (without `data: `) and the time to the first
    /// frame that carries token text.
    async fn stream(&self, path: &str, body: Value) -> (Vec<String>, Duration) {
        let t0 = Instant::now();
        let resp = self
            .client
            .request(self.request(Method::POST, path, body.to_string()))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let mut body = resp.into_body();
        let mut raw = Vec::new();
        let mut ttft = None;
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                ttft.get_or_insert_with(|| t0.elapsed());
                raw.extend_from_slice(&data);
            }
        }
        let text = String::from_utf8(raw).unwrap();
        assert!(text.ends_with("\n\n"), "{text}");
        let events = text
            .split_terminator("\n\n")
            .map(|e| {
                e.strip_prefix("data: ")
                    .expect("every event is a data line")
                    .to_owned()
            })
            .collect();
        (events, ttft.unwrap())
    }
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body =
        json!({"model": "sim-model", "messages": [{"role": "user", "content": content}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn streaming_chat_has_openai_chunks_usage_and_done() {
    let sim = start(fast_config()).await;
    let prompt = "hello there, simulator"; // "user" + prompt = 26 bytes -> 7 tokens
    let (events, _) = sim
        .stream(
            "/v1/chat/completions",
            chat(
                prompt,
                json!({"stream": true, "max_tokens": 5, "stream_options": {"include_usage": true}}),
            ),
        )
        .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    // role chunk + 5 tokens + finish chunk + usage chunk
    assert_eq!(chunks.len(), 8, "{chunks:#?}");
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["id"], id);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "sim-model");
        assert!(c["created"].as_u64().unwrap() > 1_600_000_000);
        assert!(c.as_object().unwrap().contains_key("usage"));
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    for c in &chunks[1..6] {
        let choice = &c["choices"][0];
        assert_eq!(choice["index"], 0);
        assert!(choice["delta"]["content"]
            .as_str()
            .unwrap()
            .starts_with(' '));
        assert!(choice["logprobs"].is_null());
        assert!(choice["finish_reason"].is_null());
        assert!(c["usage"].is_null());
    }
    assert_eq!(chunks[6]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[7]["choices"], json!([]));
    assert_eq!(
        chunks[7]["usage"],
        json!({"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
}

#[tokio::test]
async fn streaming_completion_without_include_usage_omits_usage() {
    let sim = start(fast_config()).await;
    let body = json!({"model": "sim-model", "prompt": "abc", "stream": true, "max_tokens": 3});
    let (events, _) = sim.stream("/v1/completions", body).await;
    assert_eq!(events.len(), 3 + 1 + 1);
    assert_eq!(events.last().unwrap(), "[DONE]");
    for e in &events[..4] {
        let c: Value = serde_json::from_str(e).unwrap();
        assert_eq!(c["object"], "text_completion");
        assert!(c["id"].as_str().unwrap().starts_with("cmpl-"));
        assert!(!c.as_object().unwrap().contains_key("usage"));
    }
    let fin: Value = serde_json::from_str(&events[3]).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn max_tokens_is_respected_and_same_seed_and_prompt_give_same_text() {
    let sim = start(fast_config()).await;
    let body = chat("tell me a story", json!({"max_completion_tokens": 4}));
    let (status, a) = sim.post_json("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK);
    let (_, b) = sim.post_json("/v1/chat/completions", body).await;
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 4);
    let text = a["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text.split_whitespace().count(), 4);
    assert_eq!(text, b["choices"][0]["message"]["content"]);

    // Without a limit: default_max_tokens tokens and a natural stop.
    let (_, d) = sim
        .post_json(
            "/v1/completions",
            json!({"model": "sim-model", "prompt": "x"}),
        )
        .await;
    assert_eq!(d["object"], "text_completion");
    assert_eq!(d["usage"]["completion_tokens"], 64);
    assert_eq!(d["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn n_choices_batches_and_token_id_prompts_are_answered_per_choice() {
    let sim = start(fast_config()).await;
    // Streamed chat with n = 2: each choice has its role chunk, its tokens and its finish.
    let (events, _) = sim
        .stream(
            "/v1/chat/completions",
            chat(
                "two answers",
                json!({"stream": true, "n": 2, "max_tokens": 3,
                                       "stream_options": {"include_usage": true}}),
            ),
        )
        .await;
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let mut texts = [String::new(), String::new()];
    let mut finished = [false, false];
    for c in &chunks[..chunks.len() - 1] {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        texts[i].push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        finished[i] |= choice["finish_reason"] == "length";
    }
    assert_eq!(finished, [true, true]);
    assert_ne!(texts[0], texts[1]);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 6);

    // Choice 0 of n is the text n = 1 gives.
    let (_, one) = sim
        .post_json(
            "/v1/chat/completions",
            chat("two answers", json!({"max_tokens": 3})),
        )
        .await;
    assert_eq!(one["choices"][0]["message"]["content"], texts[0].as_str());

    // A batch of two prompts with two choices each: four choices, prompt-major.
    let (status, v) = sim
        .post_json(
            "/v1/completions",
            json!({"model": "sim-model", "prompt": ["first", "second"], "n": 2, "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    let (_, second) = sim
        .post_json(
            "/v1/completions",
            json!({"model": "sim-model", "prompt": "second", "max_tokens": 2}),
        )
        .await;
    assert_eq!(choices[2]["text"], second["choices"][0]["text"]);
    assert_eq!(v["usage"]["completion_tokens"], 8);

    // Token ids: one token each.
    let (status, v) = sim
        .post_json(
            "/v1/completions",
            json!({"model": "sim-model", "prompt": [101, 2023, 2003, 102], "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
}

#[tokio::test]
async fn outputs_end_at_a_stop_string_or_the_models_own_end_unless_eos_is_ignored() {
    let sim = start(SimConfig {
        eos_mean_tokens: 5.0,
        ..fast_config()
    })
    .await;
    // Natural ends: lengths vary, below the limit, with finish_reason "stop".
    let mut lengths = Vec::new();
    for i in 0..20 {
        let (_, v) = sim
            .post_json(
                "/v1/completions",
                json!({"model": "sim-model", "prompt": format!("p{i}"), "max_tokens": 200}),
            )
            .await;
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert!(v["choices"][0]["stop_reason"].is_null(), "{v}");
        lengths.push(v["usage"]["completion_tokens"].as_u64().unwrap());
    }
    assert!(lengths.iter().any(|&n| n != lengths[0]), "{lengths:?}");
    assert!(lengths.iter().all(|&n| n < 200), "{lengths:?}");
    // ignore_eos: the limit ends it.
    let (_, v) = sim
        .post_json(
            "/v1/completions",
            json!({"model": "sim-model", "prompt": "p0", "max_tokens": 30, "ignore_eos": true}),
        )
        .await;
    assert_eq!(
        (
            v["usage"]["completion_tokens"].as_u64(),
            v["choices"][0]["finish_reason"].as_str()
        ),
        (Some(30), Some("length"))
    );
    // A stop string: the text ends right before it, streamed or whole.
    let (_, whole) = sim
        .post_json(
            "/v1/completions",
            json!({"model": "sim-model", "prompt": "q", "max_tokens": 40, "ignore_eos": true}),
        )
        .await;
    let text = whole["choices"][0]["text"].as_str().unwrap().to_owned();
    let stop = text.split_whitespace().nth(3).unwrap().to_owned();
    let want = &text[..text.find(&stop).unwrap()];
    let body = json!({"model": "sim-model", "prompt": "q", "max_tokens": 40, "ignore_eos": true, "stop": [stop.clone()]});
    let (_, v) = sim.post_json("/v1/completions", body.clone()).await;
    assert_eq!(v["choices"][0]["text"], want);
    assert_eq!(
        (
            v["choices"][0]["finish_reason"].as_str(),
            v["choices"][0]["stop_reason"].as_str()
        ),
        (Some("stop"), Some(stop.as_str()))
    );
    let mut stream_body = body;
    stream_body["stream"] = json!(true);
    let (events, _) = sim.stream("/v1/completions", stream_body).await;
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(streamed, want);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["stop_reason"],
        stop.as_str()
    );
    // One that spans two tokens: a stream holds back what could begin it, as vLLM does, and
    // never sends part of it.
    let at = text.find(&stop).unwrap();
    let spanning = text[at - 2..at + 3].to_owned();
    let body = json!({"model": "sim-model", "prompt": "q", "max_tokens": 40, "ignore_eos": true,
                      "stop": spanning, "stream": true});
    let (events, _) = sim.stream("/v1/completions", body).await;
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(streamed, text[..at - 2]);
}

#[tokio::test]
async fn embeddings_are_unit_vectors_as_floats_or_base64() {
    let sim = start(SimConfig {
        embedding_dimensions: 16,
        ..fast_config()
    })
    .await;
    let (status, v) = sim
        .post_json(
            "/v1/embeddings",
            json!({"model": "sim-model", "input": ["a cat", "a dog"]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "sim-model");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    let first: Vec<f64> = data[0]["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(first.len(), 16);
    assert!((first.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-5);

    let (_, b64) = sim
        .post_json(
            "/v1/embeddings",
            json!({"model": "sim-model", "input": "a cat", "encoding_format": "base64"}),
        )
        .await;
    assert_eq!(
        b64["data"][0]["embedding"].as_str().unwrap().len(),
        (16 * 4usize).div_ceil(3) * 4
    );

    let (status, v) = sim
        .post_json(
            "/v1/embeddings",
            json!({"model": "sim-model", "input": "x", "dimensions": 17}),
        )
        .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (StatusCode::BAD_REQUEST, &json!("dimensions"))
    );
    let (status, v) = sim
        .post_json("/v1/embeddings", json!({"model": "nope", "input": "x"}))
        .await;
    assert_eq!(
        (status, &v["error"]["code"]),
        (StatusCode::NOT_FOUND, &json!("model_not_found"))
    );
}

#[tokio::test]
async fn repeated_long_prompt_has_lower_ttft_thanks_to_the_prefix_cache() {
    let sim = start(SimConfig {
        prefill_tokens_per_second: 100_000.0,
        ..fast_config()
    })
    .await;
    // 80 000 bytes -> ~20 000 tokens -> 200 ms of prefill when uncached.
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(1800);
    let body = chat(&prompt, json!({"stream": true, "max_tokens": 1}));
    let (_, cold) = sim.stream("/v1/chat/completions", body.clone()).await;
    let (_, warm) = sim.stream("/v1/chat/completions", body).await;
    assert!(cold >= Duration::from_millis(180), "cold TTFT {cold:?}");
    assert!(warm < cold / 3, "warm TTFT {warm:?} vs cold {cold:?}");

    let (_, full) = sim
        .post_json(
            "/v1/chat/completions",
            chat(&prompt, json!({"max_tokens": 1})),
        )
        .await;
    let cached = full["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt_tokens = full["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens - cached < 16, "{full}");
}

#[tokio::test]
async fn concurrent_prefills_share_the_engines_prefill_rate() {
    let sim = std::sync::Arc::new(
        start(SimConfig {
            prefill_tokens_per_second: 100_000.0,
            ..fast_config()
        })
        .await,
    );
    // Two different 20 000-token prompts at once: 200 ms of prefill each, one after the other.
    let runs: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|tag| {
            let sim = sim.clone();
            tokio::spawn(async move {
                let prompt = format!("{tag} ").repeat(40_000);
                let body = chat(&prompt, json!({"stream": true, "max_tokens": 1}));
                sim.stream("/v1/chat/completions", body).await.1
            })
        })
        .collect();
    let mut ttfts = Vec::new();
    for r in runs {
        ttfts.push(r.await.unwrap());
    }
    let later = ttfts.iter().max().unwrap();
    assert!(
        *later >= Duration::from_millis(380),
        "the second prefill did not wait for the first: {ttfts:?}"
    );
}

#[tokio::test]
async fn a_request_whose_prompt_does_not_fit_the_kv_cache_waits_for_room() {
    let sim = std::sync::Arc::new(
        start(SimConfig {
            prefix_cache_tokens: 1_000,
            prefill_tokens_per_second: 1_000_000.0,
            time_per_output_token_ms: 20.0,
            ..fast_config()
        })
        .await,
    );
    // Two 800-token prompts: the second fits only once the first has ended (~400 ms).
    let first = {
        let sim = sim.clone();
        tokio::spawn(async move {
            let body = chat(
                &"a ".repeat(1_600),
                json!({"stream": true, "max_tokens": 20}),
            );
            sim.stream("/v1/chat/completions", body).await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = {
        let sim = sim.clone();
        tokio::spawn(async move {
            let body = chat(
                &"b ".repeat(1_600),
                json!({"stream": true, "max_tokens": 1}),
            );
            sim.stream("/v1/chat/completions", body).await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (_, metrics) = sim.get("/metrics").await;
    assert!(
        metrics.contains("vllm:num_requests_running{model_name=\"sim-model\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("vllm:num_requests_waiting{model_name=\"sim-model\"} 1"),
        "{metrics}"
    );
    first.await.unwrap();
    let (events, ttft) = second.await.unwrap();
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert!(
        ttft >= Duration::from_millis(250),
        "the second did not wait: {ttft:?}"
    );
}

/// A client that writes its whole oversized body before reading (as the `openai` package
/// does: no `Expect`) gets the 413, declared or chunked, where it used to find the connection
/// reset: the server closed with the body unread.
#[tokio::test]
async fn an_oversized_body_written_whole_gets_its_413() {
    use std::io::{Read, Write};
    let sim = start(fast_config()).await;
    let addr = sim.addr;
    let body = vec![b' '; 40 << 20];
    let exchange = move |chunked: bool| {
        let body = body.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = std::net::TcpStream::connect(addr).expect("connect");
            conn.set_read_timeout(Some(Duration::from_secs(30)))
                .expect("timeout");
            let framing = if chunked {
                "transfer-encoding: chunked".to_owned()
            } else {
                format!("content-length: {}", body.len())
            };
            write!(
                conn,
                "POST /v1/chat/completions HTTP/1.1\r\nhost: sim\r\n\
                 content-type: application/json\r\n{framing}\r\n\r\n"
            )
            .expect("head");
            let written = if chunked {
                body.chunks(1 << 20)
                    .try_for_each(|c| {
                        write!(conn, "{:x}\r\n", c.len())?;
                        conn.write_all(c)?;
                        conn.write_all(b"\r\n")
                    })
                    .and_then(|()| conn.write_all(b"0\r\n\r\n"))
            } else {
                conn.write_all(&body)
            };
            written.expect("the whole body is taken");
            let mut answer = Vec::new();
            let mut buf = [0u8; 4096];
            while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = conn.read(&mut buf).expect("the answer, not a reset");
                assert!(n > 0, "closed without an answer");
                answer.extend_from_slice(&buf[..n]);
            }
            String::from_utf8_lossy(&answer).into_owned()
        })
    };
    for chunked in [false, true] {
        let head = exchange(chunked).await.expect("client thread");
        assert!(
            head.starts_with("HTTP/1.1 413"),
            "chunked {chunked}: {head}"
        );
    }
}

#[tokio::test]
async fn bad_requests_get_openai_error_bodies() {
    let sim = start(fast_config()).await;
    let (status, body) = sim
        .call(Method::POST, "/v1/chat/completions", "{not json")
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["param"].is_null() && v["error"]["code"].is_null());
    assert!(v["error"]["message"].as_str().unwrap().contains("JSON"));

    let (status, v) = sim
        .post_json(
            "/v1/chat/completions",
            json!({"model": "nope", "messages": []}),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], "model_not_found");

    let (status, v) = sim.post_json("/v1/nothing", json!({})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["type"], "invalid_request_error");

    // A known path with the wrong method: 405 naming what it takes, not "unknown route".
    let (status, body) = sim.get("/v1/chat/completions").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{body}");
    assert!(body.contains("takes POST"), "{body}");
    let (status, _) = sim.call(Method::DELETE, "/health", Bytes::new()).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    // HEAD is GET without the body.
    let (status, body) = sim.call(Method::HEAD, "/health", Bytes::new()).await;
    assert_eq!((status, body.len()), (StatusCode::OK, 0));

    // More output than a context holds: a 400 naming the parameter, as vLLM answers.
    let (status, v) = sim
        .post_json(
            "/v1/chat/completions",
            json!({"model": "sim-model", "max_tokens": 4_294_967_295u32,
                   "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "max_tokens");
}

#[tokio::test]
async fn models_health_and_metrics_endpoints() {
    let sim = start(SimConfig {
        model_names: vec!["a".into(), "b".into()],
        ..fast_config()
    })
    .await;
    let (status, body) = sim.get("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "a");
    assert_eq!(v["data"][1]["id"], "b");
    assert_eq!(v["data"][1]["object"], "model");
    assert_eq!(v["data"][1]["owned_by"], "tokenway-sim");

    assert_eq!(sim.get("/health").await, (StatusCode::OK, "ok".to_owned()));

    let body = json!({"model": "a", "prompt": "x", "max_tokens": 2, "stream": true});
    sim.stream("/v1/completions", body).await;
    let (status, text) = sim.get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    // Two registries in one OpenMetrics page: one `# EOF`, at the end.
    assert_eq!(text.matches("# EOF").count(), 1, "{text}");
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert!(
        text.contains(
            "tokenway_requests_total{route=\"/v1/completions\",backend=\"self\",status=\"200\"} 1"
        ),
        "{text}"
    );
    assert!(text.contains("tokenway_ttft_seconds_count{route=\"/v1/completions\",backend=\"self\",transport=\"h1\",client_region=\"local\",backend_region=\"local\"} 1"), "{text}");
    assert!(
        text.contains("vllm:num_requests_running{model_name=\"a\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("vllm:num_requests_waiting{model_name=\"a\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("vllm:gpu_cache_usage_perc{model_name=\"a\"}"),
        "{text}"
    );
    assert!(
        text.contains("vllm:kv_cache_usage_perc{model_name=\"a\"}"),
        "{text}"
    );
    // "x" is 1 prompt token (no whole block cached); 2 tokens generated.
    for line in [
        "vllm:prompt_tokens_total{model_name=\"a\"} 1",
        "vllm:generation_tokens_total{model_name=\"a\"} 2",
        "vllm:prefix_cache_queries_total{model_name=\"a\"} 1",
        "vllm:prefix_cache_hits_total{model_name=\"a\"} 0",
    ] {
        assert!(text.contains(line), "{line}: {text}");
    }
    assert_eq!(v["data"][0]["max_model_len"], 2_097_152);
    assert_eq!(text.matches("# EOF").count(), 1, "{text}");

    // The unhealthy fault fails /health only.
    sim.set_faults(json!({"unhealthy": true})).await;
    assert_eq!(sim.get("/health").await.0, StatusCode::SERVICE_UNAVAILABLE);
    let (status, _) = sim
        .post_json(
            "/v1/completions",
            json!({"model": "a", "prompt": "x", "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn error_after_tokens_ends_a_stream_with_vllms_error_event() {
    let sim = start(fast_config()).await;
    sim.set_faults(json!({"error_after_tokens": 2})).await;
    let (events, _) = sim
        .stream(
            "/v1/chat/completions",
            chat("fail soon", json!({"stream": true, "max_tokens": 5})),
        )
        .await;
    // role chunk, two tokens, the error, [DONE]
    assert_eq!(events.len(), 5, "{events:?}");
    let err: Value = serde_json::from_str(&events[3]).unwrap();
    assert_eq!(err["error"]["type"], "server_error");
    assert_eq!(events[4], "[DONE]");
    let (status, v) = sim
        .post_json(
            "/v1/chat/completions",
            chat("fail soon", json!({"max_tokens": 5})),
        )
        .await;
    assert_eq!(
        (status, &v["error"]["type"]),
        (StatusCode::INTERNAL_SERVER_ERROR, &json!("server_error"))
    );
}

#[tokio::test]
async fn error_rate_one_answers_500_and_faults_change_at_run_time() {
    let sim = start(SimConfig {
        faults: Faults {
            error_rate: 1.0,
            ..Faults::default()
        },
        ..fast_config()
    })
    .await;
    let body = chat("hi", json!({"max_tokens": 1}));
    let (status, v) = sim.post_json("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(v["error"]["message"].is_string());

    sim.set_faults(json!({"error_rate": 0.0})).await;
    let (status, _) = sim.post_json("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK);

    let (status, v) = sim
        .post_json("/admin/faults", json!({"error_rate": 2.0}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("sim.faults.error_rate"));
    // A delay no clock can hold is refused, not a panic in every later request.
    let (status, v) = sim
        .post_json("/admin/faults", json!({"slow_start_ms": 1e300}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("sim.faults.slow_start_ms"));
    let (status, _) = sim.post_json("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn hang_never_answers_while_health_stays_up() {
    let sim = start(fast_config()).await;
    sim.set_faults(json!({"hang": true})).await;
    let req = sim.request(
        Method::POST,
        "/v1/chat/completions",
        chat("hi", json!({})).to_string(),
    );
    let pending = tokio::time::timeout(Duration::from_millis(300), sim.client.request(req)).await;
    assert!(pending.is_err(), "a hung server must not answer");
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);
}

/// A sim of one slot, a queue of `max_queue`, and `tpot_ms` between tokens.
fn one_slot(max_queue: usize, tpot_ms: f64) -> SimConfig {
    SimConfig {
        max_concurrency: 1,
        max_queue,
        time_per_output_token_ms: tpot_ms,
        ..fast_config()
    }
}

/// A streamed chat request of five tokens.
fn slow_stream(sim: &Sim) -> Request<Full<Bytes>> {
    sim.request(
        Method::POST,
        "/v1/chat/completions",
        chat("slow", json!({"stream": true, "max_tokens": 5})).to_string(),
    )
}

#[tokio::test]
async fn full_queue_answers_429() {
    let sim = start(one_slot(0, 100.0)).await;
    let held = sim.client.request(slow_stream(&sim)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (status, v) = sim
        .post_json(
            "/v1/chat/completions",
            chat("next", json!({"max_tokens": 1})),
        )
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    drop(held);
}

#[tokio::test]
async fn a_client_that_leaves_between_tokens_frees_its_slot_at_once() {
    // One slot, and ten minutes between tokens.
    let sim = start(one_slot(1, 600_000.0)).await;
    let mut body = sim
        .client
        .request(slow_stream(&sim))
        .await
        .unwrap()
        .into_body();
    // The role chunk and the first token, then the client leaves while the next is decoded.
    let mut events = 0;
    while events < 2 {
        if body.frame().await.unwrap().unwrap().is_data() {
            events += 1;
        }
    }
    drop(body);
    // Before, the slot stayed taken until the next token's send failed, ten minutes on.
    let next = sim.post_json(
        "/v1/chat/completions",
        chat("next", json!({"max_tokens": 1})),
    );
    let (status, _) = tokio::time::timeout(Duration::from_secs(30), next)
        .await
        .expect("the slot was freed when the client left");
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn stall_stops_the_stream_after_n_tokens_but_keeps_it_open() {
    let sim = start(fast_config()).await;
    sim.set_faults(json!({"stall_after_tokens": 2})).await;
    let req = sim.request(
        Method::POST,
        "/v1/chat/completions",
        chat("hi", json!({"stream": true, "max_tokens": 10})).to_string(),
    );
    let mut body = sim.client.request(req).await.unwrap().into_body();
    let mut events = 0;
    let read = tokio::time::timeout(Duration::from_millis(300), async {
        while let Some(frame) = body.frame().await {
            if frame.unwrap().is_data() {
                events += 1;
            }
        }
    })
    .await;
    assert!(read.is_err(), "a stalled stream stays open");
    assert_eq!(events, 3, "role chunk and two tokens before the stall");
}

#[tokio::test]
async fn refuse_connections_resets_every_connection() {
    let sim = start(fast_config()).await;
    sim.set_faults(json!({"refuse_connections": true})).await;
    // A fresh client, so no pooled connection is reused.
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let res = client
        .request(sim.request(Method::GET, "/health", Bytes::new()))
        .await;
    assert!(res.is_err(), "{res:?}");
    // The admin route stays reachable, so the fault can be switched off again.
    let fresh: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let res = fresh
        .request(sim.request(Method::POST, "/admin/faults", Bytes::from_static(b"[]")))
        .await
        .expect("admin answers while refusing");
    assert_eq!(
        res.status(),
        StatusCode::BAD_REQUEST,
        "an array is not a faults object"
    );
    let res = fresh
        .request(sim.request(Method::POST, "/admin/faults", Bytes::from_static(b"{}")))
        .await
        .expect("admin answers while refusing");
    assert_eq!(res.status(), StatusCode::OK);
    let res = Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>()
        .request(sim.request(Method::GET, "/health", Bytes::new()))
        .await
        .expect("connections are accepted again");
    assert_eq!(res.status(), StatusCode::OK);
}

/// A zero-cost decode has no timer to wait on: it still gives the thread to other requests. The
/// test runtime has one thread, so without that the health check could not be answered until
/// the long answer was finished.
#[tokio::test]
async fn a_zero_cost_decode_lets_other_requests_through() {
    let sim = start(SimConfig {
        base_latency_ms: 0.0,
        time_per_output_token_ms: 0.0,
        prefill_tokens_per_second: 1_000_000.0,
        ..SimConfig::default()
    })
    .await;
    assert_eq!(sim.get("/health").await.0, StatusCode::OK);
    let long = {
        let client = sim.client.clone();
        let request = sim.request(
            Method::POST,
            "/v1/completions",
            json!({"model": "sim-model", "prompt": "x", "max_tokens": 400_000, "ignore_eos": true})
                .to_string(),
        );
        tokio::spawn(async move {
            let resp = client.request(request).await.unwrap();
            let status = resp.status();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, body.len())
        })
    };
    // Let the long request reach its decode loop.
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(sim.get("/health").await, (StatusCode::OK, "ok".to_owned()));
    assert!(
        !long.is_finished(),
        "the long answer finished before the health check: the test proves nothing"
    );
    let (status, len) = long.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(len > 400_000, "{len}");
}

/// A request that leaves during its prefill gives the engine's prefill time back to the
/// requests after it: the second request here would wait ten minutes behind the first's
/// abandoned prefill otherwise.
#[tokio::test]
async fn a_prefill_left_early_gives_its_time_to_the_requests_behind_it() {
    let sim = start(SimConfig {
        base_latency_ms: 0.0,
        time_per_output_token_ms: 1.0,
        // 6,000 tokens of prompt: ten minutes of prefill.
        prefill_tokens_per_second: 10.0,
        prefill_shared: true,
        ..SimConfig::default()
    })
    .await;
    let long = {
        let client = sim.client.clone();
        let request = sim.request(
            Method::POST,
            "/v1/completions",
            json!({"model": "sim-model", "prompt": "abcd".repeat(6_000), "max_tokens": 1})
                .to_string(),
        );
        tokio::spawn(async move { client.request(request).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let short = {
        let client = sim.client.clone();
        let request = sim.request(
            Method::POST,
            "/v1/completions",
            json!({"model": "sim-model", "prompt": "x", "max_tokens": 1}).to_string(),
        );
        tokio::spawn(async move {
            let resp = client.request(request).await.unwrap();
            let status = resp.status();
            resp.into_body().collect().await.unwrap();
            status
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!short.is_finished(), "the second request did not wait");
    long.abort();
    let status = tokio::time::timeout(Duration::from_secs(60), short)
        .await
        .expect("the second request still waits for the first one's prefill")
        .unwrap();
    assert_eq!(status, StatusCode::OK);
}
