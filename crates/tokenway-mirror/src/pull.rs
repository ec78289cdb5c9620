//! `pull`: download a model revision with parallel ranged GETs, verifying every piece.
//!
//! For each distinct blob the puller keeps `<out>/.partial/<hash>` (preallocated to the full
//! size, written in place) and `<out>/.partial/<hash>.progress` (which pieces are done, see
//! [`crate::progress`]). A piece is fetched with one ranged GET, hashed, and only if its
//! BLAKE3 matches the manifest is it written and then marked done; so an interrupted pull
//! loses at most the pieces that were in flight. When every piece of a blob is done, the
//! whole-file hash is checked (the root check), the file synced, and renamed atomically into
//! `<out>/<path>`; nothing unverified ever appears under its final name. The root check merges
//! the chaining values of the verified pieces ([`crate::piece_tree`]: with format 2 manifests
//! these are the piece hashes themselves, format 1 computes them beside the piece hash), which
//! gives the BLAKE3 of exactly the bytes written without reading the file again; only a
//! format 1 manifest whose piece size is not a power of two still hashes the file once more.
//!
//! Pieces come from a [`SourceSet`]: peers holding the piece, then mirrors by RTT, then the
//! origin. A corrupt piece is discarded, its source penalised, and the piece refetched from
//! the next source (up to `max_attempts` fetches from mirrors and the origin; peers are an
//! extra: at most [`PEER_TRIES_PER_PIECE`] failed or corrupt peer fetches per piece, which
//! never use up the mirrors' and the origin's attempts, and a peer that cannot be connected
//! to is demoted at once, see [`SourceState::unreachable`]). A piece much slower than recent ones
//! (see [`crate::straggler`]) is hedged: a second source is asked too and the first
//! verified copy wins. With the origin as the only source a refetch only helps against
//! corruption in transit; corruption at rest ends in an error naming the file and piece.
//! Local I/O errors (disk full) stop the pull with progress kept.
//!
//! The next piece to start comes from a [`PieceQueue`]: a pull that shares with peers
//! (`spread`) starts at a random piece and wraps around, and every other slot goes to a piece
//! a peer already holds, so nodes that scale up together do not all ask the mirror for the
//! same piece at the same moment; the mirror's uplink carries about one copy and the peers
//! the rest. A lone pull goes in file order.

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{self, FuturesUnordered, StreamExt};
use object_store::path::Path as StorePath;
use object_store::ObjectStore;

use crate::dir_lock::DirLock;
use crate::holdings::Holdings;
use crate::manifest::{
    manifest_key, parse_tag, tag_key, Blake3Hash, FileEntry, Manifest, ModelRef, Selector,
    MAX_TAG_BYTES,
};
use crate::origin::small_get::{get_small, Small};
use crate::outage::Outage;
use crate::piece_bits::PieceBits;
use crate::piece_queue::{spread_order, PieceQueue};
use crate::piece_writer::PieceWriter;
use crate::progress::PieceProgress;
use crate::publish::read_full;
use crate::rate_limit::Pacer;
use crate::source::{FetchError, SourceKind, MAX_MANIFEST_BYTES};
use crate::sources::{SourceSet, SourceState};
use crate::straggler::{should_hedge, Straggler, FLOOR};
use crate::verified::{Stamp, Verified};
use crate::MirrorError;

/// Directory under the output directory that holds unfinished blobs.
pub const PARTIAL_DIR: &str = ".partial";
/// Failed or corrupt peer fetches of one piece after which that piece is taken from mirrors
/// and the origin only.
pub const PEER_TRIES_PER_PIECE: u32 = 2;
/// Answers "busy" (503, a mirror at its serving bound) a piece waits out before they count as
/// failed attempts: with [`busy_pause`], about a minute.
pub const BUSY_WAITS: u32 = 30;

/// The pause after the `k`-th busy answer for a piece: 200 ms doubling to 2 s, with up to a
/// quarter more at random so that a crowd turned away together does not come back together.
fn busy_pause(k: u32) -> Duration {
    let base = Duration::from_millis(200)
        .saturating_mul(1 << k.min(4))
        .min(Duration::from_secs(2));
    base + base.mul_f64(rand::random::<f64>() / 4.0)
}

/// Puts the first of `cands` that is neither the origin nor in `busy` (mirrors that answered
/// 503 for this piece since the last pause) first, if the first is busy: a mirror at its
/// serving bound is not asked again while another mirror or a peer may be idle, and the
/// origin is not preferred to a busy mirror (it is the one to spare). Returns whether such an
/// idle candidate was there; if not, the piece pauses before asking the busy ones again.
fn pass_over_busy(cands: &mut [Arc<SourceState>], busy: &[String]) -> bool {
    let busy_first = cands.first().is_some_and(|s| busy.contains(&s.name));
    let idle = cands
        .iter()
        .position(|s| s.kind() != SourceKind::Origin && !busy.contains(&s.name));
    match idle {
        Some(i) => {
            if busy_first {
                cands[..=i].rotate_right(1);
            }
            true
        }
        None => false,
    }
}

/// Progress callback: called after every completed piece and file.
pub type ProgressFn = Arc<dyn Fn(&PullProgress) + Send + Sync>;

/// Settings of a pull.
#[derive(Clone)]
pub struct PullOptions {
    /// Pieces fetched at once.
    pub parallel: usize,
    /// Fetches of one piece from mirrors and the origin before giving up (corrupt data or
    /// store errors); failed peer fetches do not count (see [`PEER_TRIES_PER_PIECE`]).
    pub max_attempts: u32,
    /// Stop (as if interrupted) once this many pieces have been written. For tests and for
    /// bounded work; the pull returns `complete: false` and can be resumed.
    pub piece_budget: Option<u64>,
    /// Set to stop the pull: no new pieces start, pieces in flight are discarded.
    pub cancel: Arc<AtomicBool>,
    /// Called as the pull advances.
    pub progress: Option<ProgressFn>,
    /// Hedge straggling pieces to a second source.
    pub hedge: bool,
    /// Cap on fetched bytes per second.
    pub limit_rate: Option<u64>,
    /// Kept up to date with the verified pieces this node holds (for serving peers).
    pub holdings: Option<Arc<Holdings>>,
    /// Bytes taken from peers so far (shared with the announcer).
    pub peer_bytes: Arc<AtomicU64>,
    /// Start at a random piece instead of the first (for nodes that share as peers).
    pub spread: bool,
    /// Hash every file already in place, even those an earlier pull listed as verified and
    /// that are unchanged since (see [`crate::verified`]).
    pub verify: bool,
    /// The output directory's lock, taken by the caller (who keeps it past the pull, to serve
    /// the files); without one the pull takes it for its own run.
    pub dir_lock: Option<Arc<DirLock>>,
}

impl Default for PullOptions {
    fn default() -> Self {
        Self {
            parallel: 8,
            max_attempts: 3,
            piece_budget: None,
            cancel: Arc::new(AtomicBool::new(false)),
            progress: None,
            hedge: true,
            limit_rate: None,
            holdings: None,
            peer_bytes: Arc::new(AtomicU64::new(0)),
            spread: false,
            verify: false,
            dir_lock: None,
        }
    }
}

impl std::fmt::Debug for PullOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PullOptions")
            .field("parallel", &self.parallel)
            .field("max_attempts", &self.max_attempts)
            .field("piece_budget", &self.piece_budget)
            .field("hedge", &self.hedge)
            .field("limit_rate", &self.limit_rate)
            .finish_non_exhaustive()
    }
}

