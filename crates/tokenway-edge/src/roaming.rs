//! Roaming: notice when the machine's address towards a gateway changes and move the QUIC
//! endpoint to a fresh socket, so open connections migrate at once.
//!
//! Why the edge has to act: it binds the wildcard address, so after a handover (Wi-Fi to
//! cellular, a DHCP renewal, a VPN coming up) the kernel already sends from the new address.
//! But a client that is only *receiving* a stream sends nothing ack-eliciting; the gateway keeps
//! sending to the old address, nothing comes back to trigger a reply, and the stream stalls
//! until the next keep-alive PING (seconds) reaches the gateway from the new address. Measured
//! on the netlab `handover` profile before this module: 9.4 s stalls. Rebinding makes quinn
//! switch to a fresh connection ID and send a PING from the new address right away; the gateway
//! validates the new path within a round trip and the stream goes on. A TCP fallback connection
//! cannot migrate (its socket keeps the old source address): it is closed and redialed from the
//! new address at once, instead of hanging until HTTP/2's keep-alive gives up (10 s + 10 s).
//!
//! Detection is a poll of the kernel's route choice, not an interface-event subscription: for
//! each gateway a UDP socket is `connect`ed (no packet leaves) and its local address read. That
//! answers exactly the question that matters (which source address would packets to this
//! gateway use now?), costs a few syscalls per interval, needs no netlink and works on every
//! platform. A change from one address to another triggers a rebind; losing the route
//! altogether does not (there is nowhere to send), its return with a different address does.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Weak;
use std::time::Duration;

use tokenway_telemetry::Counter;

use tokenway_transport::tunnel::Tunnel;

/// The source address the kernel would use to reach `dst` now, or `None` without a route.
pub fn route_source(dst: SocketAddr) -> Option<IpAddr> {
    let any: SocketAddr = if dst.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        ([0u16; 8], 0).into()
    };
    let socket = UdpSocket::bind(any).ok()?;
    socket.connect(dst).ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// What one gateway's source address did since the last look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Same address as before (or no route now, or no address known yet).
    None,
    /// A different address than the last one seen: the endpoint should rebind.
    Moved { from: IpAddr, to: IpAddr },
}

/// The last known source address per gateway (sans-IO: fed with [`route_source`] results).
#[derive(Debug, Default)]
pub struct SourceTracker {
    last: Vec<Option<IpAddr>>,
}

impl SourceTracker {
    /// Starts with the current addresses (`None` where there is no route).
    pub fn new(current: Vec<Option<IpAddr>>) -> Self {
        Self { last: current }
    }

    /// Records the addresses seen now; the first gateway whose address moved, if any.
    /// A gateway that lost its route keeps its last address, so a return to the same address
    /// is no move and a return to another one is.
    pub fn observe(&mut self, now: &[Option<IpAddr>]) -> Change {
        let mut change = Change::None;
        for (last, now) in self.last.iter_mut().zip(now) {
            match (*last, *now) {
                (Some(from), Some(to)) if from != to => {
                    if change == Change::None {
                        change = Change::Moved { from, to };
                    }
                    *last = Some(to);
                }
                (None, Some(to)) => *last = Some(to),
                _ => {}
            }
        }
        change
    }
}

/// Polls every `every` while `tunnel` lives; rebinds its endpoint when the source address
/// towards any gateway changes, and counts it.
pub async fn watch(tunnel: Weak<Tunnel>, every: Duration, rebinds: Counter) {
    let gateways = match tunnel.upgrade() {
        Some(t) => t.quic_addrs(),
        None => return,
    };
    if gateways.is_empty() {
        return;
    }
    let look = || {
        gateways
            .iter()
            .map(|g| route_source(*g))
            .collect::<Vec<_>>()
    };
    let mut tracker = SourceTracker::new(look());
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(tunnel) = tunnel.upgrade() else {
            return;
        };
        if let Change::Moved { from, to } = tracker.observe(&look()) {
            let tcp = tunnel.redial_tcp();
            if tcp > 0 {
                tracing::info!(%from, %to, connections = tcp, "local address changed: TCP fallback connections closed, redialing");
            }
            match tunnel.rebind() {
                Ok(local) => {
                    rebinds.inc();
                    tracing::info!(%from, %to, %local, "local address changed: QUIC endpoint rebound, connections migrate");
                }
                Err(e) => {
                    tracing::warn!(%from, %to, error = %e, "local address changed but the rebind failed")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().expect("ip"))
    }

    #[test]
    fn a_new_address_is_a_move_and_the_same_one_is_not() {
        let mut t = SourceTracker::new(vec![ip("198.18.0.1")]);
        assert_eq!(t.observe(&[ip("198.18.0.1")]), Change::None);
        assert_eq!(
            t.observe(&[ip("198.18.0.5")]),
            Change::Moved {
                from: "198.18.0.1".parse().expect("ip"),
                to: "198.18.0.5".parse().expect("ip"),
            }
        );
        assert_eq!(t.observe(&[ip("198.18.0.5")]), Change::None);
    }

    #[test]
    fn losing_the_route_is_no_move_and_coming_back_elsewhere_is() {
        let mut t = SourceTracker::new(vec![ip("10.0.0.2")]);
        assert_eq!(t.observe(&[None]), Change::None);
        assert_eq!(t.observe(&[ip("10.0.0.2")]), Change::None);
        assert_eq!(t.observe(&[None]), Change::None);
        assert!(matches!(t.observe(&[ip("10.0.0.9")]), Change::Moved { .. }));
    }

    #[test]
    fn a_first_route_is_learned_without_a_rebind() {
        let mut t = SourceTracker::new(vec![None, ip("10.0.0.2")]);
        assert_eq!(t.observe(&[ip("192.0.2.1"), ip("10.0.0.2")]), Change::None);
        assert!(matches!(
            t.observe(&[ip("192.0.2.7"), ip("10.0.0.2")]),
            Change::Moved { .. }
        ));
    }

    #[test]
    fn loopback_gateways_have_a_loopback_source() {
        assert_eq!(
            route_source("127.0.0.1:4433".parse().expect("addr")),
            ip("127.0.0.1")
        );
    }
}
