//! The mirror's directory of peers: which pullers, in which region, hold which pieces.
//! Sans-IO (`now` is a parameter).
//!
//! A puller announces itself every few hundred milliseconds with what it holds, what it is
//! fetching right now and what it wants; the answer lists the other peers of its region that
//! hold or are fetching pieces of those blobs (so that two nodes rarely fetch the same piece
//! from the mirror at once, see [`crate::piece_queue`]).
//! Peers are untrusted (pullers verify every piece), so the directory only has to be
//! roughly right. It is bounded: at most `max_peers` peers, at most [`MAX_BLOBS`] blobs each,
//! at most [`MAX_ANNOUNCED_PIECES`] piece bits each (and for a blob of a manifest the mirror
//! has in memory, exactly its piece count), and a peer that stops announcing is forgotten
//! after `ttl`. Announcements need no token unless the operator sets one, so a stranger can
//! announce: an answer holds at most [`MAX_REPLY_PEERS`] peers and about
//! [`MAX_REPLY_BYTES`], however large the bitsets others announced.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::manifest::Blake3Hash;
use crate::piece_bits::{PieceBits, PieceBitsWire};

/// Blobs one announcement may list.
pub const MAX_BLOBS: usize = 4096;
/// Longest peer id.
pub const MAX_ID_LEN: usize = 128;
/// Peers in one answer; with more holders a random subset is handed out, which also
/// spreads pullers over them.
pub const MAX_REPLY_PEERS: usize = 64;
/// Piece bits one announcement may carry, `have` and `taking` together (a 4 TiB model at
/// 4 MiB pieces); 128 KiB of bits per peer at most.
pub const MAX_ANNOUNCED_PIECES: u64 = 1 << 20;
/// Rough size bound of an answer in bytes (pullers refuse answers above 16 MiB): peers
/// that would go past it are left out.
pub const MAX_REPLY_BYTES: usize = 2 << 20;

/// What a puller sends to `POST /v1/peers/announce`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Announce {
    /// Stable id of the puller (random per process).
    pub id: String,
    /// Region; empty means the mirror's own.
    #[serde(default)]
    pub region: String,
    /// Where it serves pieces (`host:port`), if it does.
    #[serde(default)]
    pub addr: Option<String>,
    /// Pieces it holds, by blob hash.
    #[serde(default)]
    pub have: HashMap<Blake3Hash, PieceBitsWire>,
    /// Pieces it is fetching now (from anywhere), by blob hash.
    #[serde(default)]
    pub taking: HashMap<Blake3Hash, PieceBitsWire>,
    /// Blobs it wants peers for.
    #[serde(default)]
    pub want: Vec<Blake3Hash>,
    /// Bytes it got from peers so far (cumulative; the mirror counts the increase).
    #[serde(default)]
    pub bytes_from_peers: u64,
}

/// One peer in an answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerView {
    /// Its id.
    pub id: String,
    /// Where it serves (`host:port`).
    pub addr: String,
    /// What it holds of the wanted blobs.
    pub have: HashMap<Blake3Hash, PieceBitsWire>,
    /// What it is fetching of the wanted blobs.
    #[serde(default)]
    pub taking: HashMap<Blake3Hash, PieceBitsWire>,
}

/// The answer to an announcement.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AnnounceReply {
    /// Region the peer was filed under.
    pub region: String,
    /// Other peers of the region holding wanted pieces.
    pub peers: Vec<PeerView>,
}

struct Peer {
    region: String,
    addr: Option<String>,
    have: HashMap<Blake3Hash, PieceBits>,
    taking: HashMap<Blake3Hash, PieceBits>,
    bytes_from_peers: u64,
    seen: Instant,
}

/// Peers by id.
pub struct PeerDirectory {
    peers: HashMap<String, Peer>,
    max_peers: usize,
    ttl: Duration,
    default_region: String,
}

impl PeerDirectory {
    /// An empty directory.
    pub fn new(default_region: &str, max_peers: usize, ttl: Duration) -> Self {
        Self {
            peers: HashMap::new(),
            max_peers,
            ttl,
            default_region: default_region.into(),
        }
    }

