//! `smallseq triage`: a campaign's failures grouped by signature (property, tensor, case
//! class, error pattern), so that the many cases of one defect become one finding with one
//! representative, one repro line, one standalone script and one verdict (issue 31). This file
//! reads the campaigns and groups; `triage_verdict` judges a group, `triage_script` writes its
//! script, and the CLI opens the backends that replay and shrink.

use super::campaign::FailureEntry;
use crate::case::Case;
use crate::case_file::read_case;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// What triage cannot do with its inputs; each names the file.
#[derive(Debug, Error)]
pub enum TriageError {
    #[error("{path}: cannot read the campaign's report: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a smallseq report.json: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: cannot write: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The output tensors a detail may name.
const TENSORS: [&str; 5] = ["o", "lse", "dq", "dk", "dv"];

/// What makes failures the same finding.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Signature {
    /// What ran: the worker command of an outside implementation, else the backend. One
    /// implementation's verdict says nothing of another's.
    pub implementation: String,
    pub property: String,
    /// The first output tensor the detail names, or `-`.
    pub tensor: String,
    /// Dtype and passes of the case (`-` where the capsule is unreadable). The path, heads and
    /// mask are not part of it: one implementation's one error pattern in one dtype is one
    /// finding to read first, and an H200 triage that split them made 224 groups of 638
    /// failures. Which of those the members span is in [`Group::classes`].
    pub class: String,
    /// The detail with its numbers and indices taken out.
    pub pattern: String,
    /// Listed among the campaign's range limits, not its failures.
    pub range_limit: bool,
}

/// One failure of one campaign.
#[derive(Clone, Debug)]
pub struct Item {
    pub dir: PathBuf,
    pub entry: FailureEntry,
    /// The report's backend (`exec` for an outside implementation) and profile.
    pub backend: String,
    pub profile: String,
    /// The capsule as found on disk (the recorded path, else the same name in `DIR/capsules`).
    pub capsule: Option<PathBuf>,
    pub shrunk: Option<PathBuf>,
    pub signature: Signature,
    /// The case's whole class ([`class_of`]): dtype, path, heads, passes, mask.
    pub class: String,
}

/// The failures of one signature, most frequent first.
#[derive(Clone, Debug)]
pub struct Group {
    pub signature: Signature,
    pub items: Vec<Item>,
}

impl Group {
    /// The item whose capsule is the smallest shrunk one, else the smallest original.
    pub fn representative(&self) -> Option<(&Item, &Path, bool)> {
        let size = |p: &Path| std::fs::metadata(p).map_or(u64::MAX, |m| m.len());
        let pick = |shrunk: bool| {
            self.items
                .iter()
                .filter_map(|i| {
                    let p = if shrunk { &i.shrunk } else { &i.capsule };
                    p.as_deref().map(|p| (i, p, shrunk))
                })
                .min_by_key(|(_, p, _)| size(p))
        };
        pick(true).or_else(|| pick(false))
    }

    /// The members' whole classes with how many members each holds, the largest first.
    pub fn classes(&self) -> Vec<(String, usize)> {
        let mut n: BTreeMap<&str, usize> = BTreeMap::new();
        for i in &self.items {
            *n.entry(&i.class).or_default() += 1;
        }
        let mut v: Vec<(String, usize)> = n.into_iter().map(|(c, k)| (c.to_string(), k)).collect();
        v.sort_by_key(|(_, k)| std::cmp::Reverse(*k));
        v
    }
}

/// The detail with numbers and index lists taken out (ci/triage.py's `kind`): "lse: max
/// error # > threshold # (emulation error #)".
pub fn pattern(detail: &str) -> String {
    let mut out = String::new();
    let mut chars = detail.chars().peekable();
    while let Some(c) = chars.next() {
        let starts_number = c.is_ascii_digit()
            || (c == '-' && chars.peek().is_some_and(|n| n.is_ascii_digit()) && !ends_word(&out));
        if !starts_number || ends_word(&out) {
            out.push(c);
            continue;
        }
        // The rest of the number: digits, one fraction, one exponent.
        while let Some(&n) = chars.peek() {
            let exp_sign = (n == '-' || n == '+') && out.ends_with("#e");
            if n.is_ascii_digit() || n == '.' || n == 'e' || exp_sign {
                if n == 'e' {
                    out.push_str("#e");
                }
                chars.next();
            } else {
                break;
            }
        }
        while out.ends_with("#e") {
            out.truncate(out.len() - 2);
        }
        out.push('#');
    }
    let mut s = collapse_index_lists(&out);
    if s.chars().count() > 160 {
        s = s.chars().take(160).collect();
    }
    s
}

