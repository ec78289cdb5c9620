//! Telling the mirror what this node holds and learning which peers hold what it wants.
//!
//! Every [`INTERVAL`] the puller posts its holdings (and, with `--serve`, its address) to
//! every mirror it knows: first to the best one that answers, whose answer settles the region
//! when the puller has none, then to the others at once, in that region. So pullers that prefer
//! different mirrors of a region (two mirrors behind one name, a mirror that failed over)
//! still find each other. The union of the answers' peers becomes sources of the pull. A
//! mirror further down the list gets [`SECONDARY_TIMEOUT`] to answer, so one that is down does
//! not slow the rounds; so does a mirror that is not answering (see
//! [`crate::sources::SourceState::demoted`]), even when it comes first. The count of bytes taken from peers rides along: each new byte is
//! reported to the first mirror that answered at the time, and every mirror is sent the
//! cumulative share it was given, so the `bytes_from_peers` metrics of a region's mirrors add
//! up to the bytes taken, also when the first mirror changes.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::holdings::Holdings;
use crate::http_client::{post_json, send, HttpClient, Timeouts};
use crate::lock;
use crate::manifest::Blake3Hash;
use crate::mirror::peers::{Announce, AnnounceReply};
use crate::source::Source;
use crate::sources::SourceSet;

/// Time between announcements.
pub const INTERVAL: Duration = Duration::from_millis(300);
/// How often a node that holds everything it wants announces (to stay listed as a peer).
pub const IDLE_INTERVAL: Duration = Duration::from_secs(5);
/// Announcement traffic a node allows itself, posts and answers together: past it the rounds
/// are spaced out. A round carries whole bitsets, and an answer up to 64 peers' (about 2 MiB
/// for a 500 GB model at 4 MiB pieces): every 300 ms that was 6.7 MB/s per node outside
/// `--limit-rate`, and 100 nodes drew 670 MB/s of JSON from their mirror. At this budget a
/// round of a 14 GB model's (about 60 KB with 64 peers) still goes every 300 ms; the
/// 500 GB model's every 8 s, and 100 such nodes draw 25 MiB/s at most.
pub const BYTES_PER_SEC: u64 = 256 << 10;

/// The pause after a round of `round_bytes` (posts and answers): [`INTERVAL`] (or
/// [`IDLE_INTERVAL`] once the node wants nothing), longer if that would exceed
/// [`BYTES_PER_SEC`].
pub fn pause_after(round_bytes: u64, idle: bool) -> Duration {
    let base = if idle { IDLE_INTERVAL } else { INTERVAL };
    base.max(Duration::from_secs_f64(
        round_bytes as f64 / BYTES_PER_SEC as f64,
    ))
}

/// How long the first mirror asked has to answer an announcement.
pub const FIRST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a mirror after the first that answered, or one that is not answering requests,
/// has to answer an announcement.
pub const SECONDARY_TIMEOUT: Duration = Duration::from_millis(500);

/// Which mirror was told about which bytes taken from peers.
#[derive(Debug, Default)]
pub struct ByteShares {
    /// Bytes already reported to some mirror.
    given: u64,
    /// Per mirror base URL, the cumulative count it was sent.
    per_mirror: HashMap<String, u64>,
}

/// One node's announcer.
pub struct Announcer {
    /// Random id of this process.
    pub id: String,
    /// Region.
    pub region: String,
    /// Where this node serves pieces.
    pub addr: Option<String>,
    /// Blobs this pull wants.
    pub want: Vec<Blake3Hash>,
    /// What this node holds.
    pub holdings: Arc<Holdings>,
    /// Bytes taken from peers so far.
    pub peer_bytes: Arc<AtomicU64>,
    /// The pull's sources (peers are updated here).
    pub sources: Arc<SourceSet>,
    /// What each mirror was told of `peer_bytes`.
    pub shares: Mutex<ByteShares>,
}

impl Announcer {
    /// One round of announcements (see the module docs); returns how many peers were learnt,
    /// or, when no mirror answered, the failures.
    pub async fn once(&self) -> Result<usize, String> {
        self.round().await.map(|(n, _)| n)
    }

