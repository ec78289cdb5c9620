//! The dialer: races QUIC against HTTP/2-over-TLS-over-TCP, happy-eyeballs style (RFC 8305 §5
//! spirit, with transports instead of address families).
//!
//! QUIC starts first; TCP starts after a head start (250 ms by default) unless QUIC has already
//! failed; the first connection to be established wins and the other attempt is dropped. A win
//! by TCP is counted as a fallback. Moving back to QUIC later is the caller's job
//! ([`Dialer::quic`] in the background, then swapping connections), since only the caller knows
//! when requests may move.
//!
//! A QUIC connection resumed with 0-RTT can carry requests before the gateway has answered, but
//! it is established only once its handshake completes ([`QuicClient::established`]): with UDP
//! blocked or the gateway down, a resumption ticket alone would otherwise win every race and TCP
//! would never be tried. So [`Dialer::race_early`] hands such a connection to the caller at once
//! (early requests go out as 0-RTT data) and goes on racing: TCP still joins after the head
//! start, and when TCP wins the caller closes the early connection, whose requests then fail as
//! retryable and go again over TCP.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Body;
use tokenway_telemetry::quic::{PeerLabels, QuicMetrics};

use crate::client::{BoxError, ClientBody, QuicClient, QuicConnect, RequestError, ZeroRtt};
use crate::error::TransportError;
use crate::fallback::TcpClient;
use crate::settings::QuicSettings;

/// An established tunnel connection of either kind.
#[derive(Clone, Debug)]
pub enum Conn {
    /// HTTP/3 over QUIC.
    Quic(Arc<QuicClient>),
    /// HTTP/2 over TLS over TCP.
    Tcp(Arc<TcpClient>),
}

