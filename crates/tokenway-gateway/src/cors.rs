//! CORS for browser clients (`cors_allow_origins`): a web app that calls vLLM or SGLang
//! directly works because they allow every origin by default; in front of them the gateway
//! answers the browser's preflight itself and marks its own answers, so the same app works
//! through it. Off unless configured.

use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};

use crate::error::{full, ResponseBody};

/// The answer headers a browser client reads besides the safelisted ones: retry advice, the
/// backend's request id, and the gateway's timing and choice.
const EXPOSED: &str =
    "retry-after, x-should-retry, x-request-id, server-timing, x-tokenway-backend";

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
    pub fn preflight(&self, allow: HeaderValue, headers: &HeaderMap) -> Response<ResponseBody> {
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
        self.mark(&mut r, Some(allow));
        r
    }

    /// Marks an answer to a request with `headers` as the gateway's CORS rules say: readable by
    /// an allowed origin (with the headers a client needs exposed), and without any CORS
    /// header a backend put on it for another origin.
    pub fn mark_for(&self, headers: &HeaderMap, r: &mut Response<ResponseBody>) {
        self.mark(r, self.allow(headers));
    }

    /// Marks an answer with `allow` (from [`Cors::allow`] of its request) as
    /// [`Cors::mark_for`] does.
    pub fn mark(&self, r: &mut Response<ResponseBody>, allow: Option<HeaderValue>) {
        let h = r.headers_mut();
        // The backend's own CORS answer (vLLM allows every origin) is not the gateway's.
        for name in [
            header::ACCESS_CONTROL_ALLOW_ORIGIN,
            header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
        ] {
            h.remove(name);
        }
        // The answer depends on the origin unless every origin gets the same.
        if !self.any {
            h.append(header::VARY, HeaderValue::from_static("origin"));
        }
        let Some(allow) = allow else { return };
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
        h.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static(EXPOSED),
        );
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
        let cors = Cors::new(&["https://a.test".into()]).unwrap();
        let r = cors.preflight(HeaderValue::from_static("https://a.test"), &h);
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
    fn a_backends_cors_headers_give_way_to_the_gateways() {
        let cors = Cors::new(&["https://a.test".into()]).unwrap();
        let answer = || {
            let mut r = Response::new(full(bytes::Bytes::new()));
            r.headers_mut()
                .insert("access-control-allow-origin", HeaderValue::from_static("*"));
            r
        };
        let mut other = answer();
        cors.mark_for(&headers(&[("origin", "https://evil.test")]), &mut other);
        assert!(!other.headers().contains_key("access-control-allow-origin"));
        assert_eq!(other.headers()["vary"], "origin");
        let mut listed = answer();
        cors.mark_for(&headers(&[("origin", "https://a.test")]), &mut listed);
        assert_eq!(
            listed.headers()["access-control-allow-origin"],
            "https://a.test"
        );
        assert!(listed.headers()["access-control-expose-headers"]
            .to_str()
            .unwrap()
            .contains("x-should-retry"));
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
