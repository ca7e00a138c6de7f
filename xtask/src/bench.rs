//! Benchmark results: the `RESULT {json}` lines the collective benchmarks print, an nccl-tests
//! style table of them, and SVG charts (`cargo xtask chart`).
//!
//! One line per measurement:
//!
//! ```text
//! RESULT {"bench":"allreduce","impl":"cuda-multimem","operand":"symmetric","dtype":"bf16","op":"sum",
//!         "ranks":2,"bytes":1024,"mode":"pipelined","time_us":2.8,"algbw_gbs":0.37,"busbw_gbs":0.37,
//!         "path":"peer-to-peer","algorithm":"one-shot-ll","correct":true}
//! ```
//!
//! The parser is strict: a `RESULT` line that is not this schema, or whose numbers are not finite
//! and positive, is an error naming the line, never a line silently left out of a table or chart.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::Result;

/// Our implementation's name in `impl`.
pub const OURS: &str = "cuda-multimem";
/// The references whose faster time per size is "best reference": NCCL one process per GPU with
/// plain buffers and with symmetric windows, torch symm_mem where it has the operation, for
/// the fused norm torch's NCCL allreduce then add + rms_norm, and for the all-to-all and MoE
/// dispatch / combine torch's `all_to_all_single` over NCCL.
pub const REFERENCES: [&str; 7] = [
    "nccl-plain",
    "nccl-symmetric",
    "torch-symm-mem-one-shot",
    "torch-symm-mem-two-shot",
    "torch-symm-mem-reduce-scatter",
    "torch-nccl-unfused",
    "torch-nccl-all-to-all-single",
];

/// One measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    /// The collective: allreduce, all_gather, reduce_scatter, broadcast, allreduce_rmsnorm,
    /// alltoall, moe_dispatch, moe_combine.
    pub bench: String,
    /// Who ran it: cuda-multimem, nccl-plain, nccl-symmetric, torch-symm-mem-one-shot, ...
    #[serde(rename = "impl")]
    pub implementation: String,
    /// symmetric, local, or "-".
    pub operand: String,
    /// Element type (bf16, f16, f32, ...).
    pub dtype: String,
    /// Reduction (sum, ...).
    pub op: String,
    /// Ranks (GPUs) taking part.
    pub ranks: u32,
    /// Message size in bytes.
    pub bytes: u64,
    /// pipelined (back-to-back calls) or single (one call at a time).
    pub mode: String,
    /// Time per call, microseconds.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw_gbs: f64,
    /// Bus bandwidth, GB/s (nccl-tests' definition).
    pub busbw_gbs: f64,
    /// The transport (peer-to-peer, multicast, ...), where the implementation says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The algorithm, where the implementation says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    /// Checked against a reference: true or false; null where not checked.
    #[serde(default)]
    pub correct: Option<bool>,
}

impl Measurement {
    fn check(&self) -> std::result::Result<(), String> {
        for (k, v) in [
            ("time_us", self.time_us),
            ("algbw_gbs", self.algbw_gbs),
            ("busbw_gbs", self.busbw_gbs),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{k} = {v} is not a finite, non-negative number"));
            }
        }
        if self.time_us == 0.0 {
            return Err("time_us = 0".into());
        }
        if self.bytes == 0 {
            return Err("bytes = 0".into());
        }
        if self.ranks == 0 {
            return Err("ranks = 0".into());
        }
        Ok(())
    }

    /// Elements per rank's buffer (nccl-tests' "count").
    pub fn count(&self) -> Option<u64> {
        dtype_size(&self.dtype).map(|s| self.bytes / s)
    }
}

/// Bytes per element of a dtype name.
pub fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "bf16" | "f16" | "fp16" | "half" | "bfloat16" => 2,
        "f32" | "fp32" | "float" | "i32" | "u32" => 4,
        "f64" | "fp64" | "double" | "i64" | "u64" => 8,
        "fp8" | "e4m3" | "e5m2" | "i8" | "u8" => 1,
        _ => return None,
    })
}

