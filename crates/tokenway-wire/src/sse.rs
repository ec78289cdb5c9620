//! Incremental Server-Sent-Events scanning for the streaming proxy.
//!
//! The gateway forwards an upstream SSE stream byte for byte and flushes every chunk at once;
//! it only needs to know *where events end*, to measure time to first token and inter-token
//! gaps, and to notice the OpenAI end marker `data: [DONE]`. [`SseScanner`] answers exactly
//! that, chunk by chunk, whatever the chunk boundaries are: an event may be split over many
//! chunks and a chunk may hold many events.
//!
//! Parsing follows the WHATWG HTML "Server-sent events" section 9.2.6 (interpreting an event
//! stream): lines end at CRLF, LF or CR; a leading UTF-8 BOM is skipped; a line starting with
//! `:` is a comment; a field line without a colon has an empty value; one space after the colon
//! is dropped; a blank line dispatches the event, and an event whose data buffer is empty (no
//! `data` field at all) is not dispatched. An unterminated event at the end of the stream is
//! never dispatched.
//!
//! The scanner must never buffer an event, copy payload bytes or allocate: its whole state is a
//! few small integers (where it is in the current line, how far the field name matches `data`
//! and the value matches `[DONE]`), so memory is bounded whatever the upstream sends. It must
//! never modify or hold back bytes either; it only observes them.

/// The UTF-8 byte order mark, skipped once at the start of a stream.
const BOM: &[u8; 3] = b"\xEF\xBB\xBF";
/// The only field name the scanner cares about.
const DATA: &[u8; 4] = b"data";
/// How nearly every data line starts.
const DATA_SPACE: &[u8; 6] = b"data: ";
/// The OpenAI end-of-stream data value.
const DONE: &[u8; 6] = b"[DONE]";

/// Where the scanner is inside the current line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// Nothing of the line seen yet; a line end here is a blank line.
    Start,
    /// The field name so far equals `DATA[..matched]`.
    Name { matched: u8 },
    /// Just after `data:`; one space may be skipped.
    ValueStart,
    /// The data value so far equals `DONE[..matched]`.
    Value { matched: u8 },
    /// The rest of the line does not matter; `data` says whether it is a data field line
    /// (which still counts for the event) or a comment / other field.
    Rest { data: bool },
}

/// What a blank line will dispatch, accumulated over the lines of the current event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Pending {
    /// Number of `data` field lines, saturating at 2 (only 0, 1 and "more" matter).
    data_lines: u8,
    /// The last data line's value was exactly `[DONE]`.
    last_value_done: bool,
    /// At least one non-blank line (comment or field) was seen since the last dispatch.
    any_line: bool,
}

/// What happened inside one chunk passed to [`SseScanner::feed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScanResult {
    /// Number of data events whose terminating blank line ended inside this chunk.
    pub events: u32,
    /// A `data: [DONE]` event ended inside this chunk.
    pub done: bool,
}

/// Incremental, bounded-state SSE event-boundary scanner. See the [module docs](self).
///
/// ```
/// use tokenway_wire::sse::SseScanner;
///
/// let mut scanner = SseScanner::new();
/// assert_eq!(scanner.feed(b"data: {\"a\":1}\n").events, 0);
/// assert_eq!(scanner.feed(b"\ndata: [DO").events, 1);
/// let last = scanner.feed(b"NE]\r\n\r\n");
/// assert!(last.done);
/// assert_eq!(scanner.events(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct SseScanner {
    line: Line,
    pending: Pending,
    /// The previous byte was a CR that ended a line, so an LF right after it is part of the
    /// same line terminator (CRLF may be split across chunks).
    after_cr: bool,
    /// Bytes of a leading BOM matched so far, while `in_prefix`.
    bom_matched: u8,
    /// Still at the very start of the stream (BOM not yet ruled in or out).
    in_prefix: bool,
    events: u64,
    /// Of `events`, those that were `data: [DONE]`.
    dones: u64,
    comments: u64,
    saw_done: bool,
}

impl Default for SseScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl SseScanner {
    /// A scanner at the start of a stream.
    pub fn new() -> Self {
        Self {
            line: Line::Start,
            pending: Pending::default(),
            after_cr: false,
            bom_matched: 0,
            in_prefix: true,
            events: 0,
            dones: 0,
            comments: 0,
            saw_done: false,
        }
    }

