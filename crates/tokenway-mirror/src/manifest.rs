//! Model format: manifests, tags, names and object-store layout. Sans-IO.
//!
//! A model revision is one JSON manifest listing its files; each file is stored once, as a
//! blob named by its BLAKE3 hash. A file is also cut into fixed-size pieces whose BLAKE3
//! hashes are listed in the manifest, so whoever receives any piece (from an origin, a mirror
//! or a peer) can verify it without trusting the sender, and without the whole file.
//!
//! Three formats, all read: format 1 lists each piece's BLAKE3 as if the piece were a file of
//! its own; format 2 uses power-of-two piece sizes and lists each piece's chaining value in
//! the file's BLAKE3 tree ([`crate::piece_tree`]), so the pieces are checked against the file
//! hash when the manifest is validated, and a file assembled from verified pieces has the
//! file hash without being hashed again. Format 3 (written since) lists no pieces: each blob
//! has a bao-tree outboard beside it ([`crate::outboard`], `outboards/<hash>-<group size>`),
//! and the piece CVs are read out of it, checked against the file hash, when the manifest is
//! loaded ([`FileEntry::attach_outboard`]); until then its multi-piece entries are
//! unresolved ([`FileEntry::needs_outboard`]).
//!
//! This module parses and validates; it never touches a file or the network. Everything it
//! accepts is safe to join onto a local directory: paths are relative, have no `..`, no
//! empty components, no NUL or backslash.
//!
//! Layout in the origin (and in any mirror):
//! - `blobs/<hash>`: file contents,
//! - `outboards/<hash>-<group size>`: the blob's BLAKE3 tree above its chunk groups,
//! - `models/<name>/revisions/<rev>.json`: manifest,
//! - `models/<name>/tags/<tag>`: the revision name, as text.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::outboard::{self, BadOutboard};
use crate::piece_tree::{is_subtree_size, piece_cv, root_from_piece_cvs};
use crate::MirrorError;

/// Version of the manifest format written by this crate: pieces are subtrees whose CVs come
/// from the blob's outboard.
pub const MANIFEST_FORMAT: u32 = 3;
/// The second manifest format: pieces hashed as subtrees, their CVs listed. Still read.
pub const MANIFEST_FORMAT_PIECE_LIST: u32 = 2;
/// The first manifest format: pieces hashed as standalone inputs. Still read.
pub const MANIFEST_FORMAT_STANDALONE_PIECES: u32 = 1;
/// Default piece size: 4 MiB.
pub const DEFAULT_PIECE_SIZE: u64 = 4 << 20;
/// Smallest piece size accepted (64 KiB).
pub const MIN_PIECE_SIZE: u64 = 64 << 10;
/// Largest piece size accepted (64 MiB): a piece is held in memory while it is verified.
pub const MAX_PIECE_SIZE: u64 = 64 << 20;
/// Longest accepted model, revision or tag name.
pub const MAX_NAME_LEN: usize = 128;
/// Longest accepted file path in a manifest.
pub const MAX_PATH_LEN: usize = 1024;
/// Longest component of a file path (`NAME_MAX` of common file systems).
pub const MAX_COMPONENT_LEN: usize = 255;

/// A BLAKE3 hash (32 bytes), written as 64 lowercase hex characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Blake3Hash(pub [u8; 32]);

impl Blake3Hash {
    /// Hash of `data`.
    pub fn of(data: &[u8]) -> Self {
        Self(*blake3::hash(data).as_bytes())
    }

    /// Parses 64 hex characters.
    pub fn from_hex(s: &str) -> Result<Self, String> {
        if s.len() != 64 {
            return Err(format!("expected 64 hex characters, got {}", s.len()));
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|e| format!("not hex: {e}"))?;
        Ok(Self(out))
    }

    /// Lowercase hex form.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl From<blake3::Hash> for Blake3Hash {
    fn from(h: blake3::Hash) -> Self {
        Self(*h.as_bytes())
    }
}

impl fmt::Display for Blake3Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Blake3Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Blake3Hash({})", self.to_hex())
    }
}

impl Serialize for Blake3Hash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Blake3Hash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::from_hex(&s).map_err(|e| serde::de::Error::custom(format!("BLAKE3 hash: {e}")))
    }
}

/// Checks a model name: one or two `/`-separated components (`org/model`), each a
/// [`validate_name`]-valid name.
pub fn validate_model_name(field: &str, name: &str) -> Result<(), MirrorError> {
    let parts: Vec<&str> = name.split('/').collect();
    if parts.len() > 2 {
        return Err(MirrorError::invalid_name(
            field,
            name,
            "at most one '/' (as in org/model)",
        ));
    }
    for part in &parts {
        if parts.len() == 2 && matches!(*part, "tags" | "revisions") {
            return Err(MirrorError::invalid_name(
                field,
                name,
                "'tags' and 'revisions' are reserved (they would clash in the origin layout)",
            ));
        }
        validate_name(field, part).map_err(|_| {
            MirrorError::invalid_name(
                field,
                name,
                "each part must be 1-128 of [A-Za-z0-9._-], not starting with '.' or '-'",
            )
        })?;
    }
    Ok(())
}

