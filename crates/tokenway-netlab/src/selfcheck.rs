//! `selfcheck`: measures the emulator on this machine and says whether it meets its targets:
//! releases within ±0.2 ms of their due time (99th percentile) and 50,000 packets/s forwarded.
//!
//! It brings up its own lab (prefix `twchk` by default) with a plain 5 ms one-way delay, sends
//! UDP from the client namespace to a receiver in the server namespace, and reports two
//! numbers per phase: the release error the emulator itself recorded (write time minus due
//! time: the target), and the end-to-end one-way delay error seen by the receiver (which adds
//! the kernel path and the receiver thread's wake-up; informative).

use std::fmt;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::config::{LabConfig, CLIENT, SERVER};
use crate::lab::Lab;
use crate::model::Conditions;
use crate::profile::Profile;
use crate::{sys, NetlabError};

/// Target: 99 % of releases within this of their due time.
pub const TARGET_RELEASE_ERROR_US: f64 = 200.0;
/// Target forwarding rate.
pub const TARGET_PPS: u32 = 50_000;
const DELAY: Duration = Duration::from_millis(5);
const PAYLOAD: usize = 64;
const PORT: u16 = 9000;
/// SCHED_FIFO priority of the sender and receiver threads: below the emulator, above the
/// machine's other work, so the measurement sees the emulator rather than the machine's load.
const TRAFFIC_PRIORITY: i32 = 5;

/// Options of the self-check.
#[derive(Debug, Clone)]
pub struct SelfcheckOptions {
    /// Name prefix of the self-check's own lab.
    pub prefix: String,
    /// Offered rate of the throughput phase, packets/s.
    pub rate_pps: u32,
    /// Length of the throughput phase.
    pub duration: Duration,
}

impl Default for SelfcheckOptions {
    fn default() -> Self {
        Self {
            prefix: "twchk".into(),
            rate_pps: TARGET_PPS,
            duration: Duration::from_secs(3),
        }
    }
}

/// Results of one phase.
#[derive(Debug, Clone, Default)]
pub struct Phase {
    /// Offered rate, packets/s.
    pub offered_pps: u32,
    /// Packets sent.
    pub sent: u64,
    /// Packets received.
    pub received: u64,
    /// Send rate achieved, packets/s.
    pub sent_pps: f64,
    /// Receive rate achieved, packets/s.
    pub received_pps: f64,
    /// Emulator release error quantiles (µs, + = late): p50, p99, p99.9; and max.
    pub release_us: [f64; 4],
    /// 99th percentile of the absolute release error, µs.
    pub release_abs_p99_us: f64,
    /// End-to-end one-way delay error quantiles (µs): p50, p99, p99.9, max.
    pub e2e_us: [f64; 4],
}

/// The whole report.
#[derive(Debug, Clone, Default)]
pub struct SelfcheckReport {
    /// Low-rate phase (2,000 packets/s for 1 s): timing accuracy.
    pub accuracy: Phase,
    /// Full-rate phase: throughput, and accuracy under load.
    pub throughput: Phase,
    /// Whether the emulator thread got real-time priority.
    pub realtime: bool,
    /// Whether the targets were met.
    pub pass: bool,
}

/// Runs the self-check (needs root; takes a few seconds).
pub fn selfcheck(opts: &SelfcheckOptions) -> Result<SelfcheckReport, NetlabError> {
    let profile = Profile::symmetric(
        "selfcheck",
        Conditions {
            delay: DELAY,
            ..Default::default()
        },
    );
    let config = LabConfig::from_profile(&opts.prefix, &profile, 1);
    let lab = Lab::up(config)?;
    let server = SocketAddr::new(
        lab.address(SERVER).expect("server host exists").into(),
        PORT,
    );
    let client = SocketAddr::new(lab.address(CLIENT).expect("client host exists").into(), 0);
    let rx = lab
        .run_in(SERVER, || UdpSocket::bind(server))?
        .map_err(|e| NetlabError::io("binding the receiver", e))?;
    let tx = lab
        .run_in(CLIENT, || {
            let s = UdpSocket::bind(client)?;
            s.connect(server)?;
            Ok::<_, std::io::Error>(s)
        })?
        .map_err(|e| NetlabError::io("binding the sender", e))?;
    sys::set_socket_buffers(rx.as_raw_fd(), 32 << 20);
    sys::set_socket_buffers(tx.as_raw_fd(), 4 << 20);
    rx.set_read_timeout(Some(Duration::from_millis(50)))
        .map_err(|e| NetlabError::io("receiver timeout", e))?;
    // Let the devices settle.
    std::thread::sleep(Duration::from_millis(100));
    let accuracy = run_phase(&lab, &tx, &rx, 2_000, Duration::from_secs(1));
    let throughput = run_phase(&lab, &tx, &rx, opts.rate_pps, opts.duration);
    let realtime = lab.stats().realtime;
    lab.down()?;
    let target = f64::from(opts.rate_pps.min(TARGET_PPS)) * 0.98;
    let pass = accuracy.release_abs_p99_us <= TARGET_RELEASE_ERROR_US
        && throughput.release_abs_p99_us <= TARGET_RELEASE_ERROR_US
        && throughput.received_pps >= target
        && throughput.received as f64 >= throughput.sent as f64 * 0.99
        && opts.rate_pps >= TARGET_PPS;
    Ok(SelfcheckReport {
        accuracy,
        throughput,
        realtime,
        pass,
    })
}

