//! Telling the mirror what this node holds and learning which peers hold what it wants.
//!
//! Every [`INTERVAL`] the puller posts its holdings (and, with `--serve`, its address) to
//! the best mirror that answers; the answer's peers become sources of the pull. The
//! cumulative count of bytes taken from peers rides along, so the mirror's
//! `bytes_from_peers` metric shows how much load peers took off it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::holdings::Holdings;
use crate::http_client::{post_json, send, HttpClient};
use crate::manifest::Blake3Hash;
use crate::mirror::peers::{Announce, AnnounceReply};
use crate::source::Source;
use crate::sources::SourceSet;

/// Time between announcements.
pub const INTERVAL: Duration = Duration::from_millis(300);

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
}

impl Announcer {
    /// One announcement to the first mirror that answers; the error lists the failures.
    pub async fn once(&self) -> Result<usize, String> {
        let (have, taking) = self.holdings.wire();
        let body = serde_json::to_vec(&Announce {
            id: self.id.clone(),
            region: self.region.clone(),
            addr: self.addr.clone(),
            have,
            taking,
            want: self.want.clone(),
            bytes_from_peers: self.peer_bytes.load(Ordering::Relaxed),
        })
        .expect("invariant: an announcement serializes");
        let mut failures = Vec::new();
        for m in self.sources.mirrors() {
            let Source::Http { base, client, .. } = &m.source else {
                continue;
            };
            match post(client, base, body.clone()).await {
                Ok(reply) => {
                    let n = reply.peers.len();
                    self.sources.set_peers(reply.peers);
                    return Ok(n);
                }
                Err(e) => failures.push(format!("{base}: {e}")),
            }
        }
        Err(failures.join("; "))
    }

    /// Announces every [`INTERVAL`] until dropped (run it on its own task).
    pub async fn run(self: Arc<Self>) {
        let mut warned = false;
        loop {
            match self.once().await {
                Ok(_) => warned = false,
                Err(e) if !warned => {
                    tracing::warn!(error = %e, "cannot announce to any mirror; peers unknown");
                    warned = true;
                }
                Err(_) => {}
            }
            tokio::time::sleep(INTERVAL).await;
        }
    }
}

async fn post(client: &HttpClient, base: &str, body: Vec<u8>) -> Result<AnnounceReply, String> {
    let req = post_json(&format!("{base}/v1/peers/announce"), body).map_err(|e| e.to_string())?;
    let (_, bytes) = send(client, req, 16 << 20, Duration::from_secs(5))
        .await
        .map_err(|e| e.to_string())?;
    serde_json::from_slice(&bytes).map_err(|e| format!("unexpected answer: {e}"))
}