    /// Feed the next chunk of the stream; returns how many complete data events ended inside
    /// it and whether one of them was `data: [DONE]`.
    ///
    /// Blocks that end without any `data` field (comments such as `: keepalive`, `retry:`-only
    /// blocks) are not events; they are counted in [`comments`](Self::comments).
    pub fn feed(&mut self, chunk: &[u8]) -> ScanResult {
        let mut out = ScanResult::default();
        let mut rest = chunk;
        while self.in_prefix {
            let Some((&b, tail)) = rest.split_first() else {
                return out;
            };
            if b == BOM[usize::from(self.bom_matched)] {
                self.bom_matched += 1;
                rest = tail;
                if usize::from(self.bom_matched) == BOM.len() {
                    self.in_prefix = false;
                }
            } else {
                // Not a BOM after all: the bytes held back so far are ordinary stream bytes.
                self.in_prefix = false;
                let held = usize::from(self.bom_matched);
                self.scan(&BOM[..held], &mut out);
            }
        }
        self.scan(rest, &mut out);
        out
    }

    /// Whether an event that carries output ended inside `chunk` (what a clock of token
    /// arrivals needs), leaving the scanner where [`feed`](Self::feed) would.
    ///
    /// An event is output when it is a data event other than a lone `data: [DONE]` and, if
    /// it is whole in `chunk` and ends with a blank line `\n\n`, when
    /// [`event_carries_output`](crate::sse_output::event_carries_output) says so: role, finish,
    /// usage and error chunks of an OpenAI stream, and the framing events of Anthropic's and
    /// the Responses API's, are not tokens. An event that began in an earlier chunk, or ends
    /// with CR line endings, counts as output unread.
    ///
    /// Once an output event is seen and the rest of the chunk ends with `\n\n` (an event
    /// boundary whatever it holds), the rest is not scanned: a burst of events that arrived
    /// together costs one event's scan. The totals ([`events`](Self::events),
    /// [`comments`](Self::comments), [`saw_done`](Self::saw_done)) then leave out what was
    /// skipped.
    pub fn feed_tokens(&mut self, chunk: &[u8]) -> bool {
        let mut whole = self.at_event_start();
        let mut rest = chunk;
        while let Some(i) = memchr::memmem::find(rest, b"\n\n") {
            let (event, tail) = rest.split_at(i + 2);
            let output = self.feed_data_events(event)
                && (!whole || crate::sse_output::event_carries_output(event));
            if output {
                if tail.is_empty() || tail.ends_with(b"\n\n") {
                    // The state `feed` would leave after the chunk's closing blank line.
                    self.line = Line::Start;
                    self.pending = Pending::default();
                    self.after_cr = false;
                } else {
                    self.feed(tail);
                }
                return true;
            }
            // A blank line `\n\n` dispatches whatever came before it: the next event starts
            // here.
            whole = true;
            rest = tail;
        }
        self.feed_data_events(rest)
    }

    /// Feeds `bytes`; whether a data event other than `[DONE]` ended inside them.
    fn feed_data_events(&mut self, bytes: &[u8]) -> bool {
        let (events, dones) = (self.events, self.dones);
        self.feed(bytes);
        self.events - events > self.dones - dones
    }

    /// Whether the scanner stands at the start of an event: nothing of one has been seen.
    fn at_event_start(&self) -> bool {
        self.line == Line::Start
            && self.pending == Pending::default()
            && (!self.in_prefix || self.bom_matched == 0)
    }

    /// Total data events dispatched so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Total blank-line-terminated blocks without a `data` field so far (comments,
    /// keep-alives, `retry`-only or `id`-only blocks).
    pub fn comments(&self) -> u64 {
        self.comments
    }

    /// Whether a `data: [DONE]` event has ended.
    pub fn saw_done(&self) -> bool {
        self.saw_done
    }

