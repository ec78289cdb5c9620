//! Opening the origin object store from a URL.
//!
//! The origin is an `Arc<dyn ObjectStore>` so every backend `object_store` offers can be
//! added without touching publish or pull. Three are built:
//!
//! - `file:///absolute/dir`: a local directory (created if missing).
//! - `s3://bucket[/prefix]` ([`s3`]): Amazon S3 or any S3-compatible server, configured from
//!   `AWS_*` variables.
//! - `az://container[/prefix]` ([`azure`]): Azure Blob Storage (or Azurite), configured from
//!   `AZURE_*` variables.
//!
//! A cloud store differs from a directory in ways publish and pull must not have to know
//! about, so it is wrapped in [`CheckedOrigin`], a layer with two jobs:
//!
//! - **Part size.** S3 refuses a multipart upload whose parts (all but the last) are under
//!   5 MiB; publish sends one piece per part and pieces may be as small as 64 KiB. The layer
//!   coalesces parts until they reach the provider's minimum (Azure has none).
//! - **Clear first errors.** Both answer 404 for a missing key and a missing bucket or
//!   container alike, so without a check a missing bucket reads as "tag not found", and a bad
//!   endpoint or key surfaces as a retry trace. The first operation through the layer fetches
//!   a key that should not exist and turns a telling answer (`NoSuchBucket`,
//!   `ContainerNotFound`, rejected credentials, no connection) into a message that names the
//!   bucket, the endpoint and the environment variables to check.
//!
//! This module never reads or logs secret values; it only checks whether variables are set.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::stream::BoxStream;
use object_store::local::LocalFileSystem;
use object_store::path::Path as StorePath;
use object_store::{
    BackoffConfig, ClientConfigKey, CopyOptions, GetOptions, GetResult, ListResult,
    MultipartUpload, ObjectMeta, ObjectStore, ObjectStoreExt as _, ObjectStoreScheme,
    PutMultipartOptions, PutOptions, PutPayload, PutPayloadMut, PutResult, RenameOptions,
    RetryConfig, UploadPart,
};

use crate::MirrorError;

pub mod azure;
pub mod s3;
pub mod small_get;

/// Opens an origin URL as an object store: `file:///absolute/dir` (created if missing),
/// `s3://bucket[/prefix]` (configured from `AWS_*` environment variables) or
/// `az://container[/prefix]` (from `AZURE_*` variables).
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
        Some(("s3", _)) => s3::open(url, |key| std::env::var(key).ok()),
        Some(("az" | "azure", _)) => azure::open(url, |key| std::env::var(key).ok()),
        Some((scheme, _)) => Err(refuse(&format!(
            "unsupported scheme {scheme}://; origins are file:///absolute/dir, \
             s3://bucket/prefix or az://container/prefix"
        ))),
        None => Err(refuse(
            "expected a URL like file:///srv/models, s3://bucket/prefix or \
             az://container/prefix",
        )),
    }
}

/// A cloud URL split into its bucket (or container) and prefix; errors name `noun` and the
/// expected form, e.g. ("bucket", "s3://bucket/prefix").
fn parse_cloud_url(
    url: &str,
    scheme: ObjectStoreScheme,
    noun: &str,
    form: &str,
) -> Result<(String, StorePath), MirrorError> {
    let refuse = |reason: String| MirrorError::Origin {
        url: url.into(),
        reason,
    };
    let parsed = url::Url::parse(url).map_err(|e| refuse(format!("not a valid URL: {e}")))?;
    let name = parsed.host_str().unwrap_or_default().to_string();
    if name.is_empty() {
        return Err(refuse(format!("no {noun}: expected {form}")));
    }
    let (found, prefix) = ObjectStoreScheme::parse(&parsed)
        .map_err(|e| refuse(format!("not a URL object_store understands: {e}")))?;
    if found != scheme {
        return Err(refuse(format!("expected {form}")));
    }
    let prefix = StorePath::parse(prefix.as_ref())
        .map_err(|e| refuse(format!("bad prefix {:?}: {e}", prefix.as_ref())))?;
    Ok((name, prefix))
}

/// Retries of a cloud origin, bounded so an unreachable endpoint fails in seconds, not after
/// the default three minutes, while a transient 5xx during a long publish is still retried.
fn bounded_retry() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig::default(),
        max_retries: 5,
        retry_timeout: std::time::Duration::from_secs(60),
    }
}

