//! The tunnel's switchable congestion controller, and how its rate is settled after the
//! handshake.
//!
//! Every tunnel connection (an endpoint with a datagram layer) runs a [`Switchable`]
//! controller: a base controller (cubic by default, bbr or new_reno) and a [`Brutal`] one fed
//! side by side; the window is brutal's while a brutal rate is set, the base's otherwise. The
//! rate lives in a [`RateHandle`] shared by the controller and its clones.
//!
//! **Reaching a connection's handle.** quinn does not expose a connection's controller, but
//! `quinn::Connection::congestion_state()` returns a clone of it, and a clone of a
//! [`Switchable`] shares the original's `Arc<RateHandle>`. So [`rate_handle`] downcasts that
//! clone and returns the handle: no registry, no map to bound, nothing to clean up when the
//! connection ends. A path migration that keeps the IPv4 address keeps the controller,
//! cloned, so the handle follows it; any other (a new IP, any IPv6 or IPv4-mapped address,
//! as on a gateway bound to `[::]`) resets the path, and quinn builds a fresh controller from
//! the configured plan: on the gateway, the base controller until the edge's next request
//! advertises its rate again. So the gateway looks the handle up per request and never keeps
//! it.
//!
//! **Negotiation (Hysteria 2 style).** The edge advertises what it can receive in the header
//! [`RX_RATE_HEADER`] (`tw-rx-rate: <bytes per second>`, from its `bandwidth.down`) on every
//! tunnel request. The gateway's tunnel code, once the request is authenticated, calls
//! [`RateHandle::apply_peer_rx_rate`] with it: if the gateway's tunnel `cc` is `brutal`, the
//! connection switches to brutal at `min(edge rx, gateway bandwidth.up)`, less the FEC repair
//! reserve. Without the header (or with another `cc`) the gateway stays on the base controller.
//! The other direction is settled the same way round: the gateway's tunnel port answers every
//! authenticated request with its own receive rate in the same header (from its
//! `bandwidth.down`, when set), and the edge's QUIC client applies it as it reads the answer's
//! head. An edge with `cc = "brutal"` starts at its `bandwidth.up` (less the reserve) and from
//! its first answer on sends at `min(edge bandwidth.up, gateway rx)`: an edge configured for
//! more than the gateway's link takes does not flood it. The header is consumed on both ends
//! (the gateway replaces whatever a backend's answer carried under that name; the edge never
//! hands it to its client).
//!
//! **Repair bytes.** quinn never sees the datagram layer's repair packets, so its window counts
//! only QUIC bytes. Brutal accounts for them by reservation: the rate given to QUIC is the
//! configured wire rate less [`DatagramSettings::repair_reserve`], the most repair traffic the
//! FEC sender's byte budget can add on top (`fec_max_overhead` × the FEC-covered source rate).
//! The repairs outside that budget (a head's extra copies, a sparse block's repairs beyond the
//! first) are not reserved: they come with pauses and sparse packets, which a link filled to
//! its brutal rate does not have.
//! Under cubic (and new_reno) the repairs take their share of the window instead: the layer's RTT
//! follower ([`crate::datagram::LayerSlot::follow_rtt`]) measures, every 100 ms, the repair
//! bytes sent to the peer per source byte, and sets it on the handle
//! ([`RateHandle::set_repair_share`]); the window QUIC gets is the base controller's divided by
//! 1 + that share, so QUIC's bytes and their repairs together fill the base window (a cubic
//! connection with FEC put up to 1.5 × its window, and more with a head's extra copies, on
//! the wire, and took that much more than its share of a link from a plain one). A repair lost
//! to congestion is still not seen by QUIC's loss detection: only QUIC packets lost beyond what
//! FEC restores are. bbr is left alone: it sizes its window from the delivery rate of QUIC's
//! bytes, which already leaves out what the repairs took of the link, so a share would count
//! them twice and take away the headroom bbr probes with.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use quinn::congestion::{Controller, ControllerFactory};

use crate::brutal::Brutal;
use crate::settings::{base_factory, CongestionControl, DatagramSettings};

