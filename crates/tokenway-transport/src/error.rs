//! The transport's error type.

/// Errors of building endpoints, loading certificates, and connecting.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A setting is out of range; the message names the key.
    #[error("invalid transport setting: {0}")]
    Config(String),
    /// A certificate, key or trust anchor could not be loaded or generated.
    #[error("TLS: {0}")]
    Tls(String),
    /// A socket could not be opened or bound.
    #[error("cannot use UDP/TCP socket {addr}: {source}")]
    Socket {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Connecting failed.
    #[error("connect to {addr}: {message}")]
    Connect {
        /// The peer.
        addr: std::net::SocketAddr,
        /// Why.
        message: String,
    },
}