impl Conn {
    /// Sends one request over whichever transport this is.
    pub async fn send_request<B>(
        &self,
        req: Request<B>,
    ) -> Result<Response<ClientBody>, RequestError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        match self {
            Conn::Quic(c) => c.send_request(req).await,
            Conn::Tcp(c) => c.send_request(req).await,
        }
    }

    /// Whether the connection has closed.
    pub fn is_closed(&self) -> bool {
        match self {
            Conn::Quic(c) => c.is_closed(),
            Conn::Tcp(c) => c.is_closed(),
        }
    }

    /// Closes the connection.
    pub fn close(&self) {
        match self {
            Conn::Quic(c) => c.close(),
            Conn::Tcp(c) => c.close(),
        }
    }

    /// Takes a QUIC connection out of use without cutting the answers it is streaming (see
    /// [`QuicClient::set_aside`]); closes a TCP one.
    pub fn set_aside(&self) {
        match self {
            Conn::Quic(c) => c.set_aside(),
            Conn::Tcp(c) => c.close(),
        }
    }

    /// Whether this is the QUIC transport.
    pub fn is_quic(&self) -> bool {
        matches!(self, Conn::Quic(_))
    }

    /// The `transport` metric label of requests carried by this connection.
    pub fn transport_label(&self) -> &'static str {
        match self {
            Conn::Quic(_) => "tunnel",
            Conn::Tcp(_) => "tunnel-tcp",
        }
    }

    /// Whether two handles refer to the same connection.
    pub fn same(&self, other: &Conn) -> bool {
        match (self, other) {
            (Conn::Quic(a), Conn::Quic(b)) => Arc::ptr_eq(a, b),
            (Conn::Tcp(a), Conn::Tcp(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// One gateway as the dialer sees it.
#[derive(Clone, Debug)]
pub struct Target {
    /// Name, for logs and metric labels.
    pub name: String,
    /// The tunnel's UDP address.
    pub quic: Option<SocketAddr>,
    /// The TLS TCP address of the fallback.
    pub tcp: Option<SocketAddr>,
    /// TLS server name.
    pub server_name: String,
}

/// The TLS client configurations of the gateways, one pair (QUIC, TCP) per gateway name,
/// each with its own resumption store. rustls keys its store by server name, and gateways
/// often share one (a fleet behind one certificate): with one store an edge would offer a
/// gateway the tickets another issued, which it cannot decrypt, and lose 0-RTT on about every
/// other reconnect. The map holds one entry per configured gateway.
#[derive(Debug)]
pub struct GatewayTls {
    quic: Arc<rustls::ClientConfig>,
    tcp: Arc<rustls::ClientConfig>,
    by_gateway: std::sync::Mutex<std::collections::HashMap<String, TlsPair>>,
}

type TlsPair = (Arc<rustls::ClientConfig>, Arc<rustls::ClientConfig>);

impl GatewayTls {
    /// Templates for QUIC and for the TCP fallback.
    pub fn new(quic: Arc<rustls::ClientConfig>, tcp: Arc<rustls::ClientConfig>) -> Self {
        Self {
            quic,
            tcp,
            by_gateway: Default::default(),
        }
    }

    /// The configurations of gateway `name`, made on first use.
    pub fn for_gateway(&self, name: &str) -> TlsPair {
        let mut map = self.by_gateway.lock().unwrap_or_else(|p| p.into_inner());
        let pair = map.entry(name.to_string()).or_insert_with(|| {
            let own = |template: &rustls::ClientConfig| {
                let mut c = template.clone();
                c.resumption = rustls::client::Resumption::in_memory_sessions(SESSIONS_PER_GATEWAY);
                Arc::new(c)
            };
            (own(&self.quic), own(&self.tcp))
        });
        (pair.0.clone(), pair.1.clone())
    }
}

/// Sessions a gateway's resumption store holds (rustls keeps a few tickets per server name).
const SESSIONS_PER_GATEWAY: usize = 8;

/// Builds connections to gateways.
#[derive(Clone)]
pub struct Dialer {
    /// The client endpoint shared by every QUIC connection.
    pub endpoint: quinn::Endpoint,
    /// TLS for QUIC (ALPN h3, early data) and for the TCP fallback (ALPN h2): the templates
    /// of [`GatewayTls`], which gives every gateway its own copies.
    pub tls: Arc<GatewayTls>,
    /// QUIC settings.
    pub settings: QuicSettings,
    /// How long QUIC runs alone before TCP joins the race.
    pub head_start: Duration,
    /// Longest wait for one connection attempt.
    pub connect_timeout: Duration,
    /// Metrics.
    pub metrics: Option<QuicMetrics>,
    /// Gateways where TCP won the last race (or whose QUIC path went silent): the next race
    /// starts both at once instead of giving QUIC its head start again (Happy Eyeballs
    /// remembers, RFC 8305 §4). A QUIC success clears the mark.
    pub tcp_won_last: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

impl Dialer {
    fn mark(&self, target: &Target, tcp_won: bool) {
        let mut set = self.tcp_won_last.lock().unwrap_or_else(|p| p.into_inner());
        if tcp_won {
            set.insert(target.name.clone());
        } else {
            set.remove(&target.name);
        }
    }

    /// An established QUIC connection to `target` (a 0-RTT one once its handshake completed).
    pub async fn quic(
        &self,
        target: &Target,
        initial_rtt: Option<Duration>,
    ) -> Result<Conn, TransportError> {
        self.quic_early(target, initial_rtt, |_| {}).await
    }

    /// [`quic`](Self::quic), handing a 0-RTT connection to `early` as soon as it can carry
    /// requests, before its handshake completes.
    pub async fn quic_early(
        &self,
        target: &Target,
        initial_rtt: Option<Duration>,
        early: impl FnOnce(&Conn),
    ) -> Result<Conn, TransportError> {
        let addr = target.quic.ok_or_else(|| {
            TransportError::Config(format!("gateway {} has no quic address", target.name))
        })?;
        let client = QuicClient::connect(QuicConnect {
            endpoint: &self.endpoint,
            addr,
            server_name: &target.server_name,
            tls: self.tls.for_gateway(&target.name).0,
            settings: &self.settings,
            initial_rtt,
            peer: &target.name,
            metrics: self.metrics.clone(),
            timeout: self.connect_timeout,
        })
        .await?;
        let client = Arc::new(client);
        if client.zero_rtt() == ZeroRtt::Pending {
            early(&Conn::Quic(client.clone()));
        }
        client.established().await?;
        // QUIC works again: the next race gives it its head start.
        self.mark(target, false);
        Ok(Conn::Quic(client))
    }

    /// An HTTP/2-over-TLS connection to `target`.
    pub async fn tcp(&self, target: &Target) -> Result<Conn, TransportError> {
        let addr = target.tcp.ok_or_else(|| {
            TransportError::Config(format!("gateway {} has no tcp address", target.name))
        })?;
        let client = TcpClient::connect(
            addr,
            &target.server_name,
            self.tls.for_gateway(&target.name).1,
            self.connect_timeout,
            &target.name,
            self.metrics.as_ref(),
        )
        .await?;
        Ok(Conn::Tcp(Arc::new(client)))
    }

    /// Has the next race to `target` start TCP at once, as after a race TCP won: its QUIC path
    /// just went silent.
    pub fn prefer_tcp_next(&self, target: &Target) {
        self.mark(target, true);
    }

    /// Races QUIC and TCP to `target`; returns the winner.
    pub async fn race(
        &self,
        target: &Target,
        initial_rtt: Option<Duration>,
    ) -> Result<Conn, TransportError> {
        self.race_early(target, initial_rtt, |_| {}).await
    }

    /// [`race`](Self::race), handing a 0-RTT QUIC connection to `early` as soon as it can carry
    /// requests. It wins only once its handshake completes; if TCP wins instead (or QUIC fails),
    /// the caller should close the connection it got from `early`.
    pub async fn race_early(
        &self,
        target: &Target,
        initial_rtt: Option<Duration>,
        early: impl FnOnce(&Conn),
    ) -> Result<Conn, TransportError> {
        match (target.quic.is_some(), target.tcp.is_some()) {
            (true, false) => return self.quic_early(target, initial_rtt, early).await,
            (false, true) => return self.tcp(target).await,
            (false, false) => {
                return Err(TransportError::Config(format!(
                    "gateway {} has neither a quic nor a tcp address",
                    target.name
                )))
            }
            (true, true) => {}
        }
        let remembered = self
            .tcp_won_last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&target.name);
        let quic = self.quic_early(target, initial_rtt, early);
        tokio::pin!(quic);
        let head_start = tokio::time::sleep(if remembered {
            Duration::ZERO
        } else {
            self.head_start
        });
        tokio::pin!(head_start);
        // Phase 1: QUIC alone.
        let quic_error = tokio::select! {
            biased;
            r = &mut quic => match r {
                Ok(c) => {
                    self.mark(target, false);
                    return Ok(c);
                }
                Err(e) => Some(e),
            },
            _ = &mut head_start => None,
        };
        let tcp = self.tcp(target);
        tokio::pin!(tcp);
        if let Some(qe) = quic_error {
            tracing::info!(gateway = %target.name, error = %qe, "QUIC failed; using TCP");
            return self.count_fallback(target, tcp.await.map_err(|te| both_failed(&qe, te)));
        }
        // Phase 2: both; the first success wins.
        tokio::select! {
            r = &mut quic => match r {
                Ok(c) => {
                    self.mark(target, false);
                    Ok(c)
                }
                Err(qe) => {
                    tracing::info!(gateway = %target.name, error = %qe, "QUIC failed; waiting for TCP");
                    self.count_fallback(target, tcp.await.map_err(|te| both_failed(&qe, te)))
                }
            },
            r = &mut tcp => match r {
                Ok(c) => {
                    tracing::info!(gateway = %target.name, "TCP won the race against QUIC");
                    self.count_fallback(target, Ok(c))
                }
                Err(te) => {
                    tracing::debug!(gateway = %target.name, error = %te, "TCP failed; waiting for QUIC");
                    quic.await.map_err(|qe| both_failed(&qe, te))
                }
            },
        }
    }

    fn count_fallback(
        &self,
        target: &Target,
        r: Result<Conn, TransportError>,
    ) -> Result<Conn, TransportError> {
        if r.is_ok() {
            self.mark(target, true);
            if let Some(m) = &self.metrics {
                m.tcp_fallback
                    .get_or_create(&PeerLabels {
                        peer: target.name.clone(),
                    })
                    .inc();
            }
        }
        r
    }
}

/// The error of a race both transports lost: what each one ran into.
fn both_failed(quic: &TransportError, tcp: TransportError) -> TransportError {
    match tcp {
        TransportError::Connect { addr, message } => TransportError::Connect {
            addr,
            message: format!("{message} (and QUIC: {quic})"),
        },
        other => other,
    }
}