/// Parse every `RESULT ` line of `text` (other lines are output around them). Any `RESULT` line
/// that does not parse, or has a non-finite or non-positive number, fails the whole parse with
/// its line number.
pub fn parse(text: &str) -> std::result::Result<Vec<Measurement>, String> {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let Some(j) = line.trim().strip_prefix("RESULT") else {
            continue;
        };
        let j = j.trim();
        match serde_json::from_str::<Measurement>(j)
            .map_err(|e| e.to_string())
            .and_then(|m| m.check().map(|()| m))
        {
            Ok(m) => out.push(m),
            Err(e) => errors.push(format!("line {}: {e}: {}", i + 1, line.trim())),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(format!(
            "{} RESULT line(s) are not valid measurements:\n  {}",
            errors.len(),
            errors.join("\n  ")
        ))
    }
}

/// Parse a results file (`.jsonl`: bare JSON objects, or `RESULT {json}` lines as printed).
pub fn parse_file(path: &Path) -> Result<Vec<Measurement>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    // Accept the saved form (one object a line) as well as captured benchmark output.
    let normalised: String = text
        .lines()
        .map(|l| {
            if l.trim_start().starts_with('{') {
                format!("RESULT {l}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    parse(&normalised).map_err(|e| format!("{}: {e}", path.display()).into())
}

/// The saved form: one JSON object per line.
pub fn to_jsonl(ms: &[Measurement]) -> String {
    ms.iter()
        .map(|m| serde_json::to_string(m).unwrap_or_default() + "\n")
        .collect()
}

/// Sizes for people: 1 KiB, 256 MiB, 1 GiB; plain bytes otherwise.
pub fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// Column label of a measurement: the implementation, with the operand where one implementation
/// was measured with more than one kind of operand in the same table.
fn labels(ms: &[&Measurement]) -> BTreeMap<(String, String), String> {
    let mut operands: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for m in ms {
        operands
            .entry(&m.implementation)
            .or_default()
            .insert(&m.operand);
    }
    ms.iter()
        .map(|m| {
            let k = (m.implementation.clone(), m.operand.clone());
            let l = if operands[m.implementation.as_str()].len() > 1 {
                format!("{} ({})", m.implementation, m.operand)
            } else {
                m.implementation.clone()
            };
            (k, l)
        })
        .collect()
}

/// Column order: ours first, then the references, then the rest, each alphabetically.
fn column_order(label: &str) -> (u8, String) {
    let rank = if label.starts_with(OURS) {
        0
    } else if REFERENCES.iter().any(|r| label.starts_with(r)) {
        1
    } else {
        2
    };
    (rank, label.to_string())
}

/// The faster of the references at one size and mode: (time, impl).
fn best_reference<'a>(ms: &[&'a Measurement]) -> Option<&'a Measurement> {
    ms.iter()
        .copied()
        .filter(|m| REFERENCES.contains(&m.implementation.as_str()))
        .min_by(|a, b| a.time_us.total_cmp(&b.time_us))
}

/// Group key of one table or chart: the collective and what was reduced, on how many ranks.
type Group = (String, String, String, u32);

fn groups(ms: &[Measurement]) -> BTreeMap<Group, Vec<&Measurement>> {
    let mut g: BTreeMap<Group, Vec<&Measurement>> = BTreeMap::new();
    for m in ms {
        g.entry((m.bench.clone(), m.dtype.clone(), m.op.clone(), m.ranks))
            .or_default()
            .push(m);
    }
    g
}

