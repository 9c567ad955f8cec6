//! The HTML around the pictures: one self-contained file (inline CSS and SVG, no script, no
//! outside resource), for one run or for several.

use super::charts;
use super::heatmap::error_grid;
use super::run::{Failure, Run};
use std::fmt::Write;

/// Failures that get an error picture; the rest are listed with their repro command.
const HEATMAPS: usize = 20;

const STYLE: &str = "body{font-family:sans-serif;margin:1.5em auto;max-width:1100px;color:#222}\
h1{font-size:1.4em}h2{font-size:1.15em;border-bottom:1px solid #ccc;margin-top:1.6em}\
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;\
text-align:left}td.n{text-align:right}.fail{color:#c81e1e;font-weight:bold}.ok{color:#2e8b57}\
pre{background:#f4f4f4;padding:6px;white-space:pre-wrap;word-break:break-all}\
.row{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}.row>div{flex:1 1 400px;min-width:0}.note{color:#666;font-size:.9em}\
details{margin:.6em 0}summary{cursor:pointer;font-weight:bold}";

/// Escapes text for HTML content and attribute values.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\
         <style>{STYLE}</style></head><body>\n{body}</body></html>\n",
        esc(title)
    )
}

/// A chart, or the reason it could not be drawn.
fn picture(svg: crate::Result<String>) -> String {
    svg.unwrap_or_else(|e| {
        format!(
            "<p class=\"note\">(no picture: {})</p>",
            esc(&e.to_string())
        )
    })
}

fn verdict(run: &Run) -> String {
    let n = run.failures.len();
    let count = format!("<span id=\"failure-count\">{n}</span>");
    match (n, run.interrupted) {
        (0, false) => format!("<p class=\"ok\">passed: {count} failures</p>"),
        (0, true) => format!("<p>interrupted before its budget: {count} failures so far</p>"),
        (_, i) => format!(
            "<p class=\"fail\">FAILED: {count} failing case(s){}</p>",
            if i {
                ", interrupted before its budget"
            } else {
                ""
            }
        ),
    }
}

/// The page of one campaign.
pub fn run_page(run: &Run) -> String {
    let title = format!(
        "smallseq fuzz: {} / {}, seed {}",
        run.backend, run.profile, run.seed
    );
    let body = format!(
        "<h1>{}</h1>\n{}{}",
        esc(&title),
        verdict(run),
        run_body(run)
    );
    page(&title, &body)
}

/// Everything of one run below its verdict.
fn run_body(run: &Run) -> String {
    let mut b = String::new();
    let _ = writeln!(
        b,
        "<p>{} cases in {:.1} s ({:.1} cases/s); paths taken: {}.</p>",
        run.cases,
        run.elapsed_s,
        run.cases_per_s,
        esc(&run
            .paths
            .iter()
            .map(|(p, n)| format!("{p} {n}"))
            .collect::<Vec<_>>()
            .join(", "))
    );
    properties(&mut b, run);
    coverage(&mut b, run);
    margins(&mut b, run);
    failures(&mut b, run);
    b
}

fn properties(b: &mut String, run: &Run) {
    b.push_str("<h2>Properties</h2>\n<div class=\"row\"><table><tr><th>property</th><th>pass</th><th>fail</th><th>skip</th></tr>\n");
    for (name, c) in &run.properties {
        let cls = if c.fail > 0 { " class=\"fail\"" } else { "" };
        let _ = writeln!(
            b,
            "<tr{cls}><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            esc(name),
            c.pass,
            c.fail,
            c.skip
        );
    }
    b.push_str("</table>");
    let rows: Vec<_> = run
        .properties
        .iter()
        .map(|(n, c)| (n.clone(), [c.pass, c.fail, c.skip]))
        .collect();
    b.push_str(&picture(charts::properties(&rows)));
    b.push_str("</div>\n");
    if !run.skip_reasons.is_empty() {
        b.push_str("<h3>Why cases were skipped</h3>\n<table><tr><th>property: reason</th><th>cases</th></tr>\n");
        for (reason, n) in &run.skip_reasons {
            let _ = writeln!(
                b,
                "<tr><td>{}</td><td class=\"n\">{n}</td></tr>",
                esc(reason)
            );
        }
        b.push_str("</table>\n");
    }
}

