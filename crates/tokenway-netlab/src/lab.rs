//! Bringing a lab up and down: namespaces, TUN devices, addresses, routes, the emulator
//! thread, address changes, and the state files of a detached lab.
//!
//! Everything the lab creates is named `{prefix}-{host}`, so clean-up can find it by name even
//! after a crash: namespaces (`ip netns list`), root-namespace links, and the emulator process
//! (its pid file, and a scan of `/proc` for `netlab up ... --name PREFIX`). TUN devices are not
//! persistent: they vanish with the emulator's file descriptors.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::{LabConfig, LAB_NET, MTU};
use crate::emulator::{Emulator, Routing, Stats};
use crate::model::LinkModel;
use crate::netns::{self, ip, ip_batch};
use crate::profile::AddressChange;
use crate::sys::{self, Tun};
use crate::NetlabError;

/// Directory of the pid, state and log files of running labs.
pub const RUN_DIR: &str = "/run/tokenway-netlab";

/// A running lab. Dropping it tears everything down (namespaces, devices, threads), so a
/// test that panics still cleans up.
pub struct Lab {
    config: LabConfig,
    emulator: Option<Emulator>,
    changer: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

/// SplitMix64 step: derives independent seeds per link direction from the lab seed.
fn mix(seed: u64, n: u64) -> u64 {
    let mut z = seed.wrapping_add(n.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Lab {
    /// Creates the namespaces and devices and starts the emulator. Fails if a lab with the
    /// same prefix exists; on failure removes whatever it had created.
    pub fn up(config: LabConfig) -> Result<Lab, NetlabError> {
        if !sys::is_root() {
            return Err(NetlabError::NotRoot);
        }
        config.validate()?;
        if !netns::namespaces_with_prefix(&config.prefix).is_empty()
            || !netns::links_with_prefix(&config.prefix).is_empty()
        {
            return Err(NetlabError::AlreadyUp(config.prefix.clone()));
        }
        match Self::build(&config) {
            Ok(emulator) => {
                let mut lab = Lab {
                    config,
                    emulator: Some(emulator),
                    changer: None,
                };
                lab.start_address_changes();
                Ok(lab)
            }
            Err(e) => {
                netns::remove_with_prefix(&config.prefix);
                Err(e)
            }
        }
    }

    fn build(config: &LabConfig) -> Result<Emulator, NetlabError> {
        let mut ports = Vec::new();
        for host in &config.hosts {
            let name = config.namespace(&host.name);
            ip(&["netns", "add", &name])?;
            let tun = Tun::create(&name)
                .map_err(|e| NetlabError::io(format!("creating TUN {name}"), e))?;
            ip(&["link", "set", &name, "netns", &name])?;
            ip_batch(
                &name,
                &[
                    "link set lo up".to_string(),
                    format!("link set {name} mtu {MTU} txqueuelen 10000 up"),
                    format!("addr add {}/32 dev {name}", host.addresses[0]),
                    format!("route add {LAB_NET} dev {name}"),
                ],
            )?;
            ports.push(tun);
        }
        let n = config.hosts.len();
        let mut routing = Routing {
            addresses: Vec::new(),
            direction: vec![None; n * n],
            hosts: n,
        };
        for (i, h) in config.hosts.iter().enumerate() {
            routing
                .addresses
                .extend(h.addresses.iter().map(|a| (*a, i)));
        }
        let mut models = Vec::new();
        let mut names = Vec::new();
        for link in &config.links {
            let a = config
                .host_index(&link.a)
                .expect("validated: link ends exist");
            let b = config
                .host_index(&link.b)
                .expect("validated: link ends exist");
            for (from, to, spec) in [(a, b, &link.a_to_b), (b, a, &link.b_to_a)] {
                routing.direction[from * n + to] = Some(models.len());
                models.push(LinkModel::new(
                    spec.clone(),
                    mix(config.seed, models.len() as u64),
                ));
                names.push((
                    config.hosts[from].name.clone(),
                    config.hosts[to].name.clone(),
                ));
            }
        }
        Emulator::start(
            ports,
            routing,
            models,
            names,
            Instant::now(),
            config.realtime,
        )
        .map_err(|e| NetlabError::io("starting the emulator thread", e))
    }

    fn start_address_changes(&mut self) {
        if self.config.address_changes.is_empty() {
            return;
        }
        let Some(epoch) = self.emulator.as_ref().map(Emulator::epoch) else {
            return;
        };
        let stop = Arc::new(AtomicBool::new(false));
        let changes: Vec<(String, AddressChange)> = self
            .config
            .address_changes
            .iter()
            .map(|c| (self.config.namespace(&c.host), c.clone()))
            .collect();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || run_address_changes(epoch, &changes, &flag));
        self.changer = Some((stop, thread));
    }

    /// The configuration it was started with.
    pub fn config(&self) -> &LabConfig {
        &self.config
    }

    /// Namespace (and device) name of a host.
    pub fn namespace(&self, host: &str) -> String {
        self.config.namespace(host)
    }

    /// A host's address at start (an address change may replace it later).
    pub fn address(&self, host: &str) -> Option<Ipv4Addr> {
        let h = self.config.host_index(host)?;
        self.config.hosts[h].addresses.first().copied()
    }

    /// Runs `f` inside a host's namespace (see [`netns::run_in_namespace`]).
    pub fn run_in<R: Send>(
        &self,
        host: &str,
        f: impl FnOnce() -> R + Send,
    ) -> Result<R, NetlabError> {
        netns::run_in_namespace(&self.namespace(host), f)
    }

    /// The emulator's counters.
    pub fn stats(&self) -> Stats {
        self.emulator
            .as_ref()
            .map(Emulator::stats)
            .unwrap_or_default()
    }

    /// Stops everything and removes the namespaces; reports what could not be removed.
    pub fn down(mut self) -> Result<(), NetlabError> {
        self.teardown();
        let (ns, links) = leftovers(&self.config.prefix);
        if ns.is_empty() && links.is_empty() {
            Ok(())
        } else {
            Err(NetlabError::Config(format!(
                "left behind after down: namespaces {ns:?}, links {links:?}"
            )))
        }
    }

    fn teardown(&mut self) {
        if let Some((stop, thread)) = self.changer.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = thread.join();
        }
        if let Some(mut e) = self.emulator.take() {
            e.stop();
        }
        netns::remove_with_prefix(&self.config.prefix);
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.teardown();
    }
}

fn run_address_changes(epoch: Instant, changes: &[(String, AddressChange)], stop: &AtomicBool) {
    let mut next: Vec<(Duration, usize)> = changes.iter().map(|(_, c)| (c.first, 0)).collect();
    while !stop.load(Ordering::Relaxed) {
        let now = epoch.elapsed();
        for ((ns, change), (at, current)) in changes.iter().zip(next.iter_mut()) {
            if now < *at {
                continue;
            }
            let old = change.addresses[*current];
            let new_index = (*current + 1) % change.addresses.len();
            let new = change.addresses[new_index];
            // Add the new address before removing the old one: removing a device's last
            // address would flush its routes.
            let result = ip_batch(
                ns,
                &[
                    format!("addr add {new}/32 dev {ns}"),
                    format!("addr del {old}/32 dev {ns}"),
                ],
            );
            match result {
                Ok(()) => tracing::info!(namespace = %ns, %old, %new, "address changed"),
                Err(e) => tracing::warn!("address change failed: {e}"),
            }
            *current = new_index;
            *at += change.every;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Namespaces and root-namespace links left with this prefix.
pub fn leftovers(prefix: &str) -> (Vec<String>, Vec<String>) {
    (
        netns::namespaces_with_prefix(prefix),
        netns::links_with_prefix(prefix),
    )
}

/// Pid file of a detached lab.
pub fn pid_file(prefix: &str) -> PathBuf {
    PathBuf::from(RUN_DIR).join(format!("{prefix}.pid"))
}

/// State file (TOML, refreshed every second) of a running lab.
pub fn state_file(prefix: &str) -> PathBuf {
    PathBuf::from(RUN_DIR).join(format!("{prefix}.toml"))
}

/// Log file (stderr) of a detached lab.
pub fn log_file(prefix: &str) -> PathBuf {
    PathBuf::from(RUN_DIR).join(format!("{prefix}.log"))
}

/// Writes `contents` to `path` atomically (temp file + rename), creating [`RUN_DIR`].
pub fn write_run_file(path: &std::path::Path, contents: &str) -> Result<(), NetlabError> {
    std::fs::create_dir_all(RUN_DIR)
        .map_err(|e| NetlabError::io(format!("creating {RUN_DIR}"), e))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| NetlabError::io(format!("writing {}", path.display()), e))
}

/// What a running lab reports in its state file (TOML), for `status`.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct LabState {
    /// Profile name.
    pub profile: String,
    /// Seed.
    pub seed: u64,
    /// Emulator process id.
    pub pid: u32,
    /// Seconds since the lab came up.
    pub uptime_s: f64,
    /// Hosts as `name address...`.
    pub hosts: Vec<String>,
    /// Whether the emulator thread runs at real-time priority.
    pub realtime: bool,
    /// Median release error, µs.
    pub release_p50_us: f64,
    /// 99th percentile release error, µs.
    pub release_p99_us: f64,
    /// Largest release error, µs.
    pub release_max_us: f64,
    /// Packets to unknown destinations.
    pub no_route: u64,
    /// Packets dropped because the emulator was full.
    pub overflow: u64,
    /// Per-direction counters.
    pub directions: Vec<crate::emulator::DirectionStats>,
}

impl Lab {
    /// A state snapshot for the state file.
    pub fn state(&self) -> LabState {
        let stats = self.stats();
        LabState {
            profile: self.config.profile_name.clone(),
            seed: self.config.seed,
            pid: std::process::id(),
            uptime_s: self
                .emulator
                .as_ref()
                .map(|e| e.epoch().elapsed().as_secs_f64())
                .unwrap_or_default(),
            hosts: self
                .config
                .hosts
                .iter()
                .map(|h| {
                    let addrs: Vec<String> = h.addresses.iter().map(|a| a.to_string()).collect();
                    format!("{} {}", h.name, addrs.join(" "))
                })
                .collect(),
            realtime: stats.realtime,
            release_p50_us: stats.lateness.quantile(0.5),
            release_p99_us: stats.lateness.quantile(0.99),
            release_max_us: stats.lateness.max_us,
            no_route: stats.no_route,
            overflow: stats.overflow,
            directions: stats.directions,
        }
    }

    /// Writes the pid file and the state file (for `status` and `down`).
    pub fn write_state_files(&self) -> Result<(), NetlabError> {
        let prefix = &self.config.prefix;
        write_run_file(&pid_file(prefix), &format!("{}\n", std::process::id()))?;
        let text = toml::to_string(&self.state())
            .map_err(|e| NetlabError::Config(format!("cannot serialise state: {e}")))?;
        write_run_file(&state_file(prefix), &text)
    }
}

/// The state a detached lab last wrote, if any.
pub fn read_state(prefix: &str) -> Option<LabState> {
    let text = std::fs::read_to_string(state_file(prefix)).ok()?;
    toml::from_str(&text).ok()
}

/// Command line of a process, split at NULs.
fn cmdline(pid: i32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

/// Whether `args` is the emulator process of the lab `prefix`
/// (`... netlab up ... --name PREFIX ...`).
fn is_lab_process(args: &[String], prefix: &str) -> bool {
    let up = args.windows(2).any(|w| w[0] == "netlab" && w[1] == "up");
    let named = args.windows(2).any(|w| w[0] == "--name" && w[1] == prefix)
        || args.iter().any(|a| *a == format!("--name={prefix}"));
    let unnamed = !args.iter().any(|a| a.starts_with("--name"));
    up && (named || (unnamed && prefix == crate::config::DEFAULT_PREFIX))
}

/// Pids of running emulator processes of the lab `prefix`, from the pid file and `/proc`.
pub fn lab_processes(prefix: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut pids = Vec::new();
    if let Ok(text) = std::fs::read_to_string(pid_file(prefix)) {
        if let Ok(pid) = text.trim().parse::<i32>() {
            if cmdline(pid).is_some_and(|a| is_lab_process(&a, prefix)) {
                pids.push(pid);
            }
        }
    }
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<i32>().ok())
            else {
                continue;
            };
            if pid != me
                && !pids.contains(&pid)
                && cmdline(pid).is_some_and(|a| is_lab_process(&a, prefix))
            {
                pids.push(pid);
            }
        }
    }
    pids
}

