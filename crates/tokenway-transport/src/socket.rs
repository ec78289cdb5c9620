//! UDP sockets for QUIC endpoints, and the plug point of the datagram layer.
//!
//! Endpoints are built on a `quinn::AsyncUdpSocket`. Today that is quinn's own tokio socket over
//! a UDP socket with large kernel buffers; the loss-resilient datagram layer (FEC and
//! obfuscation, a later stage) wraps it here, below QUIC, without the endpoints changing.

use std::net::SocketAddr;
use std::sync::Arc;

use quinn::{AsyncUdpSocket, Runtime, TokioRuntime};
use socket2::{Domain, Protocol, Socket, Type};

use crate::error::TransportError;

/// Binds a non-blocking UDP socket with `buffer` bytes of kernel send and receive buffer (the
/// kernel may clamp it to `net.core.{r,w}mem_max`; that is logged, not fatal).
pub fn bind_udp(addr: SocketAddr, buffer: usize) -> Result<std::net::UdpSocket, TransportError> {
    let err = |source| TransportError::Socket { addr, source };
    let socket =
        Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP)).map_err(err)?;
    if addr.is_ipv6() {
        let _ = socket.set_only_v6(false);
    }
    for (what, r) in [
        ("receive", socket.set_recv_buffer_size(buffer)),
        ("send", socket.set_send_buffer_size(buffer)),
    ] {
        if let Err(e) = r {
            tracing::debug!(%addr, error = %e, "cannot set the UDP {what} buffer");
        }
    }
    socket.set_nonblocking(true).map_err(err)?;
    socket.bind(&addr.into()).map_err(err)?;
    Ok(socket.into())
}

/// Wraps a bound UDP socket into the `AsyncUdpSocket` an endpoint runs on. The datagram layer
/// plugs in here.
pub fn async_socket(
    socket: std::net::UdpSocket,
) -> Result<Arc<dyn AsyncUdpSocket>, TransportError> {
    let addr = socket
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    TokioRuntime
        .wrap_udp_socket(socket)
        .map_err(|source| TransportError::Socket { addr, source })
}
