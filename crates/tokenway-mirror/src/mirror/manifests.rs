//! The mirror's copy of manifests and tags, on disk and in a small memo.
//!
//! Revisions are immutable: once fetched from the origin and validated, a manifest is kept
//! on disk and served from there forever, even with the origin down. Tags move, so a tag is
//! asked of the origin every time; only when the origin cannot be reached is the last value
//! seen used (the answer says so with `x-tokenway-stale`). An origin that says a tag does
//! not exist is believed.
//!
//! Format-3 manifests name an outboard per blob; the mirror fetches each from the origin
//! when it first loads the manifest, checks it against the blob hash, keeps it on disk beside
//! the manifests and serves it to pullers, so a manifest in the memo always has its piece
//! hashes ([`FileEntry::needs_outboard`] is false).
//!
//! Loading a manifest that is not in the memo is single flight per revision: on a cold mirror
//! a crowd asking for one model at once makes one load (one copy of the manifest and of
//! every outboard from the origin, one copy in memory), and the others wait for it and take
//! it from the memo.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use object_store::path::Path as StorePath;
use object_store::ObjectStore;
use tokenway_telemetry::Counter;

use super::outboard_disk::{OutboardDisk, MAX_OUTBOARD_DISK_BYTES};
use super::recent::Recent;
use crate::http_error::ServeError;
use crate::local_read::read_at_most_async;
use crate::lock;
use crate::manifest::{
    manifest_key, parse_tag, tag_key, Blake3Hash, FileEntry, Manifest, ModelRef, Selector,
    MAX_TAG_BYTES,
};
use crate::origin::small_get::{get_small, Small};
use crate::source::MAX_MANIFEST_BYTES;

/// Manifests kept in memory (the disk copy has them all).
pub const MEMO_MANIFESTS: usize = 256;
/// Revisions loaded at once with single flight; past that a load runs on its own.
pub const MAX_LOADS: usize = 1024;
/// How long one origin request may take.
pub const ORIGIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Outboards of one revision fetched from the origin at once while it loads.
pub const OUTBOARD_LOADS: usize = 16;
/// Bytes of verified outboards kept in memory (the outboards of a 128 GiB model at the
/// default group size).
pub const VERIFIED_OUTBOARD_BYTES: usize = 128 << 20;
/// How long a tag lookup waits for the origin when this mirror has a copy of the tag: then
/// the copy answers (marked stale), well inside a puller's 10 s wait for a manifest.
pub const STALE_TAG_AFTER: Duration = Duration::from_secs(3);
/// How long a tag's answer is reused: a crowd asking for `org/m:latest` at once costs the
/// origin one lookup per this interval, and a moved tag is seen within it.
pub const TAG_TTL: Duration = Duration::from_secs(2);
/// Tag answers kept for [`TAG_TTL`].
const MAX_TAG_MEMO: usize = 4096;

/// A resolved manifest.
pub struct Resolved {
    /// The manifest.
    pub manifest: Arc<Manifest>,
    /// The tag was taken from the mirror's copy because the origin was unreachable.
    pub stale_tag: bool,
}

/// The manifests in memory, keyed by (model, revision): past [`MEMO_MANIFESTS`] the least
/// recently used one makes room (reloading it costs a disk read and its outboards).
#[derive(Default)]
struct Memo {
    entries: HashMap<(String, String), (Arc<Manifest>, u64)>,
    clock: u64,
}

impl Memo {
    fn get(&mut self, key: &(String, String)) -> Option<Arc<Manifest>> {
        self.clock += 1;
        let (m, used) = self.entries.get_mut(key)?;
        *used = self.clock;
        Some(Arc::clone(m))
    }

    fn insert(&mut self, key: (String, String), m: Arc<Manifest>) {
        if self.entries.len() >= MEMO_MANIFESTS && !self.entries.contains_key(&key) {
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.entries.remove(&k);
            }
        }
        self.clock += 1;
        self.entries.insert(key, (m, self.clock));
    }

    fn manifests(&self) -> impl Iterator<Item = &Arc<Manifest>> {
        self.entries.values().map(|(m, _)| m)
    }
}