    fn scan(&mut self, bytes: &[u8], out: &mut ScanResult) {
        let mut i = 0;
        while let Some(&b) = bytes.get(i) {
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    i += 1;
                    continue;
                }
            }
            match b {
                b'\r' => {
                    self.end_line(out);
                    self.after_cr = true;
                    i += 1;
                }
                b'\n' => {
                    self.end_line(out);
                    i += 1;
                }
                _ => match self.line {
                    Line::Rest { .. } => {
                        // Payload bytes: jump straight to the next line terminator.
                        let skip =
                            memchr::memchr2(b'\n', b'\r', &bytes[i..]).unwrap_or(bytes.len() - i);
                        i += skip;
                    }
                    // The common line start, whole in this chunk: the same state as byte by
                    // byte, in one comparison.
                    Line::Start if bytes[i..].starts_with(DATA_SPACE) => {
                        if let Some(end) = Self::whole_event(bytes, i + DATA_SPACE.len()) {
                            // A whole single-line event: the same as the line-by-line path
                            // (a data line that is not `[DONE]`, then the blank line).
                            self.pending.any_line = true;
                            self.pending.data_lines =
                                self.pending.data_lines.saturating_add(1).min(2);
                            self.pending.last_value_done = false;
                            self.dispatch(out);
                            i = end;
                            continue;
                        }
                        self.line = Line::Value { matched: 0 };
                        i += DATA_SPACE.len();
                    }
                    line => {
                        self.line = Self::advance(line, b);
                        i += 1;
                    }
                },
            }
        }
    }

    /// If `bytes[value..]` holds a data value that cannot be `[DONE]` (it does not start with
    /// `[`) followed by `\n\n` with no CR before it, the index just past that blank line: the
    /// shape of nearly every event an OpenAI-compatible server sends, handled in one `memchr2`.
    fn whole_event(bytes: &[u8], value: usize) -> Option<usize> {
        match bytes.get(value) {
            None | Some(b'[' | b'\r' | b'\n') => return None,
            Some(_) => {}
        }
        let end = value + memchr::memchr2(b'\n', b'\r', &bytes[value..])?;
        (bytes[end] == b'\n' && bytes.get(end + 1) == Some(&b'\n')).then_some(end + 2)
    }

    /// Next line state after a byte that is not CR or LF.
    fn advance(line: Line, b: u8) -> Line {
        match line {
            Line::Start => Self::advance(Line::Name { matched: 0 }, b),
            Line::Name { matched } => {
                let m = usize::from(matched);
                if b == b':' {
                    if m == DATA.len() {
                        Line::ValueStart
                    } else {
                        // A comment (empty name) or a field other than `data`.
                        Line::Rest { data: false }
                    }
                } else if m < DATA.len() && b == DATA[m] {
                    Line::Name {
                        matched: matched + 1,
                    }
                } else {
                    Line::Rest { data: false }
                }
            }
            Line::ValueStart if b == b' ' => Line::Value { matched: 0 },
            Line::ValueStart => Self::advance(Line::Value { matched: 0 }, b),
            Line::Value { matched } => {
                let m = usize::from(matched);
                if m < DONE.len() && b == DONE[m] {
                    Line::Value {
                        matched: matched + 1,
                    }
                } else {
                    Line::Rest { data: true }
                }
            }
            rest @ Line::Rest { .. } => rest,
        }
    }

    fn end_line(&mut self, out: &mut ScanResult) {
        let data_value_done = match self.line {
            Line::Start => {
                self.dispatch(out);
                return;
            }
            // `data` without a colon: a data field with an empty value.
            Line::Name { matched } if usize::from(matched) == DATA.len() => Some(false),
            Line::Name { .. } | Line::Rest { data: false } => None,
            Line::ValueStart | Line::Rest { data: true } => Some(false),
            Line::Value { matched } => Some(usize::from(matched) == DONE.len()),
        };
        self.pending.any_line = true;
        if let Some(done) = data_value_done {
            self.pending.data_lines = self.pending.data_lines.saturating_add(1).min(2);
            self.pending.last_value_done = done;
        }
        self.line = Line::Start;
    }

    fn dispatch(&mut self, out: &mut ScanResult) {
        let p = std::mem::take(&mut self.pending);
        if p.data_lines > 0 {
            self.events += 1;
            out.events = out.events.saturating_add(1);
            // Several data lines join with "\n", so only a single `[DONE]` line is the marker.
            if p.data_lines == 1 && p.last_value_done {
                self.saw_done = true;
                self.dones += 1;
                out.done = true;
            }
        } else if p.any_line {
            self.comments += 1;
        }
    }
}

/// Whose fault an in-stream error event says it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamErrorCause {
    /// The server's (no 4xx code or client error type): a failure of the backend.
    Server,
    /// The request's (`"code": 4xx`, or a type such as vLLM's `BadRequestError`).
    Client,
}

/// The first error event in `data` (whole events of a stream), as the OpenAI-compatible servers
/// send one after their 200, and whose fault it says it is: a data line whose JSON value starts
/// with `{"error"` (`data: {"error": {...}}`, vLLM and SGLang), or a line of the SSE field
/// `error` with a JSON object (`error: {"code": 500, ...}`, llama.cpp's server; SSE clients
/// ignore that field, so the gateway's health accounting is what sees it). Token text cannot
/// look like either: inside a JSON string quotes are escaped and line breaks are `\n`.
pub fn find_error_event(data: &[u8]) -> Option<StreamErrorCause> {
    error_event_line(data).map(|(cause, _)| cause)
}

