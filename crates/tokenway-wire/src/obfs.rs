//! Obfuscation of the datagram layer (the Salamander construction, with a full key stream).
//!
//! Every UDP datagram is `salt ‖ (inner packet ⊕ key stream)`, where `salt` is 8 fresh random
//! bytes per datagram and the key stream depends only on the pre-shared key and the salt:
//!
//! ```text
//! K      = BLAKE2b-256(psk ‖ salt)                      (Hysteria 2's Salamander key)
//! S_i    = BLAKE2b-512(K ‖ le64(i))      for i = 0, 1, 2, ...
//! stream = S_0 ‖ S_1 ‖ S_2 ‖ ...         (truncated to the inner packet's length)
//! ```
//!
//! Hysteria 2's Salamander XORs the payload with the 32-byte `K` *repeated*. That leaks
//! `p[i] ⊕ p[i+32]` of the plaintext inside each datagram, and our inner packets have known
//! structure (version and type bytes, block headers, zero padding in shards, QUIC long headers),
//! so a repeated key would make the datagrams distinguishable from random. Counter-mode blocks
//! of a PRF keyed by `K` do not: without the psk the salt is random and the rest is a
//! pseudo-random stream XORed onto the packet. BLAKE2b-512 blocks (64 bytes per compression)
//! halve the cost of BLAKE2b-256 blocks and need no primitive beyond BLAKE2b; the cost is one
//! compression for `K` plus one per 64 bytes. A ChaCha20 stream keyed by `K` would be faster and
//! is the upgrade path (it would bump [`crate::packet::VERSION`]).
//!
//! Obfuscation is not authentication: a datagram under the wrong key de-obfuscates to random
//! bytes, which the framing rejects (version and type bytes, header ranges) with probability
//! about 1 − 2^-14, and QUIC's AEAD rejects whatever slips through. The salt must come from a
//! CSPRNG: a repeated salt repeats the key stream.

use blake2::digest::consts::U32;
use blake2::{Blake2b, Blake2b512, Digest};
use rand::CryptoRng;

use crate::error::WireError;

/// Length of the per-datagram salt.
pub const SALT_LEN: usize = 8;

/// Applies and removes the obfuscation for one pre-shared key.
#[derive(Clone)]
pub struct Obfuscator {
    /// BLAKE2b-256 with the psk already absorbed; cloned per datagram.
    keyed: Blake2b<U32>,
}

impl std::fmt::Debug for Obfuscator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Obfuscator { psk: <redacted> }")
    }
}

impl Obfuscator {
    /// An obfuscator for `psk`, which must not be empty.
    pub fn new(psk: &[u8]) -> Result<Self, WireError> {
        if psk.is_empty() {
            return Err(WireError::InvalidConfig {
                key: "obfs.psk",
                reason: "must not be empty",
            });
        }
        let mut keyed = Blake2b::<U32>::new();
        keyed.update(psk);
        Ok(Self { keyed })
    }

    /// XORs the key stream for `salt` onto `payload` in place. Applying it twice restores the
    /// payload.
    pub fn apply(&self, salt: &[u8; SALT_LEN], payload: &mut [u8]) {
        let mut h = self.keyed.clone();
        h.update(salt);
        let key = h.finalize();
        for (i, chunk) in payload.chunks_mut(64).enumerate() {
            let mut b = Blake2b512::new();
            b.update(key);
            b.update((i as u64).to_le_bytes());
            let block = b.finalize();
            for (p, k) in chunk.iter_mut().zip(block.iter()) {
                *p ^= k;
            }
        }
    }

    /// Obfuscates a datagram in place: `datagram[..SALT_LEN]` is room for the salt (the
    /// caller reserves it before writing the inner packet after it), which this fills from
    /// `rng`; the rest is XORed with the key stream. A datagram shorter than the salt is left
    /// alone (callers always reserve the room).
    pub fn seal_in_place<R: CryptoRng + ?Sized>(&self, rng: &mut R, datagram: &mut [u8]) {
        if datagram.len() < SALT_LEN {
            return;
        }
        let (salt, inner) = datagram.split_at_mut(SALT_LEN);
        rng.fill_bytes(salt);
        let mut s = [0u8; SALT_LEN];
        s.copy_from_slice(salt);
        self.apply(&s, inner);
    }

    /// Writes `salt ‖ (packet ⊕ stream)` into `out` (cleared first).
    pub fn seal<R: CryptoRng + ?Sized>(&self, rng: &mut R, packet: &[u8], out: &mut Vec<u8>) {
        let mut salt = [0u8; SALT_LEN];
        rng.fill_bytes(&mut salt);
        out.clear();
        out.extend_from_slice(&salt);
        out.extend_from_slice(packet);
        self.apply(&salt, &mut out[SALT_LEN..]);
    }

    /// Removes the obfuscation from a received datagram in place and returns the inner packet
    /// (`datagram[SALT_LEN..]`). Fails only if the datagram is shorter than the salt; a wrong
    /// key yields garbage that the framing rejects.
    pub fn open_in_place<'a>(&self, datagram: &'a mut [u8]) -> Result<&'a mut [u8], WireError> {
        if datagram.len() < SALT_LEN {
            return Err(WireError::Truncated {
                need: SALT_LEN,
                got: datagram.len(),
            });
        }
        let (salt, inner) = datagram.split_at_mut(SALT_LEN);
        let mut s = [0u8; SALT_LEN];
        s.copy_from_slice(salt);
        self.apply(&s, inner);
        Ok(inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn obfuscation_round_trips_and_hides_the_payload() {
        let o = Obfuscator::new(b"correct horse").unwrap();
        let mut rng = StdRng::seed_from_u64(1);
        let packet: Vec<u8> = (0..300u32).map(|i| (i % 7) as u8).collect();
        let mut out = Vec::new();
        o.seal(&mut rng, &packet, &mut out);
        assert_eq!(out.len(), packet.len() + SALT_LEN);
        assert_ne!(&out[SALT_LEN..], &packet[..]);
        assert_eq!(o.open_in_place(&mut out).unwrap(), &packet[..]);
    }

    #[test]
    fn key_stream_does_not_repeat_every_32_bytes() {
        let o = Obfuscator::new(b"psk").unwrap();
        let mut zeros = [0u8; 128];
        o.apply(&[7; SALT_LEN], &mut zeros);
        assert_ne!(zeros[..32], zeros[32..64]);
        assert_ne!(zeros[..64], zeros[64..]);
    }

    #[test]
    fn seal_in_place_matches_seal() {
        let o = Obfuscator::new(b"psk").unwrap();
        let mut a = Vec::new();
        o.seal(&mut StdRng::seed_from_u64(5), b"hello", &mut a);
        let mut b = [0u8; SALT_LEN].to_vec();
        b.extend_from_slice(b"hello");
        o.seal_in_place(&mut StdRng::seed_from_u64(5), &mut b);
        assert_eq!(a, b);
        assert!(o.open_in_place(&mut [0u8; 7]).is_err());
        assert!(Obfuscator::new(b"").is_err());
    }
}