/// What [`down`] removed.
#[derive(Debug, Default)]
pub struct DownReport {
    /// Emulator processes stopped.
    pub processes: Vec<i32>,
    /// Namespaces deleted.
    pub namespaces: Vec<String>,
    /// Links deleted.
    pub links: Vec<String>,
}

/// Removes every trace of the lab `prefix`: stops its emulator process (SIGTERM, then SIGKILL
/// after 3 s), deletes its namespaces and links and its files under [`RUN_DIR`]. Works after
/// a crash and when nothing is left (then it removes nothing).
pub fn down(prefix: &str) -> Result<DownReport, NetlabError> {
    crate::config::validate_prefix(prefix)?;
    if !sys::is_root() {
        return Err(NetlabError::NotRoot);
    }
    let mut report = DownReport {
        processes: lab_processes(prefix),
        ..Default::default()
    };
    for pid in &report.processes {
        sys::kill(*pid, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while report
        .processes
        .iter()
        .any(|p| std::path::Path::new(&format!("/proc/{p}")).exists() && !is_zombie(*p))
    {
        if Instant::now() > deadline {
            for pid in &report.processes {
                sys::kill(*pid, libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(100));
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (namespaces, links) = netns::remove_with_prefix(prefix);
    report.namespaces = namespaces;
    report.links = links;
    for f in [pid_file(prefix), state_file(prefix)] {
        let _ = std::fs::remove_file(f);
    }
    let (ns, links) = leftovers(prefix);
    if !ns.is_empty() || !links.is_empty() {
        return Err(NetlabError::Config(format!(
            "could not remove namespaces {ns:?} / links {links:?}"
        )));
    }
    Ok(report)
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('Z'))
        })
        .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split(' ').map(str::to_string).collect()
    }

    #[test]
    fn lab_process_is_recognised_by_its_name_only() {
        assert!(is_lab_process(
            &args("/x/tokenway netlab up --profile 4g --name twlab --detached-child"),
            "twlab"
        ));
        assert!(!is_lab_process(
            &args("/x/tokenway netlab up --name twlab2"),
            "twlab"
        ));
        assert!(!is_lab_process(
            &args("/x/tokenway netlab down --name twlab"),
            "twlab"
        ));
        assert!(!is_lab_process(&args("vim --name twlab up"), "twlab"));
    }

    #[test]
    fn derived_seeds_differ_per_direction() {
        assert_ne!(mix(1, 0), mix(1, 1));
        assert_ne!(mix(1, 0), mix(2, 0));
    }
}
