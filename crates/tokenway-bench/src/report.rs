//! Results of `tokenway bench gateway`: the data model, the verdicts against the targets, and
//! their two renderings (`results.json` for machines, `results.md` for people).
//!
//! Added latency is the difference of percentiles (gateway p50 minus direct p50), not a
//! percentile of per-request differences: the runs are separate, so requests cannot be paired.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::process::Memory;
use crate::stats::{LatencySummary, TailSummary};
use crate::BenchError;

/// Targets of the issue: added TTFT p50, milliseconds.
pub const TARGET_ADDED_P50_MS: f64 = 0.3;
/// Added TTFT p99, milliseconds.
pub const TARGET_ADDED_P99_MS: f64 = 2.0;
/// Throughput through the gateway as a fraction of direct.
pub const TARGET_THROUGHPUT_FRACTION: f64 = 0.70;
/// Gateway peak RSS under load, MiB.
pub const TARGET_RSS_LOAD_MIB: f64 = 32.0;
/// Gateway RSS with the open streams, MiB.
pub const TARGET_RSS_OPEN_MIB: f64 = 64.0;

/// What the load went through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetKind {
    /// Straight to the simulated backend.
    Direct,
    /// Through `tokenway gateway`.
    Gateway,
    /// Through nginx as a streaming reverse proxy.
    Nginx,
}

impl TargetKind {
    /// The name shown in tables.
    pub fn label(self) -> &'static str {
        match self {
            Self::Direct => "direct (sim)",
            Self::Gateway => "tokenway gateway",
            Self::Nginx => "nginx",
        }
    }
}

/// The machine and the run.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Logical CPUs available to the bench.
    pub nproc: usize,
    /// `uname -r`.
    pub kernel: Option<String>,
    /// `git rev-parse --short HEAD`, when run inside a git checkout with commits.
    pub git_commit: Option<String>,
    /// `nginx -v`, when nginx took part.
    pub nginx_version: Option<String>,
    /// `/proc/loadavg` before the run: other work on the machine skews every number.
    pub loadavg_before: Option<String>,
    /// Percent of the machine's CPU time stolen by the hypervisor during the sequential requests
    /// and during the throughput levels (`/proc/stat`).
    pub steal_percent: StealPercent,
}

/// CPU time stolen from this virtual machine while the scenarios ran, percent.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct StealPercent {
    /// During the sequential requests.
    pub sequential: Option<f64>,
    /// During the throughput levels.
    pub load: Option<f64>,
}

/// The knobs of the run.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    /// Requests in the sequential single-stream scenario.
    pub sequential_requests: usize,
    /// Seconds per throughput level.
    pub duration_secs: f64,
    /// Concurrency levels of the throughput scenario.
    pub concurrency: Vec<usize>,
    /// `max_tokens` of the sequential and throughput requests.
    pub max_tokens: u32,
    /// Streams held open at once through the gateway (0 = scenario skipped).
    pub open_streams: usize,
    /// `max_tokens` of each open stream.
    pub open_stream_tokens: u32,
    /// The sim's time per output token for the open streams, milliseconds.
    pub open_stream_tpot_ms: f64,
}

/// A set of requests and what became of them.
#[derive(Clone, Debug, Serialize)]
pub struct ScenarioResult {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed (not 200, or no `data: [DONE]`).
    pub errors: usize,
    /// Time to first `data:` event of the successful requests.
    pub ttft: Option<LatencySummary>,
    /// Whole-response time of the successful requests.
    pub total: Option<LatencySummary>,
    /// The first failure, to say why.
    pub first_error: Option<String>,
}

/// CPU used during a throughput level, percent of one core.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct CpuUse {
    /// The bench process (load generator).
    pub load_generator: Option<f64>,
    /// The simulated backend.
    pub sim: Option<f64>,
    /// The proxy (gateway or nginx master plus workers); `None` for direct.
    pub proxy: Option<f64>,
}

