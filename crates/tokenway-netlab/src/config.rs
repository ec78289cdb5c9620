//! The lab's topology: N hosts (one network namespace each) on a graph of emulated links.
//!
//! Today the CLI wires two hosts, `client` and `server`, joined by one link whose conditions
//! come from a [`Profile`]; the types already allow more hosts and links (a later issue adds a
//! far backend region as a third namespace). Every host gets one TUN device in its namespace;
//! the emulator forwards a packet from host A's device to the device of the host that owns the
//! destination address, through the model of the A→B direction of their link.

use std::net::Ipv4Addr;

use crate::model::DirectionSpec;
use crate::profile::{in_lab_range, AddressChange, Profile};
use crate::NetlabError;

/// Default name prefix of everything the lab creates.
pub const DEFAULT_PREFIX: &str = "twlab";
/// Name of the client-side host.
pub const CLIENT: &str = "client";
/// Name of the server-side host.
pub const SERVER: &str = "server";
/// The client's address (first of its addresses).
pub const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The server's address.
pub const SERVER_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
/// The range routed through the lab inside every namespace (RFC 2544 benchmarking range).
pub const LAB_NET: &str = "198.18.0.0/15";
/// MTU of the TUN devices.
pub const MTU: usize = 1500;

/// One host: a namespace `{prefix}-{name}` with a TUN device of the same name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSpec {
    /// Short name (`client`, `server`): lowercase letters and digits, at most 6.
    pub name: String,
    /// Addresses routed to this host. The first is configured at start; others appear only
    /// through an address change.
    pub addresses: Vec<Ipv4Addr>,
}

/// A link between two hosts, with a model per direction.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkSpec {
    /// One end (host name).
    pub a: String,
    /// The other end (host name).
    pub b: String,
    /// Conditions of packets from `a` to `b`.
    pub a_to_b: DirectionSpec,
    /// Conditions of packets from `b` to `a`.
    pub b_to_a: DirectionSpec,
}

/// Everything needed to bring a lab up.
#[derive(Debug, Clone, PartialEq)]
pub struct LabConfig {
    /// Prefix of namespace and device names: lowercase letters and digits, at most 8.
    pub prefix: String,
    /// The hosts.
    pub hosts: Vec<HostSpec>,
    /// The links.
    pub links: Vec<LinkSpec>,
    /// Seed of every random decision (each link direction derives its own).
    pub seed: u64,
    /// Periodic address changes.
    pub address_changes: Vec<AddressChange>,
    /// Run the emulator thread at real-time priority (SCHED_FIFO) when allowed; keeps release
    /// times accurate while the machine is busy.
    pub realtime: bool,
    /// Name of the profile, for status output.
    pub profile_name: String,
}

impl LabConfig {
    /// Two hosts, `client` (198.18.0.1) and `server` (198.18.0.2), joined by a link with the
    /// conditions of `profile` (uplink = client to server).
    pub fn from_profile(prefix: &str, profile: &Profile, seed: u64) -> Self {
        let mut client = HostSpec {
            name: CLIENT.into(),
            addresses: vec![CLIENT_ADDR],
        };
        let mut server = HostSpec {
            name: SERVER.into(),
            addresses: vec![SERVER_ADDR],
        };
        if let Some(change) = &profile.address_change {
            let host = if change.host == SERVER {
                &mut server
            } else {
                &mut client
            };
            host.addresses = change.addresses.clone();
        }
        LabConfig {
            prefix: prefix.into(),
            hosts: vec![client, server],
            links: vec![LinkSpec {
                a: CLIENT.into(),
                b: SERVER.into(),
                a_to_b: profile.uplink.clone(),
                b_to_a: profile.downlink.clone(),
            }],
            seed,
            address_changes: profile.address_change.iter().cloned().collect(),
            realtime: true,
            profile_name: profile.name.clone(),
        }
    }

    /// Name of a host's namespace and of its TUN device.
    pub fn namespace(&self, host: &str) -> String {
        namespace_name(&self.prefix, host)
    }

