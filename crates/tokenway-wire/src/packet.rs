//! Framing of the datagram layer: the version byte, the packet types and their headers.
//!
//! Every UDP datagram of the layer is, after de-obfuscation (see [`crate::obfs`]), one *inner
//! packet*: a version byte, a type byte and a type-specific header (all integers big-endian):
//!
//! ```text
//! plain        | ver | 0x00 | QUIC datagram ...                                   (2 bytes)
//! source       | ver | 0x01 | block:u16 | index:u8 | QUIC datagram ...           (5 bytes)
//! repair       | ver | 0x02 | block:u16 | k:u8 | r:u8 | index:u8 | shard ...     (7 bytes)
//! loss report  | ver | 0x03 | seq:u32 | received:u32 | lost:u32 | recovered:u32
//!              | residual:u32 | bursts:[u32; 8] | blocks_missing:u32
//!              | n:u8 | missing_ids:[u16; n]                              (59 + 2n bytes)
//! padded plain | ver | 0x04 | pad:u8 | QUIC datagram ... | pad bytes        (3 + pad bytes)
//! ```
//!
//! A padded plain packet is a QUIC MTU probe framed to the size a repair packet of it would
//! have (see [`crate::fec::FecSender::set_quic_mtu`]): a probe that gets through proves the
//! path carries the repairs of packets that size too. A build that does not know the type drops
//! it (counted as an unknown type), so the probe is lost and QUIC keeps its smaller MTU.
//!
//! Parsing is total: every length is checked before it is read, and anything short, of an
//! unknown version or type, or with a field out of range is a [`WireError`], never a panic.
//! Ranges: a block holds 1..=[`MAX_BLOCK_SOURCES`] source packets and 1..=[`MAX_BLOCK_REPAIRS`]
//! repair packets; a repair shard has an even, non-zero length (a `reed-solomon-simd`
//! requirement). The layout of a shard is described in [`crate::fec`].

use crate::error::WireError;
use crate::loss_report::LossReport;

/// The datagram-layer version this build sends: 2, the AES-128-CTR key stream of
/// [`crate::obfs`]. Bump it on any incompatible change to this module or to [`crate::obfs`].
pub const VERSION: u8 = 2;
/// The previous version (the BLAKE2b key stream; the framing is the same), still read so that
/// ends can be upgraded one after the other. Any other version is dropped and counted.
pub const VERSION_1: u8 = 1;

/// Whether this build reads packets of version `v`.
pub fn is_known_version(v: u8) -> bool {
    v == VERSION || v == VERSION_1
}

/// The most source packets one FEC block can hold (block indices fit a `u64` bitmap).
pub const MAX_BLOCK_SOURCES: usize = 64;
/// The most repair packets one FEC block can carry.
pub const MAX_BLOCK_REPAIRS: usize = 64;

/// Header length of a [`PacketType::Plain`] packet.
pub const PLAIN_HEADER_LEN: usize = 2;
/// Header length of a [`PacketType::Source`] packet.
pub const SOURCE_HEADER_LEN: usize = 5;
/// Header length of a [`PacketType::Repair`] packet.
pub const REPAIR_HEADER_LEN: usize = 7;
/// Header length of a [`PacketType::PaddedPlain`] packet (before its payload; the padding
/// follows the payload).
pub const PADDED_PLAIN_HEADER_LEN: usize = 3;

/// The kinds of inner packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PacketType {
    /// A QUIC datagram sent without FEC (mode `off`, or outside the FEC scope).
    Plain = 0x00,
    /// A QUIC datagram that is source packet `index` of an FEC block.
    Source = 0x01,
    /// A repair shard of an FEC block.
    Repair = 0x02,
    /// A receiver's loss report, consumed by the peer's FEC sender.
    LossReport = 0x03,
    /// A QUIC datagram sent without FEC, padded (a QUIC MTU probe, see the module docs).
    PaddedPlain = 0x04,
}

impl PacketType {
    /// The type for a type byte, if it is a known one.
    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            0x00 => Some(Self::Plain),
            0x01 => Some(Self::Source),
            0x02 => Some(Self::Repair),
            0x03 => Some(Self::LossReport),
            0x04 => Some(Self::PaddedPlain),
            _ => None,
        }
    }
}

/// An FEC block number. It wraps at 2^16 and is compared with serial-number arithmetic
/// (RFC 1982): `a` is newer than `b` when `a - b` (mod 2^16) is in `1..2^15`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BlockId(pub u16);

