//! The edge's configuration (TOML; every key is documented in `docs/edge.md`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use tokenway_transport::trust::{parse_pin, Trust};
use tokenway_transport::{DatagramSettings, QuicSettings};

use crate::error::EdgeError;

/// The whole edge configuration.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeConfig {
    /// Local OpenAI-compatible endpoint (HTTP/1.1 and h2c).
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// The shared tunnel token, sent as `tw-auth` on every tunnel request.
    pub token: String,
    /// Which gateway certificates are trusted.
    pub trust: TrustConfig,
    /// The gateways, in no particular order (the lowest smoothed RTT is used).
    pub gateways: Vec<GatewayEntry>,
    /// QUIC settings of the tunnel connections.
    #[serde(default)]
    pub quic: QuicSettings,
    /// How long QUIC runs alone before the TCP fallback joins the race, milliseconds.
    #[serde(default = "default_head_start")]
    pub fallback_head_start_ms: u64,
    /// How often the choice of gateway is re-evaluated, milliseconds.
    #[serde(default = "default_reevaluate")]
    pub reevaluate_ms: u64,
    /// Longest wait for one connection attempt, milliseconds.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// While on the TCP fallback, how often QUIC is tried again, milliseconds.
    #[serde(default = "default_quic_retry")]
    pub quic_retry_ms: u64,
    /// Largest request body accepted from a local client, bytes (bodies are held so that a
    /// request can be retried on a fresh connection).
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// How often the local address towards each gateway is checked, milliseconds; when it
    /// changes the QUIC endpoint rebinds so connections migrate at once (0 = never).
    #[serde(default = "default_address_check")]
    pub address_check_ms: u64,
    /// TCP port forwards through the tunnel.
    #[serde(default)]
    pub forwards: Vec<ForwardEntry>,
    /// `[datagram]`: the datagram layer under the tunnel's QUIC (FEC, obfuscation) and the
    /// tunnel's congestion control (docs/datagram-layer.md); absent means plain QUIC. `fec`
    /// (off or not) and `obfs.psk` must match the gateway's `[tunnel.datagram]`.
    #[serde(default)]
    pub datagram: Option<DatagramSettings>,
}

/// `[trust]`: exactly one of `ca_file` or `pin_sha256`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustConfig {
    /// PEM file of CA certificates.
    pub ca_file: Option<PathBuf>,
    /// `sha256:<hex>` fingerprints of accepted (self-signed) gateway certificates.
    #[serde(default)]
    pub pin_sha256: Vec<String>,
}

/// `[[gateways]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayEntry {
    /// Name, for logs and metric labels.
    pub name: String,
    /// The gateway's tunnel port, UDP, `host:port`.
    pub quic: String,
    /// The gateway's TLS TCP port for the fallback, `host:port`.
    pub tcp: Option<String>,
    /// TLS server name (SNI).
    #[serde(default = "default_server_name")]
    pub server_name: String,
}

/// `[[forwards]]`: a local TCP listener whose connections are carried to `target`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForwardEntry {
    /// Local address to listen on.
    pub listen: SocketAddr,
    /// `host:port` the gateway connects to (must be in the gateway's `[tunnel] forward_allow`).
    pub target: String,
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8080))
}
fn default_head_start() -> u64 {
    250
}
fn default_reevaluate() -> u64 {
    10_000
}
fn default_connect_timeout() -> u64 {
    3_000
}
fn default_quic_retry() -> u64 {
    3_000
}
fn default_address_check() -> u64 {
    100
}
fn default_max_body() -> usize {
    32 << 20
}
fn default_server_name() -> String {
    "localhost".into()
}

/// The shortest tunnel token the gateway accepts (its `tunnel.tokens` rule).
pub const MIN_TOKEN_LEN: usize = 16;

fn is_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

