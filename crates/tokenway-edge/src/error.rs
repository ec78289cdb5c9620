//! The edge's error type.

/// Errors of configuring and starting the edge.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    /// The configuration is invalid; the message names the key.
    #[error("invalid edge configuration: {0}")]
    Config(String),
    /// A listener or socket could not be opened.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The transport could not be set up.
    #[error(transparent)]
    Transport(#[from] tokenway_transport::TransportError),
}