fn run_phase(lab: &Lab, tx: &UdpSocket, rx: &UdpSocket, rate: u32, duration: Duration) -> Phase {
    let before = lab.stats().lateness;
    let base = Instant::now();
    let done = AtomicBool::new(false);
    let (sent, errors) = std::thread::scope(|s| {
        let receiver = s.spawn(|| {
            sys::tune_current_thread(Some(TRAFFIC_PRIORITY));
            let mut errors: Vec<i64> = Vec::with_capacity(rate as usize * 4);
            let mut buf = [0u8; 2048];
            loop {
                match rx.recv(&mut buf) {
                    Ok(n) if n >= 16 => {
                        let now = base.elapsed().as_nanos() as i64;
                        let sent = i64::from_le_bytes(buf[8..16].try_into().expect("8 bytes"));
                        errors.push(now - sent - DELAY.as_nanos() as i64);
                    }
                    Ok(_) => {}
                    Err(_) => {
                        if done.load(Ordering::Relaxed) {
                            return errors;
                        }
                    }
                }
            }
        });
        let sender = s.spawn(|| {
            sys::tune_current_thread(Some(TRAFFIC_PRIORITY));
            send_paced(tx, base, rate, duration)
        });
        let (sent, send_time) = sender.join().unwrap_or((0, Duration::ZERO));
        std::thread::sleep(DELAY + Duration::from_millis(200));
        done.store(true, Ordering::Relaxed);
        let errors = receiver.join().unwrap_or_default();
        (sent, (errors, send_time))
    });
    let (mut errors, send_time) = errors;
    let lateness = lab.stats().lateness.since(&before);
    errors.sort_unstable();
    let q = |v: &[i64], q: f64| -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
        v[i] as f64 / 1000.0
    };
    Phase {
        offered_pps: rate,
        sent,
        received: errors.len() as u64,
        sent_pps: sent as f64 / send_time.as_secs_f64(),
        received_pps: errors.len() as f64 / send_time.as_secs_f64(),
        release_us: [
            lateness.quantile(0.5),
            lateness.quantile(0.99),
            lateness.quantile(0.999),
            lateness.quantile(1.0),
        ],
        release_abs_p99_us: lateness.abs_quantile(0.99),
        e2e_us: [
            q(&errors, 0.5),
            q(&errors, 0.99),
            q(&errors, 0.999),
            q(&errors, 1.0),
        ],
    }
}

/// Sends `rate` packets/s for `duration`, each stamped with its sequence number and send
/// time (ns since `base`). Returns (packets sent, time taken).
fn send_paced(tx: &UdpSocket, base: Instant, rate: u32, duration: Duration) -> (u64, Duration) {
    let mut packet = [0u8; PAYLOAD];
    let mut sent = 0u64;
    let total = (f64::from(rate) * duration.as_secs_f64()) as u64;
    while sent < total {
        let due = (base.elapsed().as_secs_f64() * f64::from(rate)) as u64;
        while sent < due.min(total) {
            packet[..8].copy_from_slice(&sent.to_le_bytes());
            let now = base.elapsed().as_nanos() as i64;
            packet[8..16].copy_from_slice(&now.to_le_bytes());
            if tx.send(&packet).is_err() {
                // Queue full (ENOBUFS): back off briefly, do not count it as sent.
                break;
            }
            sent += 1;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    (sent, base.elapsed())
}

fn phase_lines(f: &mut fmt::Formatter<'_>, name: &str, p: &Phase) -> fmt::Result {
    writeln!(
        f,
        "{name}: offered {} pkt/s, sent {} ({:.0} pkt/s), received {} ({:.0} pkt/s, {:.2} % lost)",
        p.offered_pps,
        p.sent,
        p.sent_pps,
        p.received,
        p.received_pps,
        if p.sent == 0 {
            0.0
        } else {
            100.0 * (p.sent.saturating_sub(p.received)) as f64 / p.sent as f64
        }
    )?;
    writeln!(
        f,
        "  release error (emulator): p50 {:+.0} us, p99 {:+.0} us, p99.9 {:+.0} us, max {:+.0} us; |err| p99 {:.0} us",
        p.release_us[0], p.release_us[1], p.release_us[2], p.release_us[3], p.release_abs_p99_us
    )?;
    writeln!(
        f,
        "  one-way delay error (end to end, incl. kernel and receiver wake-up): p50 {:+.0} us, p99 {:+.0} us, p99.9 {:+.0} us, max {:+.0} us",
        p.e2e_us[0], p.e2e_us[1], p.e2e_us[2], p.e2e_us[3]
    )
}

impl fmt::Display for SelfcheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "netlab selfcheck: 5 ms one-way delay, {PAYLOAD}-byte UDP, emulator thread {}",
            if self.realtime {
                "SCHED_FIFO"
            } else {
                "normal priority"
            }
        )?;
        phase_lines(f, "accuracy", &self.accuracy)?;
        phase_lines(f, "throughput", &self.throughput)?;
        writeln!(
            f,
            "targets: |release error| p99 <= {TARGET_RELEASE_ERROR_US:.0} us in both phases, >= {TARGET_PPS} pkt/s forwarded with < 1 % loss"
        )?;
        write!(f, "{}", if self.pass { "PASS" } else { "FAIL" })
    }
}
