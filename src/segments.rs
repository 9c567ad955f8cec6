//! JAX-style segment ids (`[B, S]` ids and positions) to and from `cu_seqlens` and offsets, as
//! TransformerEngine converts them (te-smallseq-path.md §1.2).

use crate::error::{Error, Result};
use crate::mutants::{Defects, Mutant};
use serde::{Deserialize, Serialize};
use smallseq_reference::{Layout, Side};

/// The case-file metadata key that carries a case's segment ids ([`Segmented`] as JSON).
pub const META_KEY: &str = "smallseq.segments";

/// Segment ids and positions of a batch, row-major `[batch, seq]` per side.
/// Id 0 is padding; segments are numbered 1, 2, … in order of appearance, each a contiguous run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentIds {
    pub batch: usize,
    pub seq_q: usize,
    pub seq_kv: usize,
    pub ids_q: Vec<i32>,
    pub ids_kv: Vec<i32>,
    pub pos_q: Vec<i32>,
    pub pos_kv: Vec<i32>,
}

impl SegmentIds {
    fn check(&self) -> Result<()> {
        for (name, v, s) in [
            ("segment_ids_q", &self.ids_q, self.seq_q),
            ("segment_ids_kv", &self.ids_kv, self.seq_kv),
            ("segment_pos_q", &self.pos_q, self.seq_q),
            ("segment_pos_kv", &self.pos_kv, self.seq_kv),
        ] {
            if Some(v.len()) != self.batch.checked_mul(s) {
                return Err(Error::Tensor {
                    tensor: name.into(),
                    detail: format!("length {} != batch {} x seq {s}", v.len(), self.batch),
                });
            }
        }
        for (name, v) in [
            ("segment_ids_q", &self.ids_q),
            ("segment_ids_kv", &self.ids_kv),
        ] {
            if let Some((i, x)) = v.iter().enumerate().find(|(_, x)| **x < 0) {
                return Err(Error::Tensor {
                    tensor: name.into(),
                    detail: format!("element {i} = {x} is negative"),
                });
            }
        }
        Ok(())
    }

    /// Converts to a THD layout with `b = batch * max_segments` slots, as TE does:
    /// a token whose segment has no partner on the other side becomes padding; per row,
    /// lengths are `bincount(ids)[1..=max_segments]` (larger ids are dropped) and offsets are
    /// the starts of non-zero runs; lengths > 0 and offsets >= 0 are compacted to the front,
    /// unused lengths become 0 and unused offsets `batch * seq` (so `off[b] = T`).
    ///
    /// # Errors
    /// Malformed inputs, or a layout that TE's algorithm leaves invalid.
    pub fn to_layout(&self, max_segments: usize) -> Result<Layout> {
        self.to_layout_with(max_segments, &Defects::none())
    }

    /// [`SegmentIds::to_layout`] with the conversion's planted bugs (mutation testing; none
    /// in production).
    ///
    /// # Errors
    /// As [`SegmentIds::to_layout`].
    pub fn to_layout_with(&self, max_segments: usize, defects: &Defects) -> Result<Layout> {
        self.check()?;
        let (ids_q, ids_kv) = self.paired_ids();
        // The slip is a Python slice's exclusive bound, `bincount(ids)[1:max_segments]`: a
        // row's last admitted segment loses its length but keeps its start.
        let last_id = if defects.has(Mutant::SegmentConversionSlip) {
            max_segments.saturating_sub(1)
        } else {
            max_segments
        };
        let q = side(&ids_q, self.batch, self.seq_q, max_segments, last_id);
        let kv = side(&ids_kv, self.batch, self.seq_kv, max_segments, last_id);
        Ok(Layout::new(q, kv)?)
    }

    /// Ids with unpaired segments turned into padding (TE's mask-derived row/column ids).
    fn paired_ids(&self) -> (Vec<i32>, Vec<i32>) {
        let mut q = self.ids_q.clone();
        let mut kv = self.ids_kv.clone();
        for r in 0..self.batch {
            let rq = r * self.seq_q..(r + 1) * self.seq_q;
            let rk = r * self.seq_kv..(r + 1) * self.seq_kv;
            let in_kv: Vec<i32> = self.ids_kv[rk.clone()].to_vec();
            let in_q: Vec<i32> = self.ids_q[rq.clone()].to_vec();
            q[rq].iter_mut().for_each(|id| {
                if !in_kv.contains(id) {
                    *id = 0
                }
            });
            kv[rk].iter_mut().for_each(|id| {
                if !in_q.contains(id) {
                    *id = 0
                }
            });
        }
        (q, kv)
    }

