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
    held: Option<Bytes>,
}

impl EventHoldBack {
    /// Of what is held followed by `data`, the whole events, which can go on now; the start
    /// of an unfinished event after them is held. `None` when all of it is held.
    pub fn whole_events(&mut self, data: Bytes) -> Option<Bytes> {
        let data = self.all(data);
        let whole = crate::sse::complete_events_len(&data);
        if whole == data.len() || data.len() - whole > MAX_HELD_EVENT {
            return Some(data);
        }
        self.held = Some(data.slice(whole..));
        (whole > 0).then(|| data.slice(..whole))
    }

    /// What is held followed by `data`, all of it (the last data of a stream).
    pub fn all(&mut self, data: Bytes) -> Bytes {
        match self.held.take() {
            None => data,
            Some(held) => {
                let mut joined = BytesMut::with_capacity(held.len() + data.len());
                joined.extend_from_slice(&held);
                joined.extend_from_slice(&data);
                joined.freeze()
            }
        }
    }

    /// What is held, to pass on as it is: the stream ended inside an event.
    pub fn take(&mut self) -> Option<Bytes> {
        self.held.take()
    }

    /// Drops what is held: the unfinished event will never be finished, and an error event
    /// takes its place.
    pub fn discard(&mut self) {
        self.held = None;
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
        h.discard();
        assert_eq!(h.all(Bytes::from_static(b"x")), Bytes::from_static(b"x"));
    }

    #[test]
    fn an_unfinished_event_past_the_bound_is_not_held() {
        let mut h = EventHoldBack::default();
        let big = Bytes::from(vec![b'a'; MAX_HELD_EVENT + 1]);
        assert_eq!(h.whole_events(big.clone()), Some(big));
        assert_eq!(h.take(), None);
    }
}
