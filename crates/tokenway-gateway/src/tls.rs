//! TLS for the TCP front: a configured certificate, or a generated self-signed one (said loudly,
//! since clients must then trust it explicitly). ALPN offers HTTP/2 first, then HTTP/1.1.

use std::sync::Arc;

use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::TlsFiles;
use crate::error::GatewayError;

/// Builds the rustls server configuration.
pub fn server_config(files: Option<&TlsFiles>) -> Result<Arc<ServerConfig>, GatewayError> {
    let (certs, key) = match files {
        Some(f) => load(f)?,
        None => self_signed()?,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| GatewayError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| GatewayError::Tls(format!("certificate and key do not match: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn load(
    f: &TlsFiles,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), GatewayError> {
    let certs = CertificateDer::pem_file_iter(&f.cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| GatewayError::Tls(format!("tls.cert {}: {e}", f.cert.display())))?;
    if certs.is_empty() {
        return Err(GatewayError::Tls(format!(
            "tls.cert {}: no certificate in the file",
            f.cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(&f.key)
        .map_err(|e| GatewayError::Tls(format!("tls.key {}: {e}", f.key.display())))?;
    Ok((certs, key))
}

fn self_signed() -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), GatewayError> {
    let names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    let generated = rcgen::generate_simple_self_signed(names).map_err(|e| {
        GatewayError::Tls(format!("cannot generate a self-signed certificate: {e}"))
    })?;
    tracing::warn!(
        "no TLS certificate configured (tls.cert / tls.key): generated a self-signed certificate \
         for localhost, 127.0.0.1 and ::1; clients must trust it explicitly (curl -k)"
    );
    let cert = generated.cert.der().clone();
    let key = PrivateKeyDer::try_from(generated.key_pair.serialize_der())
        .map_err(|e| GatewayError::Tls(format!("generated key: {e}")))?;
    Ok((vec![cert], key))
}
