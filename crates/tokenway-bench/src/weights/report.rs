//! Results of `tokenway bench weights`: what was measured, the verdicts against the issue's
//! targets, and their renderings (`results.json`, `results.md`).
//!
//! Times are wall clock from starting a process to its end (or, for a puller that keeps
//! serving peers, to its `pull summary:` line), so they include process start, RTT probes,
//! the manifest, the final whole-file hash and the fsync: what a node waiting for its weights
//! sees. Throughput is bytes over that time in MiB/s (2^20 bytes per second).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::BenchError;

/// Origin egress for the eight pullers, as a multiple of the model size.
pub const TARGET_ORIGIN_FACTOR: f64 = 1.05;
/// The slowest of the eight pullers, as a multiple of one puller alone.
pub const TARGET_CROWD_FACTOR: f64 = 2.0;
/// One pull's throughput (verification included) as a fraction of curl's.
pub const TARGET_CURL_FRACTION: f64 = 0.80;

/// The machine and the run.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Logical CPUs.
    pub nproc: usize,
    /// `uname -r`.
    pub kernel: Option<String>,
    /// `git rev-parse --short HEAD` of the working directory.
    pub git_commit: Option<String>,
    /// `/proc/loadavg` before the run: other work on the machine skews every number.
    pub loadavg_before: Option<String>,
    /// `/proc/loadavg` after the run.
    pub loadavg_after: Option<String>,
    /// `curl --version`, first line.
    pub curl_version: Option<String>,
    /// `aria2c --version`, first line; `None` when not installed.
    pub aria2c_version: Option<String>,
}

/// The knobs of the run.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    /// Bytes of the model (every file).
    pub model_bytes: u64,
    /// Files in the model.
    pub files: usize,
    /// The largest file (the blob curl and aria2c fetch), bytes.
    pub largest_file_bytes: u64,
    /// Piece size of the published manifest, bytes.
    pub piece_size: u64,
    /// Pullers started at once in the crowd scenario.
    pub pullers: usize,
    /// `tokenway pull --parallel`.
    pub parallel: usize,
    /// Seed of the generated model.
    pub seed: u64,
    /// Where the model, the origin and the scratch data live.
    pub data_dir: PathBuf,
    /// Where the pullers write: `disk` (under the output directory, this machine's one
    /// disk) or `tmpfs` (one tmpfs per puller, in RAM, standing in for a disk per node).
    pub puller_storage: String,
    /// `tokenway mirror --limit-rate`: the mirror's uplink cap, bytes per second (none: the
    /// loopback's speed).
    pub mirror_limit_rate: Option<u64>,
    /// Piece order of the crowd's pulls: `spread` (each starts at a random piece, the
    /// default with `--serve`) or `sequential` (`tokenway pull --sequential`).
    pub crowd_piece_order: String,
}

/// One `tokenway pull` process.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PullRun {
    /// Wall clock from start to done, seconds.
    pub wall_secs: f64,
    /// `seconds=` of its summary line (from its start, without process start-up).
    pub summary_secs: f64,
    /// Model bytes over wall time, MiB/s.
    pub mib_per_sec: f64,
    /// Verified bytes from mirrors.
    pub bytes_from_mirrors: u64,
    /// Verified bytes from peers.
    pub bytes_from_peers: u64,
    /// Verified bytes from the origin.
    pub bytes_from_origin: u64,
    /// Pieces hedged to a second source.
    pub pieces_hedged: u64,
    /// CPU time (user + system) of the process, seconds.
    pub cpu_secs: Option<f64>,
    /// Bytes it caused to be written to block storage (`write_bytes` of `/proc/PID/io` at
    /// the last look while it ran; writes to a tmpfs count nothing).
    pub disk_write_bytes: Option<u64>,
}

/// A plain HTTP download of the largest blob from the warm mirror.
#[derive(Clone, Debug, Serialize)]
pub struct FetchRun {
    /// `curl` or `aria2c -x8`.
    pub tool: String,
    /// Bytes received.
    pub bytes: u64,
    /// Wall clock of the process, seconds.
    pub wall_secs: f64,
    /// Bytes over wall time, MiB/s.
    pub mib_per_sec: f64,
}