/// Whether `data` (the start of a stream) holds the beginning of an error event whose line has
/// not ended yet: the member that says whose fault it is (`code`, `type`) may be in the bytes
/// still to come, so [`find_error_event`] on `data` alone may call the client's error the
/// server's.
pub fn error_event_unfinished(data: &[u8]) -> bool {
    error_event_line(data).is_some_and(|(_, whole)| !whole)
}

/// The first error event's cause, and whether its line is whole in `data`.
fn error_event_line(data: &[u8]) -> Option<(StreamErrorCause, bool)> {
    static DATA_ERROR: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"{\"error\""));
    static ERROR_FIELD: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"error:"));
    let line_start =
        |before: &[u8]| before.is_empty() || before.ends_with(b"\n") || before.ends_with(b"\r");
    let as_data = DATA_ERROR.find_iter(data).find(|&at| {
        let before = &data[..at];
        let before = before.strip_suffix(b" ").unwrap_or(before);
        before.strip_suffix(b"data:").is_some_and(line_start)
    });
    let as_field = ERROR_FIELD.find_iter(data).find(|&at| {
        let value = &data[at + b"error:".len()..];
        let value = value.strip_prefix(b" ").unwrap_or(value);
        line_start(&data[..at]) && value.starts_with(b"{")
    });
    let at = match (as_data, as_field) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b)?,
    };
    let rest = &data[at..];
    let end = memchr::memchr2(b'\n', b'\r', rest);
    let line = &rest[..end.unwrap_or(rest.len())];
    // Whole JSON members only: inside a string (a message quoting `FileNotFoundError`) the
    // quotes are escaped, so a server's own failure cannot pass for the client's.
    let client = [
        &b"\"code\":4"[..],
        b"\"code\": 4",
        b"\"type\":\"BadRequestError\"",
        b"\"type\": \"BadRequestError\"",
        b"\"type\":\"NotFoundError\"",
        b"\"type\": \"NotFoundError\"",
        b"\"type\":\"invalid_request_error\"",
        b"\"type\": \"invalid_request_error\"",
    ]
    .iter()
    .any(|marker| memchr::memmem::find(line, marker).is_some());
    let cause = if client {
        StreamErrorCause::Client
    } else {
        StreamErrorCause::Server
    };
    Some((cause, end.is_some()))
}

/// How many leading bytes of `data` (a piece of an event stream that starts at an event
/// boundary) are whole events: up to and including the last blank line, whatever mix of line
/// endings ends it (`\n\n`, `\r\n\r\n`, `\r\r`, `\n\r`, `\r\n\r`, as the scanner reads
/// them). The rest is an event still arriving. `data.len()` when it ends at a boundary.
pub fn complete_events_len(data: &[u8]) -> usize {
    if data.ends_with(b"\n\n") || data.ends_with(b"\r\r") || data.ends_with(b"\n\r") {
        return data.len();
    }
    let ends = [&b"\n\n"[..], b"\r\r", b"\n\r\n", b"\n\r"];
    ends.iter()
        .filter_map(|end| {
            data.windows(end.len())
                .rposition(|w| w == *end)
                .map(|i| i + end.len())
        })
        .max()
        .unwrap_or(0)
}

/// An SSE event carrying an OpenAI-style error object, for ending a stream cleanly after the
/// first byte has already reached the client:
/// `data: {"error":{"message":...,"type":"upstream_error","code":...}}\n\n`.
///
/// `message` and `code` are JSON-escaped, so the event is always a single `data` line.
pub fn error_event(message: &str, code: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + message.len() + code.len());
    out.extend_from_slice(b"data: {\"error\":{\"message\":");
    push_json_string(&mut out, message);
    out.extend_from_slice(b",\"type\":\"upstream_error\",\"code\":");
    push_json_string(&mut out, code);
    out.extend_from_slice(b"}}\n\n");
    out
}

/// The API whose shape a relay's own error event takes: the Anthropic SDKs raise only on an
/// event named `error` (`event: error`) and ignore an unnamed one, so on `/v1/messages` the
/// OpenAI-shaped event would leave a cut answer looking complete.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ErrorEventStyle {
    /// [`error_event`]: an unnamed event with an OpenAI error object.
    #[default]
    OpenAi,
    /// `event: error` with `{"type":"error","error":{"type":"api_error","message":...}}`, as
    /// the Messages API streams an error.
    Anthropic,
}

impl ErrorEventStyle {
    /// The style of the API served at `path` (a route label or a request path).
    pub fn for_path(path: &str) -> Self {
        if path == "/v1/messages" || path.starts_with("/v1/messages?") {
            Self::Anthropic
        } else {
            Self::OpenAi
        }
    }