fn coverage(b: &mut String, run: &Run) {
    b.push_str("<h2>Coverage per class</h2>\n");
    let missed: Vec<&str> = run
        .coverage
        .iter()
        .filter(|(_, n)| **n == 0)
        .map(|(c, _)| c.as_str())
        .collect();
    if missed.is_empty() {
        b.push_str("<p class=\"ok\">every class was hit</p>\n");
    } else {
        let _ = writeln!(
            b,
            "<p class=\"fail\">classes no case hit: {}</p>",
            esc(&missed.join(", "))
        );
    }
    let rows: Vec<_> = run.coverage.iter().map(|(c, n)| (c.clone(), *n)).collect();
    b.push_str(&picture(charts::coverage(&rows)));
}

fn fmt_margin(m: Option<f64>) -> String {
    m.map_or_else(|| "inf".into(), |m| crate::harness::text::decimal(m, 3))
}

fn margins(b: &mut String, run: &Run) {
    b.push_str("<h2>Margins per tensor</h2>\n<p class=\"note\">margin = a tensor's largest error / its threshold in one case; above 1 fails (<code>docs/judgement.md</code>). The grey bar at the left counts margins below the first bin (exact results included), the red one at the right those past the last (infinite included).</p>\n");
    b.push_str("<table><tr><th>tensor</th><th>judged</th><th>p50</th><th>p90</th><th>p99</th><th>max</th></tr>\n");
    for (t, p) in &run.margins {
        let _ = writeln!(
            b,
            "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            esc(t),
            p.n,
            fmt_margin(p.p50),
            fmt_margin(p.p90),
            fmt_margin(p.p99),
            fmt_margin(p.max)
        );
    }
    b.push_str("</table>\n<div class=\"row\">");
    for (t, h) in &run.margin_histograms {
        b.push_str(&picture(charts::margins(t, h)));
    }
    if run.margin_histograms.is_empty() && !run.margins.is_empty() {
        b.push_str("<p class=\"note\">(this report has percentiles only: no histogram)</p>");
    }
    b.push_str("</div>\n");
}

fn failures(b: &mut String, run: &Run) {
    if run.failures.is_empty() {
        return;
    }
    b.push_str("<h2>Failures</h2>\n");
    for (k, f) in run.failures.iter().enumerate() {
        let card = if k < HEATMAPS {
            card(run, f)
        } else {
            Card {
                which: "original",
                capsule: &f.capsule,
                detail: f.detail.clone(),
                picture: String::new(),
            }
        };
        let _ = write!(
            b,
            "<h3>case {} <span class=\"fail\">{}</span></h3>\n<p class=\"card-capsule\">shown: the \
             <b>{}</b> capsule <code>{}</code> (its recorded verdict{})</p>\n<p>{}</p>\n<div \
             class=\"row\"><div><p>repro:</p><pre>{}</pre>{}</div>",
            f.case,
            esc(&f.property),
            card.which,
            esc(file_name(card.capsule)),
            if card.picture.is_empty() { "" } else { " and error picture" },
            esc(&card.detail),
            esc(&f.repro),
            other_capsule(f, card.capsule),
        );
        b.push_str(&card.picture);
        b.push_str("</div>\n");
    }
    if run.failures.len() > HEATMAPS {
        let _ = writeln!(
            b,
            "<p class=\"note\">error pictures are drawn for the first {HEATMAPS} failures only</p>"
        );
    }
}

/// What one failure card shows: one capsule's verdict text and its error picture, never the
/// text of one and the picture of another (a shrunk case fails with other tensors and sizes).
struct Card<'a> {
    /// `shrunk` or `original`.
    which: &'static str,
    capsule: &'a str,
    detail: String,
    picture: String,
}

