//! Weights distribution: content-addressed models on an object store, publish, and verified,
//! resumable, parallel pulls.
//!
//! - [`manifest`]: the model format (sans-IO): manifests, tags, names, object layout.
//! - [`origin`]: opens an object store from a URL (`file://`, `s3://`, `az://`).
//! - [`publish`]: hashes a directory and uploads blobs, manifest and tag.
//! - [`pull`]: downloads pieces in parallel with ranged GETs, verifies each, writes in place,
//!   records progress for resume, verifies the whole file and renames it atomically.
//! - [`progress`]: the on-disk record of completed pieces (sans-IO encoding).
//!
//! - [`mirror`]: the regional mirror (HTTP API, single flight, LRU disk cache, preheat,
//!   peer directory, metrics).
//! - [`range_server`], [`http_range`], [`http_error`]: the blob range API mirrors and peers
//!   share.
//! - [`piece_bits`]: which pieces a peer holds (sans-IO).
//! - [`piece_buffers`]: reused piece-sized receive buffers.
//! - [`piece_writer`]: writes verified pieces with `O_DIRECT` when aligned.
//! - [`piece_tree`]: the whole-file BLAKE3 from the pieces' chaining values (sans-IO).
//! - [`outboard`]: bao-tree outboards, any byte range verified against the file hash.
//! - [`auth`]: the access token mirrors and peers ask for and pullers send.
//! - [`tls`]: HTTPS for mirrors (server certificates, the trust of pullers).
//! - [`faults`]: test-only fault injection (corrupt pieces on purpose).
//!
//! Not here yet (see `docs/weights.md`): `gs://` origins, TLS between peers.

pub mod announce;
pub mod auth;
pub mod dir_lock;
pub mod disk_space;
pub mod display;
pub mod faults;
pub mod holdings;
pub mod http_client;
pub mod http_error;
pub mod http_range;
pub mod http_serve;
pub mod local_read;
pub mod manifest;
pub mod mirror;
pub mod origin;
pub mod outage;
pub mod outboard;
pub mod peer_server;
pub mod piece_bits;
pub mod piece_buffers;
pub mod piece_queue;
pub mod piece_tree;
pub mod piece_writer;
pub mod progress;
pub mod publish;
pub mod pull;
pub mod range_server;
pub mod rate_limit;
pub mod size;
pub mod source;
pub mod sources;
pub mod straggler;
pub mod tls;
pub mod verified;

pub use manifest::{Blake3Hash, FileEntry, Manifest, ModelRef, Selector};
pub use origin::open_origin;
pub use publish::{publish, PublishOptions, PublishReport};
pub use pull::{pull, pull_from, PullOptions, PullProgress, PullReport};
pub use sources::SourceSet;

/// Every error of this crate; messages say what was wrong and where.
#[derive(Debug, thiserror::Error)]
pub enum MirrorError {
    /// A model, revision or tag name is not acceptable.
    #[error("invalid {field} {value:?}: {reason}")]
    InvalidName {
        /// Which name (`model`, `revision`, `tag`).
        field: String,
        /// The value given.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// A manifest failed to parse or validate.
    #[error("invalid manifest: field {field}: {reason}")]
    Manifest {
        /// Field path, e.g. `files[2].path`.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// The origin URL cannot be used.
    #[error("origin {url:?}: {reason}")]
    Origin {
        /// URL given.
        url: String,
        /// Why it is refused.
        reason: String,
    },
    /// A tag or revision does not exist in the origin.
    #[error("{what} not found in the origin (object {key})")]
    NotFound {
        /// Human description (`tag latest of model m`).
        what: String,
        /// Object key looked up.
        key: String,
    },
    /// The object store failed.
    #[error("object store: {context}: {source}")]
    Store {
        /// What was being done.
        context: String,
        /// Underlying error.
        #[source]
        source: object_store::Error,
    },
    /// A local file operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, with the path.
        context: String,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A piece kept failing verification.
    #[error(
        "file {path:?} piece {piece} (bytes {start}..{end}) failed BLAKE3 verification \
         {attempts} times: the source serves corrupt data{hint}"
    )]
    CorruptPiece {
        /// File path in the model.
        path: String,
        /// Piece index.
        piece: u64,
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
        /// How many fetches were tried.
        attempts: u32,
        /// Extra advice.
        hint: String,
    },
    /// All pieces verified but the whole file did not.
    #[error("file {path:?}: whole-file BLAKE3 {got} does not match the manifest's {want}")]
    WholeFileMismatch {
        /// File path in the model.
        path: String,
        /// Hash computed.
        got: Blake3Hash,
        /// Hash expected.
        want: Blake3Hash,
    },
    /// A revision exists in the origin with a different manifest.
    #[error("revision {revision:?} of {model:?} is already published with different content; revisions are immutable, publish a new one")]
    RevisionExists {
        /// Model.
        model: String,
        /// Revision.
        revision: String,
    },
    /// A mirror or peer answered with an error or not at all.
    #[error("{url}: {reason}")]
    Remote {
        /// What was asked.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// A setting is out of range.
    #[error("invalid setting {field}: {reason}")]
    Config {
        /// The flag or key.
        field: String,
        /// What is allowed.
        reason: String,
    },
    /// Several pieces failed; the first error is shown.
    #[error("{count} piece(s) failed; progress is kept, rerun to resume. First: {first}")]
    PiecesFailed {
        /// Number of failures.
        count: usize,
        /// The first failure.
        first: Box<MirrorError>,
    },
}

impl MirrorError {
    pub(crate) fn invalid_name(field: &str, value: &str, reason: &str) -> Self {
        Self::InvalidName {
            field: field.into(),
            value: value.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn manifest(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Manifest {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn store(context: impl Into<String>, source: object_store::Error) -> Self {
        Self::Store {
            context: context.into(),
            source,
        }
    }
}

/// Locks `m`, taking the data of a poisoned lock as it is (a panic elsewhere leaves counters
/// and maps usable).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
