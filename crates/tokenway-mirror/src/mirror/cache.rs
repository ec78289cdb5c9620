//! The mirror's disk cache of verified pieces, bounded by bytes, evicted least recently used.
//!
//! Two layers: [`LruIndex`] is the sans-IO bookkeeping (sizes, recency, pins) and decides
//! what to evict; [`PieceCache`] does the file work. A piece being read or written is
//! pinned and never evicted; space for a piece is reserved before it is written, so the
//! bytes on disk never exceed the bound (in-progress writes included). When every byte is
//! pinned there is no room and the piece is served without being cached.
//!
//! Layout: `<cache>/pieces/<blob hash>/<piece size>-<index>`; a write goes to a `.tmp` file
//! first and is renamed, so a crash never leaves a half piece under a real name. On start the
//! directory is scanned (oldest modification first) and trimmed to the bound.
//!
//! Piece files are written and read with `O_DIRECT` (from and into 4 KiB-aligned pooled
//! buffers), around the page cache. A buffered write of a new file is far dearer than the
//! copy it looks like: on the benchmark VM `perf` put 68% of a cold mirror's CPU in
//! `copy_folio_from_iter_atomic` (allocating, charging and faulting in page-cache pages),
//! 6 of its 8.9 CPU seconds for a 2 GB model. The page cache would also hold the model a
//! second time beside the origin's copy. Reads of what was just fetched are served from
//! memory by the mirror ([`super::recent`]), so the cache is read mostly for warm pulls,
//! which `O_DIRECT` reads at the disk's speed for almost no CPU. A filesystem that refuses
//! `O_DIRECT` gets buffered I/O, as before.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use bytes::Bytes;

use crate::lock;
use crate::manifest::Blake3Hash;
use crate::piece_writer::DIRECT_ALIGN;

/// One cached piece: a blob, a piece size (the same blob may be cut differently by two
/// manifests) and an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PieceKey {
    /// Blob hash.
    pub hash: Blake3Hash,
    /// Piece size of the layout.
    pub piece_size: u64,
    /// Piece index.
    pub index: u64,
}

#[derive(Debug)]
struct Entry {
    size: u64,
    pins: u32,
    tick: u64,
    ready: bool,
}

/// What a verified read of the cache found.
#[derive(Debug)]
pub enum CachedPiece {
    /// The piece, checked.
    Hit(Bytes),
    /// Not cached (or unreadable, now dropped).
    Miss,
    /// Cached but failed the check; now dropped.
    Corrupt,
}

/// No room: everything that could be evicted is pinned.
#[derive(Debug, PartialEq, Eq)]
pub struct NoRoom;

/// Sizes, recency and pins of cached items; decides evictions. Sans-IO.
#[derive(Debug)]
pub struct LruIndex<K> {
    /// The bound asked for; `max_bytes` is below it while the disk holds less.
    configured: u64,
    max_bytes: u64,
    used: u64,
    tick: u64,
    entries: HashMap<K, Entry>,
    order: BTreeMap<u64, K>,
}