/// nccl-tests style tables: per collective and mode, one row per size, each implementation's
/// time, algbw, busbw and correctness side by side, then the best reference (the fastest of the
/// [`REFERENCES`] in the run at that size) and ours against it.
pub fn table(ms: &[Measurement]) -> String {
    let mut out = String::new();
    for ((bench, dtype, op, ranks), group) in groups(ms) {
        let modes: BTreeSet<&str> = group.iter().map(|m| m.mode.as_str()).collect();
        for mode in modes {
            let rows: Vec<&Measurement> =
                group.iter().copied().filter(|m| m.mode == mode).collect();
            let label = labels(&rows);
            let mut cols: Vec<&String> = label
                .values()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            cols.sort_by_key(|l| column_order(l));
            let sizes: BTreeSet<u64> = rows.iter().map(|m| m.bytes).collect();
            let ours = cols.iter().position(|c| c.starts_with(OURS));
            let _ = writeln!(out, "# {bench}  {dtype} {op}  ranks {ranks}  mode {mode}");
            // Header: implementation names over their four columns.
            let mut h1 = format!("#{:>11} {:>12}", "", "");
            let mut h2 = format!("#{:>11} {:>12}", "size", "count");
            for c in &cols {
                let _ = write!(h1, " | {c:^34}");
                let _ = write!(
                    h2,
                    " | {:>9} {:>7} {:>7} {:>7}",
                    "time(us)", "algbw", "busbw", "correct"
                );
            }
            let _ = write!(h1, " | {:^36}", "best reference");
            let _ = write!(h2, " | {:>9} {:>16} {:>9}", "time(us)", "impl", "ours/best");
            let _ = writeln!(out, "{}\n{}", h1.trim_end(), h2);
            for bytes in sizes {
                let at: Vec<&Measurement> =
                    rows.iter().copied().filter(|m| m.bytes == bytes).collect();
                let count = at
                    .first()
                    .and_then(|m| m.count())
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "-".into());
                let mut line = format!("{:>12} {:>12}", human_bytes(bytes), count);
                let mut ours_time = None;
                for (ci, c) in cols.iter().enumerate() {
                    let m = at
                        .iter()
                        .find(|m| label[&(m.implementation.clone(), m.operand.clone())] == **c);
                    match m {
                        Some(m) => {
                            if Some(ci) == ours {
                                ours_time = Some(m.time_us);
                            }
                            let ok = match m.correct {
                                Some(true) => "ok",
                                Some(false) => "WRONG",
                                None => "-",
                            };
                            let _ = write!(
                                line,
                                " | {:>9.2} {:>7.2} {:>7.2} {:>7}",
                                m.time_us, m.algbw_gbs, m.busbw_gbs, ok
                            );
                        }
                        None => {
                            let _ = write!(line, " | {:>9} {:>7} {:>7} {:>7}", "-", "-", "-", "-");
                        }
                    }
                }
                match best_reference(&at) {
                    Some(b) => {
                        let ratio = ours_time
                            .map(|t| format!("{:.2}x", b.time_us / t))
                            .unwrap_or_else(|| "-".into());
                        let _ = write!(
                            line,
                            " | {:>9.2} {:>16} {:>9}",
                            b.time_us, b.implementation, ratio
                        );
                    }
                    None => {
                        let _ = write!(line, " | {:>9} {:>16} {:>9}", "-", "-", "-");
                    }
                }
                let _ = writeln!(out, "{line}");
            }
            if ours.is_some() {
                let present: Vec<&str> = REFERENCES
                    .iter()
                    .copied()
                    .filter(|r| rows.iter().any(|m| m.implementation == *r))
                    .collect();
                let _ = writeln!(
                    out,
                    "# ours/best > 1: {OURS} is faster than the fastest of {}",
                    present.join(", ")
                );
            }
            out.push('\n');
        }
    }
    out
}

