//! `tokenway mirror`: a regional cache between pullers and the origin.
//!
//! - [`server`]: the HTTP API (manifests, blob ranges, preheat, peers, metrics).
//! - [`cache`]: verified pieces on disk, LRU by bytes, never evicting what is in use.
//! - [`single_flight`]: one origin fetch per piece however many requests want it.
//! - [`origin_reads`]: the origin reads of those flights, a bounded number at once.
//! - [`recent`]: the pieces fetched last, in memory, for requests just after their flight.
//! - [`manifests`]: manifests and tags, kept so they are served with the origin down.
//! - [`peers`]: which pullers of a region hold which pieces.
//! - [`preheat`]: pulling a whole model into the cache before anyone asks.
//! - [`serve_budget`]: a bound on the piece bytes held for clients, all together.
//! - [`metrics`]: the Prometheus series.
//!
//! A piece is the unit of everything here: it is fetched from the origin with one ranged
//! GET, verified against the manifest's piece hash, written to the cache, and served. The
//! mirror never serves a byte it has not verified.

pub mod cache;
pub mod manifests;
pub mod metrics;
pub mod origin_reads;
pub mod outboard_disk;
pub mod peers;
pub mod preheat;
pub mod recent;
pub mod serve_budget;
pub mod server;
pub mod single_flight;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use object_store::path::Path as StorePath;
use object_store::ObjectStore;
use tokenway_telemetry::Registry;

use crate::faults::Faults;
use crate::http_error::ServeError;
use crate::manifest::{blob_key, FileEntry};
use crate::range_server::BudgetWait;
use crate::rate_limit::Pacer;
use crate::MirrorError;
use cache::{CachedPiece, PieceCache, PieceKey};
use manifests::ManifestCache;
use metrics::MirrorMetrics;
use origin_reads::{OriginReads, ReadError};
use peers::PeerDirectory;
use recent::{RecentPieces, RECENT_BYTES};
use serve_budget::{ServeBudget, BUDGET_WAIT, MAX_SERVING_BYTES};
use single_flight::{FlightError, Role, SingleFlight};

/// Origin fetches in flight at once (distinct pieces); more requests get 503.
pub const MAX_FLIGHTS: usize = 1024;
/// Peers tracked at once.
pub const MAX_PEERS: usize = 4096;
/// A peer that has not announced for this long is forgotten.
pub const PEER_TTL: Duration = Duration::from_secs(30);
/// Preheats running at once.
pub const MAX_PREHEATS: usize = 4;
/// Fetches of one piece from the origin before giving up (corrupt or failed).
const ORIGIN_ATTEMPTS: u32 = 3;

/// Settings of a mirror.
#[derive(Clone, Debug)]
pub struct MirrorConfig {
    /// Origin URL (`file:///srv/models`).
    pub origin: String,
    /// Cache directory.
    pub cache_dir: PathBuf,
    /// Bound of the piece cache, bytes.
    pub max_size: u64,
    /// Region this mirror serves; peers of other regions are not handed out.
    pub region: String,
    /// Pieces a preheat fetches at once.
    pub preheat_parallel: usize,
    /// Cap on blob bytes served per second, all clients together (`--limit-rate`): the
    /// uplink this mirror may use. Peers are not limited by it, so a crowd that shares
    /// gets its pieces from each other while the mirror's share stays within the cap.
    pub limit_rate: Option<u64>,
    /// The access token every `/v1/` request must carry; `None` serves everyone.
    pub token: Option<crate::auth::AccessToken>,
    /// Test only: corrupt every Nth piece served (0 = off).
    pub test_corrupt_every: u64,
    /// Test only: stall every Nth piece served (0 = off) for `test_stall_ms`, at most 3 times.
    pub test_stall_every: u64,
    /// Test only: length of a stall.
    pub test_stall_ms: u64,
}

