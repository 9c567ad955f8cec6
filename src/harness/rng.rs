//! Deterministic randomness: one small PRNG (splitmix64) behind the [`Draw`] trait, so the
//! CLI, proptest and cargo-fuzz all drive the same case model from their own entropy.

/// A source of choices. The CLI uses [`Rng`]; the fuzz targets implement it over the fuzzer's
/// bytes; proptest seeds an [`Rng`].
pub trait Draw {
    /// A uniform value in `0..n` (`n >= 1`).
    fn below(&mut self, n: u64) -> u64;

    /// A uniform value in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below((hi - lo + 1) as u64) as usize
    }

    /// True with probability `p` (in percent).
    fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }

    /// One of `items`, uniformly.
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }

    /// One of `items`, with integer weights.
    fn weighted<T: Copy>(&mut self, items: &[(u64, T)]) -> T {
        let total: u64 = items.iter().map(|(w, _)| w).sum();
        let mut x = self.below(total);
        for &(w, t) in items {
            if x < w {
                return t;
            }
            x -= w;
        }
        items[items.len() - 1].1
    }
}

/// splitmix64: tiny, fast, and stable across versions (capsule seeds must replay).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.unit().max(f64::MIN_POSITIVE);
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// A derived, independent stream.
    pub fn fork(&mut self, salt: u64) -> Rng {
        Rng(self.next_u64() ^ salt.wrapping_mul(0xd134_2543_de82_ef95))
    }
}

impl Draw for Rng {
    fn below(&mut self, n: u64) -> u64 {
        // Multiply-shift: unbiased enough for test generation, and never divides by zero.
        ((u128::from(self.next_u64()) * u128::from(n.max(1))) >> 64) as u64
    }
}