/// Charts for one run: `<bench>-time.svg` (time against size, log–log) and
/// `<bench>-bandwidth.svg` (bus bandwidth against size), one series per implementation and mode.
/// Returns the files written.
pub fn charts(
    ms: &[Measurement],
    out_dir: &Path,
    machine: &str,
    date: &str,
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out_dir)
        .map_err(|e| format!("cannot create {}: {e}", out_dir.display()))?;
    let mut by_bench: BTreeMap<&str, Vec<&Measurement>> = BTreeMap::new();
    for m in ms {
        by_bench.entry(&m.bench).or_default().push(m);
    }
    let mut files = Vec::new();
    for (bench, rows) in by_bench {
        let series = chart_series(&rows);
        let sub = {
            let first = rows[0];
            let ranks: BTreeSet<u32> = rows.iter().map(|m| m.ranks).collect();
            let ranks: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
            format!("{} {}, {} ranks", first.dtype, first.op, ranks.join("/"))
        };
        for (what, file) in [(Axis::Time, "time"), (Axis::Bandwidth, "bandwidth")] {
            let path = out_dir.join(format!("{bench}-{file}.svg"));
            let title = format!("{bench} ({sub}): {} — {machine}, {date}", what.title());
            draw(&path, &title, &series, what)?;
            files.push(path);
        }
    }
    Ok(files)
}

#[derive(Clone, Copy, PartialEq)]
enum Axis {
    Time,
    Bandwidth,
}

impl Axis {
    fn title(self) -> &'static str {
        match self {
            Axis::Time => "time per call",
            Axis::Bandwidth => "bus bandwidth",
        }
    }
}

/// One line of a chart: its label, whether it is ours, and (bytes, time_us, busbw) by size.
struct Series {
    label: String,
    ours: bool,
    points: Vec<(u64, f64, f64)>,
}

fn chart_series(rows: &[&Measurement]) -> Vec<Series> {
    let label = labels(rows);
    let modes: BTreeSet<&str> = rows.iter().map(|m| m.mode.as_str()).collect();
    let ranks: BTreeSet<u32> = rows.iter().map(|m| m.ranks).collect();
    let mut by: BTreeMap<String, Series> = BTreeMap::new();
    for m in rows {
        let mut l = label[&(m.implementation.clone(), m.operand.clone())].clone();
        if modes.len() > 1 {
            l = format!("{l}, {}", m.mode);
        }
        if ranks.len() > 1 {
            l = format!("{l}, {} ranks", m.ranks);
        }
        let s = by.entry(l.clone()).or_insert_with(|| Series {
            label: l,
            ours: m.implementation == OURS,
            points: Vec::new(),
        });
        s.points.push((m.bytes, m.time_us, m.busbw_gbs));
    }
    let mut v: Vec<Series> = by.into_values().collect();
    for s in &mut v {
        s.points.sort_by_key(|p| p.0);
    }
    v.sort_by_key(|s| column_order(&s.label));
    v
}

