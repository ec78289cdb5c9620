//! Reading piece ranges from the origin: a bounded number at once, each timed out on lack of
//! progress rather than on its total length.
//!
//! A cold mirror taking a crowd starts a flight per distinct piece (up to
//! [`super::MAX_FLIGHTS`]). Unbounded, they all share the mirror's origin link: on a link
//! slower than their sum every transfer is slow at once, and a fixed whole-piece timeout then
//! fails them all together, to be thrown away and started over. So at most
//! [`ORIGIN_TRANSFERS`] ranges are read at a time (the others wait their turn, which is not
//! counted against them), and a read fails only when no bytes came for [`READ_IDLE`]: a 64 MiB
//! piece at 1 MB/s takes a minute and is fine; a stalled connection is noticed in seconds.

use std::ops::Range;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use object_store::path::Path as StorePath;
use object_store::{GetOptions, GetRange, ObjectStore};
use tokio::sync::Semaphore;

/// Origin ranges read at once.
pub const ORIGIN_TRANSFERS: usize = 32;
/// Longest wait for the answer to a range read, and then for each next bytes of it.
pub const READ_IDLE: Duration = Duration::from_secs(30);

/// Why a range read failed.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadError {
    /// The object is not in the origin.
    NotFound,
    /// Anything else (worth another attempt), said in words.
    Failed(String),
}

/// The origin reads of one mirror.
#[derive(Debug)]
pub struct OriginReads {
    transfers: Semaphore,
    idle: Duration,
}

impl Default for OriginReads {
    fn default() -> Self {
        Self::new(ORIGIN_TRANSFERS, READ_IDLE)
    }
}

impl OriginReads {
    /// At most `transfers` at once, each failing after `idle` without bytes.
    pub fn new(transfers: usize, idle: Duration) -> Self {
        Self {
            transfers: Semaphore::new(transfers.max(1)),
            idle,
        }
    }

    /// Reads bytes `range` of `path`, waiting for a transfer slot first.
    pub async fn read(
        &self,
        origin: &dyn ObjectStore,
        path: &StorePath,
        range: Range<u64>,
    ) -> Result<Bytes, ReadError> {
        let _slot = self
            .transfers
            .acquire()
            .await
            .map_err(|_| ReadError::Failed("the mirror is shutting down".into()))?;
        let idle = self.idle;
        let stalled = || ReadError::Failed(format!("origin unavailable: no bytes for {idle:?}"));
        let options = GetOptions {
            range: Some(GetRange::Bounded(range.clone())),
            ..GetOptions::default()
        };
        let answer = match tokio::time::timeout(idle, origin.get_opts(path, options)).await {
            Err(_) => return Err(stalled()),
            Ok(Err(object_store::Error::NotFound { .. })) => return Err(ReadError::NotFound),
            Ok(Err(e)) => return Err(ReadError::Failed(format!("origin unavailable: {e}"))),
            Ok(Ok(a)) => a,
        };
        let want = range.end - range.start;
        let mut body = answer.into_stream();
        let mut got = BytesMut::with_capacity(usize::try_from(want).unwrap_or(0));
        loop {
            match tokio::time::timeout(idle, body.next()).await {
                Err(_) => return Err(stalled()),
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Err(ReadError::Failed(format!("origin unavailable: {e}")))
                }
                Ok(Some(Ok(chunk))) => {
                    if got.len() as u64 + chunk.len() as u64 > want {
                        return Err(ReadError::Failed(format!(
                            "the origin sent more than the {want} bytes asked for"
                        )));
                    }
                    got.extend_from_slice(&chunk);
                }
            }
        }
        if got.len() as u64 != want {
            return Err(ReadError::Failed(format!(
                "the origin sent {} of the {want} bytes asked for",
                got.len()
            )));
        }
        Ok(got.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use object_store::memory::InMemory;
    use object_store::{GetResult, GetResultPayload, ObjectStoreExt, PutPayload};

    /// An origin on a slow link: a range arrives in 16 KiB chunks, one every `every`; counts
    /// the reads running at once.
    #[derive(Debug)]
    struct SlowLink {
        inner: InMemory,
        every: Duration,
        running: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
    }

    impl std::fmt::Display for SlowLink {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SlowLink")
        }
    }

    struct Running(Arc<AtomicUsize>);