/// One throughput level.
#[derive(Clone, Debug, Serialize)]
pub struct LoadResult {
    /// Closed-loop workers.
    pub concurrency: usize,
    /// Wall time from start until the last request finished, seconds.
    pub wall_secs: f64,
    /// Successful requests per second of wall time.
    pub rps: f64,
    /// Requests and latencies.
    pub scenario: ScenarioResult,
    /// CPU use while it ran.
    pub cpu: CpuUse,
}

/// Everything measured against one target.
#[derive(Clone, Debug, Serialize)]
pub struct TargetResult {
    /// Which target.
    pub target: TargetKind,
    /// Sequential single-stream requests.
    pub sequential: ScenarioResult,
    /// The tail of their times to first token.
    pub sequential_ttft_tail: Option<TailSummary>,
    /// Throughput levels, in the order of `Settings::concurrency`.
    pub load: Vec<LoadResult>,
    /// The proxy's memory after the throughput levels (`None` for direct).
    pub proxy_memory: Option<Memory>,
}

/// The open-streams scenario (gateway only).
#[derive(Clone, Debug, Serialize)]
pub struct OpenStreamsResult {
    /// Streams started at once.
    pub streams: usize,
    /// Streams that had received their first event when memory was sampled.
    pub open_when_sampled: usize,
    /// Largest gateway VmRSS sampled while the streams were open.
    pub rss_open_kib: u64,
    /// Gateway VmHWM after all streams ended.
    pub hwm_kib: u64,
    /// Requests and latencies.
    pub scenario: ScenarioResult,
}

/// One target of the issue, checked.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    /// The target, in words.
    pub target: String,
    /// What was measured.
    pub measured: String,
    /// `Some(true)` pass, `Some(false)` fail, `None` not measured.
    pub pass: Option<bool>,
}

