//! `front_cpu_affinity`: the gateway's front threads run on one CPU each when pinned, and
//! wherever the scheduler puts them when not (tokenway-gateway's `cpu_affinity.rs`).

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
    let own = allowed_lists(std::process::id(), "");
    if own.iter().all(|l| single(l)) {
        eprintln!("skipped: this process may use one CPU only ({own:?})");
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
