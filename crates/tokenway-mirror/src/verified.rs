//! What earlier pulls verified in an output directory, so that a rerun does not read and hash
//! the whole model again before it fetches nothing (an init container that runs `tokenway
//! pull` on every pod start spent an hour re-reading 500 GB on a 125 MB/s volume).
//!
//! `<out>/.tokenway/verified.json` lists, for every file a pull put in place or found in place
//! with the right hash, its hash and what the file system says of it then: size, device,
//! inode, modification and change times (nanoseconds). A rerun trusts a file without reading
//! it only when all of these are unchanged. The change time cannot be set by anyone but the
//! kernel and moves on any write, truncation, rename or `chmod`, and a replaced file has
//! another inode, so an edited or swapped file is hashed again. `tokenway pull --verify`
//! ignores the list and hashes everything. The list is advisory: missing, unreadable or
//! damaged, it is simply empty, and it holds only the paths of the revision last pulled into
//! the directory (bounded by the manifest).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::manifest::Blake3Hash;

/// The directory under the output directory where pulls keep what outlives a pull.
pub const STATE_DIR: &str = ".tokenway";
/// The list, under [`STATE_DIR`].
pub const VERIFIED_FILE: &str = "verified.json";
/// Largest verified list read back (about 200 bytes a file: room for some 300,000 files); a
/// longer one is damaged and rebuilt.
pub const MAX_VERIFIED_BYTES: u64 = 64 << 20;

/// What the file system said of a verified file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stamp {
    /// BLAKE3 of the file, hex.
    pub hash: String,
    /// Size in bytes.
    pub size: u64,
    /// Device.
    pub dev: u64,
    /// Inode.
    pub ino: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Change time, nanoseconds since the epoch.
    pub ctime_ns: i128,
}

impl Stamp {
    /// `path`'s stamp now, for content `hash`; `None` if it is not a regular file.
    pub fn of(path: &Path, hash: &Blake3Hash) -> Option<Self> {
        let m = std::fs::metadata(path)
            .ok()
            .filter(std::fs::Metadata::is_file)?;
        Some(Self {
            hash: hash.to_hex(),
            size: m.len(),
            dev: m.dev(),
            ino: m.ino(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
        })
    }
}

#[derive(Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Saved {
    version: u32,
    files: BTreeMap<String, Stamp>,
}

const VERSION: u32 = 1;

/// The list of one output directory.
#[derive(Clone, Debug)]
pub struct Verified {
    out: PathBuf,
    files: BTreeMap<String, Stamp>,
    changed: bool,
}

impl Verified {
    /// The list of `out`, or an empty one if there is none or it cannot be read.
    pub fn load(out: &Path) -> Self {
        let files = crate::local_read::read_at_most(&Self::path_in(out), MAX_VERIFIED_BYTES)
            .and_then(|b| serde_json::from_slice::<Saved>(&b).ok())
            .filter(|s| s.version == VERSION)
            .map(|s| s.files)
            .unwrap_or_default();
        Self {
            out: out.to_path_buf(),
            files,
            changed: false,
        }
    }

    fn path_in(out: &Path) -> PathBuf {
        out.join(STATE_DIR).join(VERIFIED_FILE)
    }

    /// Whether `path` (relative to the output directory) is listed with content `hash` and
    /// is unchanged since.
    pub fn holds(&self, path: &str, hash: &Blake3Hash) -> bool {
        self.files.get(path).is_some_and(|s| {
            s.hash == hash.to_hex() && Stamp::of(&self.out.join(path), hash).as_ref() == Some(s)
        })
    }

    /// Lists `path` as verified with content `hash`, as it is now.
    pub fn record(&mut self, path: &str, stamp: Option<Stamp>) {
        match stamp {
            Some(s) => {
                if self.files.get(path) != Some(&s) {
                    self.files.insert(path.to_string(), s);
                    self.changed = true;
                }
            }
            None => self.forget(path),
        }
    }

    /// Drops `path` from the list.
    pub fn forget(&mut self, path: &str) {
        self.changed |= self.files.remove(path).is_some();
    }

    /// Keeps only paths `keep` says yes to (the revision being pulled).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        let before = self.files.len();
        self.files.retain(|p, _| keep(p));
        self.changed |= self.files.len() != before;
    }

    /// Writes the list if it changed since it was loaded (synced, then renamed into place).
    pub fn save(&self) -> std::io::Result<()> {
        if !self.changed {
            return Ok(());
        }
        let path = Self::path_in(&self.out);
        let dir = self.out.join(STATE_DIR);
        std::fs::create_dir_all(&dir)?;
        let bytes = serde_json::to_vec_pretty(&Saved {
            version: VERSION,
            files: self.files.clone(),
        })
        .map_err(std::io::Error::other)?;
        let tmp = dir.join(format!("{VERIFIED_FILE}.tmp"));
        let written = (|| {
            use std::io::Write as _;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, &path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listed_file_is_trusted_until_it_changes_and_the_list_survives_a_reload() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path();
        std::fs::create_dir_all(out.join("sub")).expect("mkdir");
        let (a, b) = (out.join("sub/a.bin"), out.join("b.bin"));
        std::fs::write(&a, b"weights a").expect("write");
        std::fs::write(&b, b"weights b").expect("write");
        let (ha, hb) = (Blake3Hash::of(b"weights a"), Blake3Hash::of(b"weights b"));
        let mut v = Verified::load(out);
        assert!(!v.holds("sub/a.bin", &ha), "nothing listed yet");
        v.record("sub/a.bin", Stamp::of(&a, &ha));
        v.record("b.bin", Stamp::of(&b, &hb));
        v.save().expect("save");

        let mut v = Verified::load(out);
        assert!(v.holds("sub/a.bin", &ha));
        assert!(v.holds("b.bin", &hb));
        assert!(
            !v.holds("b.bin", &ha),
            "another hash is not what was verified"
        );
        // Same size, same bytes even: the change time moved, so it is hashed again (after a
        // pause past the kernel's coarse timestamp tick, a few ms).
        std::thread::sleep(std::time::Duration::from_millis(50));
        std::fs::write(&b, b"weights b").expect("rewrite");
        assert!(!v.holds("b.bin", &hb), "a rewritten file is not trusted");
        // Replaced by another file (another inode).
        std::fs::write(out.join("c"), b"weights a").expect("write");
        std::fs::rename(out.join("c"), &a).expect("rename");
        assert!(!v.holds("sub/a.bin", &ha), "a replaced file is not trusted");
        v.retain(|p| p == "b.bin");
        v.save().expect("save");
        let text = std::fs::read_to_string(out.join(STATE_DIR).join(VERIFIED_FILE)).expect("read");
        assert!(!text.contains("sub/a.bin"), "{text}");
    }

    #[test]
    fn a_damaged_list_is_an_empty_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join(STATE_DIR)).expect("mkdir");
        std::fs::write(dir.path().join(STATE_DIR).join(VERIFIED_FILE), b"{not json")
            .expect("write");
        let v = Verified::load(dir.path());
        assert!(!v.holds("x", &Blake3Hash::of(b"x")));
    }
}
