//! `tokenway bench weights`: a generated model published to a `file://` origin, one
//! `tokenway mirror`, and `tokenway pull` processes through it, all on loopback.
//!
//! Scenarios, in this order:
//!
//! 1. one pull alone through a cold mirror (the baseline time);
//! 2. one pull through the same mirror, now warm, then `curl` (and `aria2c -x8` when it is
//!    installed) fetching the largest blob from it: the pull's throughput, verification and
//!    fsync included, against plain HTTP downloads of the same bytes;
//! 3. N pullers (default 8) started at once through a fresh cold mirror, sharing as peers
//!    (`--serve`): origin egress from the mirror's `/metrics`, and each puller's time against
//!    the lone one's.
//!
//! The model is generated once under `--out` ([`model`]) and published once; both are reused
//! by later runs with the same size and seed. Caches and pulled copies live under
//! `<out>/work` and are deleted at the end. Everything shares one machine, so the crowd's
//! times measure the machine's CPUs and disk as much as the mirror; the report says so.
//!
//! On one machine the crowd writes eight copies of the model to one disk, which a cluster
//! (a disk per node) never does. `--tmpfs-per-puller` mounts a tmpfs for each pull (the
//! lone ones too, so the comparison stays like for like) to take that disk out of the
//! picture; the CPUs are still shared. It needs root and RAM for every puller's copy, is
//! refused with a message when `MemAvailable` is short, and is labelled in the report.

pub mod model;
pub mod report;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::plot::{self, Series};
use crate::process::ChildProcess;
use crate::BenchError;
use model::GeneratedModel;
use report::{CrowdRun, FetchRun, Machine, MirrorCounters, PullRun, Settings, WeightsBenchReport};

/// Model name in the origin.
const MODEL: &str = "bench/weights";
/// Region of the mirror and the pullers.
const REGION: &str = "bench";
/// How long a mirror may take to print its address.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);
/// How often a running puller's log is looked at.
const POLL: Duration = Duration::from_millis(10);

