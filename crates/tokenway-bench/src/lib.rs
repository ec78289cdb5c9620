//! Workloads, measurement and reports for `tokenway bench`.
//!
//! Benchmarks are code too: each one starts the servers it compares as child processes, drives
//! them with the same load generator, and writes `results.json` plus a Markdown table that state
//! the machine, the commit and the exact command. Nothing here is imported by a serving role.
//!
//! - [`gateway`] — `tokenway bench gateway`, direct vs. `tokenway gateway` vs. nginx.
//! - [`transport`] — `tokenway bench transport`, h1/h2/h3/tunnel side by side on netlab links.
//! - [`routing`] — `tokenway bench routing`, the gateway's routing policies side by side on a
//!   multi-turn workload over eight simulated backends, and the router's decision time.
//! - [`weights`] — `tokenway bench weights`, one pull alone vs. eight at once through a mirror,
//!   origin egress, and a pull's throughput against curl and aria2c.
//! - [`plot`] — SVG plots (CDFs).
//! - [`load`] — the streaming load generator.
//! - [`process`] — child servers, their memory and CPU time.
//! - [`nginx`] — nginx as the reference streaming reverse proxy.
//! - [`report`] — results, verdicts, JSON and Markdown.
//! - [`stats`] — percentiles.

pub mod gateway;
pub mod load;
pub mod nginx;
pub mod plot;
pub mod process;
pub mod report;
pub mod routing;
pub mod stats;
pub mod transport;
pub mod weights;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A file or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A server under test did not start or died.
    #[error("{name}: {message}")]
    Child {
        /// Which server.
        name: String,
        /// What went wrong, and where its log is.
        message: String,
    },
    /// A server under test started but does not answer requests correctly.
    #[error("{target} does not serve streaming chat completions: {message}")]
    NotServing {
        /// Which target.
        target: String,
        /// The last failure.
        message: String,
    },
}
