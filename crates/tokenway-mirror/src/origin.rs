//! Opening the origin object store from a URL.
//!
//! The origin is an `Arc<dyn ObjectStore>` so every backend `object_store` offers can be
//! added without touching publish or pull. This round builds `file://` only; `s3://` needs
//! the crate's `aws` feature (see `docs/weights.md`).

use std::sync::Arc;

use object_store::local::LocalFileSystem;
use object_store::ObjectStore;

use crate::MirrorError;

/// Opens `file:///absolute/dir` (created if missing) as an object store.
pub fn open_origin(url: &str) -> Result<Arc<dyn ObjectStore>, MirrorError> {
    let refuse = |reason: &str| MirrorError::Origin {
        url: url.into(),
        reason: reason.into(),
    };
    if let Some(path) = url.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(refuse(
                "a file:// URL needs an absolute path (file:///srv/models)",
            ));
        }
        std::fs::create_dir_all(path)
            .map_err(|e| MirrorError::io(format!("creating origin directory {path}"), e))?;
        let store = LocalFileSystem::new_with_prefix(path)
            .map_err(|e| MirrorError::store(format!("opening {path}"), e))?;
        return Ok(Arc::new(store));
    }
    match url.split_once("://") {
        Some(("s3" | "gs" | "az" | "azure" | "http" | "https", _)) => Err(refuse(
            "this build supports file:// origins only; s3/gcs/azure are not built in yet",
        )),
        _ => Err(refuse("expected a URL like file:///srv/models")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_and_unknown_origins_are_refused() {
        assert!(open_origin("file://rel/dir")
            .unwrap_err()
            .to_string()
            .contains("absolute"));
        assert!(open_origin("s3://bucket")
            .unwrap_err()
            .to_string()
            .contains("file://"));
        assert!(open_origin("/tmp/x").is_err());
    }
}
