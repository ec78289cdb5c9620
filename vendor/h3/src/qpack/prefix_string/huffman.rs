//! Table-driven Huffman coding of string literals (RFC 7541 Appendix B, used by QPACK).
//!
//! tokenway patch (see `vendor/README.md`): h3 0.0.8 codes one bit window at a time through
//! nested decoder tables, which made QPACK the largest user-space cost of a tunnelled request.
//! This module codes a symbol per step with a 64-bit accumulator. The code table comes from
//! `encode.rs`'s (unchanged) `HPACK_STRING`; decoding uses the code's canonical form (codes of
//! one length are consecutive and longer codes sort after shorter ones), checked by the tests.

use std::sync::OnceLock;

use super::decode::Error as HuffmanDecodingError;
use super::BitWindow;

/// End of string: 30 one bits, never a symbol of a valid string.
const EOS: usize = 256;
const MAX_LEN: usize = 30;

struct Tables {
    code: [u32; 257],
    len: [u8; 257],
    /// Per code length: the first code, how many codes, and where their symbols start in
    /// `sorted`.
    first: [u32; MAX_LEN + 1],
    count: [u32; MAX_LEN + 1],
    offset: [u16; MAX_LEN + 1],
    sorted: [u16; 257],
    /// For every value of the next 8 bits: `symbol << 4 | length` of the code they start with,
    /// when that code is at most 8 bits long (most of ASCII); 0 otherwise.
    short: [u16; 256],
}

fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(build)
}

fn build() -> Tables {
    let mut code = [0u32; 257];
    let mut len = [0u8; 257];
    for sym in 0..256 {
        let (c, l) = super::encode::code_of(sym as u8);
        code[sym] = c;
        len[sym] = l as u8;
    }
    code[EOS] = (1 << MAX_LEN) - 1;
    len[EOS] = MAX_LEN as u8;
    let mut order: Vec<u16> = (0..257).collect();
    order.sort_by_key(|&s| (len[s as usize], code[s as usize]));
    let mut sorted = [0u16; 257];
    sorted.copy_from_slice(&order);
    let mut first = [0u32; MAX_LEN + 1];
    let mut count = [0u32; MAX_LEN + 1];
    let mut offset = [0u16; MAX_LEN + 1];
    for (i, &s) in sorted.iter().enumerate() {
        let l = len[s as usize] as usize;
        if count[l] == 0 {
            first[l] = code[s as usize];
            offset[l] = i as u16;
        }
        count[l] += 1;
    }
    let mut short = [0u16; 256];
    for sym in 0..256usize {
        let l = len[sym] as usize;
        if l <= 8 {
            let start = (code[sym] as usize) << (8 - l);
            for v in start..start + (1 << (8 - l)) {
                short[v] = (sym as u16) << 4 | l as u16;
            }
        }
    }
    Tables {
        code,
        len,
        first,
        count,
        offset,
        sorted,
        short,
    }
}

/// Bytes that `value` takes Huffman-coded.
pub fn encoded_len(value: &[u8]) -> usize {
    let t = tables();
    let bits: usize = value.iter().map(|&b| t.len[b as usize] as usize).sum();
    bits.div_ceil(8)
}

