//! Results of `tokenway bench transport`: the data model and its renderings (`results.json`,
//! `results.md`, and CDF plots under `plots/`).
//!
//! Ratios compare percentiles of separate runs (transport p50 / baseline p50 in the same
//! profile and scenario); requests cannot be paired across transports.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde::Serialize;

use super::clients::Record;
use super::{Scenario, Transport, TransportBenchOptions};
use crate::plot::{self, Series};
use crate::stats::percentile;
use crate::BenchError;

/// Percentiles of one metric, milliseconds (nearest rank).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Pcts {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Pcts {
    /// Percentiles of `ms`; `None` when empty.
    pub fn of(ms: &[f64]) -> Option<Self> {
        let mut v = ms.to_vec();
        v.sort_by(f64::total_cmp);
        Some(Self {
            count: v.len(),
            p50: percentile(&v, 50.0)?,
            p95: percentile(&v, 95.0)?,
            p99: percentile(&v, 99.0)?,
            max: *v.last()?,
        })
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One transport in one scenario of one profile.
#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    /// Transport.
    pub transport: Transport,
    /// Scenario.
    pub scenario: Scenario,
    /// Requests planned.
    pub planned: usize,
    /// Requests sent (fewer when the transport was given up after failing from the start).
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// The first failure, to say why.
    pub first_error: Option<String>,
    /// Time to first token of successful requests, ms.
    pub ttft: Option<Pcts>,
    /// Largest inter-token gap per successful request, ms.
    pub max_gap: Option<Pcts>,
    /// Whole-response time of successful requests, ms.
    pub total: Option<Pcts>,
    /// Mean request bytes (HTTP/1.1-equivalent head + body).
    pub request_bytes: u64,
    /// Mean response bytes (HTTP/1.1-equivalent head + body).
    pub response_bytes: u64,
    /// 0-RTT resumptions the server accepted (h3: per connection; tunnel: the edge's counter).
    pub zero_rtt_accepted: Option<u64>,
    /// TCP fallbacks the edge counted during the scenario (tunnel transports).
    pub tcp_fallbacks: Option<u64>,
    /// Requests refused before their first byte and re-sent on the same connection (direct
    /// h3 0-RTT; the edge does the same for the tunnel but does not count it).
    pub retried: usize,
    /// Raw samples of successful requests, ms, in request order (for plots and re-analysis).
    pub ttft_ms: Vec<f64>,
    /// Largest gap per successful request, ms.
    pub max_gap_ms: Vec<f64>,
    /// Total per successful request, ms.
    pub total_ms: Vec<f64>,
    /// Datagram-layer counters of the edge and its gateway over the run (layered tunnels).
    pub layer: Option<LayerCounters>,
}

/// Datagram-layer counters summed over an edge and its gateway (both directions).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LayerCounters {
    /// FEC source packets sent.
    pub source_packets: f64,
    /// Bytes of FEC source packets sent (UDP payload).
    pub source_bytes: f64,
    /// Packets sent outside FEC (bulk, with scope `interactive`).
    pub plain_packets: f64,
    /// FEC repair packets sent.
    pub repair_packets: f64,
    /// Bytes of repair packets sent.
    pub repair_bytes: f64,
    /// Lost packets restored by FEC.
    pub recovered: f64,
    /// Source packets seen missing before recovery.
    pub lost: f64,
    /// Missing source packets FEC could not restore.
    pub residual: f64,
    /// Whole FEC blocks that never arrived (not in `lost` or `residual`).
    pub blocks_missing: f64,
    /// Packets QUIC declared lost.
    pub quic_lost: f64,
}

impl LayerCounters {
    /// The metric names, in field order.
    pub const METRICS: [&'static str; 10] = [
        "tokenway_datagram_source_packets_total",
        "tokenway_datagram_source_bytes_total",
        "tokenway_datagram_plain_packets_total",
        "tokenway_datagram_repair_packets_total",
        "tokenway_datagram_repair_bytes_total",
        "tokenway_datagram_recovered_packets_total",
        "tokenway_datagram_lost_packets_total",
        "tokenway_datagram_residual_loss_total",
        "tokenway_quic_lost_packets_total",
        "tokenway_datagram_blocks_missing_total",
    ];

