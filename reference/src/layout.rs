//! THD layouts: `cu_seqlens` and padded offsets, validated against `docs/semantics.md` §1.1.

use thiserror::Error;

/// Why a layout or a problem's tensors are not a valid input of `docs/semantics.md` §1.1.
/// Every variant names the field (tensor), the index and the value.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum LayoutError {
    #[error("{field}: must hold at least one element (b+1 with b >= 0), got an empty array")]
    Empty { field: &'static str },
    #[error("{field}: length {len} does not match cu_seqlens_q's length {expected} (b+1)")]
    Length {
        field: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("{field}[0] = {value}: prefix sums must start at 0")]
    NonZeroStart { field: &'static str, value: i64 },
    #[error("{field}[{index}] = {value} is negative")]
    Negative {
        field: &'static str,
        index: usize,
        value: i64,
    },
    #[error("{field}[{index}] = {value} is smaller than {field}[{}] = {prev}: must be non-decreasing", index - 1)]
    NonMonotone {
        field: &'static str,
        index: usize,
        value: i64,
        prev: i64,
    },
    #[error("{field}: slot {slot} has length {len} but padded span {span} (offsets {field_off}[{slot}..={}])", slot + 1)]
    SpanShorterThanLength {
        field: &'static str,
        field_off: &'static str,
        slot: usize,
        len: i64,
        span: i64,
    },
    #[error("{field}[{index}] = {value} is past the end of the {tensor} buffer ({tokens} tokens)")]
    PastBuffer {
        field: &'static str,
        index: usize,
        value: i64,
        tensor: &'static str,
        tokens: usize,
    },
    #[error("tensor {tensor}: shape {got:?} does not match expected {expected:?}")]
    Shape {
        tensor: &'static str,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("num_heads = {num_heads} is not a multiple of num_gqa_groups = {num_kv_heads}")]
    Gqa {
        num_heads: usize,
        num_kv_heads: usize,
    },
    #[error("{field} = {value}: must be at least 1")]
    Zero { field: &'static str, value: usize },
    #[error("scale = {value}: must be finite")]
    Scale { value: f64 },
    #[error(transparent)]
    Bias(#[from] crate::bias::BiasError),
}

/// One side's token addressing: per-slot start offsets and lengths.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Side {
    /// `cu_seqlens[b+1]`: prefix sums of actual lengths.
    pub cu: Vec<i32>,
    /// `cu_seqlens_padded[b+1]`: start token of each slot; `None` means equal to `cu`.
    pub padded: Option<Vec<i32>>,
    /// Rows of the buffer (`Tq` or `Tk`).
    pub tokens: usize,
}

impl Side {
    /// Number of slots `b`.
    pub fn slots(&self) -> usize {
        self.cu.len().saturating_sub(1)
    }

    /// Actual length `L_i`.
    pub fn len(&self, i: usize) -> usize {
        (self.cu[i + 1] - self.cu[i]) as usize
    }

    /// Start token `off[i]`.
    pub fn offset(&self, i: usize) -> usize {
        self.offsets()[i] as usize
    }

    /// The offsets array (`padded`, or `cu` when absent).
    pub fn offsets(&self) -> &[i32] {
        self.padded.as_deref().unwrap_or(&self.cu)
    }

    /// Padded span `off[i+1] - off[i]`.
    pub fn span(&self, i: usize) -> usize {
        let o = self.offsets();
        (o[i + 1] - o[i]) as usize
    }

    /// Largest actual length over slots (0 when `b = 0`).
    pub fn max_len(&self) -> usize {
        (0..self.slots()).map(|i| self.len(i)).max().unwrap_or(0)
    }

    /// Largest padded span over slots (0 when `b = 0`).
    pub fn max_span(&self) -> usize {
        (0..self.slots()).map(|i| self.span(i)).max().unwrap_or(0)
    }

    /// Mask of valid tokens, one flag per buffer row.
    pub fn valid_tokens(&self) -> Vec<bool> {
        let mut valid = vec![false; self.tokens];
        for i in 0..self.slots() {
            let o = self.offset(i);
            valid[o..o + self.len(i)].iter_mut().for_each(|v| *v = true);
        }
        valid
    }

    fn validate(&self, names: SideNames, expected_len: usize) -> Result<(), LayoutError> {
        check_prefix(names.cu, &self.cu, expected_len)?;
        if let Some(p) = &self.padded {
            check_prefix(names.padded, p, expected_len)?;
        }
        let off = self.offsets();
        let off_name = if self.padded.is_some() {
            names.padded
        } else {
            names.cu
        };
        for i in 0..self.slots() {
            let len = i64::from(self.cu[i + 1]) - i64::from(self.cu[i]);
            let span = i64::from(off[i + 1]) - i64::from(off[i]);
            if span < len {
                return Err(LayoutError::SpanShorterThanLength {
                    field: names.cu,
                    field_off: off_name,
                    slot: i,
                    len,
                    span,
                });
            }
        }
        let last = *off.last().expect("checked non-empty") as i64;
        if last as u64 > self.tokens as u64 {
            return Err(LayoutError::PastBuffer {
                field: off_name,
                index: off.len() - 1,
                value: last,
                tensor: names.tensor,
                tokens: self.tokens,
            });
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
struct SideNames {
    cu: &'static str,
    padded: &'static str,
    tensor: &'static str,
}

/// Checks a `[b+1]` offsets array: right length, starts at 0 (for `cu_seqlens`) or >= 0, and
/// non-decreasing.
fn check_prefix(field: &'static str, a: &[i32], expected_len: usize) -> Result<(), LayoutError> {
    if a.is_empty() {
        return Err(LayoutError::Empty { field });
    }
    if a.len() != expected_len {
        return Err(LayoutError::Length {
            field,
            len: a.len(),
            expected: expected_len,
        });
    }
    if a[0] < 0 {
        return Err(LayoutError::Negative {
            field,
            index: 0,
            value: a[0].into(),
        });
    }
    if !field.ends_with("_padded") && a[0] != 0 {
        return Err(LayoutError::NonZeroStart {
            field,
            value: a[0].into(),
        });
    }
    for i in 1..a.len() {
        if a[i] < a[i - 1] {
            return Err(LayoutError::NonMonotone {
                field,
                index: i,
                value: a[i].into(),
                prev: a[i - 1].into(),
            });
        }
    }
    Ok(())
}

/// A validated THD layout: both sides' offsets and buffer sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub q: Side,
    pub kv: Side,
}

impl Layout {
    /// Builds and validates a layout.
    ///
    /// # Errors
    /// A [`LayoutError`] naming the first offending field, index and value.
    pub fn new(q: Side, kv: Side) -> Result<Layout, LayoutError> {
        if q.cu.is_empty() {
            return Err(LayoutError::Empty {
                field: "cu_seqlens_q",
            });
        }
        let n = q.cu.len();
        q.validate(
            SideNames {
                cu: "cu_seqlens_q",
                padded: "cu_seqlens_q_padded",
                tensor: "q",
            },
            n,
        )?;
        kv.validate(
            SideNames {
                cu: "cu_seqlens_kv",
                padded: "cu_seqlens_kv_padded",
                tensor: "k",
            },
            n,
        )?;
        Ok(Layout { q, kv })
    }

    /// Unpadded layout from per-slot lengths, buffers exactly as large as the tokens.
    pub fn packed(lens: &[(usize, usize)]) -> Layout {
        let mut cq = vec![0i32];
        let mut ck = vec![0i32];
        for &(lq, lk) in lens {
            cq.push(cq.last().unwrap() + lq as i32);
            ck.push(ck.last().unwrap() + lk as i32);
        }
        let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
        Layout {
            q: Side {
                cu: cq,
                padded: None,
                tokens: tq,
            },
            kv: Side {
                cu: ck,
                padded: None,
                tokens: tk,
            },
        }
    }

    /// Number of slots `b`.
    pub fn slots(&self) -> usize {
        self.q.slots()
    }
}
