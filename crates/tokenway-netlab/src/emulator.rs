//! The I/O loop: reads packets from every host's TUN device, asks the link model of the right
//! direction what happens to each, and writes survivors to the destination host's device at
//! their release time.
//!
//! One dedicated thread does everything, so there are no locks on the packet path. Pending
//! packets wait in a binary heap keyed by release time. The thread sleeps in `ppoll` with a
//! nanosecond timeout (timer slack set to 1 ns) until about [`WAKE_EARLY`] before the next
//! release, then polls without sleeping until it is due: releases land within a few
//! microseconds of their due time unless the machine is overloaded; every release's error is
//! recorded in a histogram so `selfcheck` can prove it. Packet buffers are recycled, never
//! allocated per packet once the pool is warm. Memory is bounded: at most [`MAX_PENDING`]
//! packets wait at once (beyond that the emulator drops and counts `overflow`).

use std::collections::BinaryHeap;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::model::{DropReason, LinkModel, Verdict};
use crate::packet::ipv4_destination;
use crate::sys::{self, Tun};

/// Wake this long before a release and poll without sleeping for the rest.
pub const WAKE_EARLY: Duration = Duration::from_micros(80);
/// A packet this close to its due time is released now.
const RELEASE_SLACK: Duration = Duration::from_micros(2);
/// Bound on packets waiting for release.
pub const MAX_PENDING: usize = 1 << 17;
/// Packets read from one device before the loop checks releases again.
const READ_BATCH: usize = 64;
/// Size of a packet buffer (MTU 1500 plus room).
const BUF_SIZE: usize = 2048;
/// SCHED_FIFO priority of the emulator thread (above the selfcheck's traffic threads).
pub const EMULATOR_PRIORITY: i32 = 10;
/// Longest sleep, so a stop request is seen promptly.
const MAX_SLEEP: Duration = Duration::from_millis(20);
/// How often the shared statistics are refreshed.
const PUBLISH_EVERY: Duration = Duration::from_millis(50);

/// Release error histogram: 1 µs buckets from [`Lateness::MIN_US`] to [`Lateness::MAX_US`];
/// values outside are counted in the end buckets.
#[derive(Debug, Clone, PartialEq)]
pub struct Lateness {
    buckets: Vec<u64>,
    /// Largest error seen, µs.
    pub max_us: f64,
}

impl Default for Lateness {
    fn default() -> Self {
        Self {
            buckets: vec![0; (Self::MAX_US - Self::MIN_US + 1) as usize],
            max_us: 0.0,
        }
    }
}

impl Lateness {
    /// Lowest bucket (early releases), µs.
    pub const MIN_US: i64 = -1000;
    /// Highest bucket, µs.
    pub const MAX_US: i64 = 20_000;

    fn record(&mut self, error_ns: i64) {
        let us = (error_ns / 1000).clamp(Self::MIN_US, Self::MAX_US);
        self.buckets[(us - Self::MIN_US) as usize] += 1;
        self.max_us = self.max_us.max(error_ns as f64 / 1000.0);
    }

    /// Number of releases recorded.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The `q` quantile (0..=1) of the release error in µs (positive = late).
    pub fn quantile(&self, q: f64) -> f64 {
        let total = self.count();
        if total == 0 {
            return 0.0;
        }
        let target = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= target {
                return (i as i64 + Self::MIN_US) as f64;
            }
        }
        Self::MAX_US as f64
    }

    /// The `q` quantile of the absolute release error in µs.
    pub fn abs_quantile(&self, q: f64) -> f64 {
        let total = self.count();
        if total == 0 {
            return 0.0;
        }
        let width = (Self::MAX_US.max(-Self::MIN_US) + 1) as usize;
        let mut abs = vec![0u64; width];
        for (i, c) in self.buckets.iter().enumerate() {
            abs[(i as i64 + Self::MIN_US).unsigned_abs() as usize] += c;
        }
        let target = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in abs.iter().enumerate() {
            seen += c;
            if seen >= target {
                return i as f64;
            }
        }
        width as f64
    }

    /// Releases recorded since `earlier` (a previous snapshot of the same histogram).
    pub fn since(&self, earlier: &Lateness) -> Lateness {
        Lateness {
            buckets: self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
            max_us: self.max_us,
        }
    }
}

/// Counters of one direction of one link.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DirectionStats {
    /// Sending host.
    pub from: String,
    /// Receiving host.
    pub to: String,
    /// Packets that entered the model.
    pub received: u64,
    /// Packets written out (duplicates included).
    pub delivered: u64,
    /// Extra copies made by duplication.
    pub duplicated: u64,
    /// Drops by reason, in [`DropReason::ALL`] order.
    pub drops: [u64; 5],
}

