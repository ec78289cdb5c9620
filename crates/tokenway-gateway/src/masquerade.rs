//! The site shown to requests that fail tunnel authentication.
//!
//! A prober must see an ordinary web site, never an error that names tokenway: a static directory,
//! a reverse-proxied site, or a plain default page. Only GET and HEAD get content; anything else
//! gets the 405 any static site would send.

use std::path::{Component, Path, PathBuf};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};

use crate::config::MasqueradeConfig;
use crate::error::{full, ResponseBody};
use crate::state::UpstreamClient;

/// Largest file or proxied page served.
const MAX_PAGE_BYTES: usize = 16 << 20;

const DEFAULT_PAGE: &str = "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Welcome</title></head>\n<body><h1>Welcome</h1><p>This site is under construction.</p></body></html>\n";

const NOT_FOUND_PAGE: &str =
    "<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>\n<body><h1>Not Found</h1></body></html>\n";

/// What unauthenticated visitors are shown.
#[derive(Clone, Debug)]
pub enum Masquerade {
    /// Static files.
    Dir(PathBuf),
    /// A reverse-proxied `http://` site.
    Proxy(Uri),
    /// The built-in plain page.
    Default,
}

impl Masquerade {
    /// From the validated config.
    pub fn from_config(c: &MasqueradeConfig) -> Self {
        if let Some(d) = &c.dir {
            return Masquerade::Dir(d.clone());
        }
        if let Some(p) = c.proxy.as_ref().and_then(|p| p.parse::<Uri>().ok()) {
            return Masquerade::Proxy(p);
        }
        Masquerade::Default
    }

    /// The answer to `req` (whose body is ignored).
    pub async fn respond<B>(
        &self,
        req: &Request<B>,
        client: &UpstreamClient,
    ) -> Response<ResponseBody> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            let mut r = html(
                StatusCode::METHOD_NOT_ALLOWED,
                "<!DOCTYPE html>\n<title>405 Method Not Allowed</title>\n",
            );
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
            return r;
        }
        match self {
            Masquerade::Default => html(StatusCode::OK, DEFAULT_PAGE),
            Masquerade::Dir(root) => serve_file(root, req.uri().path()).await,
            Masquerade::Proxy(base) => proxy(base, req, client).await,
        }
    }
}

fn html(status: StatusCode, body: &'static str) -> Response<ResponseBody> {
    let mut r = Response::new(full(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    r
}

/// Maps a URL path to a file under `root`, refusing anything that could leave it.
fn resolve(root: &Path, url_path: &str) -> Option<PathBuf> {
    let mut out = root.to_path_buf();
    let rel = Path::new(url_path.trim_start_matches('/'));
    for c in rel.components() {
        match c {
            Component::Normal(part) => {
                let s = part.to_str()?;
                if s.contains('\0') || s.contains('\\') || s.starts_with('.') {
                    return None;
                }
                out.push(part);
            }
            Component::CurDir => {}
            _ => return None,
        }
    }
    Some(out)
}

async fn serve_file(root: &Path, url_path: &str) -> Response<ResponseBody> {
    let Some(mut path) = resolve(root, url_path) else {
        return html(StatusCode::NOT_FOUND, NOT_FOUND_PAGE);
    };
    if tokio::fs::metadata(&path).await.is_ok_and(|m| m.is_dir()) {
        path.push("index.html");
    }
    let meta = match tokio::fs::metadata(&path).await {
        Ok(m) if m.is_file() && m.len() <= MAX_PAGE_BYTES as u64 => m,
        _ => return html(StatusCode::NOT_FOUND, NOT_FOUND_PAGE),
    };
    match tokio::fs::read(&path).await {
        Ok(bytes) => {
            let mut r = Response::new(full(bytes));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(content_type(&path)),
            );
            r.headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(meta.len()));
            r
        }
        Err(_) => html(StatusCode::NOT_FOUND, NOT_FOUND_PAGE),
    }
}

fn content_type(path: &Path) -> &'static str {
    match path.extension().and_then(|e| e.to_str()).unwrap_or("") {
        "html" | "htm" => "text/html; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "js" => "text/javascript; charset=utf-8",
        "json" => "application/json",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "svg" => "image/svg+xml",
        "ico" => "image/x-icon",
        "txt" => "text/plain; charset=utf-8",
        "woff2" => "font/woff2",
        _ => "application/octet-stream",
    }
}

async fn proxy<B>(base: &Uri, req: &Request<B>, client: &UpstreamClient) -> Response<ResponseBody> {
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let mut parts = base.clone().into_parts();
    parts.path_and_query = path.parse().ok();
    let Ok(uri) = Uri::from_parts(parts) else {
        return html(StatusCode::NOT_FOUND, NOT_FOUND_PAGE);
    };
    let mut upstream = Request::new(Full::new(Bytes::new()));
    *upstream.method_mut() = req.method().clone();
    *upstream.uri_mut() = uri;
    for name in [header::ACCEPT, header::ACCEPT_LANGUAGE, header::USER_AGENT] {
        if let Some(v) = req.headers().get(&name) {
            upstream.headers_mut().insert(name, v.clone());
        }
    }
    let resp =
        match tokio::time::timeout(std::time::Duration::from_secs(10), client.request(upstream))
            .await
        {
            Ok(Ok(r)) => r,
            _ => {
                return html(
                    StatusCode::BAD_GATEWAY,
                    "<!DOCTYPE html>\n<title>502 Bad Gateway</title>\n",
                )
            }
        };
    let (parts, body) = resp.into_parts();
    let body = match Limited::new(body, MAX_PAGE_BYTES).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return html(
                StatusCode::BAD_GATEWAY,
                "<!DOCTYPE html>\n<title>502 Bad Gateway</title>\n",
            )
        }
    };
    let mut r = Response::new(full(body));
    *r.status_mut() = parts.status;
    for name in [
        header::CONTENT_TYPE,
        header::CACHE_CONTROL,
        header::LAST_MODIFIED,
        header::ETAG,
    ] {
        if let Some(v) = parts.headers.get(&name) {
            r.headers_mut().insert(name, v.clone());
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_cannot_leave_the_root() {
        let root = Path::new("/srv/www");
        assert_eq!(
            resolve(root, "/a/b.html"),
            Some(PathBuf::from("/srv/www/a/b.html"))
        );
        assert_eq!(resolve(root, "/"), Some(PathBuf::from("/srv/www")));
        for bad in ["/../etc/passwd", "/a/../../x", "/.git/config", "/a\\b"] {
            assert_eq!(resolve(root, bad), None, "{bad}");
        }
    }
}
