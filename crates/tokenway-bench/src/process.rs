//! Servers under test as child processes, and what /proc says about them.
//!
//! Every server (sim, gateway, nginx) runs in its own process so that its memory (VmHWM,
//! VmRSS) and CPU time can be read from `/proc/PID/...` without the load generator's own
//! allocations mixed in. A [`ChildProcess`] kills its process (and, for a master/worker server
//! such as nginx, the workers) when dropped, so an error or a panic in the bench never leaves
//! servers running.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde::Serialize;

use crate::BenchError;

/// Linux's USER_HZ: the unit of utime/stime in `/proc/PID/stat` (100 on every mainstream
/// architecture; the kernel's internal HZ does not change it).
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

/// A running child server; killed on drop.
pub struct ChildProcess {
    name: String,
    child: Child,
    log: PathBuf,
}

impl ChildProcess {
    /// Starts `command` with stdout piped and stderr appended to `log`, and waits up to
    /// `timeout` for a stdout line `"<banner> http://ADDR"`; returns the process and ADDR.
    /// Later stdout output is drained and discarded.
    pub async fn spawn_with_banner(
        name: &str,
        mut command: Command,
        banner: &str,
        log: &Path,
        timeout: Duration,
    ) -> Result<(Self, SocketAddr), BenchError> {
        command.stdout(Stdio::piped());
        let mut process = Self::spawn(name, command, log)?;
        let stdout = process
            .child
            .stdout
            .take()
            .expect("stdout was configured as a pipe just above");
        let (tx, rx) = tokio::sync::oneshot::channel::<String>();
        let prefix = format!("{banner} http://");
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.trim().strip_prefix(&prefix) {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(rest.trim_end_matches('/').to_owned());
                    }
                }
            }
        });
        let addr = match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(addr)) => addr,
            Ok(Err(_)) => {
                let status = process.child.try_wait().ok().flatten();
                return Err(process.startup_error(format!(
                    "exited ({}) without printing \"{banner} http://ADDR\"",
                    status.map_or("still running".to_owned(), |s| s.to_string())
                )));
            }
            Err(_) => {
                return Err(process.startup_error(format!(
                    "did not print \"{banner} http://ADDR\" within {timeout:?}"
                )))
            }
        };
        let addr = addr.parse::<SocketAddr>().map_err(|e| {
            process.startup_error(format!("printed an unparsable address {addr:?}: {e}"))
        })?;
        Ok((process, addr))
    }

    /// Starts `command` with stdout piped and stderr appended to `log`, and waits up to
    /// `timeout` until, for every prefix in `wanted`, a stdout line starting with it has been
    /// printed; returns the process and, per prefix in order, the rest of its first such line
    /// (trimmed). For servers that announce several addresses (the gateway prints its TCP, TLS,
    /// HTTP/3 and tunnel ports on separate lines). Later stdout output is drained and discarded.
    pub async fn spawn_with_lines(
        name: &str,
        mut command: Command,
        wanted: &[&str],
        log: &Path,
        timeout: Duration,
    ) -> Result<(Self, Vec<String>), BenchError> {
        command.stdout(Stdio::piped());
        let mut process = Self::spawn(name, command, log)?;
        let stdout = process
            .child
            .stdout
            .take()
            .expect("stdout was configured as a pipe just above");
        let (tx, rx) = tokio::sync::oneshot::channel::<Vec<String>>();
        let prefixes: Vec<String> = wanted.iter().map(|p| (*p).to_owned()).collect();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            let mut found: Vec<Option<String>> = vec![None; prefixes.len()];
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let line = line.trim();
                for (i, prefix) in prefixes.iter().enumerate() {
                    if found[i].is_none() {
                        if let Some(rest) = line.strip_prefix(prefix.as_str()) {
                            found[i] = Some(rest.trim().to_owned());
                        }
                    }
                }
                if found.iter().all(Option::is_some) {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(found.iter().flatten().cloned().collect());
                    }
                }
            }
        });
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(lines)) => Ok((process, lines)),
            Ok(Err(_)) => {
                let status = process.child.try_wait().ok().flatten();
                Err(process.startup_error(format!(
                    "exited ({}) before printing lines starting with {wanted:?}",
                    status.map_or("still running".to_owned(), |s| s.to_string())
                )))
            }
            Err(_) => Err(process.startup_error(format!(
                "did not print lines starting with {wanted:?} within {timeout:?}"
            ))),
        }
    }

    /// Starts `command` with stdin closed, stdout discarded and stderr appended to `log`.
    pub fn spawn(name: &str, mut command: Command, log: &Path) -> Result<Self, BenchError> {
        let log_file = File::create(log).map_err(|source| BenchError::Io {
            context: format!("cannot create log file {}", log.display()),
            source,
        })?;
        command.stdin(Stdio::null()).stderr(log_file);
        let child = command.spawn().map_err(|source| BenchError::Io {
            context: format!("cannot start {name} ({:?})", command.get_program()),
            source,
        })?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log: log.to_owned(),
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Err` when the process has already exited.
    pub fn check_running(&mut self) -> Result<(), BenchError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(self.startup_error(format!("exited ({status})"))),
            Err(e) => Err(self.startup_error(format!("cannot be waited for: {e}"))),
        }
    }

    /// An error naming this process and its log file.
    pub fn startup_error(&self, message: String) -> BenchError {
        BenchError::Child {
            name: self.name.clone(),
            message: format!("{message}; see {}", self.log.display()),
        }
    }

    /// The process and its direct children (nginx workers), for memory and CPU accounting.
    fn pids(&self) -> Vec<u32> {
        let pid = self.pid();
        let mut pids = vec![pid];
        pids.extend(children_of(pid));
        pids
    }

    /// Memory of the process plus its direct children (summed).
    pub fn memory(&self) -> Option<Memory> {
        let mut total = Memory::default();
        for pid in self.pids() {
            let m = read_memory(pid)?;
            total.rss_kib += m.rss_kib;
            total.hwm_kib += m.hwm_kib;
        }
        Some(total)
    }

    /// CPU time (user + system) of the process plus its direct children, seconds.
    pub fn cpu_seconds(&self) -> Option<f64> {
        self.pids().into_iter().map(cpu_seconds_of).sum()
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        // Note the workers first, then kill the parent (so it cannot fork replacements), then
        // the workers, which would otherwise live on re-parented to init.
        let pid = self.pid();
        let workers = children_of(pid);
        let _ = self.child.kill();
        for worker in workers {
            let _ = Command::new("kill")
                .args(["-KILL", &worker.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        let _ = self.child.wait();
    }
}

/// Processes whose parent is `pid`. `/proc/PID/task/TID/children` would be cheaper but needs
/// CONFIG_PROC_CHILDREN, which some kernels lack, so this scans `/proc/*/stat`.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|stat| parse_stat_ppid(&stat))
                == Some(pid)
        })
        .collect()
}

/// Resident memory of a process, KiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Memory {
    /// VmRSS: resident now.
    pub rss_kib: u64,
    /// VmHWM: peak resident since start.
    pub hwm_kib: u64,
}

/// Reads VmRSS and VmHWM from `/proc/PID/status`.
pub fn read_memory(pid: u32) -> Option<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_status(&status)
}

fn parse_status(status: &str) -> Option<Memory> {
    let field = |key: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    Some(Memory {
        rss_kib: field("VmRSS:")?,
        hwm_kib: field("VmHWM:")?,
    })
}

/// CPU time (utime + stime) of a process, seconds; `None` if it cannot be read.
pub fn cpu_seconds_of(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_cpu(&stat)
}

/// CPU time of this (the load generator's) process, seconds.
pub fn own_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_stat_cpu(&stat)
}

fn parse_stat_ppid(stat: &str) -> Option<u32> {
    // Field 4 (ppid) is the second field after the command name's closing ')'.
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn parse_stat_cpu(stat: &str) -> Option<f64> {
    // The command name (field 2) may contain spaces; fields after its closing ')' start at
    // field 3 (state); utime and stime are fields 14 and 15.
    let after = &stat[stat.rfind(')')? + 1..];
    let mut fields = after.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / CLOCK_TICKS_PER_SECOND)
}

/// The machine's CPU time so far from `/proc/stat`, in clock ticks: (all, stolen). Stolen time is
/// when the hypervisor ran something else while a virtual CPU had work: on a shared VM the share
/// stolen during a run says how much of its noise came from outside.
pub fn machine_cpu_ticks() -> Option<(u64, u64)> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// Percent of the CPU time between two [`machine_cpu_ticks`] readings that was stolen.
pub fn steal_percent(before: Option<(u64, u64)>, after: Option<(u64, u64)>) -> Option<f64> {
    let ((all0, steal0), (all1, steal1)) = (before?, after?);
    let all = all1.checked_sub(all0).filter(|&t| t > 0)?;
    Some(steal1.saturating_sub(steal0) as f64 / all as f64 * 100.0)
}

fn parse_proc_stat(stat: &str) -> Option<(u64, u64)> {
    // "cpu  user nice system idle iowait irq softirq steal guest guest_nice": guest time is
    // already in user and nice, so the total is the first eight.
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    (ticks.len() == 8).then(|| (ticks.iter().sum(), ticks[7]))
}

/// Writes a generated file (a config, a script) for a child process.
pub fn write_file(path: &Path, text: &str) -> Result<(), BenchError> {
    std::fs::write(path, text).map_err(|source| BenchError::Io {
        context: format!("cannot write {}", path.display()),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_are_read_in_kib() {
        let s = "Name:\tx\nVmPeak:\t  9 kB\nVmHWM:\t   2048 kB\nVmRSS:\t    1024 kB\n";
        assert_eq!(
            parse_status(s),
            Some(Memory {
                rss_kib: 1024,
                hwm_kib: 2048
            })
        );
        assert_eq!(parse_status("Name:\tkthread\n"), None);
    }

    #[test]
    fn stat_cpu_skips_a_command_name_with_spaces() {
        let stat = "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0";
        assert_eq!(parse_stat_cpu(stat), Some(3.0));
        assert_eq!(parse_stat_ppid(stat), Some(1));
    }
    #[test]
    fn stolen_time_is_read_from_the_cpu_line() {
        let stat = "cpu  100 5 50 800 10 0 5 30 0 0\ncpu0 50 2 25 400 5 0 2 15 0 0\n";
        assert_eq!(parse_proc_stat(stat), Some((1000, 30)));
        assert_eq!(parse_proc_stat("cpu0 1 2 3\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 2 3\n"), None);
        assert_eq!(steal_percent(Some((1000, 30)), Some((2000, 80))), Some(5.0));
        assert_eq!(steal_percent(Some((1000, 30)), Some((1000, 30))), None);
        assert_eq!(steal_percent(None, Some((1000, 30))), None);
    }
}
