//! Which piece a pull starts next (sans-IO).
//!
//! A pull works through its pieces in a fixed order: file order, or, for a node that shares
//! with peers, an order of its own ([`spread_order`], a seeded shuffle, BitTorrent's "random
//! first"), so that nodes that scale up together rarely ask the mirror for the same piece at
//! the same moment. Before that order, each free slot takes a piece that a peer already
//! holds and that this pull has not started (the caller says which, from the peers'
//! announced holdings), fetched from that peer; only when no peer has anything new does a
//! slot take the next piece of the order, which nobody may have yet and so usually comes
//! from the mirror. A piece of the order that a peer announced it is fetching is put off
//! until the order has nothing else: by then the peer holds it, or it is fetched anyway. The
//! mirror's uplink then carries little more than one copy of the model and the peers the
//! rest (`docs/benchmarks.md`, "Pullers that share").

use rand::SeedableRng as _;

use crate::piece_bits::PieceBits;

/// The pieces of one pull not started yet.
#[derive(Debug)]
pub struct PieceQueue {
    /// `(blob, piece)` in the order they are taken when no peer offers one.
    order: Vec<(usize, u64)>,
    cursor: usize,
    /// Pieces of the order put off because a peer was fetching them.
    later: std::collections::VecDeque<(usize, u64)>,
    /// Per blob: started, or done before this pull began.
    started: Vec<PieceBits>,
    left: usize,
}

impl PieceQueue {
    /// Pieces `order` of blobs with `counts` pieces each; every piece not in `order` counts
    /// as done.
    pub fn new(order: Vec<(usize, u64)>, counts: &[u64]) -> Self {
        let mut todo: Vec<PieceBits> = counts.iter().map(|c| PieceBits::empty(*c)).collect();
        for (b, i) in &order {
            todo[*b].set(*i);
        }
        let started = todo
            .iter()
            .zip(counts)
            .map(|(t, c)| {
                let mut s = PieceBits::empty(*c);
                (0..*c).filter(|i| !t.has(*i)).for_each(|i| s.set(i));
                s
            })
            .collect();
        Self {
            left: order.len(),
            order,
            cursor: 0,
            later: std::collections::VecDeque::new(),
            started,
        }
    }

    /// The next piece to start, `None` when every piece has been started.
    /// `peer_piece(blob, started)` offers a piece of `blob` that a peer holds and that is
    /// not in `started`; `peer_taking(blob, piece)` says whether a peer is fetching it.
    pub fn next(
        &mut self,
        mut peer_piece: impl FnMut(usize, &PieceBits) -> Option<u64>,
        mut peer_taking: impl FnMut(usize, u64) -> bool,
    ) -> Option<(usize, u64)> {
        if self.left == 0 {
            return None;
        }
        for b in 0..self.started.len() {
            if let Some(i) = peer_piece(b, &self.started[b]) {
                if i < self.started[b].count() && !self.started[b].has(i) {
                    return Some(self.take(b, i));
                }
            }
        }
        while let Some(&(b, i)) = self.order.get(self.cursor) {
            self.cursor += 1;
            if self.started[b].has(i) {
                continue;
            }
            if peer_taking(b, i) {
                self.later.push_back((b, i));
                continue;
            }
            return Some(self.take(b, i));
        }
        while let Some((b, i)) = self.later.pop_front() {
            if !self.started[b].has(i) {
                return Some(self.take(b, i));
            }
        }
        None
    }

    fn take(&mut self, b: usize, i: u64) -> (usize, u64) {
        self.started[b].set(i);
        self.left -= 1;
        (b, i)
    }
}

/// Shuffles the piece list with `seed`: a different order on every node that shares, so
/// that two nodes rarely ask the mirror for the same piece at the same time.
pub fn spread_order<T>(jobs: &mut [T], seed: u64) {
    use rand::seq::SliceRandom as _;
    jobs.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut PieceQueue, peer: &PieceBits) -> Vec<(usize, u64)> {
        std::iter::from_fn(|| {
            q.next(
                |b, s| (b == 0).then(|| peer.first_not_in(s, 0)).flatten(),
                |_, _| false,
            )
        })
        .collect()
    }

    #[test]
    fn without_peers_pieces_come_in_order_each_once_and_done_ones_are_skipped() {
        let order = vec![(0, 2), (0, 3), (1, 0), (0, 0)];
        let mut q = PieceQueue::new(order.clone(), &[4, 1]);
        assert_eq!(drain(&mut q, &PieceBits::empty(4)), order);
        assert_eq!(q.next(|_, _| None, |_, _| false), None);
    }

    #[test]
    fn pieces_a_peer_is_fetching_are_put_off_until_nothing_else_is_left() {
        let order: Vec<(usize, u64)> = (0..5).map(|i| (0, i)).collect();
        let mut q = PieceQueue::new(order, &[5]);
        let taking = |_: usize, i: u64| i == 1 || i == 2;
        let got: Vec<_> = std::iter::from_fn(|| q.next(|_, _| None, taking)).collect();
        assert_eq!(got, vec![(0, 0), (0, 3), (0, 4), (0, 1), (0, 2)]);
        // Put off, then offered by the peer that finished it: taken once.
        let mut q = PieceQueue::new(vec![(0, 0), (0, 1)], &[2]);
        assert_eq!(q.next(|_, _| None, |_, i| i == 0), Some((0, 1)));
        assert_eq!(q.next(|_, _| Some(0), |_, _| true), Some((0, 0)));
        assert_eq!(q.next(|_, _| None, |_, _| false), None);
    }

    #[test]
    fn pieces_a_peer_holds_go_first_and_nothing_is_taken_twice() {
        let order: Vec<(usize, u64)> = (0..8).map(|i| (0, i)).collect();
        let mut peer = PieceBits::empty(8);
        for i in [5, 6, 7] {
            peer.set(i);
        }
        let mut q = PieceQueue::new(order, &[8]);
        let got = drain(&mut q, &peer);
        assert_eq!(&got[..5], &[(0, 5), (0, 6), (0, 7), (0, 0), (0, 1)]);
        let mut sorted = got.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..8).map(|i| (0, i)).collect::<Vec<_>>());
    }

    #[test]
    fn a_peer_offering_a_started_or_unknown_piece_is_ignored() {
        let mut q = PieceQueue::new(vec![(0, 0), (0, 1)], &[2]);
        assert_eq!(q.next(|_, _| Some(9), |_, _| false), Some((0, 0)));
        assert_eq!(q.next(|_, _| Some(0), |_, _| false), Some((0, 1)));
        assert_eq!(q.next(|_, _| Some(1), |_, _| false), None);
    }

    #[test]
    fn spread_orders_keep_every_piece_once_and_differ_between_seeds() {
        let base: Vec<(usize, u64)> = (0..4).flat_map(|b| (0..64).map(move |i| (b, i))).collect();
        let orders: Vec<Vec<(usize, u64)>> = (0..4u64)
            .map(|seed| {
                let mut jobs = base.clone();
                spread_order(&mut jobs, seed);
                let mut sorted = jobs.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, base);
                jobs
            })
            .collect();
        // Four nodes: their first pieces (what they ask the mirror for at once) differ.
        let firsts: std::collections::HashSet<_> = orders.iter().map(|o| o[0]).collect();
        assert_eq!(firsts.len(), 4);
        assert_ne!(orders[0], base);
        let mut none: Vec<(usize, u64)> = Vec::new();
        spread_order(&mut none, 7);
        assert!(none.is_empty());
    }
}
