//! `tokenway-netlab`: emulated network links between Linux network namespaces, so every claim
//! tokenway makes about bad networks can be measured on one machine, reproducibly.
//!
//! The kernel here has no `netem`, so the link emulator runs in user space: each host
//! (`client`, `server`, later more) is a network namespace with one TUN device and an address
//! in 198.18.0.0/15; one thread reads packets from every device, passes each through the
//! [`model::LinkModel`] of its direction (delay, jitter, loss, bursts, rate and queue,
//! duplication, UDP blocking, blackouts, a timeline of changes) and writes it to the
//! destination's device at its release time.
//!
//! * [`model`] and [`packet`] are sans-IO: no clock, no sockets; unit-tested with simulated time.
//! * [`profile`] parses the shipped link profiles (`profiles/*.toml`, compiled in).
//! * [`Lab`] brings a lab up and tears it down (also on drop); [`down`] cleans up by name
//!   prefix after a crash; [`selfcheck`](selfcheck::selfcheck) measures the emulator.
//!
//! This crate is a test and benchmark fixture: the serving roles never import it.
//! See `docs/netlab.md`.

pub mod config;
pub mod emulator;
mod error;
pub mod lab;
pub mod model;
pub mod netns;
pub mod packet;
pub mod profile;
pub mod selfcheck;
mod sys;

pub use config::{LabConfig, CLIENT, CLIENT_ADDR, DEFAULT_PREFIX, SERVER, SERVER_ADDR};
pub use error::NetlabError;
pub use lab::{down, leftovers, Lab};
pub use profile::Profile;
pub use sys::{is_root, set_socket_buffers, Tun};
