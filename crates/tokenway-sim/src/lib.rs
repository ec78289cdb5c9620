//! A simulated OpenAI-compatible inference server, standing in for vLLM or SGLang in tests,
//! demos and benchmarks.
//!
//! It serves `POST /v1/chat/completions` and `POST /v1/completions` (streaming and not, `n`
//! choices, batches of prompts, token-id prompts) and `POST /v1/embeddings` in the exact
//! OpenAI/vLLM wire format, with timing that makes routing matter: a FIFO queue in front of
//! a fixed number of slots, a prefill time that a prefix cache shortens, and a decode rate that
//! slows as more requests run at once. Faults (errors, stalls, hangs, slow starts, refused
//! connections) can be configured and replaced at run time (`POST /admin/faults`). It also
//! serves `/v1/models`, `/health` and `/metrics` (tokenway series plus vLLM's load gauges).
//!
//! The cost model lives in [`cost`], free of I/O; [`serve`] is the glue that puts it on the wire.
//! This crate must never be imported by a serving role (gateway, edge): it is a test fixture.
//! See `docs/sim.md` for every option.

mod body;
mod choice;
mod config;
pub mod cost;
mod embeddings;
mod error;
mod openai;
mod prefill;
mod server;
mod text;

pub use config::{Faults, SimConfig};
pub use error::SimError;
pub use server::{serve, MAX_BODY_BYTES};
