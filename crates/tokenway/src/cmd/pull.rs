//! `tokenway pull`: download a model revision from mirrors, peers and/or an origin,
//! verified and resumable; optionally serve the pieces held to other pullers (see
//! `docs/weights.md`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use tokenway_mirror::announce::Announcer;
use tokenway_mirror::dir_lock::DirLock;
use tokenway_mirror::display::PullDisplay;
use tokenway_mirror::faults::Faults;
use tokenway_mirror::holdings::Holdings;
use tokenway_mirror::peer_server::PeerServer;
use tokenway_mirror::size::parse_size;
use tokenway_mirror::{open_origin, pull_from, ModelRef, PullOptions, PullReport, SourceSet};

/// Flags of `tokenway pull`.
#[derive(clap::Args)]
pub struct PullArgs {
    /// What to pull: `NAME` (tag latest), `NAME:TAG` or `NAME@REVISION`.
    #[arg(value_name = "MODEL")]
    pub model: String,
    /// Mirrors, `http://HOST:PORT` or `https://HOST[:PORT]`, comma-separated; the lowest RTT
    /// is preferred, the others are fallbacks.
    #[arg(long, value_name = "URL[,URL...]", value_delimiter = ',')]
    pub mirror: Vec<String>,
    /// Origin object store, e.g. `file:///srv/models`: the last fallback after the mirrors
    /// (or the only source).
    #[arg(long, value_name = "URL")]
    pub origin: Option<String>,
    /// Output directory; unfinished files live in `<out>/.partial` until verified.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Pieces downloaded at once.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub parallel: usize,
    /// Serve the pieces this node holds to other pullers on ADDR, register with the mirror,
    /// and keep serving after the pull until interrupted.
    #[arg(long, value_name = "ADDR")]
    pub serve: Option<SocketAddr>,
    /// Region of this node (peers are shared within a region); default: the mirror's.
    #[arg(long, value_name = "NAME", default_value = "")]
    pub region: String,
    /// Cap on download rate, bytes per second (e.g. `100M`).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub limit_rate: Option<u64>,
    /// Fetch pieces in file order even with --serve (by default a sharing pull starts at a
    /// random piece, so nodes that start together have different pieces to give each other).
    #[arg(long)]
    pub sequential: bool,
    /// Do not hedge straggling pieces to a second source.
    #[arg(long)]
    pub no_hedge: bool,
    /// Hash every file already in place, even those an earlier pull into this directory
    /// verified and that are unchanged since (by default those are trusted without being read,
    /// see `<out>/.tokenway/verified.json`).
    #[arg(long)]
    pub verify: bool,
    /// Requests per mirror to measure its RTT.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub rtt_probes: u32,
    #[command(flatten)]
    pub token: crate::cmd::weights_access::TokenArg,
    #[command(flatten)]
    pub tls: crate::cmd::weights_access::ClientTlsArgs,
    /// TESTING ONLY: as a peer, corrupt one byte of every Nth piece served (0 = off).
    #[arg(long, value_name = "N", default_value_t = 0, hide = true)]
    pub test_corrupt_every: u64,
}

/// Ctrl-C presses; on Unix none is lost between two waits (a second press that comes while
/// the first is being handled still counts).
struct Interrupts {
    #[cfg(unix)]
    sigint: Option<tokio::signal::unix::Signal>,
}

impl Interrupts {
    fn new() -> Self {
        Self {
            #[cfg(unix)]
            sigint: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok(),
        }
    }

    /// Waits for the next press; false if they cannot be listened for.
    async fn next(&mut self) -> bool {
        #[cfg(unix)]
        if let Some(s) = &mut self.sigint {
            return s.recv().await.is_some();
        }
        tokio::signal::ctrl_c().await.is_ok()
    }
}

/// One line with every counter, for logs and tests.
fn summary(r: &PullReport, secs: f64) -> String {
    let list = |v: &[(String, u32)]| -> String {
        v.iter()
            .map(|(s, n)| format!("{}:{n}", s.replace(' ', "=")))
            .collect::<Vec<_>>()
            .join(",")
    };
    format!(
        "pull summary: complete={} seconds={secs:.2} pieces_fetched={} bytes_fetched={} \
         bytes_from_origin={} bytes_from_mirrors={} bytes_from_peers={} pieces_written={} \
         pieces_resumed={} pieces_discarded_in_flight={} pieces_corrupt={} pieces_hedged={} \
         hedge_wins={} source_errors={} files_already_present={} files_hashed={} files_written={} \
         penalised=[{}] \
         failing=[{}]",
        r.complete,
        r.pieces_fetched,
        r.bytes_fetched,
        r.bytes_from_origin,
        r.bytes_from_mirrors,
        r.bytes_from_peers,
        r.pieces_written,
        r.pieces_resumed,
        r.pieces_discarded_in_flight,
        r.pieces_corrupt,
        r.pieces_hedged,
        r.hedge_wins,
        r.source_errors,
        r.files_already_present,
        r.files_hashed,
        r.files_written,
        list(&r.sources_penalised),
        list(&r.sources_failing)
    )
}

