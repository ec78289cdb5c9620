//! Opening the origin object store from a URL.
//!
//! The origin is an `Arc<dyn ObjectStore>` so every backend `object_store` offers can be
//! added without touching publish or pull. Two are built:
//!
//! - `file:///absolute/dir`: a local directory (created if missing).
//! - `s3://bucket[/prefix]`: Amazon S3 or any S3-compatible server, configured from the
//!   environment by `AmazonS3Builder::from_env` (credentials, region, endpoint; see
//!   `docs/weights.md`, "S3 origin").
//!
//! S3 differs from a directory in ways publish and pull must not have to know about, so the
//! S3 store is wrapped in [`S3Origin`], a layer with two jobs:
//!
//! - **Part size.** S3 refuses a multipart upload whose parts (all but the last) are under
//!   5 MiB; publish sends one piece per part and pieces may be as small as 64 KiB. The layer
//!   coalesces parts until they reach 5 MiB.
//! - **Clear first errors.** S3 answers 404 both for a missing key and for a missing bucket,
//!   so without a check a missing bucket reads as "tag not found", and a bad endpoint or key
//!   surfaces as a retry trace. The first operation through the layer fetches a key that
//!   should not exist and turns a telling answer (`NoSuchBucket`, `InvalidAccessKeyId`,
//!   no connection) into a message that names the bucket, the endpoint and the environment
//!   variables to check.
//!
//! This module never reads or logs secret values; it only checks whether variables are set.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::stream::BoxStream;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path as StorePath;
use object_store::prefix::PrefixStore;
use object_store::{
    BackoffConfig, ClientConfigKey, CopyOptions, GetOptions, GetResult, ListResult,
    MultipartUpload, ObjectMeta, ObjectStore, ObjectStoreExt as _, ObjectStoreScheme,
    PutMultipartOptions, PutOptions, PutPayload, PutPayloadMut, PutResult, RenameOptions,
    RetryConfig, UploadPart,
};

use crate::MirrorError;

/// Smallest part S3 accepts in a multipart upload, except the last (AWS S3 quotas).
const S3_MIN_PART: usize = 5 * 1024 * 1024;

/// Environment variables that name a credential source other than a static key pair; any of
/// them set means "credentials will come from there", so a missing key pair is not an error.
const OTHER_CREDENTIAL_SOURCES: &[&str] = &[
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_METADATA_ENDPOINT",
];

/// Opens an origin URL as an object store: `file:///absolute/dir` (created if missing) or
/// `s3://bucket[/prefix]` (configured from `AWS_*` environment variables).
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
        Some(("s3", _)) => open_s3(url, |key| std::env::var(key).ok()),
        Some((scheme, _)) => Err(refuse(&format!(
            "unsupported scheme {scheme}://; origins are file:///absolute/dir or \
             s3://bucket/prefix"
        ))),
        None => Err(refuse(
            "expected a URL like file:///srv/models or s3://bucket/prefix",
        )),
    }
}

/// Opens `s3://bucket[/prefix]`. `env` reads an environment variable; it is a parameter so
/// the checks can be tested without touching the process environment. The builder itself
/// still reads the real environment (`AmazonS3Builder::from_env`).
fn open_s3(
    url: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Arc<dyn ObjectStore>, MirrorError> {
    let refuse = |reason: String| MirrorError::Origin {
        url: url.into(),
        reason,
    };
    let parsed = url::Url::parse(url).map_err(|e| refuse(format!("not a valid URL: {e}")))?;
    let bucket = parsed.host_str().unwrap_or_default().to_string();
    if bucket.is_empty() {
        return Err(refuse("no bucket: expected s3://bucket/prefix".into()));
    }
    let (scheme, prefix) = ObjectStoreScheme::parse(&parsed)
        .map_err(|e| refuse(format!("not an S3 URL object_store understands: {e}")))?;
    if scheme != ObjectStoreScheme::AmazonS3 {
        return Err(refuse("not an S3 URL".into()));
    }
    let prefix = StorePath::parse(prefix.as_ref())
        .map_err(|e| refuse(format!("bad prefix {:?}: {e}", prefix.as_ref())))?;

    let set = |key: &str| env(key).is_some_and(|v| !v.is_empty());
    let skip_signature = env("AWS_SKIP_SIGNATURE").is_some_and(|v| truthy(&v));
    if !set("AWS_ACCESS_KEY_ID")
        && !skip_signature
        && !OTHER_CREDENTIAL_SOURCES.iter().any(|k| set(k))
    {
        return Err(refuse(
            "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
             (or AWS_WEB_IDENTITY_TOKEN_FILE, AWS_CONTAINER_CREDENTIALS_*, \
             AWS_METADATA_ENDPOINT for an instance profile, AWS_SKIP_SIGNATURE=true for a \
             public bucket)"
                .into(),
        ));
    }
    if set("AWS_ACCESS_KEY_ID") != set("AWS_SECRET_ACCESS_KEY") {
        return Err(refuse(
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together".into(),
        ));
    }

    let builder = AmazonS3Builder::from_env()
        .with_url(url)
        // Bounded so an unreachable endpoint fails in seconds, not after the default three
        // minutes, while a transient 5xx during a long publish is still retried.
        .with_retry(RetryConfig {
            backoff: BackoffConfig::default(),
            max_retries: 5,
            retry_timeout: Duration::from_secs(60),
        });
    let endpoint = builder.get_config_value(&AmazonS3ConfigKey::Endpoint);
    let allow_http = builder
        .get_config_value(&AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
        .is_some_and(|v| truthy(&v));
    if let Some(ep) = &endpoint {
        if ep.starts_with("http://") && !allow_http {
            return Err(refuse(format!(
                "endpoint {ep} is plain http; set AWS_ALLOW_HTTP=true to allow it"
            )));
        }
    }
    let s3 = builder
        .build()
        .map_err(|e| refuse(format!("cannot configure S3: {e}")))?;
    let inner: Arc<dyn ObjectStore> = if prefix.as_ref().is_empty() {
        Arc::new(s3)
    } else {
        Arc::new(PrefixStore::new(s3, prefix))
    };
    let region = env("AWS_REGION")
        .or_else(|| env("AWS_DEFAULT_REGION"))
        .unwrap_or_else(|| "us-east-1".into());
    Ok(Arc::new(S3Origin {
        inner,
        url: url.into(),
        bucket,
        endpoint: endpoint.unwrap_or_else(|| format!("AWS S3 in region {region}")),
        checked: tokio::sync::OnceCell::new(),
    }))
}

fn truthy(v: &str) -> bool {
    matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
}

/// The S3 store behind the two adaptations described in the module docs.
#[derive(Debug)]
pub struct S3Origin {
    inner: Arc<dyn ObjectStore>,
    url: String,
    bucket: String,
    endpoint: String,
    /// Set once the bucket answered the probe; a failed check is retried on the next call.
    checked: tokio::sync::OnceCell<()>,
}

impl fmt::Display for S3Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "S3Origin({})", self.url)
    }
}