/// What to run.
#[derive(Clone, Debug)]
pub struct WeightsBenchOptions {
    /// The `tokenway` executable whose `publish`, `mirror` and `pull` are measured.
    pub exe: PathBuf,
    /// Results, logs, the generated model and scratch data.
    pub out_dir: PathBuf,
    /// About this many bytes of model.
    pub size: u64,
    /// Pullers at once in the crowd scenario.
    pub pullers: usize,
    /// `tokenway pull --parallel`.
    pub parallel: usize,
    /// `tokenway publish --piece-size-kib`.
    pub piece_size_kib: u64,
    /// Seed of the generated model.
    pub seed: u64,
    /// Keep `<out>/work` (mirror caches, pulled copies) after the run.
    pub keep_work: bool,
    /// Each pull writes to a tmpfs of its own instead of the disk (see the module docs).
    pub tmpfs_per_puller: bool,
    /// `tokenway mirror --limit-rate` for every mirror of the run, bytes per second.
    pub mirror_limit_rate: Option<u64>,
    /// The crowd's pulls fetch in file order (`tokenway pull --sequential`).
    pub sequential: bool,
    /// The command line, for the report.
    pub command_line: String,
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> BenchError {
    move |source| BenchError::Io { context, source }
}

fn progress(msg: &str) {
    eprintln!("[bench weights] {msg}");
}

/// Runs the benchmark, writes `results.json`, `results.md` and `plots/` into `out_dir`, and
/// returns the report.
pub async fn run(opts: &WeightsBenchOptions) -> Result<WeightsBenchReport, BenchError> {
    let timestamp = crate::report::rfc3339(SystemTime::now());
    let loadavg_before = loadavg();
    let data = opts.out_dir.join("data");
    let work = opts.out_dir.join("work");
    let logs = opts.out_dir.join("logs");
    let _ = std::fs::remove_dir_all(&work);
    for d in [&data, &work, &logs] {
        std::fs::create_dir_all(d).map_err(io(format!("cannot create {}", d.display())))?;
    }
    let mut notes = Vec::new();
    if opts.tmpfs_per_puller {
        check_tmpfs_room(opts)?;
    }

    progress(&format!(
        "model of {} bytes under {}",
        opts.size,
        data.display()
    ));
    let (size, seed) = (opts.size, opts.seed);
    let data2 = data.clone();
    let model = tokio::task::spawn_blocking(move || model::ensure(&data2, size, seed))
        .await
        .map_err(|e| io("generating the model".into())(std::io::Error::other(e)))??;
    let (origin, publish_secs) = publish(opts, &data, &model, &logs).await?;
    let origin_url = format!("file://{}", origin.display());
    let largest = largest_blob(&origin, &model)?;

    // 1. One pull alone through a cold mirror.
    let (mirror, mirror_addr) =
        start_mirror(opts, &origin_url, &work.join("cache-a"), "mirror-a", &logs).await?;
    let mirror_url = format!("http://{mirror_addr}");
    progress("one pull alone through a cold mirror");
    let cpu0 = mirror.cpu_seconds();
    let w0 = disk_write_bytes_of(mirror.pid());
    let alone = run_pulls(opts, &mirror_url, &work, &logs, "alone", 1, false, &model).await?;
    let mut alone_mirror = counters(mirror_addr).await?;
    alone_mirror.cpu_secs = cpu_delta(cpu0, mirror.cpu_seconds());
    alone_mirror.disk_write_bytes = written_delta(w0, disk_write_bytes_of(mirror.pid()));
    let alone = alone.pulls.into_iter().next().expect("one pull was run");
    remove(&work.join("alone-1"));

    // 2. The same mirror, now warm: a pull, then curl and aria2c on the largest blob.
    progress("one pull alone through the warm mirror");
    let warm = run_pulls(opts, &mirror_url, &work, &logs, "warm", 1, false, &model).await?;
    let warm = warm.pulls.into_iter().next().expect("one pull was run");
    remove(&work.join("warm-1"));
    let blob_url = format!(
        "{mirror_url}/v1/blobs/{}?model={MODEL}&revision=r1",
        largest.0
    );
    let curl_version = first_line(Command::new("curl").arg("--version")).map(two_words);
    let mut curl_fsync = None;
    let curl = if curl_version.is_some() {
        progress("curl: the largest blob from the warm mirror");
        let dst = work.join("curl.bin");
        let curl = |dst: &Path| {
            let mut c = Command::new("curl");
            c.args(["-sS", "--fail", "-o"]).arg(dst).arg(&blob_url);
            c
        };
        let r = download("curl", curl(&dst), &dst, largest.1, false).await?;
        remove(&dst);
        // The pull syncs every file before it names it; curl does not. The same download
        // with an fsync at the end shows what that durability costs on this disk.
        let synced = download("curl + fsync", curl(&dst), &dst, largest.1, true).await?;
        remove(&dst);
        curl_fsync = Some(synced);
        Some(r)
    } else {
        notes.push("curl not found on PATH: the curl comparison was skipped".to_owned());
        None
    };
    // `aria2 version 1.36.0` -> `aria2c 1.36.0`.
    let aria2c_version = first_line(Command::new("aria2c").arg("--version"))
        .map(|l| format!("aria2c {}", l.split_whitespace().last().unwrap_or("?")));
    let aria2c = if aria2c_version.is_some() {
        progress("aria2c -x8: the largest blob from the warm mirror");
        let dst = work.join("aria2c.bin");
        let mut c = Command::new("aria2c");
        c.args([
            "-x8",
            "-s8",
            "-k1M",
            "--file-allocation=none",
            "--allow-overwrite=true",
        ])
        .args([
            "--console-log-level=error",
            "--summary-interval=0",
            "--quiet=true",
        ])
        .arg("-d")
        .arg(&work)
        .args(["-o", "aria2c.bin"])
        .arg(&blob_url);
        let r = download("aria2c -x8", c, &dst, largest.1, false).await?;
        remove(&dst);
        Some(r)
    } else {
        notes.push(
            "aria2c not installed: the aria2c -x8 comparison was skipped \
             (Debian/Ubuntu: apt-get install -y aria2; scripts/setup.sh installs it)"
                .to_owned(),
        );
        None
    };
    drop(mirror);
    remove(&work.join("cache-a"));

    // 3. N pullers at once through a fresh cold mirror, sharing as peers.
    let (mirror, mirror_addr) =
        start_mirror(opts, &origin_url, &work.join("cache-b"), "mirror-b", &logs).await?;
    let mirror_url = format!("http://{mirror_addr}");
    progress(&format!(
        "{} pullers at once through a cold mirror, sharing as peers",
        opts.pullers
    ));
    let cpu0 = mirror.cpu_seconds();
    let w0 = disk_write_bytes_of(mirror.pid());
    let mut crowd = run_pulls(
        opts,
        &mirror_url,
        &work,
        &logs,
        "crowd",
        opts.pullers,
        true,
        &model,
    )
    .await?;
    // Let the last announcements (the final peer byte counts) land.
    tokio::time::sleep(Duration::from_millis(400)).await;
    crowd.mirror = counters(mirror_addr).await?;
    crowd.mirror.cpu_secs = cpu_delta(cpu0, mirror.cpu_seconds());
    crowd.mirror.disk_write_bytes = written_delta(w0, disk_write_bytes_of(mirror.pid()));
    drop(mirror);

    if !opts.keep_work {
        remove(&work);
    }
    let mut report = WeightsBenchReport {
        machine: Machine {
            nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
            kernel: first_line(Command::new("uname").arg("-r")),
            // The commit of the checkout the executable was built in, else of the working
            // directory.
            git_commit: opts
                .exe
                .parent()
                .and_then(|d| {
                    first_line(Command::new("git").arg("-C").arg(d).args([
                        "rev-parse",
                        "--short",
                        "HEAD",
                    ]))
                })
                .or_else(|| first_line(Command::new("git").args(["rev-parse", "--short", "HEAD"]))),
            loadavg_before,
            loadavg_after: loadavg(),
            curl_version,
            aria2c_version,
        },
        command_line: opts.command_line.clone(),
        timestamp,
        settings: Settings {
            model_bytes: model.total_bytes,
            files: model.files.len(),
            largest_file_bytes: largest.1,
            piece_size: opts.piece_size_kib * 1024,
            pullers: opts.pullers,
            parallel: opts.parallel,
            seed: opts.seed,
            data_dir: data,
            puller_storage: if opts.tmpfs_per_puller {
                "tmpfs"
            } else {
                "disk"
            }
            .to_owned(),
            mirror_limit_rate: opts.mirror_limit_rate,
            crowd_piece_order: if opts.sequential {
                "sequential"
            } else {
                "spread"
            }
            .to_owned(),
        },
        generate_secs: model.generate_secs,
        publish_secs,
        alone,
        alone_mirror,
        warm,
        curl,
        curl_fsync,
        aria2c,
        crowd,
        notes,
        verdicts: Vec::new(),
    };
    report.verdicts = report.compute_verdicts();
    report.write(&opts.out_dir)?;
    write_plot(&report, &opts.out_dir.join("plots"))?;
    Ok(report)
}

fn remove(path: &Path) {
    let _ = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
}

fn loadavg() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.trim().to_owned())
}

