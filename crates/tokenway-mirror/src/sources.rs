//! The set of sources a pull draws from, and the order it tries them in.
//!
//! For each piece: peers that hold it first (rotating among them so load spreads), then
//! mirrors by measured RTT, then the origin. A mirror that did not answer its RTT probes, and
//! a mirror or peer that failed [`DEMOTE_AFTER_ERRORS`] requests in a row (a timeout, a
//! silence abandoned for a hedge, an error status), is *demoted*: tried after every healthy
//! source, the origin included, until it answers again. The manifest and outboards are asked
//! in the same order. A source that serves a corrupt piece is penalised; after
//! [`BAN_AFTER_CORRUPT`] corrupt pieces it is only tried when nothing else is left. Peers come
//! and go as the mirror's announcements say.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use object_store::ObjectStore;

use crate::auth::AccessToken;
use crate::http_client::{any_https, base_url, client, HttpClient};
use crate::lock;
use crate::manifest::{Blake3Hash, Manifest, ModelRef};
use crate::mirror::peers::PeerView;
use crate::piece_bits::PieceBits;
use crate::pull;
use crate::source::{manifest_error, FetchError, Source, SourceKind};
use crate::tls::ClientTrust;
use crate::MirrorError;

/// Corrupt pieces after which a source is a last resort.
pub const BAN_AFTER_CORRUPT: u32 = 3;
/// Consecutive failures after which a mirror drops behind the others.
pub const DEMOTE_AFTER_ERRORS: u32 = 3;
/// Peers kept at once.
pub const MAX_PEERS: usize = 256;
/// How often a demoted mirror is given one more try ahead of the origin: it may have been
/// restarting, and nothing else would ask it again (hedges stop once the origin answers
/// steadily), so a fleet that lost its mirror for 20 s pulled the rest of the model from the
/// origin.
pub const RETRY_DEMOTED: Duration = Duration::from_secs(30);

/// One source with its record.
pub struct SourceState {
    /// `origin`, `mirror http://..`, `peer http://..`.
    pub name: String,
    /// How to fetch.
    pub source: Source,
    /// Measured RTT (mirrors).
    pub rtt: Option<Duration>,
    /// Corrupt pieces served.
    pub corrupt: AtomicU32,
    /// Failed requests in a row.
    pub consecutive_errors: AtomicU32,
    /// Failed requests in all, for the summary.
    pub failures: AtomicU32,
    /// A mirror that did not answer its RTT probes and has not answered since.
    unresponsive: AtomicBool,
    /// Since when a demoted mirror has been passed over (its next try is [`RETRY_DEMOTED`]
    /// later).
    passed_over: Mutex<Option<Instant>>,
    /// Verified bytes taken from it.
    pub bytes: AtomicU64,
}

impl SourceState {
    pub(crate) fn new(name: String, source: Source, rtt: Option<Duration>) -> Arc<Self> {
        Arc::new(Self {
            unresponsive: AtomicBool::new(source.kind() == SourceKind::Mirror && rtt.is_none()),
            passed_over: Mutex::new(None),
            rtt,
            corrupt: AtomicU32::new(0),
            consecutive_errors: AtomicU32::new(0),
            failures: AtomicU32::new(0),
            bytes: AtomicU64::new(0),
            name,
            source,
        })
    }

    /// Kind of source.
    pub fn kind(&self) -> SourceKind {
        self.source.kind()
    }

    fn banned(&self) -> bool {
        self.corrupt.load(Ordering::Relaxed) >= BAN_AFTER_CORRUPT
    }

    /// Not answering: no RTT at start, or [`DEMOTE_AFTER_ERRORS`] failed requests in a row.
    /// Tried after every healthy source until it answers again. Free of side effects; the
    /// piece path asks [`Self::demoted_taking_turn`].
    pub fn demoted(&self) -> bool {
        self.unresponsive.load(Ordering::Relaxed)
            || self.consecutive_errors.load(Ordering::Relaxed) >= DEMOTE_AFTER_ERRORS
    }

