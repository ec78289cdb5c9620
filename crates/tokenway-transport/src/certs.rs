//! Server identities: a configured certificate chain and key, or a generated self-signed one,
//! and the TLS server configurations built from them for TCP (h2, http/1.1) and QUIC (h3).
//!
//! A self-signed identity is announced with its SHA-256 fingerprint so an edge can pin it.

use std::path::Path;
use std::sync::Arc;

use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::TransportError;

/// A certificate chain and its private key.
#[derive(Debug)]
pub struct Identity {
    /// Leaf first.
    pub certs: Vec<CertificateDer<'static>>,
    /// The leaf's private key.
    pub key: PrivateKeyDer<'static>,
    /// Whether it was generated here.
    pub self_signed: bool,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Self {
            certs: self.certs.clone(),
            key: self.key.clone_key(),
            self_signed: self.self_signed,
        }
    }
}

impl Identity {
    /// Loads PEM files; errors name the file and the config key.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TransportError> {
        let certs = CertificateDer::pem_file_iter(cert)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|e| TransportError::Tls(format!("tls.cert {}: {e}", cert.display())))?;
        if certs.is_empty() {
            return Err(TransportError::Tls(format!(
                "tls.cert {}: no certificate in the file",
                cert.display()
            )));
        }
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| TransportError::Tls(format!("tls.key {}: {e}", key.display())))?;
        Ok(Self {
            certs,
            key,
            self_signed: false,
        })
    }

    /// Generates a self-signed certificate for `names` (DNS names or IP addresses).
    ///
    /// It reads like one an operator would make: the first name as its common name, valid from
    /// yesterday for 397 days (the longest a public CA issues). rcgen's defaults (the common
    /// name "rcgen self signed cert", valid 1975 to 4096) would mark every tokenway port for a
    /// prober, the masquerade's included. Edges pin the certificate itself, not its dates.
    pub fn self_signed(names: &[&str]) -> Result<Self, TransportError> {
        let failed = |e: rcgen::Error| {
            TransportError::Tls(format!("cannot generate a self-signed certificate: {e}"))
        };
        let owned: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(owned).map_err(failed)?;
        let mut dn = rcgen::DistinguishedName::new();
        if let Some(first) = names.first() {
            dn.push(rcgen::DnType::CommonName, *first);
        }
        params.distinguished_name = dn;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::days(1);
        params.not_after = now + time::Duration::days(397);
        let key_pair = rcgen::KeyPair::generate().map_err(failed)?;
        let generated = params.self_signed(&key_pair).map_err(failed)?;
        let cert = generated.der().clone();
        let key = PrivateKeyDer::try_from(key_pair.serialize_der())
            .map_err(|e| TransportError::Tls(format!("generated key: {e}")))?;
        Ok(Self {
            certs: vec![cert],
            key,
            self_signed: true,
        })
    }

    /// Loads `files` when given, else generates a self-signed identity for localhost and says
    /// so in the log with the fingerprint to pin.
    pub fn load_or_generate(files: Option<(&Path, &Path)>) -> Result<Self, TransportError> {
        match files {
            Some((cert, key)) => Self::load(cert, key),
            None => {
                let id = Self::self_signed(&["localhost", "127.0.0.1", "::1"])?;
                tracing::warn!(
                    fingerprint = %id.fingerprint(),
                    "no TLS certificate configured (tls.cert / tls.key): generated a self-signed \
                     certificate for localhost, 127.0.0.1 and ::1; clients must trust it \
                     explicitly (curl -k, or pin the fingerprint in the edge's config)"
                );
                Ok(id)
            }
        }
    }

    /// `sha256:<hex>` of the leaf certificate's DER bytes.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.certs[0])
    }

    /// TLS server configuration for a TCP front (ALPN h2, http/1.1).
    pub fn tcp_server_config(&self) -> Result<Arc<ServerConfig>, TransportError> {
        let mut c = self.server_config()?;
        c.alpn_protocols = vec![crate::ALPN_H2.to_vec(), crate::ALPN_HTTP11.to_vec()];
        Ok(Arc::new(c))
    }

    /// TLS server configuration for QUIC (ALPN h3), accepting 0-RTT when `zero_rtt`.
    pub fn quic_server_config(&self, zero_rtt: bool) -> Result<ServerConfig, TransportError> {
        let mut c = self.server_config()?;
        c.alpn_protocols = vec![crate::ALPN_H3.to_vec()];
        // QUIC requires max_early_data_size to be 0 or u32::MAX (RFC 9001 §4.6.1).
        c.max_early_data_size = if zero_rtt { u32::MAX } else { 0 };
        Ok(c)
    }

    fn server_config(&self) -> Result<ServerConfig, TransportError> {
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| TransportError::Tls(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(self.certs.clone(), self.key.clone_key())
            .map_err(|e| TransportError::Tls(format!("certificate and key do not match: {e}")))
    }
}

/// `sha256:<hex>` of a certificate's DER bytes.
pub fn fingerprint(cert: &CertificateDer<'_>) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    format!("sha256:{}", hex::encode(digest.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_certificate_does_not_carry_rcgens_defaults() {
        let id = Identity::self_signed(&["localhost", "127.0.0.1"]).expect("generated");
        let der = id.certs[0].as_ref();
        let has = |needle: &[u8]| der.windows(needle.len()).any(|w| w == needle);
        assert!(!has(b"rcgen"), "rcgen's common name");
        // rcgen's default validity starts 1975-01-01 (UTCTime 750101000000Z).
        assert!(!has(b"750101000000Z"), "rcgen's default validity");
        assert!(
            has(b"localhost"),
            "the first name is the common name and a SAN"
        );
    }

    #[test]
    fn self_signed_identity_builds_both_server_configs() {
        let id = Identity::self_signed(&["localhost"]).expect("generated");
        assert!(id.fingerprint().starts_with("sha256:"));
        assert_eq!(id.fingerprint().len(), 7 + 64);
        let tcp = id.tcp_server_config().expect("tcp config");
        assert_eq!(tcp.alpn_protocols[0], b"h2");
        let quic = id.quic_server_config(true).expect("quic config");
        assert_eq!(quic.max_early_data_size, u32::MAX);
    }
}