/// Runs `tokenway pull`.
pub async fn run(args: PullArgs) -> anyhow::Result<()> {
    let mref = ModelRef::parse(&args.model)?;
    if args.mirror.is_empty() && args.origin.is_none() {
        anyhow::bail!("give --mirror URL[,URL...] and/or --origin URL");
    }
    if args.serve.is_some() && args.mirror.is_empty() {
        anyhow::bail!("--serve needs --mirror: peers find each other through a mirror");
    }
    let origin = args.origin.as_deref().map(open_origin).transpose()?;
    let token = args.token.get()?;
    let started = Instant::now();

    let listener = match args.serve {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--serve: cannot listen on {addr}"))?;
            let a = l.local_addr()?;
            println!("tokenway pull listening on http://{a}");
            Some((l, a))
        }
        None => None,
    };
    let own_addr = listener.as_ref().map(|(_, a)| a.to_string());
    let sources = Arc::new(
        SourceSet::new(
            &args.mirror,
            origin,
            args.rtt_probes,
            own_addr.clone(),
            token.clone(),
            &args.tls.trust(),
        )
        .await
        .context("setting up the sources")?,
    );
    for m in sources.mirrors() {
        match m.rtt {
            Some(rtt) => eprintln!("{}: rtt {:.2} ms", m.name, rtt.as_secs_f64() * 1e3),
            None => eprintln!(
                "{}: no answer to RTT probes (tried after the other sources until it answers)",
                m.name
            ),
        }
    }
    let manifest = sources
        .resolve(&mref)
        .await
        .with_context(|| format!("resolving {mref}"))?;

    let display = PullDisplay::for_stderr();
    let holdings = Arc::new(Holdings::default());
    // A node that serves the files after the pull keeps the directory locked while it does:
    // another pull placing the next revision there would have it serve other bytes under
    // the old hashes.
    let dir_lock = match args.serve {
        Some(_) => {
            Some(Arc::new(DirLock::take(&args.out).with_context(|| {
                format!("locking {}", args.out.display())
            })?))
        }
        None => None,
    };
    let mut opts = PullOptions {
        parallel: args.parallel.max(1),
        progress: Some(display.callback()),
        hedge: !args.no_hedge,
        limit_rate: args.limit_rate,
        holdings: Some(Arc::clone(&holdings)),
        spread: args.serve.is_some() && !args.sequential,
        verify: args.verify,
        dir_lock,
        ..PullOptions::default()
    };
    opts.max_attempts = opts.max_attempts.max(sources.all().len() as u32 + 1);

    if let Some((listener, _)) = listener {
        let server = PeerServer::new(
            Arc::clone(&holdings),
            token.clone(),
            Faults::corrupt_every(args.test_corrupt_every),
        );
        tokio::spawn(server.serve(listener, std::future::pending::<()>()));
    }
    let announcer = (!args.mirror.is_empty()).then(|| {
        Arc::new(Announcer {
            id: format!("{:016x}", rand::random::<u64>()),
            region: args.region.clone(),
            addr: own_addr.clone(),
            want: manifest.files.iter().map(|f| f.hash).collect(),
            holdings: Arc::clone(&holdings),
            peer_bytes: Arc::clone(&opts.peer_bytes),
            sources: Arc::clone(&sources),
            shares: Default::default(),
        })
    });

    // Ctrl-C stops starting pieces (those in flight are dropped when they end); what is
    // recorded is kept for the next run. A second Ctrl-C quits at once: the record on disk
    // only ever lists written pieces, so nothing is lost but the pieces in flight.
    let cancel = Arc::clone(&opts.cancel);
    let mut interrupts = Interrupts::new();
    tokio::spawn(async move {
        if interrupts.next().await {
            eprintln!(
                "interrupted: stopping; progress is kept, rerun to resume (Ctrl-C again to quit \
                 at once)"
            );
            cancel.store(true, Ordering::Relaxed);
            if interrupts.next().await {
                eprintln!("interrupted again: quitting; progress is kept, rerun to resume");
                std::process::exit(130);
            }
        }
    });

    let out = args.out.clone();
    let run_pull = async {
        // Learn the peers before the first piece so they are preferred from the start.
        if let Some(a) = &announcer {
            if let Err(e) = a.once().await {
                eprintln!("warning: cannot announce to any mirror ({e}); pulling without peers");
            }
            tokio::spawn(Arc::clone(a).run());
        }
        pull_from(Arc::clone(&sources), manifest.clone(), &out, &opts).await
    };
    let result = run_pull.await;
    display.finish();
    if let Some(a) = announcer
        .as_ref()
        .filter(|_| !opts.cancel.load(Ordering::Relaxed))
    {
        // Report the final bytes-from-peers count (and complete holdings) right away (not
        // when interrupted: an unreachable mirror would hold up the exit).
        let _ = a.once().await;
    }
    let report = result.with_context(|| format!("pulling {mref} into {}", args.out.display()))?;
    let secs = started.elapsed().as_secs_f64();
    eprintln!("{}", summary(&report, secs));
    if !report.complete {
        anyhow::bail!("pull of {mref} interrupted; rerun the same command to resume");
    }
    eprintln!(
        "pulled {}@{} into {}: {} files ({} already present), {} bytes fetched in {secs:.1}s, {} pieces resumed",
        report.manifest.model,
        report.manifest.revision,
        args.out.display(),
        report.manifest.files.len(),
        report.files_already_present,
        report.bytes_fetched,
        report.pieces_resumed
    );
    if args.serve.is_some() {
        eprintln!("pull complete; serving pieces to peers until interrupted");
        crate::cmd::signal::shutdown().await;
    }
    Ok(())
}