    /// Converts a layout back to segment ids for `batch` rows of `seq_q` / `seq_kv` tokens:
    /// slot tokens get the slot's 1-based rank within its row, positions count from 0 within
    /// the segment, everything else is padding (id 0, position 0).
    ///
    /// # Errors
    /// A slot that crosses a row boundary or buffers that do not hold `batch * seq` tokens.
    pub fn from_layout(layout: &Layout, batch: usize, seq_q: usize, seq_kv: usize) -> Result<Self> {
        let (ids_q, pos_q) = ids_of(&layout.q, batch, seq_q, "cu_seqlens_q")?;
        let (ids_kv, pos_kv) = ids_of(&layout.kv, batch, seq_kv, "cu_seqlens_kv")?;
        Ok(SegmentIds {
            batch,
            seq_q,
            seq_kv,
            ids_q,
            ids_kv,
            pos_q,
            pos_kv,
        })
    }
}

/// A case's layout as JAX users hand it over: segment ids and positions with the
/// `max_segments` TE converts them under. Stored with the case ([`META_KEY`]), so a capsule
/// replays the conversion its campaign ran.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segmented {
    pub max_segments: usize,
    #[serde(flatten)]
    pub ids: SegmentIds,
}

impl Segmented {
    /// The segment ids of `layout` (`batch` rows of `seq_q` / `seq_kv` tokens), derived with
    /// [`SegmentIds::from_layout`] and not with the conversion under test, so a bug in
    /// [`SegmentIds::to_layout`] cannot hide in both the case and its launch.
    ///
    /// # Errors
    /// As [`SegmentIds::from_layout`].
    pub fn of_layout(
        layout: &Layout,
        batch: usize,
        seq_q: usize,
        seq_kv: usize,
        max_segments: usize,
    ) -> Result<Self> {
        Ok(Segmented {
            max_segments,
            ids: SegmentIds::from_layout(layout, batch, seq_q, seq_kv)?,
        })
    }

    /// The metadata value.
    pub fn to_meta(&self) -> String {
        serde_json::to_string(self).expect("plain integers serialise")
    }

    /// Reads a metadata value.
    ///
    /// # Errors
    /// [`Error::Tensor`] naming [`META_KEY`] when it is not this JSON or its buffers do not
    /// hold `batch x seq` entries.
    pub fn from_meta(text: &str) -> Result<Self> {
        let bad = |detail: String| Error::Tensor {
            tensor: META_KEY.into(),
            detail,
        };
        let s: Segmented = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if s.max_segments == 0 || s.max_segments > 64 {
            return Err(bad(format!(
                "max_segments {} outside 1..=64",
                s.max_segments
            )));
        }
        // Rows of no token would let `batch` (and the slot count it sets) grow without a
        // buffer to bound it.
        if s.ids.seq_q == 0 || s.ids.seq_kv == 0 {
            return Err(bad(format!(
                "seq_q {} and seq_kv {} must be at least 1",
                s.ids.seq_q, s.ids.seq_kv
            )));
        }
        s.ids.check()?;
        Ok(s)
    }

    /// Whether these ids describe exactly `layout` in TE's compact form: `batch x
    /// max_segments` slots, the used ones first (each a run of one row on both sides, at most
    /// `max_segments` per row, ranked as the ids number them), the rest empty at the end of
    /// the buffers. A case whose layout was changed after drawing (a shrink step, a
    /// metamorphic relation, a worker's capabilities) keeps stale ids; they must not reach the
    /// launch. The test reads the layout, never [`SegmentIds::to_layout`], so it stays true
    /// under a conversion bug.
    pub fn describes(&self, layout: &Layout) -> bool {
        let s = &self.ids;
        let (q, kv) = (&layout.q, &layout.kv);
        if Some(layout.slots()) != s.batch.checked_mul(self.max_segments)
            || Some(q.tokens) != s.batch.checked_mul(s.seq_q)
            || Some(kv.tokens) != s.batch.checked_mul(s.seq_kv)
            || q.padded.is_none()
            || kv.padded.is_none()
        {
            return false;
        }
        let used = (0..layout.slots()).take_while(|&i| q.len(i) > 0).count();
        let rows_agree = (0..used).all(|i| {
            kv.len(i) > 0 && q.offset(i) / s.seq_q.max(1) == kv.offset(i) / s.seq_kv.max(1)
        });
        let tail_empty = (used..=layout.slots()).all(|i| {
            q.offsets()[i] as usize == q.tokens
                && kv.offsets()[i] as usize == kv.tokens
                && (i == layout.slots() || (q.len(i) == 0 && kv.len(i) == 0))
        });
        let per_row_ok = s
            .ids_q
            .chunks(s.seq_q.max(1))
            .all(|row| row.iter().all(|&id| id as usize <= self.max_segments));
        rows_agree
            && tail_empty
            && per_row_ok
            && SegmentIds::from_layout(layout, s.batch, s.seq_q, s.seq_kv).is_ok_and(|b| b == *s)
    }

