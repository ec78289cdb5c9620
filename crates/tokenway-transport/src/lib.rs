//! tokenway-transport: QUIC endpoints (quinn + rustls), congestion controllers, the UDP socket
//! plug point for the datagram layer, and the HTTP/2-over-TLS-over-TCP fallback with the dialer
//! that races the two.
//!
//! This crate moves bytes between an edge and a gateway; it knows nothing of HTTP routing or of
//! OpenAI requests. Server side: [`endpoint::server_endpoint`]; client side:
//! [`client`], [`dial`], [`fallback`]. Certificates and trust: [`certs`], [`trust`]. The
//! tunnel's datagram layer (FEC, obfuscation) is [`datagram`]; its congestion control is
//! [`cc`] and [`brutal`]; a QUIC path gone silent is noticed by [`liveness`]. The tunnel
//! client that the edge and a gateway's overflow share (its connection per gateway, the RTT
//! choice among them, retries) is [`tunnel`], configured by
//! [`tunnel_config`], choosing with [`select`]. The bound on request bodies held, which the
//! edge's and the gateway's fronts share, is [`body_budget`].

pub mod body_budget;
pub mod brutal;
pub mod cc;
pub mod certs;
pub mod client;
pub mod datagram;
pub mod dial;
pub mod endpoint;
pub mod error;
pub mod fallback;
pub mod h3_quinn_prio;
pub mod liveness;
pub mod select;
pub mod settings;
pub mod socket;
pub mod stall_io;
pub mod stats;
pub mod trust;
pub mod tunnel;
pub mod tunnel_config;

pub use error::TransportError;
pub use settings::{Bandwidth, CongestionControl, DatagramSettings, QuicSettings};

/// ALPN of HTTP/3 (RFC 9114 §3.1). The tunnel uses it too, so it looks like any HTTP/3 site.
pub const ALPN_H3: &[u8] = b"h3";
/// ALPN of HTTP/2 over TLS (RFC 9113 §3.2).
pub const ALPN_H2: &[u8] = b"h2";
/// ALPN of HTTP/1.1.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";