impl MirrorConfig {
    /// Checks the settings; the error names the flag.
    pub fn validate(&self) -> Result<(), MirrorError> {
        let bad = |field: &str, reason: &str| MirrorError::Config {
            field: field.into(),
            reason: reason.into(),
        };
        if self.max_size < crate::manifest::MIN_PIECE_SIZE {
            return Err(bad("--max-size", "must be at least 64 KiB (one piece)"));
        }
        if self.limit_rate == Some(0) {
            return Err(bad(
                "--limit-rate",
                "must be more than 0 bytes per second (leave it out for no cap)",
            ));
        }
        if self.preheat_parallel == 0 || self.preheat_parallel > 256 {
            return Err(bad("preheat parallelism", "must be 1 to 256"));
        }
        if self.region.len() > 64 {
            return Err(bad("--region", "at most 64 bytes"));
        }
        Ok(())
    }
}

type PieceResult = Result<Bytes, ServeError>;

/// A running mirror's state.
pub struct Mirror {
    origin: Arc<dyn ObjectStore>,
    cache: PieceCache,
    flights: Arc<SingleFlight<PieceKey, PieceResult>>,
    recent: Mutex<RecentPieces>,
    manifests: ManifestCache,
    peers: Mutex<PeerDirectory>,
    metrics: MirrorMetrics,
    registry: Registry,
    region: String,
    faults: Faults,
    preheat_parallel: usize,
    preheats: Arc<tokio::sync::Semaphore>,
    uplink: Option<Pacer>,
    origin_reads: OriginReads,
    token: Option<crate::auth::AccessToken>,
    serving: ServeBudget,
}

impl Mirror {
    /// Opens the origin and the cache.
    pub fn open(config: &MirrorConfig) -> Result<Arc<Self>, MirrorError> {
        config.validate()?;
        let origin = crate::open_origin(&config.origin)?;
        Self::with_origin(config, origin)
    }

    /// Like [`open`](Self::open) with an origin already opened.
    pub fn with_origin(
        config: &MirrorConfig,
        origin: Arc<dyn ObjectStore>,
    ) -> Result<Arc<Self>, MirrorError> {
        config.validate()?;
        let cache = PieceCache::open(&config.cache_dir, config.max_size).map_err(|e| {
            MirrorError::io(
                format!("opening the cache {}", config.cache_dir.display()),
                e,
            )
        })?;
        if let Some(free) = crate::disk_space::available(&config.cache_dir) {
            let room = free.saturating_add(cache.used());
            if room < config.max_size {
                tracing::warn!(
                    "the disk under {} has room for {} of cache, less than --max-size {}: the \
                     cache's bound comes down to what fits when the disk fills",
                    config.cache_dir.display(),
                    crate::disk_space::gb(room),
                    crate::disk_space::gb(config.max_size)
                );
            }
        }
        let (metrics, registry) = MirrorMetrics::register();
        metrics
            .cache_max_bytes
            .set(i64::try_from(config.max_size).unwrap_or(i64::MAX));
        metrics
            .cache_bytes
            .set(i64::try_from(cache.used()).unwrap_or(i64::MAX));
        let serving = ServeBudget::new(MAX_SERVING_BYTES, metrics.serving_bytes.clone());
        Ok(Arc::new(Self {
            origin,
            cache,
            flights: SingleFlight::new(MAX_FLIGHTS),
            origin_reads: OriginReads::default(),
            recent: Mutex::new(RecentPieces::new(RECENT_BYTES)),
            manifests: ManifestCache::new(
                &config.cache_dir,
                metrics.outboard_bytes_from_origin.clone(),
            ),
            peers: Mutex::new(PeerDirectory::new(&config.region, MAX_PEERS, PEER_TTL)),
            metrics,
            registry,
            region: config.region.clone(),
            faults: Faults::corrupt_every(config.test_corrupt_every).with_stalls(
                config.test_stall_every,
                Duration::from_millis(config.test_stall_ms),
                3,
            ),
            preheat_parallel: config.preheat_parallel,
            preheats: Arc::new(tokio::sync::Semaphore::new(MAX_PREHEATS)),
            uplink: config.limit_rate.map(Pacer::new),
            token: config.token.clone(),
            serving,
        }))
    }

    /// The access token requests must carry, if any.
    pub fn token(&self) -> Option<&crate::auth::AccessToken> {
        self.token.as_ref()
    }

    /// The metrics.
    pub fn metrics(&self) -> &MirrorMetrics {
        &self.metrics
    }

