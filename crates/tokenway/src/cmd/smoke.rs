//! `tokenway demo --smoke`: a batch of streaming chat requests through each demo entry point,
//! with time-to-first-token and inter-token percentiles.

use std::net::SocketAddr;
use std::time::Duration;

use tokenway_bench::load::{chat_body, LoadClient, Sample};
use tokenway_bench::stats::LatencySummary;

/// Concurrent streams per entry point.
const CONCURRENCY: usize = 8;
/// Tokens asked for per request.
const TOKENS: u32 = 16;
/// Longest a request may take, from sending it to its last byte: a stuck stream fails the
/// smoke run instead of hanging it (a demo request takes well under a second).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Sends `requests` streaming requests to each of `targets`, prints percentiles, and fails if
/// any request failed.
pub async fn run(targets: &[(&str, SocketAddr)], requests: usize) -> anyhow::Result<()> {
    let mut failed = 0;
    let mut first_error = None;
    for (name, addr) in targets {
        let client = LoadClient::new(*addr);
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..CONCURRENCY {
            let client = client.clone();
            let n = requests / CONCURRENCY + usize::from(w < requests % CONCURRENCY);
            tasks.spawn(async move {
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    let chat = client.chat(chat_body(TOKENS), None);
                    out.push(
                        tokio::time::timeout(REQUEST_TIMEOUT, chat)
                            .await
                            .unwrap_or_else(|_| Sample {
                                ttft: None,
                                total: REQUEST_TIMEOUT,
                                gaps: Vec::new(),
                                error: Some(format!("no answer within {REQUEST_TIMEOUT:?}")),
                            }),
                    );
                }
                out
            });
        }
        let mut ttft = Vec::new();
        let mut gaps: Vec<Duration> = Vec::new();
        let mut errors = 0;
        while let Some(joined) = tasks.join_next().await {
            for s in joined? {
                match &s.error {
                    None => {
                        ttft.extend(s.ttft);
                        gaps.extend(s.gaps.iter().copied());
                    }
                    Some(e) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| format!("{name}: {e}"));
                    }
                }
            }
        }
        failed += errors;
        let fmt = |s: Option<LatencySummary>| {
            s.map_or("-".to_string(), |s| {
                format!("p50 {:.1} ms  p99 {:.1} ms", s.p50_ms, s.p99_ms)
            })
        };
        println!(
            "smoke {name:<8} {requests} requests, {errors} failed   TTFT {}   inter-token {}",
            fmt(LatencySummary::from_durations(&ttft)),
            fmt(LatencySummary::from_durations(&gaps)),
        );
    }
    if let Some(e) = first_error {
        anyhow::bail!("{failed} smoke requests failed; first: {e}");
    }
    Ok(())
}
