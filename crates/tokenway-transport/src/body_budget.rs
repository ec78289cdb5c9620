//! A bound on the request bodies a server holds, all connections and fronts together.
//!
//! The edge and the gateway read a request's whole body before sending it on (so that it can
//! be sent again: on a fresh connection, to another backend, to a hedge), up to
//! `max_body_bytes` each; with no bound on their number, one h2c client with 1024 streams of
//! 32 MiB made the edge hold 32 GiB, and 10 000 HTTP/1.1 connections could make a gateway
//! hold ten times that. A body takes its bytes from this budget as they arrive and gives them
//! back when the request no longer needs them (its answer's head is in, or it failed); a
//! request that finds no room is answered 503 at once (with `Retry-After`), the rest of its
//! body unread. A declared length is checked against the room left before any of the body
//! is read (and before `100 Continue`), but takes nothing: a declaration alone, its bytes
//! trickled or never sent, must not hold the budget that other requests' real bytes need. Shared by the edge and the gateway, which
//! never import each other.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A request head's size as HTTP/2 and HTTP/3 count it against their limit on header lists:
/// name, value and 32 bytes per field (RFC 9113 §6.5.2, RFC 9114 §4.2.2), the target's
/// pseudo-fields (its path with the query, its authority) included. On those protocols a
/// request's head is held with its body in the budget: one connection may have 1024 streams
/// each waiting for its body with up to 64 KiB of fields (cheap to send: HPACK and QPACK
/// repeat a field for a byte or two), where an HTTP/1.1 connection holds one head.
pub fn request_head_bytes(parts: &http::request::Parts) -> usize {
    let target = parts.uri.path_and_query().map_or(0, |p| p.as_str().len())
        + parts.uri.authority().map_or(0, |a| a.as_str().len())
        + 2 * 32;
    let fields: usize = parts
        .headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 32)
        .sum();
    target + fields
}

/// The least the budget holds: at least two of the largest bodies.
pub const MIN_BUDGET_BYTES: usize = 256 << 20;

/// The budget.
#[derive(Debug)]
pub struct BodyBudget {
    permits: Arc<Semaphore>,
}

/// Bytes of the budget taken by one body; given back when dropped.
#[derive(Debug)]
pub struct Held {
    permits: Arc<Semaphore>,
    permit: Option<OwnedSemaphorePermit>,
}

impl BodyBudget {
    /// A budget for bodies of at most `max_body_bytes` each: the larger of
    /// [`MIN_BUDGET_BYTES`] and twice that.
    pub fn for_bodies_of(max_body_bytes: usize) -> Self {
        Self::of_bytes(MIN_BUDGET_BYTES.max(max_body_bytes.saturating_mul(2)))
    }

    /// A budget of `bytes` (at most 4 GiB - 1, a semaphore's permits are counted in `u32`).
    pub fn of_bytes(bytes: usize) -> Self {
        let bytes = bytes.min(Semaphore::MAX_PERMITS).min(u32::MAX as usize);
        Self {
            permits: Arc::new(Semaphore::new(bytes)),
        }
    }

    /// An empty hold, to grow as a body arrives.
    pub fn hold(&self) -> Held {
        Held {
            permits: Arc::clone(&self.permits),
            permit: None,
        }
    }
}

impl Held {
    /// Takes `bytes` more, at once or not at all: false when the budget has no room.
    pub fn grow(&mut self, bytes: usize) -> bool {
        if bytes == 0 {
            return true;
        }
        let Ok(n) = u32::try_from(bytes) else {
            return false;
        };
        match Arc::clone(&self.permits).try_acquire_many_owned(n) {
            Ok(p) => {
                match &mut self.permit {
                    Some(held) => held.merge(p),
                    None => self.permit = Some(p),
                }
                true
            }
            Err(_) => false,
        }
    }

    /// Whether the budget has room for `bytes` more now (a body's declared length, before
    /// any of it is read). Takes nothing: the bytes are taken by [`grow`](Self::grow) as they
    /// arrive, and may find the room gone by then.
    pub fn has_room_for(&self, bytes: usize) -> bool {
        self.permits.available_permits() >= bytes
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.permit
            .as_ref()
            .map_or(0, OwnedSemaphorePermit::num_permits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_take_their_bytes_while_they_are_held_and_past_the_bound_are_refused() {
        let budget = BodyBudget::for_bodies_of(1 << 20);
        let total = MIN_BUDGET_BYTES;
        let mut a = budget.hold();
        assert!(a.grow(total - 10));
        assert_eq!(a.bytes(), total - 10);
        let mut b = budget.hold();
        assert!(b.has_room_for(10) && !b.has_room_for(11));
        assert!(b.grow(10));
        assert!(!b.grow(1), "the budget is full");
        assert!(!budget.hold().has_room_for(1));
        drop(a);
        assert!(b.grow(1_000), "a body that is done gives its bytes back");
        // Large bodies: room for two of the largest.
        let budget = BodyBudget::for_bodies_of(512 << 20);
        let (mut x, mut y) = (budget.hold(), budget.hold());
        assert!(x.grow(512 << 20) && y.grow(512 << 20));
        assert!(!budget.hold().grow(1));
    }
}