/// First line of a command's stdout, trimmed; `None` if it cannot run or fails.
fn first_line(command: &mut Command) -> Option<String> {
    let out = command.stderr(Stdio::null()).output().ok()?;
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

/// `curl 7.88.1 (x86_64-pc-linux-gnu) libcurl/...` -> `curl 7.88.1`.
fn two_words(line: String) -> String {
    line.split_whitespace()
        .take(2)
        .collect::<Vec<_>>()
        .join(" ")
}

fn cpu_delta(before: Option<f64>, after: Option<f64>) -> Option<f64> {
    Some(after? - before?)
}

fn written_delta(before: Option<u64>, after: Option<u64>) -> Option<u64> {
    Some(after?.saturating_sub(before?))
}

/// `write_bytes` of `/proc/PID/io`: bytes the process caused to be sent to block storage
/// (buffered writes when they are dirtied, `O_DIRECT` writes as they are issued).
fn disk_write_bytes_of(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))?
        .trim()
        .parse()
        .ok()
}

/// Publishes the model once per size, seed, piece size and manifest format; returns the origin directory
/// and the seconds publishing took (0 when reused).
async fn publish(
    opts: &WeightsBenchOptions,
    data: &Path,
    model: &GeneratedModel,
    logs: &Path,
) -> Result<(PathBuf, f64), BenchError> {
    // `-m2`: manifest format 2 (pieces hashed as BLAKE3 subtrees). An origin published by
    // an older build (format 1) is not reused, so a run measures the format its executable
    // writes.
    let name = format!(
        "origin-{}-seed{}-{}k-m2",
        opts.size, opts.seed, opts.piece_size_kib
    );
    let origin = data.join(&name);
    let marker = data.join(format!("{name}.complete"));
    if marker.exists() {
        return Ok((origin, 0.0));
    }
    progress(&format!("publishing to file://{}", origin.display()));
    remove(&origin);
    let mut c = Command::new(&opts.exe);
    c.arg("publish")
        .arg(&model.dir)
        .arg("--origin")
        .arg(format!("file://{}", origin.display()))
        .args(["--model", MODEL, "--revision", "r1", "--tag", "latest"])
        .args(["--piece-size-kib", &opts.piece_size_kib.to_string()])
        .stdin(Stdio::null());
    let log = logs.join("publish.log");
    let t = Instant::now();
    let out = tokio::task::spawn_blocking(move || c.output())
        .await
        .map_err(|e| io("running tokenway publish".into())(std::io::Error::other(e)))?
        .map_err(io("cannot run tokenway publish".into()))?;
    let _ = std::fs::write(&log, &out.stderr);
    if !out.status.success() {
        return Err(BenchError::Child {
            name: "tokenway publish".into(),
            message: format!(
                "exited ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    let secs = t.elapsed().as_secs_f64();
    std::fs::write(&marker, b"").map_err(io(format!("cannot write {}", marker.display())))?;
    Ok((origin, secs))
}

/// The hash and size of the largest file, from the manifest in the origin.
fn largest_blob(origin: &Path, model: &GeneratedModel) -> Result<(String, u64), BenchError> {
    let path = origin.join(format!("models/{MODEL}/revisions/r1.json"));
    let text =
        std::fs::read_to_string(&path).map_err(io(format!("cannot read {}", path.display())))?;
    let bad = |why: &str| BenchError::Child {
        name: "tokenway publish".into(),
        message: format!("{}: {why}", path.display()),
    };
    let manifest: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(&format!("not JSON: {e}")))?;
    let want = &model.largest().path;
    manifest["files"]
        .as_array()
        .and_then(|files| files.iter().find(|f| f["path"] == **want))
        .and_then(|f| Some((f["hash"].as_str()?.to_owned(), f["size"].as_u64()?)))
        .ok_or_else(|| bad(&format!("no entry for {want}")))
}

async fn start_mirror(
    opts: &WeightsBenchOptions,
    origin_url: &str,
    cache: &Path,
    name: &str,
    logs: &Path,
) -> Result<(ChildProcess, std::net::SocketAddr), BenchError> {
    // Room for the whole model twice over: the benchmark measures distribution, not eviction.
    let max_size = opts.size.saturating_mul(2).max(64 << 20);
    let mut c = Command::new(&opts.exe);
    c.arg("mirror")
        .args(["--origin", origin_url])
        .arg("--cache")
        .arg(cache)
        .args(["--max-size", &max_size.to_string()])
        .args(["--listen", "127.0.0.1:0", "--region", REGION])
        .env("RUST_LOG", "warn");
    if let Some(r) = opts.mirror_limit_rate {
        c.args(["--limit-rate", &r.to_string()]);
    }
    ChildProcess::spawn_with_banner(
        name,
        c,
        "tokenway mirror listening on",
        &logs.join(format!("{name}.log")),
        STARTUP_TIMEOUT,
    )
    .await
}

/// One running `tokenway pull`.
struct Puller {
    child: ChildProcess,
    log: PathBuf,
    started: Instant,
    /// CPU seconds at the last look while it ran (a pull that exits is reaped by the look
    /// that notices, after which /proc has nothing).
    cpu_secs: Option<f64>,
    /// Bytes written to block storage at the last look (like `cpu_secs`).
    disk_write_bytes: Option<u64>,
    done: Option<PullRun>,
}

/// `key=value` of a `pull summary:` line.
fn summary_field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// Starts `n` pulls at once into `<work>/<label>-<i>`; waits until each has printed its
/// summary line (pullers that serve peers keep running until dropped).
#[allow(clippy::too_many_arguments)]
async fn run_pulls(
    opts: &WeightsBenchOptions,
    mirror_url: &str,
    work: &Path,
    logs: &Path,
    label: &str,
    n: usize,
    serve: bool,
    model: &GeneratedModel,
) -> Result<CrowdRun, BenchError> {
    // A pull slower than 5 MiB/s is broken, not slow.
    let timeout = Duration::from_secs(120).max(Duration::from_secs(model.total_bytes / (5 << 20)));
    // Declared before the pullers, so they are dropped (killed) before it is unmounted.
    let mut mounts = Vec::new();
    if opts.tmpfs_per_puller {
        for i in 1..=n {
            mounts.push(TmpfsMount::new(
                &work.join(format!("{label}-{i}")),
                tmpfs_bytes(model.total_bytes),
            )?);
        }
    }
    let mut pullers = Vec::with_capacity(n);
    let first_start = Instant::now();
    for i in 1..=n {
        let mut c = Command::new(&opts.exe);
        c.args(["pull", MODEL, "--mirror", mirror_url, "--out"])
            .arg(work.join(format!("{label}-{i}")))
            .args(["--parallel", &opts.parallel.to_string(), "--region", REGION])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null());
        if serve {
            c.args(["--serve", "127.0.0.1:0"]);
        }
        if opts.sequential {
            c.arg("--sequential");
        }
        let log = logs.join(format!("pull-{label}-{i}.log"));
        let child = ChildProcess::spawn(&format!("pull {label} {i}"), c, &log)?;
        pullers.push(Puller {
            child,
            log,
            started: Instant::now(),
            cpu_secs: None,
            disk_write_bytes: None,
            done: None,
        });
    }
    let mut last_done = first_start;
    while pullers.iter().any(|p| p.done.is_none()) {
        for p in pullers.iter_mut().filter(|p| p.done.is_none()) {
            // Whether it has exited is asked before its log is read: a pull that prints its
            // summary and exits in between is then still seen as done.
            let exited = p.child.check_running().err();
            if exited.is_none() {
                p.cpu_secs = crate::process::cpu_seconds_of(p.child.pid()).or(p.cpu_secs);
                p.disk_write_bytes = disk_write_bytes_of(p.child.pid()).or(p.disk_write_bytes);
            }
            let text = std::fs::read_to_string(&p.log).unwrap_or_default();
            if let Some(line) = text.lines().rfind(|l| l.starts_with("pull summary:")) {
                let now = Instant::now();
                last_done = now;
                let wall = now.duration_since(p.started).as_secs_f64();
                if !line.contains("complete=true") {
                    return Err(p.child.startup_error(format!("did not complete: {line}")));
                }
                let f = |k| summary_field(line, k).unwrap_or(0);
                p.done = Some(PullRun {
                    wall_secs: wall,
                    summary_secs: line
                        .split_whitespace()
                        .find_map(|kv| kv.strip_prefix("seconds="))
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0.0),
                    mib_per_sec: model.total_bytes as f64 / f64::from(1u32 << 20) / wall,
                    bytes_from_mirrors: f("bytes_from_mirrors"),
                    bytes_from_peers: f("bytes_from_peers"),
                    bytes_from_origin: f("bytes_from_origin"),
                    pieces_hedged: f("pieces_hedged"),
                    cpu_secs: p.cpu_secs,
                    disk_write_bytes: p.disk_write_bytes,
                });
                continue;
            }
            if let Some(e) = exited {
                return Err(e);
            }
            if p.started.elapsed() > timeout {
                return Err(p
                    .child
                    .startup_error(format!("did not finish within {timeout:?}")));
            }
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(CrowdRun {
        wall_secs: last_done.duration_since(first_start).as_secs_f64(),
        pulls: pullers.into_iter().filter_map(|p| p.done).collect(),
        mirror: MirrorCounters::default(),
    })
}

/// Room given to one puller's tmpfs: the model, its progress files and some slack.
fn tmpfs_bytes(model: u64) -> u64 {
    model + model / 64 + (64 << 20)
}

/// RAM kept free for everything else on the machine while the pullers' tmpfs are full.
const TMPFS_RESERVE: u64 = 4 << 30;

/// Refuses `--tmpfs-per-puller` unless running as root with room in RAM for every puller's
/// copy of the model plus [`TMPFS_RESERVE`].
fn check_tmpfs_room(opts: &WeightsBenchOptions) -> Result<(), BenchError> {
    let refuse = |message: String| BenchError::Child {
        name: "--tmpfs-per-puller".into(),
        message,
    };
    if !tokenway_netlab::is_root() {
        return Err(refuse(
            "mounting a tmpfs per puller needs root; run as root or without the flag".into(),
        ));
    }
    let meminfo =
        std::fs::read_to_string("/proc/meminfo").map_err(io("cannot read /proc/meminfo".into()))?;
    let available = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| refuse("no MemAvailable in /proc/meminfo".into()))?;
    // The crowd is the largest: every puller holds a whole copy at the end.
    let need = tmpfs_bytes(opts.size) * opts.pullers as u64 + TMPFS_RESERVE;
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    if available < need {
        return Err(refuse(format!(
            "{} tmpfs of {:.1} GiB each plus {:.0} GiB for everything else need {:.1} GiB of \
             RAM, and MemAvailable is {:.1} GiB (see `free -g`); use fewer --pullers, a \
             smaller --size, or run without the flag",
            opts.pullers,
            gib(tmpfs_bytes(opts.size)),
            gib(TMPFS_RESERVE),
            gib(need),
            gib(available)
        )));
    }
    Ok(())
}

/// A tmpfs mounted on a directory for as long as this lives; unmounted (lazily if busy) and
/// the directory removed on drop, which frees its RAM.
struct TmpfsMount {
    dir: PathBuf,
}

impl TmpfsMount {
    fn new(dir: &Path, bytes: u64) -> Result<Self, BenchError> {
        std::fs::create_dir_all(dir).map_err(io(format!("cannot create {}", dir.display())))?;
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={bytes},mode=0755"),
                "tmpfs",
            ])
            .arg(dir)
            .output()
            .map_err(io("cannot run mount".into()))?;
        if !out.status.success() {
            return Err(BenchError::Child {
                name: "mount -t tmpfs".into(),
                message: format!(
                    "{} ({}): {}",
                    dir.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        Ok(Self {
            dir: dir.to_owned(),
        })
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Runs a download command to completion and checks the file it wrote.
/// With `fsync`, the file is synced to disk before the clock stops.
async fn download(
    tool: &str,
    mut command: Command,
    dst: &Path,
    want: u64,
    fsync: bool,
) -> Result<FetchRun, BenchError> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let t = Instant::now();
    let out = tokio::task::spawn_blocking(move || command.output())
        .await
        .map_err(|e| io(format!("running {tool}"))(std::io::Error::other(e)))?
        .map_err(io(format!("cannot run {tool}")))?;
    if fsync && out.status.success() {
        let d = dst.to_owned();
        tokio::task::spawn_blocking(move || std::fs::File::open(&d)?.sync_all())
            .await
            .map_err(|e| io(format!("syncing {}", dst.display()))(std::io::Error::other(e)))?
            .map_err(io(format!("cannot sync {}", dst.display())))?;
    }
    let wall = t.elapsed().as_secs_f64();
    let got = std::fs::metadata(dst).map(|m| m.len()).unwrap_or(0);
    if !out.status.success() || got != want {
        return Err(BenchError::Child {
            name: tool.to_owned(),
            message: format!(
                "exited ({}) with {got} of {want} bytes in {}: {}",
                out.status,
                dst.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(FetchRun {
        tool: tool.to_owned(),
        bytes: got,
        wall_secs: wall,
        mib_per_sec: got as f64 / f64::from(1u32 << 20) / wall,
    })
}

/// The mirror's counters, from `GET /metrics` (HTTP/1.0, read to the end).
async fn counters(addr: std::net::SocketAddr) -> Result<MirrorCounters, BenchError> {
    let err = |e: std::io::Error| io(format!("GET http://{addr}/metrics"))(e);
    let mut s = tokio::net::TcpStream::connect(addr).await.map_err(err)?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n")
        .await
        .map_err(err)?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut text))
        .await
        .map_err(|_| err(std::io::Error::other("no answer within 10 s")))?
        .map_err(err)?;
    let metric = |name: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    Ok(MirrorCounters {
        bytes_from_origin: metric("tokenway_mirror_bytes_from_origin_total"),
        bytes_served: metric("tokenway_mirror_bytes_served_total"),
        bytes_from_peers: metric("tokenway_mirror_bytes_from_peers_total"),
        single_flight_joins: metric("tokenway_mirror_single_flight_joins_total"),
        cpu_secs: None,
        disk_write_bytes: None,
    })
}

/// The CDF of the crowd's pull times next to the lone pull and the 2x target.
fn write_plot(report: &WeightsBenchReport, dir: &Path) -> Result<(), BenchError> {
    std::fs::create_dir_all(dir).map_err(io(format!("cannot create {}", dir.display())))?;
    let alone = report.alone.wall_secs;
    let series = [
        Series {
            label: format!("{} pullers at once, cold mirror", report.settings.pullers),
            values: report.crowd.pulls.iter().map(|p| p.wall_secs).collect(),
        },
        Series {
            label: "one pull alone, cold mirror".into(),
            values: vec![alone],
        },
        Series {
            label: "target: 2 x alone".into(),
            values: vec![alone * report::TARGET_CROWD_FACTOR],
        },
    ];
    plot::cdf_svg(
        &dir.join("weights-pull-times.svg"),
        "tokenway pull: time to a verified model",
        "seconds",
        &series,
    )
    .map_err(|e| io("plotting".into())(std::io::Error::other(e)))
}