/// Manifests and tags seen, on disk under `<cache>/manifests/` and in memory.
pub struct ManifestCache {
    dir: PathBuf,
    /// Outboard bytes fetched from the origin (verified).
    outboard_from_origin: Counter,
    memo: Mutex<Memo>,
    /// Outboards verified last, by (blob hash, group size): a rollout asks for each one once
    /// per node, and reading and verifying it from disk each time cost a full walk of it.
    verified: Mutex<Recent<(Blake3Hash, u64)>>,
    /// Recent tag answers.
    tags: Mutex<HashMap<(String, String), TagAnswer>>,
    /// Revisions being loaded: the load lock callers of one revision queue on.
    loading: Loading,
    /// The outboards kept on disk, bounded.
    outboard_disk: OutboardDisk,
}

/// A tag's revision, whether it came from this mirror's copy (the origin unreachable), and
/// when the answer came.
type TagAnswer = (String, bool, tokio::time::Instant);

/// `ob` if it is `entry`'s outboard (checked on a blocking thread: a walk of all of it).
async fn verified_outboard(entry: &FileEntry, ob: bytes::Bytes) -> Result<bytes::Bytes, String> {
    let mut probe = entry.clone();
    probe.pieces.clear();
    tokio::task::spawn_blocking(move || {
        probe
            .attach_outboard(&ob)
            .map(|_| ob)
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|e| Err(format!("the check failed: {e}")))
}

/// Load locks by (model, revision).
type Loading = Mutex<HashMap<(String, String), Arc<tokio::sync::Mutex<()>>>>;

/// Removes a revision's load lock when its leader is done, however it ends.
struct LoadDone<'a> {
    loading: &'a Loading,
    key: (String, String),
}

impl Drop for LoadDone<'_> {
    fn drop(&mut self) {
        lock(self.loading).remove(&self.key);
    }
}

enum Got {
    Bytes(bytes::Bytes),
    NotFound,
    Down(String),
}

/// The origin's object `key`, which holds at most `limit` bytes when it is what it should be.
async fn origin_get(origin: &dyn ObjectStore, key: &str, limit: u64) -> Got {
    let path = StorePath::from(key);
    let res = tokio::time::timeout(ORIGIN_TIMEOUT, get_small(origin, &path, limit)).await;
    match res {
        Ok(Ok(Small::Bytes(b))) => Got::Bytes(b),
        Ok(Ok(Small::TooLarge(n))) => Got::Down(format!(
            "its {key} holds {n} bytes or more, where at most {limit} can be valid"
        )),
        Ok(Err(object_store::Error::NotFound { .. })) => Got::NotFound,
        Ok(Err(e)) => Got::Down(e.to_string()),
        Err(_) => Got::Down(format!("no answer within {ORIGIN_TIMEOUT:?}")),
    }
}

impl ManifestCache {
    /// Keeps copies under `dir`, counting outboard bytes from the origin in
    /// `outboard_from_origin`.
    pub fn new(dir: &Path, outboard_from_origin: Counter) -> Self {
        Self {
            dir: dir.join("manifests"),
            outboard_from_origin,
            memo: Mutex::new(Memo::default()),
            verified: Mutex::new(Recent::new(VERIFIED_OUTBOARD_BYTES)),
            tags: Mutex::new(HashMap::new()),
            loading: Mutex::new(HashMap::new()),
            outboard_disk: OutboardDisk::new(
                dir.join("manifests").join("outboards"),
                MAX_OUTBOARD_DISK_BYTES,
            ),
        }
    }

    /// The manifest `mref` names.
    pub async fn resolve(
        &self,
        origin: &dyn ObjectStore,
        mref: &ModelRef,
    ) -> Result<Resolved, ServeError> {
        let (revision, stale_tag) = match &mref.selector {
            Selector::Revision(r) => (r.clone(), false),
            Selector::Tag(t) => self.tag(origin, &mref.model, t).await?,
        };
        let manifest = self.revision(origin, &mref.model, &revision).await?;
        Ok(Resolved {
            manifest,
            stale_tag,
        })
    }