/// A snapshot of a pull's advance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullProgress {
    /// Bytes verified and on disk (including what earlier runs left).
    pub bytes_done: u64,
    /// Bytes of the whole revision.
    pub bytes_total: u64,
    /// Files in place.
    pub files_done: usize,
    /// Files in the revision.
    pub files_total: usize,
    /// A file that just got into place, if any.
    pub file_finished: Option<String>,
    /// Still checking what earlier runs left on disk (nothing is fetched yet).
    pub checking: bool,
}

/// What a pull did; counters are for this run only.
#[derive(Clone, Debug)]
pub struct PullReport {
    /// The manifest pulled.
    pub manifest: Manifest,
    /// Every file is in place and verified.
    pub complete: bool,
    /// Ranged GETs that returned data (including discarded and refetched ones).
    pub pieces_fetched: u64,
    /// Bytes those GETs returned.
    pub bytes_fetched: u64,
    /// Pieces verified, written and recorded.
    pub pieces_written: u64,
    /// Pieces fetched but discarded because the pull was stopped while they were in flight.
    pub pieces_discarded_in_flight: u64,
    /// Pieces that failed verification and were discarded.
    pub pieces_corrupt: u64,
    /// Pieces found done from an earlier run (re-verified locally).
    pub pieces_resumed: u64,
    /// Files already in place and verified before this run.
    pub files_already_present: usize,
    /// Of those, the files read and hashed to check them (the others were listed as verified
    /// by an earlier pull and are unchanged since, see [`crate::verified`]).
    pub files_hashed: usize,
    /// Files renamed into place by this run.
    pub files_written: usize,
    /// Pieces for which a second source was asked because the first was slow.
    pub pieces_hedged: u64,
    /// Hedged pieces where the second source won.
    pub hedge_wins: u64,
    /// Verified bytes by kind of source.
    pub bytes_from_origin: u64,
    /// Verified bytes from mirrors.
    pub bytes_from_mirrors: u64,
    /// Verified bytes from peers.
    pub bytes_from_peers: u64,
    /// Failed requests (any source).
    pub source_errors: u64,
    /// Sources that served corrupt pieces, with how many.
    pub sources_penalised: Vec<(String, u32)>,
    /// Sources with failed requests (errors, timeouts, silences abandoned for a hedge), with
    /// how many, the manifest's and outboards' included.
    pub sources_failing: Vec<(String, u32)>,
}

/// Fetches and validates the manifest `mref` names.
pub async fn resolve(store: &dyn ObjectStore, mref: &ModelRef) -> Result<Manifest, MirrorError> {
    let revision = match &mref.selector {
        Selector::Revision(r) => r.clone(),
        Selector::Tag(t) => {
            let key = tag_key(&mref.model, t);
            let bytes = get_all(store, &key, MAX_TAG_BYTES, || {
                format!("tag {t} of model {}", mref.model)
            })
            .await?;
            parse_tag(&bytes)?
        }
    };
    let key = manifest_key(&mref.model, &revision);
    let bytes = get_all(store, &key, MAX_MANIFEST_BYTES as u64, || {
        format!("revision {revision} of model {}", mref.model)
    })
    .await?;
    let manifest = Manifest::from_json(&bytes)?;
    if manifest.model != mref.model || manifest.revision != revision {
        return Err(MirrorError::manifest(
            "model/revision",
            format!(
                "object {key} describes {}@{}, not {}@{revision}",
                manifest.model, manifest.revision, mref.model
            ),
        ));
    }
    Ok(manifest)
}

/// The origin's small object `key` (a tag or a manifest), of at most `limit` bytes.
async fn get_all(
    store: &dyn ObjectStore,
    key: &str,
    limit: u64,
    what: impl Fn() -> String,
) -> Result<bytes::Bytes, MirrorError> {
    let path = StorePath::from(key);
    match get_small(store, &path, limit).await {
        Ok(Small::Bytes(b)) => Ok(b),
        Ok(Small::TooLarge(n)) => Err(MirrorError::Remote {
            url: format!("origin object {key}"),
            reason: format!(
                "{} holds {n} bytes or more, where at most {limit} can be valid",
                what()
            ),
        }),
        Err(object_store::Error::NotFound { .. }) => Err(MirrorError::NotFound {
            what: what(),
            key: key.into(),
        }),
        Err(e) => Err(MirrorError::store(format!("reading {key}"), e)),
    }
}

/// Removes the files under `partial_dir` that belong to blobs not in `current` (hex hashes):
/// a partial blob and its progress, temporary and copy files, named by the blob's hash. Other
/// names are left alone. Returns the bytes the removed files held on the disk.
async fn reclaim_foreign_partials(partial_dir: &Path, current: &HashSet<String>) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(mut dir) = tokio::fs::read_dir(partial_dir).await else {
        return 0;
    };
    let mut reclaimed = 0u64;
    while let Ok(Some(e)) = dir.next_entry().await {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let hex = name.split('.').next().unwrap_or_default();
        let ours = hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit());
        let suffix_known = matches!(
            &name[hex.len()..],
            "" | ".progress" | ".progress.tmp" | ".copy"
        );
        if !ours || !suffix_known || current.contains(hex) {
            continue;
        }
        // Blocks allocated, not the length: a partial file is sparse until written.
        let held = e.metadata().await.map_or(0, |m| m.blocks() * 512);
        if tokio::fs::remove_file(e.path()).await.is_ok() {
            reclaimed += held;
        }
    }
    reclaimed
}

/// Stops a pull: set from outside (`PullOptions::cancel`) or by the pull itself (piece
/// budget reached, local I/O error), without touching the caller's flag.
#[derive(Clone)]
struct Stop {
    external: Arc<AtomicBool>,
    internal: Arc<AtomicBool>,
}

impl Stop {
    fn is_set(&self) -> bool {
        self.external.load(Ordering::Relaxed) || self.internal.load(Ordering::Relaxed)
    }
}