/// Checks a revision or tag name: 1 to 128 of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn validate_name(field: &str, name: &str) -> Result<(), MirrorError> {
    let reason = if name.is_empty() {
        Some("must not be empty")
    } else if name.len() > MAX_NAME_LEN {
        Some("longer than 128 characters")
    } else if name.starts_with('.') || name.starts_with('-') {
        Some("must not start with '.' or '-'")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        Some("only [A-Za-z0-9._-] allowed")
    } else {
        None
    };
    match reason {
        Some(r) => Err(MirrorError::invalid_name(field, name, r)),
        None => Ok(()),
    }
}

/// Checks a relative file path from a manifest: `/`-separated, no leading `/`, no empty,
/// `.` or `..` components, no NUL, no backslash, no control characters (they would reach
/// terminals and file names), at most [`MAX_PATH_LEN`] bytes and [`MAX_COMPONENT_LEN`] per
/// component (what file systems take).
pub fn validate_rel_path(field: &str, path: &str) -> Result<(), MirrorError> {
    let bad = |reason: &str| Err(MirrorError::manifest(field, format!("{path:?}: {reason}")));
    if path.is_empty() {
        return bad("empty path");
    }
    if path.len() > MAX_PATH_LEN {
        return bad("path longer than 1024 bytes");
    }
    if path.starts_with('/') {
        return bad("absolute path");
    }
    if path.contains('\0') || path.contains('\\') {
        return bad("NUL or backslash in path");
    }
    if path.chars().any(char::is_control) {
        return bad("control character in path");
    }
    for comp in path.split('/') {
        match comp {
            "" => return bad("empty path component"),
            "." | ".." => return bad("'.' or '..' component (path traversal)"),
            c if c.len() > MAX_COMPONENT_LEN => {
                return bad("a path component longer than 255 bytes")
            }
            _ => {}
        }
    }
    // `.partial` is where pulls keep unfinished files, `.tokenway` what they verified.
    for reserved in [".partial", crate::verified::STATE_DIR] {
        if path == reserved
            || path
                .strip_prefix(reserved)
                .is_some_and(|r| r.starts_with('/'))
        {
            return bad(&format!("'{reserved}' is reserved"));
        }
    }
    Ok(())
}

/// What the `pieces` of a file entry are the hashes of; follows from the manifest's format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PieceHashing {
    /// Format 1: `BLAKE3(piece)`, each piece hashed as an input of its own.
    #[default]
    Standalone,
    /// Formats 2 and 3: the piece's chaining value as the subtree at its offset in the
    /// file's BLAKE3 tree; the file hash itself when the file is one piece.
    Subtree,
}

impl PieceHashing {
    /// The hashing of manifest format `format`, if this build knows it.
    pub fn of_format(format: u32) -> Option<Self> {
        match format {
            MANIFEST_FORMAT_STANDALONE_PIECES => Some(Self::Standalone),
            MANIFEST_FORMAT_PIECE_LIST | MANIFEST_FORMAT => Some(Self::Subtree),
            _ => None,
        }
    }
}

/// A piece whose bytes do not match the manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceMismatch;

/// One file of a model revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Relative path inside the model directory (`/`-separated).
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// BLAKE3 hash of the whole file; also the blob name.
    pub hash: Blake3Hash,
    /// Size of every piece but the last.
    pub piece_size: u64,
    /// Hash of each piece, in order; `ceil(size / piece_size)` of them; see
    /// [`piece_hashing`](Self::piece_hashing). Not in format-3 JSON: filled from the
    /// outboard ([`attach_outboard`](Self::attach_outboard)).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<Blake3Hash>,
    /// Format 3: chunk group size of the blob's outboard ([`crate::outboard`]), a power of two
    /// from 64 KiB to 1 MiB, at most `piece_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_size: Option<u64>,
    /// How `pieces` were computed: not in the JSON, set from the manifest's `format` by
    /// [`Manifest::from_json`] (and by whoever builds an entry).
    #[serde(skip)]
    pub piece_hashing: PieceHashing,
}

impl FileEntry {
    /// Number of pieces a file of `size` bytes has with `piece_size`.
    pub fn piece_count_for(size: u64, piece_size: u64) -> u64 {
        size.div_ceil(piece_size)
    }

    /// Byte range of piece `index`.
    pub fn piece_range(&self, index: u64) -> std::ops::Range<u64> {
        let start = index * self.piece_size;
        start..(start + self.piece_size).min(self.size)
    }

