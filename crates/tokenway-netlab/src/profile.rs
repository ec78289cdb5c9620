//! Link profiles: TOML files that describe the conditions of the client–server link.
//!
//! The shipped profiles live in `profiles/*.toml` and are compiled into the binary, so
//! `--profile 4g` works from any directory; `--profile path/to/file.toml` loads a file.
//! Every key is documented in `docs/netlab.md`. Durations are milliseconds (`*_ms`), loss and
//! duplication are fractions (0.05 = 5 %), rates are Mbit/s.

use std::net::Ipv4Addr;
use std::time::Duration;

use serde::Deserialize;

use crate::model::{Blackout, Conditions, DirectionSpec, GilbertElliott, Step, UdpBlock};
use crate::NetlabError;

/// The shipped profiles: (name, TOML text).
pub const BUILTIN: &[(&str, &str)] = &[
    ("fiber", include_str!("../profiles/fiber.toml")),
    ("wifi", include_str!("../profiles/wifi.toml")),
    ("4g", include_str!("../profiles/4g.toml")),
    ("lossy", include_str!("../profiles/lossy.toml")),
    ("satellite", include_str!("../profiles/satellite.toml")),
    ("udp-blocked", include_str!("../profiles/udp-blocked.toml")),
    ("handover", include_str!("../profiles/handover.toml")),
];

/// A host's address that changes periodically (a handover): at `first`, `first + every`, ...
/// the host's address moves to the next one in `addresses`, cyclically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressChange {
    /// Host name (`client` in the shipped profile).
    pub host: String,
    /// The addresses it cycles through; the first is the one it has at the start.
    pub addresses: Vec<Ipv4Addr>,
    /// Time of the first change.
    pub first: Duration,
    /// Period of the changes.
    pub every: Duration,
}

/// A parsed, validated profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Name (built-in name or file name).
    pub name: String,
    /// One line saying what it models.
    pub description: String,
    /// Client to server.
    pub uplink: DirectionSpec,
    /// Server to client.
    pub downlink: DirectionSpec,
    /// Periodic address change, if any.
    pub address_change: Option<AddressChange>,
}

#[derive(Debug, Deserialize, Default, Clone)]
#[serde(deny_unknown_fields)]
struct ProfileToml {
    #[serde(default)]
    description: String,
    #[serde(default)]
    conditions: ConditionsToml,
    uplink: Option<ConditionsToml>,
    downlink: Option<ConditionsToml>,
    #[serde(default)]
    blackout: Vec<BlackoutToml>,
    #[serde(default)]
    timeline: Vec<StepToml>,
    address_change: Option<AddressChangeToml>,
}

#[derive(Debug, Deserialize, Default, Clone)]
#[serde(deny_unknown_fields, default)]
struct ConditionsToml {
    delay_ms: f64,
    jitter_ms: f64,
    reorder: bool,
    loss: f64,
    duplicate: f64,
    rate_mbit: Option<f64>,
    queue_bytes: Option<u64>,
    block_udp: bool,
    block_udp_ports: Vec<u16>,
    burst_loss: Option<BurstToml>,
}