/// Header in which the edge advertises its receive rate, bytes per second (decimal).
pub const RX_RATE_HEADER: &str = "tw-rx-rate";

/// Smallest brutal rate accepted from a peer (8 kbit/s); anything lower is ignored.
pub const MIN_PEER_RATE: u64 = 1_000;

/// Most repair bytes per source byte the base controller's window is shared with: it gives
/// QUIC at least half of it.
pub const MAX_REPAIR_SHARE: f64 = 1.0;

/// The brutal rate of one connection, shared by its controller and the code that negotiates,
/// and the repair share of its window.
#[derive(Debug)]
pub struct RateHandle {
    /// Brutal rate in bytes per second; 0 = brutal off (base controller).
    rate: AtomicU64,
    /// Repair bytes sent per source byte, lately, in millionths (see the module docs).
    repair_share_ppm: AtomicU64,
    /// The local send capacity that caps a negotiated rate; `None` = this end does not switch
    /// on a peer's advertisement.
    cap: Option<u64>,
    settings: Arc<DatagramSettings>,
}

impl RateHandle {
    /// The brutal rate given to QUIC (bytes per second), if brutal is on.
    pub fn rate(&self) -> Option<u64> {
        match self.rate.load(Ordering::Relaxed) {
            0 => None,
            r => Some(r),
        }
    }

    /// Switches to brutal at `wire_rate` bytes per second on the wire (the repair reserve is
    /// taken off), or back to the base controller with `None`.
    pub fn set_wire_rate(&self, wire_rate: Option<u64>) {
        let r = wire_rate
            .map(|w| w.saturating_sub(self.settings.repair_reserve(w)).max(1))
            .unwrap_or(0);
        self.rate.store(r, Ordering::Relaxed);
    }

    /// Sets the repair bytes the datagram layer sends lately per source byte (clamped to
    /// `0..=`[`MAX_REPAIR_SHARE`]): the base controller's window is shared with them.
    pub fn set_repair_share(&self, share: f64) {
        let share = if share.is_finite() {
            share.clamp(0.0, MAX_REPAIR_SHARE)
        } else {
            0.0
        };
        self.repair_share_ppm
            .store((share * 1e6) as u64, Ordering::Relaxed);
    }

    /// The repair share last set.
    pub fn repair_share(&self) -> f64 {
        self.repair_share_ppm.load(Ordering::Relaxed) as f64 / 1e6
    }

    /// Whether this end switches to brutal on a peer's advertisement (its `cc` is brutal).
    pub fn negotiates(&self) -> bool {
        self.cap.is_some()
    }

    /// Applies a peer's advertised receive rate (bytes per second): brutal at
    /// `min(peer rx, local bandwidth.up)` if this end's `cc` is brutal. Returns the rate set.
    pub fn apply_peer_rx(&self, peer_rx: u64) -> Option<u64> {
        let cap = self.cap?;
        if peer_rx < MIN_PEER_RATE {
            return None;
        }
        self.set_wire_rate(Some(peer_rx.min(cap)));
        self.rate()
    }

    /// Reads [`RX_RATE_HEADER`] from a request's (gateway) or an answer's (edge) headers and
    /// removes it, applying it with
    /// [`Self::apply_peer_rx`]. A missing or unreadable value changes nothing.
    pub fn apply_peer_rx_rate(&self, headers: &mut http::HeaderMap) -> Option<u64> {
        let v = headers.remove(RX_RATE_HEADER)?;
        let rate = v.to_str().ok()?.trim().parse::<u64>().ok()?;
        self.apply_peer_rx(rate)
    }
}

/// The rate handle of a connection running on a tunnel endpoint (`None` for other
/// connections). See the module docs for why this works.
pub fn rate_handle(conn: &quinn::Connection) -> Option<Arc<RateHandle>> {
    conn.congestion_state()
        .into_any()
        .downcast::<Switchable>()
        .ok()
        .map(|s| s.handle.clone())
}