impl<K: Clone + Eq + Hash> LruIndex<K> {
    /// An empty index holding at most `max_bytes`.
    pub fn new(max_bytes: u64) -> Self {
        Self {
            configured: max_bytes,
            max_bytes,
            used: 0,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    /// Bytes accounted (ready and being written).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Items accounted.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Is nothing accounted?
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn touch(&mut self, k: &K) {
        self.tick += 1;
        if let Some(e) = self.entries.get_mut(k) {
            self.order.remove(&e.tick);
            e.tick = self.tick;
            self.order.insert(self.tick, k.clone());
        }
    }

    /// Is `k` ready (no recency change)?
    pub fn has(&self, k: &K) -> bool {
        self.entries.get(k).is_some_and(|e| e.ready)
    }

    /// If `k` is ready: marks it most recently used and returns true.
    pub fn refresh(&mut self, k: &K) -> bool {
        if !self.has(k) {
            return false;
        }
        self.touch(k);
        true
    }

    /// If `k` is ready: marks it most recently used, pins it (unpin when the read is over)
    /// and returns true.
    pub fn pin(&mut self, k: &K) -> bool {
        match self.entries.get_mut(k) {
            Some(e) if e.ready => e.pins += 1,
            _ => return false,
        }
        self.touch(k);
        true
    }

    /// Ends a pin taken by [`pin`](Self::pin).
    pub fn unpin(&mut self, k: &K) {
        if let Some(e) = self.entries.get_mut(k) {
            e.pins = e.pins.saturating_sub(1);
        }
    }

    /// Reserves `size` bytes for `k` (to be written), evicting unpinned items from the
    /// least recently used; returns what was evicted. The new item is pinned until
    /// [`commit`](Self::commit) or [`abort`](Self::abort). Nothing changes on `NoRoom`.
    pub fn reserve(&mut self, k: K, size: u64) -> Result<Vec<K>, NoRoom> {
        if self.entries.contains_key(&k) || size > self.max_bytes {
            return Err(NoRoom);
        }
        let need = (self.used + size).saturating_sub(self.max_bytes);
        let mut victims = Vec::new();
        let mut freed = 0;
        for key in self.order.values() {
            if freed >= need {
                break;
            }
            let e = &self.entries[key];
            if e.pins == 0 && e.ready {
                freed += e.size;
                victims.push(key.clone());
            }
        }
        if freed < need {
            return Err(NoRoom);
        }
        for v in &victims {
            if let Some(e) = self.entries.remove(v) {
                self.order.remove(&e.tick);
                self.used -= e.size;
            }
        }
        self.tick += 1;
        self.entries.insert(
            k.clone(),
            Entry {
                size,
                pins: 1,
                tick: self.tick,
                ready: false,
            },
        );
        self.order.insert(self.tick, k);
        self.used += size;
        Ok(victims)
    }

    /// The reserved item is written: readable and (once unpinned here) evictable.
    pub fn commit(&mut self, k: &K) {
        if let Some(e) = self.entries.get_mut(k) {
            e.ready = true;
            e.pins = e.pins.saturating_sub(1);
        }
    }

    /// Drops an item (a failed write, or a file found unreadable).
    pub fn remove(&mut self, k: &K) {
        if let Some(e) = self.entries.remove(k) {
            self.order.remove(&e.tick);
            self.used -= e.size;
        }
    }

    /// Abandons a reservation.
    pub fn abort(&mut self, k: &K) {
        self.remove(k);
    }

    /// Lowers the bound to `max` and evicts least recently used items (not pinned, not in
    /// progress) until what is held fits, as far as they allow; returns them.
    pub fn shrink_to(&mut self, max: u64) -> Vec<K> {
        self.max_bytes = self.max_bytes.min(max);
        let mut victims = Vec::new();
        let mut ticks = self.order.keys().copied().collect::<Vec<_>>().into_iter();
        while self.used > self.max_bytes {
            let Some(t) = ticks.next() else { break };
            let Some(key) = self.order.get(&t).cloned() else {
                continue;
            };
            let e = &self.entries[&key];
            if e.pins == 0 && e.ready {
                self.used -= e.size;
                self.entries.remove(&key);
                self.order.remove(&t);
                victims.push(key);
            }
        }
        victims
    }

    /// Raises a lowered bound towards the configured one, to `max` at most.
    pub fn grow_to(&mut self, max: u64) {
        self.max_bytes = self.max_bytes.max(max.min(self.configured));
    }

    /// The bound.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Whether the bound is below the configured one.
    pub fn lowered(&self) -> bool {
        self.max_bytes < self.configured
    }
}

/// Whether `e` says the disk (or the quota) is full.
fn is_disk_full(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    )
}

/// Opens `path` with `O_DIRECT` added to `options` when the filesystem allows it, else
/// without; the flag says which.
fn open_maybe_direct(
    options: &mut std::fs::OpenOptions,
    path: &Path,
) -> std::io::Result<(std::fs::File, bool)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    match options.clone().custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((options.open(path)?, false)),
        Err(e) => Err(e),
    }
}

/// Reads a whole cached piece into a pooled buffer ([`crate::piece_buffers`]), with
/// `O_DIRECT` when it can (see the module docs and [`read_pooled_at`]).
fn read_pooled(path: &Path) -> std::io::Result<Bytes> {
    let len = std::fs::metadata(path)?.len();
    read_pooled_at(
        path,
        0,
        usize::try_from(len).map_err(std::io::Error::other)?,
    )
}

