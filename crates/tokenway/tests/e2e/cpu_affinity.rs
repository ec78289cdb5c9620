//! `front_cpu_affinity`: the gateway's front threads run on one CPU each when pinned, and
//! wherever the scheduler puts them when not (tokenway-gateway's `cpu_affinity.rs`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::harness::*;

/// `Cpus_allowed_list` of every thread of `pid` whose name starts with `prefix`.
fn allowed_lists(pid: u32, prefix: &str) -> Vec<String> {
    let mut lists = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks") {
        let dir = task.expect("task").path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        if let Some(list) = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        {
            lists.push(list.trim().to_owned());
        }
    }
    lists
}

/// Whether a `Cpus_allowed_list` names one CPU.
fn single(list: &str) -> bool {
    !list.contains(',') && !list.contains('-')
}

/// The CPUs this process may use (a `Cpus_allowed_list`), or `None`, after saying the test is
/// skipped, when that is one CPU.
fn several_cpus() -> Option<String> {
    let own = allowed_lists(std::process::id(), "");
    if own.iter().all(|l| single(l)) {
        eprintln!("skipped: this process may use one CPU only ({own:?})");
        return None;
    }
    own.into_iter().find(|l| !single(l))
}

/// Starts a gateway with `affinity` and two front threads, and checks that it answers.
async fn gateway_with(backend: &Proc, affinity: &str) -> Proc {
    let gw = gateway(
        &[backend],
        &format!("front_threads = 2\nfront_cpu_affinity = \"{affinity}\""),
        "",
    );
    let reply = post(
        &format!("{}/v1/chat/completions", gw.url()),
        &chat("hello", true, 4),
        None,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    gw
}

#[tokio::test]
async fn front_threads_run_on_one_cpu_each_when_pinned() {
    if several_cpus().is_none() {
        return;
    }
    let backend = sim(FAST_SIM);

    let pinned = gateway_with(&backend, "on").await;
    // Front thread 1's event loop (its worker thread, named after it; the kernel keeps 15
    // characters of a name) and front thread 0's, the main runtime's worker.
    let front = allowed_lists(pinned.child.id(), "tokenway-front");
    assert!(front.iter().any(|l| single(l)), "{front:?}");
    let main = allowed_lists(pinned.child.id(), "tokio-rt-worker");
    assert!(main.iter().any(|l| single(l)), "{main:?}");

    let unpinned = gateway_with(&backend, "off").await;
    let all = allowed_lists(unpinned.child.id(), "");
    assert!(all.iter().all(|l| !single(l)), "{all:?}");
}

/// Busy processes pinned to one CPU, killed when dropped.
struct Hogs(Vec<std::process::Child>);

impl Hogs {
    fn on(cpu: &str, count: usize) -> Self {
        let spawn = || {
            std::process::Command::new("taskset")
                .args(["-c", cpu, "python3", "-c", "while True: pass"])
                .spawn()
                .expect("taskset (util-linux) and python3")
        };
        Self((0..count).map(|_| spawn()).collect())
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[tokio::test]
async fn a_pinned_front_thread_steps_aside_while_another_program_keeps_its_cpu_busy() {
    let Some(own) = several_cpus() else {
        return;
    };
    // `auto` pins when there is one front thread per CPU the process may use.
    let cpus = cpus_in(&own);
    let backend = sim(FAST_SIM);
    let gw = gateway(
        &[&backend],
        &format!(
            "front_threads = {}\nfront_cpu_affinity = \"auto\"",
            cpus.len()
        ),
        "",
    );
    let metrics = format!("{}/metrics", gw.url());
    let pinned_at_start = eventually(Duration::from_secs(5), || async {
        metric_sum(&get(&metrics).await.body, "tokenway_front_threads_pinned") == cpus.len() as f64
    })
    .await;
    assert!(pinned_at_start, "{}", get(&metrics).await.body);
    // A front thread pins itself when its event loop starts.
    let pinned_thread = || {
        allowed_lists(gw.child.id(), "tokenway-front")
            .into_iter()
            .find(|l| single(l))
    };
    eventually(Duration::from_secs(5), || async {
        pinned_thread().is_some()
    })
    .await;
    let cpu = pinned_thread().unwrap_or_else(|| {
        let front = allowed_lists(gw.child.id(), "tokenway-front");
        panic!("no pinned front thread: {front:?}")
    });

    // Two busy programs on that CPU, and requests on many connections, so that the thread
    // pinned there is woken often and has to wait for its CPU.
    let hogs = Hogs::on(&cpu, 2);
    let stop = Arc::new(AtomicBool::new(false));
    let url = format!("{}/v1/chat/completions", gw.url());
    let load: Vec<_> = (0..8)
        .map(|_| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let reply = post(&url, &chat("busy", true, 8), None).await;
                    assert_eq!(reply.status, 200, "{}", reply.body);
                }
            })
        })
        .collect();
    let unpinned = eventually(Duration::from_secs(20), || async {
        metric_sum(
            &get(&metrics).await.body,
            "tokenway_front_thread_unpins_total",
        ) >= 1.0
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.expect("load task");
    }
    drop(hogs);
    let body = get(&metrics).await.body;
    assert!(unpinned, "no front thread was unpinned: {body}");
    assert!(
        metric_sum(&body, "tokenway_front_threads_pinned") < cpus.len() as f64,
        "{body}"
    );
    // The unpinned thread may now run on every CPU of the process.
    let after = allowed_lists(gw.child.id(), "tokenway-front");
    let main = allowed_lists(gw.child.id(), "tokio-rt-worker");
    assert!(
        after.iter().chain(&main).any(|l| cpus_in(l) == cpus),
        "front threads {after:?}, main workers {main:?}, process {cpus:?}"
    );
}

/// The CPUs of a `Cpus_allowed_list` ("0-3,8").
fn cpus_in(list: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (usize, usize) = (a.parse().expect("cpu"), b.parse().expect("cpu"));
        cpus.extend(a..=b);
    }
    cpus
}
