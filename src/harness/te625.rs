//! Naming the TE #625 defects a campaign against the `te625-model` backend found.
//!
//! A failure is attributed to a defect by differential replay: the failing case is rerun on
//! the model with only that defect, and if the same property fails, the defect alone suffices
//! to cause it (a case may show several defects at once; each is credited). The padded-span gate is no failure of any property — it is
//! TE's own surface — so it is found by comparing decisions: a case TE declines only for its
//! padded span although every actual length is within the small-seq limit.

use super::campaign::{case_seed, Report};
use super::gen::{build, draw_geometry_for};
use super::props::Checker;
use super::rng::Rng;
use crate::backend::cpu::{CpuBackend, TE625_DEFECTS};
use crate::backend::BackendInfo;
use crate::case_file::read_case;
use crate::dispatch::gate::MAX_SMALL_SEQ;
use crate::dispatch::{surface, Code, Profile, RuntimeFacts, StaticFacts};
use crate::error::Result;
use crate::mutants::Mutant;
use crate::wrapper::RunOptions;
use serde::Serialize;
use std::path::Path;

/// One defect of the model and what the campaign showed about it.
#[derive(Clone, Debug, Serialize)]
pub struct DefectFinding {
    pub defect: String,
    pub description: &'static str,
    /// Failures (or, for the gate, cases) attributed to it.
    pub count: u64,
    /// The property that exposed it.
    pub property: Option<String>,
    /// A capsule that shows it, relative to the campaign's output directory where written.
    pub example: Option<String>,
}

impl DefectFinding {
    pub fn found(&self) -> bool {
        self.count > 0
    }
}

fn describe(m: Mutant) -> &'static str {
    match m {
        Mutant::LsePermuted => "LSE aux written token-major, read head-major (§4.2)",
        Mutant::CausalIgnored => "causal padding masks admitted, kernel runs non-causal (§6.15)",
        Mutant::WindowIgnored => "sliding window admitted and ignored (§6.16)",
        Mutant::NanOnEmptyKv => "NaN output for a query slot with no keys",
        Mutant::WorkspaceEnvMismatch => {
            "workspace sized with the trace-time env, carved with the launch-time env (§3.2)"
        }
        _ => "not a TE #625 defect",
    }
}

/// How far [`attribute`] is: it runs for minutes after a campaign's report, so the caller
/// shows this rather than a silence that reads as a hang.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// `replaying failures` (one step per failure), then `scanning cases for the padded-span
    /// gate` (one step per case of the campaign).
    pub phase: &'static str,
    pub done: u64,
    pub total: u64,
}

/// The phases of [`Step`].
pub const PHASE_REPLAY: &str = "replaying failures";
pub const PHASE_GATE: &str = "scanning cases for the padded-span gate";

/// Attributes the report's failures (at most `max_failures`, shrunk capsules preferred) to
/// the model's defects, and scans the campaign's cases for the padded-span gate, telling
/// `progress` after each failure and each case.
///
/// # Errors
/// Capsules that cannot be read back, or harness errors on a replay.
pub fn attribute(
    report: &Report,
    out: &Path,
    opts: &RunOptions,
    max_failures: usize,
    progress: &mut dyn FnMut(Step),
) -> Result<Vec<DefectFinding>> {
    let mut findings: Vec<DefectFinding> = TE625_DEFECTS
        .iter()
        .map(|&m| DefectFinding {
            defect: m.name().into(),
            description: describe(m),
            count: 0,
            property: None,
            example: None,
        })
        .collect();
    let replayed = report.failures.len().min(max_failures) as u64;
    for (k, f) in report.failures.iter().take(max_failures).enumerate() {
        progress(Step {
            phase: PHASE_REPLAY,
            done: k as u64,
            total: replayed,
        });
        // Shrinking keeps the property failing, not the defect that made it fail: a shrunk
        // case may show another defect than the original, so both are replayed.
        let capsules: Vec<&str> = f
            .shrunk_capsule
            .as_deref()
            .into_iter()
            .chain(std::iter::once(f.capsule.as_str()))
            .collect();
        let mut credited = vec![false; TE625_DEFECTS.len()];
        for capsule in capsules {
            let case = read_case(&out.join(capsule)).or_else(|_| read_case(Path::new(capsule)))?;
            for (i, &m) in TE625_DEFECTS.iter().enumerate() {
                if credited[i] {
                    continue;
                }
                let backend = CpuBackend::te625_model_with(&[m]);
                let checker = Checker::new(
                    Box::new(crate::runner::InProcess::new(&backend)),
                    opts.clone(),
                );
                // The salt the capsule's case failed with (the shrunk one: 0).
                let salt = super::capsule::Replay::from_meta(&case.meta)
                    .and_then(|r| r.ok())
                    .map_or(f.case, |r| r.salt);
                let run = checker.check(&case, salt)?;
                if run.failures().iter().any(|x| x.prop.name() == f.property) {
                    credited[i] = true;
                    let d = &mut findings[i];
                    d.count += 1;
                    d.property.get_or_insert_with(|| f.property.clone());
                    d.example.get_or_insert_with(|| capsule.to_string());
                }
            }
        }
    }
    progress(Step {
        phase: PHASE_REPLAY,
        done: replayed,
        total: replayed,
    });
    findings.push(padded_span_gate(report, opts, progress)?);
    Ok(findings)
}

