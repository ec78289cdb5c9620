//! The HTTP `Range` header (RFC 9110 section 14.2), single byte ranges only. Sans-IO.
//!
//! Mirrors and peers serve blob byte ranges; pullers ask for exactly one piece at a time.
//! A multi-range request is refused (416) rather than answered with `multipart/byteranges`,
//! which no puller needs.

use std::ops::Range;

/// Why a range cannot be served.
#[derive(Debug, PartialEq, Eq)]
pub enum RangeError {
    /// Not a byte range at all (another unit, bad syntax): RFC 9110 section 14.2 says to
    /// ignore the header, so the whole blob is served (200).
    Malformed(String),
    /// A byte range this server refuses (several ranges, END before START): 416.
    Refused(String),
    /// Well formed but outside the blob (answer 416 with `Content-Range: bytes */SIZE`).
    Unsatisfiable,
}

/// A position: DIGITs only (no sign, no space inside); one too large for `u64` is `u64::MAX`
/// (it is past the end of any blob, which is what it means).
fn position(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.parse::<u64>().unwrap_or(u64::MAX))
}

/// Parses a `Range` header value against a blob of `size` bytes.
pub fn parse_range(value: &str, size: u64) -> Result<Range<u64>, RangeError> {
    let malformed = |why: &str| RangeError::Malformed(format!("Range {value:?}: {why}"));
    let refused = |why: &str| RangeError::Refused(format!("Range {value:?}: {why}"));
    let (unit, spec) = value
        .trim()
        .split_once('=')
        .ok_or_else(|| malformed("expected bytes=START-END"))?;
    // The range unit is case-insensitive (RFC 9110 section 14.1).
    if !unit.trim().eq_ignore_ascii_case("bytes") {
        return Err(malformed("only the bytes unit is supported"));
    }
    if spec.contains(',') {
        return Err(refused("one range per request"));
    }
    let (a, b) = spec
        .split_once('-')
        .ok_or_else(|| malformed("expected bytes=START-END"))?;
    let (a, b) = (a.trim(), b.trim());
    let num = |s: &str| position(s).ok_or_else(|| malformed("positions must be decimal digits"));
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
                return Err(refused("END before START"));
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
            Err(RangeError::Refused(_))
        ));
        assert!(matches!(
            parse_range("items=0-1", 1000),
            Err(RangeError::Malformed(_))
        ));
        assert!(matches!(
            parse_range("bytes=5-1", 1000),
            Err(RangeError::Refused(_))
        ));
        assert_eq!(range_header(&(0..100)), "bytes=0-99");
    }

    #[test]
    fn ranges_follow_rfc_9110_on_unit_case_huge_positions_and_signs() {
        assert_eq!(parse_range("BYTES=0-1", 1000), Ok(0..2));
        assert_eq!(parse_range("Bytes=0-1", 1000), Ok(0..2));
        assert_eq!(
            parse_range("bytes=0-99999999999999999999", 1000),
            Ok(0..1000)
        );
        assert_eq!(
            parse_range("bytes=-99999999999999999999", 1000),
            Ok(0..1000)
        );
        assert_eq!(
            parse_range("bytes=99999999999999999999-", 1000),
            Err(RangeError::Unsatisfiable)
        );
        for bad in [
            "bytes=+5-+9",
            "bytes=5-+9",
            "bytes=-+5",
            "bytes=0x1-2",
            "bytes",
        ] {
            assert!(
                matches!(parse_range(bad, 1000), Err(RangeError::Malformed(_))),
                "{bad}"
            );
        }
    }
}
