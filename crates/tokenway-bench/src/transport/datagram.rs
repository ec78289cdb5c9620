//! Issue 5's targets for the datagram layer, judged from a transport report: PASS or FAIL per
//! target, for whatever part of the workload the run contained.
//!
//! - `lossy` streaming chat: `tunnel-fec` p99 TTFT ≤ 1.25 × its own p99 on `lossy-noloss`
//!   (the same 100 ms RTT without loss) and ≤ 0.5 × `h1` on `lossy`; p99 of the largest
//!   inter-token gap ≤ token interval + 0.5 RTT.
//! - `4g` streaming chat: `tunnel-fec` p99 TTFT and p99 largest gap ≤ 0.6 × `h3`.
//! - FEC overhead: repair bytes ≤ 30 % of the streaming workload's bytes (on `lossy`), ≤ 5 % of
//!   a bulk upload's (the `upload` scenario, any profile).
//! - Obfuscation + FEC cost ≤ 10 % of tunnel throughput on loopback (the `upload` scenario:
//!   `tunnel-fec-obfs` against `tunnel`).

use std::fmt::Write;

use super::report::{ProfileResult, RunResult, TransportReport};
use super::{Scenario, Transport};

/// `lossy`'s round-trip time, ms.
const LOSSY_RTT_MS: f64 = 100.0;

struct Verdicts(Vec<(String, String, bool)>);

impl Verdicts {
    fn add(&mut self, target: String, measured: String, pass: bool) {
        self.0.push((target, measured, pass));
    }
}

fn profile<'a>(r: &'a TransportReport, name: &str) -> Option<&'a ProfileResult> {
    r.profiles.iter().find(|p| p.profile == name)
}

fn stream(p: Option<&ProfileResult>, t: Transport) -> Option<&RunResult> {
    p?.run(t, Scenario::Stream)
}

fn ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0} ms")
    } else {
        format!("{v:.1} ms")
    }
}

/// Appends the "Issue 5 targets" section (nothing if the run had no layered tunnel).
pub fn section(r: &TransportReport, out: &mut String) {
    let mut v = Verdicts(Vec::new());
    let fec = Transport::TunnelFec;
    let lossy = profile(r, "lossy");
    let noloss = profile(r, super::LOSSY_NOLOSS);
    let token_ms = r.settings.token_ms;
    if let Some(on) = stream(lossy, fec).and_then(|x| x.ttft) {
        if let Some(clean) = stream(noloss, fec).and_then(|x| x.ttft) {
            v.add(
                "lossy: tunnel-fec TTFT p99 ≤ 1.25 × its p99 without loss".into(),
                format!(
                    "{} vs {} ({:.2}×)",
                    ms(on.p99),
                    ms(clean.p99),
                    on.p99 / clean.p99
                ),
                on.p99 <= 1.25 * clean.p99,
            );
        }
        if let Some(h1) = stream(lossy, Transport::H1).and_then(|x| x.ttft) {
            v.add(
                "lossy: tunnel-fec TTFT p99 ≤ 0.5 × h1".into(),
                format!("{} vs {} ({:.2}×)", ms(on.p99), ms(h1.p99), on.p99 / h1.p99),
                on.p99 <= 0.5 * h1.p99,
            );
        }
    }
    if let Some(gap) = stream(lossy, fec).and_then(|x| x.max_gap) {
        let limit = token_ms + 0.5 * LOSSY_RTT_MS;
        v.add(
            format!("lossy: tunnel-fec largest-gap p99 ≤ {token_ms} ms + 0.5 RTT = {limit} ms"),
            ms(gap.p99),
            gap.p99 <= limit,
        );
    }
    let g4 = profile(r, "4g");
    for (what, pick) in [
        ("TTFT", (|x: &RunResult| x.ttft) as fn(&RunResult) -> _),
        ("largest gap", |x: &RunResult| x.max_gap),
    ] {
        let a = stream(g4, fec).and_then(pick);
        let b = stream(g4, Transport::H3).and_then(pick);
        if let (Some(a), Some(b)) = (a, b) {
            v.add(
                format!("4g: tunnel-fec {what} p99 ≤ 0.6 × h3"),
                format!("{} vs {} ({:.2}×)", ms(a.p99), ms(b.p99), a.p99 / b.p99),
                a.p99 <= 0.6 * b.p99,
            );
        }
    }
    if let Some(c) = stream(lossy, fec).and_then(|x| x.layer) {
        let total = c.source_bytes + c.repair_bytes;
        if total > 0.0 {
            let share = c.repair_bytes / total;
            v.add(
                "FEC repair bytes ≤ 30 % of the streaming workload's bytes (lossy)".into(),
                format!(
                    "{:.1} % ({:.0} repair of {:.0} bytes; {:.0} packets outside FEC; {:.0} \
                     recovered, {:.0} residual, {:.0} whole blocks missing, QUIC lost {:.0})",
                    100.0 * share,
                    c.repair_bytes,
                    total,
                    c.plain_packets,
                    c.recovered,
                    c.residual,
                    c.blocks_missing,
                    c.quic_lost
                ),
                share <= 0.30,
            );
        }
    }
    for p in &r.profiles {
        let Some(up) = p.run(fec, Scenario::Upload) else {
            continue;
        };
        let Some(c) = up.layer else { continue };
        let http = ((up.request_bytes + up.response_bytes) * up.requests as u64) as f64;
        if http > 0.0 {
            let share = c.repair_bytes / (http + c.repair_bytes);
            v.add(
                format!(
                    "FEC repair bytes ≤ 5 % of a bulk upload ({}, {} B each)",
                    p.profile, up.request_bytes
                ),
                format!(
                    "{:.2} % ({:.0} repair bytes, {:.0} source, {:.0} packets outside FEC)",
                    100.0 * share,
                    c.repair_bytes,
                    c.source_bytes,
                    c.plain_packets
                ),
                share <= 0.05,
            );
        }
    }
    if let Some(lo) = profile(r, super::LOOPBACK) {
        let tput = |t: Transport| {
            let run = lo.run(t, Scenario::Upload)?;
            let total = run.total?;
            Some(run.request_bytes as f64 * 8.0 / (total.p50 / 1e3) / 1e6)
        };
        if let (Some(plain), Some(obfs)) = (tput(Transport::Tunnel), tput(Transport::TunnelFecObfs))
        {
            let cost = 1.0 - obfs / plain;
            let fec_only =
                tput(fec).map_or(String::new(), |f| format!("; FEC alone {f:.0} Mbit/s"));
            v.add(
                "loopback: obfuscation + FEC cost ≤ 10 % of tunnel throughput".into(),
                format!(
                    "{:.1} % ({obfs:.0} vs {plain:.0} Mbit/s, upload p50{fec_only})",
                    100.0 * cost
                ),
                cost <= 0.10,
            );
        }
    }
    if v.0.is_empty() {
        return;
    }
    out.push_str(
        "\n## Issue 5 targets (datagram layer)\n\n| target | measured | result |\n|---|---|---|\n",
    );
    for (target, measured, pass) in &v.0 {
        let _ = writeln!(
            out,
            "| {target} | {measured} | {} |",
            if *pass { "PASS" } else { "**FAIL**" }
        );
    }
}
