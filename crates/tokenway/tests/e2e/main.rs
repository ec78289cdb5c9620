//! End-to-end tests: real `tokenway` processes on ephemeral loopback ports, driven by real
//! clients (a hyper client, curl, the official `openai` Python package).
//!
//! One test binary for the crate; each file below is one concern.

mod azure;
mod bad_input;
mod bench;
mod clients;
mod cloud_origin;
mod cpu_affinity;
mod discovery;
mod examples;
mod failover;
mod h3;
mod harness;
mod http1;
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod huge_text;
mod lossy;
mod overflow;
mod roaming;
mod routing;
mod s3;
mod streaming;
mod tunnel;
mod tunnel_tcp;
mod weights;
