//! Front threads pinned to CPUs (`front_cpu_affinity`): front thread `i` runs only on the
//! `i`-th CPU the process may use.
//!
//! A request through a TCP front sleeps twice (for the client's request, for the backend's
//! answer), and an unpinned thread may be woken on another CPU each time, where the gateway's
//! code and data are not in the caches; a pinned thread always wakes where they were left
//! (measured: docs/benchmarks.md, "Front threads on their own CPUs"). nginx offers the same as
//! `worker_cpu_affinity`.

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;
use serde::Deserialize;

/// When front threads are pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Affinity {
    /// When there is one front thread per CPU the process may use (the default
    /// `front_threads = 0`, a dedicated machine, a container with its own cpuset). Not when
    /// fewer threads share a larger set, as under a CPU quota on a big host: there the first
    /// CPUs may be other programs' busiest. A pinned thread whose CPU something else keeps busy
    /// is unpinned for a while ([`crate::cpu_placement`]).
    #[default]
    Auto,
    /// Always, and never let go; with more threads than CPUs, the CPUs are taken in turn.
    On,
    /// Never: the scheduler places the threads.
    Off,
}

/// The CPU of each front thread (index `i` → element `i`), or an empty list when the threads
/// stay unpinned. Reads the CPUs this process may use, so it is called before any front thread
/// is pinned.
pub fn front_cpus(mode: Affinity, threads: usize) -> Vec<usize> {
    let allowed = match mode {
        Affinity::Off => return Vec::new(),
        Affinity::Auto | Affinity::On => allowed_cpus(),
    };
    let cpus = plan(mode, &allowed, threads);
    if !cpus.is_empty() {
        tracing::info!(?cpus, "front threads pinned to their CPUs");
    }
    cpus
}

/// [`front_cpus`] for a given set of `allowed` CPUs.
fn plan(mode: Affinity, allowed: &[usize], threads: usize) -> Vec<usize> {
    let pin = match mode {
        Affinity::Off => false,
        Affinity::Auto => allowed.len() == threads && threads > 1,
        Affinity::On => !allowed.is_empty(),
    };
    if !pin {
        return Vec::new();
    }
    (0..threads).map(|i| allowed[i % allowed.len()]).collect()
}

/// The CPUs the calling thread may run on, ascending (empty when they cannot be read); before
/// any front thread is pinned, the process's.
pub fn allowed_cpus() -> Vec<usize> {
    match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the CPUs this process may use; front threads stay unpinned");
            Vec::new()
        }
    }
}

/// Pins the calling thread to `cpu`; a failure is logged, and the thread runs unpinned.
/// Returns whether it is pinned.
pub fn pin_current_thread(cpu: usize) -> bool {
    let mut set = CpuSet::new();
    let pinned = set
        .set(cpu)
        .and_then(|()| sched_setaffinity(Pid::from_raw(0), &set));
    if let Err(e) = &pinned {
        tracing::warn!(error = %e, cpu, "cannot pin a front thread to its CPU");
    }
    pinned.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_pins_only_one_thread_per_allowed_cpu() {
        assert_eq!(plan(Affinity::Auto, &[0, 1], 2), [0, 1]);
        assert_eq!(plan(Affinity::Auto, &[4, 5, 6, 7], 4), [4, 5, 6, 7]);
        // A quota of 2 CPUs on a 4-CPU host, more threads than CPUs, a single CPU.
        assert!(plan(Affinity::Auto, &[0, 1, 2, 3], 2).is_empty());
        assert!(plan(Affinity::Auto, &[0, 1], 3).is_empty());
        assert!(plan(Affinity::Auto, &[3], 1).is_empty());
    }

    #[test]
    fn on_takes_the_allowed_cpus_in_turn_and_off_never_pins() {
        assert_eq!(plan(Affinity::On, &[2, 3, 6], 5), [2, 3, 6, 2, 3]);
        assert_eq!(plan(Affinity::On, &[0, 1, 2, 3], 2), [0, 1]);
        assert!(plan(Affinity::On, &[], 2).is_empty());
        assert!(plan(Affinity::Off, &[0, 1], 2).is_empty());
    }

    #[test]
    fn a_pinned_thread_runs_on_its_cpu_only() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty(), "this process may run on no CPU?");
        let last = *cpus.last().expect("one CPU");
        // In a thread of its own: the test harness's threads keep their CPUs.
        std::thread::spawn(move || {
            assert!(pin_current_thread(last));
            assert_eq!(allowed_cpus(), [last]);
        })
        .join()
        .expect("the pinned thread");
    }
}
