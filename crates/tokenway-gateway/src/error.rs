//! The gateway's error type, and the OpenAI error JSON that clients receive.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};

/// Errors of starting or configuring a gateway.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The configuration is invalid; the message names the key.
    #[error("invalid gateway configuration: {0}")]
    Config(String),
    /// A TLS certificate or key could not be loaded or generated.
    #[error("TLS: {0}")]
    Tls(String),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// Error type of response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every response the gateway sends.
pub type ResponseBody = BoxBody<Bytes, BoxError>;

/// What a client did wrong or what went wrong upstream, as the client will see it.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI error `type`.
    pub kind: &'static str,
    /// OpenAI error `code`.
    pub code: &'static str,
    /// Human-readable message.
    pub message: String,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u32>,
    /// OpenAI error `param`: the request field at fault, if one is.
    pub param: Option<&'static str>,
}

impl ApiError {
    /// An error with no `Retry-After`.
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            code,
            message: message.into(),
            retry_after: None,
            param: None,
        }
    }

    /// 400: the body is not the JSON this route expects.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_json",
            message,
        )
    }

    /// 413: the request body is larger than `limit` bytes.
    pub fn body_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("the request body exceeds the limit of {limit} bytes"),
        )
    }

    /// 503: the bodies held by the gateway's fronts, all together, are at
    /// `max_held_body_bytes` (`Retry-After: 1`).
    pub fn bodies_held() -> Self {
        Self {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "gateway_busy",
                "the gateway holds as many request bodies as it may (max_held_body_bytes); retry shortly",
            )
        }
    }

    /// 408: the request body did not arrive within the client read timeout.
    pub fn request_timeout() -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            "the request body did not arrive in time",
        )
    }

    /// The OpenAI error object as JSON bytes.
    pub fn json(&self) -> Bytes {
        let v = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        Bytes::from(v.to_string())
    }

    /// The full HTTP response.
    pub fn into_response(self) -> Response<ResponseBody> {
        let mut resp = Response::new(full(self.json()));
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = self.retry_after {
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        // The gateway waited its whole first-byte timeout (and retried what it could): a
        // client's own retries (the openai package makes two on a 504) would wait it again.
        if self.status == StatusCode::GATEWAY_TIMEOUT {
            h.insert("x-should-retry", HeaderValue::from_static("false"));
        }
        resp
    }
}

/// A complete body from bytes.
pub fn full(bytes: impl Into<Bytes>) -> ResponseBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_tells_clients_not_to_retry_and_param_is_reported() {
        let r = ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "upstream_timeout",
            "slow",
        )
        .into_response();
        assert_eq!(r.headers()["x-should-retry"], "false");
        let r = ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_unavailable",
            "down",
        )
        .into_response();
        assert!(!r.headers().contains_key("x-should-retry"));
        let e = ApiError {
            param: Some("model"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                "no",
            )
        };
        let v: serde_json::Value = serde_json::from_slice(&e.json()).expect("JSON");
        assert_eq!(v["error"]["param"], "model");
        let v: serde_json::Value =
            serde_json::from_slice(&ApiError::bad_request("x").json()).expect("JSON");
        assert!(v["error"]["param"].is_null());
    }
}
