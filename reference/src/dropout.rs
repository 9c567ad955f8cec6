//! Attention dropout (`docs/semantics.md` §1.8): which elements of P drop, decided by
//! Philox 4×32-10 so that the reference, a backend and an adapter agree bit for bit.
//!
//! The mask is a pure function of the case: `(p, seed, offset)` and the element's
//! (slot, head, query row, key column). Nothing here keeps state, so a backward pass recomputes
//! exactly the forward's mask, as FlashAttention's and TE's kernels do from their saved
//! `(seed, offset)`.

/// Philox 4×32's round multipliers and Weyl key increments (Salmon et al., SC'11; Random123).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox 4×32 with 10 rounds: the generator of cuRAND's `curand_Philox4x32_10`, PyTorch's
/// CUDA generator and FlashAttention's dropout.
pub fn philox4x32_10(key: [u32; 2], counter: [u32; 4]) -> [u32; 4] {
    let (mut k, mut x) = (key, counter);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(x[0]);
        let p1 = u64::from(M1) * u64::from(x[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        x = [hi1 ^ x[1] ^ k[0], lo1, hi0 ^ x[3] ^ k[1], lo0];
    }
    x
}

/// The dropout of a call: probability `p` of dropping an element of P, and the generator's
/// `(seed, offset)` (the pair PyTorch returns as `philox_seed`, `philox_offset` and TE keeps in
/// `rng_state`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// In `[0, 1]`; `1` drops every element.
    pub p: f64,
    pub seed: u64,
    pub offset: u64,
}

impl Default for Dropout {
    fn default() -> Self {
        Dropout::NONE
    }
}

impl Dropout {
    pub const NONE: Dropout = Dropout {
        p: 0.0,
        seed: 0,
        offset: 0,
    };

    /// Whether any element can drop; `p = 0` is exactly no dropout, whatever the seed.
    pub fn is_active(&self) -> bool {
        self.p > 0.0
    }

    /// The 32-bit word at or above which an element is kept: `⌈p · 2³²⌉`. `p · 2³²` is exact
    /// in f64, so the threshold is too; `p = 1` gives 2³², which no word reaches.
    pub fn threshold(&self) -> u64 {
        let t = (self.p.clamp(0.0, 1.0) * 4_294_967_296.0).ceil();
        t as u64
    }

    /// The generator's four words for query row `r` and key column `c` (both counted from the
    /// slot's first token) of query head `head` in slot `slot` of a call with `heads` query
    /// heads. Key: `(seed_lo, seed_hi)`; counter: `(n_lo, n_hi, r, c)` with
    /// `n = offset + slot · heads + head` (mod 2⁶⁴): FlashAttention's layout, the offset
    /// advanced per (batch, head), the row and column in the subsequence words.
    pub fn words(&self, slot: usize, heads: usize, head: usize, r: usize, c: usize) -> [u32; 4] {
        let n = self
            .offset
            .wrapping_add((slot as u64).wrapping_mul(heads as u64))
            .wrapping_add(head as u64);
        let key = [self.seed as u32, (self.seed >> 32) as u32];
        philox4x32_10(key, [n as u32, (n >> 32) as u32, r as u32, c as u32])
    }

    /// Whether element `(r, c)` of head `head` in slot `slot` is kept: the first word of
    /// [`Dropout::words`] at or above [`Dropout::threshold`].
    pub fn keep(&self, slot: usize, heads: usize, head: usize, r: usize, c: usize) -> bool {
        if !self.is_active() {
            return true;
        }
        u64::from(self.words(slot, heads, head, r, c)[0]) >= self.threshold()
    }

    /// The factor a kept element is multiplied by, `1/(1 − p)`; 0 at `p = 1`, where nothing
    /// is kept and the factor would be infinite.
    pub fn rescale(&self) -> f64 {
        if self.p >= 1.0 {
            0.0
        } else {
            1.0 / (1.0 - self.p)
        }
    }

    /// The factor element `(r, c)` of P is multiplied by: [`Dropout::rescale`] when kept, else 0.
    pub fn factor(&self, slot: usize, heads: usize, head: usize, r: usize, c: usize) -> f64 {
        if !self.is_active() {
            1.0
        } else if self.keep(slot, heads, head, r, c) {
            self.rescale()
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for philox4x32_10 (`kat_vectors`).
    #[test]
    fn philox_matches_random123_known_answers() {
        assert_eq!(
            philox4x32_10([0, 0], [0, 0, 0, 0]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX, u32::MAX], [u32::MAX; 4]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0xa4093822, 0x299f31d0],
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn the_extremes_keep_everything_and_nothing() {
        let none = Dropout {
            p: 0.0,
            seed: 7,
            offset: 3,
        };
        let all = Dropout { p: 1.0, ..none };
        for (r, c) in [(0, 0), (3, 5), (16, 16)] {
            assert!(none.keep(1, 4, 2, r, c));
            assert_eq!(none.factor(1, 4, 2, r, c), 1.0);
            assert!(!all.keep(1, 4, 2, r, c));
            assert_eq!(all.factor(1, 4, 2, r, c), 0.0);
        }
        assert_eq!(all.threshold(), 1 << 32);
    }

    #[test]
    fn the_kept_share_is_near_one_minus_p() {
        for p in [0.1, 0.5, 0.9] {
            let d = Dropout {
                p,
                seed: 0x1234_5678_9abc,
                offset: 99,
            };
            let n = 20_000;
            let kept = (0..n)
                .filter(|i| d.keep(i % 7, 8, i % 8, i / 56, i % 13))
                .count();
            let share = kept as f64 / n as f64;
            // Four standard deviations of a binomial share at n = 20000.
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            assert!((share - (1.0 - p)).abs() < 4.0 * sd, "p = {p}: {share}");
        }
    }

    /// Each index and each of seed and offset reaches the generator: changing one changes
    /// the words.
    #[test]
    fn every_index_moves_the_words() {
        let d = Dropout {
            p: 0.5,
            seed: 1,
            offset: 2,
        };
        let base = d.words(1, 4, 2, 3, 5);
        assert_ne!(base, d.words(2, 4, 2, 3, 5));
        assert_ne!(base, d.words(1, 4, 3, 3, 5));
        assert_ne!(base, d.words(1, 4, 2, 4, 5));
        assert_ne!(base, d.words(1, 4, 2, 3, 6));
        assert_ne!(base, d.words(1, 4, 2, 5, 3));
        assert_ne!(base, Dropout { seed: 2, ..d }.words(1, 4, 2, 3, 5));
        assert_ne!(base, Dropout { offset: 3, ..d }.words(1, 4, 2, 3, 5));
        // The offset counts (slot, head) pairs, as FlashAttention advances it.
        assert_eq!(
            Dropout { offset: 3, ..d }.words(1, 4, 2, 3, 5),
            d.words(1, 4, 3, 3, 5)
        );
    }
}
