//! CONNECT port forwarding on the TCP fronts: an edge on its TCP fallback (HTTP/2 over TLS)
//! reaches an allow-listed target the same way it does over QUIC (`h3_front::forward`).
//!
//! The caller has already checked the tunnel token. The target must be in `forward_allow`
//! exactly as configured (403 otherwise), the gateway connects to it first (502 when it cannot),
//! and only then answers 200; the CONNECT stream, upgraded, is then spliced with the TCP
//! connection until either side closes. Never an open proxy: without `[tunnel]` or with a
//! target outside the list nothing is dialled.

use std::sync::{Arc, Mutex};

use http::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::error::{full, ApiError, ResponseBody};
use crate::state::Shared;

/// Where the HTTP/1.1 front (`front_h1`) takes the dialled target of a CONNECT it carries: it
/// has no hyper upgrade to hand over, so the connection comes back through the request.
#[derive(Clone, Default)]
pub struct SpliceSlot(Arc<Mutex<Option<TcpStream>>>);

impl SpliceSlot {
    fn put(&self, tcp: TcpStream) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(tcp);
    }

    /// The target connection, if the CONNECT was accepted.
    pub fn take(&self) -> Option<TcpStream> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// Answers a CONNECT request from an authenticated edge.
pub async fn connect<B>(shared: &Arc<Shared>, req: Request<B>) -> Response<ResponseBody>
where
    B: Send + 'static,
{
    let target = req.uri().authority().map(|a| a.as_str().to_string());
    let allowed = match (&shared.tunnel, &target) {
        (Some(t), Some(target)) => t.may_forward_to(target),
        _ => false,
    };
    let Some(target) = target.filter(|_| allowed) else {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            "forward_not_allowed",
            "this target is not in the gateway's forward_allow list",
        )
        .into_response();
    };
    let tcp = match tokio::time::timeout(
        shared.config.timeouts.connect(),
        TcpStream::connect(&target),
    )
    .await
    {
        Ok(Ok(s)) => s,
        _ => {
            return ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "forward_unreachable",
                format!("cannot connect to {target}"),
            )
            .into_response()
        }
    };
    let _ = tcp.set_nodelay(true);
    if let Some(slot) = req.extensions().get::<SpliceSlot>() {
        // The HTTP/1.1 front joins the two itself once its 200 is out.
        slot.put(tcp);
        return Response::new(full(bytes::Bytes::new()));
    }
    tokio::spawn(async move {
        let upgraded = match hyper::upgrade::on(req).await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(%target, error = %e, "CONNECT stream was not upgraded");
                return;
            }
        };
        let mut stream = TokioIo::new(upgraded);
        let mut tcp = tcp;
        if let Err(e) = tokio::io::copy_bidirectional(&mut stream, &mut tcp).await {
            tracing::debug!(%target, error = %e, "forwarded connection ended with an error");
        }
    });
    Response::new(full(bytes::Bytes::new()))
}
