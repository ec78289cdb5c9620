//! The edge's configuration (TOML; every key is documented in `docs/edge.md`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::de::IgnoredAny;
use serde::Deserialize;
use tokenway_transport::body_budget::BodyBudget;
use tokenway_transport::tunnel_config::{is_host_port, TunnelClientConfig};
use tokenway_transport::TransportError;

use crate::error::EdgeError;

/// The whole edge configuration: the tunnel client's keys ([`TunnelClientConfig`], at the top
/// level of the file) and the edge's own.
#[derive(Clone, Debug, Deserialize)]
pub struct EdgeConfig {
    /// Local OpenAI-compatible endpoint (HTTP/1.1 and h2c).
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Largest request body accepted from a local client, bytes (bodies are held so that a
    /// request can be retried on a fresh connection).
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Request bodies held at once, all requests together, bytes (unset: the larger of
    /// 256 MiB and twice `max_body_bytes`).
    #[serde(default)]
    pub max_held_body_bytes: Option<usize>,
    /// How often the local address towards each gateway is checked, milliseconds; when it
    /// changes the QUIC endpoint rebinds so connections migrate at once (0 = never).
    #[serde(default = "default_address_check")]
    pub address_check_ms: u64,
    /// TCP port forwards through the tunnel.
    #[serde(default)]
    pub forwards: Vec<ForwardEntry>,
    /// Token, trust, gateways, `[quic]`, `[datagram]` and the fallback's timing.
    #[serde(flatten)]
    pub tunnel: TunnelClientConfig,
    /// Keys neither the edge's nor the tunnel's (serde's `deny_unknown_fields` does not work
    /// across `flatten`): refused by [`EdgeConfig::validate`] by name.
    #[serde(flatten)]
    unknown: BTreeMap<String, IgnoredAny>,
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
fn default_address_check() -> u64 {
    100
}
fn default_max_body() -> usize {
    32 << 20
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
        if let Some(key) = self.unknown.keys().next() {
            return bad(format!(
                "unknown key `{key}` (every key is listed in docs/edge.md)"
            ));
        }
        self.tunnel.validate().map_err(|e| match e {
            TransportError::Config(m) => EdgeError::Config(m),
            other => other.into(),
        })?;
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
        if let Some(held) = self.max_held_body_bytes {
            if held < self.max_body_bytes || held > u32::MAX as usize {
                return bad(format!(
                    "max_held_body_bytes must be in max_body_bytes ({})..=4294967295 (got {held})",
                    self.max_body_bytes
                ));
            }
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

    /// The bound on request bodies held, all requests together.
    pub fn body_budget(&self) -> BodyBudget {
        match self.max_held_body_bytes {
            Some(bytes) => BodyBudget::of_bytes(bytes),
            None => BodyBudget::for_bodies_of(self.max_body_bytes),
        }
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
        assert_eq!(c.tunnel.gateways[0].tcp.as_deref(), Some("127.0.0.1:4433"));
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = EdgeConfig::from_toml_str(&base()).expect("valid");
        assert_eq!(c.listen, default_listen());
        assert_eq!(c.tunnel.fallback_head_start_ms, 250);
        assert_eq!(c.tunnel.reevaluate_ms, 10_000);
        assert_eq!(c.tunnel.gateways[0].server_name, "localhost");
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
    fn the_bodies_held_are_bounded_by_max_held_body_bytes_or_the_default() {
        let c = EdgeConfig::from_toml_str(&format!("max_body_bytes = 4096\n{}", base()))
            .expect("valid");
        assert_eq!(c.max_held_body_bytes, None);
        let budget = c.body_budget();
        assert!(budget.hold().has_room_for(256 << 20));
        assert!(!budget.hold().has_room_for((256 << 20) + 1));
        let c = EdgeConfig::from_toml_str(&format!(
            "max_body_bytes = 4096\nmax_held_body_bytes = 10000\n{}",
            base()
        ))
        .expect("valid");
        let budget = c.body_budget();
        assert!(budget.hold().has_room_for(10_000));
        assert!(!budget.hold().has_room_for(10_001));
        for held in ["4095", "4294967296"] {
            let e = EdgeConfig::from_toml_str(&format!(
                "max_body_bytes = 4096\nmax_held_body_bytes = {held}\n{}",
                base()
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains("max_held_body_bytes"), "{held}: {e}");
        }
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        // The tunnel client's keys are flattened in; an unknown key, at the top or in a table,
        // is still an error that names it.
        for (text, key) in [
            (format!("lisen = \"127.0.0.1:1\"\n{}", base()), "lisen"),
            (format!("reevaluate = 5\n{}", base()), "reevaluate"),
            (base() + "sni = \"x\"\n", "sni"),
            (base() + "[quic]\nidle = 1\n", "idle"),
        ] {
            let e = EdgeConfig::from_toml_str(&text)
                .map(|_| "accepted".to_string())
                .unwrap_or_else(|e| e.to_string());
            assert!(e.contains(key), "{key}: {e}");
        }
        // The edge's own keys and the tunnel's mix in any order.
        let c = EdgeConfig::from_toml_str(&format!(
            "max_body_bytes = 4096\nquic_retry_ms = 500\nlisten = \"127.0.0.1:9\"\n{}",
            base()
        ))
        .expect("valid");
        assert_eq!((c.max_body_bytes, c.tunnel.quic_retry_ms), (4096, 500));
        assert_eq!(c.listen.port(), 9);
    }

    #[test]
    fn datagram_section_reaches_the_tunnel_settings() {
        let c = EdgeConfig::from_toml_str(&format!(
            "{}[datagram]\nfec = \"auto\"\nobfs.psk = \"0123456789abcdef\"\n\
             bandwidth.down = \"80 mbps\"\n",
            base()
        ))
        .expect("valid");
        let q = c.tunnel.tunnel_quic();
        let d = q.datagram.expect("the layer is on");
        assert_eq!(
            d.bandwidth.down.map(|b| b.bytes_per_sec()),
            Some(10_000_000)
        );
        assert!(EdgeConfig::from_toml_str(&base())
            .expect("valid")
            .tunnel
            .tunnel_quic()
            .datagram
            .is_none());
        let e = EdgeConfig::from_toml_str(&format!("{}[datagram]\ncc = \"brutal\"\n", base()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("datagram.bandwidth.up"), "{e}");
    }
}
