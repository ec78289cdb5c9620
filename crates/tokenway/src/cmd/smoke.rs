//! `tokenway demo --smoke`: a batch of streaming chat requests through the demo gateway.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokenway_bench::load::{stream_chat, LoadClient};
use tokenway_bench::stats::percentile;

/// Concurrent streams the smoke test keeps open.
const CONCURRENCY: usize = 8;

/// Sends `requests` streaming requests to `gateway`, prints percentiles, fails if any failed.
pub async fn run(gateway: SocketAddr, requests: usize) -> anyhow::Result<()> {
    let client = LoadClient::new();
    let url = format!("http://{gateway}/v1/chat/completions");
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let per_worker = requests.div_ceil(CONCURRENCY);
    for w in 0..CONCURRENCY {
        let client = client.clone();
        let url = url.clone();
        let n = per_worker.min(requests.saturating_sub(w * per_worker));
        tasks.spawn(async move {
            let mut out = Vec::with_capacity(n);
            for i in 0..n {
                let prompt = format!("smoke test request {w}-{i}: say something");
                out.push(stream_chat(&client, &url, "sim-model", &prompt, 16).await);
            }
            out
        });
    }
    let mut ttft = Vec::new();
    let mut gaps = Vec::new();
    let mut failures = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        for r in joined? {
            match r {
                Ok(s) => {
                    ttft.push(s.ttft);
                    gaps.extend(s.gaps);
                }
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    let ms = |d: Option<Duration>| {
        d.map_or("-".to_string(), |d| {
            format!("{:.1} ms", d.as_secs_f64() * 1e3)
        })
    };
    println!(
        "smoke: {} requests in {:.2} s, {} failed",
        ttft.len() + failures.len(),
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    println!(
        "smoke: TTFT p50 {}  p99 {}   inter-token p50 {}  p99 {}",
        ms(percentile(&mut ttft, 50.0)),
        ms(percentile(&mut ttft, 99.0)),
        ms(percentile(&mut gaps, 50.0)),
        ms(percentile(&mut gaps, 99.0)),
    );
    if let Some(first) = failures.first() {
        anyhow::bail!(
            "{} of {requests} smoke requests failed; first: {first}",
            failures.len()
        );
    }
    Ok(())
}
