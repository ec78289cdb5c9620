//! `az://container[/prefix]` (or `azure://`): Azure Blob Storage, or the Azurite emulator,
//! configured from the environment by `MicrosoftAzureBuilder::from_env` (account, credentials,
//! endpoint; see `docs/weights.md`, "Azure origin"). Azure takes parts of any size, so only the
//! first request's failure needs explaining ([`CheckedOrigin`]).

use std::sync::Arc;

use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::{ClientConfigKey, ObjectStore, ObjectStoreScheme};

use super::{
    bounded_retry, innermost, parse_cloud_url, refuse_plain_http, transfer_timeouts, truthy,
    under_prefix, xml_field, CheckedOrigin, Provider,
};
use crate::MirrorError;

/// Variables that each name a credential source (alone or with the account name and, for a
/// service principal or workload identity, `AZURE_CLIENT_ID` and `AZURE_TENANT_ID`). With none
/// of them set `object_store` would ask the instance metadata service; tokenway refuses
/// instead, so a forgotten key is an error at start, not a timeout.
const CREDENTIAL_SOURCES: &[&str] = &[
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_MASTER_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_TOKEN",
    "AZURE_STORAGE_CLIENT_SECRET",
    "AZURE_CLIENT_SECRET",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_MSI_ENDPOINT",
    "AZURE_MSI_RESOURCE_ID",
    "AZURE_OBJECT_ID",
];

/// Flags that stand in for credentials when true.
const CREDENTIAL_FLAGS: &[&str] = &[
    "AZURE_STORAGE_USE_EMULATOR",
    "AZURE_USE_AZURE_CLI",
    "AZURE_SKIP_SIGNATURE",
];

/// Azure error codes that mean "these credentials are not valid" or "this client may not use
/// the account at all" (`AuthorizationFailure`: a bad signature on Azurite, a firewall rule or a
/// SAS without the permission on Azure), as opposed to "valid but not allowed to read this"
/// (`AuthorizationPermissionMismatch`), which a narrowly scoped identity may get for the probe.
const BAD_CREDENTIAL_CODES: &[&str] = &[
    "AuthenticationFailed",
    "AuthorizationFailure",
    "InvalidAuthenticationInfo",
    "NoAuthenticationInformation",
    "AccountIsDisabled",
];

/// Where Azurite listens unless `AZURITE_BLOB_STORAGE_URL` says otherwise (as in
/// `object_store`).
const AZURITE_DEFAULT: &str = "http://127.0.0.1:10000";

