//! `publish`: hash a directory and upload it to the origin as one model revision.
//!
//! Order matters for readers that race with a publish: outboards and blobs first, then the
//! manifest, then the tag, so a tag never points at a manifest whose blobs are missing.
//! Objects already in the origin (same name, same size) are skipped, so republishing a model
//! that shares files with an earlier revision uploads only what changed; `reupload` uploads
//! them anyway, which repairs an object that went bad in the origin. Hashing runs on
//! blocking threads, at most `parallel` files at a time, one read of each file that yields
//! its hash and its outboard ([`crate::outboard`]); each outboard is uploaded as soon as its
//! file is hashed, so at most `parallel` of them are held in memory.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::manifest::{
    self, blob_key, manifest_key, tag_key, Blake3Hash, FileEntry, Manifest, DEFAULT_PIECE_SIZE,
    MANIFEST_FORMAT, MAX_PIECE_SIZE, MIN_PIECE_SIZE,
};
use crate::outboard::{self, DEFAULT_GROUP_SIZE, MAX_GROUP_SIZE, MIN_GROUP_SIZE};
use crate::piece_tree::is_subtree_size;
use crate::MirrorError;

/// Settings of a publish.
#[derive(Clone, Debug)]
pub struct PublishOptions {
    /// Piece size, [`MIN_PIECE_SIZE`]..=[`MAX_PIECE_SIZE`].
    pub piece_size: u64,
    /// Chunk group of the outboards, [`MIN_GROUP_SIZE`]..=[`MAX_GROUP_SIZE`], at most the
    /// piece size.
    pub group_size: u64,
    /// Files hashed and uploaded at once.
    pub parallel: usize,
    /// Upload blobs and outboards even when an object of that name and size exists (to
    /// repair one that went bad in the origin: its content is not checked otherwise).
    pub reupload: bool,
}

impl Default for PublishOptions {
    fn default() -> Self {
        Self {
            piece_size: DEFAULT_PIECE_SIZE,
            group_size: DEFAULT_GROUP_SIZE,
            parallel: 4,
            reupload: false,
        }
    }
}

/// What a publish did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PublishReport {
    /// The manifest written.
    pub manifest: Option<Manifest>,
    /// Files in the revision.
    pub files: usize,
    /// Bytes hashed.
    pub bytes_hashed: u64,
    /// Blobs uploaded.
    pub blobs_uploaded: usize,
    /// Blobs already present in the origin.
    pub blobs_skipped: usize,
    /// Outboards uploaded (files of one group have an empty outboard, uploaded all the same).
    pub outboards_uploaded: usize,
}