/// Resolves once `stop` is set (checked every 100 ms).
async fn stopped(stop: &Stop) {
    while !stop.is_set() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One blob being assembled.
struct Blob {
    entry: FileEntry,
    /// Every manifest path with this content (usually one).
    paths: Vec<String>,
    partial: PathBuf,
    progress_path: PathBuf,
    /// The resume record, open for updates in place once this run has written it whole.
    record: Option<Arc<std::fs::File>>,
    file: Option<Arc<PieceWriter>>,
    progress: PieceProgress,
    /// Tree hash of each verified piece (see [`FileEntry::verify_piece`]), for the root check.
    trees: Vec<Option<Blake3Hash>>,
    remaining: u64,
}

enum PieceEnd {
    Written,
    Discarded,
    Failed(MirrorError),
}

struct PieceOutcome {
    blob: usize,
    piece: u64,
    fetched: u64,
    bytes_fetched: u64,
    corrupt: u64,
    errors: u64,
    hedged: bool,
    hedge_won: bool,
    /// Kind of the source the written copy came from, and its size.
    verified_from: Option<(SourceKind, u64)>,
    /// Tree hash of the written copy.
    tree: Option<Blake3Hash>,
    end: PieceEnd,
}

/// Pulls `mref` from the origin `store` into `out`.
pub async fn pull(
    store: Arc<dyn ObjectStore>,
    mref: &ModelRef,
    out: &Path,
    opts: &PullOptions,
) -> Result<PullReport, MirrorError> {
    let sources = Arc::new(SourceSet::origin_only(store));
    let manifest = sources.resolve(mref).await?;
    pull_from(sources, manifest, out, opts).await
}

/// What every piece fetch shares.
struct Ctx {
    sources: Arc<SourceSet>,
    manifest: Manifest,
    straggler: Mutex<Straggler>,
    /// `--limit-rate`: a piece takes its slot when its turn comes, so a hedge dropped while
    /// it waits (the first source answered) takes none.
    rate: Option<Pacer>,
    hedge: bool,
    attempts: u32,
    only_origin: bool,
    outage: Outage,
    /// Pieces fetched at once (`parallel`), sharing the link: each piece's deadline allows
    /// for the others ([`crate::source::piece_deadline`]).
    sharing: u64,
}

/// Pulls `manifest` (resolved with [`SourceSet::resolve`]) from `sources` into `out`.
pub async fn pull_from(
    sources: Arc<SourceSet>,
    manifest: Manifest,
    out: &Path,
    opts: &PullOptions,
) -> Result<PullReport, MirrorError> {
    // The caller's lock (one that serves the files after the pull keeps it), or our own.
    let dir_lock = match &opts.dir_lock {
        Some(_) => None,
        None => {
            let o = out.to_path_buf();
            Some(blocking(move || DirLock::take(&o)).await?)
        }
    };
    let partial_dir = out.join(PARTIAL_DIR);
    tokio::fs::create_dir_all(&partial_dir)
        .await
        .map_err(|e| MirrorError::io(format!("creating {}", partial_dir.display()), e))?;

    let mut report = PullReport {
        manifest: manifest.clone(),
        complete: false,
        pieces_fetched: 0,
        bytes_fetched: 0,
        pieces_written: 0,
        pieces_discarded_in_flight: 0,
        pieces_corrupt: 0,
        pieces_resumed: 0,
        files_already_present: 0,
        files_hashed: 0,
        files_written: 0,
        pieces_hedged: 0,
        hedge_wins: 0,
        bytes_from_origin: 0,
        bytes_from_mirrors: 0,
        bytes_from_peers: 0,
        source_errors: 0,
        sources_penalised: Vec::new(),
        sources_failing: Vec::new(),
    };
    let mut prog = PullProgress {
        bytes_done: 0,
        bytes_total: manifest.total_size(),
        files_done: 0,
        files_total: manifest.files.len(),
        file_finished: None,
        checking: false,
    };

    // Group files by content; skip blobs whose every path is already in place and verified.
    let mut by_hash: BTreeMap<Blake3Hash, (FileEntry, Vec<String>)> = BTreeMap::new();
    for f in &manifest.files {
        by_hash
            .entry(f.hash)
            .or_insert_with(|| (f.clone(), Vec::new()))
            .1
            .push(f.path.clone());
    }
    // What is on disk already, blobs checked a few at a time (a rerun over a large model reads
    // and hashes what earlier runs left; files listed as verified and unchanged are not read).
    // With `verify`, the list is kept (a stopped run must not lose it) but not trusted.
    let mut verified = {
        let out2 = out.to_path_buf();
        blocking(move || Ok(Verified::load(&out2))).await?
    };
    {
        let listed: std::collections::HashSet<&str> =
            manifest.files.iter().map(|f| f.path.as_str()).collect();
        verified.retain(|p| listed.contains(p));
    }
    let scan_list = Arc::new(verified);
    prog.checking = true;
    let scan_parallel = std::thread::available_parallelism()
        .map_or(2, std::num::NonZeroUsize::get)
        .clamp(1, 4);
    let scans = stream::iter(by_hash)
        .map(|(_, (entry, paths))| {
            let (out2, pd, v, cancel) = (
                out.to_path_buf(),
                partial_dir.clone(),
                (!opts.verify).then(|| Arc::clone(&scan_list)),
                Arc::clone(&opts.cancel),
            );
            let (e2, p2) = (entry.clone(), paths.clone());
            async move {
                let r =
                    blocking(move || scan_blob(&out2, &pd, &e2, &p2, v.as_deref(), &cancel)).await;
                (entry, paths, r)
            }
        })
        .buffered(scan_parallel);
    let mut scans = std::pin::pin!(scans);
    let mut found: Vec<(String, Option<Stamp>)> = Vec::new();
    let mut cancelled = false;
    let mut blobs: Vec<Blob> = Vec::new();
    while let Some((entry, paths, scanned)) = scans.next().await {
        let hash = entry.hash;
        let (file, progress, trees) = match scanned? {
            Scanned::Cancelled => {
                cancelled = true;
                continue;
            }
            Scanned::Present(stamps) => {
                report.files_hashed += stamps.len();
                found.extend(stamps);
                if let Some(h) = &opts.holdings {
                    h.add(
                        &entry,
                        out.join(&paths[0]),
                        PieceBits::full(entry.pieces.len() as u64),
                    );
                }
                report.files_already_present += paths.len();
                prog.files_done += paths.len();
                prog.bytes_done += entry.size * paths.len() as u64;
                // An earlier run that stopped between placing the file and removing its record
                // (a process exiting while a blob was being finished) leaves these behind.
                let hex = hash.to_hex();
                for leftover in [
                    hex.clone(),
                    format!("{hex}.progress"),
                    format!("{hex}.progress.tmp"),
                    format!("{hex}.copy"),
                ] {
                    let _ = tokio::fs::remove_file(partial_dir.join(leftover)).await;
                }
                if let Some(cb) = &opts.progress {
                    cb(&prog);
                }
                continue;
            }
            Scanned::Partial(file, progress, trees) => (file, progress, trees),
        };
        let partial = partial_dir.join(hash.to_hex());
        let progress_path = partial_dir.join(format!("{}.progress", hash.to_hex()));
        let done = progress.done_count();
        report.pieces_resumed += done;
        if let Some(h) = &opts.holdings {
            let mut bits = PieceBits::empty(entry.pieces.len() as u64);
            for i in 0..entry.pieces.len() as u64 {
                if progress.is_done(i) {
                    bits.set(i);
                }
            }
            h.add(&entry, partial.clone(), bits);
        }
        for i in 0..entry.pieces.len() as u64 {
            if progress.is_done(i) {
                prog.bytes_done += entry.piece_range(i).end - entry.piece_range(i).start;
            }
        }
        if let Some(cb) = &opts.progress {
            cb(&prog);
        }
        blobs.push(Blob {
            remaining: (entry.pieces.len() as u64).saturating_sub(done),
            entry,
            paths,
            partial,
            progress_path,
            record: None,
            file: Some(Arc::new(file)),
            progress,
            trees,
        });
    }
    let mut verified = (*scan_list).clone();
    for (p, stamp) in found {
        verified.record(&p, stamp);
    }
    save_verified(&verified).await;
    prog.checking = false;
    if cancelled {
        return Ok(report);
    }
    if let Some(cb) = &opts.progress {
        cb(&prog);
    }

    // The room the rest of the pull needs (the pieces still missing, and the extra copies of
    // files listed under several paths), checked now: a disk too small is otherwise found
    // hours into the download (partial files are sparse until written).
    let needed: u64 = blobs
        .iter()
        .map(|b| {
            let missing: u64 = (0..b.entry.pieces.len() as u64)
                .filter(|i| !b.progress.is_done(*i))
                .map(|i| {
                    let r = b.entry.piece_range(i);
                    r.end - r.start
                })
                .sum();
            missing + b.entry.size * (b.paths.len() as u64).saturating_sub(1)
        })
        .sum();
    if let Some(mut free) = crate::disk_space::available(&partial_dir) {
        if needed > free {
            // Partial files of blobs this revision does not have (an earlier pull of another
            // revision, stopped) are given up before the pull is: the directory is locked, and
            // without this a volume filled by a stopped pull of `:latest` refused every pull
            // of the tag's next revision until `.partial` was emptied by hand.
            let current: HashSet<String> = manifest.files.iter().map(|f| f.hash.to_hex()).collect();
            let reclaimed = reclaim_foreign_partials(&partial_dir, &current).await;
            if reclaimed > 0 {
                tracing::info!(
                    bytes = reclaimed,
                    "removed the partial files of blobs this revision does not have, to make room"
                );
                free = crate::disk_space::available(&partial_dir).unwrap_or(free);
            }
        }
        if needed > free {
            return Err(MirrorError::io(
                format!(
                    "the pull needs {} more on the disk under {} and {} is free",
                    crate::disk_space::gb(needed),
                    out.display(),
                    crate::disk_space::gb(free)
                ),
                std::io::Error::from(std::io::ErrorKind::StorageFull),
            ));
        }
    }

    let mut jobs: Vec<(usize, u64)> = blobs
        .iter()
        .enumerate()
        .flat_map(|(b, blob)| {
            (0..blob.entry.pieces.len() as u64)
                .filter(|i| !blob.progress.is_done(*i))
                .map(move |i| (b, i))
        })
        .collect();
    let seed: u64 = rand::random();
    if opts.spread {
        spread_order(&mut jobs, seed);
    }
    let counts: Vec<u64> = blobs.iter().map(|b| b.entry.pieces.len() as u64).collect();
    let hashes: Vec<Blake3Hash> = blobs.iter().map(|b| b.entry.hash).collect();
    let mut queue = PieceQueue::new(jobs, &counts);
    let peer_sources = Arc::clone(&sources);
    let taking = opts.holdings.clone();
    let jobs = std::iter::from_fn(move || {
        let (b, i) = queue.next(
            |b, started| peer_sources.peer_piece(&hashes[b], started, seed),
            |b, i| peer_sources.peer_taking(&hashes[b], i),
        )?;
        if let Some(h) = &taking {
            h.taking(&hashes[b], i, true);
        }
        Some((b, i))
    });
    let jobs_meta: Vec<(String, FileEntry, Arc<PieceWriter>)> = blobs
        .iter()
        .map(|b| {
            (
                b.paths[0].clone(),
                b.entry.clone(),
                Arc::clone(
                    b.file
                        .as_ref()
                        .expect("invariant: file open until finished"),
                ),
            )
        })
        .collect();
    let jobs_meta = Arc::new(jobs_meta);
    let mut errors: Vec<MirrorError> = Vec::new();
    // Blobs with nothing left to fetch (empty files, or all pieces from an earlier run).
    for (b, blob) in blobs.iter_mut().enumerate() {
        if blob.remaining == 0 {
            let placed = finish_blob(out, b, blob, &mut report, &mut prog, opts, &mut errors).await;
            for (p, stamp) in placed {
                verified.record(&p, stamp);
            }
        }
    }

    let all = sources.all();
    let ctx = Arc::new(Ctx {
        only_origin: all.len() == 1 && all[0].kind() == SourceKind::Origin,
        attempts: opts.max_attempts.max(1),
        sources: Arc::clone(&sources),
        manifest: manifest.clone(),
        straggler: Mutex::new(Straggler::default()),
        rate: opts.limit_rate.map(Pacer::new),
        hedge: opts.hedge,
        outage: Outage::new(std::time::Instant::now()),
        sharing: opts.parallel.max(1) as u64,
    });
    let stop = Stop {
        external: Arc::clone(&opts.cancel),
        internal: Arc::new(AtomicBool::new(false)),
    };
    let stop2 = stop.clone();
    let stream = stream::iter(jobs)
        .take_while(move |_| {
            let go = !stop2.is_set();
            async move { go }
        })
        .map(|(b, i)| {
            let ctx = Arc::clone(&ctx);
            let meta = Arc::clone(&jobs_meta);
            let stop = stop.clone();
            async move {
                let (path, entry, file) = &meta[b];
                fetch_piece(&ctx, path, entry, file, b, i, &stop).await
            }
        })
        .buffer_unordered(opts.parallel.max(1));
    let mut stream = std::pin::pin!(stream);

    // Finishing a blob (fsync, whole-file hash, rename) takes seconds for a large file; it
    // runs beside the stream so the pieces of the other blobs keep arriving meanwhile.
    let mut finishing = FuturesUnordered::new();
    let mut pieces_left = true;
    while pieces_left || !finishing.is_empty() {
        let o = tokio::select! {
            o = stream.next(), if pieces_left => match o {
                Some(o) => o,
                None => {
                    pieces_left = false;
                    continue;
                }
            },
            Some((b, res)) = finishing.next() => {
                let placed =
                    finished_blob(out, &blobs[b], res, &mut report, &mut prog, opts, &mut errors);
                for (p, stamp) in placed {
                    verified.record(&p, stamp);
                }
                continue;
            }
        };
        report.pieces_fetched += o.fetched;
        report.bytes_fetched += o.bytes_fetched;
        report.pieces_corrupt += o.corrupt;
        report.pieces_hedged += u64::from(o.hedged);
        report.hedge_wins += u64::from(o.hedge_won);
        report.source_errors += o.errors;
        if let Some((kind, n)) = o.verified_from {
            match kind {
                SourceKind::Origin => report.bytes_from_origin += n,
                SourceKind::Mirror => report.bytes_from_mirrors += n,
                SourceKind::Peer => {
                    report.bytes_from_peers += n;
                    opts.peer_bytes.fetch_add(n, Ordering::Relaxed);
                }
            }
        }
        if !matches!(o.end, PieceEnd::Written) {
            if let Some(h) = &opts.holdings {
                h.taking(&blobs[o.blob].entry.hash, o.piece, false);
            }
        }
        match o.end {
            PieceEnd::Discarded => report.pieces_discarded_in_flight += 1,
            PieceEnd::Failed(e) => {
                if matches!(e, MirrorError::Io { .. }) {
                    // Local trouble (disk full): stop starting pieces, keep progress.
                    stop.internal.store(true, Ordering::Relaxed);
                }
                errors.push(e);
            }
            PieceEnd::Written => {
                report.pieces_written += 1;
                let blob = &mut blobs[o.blob];
                if !blob.progress.is_done(o.piece) {
                    blob.remaining = blob.remaining.saturating_sub(1);
                }
                blob.progress.set(o.piece, true);
                blob.trees[o.piece as usize] = o.tree;
                if let Some(h) = &opts.holdings {
                    h.piece_written(&blob.entry.hash, o.piece);
                }
                let r = blob.entry.piece_range(o.piece);
                prog.bytes_done += r.end - r.start;
                if let Err(e) = save_record(blob, o.piece).await {
                    stop.internal.store(true, Ordering::Relaxed);
                    errors.push(e);
                }
                if blob.remaining == 0 {
                    finishing.push(finish_work(out, o.blob, blob));
                } else if let Some(cb) = &opts.progress {
                    cb(&prog);
                }
                if opts
                    .piece_budget
                    .is_some_and(|budget| report.pieces_written >= budget)
                {
                    stop.internal.store(true, Ordering::Relaxed);
                }
            }
        }
    }

    let counted = |counter: fn(&SourceState) -> u32| -> Vec<(String, u32)> {
        sources
            .all()
            .iter()
            .filter_map(|s| {
                let n = counter(s);
                (n > 0).then(|| (s.name.clone(), n))
            })
            .collect()
    };
    report.sources_penalised = counted(|s| s.corrupt.load(Ordering::Relaxed));
    report.sources_failing = counted(|s| s.failures.load(Ordering::Relaxed));
    save_verified(&verified).await;
    let count = errors.len();
    if let Some(first) = errors.into_iter().next() {
        return Err(MirrorError::PiecesFailed {
            count,
            first: Box::new(first),
        });
    }
    report.complete = prog.files_done == prog.files_total;
    if report.complete {
        // Best effort: the directory is empty once everything is in place.
        drop(dir_lock);
        let _ = tokio::fs::remove_dir(&partial_dir).await;
    }
    Ok(report)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, MirrorError> + Send + 'static,
) -> Result<T, MirrorError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| MirrorError::io("blocking task", std::io::Error::other(e)))?
}

