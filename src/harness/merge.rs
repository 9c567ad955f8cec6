//! Joining the shards of a campaign (`smallseq fuzz --shard I/N` on N machines) into the
//! report the whole campaign would have written: counts summed, margins pooled, failures in
//! case order with their capsules copied beside the merged report.

use super::campaign::{percentiles, Report};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Reads a shard's directory: `report.json` and `margins.json`.
///
/// # Errors
/// [`Error::Io`] naming the file, or [`Error::Config`] when it is not a report.
pub fn read_shard(dir: &Path) -> Result<Report> {
    let rp = dir.join("report.json");
    let text = std::fs::read_to_string(&rp).map_err(io(&rp))?;
    let mut rep: Report = serde_json::from_str(&text)
        .map_err(|e| Error::config(format!("{}: not a smallseq report: {e}", rp.display())))?;
    let mp = dir.join("margins.json");
    let text = std::fs::read_to_string(&mp).map_err(io(&mp))?;
    rep.margin_samples = serde_json::from_str(&text)
        .map_err(|e| Error::config(format!("{}: not a margins file: {e}", mp.display())))?;
    Ok(rep)
}

/// Merges shard reports read from `dirs` into one, copying every capsule into
/// `out/capsules` and pointing the failures (and their repro lines) at the copies.
///
/// # Errors
/// Unreadable shards, shards of different campaigns (seed, backend, profile), a shard set
/// that is not `0/N … N-1/N` once each, or I/O errors while copying capsules.
pub fn merge(dirs: &[PathBuf], out: &Path) -> Result<Report> {
    let shards = dirs
        .iter()
        .map(|d| read_shard(d).map(|r| (d.clone(), r)))
        .collect::<Result<Vec<_>>>()?;
    let Some((_, first)) = shards.first() else {
        return Err(Error::config("merge needs at least one shard directory"));
    };
    check_complete(&shards)?;
    let mut m = first.clone();
    m.cases = 0;
    m.elapsed_s = 0.0;
    m.properties
        .values_mut()
        .for_each(|c| *c = Default::default());
    m.skip_reasons.clear();
    m.coverage.values_mut().for_each(|n| *n = 0);
    m.paths.clear();
    m.blind_verdicts.clear();
    m.indeterminate_verdicts.clear();
    m.largest_margins.clear();
    m.dimensions = Default::default();
    m.failures.clear();
    m.range_limits.clear();
    m.margin_samples.clear();
    m.interrupted = false;
    m.shard = None;
    m.stages.clear();
    let capsules = out.join("capsules");
    std::fs::create_dir_all(&capsules).map_err(io(&capsules))?;
    for (dir, r) in &shards {
        if (r.seed, &r.backend, &r.profile) != (first.seed, &first.backend, &first.profile) {
            return Err(Error::config(format!(
                "{}: seed {}, backend {}, profile {} is another campaign than {}'s (seed {}, \
                 backend {}, profile {})",
                dir.display(),
                r.seed,
                r.backend,
                r.profile,
                shards[0].0.display(),
                first.seed,
                first.backend,
                first.profile
            )));
        }
        m.cases += r.cases;
        m.elapsed_s = m.elapsed_s.max(r.elapsed_s);
        m.interrupted |= r.interrupted;
        for (k, c) in &r.properties {
            let t = m.properties.entry(k.clone()).or_default();
            t.pass += c.pass;
            t.fail += c.fail;
            t.skip += c.skip;
            t.range_limit += c.range_limit;
        }
        add(&mut m.skip_reasons, &r.skip_reasons);
        add(&mut m.coverage, &r.coverage);
        add(&mut m.paths, &r.paths);
        add(&mut m.blind_verdicts, &r.blind_verdicts);
        add(&mut m.indeterminate_verdicts, &r.indeterminate_verdicts);
        for (t, at) in &r.largest_margins {
            super::campaign::keep_largest_margin(&mut m.largest_margins, t, *at);
        }
        m.dimensions.merge(&r.dimensions);
        super::profile::add(&mut m.stages, &r.stages);
        for (k, v) in &r.margin_samples {
            m.margin_samples
                .entry(k.clone())
                .or_default()
                .extend(v.iter().copied());
        }
        for f in &r.failures {
            m.failures.push(with_copied_capsules(f, dir, &capsules)?);
        }
        for f in &r.range_limits {
            m.range_limits
                .push(with_copied_capsules(f, dir, &capsules)?);
        }
    }
    m.failures.sort_by_key(|f| f.case);
    m.range_limits.sort_by_key(|f| f.case);
    m.cases_per_s = m.cases as f64 / m.elapsed_s.max(1e-9);
    super::profile::reshare(&mut m.stages, m.cases_per_s);
    m.margins = m
        .margin_samples
        .iter()
        .map(|(k, v)| (k.clone(), percentiles(v.clone())))
        .collect();
    m.margin_histograms = m
        .margin_samples
        .iter()
        .map(|(k, v)| (k.clone(), super::histogram::Histogram::of(v)))
        .collect();
    Ok(m)
}

