//! The TCP fronts: cleartext HTTP/1.1 + h2c on one port, and TLS with ALPN (h2, http/1.1).
//! HTTP/1.1 is served by the gateway's own front (`front_h1`), HTTP/2 by hyper.
//!
//! Every accepted socket gets TCP_NODELAY: without it Nagle's algorithm and delayed ACKs can add
//! ~40 ms to a small first-token write. Open connections are bounded by a semaphore; on shutdown
//! the listeners close and open connections get a graceful close with a deadline.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio_rustls::TlsAcceptor;

use crate::config::GatewayConfig;
use crate::cpu_placement::{self, PinnedThreads};
use crate::drain::Drain;
use crate::error::GatewayError;
use crate::front_h1::H1Connection;
use crate::h2_idle::{Activity, IdleClose};
use crate::h3_front::{self, Front};
use crate::service::TcpFront;
use crate::state::Shared;
use crate::{cpu_affinity, discovery, probe, service};
use tokenway_transport::certs::Identity;
use tokenway_transport::stall_io::StallGuard;

/// How long open connections get to finish after shutdown is asked.
const DRAIN: Duration = Duration::from_secs(5);
/// The HTTP/2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// First read of a cleartext connection: the request head (or preface) and a small body.
const FIRST_READ_BYTES: usize = 8 * 1024;
/// Pins the calling runtime's one worker thread to `cpu`, from a task (which runs on that
/// worker), and records it for `cpu_placement::watch`. Not from `on_thread_start`: that runs for
/// the runtime's blocking threads too (a connect to a host name resolves it on one), which come
/// and go.
fn pin_worker(cpu: usize, pinned: Arc<PinnedThreads>) {
    tokio::spawn(async move {
        if cpu_affinity::pin_current_thread(cpu) {
            pinned.add_current(cpu);
        }
    });
}

/// A TCP listener as the front threads share it: the socket, its TLS acceptor (none for
/// cleartext) and what it serves.
type Listener = (std::net::TcpListener, Option<TlsAcceptor>, TcpFront);

/// Period of the timer every front thread keeps armed (see [`keep_timer_armed`]).
const TIMER_KEEPER: Duration = Duration::from_millis(500);

/// A gateway whose listeners are bound, ready to serve.
pub struct BoundGateway {
    shared: Arc<Shared>,
    plain: Option<TcpListener>,
    tls: Option<(TcpListener, TlsAcceptor)>,
    /// `tunnel.tcp_listen`: the tunnel's own TLS port, for edges on their TCP fallback.
    tunnel_tcp: Option<(TcpListener, TlsAcceptor)>,
    h3: Option<quinn::Endpoint>,
    tunnel: Option<quinn::Endpoint>,
    fingerprint: Option<String>,
}

