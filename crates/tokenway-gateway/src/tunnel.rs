//! The tunnel's gatekeeping: who is an edge (the `tw-auth` token), which requests are replays
//! (the `tw-idempotency-key` window), and which port-forwarding targets are allowed.
//! See docs/tunnel.md for the wire contract.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{HeaderMap, StatusCode};
use tokio::sync::Notify;

use crate::config::TunnelConfig;
use crate::error::ApiError;
use crate::masquerade::Masquerade;
use crate::replay::{Refusal, ReplayWindow};

/// Header carrying the tunnel token.
pub const AUTH_HEADER: &str = "tw-auth";
/// Header carrying the idempotency key.
pub const IDEMPOTENCY_HEADER: &str = "tw-idempotency-key";
/// Header of a retry naming its earlier attempts' keys (see [`Running`]).
pub const SUPERSEDES_HEADER: &str = tokenway_transport::tunnel::SUPERSEDES_HEADER;

/// Shared state of the tunnel port.
pub struct TunnelState {
    tokens: crate::secret::Secrets,
    replay: Mutex<ReplayWindow>,
    /// Tunnel requests running on the QUIC port, by idempotency key (see [`Running`]).
    running: RunningMap,
    /// Most entries of `running` (`max_replay_keys`).
    max_running: usize,
    forward_allow: HashSet<String>,
    /// What failed authentication sees.
    pub masquerade: Masquerade,
}

impl TunnelState {
    /// From the validated config.
    pub fn new(c: &TunnelConfig) -> Self {
        Self {
            tokens: crate::secret::Secrets::new(&c.tokens),
            replay: Mutex::new(ReplayWindow::new(
                Duration::from_millis(c.replay_window_ms),
                c.max_replay_keys,
            )),
            forward_allow: c.forward_allow.iter().cloned().collect(),
            masquerade: Masquerade::from_config(&c.masquerade),
            running: RunningMap::default(),
            max_running: c.max_replay_keys,
        }
    }

    /// Whether `headers` carry a valid token (compared in constant time).
    pub fn is_authenticated(&self, headers: &HeaderMap) -> bool {
        let Some(presented) = headers.get(AUTH_HEADER) else {
            return false;
        };
        self.tokens.matches(presented.as_bytes())
    }

    /// Removes the tunnel headers and admits the idempotency key, refusing replays; returns
    /// the key. A retry's earlier attempts that still run here ([`SUPERSEDES_HEADER`]) are
    /// stopped.
    pub fn admit(&self, headers: &mut HeaderMap, now: Instant) -> Result<String, ApiError> {
        headers.remove(AUTH_HEADER);
        let supersedes = headers.remove(SUPERSEDES_HEADER);
        let key = headers.remove(IDEMPOTENCY_HEADER);
        let Some(key) = key else {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "missing_idempotency_key",
                format!("tunnel requests must carry {IDEMPOTENCY_HEADER}"),
            ));
        };
        let key = key.to_str().unwrap_or_default();
        let verdict = self
            .replay
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .admit(key, now);
        match verdict {
            Ok(()) => {
                if let Some(list) = supersedes.as_ref().and_then(|v| v.to_str().ok()) {
                    self.stop_running(list.split(',').map(str::trim));
                }
                Ok(key.to_string())
            }
            Err(Refusal::Malformed) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "bad_idempotency_key",
                format!("{IDEMPOTENCY_HEADER} must be 32 hexadecimal characters"),
            )),
            Err(Refusal::Replayed) => Err(ApiError::new(
                StatusCode::CONFLICT,
                "invalid_request_error",
                "replayed_request",
                "this request was already received; it is not executed twice",
            )),
        }
    }

    /// Notes a tunnel request running under `key` until the returned guard is dropped; `None`
    /// when `max_replay_keys` already run (the request runs, it just cannot be superseded).
    pub fn run(&self, key: String) -> Option<Running> {
        let stop = Arc::new(Notify::new());
        let mut map = lock(&self.running.0);
        if map.len() >= self.max_running {
            return None;
        }
        map.insert(key.clone(), stop.clone());
        Some(Running {
            map: self.running.clone(),
            key,
            stop,
        })
    }

    /// Stops the requests running under `keys` (a retry superseded them).
    fn stop_running<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let map = lock(&self.running.0);
        for key in keys.take(MAX_SUPERSEDED) {
            if let Some(stop) = map.get(key) {
                tracing::info!(
                    key,
                    "a retry supersedes a tunnel request still running; stopping it"
                );
                stop.notify_one();
            }
        }
    }

    /// Whether CONNECT may reach `target` (`host:port`, exactly as configured).
    pub fn may_forward_to(&self, target: &str) -> bool {
        self.forward_allow.contains(target)
    }
}

