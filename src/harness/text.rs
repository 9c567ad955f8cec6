//! Numbers for people: fixed notation while it stays readable, scientific past it. A
//! broken kernel's margins and deviations reach 1e37; printed fixed they are forty digits
//! that no one reads, and they push every column of a table apart.

/// Magnitudes from here on print in scientific notation.
const SCIENTIFIC_FROM: f64 = 1e6;

/// `x` with `places` decimals, or as `1.234e7` (three decimals) from 1e6 on; `inf`, `-inf`,
/// `NaN` as such.
pub fn decimal(x: f64, places: usize) -> String {
    if x.is_finite() && x.abs() >= SCIENTIFIC_FROM {
        format!("{x:.3e}")
    } else {
        format!("{x:.places$}")
    }
}

/// As [`decimal`], with a sign always (`+0.25`, `-3.000e9`).
pub fn signed(x: f64, places: usize) -> String {
    let s = decimal(x, places);
    if s.starts_with('-') || x.is_nan() {
        s
    } else {
        format!("+{s}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_values_turn_scientific() {
        assert_eq!(decimal(7_044_541_051_373_307.0, 3), "7.045e15");
        assert_eq!(decimal(999_999.5, 2), "999999.50");
        assert_eq!(decimal(0.1234, 3), "0.123");
        assert_eq!(decimal(f64::INFINITY, 3), "inf");
        assert_eq!(signed(6.838e36, 2), "+6.838e36");
        assert_eq!(signed(-0.5, 2), "-0.50");
        assert_eq!(signed(0.25, 2), "+0.25");
    }
}