    /// Checks piece `index` (`data` is all of it) against the manifest. On a match, returns
    /// the piece's chaining value in the file's BLAKE3 tree (the file hash for a file of one
    /// piece) when `want_tree` is set and it can be had, so the whole-file hash can be merged
    /// from the pieces ([`file_hash_from_pieces`](Self::file_hash_from_pieces)) instead of
    /// read again. Format 2 gets it for free; format 1 pays a second hash of the piece (in
    /// memory), and has none when its piece size is not a power of two.
    pub fn verify_piece(
        &self,
        index: u64,
        data: &[u8],
        want_tree: bool,
    ) -> Result<Option<Blake3Hash>, PieceMismatch> {
        let want = *self.pieces.get(index as usize).ok_or(PieceMismatch)?;
        let r = self.piece_range(index);
        if data.len() as u64 != r.end - r.start {
            return Err(PieceMismatch);
        }
        let only = self.pieces.len() == 1;
        match self.piece_hashing {
            PieceHashing::Subtree => {
                let got = if only {
                    Blake3Hash::of(data)
                } else {
                    piece_cv(data, r.start)
                };
                (got == want).then_some(Some(got)).ok_or(PieceMismatch)
            }
            PieceHashing::Standalone => {
                if Blake3Hash::of(data) != want {
                    return Err(PieceMismatch);
                }
                Ok(if only {
                    Some(want)
                } else if want_tree && is_subtree_size(self.piece_size) {
                    Some(piece_cv(data, r.start))
                } else {
                    None
                })
            }
        }
    }

    /// The format-3 entry of a blob of `size` bytes whose hash is `hash` and whose outboard
    /// at `group_size` is `outboard` (as [`crate::outboard::create`] makes them); the piece
    /// CVs are read out of the outboard, which is checked against `hash`.
    pub fn from_outboard(
        path: &str,
        size: u64,
        hash: Blake3Hash,
        piece_size: u64,
        group_size: u64,
        outboard: &[u8],
    ) -> Result<Self, BadOutboard> {
        let mut e = Self {
            path: path.to_string(),
            size,
            hash,
            piece_size,
            pieces: Vec::new(),
            group_size: Some(group_size),
            piece_hashing: PieceHashing::Subtree,
        };
        e.attach_outboard(outboard)?;
        Ok(e)
    }

    /// Format 3 and more than one piece, not yet resolved: the piece CVs are to be read from
    /// the blob's outboard before any piece can be verified.
    pub fn needs_outboard(&self) -> bool {
        self.group_size.is_some()
            && self.pieces.len() as u64 != Self::piece_count_for(self.size, self.piece_size)
    }

    /// Object key (and mirror path) of this blob's outboard; format 3 only.
    pub fn outboard_key(&self) -> Option<String> {
        self.group_size.map(|g| outboard_key(&self.hash, g))
    }

    /// Length the outboard must have; format 3 only.
    pub fn outboard_len(&self) -> Option<u64> {
        self.group_size
            .map(|g| outboard::outboard_len(self.size, g))
    }

    /// Fills the piece CVs from the blob's outboard, checked against the file hash. The
    /// outboard may come from anyone: one that does not match is refused and changes nothing.
    pub fn attach_outboard(&mut self, outboard: &[u8]) -> Result<(), BadOutboard> {
        let group = self
            .group_size
            .expect("invariant: attach_outboard is called on format-3 entries only");
        self.pieces = outboard::piece_cvs(outboard, self.size, group, self.piece_size, &self.hash)?;
        Ok(())
    }

    /// Does piece `index` match the manifest?
    pub fn piece_matches(&self, index: u64, data: &[u8]) -> bool {
        self.verify_piece(index, data, false).is_ok()
    }

    /// The file hash merged from the tree hashes [`verify_piece`](Self::verify_piece)
    /// returned for every piece, in order.
    pub fn file_hash_from_pieces(&self, trees: &[Blake3Hash]) -> Blake3Hash {
        match trees {
            [] => Blake3Hash::of(&[]),
            [one] => *one,
            _ => root_from_piece_cvs(trees),
        }
    }

