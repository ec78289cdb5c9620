//! Holding back the start of an SSE event whose end has not arrived yet.
//!
//! A relay that may end a stream with an error event of its own (the gateway when its backend
//! fails, the edge when the tunnel does) must never append it inside an unfinished event: a
//! client would read the two as one event of broken JSON, not as an error. So what it passes
//! on is whole events ([`crate::sse::complete_events_len`]), and the start of the next one
//! waits for the rest. An unfinished event longer than [`MAX_HELD_EVENT`] is passed on as it
//! comes, so memory stays bounded whatever the upstream sends.

use bytes::{Bytes, BytesMut};

/// Most bytes of an unfinished event held back.
pub const MAX_HELD_EVENT: usize = 1 << 20;

/// See the module docs.
#[derive(Debug, Default)]
pub struct EventHoldBack {
    /// The start of an unfinished event (empty: nothing held). It holds no event boundary,
    /// so only the bytes that arrive (and the last two held, for a boundary split between
    /// pieces) are searched for one: searching all of it for every piece was quadratic in
    /// the event's size (a 1 MiB event in 1.2 KB pieces: ~2 GB of byte operations).
    held: BytesMut,
    /// What went on last ended inside an event (one passed on unfinished for its size): an
    /// event of the relay's own must first end it ([`Self::discard`]).
    passed_unfinished: bool,
}

/// Bytes of a boundary that can be held before the rest of it arrives (`\n\r\n` less one).
const BOUNDARY_SPLIT: usize = 2;

impl EventHoldBack {
    /// Of what is held followed by `data`, the whole events, which can go on now; the start
    /// of an unfinished event after them is held. `None` when all of it is held.
    pub fn whole_events(&mut self, data: Bytes) -> Option<Bytes> {
        if self.held.is_empty() {
            let whole = crate::sse::complete_events_len(&data);
            if whole == data.len() || data.len() - whole > MAX_HELD_EVENT {
                self.passed_unfinished = whole != data.len();
                return Some(data);
            }
            self.held.extend_from_slice(&data[whole..]);
            if whole > 0 {
                self.passed_unfinished = false;
            }
            return (whole > 0).then(|| data.slice(..whole));
        }
        let from = self.held.len().saturating_sub(BOUNDARY_SPLIT);
        self.held.extend_from_slice(&data);
        let whole = match crate::sse::complete_events_len(&self.held[from..]) {
            0 => 0,
            n => from + n,
        };
        if whole == self.held.len() || self.held.len() - whole > MAX_HELD_EVENT {
            self.passed_unfinished = whole != self.held.len();
            return Some(self.held.split().freeze());
        }
        if whole > 0 {
            self.passed_unfinished = false;
        }
        (whole > 0).then(|| self.held.split_to(whole).freeze())
    }

    /// What is held followed by `data`, all of it (the last data of a stream).
    pub fn all(&mut self, data: Bytes) -> Bytes {
        if self.held.is_empty() {
            return data;
        }
        self.held.extend_from_slice(&data);
        self.held.split().freeze()
    }

    /// What is held, to pass on as it is: the stream ended inside an event.
    pub fn take(&mut self) -> Option<Bytes> {
        (!self.held.is_empty()).then(|| self.held.split().freeze())
    }