/// The shrunk capsule's card when it can be drawn, else the original's.
fn card<'a>(run: &Run, f: &'a Failure) -> Card<'a> {
    let mut why_not = None;
    let candidates = f
        .shrunk_capsule
        .as_deref()
        .map(|s| ("shrunk", s))
        .into_iter()
        .chain(std::iter::once(("original", f.capsule.as_str())));
    for (which, capsule) in candidates {
        match error_grid(&run.locate(capsule)) {
            Ok(g) => {
                let detail = match (which, g.detail_of(&f.property)) {
                    (_, Some(d)) => d.to_string(),
                    // The original's verdict is the report's own failure entry.
                    ("original", None) => f.detail.clone(),
                    (_, None) => "(the capsule records no verdict)".into(),
                };
                return Card {
                    which,
                    capsule,
                    detail,
                    picture: heat_section(&g),
                };
            }
            Err(e) => {
                why_not.get_or_insert(e.to_string());
            }
        }
    }
    Card {
        which: "original",
        capsule: &f.capsule,
        detail: f.detail.clone(),
        picture: format!(
            "<p class=\"note\">(no error picture: {})</p>",
            esc(why_not.as_deref().unwrap_or("no capsule"))
        ),
    }
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// The card's note on the failure's other capsule, so both files stay findable.
fn other_capsule(f: &Failure, shown: &str) -> String {
    let other = if shown == f.capsule {
        f.shrunk_capsule.as_deref()
    } else {
        Some(f.capsule.as_str())
    };
    match other {
        Some(o) => format!(
            "<p>capsule: <code>{}</code></p><p class=\"note\">{} capsule: <code>{}</code></p>",
            esc(shown),
            if shown == f.capsule {
                "shrunk"
            } else {
                "original"
            },
            esc(o)
        ),
        None => format!("<p>capsule: <code>{}</code></p>", esc(shown)),
    }
}

fn heat_section(g: &super::heatmap::ErrorGrid) -> String {
    let worst = g.worst().map_or(String::new(), |(e, t, h)| {
        format!("; largest error {e:.3e} at token {t}, head {h}")
    });
    format!(
        "<div>{}<p class=\"note\">tensor <b>{}</b> ({}){worst}. Colour: log10 error over six decades below the largest (yellow); grey: exact; magenta: NaN or infinite. Black lines: slot starts and the end of the used tokens; blue dashes: end of each slot's valid tokens.</p></div>",
        picture(charts::heatmap(g)),
        esc(&g.tensor),
        esc(&g.chosen_by)
    )
}

/// The page of several runs: trends over them, a table, then each run in full.
pub fn runs_page(runs: &[Run]) -> String {
    let total: usize = runs.iter().map(|r| r.failures.len()).sum();
    let names: Vec<String> = runs.iter().map(Run::name).collect();
    let mut b = format!(
        "<h1>smallseq: {} runs</h1>\n<p{}>failures over all runs: <span id=\"failure-count\">{total}</span></p>\n",
        runs.len(),
        if total > 0 { " class=\"fail\"" } else { " class=\"ok\"" }
    );
    b.push_str("<h2>Trends</h2>\n<div class=\"row\">");
    let one = |f: &dyn Fn(&Run) -> f64| runs.iter().map(|r| Some(f(r))).collect::<Vec<_>>();
    b.push_str(&picture(charts::trend(
        "cases per second",
        &names,
        &[("cases/s".into(), one(&|r| r.cases_per_s))],
        false,
    )));
    b.push_str(&picture(charts::trend(
        "failing cases",
        &names,
        &[("failures".into(), one(&|r| r.failures.len() as f64))],
        false,
    )));
    let tensors: std::collections::BTreeSet<&String> =
        runs.iter().flat_map(|r| r.margins.keys()).collect();
    let series: Vec<(String, Vec<Option<f64>>)> = tensors
        .iter()
        .flat_map(|t| {
            let pick = |q: fn(&super::run::Percentiles) -> Option<f64>| {
                runs.iter().map(|r| r.margins.get(*t).and_then(q)).collect()
            };
            [
                (format!("{t} p99"), pick(|p| p.p99)),
                (format!("{t} max"), pick(|p| p.max)),
            ]
        })
        .collect();
    b.push_str(&picture(charts::trend(
        "margin percentiles (log)",
        &names,
        &series,
        true,
    )));
    b.push_str("</div>\n<h2>Runs</h2>\n<table><tr><th>run</th><th>written (UTC)</th><th>backend / profile</th><th>seed</th><th>cases</th><th>cases/s</th><th>failures</th><th>page</th></tr>\n");
    for (r, name) in runs.iter().zip(&names) {
        let page = r.dir.join("report.html");
        let link = if page.exists() {
            format!(
                "<a href=\"{}\">report.html</a>",
                esc(&page.display().to_string())
            )
        } else {
            "-".into()
        };
        let _ = writeln!(
            b,
            "<tr><td>{}</td><td>{}</td><td>{} / {}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{:.1}</td><td class=\"n{}\">{}</td><td>{link}</td></tr>",
            esc(name),
            r.written.map_or("-".into(), utc),
            esc(&r.backend),
            esc(&r.profile),
            r.seed,
            r.cases,
            r.cases_per_s,
            if r.failures.is_empty() { "" } else { " fail" },
            r.failures.len()
        );
    }
    b.push_str("</table>\n");
    for (r, name) in runs.iter().zip(&names) {
        let _ = write!(
            b,
            "<details><summary>{} ({} / {}, seed {}): {} failures</summary>\n{}</details>\n",
            esc(name),
            esc(&r.backend),
            esc(&r.profile),
            r.seed,
            r.failures.len(),
            run_body(r)
        );
    }
    page(&format!("smallseq: {} runs", runs.len()), &b)
}

