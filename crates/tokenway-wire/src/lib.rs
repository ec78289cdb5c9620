//! Sans-IO codecs for tokenway's wire formats.
//!
//! This crate holds the byte-level logic that the serving roles run on their hot paths:
//! the incremental Server-Sent-Events scanner used by the gateway's streaming proxy
//! ([`sse`]) and the hold-back of unfinished events a relay needs ([`sse_hold`]), the OpenAI request fields as the Python servers read them ([`openai_fields`]), and the tunnel's datagram layer below QUIC (`docs/datagram-layer.md`): its
//! framing ([`packet`]), forward error correction ([`fec`]), loss reports ([`loss_report`])
//! and obfuscation ([`obfs`]). The `quinn` socket adapter that drives the datagram layer lives
//! in `tokenway-transport`.
//!
//! It must never do I/O, read a clock, spawn tasks or depend on tokio: every input (bytes,
//! and time where needed) is a parameter, so every codec is deterministic and unit-testable.
//! Randomness (obfuscation salts) comes from an RNG the caller seeds.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod error;
pub mod fec;
pub mod loss_report;
pub mod obfs;
pub mod openai_fields;
pub mod packet;
pub mod sse;
pub mod sse_hold;
pub mod sse_output;

pub use error::WireError;
