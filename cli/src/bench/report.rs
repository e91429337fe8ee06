//! The table and the JSON object `memgov bench` prints.

use super::measure::Plan;
use super::row::Row;
use serde::Serialize;

fn fmt_num(v: Option<f64>) -> String {
    match v {
        None => "n/a".into(),
        Some(v) if v.abs() >= 100.0 => format!("{v:.0}"),
        Some(v) if v.abs() >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

fn fmt_met(m: Option<bool>) -> &'static str {
    match m {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "n/a",
    }
}

/// The table as text.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let header = [
        "figure",
        "median",
        "baseline",
        "base median",
        "ratio",
        "target",
        "met",
    ];
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.figure.clone(),
                r.value
                    .map_or("n/a".into(), |v| format!("{} {}", fmt_num(Some(v)), r.unit)),
                r.baseline.clone(),
                r.baseline_value
                    .map_or("-".into(), |v| format!("{} {}", fmt_num(Some(v)), r.unit)),
                r.ratio
                    .map_or("-".into(), |v| format!("{}x", fmt_num(Some(v)))),
                r.target.describe(r.unit),
                fmt_met(r.met).into(),
            ]
        })
        .collect();
    let mut width = header.map(str::len);
    for c in &cells {
        for (w, s) in width.iter_mut().zip(c.iter()) {
            *w = (*w).max(s.chars().count());
        }
    }
    let line = |c: &[String]| {
        let mut l = String::new();
        for (i, (s, w)) in c.iter().zip(width.iter()).enumerate() {
            if i > 0 {
                l.push_str(" | ");
            }
            let pad = w - s.chars().count();
            // Numbers right-aligned, text left-aligned.
            if matches!(i, 1 | 3 | 4) {
                l.push_str(&" ".repeat(pad));
                l.push_str(s);
            } else {
                l.push_str(s);
                l.push_str(&" ".repeat(pad));
            }
        }
        l.trim_end().to_owned() + "\n"
    };
    out.push_str(&line(&header.map(String::from)));
    out.push_str(&line(&width.map(|w| "-".repeat(w))));
    for c in &cells {
        out.push_str(&line(c));
    }
    let notes: Vec<_> = rows
        .iter()
        .filter_map(|r| r.note.as_ref().map(|n| format!("  {}: {n}\n", r.key)))
        .collect();
    if !notes.is_empty() {
        out.push_str("notes:\n");
        for n in notes {
            out.push_str(&n);
        }
    }
    out
}

/// The rows as one JSON object; with `error` (a failed `--check`), an
/// `"error"` member says why the run failed.
pub fn json(rows: &[Row], plan: &Plan, quick: bool, error: Option<&str>) -> String {
    #[derive(Serialize)]
    struct Report<'a> {
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<&'a str>,
        tool: &'static str,
        version: &'static str,
        mode: &'static str,
        samples: usize,
        cores: usize,
        rows: &'a [Row],
    }
    let report = Report {
        error,
        tool: "memgov bench",
        version: env!("CARGO_PKG_VERSION"),
        mode: if quick { "quick" } else { "full" },
        samples: plan.samples,
        cores: super::cores(),
        rows,
    };
    let mut text = serde_json::to_string_pretty(&report).expect("rows serialize");
    text.push('\n');
    text
}