/// `YYYY-MM-DD hh:mm:ss` of a time, in UTC.
fn utc(t: std::time::SystemTime) -> String {
    let s = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (s.div_euclid(86_400), s.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        let at = |s| utc(std::time::UNIX_EPOCH + std::time::Duration::from_secs(s));
        assert_eq!(at(0), "1970-01-01 00:00:00");
        assert_eq!(at(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(at(1_796_096_096), "2026-12-01 03:34:56");
    }

    #[test]
    fn escapes_markup() {
        assert_eq!(
            esc("<a href=\"x\">&</a>"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&lt;/a&gt;"
        );
    }

    /// A card draws one capsule and prints that capsule's verdict, saying which it is: the
    /// shrunk one when it can be drawn, else the original.
    #[test]
    fn a_failure_card_shows_one_capsules_text_and_picture() {
        use crate::case_file::{write_case, OutputPrecision};
        use crate::AttnConfig;
        use smallseq_reference::{Dtype, Layout, Mask};
        let dir = std::env::temp_dir().join(format!("smallseq-card-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("capsules")).unwrap();
        let cfg = AttnConfig::new(Dtype::F32, 2, 64, Mask::Padding);
        let layout = Layout::packed(&[(3, 4), (2, 2)]);
        let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
        let t = |n: usize| {
            ndarray::Array3::from_shape_fn((n, 2, 64), |(a, b, c)| {
                ((a * 7 + b * 3 + c) % 11) as f32 / 11.0 - 0.5
            })
        };
        let mut case = crate::Case::new(cfg, layout, t(tq), t(tk), t(tk), None).unwrap();
        case.outputs = crate::harness::props::oracle(&case).unwrap().reference;
        let capsule = |name: &str, detail: &str| {
            let mut c = case.clone();
            c.meta.insert(
                "smallseq.verdict".into(),
                format!(
                    r#"{{"failures":[{{"property":"numeric_agreement","detail":"{detail}"}}]}}"#
                ),
            );
            let p = dir.join("capsules").join(name);
            write_case(&c, &p, OutputPrecision::Device).unwrap();
            p.display().to_string()
        };
        let run = Run {
            dir: dir.clone(),
            failures: vec![Failure {
                case: 4,
                property: "numeric_agreement".into(),
                detail: "original text".into(),
                capsule: capsule("case-000004-numeric_agreement.safetensors", "original text"),
                shrunk_capsule: Some(capsule(
                    "case-000004-numeric_agreement-shrunk.safetensors",
                    "shrunk text",
                )),
                repro: "smallseq repro x".into(),
            }],
            ..Run::default()
        };
        let mut b = String::new();
        failures(&mut b, &run);
        assert!(
            b.contains("<p>shrunk text</p>") && !b.contains("<p>original text</p>"),
            "{b}"
        );
        assert!(
            b.contains(
                "the <b>shrunk</b> capsule <code>case-000004-numeric_agreement-shrunk.safetensors</code> \
                 (its recorded verdict and error picture)"
            ),
            "{b}"
        );
        assert_eq!(b.matches("<svg").count(), 1, "{b}");
        // Without a drawable shrunk capsule the card is the original's, text and picture.
        std::fs::remove_file(run.failures[0].shrunk_capsule.as_ref().unwrap()).unwrap();
        let mut b = String::new();
        failures(&mut b, &run);
        assert!(
            b.contains("<p>original text</p>") && !b.contains("shrunk text"),
            "{b}"
        );
        assert!(b.contains("the <b>original</b> capsule"), "{b}");
        assert_eq!(b.matches("<svg").count(), 1, "{b}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
