//! The workspace planner. One [`Plan`] gives both the size of the workspace and the offsets
//! every kernel carves from it, so sizing and carving cannot disagree (TE's planner evaluates
//! its conditions twice and can; te-smallseq-path.md §3.2).

use crate::dispatch::Path;
use serde::Serialize;

/// Workspace regions are aligned to this many f32 elements (256 bytes).
pub const ALIGN: usize = 64;

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    Fwd,
    Bwd,
}

/// What the planner needs to know about a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Rows of the q buffer (`Tq`).
    pub tq: usize,
    /// Rows of the k/v buffers (`Tk`).
    pub tk: usize,
    /// Query tokens the kernels can address (`off_q[b]`); at most `tq`.
    pub tq_addressed: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim_qk: usize,
    pub head_dim_v: usize,
    /// THD (the runtime probe needs a prefix) or BSHD (no probe).
    pub thd: bool,
}

/// One named region, in f32 elements.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Region {
    pub name: &'static str,
    pub offset: usize,
    pub len: usize,
}

/// A workspace plan: regions in order, total size in f32 elements.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub regions: Vec<Region>,
    pub total: usize,
}

/// Region names.
pub mod names {
    /// `[max_len_q, max_len_kv]` written by the runtime probe.
    pub const PROBE: &str = "probe";
    /// `D = Σ P·dP` per (token, head), token-major `[Tq, H]`.
    pub const DELTA: &str = "delta";
    /// Fallback backward: `Z = Σ exp(s - lse)` per (token, head), token-major `[Tq, H]`, by
    /// which the recomputed P is renormalised (an LSE from another kernel's forward is off by
    /// rounding; one-key rows must still get P = 1 exactly).
    pub const ROWSUM: &str = "rowsum";
    /// Per-query-head dK accumulators for GQA, `[Tk, H, Dqk]`.
    pub const DK_ACC: &str = "dk_acc";
    /// Per-query-head dV accumulators for GQA, `[Tk, H, Dv]`.
    pub const DV_ACC: &str = "dv_acc";
}

impl Plan {
    fn push(&mut self, name: &'static str, len: usize) {
        let offset = self.total.div_ceil(ALIGN) * ALIGN;
        self.regions.push(Region { name, offset, len });
        self.total = offset + len;
    }

    /// The region called `name`, if planned.
    pub fn region(&self, name: &str) -> Option<&Region> {
        self.regions.iter().find(|r| r.name == name)
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.total * 4
    }
}

/// Plans the workspace of one launch. `path = None` means no kernel runs (empty batch).
pub fn plan(dir: Direction, path: Option<Path>, s: &Shape) -> Plan {
    let mut p = Plan::default();
    let Some(path) = path else {
        return p;
    };
    if path == Path::SmallSeq && s.thd {
        p.push(names::PROBE, 2);
    }
    if dir == Direction::Bwd {
        p.push(names::DELTA, s.tq_addressed * s.heads);
        if path == Path::Fallback {
            p.push(names::ROWSUM, s.tq_addressed * s.heads);
        }
        if path == Path::Fallback && s.heads != s.kv_heads {
            p.push(names::DK_ACC, s.tk * s.heads * s.head_dim_qk);
            p.push(names::DV_ACC, s.tk * s.heads * s.head_dim_v);
        }
    }
    p
}

/// The conservative size a framework computes at trace time, knowing only static shapes
/// (`Tq` bounded by batch × max_seqlen, i.e. the buffer size) and not which path will run:
/// every region of every path, sized from the full buffers.
pub fn trace_time_bound(dir: Direction, s: &Shape) -> usize {
    let full = Shape {
        tq_addressed: s.tq,
        thd: true,
        ..*s
    };
    [Path::SmallSeq, Path::Fallback]
        .into_iter()
        .map(|path| {
            let mut p = plan(dir, Some(path), &full);
            if path == Path::Fallback {
                // The probe prefix may be reserved whatever path runs later.
                p.push(names::PROBE, 2);
            }
            p.total
        })
        .max()
        .unwrap_or(0)
        .div_ceil(ALIGN)
        * ALIGN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_do_not_overlap_and_fit() {
        let s = Shape {
            tq: 100,
            tk: 70,
            tq_addressed: 90,
            heads: 8,
            kv_heads: 2,
            head_dim_qk: 64,
            head_dim_v: 32,
            thd: true,
        };
        for dir in [Direction::Fwd, Direction::Bwd] {
            for path in [None, Some(Path::SmallSeq), Some(Path::Fallback)] {
                let p = plan(dir, path, &s);
                let mut end = 0;
                for r in &p.regions {
                    assert!(r.offset >= end && r.offset % ALIGN == 0, "{p:?}");
                    end = r.offset + r.len;
                }
                assert_eq!(end, p.total);
                assert!(p.total <= trace_time_bound(dir, &s));
            }
        }
        let bwd = plan(Direction::Bwd, Some(Path::Fallback), &s);
        assert_eq!(bwd.region(names::DK_ACC).unwrap().len, 70 * 8 * 64);
        assert!(plan(Direction::Fwd, None, &s).regions.is_empty());
    }
}
