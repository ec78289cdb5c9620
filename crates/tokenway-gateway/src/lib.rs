//! The tokenway gateway: OpenAI-compatible HTTP fronts beside the GPUs that stream tokens without
//! buffering and route every request to the best inference backend.
//!
//! Layout: [`config`] (what an operator sets), [`server`] (listeners, TLS, connection limits),
//! [`service`] (the per-request stack: route, auth, bounded body, parse, rank), [`admission`]
//! (requests waiting for a slot while every backend is full), [`proxy`] (attempts
//! and retries before the first byte), [`relay`] (streaming the answer and measuring it),
//! [`probe`] (active health checks), [`state`] (router, pool, metrics). Routing decisions
//! themselves live in the sans-IO `tokenway-router` crate.
//!
//! The gateway must never buffer a whole streamed response, never forward the client's
//! credentials upstream, and never let one client's behaviour stall another's.

pub mod admission;
pub mod config;
pub mod cors;
pub mod cpu_affinity;
pub mod cpu_placement;
pub mod discovery;
pub mod drain;
pub mod error;
pub mod forward_tcp;
pub mod front_h1;
pub mod h1_head;
pub mod h2_idle;
pub mod h2_stall;
pub mod h3_front;
pub mod masquerade;
pub mod overflow;
pub mod probe;
pub mod proxy;
pub mod relay;
pub mod replay;
pub mod request_meta;
pub mod secret;
pub mod server;
pub mod service;
pub mod state;
pub mod status;
pub mod tunnel;
pub mod upstream_h1;

pub use config::{BackendConfig, GatewayConfig};
pub use error::GatewayError;
pub use server::{bind, BoundGateway};