/// What a new connection's controller does about brutal.
#[derive(Clone, Debug)]
pub struct BrutalPlan {
    /// Brutal rate for QUIC from the start (bytes/s), if any (the edge with `cc = "brutal"`).
    pub initial: Option<u64>,
    /// Cap on a peer-negotiated rate (either end with `cc = "brutal"`: its `bandwidth.up`).
    pub cap: Option<u64>,
    /// The layer's settings (for the repair reserve).
    pub settings: Arc<DatagramSettings>,
}

/// The factory of [`Switchable`] controllers.
#[derive(Debug)]
pub struct SwitchableConfig {
    base: CongestionControl,
    plan: BrutalPlan,
}

impl SwitchableConfig {
    /// Controllers on `base` (cubic, bbr, new_reno) following `plan` for brutal.
    pub fn new(base: CongestionControl, plan: BrutalPlan) -> Self {
        Self { base, plan }
    }
}

impl ControllerFactory for SwitchableConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        let handle = Arc::new(RateHandle {
            rate: AtomicU64::new(self.plan.initial.unwrap_or(0)),
            repair_share_ppm: AtomicU64::new(0),
            cap: self.plan.cap,
            settings: self.plan.settings.clone(),
        });
        Box::new(Switchable {
            base: base_factory(self.base).build(now, current_mtu),
            // bbr's window comes from the delivery rate of QUIC's own bytes, which the repairs
            // already hold down: sharing it again would count them twice.
            shares_window: self.base != CongestionControl::Bbr,
            brutal: Brutal::new(self.plan.initial.unwrap_or(0), now, current_mtu),
            handle,
            last_now: now,
            mtu: current_mtu,
        })
    }
}

/// A controller that is the base one or brutal, as its [`RateHandle`] says.
pub struct Switchable {
    base: Box<dyn Controller>,
    brutal: Brutal,
    handle: Arc<RateHandle>,
    last_now: Instant,
    mtu: u16,
    /// Whether the base window is shared with the repairs (loss-based controllers).
    shares_window: bool,
}

impl std::fmt::Debug for Switchable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Switchable")
            .field("brutal_rate", &self.handle.rate())
            .finish_non_exhaustive()
    }
}

impl Switchable {
    /// The shared rate handle.
    pub fn handle(&self) -> &Arc<RateHandle> {
        &self.handle
    }

    fn touch(&mut self, now: Instant) {
        if now > self.last_now {
            self.last_now = now;
        }
    }
}