/// Binds the listeners of `config` (port 0 picks a free port; see [`BoundGateway::plain_addr`]).
pub async fn bind(config: GatewayConfig) -> Result<BoundGateway, GatewayError> {
    let shared = Shared::new(config)?;
    if let Some(peers) = &shared.config.overflow {
        let tunnel = tokenway_transport::tunnel::Tunnel::start(peers, shared.quic_metrics.clone())
            .await
            .map_err(|e| GatewayError::Config(format!("[overflow]: {e}")))?;
        let _ = shared.overflow.set(tunnel);
    }
    let plain = match shared.config.listen {
        Some(addr) => Some(listen(addr).await?),
        None => None,
    };
    let c = &shared.config;
    let needs_identity = c.tls_listen.is_some() || c.h3_listen.is_some() || c.tunnel.is_some();
    let identity = if needs_identity {
        let files = c.tls.as_ref().map(|t| (t.cert.as_path(), t.key.as_path()));
        Some(Identity::load_or_generate(files).map_err(|e| GatewayError::Tls(e.to_string()))?)
    } else {
        None
    };
    let tls_err = |e: tokenway_transport::TransportError| GatewayError::Tls(e.to_string());
    let acceptor = match &identity {
        Some(id) => Some(TlsAcceptor::from(id.tcp_server_config().map_err(tls_err)?)),
        None => None,
    };
    let tls = match (c.tls_listen, &acceptor) {
        (Some(addr), Some(acceptor)) => Some((listen(addr).await?, acceptor.clone())),
        _ => None,
    };
    let tunnel_tcp = match (c.tunnel.as_ref().and_then(|t| t.tcp_listen), &acceptor) {
        (Some(addr), Some(acceptor)) => Some((listen(addr).await?, acceptor.clone())),
        _ => None,
    };
    let quic = |addr: SocketAddr, id: &Identity, settings: &tokenway_transport::QuicSettings| {
        tokenway_transport::endpoint::server_endpoint(addr, id, settings).map_err(|e| match e {
            tokenway_transport::TransportError::Socket { addr, source } => {
                GatewayError::Bind { addr, source }
            }
            other => GatewayError::Tls(other.to_string()),
        })
    };
    let h3 = match (c.h3_listen, &identity) {
        (Some(addr), Some(id)) => Some(quic(addr, id, &c.quic)?),
        _ => None,
    };
    let tunnel = match (&c.tunnel, &identity) {
        (Some(t), Some(id)) => {
            // The tunnel port alone gets the datagram layer (FEC, obfuscation, tunnel cc):
            // public HTTP/3 clients do not speak it. Without `[tunnel.datagram]` it is plain
            // QUIC, exactly as before.
            let mut settings = c.quic.clone();
            settings.datagram = t.datagram.clone();
            settings.datagram_metrics = Some(shared.quic_metrics.datagram.clone());
            Some(quic(t.listen, id, &settings)?)
        }
        _ => None,
    };
    if let Some(port) = h3
        .as_ref()
        .and_then(|e| e.local_addr().ok())
        .map(|a| a.port())
    {
        if let Ok(v) = http::HeaderValue::try_from(format!("h3=\":{port}\"; ma=86400")) {
            let _ = shared.alt_svc.set(v);
        }
    }
    let fingerprint = identity.as_ref().map(Identity::fingerprint);
    Ok(BoundGateway {
        shared,
        plain,
        tls,
        tunnel_tcp,
        h3,
        tunnel,
        fingerprint,
    })
}

async fn listen(addr: SocketAddr) -> Result<TcpListener, GatewayError> {
    tokenway_transport::socket::listen_tcp(addr)
        .map_err(|source| GatewayError::Bind { addr, source })
}

impl BoundGateway {
    /// The cleartext listener's address.
    pub fn plain_addr(&self) -> Option<SocketAddr> {
        self.plain.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The TLS listener's address.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls.as_ref().and_then(|(l, _)| l.local_addr().ok())
    }

    /// The tunnel's own TLS port (`tunnel.tcp_listen`).
    pub fn tunnel_tcp_addr(&self) -> Option<SocketAddr> {
        self.tunnel_tcp
            .as_ref()
            .and_then(|(l, _)| l.local_addr().ok())
    }

    /// The public HTTP/3 front's UDP address.
    pub fn h3_addr(&self) -> Option<SocketAddr> {
        self.h3.as_ref().and_then(|e| e.local_addr().ok())
    }

    /// The tunnel port's UDP address.
    pub fn tunnel_addr(&self) -> Option<SocketAddr> {
        self.tunnel.as_ref().and_then(|e| e.local_addr().ok())
    }

    /// `sha256:<hex>` of the certificate the TLS and QUIC fronts present (for edges to pin).
    pub fn fingerprint(&self) -> Option<&str> {
        self.fingerprint.as_deref()
    }