/// Appends the Huffman code of `value`, padded with one bits to a whole byte, to `out`.
pub fn encode(value: &[u8], out: &mut impl bytes::BufMut) {
    let t = tables();
    let mut acc: u64 = 0;
    let mut bits: u32 = 0;
    for &b in value {
        let l = u32::from(t.len[b as usize]);
        acc = (acc << l) | u64::from(t.code[b as usize]);
        bits += l;
        while bits >= 8 {
            bits -= 8;
            out.put_u8((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        out.put_u8(((acc << (8 - bits)) as u8) | (0xff >> bits));
    }
}

/// Decodes a Huffman-coded string. Errors on an EOS symbol, on padding longer than 7 bits or
/// not all ones (RFC 7541 §5.2), and on bits that start no code.
pub fn decode(input: &[u8]) -> Result<Vec<u8>, HuffmanDecodingError> {
    let t = tables();
    let mut out = Vec::with_capacity(input.len() + input.len() / 2);
    let mut acc: u64 = 0;
    let mut bits: u32 = 0;
    let mut pos = 0;
    let error = |pos: usize, bits: u32| {
        HuffmanDecodingError::Unhandled(
            BitWindow {
                byte: pos as u32,
                bit: 0,
                count: bits,
            },
            0,
        )
    };
    loop {
        while bits <= 56 && pos < input.len() {
            acc = (acc << 8) | u64::from(input[pos]);
            bits += 8;
            pos += 1;
        }
        if bits == 0 {
            break;
        }
        if bits >= 8 {
            let e = t.short[((acc >> (bits - 8)) & 0xff) as usize];
            if e != 0 {
                out.push((e >> 4) as u8);
                bits -= u32::from(e & 0xf);
                continue;
            }
        }
        let mut matched = None;
        for l in 5..=(bits as usize).min(MAX_LEN) {
            let c = ((acc >> (bits as usize - l)) & ((1u64 << l) - 1)) as u32;
            let d = c.wrapping_sub(t.first[l]);
            if d < t.count[l] {
                matched = Some((l, t.sorted[t.offset[l] as usize + d as usize]));
                break;
            }
        }
        match matched {
            Some((_, sym)) if sym as usize == EOS => return Err(error(pos, bits)),
            Some((l, sym)) => {
                out.push(sym as u8);
                bits -= l as u32;
            }
            None => {
                let ones = (1u64 << bits) - 1;
                if pos == input.len() && bits < 8 && acc & ones == ones {
                    break;
                }
                return Err(error(pos, bits));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::{HpackStringDecode, HpackStringEncode};
    use super::*;

    fn samples() -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = [
            &b""[..],
            b"a",
            b"/v1/chat/completions",
            b"application/json",
            b"text/event-stream",
            b"gateway;dur=0.059, ttfb;dur=1.204, backend;desc=\"sim\", route;desc=\"cost\"",
            b"Mozilla/5.0 (X11; Linux x86_64)",
        ]
        .iter()
        .map(|s| s.to_vec())
        .collect();
        v.push((0..=255u8).collect());
        // Deterministic pseudo-random strings of every length up to 200.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for n in 0..200 {
            let s = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 24) as u8
                })
                .collect();
            v.push(s);
        }
        v
    }

    #[test]
    fn the_code_is_canonical() {
        let t = tables();
        for w in t.sorted.windows(2) {
            let (a, b) = (w[0] as usize, w[1] as usize);
            let (la, lb) = (t.len[a], t.len[b]);
            if la == lb {
                assert_eq!(t.code[b], t.code[a] + 1, "symbols {a} and {b}");
            } else {
                assert!(lb > la);
                assert_eq!(t.code[b], (t.code[a] + 1) << (lb - la), "symbols {a} and {b}");
            }
        }
    }

    #[test]
    fn encodes_like_the_bitwise_coder_and_decodes_back() {
        for s in samples() {
            let mut fast = Vec::new();
            encode(&s, &mut fast);
            let slow = s.clone().hpack_encode().expect("encodes");
            assert_eq!(fast, slow, "{s:?}");
            assert_eq!(encoded_len(&s), fast.len());
            assert_eq!(decode(&fast).expect("decodes"), s);
            let old: Vec<u8> = fast
                .hpack_decode()
                .collect::<Result<_, _>>()
                .expect("old decodes");
            assert_eq!(old, s);
        }
    }

    #[test]
    fn rejects_bad_padding_and_eos() {
        let mut coded = Vec::new();
        encode(b"ab", &mut coded);
        assert_eq!(coded.len(), 2, "11 bits and 5 of padding");
        assert_eq!(decode(&coded).expect("decodes"), b"ab");
        // Eight more bits of padding.
        let mut long_pad = coded.clone();
        long_pad.push(0xff);
        assert!(decode(&long_pad).is_err());
        // Padding that is not all ones.
        let mut zero_pad = coded.clone();
        zero_pad[1] &= 0xfe;
        assert!(decode(&zero_pad).is_err());
        // An explicit EOS (30 one bits) followed by padding.
        assert!(decode(&[0xff, 0xff, 0xff, 0xff]).is_err());
        // Garbage never panics.
        for a in 0..=255u8 {
            for b in [0u8, 0x7f, 0x80, 0xff] {
                let _ = decode(&[a, b, a ^ b]);
            }
        }
    }
}
