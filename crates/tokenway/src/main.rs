//! `tokenway`: the network layer for remote LLM inference, in one binary.
//!
//! This crate only parses flags and configuration and wires the roles together; the library
//! crates do the work. Every error ends in a clear message and a non-zero exit, never a panic.

mod cmd;
mod huge_text;

use clap::{Parser, Subcommand};

/// The network layer for remote LLM inference: streaming gateway, simulated backends,
/// benchmarks.
#[derive(Parser)]
#[command(name = "tokenway", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Simulated OpenAI-compatible inference server (for tests, demos and benchmarks).
    Sim(cmd::sim::SimArgs),
    /// Streaming OpenAI-compatible gateway in front of inference backends.
    Gateway(cmd::gateway::GatewayArgs),
    /// Local OpenAI-compatible endpoint that tunnels every request to the best gateway.
    Edge(cmd::edge::EdgeArgs),
    /// Three simulated backends and a gateway on loopback, ready for requests.
    Demo(cmd::demo::DemoArgs),
    /// Side-by-side measurements.
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
    /// Emulated lossy links between network namespaces (needs root).
    #[command(subcommand)]
    Netlab(cmd::netlab::NetlabCommand),
    /// Upload a model directory to an origin object store as one revision.
    Publish(cmd::publish::PublishArgs),
    /// Download a model revision, verifying every piece; resumable.
    Pull(cmd::pull::PullArgs),
    /// Regional cache of model weights in front of an origin (HTTP range API, peers).
    Mirror(cmd::mirror::MirrorArgs),
    /// Ask a mirror to pull a whole model into its cache.
    Preheat(cmd::preheat::PreheatArgs),
}

/// Raises the soft limit on open files to the hard one (at most 2^20), as Go's runtime does: a
/// proxy holds two sockets per request besides its pools, and the usual soft limit of 1024
/// would run out in a burst the hard limit allows (the gateway then refuses connections and
/// fails requests it could serve).
fn raise_open_files_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    let want = hard.min(1 << 20);
    if soft < want {
        match setrlimit(Resource::RLIMIT_NOFILE, want, hard) {
            Ok(()) => tracing::debug!(from = soft, to = want, "raised the open files limit"),
            Err(e) => tracing::debug!(error = %e, "could not raise the open files limit"),
        }
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tokenway_telemetry::init_tracing();
    raise_open_files_limit();
    if matches!(cli.command, Command::Gateway(_) | Command::Edge(_)) {
        // Before any other thread exists (huge_text::remap).
        match huge_text::remap() {
            huge_text::Outcome::Huge => tracing::info!("request path code on a 2 MiB huge page"),
            huge_text::Outcome::Small => {
                tracing::info!("request path code copied, but no huge page was free for it")
            }
            huge_text::Outcome::Skipped(why) => {
                tracing::info!("request path code left on small pages: {why}")
            }
        }
    }
    // The gateway and the edge are proxies: a request's tasks wake each other many times, and a
    // wake-up that crosses to another worker thread costs a futex and an inter-processor
    // interrupt (several per request, measured). They run on one worker thread instead: the
    // edge on one, the gateway's TCP fronts on one per CPU (`front_threads`). One worker of the
    // multi-thread scheduler rather than the current-thread one: its LIFO slot runs a task woken
    // by the running one next, which keeps a request's hand-offs back to back (measured: fewer
    // packets per request and a lower latency than with the current-thread scheduler).
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if matches!(cli.command, Command::Gateway(_) | Command::Edge(_)) {
        builder.worker_threads(1);
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Sim(args) => cmd::sim::run(args).await,
            Command::Gateway(args) => cmd::gateway::run(args).await,
            Command::Edge(args) => cmd::edge::run(args).await,
            Command::Demo(args) => cmd::demo::run(args).await,
            Command::Bench(command) => cmd::bench::run(command).await,
            Command::Netlab(command) => cmd::netlab::run(command).await,
            Command::Publish(args) => cmd::publish::run(args).await,
            Command::Pull(args) => cmd::pull::run(args).await,
            Command::Mirror(args) => cmd::mirror::run(args).await,
            Command::Preheat(args) => cmd::preheat::run(args).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each cause only once: many of our error types already
/// put their cause in their message, and printing the chain again would repeat it.
fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}