    /// Serves until `shutdown` resolves, then drains open connections.
    pub async fn serve(self, shutdown: impl std::future::Future<Output = ()> + Send) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let graceful = Arc::new(Drain::default());
        // `max_connections` for the API's TCP fronts (cleartext and TLS together) and, apart,
        // for the tunnel's TCP port: a flood of public connections does not lock edges out of
        // their fallback.
        let max = self.shared.config.max_connections;
        let permits = [Arc::new(Semaphore::new(max)), Arc::new(Semaphore::new(max))];
        for (id, _) in self.shared.live_upstreams() {
            tokio::spawn(probe::run(self.shared.clone(), id, stop_rx.clone()));
        }
        tokio::spawn(crate::upstream_h1::sweep_idle(
            self.shared.h1.clone(),
            stop_rx.clone(),
        ));
        if let Some(path) = self.shared.config.backends_file.clone() {
            tokio::spawn(discovery::watch_file(
                self.shared.clone(),
                path,
                stop_rx.clone(),
            ));
        }
        if !self.shared.config.discovery.dns.is_empty() {
            tokio::spawn(discovery::dns::run(self.shared.clone(), stop_rx.clone()));
        }
        let mut tasks = Vec::new();
        // The TCP listeners, as plain sockets that every front thread registers with its own
        // event loop.
        let mut listeners = Vec::new();
        let tcp = self.plain.map(|l| (l, None, TcpFront::Api));
        let tls = self.tls.map(|(l, a)| (l, Some(a), TcpFront::Api));
        let tunnel_tcp = self.tunnel_tcp.map(|(l, a)| (l, Some(a), TcpFront::Tunnel));
        for (l, tls, front) in tcp.into_iter().chain(tls).chain(tunnel_tcp) {
            match l.into_std() {
                Ok(l) => listeners.push((l, tls, front)),
                Err(e) => tracing::error!(error = %e, "cannot take over a listener"),
            }
        }
        let fronts = FrontThreads {
            shared: self.shared.clone(),
            graceful: graceful.clone(),
            permits: permits.clone(),
            stop: stop_rx.clone(),
            pinned: Arc::new(PinnedThreads::default()),
        };
        // Read before any front thread is pinned (`front_cpu_affinity`).
        let config = &self.shared.config;
        let allowed = cpu_affinity::allowed_cpus();
        let cpus = cpu_affinity::front_cpus(config.front_cpu_affinity, config.front_thread_count());
        let mut extra = fronts.spawn_threads(&listeners, &cpus);
        // This runtime's worker is front thread 0.
        if let Some(&cpu) = cpus.first() {
            pin_worker(cpu, fronts.pinned.clone());
        }
        self.shared.placement_metrics.set_pinned(cpus.len());
        if config.front_cpu_affinity == cpu_affinity::Affinity::Auto && !cpus.is_empty() {
            // Pinned threads step aside while another program holds their CPU.
            tokio::spawn(cpu_placement::watch(
                fronts.pinned.clone(),
                allowed,
                self.shared.placement_metrics.clone(),
                stop_rx.clone(),
            ));
        }
        tokio::spawn(keep_timer_armed(stop_rx.clone()));
        for (l, tls, front) in listeners {
            match TcpListener::from_std(l) {
                Ok(l) => tasks.push(tokio::spawn(fronts.clone().accept_loop(l, tls, front))),
                Err(e) => tracing::error!(error = %e, "cannot register a listener"),
            }
        }
        drop(fronts);
        let mut quic = Vec::new();
        for (endpoint, front) in [(self.h3, Front::Public), (self.tunnel, Front::Tunnel)] {
            if let Some(endpoint) = endpoint {
                quic.push(tokio::spawn(h3_front::serve(
                    endpoint,
                    self.shared.clone(),
                    front,
                    stop_rx.clone(),
                    DRAIN,
                )));
            }
        }
        shutdown.await;
        let _ = stop_tx.send(true);
        for t in tasks {
            let _ = t.await;
        }
        extra.stop_accepting().await;
        // The QUIC fronts drain their requests (h3_front::serve) while the TCP ones do.
        let tcp = async {
            if tokio::time::timeout(DRAIN, graceful.shutdown())
                .await
                .is_err()
            {
                tracing::info!("connections still open after the drain period; closing them");
            }
        };
        let quic = async {
            for t in quic {
                let _ = t.await;
            }
        };
        tokio::join!(tcp, quic);
        extra.exit().await;
    }
}

/// What every front thread shares: the gateway, the graceful-shutdown handle, the connection
/// limit and the stop signal.
#[derive(Clone)]
struct FrontThreads {
    shared: Arc<Shared>,
    graceful: Arc<Drain>,
    /// The connection limits: the API fronts', the tunnel TCP port's.
    permits: [Arc<Semaphore>; 2],
    stop: watch::Receiver<bool>,
    /// The front threads that pinned themselves, for `cpu_placement::watch`.
    pinned: Arc<PinnedThreads>,
}

/// The front threads besides the caller's: each signals when it stopped accepting, and leaves
/// (closing what is still open on it) when told to exit.
struct ExtraFronts {
    stopped: Vec<tokio::sync::oneshot::Receiver<()>>,
    exited: Vec<tokio::sync::oneshot::Receiver<()>>,
    exit: watch::Sender<bool>,
}

impl ExtraFronts {
    async fn stop_accepting(&mut self) {
        for s in self.stopped.drain(..) {
            let _ = s.await;
        }
    }

    async fn exit(self) {
        let _ = self.exit.send(true);
        for e in self.exited {
            let _ = e.await;
        }
    }
}