    /// The error event for `message` (`code` is the OpenAI error code; the Anthropic shape
    /// has none).
    pub fn event(self, message: &str, code: &str) -> Vec<u8> {
        match self {
            Self::OpenAi => error_event(message, code),
            Self::Anthropic => {
                let mut out = Vec::with_capacity(96 + message.len());
                out.extend_from_slice(
                    b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":",
                );
                push_json_string(&mut out, message);
                out.extend_from_slice(b"}}\n\n");
                out
            }
        }
    }
}

/// Append `s` as a JSON string literal (RFC 8259 section 7). Control characters are escaped,
/// so the result never contains a raw CR or LF that would break the SSE line.
fn push_json_string(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x00..=0x1f => out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xf)],
            ]),
            // Multi-byte UTF-8 sequences pass through unchanged: JSON text is UTF-8.
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    #[test]
    fn error_events_are_found_with_their_cause_and_token_text_is_not_one() {
        use super::{find_error_event as error_event, StreamErrorCause::*};
        assert_eq!(
            error_event(b"data: {\"error\": {\"message\": \"x\"}}\n\n"),
            Some(Server)
        );
        assert_eq!(
            error_event(b"data: {\"a\":1}\n\ndata:{\"error\":{}}\n\n"),
            Some(Server)
        );
        assert_eq!(
            error_event(b"data: {\"a\":1}\r\n\r\ndata: {\"error\":{}}\r\n\r\n"),
            Some(Server)
        );
        // vLLM's shape for a request's fault, and OpenAI's.
        assert_eq!(
            error_event(b"data: {\"error\": {\"object\": \"error\", \"type\": \"BadRequestError\", \"code\": 400}}\n\n"),
            Some(Client)
        );
        assert_eq!(
            error_event(b"data: {\"error\":{\"type\":\"invalid_request_error\"}}\n\n"),
            Some(Client)
        );
        assert_eq!(
            error_event(
                b"data: {\"error\": {\"type\": \"InternalServerError\", \"code\": 500}}\n\n"
            ),
            Some(Server)
        );
        // A message that quotes a client error's name is still the server's failure.
        assert_eq!(
            error_event(
                b"data: {\"error\": {\"message\": \"FileNotFoundError: \\\"type\\\": \\\"NotFoundError\\\"\", \"type\": \"InternalServerError\"}}\n\n"
            ),
            Some(Server)
        );
        assert_eq!(
            error_event(b"data: {\"choices\":[{\"text\":\"{\\\"error\\\"\"}]}\n\n"),
            None
        );
        assert_eq!(
            error_event(b"data: {\"id\":\"x\",\"error\":null}\n\n"),
            None
        );
        assert_eq!(error_event(b"xdata: {\"error\":1}\n\n"), None);
        // llama.cpp's server: the SSE field `error` with its error object.
        assert_eq!(
            error_event(b"data: {\"a\":1}\n\nerror: {\"code\":500,\"message\":\"x\",\"type\":\"server_error\"}\n\ndata: [DONE]\n\n"),
            Some(Server)
        );
        assert_eq!(
            error_event(b"error: {\"code\":400,\"message\":\"the request exceeds the available context size\",\"type\":\"exceed_context_size_error\"}\n\n"),
            Some(Client)
        );
        assert_eq!(error_event(b"error:{\"code\":503}\r\n\r\n"), Some(Server));
        // Not that field: a word inside a token's text, another field's value, a plain string.
        assert_eq!(
            error_event(b"data: {\"choices\":[{\"text\":\"error: {\"}]}\n\n"),
            None
        );
        assert_eq!(error_event(b"event: error: {x}\n\n"), None);
        assert_eq!(error_event(b"error: oops\n\n"), None);
        assert_eq!(error_event(b"data: [DONE]\n\n"), None);
    }

    #[test]
    fn an_error_event_still_arriving_is_told_from_a_whole_one() {
        use super::error_event_unfinished as unfinished;
        assert!(unfinished(b"data: {\"error\": {\"message\": \"xxxx"));
        assert!(unfinished(b"data: {\"a\":1}\n\nerror: {\"message\":\""));
        assert!(!unfinished(
            b"data: {\"error\": {\"type\": \"BadRequestError\", \"code\": 400}}\n"
        ));
        assert!(!unfinished(b"data: {\"error\": {}}\r"));
        assert!(!unfinished(b"data: {\"choices\":[]}"));
        assert!(!unfinished(b""));
    }

    #[test]
    fn complete_events_end_at_the_last_blank_line() {
        assert_eq!(complete_events_len(b"data: a\n\ndata: b\n\n"), 18);
        assert_eq!(complete_events_len(b"data: a\n\ndata: {\"cho"), 9);
        assert_eq!(complete_events_len(b"data: a\r\n\r\ndata: b"), 11);
        assert_eq!(complete_events_len(b"data: a\r\rdata"), 9);
        assert_eq!(complete_events_len(b"data: {\"choices\""), 0);
        assert_eq!(complete_events_len(b"data: a\n"), 0);
        assert_eq!(complete_events_len(b""), 0);
    }
    use super::*;
    use proptest::prelude::*;

    fn scan_whole(input: &[u8]) -> (u64, u64, bool) {
        let mut s = SseScanner::new();
        s.feed(input);
        (s.events(), s.comments(), s.saw_done())
    }

    /// A deliberately simple, non-incremental reading of the WHATWG algorithm.
    fn reference(input: &[u8]) -> (u64, u64, bool) {
        let input = input.strip_prefix(BOM.as_slice()).unwrap_or(input);
        let (mut events, mut comments, mut done) = (0, 0, false);
        let (mut data_lines, mut last_value, mut any_line) = (0, Vec::new(), false);
        let mut line = Vec::new();
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            i += 1;
            if b != b'\r' && b != b'\n' {
                line.push(b);
                continue;
            }
            if b == b'\r' && input.get(i) == Some(&b'\n') {
                i += 1;
            }
            if line.is_empty() {
                if data_lines > 0 {
                    events += 1;
                    done |= data_lines == 1 && last_value == b"[DONE]";
                } else if any_line {
                    comments += 1;
                }
                (data_lines, any_line) = (0, false);
            } else {
                any_line = true;
                if line[0] != b':' {
                    let (name, value) = match line.iter().position(|&c| c == b':') {
                        Some(p) => (&line[..p], &line[p + 1..]),
                        None => (&line[..], &[][..]),
                    };
                    let value = value.strip_prefix(b" ").unwrap_or(value);
                    if name == b"data" {
                        data_lines += 1;
                        last_value = value.to_vec();
                    }
                }
            }
            line.clear();
        }
        (events, comments, done)
    }

    #[test]
    fn counts_lf_separated_events_in_one_chunk() {
        let mut s = SseScanner::new();
        let r = s.feed(b"data: {\"x\":1}\n\ndata: {\"x\":2}\n\n");
        assert_eq!(
            r,
            ScanResult {
                events: 2,
                done: false
            }
        );
        assert_eq!(s.events(), 2);
    }

    #[test]
    fn every_line_ending_mix_ends_an_event() {
        for input in [
            &b"data: a\n\n"[..],
            b"data: a\r\n\r\n",
            b"data: a\r\r",
            b"data: a\r\n\n",
            b"data: a\n\r\n",
            b"data: a\n\r",
            b"data: a\r\n\r",
        ] {
            assert_eq!(scan_whole(input), (1, 0, false), "{input:?}");
        }
    }

    #[test]
    fn crlf_split_across_chunks_is_one_line_end() {
        let mut s = SseScanner::new();
        assert_eq!(s.feed(b"data: a\r").events, 0);
        // If the LF were taken as a second line end this would be a blank line.
        assert_eq!(s.feed(b"\ndata: b\r").events, 0);
        assert_eq!(s.feed(b"\n").events, 0);
        assert_eq!(s.feed(b"\r").events, 1);
        assert_eq!(s.feed(b"\n").events, 0);
        assert_eq!(s.events(), 1);
    }

    #[test]
    fn event_split_byte_by_byte_ends_in_the_right_chunk() {
        let input = b"event: delta\ndata: {\"t\":\"hi\"}\n\n";
        let mut s = SseScanner::new();
        for (i, b) in input.iter().enumerate() {
            let r = s.feed(std::slice::from_ref(b));
            let expected = u32::from(i == input.len() - 1);
            assert_eq!(r.events, expected, "byte {i}");
        }
    }

    #[test]
    fn comments_and_retry_only_blocks_are_not_events() {
        let mut s = SseScanner::new();
        let r = s.feed(b": keepalive\n\nretry: 1000\n\nid: 7\n\n");
        assert_eq!(r.events, 0);
        assert_eq!(s.events(), 0);
        assert_eq!(s.comments(), 3);
    }

    #[test]
    fn extra_blank_lines_count_as_nothing() {
        assert_eq!(scan_whole(b"\n\n\r\n\ndata: x\n\n\n\n"), (1, 0, false));
    }

    #[test]
    fn multi_line_data_is_one_event() {
        assert_eq!(scan_whole(b"data: a\ndata: b\ndata\n\n"), (1, 0, false));
    }

    #[test]
    fn data_without_colon_or_value_is_an_event() {
        assert_eq!(scan_whole(b"data\n\n"), (1, 0, false));
        assert_eq!(scan_whole(b"data:\n\n"), (1, 0, false));
    }

    #[test]
    fn similar_field_names_are_not_data() {
        for input in [
            &b"dat: x\n\n"[..],
            b"datax: x\n\n",
            b"Data: x\n\n",
            b" data: x\n\n",
        ] {
            assert_eq!(scan_whole(input), (0, 1, false), "{input:?}");
        }
    }

    #[test]
    fn done_marker_is_recognised_with_or_without_space_and_split() {
        assert_eq!(scan_whole(b"data: [DONE]\n\n"), (1, 0, true));
        assert_eq!(scan_whole(b"data:[DONE]\r\n\r\n"), (1, 0, true));
        assert_eq!(scan_whole(b"event: end\ndata: [DONE]\n\n"), (1, 0, true));
        let mut s = SseScanner::new();
        assert!(!s.feed(b"data: {}\n\ndata: [DO").done);
        let r = s.feed(b"NE]\n\n");
        assert_eq!(
            r,
            ScanResult {
                events: 1,
                done: true
            }
        );
        assert!(s.saw_done());
    }

    #[test]
    fn near_misses_are_not_done() {
        for input in [
            &b"data: [DONE]x\n\n"[..],
            b"data: [DONE] \n\n",
            b"data:  [DONE]\n\n",
            b"data: [DONE\n\n",
            b"data: [DONE]\ndata: more\n\n",
            b"data: [DONE]\ndata: [DONE]\n\n",
            b": data: [DONE]\n\n",
        ] {
            assert!(!scan_whole(input).2, "{input:?}");
        }
    }

    #[test]
    fn unterminated_event_is_not_counted() {
        assert_eq!(scan_whole(b"data: [DONE]\n"), (0, 0, false));
    }

    #[test]
    fn leading_bom_is_skipped_even_when_split() {
        assert_eq!(scan_whole(b"\xEF\xBB\xBFdata: [DONE]\n\n"), (1, 0, true));
        let mut s = SseScanner::new();
        s.feed(b"\xEF");
        s.feed(b"\xBB\xBFdata: [DONE]\n\n");
        assert!(s.saw_done());
        // A BOM-like prefix that is not a BOM is ordinary bytes of a field name.
        assert_eq!(scan_whole(b"\xEF\xBBdata: x\n\n"), (0, 1, false));
        // Only one BOM is stripped.
        assert_eq!(
            scan_whole(b"\xEF\xBB\xBF\xEF\xBB\xBFdata: x\n\n"),
            (0, 1, false)
        );
    }

    #[test]
    fn error_event_is_one_data_line_of_valid_json() {
        let message = "bad \"thing\"\n\\ happened\r\t\u{1}é";
        let ev = error_event(message, "backend_down");
        let text = std::str::from_utf8(&ev).expect("error_event emits UTF-8");
        let body = text
            .strip_prefix("data: ")
            .and_then(|t| t.strip_suffix("\n\n"))
            .expect("framed as a single SSE data event");
        assert!(!body.contains('\n') && !body.contains('\r'));
        let v: serde_json::Value = serde_json::from_str(body).expect("valid JSON");
        assert_eq!(v["error"]["message"], message);
        assert_eq!(v["error"]["type"], "upstream_error");
        assert_eq!(v["error"]["code"], "backend_down");
        assert_eq!(scan_whole(&ev), (1, 0, false));
    }

    #[test]
    fn on_the_messages_api_the_error_event_is_named_error_with_an_anthropic_error() {
        assert_eq!(
            ErrorEventStyle::for_path("/v1/chat/completions"),
            ErrorEventStyle::OpenAi
        );
        let style = ErrorEventStyle::for_path("/v1/messages");
        assert_eq!(style, ErrorEventStyle::Anthropic);
        let message = "cut \"here\"\n";
        let ev = style.event(message, "upstream_error");
        let text = std::str::from_utf8(&ev).expect("UTF-8");
        let data = text
            .strip_prefix("event: error\ndata: ")
            .and_then(|t| t.strip_suffix("\n\n"))
            .expect("an event named error with one data line");
        let v: serde_json::Value = serde_json::from_str(data).expect("valid JSON");
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "api_error");
        assert_eq!(v["error"]["message"], message);
        assert_eq!(scan_whole(&ev), (1, 0, false));
    }

    fn stream() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            Just(b"data".to_vec()),
            Just(b"data: ".to_vec()),
            Just(b"[DONE]".to_vec()),
            Just(b"\r".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b":".to_vec()),
            Just(b" ".to_vec()),
            Just(b"retry: 5".to_vec()),
            Just(BOM.to_vec()),
            proptest::collection::vec(any::<u8>(), 0..6),
        ];
        proptest::collection::vec(piece, 0..40).prop_map(|v| v.concat())
    }

    fn bursts() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            stream(),
            Just(b"\n\n".to_vec()),
            Just(b"data: {\"t\":1}\n\n".to_vec()),
            Just(b"data: [DONE]\n\n".to_vec()),
            Just(b": keep-alive\n\n".to_vec()),
            Just(b"data: a\r\ndata: b\r\n\r\n".to_vec()),
            Just(b"data: {\"choices\":[]}\n\n".to_vec()),
            Just(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n".to_vec()),
        ];
        proptest::collection::vec(piece, 0..12).prop_map(|v| v.concat())
    }

    /// The scanner's state, without its totals.
    fn state(s: &SseScanner) -> (Line, Pending, bool, bool, u8) {
        (s.line, s.pending, s.after_cr, s.in_prefix, s.bom_matched)
    }

    #[test]
    fn a_burst_that_ends_with_a_blank_line_is_a_token_after_one_event() {
        let mut s = SseScanner::new();
        let burst = b"data: {\"t\":1}\n\ndata: {\"t\":2}\n\ndata: [DONE]\n\n";
        assert!(s.feed_tokens(burst));
        // Only the first event was scanned.
        assert_eq!(s.events(), 1);
        assert!(!s.feed_tokens(b"data: [DONE]\n\n"));
        assert!(!s.feed_tokens(b": keep-alive\n\n"));
        assert!(s.feed_tokens(b": keep-alive\n\ndata: x\n\n"));
        assert!(!s.feed_tokens(b"data: half"));
        assert!(s.feed_tokens(b" of it\n\n"));
    }

    #[test]
    fn role_and_usage_chunks_are_not_tokens_unless_they_began_earlier() {
        let role =
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
        let token = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n";
        let usage = b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":1}}\n\n";
        let mut s = SseScanner::new();
        assert!(!s.feed_tokens(role));
        assert!(s.feed_tokens(&[&role[..], &token[..]].concat()));
        assert!(!s.feed_tokens(&[&usage[..], b"data: [DONE]\n\n"].concat()));
        assert_eq!(s.events(), 5);
        // Split, the usage chunk's end cannot be read whole: it counts.
        assert!(!s.feed_tokens(&usage[..10]));
        assert!(s.feed_tokens(&usage[10..]));
    }

    proptest! {
        #[test]
        fn feed_tokens_answers_and_leaves_the_state_as_feed_does(
            input in bursts(),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let mut points: Vec<usize> = cuts.iter().map(|c| c.index(input.len() + 1)).collect();
            points.sort_unstable();
            let (mut full, mut fast) = (SseScanner::new(), SseScanner::new());
            let mut start = 0;
            for p in points.into_iter().chain([input.len()]) {
                let piece = &input[start..p];
                // Byte by byte, each event ends alone: whether one other than `[DONE]` did.
                let events = piece.iter().fold(false, |any, b| {
                    let r = full.feed(std::slice::from_ref(b));
                    any || (r.events > 0 && !r.done)
                });
                let tokens = fast.feed_tokens(piece);
                prop_assert!(!tokens || events);
                // Only events the chunk shows to hold no output are left out.
                if memchr::memmem::find(piece, b"\"choices\":[]").is_none() {
                    prop_assert_eq!(tokens, events);
                }
                prop_assert_eq!(state(&fast), state(&full));
                start = p;
            }
        }

        #[test]
        fn splitting_anywhere_gives_the_same_counts_as_whole(
            input in stream(),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let whole = scan_whole(&input);
            let mut points: Vec<usize> = cuts.iter().map(|c| c.index(input.len() + 1)).collect();
            points.sort_unstable();
            let mut s = SseScanner::new();
            let (mut events, mut done, mut start) = (0u64, false, 0);
            for p in points.into_iter().chain([input.len()]) {
                let r = s.feed(&input[start..p]);
                events += u64::from(r.events);
                done |= r.done;
                start = p;
            }
            prop_assert_eq!((s.events(), s.comments(), s.saw_done()), whole);
            prop_assert_eq!((events, done), (whole.0, whole.2));
        }

        #[test]
        fn scanner_agrees_with_reference_parser(input in stream()) {
            prop_assert_eq!(scan_whole(&input), reference(&input));
        }
    }
}
