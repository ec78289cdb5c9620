//! The bound on the outboards a mirror keeps on disk.
//!
//! Manifests and tags are a few kilobytes each, but every blob's outboard (its piece tree,
//! about 0.1 % of the blob at the default group size) is kept beside them, outside the piece
//! cache's `--max-size`: a mirror that sees a terabyte of new checkpoints a week added a
//! gigabyte a week to its disk, for ever. Outboards can be fetched again from the origin, so
//! past [`MAX_OUTBOARD_DISK_BYTES`] the oldest written go. The total is counted once (a scan
//! at the first write) and kept up to date after; a scan again runs only to evict.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Bytes of outboards kept on disk: those of some 4 TB of distinct blobs.
pub const MAX_OUTBOARD_DISK_BYTES: u64 = 4 << 30;

/// The outboards directory of a mirror's manifest store, and its byte count.
pub struct OutboardDisk {
    dir: PathBuf,
    cap: u64,
    /// Bytes of the files in `dir`, once counted.
    used: tokio::sync::Mutex<Option<u64>>,
}

impl OutboardDisk {
    /// The outboards under `dir`, kept to `cap` bytes.
    pub fn new(dir: PathBuf, cap: u64) -> Self {
        Self {
            dir,
            cap,
            used: tokio::sync::Mutex::new(None),
        }
    }

    /// An outboard of `len` bytes was written: evicts the oldest when over the cap (down to
    /// 90 % of it, so that the next writes do not each scan again). Best effort: a file that
    /// cannot be removed is left and counted.
    pub async fn written(&self, len: u64) {
        let mut used = self.used.lock().await;
        let total = match *used {
            Some(n) => n + len,
            // The scan sees the new file too.
            None => scan(&self.dir).await.iter().map(|f| f.1).sum(),
        };
        *used = Some(total);
        if total <= self.cap {
            return;
        }
        let mut files = scan(&self.dir).await;
        files.sort_by_key(|f| f.0);
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        let target = self.cap / 10 * 9;
        let mut evicted = 0u64;
        for (_, size, path) in files {
            if total <= target {
                break;
            }
            if tokio::fs::remove_file(&path).await.is_ok() {
                total -= size;
                evicted += 1;
            }
        }
        tracing::info!(
            evicted,
            bytes = total,
            cap = self.cap,
            "outboards on disk over their bound: the oldest removed (the origin has them)"
        );
        *used = Some(total);
    }
}

/// (modified, bytes, path) of every file in `dir`; temporary files of writes cut short (names
/// with `~`) are removed on the way.
async fn scan(dir: &Path) -> Vec<(SystemTime, u64, PathBuf)> {
    let mut out = Vec::new();
    let Ok(mut entries) = tokio::fs::read_dir(dir).await else {
        return out;
    };
    while let Ok(Some(e)) = entries.next_entry().await {
        let Ok(meta) = e.metadata().await else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        if e.file_name().to_string_lossy().contains('~') {
            let _ = tokio::fs::remove_file(e.path()).await;
            continue;
        }
        let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        out.push((modified, meta.len(), e.path()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn past_the_cap_the_oldest_outboards_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disk = OutboardDisk::new(dir.path().to_path_buf(), 10_000);
        let write = |name: &str, age_secs: u64| {
            let path = dir.path().join(name);
            std::fs::write(&path, vec![1u8; 3000]).expect("write");
            let when = SystemTime::now() - std::time::Duration::from_secs(age_secs);
            std::fs::File::options()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_modified(when))
                .expect("set mtime");
        };
        write("a", 40);
        write("b", 30);
        write("c", 20);
        std::fs::write(dir.path().join("d~0123"), b"cut short").expect("write");
        disk.written(3000).await;
        // 9,000 bytes: under the cap; the temporary file went.
        assert!(!dir.path().join("d~0123").exists());
        write("d", 10);
        disk.written(3000).await;
        // 12,000 > 10,000: down to 9,000 at most, oldest first.
        assert!(!dir.path().join("a").exists());
        for kept in ["b", "c", "d"] {
            assert!(dir.path().join(kept).exists(), "{kept}");
        }
        write("e", 0);
        disk.written(3000).await;
        assert!(!dir.path().join("b").exists());
        assert!(dir.path().join("e").exists());
    }
}
