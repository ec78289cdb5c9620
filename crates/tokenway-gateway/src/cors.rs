//! CORS for browser clients (`cors_allow_origins`): a web app that calls vLLM or SGLang
//! directly works because they allow every origin by default; in front of them the gateway
//! answers the browser's preflight itself and marks its own answers, so the same app works
//! through it. Off unless configured.

use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};

use crate::error::{full, ResponseBody};

/// How long a browser may cache a preflight's answer, seconds.
const MAX_AGE: &str = "86400";

/// The origins allowed to call the API from a browser.
#[derive(Debug)]
pub struct Cors {
    any: bool,
    origins: Vec<HeaderValue>,
}

impl Cors {
    /// From `cors_allow_origins` (validated by the config); `None` when empty.
    pub fn new(origins: &[String]) -> Option<Self> {
        if origins.is_empty() {
            return None;
        }
        Some(Self {
            any: origins.iter().any(|o| o == "*"),
            origins: origins
                .iter()
                .filter_map(|o| HeaderValue::from_str(o.trim_end_matches('/')).ok())
                .collect(),
        })
    }

    /// The `Access-Control-Allow-Origin` value for a request from `headers`' `Origin`, if that
    /// origin may call: `*` when any may, else the origin itself.
    pub fn allow(&self, headers: &HeaderMap) -> Option<HeaderValue> {
        let origin = headers.get(header::ORIGIN)?;
        if self.any {
            return Some(HeaderValue::from_static("*"));
        }
        self.origins
            .iter()
            .any(|o| o.as_bytes().eq_ignore_ascii_case(origin.as_bytes()))
            .then(|| origin.clone())
    }

    /// Whether a request is a browser's preflight (`OPTIONS` naming the method it will send).
    pub fn is_preflight(method: &Method, headers: &HeaderMap) -> bool {
        method == Method::OPTIONS && headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
    }

    /// The answer to an allowed preflight: 204, the API's methods, the headers it asked for.
    pub fn preflight(allow: HeaderValue, headers: &HeaderMap) -> Response<ResponseBody> {
        let mut r = Response::new(full(bytes::Bytes::new()));
        *r.status_mut() = StatusCode::NO_CONTENT;
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        let asked = headers
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .cloned()
            .unwrap_or_else(|| HeaderValue::from_static("authorization, content-type"));
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static(MAX_AGE),
        );
        Self::mark(&mut r, allow);
        r
    }

    /// Marks an answer as readable by the allowed origin.
    pub fn mark(r: &mut Response<ResponseBody>, allow: HeaderValue) {
        let h = r.headers_mut();
        if allow != "*" {
            h.append(header::VARY, HeaderValue::from_static("origin"));
        }
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
    }
}

/// Checks one `cors_allow_origins` entry: `*`, or an origin `scheme://host[:port]`.
pub fn validate_origin(o: &str) -> Result<(), String> {
    if o == "*" {
        return Ok(());
    }
    let bad = || {
        format!("cors_allow_origins: {o:?} is not \"*\" or an origin such as \"https://app.example.com\"")
    };
    let (scheme, rest) = o.split_once("://").ok_or_else(bad)?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if !matches!(scheme, "http" | "https") || rest.is_empty() || rest.contains('/') {
        return Err(bad());
    }
    HeaderValue::from_str(o).map_err(|_| bad())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn listed_origins_are_echoed_and_others_get_nothing() {
        let cors = Cors::new(&["https://app.example.com".into()]).unwrap();
        let ok = headers(&[("origin", "https://APP.example.com")]);
        assert_eq!(cors.allow(&ok).unwrap(), "https://APP.example.com");
        assert!(cors
            .allow(&headers(&[("origin", "https://evil.test")]))
            .is_none());
        assert!(cors.allow(&HeaderMap::new()).is_none());
        let any = Cors::new(&["*".into()]).unwrap();
        assert_eq!(any.allow(&ok).unwrap(), "*");
        assert!(Cors::new(&[]).is_none());
    }

    #[test]
    fn a_preflight_gets_the_methods_and_the_headers_it_asked_for() {
        let h = headers(&[
            ("origin", "https://a.test"),
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "authorization, content-type, x-stainless-os",
            ),
        ]);
        assert!(Cors::is_preflight(&Method::OPTIONS, &h));
        assert!(!Cors::is_preflight(&Method::OPTIONS, &HeaderMap::new()));
        let r = Cors::preflight(HeaderValue::from_static("https://a.test"), &h);
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
        let rh = r.headers();
        assert_eq!(rh["access-control-allow-origin"], "https://a.test");
        assert_eq!(
            rh["access-control-allow-headers"],
            "authorization, content-type, x-stainless-os"
        );
        assert!(rh["access-control-allow-methods"]
            .to_str()
            .unwrap()
            .contains("POST"));
        assert_eq!(rh["vary"], "origin");
    }

    #[test]
    fn origins_are_validated() {
        for ok in [
            "*",
            "https://a.example.com",
            "http://localhost:3000",
            "http://a.test/",
        ] {
            assert!(validate_origin(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a.example.com", "ftp://a", "https://a/b", "https://"] {
            assert!(validate_origin(bad).is_err(), "{bad}");
        }
    }
}
