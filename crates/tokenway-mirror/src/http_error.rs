//! Errors that the mirror and peer HTTP servers answer with: a status and a JSON message.
//!
//! Cloneable, because one failed origin fetch is handed to every request that waited on it
//! (single flight).

use bytes::Bytes;
use http::{header, Response, StatusCode};

use crate::MirrorError;

/// An error answer: `{"error": {"kind": "...", "message": "..."}}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeError {
    /// HTTP status.
    pub status: StatusCode,
    /// Short machine-readable kind (`origin_unavailable`, `not_found`, ...).
    pub kind: &'static str,
    /// What went wrong, for a human.
    pub message: String,
}

impl ServeError {
    /// A new error.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
        }
    }

    /// 400.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 502: the origin failed or is unreachable.
    pub fn origin(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "origin_unavailable", message)
    }

    /// 503: a bound was reached; retry later or elsewhere.
    pub fn busy(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "busy", message)
    }

    /// Maps a crate error met while asking the origin.
    pub fn from_origin(e: &MirrorError) -> Self {
        match e {
            MirrorError::NotFound { .. } => Self::not_found(e.to_string()),
            MirrorError::InvalidName { .. } => Self::bad_request(e.to_string()),
            MirrorError::Manifest { .. } => {
                Self::origin(format!("the origin holds an invalid manifest: {e}"))
            }
            _ => Self::origin(format!("origin unavailable: {e}")),
        }
    }

    /// The JSON response (a 401 names the scheme in `WWW-Authenticate`).
    pub fn response<B: From<Bytes>>(&self) -> Response<B> {
        let body = serde_json::json!({
            "error": {"kind": self.kind, "message": self.message}
        });
        let mut r = Response::new(B::from(Bytes::from(body.to_string())));
        *r.status_mut() = self.status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        r
    }
}

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.as_u16(),
            self.kind,
            self.message
        )
    }
}