impl Controller for Switchable {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.touch(now);
        self.base.on_sent(now, bytes, last_packet_number);
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        self.touch(now);
        if let Some(rate) = self.handle.rate() {
            // The gain compares deliveries with the rate in force.
            self.brutal.set_rate(rate);
        }
        self.brutal.on_rtts(now, rtt.conservative(), rtt.get());
        self.brutal.on_acked_app(now, bytes, app_limited);
        self.base.on_ack(now, sent, bytes, app_limited, rtt);
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        self.touch(now);
        self.base
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
    }

    fn on_congestion_event(
        &mut self,
        now: Instant,
        sent: Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.touch(now);
        self.brutal.on_lost(now, lost_bytes);
        self.base
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.mtu = new_mtu;
        self.brutal.set_mtu(new_mtu);
        self.base.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        match self.handle.rate() {
            // Brutal's rate already has the repairs' reserve taken off.
            Some(rate) => self.brutal.window_with_rate(rate, self.last_now),
            None if !self.shares_window => self.base.window(),
            None => {
                // QUIC's bytes and their repairs share the base window; QUIC keeps at least
                // the two packets quinn's controllers never go below.
                let base = self.base.window();
                let shared = (base as f64 / (1.0 + self.handle.repair_share())) as u64;
                shared.max(base.min(2 * u64::from(self.mtu)))
            }
        }
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(Switchable {
            base: self.base.clone_box(),
            brutal: self.brutal.clone(),
            handle: self.handle.clone(),
            last_now: self.last_now,
            mtu: self.mtu,
            shares_window: self.shares_window,
        })
    }

    fn initial_window(&self) -> u64 {
        match self.handle.rate() {
            Some(_) => self.window(),
            None => self.base.initial_window(),
        }
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{Bandwidth, BandwidthSettings, FecSetting};
    use tokenway_wire::fec::FecMode;

    fn settings(brutal: bool) -> DatagramSettings {
        DatagramSettings {
            fec: FecSetting(FecMode::Off),
            cc: brutal.then_some(CongestionControl::Brutal),
            bandwidth: BandwidthSettings {
                up: Some(Bandwidth(1_000_000)),
                down: Some(Bandwidth(4_000_000)),
            },
            ..DatagramSettings::default()
        }
    }

    fn controller(s: &DatagramSettings, client: bool) -> Box<dyn Controller> {
        Arc::new(SwitchableConfig::new(
            CongestionControl::Cubic,
            s.brutal_plan(client),
        ))
        .build(Instant::now(), 1200)
    }

    fn handle(c: &dyn Controller) -> Arc<RateHandle> {
        c.clone_box()
            .into_any()
            .downcast::<Switchable>()
            .expect("a switchable controller")
            .handle
            .clone()
    }

    #[test]
    fn cubics_window_is_shared_with_the_repairs_and_bbrs_and_brutals_are_not() {
        let s = settings(false);
        let c = controller(&s, false);
        let base = c.window();
        let h = handle(c.as_ref());
        h.set_repair_share(0.5);
        assert_eq!(c.window(), (base as f64 / 1.5) as u64);
        // Clamped: QUIC keeps at least half, and garbage counts as none.
        h.set_repair_share(7.0);
        assert_eq!(c.window(), base / 2);
        h.set_repair_share(f64::NAN);
        assert_eq!(c.window(), base);
        // bbr's window already reflects the repairs (its delivery rate): no share.
        let c = Arc::new(SwitchableConfig::new(
            CongestionControl::Bbr,
            settings(false).brutal_plan(false),
        ))
        .build(Instant::now(), 1200);
        let bbr = c.window();
        handle(c.as_ref()).set_repair_share(0.5);
        assert_eq!(c.window(), bbr);
        // Brutal's rate has the repair reserve taken off already: no second share.
        let s = settings(true);
        let c = controller(&s, true);
        let h = handle(c.as_ref());
        let brutal = c.window();
        h.set_repair_share(0.5);
        assert_eq!(c.window(), brutal);
    }

    #[test]
    fn server_switches_to_brutal_at_the_smaller_of_peer_rx_and_its_up() {
        let s = settings(true);
        let c = controller(&s, false);
        let cubic_window = c.window();
        let h = handle(c.as_ref());
        assert_eq!(h.rate(), None, "the gateway waits for the edge's rate");
        let mut headers = http::HeaderMap::new();
        headers.insert(RX_RATE_HEADER, "250000".parse().unwrap());
        assert_eq!(h.apply_peer_rx_rate(&mut headers), Some(250_000));
        assert!(headers.is_empty(), "the header is consumed");
        assert_ne!(c.window(), cubic_window, "the clone shares the handle");
        assert_eq!(h.apply_peer_rx(9_000_000), Some(1_000_000), "capped by up");
        assert_eq!(h.apply_peer_rx(10), None, "absurd rates are ignored");
    }

    #[test]
    fn client_with_brutal_starts_at_its_up_and_others_never_switch() {
        let c = controller(&settings(true), true);
        assert_eq!(handle(c.as_ref()).rate(), Some(1_000_000));
        let c = controller(&settings(false), false);
        let h = handle(c.as_ref());
        assert_eq!(h.apply_peer_rx(500_000), None, "cc is not brutal here");
        assert_eq!(h.rate(), None);
    }

    #[test]
    fn repair_reserve_is_taken_off_the_brutal_rate() {
        let s = DatagramSettings {
            fec: FecSetting(FecMode::Auto),
            fec_scope: crate::settings::FecScopeSetting::All,
            fec_max_overhead: 0.5,
            ..settings(true)
        };
        let c = controller(&s, true);
        // W = q · 1.5 → q = 2/3 W.
        assert_eq!(handle(c.as_ref()).rate(), Some(666_667));
    }
}