/// What [`scan_blob`] found of a blob on disk.
enum Scanned {
    /// Every path in place with the right hash; the stamps of those hashed now (`None` where
    /// the file changed while it was hashed: not listed).
    Present(Vec<(String, Option<Stamp>)>),
    /// Not in place: its partial file (opened, or created), recorded pieces re-verified.
    Partial(PieceWriter, PieceProgress, Vec<Option<Blake3Hash>>),
    /// The pull was stopped while checking.
    Cancelled,
}

/// Checks what is on disk of the blob `entry` listed at `paths`: the files in place (those
/// `verified` lists unchanged are not read; all are without a list), else the partial file
/// and its record.
fn scan_blob(
    out: &Path,
    partial_dir: &Path,
    entry: &FileEntry,
    paths: &[String],
    verified: Option<&Verified>,
    cancel: &AtomicBool,
) -> Result<Scanned, MirrorError> {
    let mut stamps = Vec::new();
    let mut present = true;
    for p in paths {
        if verified.is_some_and(|v| v.holds(p, &entry.hash)) {
            continue;
        }
        let path = out.join(p);
        // Stamped before it is read, and listed only if unchanged after.
        let before = Stamp::of(&path, &entry.hash);
        match file_matches(&path, entry.size, &entry.hash, cancel) {
            Some(true) => {
                let after = Stamp::of(&path, &entry.hash);
                stamps.push((p.clone(), after.filter(|a| Some(a) == before.as_ref())));
            }
            Some(false) => {
                present = false;
                break;
            }
            None => return Ok(Scanned::Cancelled),
        }
    }
    if present {
        return Ok(Scanned::Present(stamps));
    }
    let partial = partial_dir.join(entry.hash.to_hex());
    let progress_path = partial_dir.join(format!("{}.progress", entry.hash.to_hex()));
    Ok(
        match open_partial(entry, &partial, &progress_path, cancel)? {
            Some((f, progress, trees)) => {
                Scanned::Partial(PieceWriter::new(f, &partial), progress, trees)
            }
            None => Scanned::Cancelled,
        },
    )
}