    /// [`Self::once`], also returning the bytes the round sent and received.
    async fn round(&self) -> Result<(usize, u64), String> {
        let mut bytes = 0u64;
        // A mirror that is not answering (no RTT, or failing requests) gets the short
        // timeout even when it is first, so the pull does not wait for it before its first
        // piece.
        let mirrors: Vec<(String, Arc<HttpClient>, Duration)> = self
            .sources
            .mirrors()
            .iter()
            .filter_map(|m| match &m.source {
                Source::Http { base, client, .. } => Some((
                    base.clone(),
                    Arc::clone(client),
                    if m.demoted() {
                        SECONDARY_TIMEOUT
                    } else {
                        FIRST_TIMEOUT
                    },
                )),
                Source::Origin(_) => None,
            })
            .collect();
        let mut failures = Vec::new();
        let mut answered = None;
        for (i, (base, client, within)) in mirrors.iter().enumerate() {
            let total = self.peer_bytes.load(Ordering::Relaxed);
            let share = {
                let s = lock(&self.shares);
                s.per_mirror.get(base).copied().unwrap_or(0) + total.saturating_sub(s.given)
            };
            let body = self.body(&self.region, share);
            bytes += body.len() as u64;
            match post(client, base, body, *within).await {
                Ok((reply, n)) => {
                    bytes += n;
                    let mut s = lock(&self.shares);
                    s.per_mirror.insert(base.clone(), share);
                    s.given = s.given.max(total);
                    answered = Some((i, reply));
                    break;
                }
                Err(e) => failures.push(format!("{base}: {e}")),
            }
        }
        let Some((first, reply)) = answered else {
            return Err(failures.join("; "));
        };
        let region = if self.region.is_empty() {
            reply.region.clone()
        } else {
            self.region.clone()
        };
        let others = mirrors[first + 1..].iter().map(|(base, client, _)| {
            let share = lock(&self.shares)
                .per_mirror
                .get(base)
                .copied()
                .unwrap_or(0);
            let body = self.body(&region, share);
            bytes += body.len() as u64;
            post(client, base, body, SECONDARY_TIMEOUT)
        });
        let others: Vec<_> = others.collect();
        let mut peers = reply.peers;
        // A mirror further down the list that does not answer in time is left out of this
        // round: the first one answered.
        for (r, n) in futures_util::future::join_all(others)
            .await
            .into_iter()
            .flatten()
        {
            bytes += n;
            peers.extend(r.peers);
        }
        let mut seen = HashSet::new();
        peers.retain(|p| seen.insert(p.addr.clone()));
        let n = peers.len();
        self.sources.set_peers(peers);
        Ok((n, bytes))
    }

    /// The announcement, filed under `region`, with `bytes_from_peers` as the cumulative count.
    fn body(&self, region: &str, bytes_from_peers: u64) -> Vec<u8> {
        let (have, taking) = self.holdings.wire();
        serde_json::to_vec(&Announce {
            id: self.id.clone(),
            region: region.to_string(),
            addr: self.addr.clone(),
            have,
            taking,
            // Only what is still missing: a node that has it all asks for nobody's pieces
            // (and the mirror encodes no holders for it).
            want: self.holdings.missing(&self.want),
            bytes_from_peers,
        })
        .expect("invariant: an announcement serializes")
    }

    /// Announces every [`INTERVAL`] until dropped (run it on its own task); every
    /// [`IDLE_INTERVAL`] once this node holds everything it wants (it only needs to stay in the
    /// mirrors' directories, whose entries live [`crate::mirror::PEER_TTL`]).
    pub async fn run(self: Arc<Self>) {
        let mut warned = false;
        loop {
            let bytes = match self.round().await {
                Ok((_, bytes)) => {
                    warned = false;
                    bytes
                }
                Err(e) => {
                    if !warned {
                        tracing::warn!(error = %e, "cannot announce to any mirror; peers unknown");
                        warned = true;
                    }
                    0
                }
            };
            let idle = self.holdings.missing(&self.want).is_empty();
            tokio::time::sleep(pause_after(bytes, idle)).await;
        }
    }
}

async fn post(
    client: &HttpClient,
    base: &str,
    body: Vec<u8>,
    within: Duration,
) -> Result<(AnnounceReply, u64), String> {
    let req = post_json(&format!("{base}/v1/peers/announce"), body).map_err(|e| e.to_string())?;
    let (_, bytes) = send(client, req, 16 << 20, Timeouts::all(within))
        .await
        .map_err(|e| e.to_string())?;
    let reply = serde_json::from_slice(&bytes).map_err(|e| format!("unexpected answer: {e}"))?;
    Ok((reply, bytes.len() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_are_spaced_out_past_the_traffic_budget() {
        // A small model's rounds keep their pace.
        assert_eq!(pause_after(60_000, false), INTERVAL);
        assert_eq!(pause_after(60_000, true), IDLE_INTERVAL);
        // 2 MiB answers (a 500 GB model, 64 peers): one round every 8 s, not every 300 ms.
        assert_eq!(pause_after(2 << 20, false), Duration::from_secs(8));
        assert_eq!(pause_after(2 << 20, true), Duration::from_secs(8));
        assert_eq!(pause_after(0, false), INTERVAL, "a round that failed");
    }
}