/// Whether `s` ends inside a word, so a digit there is part of a name (`sm_90`, `f16`).
fn ends_word(s: &str) -> bool {
    s.chars()
        .rev()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .any(|c| c.is_ascii_alphabetic() || c == '_')
}

/// `[#, #, #]` as `[#]`.
fn collapse_index_lists(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('[') {
        out.push_str(&rest[..=i]);
        rest = &rest[i + 1..];
        match rest.find(']') {
            Some(j) if !rest[..j].is_empty() && rest[..j].chars().all(|c| "#, ".contains(c)) => {
                out.push('#');
                rest = &rest[j..];
            }
            _ => {}
        }
    }
    out.push_str(rest);
    out
}

/// The first output tensor a detail names.
pub fn tensor_of(detail: &str) -> String {
    detail
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .find(|w| TENSORS.contains(w))
        .unwrap_or("-")
        .to_string()
}

/// The part of a case's class that a signature holds: dtype and passes.
pub fn signature_class(case: &Case) -> String {
    let passes = if case.d_o.is_some() { "fwd+bwd" } else { "fwd" };
    format!("{} {passes}", case.config.dtype)
}

/// A case's whole class: dtype, the forward path, the shape class (heads, passes) and the mask.
pub fn class_of(case: &Case) -> String {
    let p = &case.config.params;
    let heads = match (p.num_heads, p.num_kv_heads) {
        (h, k) if h == k => "mha",
        (_, 1) => "mqa",
        _ => "gqa",
    };
    let passes = if case.d_o.is_some() { "fwd+bwd" } else { "fwd" };
    let path = case
        .meta
        .get(super::capsule::PATH)
        .map_or("-", String::as_str);
    format!(
        "{} {path} {heads} {passes} {}",
        case.config.dtype,
        case.config.params.mask.name()
    )
}

/// What triage reads of a `report.json`: not the whole [`super::campaign::Report`], whose
/// margins a report writes as null where they are infinite and which does not read them back.
#[derive(Deserialize)]
struct Listed {
    backend: String,
    #[serde(default)]
    profile: String,
    #[serde(default)]
    worker: Option<String>,
    failures: Vec<FailureEntry>,
    #[serde(default)]
    range_limits: Vec<FailureEntry>,
}

/// Finds `recorded` on disk: as recorded (a campaign run from another directory recorded it
/// relative to that one), else by its file name in `dir/capsules`.
fn locate(dir: &Path, recorded: &str) -> Option<PathBuf> {
    let p = PathBuf::from(recorded);
    if p.is_file() {
        return Some(p);
    }
    let name = p.file_name()?;
    let here = dir.join("capsules").join(name);
    here.is_file().then_some(here)
}

/// The failures and range limits of the campaigns in `dirs`, each with its signature.
///
/// # Errors
/// [`TriageError`] naming a `report.json` that cannot be read or parsed.
pub fn load(dirs: &[PathBuf]) -> Result<Vec<Item>, TriageError> {
    let mut items = Vec::new();
    for dir in dirs {
        let path = dir.join("report.json");
        let text = std::fs::read_to_string(&path).map_err(|source| TriageError::Read {
            path: path.clone(),
            source,
        })?;
        let rep: Listed =
            serde_json::from_str(&text).map_err(|source| TriageError::Parse { path, source })?;
        let listed = (rep.failures.iter().map(|f| (f, false)))
            .chain(rep.range_limits.iter().map(|f| (f, true)));
        for (entry, range_limit) in listed {
            let capsule = locate(dir, &entry.capsule);
            let shrunk = entry.shrunk_capsule.as_deref().and_then(|s| locate(dir, s));
            let case = capsule.as_deref().and_then(|c| read_case(c).ok());
            let (class, whole) = case.as_ref().map_or_else(
                || ("-".to_string(), "-".to_string()),
                |c| (signature_class(c), class_of(c)),
            );
            let signature = Signature {
                implementation: rep.worker.clone().unwrap_or_else(|| rep.backend.clone()),
                property: entry.property.clone(),
                tensor: tensor_of(&entry.detail),
                class,
                pattern: pattern(&entry.detail),
                range_limit,
            };
            items.push(Item {
                dir: dir.clone(),
                entry: entry.clone(),
                backend: rep.backend.clone(),
                profile: rep.profile.clone(),
                capsule,
                shrunk,
                signature,
                class: whole,
            });
        }
    }
    Ok(items)
}

