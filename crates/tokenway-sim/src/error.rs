//! The one error type of the crate.

/// Everything that can go wrong when configuring or running the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A configuration value is outside its allowed range.
    #[error("{key} must be {allowed} (got {got})")]
    InvalidValue {
        /// Dotted key, e.g. `sim.prefill_tokens_per_second`.
        key: &'static str,
        /// The allowed range, in words, e.g. `> 0`.
        allowed: &'static str,
        /// The value that was given.
        got: String,
    },
    /// The TOML text could not be parsed into a [`crate::SimConfig`] (the message names the key).
    /// (Not a `#[source]`: the message is already in the text, and printing the chain would
    /// repeat it.)
    #[error("invalid sim config: {0}")]
    Toml(toml::de::Error),
    /// Accepting connections failed for good.
    #[error("sim server I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl SimError {
    pub(crate) fn invalid(key: &'static str, allowed: &'static str, got: impl ToString) -> Self {
        Self::InvalidValue {
            key,
            allowed,
            got: got.to_string(),
        }
    }
}