/// What the mirror's `/metrics` said after a scenario.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct MirrorCounters {
    /// `tokenway_mirror_bytes_from_origin_total`.
    pub bytes_from_origin: u64,
    /// `tokenway_mirror_bytes_served_total`.
    pub bytes_served: u64,
    /// `tokenway_mirror_bytes_from_peers_total` (what pullers reported).
    pub bytes_from_peers: u64,
    /// `tokenway_mirror_single_flight_joins_total`.
    pub single_flight_joins: u64,
    /// CPU time of the mirror process during the scenario, seconds.
    pub cpu_secs: Option<f64>,
    /// Bytes the mirror wrote to block storage during the scenario (its piece cache).
    pub disk_write_bytes: Option<u64>,
}

/// Several pullers at once through one cold mirror, sharing as peers.
#[derive(Clone, Debug, Serialize)]
pub struct CrowdRun {
    /// Each puller, in start order.
    pub pulls: Vec<PullRun>,
    /// From starting the first to the last one done, seconds.
    pub wall_secs: f64,
    /// The mirror's counters.
    pub mirror: MirrorCounters,
}

/// One target of the issue, checked.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    /// The target, in words.
    pub target: String,
    /// What was measured.
    pub measured: String,
    /// `Some(true)` pass, `Some(false)` fail, `None` not measured or no threshold.
    pub pass: Option<bool>,
}

