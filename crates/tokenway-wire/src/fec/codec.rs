//! Shards and the erasure codes over them.
//!
//! A source packet of length `len` becomes the shard `len:u16 ‖ packet ‖ zero padding`, all
//! shards of a block padded to one even length (`reed-solomon-simd` needs equal, even shard
//! sizes), so a recovered shard yields the exact packet. Repair shards are computed over these
//! padded shards by the cheapest code that does the job:
//!
//! - `k = 1`: every repair shard is the source shard itself (a duplicate);
//! - `r = 1`: the single repair shard is the XOR of the source shards (parity);
//! - otherwise: systematic Reed-Solomon over GF(2^16) (Leopard-RS, via `reed-solomon-simd`),
//!   any `k` of the `k + r` shards restore the block.

use reed_solomon_simd::{ReedSolomonDecoder, ReedSolomonEncoder};

/// Bytes the shard layout adds to a packet: the length prefix and at most one pad byte.
pub(crate) const SHARD_OVERHEAD: usize = 3;

/// Shard length for a block whose longest source packet is `max_len` bytes.
pub(crate) fn shard_len_for(max_len: usize) -> usize {
    (max_len + 2 + 1) & !1
}

/// XORs `packet` laid out as a shard (prefix, bytes, implicit zero padding) onto `acc`.
fn xor_shard(acc: &mut [u8], packet: &[u8]) {
    let len = (packet.len() as u16).to_be_bytes();
    acc[0] ^= len[0];
    acc[1] ^= len[1];
    for (a, p) in acc[2..].iter_mut().zip(packet) {
        *a ^= p;
    }
}

/// Writes `packet` as a shard of `shard_len` bytes into `buf` (cleared first).
fn fill_shard(buf: &mut Vec<u8>, packet: &[u8], shard_len: usize) {
    buf.clear();
    buf.extend_from_slice(&(packet.len() as u16).to_be_bytes());
    buf.extend_from_slice(packet);
    buf.resize(shard_len, 0);
}

/// The packet inside a shard, or `None` if the length prefix is impossible (corrupt input).
pub(crate) fn unshard(shard: &[u8]) -> Option<&[u8]> {
    let len = usize::from(u16::from_be_bytes([*shard.first()?, *shard.get(1)?]));
    shard.get(2..2 + len)
}

/// Why a block could not be encoded or decoded. Only reachable with inconsistent input.
#[derive(Debug)]
pub(crate) struct CodecError;

/// Reusable repair-shard encoder.
#[derive(Default)]
pub(crate) struct Encoder {
    rs: Option<ReedSolomonEncoder>,
    scratch: Vec<u8>,
}

impl Encoder {
    /// Computes `r` repair shards over `sources` (each ≤ `shard_len - 2` bytes) and hands each
    /// to `emit(index, shard)`.
    pub(crate) fn encode(
        &mut self,
        sources: &[Vec<u8>],
        r: usize,
        shard_len: usize,
        mut emit: impl FnMut(usize, &[u8]),
    ) -> Result<(), CodecError> {
        let k = sources.len();
        if k == 0 || r == 0 {
            return Err(CodecError);
        }
        if k == 1 {
            fill_shard(&mut self.scratch, &sources[0], shard_len);
            for i in 0..r {
                emit(i, &self.scratch);
            }
            return Ok(());
        }
        if r == 1 {
            self.scratch.clear();
            self.scratch.resize(shard_len, 0);
            for s in sources {
                xor_shard(&mut self.scratch, s);
            }
            emit(0, &self.scratch);
            return Ok(());
        }
        let rs = match &mut self.rs {
            Some(rs) => {
                rs.reset(k, r, shard_len).map_err(|_| CodecError)?;
                rs
            }
            None => self
                .rs
                .insert(ReedSolomonEncoder::new(k, r, shard_len).map_err(|_| CodecError)?),
        };
        for s in sources {
            fill_shard(&mut self.scratch, s, shard_len);
            rs.add_original_shard(&self.scratch)
                .map_err(|_| CodecError)?;
        }
        let result = rs.encode().map_err(|_| CodecError)?;
        for (i, shard) in result.recovery_iter().enumerate() {
            emit(i, shard);
        }
        Ok(())
    }
}

/// Reusable block decoder.
#[derive(Default)]
pub(crate) struct Decoder {
    rs: Option<ReedSolomonDecoder>,
    scratch: Vec<u8>,
}

