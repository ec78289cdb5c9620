//! TCP port forwarding: a local listener whose connections are carried through the tunnel as
//! CONNECT streams to an allow-listed target (the gateway refuses any other with 403).
//!
//! Over QUIC the CONNECT request's body carries the local bytes and its response body carries
//! the target's; over the TCP fallback the HTTP/2 CONNECT stream is an upgraded byte stream.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::Request;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokenway_transport::dial::Conn;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::config::ForwardEntry;
use crate::error::EdgeError;
use tokenway_transport::tunnel::Tunnel;

/// One forward listener.
pub struct Forward {
    listener: TcpListener,
    target: String,
    tunnel: Arc<Tunnel>,
}

impl Forward {
    /// Binds the local listener of `entry`.
    pub async fn bind(entry: &ForwardEntry, tunnel: Arc<Tunnel>) -> Result<Self, EdgeError> {
        let listener = TcpListener::bind(entry.listen)
            .await
            .map_err(|source| EdgeError::Bind {
                addr: entry.listen,
                source,
            })?;
        Ok(Self {
            listener,
            target: entry.target.clone(),
            tunnel,
        })
    }

    /// The local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// The target `host:port`.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// Accepts and carries connections until `stop` changes.
    pub async fn serve(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let target: Arc<str> = self.target.into();
        loop {
            let (stream, peer) = tokio::select! {
                r = self.listener.accept() => match r {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "forward accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = stop.changed() => return,
            };
            let _ = stream.set_nodelay(true);
            let tunnel = self.tunnel.clone();
            let target = target.clone();
            tokio::spawn(async move {
                if let Err(e) = carry(stream, &tunnel, &target).await {
                    tracing::info!(%peer, %target, error = %e, "forwarded connection ended");
                }
            });
        }
    }
}

async fn carry(mut local: TcpStream, tunnel: &Tunnel, target: &str) -> Result<(), String> {
    let (conn, headers) = tunnel.connection().await.ok_or_else(|| {
        abort(&local);
        "no gateway is reachable".to_string()
    })?;
    match conn {
        Conn::Quic(q) => {
            let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(16);
            let mut req = Request::connect(target)
                .body(ChannelBody { rx })
                .map_err(|e| format!("bad target {target:?}: {e}"))?;
            *req.headers_mut() = headers;
            // The application is told of a failure with a reset, never a FIN (which reads as
            // "the target accepted and closed").
            let resp = q.send_request(req).await.map_err(|e| {
                abort(&local);
                e.message
            })?;
            if !resp.status().is_success() {
                abort(&local);
                return Err(format!("the gateway refused the target: {}", resp.status()));
            }
            let clean = {
                let (mut rd, mut wr) = local.split();
                let up = async move {
                    let mut buf = BytesMut::with_capacity(16 * 1024);
                    loop {
                        buf.reserve(16 * 1024);
                        match rd.read_buf(&mut buf).await {
                            Ok(0) => return,
                            // The application reset its connection: the stream is reset too
                            // (the body's error), so the target is not told a clean end.
                            Err(e) => {
                                let _ = tx.send(Err(e)).await;
                                return;
                            }
                            Ok(_) => {
                                if tx.send(Ok(buf.split().freeze())).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                };
                // Whether the tunnel side ended cleanly (its FIN becomes the local FIN).
                let down = async move {
                    let mut body = resp.into_body();
                    while let Some(frame) = body.frame().await {
                        let Ok(frame) = frame else { return false };
                        if let Ok(data) = frame.into_data() {
                            if wr.write_all(&data).await.is_err() {
                                return true;
                            }
                        }
                    }
                    let _ = wr.shutdown().await;
                    true
                };
                // A tunnel that broke ends the local reads too (they would otherwise wait on an
                // application that waits on us); a clean end is a half-close, as on TCP.
                tokio::pin!(up, down);
                tokio::select! {
                    clean = &mut down => {
                        if clean {
                            up.await;
                        }
                        clean
                    }
                    () = &mut up => down.await,
                }
            };
            if !clean {
                abort(&local);
                return Err("the tunnel stream broke".into());
            }
            Ok(())
        }
        Conn::Tcp(t) => {
            let upgraded = t
                .connect_stream(target, headers)
                .await
                .map_err(|e| e.message)
                .and_then(|r| {
                    r.map_err(|status| format!("the gateway refused the target: {status}"))
                })
                .inspect_err(|_| abort(&local))?;
            let mut remote = TokioIo::new(upgraded);
            tokio::io::copy_bidirectional(&mut local, &mut remote)
                .await
                .map(|_| ())
                .map_err(|e| {
                    abort(&local);
                    e.to_string()
                })
        }
    }
}

/// Makes the local connection end with a reset instead of a FIN once it is dropped: the
/// tunnel broke, and a FIN would tell the application its peer finished cleanly (a truncated
/// download or reply looking complete).
fn abort(local: &TcpStream) {
    if let Err(e) = local.set_zero_linger() {
        tracing::debug!(error = %e, "cannot set SO_LINGER to reset a forwarded connection");
    }
}

/// A request body fed by a channel; ends when the sender is dropped, and fails (resetting
/// the stream) with an error sent through it.
struct ChannelBody {
    rx: mpsc::Receiver<std::io::Result<Bytes>>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}