/// Reads `len` bytes at `offset` of `path` into a pooled buffer, with `O_DIRECT` when the
/// offset is block aligned and the filesystem allows it (a fresh allocation per piece would
/// be mapped and faulted in page by page every time, and a buffered read of a file written
/// around the page cache fills the page cache with it, at the cost the module docs give).
/// Used for the mirror's cache and for what a peer serves from its partial files.
pub fn read_pooled_at(path: &Path, offset: u64, len: usize) -> std::io::Result<Bytes> {
    use std::os::unix::fs::FileExt as _;
    let short = |got: usize| {
        std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("{}: {got} of {len} bytes read at {offset}", path.display()),
        )
    };
    let (mut f, direct) = open_maybe_direct(std::fs::OpenOptions::new().read(true), path)?;
    if direct
        && len >= crate::piece_buffers::MIN_POOLED
        && offset.is_multiple_of(DIRECT_ALIGN as u64)
    {
        // Whole aligned blocks: the last read is short at the end of the file.
        let padded = len.next_multiple_of(DIRECT_ALIGN);
        let mut buf = crate::piece_buffers::take_for_read(padded);
        let mut got = 0;
        let res = loop {
            if got >= len || got % DIRECT_ALIGN != 0 {
                break Ok(());
            }
            match f.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break Ok(()),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        match res {
            Ok(()) if got >= len => {
                buf.truncate(len);
                return Ok(crate::piece_buffers::into_shared(buf));
            }
            Ok(()) => return Err(short(got)),
            // Refused after all (alignment rules of this filesystem): buffered below.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    if direct {
        f = std::fs::File::open(path)?;
    }
    let mut buf = crate::piece_buffers::take_for_read(len);
    f.read_exact_at(&mut buf, offset)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => short(0),
            _ => e,
        })?;
    Ok(crate::piece_buffers::into_shared(buf))
}

/// Writes a new piece file, with `O_DIRECT` when it can (see the module docs). An aligned
/// buffer of whole blocks is written as it is; anything else (a file's short last piece) is
/// copied into an aligned buffer padded with zeros, written, and the file cut to length.
fn write_piece_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::FileExt as _;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    let (f, direct) = open_maybe_direct(&mut options, path)?;
    let len = bytes.len();
    if direct && len >= crate::piece_buffers::MIN_POOLED {
        let res = if crate::piece_writer::is_aligned(bytes, 0) {
            f.write_all_at(bytes, 0)
        } else {
            let padded = len.next_multiple_of(DIRECT_ALIGN);
            let mut buf = crate::piece_buffers::take(padded);
            buf.extend_from_slice(bytes);
            buf.resize(padded, 0);
            let r = f.write_all_at(&buf, 0).and_then(|()| f.set_len(len as u64));
            crate::piece_buffers::give_back(buf.freeze());
            r
        };
        match res {
            Ok(()) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)
}

/// What [`PieceCache::store`] did.
#[derive(Debug, PartialEq, Eq)]
pub struct Stored {
    /// The piece is now cached.
    pub cached: bool,
    /// Pieces evicted to make room.
    pub evicted: u64,
}

/// Whether a read error is evidence about the piece itself: its file is gone or shorter than
/// it was written.
fn gone_or_short(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::UnexpectedEof
    )
}

/// Verified pieces on disk, bounded by bytes.
pub struct PieceCache {
    dir: PathBuf,
    index: Mutex<LruIndex<PieceKey>>,
}