/// Is `path` a file of `size` bytes whose BLAKE3 is `hash`? `None` if `cancel` was set while
/// it was being hashed.
fn file_matches(path: &Path, size: u64, hash: &Blake3Hash, cancel: &AtomicBool) -> Option<bool> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() && m.len() == size => {}
        _ => return Some(false),
    }
    match hash_whole(path, Some(cancel)) {
        Ok(h) => Some(h == *hash),
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => None,
        Err(_) => Some(false),
    }
}

/// BLAKE3 of the file at `path`; fails with `Interrupted` once `cancel` is set.
fn hash_whole(path: &Path, cancel: Option<&AtomicBool>) -> std::io::Result<Blake3Hash> {
    let mut f = std::fs::File::open(path)?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(std::io::ErrorKind::Interrupted.into());
        }
        let n = read_full(&mut f, &mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().into())
}

/// Writes the list of verified files, if it changed; a failure costs only a re-hash later.
async fn save_verified(verified: &Verified) {
    let v = verified.clone();
    let res = tokio::task::spawn_blocking(move || v.save())
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
    if let Err(e) = res {
        tracing::warn!(error = %e, "cannot save the list of verified files; a rerun hashes them again");
    }
}

/// The partial file of a blob, its progress, and the tree hashes of its verified pieces.
type Opened = (std::fs::File, PieceProgress, Vec<Option<Blake3Hash>>);

/// Opens (or creates and preallocates) the partial file of a blob and loads its progress,
/// re-verifying every piece it claims (and keeping their tree hashes); `None` if `cancel`
/// was set meanwhile (the record is left as it is: its pieces were not all checked).
fn open_partial(
    entry: &FileEntry,
    partial: &Path,
    progress_path: &Path,
    cancel: &AtomicBool,
) -> Result<Option<Opened>, MirrorError> {
    let ctx = || format!("opening partial file {}", partial.display());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(partial)
        .map_err(|e| MirrorError::io(ctx(), e))?;
    let len = file
        .metadata()
        .map_err(|e| MirrorError::io(ctx(), e))?
        .len();
    let pieces = entry.pieces.len() as u64;
    let mut progress = if len == entry.size {
        // The record is a little JSON around two hex digits per eight pieces.
        crate::local_read::read_at_most(progress_path, pieces.div_ceil(8) * 2 + 4096)
            .and_then(|b| PieceProgress::decode(&b, &entry.hash, entry.piece_size, pieces))
    } else {
        None
    }
    .unwrap_or_else(|| PieceProgress::new(entry.hash, entry.piece_size, pieces));
    if len != entry.size {
        file.set_len(entry.size).map_err(|e| {
            MirrorError::io(
                format!(
                    "preallocating {} bytes for {}",
                    entry.size,
                    partial.display()
                ),
                e,
            )
        })?;
    }
    let mut buf = Vec::new();
    let mut trees = vec![None; entry.pieces.len()];
    for i in 0..pieces {
        if !progress.is_done(i) {
            continue;
        }
        if cancel.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let r = entry.piece_range(i);
        buf.resize((r.end - r.start) as usize, 0);
        match file
            .read_exact_at(&mut buf, r.start)
            .ok()
            .and_then(|()| entry.verify_piece(i, &buf, true).ok())
        {
            Some(tree) => trees[i as usize] = tree,
            None => progress.set(i, false),
        }
    }
    Ok(Some((file, progress, trees)))
}

/// One fetch from one source, verified.
enum Fetched {
    /// The bytes and their tree hash.
    Good(Bytes, Option<Blake3Hash>),
    Corrupt(u64),
    Failed(FetchError),
}

/// Waits for piece `i`'s turn under the pull's own `--limit-rate`, if it has one.
async fn pace(ctx: &Ctx, entry: &FileEntry, i: u64) {
    if let Some(rate) = &ctx.rate {
        let r = entry.piece_range(i);
        rate.pace(r.end - r.start).await;
    }
}