#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
struct BurstToml {
    p: f64,
    r: f64,
    #[serde(default = "one")]
    loss_bad: f64,
    #[serde(default)]
    loss_good: f64,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
struct BlackoutToml {
    start_ms: f64,
    duration_ms: f64,
    every_ms: Option<f64>,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct StepToml {
    at_ms: f64,
    #[serde(default)]
    conditions: ConditionsToml,
    uplink: Option<ConditionsToml>,
    downlink: Option<ConditionsToml>,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct AddressChangeToml {
    host: String,
    addresses: Vec<Ipv4Addr>,
    first_ms: f64,
    every_ms: f64,
}

/// Default bottleneck queue: 100 ms at the rate.
const DEFAULT_QUEUE_SECONDS: f64 = 0.1;

fn ms(key: &str, v: f64, max: f64) -> Result<Duration, String> {
    if !v.is_finite() || !(0.0..=max).contains(&v) {
        return Err(format!("{key} = {v} is out of range (0 to {max})"));
    }
    Ok(Duration::from_secs_f64(v / 1000.0))
}

fn fraction(key: &str, v: f64) -> Result<f64, String> {
    if !v.is_finite() || !(0.0..=1.0).contains(&v) {
        return Err(format!("{key} = {v} is out of range (0.0 to 1.0)"));
    }
    Ok(v)
}

impl ConditionsToml {
    fn resolve(&self, key: &str) -> Result<Conditions, String> {
        const HOUR_MS: f64 = 3_600_000.0;
        let rate_bps = match self.rate_mbit {
            Some(r) if !r.is_finite() || !(0.001..=100_000.0).contains(&r) => {
                return Err(format!(
                    "{key}.rate_mbit = {r} is out of range (0.001 to 100000)"
                ))
            }
            Some(r) => Some((r * 1e6) as u64),
            None => None,
        };
        let queue_bytes = match (self.queue_bytes, rate_bps) {
            (Some(q), _) if q < 1500 => {
                return Err(format!(
                    "{key}.queue_bytes = {q} is too small (at least 1500, one full packet)"
                ))
            }
            (Some(q), _) => q,
            (None, Some(r)) => ((r as f64 / 8.0 * DEFAULT_QUEUE_SECONDS) as u64).max(1500),
            (None, None) => 0,
        };
        let burst_loss = match self.burst_loss {
            Some(b) => Some(GilbertElliott {
                p: fraction(&format!("{key}.burst_loss.p"), b.p)?,
                r: fraction(&format!("{key}.burst_loss.r"), b.r)?,
                loss_bad: fraction(&format!("{key}.burst_loss.loss_bad"), b.loss_bad)?,
                loss_good: fraction(&format!("{key}.burst_loss.loss_good"), b.loss_good)?,
            }),
            None => None,
        };
        let udp_block = if self.block_udp {
            UdpBlock::All
        } else if !self.block_udp_ports.is_empty() {
            UdpBlock::Ports(self.block_udp_ports.clone())
        } else {
            UdpBlock::None
        };
        Ok(Conditions {
            delay: ms(&format!("{key}.delay_ms"), self.delay_ms, HOUR_MS)?,
            jitter: ms(&format!("{key}.jitter_ms"), self.jitter_ms, HOUR_MS)?,
            reorder: self.reorder,
            loss: fraction(&format!("{key}.loss"), self.loss)?,
            burst_loss,
            rate_bps,
            queue_bytes,
            duplicate: fraction(&format!("{key}.duplicate"), self.duplicate)?,
            udp_block,
        })
    }
}

/// Resolves (both, uplink override, downlink override) into (uplink, downlink).
fn directions(
    key: &str,
    both: &ConditionsToml,
    up: &Option<ConditionsToml>,
    down: &Option<ConditionsToml>,
) -> Result<(Conditions, Conditions), String> {
    let up = match up {
        Some(c) => c.resolve(&format!("{key}uplink"))?,
        None => both.resolve(&format!("{key}conditions"))?,
    };
    let down = match down {
        Some(c) => c.resolve(&format!("{key}downlink"))?,
        None => both.resolve(&format!("{key}conditions"))?,
    };
    Ok((up, down))
}

impl Profile {
    /// Parses and validates a profile from TOML text.
    pub fn from_toml_str(name: &str, text: &str) -> Result<Self, NetlabError> {
        let err = |message: String| NetlabError::Profile {
            name: name.to_string(),
            message,
        };
        let t: ProfileToml = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        let (up, down) = directions("", &t.conditions, &t.uplink, &t.downlink).map_err(err)?;
        let mut blackouts = Vec::new();
        for (i, b) in t.blackout.iter().enumerate() {
            let key = format!("blackout[{i}]");
            let blackout = Blackout {
                start: ms(&format!("{key}.start_ms"), b.start_ms, f64::MAX).map_err(err)?,
                duration: ms(&format!("{key}.duration_ms"), b.duration_ms, f64::MAX)
                    .map_err(err)?,
                every: match b.every_ms {
                    Some(e) => Some(ms(&format!("{key}.every_ms"), e, f64::MAX).map_err(err)?),
                    None => None,
                },
            };
            if blackout.every.is_some_and(|e| e <= blackout.duration) {
                return Err(err(format!(
                    "{key}.every_ms must be longer than duration_ms"
                )));
            }
            blackouts.push(blackout);
        }
        let mut up_steps = Vec::new();
        let mut down_steps = Vec::new();
        for (i, s) in t.timeline.iter().enumerate() {
            let key = format!("timeline[{i}].");
            let at = ms(&format!("{key}at_ms"), s.at_ms, f64::MAX).map_err(err)?;
            let (u, d) = directions(&key, &s.conditions, &s.uplink, &s.downlink).map_err(err)?;
            up_steps.push(Step { at, conditions: u });
            down_steps.push(Step { at, conditions: d });
        }
        let address_change = match t.address_change {
            Some(a) => {
                if a.addresses.len() < 2 {
                    return Err(err("address_change.addresses needs at least two".into()));
                }
                if let Some(bad) = a.addresses.iter().find(|ip| !in_lab_range(**ip)) {
                    return Err(err(format!(
                        "address_change.addresses: {bad} is outside 198.18.0.0/15"
                    )));
                }
                let every = ms("address_change.every_ms", a.every_ms, f64::MAX).map_err(err)?;
                if every < Duration::from_millis(100) {
                    return Err(err("address_change.every_ms must be at least 100".into()));
                }
                Some(AddressChange {
                    host: a.host,
                    addresses: a.addresses,
                    first: ms("address_change.first_ms", a.first_ms, f64::MAX).map_err(err)?,
                    every,
                })
            }
            None => None,
        };
        Ok(Profile {
            name: name.to_string(),
            description: t.description,
            uplink: DirectionSpec {
                conditions: up,
                blackouts: blackouts.clone(),
                timeline: up_steps,
            },
            downlink: DirectionSpec {
                conditions: down,
                blackouts,
                timeline: down_steps,
            },
            address_change,
        })
    }

    /// A shipped profile by name.
    pub fn builtin(name: &str) -> Result<Self, NetlabError> {
        match BUILTIN.iter().find(|(n, _)| *n == name) {
            Some((n, text)) => Self::from_toml_str(n, text),
            None => Err(NetlabError::Profile {
                name: name.to_string(),
                message: format!(
                    "no such built-in profile (have: {}); or give a path to a .toml file",
                    BUILTIN
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }),
        }
    }

    /// A shipped profile by name, or else a TOML file at that path.
    pub fn load(name_or_path: &str) -> Result<Self, NetlabError> {
        if BUILTIN.iter().any(|(n, _)| *n == name_or_path) {
            return Self::builtin(name_or_path);
        }
        let path = std::path::Path::new(name_or_path);
        if !path.exists() {
            return Self::builtin(name_or_path);
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| NetlabError::io(format!("cannot read profile {name_or_path}"), e))?;
        Self::from_toml_str(name_or_path, &text)
    }

    /// A profile with the same conditions in both directions and nothing else.
    pub fn symmetric(name: &str, conditions: Conditions) -> Self {
        let spec = DirectionSpec {
            conditions,
            ..Default::default()
        };
        Profile {
            name: name.to_string(),
            description: String::new(),
            uplink: spec.clone(),
            downlink: spec,
            address_change: None,
        }
    }
}

/// Whether `ip` is in 198.18.0.0/15 (RFC 2544 benchmarking range), the only range the lab uses.
pub fn in_lab_range(ip: Ipv4Addr) -> bool {
    let o = ip.octets();
    o[0] == 198 && (o[1] == 18 || o[1] == 19)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_parses_and_validates() {
        for (name, _) in BUILTIN {
            let p = Profile::builtin(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(p.name, *name);
            assert!(!p.description.is_empty(), "{name} has no description");
        }
    }

    #[test]
    fn builtin_round_trip_times_match_their_names() {
        for (name, rtt_ms) in [
            ("fiber", 10.0),
            ("wifi", 30.0),
            ("4g", 70.0),
            ("lossy", 100.0),
            ("satellite", 600.0),
        ] {
            let p = Profile::builtin(name).expect("builtin parses");
            let rtt = p.uplink.conditions.delay + p.downlink.conditions.delay;
            assert!(
                (rtt.as_secs_f64() * 1000.0 - rtt_ms).abs() < 1e-6,
                "{name}: {rtt:?}"
            );
        }
        let g = Profile::builtin("4g").expect("4g");
        assert_eq!(g.uplink.conditions.rate_bps, Some(20_000_000));
        let mean = g.uplink.conditions.burst_loss.expect("bursty").mean_loss();
        assert!((mean - 0.02).abs() < 0.001, "{mean}");
        let w = Profile::builtin("wifi").expect("wifi");
        let mean = w.uplink.conditions.burst_loss.expect("bursty").mean_loss();
        assert!((mean - 0.01).abs() < 0.001, "{mean}");
    }

    #[test]
    fn bad_values_name_the_key() {
        let e = Profile::from_toml_str("t", "[conditions]\nloss = 1.5\n").unwrap_err();
        assert!(e.to_string().contains("conditions.loss"), "{e}");
        let e = Profile::from_toml_str("t", "[uplink]\ndelay_ms = -1\n").unwrap_err();
        assert!(e.to_string().contains("uplink.delay_ms"), "{e}");
        let e = Profile::from_toml_str("t", "[conditions]\nlos = 0.1\n").unwrap_err();
        assert!(e.to_string().contains("unknown field"), "{e}");
        assert!(Profile::builtin("nope").is_err());
    }

    #[test]
    fn uplink_overrides_only_its_direction() {
        let p = Profile::from_toml_str(
            "t",
            "[conditions]\ndelay_ms = 10\n[uplink]\ndelay_ms = 30\n",
        )
        .expect("valid");
        assert_eq!(p.uplink.conditions.delay, Duration::from_millis(30));
        assert_eq!(p.downlink.conditions.delay, Duration::from_millis(10));
    }
}
