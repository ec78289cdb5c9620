//! Sans-IO codecs for tokenway's wire formats.
//!
//! This crate holds the byte-level logic that the serving roles run on their hot paths:
//! today the incremental Server-Sent-Events scanner used by the gateway's streaming proxy
//! ([`sse`]); later FEC blocks, obfuscation, loss reports and manifests.
//!
//! It must never do I/O, read a clock, spawn tasks or depend on tokio: every input (bytes,
//! and time where needed) is a parameter, so every codec is deterministic and unit-testable.
//! It has no runtime dependencies.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod sse;