    /// Index of a host by name.
    pub fn host_index(&self, host: &str) -> Option<usize> {
        self.hosts.iter().position(|h| h.name == host)
    }

    /// Checks names, addresses and the link graph.
    pub fn validate(&self) -> Result<(), NetlabError> {
        let bad = |m: String| Err(NetlabError::Config(m));
        validate_prefix(&self.prefix)?;
        if self.hosts.is_empty() {
            return bad("at least one host is needed".into());
        }
        let mut seen_addr = Vec::new();
        for (i, h) in self.hosts.iter().enumerate() {
            if h.name.is_empty()
                || h.name.len() > 6
                || !h
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            {
                return bad(format!(
                    "host name {:?}: use 1 to 6 lowercase letters or digits",
                    h.name
                ));
            }
            if self.hosts[..i].iter().any(|o| o.name == h.name) {
                return bad(format!("host {:?} appears twice", h.name));
            }
            if h.addresses.is_empty() {
                return bad(format!("host {:?} has no address", h.name));
            }
            for a in &h.addresses {
                if !in_lab_range(*a) {
                    return bad(format!(
                        "host {:?}: address {a} is outside {LAB_NET}",
                        h.name
                    ));
                }
                if seen_addr.contains(a) {
                    return bad(format!("address {a} is used twice"));
                }
                seen_addr.push(*a);
            }
        }
        for (i, l) in self.links.iter().enumerate() {
            for end in [&l.a, &l.b] {
                if self.host_index(end).is_none() {
                    return bad(format!("link {i}: no host named {end:?}"));
                }
            }
            if l.a == l.b {
                return bad(format!("link {i} joins {:?} to itself", l.a));
            }
            if self.links[..i]
                .iter()
                .any(|o| (o.a == l.a && o.b == l.b) || (o.a == l.b && o.b == l.a))
            {
                return bad(format!("two links join {:?} and {:?}", l.a, l.b));
            }
        }
        for c in &self.address_changes {
            let Some(h) = self.host_index(&c.host) else {
                return bad(format!("address_change: no host named {:?}", c.host));
            };
            if c.addresses
                .iter()
                .any(|a| !self.hosts[h].addresses.contains(a))
            {
                return bad(format!(
                    "address_change: every address must belong to host {:?}",
                    c.host
                ));
            }
        }
        Ok(())
    }
}

/// `{prefix}-{host}`: the namespace and TUN device name of a host.
pub fn namespace_name(prefix: &str, host: &str) -> String {
    format!("{prefix}-{host}")
}

/// A prefix is 1 to 8 lowercase letters or digits (so `{prefix}-{host}` fits the 15-byte
/// interface name limit and never matches another lab's names).
pub fn validate_prefix(prefix: &str) -> Result<(), NetlabError> {
    if prefix.is_empty()
        || prefix.len() > 8
        || !prefix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Err(NetlabError::Config(format!(
            "name {prefix:?}: use 1 to 8 lowercase letters or digits"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handover_profile_gives_the_client_both_addresses() {
        let p = Profile::builtin("handover").expect("builtin");
        let c = LabConfig::from_profile("twlab", &p, 1);
        c.validate().expect("valid");
        assert_eq!(
            c.hosts[0].addresses,
            vec![CLIENT_ADDR, Ipv4Addr::new(198, 18, 0, 5)]
        );
        assert_eq!(c.namespace(CLIENT), "twlab-client");
    }

    #[test]
    fn bad_names_and_addresses_are_rejected() {
        let p = Profile::builtin("fiber").expect("builtin");
        let mut c = LabConfig::from_profile("TW-lab", &p, 1);
        assert!(c.validate().is_err());
        c.prefix = "twlab".into();
        c.hosts[1].addresses = vec![Ipv4Addr::new(10, 0, 0, 1)];
        assert!(c.validate().unwrap_err().to_string().contains("outside"));
    }
}