impl Verdict {
    fn word(&self) -> &'static str {
        match self.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "SKIP",
        }
    }
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct GatewayBenchReport {
    /// The machine.
    pub machine: Machine,
    /// The exact command line.
    pub command_line: String,
    /// When the run started, RFC 3339 UTC.
    pub timestamp: String,
    /// The knobs.
    pub settings: Settings,
    /// Per target, direct first.
    pub targets: Vec<TargetResult>,
    /// 1,000 open streams through the gateway.
    pub open_streams: Option<OpenStreamsResult>,
    /// Things not run, and why.
    pub notes: Vec<String>,
    /// Targets of the issue, checked.
    pub verdicts: Vec<Verdict>,
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn ms(v: Option<f64>) -> String {
    v.map_or("—".to_owned(), |v| format!("{v:.3} ms"))
}

fn percent(v: Option<f64>) -> String {
    v.map_or("unknown".to_owned(), |v| format!("{v:.1} %"))
}

fn signed_ms(v: Option<f64>) -> String {
    v.map_or("—".to_owned(), |v| format!("{v:+.3} ms"))
}

impl GatewayBenchReport {
    /// The result for `kind`, if it ran.
    pub fn target(&self, kind: TargetKind) -> Option<&TargetResult> {
        self.targets.iter().find(|t| t.target == kind)
    }

    /// Added sequential TTFT (p50, p99) of `kind` over direct, milliseconds.
    pub fn added_ttft(&self, kind: TargetKind) -> (Option<f64>, Option<f64>) {
        let ttft = |k| self.target(k).and_then(|t| t.sequential.ttft);
        match (ttft(kind), ttft(TargetKind::Direct)) {
            (Some(t), Some(d)) => (Some(t.p50_ms - d.p50_ms), Some(t.p99_ms - d.p99_ms)),
            _ => (None, None),
        }
    }

    /// Requests per second of `kind` at `concurrency`.
    pub fn rps(&self, kind: TargetKind, concurrency: usize) -> Option<f64> {
        self.target(kind)?
            .load
            .iter()
            .find(|l| l.concurrency == concurrency)
            .map(|l| l.rps)
    }

    /// Checks the targets against what was measured.
    pub fn compute_verdicts(&self) -> Vec<Verdict> {
        use TargetKind::{Direct, Gateway, Nginx};
        let mut v = Vec::new();
        let (gw50, gw99) = self.added_ttft(Gateway);
        let (ng50, ng99) = self.added_ttft(Nginx);
        let check =
            |target: String, measured: Option<f64>, unit: &str, ok: &dyn Fn(f64) -> bool| Verdict {
                target,
                measured: measured.map_or("not measured".to_owned(), |m| format!("{m:+.3}{unit}")),
                pass: measured.map(ok),
            };
        v.push(check(
            format!("gateway added TTFT p50 <= {TARGET_ADDED_P50_MS} ms"),
            gw50,
            " ms",
            &|m| m <= TARGET_ADDED_P50_MS,
        ));
        v.push(check(
            format!("gateway added TTFT p99 <= {TARGET_ADDED_P99_MS} ms"),
            gw99,
            " ms",
            &|m| m <= TARGET_ADDED_P99_MS,
        ));
        for c in &self.settings.concurrency {
            let frac = match (self.rps(Gateway, *c), self.rps(Direct, *c)) {
                (Some(g), Some(d)) if d > 0.0 => Some(g / d),
                _ => None,
            };
            v.push(Verdict {
                target: format!(
                    "gateway throughput >= {:.0}% of direct at concurrency {c}",
                    TARGET_THROUGHPUT_FRACTION * 100.0
                ),
                measured: frac.map_or("not measured".to_owned(), |f| format!("{:.1}%", f * 100.0)),
                pass: frac.map(|f| f >= TARGET_THROUGHPUT_FRACTION),
            });
        }
        for (what, gw, ng) in [("p50", gw50, ng50), ("p99", gw99, ng99)] {
            v.push(Verdict {
                target: format!("gateway added TTFT {what} <= nginx's"),
                measured: match (gw, ng) {
                    (Some(g), Some(n)) => format!("gateway {g:+.3} ms, nginx {n:+.3} ms"),
                    _ => "nginx not measured".to_owned(),
                },
                pass: gw.zip(ng).map(|(g, n)| g <= n),
            });
        }
        for c in &self.settings.concurrency {
            let (g, n) = (self.rps(Gateway, *c), self.rps(Nginx, *c));
            v.push(Verdict {
                target: format!("gateway rps >= nginx's at concurrency {c}"),
                measured: match (g, n) {
                    (Some(g), Some(n)) => format!("gateway {g:.0}/s, nginx {n:.0}/s"),
                    _ => "nginx not measured".to_owned(),
                },
                pass: g.zip(n).map(|(g, n)| g >= n),
            });
        }
        let errors = self
            .target(Gateway)
            .map(|t| t.sequential.errors + t.load.iter().map(|l| l.scenario.errors).sum::<usize>());
        v.push(Verdict {
            target: "no failed requests through the gateway".to_owned(),
            measured: errors.map_or("not measured".to_owned(), |e| format!("{e} errors")),
            pass: errors.map(|e| e == 0),
        });
        let load_rss = self
            .target(Gateway)
            .and_then(|t| t.proxy_memory)
            .map(|m| mib(m.hwm_kib));
        v.push(Verdict {
            target: format!("gateway peak RSS under load <= {TARGET_RSS_LOAD_MIB} MiB"),
            measured: load_rss.map_or("not measured".to_owned(), |m| format!("{m:.1} MiB (VmHWM)")),
            pass: load_rss.map(|m| m <= TARGET_RSS_LOAD_MIB),
        });
        let open = self.open_streams.as_ref();
        v.push(Verdict {
            target: format!(
                "gateway RSS <= {TARGET_RSS_OPEN_MIB} MiB with {} open streams",
                self.settings.open_streams
            ),
            measured: open.map_or("not measured".to_owned(), |o| {
                format!(
                    "{:.1} MiB (VmRSS) with {} of {} streams open",
                    mib(o.rss_open_kib),
                    o.open_when_sampled,
                    o.streams
                )
            }),
            // Memory with fewer streams open than asked for proves nothing.
            pass: open.map(|o| {
                o.open_when_sampled == o.streams && mib(o.rss_open_kib) <= TARGET_RSS_OPEN_MIB
            }),
        });
        v
    }

    /// The Markdown report (also printed to stdout).
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let _ = writeln!(s, "## tokenway bench gateway\n");
        let _ = writeln!(s, "- command: `{}`", self.command_line);
        let _ = writeln!(
            s,
            "- machine: {} CPUs, kernel {}, commit {}{}",
            m.nproc,
            m.kernel.as_deref().unwrap_or("unknown"),
            m.git_commit.as_deref().unwrap_or("unknown (no git commit)"),
            m.nginx_version
                .as_deref()
                .map_or(String::new(), |v| format!(", {v}"))
        );
        let st = &self.settings;
        let _ = writeln!(
            s,
            "- when: {}; load average before the run: {}\n\
             - CPU time stolen by the hypervisor: {} during the sequential requests, {} during \
             the throughput levels\n\
             - {} sequential requests; {} s per concurrency level; max_tokens {}; \
             load generator, sim and proxy share the machine\n",
            self.timestamp,
            m.loadavg_before.as_deref().unwrap_or("unknown"),
            percent(m.steal_percent.sequential),
            percent(m.steal_percent.load),
            st.sequential_requests,
            st.duration_secs,
            st.max_tokens
        );

        let mut header =
            "| target | single TTFT p50 | p99 | added p50 vs direct | added p99 |".to_owned();
        for c in &st.concurrency {
            let _ = write!(header, " rps@{c} |");
        }
        header.push_str(" % of direct | errors | RSS |");
        let _ = writeln!(s, "{header}");
        let _ = writeln!(s, "|{}", "---|".repeat(8 + st.concurrency.len()));
        for t in &self.targets {
            let (a50, a99) = if t.target == TargetKind::Direct {
                (None, None)
            } else {
                self.added_ttft(t.target)
            };
            let ttft = t.sequential.ttft;
            let _ = write!(
                s,
                "| {} | {} | {} | {} | {} |",
                t.target.label(),
                ms(ttft.map(|x| x.p50_ms)),
                ms(ttft.map(|x| x.p99_ms)),
                signed_ms(a50),
                signed_ms(a99)
            );
            let mut pct = Vec::new();
            for c in &st.concurrency {
                let rps = self.rps(t.target, *c);
                let _ = write!(
                    s,
                    " {} |",
                    rps.map_or("—".to_owned(), |r| format!("{r:.0}"))
                );
                pct.push(match (rps, self.rps(TargetKind::Direct, *c)) {
                    (Some(r), Some(d)) if d > 0.0 => format!("{:.0}%", r / d * 100.0),
                    _ => "—".to_owned(),
                });
            }
            let errors =
                t.sequential.errors + t.load.iter().map(|l| l.scenario.errors).sum::<usize>();
            let rss = t.proxy_memory.map_or("—".to_owned(), |m| {
                format!("{:.1} MiB peak", mib(m.hwm_kib))
            });
            let _ = writeln!(s, " {} | {errors} | {rss} |", pct.join(" / "));
        }

        let _ = writeln!(
            s,
            "\n### The single stream's tail\n\n\
             Time to first token of the sequential requests; the p99's 95 % interval is \
             distribution-free (the ranks a rerun of as many requests would land on). Two p99s \
             whose intervals overlap are not told apart by this run. CDF: `ttft-cdf.svg`.\n"
        );
        let _ = writeln!(
            s,
            "| target | requests | p90 | p99 | p99 95 % interval | p99.9 | max |\n|---|---|---|---|---|---|---|"
        );
        for t in &self.targets {
            let Some(tail) = t.sequential_ttft_tail else {
                continue;
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.3}–{:.3} ms | {} | {} |",
                t.target.label(),
                tail.count,
                ms(Some(tail.p90_ms)),
                ms(Some(tail.p99_ms)),
                tail.p99_low_ms,
                tail.p99_high_ms,
                ms(Some(tail.p999_ms)),
                ms(t.sequential.ttft.map(|x| x.max_ms)),
            );
        }
        let _ = writeln!(
            s,
            "\n### Under load (closed loop, {} s per level and target, in turns)\n",
            st.duration_secs
        );
        let _ = writeln!(
            s,
            "| target | concurrency | requests | rps | TTFT p50 | TTFT p99 | total p50 | total p99 | errors | CPU load gen | CPU sim | CPU proxy | proxy CPU per request |"
        );
        let _ = writeln!(s, "|{}", "---|".repeat(13));
        let pct = |v: Option<f64>| v.map_or("—".to_owned(), |v| format!("{v:.0}%"));
        for t in &self.targets {
            for l in &t.load {
                let sc = &l.scenario;
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    t.target.label(),
                    l.concurrency,
                    sc.requests,
                    l.rps,
                    ms(sc.ttft.map(|x| x.p50_ms)),
                    ms(sc.ttft.map(|x| x.p99_ms)),
                    ms(sc.total.map(|x| x.p50_ms)),
                    ms(sc.total.map(|x| x.p99_ms)),
                    sc.errors,
                    pct(l.cpu.load_generator),
                    pct(l.cpu.sim),
                    pct(l.cpu.proxy),
                    l.cpu
                        .proxy
                        .filter(|_| l.rps > 0.0)
                        .map_or("—".to_owned(), |p| format!(
                            "{:.0} µs",
                            p / 100.0 / l.rps * 1e6
                        ))
                );
            }
        }
        let _ = writeln!(
            s,
            "\nCPU is percent of one core over the level's wall time; the proxy's CPU per request is \
             its CPU time divided by its successful requests."
        );

        if let Some(o) = &self.open_streams {
            let _ = writeln!(
                s,
                "\n### {} open streams through the gateway\n\n\
                 Each stream asks for {} tokens at {} ms per token. {} of {} streams had started \
                 when memory was sampled; {} finished with `data: [DONE]`, {} failed. \
                 Gateway VmRSS while open: **{:.1} MiB**; VmHWM after: {:.1} MiB. \
                 TTFT p50 {}, p99 {}.",
                o.streams,
                st.open_stream_tokens,
                st.open_stream_tpot_ms,
                o.open_when_sampled,
                o.streams,
                o.scenario.requests - o.scenario.errors,
                o.scenario.errors,
                mib(o.rss_open_kib),
                mib(o.hwm_kib),
                ms(o.scenario.ttft.map(|x| x.p50_ms)),
                ms(o.scenario.ttft.map(|x| x.p99_ms)),
            );
        }

        let errors: Vec<String> = self
            .targets
            .iter()
            .flat_map(|t| {
                std::iter::once(&t.sequential)
                    .chain(t.load.iter().map(|l| &l.scenario))
                    .filter_map(move |sc| {
                        sc.first_error
                            .as_ref()
                            .map(|e| format!("{}: {e}", t.target.label()))
                    })
            })
            .chain(self.open_streams.iter().filter_map(|o| {
                o.scenario
                    .first_error
                    .as_ref()
                    .map(|e| format!("open streams: {e}"))
            }))
            .collect();
        if !errors.is_empty() || !self.notes.is_empty() {
            let _ = writeln!(s, "\n### Notes\n");
            for n in self.notes.iter().chain(&errors) {
                let _ = writeln!(s, "- {n}");
            }
        }

        let _ = writeln!(s, "\n### Verdict\n");
        let _ = writeln!(s, "| target | measured | result |\n|---|---|---|");
        for v in &self.verdicts {
            let _ = writeln!(s, "| {} | {} | {} |", v.target, v.measured, v.word());
        }
        s
    }

    /// Writes `results.json` and `results.md` into `dir`; returns their paths.
    pub fn write(&self, dir: &Path) -> Result<(PathBuf, PathBuf), BenchError> {
        let io = |context: String| move |source| BenchError::Io { context, source };
        std::fs::create_dir_all(dir).map_err(io(format!("cannot create {}", dir.display())))?;
        let json_path = dir.join("results.json");
        let json = serde_json::to_string_pretty(self).expect("the report holds only plain data");
        std::fs::write(&json_path, json + "\n")
            .map_err(io(format!("cannot write {}", json_path.display())))?;
        let md_path = dir.join("results.md");
        std::fs::write(&md_path, self.to_markdown())
            .map_err(io(format!("cannot write {}", md_path.display())))?;
        Ok((json_path, md_path))
    }
}