    impl Drop for Running {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for SlowLink {
        async fn put_opts(
            &self,
            location: &StorePath,
            payload: PutPayload,
            opts: object_store::PutOptions,
        ) -> object_store::Result<object_store::PutResult> {
            self.inner.put_opts(location, payload, opts).await
        }

        async fn put_multipart_opts(
            &self,
            location: &StorePath,
            opts: object_store::PutMultipartOptions,
        ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
            self.inner.put_multipart_opts(location, opts).await
        }

        async fn get_opts(
            &self,
            location: &StorePath,
            options: GetOptions,
        ) -> object_store::Result<GetResult> {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            let running = Running(self.running.clone());
            let whole = self.inner.get_opts(location, options).await?;
            let (meta, range, attributes, extensions) = (
                whole.meta.clone(),
                whole.range.clone(),
                whole.attributes.clone(),
                whole.extensions.clone(),
            );
            let data = whole.bytes().await?;
            let every = self.every;
            let chunks: Vec<Bytes> = data.chunks(16 << 10).map(Bytes::copy_from_slice).collect();
            let stream = futures_util::stream::iter(chunks)
                .then(move |c| async move {
                    tokio::time::sleep(every).await;
                    Ok(c)
                })
                .chain(futures_util::stream::once(async move {
                    drop(running);
                    Ok(Bytes::new())
                }))
                .boxed();
            Ok(GetResult {
                payload: GetResultPayload::Stream(stream),
                meta,
                range,
                attributes,
                extensions,
            })
        }

        fn delete_stream(
            &self,
            locations: futures_util::stream::BoxStream<'static, object_store::Result<StorePath>>,
        ) -> futures_util::stream::BoxStream<'static, object_store::Result<StorePath>> {
            self.inner.delete_stream(locations)
        }

        fn list(
            &self,
            prefix: Option<&StorePath>,
        ) -> futures_util::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>>
        {
            self.inner.list(prefix)
        }

        async fn list_with_delimiter(
            &self,
            prefix: Option<&StorePath>,
        ) -> object_store::Result<object_store::ListResult> {
            self.inner.list_with_delimiter(prefix).await
        }

        async fn copy_opts(
            &self,
            from: &StorePath,
            to: &StorePath,
            options: object_store::CopyOptions,
        ) -> object_store::Result<()> {
            self.inner.copy_opts(from, to, options).await
        }
    }

    async fn slow_link(every: Duration) -> (SlowLink, StorePath, Vec<u8>) {
        let store = SlowLink {
            inner: InMemory::new(),
            every,
            running: Arc::default(),
            most: Arc::default(),
        };
        let path = StorePath::from("blobs/x");
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
        store.put(&path, data.clone().into()).await.unwrap();
        (store, path, data)
    }

    #[tokio::test(start_paused = true)]
    async fn a_piece_that_keeps_coming_is_read_however_long_it_takes() {
        // 1 MiB in 64 chunks a second apart: over a minute, with bytes every second.
        let (store, path, data) = slow_link(Duration::from_secs(1)).await;
        let reads = OriginReads::default();
        let got = reads.read(&store, &path, 1 << 20..2 << 20).await.unwrap();
        assert_eq!(&got[..], &data[1 << 20..2 << 20]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_without_bytes_for_the_idle_time_fails() {
        let (store, path, _) = slow_link(READ_IDLE + Duration::from_secs(1)).await;
        let reads = OriginReads::default();
        let e = reads.read(&store, &path, 0..1 << 20).await.unwrap_err();
        assert!(
            matches!(&e, ReadError::Failed(m) if m.contains("no bytes for")),
            "{e:?}"
        );
        let missing = reads
            .read(&store, &StorePath::from("blobs/none"), 0..10)
            .await
            .unwrap_err();
        assert_eq!(missing, ReadError::NotFound);
    }

    #[tokio::test(start_paused = true)]
    async fn a_crowd_of_reads_goes_a_bounded_number_at_a_time() {
        let (store, path, data) = slow_link(Duration::from_millis(10)).await;
        let reads = OriginReads::default();
        let all = futures_util::future::join_all((0..100u64).map(|i| {
            let start = i * (16 << 10);
            reads.read(&store, &path, start..start + (32 << 10))
        }))
        .await;
        for (i, r) in all.into_iter().enumerate() {
            let start = i * (16 << 10);
            assert_eq!(&r.unwrap()[..], &data[start..start + (32 << 10)]);
        }
        assert_eq!(store.most.load(Ordering::SeqCst), ORIGIN_TRANSFERS);
    }
}