impl BlockId {
    /// The block after this one.
    pub fn next(self) -> Self {
        Self(self.0.wrapping_add(1))
    }

    /// How many blocks `self` is ahead of `other` (negative when behind), in serial-number
    /// arithmetic.
    pub fn distance_from(self, other: Self) -> i32 {
        i32::from(self.0.wrapping_sub(other.0) as i16)
    }
}

/// Header of a source packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceHeader {
    /// The block the packet belongs to.
    pub block: BlockId,
    /// Its position in the block, `0..MAX_BLOCK_SOURCES`.
    pub index: u8,
}

/// Header of a repair packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepairHeader {
    /// The block the shard repairs.
    pub block: BlockId,
    /// Number of source packets in the block, `1..=MAX_BLOCK_SOURCES`.
    pub k: u8,
    /// Number of repair packets the block was encoded with, `1..=MAX_BLOCK_REPAIRS`.
    pub r: u8,
    /// This shard's repair index, `0..r`.
    pub index: u8,
}

/// A parsed inner packet, borrowing its payload from the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packet<'a> {
    /// A QUIC datagram outside FEC.
    Plain(&'a [u8]),
    /// A QUIC datagram that is an FEC source packet.
    Source(SourceHeader, &'a [u8]),
    /// An FEC repair shard.
    Repair(RepairHeader, &'a [u8]),
    /// A receiver's loss report.
    LossReport(LossReport),
    /// A QUIC datagram outside FEC that came padded (its padding left out).
    PaddedPlain(&'a [u8]),
}

/// Parses one inner packet (already de-obfuscated).
pub fn parse(buf: &[u8]) -> Result<Packet<'_>, WireError> {
    let need = |n: usize| {
        if buf.len() < n {
            Err(WireError::Truncated {
                need: n,
                got: buf.len(),
            })
        } else {
            Ok(())
        }
    };
    need(2)?;
    if !is_known_version(buf[0]) {
        return Err(WireError::UnknownVersion(buf[0]));
    }
    let ty = PacketType::from_byte(buf[1]).ok_or(WireError::UnknownType(buf[1]))?;
    match ty {
        PacketType::Plain => Ok(Packet::Plain(&buf[PLAIN_HEADER_LEN..])),
        PacketType::Source => {
            need(SOURCE_HEADER_LEN)?;
            let header = SourceHeader {
                block: BlockId(u16::from_be_bytes([buf[2], buf[3]])),
                index: buf[4],
            };
            if usize::from(header.index) >= MAX_BLOCK_SOURCES {
                return Err(WireError::Malformed(
                    "source index beyond the block size limit",
                ));
            }
            Ok(Packet::Source(header, &buf[SOURCE_HEADER_LEN..]))
        }
        PacketType::Repair => {
            need(REPAIR_HEADER_LEN)?;
            let header = RepairHeader {
                block: BlockId(u16::from_be_bytes([buf[2], buf[3]])),
                k: buf[4],
                r: buf[5],
                index: buf[6],
            };
            if header.k == 0 || usize::from(header.k) > MAX_BLOCK_SOURCES {
                return Err(WireError::Malformed("repair k out of 1..=64"));
            }
            if header.r == 0 || usize::from(header.r) > MAX_BLOCK_REPAIRS {
                return Err(WireError::Malformed("repair r out of 1..=64"));
            }
            if header.index >= header.r {
                return Err(WireError::Malformed("repair index not below r"));
            }
            let shard = &buf[REPAIR_HEADER_LEN..];
            if shard.len() < 2 || shard.len() & 1 == 1 {
                return Err(WireError::Malformed(
                    "repair shard length not even and non-zero",
                ));
            }
            if shard.len() > crate::fec::MAX_SHARD_LEN {
                return Err(WireError::Malformed("repair shard longer than 2048 bytes"));
            }
            Ok(Packet::Repair(header, shard))
        }
        PacketType::LossReport => Ok(Packet::LossReport(LossReport::decode(&buf[2..])?)),
        PacketType::PaddedPlain => {
            need(PADDED_PLAIN_HEADER_LEN)?;
            let end = buf
                .len()
                .checked_sub(usize::from(buf[2]))
                .filter(|&end| end >= PADDED_PLAIN_HEADER_LEN)
                .ok_or(WireError::Malformed("padding longer than the packet"))?;
            Ok(Packet::PaddedPlain(&buf[PADDED_PLAIN_HEADER_LEN..end]))
        }
    }
}

/// Appends a plain header to `out`.
pub fn write_plain_header(out: &mut Vec<u8>) {
    out.extend_from_slice(&[VERSION, PacketType::Plain as u8]);
}

/// Appends a padded plain packet to `out`: the header, `quic`, and `pad` zero bytes.
pub fn write_padded_plain(out: &mut Vec<u8>, quic: &[u8], pad: u8) {
    out.extend_from_slice(&[VERSION, PacketType::PaddedPlain as u8, pad]);
    out.extend_from_slice(quic);
    out.resize(out.len() + usize::from(pad), 0);
}

/// Appends a source header to `out`.
pub fn write_source_header(out: &mut Vec<u8>, h: SourceHeader) {
    let b = h.block.0.to_be_bytes();
    out.extend_from_slice(&[VERSION, PacketType::Source as u8, b[0], b[1], h.index]);
}

/// Appends a repair header to `out`.
pub fn write_repair_header(out: &mut Vec<u8>, h: RepairHeader) {
    let b = h.block.0.to_be_bytes();
    out.extend_from_slice(&[
        VERSION,
        PacketType::Repair as u8,
        b[0],
        b[1],
        h.k,
        h.r,
        h.index,
    ]);
}

/// Appends a whole loss-report packet to `out`.
pub fn write_loss_report(out: &mut Vec<u8>, report: &LossReport) {
    out.extend_from_slice(&[VERSION, PacketType::LossReport as u8]);
    report.encode(out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_ids_compare_across_the_wrap() {
        assert_eq!(BlockId(2).distance_from(BlockId(65534)), 4);
        assert_eq!(BlockId(65534).distance_from(BlockId(2)), -4);
        assert_eq!(BlockId(65535).next(), BlockId(0));
    }

    #[test]
    fn headers_round_trip() {
        let mut out = Vec::new();
        let s = SourceHeader {
            block: BlockId(0xBEEF),
            index: 7,
        };
        write_source_header(&mut out, s);
        out.extend_from_slice(b"quic");
        assert_eq!(parse(&out), Ok(Packet::Source(s, &b"quic"[..])));

        out.clear();
        let r = RepairHeader {
            block: BlockId(3),
            k: 4,
            r: 2,
            index: 1,
        };
        write_repair_header(&mut out, r);
        out.extend_from_slice(&[1, 2, 3, 4]);
        assert_eq!(parse(&out), Ok(Packet::Repair(r, &[1, 2, 3, 4][..])));

        out.clear();
        write_plain_header(&mut out);
        assert_eq!(parse(&out), Ok(Packet::Plain(&[][..])));

        out.clear();
        write_padded_plain(&mut out, b"probe", 7);
        assert_eq!(out.len(), PADDED_PLAIN_HEADER_LEN + 5 + 7);
        assert_eq!(parse(&out), Ok(Packet::PaddedPlain(&b"probe"[..])));
    }

    #[test]
    fn bad_headers_are_errors_not_panics() {
        assert!(matches!(parse(&[]), Err(WireError::Truncated { .. })));
        assert_eq!(parse(&[9, 0]), Err(WireError::UnknownVersion(9)));
        assert_eq!(parse(&[VERSION, 0x7f]), Err(WireError::UnknownType(0x7f)));
        assert!(matches!(
            parse(&[VERSION, 1, 0, 0]),
            Err(WireError::Truncated { .. })
        ));
        assert!(
            parse(&[VERSION, 1, 0, 0, 64]).is_err(),
            "index 64 is out of range"
        );
        assert!(parse(&[VERSION, 2, 0, 0, 0, 1, 0, 1, 2]).is_err(), "k = 0");
        assert!(
            parse(&[VERSION, 2, 0, 0, 1, 1, 1, 1, 2]).is_err(),
            "index = r"
        );
        assert!(
            parse(&[VERSION, 2, 0, 0, 1, 1, 0, 1, 2, 3]).is_err(),
            "odd shard"
        );
        assert!(matches!(
            parse(&[VERSION, 4]),
            Err(WireError::Truncated { .. })
        ));
        assert!(
            parse(&[VERSION, 4, 3, 1, 2]).is_err(),
            "padding into the header"
        );
        assert_eq!(
            parse(&[VERSION, 4, 2, 0, 0]),
            Ok(Packet::PaddedPlain(&[][..]))
        );
    }
}