/// Fetches piece `i` from `src` and verifies it; the duration is the source's (the local
/// rate limit's wait is over before this starts: see [`hedged_fetch`]).
async fn fetch_verified(
    ctx: &Ctx,
    src: &Arc<SourceState>,
    entry: &FileEntry,
    i: u64,
    heard: &AtomicBool,
) -> (Fetched, Duration) {
    let t = Instant::now();
    let bytes = match src
        .source
        .piece(&ctx.manifest, entry, i, heard, ctx.sharing)
        .await
    {
        Ok(b) => b,
        Err(e) => return (Fetched::Failed(e), t.elapsed()),
    };
    let (b2, e2) = (bytes.clone(), entry.clone());
    // One hash per piece with format 2 (the piece hash is its chaining value).
    let checked = tokio::task::spawn_blocking(move || e2.verify_piece(i, &b2, true))
        .await
        .ok()
        .and_then(Result::ok);
    let out = match checked {
        Some(tree) => Fetched::Good(bytes, tree),
        None => Fetched::Corrupt(bytes.len() as u64),
    };
    (out, t.elapsed())
}

/// Fetches from `primary`; if it straggles or stays silent (see [`crate::straggler`]) and
/// `second` exists, from `second` too. Returns every finished fetch in order, the last one the
/// winner if good, and whether it hedged. A primary that never answered and was abandoned for
/// the second's copy is returned as failed, so a silent source is demoted like one that
/// errors.
async fn hedged_fetch(
    ctx: &Ctx,
    primary: &Arc<SourceState>,
    second: Option<&Arc<SourceState>>,
    entry: &FileEntry,
    i: u64,
) -> (Vec<(Arc<SourceState>, Fetched, Duration)>, bool) {
    // The local rate limit's wait first: it is no silence of the source, and counted as one
    // it hedged most pieces of a rate-limited pull (each hedge taking another slot).
    pace(ctx, entry, i).await;
    let heard = AtomicBool::new(false);
    let a = fetch_verified(ctx, primary, entry, i, &heard);
    tokio::pin!(a);
    let Some(second) = second.filter(|_| ctx.hedge) else {
        let (f, d) = a.await;
        return (vec![(Arc::clone(primary), f, d)], false);
    };
    // Wait for the piece or for it to become a straggler; the baseline may appear (or
    // move) while this piece is in flight, so look again at least every FLOOR.
    let started = Instant::now();
    loop {
        let after = ctx
            .straggler
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .hedge_after();
        if should_hedge(after, started.elapsed(), heard.load(Ordering::Relaxed)) {
            break;
        }
        let wait = after.map_or(FLOOR, |d| d.saturating_sub(started.elapsed()).min(FLOOR));
        tokio::select! {
            (f, d) = &mut a => return (vec![(Arc::clone(primary), f, d)], false),
            () = tokio::time::sleep(wait) => {}
        }
    }
    let heard_b = AtomicBool::new(false);
    let b = async {
        pace(ctx, entry, i).await;
        fetch_verified(ctx, second, entry, i, &heard_b).await
    };
    tokio::pin!(b);
    let mut done = Vec::new();
    tokio::select! {
        (f, d) = &mut a => {
            let good = matches!(f, Fetched::Good(..));
            done.push((Arc::clone(primary), f, d));
            if !good {
                let (f, d) = b.await;
                done.push((Arc::clone(second), f, d));
            }
        }
        (f, d) = &mut b => {
            let good = matches!(f, Fetched::Good(..));
            if good && !heard.load(Ordering::Relaxed) {
                let silent = started.elapsed();
                done.push((
                    Arc::clone(primary),
                    Fetched::Failed(FetchError::Unavailable(format!(
                        "no response in {silent:.1?}; abandoned for {}",
                        second.name
                    ))),
                    silent,
                ));
            }
            done.push((Arc::clone(second), f, d));
            if !good {
                let (f, d) = a.await;
                done.push((Arc::clone(primary), f, d));
            }
        }
    }
    (done, true)
}