impl FrontThreads {
    /// Starts front threads 1.. (`front_threads` in all, with the caller's), each running its
    /// own single-threaded event loop with accept loops on duplicates of `listeners`. A thread
    /// that cannot start is logged and skipped: the others serve.
    fn spawn_threads(&self, listeners: &[Listener], cpus: &[usize]) -> ExtraFronts {
        let (exit, exit_rx) = watch::channel(false);
        let mut extra = ExtraFronts {
            stopped: Vec::new(),
            exited: Vec::new(),
            exit,
        };
        for index in 1..self.shared.config.front_thread_count() {
            let mut own = Vec::new();
            for (l, tls, front) in listeners {
                match l.try_clone() {
                    Ok(l) => own.push((l, tls.clone(), *front)),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot share a listener with a front thread")
                    }
                }
            }
            let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel();
            let (exited_tx, exited_rx) = tokio::sync::oneshot::channel();
            let fronts = self.clone();
            let exit = exit_rx.clone();
            let cpu = cpus.get(index).copied();
            let spawned = std::thread::Builder::new()
                .name(format!("tokenway-front-{index}"))
                .spawn(move || {
                    fronts.run_thread(index, cpu, own, stopped_tx, exit);
                    let _ = exited_tx.send(());
                });
            match spawned {
                Ok(_) => {
                    extra.stopped.push(stopped_rx);
                    extra.exited.push(exited_rx);
                }
                Err(e) => tracing::warn!(error = %e, index, "cannot start a front thread"),
            }
        }
        extra
    }

    /// Body of front thread `index`, whose event loop runs on `cpu` only if one is given.
    fn run_thread(
        self,
        index: usize,
        cpu: Option<usize>,
        listeners: Vec<Listener>,
        stopped: tokio::sync::oneshot::Sender<()>,
        mut exit: watch::Receiver<bool>,
    ) {
        // One worker, like the main runtime (see `main.rs`): tasks of a request stay on it.
        let runtime = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(format!("tokenway-front-{index}"))
            .on_thread_start(move || {
                crate::upstream_h1::set_front_thread(index);
            })
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                tracing::warn!(error = %e, index, "cannot start a front thread's event loop");
                return;
            }
        };
        runtime.block_on(async move {
            if let Some(cpu) = cpu {
                pin_worker(cpu, self.pinned.clone());
            }
            tokio::spawn(keep_timer_armed(self.stop.clone()));
            let mut loops = Vec::new();
            for (l, tls, front) in listeners {
                match TcpListener::from_std(l) {
                    Ok(l) => loops.push(tokio::spawn(self.clone().accept_loop(l, tls, front))),
                    Err(e) => tracing::warn!(error = %e, index, "cannot register a listener"),
                }
            }
            drop(self);
            for l in loops {
                let _ = l.await;
            }
            let _ = stopped.send(());
            // Connections accepted here keep running on this thread while the gateway drains.
            let _ = exit.wait_for(|e| *e).await;
        });
    }

    async fn accept_loop(self, listener: TcpListener, tls: Option<TlsAcceptor>, front: TcpFront) {
        accept_loop(
            listener,
            tls,
            front,
            self.shared,
            self.graceful,
            self.permits[usize::from(front == TcpFront::Tunnel)].clone(),
            self.stop,
        )
        .await;
    }
}

/// Keeps a timer due within [`TIMER_KEEPER`] on this thread's event loop until `stop`.
///
/// tokio wakes its own event loop (an `eventfd` write, then an extra `epoll_wait` that returns
/// at once) whenever a timer is registered that is due before every other one. Each request
/// arms long timeouts (header read, first byte, stream idle), and on a front thread with no
/// shorter timer pending one of them was that earliest timer: one `eventfd` write per request
/// (ftrace: 8045 in 8134 requests), right after the answer was written, while a client woken
/// on the same CPU waited for the gateway to go back to sleep. With this timer always due
/// sooner, registering a request's timeouts costs no system call.
async fn keep_timer_armed(mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(TIMER_KEEPER);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    front: TcpFront,
    shared: Arc<Shared>,
    graceful: Arc<Drain>,
    permits: Arc<Semaphore>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            _ = stop.changed() => return,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        let drain = graceful.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let read_timeout = shared.config.timeouts.client_read();
            match tls {
                None => {
                    // The first bytes tell HTTP/1.1 from h2c (prior knowledge); a connection
                    // that sends nothing is closed after the client read timeout.
                    let mut first = BytesMut::with_capacity(FIRST_READ_BYTES);
                    let mut stream = stream;
                    match tokio::time::timeout(read_timeout, sniff(&mut stream, &mut first)).await {
                        Ok(Ok(true)) => {
                            let stream = Rewound::new(first.freeze(), stream);
                            serve_h2(stream, peer, front, shared, &drain).await
                        }
                        Ok(Ok(false)) => serve_h1(stream, first, peer, front, shared, &drain).await,
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "connection failed"),
                        Err(_) => {
                            tracing::debug!(%peer, "no request within timeouts.client_read_ms; closing")
                        }
                    }
                }
                Some(acceptor) => {
                    let handshake =
                        tokio::time::timeout(read_timeout, acceptor.accept(stream)).await;
                    match handshake {
                        Ok(Ok(tls_stream)) => {
                            let h2 = tls_stream.get_ref().1.alpn_protocol() == Some(b"h2");
                            if h2 {
                                serve_h2(tls_stream, peer, front, shared, &drain).await
                            } else {
                                let first = BytesMut::new();
                                serve_h1(tls_stream, first, peer, front, shared, &drain).await
                            }
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
        });
    }
}