    /// Forgets peers not seen within the TTL.
    pub fn expire(&mut self, now: Instant) {
        let ttl = self.ttl;
        self.peers
            .retain(|_, p| now.saturating_duration_since(p.seen) <= ttl);
    }

    /// Peers known.
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// No peers?
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// Records an announcement that came from `source`; returns the reply and the increase of
    /// the peer's bytes-from-peers counter. The error says what is wrong with the announcement.
    ///
    /// A peer listening on every interface (`--serve 0.0.0.0:8701`) announces an unspecified
    /// address, which would lead every other node to itself: it is filed under the address the
    /// announcement came from, with the announced port.
    ///
    /// `piece_counts` holds the piece count of every announced blob the mirror knows the
    /// manifest of; a bitset of another length for such a blob is refused.
    pub fn announce(
        &mut self,
        a: Announce,
        source: Option<IpAddr>,
        piece_counts: &HashMap<Blake3Hash, u64>,
        now: Instant,
    ) -> Result<(AnnounceReply, u64), String> {
        if a.id.is_empty() || a.id.len() > MAX_ID_LEN {
            return Err(format!("id must be 1 to {MAX_ID_LEN} bytes"));
        }
        if a.have.len() > MAX_BLOBS || a.taking.len() > MAX_BLOBS || a.want.len() > MAX_BLOBS {
            return Err(format!(
                "at most {MAX_BLOBS} blobs in have, in taking and in want"
            ));
        }
        let addr = match &a.addr {
            None => None,
            Some(addr) => Some(reachable_addr(addr, source)?),
        };
        let announced: u64 = a
            .have
            .values()
            .chain(a.taking.values())
            .fold(0u64, |n, w| n.saturating_add(w.count));
        if announced > MAX_ANNOUNCED_PIECES {
            return Err(format!(
                "{announced} pieces in have and taking together, at most {MAX_ANNOUNCED_PIECES}"
            ));
        }
        let bits = |field: &str, w: &PieceBitsWire, h: &Blake3Hash| {
            if let Some(&n) = piece_counts.get(h) {
                if w.count != n {
                    return Err(format!(
                        "{field}[{h}]: count {} but the blob has {n} pieces",
                        w.count
                    ));
                }
            }
            PieceBits::from_wire(w).map_err(|e| format!("{field}[{h}]: {e}"))
        };
        let mut have = HashMap::with_capacity(a.have.len());
        for (h, w) in &a.have {
            have.insert(*h, bits("have", w, h)?);
        }
        let mut taking = HashMap::with_capacity(a.taking.len());
        for (h, w) in &a.taking {
            taking.insert(*h, bits("taking", w, h)?);
        }
        self.expire(now);
        if !self.peers.contains_key(&a.id) && self.peers.len() >= self.max_peers {
            return Err(format!("the directory is full ({} peers)", self.max_peers));
        }
        let region = if a.region.is_empty() {
            self.default_region.clone()
        } else {
            a.region.clone()
        };
        let prev = self.peers.get(&a.id).map_or(0, |p| p.bytes_from_peers);
        let delta = a.bytes_from_peers.saturating_sub(prev);
        self.peers.insert(
            a.id.clone(),
            Peer {
                region: region.clone(),
                addr,
                have,
                taking,
                bytes_from_peers: a.bytes_from_peers.max(prev),
                seen: now,
            },
        );
        // The holders of anything wanted, found without encoding anything; then a random
        // subset within both bounds (it also spreads pullers over the holders), and only its
        // bitsets are encoded: a region of thousands of peers with big models costs the same
        // as one of 64.
        let holds = |p: &Peer, h: &Blake3Hash| {
            [&p.have, &p.taking]
                .iter()
                .any(|m| m.get(h).is_some_and(|b| b.present() > 0))
        };
        let mut holders: Vec<(&String, &Peer)> = self
            .peers
            .iter()
            .filter(|(id, p)| **id != a.id && p.region == region && p.addr.is_some())
            .filter(|(_, p)| a.want.iter().any(|h| holds(p, h)))
            .collect();
        use rand::seq::SliceRandom as _;
        holders.shuffle(&mut rand::rng());
        let mut peers = Vec::new();
        let mut bytes = 0usize;
        for (id, p) in holders {
            if peers.len() >= MAX_REPLY_PEERS {
                break;
            }
            let Some(addr) = p.addr.clone() else {
                continue;
            };
            let of = |m: &HashMap<Blake3Hash, PieceBits>| -> HashMap<_, _> {
                a.want
                    .iter()
                    .filter_map(|h| {
                        let bits = m.get(h)?;
                        (bits.present() > 0).then(|| (*h, bits.to_wire()))
                    })
                    .collect()
            };
            let view = PeerView {
                id: id.clone(),
                addr,
                have: of(&p.have),
                taking: of(&p.taking),
            };
            let size = view_size(&view);
            if bytes + size <= MAX_REPLY_BYTES {
                bytes += size;
                peers.push(view);
            }
        }
        Ok((AnnounceReply { region, peers }, delta))
    }