    /// The Prometheus text of this mirror.
    pub fn metrics_text(&self) -> String {
        {
            let mut dir = self
                .peers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            dir.expire(std::time::Instant::now());
            self.metrics
                .peers
                .set(i64::try_from(dir.len()).unwrap_or(i64::MAX));
        }
        self.metrics
            .cache_bytes
            .set(i64::try_from(self.cache.used()).unwrap_or(i64::MAX));
        // Below `--max-size` while the disk under the cache is fuller than that.
        self.metrics
            .cache_max_bytes
            .set(i64::try_from(self.cache.max_bytes()).unwrap_or(i64::MAX));
        MirrorMetrics::render(&self.registry)
    }

    /// Piece `i` of `entry`'s blob: from the cache, or fetched from the origin once however
    /// many ask, verified and cached.
    pub async fn piece(self: &Arc<Self>, entry: Arc<FileEntry>, i: u64) -> PieceResult {
        let key = PieceKey {
            hash: entry.hash,
            piece_size: entry.piece_size,
            index: i,
        };
        if let Some(b) = self.recent_piece(&key) {
            self.metrics.cache_hits.inc();
            self.metrics.bytes_from_cache.inc_by(b.len() as u64);
            return Ok(b);
        }
        if let Some(b) = self.cached_piece(&entry, i).await {
            self.metrics.cache_hits.inc();
            self.metrics.bytes_from_cache.inc_by(b.len() as u64);
            return Ok(b);
        }
        self.metrics.cache_misses.inc();
        self.piece_from_origin(entry, i).await.map(|(b, _)| b)
    }

    /// Makes sure piece `i` is cached; true if it already was.
    pub async fn ensure_piece(
        self: &Arc<Self>,
        entry: Arc<FileEntry>,
        i: u64,
    ) -> Result<bool, ServeError> {
        let key = PieceKey {
            hash: entry.hash,
            piece_size: entry.piece_size,
            index: i,
        };
        if self.cache.refresh(&key) {
            return Ok(true);
        }
        self.piece_from_origin(entry, i).await.map(|_| false)
    }

    /// Piece `i` from the disk cache, verified against the manifest as it is read: the cache
    /// holds only verified pieces, but a disk can rot and a file can be changed behind the
    /// mirror's back. A piece that fails is dropped (and counted), so it is fetched again.
    async fn cached_piece(&self, entry: &Arc<FileEntry>, i: u64) -> Option<Bytes> {
        let key = PieceKey {
            hash: entry.hash,
            piece_size: entry.piece_size,
            index: i,
        };
        let e = Arc::clone(entry);
        match self
            .cache
            .read_verified(&key, move |b| e.piece_matches(i, b))
            .await
        {
            CachedPiece::Hit(b) => Some(b),
            CachedPiece::Miss => None,
            CachedPiece::Corrupt => {
                self.metrics.cache_corrupt.inc();
                tracing::warn!(
                    blob = %entry.hash,
                    piece = i,
                    "a cached piece failed verification (disk corruption?): dropped, fetching it again"
                );
                None
            }
        }
    }

    fn recent_piece(&self, key: &PieceKey) -> Option<Bytes> {
        self.recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(key)
    }

    async fn piece_from_origin(
        self: &Arc<Self>,
        entry: Arc<FileEntry>,
        i: u64,
    ) -> Result<(Bytes, Role), ServeError> {
        let key = PieceKey {
            hash: entry.hash,
            piece_size: entry.piece_size,
            index: i,
        };
        let this = Arc::clone(self);
        let (res, role) = self
            .flights
            .run(
                key,
                move || async move { this.fetch_and_cache(&entry, i).await },
            )
            .await
            .map_err(|e| match e {
                FlightError::Busy => ServeError::busy(format!(
                    "more than {MAX_FLIGHTS} origin fetches in flight; retry"
                )),
                FlightError::Lost => {
                    ServeError::origin("the origin fetch was lost (task failed); retry")
                }
            })?;
        if role == Role::Follower {
            self.metrics.single_flight_joins.inc();
        }
        res.map(|b| (b, role))
    }

