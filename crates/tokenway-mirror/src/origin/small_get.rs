//! Whole reads of the origin's small objects (tags, manifests, outboards), bounded.
//!
//! `GetResult::bytes` collects whatever the store sends; a key that holds something far larger
//! than its kind ever is (a mistaken upload, a hostile bucket) would take memory without
//! limit. The size the store declares is checked first and the body is counted as it comes,
//! for a server that declares one size and sends more.

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt as _;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt as _};

/// What a bounded read found.
#[derive(Debug)]
pub enum Small {
    /// The whole object.
    Bytes(Bytes),
    /// The object is larger than the bound: at least this many bytes.
    TooLarge(u64),
}

/// The whole object at `path` when it holds at most `limit` bytes.
pub async fn get_small(
    store: &dyn ObjectStore,
    path: &StorePath,
    limit: u64,
) -> object_store::Result<Small> {
    let res = store.get(path).await?;
    if res.meta.size > limit {
        return Ok(Small::TooLarge(res.meta.size));
    }
    let mut body = BytesMut::with_capacity(usize::try_from(res.meta.size).unwrap_or(0));
    let mut stream = res.into_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        let got = (body.len() + chunk.len()) as u64;
        if got > limit {
            return Ok(Small::TooLarge(got));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Small::Bytes(body.freeze()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;

    #[tokio::test]
    async fn an_object_over_its_bound_is_not_read() {
        let store = InMemory::new();
        let path = StorePath::from("tags/m/latest");
        store
            .put(&path, Bytes::from_static(b"rev-1").into())
            .await
            .expect("put");
        match get_small(&store, &path, 5).await.expect("get") {
            Small::Bytes(b) => assert_eq!(&b[..], b"rev-1"),
            Small::TooLarge(n) => panic!("5 bytes read as too large ({n})"),
        }
        match get_small(&store, &path, 4).await.expect("get") {
            Small::TooLarge(n) => assert_eq!(n, 5),
            Small::Bytes(_) => panic!("read past the bound"),
        }
        assert!(matches!(
            get_small(&store, &StorePath::from("none"), 4).await,
            Err(object_store::Error::NotFound { .. })
        ));
    }
}
