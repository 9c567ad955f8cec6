//! What `smallseq triage` writes: `triage.json` (for scripts) and `triage.md` (for people),
//! one section per group, largest first.

use super::triage::{Group, Signature, TriageError};
use super::triage_verdict::{Finding, Verdict};
use crate::files::write_atomic;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// One triaged group.
#[derive(Clone, Debug, Serialize)]
pub struct Triaged {
    pub count: usize,
    pub signature: Signature,
    /// The capsule the verdict was given on (a shrunk one where there is one), copied into
    /// triage's own folder so that it travels with triage.md without the campaigns.
    pub representative: Option<String>,
    /// Where the representative came from: the campaign's capsule it is a copy of.
    pub source: Option<String>,
    /// Whether triage shrank it (the campaign had left no shrunk capsule).
    pub shrunk_here: bool,
    pub repro: Option<String>,
    /// The standalone script, or why there is none.
    pub script: Option<String>,
    pub script_note: Option<String>,
    pub finding: Finding,
    /// `DIR: case N` of every member.
    pub cases: Vec<String>,
    /// The members' whole classes (dtype, path, heads, passes, mask), with their counts.
    pub classes: Vec<(String, usize)>,
}

impl Triaged {
    /// A group triage did not reach: its members and signature, no verdict.
    pub fn not_triaged(g: &Group) -> Triaged {
        Triaged {
            count: g.items.len(),
            signature: g.signature.clone(),
            representative: None,
            source: None,
            shrunk_here: false,
            repro: None,
            script: None,
            script_note: None,
            finding: Finding {
                verdict: Verdict::NotTriaged,
                clause: None,
                evidence: vec![
                    "triage stopped (its --time, or a signal) before this group was reached".into(),
                ],
            },
            cases: g
                .items
                .iter()
                .map(|i| format!("{}: case {}", i.dir.display(), i.entry.case))
                .collect(),
            classes: g.classes(),
        }
    }
}

/// The first `shown` of `all`, `; `-separated, and how many more there are.
fn listing(all: &[String], shown: usize) -> String {
    let head = all[..all.len().min(shown)].join("; ");
    match all.len().saturating_sub(shown) {
        0 => head,
        more => format!("{head}; and {more} more"),
    }
}

/// The whole triage.
#[derive(Clone, Debug, Serialize)]
pub struct Triage {
    pub dirs: Vec<String>,
    pub groups: Vec<Triaged>,
}

impl Triage {
    /// How many groups have `v`.
    pub fn count(&self, v: Verdict) -> usize {
        self.groups
            .iter()
            .filter(|g| g.finding.verdict == v)
            .count()
    }

    /// One line: groups and failures per verdict.
    pub fn summary(&self) -> String {
        let failures: usize = self.groups.iter().map(|g| g.count).sum();
        let late = match self.count(Verdict::NotTriaged) {
            0 => String::new(),
            n => format!(", {n} not triaged (time)"),
        };
        format!(
            "{} group(s) of {failures} failure(s): {} defect(s), {} design or range limit(s), {} \
             harness error(s){late}",
            self.groups.len(),
            self.count(Verdict::Defect),
            self.count(Verdict::DesignOrRangeLimit),
            self.count(Verdict::HarnessError)
        )
    }

    /// `triage.md`.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "# Triage of {}\n\n{}.\n",
            self.dirs.join(", "),
            self.summary()
        );
        if self.groups.is_empty() {
            s += "\nNo failures and no range limits: nothing to triage.\n";
        }
        for (i, g) in self.groups.iter().enumerate() {
            let sig = &g.signature;
            s += &format!(
                "\n## {}. {}: {} ({} case(s))\n\n",
                i + 1,
                sig.property,
                g.finding.verdict.label(),
                g.count
            );
            s += &format!(
                "- signature: implementation `{}`, property `{}`, tensor `{}`, dtype and passes \
                 `{}`{}, \
                 pattern `{}`\n",
                sig.implementation,
                sig.property,
                sig.tensor,
                sig.class,
                if sig.range_limit {
                    ", listed as a range limit"
                } else {
                    ""
                },
                sig.pattern
            );
            let none = "none".to_string();
            s += &format!(
                "- representative: {}{}\n",
                g.representative.as_ref().unwrap_or(&none),
                match (g.shrunk_here, &g.source) {
                    (true, _) => " (shrunk by triage)".to_string(),
                    (false, Some(src)) => format!(" (a copy of {src})"),
                    (false, None) => String::new(),
                }
            );
            if let Some(r) = &g.repro {
                s += &format!("- repro: `{r}`\n");
            }
            match (&g.script, &g.script_note) {
                (Some(p), _) => s += &format!("- standalone script: {p}\n"),
                (None, Some(why)) => s += &format!("- standalone script: none ({why})\n"),
                (None, None) => {}
            }
            s += &format!("- verdict: **{}**\n", g.finding.verdict.label());
            if let Some(c) = &g.finding.clause {
                s += &format!("- breaks: {c}\n");
            }
            s += "- evidence:\n";
            for e in &g.finding.evidence {
                s += &format!("  - {e}\n");
            }
            let spans: Vec<String> = (g.classes.iter())
                .map(|(c, n)| format!("{n} x {c}"))
                .collect();
            s += &format!("- classes: {}\n", listing(&spans, 8));
            s += &format!("- cases: {}\n", listing(&g.cases, 12));
        }
        s
    }

    /// Writes `triage.json` and `triage.md` into `out`, each whole or not at all (a temporary
    /// file renamed: triage rewrites them after every group, and a kill mid-write must leave
    /// the previous version); returns their paths.
    ///
    /// # Errors
    /// [`TriageError::Write`] naming the file.
    pub fn write(&self, out: &Path) -> Result<(PathBuf, PathBuf), TriageError> {
        let put = |name: &str, text: String| {
            let path = out.join(name);
            write_atomic(&path, text.as_bytes()).map_err(|e| TriageError::Write {
                path: path.clone(),
                source: match e {
                    crate::error::Error::Io { source, .. } => source,
                    other => std::io::Error::other(other.to_string()),
                },
            })?;
            Ok(path)
        };
        let json = serde_json::to_string_pretty(self).expect("plain data serialises");
        Ok((
            put("triage.json", json + "\n")?,
            put("triage.md", self.markdown())?,
        ))
    }
}