/// Reads the first bytes of a cleartext connection into `first`: `true` when they are the
/// HTTP/2 connection preface (h2c with prior knowledge, RFC 9113 §3.3), `false` at the first
/// byte that is not.
async fn sniff(stream: &mut TcpStream, first: &mut BytesMut) -> std::io::Result<bool> {
    loop {
        let n = first.len().min(H2_PREFACE.len());
        if !H2_PREFACE.starts_with(&first[..n]) {
            return Ok(false);
        }
        if n == H2_PREFACE.len() {
            return Ok(true);
        }
        if stream.read_buf(first).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// An HTTP/1.1 connection, on the gateway's own front (`front_h1`).
async fn serve_h1<S>(
    stream: S,
    first: BytesMut,
    peer: SocketAddr,
    front: TcpFront,
    shared: Arc<Shared>,
    drain: &Arc<Drain>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let stream = StallGuard::new(stream, shared.config.timeouts.client_write());
    drain
        .watch(H1Connection::new(stream, first, peer, front, shared))
        .await;
}

/// An HTTP/2 connection, on hyper.
async fn serve_h2<S>(
    stream: S,
    peer: SocketAddr,
    front: TcpFront,
    shared: Arc<Shared>,
    drain: &Arc<Drain>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new()).http2_only();
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(1024)
        // The head limit of the other fronts (HTTP/1.1, HTTP/3), not h2's 16 KiB default: an
        // edge falling back to TCP sends what it sent over QUIC.
        .max_header_list_size(64 << 10)
        .keep_alive_interval(Some(Duration::from_secs(20)));
    let stream = StallGuard::new(stream, shared.config.timeouts.client_write());
    let write_deadline = shared.config.timeouts.client_write();
    let idle = shared.config.timeouts.client_read();
    let activity = Arc::new(Activity::default());
    let requests = Arc::clone(&activity);
    let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
        // An edge's fallback connection (a request with a valid tunnel token): kept open. A
        // header alone is not enough, nor the tunnel port: a prober shown the masquerade site
        // would hold its connection (and a `max_connections` slot) for good.
        let edge = shared
            .tunnel
            .as_ref()
            .is_some_and(|t| t.is_authenticated(req.headers()));
        let in_flight = requests.start(edge);
        let answer = service::handle(shared.clone(), req, peer, front);
        async move {
            let resp = answer.await?;
            Ok::<_, std::convert::Infallible>(resp.map(|body| {
                in_flight.track(crate::h2_stall::with_write_deadline(body, write_deadline))
            }))
        }
    });
    // With upgrades: CONNECT port forwarding from edges on their TCP fallback.
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
    let conn = IdleClose::new(conn.into_owned(), activity, idle);
    if let Err(e) = drain.watch(conn).await {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

pin_project_lite::pin_project! {
    /// A stream whose first bytes were already read: they are read again first.
    struct Rewound<S> {
        first: Bytes,
        #[pin]
        inner: S,
    }
}

impl<S> Rewound<S> {
    fn new(first: Bytes, inner: S) -> Self {
        Self { first, inner }
    }
}

impl<S: AsyncRead> AsyncRead for Rewound<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.project();
        if !this.first.is_empty() {
            let n = this.first.len().min(buf.remaining());
            buf.put_slice(&this.first.split_to(n));
            return Poll::Ready(Ok(()));
        }
        this.inner.poll_read(cx, buf)
    }
}

impl<S: AsyncWrite> AsyncWrite for Rewound<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.project().inner.poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.project().inner.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