    /// [`Self::demoted`], except that a demoted mirror is not demoted for one asking every
    /// [`RETRY_DEMOTED`]: the piece that asked tries it first again. Only the ordering of a
    /// piece's sources asks this, once per source; every other caller asks
    /// [`Self::demoted`], so the turn is not used up where nothing tries the mirror (the
    /// announcer asked every 300 ms, and a sort asked it once per comparison and placed the
    /// mirror both before and after the origin).
    pub(crate) fn demoted_taking_turn(&self) -> bool {
        self.demoted_taking_turn_at(Instant::now())
    }

    fn demoted_taking_turn_at(&self, now: Instant) -> bool {
        let down = self.demoted();
        if !down || self.kind() != SourceKind::Mirror {
            return down;
        }
        let mut since = lock(&self.passed_over);
        match *since {
            Some(t) if now.saturating_duration_since(t) >= RETRY_DEMOTED => {
                *since = Some(now);
                false
            }
            Some(_) => true,
            None => {
                *since = Some(now);
                true
            }
        }
    }

    /// Records a verified piece.
    pub fn ok(&self, bytes: u64) {
        self.answered();
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Records an answer (a piece, a manifest, an outboard): the source is healthy again.
    pub fn answered(&self) {
        self.consecutive_errors.store(0, Ordering::Relaxed);
        self.unresponsive.store(false, Ordering::Relaxed);
        *lock(&self.passed_over) = None;
    }

    /// Records a failed request.
    pub fn failed(&self) {
        self.consecutive_errors.fetch_add(1, Ordering::Relaxed);
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a request that could not even connect: a peer that refuses connections (gone
    /// away, or never there) is demoted at once, not after [`DEMOTE_AFTER_ERRORS`] tries.
    pub fn unreachable(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        if self.kind() == SourceKind::Peer {
            self.consecutive_errors
                .fetch_max(DEMOTE_AFTER_ERRORS, Ordering::Relaxed);
        } else {
            self.consecutive_errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records a piece that failed verification.
    pub fn penalise(&self) {
        self.corrupt.fetch_add(1, Ordering::Relaxed);
    }
}

struct Peer {
    state: Arc<SourceState>,
    have: HashMap<Blake3Hash, PieceBits>,
    /// Pieces it was fetching at its last announcement.
    taking: HashMap<Blake3Hash, PieceBits>,
}

/// Every source of one pull.
pub struct SourceSet {
    /// Mirrors by RTT, then the origin, then mirrors that did not answer their RTT probes.
    fixed: Vec<Arc<SourceState>>,
    peers: Mutex<HashMap<String, Peer>>,
    /// Peers used and gone from the view: for the summary, and so that one that returns
    /// gets its state back (the latest MAX_PEERS).
    retired: Mutex<Vec<Arc<SourceState>>>,
    rotate: AtomicUsize,
    /// Address of this node's own peer server, never used as a source.
    own_addr: Option<String>,
    /// The client every HTTP source (mirrors, peers) is asked through.
    client: Arc<HttpClient>,
}

impl SourceSet {
    /// Only the origin (the plain `pull --origin`).
    pub fn origin_only(store: Arc<dyn ObjectStore>) -> Self {
        Self {
            fixed: vec![SourceState::new(
                "origin".into(),
                Source::Origin(store),
                None,
            )],
            peers: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            rotate: AtomicUsize::new(0),
            own_addr: None,
            client: Arc::new(client(None, None)),
        }
    }

    /// Mirrors (RTT measured now, with `probes` requests each) and an optional origin; mirrors
    /// and peers are sent `token`, `https://` mirrors checked against `trust`.
    pub async fn new(
        mirrors: &[String],
        origin: Option<Arc<dyn ObjectStore>>,
        probes: u32,
        own_addr: Option<String>,
        token: Option<AccessToken>,
        trust: &ClientTrust,
    ) -> Result<Self, MirrorError> {
        if mirrors.is_empty() && origin.is_none() {
            return Err(MirrorError::Config {
                field: "--mirror/--origin".into(),
                reason: "give at least one mirror or an origin".into(),
            });
        }
        let tls = any_https(mirrors)
            .then(|| trust.client_config())
            .transpose()?;
        let http = Arc::new(client(token, tls));
        let mut ms = Vec::new();
        for m in mirrors {
            let base = base_url(m).map_err(|reason| MirrorError::Config {
                field: "--mirror".into(),
                reason,
            })?;
            ms.push(Source::http(SourceKind::Mirror, base, http.clone()));
        }
        let rtts = futures_util::future::join_all(ms.iter().map(|s| s.rtt(probes))).await;
        let mut fixed: Vec<Arc<SourceState>> = ms
            .into_iter()
            .zip(rtts)
            .map(|(s, rtt)| {
                let name = match &s {
                    Source::Http { base, .. } => format!("mirror {base}"),
                    Source::Origin(_) => "origin".into(),
                };
                SourceState::new(name, s, rtt)
            })
            .collect();
        fixed.sort_by_key(|s| s.rtt.unwrap_or(Duration::MAX));
        if let Some(o) = origin {
            let at = fixed.iter().take_while(|s| s.rtt.is_some()).count();
            fixed.insert(
                at,
                SourceState::new("origin".into(), Source::Origin(o), None),
            );
        }
        Ok(Self {
            fixed,
            peers: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            rotate: AtomicUsize::new(0),
            own_addr,
            client: http,
        })
    }

    /// Mirrors in preference order (demoted ones last).
    pub fn mirrors(&self) -> Vec<Arc<SourceState>> {
        self.fixed_in_order()
            .into_iter()
            .filter(|s| s.kind() == SourceKind::Mirror)
            .collect()
    }

    /// Mirrors and the origin, best first: healthy mirrors by RTT, the origin, then demoted
    /// mirrors (stable, so RTT order holds among equals).
    fn fixed_in_order(&self) -> Vec<Arc<SourceState>> {
        let mut v = self.fixed.to_vec();
        // Each key read once: the atomics may change while the sort runs, and a key that
        // changes between comparisons breaks the sort's total order (which may panic).
        v.sort_by_cached_key(|s| (s.demoted(), s.kind() == SourceKind::Origin));
        v
    }

    /// The manifest, its format-3 outboards attached ([`Self::attach_outboards`]): from the
    /// origin when the pull has one (it is what every piece and outboard is verified against,
    /// and the origin is the one source the pull authenticates; a few kilobytes), else, or
    /// when the origin does not answer, from the mirrors in RTT order. A mirror saying the
    /// model, tag or revision does not exist is believed (it asked the origin).
    pub async fn resolve(&self, mref: &ModelRef) -> Result<Manifest, MirrorError> {
        let mut m = self.manifest(mref).await?;
        self.attach_outboards(&mut m).await?;
        Ok(m)
    }

    /// Reads the piece CVs of every format-3 file of more than one piece out of its outboard,
    /// asking the mirrors, then the origin: an outboard that does not verify against the file
    /// hash counts as corrupt for its source, and the next source is asked.
    pub async fn attach_outboards(&self, m: &mut Manifest) -> Result<(), MirrorError> {
        let view = Manifest {
            files: Vec::new(),
            ..m.clone()
        };
        for f in m.files.iter_mut().filter(|f| f.needs_outboard()) {
            let mut failures = Vec::new();
            for s in &self.fixed_in_order() {
                match s.source.outboard(&view, f).await {
                    Ok(ob) => match f.attach_outboard(&ob) {
                        Ok(()) => {
                            s.answered();
                            break;
                        }
                        Err(e) => {
                            s.penalise();
                            failures.push(format!("{}: outboard does not verify: {e}", s.name));
                        }
                    },
                    Err(e) => {
                        s.failed();
                        failures.push(format!("{}: {e}", s.name));
                    }
                }
            }
            if f.needs_outboard() {
                return Err(MirrorError::Remote {
                    url: "every source".into(),
                    reason: format!(
                        "cannot get a verified outboard of {} (blob {}): {}",
                        f.path,
                        f.hash,
                        failures.join("; ")
                    ),
                });
            }
        }
        Ok(())
    }

    async fn manifest(&self, mref: &ModelRef) -> Result<Manifest, MirrorError> {
        let mut failures = Vec::new();
        let mut order = self.fixed_in_order();
        order.sort_by_key(|s| s.kind() != SourceKind::Origin);
        let mut origin_failed = None;
        for s in &order {
            match &s.source {
                Source::Origin(store) => match pull::resolve(store.as_ref(), mref).await {
                    Ok(m) => return Ok(m),
                    Err(e @ (MirrorError::NotFound { .. } | MirrorError::Manifest { .. })) => {
                        return Err(e)
                    }
                    Err(e) => {
                        origin_failed = Some(e.to_string());
                        failures.push(format!("origin: {e}"));
                    }
                },
                Source::Http { .. } => match s.source.manifest(mref).await {
                    Ok(m) => {
                        s.answered();
                        if let Some(why) = &origin_failed {
                            tracing::warn!(mirror = %s.name, origin = %why, "the origin did not answer: the manifest, which every piece is verified against, comes from a mirror");
                        }
                        return Ok(m);
                    }
                    Err(e @ (FetchError::NotFound(_) | FetchError::BadRequest(_))) => {
                        return Err(manifest_error(&s.name, mref, e))
                    }
                    Err(e) => {
                        s.failed();
                        failures.push(format!("{}: {e}", s.name));
                    }
                },
            }
        }
        Err(MirrorError::Remote {
            url: "every source".into(),
            reason: format!("cannot get the manifest of {mref}: {}", failures.join("; ")),
        })
    }

    /// Replaces the peers with the mirror's latest view. A peer that leaves it and comes back
    /// (the mirror hands out a random subset of a large region) gets back the state it left
    /// with: a peer banned for corrupt pieces stays banned.
    pub fn set_peers(&self, views: Vec<PeerView>) {
        // Decoded before the lock is taken: a large model's bitsets from 64 peers are
        // millions of bits, and every piece fetch needs the lock for its candidates.
        let decoded: Vec<_> = views
            .into_iter()
            .filter_map(|v| {
                // An unspecified address (from a mirror that does not replace it by the
                // peer's source address) would dial this host, not the peer: it is skipped,
                // and is never taken for this node's own address either.
                let unspecified = v
                    .addr
                    .parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| a.ip().is_unspecified());
                if unspecified || self.own_addr.as_deref() == Some(v.addr.as_str()) {
                    return None;
                }
                let base = base_url(&format!("http://{}", v.addr)).ok()?;
                let bits = |m: &HashMap<Blake3Hash, crate::piece_bits::PieceBitsWire>| {
                    m.iter()
                        .filter_map(|(h, w)| Some((*h, PieceBits::from_wire(w).ok()?)))
                        .collect()
                };
                Some((base, bits(&v.have), bits(&v.taking)))
            })
            .take(MAX_PEERS)
            .collect();
        let mut peers = lock(&self.peers);
        let mut retired = lock(&self.retired);
        let mut next = HashMap::new();
        for (base, have, taking) in decoded {
            let name = format!("peer {base}");
            let state = match peers.remove(&base) {
                Some(p) => p.state,
                None => match retired.iter().position(|r| r.name == name) {
                    Some(i) => retired.remove(i),
                    None => SourceState::new(
                        name,
                        Source::http(SourceKind::Peer, base.clone(), self.client.clone()),
                        None,
                    ),
                },
            };
            next.insert(
                base,
                Peer {
                    state,
                    have,
                    taking,
                },
            );
        }
        for (_, p) in peers.drain() {
            if p.state.bytes.load(Ordering::Relaxed) > 0
                || p.state.corrupt.load(Ordering::Relaxed) > 0
                || p.state.failures.load(Ordering::Relaxed) > 0
            {
                if retired.len() >= MAX_PEERS {
                    retired.remove(0);
                }
                retired.push(p.state);
            }
        }
        *peers = next;
    }

    /// A piece of blob `hash` that a usable peer holds and that is not in `taken` (see
    /// [`PieceBits::first_not_in`] for `from`).
    pub fn peer_piece(&self, hash: &Blake3Hash, taken: &PieceBits, from: u64) -> Option<u64> {
        lock(&self.peers)
            .values()
            .filter(|p| !p.state.banned() && !p.state.demoted())
            .find_map(|p| p.have.get(hash)?.first_not_in(taken, from))
            .filter(|i| *i < taken.count())
    }

    /// Is a peer fetching piece `i` of blob `hash` right now (as of its last announcement)?
    pub fn peer_taking(&self, hash: &Blake3Hash, i: u64) -> bool {
        lock(&self.peers)
            .values()
            .any(|p| p.taking.get(hash).is_some_and(|b| b.has(i)))
    }

    /// Sources to try for piece `i` of blob `hash`, best first, without those in `skip`.
    pub fn candidates(&self, hash: &Blake3Hash, i: u64, skip: &[String]) -> Vec<Arc<SourceState>> {
        let mut peers: Vec<Arc<SourceState>> = lock(&self.peers)
            .values()
            .filter(|p| p.have.get(hash).is_some_and(|b| b.has(i)))
            .map(|p| Arc::clone(&p.state))
            .collect();
        peers.sort_by(|a, b| a.name.cmp(&b.name));
        if !peers.is_empty() {
            let n = self.rotate.fetch_add(1, Ordering::Relaxed) % peers.len();
            peers.rotate_left(n);
        }
        let mut all: Vec<Arc<SourceState>> = peers
            .into_iter()
            .chain(self.fixed.iter().cloned())
            .filter(|s| !skip.contains(&s.name))
            .collect();
        // Stable: keeps the peers' rotation and the mirrors' RTT order among equals. Healthy
        // peers and mirrors, the origin, demoted peers and mirrors, and banned sources as a
        // last resort.
        // Each key computed once (a stable sort of the keys): the turn of a demoted mirror
        // is taken at most once, and keys read from atomics cannot change mid-sort.
        all.sort_by_cached_key(|s| {
            (
                s.banned(),
                s.demoted_taking_turn(),
                s.kind() == SourceKind::Origin,
            )
        });
        all
    }

    /// Every source used so far, for the summary.
    pub fn all(&self) -> Vec<Arc<SourceState>> {
        let mut v: Vec<_> = self.fixed.clone();
        v.extend(lock(&self.peers).values().map(|p| Arc::clone(&p.state)));
        v.extend(lock(&self.retired).iter().cloned());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set() -> SourceSet {
        let http = Arc::new(client(None, None));
        let mirror = |base: &str, rtt_ms| {
            SourceState::new(
                format!("mirror {base}"),
                Source::http(SourceKind::Mirror, base.into(), http.clone()),
                Some(Duration::from_millis(rtt_ms)),
            )
        };
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        SourceSet {
            fixed: vec![
                mirror("http://127.0.0.1:1", 1),
                mirror("http://127.0.0.1:2", 5),
                SourceState::new("origin".into(), Source::Origin(store), None),
            ],
            peers: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            rotate: AtomicUsize::new(0),
            own_addr: Some("127.0.0.1:9".into()),
            client: http.clone(),
        }
    }

    /// A peer at `addr` holding all 4 pieces of blob `h`.
    fn holding_all(addr: &str, h: &Blake3Hash) -> PeerView {
        PeerView {
            id: addr.into(),
            addr: addr.into(),
            have: [(*h, PieceBits::full(4).to_wire())].into_iter().collect(),
            taking: HashMap::new(),
        }
    }

    #[test]
    fn a_demoted_mirror_is_tried_first_once_every_retry_interval() {
        let s = set();
        let m = &s.fixed[0];
        for _ in 0..DEMOTE_AFTER_ERRORS {
            m.failed();
        }
        let t0 = Instant::now();
        assert!(m.demoted_taking_turn_at(t0));
        assert!(m.demoted_taking_turn_at(t0 + RETRY_DEMOTED / 2));
        // Asking without taking the turn (the announcer, the mirrors' order) leaves it.
        for _ in 0..10 {
            assert!(m.demoted());
        }
        // Its turn: one asking finds it not demoted, the next ones do again.
        assert!(!m.demoted_taking_turn_at(t0 + RETRY_DEMOTED));
        assert!(m.demoted_taking_turn_at(t0 + RETRY_DEMOTED));
        assert!(!m.demoted_taking_turn_at(t0 + 2 * RETRY_DEMOTED));
        // It answered: healthy again. The origin is never demoted this way.
        m.answered();
        assert!(!m.demoted_taking_turn_at(t0 + 2 * RETRY_DEMOTED));
        let origin = &s.fixed[2];
        for _ in 0..DEMOTE_AFTER_ERRORS {
            origin.failed();
        }
        assert!(origin.demoted_taking_turn_at(t0 + 10 * RETRY_DEMOTED));
    }

    fn names(v: &[Arc<SourceState>]) -> Vec<&str> {
        v.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn peers_holding_the_piece_come_first_then_mirrors_by_rtt_then_the_origin() {
        let s = set();
        let h = Blake3Hash::of(b"blob");
        let mut bits = PieceBits::empty(4);
        bits.set(1);
        let view = |addr: &str, bits: &PieceBits| PeerView {
            id: addr.into(),
            addr: addr.into(),
            have: [(h, bits.to_wire())].into_iter().collect(),
            taking: [(h, bits.to_wire())].into_iter().collect(),
        };
        s.set_peers(vec![
            view("127.0.0.1:7", &bits),
            view("127.0.0.1:9", &bits), // this node itself: ignored
        ]);
        let c = s.candidates(&h, 1, &[]);
        assert_eq!(
            names(&c),
            [
                "peer http://127.0.0.1:7",
                "mirror http://127.0.0.1:1",
                "mirror http://127.0.0.1:2",
                "origin"
            ]
        );
        // Piece 0 is held by no peer.
        assert_eq!(s.candidates(&h, 0, &[]).len(), 3);
        // What peers hold and fetch is known (not this node's own view of itself).
        assert!(s.peer_taking(&h, 1) && !s.peer_taking(&h, 0));
        assert_eq!(s.peer_piece(&h, &PieceBits::empty(4), 0), Some(1));
        assert_eq!(s.peer_piece(&h, &bits, 0), None);
        // Skipped sources are left out.
        let c = s.candidates(&h, 1, &["peer http://127.0.0.1:7".into()]);
        assert_eq!(names(&c)[0], "mirror http://127.0.0.1:1");
    }

    #[test]
    fn a_corrupting_source_drops_to_last_and_a_failing_mirror_behind_the_others() {
        let s = set();
        let h = Blake3Hash::of(b"blob");
        let best = Arc::clone(&s.fixed[0]);
        for _ in 0..BAN_AFTER_CORRUPT {
            best.penalise();
        }
        let c = s.candidates(&h, 0, &[]);
        assert_eq!(
            names(&c),
            [
                "mirror http://127.0.0.1:2",
                "origin",
                "mirror http://127.0.0.1:1"
            ]
        );
        let second = Arc::clone(&s.fixed[1]);
        for _ in 0..DEMOTE_AFTER_ERRORS {
            second.failed();
        }
        assert_eq!(names(&s.candidates(&h, 0, &[]))[0], "origin");
        second.ok(1);
        assert_eq!(
            names(&s.candidates(&h, 0, &[]))[0],
            "mirror http://127.0.0.1:2"
        );
    }

    #[test]
    fn a_peer_with_an_unspecified_address_is_skipped_and_not_taken_for_this_node() {
        let mut s = set();
        s.own_addr = Some("0.0.0.0:8701".into());
        let h = Blake3Hash::of(b"blob");
        let view = |addr: &str| holding_all(addr, &h);
        s.set_peers(vec![
            view("0.0.0.0:8702"),
            view("[::]:8703"),
            view("10.0.0.2:8701"),
        ]);
        let c = s.candidates(&h, 0, &[]);
        assert_eq!(names(&c)[0], "peer http://10.0.0.2:8701");
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn a_banned_peer_that_leaves_the_view_and_returns_is_still_banned() {
        let s = set();
        let h = Blake3Hash::of(b"blob");
        let view = |addr: &str| holding_all(addr, &h);
        s.set_peers(vec![view("10.0.0.2:8701"), view("10.0.0.3:8701")]);
        let bad = s.candidates(&h, 0, &[]);
        assert_eq!(
            names(&bad)[..2],
            ["peer http://10.0.0.2:8701", "peer http://10.0.0.3:8701"]
        );
        for _ in 0..BAN_AFTER_CORRUPT {
            bad[0].penalise();
        }
        // Out of the next view, back in the one after.
        s.set_peers(vec![view("10.0.0.3:8701")]);
        s.set_peers(vec![view("10.0.0.2:8701"), view("10.0.0.3:8701")]);
        let c = s.candidates(&h, 0, &[]);
        assert_eq!(names(&c)[0], "peer http://10.0.0.3:8701");
        assert_eq!(names(&c).last(), Some(&"peer http://10.0.0.2:8701"));
        // Counted once in the summary, with what it did.
        let all = s.all();
        let again: Vec<_> = all
            .iter()
            .filter(|x| x.name == "peer http://10.0.0.2:8701")
            .collect();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].corrupt.load(Ordering::Relaxed), BAN_AFTER_CORRUPT);
    }
}
