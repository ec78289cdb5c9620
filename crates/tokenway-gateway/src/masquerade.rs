//! The site shown to requests that fail tunnel authentication.
//!
//! A prober must see an ordinary web site, never an error that names tokenway: a static directory,
//! a reverse-proxied site, or a plain default page. Only GET and HEAD get content; anything else
//! gets the 405 any static site would send.
//!
//! Anyone may ask, without a token, on every port: so the memory the pages take is bounded.
//! A page of the directory or of the proxied site is read whole (at most [`MAX_PAGE_BYTES`])
//! and held until the client has taken it; at most [`PAGES_AT_ONCE`] are, and a request past
//! that gets the 503 a busy site sends. A proxied page must come whole within
//! [`PROXY_TIMEOUT`]. (Unbounded, a prober asking for a large file on 1024 HTTP/2 streams of
//! each connection, and reading nothing, made the gateway hold gigabytes.)

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::MasqueradeConfig;
use crate::error::{full, ResponseBody};
use crate::state::UpstreamClient;

/// Largest file or proxied page served.
const MAX_PAGE_BYTES: usize = 4 << 20;
/// Pages of the directory or the proxied site held in memory at once.
pub const PAGES_AT_ONCE: usize = 16;
/// Longest a proxied page may take, head and body.
const PROXY_TIMEOUT: Duration = Duration::from_secs(10);

const DEFAULT_PAGE: &str = "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Welcome</title></head>\n<body><h1>Welcome</h1><p>This site is under construction.</p></body></html>\n";

const NOT_FOUND_PAGE: &str =
    "<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>\n<body><h1>Not Found</h1></body></html>\n";

/// What unauthenticated visitors are shown, and the pages held for them.
#[derive(Clone, Debug)]
pub struct Masquerade {
    site: Site,
    pages: Arc<Semaphore>,
}

/// The site.
#[derive(Clone, Debug)]
enum Site {
    /// Static files.
    Dir(PathBuf),
    /// A reverse-proxied `http://` site.
    Proxy(Uri),
    /// The built-in plain page.
    Default,
}

/// A page's bytes, holding its place among the [`PAGES_AT_ONCE`] until they are dropped.
struct Page {
    bytes: Bytes,
    _place: OwnedSemaphorePermit,
}

impl AsRef<[u8]> for Page {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

fn held(bytes: Bytes, place: OwnedSemaphorePermit) -> Bytes {
    Bytes::from_owner(Page {
        bytes,
        _place: place,
    })
}

impl Masquerade {
    /// From the validated config.
    pub fn from_config(c: &MasqueradeConfig) -> Self {
        let site = if let Some(d) = &c.dir {
            Site::Dir(d.clone())
        } else if let Some(p) = c.proxy.as_ref().and_then(|p| p.parse::<Uri>().ok()) {
            Site::Proxy(p)
        } else {
            Site::Default
        };
        Self {
            site,
            pages: Arc::new(Semaphore::new(PAGES_AT_ONCE)),
        }
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
        if matches!(self.site, Site::Default) {
            return html(StatusCode::OK, DEFAULT_PAGE);
        }
        let Ok(place) = Arc::clone(&self.pages).try_acquire_owned() else {
            return html(
                StatusCode::SERVICE_UNAVAILABLE,
                "<!DOCTYPE html>\n<title>503 Service Unavailable</title>\n",
            );
        };
        match &self.site {
            Site::Dir(root) => serve_file(root, req.uri().path(), place).await,
            Site::Proxy(base) => proxy(base, req, client, place).await,
            Site::Default => html(StatusCode::OK, DEFAULT_PAGE),
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

async fn serve_file(
    root: &Path,
    url_path: &str,
    place: OwnedSemaphorePermit,
) -> Response<ResponseBody> {
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
            let mut r = Response::new(full(held(bytes.into(), place)));
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

async fn proxy<B>(
    base: &Uri,
    req: &Request<B>,
    client: &UpstreamClient,
    place: OwnedSemaphorePermit,
) -> Response<ResponseBody> {
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
    let page = tokio::time::timeout(PROXY_TIMEOUT, async {
        let (parts, body) = client.request(upstream).await.ok()?.into_parts();
        let body = Limited::new(body, MAX_PAGE_BYTES).collect().await.ok()?;
        Some((parts, body.to_bytes()))
    })
    .await;
    let Ok(Some((parts, body))) = page else {
        return html(
            StatusCode::BAD_GATEWAY,
            "<!DOCTYPE html>\n<title>502 Bad Gateway</title>\n",
        );
    };
    let mut r = Response::new(full(held(body, place)));
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

    #[tokio::test]
    async fn pages_held_for_visitors_are_bounded_and_past_the_bound_the_site_is_busy() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("big.bin"), vec![1u8; 1 << 20]).unwrap();
        let site = Masquerade::from_config(&MasqueradeConfig {
            dir: Some(dir.path().to_path_buf()),
            proxy: None,
        });
        let client: UpstreamClient =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http();
        let req = Request::get("/big.bin").body(()).unwrap();
        // Visitors that read nothing: each answer holds its page.
        let mut held = Vec::new();
        for _ in 0..PAGES_AT_ONCE {
            let r = site.respond(&req, &client).await;
            assert_eq!(r.status(), StatusCode::OK);
            held.push(r);
        }
        assert_eq!(
            site.respond(&req, &client).await.status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        // One visitor takes its page (or leaves): the next is served.
        let body = held.pop().unwrap().into_body().collect().await.unwrap();
        assert_eq!(body.to_bytes().len(), 1 << 20);
        assert_eq!(site.respond(&req, &client).await.status(), StatusCode::OK);
    }

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
