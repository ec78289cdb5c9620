//! The tunnel's gatekeeping: who is an edge (the `tw-auth` token), which requests are replays
//! (the `tw-idempotency-key` window), and which port-forwarding targets are allowed.
//! See docs/tunnel.md for the wire contract.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::{HeaderMap, StatusCode};

use crate::config::TunnelConfig;
use crate::error::ApiError;
use crate::masquerade::Masquerade;
use crate::replay::{Refusal, ReplayWindow};

/// Header carrying the tunnel token.
pub const AUTH_HEADER: &str = "tw-auth";
/// Header carrying the idempotency key.
pub const IDEMPOTENCY_HEADER: &str = "tw-idempotency-key";

/// Shared state of the tunnel port.
pub struct TunnelState {
    tokens: crate::secret::Secrets,
    replay: Mutex<ReplayWindow>,
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
        }
    }

    /// Whether `headers` carry a valid token (compared in constant time).
    pub fn is_authenticated(&self, headers: &HeaderMap) -> bool {
        let Some(presented) = headers.get(AUTH_HEADER) else {
            return false;
        };
        self.tokens.matches(presented.as_bytes())
    }

    /// Removes the tunnel headers and admits the idempotency key, refusing replays.
    pub fn admit(&self, headers: &mut HeaderMap, now: Instant) -> Result<(), ApiError> {
        headers.remove(AUTH_HEADER);
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
            Ok(()) => Ok(()),
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

    /// Whether CONNECT may reach `target` (`host:port`, exactly as configured).
    pub fn may_forward_to(&self, target: &str) -> bool {
        self.forward_allow.contains(target)
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
}