impl EdgeConfig {
    /// Parses TOML and validates it.
    pub fn from_toml_str(text: &str) -> Result<Self, EdgeError> {
        let c: Self = toml::from_str(text).map_err(|e| EdgeError::Config(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    /// Checks every key; the error names the bad key and the allowed values.
    pub fn validate(&self) -> Result<(), EdgeError> {
        let bad = |m: String| Err(EdgeError::Config(m));
        if self.token.trim().is_empty() {
            return bad("token must not be empty (the gateway's [tunnel] tokens entry)".into());
        }
        // The gateway accepts no shorter token (its `tunnel.tokens`): a shorter one would only
        // ever see the gateway's masquerade site.
        if self.token.len() < MIN_TOKEN_LEN {
            return bad(format!(
                "token must be at least {MIN_TOKEN_LEN} characters, as the gateway's [tunnel] \
                 tokens require (got {})",
                self.token.len()
            ));
        }
        if http::HeaderValue::from_str(&self.token).is_err() {
            return bad("token must be printable ASCII (it travels as the tw-auth header)".into());
        }
        self.trust()?;
        if self.gateways.is_empty() {
            return bad("gateways must list at least one [[gateways]] entry".into());
        }
        for (i, g) in self.gateways.iter().enumerate() {
            if g.name.trim().is_empty() {
                return bad(format!("gateways[{i}].name must not be empty"));
            }
            if self.gateways[..i].iter().any(|o| o.name == g.name) {
                return bad(format!("gateways[{i}].name {:?} is used twice", g.name));
            }
            if !is_host_port(&g.quic) {
                return bad(format!(
                    "gateways[{i}].quic must be host:port (got {:?})",
                    g.quic
                ));
            }
            if let Some(t) = &g.tcp {
                if !is_host_port(t) {
                    return bad(format!("gateways[{i}].tcp must be host:port (got {t:?})"));
                }
            }
            if g.server_name.trim().is_empty() {
                return bad(format!("gateways[{i}].server_name must not be empty"));
            }
            if rustls::pki_types::ServerName::try_from(g.server_name.as_str()).is_err() {
                return bad(format!(
                    "gateways[{i}].server_name must be a DNS name or an IP address (got {:?})",
                    g.server_name
                ));
            }
        }
        self.quic
            .validate("quic")
            .map_err(|e| EdgeError::Config(e.to_string()))?;
        if let Some(d) = &self.datagram {
            d.validate("datagram")
                .map_err(|e| EdgeError::Config(e.to_string()))?;
        }
        if self.fallback_head_start_ms > 10_000 {
            return bad(format!(
                "fallback_head_start_ms must be in 0..=10000 (got {})",
                self.fallback_head_start_ms
            ));
        }
        if !(100..=3_600_000).contains(&self.reevaluate_ms) {
            return bad(format!(
                "reevaluate_ms must be in 100..=3600000 (got {})",
                self.reevaluate_ms
            ));
        }
        if !(100..=60_000).contains(&self.connect_timeout_ms) {
            return bad(format!(
                "connect_timeout_ms must be in 100..=60000 (got {})",
                self.connect_timeout_ms
            ));
        }
        if !(100..=600_000).contains(&self.quic_retry_ms) {
            return bad(format!(
                "quic_retry_ms must be in 100..=600000 (got {})",
                self.quic_retry_ms
            ));
        }
        if self.address_check_ms != 0 && !(20..=60_000).contains(&self.address_check_ms) {
            return bad(format!(
                "address_check_ms must be 0 (off) or in 20..=60000 (got {})",
                self.address_check_ms
            ));
        }
        if self.max_body_bytes < 1024 || self.max_body_bytes > 1 << 30 {
            return bad(format!(
                "max_body_bytes must be in 1024..=1073741824 (got {})",
                self.max_body_bytes
            ));
        }
        for (i, f) in self.forwards.iter().enumerate() {
            if !is_host_port(&f.target) {
                return bad(format!(
                    "forwards[{i}].target must be host:port (got {:?})",
                    f.target
                ));
            }
        }
        Ok(())
    }

    /// The QUIC settings of tunnel connections: `[quic]` with the `[datagram]` layer.
    pub fn tunnel_quic(&self) -> QuicSettings {
        let mut q = self.quic.clone();
        q.datagram = self.datagram.clone();
        q
    }

    /// The trust setting.
    pub fn trust(&self) -> Result<Trust, EdgeError> {
        match (&self.trust.ca_file, self.trust.pin_sha256.is_empty()) {
            (Some(_), false) => Err(EdgeError::Config(
                "trust: set either ca_file or pin_sha256, not both".into(),
            )),
            (None, true) => Err(EdgeError::Config(
                "trust: set ca_file (PEM roots) or pin_sha256 (gateway certificate fingerprints)"
                    .into(),
            )),
            (Some(f), true) => Ok(Trust::CaFile(f.clone())),
            (None, false) => {
                for p in &self.trust.pin_sha256 {
                    parse_pin(p).map_err(|e| EdgeError::Config(e.to_string()))?;
                }
                Ok(Trust::Pinned(self.trust.pin_sha256.clone()))
            }
        }
    }

    /// `fallback_head_start_ms` as a duration.
    pub fn head_start(&self) -> Duration {
        Duration::from_millis(self.fallback_head_start_ms)
    }

    /// `reevaluate_ms` as a duration.
    pub fn reevaluate(&self) -> Duration {
        Duration::from_millis(self.reevaluate_ms)
    }

    /// `connect_timeout_ms` as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// `quic_retry_ms` as a duration.
    pub fn quic_retry(&self) -> Duration {
        Duration::from_millis(self.quic_retry_ms)
    }

    /// The roaming check interval, `None` when disabled.
    pub fn address_check(&self) -> Option<Duration> {
        (self.address_check_ms > 0).then(|| Duration::from_millis(self.address_check_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PIN: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";
    const TOKEN: &str = "0123456789abcdef";

    fn base() -> String {
        format!(
            "token = \"{TOKEN}\"\n[trust]\npin_sha256 = [\"{PIN}\"]\n[[gateways]]\nname = \"a\"\nquic = \"127.0.0.1:4433\"\n"
        )
    }

    #[test]
    fn the_example_config_is_valid() {
        let text = include_str!("../../../examples/edge.toml");
        let c = EdgeConfig::from_toml_str(text).expect("examples/edge.toml is valid");
        assert_eq!(c.forwards.len(), 1);
        assert_eq!(c.gateways[0].tcp.as_deref(), Some("127.0.0.1:4433"));
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = EdgeConfig::from_toml_str(&base()).expect("valid");
        assert_eq!(c.listen, default_listen());
        assert_eq!(c.fallback_head_start_ms, 250);
        assert_eq!(c.reevaluate_ms, 10_000);
        assert_eq!(c.gateways[0].server_name, "localhost");
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            (base().replace(TOKEN, ""), "token"),
            // The gateway refuses tokens under 16 characters.
            (base().replace(TOKEN, "t"), "token must be at least 16"),
            (
                base().replace(TOKEN, "0123456789abcde"),
                "token must be at least 16",
            ),
            (
                base() + "server_name = \"bad name\"\n",
                "gateways[0].server_name",
            ),
            (
                base() + "server_name = \"a..b\"\n",
                "gateways[0].server_name",
            ),
            (base() + "reevaluate_ms = 5\n", "reevaluate_ms"),
            (
                base().replace("127.0.0.1:4433", "nowhere"),
                "gateways[0].quic",
            ),
            (base().replace(PIN, "sha256:12"), "pin_sha256"),
            (
                base() + "[quic]\nidle_timeout_ms = 0\n",
                "quic.idle_timeout_ms",
            ),
            (
                base() + "[[gateways]]\nname = \"a\"\nquic = \"127.0.0.1:1\"\n",
                "used twice",
            ),
        ];
        for (text, key) in cases {
            // Keys after a table header land in that table; put scalars before the tables.
            let text = if text.ends_with("reevaluate_ms = 5\n") {
                format!("reevaluate_ms = 5\n{}", base())
            } else {
                text
            };
            let e = EdgeConfig::from_toml_str(&text).unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn datagram_section_reaches_the_tunnel_settings() {
        let c = EdgeConfig::from_toml_str(&format!(
            "{}[datagram]\nfec = \"auto\"\nobfs.psk = \"0123456789abcdef\"\n\
             bandwidth.down = \"80 mbps\"\n",
            base()
        ))
        .expect("valid");
        let q = c.tunnel_quic();
        let d = q.datagram.expect("the layer is on");
        assert_eq!(
            d.bandwidth.down.map(|b| b.bytes_per_sec()),
            Some(10_000_000)
        );
        assert!(EdgeConfig::from_toml_str(&base())
            .expect("valid")
            .tunnel_quic()
            .datagram
            .is_none());
        let e = EdgeConfig::from_toml_str(&format!("{}[datagram]\ncc = \"brutal\"\n", base()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("datagram.bandwidth.up"), "{e}");
    }
}
