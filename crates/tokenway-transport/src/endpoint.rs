//! QUIC endpoints: servers (gateway HTTP/3 front and tunnel port) and clients (edge).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Endpoint, EndpointConfig, TokioRuntime};

use crate::certs::Identity;
use crate::datagram::DatagramHandle;
use crate::error::TransportError;
use crate::settings::QuicSettings;
use crate::socket;

/// A server endpoint on `addr` presenting `identity` over ALPN h3, with the datagram layer if
/// `settings.datagram` is set.
pub fn server_endpoint(
    addr: SocketAddr,
    identity: &Identity,
    settings: &QuicSettings,
) -> Result<Endpoint, TransportError> {
    server_endpoint_with_layer(addr, identity, settings).map(|(e, _)| e)
}

/// [`server_endpoint`], also returning the datagram layer's handle (counters) if it has one.
pub fn server_endpoint_with_layer(
    addr: SocketAddr,
    identity: &Identity,
    settings: &QuicSettings,
) -> Result<(Endpoint, Option<DatagramHandle>), TransportError> {
    let tls = identity.quic_server_config(settings.zero_rtt)?;
    let crypto = QuicServerConfig::try_from(tls)
        .map_err(|e| TransportError::Tls(format!("TLS config unusable for QUIC: {e}")))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(Arc::new(settings.server_transport_config()));
    server.migration(true);
    let udp = socket::bind_udp(addr, settings.socket_buffer_bytes)?;
    let (socket, layer) = socket::layered_socket(udp, settings, "server")?;
    let endpoint = Endpoint::new_with_abstract_socket(
        EndpointConfig::new(Arc::new(reset_key(identity))),
        Some(server),
        socket,
        Arc::new(TokioRuntime),
    )
    .map_err(|source| TransportError::Socket { addr, source })?;
    Ok((endpoint, layer))
}

/// The key of stateless resets (RFC 9000 §10.3), derived from the identity's private key so that
/// a restarted server with the same certificate can reset connections its predecessor held:
/// clients then reconnect at once instead of waiting for their idle timeout.
fn reset_key(identity: &Identity) -> ring::hmac::Key {
    let mut material = b"tokenway stateless reset v1".to_vec();
    material.extend_from_slice(identity.key.secret_der());
    let digest = ring::digest::digest(&ring::digest::SHA256, &material);
    ring::hmac::Key::new(ring::hmac::HMAC_SHA256, digest.as_ref())
}

/// A client endpoint bound to `bind` (use port 0), with the datagram layer if
/// `settings.datagram` is set. Connections made with [`client_config`] from the same settings
/// then use the tunnel's congestion control too.
pub fn client_endpoint(
    bind: SocketAddr,
    settings: &QuicSettings,
) -> Result<Endpoint, TransportError> {
    client_endpoint_with_layer(bind, settings).map(|(e, _)| e)
}

/// [`client_endpoint`], also returning the datagram layer's handle (counters) if it has one.
pub fn client_endpoint_with_layer(
    bind: SocketAddr,
    settings: &QuicSettings,
) -> Result<(Endpoint, Option<DatagramHandle>), TransportError> {
    let udp = socket::bind_udp(bind, settings.socket_buffer_bytes)?;
    let (socket, layer) = socket::layered_socket(udp, settings, "client")?;
    let endpoint = Endpoint::new_with_abstract_socket(
        EndpointConfig::default(),
        None,
        socket,
        Arc::new(TokioRuntime),
    )
    .map_err(|source| TransportError::Socket { addr: bind, source })?;
    Ok((endpoint, layer))
}

/// A quinn client configuration from a rustls client configuration (which must offer ALPN h3 and
/// keep its resumption store across connections for 0-RTT), seeding the RTT estimate.
pub fn client_config(
    tls: Arc<rustls::ClientConfig>,
    settings: &QuicSettings,
    initial_rtt: Option<Duration>,
) -> Result<quinn::ClientConfig, TransportError> {
    let crypto = QuicClientConfig::try_from(tls)
        .map_err(|e| TransportError::Tls(format!("TLS config unusable for QUIC: {e}")))?;
    let mut c = quinn::ClientConfig::new(Arc::new(crypto));
    c.transport_config(Arc::new(settings.transport_config(initial_rtt)));
    Ok(c)
}
