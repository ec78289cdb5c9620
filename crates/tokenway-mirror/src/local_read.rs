//! Reads of the small state files a pull or a mirror keeps beside its data (the verified
//! list, piece progress, the lock holder, cached manifests, tags and outboards), bounded.
//!
//! They are written by tokenway, but a damaged disk, a hand edit or another program can leave
//! anything there; reading such a file whole would take memory without limit. A file longer
//! than its bound reads as absent, which every caller already handles (a list to rebuild, a
//! copy to fetch again).

use std::io::Read;
use std::path::Path;

use tokio::io::AsyncReadExt;

/// The contents of `path` when it exists and holds at most `limit` bytes.
pub fn read_at_most(path: &Path, limit: u64) -> Option<Vec<u8>> {
    let file = std::fs::File::open(path).ok()?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .ok()?;
    within(path, bytes, limit)
}

/// [`read_at_most`] without blocking the runtime.
pub async fn read_at_most_async(path: &Path, limit: u64) -> Option<Vec<u8>> {
    let file = tokio::fs::File::open(path).await.ok()?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .await
        .ok()?;
    within(path, bytes, limit)
}

fn within(path: &Path, bytes: Vec<u8>, limit: u64) -> Option<Vec<u8>> {
    if bytes.len() as u64 > limit {
        tracing::warn!(path = %path.display(), limit, "a state file is larger than it can be; ignoring it");
        return None;
    }
    Some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_file_over_its_bound_reads_as_absent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state");
        std::fs::write(&path, b"12345").expect("write");
        assert_eq!(read_at_most(&path, 5).as_deref(), Some(&b"12345"[..]));
        assert_eq!(read_at_most(&path, 4), None);
        assert_eq!(
            read_at_most_async(&path, 5).await.as_deref(),
            Some(&b"12345"[..])
        );
        assert_eq!(read_at_most_async(&path, 4).await, None);
        assert_eq!(read_at_most(&dir.path().join("none"), 5), None);
    }
}