fn draw(path: &Path, title: &str, series: &[Series], what: Axis) -> Result<()> {
    use plotters::prelude::*;

    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (u64::MAX, 0u64, f64::MAX, 0f64);
    for &(b, t, bw) in pts {
        let y = if what == Axis::Time { t } else { bw };
        x0 = x0.min(b);
        x1 = x1.max(b);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        return Err(format!("no points for {}", path.display()).into());
    }
    // The x axis is log2(bytes) on a linear scale, so that ticks fall on powers of two and read
    // as 1 KiB, 1 MiB, ... (a log scale in plotters puts them on powers of ten).
    let (x0, x1) = ((x0 as f64).log2() - 0.5, (x1 as f64).log2() + 0.5);
    let root = SVGBackend::new(path, (1000, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let palette = [
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(140, 86, 75),
        RGBColor(23, 190, 207),
        RGBColor(127, 127, 127),
    ];
    let ours = RGBColor(214, 39, 40);
    let x_fmt = |x: &f64| {
        if (x - x.round()).abs() < 1e-6 && *x >= 0.0 {
            human_bytes(1u64 << (x.round() as u32).min(62))
        } else {
            String::new()
        }
    };
    let x_labels = ((x1 - x0) as usize + 1).min(16);
    macro_rules! plot {
        ($chart:expr, $y:expr) => {{
            let mut chart = $chart;
            let mut others = palette.iter().cycle();
            for s in series {
                let color = if s.ours {
                    ours
                } else {
                    *others.next().unwrap_or(&BLACK)
                };
                let width = if s.ours { 3 } else { 2 };
                let data: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .map(|p| ((p.0 as f64).log2(), $y(p)))
                    .collect();
                chart
                    .draw_series(LineSeries::new(data.clone(), color.stroke_width(width)))?
                    .label(s.label.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(width))
                    });
                chart.draw_series(data.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        }};
    }
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72);
    match what {
        Axis::Time => {
            let mut chart = builder.build_cartesian_2d(x0..x1, (y0 / 1.5..y1 * 1.5).log_scale())?;
            chart
                .configure_mesh()
                .x_desc("message size (bytes per rank)")
                .y_desc("time per call (µs)")
                .x_labels(x_labels)
                .x_label_formatter(&x_fmt)
                .draw()?;
            plot!(chart, |p: &(u64, f64, f64)| p.1);
        }
        Axis::Bandwidth => {
            let mut chart = builder.build_cartesian_2d(x0..x1, 0f64..y1 * 1.1)?;
            chart
                .configure_mesh()
                .x_desc("message size (bytes per rank)")
                .y_desc("bus bandwidth (GB/s)")
                .x_labels(x_labels)
                .x_label_formatter(&x_fmt)
                .draw()?;
            plot!(chart, |p: &(u64, f64, f64)| p.2);
        }
    }
    root.present()
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(())
}

/// Today's date (UTC) as YYYY-MM-DD.
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    civil_date((secs / 86_400) as i64)
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's civil_from_days).
pub fn civil_date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

fn valid_date(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 10
        && b[4] == b'-'
        && b[7] == b'-'
        && b.iter()
            .enumerate()
            .all(|(i, c)| i == 4 || i == 7 || c.is_ascii_digit())
}

/// Entry point of `cargo xtask chart`: the table on stdout, the charts into `out_dir`.
pub fn chart_cmd(
    results: &Path,
    out_dir: Option<PathBuf>,
    date: Option<String>,
    machine: Option<String>,
) -> Result<()> {
    let ms = parse_file(results)?;
    if ms.is_empty() {
        return Err(format!("{}: no measurements", results.display()).into());
    }
    let date = date.unwrap_or_else(today);
    if !valid_date(&date) {
        return Err(format!("--date {date}: expected YYYY-MM-DD").into());
    }
    let machine = machine.unwrap_or_else(|| "unnamed machine".into());
    let out_dir = out_dir.unwrap_or_else(|| crate::workspace_root().join("docs/charts"));
    print!("{}", table(&ms));
    for f in charts(&ms, &out_dir, &machine, &date)? {
        println!("wrote {}", f.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(imp: &str, bytes: u64, time: f64, mode: &str) -> String {
        let bw = bytes as f64 / time / 1e3;
        format!(
            r#"RESULT {{"bench":"allreduce","impl":"{imp}","operand":"symmetric","dtype":"bf16","op":"sum","ranks":2,"bytes":{bytes},"mode":"{mode}","time_us":{time},"algbw_gbs":{bw},"busbw_gbs":{bw},"path":"peer-to-peer","algorithm":"one-shot-ll","correct":true}}"#
        )
    }

    fn sample() -> String {
        let mut s = String::from("some benchmark chatter\n");
        for (b, ours, plain, symm) in [
            (1024u64, 2.8, 8.5, 7.9),
            (65536, 3.7, 9.7, 10.2),
            (1 << 20, 8.0, 16.9, 15.0),
            (256 << 20, 745.0, 890.0, 870.0),
        ] {
            s += &line("cuda-multimem", b, ours, "pipelined");
            s += "\n";
            s += &line("nccl-plain", b, plain, "pipelined");
            s += "\n";
            s += &line("nccl-symmetric", b, symm, "pipelined");
            s += "\n";
        }
        s += r#"RESULT {"bench":"all_gather","impl":"nccl-plain","operand":"-","dtype":"bf16","op":"sum","ranks":2,"bytes":4096,"mode":"single","time_us":5.5,"algbw_gbs":0.7,"busbw_gbs":0.35,"correct":null}"#;
        s + "\n"
    }

    #[test]
    fn parses_every_result_line_and_skips_other_output() {
        let ms = parse(&sample()).unwrap();
        assert_eq!(ms.len(), 13);
        assert_eq!(ms[0].implementation, "cuda-multimem");
        assert_eq!(ms[0].count(), Some(512));
        let ag = ms.last().unwrap();
        assert_eq!((ag.correct, ag.path.as_deref()), (None, None));
    }

    #[test]
    fn non_finite_numbers_fail_loudly_with_the_line() {
        let text = format!(
            "{}\n{}\n",
            line("cuda-multimem", 1024, 2.8, "single"),
            line("cuda-multimem", 2048, 2.9, "single")
                .replace("\"time_us\":2.9", "\"time_us\":NaN")
        );
        let e = parse(&text).unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        let text =
            line("x", 1024, 1.0, "single").replace("\"busbw_gbs\":1.024", "\"busbw_gbs\":1e999");
        assert!(parse(&text).is_err());
        let text = line("x", 1024, 1.0, "single").replace("\"time_us\":1", "\"time_us\":-1");
        assert!(parse(&text).unwrap_err().contains("time_us"));
        let text = line("x", 1024, 1.0, "single").replace("\"bytes\":1024,", "");
        assert!(parse(&text).unwrap_err().contains("bytes"));
    }

    #[test]
    fn saved_lines_read_back_the_same() {
        let ms = parse(&sample()).unwrap();
        let dir = std::env::temp_dir().join(format!("xtask-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("allreduce-2026-01-01.jsonl");
        std::fs::write(&f, to_jsonl(&ms)).unwrap();
        assert_eq!(parse_file(&f).unwrap(), ms);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn table_puts_implementations_side_by_side_with_the_best_reference() {
        let ms = parse(&sample()).unwrap();
        let t = table(&ms);
        assert!(
            t.contains("# allreduce  bf16 sum  ranks 2  mode pipelined"),
            "{t}"
        );
        let row = t
            .lines()
            .find(|l| l.trim_start().starts_with("1 KiB"))
            .unwrap();
        // ours 2.80, nccl-plain 8.50, nccl-symmetric 7.90; the best reference is nccl-symmetric.
        assert!(
            row.contains("2.80") && row.contains("8.50") && row.contains("7.90"),
            "{row}"
        );
        assert!(
            row.contains("nccl-symmetric") && row.contains("2.82x"),
            "{row}"
        );
        let row = t
            .lines()
            .find(|l| l.trim_start().starts_with("64 KiB"))
            .unwrap();
        assert!(row.contains("nccl-plain") && row.contains("2.62x"), "{row}");
        let allreduce = &t[t.find("# allreduce").unwrap()..];
        let order: Vec<usize> = ["cuda-multimem", "nccl-plain", "nccl-symmetric"]
            .iter()
            .map(|c| allreduce.find(c).unwrap())
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{t}");
        assert!(
            t.contains("# all_gather  bf16 sum  ranks 2  mode single"),
            "{t}"
        );
    }

    #[test]
    fn charts_are_one_pair_per_collective() {
        let ms = parse(&sample()).unwrap();
        let dir = std::env::temp_dir().join(format!("xtask-charts-{}", std::process::id()));
        let files = charts(&ms, &dir, "2 x H200", "2026-01-01").unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "all_gather-time.svg",
                "all_gather-bandwidth.svg",
                "allreduce-time.svg",
                "allreduce-bandwidth.svg"
            ]
        );
        let svg = std::fs::read_to_string(dir.join("allreduce-time.svg")).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
        for s in [
            "2 x H200",
            "2026-01-01",
            "cuda-multimem",
            "nccl-plain",
            "nccl-symmetric",
        ] {
            assert!(svg.contains(s), "{s} missing from the chart");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(20_454), "2026-01-01");
        assert_eq!(civil_date(11_016), "2000-02-29");
        assert!(valid_date(&today()));
        assert!(!valid_date("2026-1-01"));
    }
}
