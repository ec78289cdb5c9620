//! Piece-sized buffers, reused.
//!
//! A pull receives every piece (4 MiB by default) into one contiguous buffer so it can be
//! hashed and written in one go. Allocating that buffer afresh for every piece costs more
//! than it looks: the allocator returns large blocks to the kernel when they are freed, so
//! every new one is mapped again and faults in page by page (on a 2 GB pull that was about a
//! tenth of the puller's CPU, in `exc_page_fault`, `clear_page` and `memmove` in
//! `perf`). A small process-wide pool keeps buffers whose bytes have been written and hands
//! them to the next piece. It is bounded by bytes, so it never holds more than
//! [`MAX_POOLED_BYTES`] however large the pieces.

use std::sync::{Mutex, PoisonError};

use bytes::{Bytes, BytesMut};

/// Most bytes of capacity kept in the pool.
pub const MAX_POOLED_BYTES: usize = 128 << 20;
/// Buffers smaller than this are not worth pooling.
pub const MIN_POOLED: usize = 64 << 10;

/// Buffers kept for reuse, at most `max_bytes` of capacity in all.
struct Pool {
    buffers: Vec<BytesMut>,
    bytes: usize,
    max_bytes: usize,
}

impl Pool {
    const fn new(max_bytes: usize) -> Self {
        Self {
            buffers: Vec::new(),
            bytes: 0,
            max_bytes,
        }
    }

    fn take(&mut self, capacity: usize) -> Option<BytesMut> {
        let i = self.buffers.iter().position(|b| b.capacity() >= capacity)?;
        let b = self.buffers.swap_remove(i);
        self.bytes -= b.capacity();
        Some(b)
    }

    fn give_back(&mut self, bytes: Bytes) {
        let Ok(mut b) = bytes.try_into_mut() else {
            return;
        };
        let cap = b.capacity();
        if cap >= MIN_POOLED && self.bytes + cap <= self.max_bytes {
            b.clear();
            self.bytes += cap;
            self.buffers.push(b);
        }
    }
}

static POOL: Mutex<Pool> = Mutex::new(Pool::new(MAX_POOLED_BYTES));

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An empty buffer with room for at least `capacity` bytes, from the pool when one fits.
pub fn take(capacity: usize) -> BytesMut {
    if capacity >= MIN_POOLED {
        if let Some(b) = pool().take(capacity) {
            return b;
        }
    }
    BytesMut::with_capacity(capacity)
}

/// Returns a buffer whose contents are no longer needed. Kept only when nothing else still
/// refers to it and the pool has room; dropped otherwise.
pub fn give_back(bytes: Bytes) {
    pool().give_back(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(capacity: usize) -> Bytes {
        let mut b = BytesMut::with_capacity(capacity);
        b.extend_from_slice(b"piece");
        b.freeze()
    }

    #[test]
    fn a_returned_buffer_is_handed_out_again_empty() {
        let mut pool = Pool::new(8 << 20);
        let b = filled(1 << 20);
        let ptr = b.as_ptr();
        pool.give_back(b);
        let again = pool.take(1 << 20).expect("pooled");
        assert!(again.is_empty());
        assert_eq!(again.as_ptr(), ptr);
        assert!(pool.take(1).is_none(), "handed out once");
    }

    #[test]
    fn shared_small_and_surplus_buffers_are_not_kept() {
        let mut pool = Pool::new(3 << 20);
        let b = filled(1 << 20);
        let other = b.clone();
        pool.give_back(b);
        assert!(pool.take(1).is_none(), "still referenced elsewhere");
        drop(other);
        pool.give_back(filled(1024));
        assert!(pool.take(1).is_none(), "too small to pool");
        for _ in 0..5 {
            pool.give_back(filled(1 << 20));
        }
        assert_eq!(pool.buffers.len(), 3);
        assert!(pool.bytes <= 3 << 20);
        assert!(pool.take(2 << 20).is_none(), "no buffer that large");
    }
}