impl PieceCache {
    /// Opens `dir` (created if missing), indexing the pieces already there and trimming to
    /// `max_bytes`.
    pub fn open(dir: &Path, max_bytes: u64) -> std::io::Result<Self> {
        let pieces = dir.join("pieces");
        std::fs::create_dir_all(&pieces)?;
        let mut found: Vec<(std::time::SystemTime, PieceKey, u64, PathBuf)> = Vec::new();
        for blob in std::fs::read_dir(&pieces)? {
            let blob = blob?;
            let Ok(hash) = Blake3Hash::from_hex(&blob.file_name().to_string_lossy()) else {
                continue;
            };
            for f in std::fs::read_dir(blob.path())? {
                let f = f?;
                let name = f.file_name().to_string_lossy().into_owned();
                let parsed = name
                    .split_once('-')
                    .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?)));
                let meta = f.metadata()?;
                match parsed {
                    Some((piece_size, index)) if meta.is_file() => found.push((
                        meta.modified()?,
                        PieceKey {
                            hash,
                            piece_size,
                            index,
                        },
                        meta.len(),
                        f.path(),
                    )),
                    // Leftover temporary files from a crash.
                    _ => {
                        let _ = std::fs::remove_file(f.path());
                    }
                }
            }
        }
        found.sort_by_key(|(t, ..)| *t);
        let mut index = LruIndex::new(max_bytes);
        for (_, key, size, path) in found {
            match index.reserve(key, size) {
                Ok(evicted) => {
                    index.commit(&key);
                    for v in evicted {
                        let _ = std::fs::remove_file(Self::path_in(dir, &v));
                    }
                }
                Err(NoRoom) => {
                    let _ = std::fs::remove_file(path);
                }
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            index: Mutex::new(index),
        })
    }

    fn path_in(dir: &Path, k: &PieceKey) -> PathBuf {
        dir.join("pieces")
            .join(k.hash.to_hex())
            .join(format!("{}-{}", k.piece_size, k.index))
    }

    fn path(&self, k: &PieceKey) -> PathBuf {
        Self::path_in(&self.dir, k)
    }

    /// Bytes cached (and reserved).
    pub fn used(&self) -> u64 {
        lock(&self.index).used()
    }

    /// The bound (lowered from `--max-size` if the disk filled up first).
    pub fn max_bytes(&self) -> u64 {
        lock(&self.index).max_bytes()
    }

    /// Is the piece cached? (No pin, no recency change; for peers' counts.)
    pub fn contains(&self, k: &PieceKey) -> bool {
        lock(&self.index).has(k)
    }

    /// Is the piece cached? If so it becomes the most recently used (a preheat wants what it
    /// found kept as much as what it fetched).
    pub fn refresh(&self, k: &PieceKey) -> bool {
        lock(&self.index).refresh(k)
    }

    /// Reads a cached piece, pinned while the read runs, and checks it with `verify` on the
    /// same blocking thread. A piece that is unreadable or fails the check (bit rot, a file
    /// changed or truncated behind the mirror's back) is dropped from the cache, so the
    /// caller fetches it again.
    pub async fn read_verified<F>(&self, k: &PieceKey, verify: F) -> CachedPiece
    where
        F: FnOnce(&[u8]) -> bool + Send + 'static,
    {
        if !lock(&self.index).pin(k) {
            return CachedPiece::Miss;
        }
        let path = self.path(k);
        let path2 = path.clone();
        let res = tokio::task::spawn_blocking(move || {
            read_pooled(&path2).map(|b| {
                let ok = verify(&b);
                (b, ok)
            })
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        let mut idx = lock(&self.index);
        idx.unpin(k);
        let found = match res {
            Ok((b, true)) => return CachedPiece::Hit(b),
            Ok((_, false)) => CachedPiece::Corrupt,
            Err(e) if gone_or_short(&e) => {
                tracing::warn!(error = %e, path = %path.display(), "cached piece missing or cut short, dropping it");
                CachedPiece::Miss
            }
            Err(e) => {
                // Says nothing of the piece (EMFILE under a burst, ENOMEM, a transient EIO):
                // a miss for this request, and the piece stays.
                tracing::warn!(error = %e, path = %path.display(), "cannot read a cached piece now; fetching it for this request");
                return CachedPiece::Miss;
            }
        };
        idx.remove(k);
        drop(idx);
        let _ = std::fs::remove_file(&path);
        found
    }

    /// Stores a verified piece, evicting least recently used pieces to make room. When the
    /// disk is full (or the quota reached) before the bound is, the bound comes down to what
    /// fits: least recently used pieces are evicted to make room for this one, and it is
    /// written once more; the cache stays a cache instead of every later miss going to the
    /// origin. A lowered bound grows back, up to `--max-size`, as the disk has room again (it
    /// may have been filled by something else for a while).
    pub async fn store(&self, k: PieceKey, bytes: &Bytes) -> std::io::Result<Stored> {
        let len = bytes.len() as u64;
        if lock(&self.index).lowered() {
            // What is cached, and what the disk could take beside this piece.
            if let Some(free) = crate::disk_space::available(&self.dir) {
                let mut idx = lock(&self.index);
                let fits = idx.used() + free.saturating_sub(len);
                idx.grow_to(fits);
            }
        }
        match self.store_once(k, bytes).await {
            Err(e) if is_disk_full(&e) => {
                let free = crate::disk_space::available(&self.dir).unwrap_or(0);
                let (victims, from, to) = {
                    let mut idx = lock(&self.index);
                    let from = idx.max_bytes();
                    // What is cached and what is free, less room for this piece (whatever
                    // else is being written counts as cached: it was reserved).
                    let to = (idx.used() + free).saturating_sub(len);
                    (idx.shrink_to(to), from, to)
                };
                tracing::warn!(
                    error = %e,
                    from,
                    to,
                    evicted = victims.len(),
                    "the disk under the cache is full: the cache's bound is lowered to what fits"
                );
                for v in &victims {
                    let _ = tokio::fs::remove_file(self.path(v)).await;
                }
                let mut s = self.store_once(k, bytes).await?;
                s.evicted += victims.len() as u64;
                Ok(s)
            }
            other => other,
        }
    }

    async fn store_once(&self, k: PieceKey, bytes: &Bytes) -> std::io::Result<Stored> {
        let evicted = match lock(&self.index).reserve(k, bytes.len() as u64) {
            Ok(v) => v,
            Err(NoRoom) => {
                return Ok(Stored {
                    cached: false,
                    evicted: 0,
                })
            }
        };
        for v in &evicted {
            let _ = tokio::fs::remove_file(self.path(v)).await;
        }
        let path = self.path(&k);
        let tmp = path.with_extension("tmp");
        let (tmp2, data) = (tmp.clone(), bytes.clone());
        let res = tokio::task::spawn_blocking(move || {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            write_piece_file(&tmp2, &data)?;
            std::fs::rename(&tmp2, &path)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        let mut idx = lock(&self.index);
        match res {
            Ok(()) => {
                idx.commit(&k);
                Ok(Stored {
                    cached: true,
                    evicted: evicted.len() as u64,
                })
            }
            Err(e) => {
                idx.abort(&k);
                drop(idx);
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_frees_the_least_recently_used_bytes_first() {
        let mut lru = LruIndex::new(100);
        for (k, size) in [("a", 40), ("b", 30), ("c", 30)] {
            assert_eq!(lru.reserve(k, size), Ok(vec![]));
            lru.commit(&k);
        }
        assert_eq!(lru.used(), 100);
        // Reading `a` makes `b` the oldest.
        assert!(lru.pin(&"a"));
        lru.unpin(&"a");
        assert_eq!(lru.reserve("d", 50), Ok(vec!["b", "c"]));
        lru.commit(&"d");
        assert_eq!(lru.used(), 90);
        assert!(!lru.pin(&"b"));
    }

    #[test]
    fn shrinking_the_bound_evicts_the_least_recently_used_but_nothing_in_use() {
        let mut lru = LruIndex::new(100);
        for (k, size) in [("a", 30), ("b", 30), ("c", 30)] {
            lru.reserve(k, size).unwrap();
            lru.commit(&k);
        }
        assert!(lru.pin(&"a")); // being read: stays
        assert_eq!(lru.shrink_to(40), vec!["b", "c"]);
        assert_eq!((lru.used(), lru.max_bytes()), (30, 40));
        // The lower bound holds until raised.
        assert_eq!(lru.reserve("d", 20), Err(NoRoom));
        lru.unpin(&"a");
        assert_eq!(lru.reserve("d", 20), Ok(vec!["a"]));
        lru.shrink_to(1000);
        assert_eq!(lru.max_bytes(), 40);
        assert!(lru.lowered());
        // Growing goes back up to the configured bound, never past it.
        lru.grow_to(70);
        assert_eq!(lru.max_bytes(), 70);
        lru.grow_to(1000);
        assert_eq!(lru.max_bytes(), 100);
        assert!(!lru.lowered());
    }

    /// A tmpfs of `size` mounted on a fresh directory (unmounted on drop); `None`, after
    /// saying so, when mounting is not allowed (it needs root; CI runs as root).
    fn small_tmpfs(size: &str) -> Option<SmallTmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            eprintln!("skipped: mounting a small tmpfs needs root (CI runs as root)");
            return None;
        }
        Some(SmallTmpfs(dir))
    }

    struct SmallTmpfs(tempfile::TempDir);

    impl Drop for SmallTmpfs {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg(self.0.path())
                .status();
        }
    }

    fn piece_key(index: u64) -> PieceKey {
        PieceKey {
            hash: Blake3Hash::of(b"blob"),
            piece_size: 64 << 10,
            index,
        }
    }

    /// A 1 MiB tmpfs under a cache bounded at 16 MiB: every piece is still cached (the bound
    /// comes down to what the disk holds), never over what the disk holds. Needs root (mount).
    #[tokio::test]
    async fn a_full_disk_lowers_the_bound_and_the_cache_keeps_caching() {
        let Some(disk) = small_tmpfs("1m") else {
            return;
        };
        let cache = PieceCache::open(disk.0.path(), 16 << 20).unwrap();
        let piece = Bytes::from(vec![7u8; 64 << 10]);
        for index in 0..40 {
            let k = piece_key(index);
            let stored = cache.store(k, &piece).await.expect("stored");
            assert!(stored.cached, "piece {index}");
            assert!(cache.contains(&k));
        }
        assert!(cache.max_bytes() < 1 << 20, "{}", cache.max_bytes());
        assert!(cache.used() <= cache.max_bytes());
    }

    /// Something else fills the disk while the cache is empty: the first piece finds no room
    /// (the bound comes down to nothing), and once that space is freed the cache grows back
    /// and caches again. Needs root (mount).
    #[tokio::test]
    async fn a_disk_full_for_a_while_does_not_stop_the_cache_for_good() {
        let Some(disk) = small_tmpfs("1m") else {
            return;
        };
        let cache = PieceCache::open(disk.0.path(), 16 << 20).unwrap();
        let filler = disk.0.path().join("someone-elses.log");
        let free = crate::disk_space::available(disk.0.path()).unwrap();
        std::fs::write(&filler, vec![1u8; (free - (16 << 10)) as usize]).unwrap();
        let piece = Bytes::from(vec![7u8; 64 << 10]);
        let stored = cache.store(piece_key(0), &piece).await.expect("no error");
        assert!(!stored.cached);
        assert_eq!(cache.max_bytes(), 0);

        std::fs::remove_file(&filler).unwrap();
        for index in 1..8 {
            let stored = cache.store(piece_key(index), &piece).await.expect("stored");
            assert!(stored.cached, "piece {index}");
        }
        assert_eq!(cache.used(), 7 * (64 << 10));
        assert!(cache.max_bytes() >= 7 * (64 << 10), "{}", cache.max_bytes());
    }

    #[test]
    fn pinned_and_in_progress_items_are_never_evicted() {
        let mut lru = LruIndex::new(100);
        lru.reserve("a", 60).unwrap();
        lru.commit(&"a");
        assert!(lru.pin(&"a")); // a read in progress
        lru.reserve("w", 40).unwrap(); // a write in progress
        assert_eq!(lru.reserve("x", 10), Err(NoRoom));
        assert_eq!(lru.used(), 100);
        lru.unpin(&"a");
        // `w` is still being written: only `a` can go.
        assert_eq!(lru.reserve("x", 10), Ok(vec!["a"]));
        assert_eq!(lru.used(), 50);
        lru.abort(&"w");
        assert_eq!(lru.used(), 10);
        // Larger than the whole cache: never cached.
        assert_eq!(lru.reserve("huge", 101), Err(NoRoom));
    }

    #[test]
    fn the_bound_holds_under_any_sequence() {
        let mut lru = LruIndex::new(1000);
        let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
        for i in 0..5000u64 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let k = rng % 64;
            match rng % 5 {
                0 | 1 => {
                    if lru.reserve(k, 1 + (rng >> 8) % 300).is_ok() {
                        if i % 3 == 0 {
                            lru.abort(&k);
                        } else {
                            lru.commit(&k);
                        }
                    }
                }
                2 => {
                    if lru.pin(&k) {
                        lru.unpin(&k);
                    }
                }
                _ => lru.remove(&k),
            }
            assert!(lru.used() <= 1000);
        }
    }

    #[tokio::test]
    async fn pieces_of_any_length_round_trip_through_the_direct_io_cache() {
        let dir = tempfile::tempdir().unwrap();
        let cache = PieceCache::open(dir.path(), 1 << 24).unwrap();
        let h = Blake3Hash::of(b"blob");
        // Aligned and pooled (O_DIRECT as it is), a short last piece (padded, then cut),
        // an unaligned buffer (copied), and a small one (buffered).
        let aligned = crate::piece_buffers::aligned_copy(&vec![1u8; 1 << 20]);
        let short: Bytes = (0..70_001u32).map(|i| i as u8).collect::<Vec<u8>>().into();
        let unaligned = Bytes::from(vec![3u8; 1 << 17 | 1]).slice(1..);
        let small = Bytes::from(vec![4u8; 100]);
        for (index, piece) in [aligned, short, unaligned, small].into_iter().enumerate() {
            let k = PieceKey {
                hash: h,
                piece_size: 1 << 20,
                index: index as u64,
            };
            assert!(cache.store(k, &piece).await.unwrap().cached);
            let on_disk = std::fs::metadata(cache.path(&k)).unwrap().len();
            assert_eq!(on_disk, piece.len() as u64);
            assert!(
                matches!(cache.read_verified(&k, |_| true).await, CachedPiece::Hit(b) if b == piece)
            );
        }
    }

    #[test]
    fn ranges_of_a_file_read_back_exactly_direct_or_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("partial");
        let data: Vec<u8> = (0..3 * 65536 + 100u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        for (offset, len) in [
            (65536, 65536),
            (2 * 65536, 65536 + 100),
            (3 * 65536, 100),
            (1, 70_000),
        ] {
            let got = read_pooled_at(&path, offset as u64, len).unwrap();
            assert_eq!(
                &got[..],
                &data[offset..offset + len],
                "at {offset}, {len} bytes"
            );
        }
        let past = read_pooled_at(&path, 2 * 65536, 65536 + 101).unwrap_err();
        assert_eq!(past.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[tokio::test]
    async fn the_disk_cache_stays_within_its_bound_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let h = Blake3Hash::of(b"blob");
        let key = |index| PieceKey {
            hash: h,
            piece_size: 100,
            index,
        };
        let cache = PieceCache::open(dir.path(), 250).unwrap();
        let piece = Bytes::from(vec![7u8; 100]);
        let mut evicted = 0;
        for i in 0..5 {
            let s = cache.store(key(i), &piece).await.unwrap();
            assert!(s.cached);
            evicted += s.evicted;
        }
        assert_eq!(evicted, 3);
        assert_eq!(cache.used(), 200);
        assert!(matches!(
            cache.read_verified(&key(0), |_| true).await,
            CachedPiece::Miss
        ));
        assert!(
            matches!(cache.read_verified(&key(4), |_| true).await, CachedPiece::Hit(b) if b == piece)
        );
        drop(cache);
        let again = PieceCache::open(dir.path(), 150).unwrap();
        assert_eq!(again.used(), 100);
    }

    #[tokio::test]
    async fn a_read_error_that_says_nothing_of_the_piece_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let cache = PieceCache::open(dir.path(), 1 << 20).unwrap();
        let piece = Bytes::from(vec![7u8; 100]);
        let k = piece_key(0);
        cache.store(k, &piece).await.unwrap();
        // The file cannot be read for now (here: a directory where it was; in production
        // EMFILE, ENOMEM, a transient EIO): a miss for this request, nothing dropped.
        let path = cache.path(&k);
        let aside = path.with_extension("aside");
        std::fs::rename(&path, &aside).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(matches!(
            cache.read_verified(&k, |_| true).await,
            CachedPiece::Miss
        ));
        assert!(cache.contains(&k));
        std::fs::remove_dir(&path).unwrap();
        std::fs::rename(&aside, &path).unwrap();
        assert!(
            matches!(cache.read_verified(&k, |_| true).await, CachedPiece::Hit(b) if b == piece)
        );
        // A file that is gone is dropped from the index.
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(
            cache.read_verified(&k, |_| true).await,
            CachedPiece::Miss
        ));
        assert!(!cache.contains(&k));
    }

    #[test]
    fn refreshing_an_item_saves_it_from_the_next_eviction() {
        let mut lru = LruIndex::new(90);
        for k in ["a", "b", "c"] {
            lru.reserve(k, 30).unwrap();
            lru.commit(&k);
        }
        // "a" was found already cached by a preheat: it moves to the back of the queue.
        assert!(lru.refresh(&"a"));
        assert!(!lru.refresh(&"z"));
        assert_eq!(lru.reserve("d", 30), Ok(vec!["b"]));
    }
}
