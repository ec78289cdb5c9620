//! A bound on the piece bytes the mirror holds in memory for responses, all clients together.
//!
//! Each blob response holds the piece it is sending until the client has read it; a client
//! that stops reading (a stalled or hostile one) would otherwise keep a piece per connection
//! alive, and thousands of connections times a 64 MiB piece is more memory than any host has.
//! A response takes its piece's size from this budget before it reads the piece, and the
//! bytes it sends give it back when the last of them is dropped (written or the connection
//! closed). A request that cannot get its share within [`BUDGET_WAIT`] is answered 503 (or
//! its body cut, if the head has gone); the write-stall timeout of the connections
//! (`crate::http_serve`) makes sure a stalled client gives its share back.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokenway_telemetry::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::http_error::ServeError;

/// Piece bytes held for responses at once, by default.
pub const MAX_SERVING_BYTES: u64 = 1 << 30;
/// Longest a response waits for its share of the budget.
pub const BUDGET_WAIT: Duration = Duration::from_secs(5);

/// The budget.
pub struct ServeBudget {
    permits: Arc<Semaphore>,
    max: u64,
    held: Gauge,
}

/// A share of the budget, given back when dropped.
pub struct Share {
    _permit: OwnedSemaphorePermit,
    bytes: i64,
    held: Gauge,
}

impl Drop for Share {
    fn drop(&mut self) {
        self.held.dec_by(self.bytes);
    }
}

/// Bytes that keep their share of the budget until the last slice of them is dropped.
struct Held {
    bytes: Bytes,
    _share: Share,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl ServeBudget {
    /// A budget of `max` bytes; `held` reports the bytes held.
    pub fn new(max: u64, held: Gauge) -> Self {
        let max = max.clamp(1, u64::from(u32::MAX));
        Self {
            permits: Arc::new(Semaphore::new(max as usize)),
            max,
            held,
        }
    }

    /// Takes `bytes` (at most the whole budget) from the budget, waiting up to `wait`.
    pub async fn take(&self, bytes: u64, wait: Duration) -> Result<Share, ServeError> {
        let n = bytes.clamp(1, self.max);
        let n32 = u32::try_from(n).unwrap_or(u32::MAX);
        let permit = tokio::time::timeout(wait, Arc::clone(&self.permits).acquire_many_owned(n32))
            .await
            .map_err(|_| {
                ServeError::busy(format!(
                    "{} bytes of pieces are held for clients (the bound); retry later or \
                     elsewhere",
                    self.max
                ))
            })?
            .map_err(|_| ServeError::busy("the mirror is shutting down"))?;
        let bytes = i64::try_from(n).unwrap_or(i64::MAX);
        self.held.inc_by(bytes);
        Ok(Share {
            _permit: permit,
            bytes,
            held: self.held.clone(),
        })
    }

    /// `bytes` holding `share` until the last slice of them is dropped.
    pub fn hold(bytes: Bytes, share: Share) -> Bytes {
        Bytes::from_owner(Held {
            bytes,
            _share: share,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn held_piece_bytes_are_bounded_and_given_back_when_their_last_slice_drops() {
        let budget = ServeBudget::new(100, Gauge::default());
        let a = ServeBudget::hold(
            Bytes::from(vec![1u8; 60]),
            budget.take(60, BUDGET_WAIT).await.unwrap(),
        );
        let slice = a.slice(10..20);
        drop(a);
        // 60 bytes are still held through the slice: 50 more do not fit.
        let e = budget
            .take(50, BUDGET_WAIT)
            .await
            .err()
            .expect("over budget");
        assert_eq!(e.status, http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(budget.held.get(), 60);
        drop(slice);
        assert_eq!(budget.held.get(), 0);
        let b = budget.take(50, BUDGET_WAIT).await.unwrap();
        // A piece larger than the whole budget takes all of it instead of waiting forever.
        drop(b);
        let all = budget.take(1000, BUDGET_WAIT).await.unwrap();
        assert_eq!(budget.held.get(), 100);
        drop(all);
    }
}
