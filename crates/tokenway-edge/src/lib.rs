//! tokenway-edge: the local OpenAI-compatible endpoint in front of the tunnel client.
//!
//! An app talks plain HTTP/1.1 or h2c to the edge on loopback; the edge carries every request
//! as one HTTP/3 request over QUIC to the gateway with the lowest smoothed RTT (HTTP/2 over TLS
//! over TCP when UDP does not get through), adding the tunnel token and an idempotency key
//! (docs/tunnel.md). It also forwards local TCP ports through the tunnel (CONNECT).
//!
//! The tunnel client itself ([`tokenway_transport::tunnel`]) lives in the transport crate, where
//! a gateway's overflow to peer gateways uses it too; the edge never imports the gateway crate,
//! and they share only the wire contract.

mod body;
pub mod config;
mod error;
pub mod forward;
pub mod metrics;
pub mod roaming;
pub mod server;

use std::net::SocketAddr;
use std::sync::Arc;

pub use config::EdgeConfig;
pub use error::EdgeError;
use tokenway_transport::tunnel::Tunnel;

/// An edge whose listeners are bound and whose links are dialing.
pub struct BoundEdge {
    listener: tokio::net::TcpListener,
    local: Arc<server::Local>,
    forwards: Vec<forward::Forward>,
}

/// Binds the local endpoint and the forward listeners and starts the tunnel links.
pub async fn bind(config: EdgeConfig) -> Result<BoundEdge, EdgeError> {
    config.validate()?;
    let metrics = Arc::new(metrics::EdgeMetrics::new());
    let tunnel = Tunnel::start(&config.tunnel, metrics.quic.clone()).await?;
    if let Some(every) = config.address_check() {
        tokio::spawn(roaming::watch(
            Arc::downgrade(&tunnel),
            every,
            metrics.rebinds("address_change"),
        ));
    }
    let listener = server::bind(config.listen).await?;
    let mut forwards = Vec::new();
    for f in &config.forwards {
        forwards.push(forward::Forward::bind(f, tunnel.clone()).await?);
    }
    Ok(BoundEdge {
        listener,
        local: Arc::new(server::Local {
            tunnel,
            metrics,
            max_body_bytes: config.max_body_bytes,
            bodies: config.body_budget(),
        }),
        forwards,
    })
}

impl BoundEdge {
    /// The local endpoint's address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// The forward listeners: (local address, target).
    pub fn forwards(&self) -> Vec<(SocketAddr, String)> {
        self.forwards
            .iter()
            .filter_map(|f| Some((f.local_addr()?, f.target().to_string())))
            .collect()
    }

    /// Serves until `shutdown` resolves.
    pub async fn serve(self, shutdown: impl std::future::Future<Output = ()> + Send) {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut tasks = vec![tokio::spawn(server::serve(
            self.listener,
            self.local.clone(),
            stop_rx.clone(),
        ))];
        for f in self.forwards {
            tasks.push(tokio::spawn(f.serve(stop_rx.clone())));
        }
        shutdown.await;
        let _ = stop_tx.send(true);
        for t in tasks {
            let _ = t.await;
        }
    }
}
