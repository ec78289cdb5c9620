//! `tokenway netlab`: emulated lossy links between network namespaces (see `docs/netlab.md`).
//!
//! Flag parsing and process handling only; `tokenway-netlab` does the work.

use std::io::BufRead as _;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};
use tokenway_netlab::lab::{self, LabState};
use tokenway_netlab::selfcheck::{self, SelfcheckOptions};
use tokenway_netlab::{Lab, LabConfig, Profile, DEFAULT_PREFIX};

/// Subcommands of `tokenway netlab`.
#[derive(clap::Subcommand)]
pub enum NetlabCommand {
    /// Create the client and server namespaces and run the link emulator between them
    /// (in the foreground until Ctrl-C, or in the background with --detach).
    Up(UpArgs),
    /// Stop the emulator and remove every namespace and device of a lab (also after a crash).
    Down(NameArg),
    /// Run a command inside a host's namespace: `tokenway netlab exec client -- curl ...`.
    Exec(ExecArgs),
    /// Show the namespaces, addresses, emulator process and counters of a lab.
    Status(NameArg),
    /// Measure the emulator's release accuracy and packet rate on this machine; PASS or FAIL.
    Selfcheck(SelfcheckArgs),
    /// List the built-in link profiles.
    Profiles,
}

/// Flags of `netlab up`.
#[derive(clap::Args)]
pub struct UpArgs {
    /// Built-in profile name (see `netlab profiles`) or path to a profile TOML file.
    #[arg(long, value_name = "NAME|FILE", default_value = "fiber")]
    pub profile: String,
    /// Name prefix of the namespaces and devices (1 to 8 lowercase letters or digits).
    #[arg(long, value_name = "PREFIX", default_value = DEFAULT_PREFIX)]
    pub name: String,
    /// Seed of every random decision of the link model.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Run the emulator in the background and return once the link is ready.
    #[arg(long)]
    pub detach: bool,
    /// Internal: this process is the background emulator started by --detach.
    #[arg(long, hide = true)]
    pub detached_child: bool,
}

/// The `--name` flag alone.
#[derive(clap::Args)]
pub struct NameArg {
    /// Name prefix of the lab.
    #[arg(long, value_name = "PREFIX", default_value = DEFAULT_PREFIX)]
    pub name: String,
}

/// Flags of `netlab exec`.
#[derive(clap::Args)]
pub struct ExecArgs {
    /// Host to run in: `client` or `server`.
    pub side: String,
    /// Name prefix of the lab.
    #[arg(long, value_name = "PREFIX", default_value = DEFAULT_PREFIX)]
    pub name: String,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Flags of `netlab selfcheck`.
#[derive(clap::Args)]
pub struct SelfcheckArgs {
    /// Name prefix of the self-check's own lab.
    #[arg(long, value_name = "PREFIX", default_value = "twchk")]
    pub name: String,
    /// Offered packet rate of the throughput phase.
    #[arg(long, value_name = "PPS", default_value_t = selfcheck::TARGET_PPS)]
    pub rate: u32,
    /// Length of the throughput phase, seconds.
    #[arg(long, value_name = "S", default_value_t = 3.0)]
    pub seconds: f64,
}

/// Runs a `netlab` subcommand.
pub async fn run(command: NetlabCommand) -> anyhow::Result<()> {
    match command {
        NetlabCommand::Up(args) if args.detach && !args.detached_child => detach(&args).await,
        NetlabCommand::Up(args) => up(args).await,
        NetlabCommand::Down(args) => {
            let name = args.name;
            let report = tokio::task::spawn_blocking(move || lab::down(&name)).await??;
            if report.processes.is_empty()
                && report.namespaces.is_empty()
                && report.links.is_empty()
            {
                println!("nothing to remove");
            } else {
                println!(
                    "stopped {:?}, removed namespaces {:?}, links {:?}",
                    report.processes, report.namespaces, report.links
                );
            }
            Ok(())
        }
        NetlabCommand::Exec(args) => exec(args),
        NetlabCommand::Status(args) => {
            status(&args.name);
            Ok(())
        }
        NetlabCommand::Selfcheck(args) => {
            if !(0.5..=60.0).contains(&args.seconds) {
                bail!("--seconds {} is out of range (0.5 to 60)", args.seconds);
            }
            let opts = SelfcheckOptions {
                prefix: args.name,
                rate_pps: args.rate,
                duration: Duration::from_secs_f64(args.seconds),
            };
            let report = tokio::task::spawn_blocking(move || selfcheck::selfcheck(&opts)).await??;
            println!("{report}");
            if !report.pass {
                bail!("selfcheck did not meet its targets");
            }
            Ok(())
        }
        NetlabCommand::Profiles => {
            for (name, _) in tokenway_netlab::profile::BUILTIN {
                let p = Profile::builtin(name)?;
                println!("{name:12} {}", p.description);
            }
            Ok(())
        }
    }
}

async fn up(args: UpArgs) -> anyhow::Result<()> {
    let profile = Profile::load(&args.profile)?;
    let config = LabConfig::from_profile(&args.name, &profile, args.seed);
    let lab = tokio::task::spawn_blocking(move || Lab::up(config)).await??;
    describe(&lab, &profile);
    lab.write_state_files()?;
    if args.detached_child {
        // The parent waits for this line on our stdout.
        println!("ready");
    } else {
        println!("running; Ctrl-C stops the emulator and removes the namespaces");
    }
    let shutdown = super::signal::shutdown();
    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tick.tick() => {
                if let Err(e) = lab.write_state_files() {
                    tracing::warn!("{e}");
                }
            }
        }
    }
    print_state(&lab.state());
    let name = args.name.clone();
    tokio::task::spawn_blocking(move || lab.down()).await??;
    let _ = std::fs::remove_file(lab::pid_file(&name));
    let _ = std::fs::remove_file(lab::state_file(&name));
    println!("netlab {name} down");
    Ok(())
}

