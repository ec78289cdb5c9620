//! One pull at a time per output directory: two pulls into one directory would share partial
//! files and resume records and trip over each other's renames, and a pull that serves the
//! files to peers (`--serve`) must not see them replaced by another revision under its feet.
//!
//! The lock is an advisory `flock` on `<out>/.tokenway/lock`, held for as long as the
//! [`DirLock`] lives. The kernel drops it when its process ends however it ends (SIGKILL,
//! OOM, a pod deleted), so no lock is ever left behind, and it holds between hosts on shared
//! volumes that support it (NFSv4, CephFS): a pid in a file did neither (two pods are both pid
//! 1, and a stale pid can belong to another process after a restart). The file says who holds
//! it (pid and host), for the message of a pull turned away; it is never removed, so no one
//! can lock a file another has just unlinked. A file system that cannot lock at all is used
//! without the lock, with a warning.

use std::fs::{File, TryLockError};
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::Path;

use crate::verified::STATE_DIR;
use crate::MirrorError;

/// The lock file, under [`STATE_DIR`].
pub const LOCK_FILE: &str = "lock";

/// The held lock of an output directory; released when dropped.
#[derive(Debug)]
pub struct DirLock {
    /// `None` where the file system cannot lock: best effort.
    _file: Option<File>,
}

impl DirLock {
    /// Takes the lock of `out`, or says who holds it.
    pub fn take(out: &Path) -> Result<Self, MirrorError> {
        let dir = out.join(STATE_DIR);
        std::fs::create_dir_all(&dir)
            .map_err(|e| MirrorError::io(format!("creating {}", dir.display()), e))?;
        let path = dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| MirrorError::io(format!("opening {}", path.display()), e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                // "pid N on host": a few dozen bytes; whatever else is there is not read.
                let mut holder = Vec::new();
                let _ = (&mut file).take(256).read_to_end(&mut holder);
                let holder = String::from_utf8_lossy(&holder);
                let holder = holder.trim();
                let who = if holder.is_empty() {
                    "another pull".to_string()
                } else {
                    format!("another pull ({holder})")
                };
                return Err(MirrorError::io(
                    format!(
                        "{who} is using {}; wait for it to finish (the lock goes with its \
                         process)",
                        out.display()
                    ),
                    std::io::Error::new(std::io::ErrorKind::WouldBlock, "output directory in use"),
                ));
            }
            Err(TryLockError::Error(e)) => {
                tracing::warn!(error = %e, path = %path.display(), "cannot lock the output directory; going on without");
                return Ok(Self { _file: None });
            }
        }
        // Who holds it, for others' messages (best effort: the lock is what counts).
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let me = format!("pid {} on {}\n", std::process::id(), host.trim());
        let _ = file
            .set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(me.as_bytes()));
        Ok(Self { _file: Some(file) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_turns_others_away_naming_its_holder_until_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = DirLock::take(dir.path()).expect("the first takes it");
        // Another open of the file is another holder, in this process as in any other.
        let err = DirLock::take(dir.path()).expect_err("held").to_string();
        assert!(
            err.contains(&format!("another pull (pid {} on ", std::process::id())),
            "{err}"
        );
        drop(first);
        let again = DirLock::take(dir.path()).expect("free again");
        drop(again);
        assert!(
            dir.path().join(STATE_DIR).join(LOCK_FILE).exists(),
            "the file stays: no one locks a file another has unlinked"
        );
    }
}
