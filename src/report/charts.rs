//! The report's pictures, drawn by `plotters` into SVG strings that the page inlines.

use super::heatmap::ErrorGrid;
use crate::error::{Error, Result};
use crate::harness::histogram::Histogram;
use plotters::coord::Shift;
use plotters::prelude::*;

const FONT: &str = "sans-serif";
const PASS: RGBColor = RGBColor(46, 139, 87);
const FAIL: RGBColor = RGBColor(200, 30, 30);
const SKIP: RGBColor = RGBColor(170, 170, 170);
/// Cells with no error at all: the don't-care rows and exact results.
const EXACT: RGBColor = RGBColor(235, 235, 235);

fn drawing(e: impl std::fmt::Display) -> Error {
    Error::Report(format!("drawing a chart: {e}"))
}

/// Runs `draw` on an SVG canvas of `size` and returns the SVG text.
fn svg(
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> Result<()>,
) -> Result<String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        root.fill(&WHITE).map_err(drawing)?;
        draw(&root)?;
        root.present().map_err(drawing)?;
    }
    Ok(out)
}

/// One horizontal bar per row, each split into coloured parts laid end to end.
pub fn stacked_bars(rows: &[(String, Vec<(u64, RGBColor)>)], x_desc: &str) -> Result<String> {
    let n = rows.len().max(1);
    let longest = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(4) as u32;
    let total = |parts: &[(u64, RGBColor)]| parts.iter().map(|p| p.0).sum::<u64>();
    let max = rows.iter().map(|(_, p)| total(p)).max().unwrap_or(0).max(1) as f64;
    svg((720, 40 + 22 * n as u32), |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(6)
            .x_label_area_size(28)
            .y_label_area_size(12 + 7 * longest)
            .build_cartesian_2d(0f64..max, (0..n).into_segmented())
            .map_err(drawing)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_labels(n)
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                    rows.get(*i).map(|r| r.0.clone()).unwrap_or_default()
                }
                SegmentValue::Last => String::new(),
            })
            .x_desc(x_desc)
            .label_style((FONT, 12))
            .draw()
            .map_err(drawing)?;
        let bars = rows.iter().enumerate().flat_map(|(i, (_, parts))| {
            let mut x = 0.0;
            parts.iter().filter(|p| p.0 > 0).map(move |&(v, colour)| {
                let x0 = x;
                x += v as f64;
                let mut r = Rectangle::new(
                    [
                        (x0, SegmentValue::Exact(i)),
                        (x, SegmentValue::Exact(i + 1)),
                    ],
                    colour.filled(),
                );
                r.set_margin(3, 3, 0, 0);
                r
            })
        });
        chart.draw_series(bars).map_err(drawing)?;
        Ok(())
    })
}

/// Pass, fail and skip counts per property.
pub fn properties(rows: &[(String, [u64; 3])]) -> Result<String> {
    let rows: Vec<_> = rows
        .iter()
        .map(|(name, [p, f, s])| (name.clone(), vec![(*p, PASS), (*f, FAIL), (*s, SKIP)]))
        .collect();
    stacked_bars(&rows, "cases (green pass, red fail, grey skip)")
}

/// Cases per class; a class no case hit is drawn as a red stub.
pub fn coverage(rows: &[(String, u64)]) -> Result<String> {
    let stub = (rows.iter().map(|r| r.1).max().unwrap_or(0) / 100).max(1);
    let rows: Vec<_> = rows
        .iter()
        .map(|(name, n)| {
            let part = if *n == 0 { (stub, FAIL) } else { (*n, PASS) };
            (name.clone(), vec![part])
        })
        .collect();
    stacked_bars(&rows, "cases that hit the class (red: none)")
}

/// A histogram of margins on a log axis, the out-of-range bins at either end, and the
/// failure line at margin 1.
pub fn margins(tensor: &str, h: &Histogram) -> Result<String> {
    let step = 1.0 / f64::from(h.per_decade.max(1));
    let lo = f64::from(h.log10_lo);
    let hi = lo + h.counts.len() as f64 * step;
    // `under` and `over` get one bin each, a step outside the range.
    let bars: Vec<(f64, f64, u64, RGBColor)> =
        std::iter::once((lo - 2.0 * step, lo - step, h.under, SKIP))
            .chain(h.counts.iter().enumerate().map(|(i, &c)| {
                let x0 = lo + i as f64 * step;
                (x0, x0 + step, c, if x0 >= 0.0 { FAIL } else { PASS })
            }))
            .chain(std::iter::once((hi + step, hi + 2.0 * step, h.over, FAIL)))
            .collect();
    let ymax = bars.iter().map(|b| b.2).max().unwrap_or(0).max(1) as f64 * 1.1;
    svg((520, 240), |root| {
        let mut chart = ChartBuilder::on(root)
            .caption(
                format!(
                    "{tensor}: {} margins, {} at 1 or more",
                    h.total(),
                    h.from_one()
                ),
                (FONT, 14),
            )
            .margin(6)
            .x_label_area_size(32)
            .y_label_area_size(48)
            .build_cartesian_2d((lo - 2.0 * step)..(hi + 2.0 * step), 0f64..ymax)
            .map_err(drawing)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(((hi - lo) as usize + 1).min(12))
            .x_label_formatter(&|x| {
                if *x < lo {
                    "0".into()
                } else if *x > hi {
                    "inf".into()
                } else {
                    format!("1e{x:.0}")
                }
            })
            .x_desc("margin = error / threshold (log scale)")
            .y_desc("tensors")
            .y_label_formatter(&|y| format!("{y:.0}"))
            .label_style((FONT, 11))
            .draw()
            .map_err(drawing)?;
        chart
            .draw_series(bars.iter().filter(|b| b.2 > 0).map(|&(x0, x1, c, colour)| {
                Rectangle::new([(x0, 0.0), (x1, c as f64)], colour.filled())
            }))
            .map_err(drawing)?;
        chart
            .draw_series(LineSeries::new(
                [(0.0, 0.0), (0.0, ymax)],
                FAIL.stroke_width(2),
            ))
            .map_err(drawing)?;
        chart
            .draw_series(std::iter::once(Text::new(
                "fails above 1",
                (step / 2.0, ymax * 0.95),
                (FONT, 11).into_font().color(&FAIL),
            )))
            .map_err(drawing)?;
        Ok(())
    })
}

