//! UDP sockets for QUIC endpoints, the plug point of the datagram layer, and TCP listeners.
//!
//! Endpoints are built on a `quinn::AsyncUdpSocket`: quinn's own tokio socket over a UDP socket
//! with large kernel buffers, wrapped by the datagram layer ([`crate::datagram`]: FEC and
//! obfuscation) when the settings carry one.

use std::net::SocketAddr;
use std::sync::Arc;

use quinn::{AsyncUdpSocket, Runtime, TokioRuntime};
use socket2::{Domain, Protocol, Socket, Type};

use crate::datagram::{DatagramHandle, DatagramSocket, LayerConfig};
use crate::error::TransportError;
use crate::settings::QuicSettings;

/// Accept queue of every TCP listener (the kernel clamps it to `net.core.somaxconn`). The
/// default of `TcpListener::bind`, 1024, overflowed when a thousand streams opened at once on a
/// busy machine: the dropped SYNs came back after a second and connects timed out. nginx's
/// `backlog` and vLLM's uvicorn (2048) are set deep for the same reason.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds a TCP listener on `addr` with a [`LISTEN_BACKLOG`]-deep accept queue. Must be called
/// inside a tokio runtime.
pub fn listen_tcp(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

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

/// Wraps a bound UDP socket into the socket an endpoint runs on: with the datagram layer when
/// `settings.datagram` is set (then its handle is returned too), plain otherwise. `side` is the
/// metrics label (`server` or `client`).
pub fn layered_socket(
    socket: std::net::UdpSocket,
    settings: &QuicSettings,
    side: &'static str,
) -> Result<(Arc<dyn AsyncUdpSocket>, Option<DatagramHandle>), TransportError> {
    let inner = async_socket(socket)?;
    match &settings.datagram {
        None => Ok((inner, None)),
        Some(d) => {
            let config = LayerConfig::from_settings(d, side, settings.datagram_metrics.clone())?;
            let (socket, handle) = DatagramSocket::wrap(inner, config)?;
            Ok((socket, Some(handle)))
        }
    }
}
