//! A set of piece indexes as a bitset, with a hex wire form (sans-IO).
//!
//! Peers tell the mirror which pieces of which blob they hold, and the mirror tells pullers;
//! this is the encoding both use. Bit `i` is byte `i / 8`, mask `1 << (i % 8)` (the same
//! layout as the resume record in [`crate::progress`]).

use serde::{Deserialize, Serialize};

/// Largest piece count accepted from the wire (a 64 TiB blob at 4 MiB pieces).
pub const MAX_PIECES: u64 = 1 << 24;

/// Which pieces of a blob of `count` pieces are present.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PieceBits {
    count: u64,
    bits: Vec<u8>,
}

/// Wire form: `{"count": N, "bits": "<hex>"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PieceBitsWire {
    /// Number of pieces of the blob.
    pub count: u64,
    /// Bitset, hex.
    pub bits: String,
}

impl PieceBits {
    /// No piece present.
    pub fn empty(count: u64) -> Self {
        Self {
            count,
            bits: vec![0; count.div_ceil(8) as usize],
        }
    }

    /// Every piece present.
    pub fn full(count: u64) -> Self {
        let mut b = Self::empty(count);
        for i in 0..count {
            b.set(i);
        }
        b
    }

    /// Number of pieces of the blob.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Is piece `i` present?
    pub fn has(&self, i: u64) -> bool {
        i < self.count
            && self
                .bits
                .get((i / 8) as usize)
                .is_some_and(|b| b & (1 << (i % 8)) != 0)
    }

    /// Marks piece `i` present (ignored when out of range).
    pub fn set(&mut self, i: u64) {
        if i < self.count {
            if let Some(b) = self.bits.get_mut((i / 8) as usize) {
                *b |= 1 << (i % 8);
            }
        }
    }

    /// A piece present here and not in `taken`, looking from the byte of piece `from` on and
    /// wrapping around (so that nodes looking from different places pick different pieces).
    pub fn first_not_in(&self, taken: &PieceBits, from: u64) -> Option<u64> {
        let n = self.bits.len();
        if n == 0 {
            return None;
        }
        let start = ((from % self.count) / 8) as usize;
        (0..n).find_map(|k| {
            let j = (start + k) % n;
            let free = self.bits[j] & !taken.bits.get(j).copied().unwrap_or(0);
            (free != 0).then(|| j as u64 * 8 + u64::from(free.trailing_zeros()))
        })
    }

    /// Marks piece `i` absent.
    pub fn clear(&mut self, i: u64) {
        if let Some(b) = self.bits.get_mut((i / 8) as usize) {
            *b &= !(1 << (i % 8));
        }
    }

    /// Number of pieces present.
    pub fn present(&self) -> u64 {
        self.bits.iter().map(|b| u64::from(b.count_ones())).sum()
    }

    /// Wire form.
    pub fn to_wire(&self) -> PieceBitsWire {
        PieceBitsWire {
            count: self.count,
            bits: hex::encode(&self.bits),
        }
    }

    /// Parses the wire form; the error says what is wrong.
    pub fn from_wire(w: &PieceBitsWire) -> Result<Self, String> {
        if w.count > MAX_PIECES {
            return Err(format!("count {} above {MAX_PIECES}", w.count));
        }
        let bits = hex::decode(&w.bits).map_err(|e| format!("bits: not hex: {e}"))?;
        if bits.len() as u64 != w.count.div_ceil(8) {
            return Err(format!(
                "bits: {} bytes for {} pieces, expected {}",
                bits.len(),
                w.count,
                w.count.div_ceil(8)
            ));
        }
        let mut b = Self::empty(w.count);
        // Copy only valid bits so stray high bits never count as pieces.
        for i in 0..w.count {
            if bits[(i / 8) as usize] & (1 << (i % 8)) != 0 {
                b.set(i);
            }
        }
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_round_trip_and_refuse_bad_lengths() {
        let mut b = PieceBits::empty(10);
        b.set(0);
        b.set(9);
        b.set(42);
        assert!(b.has(0) && b.has(9) && !b.has(1) && !b.has(42));
        assert_eq!(b.present(), 2);
        let back = PieceBits::from_wire(&b.to_wire()).unwrap();
        assert_eq!(back, b);
        let bad = PieceBitsWire {
            count: 10,
            bits: "ff".into(),
        };
        assert!(PieceBits::from_wire(&bad)
            .unwrap_err()
            .contains("expected 2"));
        assert_eq!(PieceBits::full(9).present(), 9);
    }
}
