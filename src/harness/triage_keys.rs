//! Evidence for a triage verdict on a wrong LSE: whether the stored value is the reference's
//! with one key's visibility flipped (a visible key left out, or a key of the slot that the
//! mask or window hides let in). A mask or window applied one key off is the commonest way an
//! implementation departs from docs/semantics.md §1.5, and its numeric trace is small where
//! that key's P is (a varlen FlashAttention row that dropped one of five keys was off by 0.134;
//! a key of P = 1e-4 moves the LSE by 1e-4). Naming the key turns "lse off by 1e-4" into a
//! report an upstream engineer can act on.

use crate::case::Case;

/// The stored LSE of row `(token, head)` against the reference's with each single key flipped;
/// a line of evidence where one flip explains it, `None` where none does (or the row has no
/// stored finite LSE, or its error is already negligible).
pub fn one_key_off(case: &Case, token: usize, head: usize) -> Option<String> {
    let stored = case.outputs.lse.as_ref()?[(token, head)];
    if !stored.is_finite() {
        return None;
    }
    let row = case
        .visible_rows()
        .find(|r| r.token == token && r.head == head)?;
    let first = case.layout.kv.offset(row.slot);
    let visible: Vec<f64> = row.keys.iter().map(|&c| case.score(&row, c)).collect();
    let reference = log_sum_exp(visible.iter().copied());
    let err = (stored - reference).abs();
    // f32 rounding of an LSE of this size moves it by far less: nothing to explain.
    if err <= 1e-6 * reference.abs().max(1.0) {
        return None;
    }
    let mut flips: Vec<(usize, bool, f64)> = Vec::new();
    for (i, &c) in row.keys.iter().enumerate() {
        let rest = (visible.iter().enumerate())
            .filter(|&(j, _)| j != i)
            .map(|(_, &s)| s);
        flips.push((c, false, log_sum_exp(rest)));
    }
    let slot_keys = first..first + case.layout.kv.len(row.slot);
    for c in slot_keys.filter(|c| !row.keys.contains(c)) {
        let s = case.score(&row, c);
        // A key a -inf bias hides stays hidden whatever the mask says.
        if s.is_finite() {
            let with = visible.iter().copied().chain(std::iter::once(s));
            flips.push((c, true, log_sum_exp(with)));
        }
    }
    let best = flips
        .iter()
        .map(|&(_, _, l)| (stored - l).abs())
        .fold(f64::INFINITY, f64::min);
    // One flip explains it where it lands 20 times closer than the reference does; keys whose
    // scores tie explain it equally (the same LSE), and are all named.
    let explained = best * 20.0 <= err;
    if !explained {
        return None;
    }
    let close = |l: f64| (stored - l).abs() <= best.max(1e-9 * err) * 1.5;
    let named = |added: bool| -> Vec<String> {
        (flips.iter())
            .filter(|&&(_, a, l)| a == added && close(l))
            .map(|&(c, _, _)| (c - first).to_string())
            .collect()
    };
    let (left_out, let_in) = (named(false), named(true));
    let what = match (left_out.is_empty(), let_in.is_empty()) {
        (false, true) => format!("with key {} of the slot left out", left_out.join(" or ")),
        (true, false) => format!(
            "with key {} of the slot let in (the mask or window hides it)",
            let_in.join(" or ")
        ),
        _ => format!(
            "with one key flipped: left out {} or let in {}",
            left_out.join(" or "),
            let_in.join(" or ")
        ),
    };
    Some(format!(
        "query row {} of slot {} (token {token}, head {head}): the stored lse {stored:.7} is the \
         reference's {what} ({:.7}; with the keys §1.5 makes visible it is {reference:.7}): the \
         implementation's mask or window differs from §1.5 at that key",
        row.row,
        row.slot,
        flips
            .iter()
            .map(|&(_, _, l)| l)
            .find(|&l| close(l))
            .unwrap_or(reference),
    ))
}

fn log_sum_exp(scores: impl Iterator<Item = f64> + Clone) -> f64 {
    let m = scores.clone().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + scores.map(|s| (s - m).exp()).sum::<f64>().ln()
}