impl DirectionStats {
    /// Drops for one reason.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        let i = DropReason::ALL
            .iter()
            .position(|r| *r == reason)
            .expect("ALL lists every reason");
        self.drops[i]
    }
}

/// A snapshot of the emulator's counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Per link direction.
    pub directions: Vec<DirectionStats>,
    /// Release error of every packet written.
    pub lateness: Lateness,
    /// Packets whose destination is no host (IPv6, stray traffic).
    pub no_route: u64,
    /// Packets dropped because [`MAX_PENDING`] were waiting.
    pub overflow: u64,
    /// Device read or write errors.
    pub io_errors: u64,
    /// Whether the thread got real-time priority.
    pub realtime: bool,
}

/// Where packets to an address go, and which model handles a (from, to) pair.
pub struct Routing {
    /// Address to host index.
    pub addresses: Vec<(Ipv4Addr, usize)>,
    /// For each (from host, to host): index into the models, row-major `from * hosts + to`.
    pub direction: Vec<Option<usize>>,
    /// Number of hosts.
    pub hosts: usize,
}

/// The running emulator thread. Dropping it stops the thread and closes the devices.
pub struct Emulator {
    stop: Arc<AtomicBool>,
    stats: Arc<Mutex<Stats>>,
    thread: Option<JoinHandle<()>>,
    epoch: Instant,
}

struct Pending {
    due: Duration,
    seq: u64,
    port: usize,
    dir: usize,
    len: usize,
    buf: Box<[u8]>,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.seq) == (other.due, other.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    // Reversed: BinaryHeap is a max-heap and we want the earliest release first.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.due, other.seq).cmp(&(self.due, self.seq))
    }
}

impl Emulator {
    /// Starts the thread. `ports[i]` is host `i`'s device; `models[d]` with `names[d]`
    /// = (from, to) is direction `d`. Time zero of the models is `epoch`.
    pub fn start(
        ports: Vec<Tun>,
        routing: Routing,
        models: Vec<LinkModel>,
        names: Vec<(String, String)>,
        epoch: Instant,
        realtime: bool,
    ) -> std::io::Result<Emulator> {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new(Stats::default()));
        let mut state = Loop {
            directions: names
                .into_iter()
                .map(|(from, to)| DirectionStats {
                    from,
                    to,
                    ..Default::default()
                })
                .collect(),
            ports,
            routing,
            models,
            heap: BinaryHeap::with_capacity(4096),
            free: Vec::new(),
            allocated: 0,
            seq: 0,
            stats: Stats::default(),
            epoch,
        };
        let thread = {
            let stop = stop.clone();
            let shared = stats.clone();
            std::thread::Builder::new()
                .name("netlab-emulator".into())
                .spawn(move || {
                    state.stats.realtime =
                        sys::tune_current_thread(realtime.then_some(EMULATOR_PRIORITY));
                    state.run(&stop, &shared);
                })?
        };
        Ok(Emulator {
            stop,
            stats,
            thread: Some(thread),
            epoch,
        })
    }

    /// The latest statistics (at most [`PUBLISH_EVERY`] old).
    pub fn stats(&self) -> Stats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Time zero of the link models.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Stops the thread and closes the devices (which removes them).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Loop {
    ports: Vec<Tun>,
    routing: Routing,
    models: Vec<LinkModel>,
    directions: Vec<DirectionStats>,
    heap: BinaryHeap<Pending>,
    free: Vec<Box<[u8]>>,
    allocated: usize,
    seq: u64,
    stats: Stats,
    epoch: Instant,
}

impl Loop {
    fn run(&mut self, stop: &AtomicBool, shared: &Mutex<Stats>) {
        let fds: Vec<_> = self.ports.iter().map(Tun::raw_fd).collect();
        let mut ready = vec![false; fds.len()];
        let mut last_publish = Instant::now();
        self.publish(shared);
        while !stop.load(Ordering::Relaxed) {
            self.release_due();
            let now = self.epoch.elapsed();
            let timeout = match self.heap.peek() {
                Some(p) => p.due.saturating_sub(now + WAKE_EARLY).min(MAX_SLEEP),
                None => MAX_SLEEP,
            };
            if sys::wait_readable(&fds, &mut ready, timeout).is_err() {
                self.stats.io_errors += 1;
            }
            for (port, is_ready) in ready.iter().enumerate() {
                if *is_ready {
                    self.read_port(port);
                }
            }
            if last_publish.elapsed() >= PUBLISH_EVERY {
                self.publish(shared);
                last_publish = Instant::now();
            }
        }
        self.publish(shared);
    }