async fn fetch_piece(
    ctx: &Ctx,
    path: &str,
    entry: &FileEntry,
    file: &Arc<PieceWriter>,
    blob: usize,
    piece: u64,
    stop: &Stop,
) -> PieceOutcome {
    let range = entry.piece_range(piece);
    let mut out = PieceOutcome {
        blob,
        piece,
        fetched: 0,
        bytes_fetched: 0,
        corrupt: 0,
        errors: 0,
        hedged: false,
        hedge_won: false,
        verified_from: None,
        tree: None,
        end: PieceEnd::Discarded,
    };
    let mut tried: Vec<String> = Vec::new();
    let mut last_err: Option<FetchError> = None;
    // All fetches, and those from mirrors and the origin (the authoritative sources): peers
    // (stale, gone, or fake: announcements may be unauthenticated) must not use up the
    // attempts the authoritative sources get.
    let mut fetches = 0u32;
    let mut authoritative = 0u32;
    let mut peer_failures = 0u32;
    // A mirror at its serving bound (503) is alive and asks for patience: those answers wait
    // and do not use up the attempts, up to [`BUSY_WAITS`] of them.
    let mut busy_waits = 0u32;
    // Mirrors that answered busy since the last pause: passed over for any idle one.
    let mut busy_srcs: Vec<String> = Vec::new();
    // Rounds started over because no source answered at all (see `outage`).
    let mut outage_waits = 0u32;
    'rounds: loop {
        while authoritative < ctx.attempts {
            if stop.is_set() {
                return out;
            }
            let peers_left = peer_failures < PEER_TRIES_PER_PIECE;
            let candidates = |tried: &[String]| {
                let mut c = ctx.sources.candidates(&entry.hash, piece, tried);
                if !peers_left {
                    c.retain(|s| s.kind() != SourceKind::Peer);
                }
                c
            };
            let mut cands = candidates(&tried);
            if cands.is_empty() {
                // Every source failed this piece once: go round again after a pause.
                tried.clear();
                tokio::time::sleep(Duration::from_millis(100)).await;
                cands = candidates(&tried);
            }
            pass_over_busy(&mut cands, &busy_srcs);
            let Some(primary) = cands.first() else { break };
            if fetches > 0 && ctx.only_origin {
                tokio::time::sleep(Duration::from_millis(50 * u64::from(fetches + 1))).await;
            }
            // A stop drops the piece in flight at once rather than when its source answers or
            // times out (up to a minute): it would be discarded anyway.
            let (done, hedged) = tokio::select! {
                r = hedged_fetch(ctx, primary, cands.get(1), entry, piece) => r,
                () = stopped(stop) => return out,
            };
            out.hedged |= hedged;
            let mut winner = None;
            let mut busy = false;
            for (src, f, d) in done {
                fetches += 1;
                let is_peer = src.kind() == SourceKind::Peer;
                let is_busy = !is_peer && matches!(f, Fetched::Failed(FetchError::Busy(_)));
                if is_busy && busy_waits < BUSY_WAITS {
                    busy = true;
                } else if !is_peer {
                    authoritative += 1;
                } else if !matches!(f, Fetched::Good(..)) {
                    peer_failures += 1;
                }
                match f {
                    Fetched::Good(bytes, tree) => {
                        out.fetched += 1;
                        out.bytes_fetched += bytes.len() as u64;
                        src.ok(bytes.len() as u64);
                        ctx.straggler
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .record(d);
                        out.hedge_won = hedged && !Arc::ptr_eq(&src, primary);
                        winner = Some((src.kind(), bytes, tree));
                    }
                    Fetched::Corrupt(n) => {
                        out.fetched += 1;
                        out.bytes_fetched += n;
                        out.corrupt += 1;
                        src.penalise();
                        tracing::warn!(source = %src.name, path, piece, "piece failed verification; discarded, source penalised");
                        tried.push(src.name.clone());
                    }
                    Fetched::Failed(e @ FetchError::Busy(_)) if is_busy && busy => {
                        // Not the source's failure: it is asked again after the pause.
                        tracing::debug!(source = %src.name, error = %e, "source busy; waiting");
                        if !busy_srcs.contains(&src.name) {
                            busy_srcs.push(src.name.clone());
                        }
                        last_err = Some(e);
                    }
                    Fetched::Failed(e) => {
                        out.errors += 1;
                        if matches!(e, FetchError::Unreachable(_)) {
                            src.unreachable();
                        } else {
                            src.failed();
                        }
                        tracing::debug!(source = %src.name, error = %e, "piece fetch failed");
                        if matches!(e, FetchError::NotFound(_)) && ctx.only_origin {
                            out.end = PieceEnd::Failed(MirrorError::NotFound {
                                what: format!("file {path:?}: blob {}", entry.hash),
                                key: format!("{e}"),
                            });
                            return out;
                        }
                        tried.push(src.name.clone());
                        last_err = Some(e);
                    }
                }
            }
            let Some((kind, bytes, tree)) = winner else {
                // Another mirror or a peer that has not said busy is asked at once; when all
                // have, the piece pauses and asks them all again.
                if busy && !pass_over_busy(&mut candidates(&tried), &busy_srcs) {
                    busy_srcs.clear();
                    tokio::select! {
                        () = tokio::time::sleep(busy_pause(busy_waits)) => {}
                        () = stopped(stop) => return out,
                    }
                    busy_waits += 1;
                }
                continue;
            };
            if stop.is_set() {
                out.end = PieceEnd::Discarded;
                return out;
            }
            let file = Arc::clone(file);
            let start = range.start;
            let n = bytes.len() as u64;
            let written = tokio::task::spawn_blocking(move || {
                let r = file.write_all_at(&bytes, start);
                crate::piece_buffers::give_back(bytes);
                r
            })
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            out.end = match written {
                Ok(()) => {
                    ctx.outage.piece_done(std::time::Instant::now());
                    out.verified_from = Some((kind, n));
                    out.tree = tree;
                    PieceEnd::Written
                }
                Err(e) => PieceEnd::Failed(MirrorError::io(
                    format!(
                        "file {path:?}: writing piece {piece} (bytes {}..{}) to the partial file; \
                     progress is kept, fix the cause (disk full?) and rerun to resume",
                        range.start, range.end
                    ),
                    e,
                )),
            };
            return out;
        }
        // The attempts ran out. On failures that say nothing of this piece (no connection, no
        // answer, a 5xx, busy), while the pull as a whole still verified a piece recently, every
        // source may just be away for a moment (a restart): wait, and start over.
        let transient = out.corrupt == 0
            && matches!(
                last_err,
                Some(FetchError::Unavailable(_) | FetchError::Unreachable(_) | FetchError::Busy(_))
            );
        if transient {
            let now = std::time::Instant::now();
            if let Some(pause) = ctx.outage.pause(outage_waits, now) {
                if ctx.outage.first_to_wait() {
                    tracing::warn!(
                        quiet_s = ctx.outage.quiet(now).as_secs(),
                        error = %last_err.as_ref().map(ToString::to_string).unwrap_or_default(),
                        "no source is answering; waiting for them to come back (the pull stops after {} s without a piece)",
                        crate::outage::OUTAGE_GRACE.as_secs()
                    );
                }
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = stopped(stop) => return out,
                }
                outage_waits += 1;
                authoritative = 0;
                busy_waits = 0;
                peer_failures = 0;
                tried.clear();
                continue 'rounds;
            }
        }
        break;
    }
    out.end = PieceEnd::Failed(match last_err {
        Some(e) if out.corrupt == 0 => MirrorError::Remote {
            url: format!(
                "file {path:?} piece {piece} (bytes {}..{})",
                range.start, range.end
            ),
            reason: format!("fetching failed {fetches} times; last: {e}"),
        },
        _ => MirrorError::CorruptPiece {
            path: path.to_string(),
            piece,
            start: range.start,
            end: range.end,
            attempts: fetches,
            hint: if ctx.only_origin {
                "; the origin is the only source, so there is nowhere else to refetch from \
                 (publish the model again with --reupload: a plain publish skips an object \
                 of the right name and size)"
                    .into()
            } else {
                "; every source tried served corrupt data".into()
            },
        },
    });
    out
}

/// The paths a finished blob was placed under, with their stamps for the verified list.
type Placed = Vec<(String, Option<Stamp>)>;

/// Verifies a blob whose pieces are all in, and moves it into place under every path.
async fn finish_blob(
    out: &Path,
    b: usize,
    blob: &mut Blob,
    report: &mut PullReport,
    prog: &mut PullProgress,
    opts: &PullOptions,
    errors: &mut Vec<MirrorError>,
) -> Placed {
    let (_, res) = finish_work(out, b, blob).await;
    finished_blob(out, blob, res, report, prog, opts, errors)
}

/// The slow part of finishing blob `b` (sync, root check, rename) as a future that borrows
/// nothing, so it can run while other pieces arrive.
fn finish_work(
    out: &Path,
    b: usize,
    blob: &mut Blob,
) -> impl std::future::Future<Output = (usize, Result<Placed, MirrorError>)> + Send + 'static {
    let file = blob.file.take();
    blob.record = None;
    // Every piece verified and gave its tree hash: the root is merged from them. Otherwise
    // (format 1 with a piece size that is not a power of two) the file is hashed again.
    let trees: Option<Vec<Blake3Hash>> = blob.trees.iter().copied().collect();
    let (entry, paths, partial, progress_path, out2) = (
        blob.entry.clone(),
        blob.paths.clone(),
        blob.partial.clone(),
        blob.progress_path.clone(),
        out.to_path_buf(),
    );
    let res = blocking(move || {
        if let Some(f) = &file {
            f.sync_all()
                .map_err(|e| MirrorError::io(format!("syncing {}", partial.display()), e))?;
        }
        drop(file);
        let got = match &trees {
            Some(t) => entry.file_hash_from_pieces(t),
            None => hash_whole(&partial, None)
                .map_err(|e| MirrorError::io(format!("hashing {}", partial.display()), e))?,
        };
        if got != entry.hash {
            // Every piece verified but the whole did not: the manifest is inconsistent.
            let _ = std::fs::remove_file(&partial);
            let _ = std::fs::remove_file(&progress_path);
            return Err(MirrorError::WholeFileMismatch {
                path: entry.path.clone(),
                got,
                want: entry.hash,
            });
        }
        // Extra paths with the same content get copies; the first takes the partial itself.
        for p in paths.iter().skip(1) {
            let dst = out2.join(p);
            let tmp = partial.with_extension("copy");
            // Synced before the rename, like the partial itself: a copy must never appear
            // under its final name with bytes a power failure lost.
            std::fs::copy(&partial, &tmp)
                .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
                .map_err(|e| {
                    let _ = std::fs::remove_file(&tmp);
                    MirrorError::io(format!("copying to {}", tmp.display()), e)
                })?;
            place(&tmp, &dst)?;
        }
        place(&partial, &out2.join(&paths[0]))?;
        let _ = std::fs::remove_file(&progress_path);
        // Listed as verified as they are now, so a rerun need not read them again.
        Ok(paths
            .iter()
            .map(|p| (p.clone(), Stamp::of(&out2.join(p), &entry.hash)))
            .collect())
    });
    async move { (b, res.await) }
}