    async fn tag(
        &self,
        origin: &dyn ObjectStore,
        model: &str,
        tag: &str,
    ) -> Result<(String, bool), ServeError> {
        let memo_key = (model.to_string(), tag.to_string());
        let now = tokio::time::Instant::now();
        if let Some((rev, stale, at)) = lock(&self.tags).get(&memo_key) {
            if now.saturating_duration_since(*at) < TAG_TTL {
                return Ok((rev.clone(), *stale));
            }
        }
        let key = tag_key(model, tag);
        let local = self.dir.join(&key);
        let copy = read_at_most_async(&local, MAX_TAG_BYTES)
            .await
            .and_then(|b| parse_tag(&b).ok());
        // With a copy to fall back on, a slow or hung origin is not waited for long.
        let got = match &copy {
            Some(_) => {
                tokio::time::timeout(STALE_TAG_AFTER, origin_get(origin, &key, MAX_TAG_BYTES))
                    .await
                    .unwrap_or_else(|_| Got::Down(format!("no answer within {STALE_TAG_AFTER:?}")))
            }
            None => origin_get(origin, &key, MAX_TAG_BYTES).await,
        };
        let answer = match got {
            Got::Bytes(b) => {
                let rev = parse_tag(&b).map_err(|e| ServeError::origin(format!("the origin's tag {tag} of {model} is invalid: {e}")))?;
                if copy.as_deref() != Some(rev.as_str()) {
                    write_atomic(&local, rev.as_bytes()).await;
                }
                (rev, false)
            }
            Got::NotFound => return Err(ServeError::not_found(format!("tag {tag} of model {model} not found in the origin"))),
            Got::Down(why) => match copy {
                Some(rev) => {
                    tracing::warn!(%model, %tag, %rev, error = %why, "origin unavailable: serving this mirror's copy of the tag");
                    (rev, true)
                }
                None => return Err(ServeError::origin(format!(
                    "origin unavailable ({why}) and tag {tag} of model {model} is not in this mirror's cache"
                ))),
            },
        };
        // Fresh from when the answer came, not from when it was asked for.
        let now = tokio::time::Instant::now();
        let mut tags = lock(&self.tags);
        if tags.len() >= MAX_TAG_MEMO {
            tags.retain(|_, (_, _, at)| now.saturating_duration_since(*at) < TAG_TTL);
            if tags.len() >= MAX_TAG_MEMO {
                tags.clear();
            }
        }
        tags.insert(memo_key, (answer.0.clone(), answer.1, now));
        Ok(answer)
    }

    /// The manifest of `model@revision`: memo, disk, then the origin.
    pub async fn revision(
        &self,
        origin: &dyn ObjectStore,
        model: &str,
        revision: &str,
    ) -> Result<Arc<Manifest>, ServeError> {
        let memo_key = (model.to_string(), revision.to_string());
        if let Some(m) = lock(&self.memo).get(&memo_key) {
            return Ok(m);
        }
        // Single flight: the first caller loads, the others wait on its lock and then find
        // the manifest in the memo (or, if its load failed, try in turn).
        let (load_lock, leader) = {
            let mut loading = lock(&self.loading);
            match loading.get(&memo_key) {
                Some(l) => (Some(Arc::clone(l)), false),
                None if loading.len() < MAX_LOADS => {
                    let l = Arc::new(tokio::sync::Mutex::new(()));
                    loading.insert(memo_key.clone(), Arc::clone(&l));
                    (Some(l), true)
                }
                None => (None, false),
            }
        };
        let _done = leader.then(|| LoadDone {
            loading: &self.loading,
            key: memo_key.clone(),
        });
        let _turn = match &load_lock {
            Some(l) => Some(l.lock().await),
            None => None,
        };
        if let Some(m) = lock(&self.memo).get(&memo_key) {
            return Ok(m);
        }
        let key = manifest_key(model, revision);
        let local = self.dir.join(&key);
        let check = |bytes: &[u8]| -> Result<Manifest, String> {
            let m = Manifest::from_json(bytes).map_err(|e| e.to_string())?;
            if m.model != model || m.revision != revision {
                return Err(format!("object {key} describes {}@{}", m.model, m.revision));
            }
            Ok(m)
        };
        let copy = read_at_most_async(&local, MAX_MANIFEST_BYTES as u64).await;
        let manifest = match copy.and_then(|b| check(&b).ok()) {
            Some(m) => m,
            None => match origin_get(origin, &key, MAX_MANIFEST_BYTES as u64).await {
                Got::Bytes(b) => {
                    let m = check(&b).map_err(|e| ServeError::origin(format!("the origin holds an invalid manifest for {model}@{revision}: {e}")))?;
                    write_atomic(&local, &b).await;
                    m
                }
                Got::NotFound => {
                    return Err(ServeError::not_found(format!(
                        "revision {revision} of model {model} not found in the origin"
                    )))
                }
                Got::Down(why) => {
                    return Err(ServeError::origin(format!(
                        "origin unavailable ({why}) and revision {revision} of model {model} is not in this mirror's cache"
                    )))
                }
            },
        };
        let mut manifest = manifest;
        // The outboards come from the origin side by side: one after another, a model of many
        // shards on a far origin kept the first request for it waiting past a puller's 10 s
        // head timeout (which then demotes this mirror and goes to the origin itself).
        let wanted: Vec<(usize, FileEntry)> = manifest
            .files
            .iter()
            .enumerate()
            .filter(|(_, f)| f.needs_outboard())
            .map(|(i, f)| (i, f.clone()))
            .collect();
        let mut loads = futures_util::stream::iter(wanted)
            .map(|(i, f)| async move { (i, self.outboard(origin, &f).await) })
            .buffer_unordered(OUTBOARD_LOADS);
        while let Some((i, ob)) = loads.next().await {
            manifest.files[i]
                .attach_outboard(&ob?)
                .expect("invariant: ManifestCache::outboard returns verified outboards");
        }
        let m = Arc::new(manifest);
        lock(&self.memo).insert(memo_key, Arc::clone(&m));
        Ok(m)
    }

