//! Flags of access to the weights tier, shared by `mirror`, `pull` and `preheat`: the access
//! token (`--token`, see `tokenway_mirror::auth`), the mirror's certificate (`--tls-cert`,
//! `--tls-key`) and the CA pullers check `https://` mirrors with (`--ca-cert`, see
//! `tokenway_mirror::tls`). `docs/weights.md` has the whole picture.

use std::path::PathBuf;
use std::sync::Arc;

use tokenway_mirror::auth::AccessToken;
use tokenway_mirror::tls::{server_config, ClientTrust, ServerConfig};

/// The `--token` flag (or `TOKENWAY_WEIGHTS_TOKEN`, preferred: flags show in the process list).
#[derive(clap::Args, Clone)]
pub struct TokenArg {
    /// Access token of the weights tier: a mirror or `--serve` peer given one answers 401
    /// without it; pullers and preheat send it. 16 to 512 visible ASCII characters.
    #[arg(
        long = "token",
        value_name = "TOKEN",
        env = "TOKENWAY_WEIGHTS_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
}

impl TokenArg {
    /// The checked token, if one was given.
    pub fn get(&self) -> anyhow::Result<Option<AccessToken>> {
        Ok(AccessToken::from_arg(self.token.as_deref())?)
    }
}

/// `--tls-cert` and `--tls-key` of a mirror.
#[derive(clap::Args, Clone)]
pub struct ServerTlsArgs {
    /// Serve HTTPS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl ServerTlsArgs {
    /// The TLS configuration, if a certificate was given.
    pub fn get(&self) -> anyhow::Result<Option<Arc<ServerConfig>>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(server_config(cert, key)?)),
            _ => Ok(None),
        }
    }
}

/// `--ca-cert` of a client of mirrors.
#[derive(clap::Args, Clone)]
pub struct ClientTlsArgs {
    /// Check https:// mirrors against the CA certificates in this PEM file instead of the
    /// system's (a private CA).
    #[arg(long, value_name = "FILE")]
    pub ca_cert: Option<PathBuf>,
}

impl ClientTlsArgs {
    /// What https:// mirrors are checked against.
    pub fn trust(&self) -> ClientTrust {
        ClientTrust::from_arg(self.ca_cert.as_deref())
    }
}