/// Colour of an error on a log scale spanning six decades below the largest finite error.
fn heat(e: f64, top: f64) -> RGBColor {
    if e == 0.0 {
        EXACT
    } else if !e.is_finite() {
        MAGENTA
    } else {
        let t = top.log10();
        ViridisRGB::get_color_normalized(e.log10().clamp(t - 6.0, t), t - 6.0, t)
    }
}

/// Errors per token (down) and head (across), slot starts as black lines, the end of each
/// slot's valid tokens as blue dashes (padding between them), tail slack below the last line.
pub fn heatmap(g: &ErrorGrid) -> Result<String> {
    let top = g
        .err
        .iter()
        .copied()
        .filter(|e| e.is_finite())
        .fold(0.0, f64::max);
    let top = if top > 0.0 { top } else { 1.0 };
    let (t, h) = (g.tokens.max(1) as f64, g.heads.max(1) as f64);
    let height = (g.tokens as u32 * 12).clamp(160, 900) + 60;
    let width = (g.heads as u32 * 28).clamp(200, 640) + 80;
    svg((width, height), |root| {
        let mut chart = ChartBuilder::on(root)
            .caption(
                format!("|{0} - reference|, max over the head dim", g.tensor),
                (FONT, 13),
            )
            .margin(6)
            .x_label_area_size(28)
            .y_label_area_size(40)
            .build_cartesian_2d(0f64..h, -t..0f64)
            .map_err(drawing)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("head")
            .y_desc("token")
            .x_labels(g.heads.min(16))
            .y_labels(g.tokens.min(24))
            .x_label_formatter(&|x| format!("{}", x.floor() as i64))
            .y_label_formatter(&|y| format!("{}", (-y).round() as i64))
            .label_style((FONT, 11))
            .draw()
            .map_err(drawing)?;
        let cells = (0..g.tokens).flat_map(|tok| (0..g.heads).map(move |hd| (tok, hd)));
        chart
            .draw_series(cells.map(|(tok, hd)| {
                let (x, y) = (hd as f64, -(tok as f64));
                Rectangle::new(
                    [(x, y), (x + 1.0, y - 1.0)],
                    heat(g.at(tok, hd), top).filled(),
                )
            }))
            .map_err(drawing)?;
        let line = |y: usize| [(0.0, -(y as f64)), (h, -(y as f64))];
        let starts = g.slots.iter().map(|s| s.0).chain([g.end]);
        chart
            .draw_series(starts.map(|y| PathElement::new(line(y), BLACK.stroke_width(2))))
            .map_err(drawing)?;
        for &(_, valid_end) in &g.slots {
            chart
                .draw_series(DashedLineSeries::new(
                    line(valid_end),
                    4,
                    3,
                    BLUE.stroke_width(1),
                ))
                .map_err(drawing)?;
        }
        Ok(())
    })
}

/// One line per series over the runs, in order; `None` leaves a gap. With `log`, values are
/// drawn on a log axis (non-positive ones are left out).
pub fn trend(
    title: &str,
    runs: &[String],
    series: &[(String, Vec<Option<f64>>)],
    log: bool,
) -> Result<String> {
    let y = |v: f64| if log { v.log10() } else { v };
    let points = |vals: &[Option<f64>]| -> Vec<(f64, f64)> {
        vals.iter()
            .enumerate()
            .filter_map(|(i, v)| {
                v.filter(|v| v.is_finite() && (!log || *v > 0.0))
                    .map(|v| (i as f64, y(v)))
            })
            .collect()
    };
    let all: Vec<f64> = series
        .iter()
        .flat_map(|s| points(&s.1))
        .map(|p| p.1)
        .collect();
    let (mut y0, mut y1) = all
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    if !y0.is_finite() {
        (y0, y1) = (0.0, 1.0);
    }
    let pad = ((y1 - y0) * 0.1).max(if log { 0.5 } else { 1.0 });
    let (y0, y1) = (if log { y0 - pad } else { (y0 - pad).max(0.0) }, y1 + pad);
    let n = runs.len().max(1);
    svg((720, 300), |root| {
        let mut chart = ChartBuilder::on(root)
            .caption(title, (FONT, 14))
            .margin(8)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), y0..y1)
            .map_err(drawing)?;
        chart
            .configure_mesh()
            .x_labels(n.min(12))
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    runs.get(i as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|v| {
                if log {
                    format!("1e{v:.1}")
                } else {
                    format!("{v:.1}")
                }
            })
            .label_style((FONT, 11))
            .draw()
            .map_err(drawing)?;
        for (k, (name, vals)) in series.iter().enumerate() {
            let colour = Palette99::pick(k).to_rgba();
            let pts = points(vals);
            chart
                .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))
                .map_err(drawing)?
                .label(name.clone())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2))
                });
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, colour.filled())))
                .map_err(drawing)?;
        }
        if !series.is_empty() {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font((FONT, 11))
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(drawing)?;
        }
        Ok(())
    })
}
