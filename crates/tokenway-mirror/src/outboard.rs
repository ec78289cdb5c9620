//! bao-tree outboards: a blob's BLAKE3 tree above its chunk groups, kept beside the blob.
//!
//! BLAKE3 hashes 1 KiB chunks into a left-complete binary tree (BLAKE3 spec §2.1, §5.1.2).
//! An outboard (the `bao-tree` crate, pre-order layout, no size prefix) stores, for every
//! node above the chunk groups (64 KiB to 1 MiB, a power of two), the chaining values (CVs)
//! of its two children: 64 bytes per group, 0.1 % of a blob at 64 KiB groups. Given the
//! blob's hash and size, whoever holds the outboard checks it top-down against the hash,
//! and then any group-aligned byte range of the blob against the CVs of its groups, without
//! the rest of the blob and without trusting whoever served either.
//!
//! Manifest format 3 ([`crate::manifest`]) names a blob's group size instead of listing its
//! piece hashes: a piece (a power of two, at least one group) is a whole subtree, so its CV
//! is one of the outboard's entries, and [`piece_cvs`] reads them out while checking the
//! outboard. The pull and mirror paths then verify pieces exactly as with format 2.
//!
//! Sans-IO but for [`create`], which reads the blob through `std::io::Read`.

use std::io::Read;

use bao_tree::io::outboard::PreOrderMemOutboard;
use bao_tree::{BaoTree, BlockSize};
use blake3::hazmat::{merge_subtrees_non_root, merge_subtrees_root, ChainingValue, Mode};

use crate::manifest::Blake3Hash;

/// Smallest chunk group (64 KiB).
pub const MIN_GROUP_SIZE: u64 = 64 << 10;
/// Largest chunk group (1 MiB).
pub const MAX_GROUP_SIZE: u64 = 1 << 20;
/// Chunk group written by `publish` unless told otherwise: the finest the issue allows, so
/// that every allowed piece size (64 KiB and up) is whole groups.
pub const DEFAULT_GROUP_SIZE: u64 = MIN_GROUP_SIZE;
/// Bytes an outboard stores per parent node: two CVs.
const PAIR: usize = 64;

/// Is `group_size` one this format accepts?
pub fn is_group_size(group_size: u64) -> bool {
    group_size.is_power_of_two() && (MIN_GROUP_SIZE..=MAX_GROUP_SIZE).contains(&group_size)
}

/// Number of chunk groups of a blob.
pub fn groups(size: u64, group_size: u64) -> u64 {
    size.div_ceil(group_size)
}

/// Length of the outboard of a blob of `size` bytes: one pair per parent node.
pub fn outboard_len(size: u64, group_size: u64) -> u64 {
    groups(size, group_size).saturating_sub(1) * PAIR as u64
}

/// Why an outboard was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadOutboard {
    /// Not as long as the tree of that size needs.
    #[error("{got} bytes, a blob of {size} bytes in groups of {group_size} needs {want}")]
    Length {
        /// Bytes received.
        got: u64,
        /// Bytes expected.
        want: u64,
        /// Blob size.
        size: u64,
        /// Chunk group size.
        group_size: u64,
    },
    /// A node's children do not merge into it (or the top into the blob hash).
    #[error("the node over chunk groups {first}..{end} does not match its parent")]
    Mismatch {
        /// First group under the node.
        first: u64,
        /// One past the last group under it.
        end: u64,
    },
}

/// Hashes a blob of `size` bytes read from `data`: its BLAKE3 hash and its pre-order
/// outboard at `group_size` (a [`is_group_size`] size).
pub fn create(
    data: impl Read,
    size: u64,
    group_size: u64,
) -> std::io::Result<(Blake3Hash, Vec<u8>)> {
    let tree = BaoTree::new(size, block_size(group_size));
    let mut ob = PreOrderMemOutboard {
        root: blake3::hash(&[]),
        tree,
        data: vec![0u8; tree.outboard_size() as usize],
    };
    let root = bao_tree::io::sync::outboard(data, tree, &mut ob)?;
    Ok((root.into(), ob.data))
}

