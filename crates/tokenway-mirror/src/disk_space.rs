//! How much room the filesystem under a path has left, for the checks made before a pull
//! starts writing and when a mirror opens its cache.

use std::path::Path;

/// Bytes an unprivileged process may still write on the filesystem holding `path`
/// (`statvfs`'s available blocks); `None` when the filesystem does not say.
pub fn available(path: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(path).ok()?;
    s.blocks_available().checked_mul(s.fragment_size())
}

/// `n` bytes in GB with two decimals, for messages.
pub fn gb(n: u64) -> String {
    format!("{:.2} GB", n as f64 / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_real_directory_has_some_room_and_a_missing_one_says_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert!(available(dir.path()).is_some_and(|n| n > 0));
        assert_eq!(available(&dir.path().join("missing")), None);
        assert_eq!(gb(1_234_000_000), "1.23 GB");
    }
}