/// Why the first request to an S3 origin failed, in words a user can act on. It carries a
/// one-line summary of the server's answer rather than the whole error chain (which repeats
/// the XML body at every level).
#[derive(Debug, thiserror::Error)]
#[error("origin {url}: {reason} ({detail})")]
struct OriginCheckError {
    url: String,
    reason: String,
    detail: String,
}

/// S3 error codes that mean "these credentials are not valid", as opposed to "valid but not
/// allowed" (`AccessDenied`), which a narrowly scoped key may well get for the probe.
const BAD_CREDENTIAL_CODES: &[&str] = &[
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
];

/// Key fetched by the probe; it is not expected to exist.
const PROBE_KEY: &str = "tokenway-origin-check";

impl S3Origin {
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
        let (bucket, endpoint) = (&self.bucket, &self.endpoint);
        let text = e.to_string();
        let code = xml_field(&text, "Code");
        let detail = match (&code, xml_field(&text, "Message")) {
            (Some(c), Some(m)) => format!("{c}: {m}"),
            (Some(c), None) => c.clone(),
            _ => innermost(e),
        };
        let reason = match (code.as_deref(), e) {
            (Some("NoSuchBucket"), _) => format!("bucket {bucket:?} does not exist at {endpoint}"),
            (Some(c), _) if BAD_CREDENTIAL_CODES.contains(&c) => format!(
                "{endpoint} rejected the credentials for bucket {bucket:?}; check \
                 AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) and \
                 AWS_REGION"
            ),
            (None, object_store::Error::Unauthenticated { .. }) => format!(
                "{endpoint} rejected the credentials for bucket {bucket:?}; check \
                 AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            ),
            // No HTTP answer at all: connection refused, DNS, TLS, timeout.
            (None, object_store::Error::Generic { .. }) if !text.contains("status code") => {
                format!(
                    "cannot reach {endpoint} for bucket {bucket:?} (is the endpoint \
                     reachable? AWS_ENDPOINT_URL sets it for S3-compatible servers)"
                )
            }
            _ => return None,
        };
        Some(object_store::Error::Generic {
            store: "S3",
            source: Box::new(OriginCheckError {
                url: self.url.clone(),
                reason,
                detail,
            }),
        })
    }
}

/// The text of `<name>...</name>` in an S3 XML error body quoted inside `text`.
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
impl ObjectStore for S3Origin {
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
        Ok(Box::new(CoalescingUpload {
            inner,
            pending: PutPayloadMut::new(),
            min_part: S3_MIN_PART,
        }))
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
mod tests {
    use super::*;
    use object_store::memory::InMemory;

    fn env_of(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |key| {
            vars.iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn relative_and_unknown_origins_are_refused() {
        assert!(open_origin("file://rel/dir")
            .unwrap_err()
            .to_string()
            .contains("absolute"));
        let gs = open_origin("gs://bucket").unwrap_err().to_string();
        assert!(gs.contains("unsupported scheme gs://"), "{gs}");
        assert!(gs.contains("s3://bucket/prefix"), "{gs}");
        assert!(open_origin("/tmp/x").is_err());
    }

    #[test]
    fn s3_without_credentials_names_the_variables() {
        let err = open_s3("s3://bucket/prefix", env_of(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no AWS credentials"), "{err}");
        assert!(err.contains("AWS_ACCESS_KEY_ID"), "{err}");
        let err = open_s3(
            "s3://bucket/prefix",
            env_of(&[("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("must be set together"), "{err}");
    }

    #[test]
    fn s3_needs_a_bucket() {
        let err = open_s3("s3:///prefix", env_of(&[("AWS_SKIP_SIGNATURE", "true")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("bucket"), "{err}");
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