fn block_size(group_size: u64) -> BlockSize {
    debug_assert!(is_group_size(group_size));
    let chunks = group_size / blake3::CHUNK_LEN as u64;
    BlockSize::from_chunk_log(chunks.trailing_zeros() as u8)
}

/// Checks `outboard` against `root` (the hash of a blob of `size` bytes) and returns the CV
/// of every piece of `piece_size` bytes (a power of two, at least `group_size`) in order:
/// exactly what a format-2 manifest lists ([`crate::piece_tree`]). A blob of one piece has
/// the blob hash as its only entry, an empty blob none.
pub fn piece_cvs(
    outboard: &[u8],
    size: u64,
    group_size: u64,
    piece_size: u64,
    root: &Blake3Hash,
) -> Result<Vec<Blake3Hash>, BadOutboard> {
    assert!(
        is_group_size(group_size) && piece_size.is_power_of_two() && piece_size >= group_size,
        "invariant: the manifest was validated (group and piece sizes)"
    );
    let per_piece = piece_size / group_size;
    let mut pieces = Vec::with_capacity(size.div_ceil(piece_size) as usize);
    walk(outboard, size, group_size, root, |first, n, cv| {
        if first.is_multiple_of(per_piece) && n == per_piece.min(groups(size, group_size) - first) {
            pieces.push(Blake3Hash(*cv));
        }
        true
    })?;
    // The root is no subtree CV: a blob of one piece is verified by its hash.
    Ok(match size.div_ceil(piece_size) {
        0 => Vec::new(),
        1 => vec![*root],
        _ => pieces,
    })
}

/// Why a byte range was refused by [`verify_range`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadRange {
    /// The range does not start on a group or does not end on one (or at the end of the blob).
    #[error("bytes {start}..{end} of {size}: a verifiable range starts and ends on a chunk group of {group_size} bytes (or at the end)")]
    Unaligned {
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
        /// Blob size.
        size: u64,
        /// Chunk group size.
        group_size: u64,
    },
    /// The outboard does not match the blob hash.
    #[error("outboard: {0}")]
    Outboard(#[from] BadOutboard),
    /// A chunk group's bytes do not match the outboard.
    #[error("chunk group {index} (bytes {start}..{end}) does not match the blob hash")]
    Mismatch {
        /// Group index.
        index: u64,
        /// Its first byte.
        start: u64,
        /// One past its last byte.
        end: u64,
    },
}

/// Checks `data`, bytes `offset..offset + data.len()` of a blob of `size` bytes whose hash is
/// `root`, against the blob's `outboard`: only the pairs on the paths from the root to the
/// range's groups are read and checked, then each group's bytes. The range starts on a
/// chunk group and ends on one or at the end of the blob.
pub fn verify_range(
    outboard: &[u8],
    size: u64,
    group_size: u64,
    root: &Blake3Hash,
    offset: u64,
    data: &[u8],
) -> Result<(), BadRange> {
    let end = offset + data.len() as u64;
    let aligned =
        offset.is_multiple_of(group_size) && (end.is_multiple_of(group_size) || end == size);
    if !aligned || end > size || data.is_empty() {
        return Err(BadRange::Unaligned {
            start: offset,
            end,
            size,
            group_size,
        });
    }
    if groups(size, group_size) == 1 {
        return (Blake3Hash::of(data) == *root)
            .then_some(())
            .ok_or(BadRange::Mismatch {
                index: 0,
                start: 0,
                end: size,
            });
    }
    let (g0, g1) = (offset / group_size, end.div_ceil(group_size));
    let mut bad = None;
    walk(outboard, size, group_size, root, |first, n, cv| {
        if n == 1 && (g0..g1).contains(&first) && bad.is_none() {
            let start = first * group_size;
            let stop = (start + group_size).min(size);
            let bytes = &data[(start - offset) as usize..(stop - offset) as usize];
            let mut h = blake3::Hasher::new();
            blake3::hazmat::HasherExt::set_input_offset(&mut h, start);
            h.update(bytes);
            if blake3::hazmat::HasherExt::finalize_non_root(&h) != *cv {
                bad = Some(BadRange::Mismatch {
                    index: first,
                    start,
                    end: stop,
                });
            }
        }
        // Only subtrees that reach into the range are opened.
        first < g1 && first + n > g0
    })?;
    bad.map_or(Ok(()), Err)
}