    /// Addresses of the peers of `region` (empty: the default) holding piece `piece` of
    /// `blob`.
    pub fn holders(
        &self,
        region: &str,
        blob: &Blake3Hash,
        piece: u64,
        now: Instant,
    ) -> Vec<String> {
        let region = if region.is_empty() {
            self.default_region.as_str()
        } else {
            region
        };
        let mut out: Vec<String> = self
            .peers
            .values()
            .filter(|p| p.region == region && now.saturating_duration_since(p.seen) <= self.ttl)
            .filter(|p| p.have.get(blob).is_some_and(|b| b.has(piece)))
            .filter_map(|p| p.addr.clone())
            .collect();
        out.sort();
        out
    }
}

/// About the JSON size of `v` in an answer.
fn view_size(v: &PeerView) -> usize {
    let bits = |m: &HashMap<Blake3Hash, PieceBitsWire>| -> usize {
        m.values().map(|w| 64 + 40 + w.bits.len()).sum()
    };
    v.id.len() + v.addr.len() + 64 + bits(&v.have) + bits(&v.taking)
}

/// `addr` as other peers should dial it: an unspecified IP (`0.0.0.0`, `::`) is replaced by
/// `source` (the announcement's source IP), keeping the port.
fn reachable_addr(addr: &str, source: Option<IpAddr>) -> Result<String, String> {
    let mut parsed: SocketAddr = addr
        .parse()
        .map_err(|_| format!("addr {addr:?} is not IP:port"))?;
    if parsed.port() == 0 {
        return Err(format!("addr {addr:?} has port 0"));
    }
    if parsed.ip().is_unspecified() {
        let Some(ip) = source else {
            return Err(format!(
                "addr {addr:?} is unspecified and the announcement's source address is unknown"
            ));
        };
        parsed.set_ip(ip.to_canonical());
    }
    Ok(parsed.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(
        id: &str,
        region: &str,
        addr: Option<&str>,
        have: &[(Blake3Hash, PieceBits)],
    ) -> Announce {
        Announce {
            id: id.into(),
            region: region.into(),
            addr: addr.map(Into::into),
            have: have.iter().map(|(h, b)| (*h, b.to_wire())).collect(),
            taking: HashMap::new(),
            want: have.iter().map(|(h, _)| *h).collect(),
            bytes_from_peers: 0,
        }
    }

    #[test]
    fn peers_see_holders_of_their_region_only_until_they_expire() {
        let h = Blake3Hash::of(b"blob");
        let now = Instant::now();
        let mut d = PeerDirectory::new("eu", 8, Duration::from_secs(10));
        let mut bits = PieceBits::empty(4);
        bits.set(2);
        d.announce(
            ann("a", "", Some("127.0.0.1:1"), &[(h, bits.clone())]),
            None,
            &HashMap::new(),
            now,
        )
        .unwrap();
        d.announce(
            ann("b", "us", Some("127.0.0.1:2"), &[(h, bits)]),
            None,
            &HashMap::new(),
            now,
        )
        .unwrap();
        let (reply, _) = d
            .announce(
                ann("c", "eu", None, &[(h, PieceBits::empty(4))]),
                None,
                &HashMap::new(),
                now,
            )
            .unwrap();
        assert_eq!(reply.peers.len(), 1);
        assert_eq!(reply.peers[0].addr, "127.0.0.1:1");
        assert_eq!(d.holders("eu", &h, 2, now), ["127.0.0.1:1"]);
        assert!(d.holders("eu", &h, 1, now).is_empty());
        let later = now + Duration::from_secs(11);
        assert!(d.holders("eu", &h, 2, later).is_empty());
        d.expire(later);
        assert!(d.is_empty());
    }

    #[test]
    fn what_a_peer_is_fetching_reaches_the_others_even_before_it_holds_anything() {
        let h = Blake3Hash::of(b"blob");
        let now = Instant::now();
        let mut d = PeerDirectory::new("eu", 8, Duration::from_secs(10));
        let mut taking = PieceBits::empty(4);
        taking.set(3);
        let mut a = ann("a", "", Some("127.0.0.1:1"), &[(h, PieceBits::empty(4))]);
        a.taking.insert(h, taking.to_wire());
        d.announce(a, None, &HashMap::new(), now).unwrap();
        let (reply, _) = d
            .announce(
                ann("b", "", None, &[(h, PieceBits::empty(4))]),
                None,
                &HashMap::new(),
                now,
            )
            .unwrap();
        assert_eq!(reply.peers.len(), 1);
        assert!(reply.peers[0].have.is_empty());
        let got = PieceBits::from_wire(&reply.peers[0].taking[&h]).unwrap();
        assert!(got.has(3) && !got.has(2));
    }

    #[test]
    fn the_directory_is_bounded_and_counts_peer_bytes_once() {
        let now = Instant::now();
        let mut d = PeerDirectory::new("eu", 1, Duration::from_secs(10));
        let mut a = ann("a", "", None, &[]);
        a.bytes_from_peers = 100;
        assert_eq!(
            d.announce(a.clone(), None, &HashMap::new(), now).unwrap().1,
            100
        );
        a.bytes_from_peers = 150;
        assert_eq!(d.announce(a, None, &HashMap::new(), now).unwrap().1, 50);
        assert!(d
            .announce(ann("b", "", None, &[]), None, &HashMap::new(), now)
            .unwrap_err()
            .contains("full"));
        let bad = ann("c", "", Some("not an address"), &[]);
        assert!(d.announce(bad, None, &HashMap::new(), now).is_err());
    }

    #[test]
    fn an_answer_hands_out_at_most_a_bounded_number_of_peers() {
        let h = Blake3Hash::of(b"blob");
        let now = Instant::now();
        let mut d = PeerDirectory::new("eu", 1000, Duration::from_secs(10));
        for i in 0..100 {
            let addr = format!("127.0.0.1:{}", 1000 + i);
            d.announce(
                ann(
                    &format!("p{i}"),
                    "",
                    Some(&addr),
                    &[(h, PieceBits::full(2))],
                ),
                None,
                &HashMap::new(),
                now,
            )
            .unwrap();
        }
        let (reply, _) = d
            .announce(
                ann("me", "", None, &[(h, PieceBits::empty(2))]),
                None,
                &HashMap::new(),
                now,
            )
            .unwrap();
        assert_eq!(reply.peers.len(), MAX_REPLY_PEERS);
        // Each answer a random subset: pullers are spread over the holders.
        let (again, _) = d
            .announce(
                ann("me-too", "", None, &[(h, PieceBits::empty(2))]),
                None,
                &HashMap::new(),
                now,
            )
            .unwrap();
        let ids = |r: &AnnounceReply| {
            let mut v: Vec<String> = r.peers.iter().map(|p| p.id.clone()).collect();
            v.sort();
            v
        };
        assert_ne!(ids(&reply), ids(&again));
        // A node that wants nothing (it holds the whole model and only serves) is handed no
        // holders.
        let mut done = ann(
            "done",
            "",
            Some("127.0.0.1:999"),
            &[(h, PieceBits::full(2))],
        );
        done.want.clear();
        let (reply, _) = d.announce(done, None, &HashMap::new(), now).unwrap();
        assert!(reply.peers.is_empty());
    }

    #[test]
    fn a_peer_announcing_an_unspecified_address_is_filed_under_its_source_ip() {
        let h = Blake3Hash::of(b"blob");
        let now = Instant::now();
        let mut d = PeerDirectory::new("eu", 8, Duration::from_secs(10));
        let src: IpAddr = "10.1.2.3".parse().unwrap();
        let a = ann("a", "", Some("0.0.0.0:8701"), &[(h, PieceBits::full(2))]);
        d.announce(a, Some(src), &HashMap::new(), now).unwrap();
        let v6 = ann("b", "", Some("[::]:8702"), &[(h, PieceBits::full(2))]);
        let mapped: IpAddr = "::ffff:10.1.2.4".parse().unwrap();
        d.announce(v6, Some(mapped), &HashMap::new(), now).unwrap();
        // A specified address is kept as announced.
        let c = ann("c", "", Some("10.9.9.9:8703"), &[(h, PieceBits::full(2))]);
        d.announce(c, Some(src), &HashMap::new(), now).unwrap();
        assert_eq!(
            d.holders("eu", &h, 0, now),
            ["10.1.2.3:8701", "10.1.2.4:8702", "10.9.9.9:8703"]
        );
        let (reply, _) = d
            .announce(
                ann("me", "", None, &[(h, PieceBits::empty(2))]),
                None,
                &HashMap::new(),
                now,
            )
            .unwrap();
        assert!(reply.peers.iter().all(|p| !p.addr.starts_with("0.0.0.0")));
        let unknown = ann("d", "", Some("0.0.0.0:8704"), &[]);
        assert!(d
            .announce(unknown, None, &HashMap::new(), now)
            .unwrap_err()
            .contains("unspecified"));
    }

    #[test]
    fn oversized_or_miscounted_bitsets_are_refused_and_answers_stay_bounded() {
        let h = Blake3Hash::of(b"blob");
        let other = Blake3Hash::of(b"other");
        let now = Instant::now();
        let mut d = PeerDirectory::new("eu", 1000, Duration::from_secs(10));
        let known: HashMap<Blake3Hash, u64> = [(h, 13)].into_iter().collect();
        // A known blob: the count must be its piece count.
        let wrong = ann(
            "w",
            "",
            Some("127.0.0.1:1"),
            &[(h, PieceBits::full(1 << 16))],
        );
        let e = d.announce(wrong, None, &known, now).unwrap_err();
        assert!(e.contains("13 pieces"), "{e}");
        // Too many pieces in all, known or not.
        let huge = ann(
            "x",
            "",
            Some("127.0.0.1:1"),
            &[(other, PieceBits::full(1 << 21))],
        );
        let e = d.announce(huge, None, &known, now).unwrap_err();
        assert!(e.contains("at most"), "{e}");
        // Peers with the largest bitsets allowed for an unknown blob: the answer stays small.
        for i in 0..12 {
            let addr = format!("127.0.0.1:{}", 2000 + i);
            let big = ann(
                &format!("p{i}"),
                "",
                Some(&addr),
                &[(other, PieceBits::full(MAX_ANNOUNCED_PIECES))],
            );
            d.announce(big, None, &known, now).unwrap();
        }
        let (reply, _) = d
            .announce(
                ann("me", "", None, &[(other, PieceBits::empty(8))]),
                None,
                &known,
                now,
            )
            .unwrap();
        let size = serde_json::to_vec(&reply).unwrap().len();
        assert!(!reply.peers.is_empty() && reply.peers.len() < 12);
        assert!(size <= MAX_REPLY_BYTES + 4096, "{size} bytes");
        assert!(d.len() <= 1000);
    }
}
