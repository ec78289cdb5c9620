//! `s3://bucket[/prefix]`: Amazon S3 or any S3-compatible server, configured from the
//! environment by `AmazonS3Builder::from_env` (credentials, region, endpoint; see
//! `docs/weights.md`, "S3 origin"). Multipart parts are coalesced to S3's 5 MiB minimum and the
//! first request's failure is explained by [`CheckedOrigin`].

use std::sync::Arc;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::{ClientConfigKey, ObjectStore, ObjectStoreScheme};

use super::{
    bounded_retry, innermost, parse_cloud_url, refuse_plain_http, transfer_timeouts, truthy,
    under_prefix, xml_field, CheckedOrigin, Provider,
};
use crate::MirrorError;

/// Smallest part S3 accepts in a multipart upload, except the last (AWS S3 quotas).
pub(super) const MIN_PART: usize = 5 * 1024 * 1024;

/// Environment variables that name a credential source other than a static key pair; any of
/// them set means "credentials will come from there", so a missing key pair is not an error.
const OTHER_CREDENTIAL_SOURCES: &[&str] = &[
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_METADATA_ENDPOINT",
];

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

/// Opens `s3://bucket[/prefix]`. `env` reads an environment variable; it is a parameter so
/// the checks can be tested without touching the process environment. The builder itself
/// still reads the real environment (`AmazonS3Builder::from_env`).
pub(super) fn open(
    url: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Arc<dyn ObjectStore>, MirrorError> {
    let refuse = |reason: String| MirrorError::Origin {
        url: url.into(),
        reason,
    };
    let (bucket, prefix) = parse_cloud_url(
        url,
        ObjectStoreScheme::AmazonS3,
        "bucket",
        "s3://bucket/prefix",
    )?;

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
        .with_retry(bounded_retry());
    let builder = transfer_timeouts(|k| builder.get_config_value(&AmazonS3ConfigKey::Client(k)))
        .into_iter()
        .fold(builder, |b, (k, v)| {
            b.with_config(AmazonS3ConfigKey::Client(k), v)
        });
    let endpoint = builder.get_config_value(&AmazonS3ConfigKey::Endpoint);
    let allow_http = builder
        .get_config_value(&AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
        .is_some_and(|v| truthy(&v));
    refuse_plain_http(endpoint.as_deref(), allow_http, "AWS_ALLOW_HTTP").map_err(refuse)?;
    let s3 = builder
        .build()
        .map_err(|e| refuse(format!("cannot configure S3: {e}")))?;
    let inner = under_prefix(s3, prefix);
    let region = env("AWS_REGION")
        .or_else(|| env("AWS_DEFAULT_REGION"))
        .unwrap_or_else(|| "us-east-1".into());
    Ok(Arc::new(CheckedOrigin::new(
        Provider::S3,
        inner,
        url,
        bucket,
        endpoint.unwrap_or_else(|| format!("AWS S3 in region {region}")),
    )))
}

/// Why the probe of an S3 origin failed (reason, server detail), or `None` when the answer
/// says the origin is usable (the key is missing, or access is denied to this key only).
pub(super) fn explain(
    bucket: &str,
    endpoint: &str,
    e: &object_store::Error,
) -> Option<(String, String)> {
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
    Some((reason, detail))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::origin::tests::env_of;

    #[test]
    fn s3_without_credentials_names_the_variables() {
        let err = open("s3://bucket/prefix", env_of(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no AWS credentials"), "{err}");
        assert!(err.contains("AWS_ACCESS_KEY_ID"), "{err}");
        let err = open(
            "s3://bucket/prefix",
            env_of(&[("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("must be set together"), "{err}");
    }

    #[test]
    fn s3_needs_a_bucket() {
        let err = open("s3:///prefix", env_of(&[("AWS_SKIP_SIGNATURE", "true")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("bucket"), "{err}");
    }
}
