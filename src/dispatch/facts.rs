//! What dispatch looks at: the static config, the environment, the device, and at launch the
//! layout.

use crate::case::bshd_seq_lens;
use crate::config::{AttnConfig, LayoutKind};
use smallseq_reference::Layout;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// A device architecture: `cpu`, `sm_NN` or `gfxNNN`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Arch(String);

impl Arch {
    pub fn cpu() -> Arch {
        Arch("cpu".into())
    }

    pub fn name(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Arch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let digits = |t: &str| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric());
        let ok = s == "cpu"
            || s.strip_prefix("sm_").is_some_and(|t| {
                !t.is_empty() && t.chars().all(|c| c.is_ascii_digit() || c == 'a')
            })
            || s.strip_prefix("gfx").is_some_and(digits);
        if ok {
            Ok(Arch(s.to_string()))
        } else {
            Err(format!(
                "unknown arch '{s}' (expected cpu, sm_NN or gfxNNN)"
            ))
        }
    }
}

/// The environment dispatch reads: a snapshot, so the plan and the launch see the same values.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EnvView(BTreeMap<String, String>);

/// Variables any profile reads.
pub const ENV_KEYS: [&str; 2] = ["SMALLSEQ_FORCE_FALLBACK", "NVTE_FUSED_ATTN_CK_SMALLSEQ"];

impl EnvView {
    /// Snapshot of the process environment (only the variables dispatch reads).
    pub fn from_process() -> Self {
        EnvView(
            ENV_KEYS
                .iter()
                .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
                .collect(),
        )
    }

    /// Exactly these variables, nothing from the process.
    pub fn from_pairs<I: IntoIterator<Item = (String, String)>>(pairs: I) -> Self {
        EnvView(pairs.into_iter().collect())
    }

    /// Every variable, in name order.
    pub fn pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    pub fn set(&mut self, key: &str, value: Option<&str>) {
        match value {
            Some(v) => self.0.insert(key.into(), v.into()),
            None => self.0.remove(key),
        };
    }
}

/// Facts known when the plan is made.
#[derive(Clone, Debug)]
pub struct StaticFacts<'a> {
    pub config: &'a AttnConfig,
    pub env: &'a EnvView,
    pub arch: &'a Arch,
    /// Whether the backend has a small-seq kernel for `arch` (native profile).
    pub backend_has_kernel: bool,
}

/// Facts known at launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeFacts {
    pub layout: LayoutKind,
    pub slots: usize,
    /// Whether every slot has `Lq = 0`.
    pub all_q_empty: bool,
    pub max_len_q: usize,
    pub max_len_kv: usize,
    pub max_span_q: usize,
    pub max_span_kv: usize,
    /// BSHD sequence lengths (`s_q`, `s_kv`), when the layout is BSHD.
    pub bshd: Option<(usize, usize)>,
}

impl RuntimeFacts {
    pub fn new(kind: LayoutKind, layout: &Layout) -> Self {
        // A layout that is not uniform is not BSHD at all; report it as s = 0 on both sides.
        let bshd = (kind == LayoutKind::Bshd).then(|| bshd_seq_lens(layout).unwrap_or((0, 0)));
        RuntimeFacts {
            layout: kind,
            slots: layout.slots(),
            all_q_empty: (0..layout.slots()).all(|i| layout.q.len(i) == 0),
            max_len_q: layout.q.max_len(),
            max_len_kv: layout.kv.max_len(),
            max_span_q: layout.q.max_span(),
            max_span_kv: layout.kv.max_span(),
            bshd,
        }
    }
}