/// Most earlier attempts one retry may name (the edge makes at most four attempts).
const MAX_SUPERSEDED: usize = 8;

/// The requests running on the tunnel's QUIC port, by idempotency key.
#[derive(Clone, Default)]
struct RunningMap(Arc<Mutex<HashMap<String, Arc<Notify>>>>);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A tunnel request running on the QUIC port. An edge whose QUIC path went silent sends the
/// requests that had no answer yet again (over TCP, or a fresh connection), naming this one's
/// key: this one may have reached the gateway all the same, and would run until the gateway
/// saw its connection die (its idle timeout), the backend generating the whole answer twice.
/// [`Running::superseded`] resolves once a retry names it; dropping the request then cancels
/// it upstream.
pub struct Running {
    map: RunningMap,
    key: String,
    stop: Arc<Notify>,
}

impl Running {
    /// Resolves once a retry of this request has arrived.
    pub async fn superseded(&self) {
        self.stop.notified().await;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut map = lock(&self.map.0);
        if map
            .get(&self.key)
            .is_some_and(|s| Arc::ptr_eq(s, &self.stop))
        {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MasqueradeConfig;

    fn state() -> TunnelState {
        TunnelState::new(&TunnelConfig {
            listen: "127.0.0.1:0".parse().expect("addr"),
            tcp_listen: None,
            tokens: vec!["0123456789abcdef-token".into()],
            replay_window_ms: 1000,
            max_replay_keys: 10,
            forward_allow: vec!["127.0.0.1:7000".into()],
            masquerade: MasqueradeConfig::default(),
            datagram: None,
        })
    }

    #[test]
    fn only_the_configured_token_authenticates() {
        let s = state();
        let mut h = HeaderMap::new();
        assert!(!s.is_authenticated(&h));
        h.insert(AUTH_HEADER, "wrong".parse().expect("header"));
        assert!(!s.is_authenticated(&h));
        h.insert(
            AUTH_HEADER,
            "0123456789abcdef-token".parse().expect("header"),
        );
        assert!(s.is_authenticated(&h));
    }

    #[test]
    fn admit_strips_tunnel_headers_and_refuses_a_replay() {
        let s = state();
        let now = Instant::now();
        let mut h = HeaderMap::new();
        h.insert(
            AUTH_HEADER,
            "0123456789abcdef-token".parse().expect("header"),
        );
        h.insert(
            IDEMPOTENCY_HEADER,
            "00112233445566778899aabbccddeeff".parse().expect("header"),
        );
        let mut again = h.clone();
        s.admit(&mut h, now).expect("first time");
        assert!(h.get(AUTH_HEADER).is_none() && h.get(IDEMPOTENCY_HEADER).is_none());
        let e = s.admit(&mut again, now).unwrap_err();
        assert_eq!(e.status, StatusCode::CONFLICT);
        assert!(s.may_forward_to("127.0.0.1:7000"));
        assert!(!s.may_forward_to("127.0.0.1:22"));
    }

    /// A retry names its earlier attempts: one still running is stopped, once, and a request
    /// that ended is forgotten (its key's entry goes with it).
    #[tokio::test]
    async fn a_retry_stops_the_attempts_it_supersedes_that_still_run() {
        let s = state();
        let now = Instant::now();
        let request = |key: &'static str, supersedes: Option<&'static str>| {
            let mut h = HeaderMap::new();
            h.insert(IDEMPOTENCY_HEADER, key.parse().expect("header"));
            if let Some(list) = supersedes {
                h.insert(SUPERSEDES_HEADER, list.parse().expect("header"));
            }
            h
        };
        const A: &str = "00112233445566778899aabbccddeeff";
        const B: &str = "ffeeddccbbaa99887766554433221100";
        const C: &str = "0123456789abcdef0123456789abcdef";
        let key = s.admit(&mut request(A, None), now).expect("admitted");
        let a = s.run(key).expect("noted");
        let mut retry = request(B, Some("0000, 00112233445566778899aabbccddeeff"));
        let key = s.admit(&mut retry, now).expect("admitted");
        assert!(retry.get(SUPERSEDES_HEADER).is_none(), "consumed");
        let b = s.run(key).expect("noted");
        tokio::time::timeout(Duration::from_secs(1), a.superseded())
            .await
            .expect("the first attempt was stopped");
        drop(a);
        drop(b);
        assert!(
            lock(&s.running.0).is_empty(),
            "ended requests are forgotten"
        );
        // Naming a request that is not running stops nothing.
        let key = s.admit(&mut request(C, Some(A)), now).expect("admitted");
        let c = s.run(key).expect("noted");
        assert!(
            tokio::time::timeout(Duration::from_millis(50), c.superseded())
                .await
                .is_err()
        );
    }
}