    /// Drops what is held: the unfinished event will never be finished, and an error event
    /// takes its place. Returns what must go before that event: nothing, or the blank line
    /// that ends an event passed on unfinished (one longer than [`MAX_HELD_EVENT`]), which the
    /// error event would otherwise be read as part of.
    pub fn discard(&mut self) -> &'static str {
        self.held.clear();
        if std::mem::take(&mut self.passed_unfinished) {
            "\n\n"
        } else {
            ""
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_events_go_on_and_the_start_of_the_next_waits_for_its_end() {
        let mut h = EventHoldBack::default();
        assert_eq!(
            h.whole_events(Bytes::from_static(b"data: 1\n\ndata: ")),
            Some(Bytes::from_static(b"data: 1\n\n"))
        );
        assert_eq!(h.whole_events(Bytes::from_static(b"{\"x\"")), None);
        assert_eq!(
            h.whole_events(Bytes::from_static(b":2}\n\n")),
            Some(Bytes::from_static(b"data: {\"x\":2}\n\n"))
        );
        assert_eq!(h.take(), None);
        // The end of a stream inside an event: the rest goes on as it is.
        assert_eq!(h.whole_events(Bytes::from_static(b"data: tail")), None);
        assert_eq!(h.take(), Some(Bytes::from_static(b"data: tail")));
        // Or an error takes its place.
        assert_eq!(h.whole_events(Bytes::from_static(b"data: cut")), None);
        assert_eq!(h.discard(), "", "nothing of it went on");
        assert_eq!(h.all(Bytes::from_static(b"x")), Bytes::from_static(b"x"));
    }

    /// An event too long to hold goes on unfinished; an error event after it must first end
    /// it (it was appended to it, and a client read the two as one broken event). Once an
    /// event boundary has gone on, nothing is needed.
    #[test]
    fn an_event_passed_on_unfinished_is_ended_before_an_error_event() {
        let mut long = b"data: ".to_vec();
        long.resize(MAX_HELD_EVENT + 10, b'a');
        for first_held in [false, true] {
            let mut h = EventHoldBack::default();
            if first_held {
                assert_eq!(h.whole_events(Bytes::from_static(b"data: a")), None);
            }
            let passed = h
                .whole_events(Bytes::from(long.clone()))
                .expect("passed on");
            assert!(!passed.ends_with(b"\n\n"));
            assert_eq!(h.discard(), "\n\n", "first held: {first_held}");
            assert_eq!(h.discard(), "", "said once");
        }
        let mut h = EventHoldBack::default();
        h.whole_events(Bytes::from(long.clone()))
            .expect("passed on");
        assert_eq!(
            h.whole_events(Bytes::from_static(b"aaa\n\ndata: x")),
            Some(Bytes::from_static(b"aaa\n\n"))
        );
        assert_eq!(h.discard(), "", "the long event ended");
    }

    proptest::proptest! {
        /// However a stream of events with mixed line endings is cut into pieces, what goes
        /// on is the stream itself, and every piece that goes on ends where an event does.
        #[test]
        fn any_cut_of_a_stream_passes_on_whole_events_and_every_byte(
            events in proptest::collection::vec(
                ("[a-z{}\":, ]{0,40}", 0usize..5),
                1..12,
            ),
            cuts in proptest::collection::vec(1usize..50, 1..40),
        ) {
            let ends: [&[u8]; 5] = [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r", b"\r\n\r"];
            let mut stream = Vec::new();
            for (text, end) in &events {
                stream.extend_from_slice(b"data: ");
                stream.extend_from_slice(text.as_bytes());
                stream.extend_from_slice(ends[*end]);
            }
            stream.extend_from_slice(b"data: unfinished");
            let mut h = EventHoldBack::default();
            let mut out = Vec::new();
            let (mut at, mut i) = (0, 0);
            while at < stream.len() {
                let n = cuts[i % cuts.len()].min(stream.len() - at);
                i += 1;
                if let Some(b) = h.whole_events(Bytes::copy_from_slice(&stream[at..at + n])) {
                    proptest::prop_assert_eq!(crate::sse::complete_events_len(&b), b.len());
                    out.extend_from_slice(&b);
                }
                at += n;
            }
            let held = h.take().unwrap_or_default();
            proptest::prop_assert!(held.ends_with(b"data: unfinished"));
            out.extend_from_slice(&held);
            proptest::prop_assert_eq!(out, stream);
        }
    }

    #[test]
    fn an_unfinished_event_past_the_bound_is_not_held() {
        let mut h = EventHoldBack::default();
        let big = Bytes::from(vec![b'a'; MAX_HELD_EVENT + 1]);
        assert_eq!(h.whole_events(big.clone()), Some(big));
        assert_eq!(h.take(), None);
    }
}
