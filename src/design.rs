//! The numeric designs an implementation may declare (docs/judgement.md, "Declared designs"): where its
//! backward rounds the intermediates to 16 bits, which sets the judge's allowance for another
//! order and the range limits it recognises. In-tree backends follow the project's design; a
//! worker declares one in its handshake (`caps.design`), and one that declares none is judged
//! against the envelope of the common designs.

use std::fmt;
use std::str::FromStr;

/// Where an implementation rounds its backward's intermediates, as far as the judge needs to
/// know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Design {
    /// This project's kernels (every in-tree backend, on both paths): P and dS rounded to the
    /// input type, dP and `D = Σ_j P·dP` in f32.
    Project,
    /// The project's kernels with the fallback backward's D taken from the stored O,
    /// `D = rowsum(dO∘O)` in f32 (docs/semantics.md §1.7; the kernels' `FTB_D_FROM_O`, the CPU
    /// backend's [`crate::backend::cpu::CpuBackend::with_d_from_o`]): D carries O's rounding to
    /// the input type, which the judge allows for, and the fallback's emulation takes D so.
    ProjectDFromO,
    /// Any of the common designs: dP or D held in the input type, D formed from the stored O,
    /// P recomputed from the stored LSE, each query head's dK and dV stored in 16 bits before a
    /// GQA group is summed, f32 intermediates flushed to zero below 2^-126 (FlashAttention-2,
    /// TE, cuDNN, PyTorch's math path in 16 bits, fast-math builds).
    Envelope,
}

impl Design {
    pub const ALL: [Design; 3] = [Design::Project, Design::ProjectDFromO, Design::Envelope];

    /// The design of the implementation a backend name (as `smallseq.backend` records it)
    /// stands for, for capsules written before designs were declared: the in-tree backends
    /// are the project's kernels; a worker's implementation is unknown, so it gets the
    /// envelope.
    pub fn of_backend(name: &str) -> Design {
        match name {
            "cpu" | "cuda" | "hip" | "te625-model" => Design::Project,
            _ => Design::Envelope,
        }
    }

    /// Whether the design is smallseq's own (its emulation models it; a failure the emulation
    /// shares is a limit of the design).
    pub fn is_project(self) -> bool {
        matches!(self, Design::Project | Design::ProjectDFromO)
    }

    /// Whether the fallback backward takes D from the stored O (the fallback emulation's
    /// `delta_from_stored_o`).
    pub fn d_from_stored_o(self) -> bool {
        self == Design::ProjectDFromO
    }

    /// Its name in reports, capsules and `caps.design`.
    pub fn name(self) -> &'static str {
        match self {
            Design::Project => "project",
            Design::ProjectDFromO => "project-d-from-o",
            Design::Envelope => "envelope",
        }
    }

    /// What it allows, one line, for `--help` and the report.
    pub fn summary(self) -> &'static str {
        match self {
            Design::Project => {
                "P and dS rounded to the input type, dP and D in f32 (smallseq's kernels)"
            }
            Design::ProjectDFromO => {
                "smallseq's kernels with the fallback backward's D = rowsum(dO∘O) from the \
                 stored O, in f32"
            }
            Design::Envelope => {
                "any common design (FlashAttention-2, TE, cuDNN, XLA, PyTorch's math path and \
                 CPU flash kernel): dP, D, a query head's dK/dV or a slot's dS under a \
                 broadcast bias may be held in 16 bits, D from the stored O, P from the stored \
                 LSE, a score summed in any GEMM's order, f32 subnormals flushed to zero, a \
                 16-bit case's exp good to 2^-12"
            }
        }
    }
}

impl fmt::Display for Design {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Design {
    type Err = String;
    fn from_str(s: &str) -> Result<Design, String> {
        Design::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                format!("'{s}' is not a design (expected project, project-d-from-o or envelope)")
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_unknown_ones_are_refused() {
        for d in Design::ALL {
            assert_eq!(d.name().parse::<Design>(), Ok(d));
        }
        let e = "fa3".parse::<Design>().unwrap_err();
        assert!(
            e.contains("'fa3'") && e.contains("project-d-from-o or envelope"),
            "{e}"
        );
    }
}
