//! A fixed log-binned histogram of margins (`error / threshold`), kept per tensor in
//! `report.json` so pages can draw the whole distribution, not only its percentiles. Part of
//! the report's data, so it lives with the campaign that fills it; `crate::report` draws it.

use serde::{Deserialize, Serialize};

/// Lowest bin edge: `10^LOG10_LO`. Margins below it (0 included) are counted in `under`.
pub const LOG10_LO: i32 = -8;
/// Highest bin edge: `10^LOG10_HI`. Margins at or above it, and non-finite ones, are in `over`.
pub const LOG10_HI: i32 = 3;
/// Bins per decade.
pub const PER_DECADE: u32 = 4;

/// Counts of margins in bins of equal width in `log10(margin)`: bin `i` holds margins in
/// `[10^(lo + i/per_decade), 10^(lo + (i+1)/per_decade))`. The edges are written into the
/// report, so a reader does not depend on this build's constants. The failure line, margin 1,
/// is a bin edge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    pub log10_lo: i32,
    pub per_decade: u32,
    pub counts: Vec<u64>,
    /// Margins below `10^log10_lo`, zero included.
    pub under: u64,
    /// Margins at or above the last edge, and infinite or NaN ones.
    pub over: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        let bins = ((LOG10_HI - LOG10_LO) as u32 * PER_DECADE) as usize;
        Histogram {
            log10_lo: LOG10_LO,
            per_decade: PER_DECADE,
            counts: vec![0; bins],
            under: 0,
            over: 0,
        }
    }
}

impl Histogram {
    /// The histogram of `margins`.
    pub fn of(margins: &[f64]) -> Self {
        let mut h = Histogram::default();
        for &m in margins {
            h.add(m);
        }
        h
    }

    /// Counts one margin.
    pub fn add(&mut self, m: f64) {
        if !m.is_finite() {
            self.over += 1;
            return;
        }
        if m < self.edge(0) {
            self.under += 1;
            return;
        }
        // The float log can land a hair off an exact edge; the comparison with the edges fixes it.
        let mut i = ((m.log10() - f64::from(self.log10_lo)) * f64::from(self.per_decade)).floor();
        let n = self.counts.len();
        if i >= n as f64 {
            self.over += 1;
            return;
        }
        i = i.max(0.0);
        let mut i = i as usize;
        if m < self.edge(i) {
            i -= 1;
        } else if i + 1 < n && m >= self.edge(i + 1) {
            i += 1;
        }
        if i + 1 == n && m >= self.edge(n) {
            self.over += 1;
        } else {
            self.counts[i] += 1;
        }
    }

    /// Lower edge of bin `i` (`edge(counts.len())` is the upper edge of the last bin).
    pub fn edge(&self, i: usize) -> f64 {
        10f64.powf(f64::from(self.log10_lo) + i as f64 / f64::from(self.per_decade.max(1)))
    }

    /// Every margin counted.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.under + self.over
    }

    /// Margins of at least 1 (1 itself passes; the bins cannot tell it from a failure),
    /// `over` included.
    pub fn from_one(&self) -> u64 {
        let first = (0..self.counts.len())
            .find(|&i| self.edge(i) >= 1.0)
            .unwrap_or(self.counts.len());
        self.counts[first..].iter().sum::<u64>() + self.over
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_edges_and_overflow() {
        let h = Histogram::of(&[
            0.0,
            1e-9,
            1e-8,
            0.6,
            0.999,
            1.0,
            1.5,
            999.0,
            1e3,
            f64::INFINITY,
            f64::NAN,
        ]);
        assert_eq!(h.total(), 11);
        assert_eq!(h.under, 2, "0 and 1e-9");
        assert_eq!(h.counts[0], 1, "1e-8 is the first edge");
        assert_eq!(h.over, 3, "1e3, inf, NaN");
        // Margin 1 is the edge 8 decades up: 1.0 and 1.5 sit in the bin that starts there.
        let one = (8 * PER_DECADE) as usize;
        assert_eq!(h.edge(one), 1.0);
        assert_eq!(h.counts[one], 2);
        assert_eq!(h.counts[one - 1], 2, "0.6 and 0.999 lie in [10^-0.25, 1)");
        assert_eq!(h.from_one(), 2 + 1 + 3, "1.0, 1.5, 999 and the three over");
    }

    #[test]
    fn every_edge_lands_in_its_own_bin() {
        let h0 = Histogram::default();
        for i in 0..h0.counts.len() {
            let h = Histogram::of(&[h0.edge(i)]);
            assert_eq!(h.counts[i], 1, "edge {i}");
        }
    }
}
