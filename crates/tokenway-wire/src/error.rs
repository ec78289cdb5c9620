//! The crate's error type.

/// Everything that can go wrong in `tokenway-wire`'s codecs.
///
/// Receive-path problems are not errors the caller must handle: the receiver drops the packet
/// and counts it (see [`crate::fec::DropReason`]); these variants say exactly why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The packet ended before its header or a declared field did.
    #[error("packet truncated: need {need} bytes, got {got}")]
    Truncated {
        /// Bytes the header or field needs.
        need: usize,
        /// Bytes the packet has.
        got: usize,
    },
    /// The version byte is not one this build speaks.
    #[error("unknown datagram-layer version {0} (this build speaks version {v})", v = crate::packet::VERSION)]
    UnknownVersion(u8),
    /// The packet-type byte is not a known type.
    #[error("unknown datagram-layer packet type {0:#04x}")]
    UnknownType(u8),
    /// A header field is out of its allowed range or inconsistent with the block.
    #[error("malformed packet: {0}")]
    Malformed(&'static str),
    /// A QUIC datagram is larger than the layer can frame.
    #[error("datagram of {len} bytes exceeds the datagram layer's limit of {max} bytes")]
    TooLarge {
        /// The datagram's length.
        len: usize,
        /// The largest length the layer accepts.
        max: usize,
    },
    /// A configuration value is outside its allowed range.
    #[error("invalid config `{key}`: {reason}")]
    InvalidConfig {
        /// The config key, as written in the tunnel config.
        key: &'static str,
        /// What the allowed range is.
        reason: &'static str,
    },
}