    fn validate(&self, field: &str) -> Result<(), MirrorError> {
        validate_rel_path(&format!("{field}.path"), &self.path)?;
        if !(MIN_PIECE_SIZE..=MAX_PIECE_SIZE).contains(&self.piece_size) {
            return Err(MirrorError::manifest(
                format!("{field}.piece_size"),
                format!(
                    "{} is outside {MIN_PIECE_SIZE}..={MAX_PIECE_SIZE}",
                    self.piece_size
                ),
            ));
        }
        if let Some(g) = self.group_size {
            if !outboard::is_group_size(g) || g > self.piece_size {
                return Err(MirrorError::manifest(
                    format!("{field}.group_size"),
                    format!(
                        "{g} is not a power of two from {} to {} bytes at most the piece size",
                        outboard::MIN_GROUP_SIZE,
                        outboard::MAX_GROUP_SIZE
                    ),
                ));
            }
        }
        let want = Self::piece_count_for(self.size, self.piece_size);
        // Format 3 lists no pieces (they come from the outboard, checked when attached).
        let unresolved = self.group_size.is_some() && self.pieces.is_empty();
        if self.pieces.len() as u64 != want && !unresolved {
            return Err(MirrorError::manifest(
                format!("{field}.pieces"),
                format!(
                    "{} piece hashes for size {} and piece_size {} (expected {want})",
                    self.pieces.len(),
                    self.size,
                    self.piece_size
                ),
            ));
        }
        if self.size == 0 && self.hash != Blake3Hash::of(&[]) {
            return Err(MirrorError::manifest(
                format!("{field}.hash"),
                "an empty file must have the hash of no bytes",
            ));
        }
        if self.piece_hashing == PieceHashing::Subtree {
            if !is_subtree_size(self.piece_size) {
                return Err(MirrorError::manifest(
                    format!("{field}.piece_size"),
                    format!(
                        "{} is not a power of two (format {MANIFEST_FORMAT} needs one)",
                        self.piece_size
                    ),
                ));
            }
            if !self.pieces.is_empty()
                && self.group_size.is_none()
                && self.file_hash_from_pieces(&self.pieces) != self.hash
            {
                return Err(MirrorError::manifest(
                    format!("{field}.pieces"),
                    "the piece hashes do not combine into the file hash",
                ));
            }
        }
        Ok(())
    }
}

/// The manifest of one model revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Format version, [`MANIFEST_FORMAT`].
    pub format: u32,
    /// Model name.
    pub model: String,
    /// Revision name.
    pub revision: String,
    /// Files, sorted by path, no duplicates.
    pub files: Vec<FileEntry>,
}