    /// From values in [`Self::METRICS`] order.
    pub fn from_values(v: [f64; 10]) -> Self {
        Self {
            source_packets: v[0],
            source_bytes: v[1],
            plain_packets: v[2],
            repair_packets: v[3],
            repair_bytes: v[4],
            recovered: v[5],
            lost: v[6],
            residual: v[7],
            quic_lost: v[8],
            blocks_missing: v[9],
        }
    }

    /// The change since `before`.
    pub fn since(&self, before: &Self) -> Self {
        let d = |a: f64, b: f64| (a - b).max(0.0);
        Self {
            source_packets: d(self.source_packets, before.source_packets),
            source_bytes: d(self.source_bytes, before.source_bytes),
            plain_packets: d(self.plain_packets, before.plain_packets),
            repair_packets: d(self.repair_packets, before.repair_packets),
            repair_bytes: d(self.repair_bytes, before.repair_bytes),
            recovered: d(self.recovered, before.recovered),
            lost: d(self.lost, before.lost),
            residual: d(self.residual, before.residual),
            quic_lost: d(self.quic_lost, before.quic_lost),
            blocks_missing: d(self.blocks_missing, before.blocks_missing),
        }
    }
}

impl RunResult {
    /// Summarises the records of one run; `edge` = (0-RTT accepted, TCP fallbacks) deltas.
    pub fn from_records(
        transport: Transport,
        scenario: Scenario,
        planned: usize,
        records: &[Record],
        edge: Option<(u64, u64)>,
    ) -> Self {
        let ok: Vec<&Record> = records.iter().filter(|r| r.error.is_none()).collect();
        let ttft_ms: Vec<f64> = ok.iter().filter_map(|r| r.ttft.map(ms)).collect();
        let max_gap_ms: Vec<f64> = ok.iter().filter_map(|r| r.max_gap.map(ms)).collect();
        let total_ms: Vec<f64> = ok.iter().map(|r| ms(r.total)).collect();
        let mean = |f: fn(&Record) -> u64| {
            if records.is_empty() {
                0
            } else {
                records.iter().map(f).sum::<u64>() / records.len() as u64
            }
        };
        let h3_zero = records
            .iter()
            .any(|r| r.zero_rtt_accepted.is_some())
            .then(|| {
                records
                    .iter()
                    .filter(|r| r.zero_rtt_accepted == Some(true))
                    .count() as u64
            });
        let (edge_zero, fallbacks) = match edge {
            Some((z, f)) => ((scenario == Scenario::First0rtt).then_some(z), Some(f)),
            None => (None, None),
        };
        Self {
            transport,
            scenario,
            planned,
            requests: records.len(),
            errors: records.len() - ok.len(),
            first_error: records.iter().find_map(|r| r.error.clone()),
            ttft: Pcts::of(&ttft_ms),
            max_gap: Pcts::of(&max_gap_ms),
            total: Pcts::of(&total_ms),
            request_bytes: mean(|r| r.request_bytes),
            response_bytes: mean(|r| r.response_bytes),
            zero_rtt_accepted: h3_zero.or(edge_zero),
            tcp_fallbacks: fallbacks,
            retried: records.iter().filter(|r| r.retried).count(),
            ttft_ms,
            max_gap_ms,
            total_ms,
            layer: None,
        }
    }
}

/// A transport that could not be used at all in a profile.
#[derive(Clone, Debug, Serialize)]
pub struct Unavailable {
    /// Transport.
    pub transport: Transport,
    /// Why.
    pub reason: String,
}

/// Everything measured on one profile.
#[derive(Clone, Debug, Serialize)]
pub struct ProfileResult {
    /// Profile name.
    pub profile: String,
    /// What the profile models.
    pub description: String,
    /// Transports that never answered.
    #[serde(serialize_with = "ser_unavailable")]
    pub unavailable: Vec<(Transport, String)>,
    /// Runs, by scenario then transport.
    pub runs: Vec<RunResult>,
    /// What the servers' logs say happened (edge retries and redials).
    pub notes: Vec<String>,
}