    /// The layout a launch takes: these ids converted as TE converts them.
    ///
    /// # Errors
    /// As [`SegmentIds::to_layout`].
    pub fn launch_layout(&self, defects: &Defects) -> Result<Layout> {
        self.ids.to_layout_with(self.max_segments, defects)
    }
}

/// One side's conversion; `last_id` is the largest id whose tokens are counted (`max_seg`
/// unless a bug is planted).
fn side(ids: &[i32], batch: usize, seq: usize, max_seg: usize, last_id: usize) -> Side {
    let mut lens: Vec<i32> = Vec::with_capacity(batch * max_seg);
    let mut offs: Vec<i32> = Vec::with_capacity(batch * (max_seg + 1));
    for r in 0..batch {
        let row = &ids[r * seq..(r + 1) * seq];
        let mut counts = vec![0i32; max_seg + 1];
        for &id in row {
            if (id as usize) <= last_id {
                counts[id as usize] += 1;
            }
        }
        lens.extend(&counts[1..]);
        let starts = (0..seq).filter(|&s| row[s] != 0 && (s == 0 || row[s - 1] != row[s]));
        let mut row_offs: Vec<i32> = starts.map(|s| (r * seq + s) as i32).collect();
        row_offs.resize(max_seg + 1, -1);
        offs.extend(row_offs);
    }
    let total = (batch * seq) as i32;
    let b = batch * max_seg;
    let mut compact_lens: Vec<i32> = lens.iter().copied().filter(|&l| l > 0).collect();
    compact_lens.resize(b, 0);
    let mut compact_offs: Vec<i32> = offs.iter().copied().filter(|&o| o >= 0).collect();
    compact_offs.resize(b + 1, total);
    compact_offs.truncate(b + 1);
    let mut cu = vec![0i32];
    for l in compact_lens {
        cu.push(cu.last().unwrap() + l);
    }
    Side {
        cu,
        padded: Some(compact_offs),
        tokens: batch * seq,
    }
}