impl Manifest {
    /// Parses and validates manifest JSON.
    pub fn from_json(bytes: &[u8]) -> Result<Self, MirrorError> {
        let mut m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| MirrorError::manifest("(json)", e.to_string()))?;
        if let Some(h) = PieceHashing::of_format(m.format) {
            for f in &mut m.files {
                f.piece_hashing = h;
            }
        }
        if m.format >= MANIFEST_FORMAT {
            for (i, f) in m.files.iter().enumerate() {
                if !f.pieces.is_empty() {
                    return Err(MirrorError::manifest(
                        format!("files[{i}].pieces"),
                        format!(
                            "format {} lists no pieces (they are in the outboard)",
                            m.format
                        ),
                    ));
                }
            }
        }
        m.validate()?;
        // A file of one piece is verified by its hash: nothing to read from an outboard.
        for f in &mut m.files {
            if f.group_size.is_some() && f.size > 0 && f.size <= f.piece_size {
                f.pieces = vec![f.hash];
            }
        }
        Ok(m)
    }

    /// Same files with the same contents and layout (format and piece hashes aside): what
    /// republishing a revision may leave as it is.
    pub fn same_content(&self, other: &Manifest) -> bool {
        self.model == other.model
            && self.revision == other.revision
            && self.files.len() == other.files.len()
            && self.files.iter().zip(&other.files).all(|(a, b)| {
                a.path == b.path
                    && a.size == b.size
                    && a.hash == b.hash
                    && a.piece_size == b.piece_size
            })
    }

    /// Pretty JSON, as stored in the origin (format 3: without the pieces resolved from the
    /// outboards).
    pub fn to_json(&self) -> Vec<u8> {
        let stored;
        let m = if self.format >= MANIFEST_FORMAT {
            let mut c = self.clone();
            c.files.iter_mut().for_each(|f| f.pieces.clear());
            stored = c;
            &stored
        } else {
            self
        };
        let mut v = serde_json::to_vec_pretty(m)
            .expect("invariant: a Manifest always serializes (only strings, numbers, arrays)");
        v.push(b'\n');
        v
    }

    /// Total bytes of all files.
    pub fn total_size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// Checks every field; errors name the field (`files[2].path`).
    pub fn validate(&self) -> Result<(), MirrorError> {
        let Some(hashing) = PieceHashing::of_format(self.format) else {
            return Err(MirrorError::manifest(
                "format",
                format!(
                    "version {} not supported (this build reads \
                     {MANIFEST_FORMAT_STANDALONE_PIECES} to {MANIFEST_FORMAT})",
                    self.format
                ),
            ));
        };
        validate_model_name("model", &self.model)?;
        validate_name("revision", &self.revision)?;
        for (i, f) in self.files.iter().enumerate() {
            if f.piece_hashing != hashing {
                return Err(MirrorError::manifest(
                    format!("files[{i}]"),
                    format!(
                        "pieces hashed as {:?}, but format {} hashes them as {hashing:?}",
                        f.piece_hashing, self.format
                    ),
                ));
            }
            if f.group_size.is_some() != (self.format >= MANIFEST_FORMAT) {
                return Err(MirrorError::manifest(
                    format!("files[{i}].group_size"),
                    format!(
                        "required from format {MANIFEST_FORMAT} on, not allowed before (this is format {})",
                        self.format
                    ),
                ));
            }
            f.validate(&format!("files[{i}]"))?;
        }
        let mut paths = std::collections::HashSet::with_capacity(self.files.len());
        for f in &self.files {
            if !paths.insert(f.path.as_str()) {
                return Err(MirrorError::manifest(
                    "files",
                    format!("duplicate path {:?}", f.path),
                ));
            }
        }
        // `a` as a file and `a/b` as another would clash on disk (whatever sorts between
        // them, such as `a.b`).
        for f in &self.files {
            for (i, _) in f.path.match_indices('/') {
                let dir = &f.path[..i];
                if paths.contains(dir) {
                    return Err(MirrorError::manifest(
                        "files",
                        format!("{dir:?} is both a file and a directory"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// What a user asks to pull: `name`, `name:tag` or `name@revision`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRef {
    /// Model name.
    pub model: String,
    /// Tag or revision.
    pub selector: Selector,
}

/// Which revision of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    /// Follow a tag.
    Tag(String),
    /// An exact revision.
    Revision(String),
}

impl ModelRef {
    /// Parses `name`, `name:tag` or `name@revision`; a bare name means tag `latest`.
    pub fn parse(s: &str) -> Result<Self, MirrorError> {
        let (model, selector) = if let Some((m, rev)) = s.split_once('@') {
            validate_name("revision", rev)?;
            (m, Selector::Revision(rev.to_string()))
        } else if let Some((m, tag)) = s.split_once(':') {
            validate_name("tag", tag)?;
            (m, Selector::Tag(tag.to_string()))
        } else {
            (s, Selector::Tag("latest".to_string()))
        };
        validate_model_name("model", model)?;
        Ok(Self {
            model: model.to_string(),
            selector,
        })
    }
}

impl fmt::Display for ModelRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.selector {
            Selector::Tag(t) => write!(f, "{}:{t}", self.model),
            Selector::Revision(r) => write!(f, "{}@{r}", self.model),
        }
    }
}

/// Object key of a blob.
pub fn blob_key(hash: &Blake3Hash) -> String {
    format!("blobs/{hash}")
}

/// Object key of the outboard of blob `hash` at chunk groups of `group_size` bytes.
pub fn outboard_key(hash: &Blake3Hash, group_size: u64) -> String {
    format!("outboards/{hash}-{group_size}")
}

/// Object key of a revision manifest.
pub fn manifest_key(model: &str, revision: &str) -> String {
    format!("models/{model}/revisions/{revision}.json")
}

/// Largest tag object read: a tag holds one revision name.
pub const MAX_TAG_BYTES: u64 = 4 << 10;

/// Object key of a tag.
pub fn tag_key(model: &str, tag: &str) -> String {
    format!("models/{model}/tags/{tag}")
}

/// Parses the contents of a tag object: a revision name, surrounding whitespace ignored.
pub fn parse_tag(bytes: &[u8]) -> Result<String, MirrorError> {
    let s = std::str::from_utf8(bytes)
        .map_err(|_| MirrorError::invalid_name("tag target", "<not UTF-8>", "not UTF-8"))?
        .trim();
    validate_name("tag target", s)?;
    Ok(s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A format-3 entry, its pieces resolved, and its outboard.
    fn entry_ob(path: &str, data: &[u8], piece_size: u64) -> (FileEntry, Vec<u8>) {
        let g = outboard::DEFAULT_GROUP_SIZE;
        let (hash, ob) = outboard::create(data, data.len() as u64, g).unwrap();
        let e = FileEntry::from_outboard(path, data.len() as u64, hash, piece_size, g, &ob);
        (e.unwrap(), ob)
    }

    fn entry(path: &str, data: &[u8], piece_size: u64) -> FileEntry {
        entry_ob(path, data, piece_size).0
    }

    /// A format-2 entry: the CV of every piece listed.
    fn entry_v2(path: &str, data: &[u8], piece_size: u64) -> FileEntry {
        let cvs: Vec<Blake3Hash> = data
            .chunks(piece_size as usize)
            .enumerate()
            .map(|(i, p)| piece_cv(p, i as u64 * piece_size))
            .collect();
        FileEntry {
            path: path.into(),
            size: data.len() as u64,
            hash: Blake3Hash::of(data),
            piece_size,
            pieces: match cvs.len() {
                0 | 1 => data
                    .chunks(piece_size as usize)
                    .map(Blake3Hash::of)
                    .collect(),
                _ => cvs,
            },
            group_size: None,
            piece_hashing: PieceHashing::Subtree,
        }
    }

    /// A format-1 entry: every piece hashed as an input of its own.
    fn entry_v1(path: &str, data: &[u8], piece_size: u64) -> FileEntry {
        FileEntry {
            path: path.into(),
            size: data.len() as u64,
            hash: Blake3Hash::of(data),
            piece_size,
            pieces: data
                .chunks(piece_size as usize)
                .map(Blake3Hash::of)
                .collect(),
            group_size: None,
            piece_hashing: PieceHashing::Standalone,
        }
    }

    fn bytes(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 1000) as u8).collect()
    }

    #[test]
    fn format_2_and_3_entries_hash_each_piece_as_a_subtree_of_the_file() {
        let piece = 4u64 << 20;
        let p = piece as usize;
        for len in [0, 1, p - 1, p, p + 1, 3 * p + 5, 5 * p + 17] {
            let data = bytes(len);
            let e = entry("f", &data, piece);
            assert_eq!(e.pieces, entry_v2("f", &data, piece).pieces, "{len} bytes");
            assert_eq!(e.hash, Blake3Hash::of(&data), "{len} bytes");
            assert_eq!(
                e.pieces.len() as u64,
                FileEntry::piece_count_for(e.size, piece)
            );
            e.validate("f").unwrap();
            let trees: Vec<Blake3Hash> = (0..e.pieces.len() as u64)
                .map(|i| {
                    let r = e.piece_range(i);
                    e.verify_piece(i, &data[r.start as usize..r.end as usize], true)
                        .unwrap()
                        .expect("format 2 always has the tree hash")
                })
                .collect();
            assert_eq!(e.file_hash_from_pieces(&trees), e.hash, "{len} bytes");
        }
    }

    #[test]
    fn a_piece_that_does_not_match_is_refused_in_both_formats() {
        let piece = MIN_PIECE_SIZE;
        let mut data = bytes(3 * piece as usize + 5);
        for e in [entry("f", &data, piece), entry_v1("f", &data, piece)] {
            let good = &data[piece as usize..2 * piece as usize];
            assert!(e.piece_matches(1, good));
            assert!(!e.piece_matches(0, good), "a piece at the wrong offset");
            assert!(!e.piece_matches(1, &good[1..]), "a short piece");
        }
        let e = entry("f", &data, piece);
        data[piece as usize + 3] ^= 0x40;
        assert!(!e.piece_matches(1, &data[piece as usize..2 * piece as usize]));
    }

    #[test]
    fn format_1_pieces_give_tree_hashes_that_merge_into_the_file_hash() {
        let piece = MIN_PIECE_SIZE;
        let data = bytes(5 * piece as usize + 9);
        let e = entry_v1("f", &data, piece);
        let trees: Vec<Blake3Hash> = (0..e.pieces.len() as u64)
            .map(|i| {
                let r = e.piece_range(i);
                e.verify_piece(i, &data[r.start as usize..r.end as usize], true)
                    .unwrap()
                    .unwrap()
            })
            .collect();
        assert_eq!(e.file_hash_from_pieces(&trees), e.hash);
        // Without a power-of-two piece size there is no tree hash (a second pass is needed).
        let e = entry_v1("f", &data, 100_000);
        assert_eq!(e.verify_piece(0, &data[..100_000], true), Ok(None));
    }

    #[test]
    fn format_1_manifests_are_still_read() {
        let mut m = manifest(vec![entry_v1("a", &bytes(200_000), MIN_PIECE_SIZE)]);
        m.format = MANIFEST_FORMAT_STANDALONE_PIECES;
        let back = Manifest::from_json(&m.to_json()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.files[0].piece_hashing, PieceHashing::Standalone);
        assert!(back.same_content(&manifest(vec![entry("a", &bytes(200_000), MIN_PIECE_SIZE)])));
    }

    #[test]
    fn format_2_pieces_must_combine_into_the_file_hash_and_sizes_be_powers_of_two() {
        let data = bytes(200_000);
        let mut e = entry_v2("a", &data, MIN_PIECE_SIZE);
        e.pieces.swap(0, 1);
        let err = manifest_v2(vec![e]).validate().unwrap_err().to_string();
        assert!(
            err.contains("files[0].pieces") && err.contains("combine"),
            "{err}"
        );
        let mut e = entry_v2("a", &data, MIN_PIECE_SIZE);
        e.hash = Blake3Hash::of(b"other");
        assert!(manifest_v2(vec![e]).validate().is_err());
        let mut e = entry_v2("a", &data, MIN_PIECE_SIZE);
        e.piece_size = 100_000;
        e.pieces.truncate(2);
        let err = manifest_v2(vec![e]).validate().unwrap_err().to_string();
        assert!(err.contains("power of two"), "{err}");
        let m = manifest_v2(vec![entry_v2("a", &data, MIN_PIECE_SIZE)]);
        assert_eq!(Manifest::from_json(&m.to_json()).unwrap(), m);
        let mut m = manifest(vec![entry("a", &data, MIN_PIECE_SIZE)]);
        m.format = 4;
        let err = Manifest::from_json(&m.to_json()).unwrap_err().to_string();
        assert!(err.contains("version 4 not supported"), "{err}");
    }

    fn manifest(files: Vec<FileEntry>) -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT,
            model: "org/m".into(),
            revision: "r1".into(),
            files,
        }
    }

    fn manifest_v2(files: Vec<FileEntry>) -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT_PIECE_LIST,
            ..manifest(files)
        }
    }

    #[test]
    fn manifest_round_trips_through_json() {
        let (a, ob) = entry_ob("a.bin", &[1u8; 200_000], MIN_PIECE_SIZE);
        let m = manifest(vec![
            a,
            entry("b.bin", &[2u8; 1000], MIN_PIECE_SIZE),
            entry("dir/empty", &[], MIN_PIECE_SIZE),
        ]);
        let json = m.to_json();
        assert!(!String::from_utf8_lossy(&json).contains("pieces"));
        let mut back = Manifest::from_json(&json).unwrap();
        // The file of four pieces waits for its outboard; the others need none.
        assert!(back.files[0].needs_outboard());
        assert!(!back.files[1].needs_outboard() && !back.files[2].needs_outboard());
        assert_eq!(back.files[0].outboard_len(), Some(ob.len() as u64));
        back.files[0].attach_outboard(&ob).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.files[0].pieces.len(), 4);
        assert_eq!(back.files[0].piece_range(3), 196_608..200_000);
    }

    #[test]
    fn a_format_3_entry_takes_only_the_outboard_of_its_own_blob() {
        let data = bytes(300_000);
        let (e, ob) = entry_ob("a", &data, MIN_PIECE_SIZE);
        let mut json = manifest(vec![e.clone()]);
        json.files[0].pieces.clear();
        let mut back = Manifest::from_json(&json.to_json()).unwrap();
        let f = &mut back.files[0];
        let mut bad = ob.clone();
        bad[70] ^= 1;
        assert!(f.attach_outboard(&bad).is_err());
        let (_, other) = entry_ob("a", &bytes(300_001), MIN_PIECE_SIZE);
        assert!(f.attach_outboard(&other).is_err());
        assert!(f.needs_outboard(), "a refused outboard changes nothing");
        f.attach_outboard(&ob).unwrap();
        assert_eq!(f.pieces, e.pieces);
        assert!(f.piece_matches(2, &data[2 * 65536..3 * 65536]));
    }

    #[test]
    fn format_3_fields_are_checked_naming_them() {
        let data = bytes(300_000);
        // Pieces listed in format-3 JSON.
        let mut m = manifest(vec![entry("a", &data, MIN_PIECE_SIZE)]);
        m.format = MANIFEST_FORMAT_PIECE_LIST;
        let listed = String::from_utf8(m.to_json())
            .unwrap()
            .replace("\"format\": 2", "\"format\": 3");
        let err = Manifest::from_json(listed.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(err.contains("files[0].pieces"), "{err}");
        // A group size in format 2, none in format 3, one larger than the pieces.
        let mut m = manifest_v2(vec![entry_v2("a", &data, MIN_PIECE_SIZE)]);
        m.files[0].group_size = Some(outboard::MIN_GROUP_SIZE);
        let err = m.validate().unwrap_err().to_string();
        assert!(err.contains("files[0].group_size"), "{err}");
        let mut m = manifest(vec![entry("a", &data, MIN_PIECE_SIZE)]);
        m.files[0].group_size = None;
        let err = m.validate().unwrap_err().to_string();
        assert!(err.contains("files[0].group_size"), "{err}");
        let mut m = manifest(vec![entry("a", &data, MIN_PIECE_SIZE)]);
        m.files[0].group_size = Some(128 << 10);
        let err = m.validate().unwrap_err().to_string();
        assert!(err.contains("files[0].group_size"), "{err}");
    }

    #[test]
    fn traversal_and_absolute_paths_are_rejected_naming_the_field() {
        for bad in [
            "../etc/passwd",
            "a/../../b",
            "/abs",
            "a//b",
            "a/./b",
            "a\\b",
            "a\0b",
            "",
            ".partial/x",
            ".tokenway/verified.json",
        ] {
            let m = manifest(vec![
                entry("ok", b"x", MIN_PIECE_SIZE),
                entry(bad, b"y", MIN_PIECE_SIZE),
            ]);
            let err = Manifest::from_json(&m.to_json()).unwrap_err().to_string();
            assert!(err.contains("files[1].path"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn wrong_piece_count_and_piece_size_are_rejected() {
        let mut e = entry("a", &[0u8; 100_000], MIN_PIECE_SIZE);
        e.pieces.pop();
        let err = manifest(vec![e]).validate().unwrap_err().to_string();
        assert!(err.contains("files[0].pieces"), "{err}");
        let e = entry_v2("a", &[0u8; 10], 1000);
        let err = manifest_v2(vec![e]).validate().unwrap_err().to_string();
        assert!(err.contains("files[0].piece_size"), "{err}");
    }

    #[test]
    fn duplicate_and_file_dir_clashes_are_rejected() {
        let m = manifest(vec![
            entry("a", b"1", MIN_PIECE_SIZE),
            entry("a", b"2", MIN_PIECE_SIZE),
        ]);
        assert!(m.validate().unwrap_err().to_string().contains("duplicate"));
        let m = manifest(vec![
            entry("a", b"1", MIN_PIECE_SIZE),
            entry("a/b", b"2", MIN_PIECE_SIZE),
        ]);
        assert!(m.validate().unwrap_err().to_string().contains("directory"));
    }

    #[test]
    fn a_file_that_is_also_a_directory_is_rejected_when_a_sibling_sorts_between_them() {
        // "a" < "a.b" < "a/b": '.' sorts before '/'.
        let m = manifest(vec![
            entry("a", b"1", MIN_PIECE_SIZE),
            entry("a.b", b"2", MIN_PIECE_SIZE),
            entry("a/b", b"3", MIN_PIECE_SIZE),
        ]);
        let err = m.validate().unwrap_err().to_string();
        assert!(
            err.contains("\"a\" is both a file and a directory"),
            "{err}"
        );
        let m = manifest(vec![
            entry("x/y", b"1", MIN_PIECE_SIZE),
            entry("x/y-2", b"2", MIN_PIECE_SIZE),
            entry("x/y.0/z", b"3", MIN_PIECE_SIZE),
        ]);
        m.validate().unwrap();
    }

    #[test]
    fn paths_with_control_characters_or_overlong_components_are_rejected() {
        let long = "x".repeat(256);
        let nested = format!("dir/{long}");
        for bad in [
            "\u{1b}[2J\u{1b}]0;owned\u{7}x\nline2.json",
            "a\nb",
            "tab\there",
            long.as_str(),
            nested.as_str(),
        ] {
            let m = manifest(vec![entry(bad, b"y", MIN_PIECE_SIZE)]);
            let err = Manifest::from_json(&m.to_json()).unwrap_err().to_string();
            assert!(err.contains("files[0].path"), "{bad:?}: {err}");
        }
        let ok = "é/".to_string() + &"x".repeat(255);
        manifest(vec![entry(&ok, b"y", MIN_PIECE_SIZE)])
            .validate()
            .unwrap();
    }

    #[test]
    fn truncated_json_and_bad_hashes_give_clear_errors() {
        let json = manifest(vec![entry("a", b"1", MIN_PIECE_SIZE)]).to_json();
        let err = Manifest::from_json(&json[..json.len() / 2]).unwrap_err();
        assert!(err.to_string().contains("manifest"), "{err}");
        let s = String::from_utf8(json)
            .unwrap()
            .replacen("\"hash\": \"", "\"hash\": \"zz", 1);
        let err = Manifest::from_json(s.as_bytes()).unwrap_err().to_string();
        assert!(err.contains("BLAKE3 hash"), "{err}");
    }

    #[test]
    fn names_and_refs_are_validated() {
        assert!(validate_name("tag", "latest").is_ok());
        assert!(validate_name("tag", "v1.2-rc_3").is_ok());
        for bad in ["", "..", ".hidden", "-x", "a/b", "a b", "ü"] {
            assert!(validate_name("tag", bad).is_err(), "{bad:?}");
        }
        assert!(validate_model_name("model", "org/name").is_ok());
        assert!(validate_model_name("model", "a/b/c").is_err());
        assert!(validate_model_name("model", "../x").is_err());
        assert!(validate_model_name("model", "org/tags").is_err());
        assert!(validate_model_name("model", "revisions/x").is_err());
        assert_eq!(
            ModelRef::parse("org/m").unwrap().selector,
            Selector::Tag("latest".into())
        );
        assert_eq!(
            ModelRef::parse("m:v2").unwrap().selector,
            Selector::Tag("v2".into())
        );
        assert_eq!(
            ModelRef::parse("m@abc").unwrap().selector,
            Selector::Revision("abc".into())
        );
        assert!(ModelRef::parse("m@../x").is_err());
        assert_eq!(parse_tag(b"rev-1\n").unwrap(), "rev-1");
        assert!(parse_tag(b"../x").is_err());
    }
}