/// The request timeouts of a cloud origin, where the environment does not set them: a request
/// may take 10 minutes in all (object_store's default of 30 s for the whole request, body
/// included, failed every piece or part over 30 s, so every 64 MiB transfer on a link below
/// about 2 MB/s), and fails after 30 s without a byte.
fn transfer_timeouts(
    configured: impl Fn(ClientConfigKey) -> Option<String>,
) -> Vec<(ClientConfigKey, &'static str)> {
    [
        (ClientConfigKey::Timeout, "10m"),
        (ClientConfigKey::ReadTimeout, "30s"),
    ]
    .into_iter()
    .filter(|(k, _)| configured(*k).is_none())
    .collect()
}

/// Refuses a plain `http://` endpoint unless `allowed`; the message names the variable
/// (`var`) that allows it.
fn refuse_plain_http(endpoint: Option<&str>, allowed: bool, var: &str) -> Result<(), String> {
    match endpoint {
        Some(ep) if ep.starts_with("http://") && !allowed => Err(format!(
            "endpoint {ep} is plain http; set {var}=true to allow it"
        )),
        _ => Ok(()),
    }
}

/// `store` seen from under `prefix` (as is for an empty one).
fn under_prefix<S: ObjectStore>(store: S, prefix: StorePath) -> Arc<dyn ObjectStore> {
    if prefix.as_ref().is_empty() {
        Arc::new(store)
    } else {
        Arc::new(object_store::prefix::PrefixStore::new(store, prefix))
    }
}

/// Whether a configuration value means yes.
fn truthy(v: &str) -> bool {
    matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
}

/// The cloud provider behind a [`CheckedOrigin`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    /// Amazon S3 or an S3-compatible server.
    S3,
    /// Azure Blob Storage.
    Azure,
}

impl Provider {
    fn name(self) -> &'static str {
        match self {
            Self::S3 => "S3",
            Self::Azure => "MicrosoftAzure",
        }
    }

    /// Smallest multipart part but the last; 0 for none.
    fn min_part(self) -> usize {
        match self {
            Self::S3 => s3::MIN_PART,
            Self::Azure => 0,
        }
    }
}

/// A cloud store behind the two adaptations described in the module docs.
#[derive(Debug)]
pub struct CheckedOrigin {
    inner: Arc<dyn ObjectStore>,
    provider: Provider,
    url: String,
    /// The bucket or container.
    container: String,
    /// Where requests go, for messages.
    endpoint: String,
    /// Set once the bucket answered the probe; a failed check is retried on the next call.
    checked: tokio::sync::OnceCell<()>,
}

impl CheckedOrigin {
    fn new(
        provider: Provider,
        inner: Arc<dyn ObjectStore>,
        url: &str,
        container: String,
        endpoint: String,
    ) -> Self {
        Self {
            inner,
            provider,
            url: url.into(),
            container,
            endpoint,
            checked: tokio::sync::OnceCell::new(),
        }
    }
}

impl fmt::Display for CheckedOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CheckedOrigin({})", self.url)
    }
}

/// Why the first request to a cloud origin failed, in words a user can act on. It carries a
/// one-line summary of the server's answer rather than the whole error chain (which repeats
/// the XML body at every level).
#[derive(Debug, thiserror::Error)]
#[error("origin {url}: {reason} ({detail})")]
struct OriginCheckError {
    url: String,
    reason: String,
    detail: String,
}

/// Key fetched by the probe; it is not expected to exist.
const PROBE_KEY: &str = "tokenway-origin-check";

impl CheckedOrigin {
    /// Once, before the first operation: fetches a key that should not exist, so a missing
    /// bucket, rejected credentials or an unreachable endpoint fail with a message naming
    /// the cause. A GET (not a listing) so a key allowed only `s3:GetObject` passes.
    async fn check(&self) -> object_store::Result<()> {
        self.checked
            .get_or_try_init(|| async {
                match self.inner.get(&StorePath::from(PROBE_KEY)).await {
                    Ok(_) => Ok(()),
                    Err(e) => match self.explain(&e) {
                        Some(err) => Err(err),
                        None => Ok(()),
                    },
                }
            })
            .await
            .map(|_| ())
    }

    /// The error to report for a failed probe, or `None` when the answer says the origin is
    /// usable (the key is missing, or access is denied to this key only).
    fn explain(&self, e: &object_store::Error) -> Option<object_store::Error> {
        let (reason, detail) = match self.provider {
            Provider::S3 => s3::explain(&self.container, &self.endpoint, e)?,
            Provider::Azure => azure::explain(&self.container, &self.endpoint, e)?,
        };
        Some(object_store::Error::Generic {
            store: self.provider.name(),
            source: Box::new(OriginCheckError {
                url: self.url.clone(),
                reason,
                detail,
            }),
        })
    }
}

/// The text of `<name>...</name>` in an XML error body (S3, Azure) quoted inside `text`.
fn xml_field(text: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let start = text.find(&open)? + open.len();
    let len = text[start..].find(&format!("</{name}>"))?;
    Some(text[start..start + len].to_string())
}