/// Records the end of [`finish_work`] for `blob`; the stamps of the files it placed.
#[must_use]
fn finished_blob(
    out: &Path,
    blob: &Blob,
    res: Result<Placed, MirrorError>,
    report: &mut PullReport,
    prog: &mut PullProgress,
    opts: &PullOptions,
    errors: &mut Vec<MirrorError>,
) -> Placed {
    match res {
        Ok(stamps) => {
            if let Some(h) = &opts.holdings {
                h.placed(&blob.entry.hash, out.join(&blob.paths[0]));
            }
            report.files_written += blob.paths.len();
            prog.files_done += blob.paths.len();
            // The pieces counted the content once; the total counts every path.
            prog.bytes_done += blob.entry.size * (blob.paths.len() as u64 - 1);
            if let Some(cb) = &opts.progress {
                for p in &blob.paths {
                    prog.file_finished = Some(p.clone());
                    cb(prog);
                }
                prog.file_finished = None;
            }
            stamps
        }
        Err(e) => {
            errors.push(e);
            Vec::new()
        }
    }
}

/// Renames `src` to `dst`, creating parent directories.
fn place(src: &Path, dst: &Path) -> Result<(), MirrorError> {
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| MirrorError::io(format!("creating {}", parent.display()), e))?;
    }
    std::fs::rename(src, dst).map_err(|e| {
        MirrorError::io(
            format!("renaming {} to {}", src.display(), dst.display()),
            e,
        )
    })?;
    // The rename itself is durable once the directory is synced (best effort: not every
    // file system lets a directory be opened and synced).
    if let Some(parent) = dst.parent() {
        if let Ok(d) = std::fs::File::open(parent) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file and a rename. A write that fails (disk
/// full) removes its temporary file, so nothing is left behind in `.partial` but the last
/// complete record.
/// Brings the resume record of `blob` up to date after piece `i` changed: written whole (and
/// renamed into place) the first time in a run, then only the two digits holding the piece's
/// bit, in place: a single small write a crash cannot tear, where rewriting the whole record
/// per piece would cost a pull of many small pieces time quadratic in their number.
async fn save_record(blob: &mut Blob, i: u64) -> Result<(), MirrorError> {
    let path = blob.progress_path.clone();
    if let (Some(f), Some((at, digits))) = (&blob.record, blob.progress.patch(i)) {
        let f = Arc::clone(f);
        return blocking(move || {
            f.write_all_at(&digits, at)
                .map_err(|e| MirrorError::io(format!("updating {}", path.display()), e))
        })
        .await;
    }
    let bytes = blob.progress.encode();
    write_atomic(&path, &bytes).await?;
    let f = blocking(move || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| MirrorError::io(format!("opening {}", path.display()), e))
    })
    .await?;
    blob.record = Some(Arc::new(f));
    Ok(())
}

/// Replaces `path` with `bytes`: written to a temporary file and synced first, so that after a
/// power loss the record is the old one or the new one, never an empty file (a rename can
/// reach the disk before the data it names; an unreadable record made the rerun fetch its blob
/// again, though its verified pieces were in the partial file).
async fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), MirrorError> {
    let tmp = path.with_extension("progress.tmp");
    let (tmp2, data) = (tmp.clone(), bytes.to_vec());
    let written = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp2)?;
        f.write_all(&data)?;
        f.sync_all()
    })
    .await
    .unwrap_or_else(|e| Err(std::io::Error::other(e)));
    if let Err(e) = written {
        let _ = tokio::fs::remove_file(&tmp).await;
        return Err(MirrorError::io(format!("writing {}", tmp.display()), e));
    }
    tokio::fs::rename(&tmp, path)
        .await
        .map_err(|e| MirrorError::io(format!("renaming {}", tmp.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Source;

    fn sources() -> Vec<Arc<SourceState>> {
        let http = Arc::new(crate::http_client::client(None, None));
        let store: Arc<dyn object_store::ObjectStore> =
            Arc::new(object_store::memory::InMemory::new());
        let mirror = |name: &str| {
            SourceState::new(
                name.into(),
                Source::http(
                    SourceKind::Mirror,
                    "http://127.0.0.1:1".into(),
                    http.clone(),
                ),
                Some(Duration::from_millis(1)),
            )
        };
        vec![
            mirror("a"),
            SourceState::new("origin".into(), Source::Origin(store), None),
            mirror("b"),
        ]
    }

    #[tokio::test]
    async fn only_the_partial_files_of_blobs_not_pulled_now_are_reclaimed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (ours, theirs) = ("a".repeat(64), "b".repeat(64));
        for name in [
            ours.clone(),
            format!("{ours}.progress"),
            theirs.clone(),
            format!("{theirs}.progress"),
            format!("{theirs}.copy"),
            "notes.txt".to_string(),
            format!("{theirs}.mine"),
        ] {
            std::fs::write(dir.path().join(name), vec![7u8; 8192]).expect("write");
        }
        let current: HashSet<String> = [ours.clone()].into_iter().collect();
        let reclaimed = reclaim_foreign_partials(dir.path(), &current).await;
        assert!(reclaimed >= 3 * 8192, "{reclaimed}");
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ours.clone(),
                format!("{ours}.progress"),
                format!("{theirs}.mine"),
                "notes.txt".to_string()
            ]
        );
    }

    #[tokio::test]
    async fn a_tag_object_larger_than_a_tag_can_be_is_refused_unread() {
        use object_store::ObjectStoreExt as _;
        let store = object_store::memory::InMemory::new();
        let key = StorePath::from(tag_key("org/m", "latest"));
        let huge = vec![b'a'; MAX_TAG_BYTES as usize + 1];
        store.put(&key, huge.into()).await.expect("put");
        let mref = ModelRef::parse("org/m:latest").expect("ref");
        let err = resolve(&store, &mref)
            .await
            .expect_err("refused")
            .to_string();
        assert!(err.contains("4097 bytes or more"), "{err}");
        assert!(err.contains("tag latest of model org/m"), "{err}");
    }

    fn names(c: &[Arc<SourceState>]) -> Vec<&str> {
        c.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn a_busy_mirror_is_passed_over_for_an_idle_one_but_not_for_the_origin() {
        let mut c = sources();
        assert!(pass_over_busy(&mut c, &[]));
        assert_eq!(names(&c), ["a", "origin", "b"], "nothing busy: order kept");
        assert!(pass_over_busy(&mut c, &["a".into()]));
        assert_eq!(
            names(&c),
            ["b", "a", "origin"],
            "the idle mirror first, the busy one before the origin"
        );
        let mut c = sources();
        assert!(
            !pass_over_busy(&mut c, &["a".into(), "b".into()]),
            "all busy: pause"
        );
        assert_eq!(names(&c), ["a", "origin", "b"]);
    }
}
