//! `smallseq case new`: a case file from flags, so a case can be made without Python.

use anyhow::Result;
use smallseq::case_file::{write_case, OutputPrecision};
use smallseq::harness::gen::{build, DataDist, Geometry};
use smallseq::reference::Layout;
use smallseq::AttnConfig;
use std::path::PathBuf;

/// Case files.
#[derive(clap::Args, Debug)]
pub struct CaseArgs {
    #[command(subcommand)]
    pub command: CaseCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum CaseCommand {
    /// Write a case file (inputs only) from flags; `smallseq run` computes its outputs.
    New(NewArgs),
}

/// The flags of `case new`. Keys and defaults are those of the case-file format.
#[derive(clap::Args, Debug)]
pub struct NewArgs {
    /// Output case file (.safetensors).
    #[arg(long)]
    pub out: PathBuf,
    /// bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Query heads.
    #[arg(long, default_value_t = 16)]
    pub heads: usize,
    /// Key/value heads (default: --heads; fewer is GQA).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Head dim of q and k.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Head dim of v (default: --head-dim).
    #[arg(long)]
    pub head_dim_v: Option<usize>,
    /// Query tokens per slot, comma-separated (e.g. 3,5,0).
    #[arg(long, value_delimiter = ',', required = true)]
    pub q_lens: Vec<usize>,
    /// Key/value tokens per slot (default: --q-lens).
    #[arg(long, value_delimiter = ',')]
    pub kv_lens: Vec<usize>,
    /// no_mask, padding, causal, causal_bottom_right, ... (the case format's mask names).
    #[arg(long, default_value = "padding")]
    pub mask: String,
    /// Sliding window LEFT,RIGHT (-1: unbounded), e.g. --window 4,0.
    #[arg(long, value_parser = parse_window, allow_hyphen_values = true)]
    pub window: Option<(i64, i64)>,
    /// Softmax scale (default: 1/sqrt(head_dim), written into the file).
    #[arg(long)]
    pub scale: Option<f64>,
    /// Dropout probability p in [0, 1] (docs/semantics.md §1.8).
    #[arg(long)]
    pub dropout: Option<f64>,
    /// Dropout's Philox seed and offset, SEED,OFFSET (default 0,0).
    #[arg(long, value_delimiter = ',')]
    pub dropout_rng: Vec<u64>,
    /// thd (packed) or bshd (every slot the same lengths).
    #[arg(long, default_value = "thd")]
    pub layout: String,
    /// Input values: randn, small_ints, spiky, near_tie or large.
    #[arg(long, default_value = "randn")]
    pub data: String,
    /// Seed of the input values.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Forward only: no output gradient dO.
    #[arg(long)]
    pub no_backward: bool,
}

fn parse_window(s: &str) -> Result<(i64, i64), String> {
    s.split_once(',')
        .and_then(|(l, r)| Some((l.trim().parse().ok()?, r.trim().parse().ok()?)))
        .ok_or_else(|| format!("'{s}': expected LEFT,RIGHT, e.g. 4,0 or -1,0"))
}

pub fn run(args: &CaseArgs) -> Result<i32> {
    let CaseCommand::New(a) = &args.command;
    match new_case(a) {
        Ok(line) => {
            say!("{line}");
            Ok(0)
        }
        Err(msg) => {
            tell!("smallseq case new: {msg}");
            Ok(super::EXIT_USAGE)
        }
    }
}

fn new_case(a: &NewArgs) -> Result<String, String> {
    let kv_lens = if a.kv_lens.is_empty() {
        a.q_lens.clone()
    } else {
        a.kv_lens.clone()
    };
    if kv_lens.len() != a.q_lens.len() {
        return Err(format!(
            "--q-lens has {} slots, --kv-lens {}: one length per slot on each side",
            a.q_lens.len(),
            kv_lens.len()
        ));
    }
    let dist = DataDist::ALL
        .into_iter()
        .find(|d| d.name() == a.data)
        .ok_or_else(|| {
            let names: Vec<&str> = DataDist::ALL.iter().map(|d| d.name()).collect();
            format!("--data '{}': expected {}", a.data, names.join(", "))
        })?;
    // Through the case format's own parser: the same keys, defaults and errors as a file.
    let mut json = serde_json::json!({
        "dtype": a.dtype,
        "num_heads": a.heads,
        "num_gqa_groups": a.kv_heads.unwrap_or(a.heads),
        "head_dim_qk": a.head_dim,
        "head_dim_v": a.head_dim_v.unwrap_or(a.head_dim),
        "mask": a.mask,
        "layout": a.layout,
    });
    if let Some((left, right)) = a.window {
        json["window"] = serde_json::json!([left, right]);
    }
    if let Some(s) = a.scale {
        json["scale"] = serde_json::json!(s);
    }
    if let Some(p) = a.dropout {
        json["dropout"] = serde_json::json!(p);
    }
    match a.dropout_rng[..] {
        [] => {}
        [seed, offset] => {
            json["dropout_seed"] = serde_json::json!(seed);
            json["dropout_offset"] = serde_json::json!(offset);
        }
        ref other => {
            return Err(format!(
                "--dropout-rng: {} values, expected SEED,OFFSET",
                other.len()
            ))
        }
    }
    let config = AttnConfig::from_json(&json.to_string()).map_err(|e| e.to_string())?;
    let lens: Vec<(usize, usize)> = a.q_lens.iter().copied().zip(kv_lens).collect();
    let g = Geometry {
        config,
        layout: Layout::packed(&lens),
        backward: !a.no_backward,
        dist,
        poison: false,
        segments: None,
        data: smallseq::harness::data_class::DataClass::Plain,
        production: false,
    };
    let case = build(&g, a.seed).map_err(|e| e.to_string())?;
    write_case(&case, &a.out, OutputPrecision::Device).map_err(|e| e.to_string())?;
    let p = &case.config.params;
    let side = |v: Vec<usize>| {
        v.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    Ok(format!(
        "wrote {}: {} {}, {} ({} kv), head dims {}/{}, mask {}, window ({}, {}), scale {}{}{}, \
         {} (q {}; kv {}), {} data seed {}, {}",
        a.out.display(),
        case.config.layout.name(),
        case.config.dtype.name(),
        counted(p.num_heads, "head"),
        p.num_kv_heads,
        p.head_dim_qk,
        p.head_dim_v,
        p.mask.name(),
        p.window.left,
        p.window.right,
        p.scale,
        if a.scale.is_none() {
            " (default 1/sqrt(head_dim))"
        } else {
            ""
        },
        if p.dropout == smallseq_reference::Dropout::NONE {
            String::new()
        } else {
            format!(
                ", dropout {} (seed {}, offset {})",
                p.dropout.p, p.dropout.seed, p.dropout.offset
            )
        },
        counted(lens.len(), "slot"),
        side(lens.iter().map(|l| l.0).collect()),
        side(lens.iter().map(|l| l.1).collect()),
        dist.name(),
        a.seed,
        if g.backward {
            "with dO (forward and backward)"
        } else {
            "forward only"
        }
    ))
}

/// `n` and `noun`, plural unless `n` is 1.
fn counted(n: usize, noun: &str) -> String {
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}