/// `items` grouped by signature, the largest group first (ties in signature order).
pub fn group(items: Vec<Item>) -> Vec<Group> {
    let mut by: BTreeMap<Signature, Vec<Item>> = BTreeMap::new();
    for i in items {
        by.entry(i.signature.clone()).or_default().push(i);
    }
    let mut groups: Vec<Group> = by
        .into_iter()
        .map(|(signature, items)| Group { signature, items })
        .collect();
    groups.sort_by_key(|g| std::cmp::Reverse(g.items.len()));
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_take_out_numbers_and_indices_but_not_names() {
        assert_eq!(
            pattern("lse: max error 2.370e2 > threshold 2.513e-4 (emulation error 2.956e-5)"),
            "lse: max error # > threshold # (emulation error #)"
        );
        assert_eq!(
            pattern("dq[12, 0, 3]: -0.5 vs 7 on sm_90 in f16"),
            "dq[#]: # vs # on sm_90 in f16"
        );
        assert_eq!(
            pattern("splitting changed dk: differs by 1e-3 > 4E"),
            "splitting changed dk: differs by # > #E"
        );
        assert_eq!(tensor_of("scaling v (and d_o) by 2: dq[1, 2, 3] = 4"), "dq");
        assert_eq!(tensor_of("eligibility: path fallback"), "-");
    }

    fn item(case: u64, detail: &str, class: &str) -> Item {
        let entry = FailureEntry {
            case,
            property: "numeric_agreement".into(),
            detail: detail.into(),
            capsule: format!("case-{case}.safetensors"),
            shrunk_capsule: None,
            shrunk_size: None,
            repro: String::new(),
        };
        Item {
            dir: PathBuf::from("run"),
            signature: Signature {
                implementation: "cpu".into(),
                property: entry.property.clone(),
                tensor: tensor_of(detail),
                class: class.split(' ').next().unwrap().to_string() + " fwd+bwd",
                pattern: pattern(detail),
                range_limit: false,
            },
            entry,
            backend: "cpu".into(),
            profile: "te-2.10".into(),
            capsule: None,
            shrunk: None,
            class: class.into(),
        }
    }

    #[test]
    fn masks_and_paths_share_a_group_that_lists_them_and_inf_is_a_group_apart() {
        let a = "f16 fallback mha fwd+bwd causal";
        let b = "f16 small_seq gqa fwd+bwd padding";
        let groups = group(vec![
            item(
                1,
                "dk: max error 1e-2 > threshold 3e-3 (emulation error 1e-4)",
                a,
            ),
            item(
                2,
                "dk: max error 2e-2 > threshold 4e-3 (emulation error 2e-4)",
                b,
            ),
            item(
                3,
                "dk: max error 5e-2 > threshold 4e-3 (emulation error 2e-4)",
                a,
            ),
            item(
                4,
                "dk: max error inf > threshold 7e4 (emulation error 1e1)",
                a,
            ),
            item(
                5,
                "dk: max error 1e-2 > threshold 3e-3 (emulation error 1e-4)",
                "bf16 fallback mha fwd+bwd causal",
            ),
        ]);
        let sizes: Vec<usize> = groups.iter().map(|g| g.items.len()).collect();
        assert_eq!(sizes, [3, 1, 1]);
        assert_eq!(
            groups[0].classes(),
            [(a.to_string(), 2), (b.to_string(), 1)]
        );
    }
}