    /// The outboard of `entry` (format 3), verified against its hash: the disk copy, else the
    /// origin's (then kept on disk).
    pub async fn outboard(
        &self,
        origin: &dyn ObjectStore,
        entry: &FileEntry,
    ) -> Result<bytes::Bytes, ServeError> {
        let key = entry.outboard_key().ok_or_else(|| {
            ServeError::not_found(format!(
                "blob {} has no outboard: its manifest predates format 3",
                entry.hash
            ))
        })?;
        let memo_key = (entry.hash, entry.group_size.unwrap_or(0));
        if let Some(b) = lock(&self.verified).get(&memo_key) {
            return Ok(b);
        }
        let local = self.dir.join(&key);
        if let Some(b) = read_at_most_async(&local, entry.outboard_len().unwrap_or(0)).await {
            if let Ok(b) = verified_outboard(entry, b.into()).await {
                lock(&self.verified).insert(memo_key, b.clone());
                return Ok(b);
            }
            tracing::warn!(path = %local.display(), "a cached outboard does not verify; fetching it again");
        }
        match origin_get(origin, &key, entry.outboard_len().unwrap_or(0)).await {
            Got::Bytes(b) => {
                let b = verified_outboard(entry, b).await.map_err(|e| {
                    ServeError::origin(format!(
                        "the origin's {key} does not verify against the blob hash: {e}"
                    ))
                })?;
                self.outboard_from_origin.inc_by(b.len() as u64);
                write_atomic(&local, &b).await;
                self.outboard_disk.written(b.len() as u64).await;
                lock(&self.verified).insert(memo_key, b.clone());
                Ok(b)
            }
            Got::NotFound => Err(ServeError::origin(format!(
                "the origin has no {key}, which the manifest of {} needs",
                entry.path
            ))),
            Got::Down(why) => Err(ServeError::origin(format!(
                "origin unavailable ({why}) and {key} is not in this mirror's cache"
            ))),
        }
    }

    /// The piece counts of those of `hashes` that a manifest in memory lists (one pass over
    /// the memo, for checking an announcement).
    pub fn piece_counts<'a>(
        &self,
        hashes: impl IntoIterator<Item = &'a Blake3Hash>,
    ) -> HashMap<Blake3Hash, u64> {
        let wanted: std::collections::HashSet<&Blake3Hash> = hashes.into_iter().collect();
        let mut out = HashMap::new();
        if wanted.is_empty() {
            return out;
        }
        for m in lock(&self.memo).manifests() {
            for f in &m.files {
                if wanted.contains(&f.hash) {
                    out.insert(f.hash, f.pieces.len() as u64);
                }
            }
        }
        out
    }

    /// The layout of blob `hash` from any manifest in memory.
    pub fn find_blob(&self, hash: &Blake3Hash) -> Option<Arc<FileEntry>> {
        lock(&self.memo)
            .manifests()
            .find_map(|m| m.files.iter().find(|f| f.hash == *hash).cloned())
            .map(Arc::new)
    }
}