/// Opens `az://container[/prefix]`. `env` reads an environment variable, a parameter so the
/// checks can be tested without touching the process environment; the builder itself still
/// reads the real one (`MicrosoftAzureBuilder::from_env`).
pub(super) fn open(
    url: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Arc<dyn ObjectStore>, MirrorError> {
    let refuse = |reason: String| MirrorError::Origin {
        url: url.into(),
        reason,
    };
    let (container, prefix) = parse_cloud_url(
        url,
        ObjectStoreScheme::MicrosoftAzure,
        "container",
        "az://container/prefix",
    )?;

    let set = |key: &str| env(key).is_some_and(|v| !v.is_empty());
    let flag = |key: &str| env(key).is_some_and(|v| truthy(&v));
    let emulator = flag("AZURE_STORAGE_USE_EMULATOR");
    if !CREDENTIAL_SOURCES.iter().any(|k| set(k)) && !CREDENTIAL_FLAGS.iter().any(|k| flag(k)) {
        return Err(refuse(
            "no Azure credentials: set AZURE_STORAGE_ACCOUNT_NAME and \
             AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_KEY, AZURE_STORAGE_TOKEN, \
             AZURE_CLIENT_ID + AZURE_CLIENT_SECRET + AZURE_TENANT_ID, AZURE_FEDERATED_TOKEN_FILE, \
             AZURE_USE_AZURE_CLI=true, AZURE_MSI_ENDPOINT for a managed identity, \
             AZURE_SKIP_SIGNATURE=true for a public container, AZURE_STORAGE_USE_EMULATOR=true \
             for Azurite)"
                .into(),
        ));
    }
    let account = env("AZURE_STORAGE_ACCOUNT_NAME").filter(|a| !a.is_empty());
    if account.is_none() && !emulator {
        return Err(refuse(
            "no storage account: set AZURE_STORAGE_ACCOUNT_NAME".into(),
        ));
    }

    let builder = MicrosoftAzureBuilder::from_env()
        .with_url(url)
        .with_retry(bounded_retry());
    let builder = transfer_timeouts(|k| builder.get_config_value(&AzureConfigKey::Client(k)))
        .into_iter()
        .fold(builder, |b, (k, v)| {
            b.with_config(AzureConfigKey::Client(k), v)
        });
    let endpoint = builder.get_config_value(&AzureConfigKey::Endpoint);
    let allow_http = builder
        .get_config_value(&AzureConfigKey::Client(ClientConfigKey::AllowHttp))
        .is_some_and(|v| truthy(&v));
    // Azurite is plain http on loopback; object_store allows it in emulator mode.
    refuse_plain_http(
        endpoint.as_deref(),
        allow_http || emulator,
        "AZURE_ALLOW_HTTP",
    )
    .map_err(refuse)?;
    let azure = builder
        .build()
        .map_err(|e| refuse(format!("cannot configure Azure: {e}")))?;
    let inner = under_prefix(azure, prefix);
    let endpoint = match (emulator, endpoint, account) {
        (true, _, _) => {
            env("AZURITE_BLOB_STORAGE_URL").unwrap_or_else(|| AZURITE_DEFAULT.to_string())
        }
        (false, Some(ep), _) => ep,
        (false, None, Some(a)) => format!("https://{a}.blob.core.windows.net"),
        (false, None, None) => "Azure Blob Storage".into(),
    };
    Ok(Arc::new(CheckedOrigin::new(
        Provider::Azure,
        inner,
        url,
        container,
        endpoint,
    )))
}

/// Why the probe of an Azure origin failed (reason, server detail), or `None` when the
/// answer says the origin is usable (the blob is missing, or this identity may not read it).
pub(super) fn explain(
    container: &str,
    endpoint: &str,
    e: &object_store::Error,
) -> Option<(String, String)> {
    let text = e.to_string();
    let code = xml_field(&text, "Code");
    let detail = match (&code, xml_field(&text, "Message")) {
        (Some(c), Some(m)) => format!("{c}: {}", m.lines().next().unwrap_or_default()),
        (Some(c), None) => c.clone(),
        _ => innermost(e),
    };
    let rejected = || {
        format!(
            "{endpoint} rejected the credentials for container {container:?}; check \
             AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or the SAS, token or \
             identity variables set) and the account's network rules"
        )
    };
    let reason = match (code.as_deref(), e) {
        (Some("ContainerNotFound"), _) => {
            format!("container {container:?} does not exist at {endpoint}")
        }
        (Some(c), _) if BAD_CREDENTIAL_CODES.contains(&c) => rejected(),
        (None, object_store::Error::Unauthenticated { .. }) => rejected(),
        (None, object_store::Error::PermissionDenied { .. }) => rejected(),
        // No HTTP answer at all: connection refused, DNS, TLS, timeout.
        (None, object_store::Error::Generic { .. }) if !text.contains("status code") => format!(
            "cannot reach {endpoint} for container {container:?} (is the endpoint reachable? \
             AZURE_STORAGE_ENDPOINT sets it; AZURITE_BLOB_STORAGE_URL for Azurite)"
        ),
        _ => return None,
    };
    Some((reason, detail))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::origin::tests::env_of;

    fn err(url: &str, env: &'static [(&'static str, &'static str)]) -> String {
        match open(url, env_of(env)) {
            Ok(_) => panic!("{url} opened"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn azure_without_credentials_or_account_names_the_variables() {
        let e = err("az://models/prefix", &[]);
        assert!(e.contains("no Azure credentials"), "{e}");
        assert!(e.contains("AZURE_STORAGE_ACCOUNT_KEY"), "{e}");
        // A flag set to false is no credential.
        let e = err("az://models", &[("AZURE_USE_AZURE_CLI", "false")]);
        assert!(e.contains("no Azure credentials"), "{e}");
        let e = err("az://models", &[("AZURE_STORAGE_ACCOUNT_KEY", "a2V5")]);
        assert!(e.contains("AZURE_STORAGE_ACCOUNT_NAME"), "{e}");
    }

    #[test]
    fn azure_needs_a_container() {
        let e = err("az:///prefix", &[("AZURE_STORAGE_USE_EMULATOR", "true")]);
        assert!(e.contains("container"), "{e}");
    }

    #[test]
    fn a_container_not_found_and_rejected_keys_are_told_apart_from_a_missing_blob() {
        let status = |code: &str| object_store::Error::Generic {
            store: "MicrosoftAzure",
            source: format!(
                "Client error with status 404: <?xml version=\"1.0\"?><Error><Code>{code}</Code>\
                 <Message>The thing.\nRequestId:1</Message></Error>"
            )
            .into(),
        };
        let (reason, detail) =
            explain("models", "http://x", &status("ContainerNotFound")).expect("explained");
        assert!(
            reason.contains("container \"models\" does not exist"),
            "{reason}"
        );
        assert_eq!(detail, "ContainerNotFound: The thing.");
        let (reason, _) =
            explain("models", "http://x", &status("AuthenticationFailed")).expect("explained");
        assert!(reason.contains("rejected the credentials"), "{reason}");
        assert!(explain("models", "http://x", &status("BlobNotFound")).is_none());
        assert!(explain(
            "models",
            "http://x",
            &status("AuthorizationPermissionMismatch")
        )
        .is_none());
    }
}