fn ser_unavailable<S: serde::Serializer>(
    v: &[(Transport, String)],
    s: S,
) -> Result<S::Ok, S::Error> {
    let list: Vec<Unavailable> = v
        .iter()
        .map(|(t, r)| Unavailable {
            transport: *t,
            reason: r.clone(),
        })
        .collect();
    list.serialize(s)
}

impl ProfileResult {
    pub(crate) fn run(&self, t: Transport, s: Scenario) -> Option<&RunResult> {
        self.runs
            .iter()
            .find(|r| r.transport == t && r.scenario == s)
    }
}

/// The machine.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Logical CPUs.
    pub nproc: usize,
    /// CPU model from /proc/cpuinfo.
    pub cpu: Option<String>,
    /// `uname -r`.
    pub kernel: Option<String>,
    /// `git rev-parse --short HEAD` (with `-dirty` when the work tree has changes).
    pub git_commit: Option<String>,
    /// /proc/loadavg before the run.
    pub loadavg_before: Option<String>,
}

/// The knobs of the run.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    /// Profiles in order.
    pub profiles: Vec<String>,
    /// Transports.
    pub transports: Vec<String>,
    /// Scenarios.
    pub scenarios: Vec<String>,
    /// Requests per transport and scenario.
    pub requests: usize,
    /// Output tokens of a streaming request.
    pub tokens: u32,
    /// The sim's time per output token, ms.
    pub token_ms: f64,
    /// Long prompt size, bytes.
    pub upload_bytes: usize,
    /// Baseline transport of the ratios.
    pub baseline: String,
    /// Link emulator seed.
    pub seed: u64,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct TransportReport {
    /// The machine.
    pub machine: Machine,
    /// The exact command.
    pub command_line: String,
    /// Start of the run (UTC).
    pub timestamp: String,
    /// Knobs.
    pub settings: Settings,
    /// How things were measured.
    pub method: Vec<String>,
    /// Results per profile.
    pub profiles: Vec<ProfileResult>,
    /// Plot files written, relative to the output directory.
    pub plots: Vec<String>,
    #[serde(skip)]
    baseline: Transport,
}

fn command_output(command: &mut Command) -> Option<String> {
    let out = command.output().ok()?;
    if !out.status.success() {
        return None;
    }
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()?
        .trim()
        .to_owned();
    (!line.is_empty()).then_some(line)
}

fn machine() -> Machine {
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .is_some_and(|o| !o.stdout.is_empty());
    Machine {
        nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu: std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).trim().to_owned())
        }),
        kernel: command_output(Command::new("uname").arg("-r")),
        git_commit: command_output(Command::new("git").args(["rev-parse", "--short", "HEAD"]))
            .map(|c| if dirty { format!("{c}-dirty") } else { c }),
        loadavg_before: std::fs::read_to_string("/proc/loadavg")
            .ok()
            .map(|s| s.trim().to_owned()),
    }
}

