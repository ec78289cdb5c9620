//! Client-side trust: which gateway certificates the edge accepts.
//!
//! Either a CA file (PEM roots, the usual web PKI check including the server name), or pinned
//! SHA-256 fingerprints of the gateway's leaf certificate, for self-signed gateways. A pinned
//! leaf is accepted whatever name it carries, but the handshake signature is still verified
//! against it, so only the holder of the pinned certificate's key can complete the handshake.
//!
//! One [`client_tls`] configuration is meant to be reused for every connection to the same
//! gateways: its in-memory session store keeps the resumption tickets that make 0-RTT possible.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;

use crate::certs::fingerprint;
use crate::error::TransportError;

/// Which server certificates are trusted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trust {
    /// PEM file of CA certificates (`[trust] ca_file`).
    CaFile(PathBuf),
    /// `sha256:<64 hex>` fingerprints of accepted leaf certificates (`[trust] pin_sha256`).
    Pinned(Vec<String>),
}

/// Checks the format of a `sha256:<hex>` pin and returns it lowercased.
pub fn parse_pin(pin: &str) -> Result<String, TransportError> {
    let lower = pin.trim().to_ascii_lowercase();
    let hex_part = lower.strip_prefix("sha256:").unwrap_or(&lower);
    let ok = hex_part.len() == 64 && hex_part.bytes().all(|b| b.is_ascii_hexdigit());
    if !ok {
        return Err(TransportError::Config(format!(
            "trust.pin_sha256 entries must be `sha256:` followed by 64 hex characters (got {pin:?})"
        )));
    }
    Ok(format!("sha256:{hex_part}"))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A rustls client configuration trusting `trust`, offering `alpn`, and sending TLS early data
/// on resumption when `early_data`.
pub fn client_tls(
    trust: &Trust,
    alpn: &[&[u8]],
    early_data: bool,
) -> Result<Arc<ClientConfig>, TransportError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| TransportError::Tls(e.to_string()))?;
    let mut config = match trust {
        Trust::CaFile(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|e| {
                    TransportError::Tls(format!("trust.ca_file {}: {e}", path.display()))
                })?;
            let mut roots = RootCertStore::empty();
            let (added, _ignored) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(TransportError::Tls(format!(
                    "trust.ca_file {}: no usable CA certificate in the file",
                    path.display()
                )));
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        Trust::Pinned(pins) => {
            if pins.is_empty() {
                return Err(TransportError::Config(
                    "trust.pin_sha256 must list at least one fingerprint".into(),
                ));
            }
            let pins = pins
                .iter()
                .map(|p| parse_pin(p))
                .collect::<Result<Vec<_>, _>>()?;
            let verifier = PinnedVerifier {
                pins,
                algorithms: provider.signature_verification_algorithms,
            };
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(verifier))
                .with_no_client_auth()
        }
    };
    config.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    config.enable_early_data = early_data;
    Ok(Arc::new(config))
}

/// Accepts exactly the pinned leaf certificates.
#[derive(Debug)]
struct PinnedVerifier {
    pins: Vec<String>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let got = fingerprint(end_entity);
        if self.pins.contains(&got) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "the server's certificate {got} is not pinned in trust.pin_sha256"
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_are_checked_for_format_and_lowercased() {
        let hex = "AB".repeat(32);
        assert_eq!(
            parse_pin(&format!("sha256:{hex}")).ok(),
            Some(format!("sha256:{}", "ab".repeat(32)))
        );
        assert!(parse_pin("sha256:abcd").is_err());
        assert!(parse_pin(&"zz".repeat(32)).is_err());
    }

    #[test]
    fn pinned_config_offers_alpn_and_early_data() {
        let id = crate::certs::Identity::self_signed(&["localhost"]).expect("identity");
        let c = client_tls(&Trust::Pinned(vec![id.fingerprint()]), &[b"h3"], true).expect("config");
        assert_eq!(c.alpn_protocols, vec![b"h3".to_vec()]);
        assert!(c.enable_early_data);
        assert!(client_tls(&Trust::Pinned(vec![]), &[b"h3"], true).is_err());
        let e = client_tls(&Trust::CaFile("/nonexistent.pem".into()), &[b"h2"], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("trust.ca_file"), "{e}");
    }
}