    /// The single-flight work: the cache again (a flight may have just ended), else the
    /// origin with verification, then the cache.
    async fn fetch_and_cache(&self, entry: &Arc<FileEntry>, i: u64) -> PieceResult {
        let key = PieceKey {
            hash: entry.hash,
            piece_size: entry.piece_size,
            index: i,
        };
        if let Some(b) = self.recent_piece(&key) {
            return Ok(b);
        }
        if let Some(b) = self.cached_piece(entry, i).await {
            return Ok(b);
        }
        let range = entry.piece_range(i);
        let path = StorePath::from(blob_key(&entry.hash));
        let mut last = String::new();
        for attempt in 1..=ORIGIN_ATTEMPTS {
            if attempt > 1 {
                tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
            }
            self.metrics.origin_fetches.inc();
            let got = self
                .origin_reads
                .read(self.origin.as_ref(), &path, range.clone())
                .await;
            let bytes = match got {
                Ok(b) => b,
                Err(ReadError::NotFound) => {
                    self.metrics.origin_errors.inc();
                    return Err(ServeError::not_found(format!(
                        "blob {} is missing in the origin",
                        entry.hash
                    )));
                }
                Err(ReadError::Failed(why)) => {
                    self.metrics.origin_errors.inc();
                    last = why;
                    continue;
                }
            };
            // Verified, then copied into an aligned pooled buffer: the cache writes it from
            // there with O_DIRECT and the same bytes are served (see `cache`).
            let e2 = Arc::clone(entry);
            let checked = tokio::task::spawn_blocking(move || {
                e2.piece_matches(i, &bytes)
                    .then(|| crate::piece_buffers::aligned_copy(&bytes))
            })
            .await
            .ok()
            .flatten();
            let Some(bytes) = checked else {
                self.metrics.origin_corrupt.inc();
                last = format!(
                    "the origin served corrupt data for blob {} piece {i} (bytes {}..{}): BLAKE3 mismatch (publish the model again with --reupload to repair it)",
                    entry.hash, range.start, range.end
                );
                continue;
            };
            self.metrics.bytes_from_origin.inc_by(bytes.len() as u64);
            self.recent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(key, bytes.clone());
            match self.cache.store(key, &bytes).await {
                Ok(s) => {
                    self.metrics.cache_evictions.inc_by(s.evicted);
                }
                Err(e) => tracing::warn!(error = %e, "cannot cache a piece; serving it uncached"),
            }
            return Ok(bytes);
        }
        Err(ServeError::origin(last))
    }

    /// Applies the test fault flags to a piece about to be served.
    /// Piece `i` of `entry` for a response, holding its share of the serving budget until
    /// the client has taken it (see [`serve_budget`]).
    pub(crate) async fn piece_for_client(
        self: &Arc<Self>,
        entry: Arc<FileEntry>,
        i: u64,
        wait: BudgetWait,
    ) -> PieceResult {
        let r = entry.piece_range(i);
        let len = r.end - r.start;
        // The uplink's pace first, holding no share: a crowd queued behind `--limit-rate`
        // would otherwise keep the whole budget while it waits, and turn later requests away.
        self.pace(len).await;
        let share = self.serving.take(len, wait.limit(BUDGET_WAIT)).await?;
        let b = self.piece(entry, i).await?;
        let b = self.serve_piece(b).await;
        Ok(ServeBudget::hold(b, share))
    }

    /// `bytes` (an outboard) for a response, holding their share of the serving budget until
    /// the client has taken them, as pieces do.
    pub(crate) async fn held_for_client(&self, bytes: Bytes) -> Result<Bytes, ServeError> {
        let share = self.serving.take(bytes.len() as u64, BUDGET_WAIT).await?;
        Ok(ServeBudget::hold(bytes, share))
    }

    /// Waits for `bytes` worth of the uplink (`--limit-rate`), if it is limited.
    async fn pace(&self, bytes: u64) {
        if let Some(up) = &self.uplink {
            up.pace(bytes).await;
        }
    }

    pub(crate) async fn serve_piece(&self, piece: Bytes) -> Bytes {
        if let Some(d) = self.faults.stall() {
            tokio::time::sleep(d).await;
        }
        let before = self.faults.injected();
        let out = self.faults.apply(piece);
        if self.faults.injected() != before {
            self.metrics.faults_injected.inc();
        }
        out
    }
}
