//! The HTTP `Range` header (RFC 9110 section 14.2), single byte ranges only. Sans-IO.
//!
//! Mirrors and peers serve blob byte ranges; pullers ask for exactly one piece at a time.
//! A multi-range request is refused (416) rather than answered with `multipart/byteranges`,
//! which no puller needs.

use std::ops::Range;

/// Why a range cannot be served.
#[derive(Debug, PartialEq, Eq)]
pub enum RangeError {
    /// Not `bytes=A-B`, `bytes=A-` or `bytes=-N`.
    Malformed(String),
    /// Well formed but outside the blob (answer 416 with `Content-Range: bytes */SIZE`).
    Unsatisfiable,
}

/// Parses a `Range` header value against a blob of `size` bytes.
pub fn parse_range(value: &str, size: u64) -> Result<Range<u64>, RangeError> {
    let malformed = |why: &str| RangeError::Malformed(format!("Range {value:?}: {why}"));
    let spec = value
        .trim()
        .strip_prefix("bytes=")
        .ok_or_else(|| malformed("only the bytes unit is supported"))?;
    if spec.contains(',') {
        return Err(malformed("one range per request"));
    }
    let (a, b) = spec
        .split_once('-')
        .ok_or_else(|| malformed("expected bytes=START-END"))?;
    let (a, b) = (a.trim(), b.trim());
    let num = |s: &str| {
        s.parse::<u64>()
            .map_err(|_| malformed("positions must be decimal integers"))
    };
    let range = match (a.is_empty(), b.is_empty()) {
        (true, true) => return Err(malformed("expected bytes=START-END")),
        (true, false) => {
            let n = num(b)?;
            if n == 0 {
                return Err(RangeError::Unsatisfiable);
            }
            size.saturating_sub(n)..size
        }
        (false, true) => num(a)?..size,
        (false, false) => {
            let (s, e) = (num(a)?, num(b)?);
            if e < s {
                return Err(malformed("END before START"));
            }
            s..e.saturating_add(1).min(size)
        }
    };
    if range.start >= size {
        return Err(RangeError::Unsatisfiable);
    }
    Ok(range)
}

/// The `Range` header value asking for `range`.
pub fn range_header(range: &Range<u64>) -> String {
    format!("bytes={}-{}", range.start, range.end.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_clamp_and_refuse() {
        assert_eq!(parse_range("bytes=0-99", 1000), Ok(0..100));
        assert_eq!(parse_range("bytes=900-", 1000), Ok(900..1000));
        assert_eq!(parse_range("bytes=-10", 1000), Ok(990..1000));
        assert_eq!(parse_range("bytes=990-5000", 1000), Ok(990..1000));
        assert_eq!(
            parse_range("bytes=1000-1001", 1000),
            Err(RangeError::Unsatisfiable)
        );
        assert!(matches!(
            parse_range("bytes=0-1,5-6", 1000),
            Err(RangeError::Malformed(_))
        ));
        assert!(matches!(
            parse_range("items=0-1", 1000),
            Err(RangeError::Malformed(_))
        ));
        assert!(matches!(
            parse_range("bytes=5-1", 1000),
            Err(RangeError::Malformed(_))
        ));
        assert_eq!(range_header(&(0..100)), "bytes=0-99");
    }
}
