//! HTTPS for mirrors: a mirror given a certificate and key (`--tls-cert`, `--tls-key`) serves
//! its API over TLS; pullers and `tokenway preheat` reach `https://` mirrors, trusting the
//! system's roots or a CA file of their own (`--ca-cert`, for a private CA).
//!
//! Certificates and CA files are loaded by `tokenway-transport` (`certs::Identity`,
//! `trust::client_tls`), as for the gateway's TLS front and the edge. Peers (`pull --serve`)
//! stay plain HTTP inside a region: what they serve is verified piece by piece anyway.

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use rustls::ServerConfig;
use rustls::{ClientConfig, RootCertStore};
use tokenway_transport::certs::Identity;
use tokenway_transport::trust::{client_tls, Trust};

use crate::MirrorError;

/// The ALPN a mirror speaks over TLS: HTTP/1.1 only (see `http_serve`; curl and other
/// clients that prefer h2 fall back to it).
const SERVER_ALPN: &[&[u8]] = &[b"http/1.1"];

/// The server side: a TLS configuration from PEM files; errors name the flag and the file.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, MirrorError> {
    let bad = |reason: String| MirrorError::Config {
        field: "--tls-cert/--tls-key".into(),
        reason,
    };
    let id = Identity::load(cert, key).map_err(|e| bad(e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| bad(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(id.certs, id.key)
        .map_err(|e| {
            bad(format!(
                "{} and {} do not make a usable certificate: {e}",
                cert.display(),
                key.display()
            ))
        })?;
    config.alpn_protocols = SERVER_ALPN.iter().map(|a| a.to_vec()).collect();
    Ok(Arc::new(config))
}

/// Which certificates a client trusts for `https://` mirrors.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ClientTrust {
    /// The system's roots (`/etc/ssl/certs` and the like).
    #[default]
    System,
    /// The CA certificates of a PEM file, instead of the system's.
    CaFile(PathBuf),
}

impl ClientTrust {
    /// `--ca-cert FILE` or the system's roots.
    pub fn from_arg(ca: Option<&Path>) -> Self {
        ca.map_or(Self::System, |p| Self::CaFile(p.to_path_buf()))
    }

    /// The rustls configuration (no ALPN: the connector offers HTTP/1.1 itself).
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, MirrorError> {
        let bad = |field: &str, reason: String| MirrorError::Config {
            field: field.into(),
            reason,
        };
        match self {
            Self::CaFile(path) => client_tls(&Trust::CaFile(path.clone()), &[], false)
                .map_err(|e| bad("--ca-cert", e.to_string())),
            Self::System => {
                let found = rustls_native_certs::load_native_certs();
                let mut roots = RootCertStore::empty();
                let (added, _) = roots.add_parsable_certificates(found.certs);
                if added == 0 {
                    let why = found
                        .errors
                        .first()
                        .map_or("none found".to_string(), ToString::to_string);
                    return Err(bad(
                        "https mirror",
                        format!(
                            "no system CA certificates to check https mirrors with ({why}); \
                             give --ca-cert FILE"
                        ),
                    ));
                }
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let config = ClientConfig::builder_with_provider(provider)
                    .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
                    .map_err(|e| bad("https mirror", e.to_string()))?
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                Ok(Arc::new(config))
            }
        }
    }
}