fn add(into: &mut BTreeMap<String, u64>, from: &BTreeMap<String, u64>) {
    for (k, n) in from {
        *into.entry(k.clone()).or_default() += n;
    }
}

/// Every shard of one split, once: `0/N … N-1/N` (or a single unsharded report).
fn check_complete(shards: &[(PathBuf, Report)]) -> Result<()> {
    let parsed: Vec<(u64, u64)> = shards
        .iter()
        .map(|(d, r)| match &r.shard {
            None => Ok((0, 1)),
            Some(s) => s
                .parse::<super::campaign::Shard>()
                .map(|s| (s.index, s.count))
                .map_err(|e| Error::config(format!("{}: {e}", d.display()))),
        })
        .collect::<Result<_>>()?;
    let n = parsed[0].1;
    let mut seen = vec![false; n as usize];
    for ((d, _), (i, count)) in shards.iter().zip(&parsed) {
        if *count != n {
            return Err(Error::config(format!(
                "{} is shard {i}/{count}, the others of {n}",
                d.display()
            )));
        }
        if std::mem::replace(&mut seen[*i as usize], true) {
            return Err(Error::config(format!("shard {i}/{n} is given twice")));
        }
    }
    let missing: Vec<String> = (0..n)
        .filter(|&i| !seen[i as usize])
        .map(|i| format!("{i}/{n}"))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::config(format!(
            "shard(s) {} missing: a merged report would not be the whole campaign",
            missing.join(", ")
        )))
    }
}

/// `f` with its capsules copied from shard `dir` into `capsules`, its paths and repro line
/// naming the copies.
fn with_copied_capsules(
    f: &super::campaign::FailureEntry,
    dir: &Path,
    capsules: &Path,
) -> Result<super::campaign::FailureEntry> {
    let mut f = f.clone();
    for p in [Some(&mut f.capsule), f.shrunk_capsule.as_mut()]
        .into_iter()
        .flatten()
    {
        let copied = copy_capsule(dir, p, capsules)?;
        f.repro = f.repro.replace(p.as_str(), &copied);
        *p = copied;
    }
    Ok(f)
}

/// Copies a capsule named in a shard's report (relative to the process that wrote it, or to
/// the shard's directory) into `capsules`; returns the new path.
fn copy_capsule(shard: &Path, named: &str, capsules: &Path) -> Result<String> {
    let p = Path::new(named);
    let file = p.file_name().ok_or_else(|| {
        Error::config(format!(
            "{}: capsule path {named:?} names no file",
            shard.display()
        ))
    })?;
    let candidates = [p.to_path_buf(), shard.join("capsules").join(file)];
    let src = candidates.iter().find(|c| c.is_file()).ok_or_else(|| {
        Error::config(format!(
            "{}: capsule {named} is neither where the report says nor in its capsules/",
            shard.display()
        ))
    })?;
    let dst = capsules.join(file);
    std::fs::copy(src, &dst).map_err(io(&dst))?;
    Ok(dst.display().to_string())
}