impl Verdict {
    fn word(&self) -> &'static str {
        match self.pass {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "—",
        }
    }
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct WeightsBenchReport {
    /// The machine.
    pub machine: Machine,
    /// The exact command line.
    pub command_line: String,
    /// When the run started, RFC 3339 UTC.
    pub timestamp: String,
    /// The knobs.
    pub settings: Settings,
    /// Seconds spent generating the model in this run (0 when reused).
    pub generate_secs: f64,
    /// Seconds `tokenway publish` took in this run (0 when reused).
    pub publish_secs: f64,
    /// One puller alone through a cold mirror.
    pub alone: PullRun,
    /// The cold mirror's counters after the lone pull.
    pub alone_mirror: MirrorCounters,
    /// One puller through the same mirror, now warm.
    pub warm: PullRun,
    /// curl fetching the largest blob from the warm mirror.
    pub curl: Option<FetchRun>,
    /// The same curl download with an fsync before the clock stops (the pull syncs every
    /// file; this is the like-for-like durability).
    pub curl_fsync: Option<FetchRun>,
    /// aria2c -x8 fetching it; `None` when not installed.
    pub aria2c: Option<FetchRun>,
    /// The pullers at once through a fresh cold mirror.
    pub crowd: CrowdRun,
    /// Things not run, and why.
    pub notes: Vec<String>,
    /// Targets of the issue, checked.
    pub verdicts: Vec<Verdict>,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

impl WeightsBenchReport {
    /// The slowest puller of the crowd, seconds.
    pub fn slowest(&self) -> Option<f64> {
        self.crowd
            .pulls
            .iter()
            .map(|p| p.wall_secs)
            .max_by(f64::total_cmp)
    }

    /// Checks the targets against what was measured.
    pub fn compute_verdicts(&self) -> Vec<Verdict> {
        let size = self.settings.model_bytes as f64;
        let mut v = Vec::new();
        let egress = self.crowd.mirror.bytes_from_origin as f64 / size;
        v.push(Verdict {
            target: format!(
                "origin egress <= {TARGET_ORIGIN_FACTOR} x model size ({} pullers, cold mirror)",
                self.settings.pullers
            ),
            measured: format!(
                "{egress:.3}x ({} of {} bytes)",
                self.crowd.mirror.bytes_from_origin, self.settings.model_bytes
            ),
            pass: Some(egress <= TARGET_ORIGIN_FACTOR),
        });
        let factor = self
            .slowest()
            .filter(|_| self.alone.wall_secs > 0.0)
            .map(|s| s / self.alone.wall_secs);
        v.push(Verdict {
            target: format!(
                "all {} done in <= {TARGET_CROWD_FACTOR} x the time of one alone{}",
                self.settings.pullers,
                if self.settings.puller_storage == "tmpfs" {
                    " (pullers write to one tmpfs each, not to the disk)"
                } else {
                    ""
                }
            ),
            measured: match (self.slowest(), factor) {
                (Some(s), Some(f)) => format!(
                    "slowest {s:.2} s = {f:.2}x of {:.2} s alone",
                    self.alone.wall_secs
                ),
                _ => "not measured".to_owned(),
            },
            pass: factor.map(|f| f <= TARGET_CROWD_FACTOR),
        });
        let curl_frac = self
            .curl
            .as_ref()
            .filter(|c| c.mib_per_sec > 0.0)
            .map(|c| self.warm.mib_per_sec / c.mib_per_sec);
        v.push(Verdict {
            target: format!(
                "one pull (warm mirror, verified) >= {:.0}% of curl's throughput",
                TARGET_CURL_FRACTION * 100.0
            ),
            measured: match (&self.curl, curl_frac) {
                (Some(c), Some(f)) => format!(
                    "pull {:.0} MiB/s = {:.0}% of curl {:.0} MiB/s",
                    self.warm.mib_per_sec,
                    f * 100.0,
                    c.mib_per_sec
                ),
                _ => "curl not measured".to_owned(),
            },
            pass: curl_frac.map(|f| f >= TARGET_CURL_FRACTION),
        });
        if let Some(c) = self.curl_fsync.as_ref().filter(|c| c.mib_per_sec > 0.0) {
            v.push(Verdict {
                target: "one pull compared with curl + fsync (same durability; no threshold)"
                    .to_owned(),
                measured: format!(
                    "pull {:.0} MiB/s = {:.0}% of curl + fsync {:.0} MiB/s",
                    self.warm.mib_per_sec,
                    self.warm.mib_per_sec / c.mib_per_sec * 100.0,
                    c.mib_per_sec
                ),
                pass: None,
            });
        }
        v.push(Verdict {
            target: "one pull compared with aria2c -x8 (no threshold)".to_owned(),
            measured: match &self.aria2c {
                Some(a) if a.mib_per_sec > 0.0 => format!(
                    "pull {:.0} MiB/s = {:.0}% of aria2c -x8 {:.0} MiB/s",
                    self.warm.mib_per_sec,
                    self.warm.mib_per_sec / a.mib_per_sec * 100.0,
                    a.mib_per_sec
                ),
                Some(_) => "aria2c measured no throughput".to_owned(),
                None => "aria2c not installed".to_owned(),
            },
            pass: None,
        });
        v
    }

    /// The Markdown report (also printed to stdout).
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let st = &self.settings;
        let _ = writeln!(s, "## tokenway bench weights\n");
        let _ = writeln!(s, "- command: `{}`", self.command_line);
        let _ = writeln!(
            s,
            "- machine: {} CPUs, kernel {}, commit {}; {}; {}",
            m.nproc,
            m.kernel.as_deref().unwrap_or("unknown"),
            m.git_commit.as_deref().unwrap_or("unknown"),
            m.curl_version.as_deref().unwrap_or("curl not found"),
            m.aria2c_version
                .as_deref()
                .unwrap_or("aria2c not installed")
        );
        let _ = writeln!(
            s,
            "- when: {}; load average before: {}; after: {}",
            self.timestamp,
            m.loadavg_before.as_deref().unwrap_or("unknown"),
            m.loadavg_after.as_deref().unwrap_or("unknown")
        );
        let _ = writeln!(
            s,
            "- model: {} bytes ({:.0} MiB) in {} files, largest {} bytes; pieces of {} KiB; \
             pull --parallel {}; seed {}; generated in {:.1} s, published in {:.1} s \
             (0 = reused)",
            st.model_bytes,
            mib(st.model_bytes),
            st.files,
            st.largest_file_bytes,
            st.piece_size / 1024,
            st.parallel,
            st.seed,
            self.generate_secs,
            self.publish_secs
        );
        let _ = writeln!(
            s,
            "- everything on loopback on this one machine: origin (file://), mirror, pullers, \
             curl and aria2c share its CPUs and its disk{}\n",
            if st.puller_storage == "tmpfs" {
                "; **except that every pull (alone, warm and in the crowd) writes to a tmpfs of \
                 its own** (`--tmpfs-per-puller`: RAM standing in for a disk per node; the \
                 mirror's cache stays on the disk)"
            } else {
                " (every pull writes to this disk)"
            }
        );
        let _ = writeln!(
            s,
            "- mirror uplink: {}; crowd piece order: {}\n",
            st.mirror_limit_rate
                .map_or("no cap".to_owned(), |r| format!(
                    "capped at {:.0} MiB/s (`mirror --limit-rate`)",
                    r as f64 / (1 << 20) as f64
                )),
            st.crowd_piece_order
        );

        let _ = writeln!(
            s,
            "| run | wall | MiB/s | from mirror | from peers | hedged | CPU |\n|---|---|---|---|---|---|---|"
        );
        let cpu = |c: Option<f64>| c.map_or("—".to_owned(), |c| format!("{c:.1} s"));
        let row = |s: &mut String, label: &str, p: &PullRun| {
            let _ = writeln!(
                s,
                "| {label} | {:.2} s | {:.0} | {:.0} MiB | {:.0} MiB | {} | {} |",
                p.wall_secs,
                p.mib_per_sec,
                mib(p.bytes_from_mirrors),
                mib(p.bytes_from_peers),
                p.pieces_hedged,
                cpu(p.cpu_secs)
            );
        };
        row(&mut s, "one pull alone, cold mirror", &self.alone);
        row(&mut s, "one pull alone, warm mirror", &self.warm);
        for (i, p) in self.crowd.pulls.iter().enumerate() {
            row(
                &mut s,
                &format!(
                    "puller {} of {}, cold mirror",
                    i + 1,
                    self.crowd.pulls.len()
                ),
                p,
            );
        }
        for f in self.curl.iter().chain(&self.curl_fsync).chain(&self.aria2c) {
            let _ = writeln!(
                s,
                "| {} (largest blob, warm mirror) | {:.2} s | {:.0} | {:.0} MiB | — | — | — |",
                f.tool,
                f.wall_secs,
                f.mib_per_sec,
                mib(f.bytes)
            );
        }

        let _ = writeln!(
            s,
            "\n| mirror | from origin | served | pullers report from peers | single-flight joins | mirror CPU |\n|---|---|---|---|---|---|"
        );
        let size = st.model_bytes as f64;
        for (label, c) in [
            ("one pull alone (cold)", &self.alone_mirror),
            (
                &*format!("{} pullers at once (cold)", st.pullers),
                &self.crowd.mirror,
            ),
        ] {
            let _ = writeln!(
                s,
                "| {label} | {:.3}x | {:.2}x | {:.2}x | {} | {} |",
                c.bytes_from_origin as f64 / size,
                c.bytes_served as f64 / size,
                c.bytes_from_peers as f64 / size,
                c.single_flight_joins,
                cpu(c.cpu_secs)
            );
        }
        let _ = writeln!(
            s,
            "\nMultiples are of the model size. The {} pullers all finished within {:.2} s of \
             the first start.",
            st.pullers, self.crowd.wall_secs
        );

        // What the machine itself allows: every process here shares its CPUs.
        let cpu_sum = |pulls: &mut dyn Iterator<Item = &PullRun>, mirror: &MirrorCounters| {
            let mut total = mirror.cpu_secs?;
            for p in pulls {
                total += p.cpu_secs?;
            }
            Some(total)
        };
        let alone_cpu = cpu_sum(&mut std::iter::once(&self.alone), &self.alone_mirror);
        let crowd_cpu = cpu_sum(&mut self.crowd.pulls.iter(), &self.crowd.mirror);
        if let (Some(a), Some(c)) = (alone_cpu, crowd_cpu) {
            let n = m.nproc.max(1) as f64;
            let _ = writeln!(
                s,
                "CPU time of pullers plus mirror: {a:.1} s for the lone pull, {c:.1} s for the \
                 {} pullers ({:.1}x); on {} CPUs the crowd cannot finish in less than \
                 {:.1} s, the lone pull in less than {:.1} s, whatever the network.",
                st.pullers,
                c / a.max(f64::MIN_POSITIVE),
                m.nproc,
                c / n,
                a / n
            );
        }

        // What the disk allows: every process here writes to the same one.
        let written = |pulls: &mut dyn Iterator<Item = &PullRun>, mirror: &MirrorCounters| {
            let mut total = mirror.disk_write_bytes?;
            for p in pulls {
                total += p.disk_write_bytes?;
            }
            Some(total)
        };
        let alone_w = written(&mut std::iter::once(&self.alone), &self.alone_mirror);
        let crowd_w = written(&mut self.crowd.pulls.iter(), &self.crowd.mirror);
        if let (Some(a), Some(c)) = (alone_w, crowd_w) {
            let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
            let _ = writeln!(
                s,
                "\nBytes written to block storage by pullers plus mirror (`write_bytes` of \
                 `/proc/PID/io`): {:.2} GiB for the lone pull, {:.2} GiB for the {} pullers \
                 ({:.1}x).{}",
                gib(a),
                gib(c),
                st.pullers,
                c as f64 / a.max(1) as f64,
                if st.puller_storage == "tmpfs" {
                    " The pullers wrote to tmpfs, which counts nothing here: this is the \
                     mirror's cache."
                } else {
                    " They share one disk: when it is the limit, the crowd takes at least that \
                     multiple of the lone pull's time."
                }
            );
        }

        if !self.notes.is_empty() {
            let _ = writeln!(s, "\n### Notes\n");
            for n in &self.notes {
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

    /// Writes `results.json` and `results.md` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), BenchError> {
        let io = |context: String| move |source| BenchError::Io { context, source };
        std::fs::create_dir_all(dir).map_err(io(format!("cannot create {}", dir.display())))?;
        let json_path = dir.join("results.json");
        let json = serde_json::to_string_pretty(self).expect("the report holds only plain data");
        std::fs::write(&json_path, json + "\n")
            .map_err(io(format!("cannot write {}", json_path.display())))?;
        let md_path = dir.join("results.md");
        std::fs::write(&md_path, self.to_markdown())
            .map_err(io(format!("cannot write {}", md_path.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pull(wall: f64) -> PullRun {
        PullRun {
            wall_secs: wall,
            mib_per_sec: 1024.0 / wall,
            ..PullRun::default()
        }
    }

    fn report(origin: u64, slowest: f64, pull_mibs: f64, curl_mibs: f64) -> WeightsBenchReport {
        let size = 1u64 << 30;
        let mut warm = pull(1.0);
        warm.mib_per_sec = pull_mibs;
        let mut r = WeightsBenchReport {
            machine: Machine {
                nproc: 2,
                kernel: None,
                git_commit: Some("abc1234".into()),
                loadavg_before: None,
                loadavg_after: None,
                curl_version: Some("curl 8".into()),
                aria2c_version: None,
            },
            command_line: "tokenway bench weights --quick".into(),
            timestamp: "2024-01-01T00:00:00Z".into(),
            settings: Settings {
                model_bytes: size,
                files: 4,
                largest_file_bytes: size / 2,
                piece_size: 4 << 20,
                pullers: 8,
                parallel: 8,
                seed: 1,
                data_dir: PathBuf::from("/tmp/x"),
                puller_storage: "disk".into(),
                mirror_limit_rate: None,
                crowd_piece_order: "spread".into(),
            },
            generate_secs: 0.0,
            publish_secs: 0.0,
            alone: pull(10.0),
            alone_mirror: MirrorCounters::default(),
            warm,
            curl: Some(FetchRun {
                tool: "curl".into(),
                bytes: size / 2,
                wall_secs: 1.0,
                mib_per_sec: curl_mibs,
            }),
            curl_fsync: None,
            aria2c: None,
            crowd: CrowdRun {
                pulls: vec![pull(12.0), pull(slowest)],
                wall_secs: slowest,
                mirror: MirrorCounters {
                    bytes_from_origin: origin,
                    ..MirrorCounters::default()
                },
            },
            notes: vec![],
            verdicts: vec![],
        };
        r.verdicts = r.compute_verdicts();
        r
    }

    #[test]
    fn one_copy_from_the_origin_a_fast_crowd_and_a_fast_pull_pass() {
        let r = report(1 << 30, 19.0, 900.0, 1000.0);
        let passes: Vec<_> = r.verdicts.iter().map(|v| v.pass).collect();
        assert_eq!(passes, vec![Some(true), Some(true), Some(true), None]);
        let md = r.to_markdown();
        assert!(md.contains("aria2c not installed"), "{md}");
        assert!(
            md.contains("| puller 2 of 2, cold mirror | 19.00 s |"),
            "{md}"
        );
    }

    #[test]
    fn two_copies_a_slow_crowd_and_a_slow_pull_fail() {
        let r = report(2 << 30, 21.0, 700.0, 1000.0);
        let passes: Vec<_> = r.verdicts.iter().map(|v| v.pass).collect();
        assert_eq!(passes, vec![Some(false), Some(false), Some(false), None]);
        assert!(r.to_markdown().contains("| FAIL |"));
        assert!(
            r.verdicts[1].measured.contains("2.10x"),
            "{:?}",
            r.verdicts[1]
        );
    }
}