fn f(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn ratio(v: f64, base: f64) -> String {
    if base > 0.0 {
        format!("{:.2}×", v / base)
    } else {
        "–".into()
    }
}

impl TransportReport {
    /// An empty report for `opts`, started at `timestamp`.
    pub fn new(opts: &TransportBenchOptions, timestamp: String) -> Self {
        Self {
            machine: machine(),
            command_line: opts.command_line.clone(),
            timestamp,
            settings: super::settings(opts),
            method: vec![
                "TTFT: from the start of the request, connection setup included, to the first \
                 body chunk holding an SSE `data:` event."
                    .into(),
                "Largest gap: the longest time between consecutive body chunks holding `data:` \
                 events of one response."
                    .into(),
                "Tunnel fresh / 0-RTT: `POST /admin/reconnect` to the edge (0-RTT off for fresh, \
                 on for 0-RTT), then the request; the clock starts after the reconnect call, \
                 while the edge is already redialling (understates by at most one loopback \
                 HTTP exchange)."
                    .into(),
                "Bytes: HTTP/1.1-equivalent message size (start line, headers, body) of \
                 request and response; no TLS/QUIC/TCP/IP overhead, handshakes or \
                 retransmissions."
                    .into(),
                "Requests run round-robin across transports (request i of each, then i+1), \
                 one at a time, from a single-threaded client in the client namespace."
                    .into(),
                "Mix: a long upload and a short streaming request start together on the same \
                 connection (HTTP/1.1: two pooled connections; tunnel: two local connections \
                 to the edge, one tunnel connection); the short request is reported."
                    .into(),
            ],
            profiles: Vec::new(),
            plots: Vec::new(),
            baseline: opts.baseline,
        }
    }

    /// Writes `results.json`, `results.md` and the plots into `dir`.
    pub fn write(&mut self, dir: &Path) -> Result<(), BenchError> {
        let io = |context: String| move |source| BenchError::Io { context, source };
        let plots_dir = dir.join("plots");
        std::fs::create_dir_all(&plots_dir)
            .map_err(io(format!("cannot create {}", plots_dir.display())))?;
        self.plots.clear();
        for p in &self.profiles {
            for (metric, title, pick) in [
                (
                    "ttft",
                    "TTFT, streaming chat on an existing connection",
                    (|r: &RunResult| r.ttft_ms.clone()) as fn(&RunResult) -> Vec<f64>,
                ),
                (
                    "gap",
                    "largest inter-token gap per request, streaming chat",
                    |r: &RunResult| r.max_gap_ms.clone(),
                ),
            ] {
                let series: Vec<Series> = Transport::ALL
                    .iter()
                    .filter_map(|t| {
                        let run = p.run(*t, Scenario::Stream)?;
                        Some(Series {
                            label: t.name().to_owned(),
                            values: pick(run),
                        })
                    })
                    .collect();
                if series.is_empty() {
                    continue;
                }
                let name = format!("plots/{metric}-cdf-{}.svg", p.profile);
                plot::cdf_svg(
                    &dir.join(&name),
                    &format!("{}: {title}", p.profile),
                    "milliseconds (log scale)",
                    &series,
                )
                .map_err(|message| BenchError::Child {
                    name: "plot".into(),
                    message,
                })?;
                self.plots.push(name);
            }
        }
        let json_path = dir.join("results.json");
        let json = serde_json::to_string_pretty(&*self).expect("the report holds only plain data");
        std::fs::write(&json_path, json + "\n")
            .map_err(io(format!("cannot write {}", json_path.display())))?;
        let md_path = dir.join("results.md");
        std::fs::write(&md_path, self.to_markdown())
            .map_err(io(format!("cannot write {}", md_path.display())))?;
        Ok(())
    }

    fn transports(&self) -> Vec<Transport> {
        Transport::ALL
            .into_iter()
            .filter(|t| {
                self.profiles
                    .iter()
                    .any(|p| p.runs.iter().any(|r| r.transport == *t))
            })
            .collect()
    }

    fn summary_table(&self, out: &mut String, scenario: Scenario, metric: &str) {
        let profiles: Vec<&ProfileResult> = self
            .profiles
            .iter()
            .filter(|p| p.runs.iter().any(|r| r.scenario == scenario))
            .collect();
        if profiles.is_empty() {
            return;
        }
        let base = self.baseline;
        let _ = writeln!(
            out,
            "\n### {} p50, ms: {} (ratio to {} in parentheses)\n",
            metric,
            scenario.description(),
            base.name()
        );
        let _ = write!(out, "| transport |");
        for p in &profiles {
            let _ = write!(out, " {} |", p.profile);
        }
        let _ = write!(out, "\n|---|");
        for _ in &profiles {
            let _ = write!(out, "---:|");
        }
        out.push('\n');
        let pick = |r: &RunResult| match metric {
            "TTFT" => r.ttft.map(|p| p.p50),
            _ => r.max_gap.map(|p| p.p50),
        };
        for t in self.transports() {
            if !scenario.applies_to(t) {
                continue;
            }
            let _ = write!(out, "| {} |", t.name());
            for p in &profiles {
                let cell = match p.run(t, scenario).and_then(pick) {
                    Some(v) => {
                        let b = p.run(base, scenario).and_then(pick);
                        match b {
                            Some(b) if t != base => format!("{} ({})", f(v), ratio(v, b)),
                            _ => f(v),
                        }
                    }
                    None => "failed".into(),
                };
                let _ = write!(out, " {cell} |");
            }
            out.push('\n');
        }
    }

    fn issue3_section(&self, out: &mut String) {
        let Some(p) = self.profiles.iter().find(|p| p.profile == super::LOOPBACK) else {
            return;
        };
        let p50 = |t, s| p.run(t, s).and_then(|r| r.ttft).map(|x| x.p50);
        let _ = writeln!(
            out,
            "\n## Loopback: first request and tunnel overhead\n\n\
             | transport | fresh connection | 0-RTT resumed | existing connection | 0-RTT − existing |\n\
             |---|---:|---:|---:|---:|"
        );
        for t in Transport::ALL {
            let fresh = p50(t, Scenario::First);
            let zero = p50(t, Scenario::First0rtt);
            let reused = p50(t, Scenario::FirstReused);
            if fresh.is_none() && reused.is_none() {
                continue;
            }
            let cell = |v: Option<f64>| v.map_or("–".into(), f);
            let diff = match (zero, reused) {
                (Some(z), Some(r)) => format!("{:+.3}", z - r),
                _ => "–".into(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                t.name(),
                cell(fresh),
                cell(zero),
                cell(reused),
                diff
            );
        }
        out.push_str("\nTTFT p50 in ms (1-token requests).\n");
        let mut lines = Vec::new();
        for s in [Scenario::FirstReused, Scenario::Stream] {
            if let (Some(tunnel), Some(h1)) = (p50(Transport::Tunnel, s), p50(Transport::H1, s)) {
                lines.push(format!(
                    "- added TTFT p50 of the tunnel over HTTP/1.1 direct to the gateway ({}): \
                     {:+.3} ms (target ≤ 0.3 ms)",
                    s.description(),
                    tunnel - h1
                ));
            }
        }
        if !lines.is_empty() {
            out.push('\n');
            out.push_str(&lines.join("\n"));
            out.push('\n');
        }
    }

    /// The Markdown report.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let m = &self.machine;
        let s = &self.settings;
        let _ = writeln!(out, "# tokenway bench transport\n");
        let _ = writeln!(out, "- command: `{}`", self.command_line);
        let _ = writeln!(out, "- started: {}", self.timestamp);
        let _ = writeln!(
            out,
            "- machine: {} CPUs ({}), kernel {}, load average before {}",
            m.nproc,
            m.cpu.as_deref().unwrap_or("unknown CPU"),
            m.kernel.as_deref().unwrap_or("unknown"),
            m.loadavg_before.as_deref().unwrap_or("unknown")
        );
        let _ = writeln!(
            out,
            "- commit: {}",
            m.git_commit.as_deref().unwrap_or("unknown")
        );
        let _ = writeln!(
            out,
            "- {} requests per transport and scenario; streaming chat of {} tokens at {} ms; \
             upload {} bytes; baseline {}; netlab seed {}",
            s.requests, s.tokens, s.token_ms, s.upload_bytes, s.baseline, s.seed
        );
        out.push_str("\nMethod:\n\n");
        for line in &self.method {
            let _ = writeln!(out, "- {line}");
        }
        out.push_str("\n## Summary\n");
        for (scenario, metric) in [
            (Scenario::Stream, "TTFT"),
            (Scenario::First, "TTFT"),
            (Scenario::First0rtt, "TTFT"),
            (Scenario::Mix, "TTFT"),
            (Scenario::Stream, "largest gap"),
        ] {
            self.summary_table(&mut out, scenario, metric);
        }
        self.issue3_section(&mut out);
        super::datagram::section(self, &mut out);
        for p in &self.profiles {
            let _ = writeln!(out, "\n## Profile `{}`: {}\n", p.profile, p.description);
            for (t, reason) in &p.unavailable {
                let _ = writeln!(out, "- **{}** unavailable: {reason}", t.name());
            }
            for note in &p.notes {
                let _ = writeln!(out, "- {note}");
            }
            if !p.unavailable.is_empty() || !p.notes.is_empty() {
                out.push('\n');
            }
            let _ = writeln!(
                out,
                "| transport | scenario | ok/sent | TTFT p50 | p95 | p99 | × {} p50 | largest gap p50 | gap p99 | total p50 | req B | resp B | notes |\n\
                 |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
                self.baseline.name()
            );
            for r in &p.runs {
                let base = p
                    .run(self.baseline, r.scenario)
                    .and_then(|b| b.ttft)
                    .map(|b| b.p50);
                let ttft = r.ttft;
                let cell = |v: Option<f64>| v.map_or("–".into(), f);
                let mut notes = Vec::new();
                if let Some(z) = r.zero_rtt_accepted {
                    notes.push(format!("0-RTT accepted {z}"));
                }
                if let Some(fb) = r.tcp_fallbacks.filter(|n| *n > 0) {
                    notes.push(format!("TCP fallbacks {fb}"));
                }
                if r.retried > 0 {
                    notes.push(format!("re-sent after refusal {}", r.retried));
                }
                if r.requests < r.planned {
                    notes.push(format!("given up after {} failures", r.requests));
                }
                if let Some(e) = &r.first_error {
                    let e: String = e.chars().take(80).collect();
                    notes.push(format!("first error: {}", e.replace('|', "/")));
                }
                let _ = writeln!(
                    out,
                    "| {} | {} | {}/{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    r.transport.name(),
                    r.scenario.name(),
                    r.requests - r.errors,
                    r.requests,
                    cell(ttft.map(|x| x.p50)),
                    cell(ttft.map(|x| x.p95)),
                    cell(ttft.map(|x| x.p99)),
                    match (ttft, base) {
                        (Some(t), Some(b)) => ratio(t.p50, b),
                        _ => "–".into(),
                    },
                    cell(r.max_gap.map(|x| x.p50)),
                    cell(r.max_gap.map(|x| x.p99)),
                    cell(r.total.map(|x| x.p50)),
                    r.request_bytes,
                    r.response_bytes,
                    notes.join("; ")
                );
            }
            for plot in self
                .plots
                .iter()
                .filter(|n| n.ends_with(&format!("-cdf-{}.svg", p.profile)))
            {
                let _ = writeln!(out, "\n![{plot}]({plot})");
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(ttft_ms: u64, error: bool) -> Record {
        Record {
            ttft: Some(Duration::from_millis(ttft_ms)),
            max_gap: Some(Duration::from_millis(20)),
            total: Duration::from_millis(ttft_ms + 600),
            request_bytes: 300,
            response_bytes: 5000,
            error: error.then(|| "boom".to_owned()),
            zero_rtt_accepted: None,
            retried: false,
        }
    }

    #[test]
    fn run_summary_counts_errors_and_ignores_their_timings() {
        let r = RunResult::from_records(
            Transport::H3,
            Scenario::Stream,
            3,
            &[record(10, false), record(30, false), record(1000, true)],
            None,
        );
        assert_eq!((r.requests, r.errors), (3, 1));
        assert_eq!(r.ttft.map(|p| p.max), Some(30.0));
        assert_eq!(r.first_error.as_deref(), Some("boom"));
        assert_eq!(r.ttft_ms, vec![10.0, 30.0]);
        assert_eq!(r.zero_rtt_accepted, None);
    }

    #[test]
    fn percentiles_of_nothing_are_none() {
        assert_eq!(Pcts::of(&[]), None);
        let p = Pcts::of(&[3.0, 1.0, 2.0]).expect("three samples");
        assert_eq!((p.p50, p.p99, p.max), (2.0, 3.0, 3.0));
    }
}
