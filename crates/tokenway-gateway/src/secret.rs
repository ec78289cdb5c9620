//! Checking a presented secret (a client's API key, an edge's tunnel token) against the
//! configured ones in a time that tells nothing about them.
//!
//! `subtle`'s `ct_eq` on byte slices returns at once when the lengths differ, so comparing the
//! presented bytes with each secret timed the secrets' lengths; and stopping at the first match
//! timed which one matched. Here each secret is kept as its BLAKE3 hash, the presented bytes
//! are hashed once, and every secret's hash is compared in constant time (`blake3::Hash`'s
//! equality), the results folded without a branch.

/// The configured secrets, hashed.
#[derive(Debug, Clone, Default)]
pub struct Secrets(Vec<blake3::Hash>);

impl Secrets {
    /// Hashes each of `secrets`.
    pub fn new<S: AsRef<[u8]>>(secrets: impl IntoIterator<Item = S>) -> Self {
        Self(
            secrets
                .into_iter()
                .map(|s| blake3::hash(s.as_ref()))
                .collect(),
        )
    }

    /// Whether no secret is configured.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `presented` is one of the secrets; the time taken depends on how many secrets
    /// there are and on the presented bytes' length, not on the secrets.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let presented = blake3::hash(presented);
        self.0.iter().fold(false, |ok, s| ok | (*s == presented))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_configured_secret_matches_whatever_its_length() {
        let s = Secrets::new(["sk-short", "sk-a-much-longer-secret-0123456789"]);
        assert!(s.matches(b"sk-short"));
        assert!(s.matches(b"sk-a-much-longer-secret-0123456789"));
        for wrong in [
            &b""[..],
            b"sk-shor",
            b"sk-short ",
            b"sk-a-much-longer-secret",
        ] {
            assert!(!s.matches(wrong), "{:?}", String::from_utf8_lossy(wrong));
        }
        assert!(Secrets::new(Vec::<String>::new()).is_empty());
        assert!(!Secrets::default().matches(b""));
    }
}
