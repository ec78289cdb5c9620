//! HTTP/1.1 heads parsed by `httparse` turned into `http` types without copying a header value:
//! shared by the client front (`front_h1`) and the backend side (`upstream_h1`).
//!
//! `httparse` hands out header slices that borrow the read buffer; the buffer's head must then be
//! split off (which needs it mutably) before the values can become slices of it. So the slices
//! are first turned into positions ([`HeaderSpans`]), then into a [`HeaderMap`] whose values
//! share the frozen head's bytes.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// Most headers in a head (either direction); more is a malformed head.
pub const MAX_HEADERS: usize = 128;
/// Header spans kept on the stack; more spill to the heap.
pub const INLINE_SPANS: usize = 24;

/// Where each header's name and value lie in the buffer a head was parsed from.
pub struct HeaderSpans {
    inline: [(usize, usize, usize, usize); INLINE_SPANS],
    spilled: Vec<(usize, usize, usize, usize)>,
    count: usize,
}

impl HeaderSpans {
    /// The positions of `headers`, parsed from the buffer that starts at `base`.
    pub fn new(base: *const u8, headers: &[httparse::Header<'_>]) -> Self {
        Self::new_kept(base, headers, |_| true)
    }

    /// The positions of those `headers` that `keep` accepts.
    pub fn new_kept(
        base: *const u8,
        headers: &[httparse::Header<'_>],
        keep: impl Fn(&httparse::Header<'_>) -> bool,
    ) -> Self {
        let base = base as usize;
        let mut spans = Self {
            inline: [(0, 0, 0, 0); INLINE_SPANS],
            spilled: Vec::new(),
            count: 0,
        };
        let spill = headers.len() > INLINE_SPANS;
        if spill {
            spans.spilled.reserve_exact(headers.len());
        }
        for h in headers.iter().filter(|h| keep(h)) {
            let span = (
                h.name.as_ptr() as usize - base,
                h.name.len(),
                h.value.as_ptr() as usize - base,
                h.value.len(),
            );
            if spill {
                spans.spilled.push(span);
            } else {
                spans.inline[spans.count] = span;
            }
            spans.count += 1;
        }
        spans
    }

    fn spans(&self) -> &[(usize, usize, usize, usize)] {
        if self.spilled.is_empty() {
            &self.inline[..self.count]
        } else {
            &self.spilled
        }
    }

    /// The headers as a map whose values are slices of `head` (the bytes the spans were taken
    /// from, split off and frozen), with room for `extra` more that the gateway adds. Fails on a
    /// name or value `http` does not accept, saying which.
    pub fn into_map(self, head: &Bytes, extra: usize) -> Result<HeaderMap, String> {
        let mut map = HeaderMap::with_capacity(self.count + extra);
        for &(name_at, name_len, at, len) in self.spans() {
            let raw_name = &head[name_at..name_at + name_len];
            let name = HeaderName::from_bytes(raw_name)
                .map_err(|_| format!("bad header name {:?}", String::from_utf8_lossy(raw_name)))?;
            let value = HeaderValue::from_maybe_shared(head.slice(at..at + len))
                .map_err(|_| format!("bad value of header {name}"))?;
            map.append(name, value);
        }
        Ok(map)
    }
}

/// Whether a comma-separated header (`connection`, `transfer-encoding`, ...) lists `token`.
pub fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .any(|v| lists_token(v.as_bytes(), token))
}

/// Whether a comma-separated header value lists `token` (ASCII case ignored).
pub fn lists_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// Whether a `connection` header value names other headers (RFC 9110 §7.6.1): any option but
/// `close` and `keep-alive`, which name none that are not hop-by-hop already.
pub fn names_headers(value: &[u8]) -> bool {
    value
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .any(|t| {
            !t.is_empty()
                && !t.eq_ignore_ascii_case(b"close")
                && !t.eq_ignore_ascii_case(b"keep-alive")
        })
}

/// Whether some `connection` header among `headers` lists `name`, which makes that header
/// hop-by-hop for this connection only.
pub fn named_by_connection<'h>(
    mut connection_values: impl Iterator<Item = &'h [u8]>,
    name: &str,
) -> bool {
    connection_values.any(|v| lists_token(v, name))
}

/// Whether `name` is a hop-by-hop header (RFC 9110 §7.6.1, plus the old `keep-alive` and
/// `proxy-connection`): one a proxy answers itself and does not pass on.
pub fn is_hop_by_hop(name: &str) -> bool {
    const HOP_BY_HOP: [&str; 9] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ];
    HOP_BY_HOP.iter().any(|h| h.eq_ignore_ascii_case(name))
}

/// A decimal number of 1 to 19 ASCII digits (no sign, no spaces: RFC 9110's `1*DIGIT`).
pub fn parse_digits(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 19 || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    s.iter().try_fold(0u64, |n, &d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}