/// Publishes `dir` as `model` revision `revision`, and points `tag` at it if given.
pub async fn publish(
    store: Arc<dyn ObjectStore>,
    dir: &Path,
    model: &str,
    revision: &str,
    tag: Option<&str>,
    opts: &PublishOptions,
) -> Result<PublishReport, MirrorError> {
    manifest::validate_model_name("model", model)?;
    manifest::validate_name("revision", revision)?;
    if let Some(t) = tag {
        manifest::validate_name("tag", t)?;
    }
    if !(MIN_PIECE_SIZE..=MAX_PIECE_SIZE).contains(&opts.piece_size) {
        return Err(MirrorError::manifest(
            "piece_size",
            format!(
                "{} is outside {MIN_PIECE_SIZE}..={MAX_PIECE_SIZE}",
                opts.piece_size
            ),
        ));
    }
    if !is_subtree_size(opts.piece_size) {
        return Err(MirrorError::manifest(
            "piece_size",
            format!(
                "{} bytes is not a power of two (64 KiB, 128 KiB, ..., 64 MiB): pieces are \
                 subtrees of the file's BLAKE3 tree",
                opts.piece_size
            ),
        ));
    }
    if !outboard::is_group_size(opts.group_size) || opts.group_size > opts.piece_size {
        return Err(MirrorError::manifest(
            "group_size",
            format!(
                "{} bytes: outboard chunk groups are a power of two from {MIN_GROUP_SIZE} to \
                 {MAX_GROUP_SIZE} bytes, at most the piece size ({})",
                opts.group_size, opts.piece_size
            ),
        ));
    }
    let parallel = opts.parallel.max(1);
    let dir_owned = dir.to_path_buf();
    let files = tokio::task::spawn_blocking(move || list_files(&dir_owned))
        .await
        .map_err(|e| MirrorError::io("listing files", std::io::Error::other(e)))??;

    let (piece_size, group_size, reupload) = (opts.piece_size, opts.group_size, opts.reupload);
    let outboards_uploaded = std::sync::atomic::AtomicUsize::new(0);
    let mut entries: Vec<FileEntry> = stream::iter(files.clone())
        .map(|(rel, abs)| {
            let (store, uploaded) = (Arc::clone(&store), &outboards_uploaded);
            async move {
                let (entry, ob) = tokio::task::spawn_blocking(move || {
                    hash_file(&rel, &abs, piece_size, group_size)
                })
                .await
                .map_err(|e| MirrorError::io("hashing", std::io::Error::other(e)))??;
                if upload_outboard(store.as_ref(), &entry, ob, reupload).await? {
                    uploaded.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Ok::<_, MirrorError>(entry)
            }
        })
        .buffer_unordered(parallel)
        .try_collect()
        .await?;
    entries.sort_by(|a, b| a.path.cmp(&b.path));

    let manifest = Manifest {
        format: MANIFEST_FORMAT,
        model: model.to_string(),
        revision: revision.to_string(),
        files: entries,
    };
    manifest.validate()?;

    let mut report = PublishReport {
        files: manifest.files.len(),
        bytes_hashed: manifest.total_size(),
        ..Default::default()
    };

    // One upload per distinct blob.
    let mut uploads: Vec<(Blake3Hash, u64, PathBuf)> = Vec::new();
    for f in &manifest.files {
        if !uploads.iter().any(|(h, _, _)| *h == f.hash) {
            uploads.push((f.hash, f.size, dir.join(&f.path)));
        }
    }
    let results: Vec<bool> = stream::iter(uploads)
        .map(|(hash, size, abs)| {
            let store = Arc::clone(&store);
            async move {
                upload_blob(store.as_ref(), &hash, size, &abs, piece_size, reupload).await
            }
        })
        .buffer_unordered(parallel)
        .try_collect()
        .await?;
    report.blobs_uploaded = results.iter().filter(|u| **u).count();
    report.blobs_skipped = results.len() - report.blobs_uploaded;
    report.outboards_uploaded = outboards_uploaded.into_inner();

    put_manifest(store.as_ref(), &manifest).await?;
    if let Some(t) = tag {
        let tkey = StorePath::from(tag_key(model, t));
        store
            .put(&tkey, PutPayload::from(format!("{revision}\n")))
            .await
            .map_err(|e| MirrorError::store(format!("writing {tkey}"), e))?;
    }
    report.manifest = Some(manifest);
    Ok(report)
}

/// Writes the manifest of a revision that must not change once published: kept when the
/// existing one lists the same files (a republish, or one by an older build), refused when it
/// lists others, created when absent. The creation is a conditional put, so two publishers
/// racing for one revision name cannot both win: the loser reads the winner's manifest and
/// is refused (or kept, with the same files). A store that cannot put conditionally (S3 with
/// conditional puts disabled) gets a plain put after the read, as before.
async fn put_manifest(store: &dyn ObjectStore, manifest: &Manifest) -> Result<(), MirrorError> {
    let mkey = StorePath::from(manifest_key(&manifest.model, &manifest.revision));
    let payload = PutPayload::from(manifest.to_json());
    // A second read only after losing a creation race; a third would mean a store that says
    // "exists" and then "not found", which a plain error reports.
    for _ in 0..2 {
        match store.get(&mkey).await {
            Ok(existing) => {
                let bytes = existing
                    .bytes()
                    .await
                    .map_err(|e| MirrorError::store(format!("reading {mkey}"), e))?;
                return if Manifest::from_json(&bytes).is_ok_and(|old| old.same_content(manifest)) {
                    Ok(())
                } else {
                    Err(MirrorError::RevisionExists {
                        model: manifest.model.clone(),
                        revision: manifest.revision.clone(),
                    })
                };
            }
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(MirrorError::store(format!("reading {mkey}"), e)),
        }
        let create = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        let put = match store.put_opts(&mkey, payload.clone(), create).await {
            Err(object_store::Error::AlreadyExists { .. }) => continue,
            Err(object_store::Error::NotImplemented { .. }) => {
                store.put(&mkey, payload.clone()).await
            }
            r => r,
        };
        return put
            .map(|_| ())
            .map_err(|e| MirrorError::store(format!("writing {mkey}"), e));
    }
    Err(MirrorError::store(
        format!("writing {mkey}"),
        object_store::Error::Generic {
            store: "origin",
            source: "the manifest exists and is not found in turn".into(),
        },
    ))
}

/// Regular files under `dir`, with their `/`-separated relative paths, but for the state a
/// pull keeps there (`crate::verified::STATE_DIR`). Symlinks are refused rather than
/// followed, so a publish never reaches outside `dir`.
fn list_files(dir: &Path) -> Result<Vec<(String, PathBuf)>, MirrorError> {
    let mut out = Vec::new();
    let mut stack = vec![(String::new(), dir.to_path_buf())];
    while let Some((prefix, path)) = stack.pop() {
        let rd = std::fs::read_dir(&path)
            .map_err(|e| MirrorError::io(format!("reading directory {}", path.display()), e))?;
        for ent in rd {
            let ent = ent
                .map_err(|e| MirrorError::io(format!("reading directory {}", path.display()), e))?;
            let name = ent.file_name().into_string().map_err(|n| {
                MirrorError::io(
                    format!("file name {n:?} in {}", path.display()),
                    std::io::Error::other("not UTF-8"),
                )
            })?;
            let rel = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            let ft = ent
                .file_type()
                .map_err(|e| MirrorError::io(format!("stat {}", ent.path().display()), e))?;
            if ft.is_dir() && rel == crate::verified::STATE_DIR {
                // What a pull into this directory verified: not part of the model.
                continue;
            }
            if ft.is_dir() {
                stack.push((rel, ent.path()));
            } else if ft.is_file() {
                out.push((rel, ent.path()));
            } else {
                return Err(MirrorError::io(
                    format!("{}", ent.path().display()),
                    std::io::Error::other("not a regular file or directory (symlinks are refused)"),
                ));
            }
        }
    }
    if out.is_empty() {
        return Err(MirrorError::io(
            format!("publishing {}", dir.display()),
            std::io::Error::other("no files to publish"),
        ));
    }
    Ok(out)
}

/// Hashes one file in one read: its BLAKE3 hash and its outboard at `group_size`, from which
/// the piece CVs are taken ([`FileEntry::from_outboard`]). `piece_size` and `group_size` are
/// powers of two, the group at most the piece.
pub fn hash_file(
    rel: &str,
    abs: &Path,
    piece_size: u64,
    group_size: u64,
) -> Result<(FileEntry, Vec<u8>), MirrorError> {
    let ctx = || format!("hashing {}", abs.display());
    let f = std::fs::File::open(abs).map_err(|e| MirrorError::io(ctx(), e))?;
    let size = f.metadata().map_err(|e| MirrorError::io(ctx(), e))?.len();
    // `take`: a file that grows while it is read is hashed at the size it had; one that
    // shrinks fails here, and one that changes is caught when it is uploaded.
    let reader = std::io::BufReader::with_capacity(1 << 20, f).take(size);
    let (hash, ob) =
        outboard::create(reader, size, group_size).map_err(|e| MirrorError::io(ctx(), e))?;
    let entry = FileEntry::from_outboard(rel, size, hash, piece_size, group_size, &ob)
        .expect("invariant: an outboard just made matches the hash made with it");
    Ok((entry, ob))
}

/// Reads until `buf` is full or end of file.
pub(crate) fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

async fn read_full_async(
    r: &mut (impl tokio::io::AsyncRead + Unpin),
    buf: &mut [u8],
) -> std::io::Result<usize> {
    use tokio::io::AsyncReadExt as _;
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]).await? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Uploads the outboard of `entry` unless an object of that name and size exists (or
/// `reupload`). Returns whether it uploaded.
async fn upload_outboard(
    store: &dyn ObjectStore,
    entry: &FileEntry,
    ob: Vec<u8>,
    reupload: bool,
) -> Result<bool, MirrorError> {
    let key = StorePath::from(
        entry
            .outboard_key()
            .expect("invariant: publish writes format-3 entries"),
    );
    match store.head(&key).await {
        Ok(meta) if meta.size == ob.len() as u64 && !reupload => return Ok(false),
        Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
        Err(e) => return Err(MirrorError::store(format!("checking {key}"), e)),
    }
    store
        .put(&key, PutPayload::from(ob))
        .await
        .map_err(|e| MirrorError::store(format!("writing {key}"), e))?;
    Ok(true)
}

/// Most parts of one multipart upload: S3 allows 10,000 (Azure 50,000 blocks).
pub const MAX_PARTS: u64 = 10_000;

/// The part size of a multipart upload of `size` bytes: one piece, or as many whole pieces
/// as keep the upload within [`MAX_PARTS`] (a 200 GiB file in 4 MiB pieces goes up in 24 MiB
/// parts; one part per piece, coalesced to 8 MiB for S3, failed above 78 GiB there, after
/// uploading all of that).
pub fn part_size(size: u64, piece_size: u64) -> u64 {
    let piece_size = piece_size.max(1);
    size.div_ceil(MAX_PARTS)
        .next_multiple_of(piece_size)
        .max(piece_size)
}

/// Uploads one blob unless an object of that name and size exists. Returns whether it
/// uploaded. Large files go up as a multipart upload, in parts of [`part_size`].
async fn upload_blob(
    store: &dyn ObjectStore,
    hash: &Blake3Hash,
    size: u64,
    abs: &Path,
    piece_size: u64,
    reupload: bool,
) -> Result<bool, MirrorError> {
    let key = StorePath::from(blob_key(hash));
    match store.head(&key).await {
        Ok(meta) if meta.size == size && !reupload => return Ok(false),
        Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
        Err(e) => return Err(MirrorError::store(format!("checking {key}"), e)),
    }
    let ctx = || format!("uploading {} as {key}", abs.display());
    let mut upload = store
        .put_multipart(&key)
        .await
        .map_err(|e| MirrorError::store(ctx(), e))?;
    let mut file = tokio::fs::File::open(abs)
        .await
        .map_err(|e| MirrorError::io(ctx(), e))?;
    let mut sent = 0u64;
    let mut hasher = blake3::Hasher::new();
    let part = part_size(size, piece_size);
    loop {
        let mut buf = vec![0u8; part as usize];
        let n = read_full_async(&mut file, &mut buf)
            .await
            .map_err(|e| MirrorError::io(ctx(), e))?;
        if n == 0 {
            break;
        }
        buf.truncate(n);
        hasher.update(&buf);
        sent += n as u64;
        if let Err(e) = upload.put_part(PutPayload::from(buf)).await {
            let _ = upload.abort().await;
            return Err(MirrorError::store(ctx(), e));
        }
    }
    // The file must not have changed between hashing and upload.
    let got: Blake3Hash = hasher.finalize().into();
    if got != *hash || sent != size {
        let _ = upload.abort().await;
        return Err(MirrorError::io(
            ctx(),
            std::io::Error::other("file changed while publishing; publish again"),
        ));
    }
    upload
        .complete()
        .await
        .map_err(|e| MirrorError::store(ctx(), e))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_goes_up_in_at_most_max_parts_parts_of_whole_pieces() {
        const MIB: u64 = 1 << 20;
        assert_eq!(part_size(0, 4 * MIB), 4 * MIB);
        assert_eq!(part_size(10 * MIB, 4 * MIB), 4 * MIB);
        assert_eq!(part_size(200 << 30, 4 * MIB), 24 * MIB);
        for (size, piece) in [
            (200u64 << 30, 4 * MIB),
            (5 << 40, 64 << 10),
            ((39 << 30) + 1, 4 * MIB),
            (12_345, 64 << 10),
        ] {
            let part = part_size(size, piece);
            assert_eq!(part % piece, 0, "{size} {piece}");
            assert!(size.div_ceil(part) <= MAX_PARTS, "{size} {piece}: {part}");
        }
    }

    /// A store whose reads take a while (a far-away origin): two publishers both find the
    /// revision absent before either writes it.
    #[derive(Debug)]
    struct SlowReads(object_store::memory::InMemory);

    impl std::fmt::Display for SlowReads {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SlowReads")
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for SlowReads {
        async fn put_opts(
            &self,
            location: &StorePath,
            payload: PutPayload,
            opts: PutOptions,
        ) -> object_store::Result<object_store::PutResult> {
            self.0.put_opts(location, payload, opts).await
        }

        async fn put_multipart_opts(
            &self,
            location: &StorePath,
            opts: object_store::PutMultipartOptions,
        ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
            self.0.put_multipart_opts(location, opts).await
        }

        async fn get_opts(
            &self,
            location: &StorePath,
            options: object_store::GetOptions,
        ) -> object_store::Result<object_store::GetResult> {
            // The answer is read now and arrives later.
            let answer = self.0.get_opts(location, options).await;
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            answer
        }

        fn delete_stream(
            &self,
            locations: futures_util::stream::BoxStream<'static, object_store::Result<StorePath>>,
        ) -> futures_util::stream::BoxStream<'static, object_store::Result<StorePath>> {
            self.0.delete_stream(locations)
        }

        fn list(
            &self,
            prefix: Option<&StorePath>,
        ) -> futures_util::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>>
        {
            self.0.list(prefix)
        }

        async fn list_with_delimiter(
            &self,
            prefix: Option<&StorePath>,
        ) -> object_store::Result<object_store::ListResult> {
            self.0.list_with_delimiter(prefix).await
        }

        async fn copy_opts(
            &self,
            from: &StorePath,
            to: &StorePath,
            options: object_store::CopyOptions,
        ) -> object_store::Result<()> {
            self.0.copy_opts(from, to, options).await
        }
    }

    fn manifest_of(revision: &str, config: &str) -> Manifest {
        let data = config.as_bytes();
        let g = DEFAULT_GROUP_SIZE;
        let (hash, ob) = outboard::create(data, data.len() as u64, g).unwrap();
        let size = data.len() as u64;
        let entry = FileEntry::from_outboard("config.json", size, hash, DEFAULT_PIECE_SIZE, g, &ob);
        Manifest {
            format: MANIFEST_FORMAT,
            model: "org/m".into(),
            revision: revision.into(),
            files: vec![entry.unwrap()],
        }
    }

    #[tokio::test]
    async fn two_publishers_racing_for_one_revision_cannot_both_win() {
        let store = SlowReads(object_store::memory::InMemory::new());
        for round in 0..4 {
            let rev = format!("r{round}");
            let (a, b) = (
                manifest_of(&rev, "{\"a\":1}"),
                manifest_of(&rev, "{\"b\":2}"),
            );
            let (ra, rb) = tokio::join!(put_manifest(&store, &a), put_manifest(&store, &b));
            assert!(ra.is_ok() != rb.is_ok(), "round {round}: {ra:?} / {rb:?}");
            let err = if ra.is_ok() { rb.as_ref() } else { ra.as_ref() }.unwrap_err();
            assert!(matches!(err, MirrorError::RevisionExists { .. }), "{err}");
            // Republishing the winner's files is a no-op; the loser's stay refused.
            let (won, lost) = if ra.is_ok() { (&a, &b) } else { (&b, &a) };
            put_manifest(&store, won).await.unwrap();
            assert!(put_manifest(&store, lost).await.is_err());
        }
    }
}