impl Decoder {
    /// Restores the missing source packets of a `(k, r)` block from the `sources` present
    /// (`(index, packet)`) and the `repairs` (`(index, shard)`), handing each restored packet
    /// to `emit(index, packet)`. Needs `sources.len() + repairs.len() >= k`.
    pub(crate) fn decode(
        &mut self,
        k: usize,
        r: usize,
        shard_len: usize,
        sources: &[(u8, Vec<u8>)],
        repairs: &[(u8, Vec<u8>)],
        mut emit: impl FnMut(usize, &[u8]),
    ) -> Result<(), CodecError> {
        if sources.len() + repairs.len() < k || repairs.is_empty() {
            return Err(CodecError);
        }
        if sources.iter().any(|(_, p)| p.len() + 2 > shard_len) {
            return Err(CodecError);
        }
        if k == 1 {
            if sources.is_empty() {
                let p = unshard(&repairs[0].1).ok_or(CodecError)?;
                emit(0, p);
            }
            return Ok(());
        }
        if r == 1 {
            // One repair, so at most one source is missing: the XOR of everything else.
            let Some(missing) =
                (0..k).find(|&i| !sources.iter().any(|(j, _)| usize::from(*j) == i))
            else {
                return Ok(());
            };
            self.scratch.clear();
            self.scratch.extend_from_slice(&repairs[0].1);
            for (_, p) in sources {
                xor_shard(&mut self.scratch, p);
            }
            let p = unshard(&self.scratch).ok_or(CodecError)?;
            emit(missing, p);
            return Ok(());
        }
        let rs = match &mut self.rs {
            Some(rs) => {
                rs.reset(k, r, shard_len).map_err(|_| CodecError)?;
                rs
            }
            None => self
                .rs
                .insert(ReedSolomonDecoder::new(k, r, shard_len).map_err(|_| CodecError)?),
        };
        for (i, p) in sources {
            fill_shard(&mut self.scratch, p, shard_len);
            rs.add_original_shard(usize::from(*i), &self.scratch)
                .map_err(|_| CodecError)?;
        }
        for (i, shard) in repairs {
            rs.add_recovery_shard(usize::from(*i), shard)
                .map_err(|_| CodecError)?;
        }
        let result = rs.decode().map_err(|_| CodecError)?;
        for (i, shard) in result.restored_original_iter() {
            let p = unshard(shard).ok_or(CodecError)?;
            emit(i, p);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(k: usize, r: usize, lose: &[usize], use_repairs: &[usize]) {
        let sources: Vec<Vec<u8>> = (0..k)
            .map(|i| (0..(10 + i * 7)).map(|b| (b * 31 + i) as u8).collect())
            .collect();
        let shard_len = shard_len_for(sources.iter().map(Vec::len).max().unwrap());
        let mut repairs = Vec::new();
        Encoder::default()
            .encode(&sources, r, shard_len, |i, s| {
                repairs.push((i as u8, s.to_vec()))
            })
            .unwrap();
        assert_eq!(repairs.len(), r);
        let present: Vec<(u8, Vec<u8>)> = (0..k)
            .filter(|i| !lose.contains(i))
            .map(|i| (i as u8, sources[i].clone()))
            .collect();
        let used: Vec<(u8, Vec<u8>)> = use_repairs.iter().map(|&i| repairs[i].clone()).collect();
        let mut got = Vec::new();
        Decoder::default()
            .decode(k, r, shard_len, &present, &used, |i, p| {
                got.push((i, p.to_vec()))
            })
            .unwrap();
        got.sort();
        let want: Vec<(usize, Vec<u8>)> = lose.iter().map(|&i| (i, sources[i].clone())).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn duplicate_xor_and_reed_solomon_restore_exact_packets() {
        round_trip(1, 1, &[0], &[0]);
        round_trip(1, 2, &[0], &[1]);
        round_trip(5, 1, &[3], &[0]);
        round_trip(4, 2, &[0, 3], &[0, 1]);
        round_trip(16, 4, &[1, 2, 3, 15], &[0, 1, 2, 3]);
        round_trip(8, 3, &[7], &[2]);
    }

    #[test]
    fn corrupt_length_prefix_is_rejected() {
        assert!(unshard(&[0xff, 0xff, 0, 0]).is_none());
        assert!(unshard(&[0]).is_none());
        assert_eq!(unshard(&[0, 1, 9, 0]), Some(&[9][..]));
    }
}