/// Checks the pairs of `outboard` top-down against `root` and calls `visit(first, n, cv)` for
/// every subtree below the root that it reaches, in pre-order, with its first group, its
/// number of groups and its checked CV; when `visit` returns false, the subtree's own pairs
/// are skipped unchecked.
fn walk(
    outboard: &[u8],
    size: u64,
    group_size: u64,
    root: &Blake3Hash,
    mut visit: impl FnMut(u64, u64, &ChainingValue) -> bool,
) -> Result<(), BadOutboard> {
    let want = outboard_len(size, group_size);
    if outboard.len() as u64 != want {
        return Err(BadOutboard::Length {
            got: outboard.len() as u64,
            want,
            size,
            group_size,
        });
    }
    let n = groups(size, group_size);
    if n < 2 {
        return Ok(());
    }
    // Pre-order: a subtree of `n` groups is its pair followed by its children's pairs,
    // `n - 1` pairs in all, so skipping one is skipping that many.
    let mut pos = 0usize;
    let mut stack: Vec<(u64, u64, Option<ChainingValue>)> = vec![(0, n, None)];
    while let Some((first, n, cv)) = stack.pop() {
        if let Some(cv) = &cv {
            if !visit(first, n, cv) {
                pos += (n as usize - 1) * PAIR;
                continue;
            }
        }
        if n < 2 {
            continue;
        }
        let pair = &outboard[pos..pos + PAIR];
        pos += PAIR;
        let left: ChainingValue = pair[..32].try_into().expect("32 bytes");
        let right: ChainingValue = pair[32..].try_into().expect("32 bytes");
        let ok = match cv {
            None => merge_subtrees_root(&left, &right, Mode::Hash).as_bytes() == &root.0,
            Some(cv) => merge_subtrees_non_root(&left, &right, Mode::Hash) == cv,
        };
        if !ok {
            return Err(BadOutboard::Mismatch {
                first,
                end: first + n,
            });
        }
        // Left-complete: the left child holds the largest power of two below `n`.
        let l = 1u64 << (63 - (n - 1).leading_zeros());
        stack.push((first + l, n - l, Some(right)));
        stack.push((first, l, Some(left)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::piece_tree::piece_cv;
    use rand::{RngCore, SeedableRng};

    fn random(len: usize, seed: u64) -> Vec<u8> {
        let mut v = vec![0u8; len];
        rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(&mut v);
        v
    }

    /// Piece CVs the long way round, as format 2 computes them.
    fn direct(data: &[u8], piece: usize) -> Vec<Blake3Hash> {
        match data.len().div_ceil(piece) {
            0 => Vec::new(),
            1 => vec![Blake3Hash::of(data)],
            _ => data
                .chunks(piece)
                .enumerate()
                .map(|(i, p)| piece_cv(p, (i * piece) as u64))
                .collect(),
        }
    }

    #[test]
    fn outboards_hash_like_blake3_and_give_the_piece_cvs_of_format_2() {
        let g = MIN_GROUP_SIZE as usize;
        for (len, piece) in [
            (0, g),
            (1, g),
            (g, g),
            (g + 1, g),
            (5 * g + 7, g),
            (6 * g, 2 * g),
            (37 * g + 1, 4 * g),
            (64 * g, 16 * g),
            (65 * g - 1, 64 * g),
        ] {
            let data = random(len, len as u64);
            let (root, ob) = create(&data[..], len as u64, g as u64).unwrap();
            assert_eq!(root, Blake3Hash::of(&data), "{len} bytes");
            assert_eq!(ob.len() as u64, outboard_len(len as u64, g as u64));
            let cvs = piece_cvs(&ob, len as u64, g as u64, piece as u64, &root).unwrap();
            assert_eq!(cvs, direct(&data, piece), "{len} bytes, pieces of {piece}");
        }
    }

    #[test]
    fn larger_groups_work_the_same() {
        let g = MAX_GROUP_SIZE;
        let data = random(3 * g as usize + 99, 7);
        let (root, ob) = create(&data[..], data.len() as u64, g).unwrap();
        assert_eq!(ob.len(), 3 * PAIR);
        let cvs = piece_cvs(&ob, data.len() as u64, g, g, &root).unwrap();
        assert_eq!(cvs, direct(&data, g as usize));
    }

    #[test]
    fn any_changed_byte_of_an_outboard_is_refused() {
        let g = MIN_GROUP_SIZE;
        let data = random(11 * g as usize + 5, 3);
        let (root, ob) = create(&data[..], data.len() as u64, g).unwrap();
        for i in (0..ob.len()).step_by(13) {
            let mut bad = ob.clone();
            bad[i] ^= 0x40;
            let err = piece_cvs(&bad, data.len() as u64, g, g, &root).unwrap_err();
            assert!(
                matches!(err, BadOutboard::Mismatch { .. }),
                "byte {i}: {err}"
            );
        }
        // Another blob's hash, a short or a long outboard.
        let other = Blake3Hash::of(b"other");
        assert!(piece_cvs(&ob, data.len() as u64, g, g, &other).is_err());
        let short = &ob[..ob.len() - 1];
        assert!(matches!(
            piece_cvs(short, data.len() as u64, g, g, &root),
            Err(BadOutboard::Length { .. })
        ));
        let mut long = ob.clone();
        long.extend_from_slice(&[0; 64]);
        assert!(piece_cvs(&long, data.len() as u64, g, g, &root).is_err());
    }

    #[test]
    fn any_aligned_range_verifies_against_the_hash_alone() {
        let g = MIN_GROUP_SIZE as usize;
        let len = 13 * g + 777;
        let data = random(len, 5);
        let (root, ob) = create(&data[..], len as u64, g as u64).unwrap();
        let check = |a: usize, b: usize, bytes: &[u8]| {
            verify_range(&ob, len as u64, g as u64, &root, a as u64, &bytes[a..b])
        };
        for (a, b) in [(0, g), (g, 3 * g), (12 * g, len), (0, len), (5 * g, 6 * g)] {
            check(a, b, &data).unwrap_or_else(|e| panic!("{a}..{b}: {e}"));
            let mut bad = data.clone();
            bad[b - 1] ^= 1;
            assert!(
                matches!(check(a, b, &bad), Err(BadRange::Mismatch { .. })),
                "{a}..{b}"
            );
        }
        // Bytes moved to another offset do not verify there.
        let moved = verify_range(&ob, len as u64, g as u64, &root, g as u64, &data[..g]);
        assert!(moved.is_err());
        for (a, b) in [(1, g), (0, g + 1), (0, 0), (12 * g, len + 1)] {
            let err = verify_range(&ob, len as u64, g as u64, &root, a as u64, &vec![0; b - a]);
            assert!(matches!(err, Err(BadRange::Unaligned { .. })), "{a}..{b}");
        }
        // A corrupt pair on the path to the range is caught; one off the path is not read.
        // The last pair is the parent of the last two groups (12 and 13 of 14).
        let mut bad = ob.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        let with = |ob: &[u8], a: usize, b: usize| {
            verify_range(ob, len as u64, g as u64, &root, a as u64, &data[a..b])
        };
        assert!(with(&bad, 0, g).is_ok());
        assert!(matches!(
            with(&bad, 12 * g, len),
            Err(BadRange::Outboard(_))
        ));
        bad[0] ^= 1;
        assert!(with(&bad, 0, g).is_err());
        // A blob of one group verifies by its hash.
        let small = random(1000, 9);
        let (r, ob) = create(&small[..], 1000, g as u64).unwrap();
        assert!(ob.is_empty());
        verify_range(&ob, 1000, g as u64, &r, 0, &small).unwrap();
    }

    #[test]
    fn group_sizes_are_powers_of_two_from_64_kib_to_1_mib() {
        assert!(is_group_size(64 << 10));
        assert!(is_group_size(1 << 20));
        assert!(!is_group_size(32 << 10));
        assert!(!is_group_size(2 << 20));
        assert!(!is_group_size(96 << 10));
    }
}