/// `t` as RFC 3339 UTC, e.g. `2024-05-01T12:00:00Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant, "chrono-Compatible Low-Level Date
    // Algorithms", civil_from_days).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn summary(p50: f64, p99: f64) -> Option<LatencySummary> {
        Some(LatencySummary {
            count: 100,
            p50_ms: p50,
            p99_ms: p99,
            max_ms: p99,
        })
    }

    fn scenario(p50: f64, p99: f64, errors: usize) -> ScenarioResult {
        ScenarioResult {
            requests: 100,
            errors,
            ttft: summary(p50, p99),
            total: summary(p50 + 1.0, p99 + 1.0),
            first_error: (errors > 0).then(|| "status 502 Bad Gateway".to_owned()),
        }
    }

    fn target(kind: TargetKind, p50: f64, p99: f64, rps: [f64; 2], hwm_mib: u64) -> TargetResult {
        TargetResult {
            target: kind,
            sequential: scenario(p50, p99, 0),
            sequential_ttft_tail: None,
            load: [64, 256]
                .into_iter()
                .zip(rps)
                .map(|(c, rps)| LoadResult {
                    concurrency: c,
                    wall_secs: 10.0,
                    rps,
                    scenario: scenario(p50 * 2.0, p99 * 2.0, 0),
                    cpu: CpuUse::default(),
                })
                .collect(),
            proxy_memory: (kind != TargetKind::Direct).then_some(Memory {
                rss_kib: hwm_mib * 1024,
                hwm_kib: hwm_mib * 1024,
            }),
        }
    }

    fn report(targets: Vec<TargetResult>, open_rss_mib: u64) -> GatewayBenchReport {
        let mut r = GatewayBenchReport {
            machine: Machine {
                nproc: 2,
                kernel: Some("6.1.0".to_owned()),
                git_commit: Some("abc1234".to_owned()),
                nginx_version: None,
                loadavg_before: Some("0.10 0.20 0.30 1/100 42".to_owned()),
                steal_percent: StealPercent::default(),
            },
            command_line: "tokenway bench gateway --quick".to_owned(),
            timestamp: "2024-01-01T00:00:00Z".to_owned(),
            settings: Settings {
                sequential_requests: 100,
                duration_secs: 2.0,
                concurrency: vec![64, 256],
                max_tokens: 16,
                open_streams: 1000,
                open_stream_tokens: 50,
                open_stream_tpot_ms: 100.0,
            },
            targets,
            open_streams: Some(OpenStreamsResult {
                streams: 1000,
                open_when_sampled: 1000,
                rss_open_kib: open_rss_mib * 1024,
                hwm_kib: open_rss_mib * 1024,
                scenario: scenario(1.0, 2.0, 0),
            }),
            notes: vec![],
            verdicts: vec![],
        };
        r.verdicts = r.compute_verdicts();
        r
    }

    fn verdict<'a>(r: &'a GatewayBenchReport, prefix: &str) -> &'a Verdict {
        r.verdicts
            .iter()
            .find(|v| v.target.starts_with(prefix))
            .unwrap_or_else(|| panic!("no verdict starting with {prefix:?}"))
    }

    #[test]
    fn fast_small_gateway_passes_every_target() {
        let r = report(
            vec![
                target(TargetKind::Direct, 1.0, 2.0, [1000.0, 1000.0], 0),
                target(TargetKind::Gateway, 1.1, 2.5, [900.0, 800.0], 20),
                target(TargetKind::Nginx, 1.2, 3.0, [850.0, 700.0], 10),
            ],
            40,
        );
        for v in &r.verdicts {
            assert_eq!(v.pass, Some(true), "{v:?}");
        }
        assert!(r.to_markdown().contains("| PASS |"));
        assert!(!r.to_markdown().contains("FAIL"));
    }

    #[test]
    fn slow_gateway_fails_latency_throughput_and_nginx_comparisons() {
        let r = report(
            vec![
                target(TargetKind::Direct, 1.0, 2.0, [1000.0, 1000.0], 0),
                target(TargetKind::Gateway, 1.5, 5.0, [600.0, 800.0], 40),
                target(TargetKind::Nginx, 1.2, 3.0, [850.0, 700.0], 10),
            ],
            80,
        );
        assert_eq!(
            verdict(&r, "gateway added TTFT p50 <= 0.3").pass,
            Some(false)
        );
        assert_eq!(verdict(&r, "gateway added TTFT p99 <= 2").pass, Some(false));
        assert_eq!(
            verdict(&r, "gateway throughput >= 70% of direct at concurrency 64").pass,
            Some(false)
        );
        assert_eq!(
            verdict(&r, "gateway throughput >= 70% of direct at concurrency 256").pass,
            Some(true)
        );
        assert_eq!(
            verdict(&r, "gateway rps >= nginx's at concurrency 64").pass,
            Some(false)
        );
        assert_eq!(
            verdict(&r, "gateway rps >= nginx's at concurrency 256").pass,
            Some(true)
        );
        assert_eq!(verdict(&r, "gateway peak RSS").pass, Some(false));
        assert_eq!(verdict(&r, "gateway RSS <= 64 MiB").pass, Some(false));
    }

    #[test]
    fn missing_nginx_is_skipped_not_passed() {
        let r = report(
            vec![
                target(TargetKind::Direct, 1.0, 2.0, [1000.0, 1000.0], 0),
                target(TargetKind::Gateway, 1.1, 2.5, [900.0, 800.0], 20),
            ],
            40,
        );
        let v = verdict(&r, "gateway added TTFT p50 <= nginx's");
        assert_eq!(v.pass, None);
        assert!(r.to_markdown().contains("| SKIP |"));
    }

    #[test]
    fn the_load_table_gives_the_proxy_cpu_per_request() {
        let mut gateway = target(TargetKind::Gateway, 1.25, 2.5, [900.0, 1000.0], 20);
        gateway.load[1].cpu.proxy = Some(50.0);
        let r = report(
            vec![
                target(TargetKind::Direct, 1.0, 2.0, [1000.0, 2000.0], 0),
                gateway,
            ],
            40,
        );
        let md = r.to_markdown();
        let row = |label: &str, concurrency: &str| {
            md.lines()
                .find(|l| l.starts_with(&format!("| {label} | {concurrency} |")))
                .unwrap_or_else(|| panic!("no load row for {label} at {concurrency}"))
                .to_owned()
        };
        // Half a core at 1,000 requests/s: 500 µs of the proxy's CPU per request.
        assert!(row("tokenway gateway", "256").ends_with("| 50% | 500 µs |"));
        assert!(row("tokenway gateway", "64").ends_with("| — | — |"));
        assert!(row("direct (sim)", "256").ends_with("| — | — |"));
    }

    #[test]
    fn markdown_table_has_one_column_per_concurrency_level() {
        let r = report(
            vec![
                target(TargetKind::Direct, 1.0, 2.0, [1000.0, 2000.0], 0),
                target(TargetKind::Gateway, 1.25, 2.5, [900.0, 1000.0], 20),
            ],
            40,
        );
        let md = r.to_markdown();
        assert!(md.contains(
            "| target | single TTFT p50 | p99 | added p50 vs direct | added p99 | rps@64 | rps@256 | % of direct | errors | RSS |"
        ));
        assert!(md.contains("\n|---|---|---|---|---|---|---|---|---|---|\n"));
        assert!(md.contains(
            "| tokenway gateway | 1.250 ms | 2.500 ms | +0.250 ms | +0.500 ms | 900 | 1000 | 90% / 50% | 0 | 20.0 MiB peak |"
        ));
        assert!(md.contains(
            "| direct (sim) | 1.000 ms | 2.000 ms | — | — | 1000 | 2000 | 100% / 100% | 0 | — |"
        ));
    }

    #[test]
    fn json_names_targets_in_snake_case() {
        let r = report(
            vec![target(TargetKind::Gateway, 1.0, 2.0, [1.0, 1.0], 1)],
            1,
        );
        let json = serde_json::to_value(&r).expect("serializable");
        assert_eq!(json["targets"][0]["target"], "gateway");
        assert_eq!(json["machine"]["nproc"], 2);
    }

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_709_210_096);
        assert_eq!(rfc3339(t), "2024-02-29T12:34:56Z");
    }
}
