//! The access token of a weights tier: one shared secret that mirrors and peer servers ask
//! for (`Authorization: Bearer <token>`) and that pullers and `tokenway preheat` send.
//!
//! Content addressing already makes what a node receives verifiable; the token decides who
//! may read a mirror at all (model weights are often licensed or private) and who may register
//! as a peer with it. `/healthz` and `/metrics` stay open, for load balancers and Prometheus.
//! Tokens are compared in constant time and never printed.

use http::{header, HeaderMap, HeaderValue, StatusCode};

use crate::http_error::ServeError;
use crate::MirrorError;

/// The environment variable every weights command reads the token from (preferred over the
/// `--token` flag, which other users can see in the process list).
pub const TOKEN_ENV: &str = "TOKENWAY_WEIGHTS_TOKEN";

/// Shortest token accepted: 16 characters, so that a guessable word is refused.
pub const MIN_TOKEN_LEN: usize = 16;

/// Longest token accepted.
pub const MAX_TOKEN_LEN: usize = 512;

/// A checked access token. `Debug` does not show it.
#[derive(Clone)]
pub struct AccessToken {
    /// `Bearer <token>`, ready to send.
    header: HeaderValue,
}

impl std::fmt::Debug for AccessToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AccessToken(<redacted>)")
    }
}

impl AccessToken {
    /// Checks `token`: 16 to 512 visible ASCII characters, no spaces (it travels in a header).
    /// The error names `field` (the flag or variable it came from).
    pub fn new(token: &str, field: &str) -> Result<Self, MirrorError> {
        let bad = |reason: String| MirrorError::Config {
            field: field.into(),
            reason,
        };
        if token.len() < MIN_TOKEN_LEN || token.len() > MAX_TOKEN_LEN {
            return Err(bad(format!(
                "an access token must be {MIN_TOKEN_LEN} to {MAX_TOKEN_LEN} characters long, \
                 this one has {}",
                token.len()
            )));
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad(
                "an access token must be visible ASCII characters without spaces".into(),
            ));
        }
        let mut header = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|e| bad(format!("not usable in a header: {e}")))?;
        header.set_sensitive(true);
        Ok(Self { header })
    }

    /// `Some` token from an optional flag value (clap fills it from [`TOKEN_ENV`] too).
    pub fn from_arg(token: Option<&str>) -> Result<Option<Self>, MirrorError> {
        token
            .map(|t| Self::new(t, &format!("--token / {TOKEN_ENV}")))
            .transpose()
    }

    /// The `Authorization` value to send.
    pub fn header_value(&self) -> &HeaderValue {
        &self.header
    }

    /// Whether `headers` carry this token (`Bearer` in any case, RFC 7235).
    pub fn admits(&self, headers: &HeaderMap) -> bool {
        let Some(v) = headers.get(header::AUTHORIZATION) else {
            return false;
        };
        let (v, ours) = (v.as_bytes(), self.header.as_bytes());
        const SCHEME: usize = b"Bearer ".len();
        v.len() > SCHEME
            && v[..SCHEME].eq_ignore_ascii_case(&ours[..SCHEME])
            // Hashes compared in constant time: `ct_eq` on the bytes themselves returned at once
            // on a length mismatch, which timed the token's length.
            && blake3::hash(&v[SCHEME..]) == blake3::hash(&ours[SCHEME..])
    }
}

/// Admits a request to a protected route: `Ok` without a configured token or with the right
/// one, otherwise the 401 to answer.
pub fn check(token: Option<&AccessToken>, headers: &HeaderMap) -> Result<(), ServeError> {
    let Some(token) = token else {
        return Ok(());
    };
    if token.admits(headers) {
        return Ok(());
    }
    let message = if headers.contains_key(header::AUTHORIZATION) {
        "wrong access token"
    } else {
        "this server needs an access token: send `Authorization: Bearer <token>` (pullers: \
         --token or TOKENWAY_WEIGHTS_TOKEN)"
    };
    Err(ServeError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        message,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "0123456789abcdef-token";

    fn headers(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn short_spaced_or_control_tokens_are_refused_with_the_field_named() {
        for t in [
            "short",
            "sixteen chars xx",
            "0123456789abcdef\n",
            &"x".repeat(513),
        ] {
            let e = AccessToken::new(t, "--token").unwrap_err().to_string();
            assert!(e.contains("--token"), "{e}");
        }
        assert!(AccessToken::new(GOOD, "--token").is_ok());
        assert!(AccessToken::from_arg(None).unwrap().is_none());
    }

    #[test]
    fn only_the_exact_bearer_token_is_admitted() {
        let t = AccessToken::new(GOOD, "--token").unwrap();
        assert!(check(Some(&t), &headers(&format!("Bearer {GOOD}"))).is_ok());
        assert!(check(Some(&t), &headers(&format!("bearer {GOOD}"))).is_ok());
        assert!(check(None, &HeaderMap::new()).is_ok());
        let missing = check(Some(&t), &HeaderMap::new()).unwrap_err();
        assert_eq!(missing.status, StatusCode::UNAUTHORIZED);
        assert!(missing.message.contains("Bearer"), "{}", missing.message);
        for wrong in [
            format!("Bearer {GOOD}x"),
            format!("Basic {GOOD}"),
            format!("Bearer  {GOOD}"),
            GOOD.to_string(),
            "Bearer 0123456789abcdef-tokeN".into(),
        ] {
            let e = check(Some(&t), &headers(&wrong)).unwrap_err();
            assert_eq!(e.message, "wrong access token", "{wrong}");
        }
    }

    #[test]
    fn the_token_never_shows_in_debug_output() {
        let t = AccessToken::new(GOOD, "--token").unwrap();
        assert!(!format!("{t:?}").contains("0123"));
        assert!(t.header_value().is_sensitive());
    }
}