fn ids_of(side: &Side, batch: usize, seq: usize, field: &str) -> Result<(Vec<i32>, Vec<i32>)> {
    if side.tokens != batch * seq {
        return Err(Error::Tensor {
            tensor: field.into(),
            detail: format!(
                "buffer of {} tokens is not batch {batch} x seq {seq}",
                side.tokens
            ),
        });
    }
    let mut ids = vec![0i32; batch * seq];
    let mut pos = vec![0i32; batch * seq];
    let mut rank = vec![0i32; batch];
    for i in 0..side.slots() {
        let (o, l) = (side.offset(i), side.len(i));
        if l == 0 {
            continue;
        }
        let row = o / seq;
        if (o + l - 1) / seq != row {
            return Err(Error::Tensor {
                tensor: field.into(),
                detail: format!(
                    "slot {i} (tokens {o}..{}) crosses a row of {seq} tokens",
                    o + l
                ),
            });
        }
        rank[row] += 1;
        for r in 0..l {
            ids[o + r] = rank[row];
            pos[o + r] = r as i32;
        }
    }
    Ok((ids, pos))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(batch: usize, seq: usize, q: &[i32], kv: &[i32]) -> SegmentIds {
        SegmentIds {
            batch,
            seq_q: seq,
            seq_kv: seq,
            ids_q: q.to_vec(),
            ids_kv: kv.to_vec(),
            pos_q: vec![0; q.len()],
            pos_kv: vec![0; kv.len()],
        }
    }

    #[test]
    fn converts_like_te() {
        // Row 0: two segments with padding inside; row 1: empty.
        let s = ids(
            2,
            5,
            &[1, 1, 0, 2, 0, 0, 0, 0, 0, 0],
            &[1, 2, 2, 2, 0, 0, 0, 0, 0, 0],
        );
        let l = s.to_layout(3).unwrap();
        assert_eq!(l.slots(), 6);
        assert_eq!(l.q.cu, vec![0, 2, 3, 3, 3, 3, 3]);
        assert_eq!(l.q.padded.as_deref().unwrap(), &[0, 3, 10, 10, 10, 10, 10]);
        assert_eq!(l.kv.cu, vec![0, 1, 4, 4, 4, 4, 4]);
        assert_eq!(l.kv.padded.as_deref().unwrap(), &[0, 1, 10, 10, 10, 10, 10]);
    }

    #[test]
    fn unpaired_segments_become_padding() {
        let s = ids(1, 4, &[1, 2, 2, 0], &[1, 1, 0, 0]);
        let l = s.to_layout(2).unwrap();
        assert_eq!(l.q.cu, vec![0, 1, 1]);
        assert_eq!(l.kv.cu, vec![0, 2, 2]);
    }

    #[test]
    fn ids_past_max_are_dropped() {
        let s = ids(1, 5, &[1, 1, 2, 3, 3], &[1, 1, 2, 3, 3]);
        let l = s.to_layout(2).unwrap();
        assert_eq!(l.q.cu, vec![0, 2, 3]);
        assert_eq!(l.q.padded.as_deref().unwrap(), &[0, 2, 3]);
        let back = SegmentIds::from_layout(&l, 1, 5, 5).unwrap();
        assert_eq!(back.ids_q, vec![1, 1, 2, 0, 0]);
        // The dropped segment's start stays an offset in TE's conversion (its tokens become
        // pad-between); converting the cleaned ids again keeps every slot's start and length.
        let again = back.to_layout(2).unwrap();
        assert_eq!(again.q.cu, l.q.cu);
        assert_eq!(
            again.q.padded.as_ref().unwrap()[..2],
            l.q.padded.as_ref().unwrap()[..2]
        );
    }

    #[test]
    fn round_trip_with_empty_rows_and_trailing_slots() {
        let q = [1, 1, 2, 0, 0, 0, 0, 0, 1, 0, 1, 1, 2, 0, 0];
        let s = ids(3, 5, &q, &q);
        let l = s.to_layout(4).unwrap();
        assert_eq!(l.slots(), 12);
        assert_eq!(*l.q.padded.as_ref().unwrap().last().unwrap(), 15);
        let back = SegmentIds::from_layout(&l, 3, 5, 5).unwrap();
        assert_eq!(back.ids_q, q.to_vec());
        assert_eq!(
            back.pos_q,
            vec![0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
        );
        assert_eq!(back.to_layout(4).unwrap(), l);
    }

    #[test]
    fn stored_ids_describe_their_layout_and_survive_the_metadata() {
        // Row 0: segments 1 and 2 with a gap between, row 1: empty; 2 rows x 2 = 4 slots.
        let q = [1, 1, 0, 2, 0, 0, 0, 0, 0, 0];
        let l = ids(2, 5, &q, &q).to_layout(2).unwrap();
        let s = Segmented::of_layout(&l, 2, 5, 5, 2).unwrap();
        assert_eq!(s.ids.ids_q, q.to_vec());
        assert!(s.describes(&l));
        let back = Segmented::from_meta(&s.to_meta()).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.launch_layout(&Defects::none()).unwrap(), l);
        // The slip drops the row's last admitted segment: one slot fewer.
        let slipped = s
            .launch_layout(&Defects::of(&[Mutant::SegmentConversionSlip]))
            .unwrap();
        assert_eq!(slipped.q.cu, vec![0, 2, 2, 2, 2]);
        // A layout the ids do not describe: another slot count, lengths, or a tail slot
        // that is not at the end of the buffer.
        assert!(!s.describes(&ids(2, 5, &q, &q).to_layout(3).unwrap()));
        let mut moved = l.clone();
        moved.q.cu = vec![0, 2, 2, 2, 2];
        assert!(!s.describes(&moved));
        let mut tail = l.clone();
        tail.q.padded.as_mut().unwrap()[3] = 9;
        assert!(!s.describes(&tail));
        for bad in [
            "",
            "{}",
            r#"{"max_segments":1,"batch":99999999999,"seq_q":0,"seq_kv":0,"ids_q":[],"ids_kv":[],"pos_q":[],"pos_kv":[]}"#,
            r#"{"max_segments":0,"batch":1,"seq_q":1,"seq_kv":1,"ids_q":[1],"ids_kv":[1],"pos_q":[0],"pos_kv":[0]}"#,
        ] {
            let e = Segmented::from_meta(bad).unwrap_err().to_string();
            assert!(e.contains(META_KEY), "{e}");
        }
    }

    #[test]
    fn malformed_inputs_are_errors() {
        let mut s = ids(1, 3, &[1, 1, 0], &[1, 0, 0]);
        s.ids_kv.pop();
        assert!(s
            .to_layout(1)
            .unwrap_err()
            .to_string()
            .contains("segment_ids_kv"));
        let s = ids(1, 3, &[1, -1, 0], &[1, 0, 0]);
        assert!(s.to_layout(1).unwrap_err().to_string().contains("negative"));
    }
}
