//! Pinned front threads that step aside while something else holds their CPU
//! (`front_cpu_affinity = "auto"`).
//!
//! Pinning keeps a front thread's caches warm ([`crate::cpu_affinity`]), but a pinned thread
//! cannot move: when another program runs on its CPU in bursts of milliseconds, every request
//! that wakes the thread waits until the CPU is free again, while an unpinned thread would have
//! been woken on another one. With a neighbour busy 5 ms out of every 10, the single stream's
//! added p99 was ~0.4 ms higher pinned than unpinned, with 20 ms bursts ~0.75 ms
//! (docs/benchmarks.md, "Pinned threads and a busy neighbour").
//!
//! So once a second the gateway reads, for every pinned front thread, how long it was ready to
//! run but had to wait for its CPU (`/proc/self/task/TID/schedstat`). When that is a tenth of the
//! time or more, the thread is unpinned and the scheduler places it. It is pinned again after a
//! back-off: 1 min, doubled each time it has to step aside again (at most 15 min), and back to
//! 1 min once it has stayed pinned and calm for 5 min. The gateway's own load does not unpin a
//! thread: its threads each have their own CPU, so only other programs' work (or the kernel's)
//! makes one wait.
//!
//! Time the hypervisor steals from the CPU is not counted: with it, the threads were unpinned in
//! noisy minutes on a VM, and the single stream got slower, not faster (docs/benchmarks.md).
//!
//! The decision ([`Placement`]) is sans-IO and takes the time as an argument; [`watch`] does the
//! reading and the `sched_setaffinity` calls.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;
use tokenway_telemetry::{Counter, Gauge, Registry};

/// How often the pinned threads are looked at.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// Share of the time a pinned thread may spend waiting for its CPU (on its run queue, while
/// another task runs there) before it is unpinned. The bench's own neighbours (its load
/// generator, the sim) cost a pinned thread ~3 %; a neighbour busy half the time, ~30 %.
pub const UNPIN_SHARE: f64 = 0.10;
/// First back-off before an unpinned thread is pinned again. Long, because the two mistakes
/// cost differently: a thread left unpinned on a CPU that is free again costs the single stream
/// ~10 µs at p50, one pinned beside a busy neighbour ~0.4 ms at p99 (docs/benchmarks.md).
pub const FIRST_BACKOFF: Duration = Duration::from_secs(60);
/// Longest back-off.
pub const MAX_BACKOFF: Duration = Duration::from_secs(15 * 60);
/// A thread that stays pinned and calm this long starts again from [`FIRST_BACKOFF`].
pub const CALM_RESET: Duration = Duration::from_secs(5 * 60);

/// What to do with one thread after a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing changes.
    Stay,
    /// Let the scheduler place it (on any of the process's CPUs).
    Unpin,
    /// Pin it to its CPU again.
    Repin,
}

/// One front thread's pinning over time.
#[derive(Debug, Clone)]
pub struct Placement {
    state: State,
    /// The back-off the next unpinning will last.
    backoff: Duration,
}

#[derive(Debug, Clone, Copy)]
enum State {
    /// Pinned, and without contention since the given time.
    Pinned { calm_since: Instant },
    /// Unpinned until the given time.
    Unpinned { until: Instant },
}

impl Placement {
    /// A thread just pinned at `now`.
    pub fn new(now: Instant) -> Self {
        Self {
            state: State::Pinned { calm_since: now },
            backoff: FIRST_BACKOFF,
        }
    }

    /// Whether the thread is pinned now.
    pub fn is_pinned(&self) -> bool {
        matches!(self.state, State::Pinned { .. })
    }

    /// How long from `now` the thread stays unpinned (zero while pinned).
    pub fn unpinned_for(&self, now: Instant) -> Duration {
        match self.state {
            State::Pinned { .. } => Duration::ZERO,
            State::Unpinned { until } => until.saturating_duration_since(now),
        }
    }

    /// A sample at `now`: `lost` is the share of the time since the last sample that the thread
    /// waited on its run queue (ignored while unpinned, where the scheduler moves the thread away
    /// from a busy CPU).
    pub fn observe(&mut self, now: Instant, lost: f64) -> Action {
        match self.state {
            State::Pinned { calm_since } => {
                if lost >= UNPIN_SHARE {
                    self.state = State::Unpinned {
                        until: now + self.backoff,
                    };
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                    Action::Unpin
                } else {
                    if now.saturating_duration_since(calm_since) >= CALM_RESET {
                        self.backoff = FIRST_BACKOFF;
                    }
                    Action::Stay
                }
            }
            State::Unpinned { until } if now >= until => {
                self.state = State::Pinned { calm_since: now };
                Action::Repin
            }
            State::Unpinned { .. } => Action::Stay,
        }
    }
}