/// Offsets as a table cell reads them: `0,10,28`.
fn offsets_text(offsets: &[i32]) -> String {
    let parts: Vec<String> = offsets.iter().map(i32::to_string).collect();
    parts.join(",")
}

/// Padded offsets, or `none` for a side without them (its slots start at `cu_seqlens`).
fn padded_text(padded: Option<&[i32]>) -> String {
    padded.map_or_else(|| "none".into(), offsets_text)
}

/// Replays the campaign's geometries and counts the cases TE declines for the padded span
/// alone while every actual length is within the limit.
fn padded_span_gate(
    report: &Report,
    opts: &RunOptions,
    progress: &mut dyn FnMut(Step),
) -> Result<DefectFinding> {
    let model = CpuBackend::te625_model();
    let arch = model.arch();
    let mut count = 0;
    let mut example = None;
    for i in 0..report.cases {
        progress(Step {
            phase: PHASE_GATE,
            done: i,
            total: report.cases,
        });
        let cs = case_seed(report.seed, i);
        let g = draw_geometry_for(&mut Rng::new(cs), Profile::Te625);
        let facts = StaticFacts {
            config: &g.config,
            env: &opts.env,
            arch: &arch,
            backend_has_kernel: model.has_small_seq(),
        };
        let rt = RuntimeFacts::new(g.config.layout, &g.layout);
        let reasons = surface::evaluate(Profile::Te625, &facts, Some(&rt));
        let only_span = !reasons.is_empty()
            && reasons
                .iter()
                .all(|r| matches!(r.code, Code::SeqlenQ | Code::SeqlenKv));
        let lengths_fit = (1..=MAX_SMALL_SEQ).contains(&g.layout.q.max_len())
            && (1..=MAX_SMALL_SEQ).contains(&g.layout.kv.max_len());
        if only_span && lengths_fit {
            count += 1;
            if example.is_none() {
                let case = build(&g, cs ^ 0xda7a)?;
                example = Some(format!(
                    "case {i}: cu_seqlens_q {} padded {}, cu_seqlens_kv {} padded {}",
                    offsets_text(&case.layout.q.cu),
                    padded_text(case.layout.q.padded.as_deref()),
                    offsets_text(&case.layout.kv.cu),
                    padded_text(case.layout.kv.padded.as_deref())
                ));
            }
        }
    }
    progress(Step {
        phase: PHASE_GATE,
        done: report.cases,
        total: report.cases,
    });
    Ok(DefectFinding {
        defect: "padded-span-gate".into(),
        description: "eligibility read from padded spans: slots of <= 17 tokens with padding \
                      between them lose the small-seq path (§3.1)",
        count,
        property: (count > 0).then(|| "eligibility vs actual lengths".into()),
        example,
    })
}

/// The findings as a Markdown table.
pub fn markdown(findings: &[DefectFinding]) -> String {
    let mut m = String::from(
        "\n#### TE #625 defects\n\n| defect | found | count | property | example |\n|---|---|---:|---|---|\n",
    );
    for f in findings {
        m.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            f.defect,
            if f.found() { "yes" } else { "no" },
            f.count,
            f.property.as_deref().unwrap_or("-"),
            f.example
                .as_deref()
                .map_or("-".into(), |e| format!("`{e}`")),
        ));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_print_as_a_list_and_missing_padding_as_none() {
        assert_eq!(padded_text(Some(&[0, 10, 28, 40, 53])), "0,10,28,40,53");
        assert_eq!(padded_text(None), "none");
    }
}
