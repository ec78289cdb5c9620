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
//!
//! Pooled buffers start on a [`DIRECT_ALIGN`] boundary, so a piece received into one can be
//! written with `O_DIRECT` ([`crate::piece_writer`]). The mirror reads cached pieces into
//! them too ([`take_for_read`]); those come back by themselves when the last `Bytes` over
//! them is dropped (after hyper has sent them).

use std::sync::{Mutex, PoisonError};

use bytes::{Buf as _, Bytes, BytesMut};

use crate::piece_writer::DIRECT_ALIGN;

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
        let Ok(b) = bytes.try_into_mut() else {
            return;
        };
        self.give_back_mut(b);
    }

    fn give_back_mut(&mut self, mut b: BytesMut) {
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
/// Buffers of at least [`MIN_POOLED`] bytes start on a [`DIRECT_ALIGN`] boundary.
pub fn take(capacity: usize) -> BytesMut {
    if capacity < MIN_POOLED {
        return BytesMut::with_capacity(capacity);
    }
    if let Some(b) = pool().take(capacity) {
        return b;
    }
    let mut b = BytesMut::with_capacity(capacity + DIRECT_ALIGN);
    // Skip to the boundary; the skipped bytes stay part of the allocation, so the start
    // stays aligned when the buffer comes back to the pool and is handed out again.
    let pad = b.as_ptr().align_offset(DIRECT_ALIGN);
    b.resize(pad, 0);
    b.advance(pad);
    b
}

/// A pooled buffer behind a `Bytes`: back to the pool when the last reference goes.
struct Pooled(BytesMut);

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        pool().give_back_mut(std::mem::take(&mut self.0));
    }
}

/// A buffer of exactly `len` bytes to read a cached piece into (its contents are stale);
/// [`into_shared`] turns it into `Bytes` that return it to the pool when dropped.
pub fn take_for_read(len: usize) -> BytesMut {
    let mut b = take(len);
    b.resize(len, 0);
    b
}

/// `Bytes` over a buffer from [`take_for_read`] that go back to the pool when the last clone
/// or slice of them is dropped.
pub fn into_shared(b: BytesMut) -> Bytes {
    if b.capacity() < MIN_POOLED {
        return b.freeze();
    }
    Bytes::from_owner(Pooled(b))
}

/// A copy of `data` in a pooled, [`DIRECT_ALIGN`]-aligned buffer, as `Bytes` that go back to
/// the pool when dropped (the mirror copies what the origin returned into one so that the
/// cache can write it with `O_DIRECT` and the same bytes can be served).
pub fn aligned_copy(data: &[u8]) -> Bytes {
    let mut b = take(data.len());
    b.extend_from_slice(data);
    into_shared(b)
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
    fn pooled_buffers_are_aligned_for_direct_io_and_come_back_from_shared_bytes() {
        let b = take_for_read(1 << 20);
        assert_eq!(b.len(), 1 << 20);
        assert_eq!(b.as_ptr().align_offset(DIRECT_ALIGN), 0);
        let ptr = b.as_ptr();
        let shared = into_shared(b);
        let slice = shared.slice(10..20);
        drop(shared);
        drop(slice);
        // Other tests share the global pool: look for this buffer among what it holds.
        let back: Vec<BytesMut> = std::iter::from_fn(|| pool().take(1 << 20)).collect();
        assert!(
            back.iter().any(|b| b.as_ptr() == ptr),
            "returned on the last drop"
        );
        assert!(back
            .iter()
            .all(|b| b.as_ptr().align_offset(DIRECT_ALIGN) == 0));
        for b in back {
            pool().give_back_mut(b);
        }
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