    fn publish(&mut self, shared: &Mutex<Stats>) {
        self.stats.directions.clone_from(&self.directions);
        if let Ok(mut s) = shared.lock() {
            s.clone_from(&self.stats);
        }
    }

    fn buffer(&mut self) -> Option<Box<[u8]>> {
        if let Some(b) = self.free.pop() {
            return Some(b);
        }
        if self.allocated >= MAX_PENDING + READ_BATCH {
            return None;
        }
        self.allocated += 1;
        Some(vec![0u8; BUF_SIZE].into_boxed_slice())
    }

    fn read_port(&mut self, port: usize) {
        for _ in 0..READ_BATCH {
            let Some(mut buf) = self.buffer() else {
                // Out of buffers: read into a scratch buffer and count the drop.
                let mut scratch = [0u8; BUF_SIZE];
                match self.ports[port].read(&mut scratch) {
                    Ok(Some(_)) => self.stats.overflow += 1,
                    Ok(None) => return,
                    Err(_) => {
                        self.stats.io_errors += 1;
                        return;
                    }
                }
                continue;
            };
            let len = match self.ports[port].read(&mut buf) {
                Ok(Some(n)) => n,
                Ok(None) => {
                    self.free.push(buf);
                    return;
                }
                Err(_) => {
                    self.stats.io_errors += 1;
                    self.free.push(buf);
                    return;
                }
            };
            let arrival = self.epoch.elapsed();
            self.forward(port, arrival, buf, len);
            // Releases keep their timing even while a device is busy.
            if self
                .heap
                .peek()
                .is_some_and(|p| p.due <= arrival + RELEASE_SLACK)
            {
                self.release_due();
            }
        }
    }

    fn forward(&mut self, from: usize, arrival: Duration, buf: Box<[u8]>, len: usize) {
        let packet = &buf[..len];
        let to = ipv4_destination(packet).and_then(|dst| {
            self.routing
                .addresses
                .iter()
                .find(|(a, _)| *a == dst)
                .map(|(_, h)| *h)
        });
        let dir = to.and_then(|to| self.routing.direction[from * self.routing.hosts + to]);
        let (Some(to), Some(dir)) = (to, dir) else {
            self.stats.no_route += 1;
            self.free.push(buf);
            return;
        };
        let d = &mut self.directions[dir];
        d.received += 1;
        match self.models[dir].on_packet(arrival, packet) {
            Verdict::Drop(reason) => {
                let i = DropReason::ALL
                    .iter()
                    .position(|r| *r == reason)
                    .expect("ALL lists every reason");
                d.drops[i] += 1;
                self.free.push(buf);
            }
            Verdict::Deliver(due) => self.schedule(due, to, dir, buf, len),
            Verdict::Duplicate(due) => {
                d.duplicated += 1;
                if let Some(mut copy) = self.buffer() {
                    copy[..len].copy_from_slice(&buf[..len]);
                    self.schedule(due, to, dir, copy, len);
                } else {
                    self.stats.overflow += 1;
                }
                self.schedule(due, to, dir, buf, len);
            }
        }
    }

    fn schedule(&mut self, due: Duration, port: usize, dir: usize, buf: Box<[u8]>, len: usize) {
        if self.heap.len() >= MAX_PENDING {
            self.stats.overflow += 1;
            self.free.push(buf);
            return;
        }
        self.seq += 1;
        self.heap.push(Pending {
            due,
            seq: self.seq,
            port,
            dir,
            len,
            buf,
        });
    }

    /// Writes every packet that is due; when the next one is due within [`WAKE_EARLY`], waits
    /// for it here without sleeping.
    fn release_due(&mut self) {
        loop {
            let Some(next) = self.heap.peek() else {
                return;
            };
            let now = self.epoch.elapsed();
            if next.due > now + RELEASE_SLACK {
                if next.due > now + WAKE_EARLY {
                    return;
                }
                std::hint::spin_loop();
                // A short busy wait; still serve devices so input is not starved.
                if next.due > now + Duration::from_micros(20) {
                    return;
                }
                continue;
            }
            let p = self.heap.pop().expect("peeked just above");
            let error_ns = now.as_nanos() as i64 - p.due.as_nanos() as i64;
            self.stats.lateness.record(error_ns);
            match self.ports[p.port].write(&p.buf[..p.len]) {
                Ok(()) => self.directions[p.dir].delivered += 1,
                Err(_) => self.stats.io_errors += 1,
            }
            self.free.push(p.buf);
        }
    }
}
