//! A small stable 64-bit hash for values that must agree across gateway replicas and versions.
//!
//! Rendezvous placement and prompt block hashes are compared between processes (two gateway
//! replicas must put a session on the same backend; a block hash computed today must equal one
//! computed by the next release), so `std::hash` is unusable: `DefaultHasher` is SipHash with an
//! unspecified, version-dependent algorithm, and `RandomState` is seeded per process.
//!
//! The hash is FNV-1a 64 (Fowler, Noll, Vo; parameters from
//! <http://www.isthe.com/chongo/tech/comp/fnv/>) over the bytes, followed by the 64-bit
//! finalizer of MurmurHash3 (`fmix64`, Appleby) so that every input bit affects every output
//! bit: FNV alone mixes its last bytes poorly, which matters when two keys differ only in their
//! last character and when the value is used as a rendezvous weight. Both parts are fixed by
//! their published definitions and pinned by tests here; changing them moves every session and
//! invalidates every prefix index, so don't.
//!
//! This is not a cryptographic hash: a client can craft colliding keys. That only lets it place
//! its own sessions or fake a prefix-cache estimate for its own prompts, both harmless.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64 of `bytes`, continuing from `state` (start with [`fnv1a`]'s offset basis by
/// calling [`stable_hash`]).
fn fnv1a_from(mut state: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        state ^= u64::from(b);
        state = state.wrapping_mul(FNV_PRIME);
    }
    state
}

/// Plain FNV-1a 64 (no finalizer), exposed for the test vectors.
fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_from(FNV_OFFSET, bytes)
}

/// MurmurHash3's 64-bit finalizer: a bijection that spreads every bit over the whole word.
pub(crate) fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// The stable hash of `bytes`: `fmix64(fnv1a64(bytes))`.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    fmix64(fnv1a(bytes))
}

/// The stable hash of `bytes` chained after `prev`: `fmix64(fnv1a64(prev as 8 LE bytes ‖ bytes))`.
pub fn stable_hash_chained(prev: u64, bytes: &[u8]) -> u64 {
    fmix64(fnv1a_from(fnv1a(&prev.to_le_bytes()), bytes))
}

/// Combine two stable hashes into one (used for rendezvous weights of key × backend).
pub(crate) fn combine(a: u64, b: u64) -> u64 {
    // The odd constant (2^64 / golden ratio) keeps combine(a, b) != combine(b, a).
    fmix64(a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_published_test_vectors() {
        // From the FNV reference test suite (test_fnv.c, FNV-1a 64).
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn stable_hash_values_are_pinned_across_releases() {
        // If this test fails, sessions move and prefix indexes reset across a rolling upgrade.
        assert_eq!(stable_hash(b""), fmix64(0xcbf2_9ce4_8422_2325));
        // Values computed independently from the published definitions of FNV-1a 64 and fmix64.
        assert_eq!(stable_hash(b"session-42"), 0x3e6c_fda4_2145_251e);
        assert_eq!(stable_hash_chained(0, b"block"), 0x647d_1dd7_fded_a92e);
    }

    #[test]
    fn fmix64_is_zero_preserving_and_spreads_one_bit() {
        assert_eq!(fmix64(0), 0);
        let d = (fmix64(1) ^ fmix64(3)).count_ones();
        assert!((16..=48).contains(&d), "{d} bits differ");
    }

    #[test]
    fn combine_is_order_sensitive() {
        assert_ne!(combine(1, 2), combine(2, 1));
    }
}