/// Best effort: a failed copy only means asking the origin again next time.
async fn write_atomic(path: &Path, bytes: &[u8]) {
    // `~` never appears in a name, so this cannot clash with a real tag or revision; the
    // random part keeps two requests that load the same manifest at once apart.
    let tmp = PathBuf::from(format!("{}~{:016x}", path.display(), rand::random::<u64>()));
    let res = async {
        if let Some(p) = path.parent() {
            tokio::fs::create_dir_all(p).await?;
        }
        tokio::fs::write(&tmp, bytes).await?;
        tokio::fs::rename(&tmp, path).await
    }
    .await;
    if let Err(e) = res {
        let _ = tokio::fs::remove_file(&tmp).await;
        tracing::warn!(error = %e, path = %path.display(), "cannot keep a copy of a manifest or tag");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::ModelRef;
    use crate::publish::{publish, PublishOptions};

    #[tokio::test]
    async fn a_crowd_asking_a_cold_mirror_for_one_model_loads_its_outboards_once() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        for (name, len) in [("a.bin", 3 << 20), ("b.bin", 1 << 20)] {
            let data: Vec<u8> = (0..len).map(|i: u32| (i % 251) as u8).collect();
            std::fs::write(src.join(name), data).unwrap();
        }
        let origin: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let opts = PublishOptions {
            piece_size: 256 << 10,
            ..Default::default()
        };
        publish(
            Arc::clone(&origin),
            &src,
            "org/tiny",
            "r1",
            Some("latest"),
            &opts,
        )
        .await
        .unwrap();
        let mref = ModelRef::parse("org/tiny:latest").unwrap();

        let one = Counter::default();
        let alone = ManifestCache::new(&tmp.path().join("c1"), one.clone());
        alone.resolve(origin.as_ref(), &mref).await.unwrap();
        let copy = one.get();
        assert!(copy > 0, "the model has outboards");

        let crowd = Counter::default();
        let cold = ManifestCache::new(&tmp.path().join("c2"), crowd.clone());
        let answers =
            futures_util::future::join_all((0..16).map(|_| cold.resolve(origin.as_ref(), &mref)))
                .await;
        for a in answers {
            assert_eq!(a.unwrap().manifest.revision, "r1");
        }
        assert_eq!(
            crowd.get(),
            copy,
            "one copy of the outboards from the origin"
        );
        assert!(lock(&cold.loading).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn with_a_hung_origin_a_tag_is_answered_from_the_copy_within_seconds() {
        use object_store::throttle::{ThrottleConfig, ThrottledStore};
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("a.bin"), vec![7u8; 300 << 10]).unwrap();
        let origin: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let opts = PublishOptions {
            piece_size: 256 << 10,
            ..Default::default()
        };
        publish(
            Arc::clone(&origin),
            &src,
            "org/tiny",
            "r1",
            Some("latest"),
            &opts,
        )
        .await
        .unwrap();
        let mref = ModelRef::parse("org/tiny:latest").unwrap();
        let cache = ManifestCache::new(&tmp.path().join("c"), Counter::default());
        let fresh = cache.resolve(origin.as_ref(), &mref).await.unwrap();
        assert!(!fresh.stale_tag);

        // The origin now accepts connections and never answers (a partition, a stuck
        // endpoint): the mirror's copy answers once STALE_TAG_AFTER has passed, long before
        // the 30 s origin timeout and inside a puller's 10 s.
        let hung = ThrottledStore::new(
            object_store::memory::InMemory::new(),
            ThrottleConfig {
                wait_get_per_call: Duration::from_secs(3600),
                ..ThrottleConfig::default()
            },
        );
        tokio::time::sleep(TAG_TTL).await;
        let started = tokio::time::Instant::now();
        let stale = cache.resolve(&hung, &mref).await.unwrap();
        assert!(stale.stale_tag);
        assert_eq!(stale.manifest.revision, "r1");
        assert!(started.elapsed() <= STALE_TAG_AFTER + Duration::from_millis(100));
        // Within TAG_TTL the answer is reused without asking the origin.
        let again = tokio::time::Instant::now();
        assert!(cache.resolve(&hung, &mref).await.unwrap().stale_tag);
        assert_eq!(again.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cold_mirror_fetches_the_outboards_of_a_revision_side_by_side() {
        use object_store::throttle::{ThrottleConfig, ThrottledStore};
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        const SHARDS: usize = 8;
        for i in 0..SHARDS {
            std::fs::write(src.join(format!("shard-{i}.bin")), vec![i as u8; 300 << 10]).unwrap();
        }
        // Every GET takes a second: an origin far away.
        let origin = ThrottledStore::new(
            object_store::memory::InMemory::new(),
            ThrottleConfig {
                wait_get_per_call: Duration::from_secs(1),
                ..ThrottleConfig::default()
            },
        );
        let origin: Arc<dyn ObjectStore> = Arc::new(origin);
        let opts = PublishOptions {
            piece_size: 256 << 10,
            ..Default::default()
        };
        publish(Arc::clone(&origin), &src, "org/sharded", "r1", None, &opts)
            .await
            .unwrap();
        let fetched = Counter::default();
        let cache = ManifestCache::new(&tmp.path().join("c"), fetched.clone());
        let started = tokio::time::Instant::now();
        let m = cache
            .revision(origin.as_ref(), "org/sharded", "r1")
            .await
            .unwrap();
        assert_eq!(m.files.iter().filter(|f| f.needs_outboard()).count(), 0);
        assert!(fetched.get() > 0);
        // The manifest, then all eight outboards at once: two seconds, where one outboard
        // after another took nine (past a puller's 10 s head timeout with a few more).
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test]
    async fn an_outboard_verified_once_is_served_again_without_the_disk_or_the_origin() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("a.bin"), vec![3u8; 600 << 10]).unwrap();
        let origin: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let opts = PublishOptions {
            piece_size: 256 << 10,
            ..Default::default()
        };
        publish(Arc::clone(&origin), &src, "org/one", "r1", None, &opts)
            .await
            .unwrap();
        let cache = ManifestCache::new(&tmp.path().join("c"), Counter::default());
        let m = cache
            .revision(origin.as_ref(), "org/one", "r1")
            .await
            .unwrap();
        let entry = &m.files[0];
        let first = cache.outboard(origin.as_ref(), entry).await.unwrap();
        // The disk copy and the origin both gone: the verified copy in memory answers.
        let key = entry.outboard_key().unwrap();
        std::fs::remove_file(cache.dir.join(&key)).unwrap();
        let empty = object_store::memory::InMemory::new();
        let again = cache.outboard(&empty, entry).await.unwrap();
        assert_eq!(again, first);
    }

    #[test]
    fn the_memo_drops_the_least_recently_used_manifest_not_all_of_them() {
        let mut memo = Memo::default();
        let key = |i: usize| ("org/m".to_string(), format!("r{i}"));
        let manifest = |i: usize| {
            Arc::new(Manifest {
                format: crate::manifest::MANIFEST_FORMAT,
                model: "org/m".into(),
                revision: format!("r{i}"),
                files: Vec::new(),
            })
        };
        for i in 0..MEMO_MANIFESTS {
            memo.insert(key(i), manifest(i));
        }
        // r0 is in use; r1 is now the least recently used.
        assert!(memo.get(&key(0)).is_some());
        memo.insert(key(MEMO_MANIFESTS), manifest(MEMO_MANIFESTS));
        assert_eq!(memo.entries.len(), MEMO_MANIFESTS);
        assert!(memo.get(&key(1)).is_none());
        for i in (0..=MEMO_MANIFESTS).filter(|i| *i != 1) {
            assert!(memo.get(&key(i)).is_some(), "r{i}");
        }
        // Inserting one already there evicts nothing.
        memo.insert(key(0), manifest(0));
        assert_eq!(memo.entries.len(), MEMO_MANIFESTS);
    }
}