/// Nanoseconds a thread has waited on a run queue, from its `schedstat` line ("run wait
/// timeslices").
pub fn schedstat_wait_ns(line: &str) -> Option<u64> {
    line.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// The pinned front threads, as they register themselves.
#[derive(Default)]
pub struct PinnedThreads(Mutex<Vec<(i32, usize)>>);

impl PinnedThreads {
    /// Records the calling thread as pinned to `cpu`.
    pub fn add_current(&self, cpu: usize) {
        match current_tid() {
            Some(tid) => self
                .0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((tid, cpu)),
            None => tracing::debug!(cpu, "cannot read this thread's id; it stays pinned"),
        }
    }

    fn list(&self) -> Vec<(i32, usize)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The calling thread's id, from `/proc/thread-self` (a link to `PID/task/TID`).
fn current_tid() -> Option<i32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

/// `tokenway_front_threads_pinned` and `tokenway_front_thread_unpins_total`.
#[derive(Clone, Default)]
pub struct PlacementMetrics {
    pinned: Gauge,
    unpins: Counter,
}

impl PlacementMetrics {
    /// The metrics, registered in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "front_threads_pinned",
            "Front threads pinned to their CPU now (front_cpu_affinity)",
            m.pinned.clone(),
        );
        registry.register(
            "front_thread_unpins",
            "Times a pinned front thread was unpinned because it waited for its CPU, busy with other tasks, a tenth of the time or more",
            m.unpins.clone(),
        );
        m
    }

    /// Sets the pinned-threads gauge (at start, before [`watch`] keeps it).
    pub fn set_pinned(&self, n: usize) {
        self.pinned.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// One watched thread: its decision and the readings of the last sample.
struct Watched {
    tid: i32,
    cpu: usize,
    placement: Placement,
    last: Option<Reading>,
}

#[derive(Clone, Copy)]
struct Reading {
    at: Instant,
    wait_ns: u64,
}

/// Samples the pinned front threads every [`SAMPLE_EVERY`] and unpins or pins them again, until
/// `stop` turns true. `allowed` is the set of CPUs an unpinned thread may run on (the process's,
/// read before any thread was pinned).
pub async fn watch(
    threads: Arc<PinnedThreads>,
    allowed: Vec<usize>,
    metrics: PlacementMetrics,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut any = CpuSet::new();
    for &cpu in &allowed {
        let _ = any.set(cpu);
    }
    let mut watched: Vec<Watched> = Vec::new();
    let mut ticker = tokio::time::interval(SAMPLE_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = false;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let now = Instant::now();
        for (tid, cpu) in threads.list() {
            if !watched.iter().any(|w| w.tid == tid) {
                watched.push(Watched {
                    tid,
                    cpu,
                    placement: Placement::new(now),
                    last: None,
                });
            }
        }
        // One log line per sample for all the threads unpinned in it: (cpu, percent lost).
        let mut unpinned: Vec<(usize, f64)> = Vec::new();
        let mut pin_again_in = Duration::ZERO;
        for w in &mut watched {
            let wait_ns = std::fs::read_to_string(format!("/proc/self/task/{}/schedstat", w.tid))
                .ok()
                .and_then(|s| schedstat_wait_ns(&s));
            let Some(wait_ns) = wait_ns else {
                if !warned {
                    warned = true;
                    tracing::info!(
                        tid = w.tid,
                        "no schedstat for a front thread (a kernel without CONFIG_SCHED_INFO?); it stays pinned"
                    );
                }
                continue;
            };
            let reading = Reading { at: now, wait_ns };
            let lost = w.last.map_or(0.0, |last| lost_share(&last, &reading));
            w.last = Some(reading);
            let set = match w.placement.observe(now, lost) {
                Action::Stay => continue,
                Action::Unpin => {
                    metrics.unpins.inc();
                    unpinned.push((w.cpu, (lost * 100.0).round()));
                    pin_again_in = pin_again_in.max(w.placement.unpinned_for(now));
                    any
                }
                Action::Repin => {
                    tracing::debug!(cpu = w.cpu, "front thread pinned to its CPU again");
                    let mut one = CpuSet::new();
                    let _ = one.set(w.cpu);
                    one
                }
            };
            if let Err(e) = sched_setaffinity(Pid::from_raw(w.tid), &set) {
                tracing::debug!(error = %e, tid = w.tid, "cannot change a front thread's CPUs");
            }
        }
        if !unpinned.is_empty() {
            tracing::info!(
                cpus_and_percent_lost = ?unpinned,
                pin_again_in_s = pin_again_in.as_secs(),
                "front threads waited for their CPUs; unpinned"
            );
        }
        metrics.set_pinned(watched.iter().filter(|w| w.placement.is_pinned()).count());
    }
}

/// Share of the time between two readings that the thread waited on its run queue.
fn lost_share(before: &Reading, after: &Reading) -> f64 {
    let wall = after.at.saturating_duration_since(before.at).as_nanos() as f64;
    let waited = after.wait_ns.saturating_sub(before.wait_ns) as f64;
    if wall > 0.0 {
        waited / wall
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_calm_thread_stays_pinned() {
        let t0 = Instant::now();
        let mut p = Placement::new(t0);
        for s in 1..=600 {
            assert_eq!(p.observe(t0 + secs(s), 0.03), Action::Stay);
        }
        assert!(p.is_pinned());
    }

    #[test]
    fn contention_unpins_until_the_back_off_and_the_back_off_doubles_up_to_its_cap() {
        let t0 = Instant::now();
        let mut p = Placement::new(t0);
        let mut now = t0;
        let mut expected = FIRST_BACKOFF;
        for _ in 0..8 {
            now += secs(1);
            assert_eq!(p.observe(now, 0.3), Action::Unpin);
            assert!(!p.is_pinned());
            assert_eq!(p.unpinned_for(now), expected);
            let unpinned_at = now;
            // While unpinned, even heavy contention changes nothing (it is not the thread's).
            while now + secs(1) < unpinned_at + expected {
                now += secs(1);
                assert_eq!(
                    p.observe(now, 0.9),
                    Action::Stay,
                    "at {:?}",
                    now - unpinned_at
                );
            }
            now = unpinned_at + expected;
            assert_eq!(p.observe(now, 0.0), Action::Repin);
            assert!(p.is_pinned());
            expected = (expected * 2).min(MAX_BACKOFF);
        }
        assert_eq!(expected, MAX_BACKOFF);
    }

    #[test]
    fn a_calm_spell_pinned_brings_the_back_off_back_to_its_start() {
        let t0 = Instant::now();
        let mut p = Placement::new(t0);
        let mut now = t0 + secs(1);
        assert_eq!(p.observe(now, 0.5), Action::Unpin);
        now += FIRST_BACKOFF;
        assert_eq!(p.observe(now, 0.0), Action::Repin);
        // Contention again at once: the second back-off is twice the first.
        now += secs(1);
        assert_eq!(p.observe(now, 0.5), Action::Unpin);
        assert_eq!(
            p.observe(now + FIRST_BACKOFF * 2 - secs(1), 0.0),
            Action::Stay
        );
        now += FIRST_BACKOFF * 2;
        assert_eq!(p.observe(now, 0.0), Action::Repin);
        // Calm for CALM_RESET: the next back-off is the first one again.
        let repinned = now;
        while now < repinned + CALM_RESET {
            now += secs(1);
            assert_eq!(p.observe(now, 0.05), Action::Stay);
        }
        now += secs(1);
        assert_eq!(p.observe(now, 0.2), Action::Unpin);
        assert_eq!(p.unpinned_for(now), FIRST_BACKOFF);
    }

    #[test]
    fn readings_parse_and_give_the_share_lost() {
        assert_eq!(
            schedstat_wait_ns("2273000000 151480000 45121\n"),
            Some(151_480_000)
        );
        assert_eq!(schedstat_wait_ns("garbage"), None);
        let t0 = Instant::now();
        let before = Reading {
            at: t0,
            wait_ns: 1_000_000_000,
        };
        // 100 ms of run-queue wait in 1 s.
        let after = Reading {
            at: t0 + secs(1),
            wait_ns: 1_100_000_000,
        };
        assert!((lost_share(&before, &after) - 0.10).abs() < 1e-9);
        // Counters that went backwards (a thread id reused) lose nothing.
        assert_eq!(lost_share(&after, &before), 0.0);
    }

    #[test]
    fn this_thread_finds_its_own_id_and_schedstat() {
        let tid = current_tid().expect("/proc/thread-self");
        assert!(tid > 0);
        if let Ok(line) = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")) {
            assert!(schedstat_wait_ns(&line).is_some(), "{line}");
        }
    }
}
