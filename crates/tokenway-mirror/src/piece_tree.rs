//! A file's BLAKE3 hash from the hashes of its pieces, without a second pass. Sans-IO.
//!
//! BLAKE3 is a tree hash (BLAKE3 spec, §2.1 and §5.1.2): the leaves are 1 KiB chunks, a
//! parent node compresses the chaining values (CVs) of its two children, and only the root is
//! finalized with the ROOT flag. The tree is left-complete: the left child of a node over
//! `n` bytes covers the largest power-of-two number of chunks that leaves something for the
//! right child. When the piece size is a power of two (64 KiB to 64 MiB, i.e. 64 to 65,536
//! chunks), every piece of a file is one complete subtree of the file's tree (the last one
//! possibly short), so:
//!
//! - a piece is hashed once, as the subtree at its offset ([`piece_cv`],
//!   `blake3::hazmat::HasherExt::set_input_offset` + `finalize_non_root`), and that CV
//!   verifies it;
//! - the whole-file hash follows from the pieces' CVs merged in the same left-complete shape
//!   ([`root_from_piece_cvs`]): the left part of `n` pieces is the largest power of two
//!   below `n`;
//! - so a manifest that lists the CVs (format 2) can be checked against its file hash on its
//!   own (a few hundred parent compressions per GB), and a file assembled from pieces that
//!   each match their CV has that file hash, exactly as if it had been hashed again.
//!
//! A file of one piece has no non-root CV: its piece hash is the file hash itself.
//! Everything here panics only on broken invariants (no pieces, a piece longer than its
//! subtree); callers check lengths first.

use blake3::hazmat::{
    merge_subtrees_non_root, merge_subtrees_root, ChainingValue, HasherExt, Mode,
};

use crate::manifest::Blake3Hash;

/// Is `piece_size` one whose pieces are whole BLAKE3 subtrees?
pub fn is_subtree_size(piece_size: u64) -> bool {
    piece_size.is_power_of_two() && piece_size >= blake3::CHUNK_LEN as u64
}

/// The chaining value of `data` as the subtree that starts at byte `offset` of a file of
/// more than one piece. `offset` is a multiple of the piece size, `data` is non-empty and at
/// most one piece long.
pub fn piece_cv(data: &[u8], offset: u64) -> Blake3Hash {
    let mut h = blake3::Hasher::new();
    h.set_input_offset(offset);
    h.update(data);
    Blake3Hash(h.finalize_non_root())
}

/// The file hash from the CVs of its pieces, in order; at least two of them.
pub fn root_from_piece_cvs(cvs: &[Blake3Hash]) -> Blake3Hash {
    assert!(
        cvs.len() >= 2,
        "invariant: a file of one piece has no chaining values to merge"
    );
    let (left, right) = split(cvs);
    merge_subtrees_root(&subtree(left), &subtree(right), Mode::Hash).into()
}

/// The CV of the subtree made of `cvs` (one or more whole pieces).
fn subtree(cvs: &[Blake3Hash]) -> ChainingValue {
    if let [one] = cvs {
        return one.0;
    }
    let (left, right) = split(cvs);
    merge_subtrees_non_root(&subtree(left), &subtree(right), Mode::Hash)
}

/// Left-complete split of `n >= 2` pieces: the left part is the largest power of two < `n`.
fn split(cvs: &[Blake3Hash]) -> (&[Blake3Hash], &[Blake3Hash]) {
    let n = cvs.len();
    let left = 1usize << (usize::BITS - 1 - (n - 1).leading_zeros());
    cvs.split_at(left)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};

    const PIECE: usize = 4 << 20;

    /// The file hash the long way round: CV of every piece, then merged.
    fn via_pieces(data: &[u8], piece: usize) -> Blake3Hash {
        let cvs: Vec<Blake3Hash> = data
            .chunks(piece)
            .enumerate()
            .map(|(i, p)| piece_cv(p, (i * piece) as u64))
            .collect();
        match cvs.len() {
            0 => Blake3Hash::of(&[]),
            1 => Blake3Hash::of(data),
            _ => root_from_piece_cvs(&cvs),
        }
    }

    fn random(len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        rand::rngs::SmallRng::seed_from_u64(len as u64).fill_bytes(&mut v);
        v
    }

    #[test]
    fn merged_piece_cvs_equal_the_hash_of_the_whole_file() {
        for len in [
            0,
            1,
            PIECE - 1,
            PIECE,
            PIECE + 1,
            2 * PIECE,
            3 * PIECE + 5,
            5 * PIECE,
            7 * PIECE + 1023,
            8 * PIECE,
        ] {
            let data = random(len);
            assert_eq!(
                via_pieces(&data, PIECE),
                Blake3Hash::of(&data),
                "{len} bytes"
            );
        }
    }

    #[test]
    fn small_power_of_two_pieces_merge_for_any_count() {
        // 64 KiB pieces (the smallest allowed), 1 to 37 pieces, last one short or whole.
        let piece = 64 << 10;
        for n in 1..=37usize {
            for tail in [1, piece / 2, piece] {
                let data = random((n - 1) * piece + tail);
                assert_eq!(
                    via_pieces(&data, piece),
                    Blake3Hash::of(&data),
                    "{n} pieces, last {tail} bytes"
                );
            }
        }
    }

    #[test]
    fn a_changed_piece_changes_its_cv_and_the_root() {
        let mut data = random(3 * PIECE + 5);
        let before = via_pieces(&data, PIECE);
        let cv = piece_cv(&data[PIECE..2 * PIECE], PIECE as u64);
        data[PIECE + 7] ^= 1;
        assert_ne!(piece_cv(&data[PIECE..2 * PIECE], PIECE as u64), cv);
        assert_ne!(via_pieces(&data, PIECE), before);
        // The same bytes at another offset have another CV: pieces cannot be swapped.
        let p = &data[..PIECE];
        assert_ne!(piece_cv(p, 0), piece_cv(p, PIECE as u64));
    }

    #[test]
    fn only_power_of_two_sizes_of_at_least_a_chunk_are_subtrees() {
        assert!(is_subtree_size(64 << 10));
        assert!(is_subtree_size(4 << 20));
        assert!(!is_subtree_size(3 << 20));
        assert!(!is_subtree_size(512));
    }
}