/// The message of the deepest error in the chain (e.g. "Connection refused").
fn innermost(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl ObjectStore for CheckedOrigin {
    async fn put_opts(
        &self,
        location: &StorePath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.check().await?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &StorePath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.check().await?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        match self.provider.min_part() {
            0 => Ok(inner),
            min_part => Ok(Box::new(CoalescingUpload {
                inner,
                pending: PutPayloadMut::new(),
                min_part,
            })),
        }
    }

    async fn get_opts(
        &self,
        location: &StorePath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.check().await?;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &StorePath,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        self.check().await?;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<StorePath>>,
    ) -> BoxStream<'static, object_store::Result<StorePath>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&StorePath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&StorePath>,
        offset: &StorePath,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&StorePath>,
    ) -> object_store::Result<ListResult> {
        self.check().await?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &StorePath,
        to: &StorePath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.check().await?;
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &StorePath,
        to: &StorePath,
        options: RenameOptions,
    ) -> object_store::Result<()> {
        self.check().await?;
        self.inner.rename_opts(from, to, options).await
    }
}

/// A multipart upload that holds parts back until they reach `min_part` bytes, so callers
/// may send parts of any size to a store that has a minimum (S3: 5 MiB but the last).
#[derive(Debug)]
struct CoalescingUpload {
    inner: Box<dyn MultipartUpload>,
    pending: PutPayloadMut,
    min_part: usize,
}

impl CoalescingUpload {
    fn take_pending(&mut self) -> PutPayload {
        std::mem::take(&mut self.pending).freeze()
    }
}

#[async_trait]
impl MultipartUpload for CoalescingUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        for chunk in data {
            self.pending.push(chunk);
        }
        if self.pending.content_length() < self.min_part {
            return Box::pin(futures_util::future::ready(Ok(())));
        }
        let part = self.take_pending();
        self.inner.put_part(part)
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        if self.pending.content_length() > 0 {
            let part = self.take_pending();
            self.inner.put_part(part).await?;
        }
        self.inner.complete().await
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        self.pending = PutPayloadMut::new();
        self.inner.abort().await
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn cloud_origins_get_transfer_timeouts_unless_the_environment_sets_them() {
        let none = transfer_timeouts(|_| None);
        assert_eq!(
            none,
            vec![
                (ClientConfigKey::Timeout, "10m"),
                (ClientConfigKey::ReadTimeout, "30s")
            ]
        );
        let own = transfer_timeouts(|k| (k == ClientConfigKey::Timeout).then(|| "2m".to_string()));
        assert_eq!(own, vec![(ClientConfigKey::ReadTimeout, "30s")]);
        // The values are durations object_store accepts.
        use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
        let built = none
            .into_iter()
            .fold(AmazonS3Builder::new().with_bucket_name("b"), |b, (k, v)| {
                b.with_config(AmazonS3ConfigKey::Client(k), v)
            })
            .with_region("us-east-1")
            .build();
        assert!(built.is_ok(), "{:?}", built.err());
    }

    /// An environment of fixed variables, for the providers' configuration checks.
    pub(crate) fn env_of(
        vars: &'static [(&'static str, &'static str)],
    ) -> impl Fn(&str) -> Option<String> {
        move |key| {
            vars.iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.to_string())
        }
    }
    use object_store::memory::InMemory;

    #[test]
    fn relative_and_unknown_origins_are_refused() {
        assert!(open_origin("file://rel/dir")
            .unwrap_err()
            .to_string()
            .contains("absolute"));
        let gs = open_origin("gs://bucket").unwrap_err().to_string();
        assert!(gs.contains("unsupported scheme gs://"), "{gs}");
        assert!(gs.contains("s3://bucket/prefix"), "{gs}");
        assert!(gs.contains("az://container/prefix"), "{gs}");
        assert!(open_origin("/tmp/x").is_err());
    }

    #[tokio::test]
    async fn small_parts_are_coalesced_up_to_the_minimum() {
        let store = InMemory::new();
        let path = StorePath::from("blob");
        let mut upload = CoalescingUpload {
            inner: store.put_multipart(&path).await.unwrap(),
            pending: PutPayloadMut::new(),
            min_part: 10,
        };
        let mut want = Vec::new();
        for i in 0..7u8 {
            let part = vec![i; 4];
            want.extend_from_slice(&part);
            upload.put_part(PutPayload::from(part)).await.unwrap();
        }
        upload.complete().await.unwrap();
        let got = store.get(&path).await.unwrap().bytes().await.unwrap();
        assert_eq!(got.as_ref(), want.as_slice());
    }
}