fn describe(lab: &Lab, profile: &Profile) {
    let c = lab.config();
    println!(
        "netlab {} up: profile {} ({}), seed {}",
        c.prefix, profile.name, profile.description, c.seed
    );
    for h in &c.hosts {
        let addrs: Vec<String> = h.addresses.iter().map(|a| a.to_string()).collect();
        println!(
            "  {:7} namespace {:14} device {:14} address {}",
            h.name,
            c.namespace(&h.name),
            c.namespace(&h.name),
            addrs.join(", then ")
        );
    }
    println!(
        "  run inside: tokenway netlab exec client{} -- COMMAND",
        if c.prefix == DEFAULT_PREFIX {
            String::new()
        } else {
            format!(" --name {}", c.prefix)
        }
    );
}

async fn detach(args: &UpArgs) -> anyhow::Result<()> {
    // Fail early, in the foreground, on a bad profile or name.
    let profile = Profile::load(&args.profile)?;
    LabConfig::from_profile(&args.name, &profile, args.seed).validate()?;
    let profile_arg = if Path::new(&args.profile).exists() {
        std::fs::canonicalize(&args.profile)?
            .to_string_lossy()
            .into_owned()
    } else {
        args.profile.clone()
    };
    let exe = std::env::current_exe().context("cannot find our own executable")?;
    std::fs::create_dir_all(lab::RUN_DIR).with_context(|| format!("creating {}", lab::RUN_DIR))?;
    let log_path = lab::log_file(&args.name);
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let mut child = Command::new(exe)
        .args([
            "netlab",
            "up",
            "--profile",
            &profile_arg,
            "--name",
            &args.name,
            "--seed",
            &args.seed.to_string(),
            "--detached-child",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        // Own process group: a Ctrl-C in this terminal does not reach the emulator.
        .process_group(0)
        .spawn()
        .context("cannot start the background emulator")?;
    let stdout = child.stdout.take().context("child stdout is piped")?;
    let pid = child.id();
    let lines = tokio::task::spawn_blocking(move || {
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let ready = line == "ready";
            lines.push(line);
            if ready {
                break;
            }
        }
        lines
    })
    .await?;
    if lines.last().map(String::as_str) != Some("ready") {
        let _ = child.wait();
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        bail!(
            "the background emulator did not start:\n{}{}",
            lines.join("\n"),
            log.trim()
        );
    }
    for line in &lines[..lines.len() - 1] {
        println!("{line}");
    }
    println!(
        "emulator running in the background (pid {pid}, log {}); stop it with `tokenway netlab down{}`",
        log_path.display(),
        if args.name == DEFAULT_PREFIX {
            String::new()
        } else {
            format!(" --name {}", args.name)
        }
    );
    Ok(())
}

fn exec(args: ExecArgs) -> anyhow::Result<()> {
    tokenway_netlab::config::validate_prefix(&args.name)?;
    let ns = tokenway_netlab::config::namespace_name(&args.name, &args.side);
    if !tokenway_netlab::netns::namespaces_with_prefix(&args.name).contains(&ns) {
        bail!(
            "no namespace {ns}: is the lab up (`tokenway netlab up --name {}`), and is {:?} one of its hosts (client, server)?",
            args.name,
            args.side
        );
    }
    let err = Command::new("ip")
        .args(["netns", "exec", &ns])
        .args(&args.command)
        .exec();
    bail!("cannot run `ip netns exec {ns} ...`: {err}")
}

fn status(name: &str) {
    let (namespaces, links) = lab::leftovers(name);
    let pids = lab::lab_processes(name);
    if namespaces.is_empty() && links.is_empty() && pids.is_empty() {
        println!("netlab {name}: down");
        return;
    }
    println!("netlab {name}: emulator processes {pids:?}");
    for ns in &namespaces {
        let addrs = tokenway_netlab::netns::ip(&["-n", ns, "-4", "-br", "addr", "show"])
            .unwrap_or_default();
        let addrs: Vec<&str> = addrs.lines().filter(|l| !l.starts_with("lo ")).collect();
        println!("  namespace {ns}: {}", addrs.join("; "));
    }
    if !links.is_empty() {
        println!("  stray devices in the root namespace: {links:?}");
    }
    match lab::read_state(name) {
        Some(s) if pids.contains(&(s.pid as i32)) => print_state(&s),
        _ if pids.is_empty() => {
            println!("  no emulator runs: leftovers of a crash; `tokenway netlab down --name {name}` removes them")
        }
        _ => println!("  (no state file yet)"),
    }
}

fn print_state(s: &LabState) {
    println!(
        "  profile {} seed {}, up {:.0} s, emulator {}",
        s.profile,
        s.seed,
        s.uptime_s,
        if s.realtime {
            "SCHED_FIFO"
        } else {
            "normal priority"
        }
    );
    println!(
        "  release error p50 {:+.0} us, p99 {:+.0} us, max {:+.0} us; no route {}, overflow {}",
        s.release_p50_us, s.release_p99_us, s.release_max_us, s.no_route, s.overflow
    );
    for d in &s.directions {
        let reasons: Vec<String> = tokenway_netlab::model::DropReason::ALL
            .iter()
            .zip(d.drops)
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| format!("{} {n}", r.name()))
            .collect();
        println!(
            "  {} -> {}: in {}, out {}, duplicated {}, dropped [{}]",
            d.from,
            d.to,
            d.received,
            d.delivered,
            d.duplicated,
            reasons.join(", ")
        );
    }
}
