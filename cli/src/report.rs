//! `memgov report TRACE -o timeline.html`: one self-contained HTML page (no
//! network, no external script) that plots a memgov trace: live, pending and
//! cached bytes over time per context, role and stream, with refusals,
//! pressure, retire and teardown marked.
//!
//! The page draws on a canvas with a few hundred lines of inline script;
//! once drawn it records what it drew in `#status` (`drew N series …`), which
//! the suite reads back from headless Chromium along with a screenshot.

use clap::Args;
use serde_json::Value;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `memgov report`.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A trace written by `memgov run --trace FILE` or
    /// `memgov::trace::Trace::write_chrome_json`; or a snapshot (`memgov run
    /// --snapshot FILE`, a `ContextSnapshot` or `GovernorSnapshot` as JSON),
    /// printed as a page of text: who holds what, by role and call site.
    pub trace: PathBuf,
    /// With a snapshot first: a later snapshot, and what grew between the
    /// two is printed, by call site, most growth first.
    pub newer: Option<PathBuf>,
    /// The HTML file to write.
    #[arg(short, long, default_value = "timeline.html")]
    pub output: PathBuf,
}

/// Why a report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The trace could not be read.
    #[error("cannot read the trace {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The trace is not JSON.
    #[error("{path} is not a JSON trace ({source}); write one with `memgov run --trace FILE`")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// The trace has no memgov events.
    #[error("{path} has no `memgovEvents` array: it is not a memgov trace (write one with `memgov run --trace FILE`)")]
    NotMemgov {
        /// The file.
        path: PathBuf,
    },
    /// Two files were given and one is not a snapshot.
    #[error("{path} is not a memgov snapshot: comparing needs two (write them with `memgov run --snapshot FILE` or serde_json of ContextHandle::snapshot())")]
    NotSnapshot {
        /// The file.
        path: PathBuf,
    },
    /// The page could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Runs `memgov report`.
pub fn main(args: &ReportArgs) -> ExitCode {
    match snapshot_report(args) {
        Ok(Some(text)) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Ok(None) => {}
        Err(e) => {
            eprintln!("memgov report: {e}");
            return ExitCode::FAILURE;
        }
    }
    match write_report(args) {
        Ok(n) => {
            println!(
                "memgov report: {} events from {} drawn into {}",
                n,
                args.trace.display(),
                args.output.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("memgov report: {e}");
            ExitCode::FAILURE
        }
    }
}

fn read_json(path: &std::path::Path) -> Result<Value, ReportError> {
    let text = std::fs::read_to_string(path).map_err(|source| ReportError::Read {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ReportError::Parse {
        path: path.to_owned(),
        source,
    })
}

/// When the first file is a snapshot: its page, or with a second snapshot
/// the difference. `None` when it is not a snapshot (a trace).
pub fn snapshot_report(args: &ReportArgs) -> Result<Option<String>, ReportError> {
    let first = read_json(&args.trace)?;
    if !crate::snapshots::is_snapshot(&first) {
        return match &args.newer {
            Some(_) => Err(ReportError::NotSnapshot {
                path: args.trace.clone(),
            }),
            None => Ok(None),
        };
    }
    let name = args.trace.display().to_string();
    let Some(newer) = &args.newer else {
        return Ok(Some(crate::snapshots::render(&name, &first)));
    };
    let second = read_json(newer)?;
    if !crate::snapshots::is_snapshot(&second) {
        return Err(ReportError::NotSnapshot {
            path: newer.clone(),
        });
    }
    Ok(Some(crate::snapshots::diff(
        &name,
        &first,
        &newer.display().to_string(),
        &second,
    )))
}

/// Writes the page; returns how many memgov events it plots.
pub fn write_report(args: &ReportArgs) -> Result<usize, ReportError> {
    let text = std::fs::read_to_string(&args.trace).map_err(|source| ReportError::Read {
        path: args.trace.clone(),
        source,
    })?;
    let trace: Value = serde_json::from_str(&text).map_err(|source| ReportError::Parse {
        path: args.trace.clone(),
        source,
    })?;
    let Some(events) = trace.get("memgovEvents").and_then(Value::as_array) else {
        return Err(ReportError::NotMemgov {
            path: args.trace.clone(),
        });
    };
    let dropped = trace
        .get("memgovDropped")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let data = serde_json::json!({
        "source": args.trace.display().to_string(),
        "events": events,
        "dropped": dropped,
    });
    // `</` never appears inside the script: a label cannot close it.
    let data = data.to_string().replace("</", "<\\/");
    let page = PAGE.replace("/*MEMGOV_DATA*/null", &data);
    std::fs::write(&args.output, page).map_err(|source| ReportError::Write {
        path: args.output.clone(),
        source,
    })?;
    Ok(events.len())
}

const PAGE: &str = r##"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>memgov memory timeline</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #1a1a1a; background: #fff; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 16px; margin: 20px 0 4px; }
  .meta { color: #555; margin: 0 0 8px; }
  canvas { border: 1px solid #ddd; display: block; margin: 4px 0; }
  .legend span { display: inline-block; margin-right: 14px; }
  .legend i { display: inline-block; width: 18px; height: 3px; vertical-align: middle; margin-right: 4px; }
  table { border-collapse: collapse; margin-top: 6px; }
  td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: right; }
  th { background: #f4f4f4; }
  td:first-child, th:first-child { text-align: left; }
</style>
</head>
<body>
<h1>memgov memory timeline</h1>
<p class="meta" id="meta"></p>
<div class="legend" id="legend"></div>
<div id="charts"></div>
<p id="status">not drawn</p>
<script>
"use strict";
const DATA = /*MEMGOV_DATA*/null;
const ROLES = ["weights", "kv-cache", "activation", "workspace", "other"];
const COLORS = {"weights": "#1f77b4", "kv-cache": "#9467bd", "activation": "#2ca02c", "workspace": "#ff7f0e", "other": "#7f7f7f"};
const MARKS = {"refused": "#d62728", "pressure": "#ff9900", "abandoned": "#8c564b", "retire begun": "#555555", "torn down": "#000000"};
const KIND_LABEL = {"live": "live", "pending": "pending (released, not yet retired)", "cached": "cached"};

function fmtBytes(b) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, v = b;
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + u[i];
}

// Series per (context, scope) where scope is "" (the context) or a stream:
// points [t_us, {live: {role: bytes}, pending: {...}, cached: {...}}].
function build(events) {
  const contexts = new Map();
  const ctxOf = (name) => {
    if (!contexts.has(name)) contexts.set(name, {name, tracks: new Map(), marks: [], t0: Infinity, t1: -Infinity});
    return contexts.get(name);
  };
  const zero = () => ({live: {}, pending: {}, cached: {}});
  for (const e of events) {
    const c = ctxOf(e.context);
    c.t0 = Math.min(c.t0, e.t_us); c.t1 = Math.max(c.t1, e.t_us);
    if (MARKS[e.kind]) c.marks.push(e);
    let d = null;
    if (e.role) {
      if (e.kind === "allocated" || e.kind === "moved in") d = [["live", e.bytes]];
      else if (e.kind === "moved out") d = [["live", -e.bytes]];
      else if (e.kind === "released") d = [["live", -e.bytes], ["pending", e.bytes]];
      else if (e.kind === "retired" || e.kind === "abandoned") d = [["pending", -e.bytes]];
      else if (e.kind === "cached") d = [["cached", e.bytes]];
      else if (e.kind === "uncached") d = [["cached", -e.bytes]];
    }
    if (!d) continue;
    for (const scope of e.stream ? ["", e.stream] : [""]) {
      if (!c.tracks.has(scope)) c.tracks.set(scope, {cur: zero(), points: [], peak: 0});
      const tr = c.tracks.get(scope);
      for (const [kind, delta] of d) {
        tr.cur[kind][e.role] = Math.max(0, (tr.cur[kind][e.role] || 0) + delta);
      }
      tr.points.push([e.t_us, JSON.parse(JSON.stringify(tr.cur))]);
      let total = 0;
      for (const k of ["live", "pending", "cached"]) for (const r of ROLES) total += tr.cur[k][r] || 0;
      tr.peak = Math.max(tr.peak, total);
    }
  }
  return contexts;
}

let drawnSeries = 0, drawnMarks = 0;

function chart(parent, title, ctx, track, height) {
  const h = document.createElement(title.startsWith("context") ? "h2" : "h3");
  h.textContent = title + " — peak " + fmtBytes(track.peak) + " (" + track.peak + " bytes)";
  parent.appendChild(h);
  const cv = document.createElement("canvas");
  const W = 1100, H = height, L = 70, R = 10, T = 8, B = 24;
  cv.width = W; cv.height = H;
  parent.appendChild(cv);
  const g = cv.getContext("2d");
  const t0 = ctx.t0, t1 = Math.max(ctx.t1, t0 + 1);
  let ymax = 1;
  for (const [, v] of track.points) for (const k of ["live", "pending", "cached"]) for (const r of ROLES) ymax = Math.max(ymax, v[k][r] || 0);
  const x = (t) => L + (t - t0) / (t1 - t0) * (W - L - R);
  const y = (b) => H - B - b / ymax * (H - T - B);
  g.fillStyle = "#fff"; g.fillRect(0, 0, W, H);
  g.strokeStyle = "#e6e6e6"; g.fillStyle = "#555"; g.font = "11px sans-serif";
  for (let i = 0; i <= 4; i++) {
    const b = ymax * i / 4;
    g.beginPath(); g.moveTo(L, y(b)); g.lineTo(W - R, y(b)); g.stroke();
    g.fillText(fmtBytes(b), 4, y(b) + 4);
  }
  for (let i = 0; i <= 5; i++) {
    const t = t0 + (t1 - t0) * i / 5;
    g.fillText(((t - t0) / 1000).toFixed(1) + " ms", x(t) - (i === 5 ? 44 : 14), H - 6);
  }
  for (const m of ctx.marks) {
    if (title.startsWith("stream") && m.stream && ("stream " + m.stream) !== title) continue;
    g.strokeStyle = MARKS[m.kind]; g.lineWidth = 1;
    g.setLineDash(m.kind === "refused" || m.kind === "pressure" ? [] : [2, 3]);
    g.beginPath(); g.moveTo(x(m.t_us), T); g.lineTo(x(m.t_us), H - B); g.stroke();
    drawnMarks++;
  }
  const dashes = {live: [], pending: [6, 4], cached: [2, 2]};
  for (const k of ["live", "pending", "cached"]) {
    for (const r of ROLES) {
      if (!track.points.some(([, v]) => (v[k][r] || 0) > 0)) continue;
      g.strokeStyle = COLORS[r]; g.lineWidth = k === "live" ? 2.5 : 1.5; g.setLineDash(dashes[k]);
      g.beginPath();
      let prev = 0;
      g.moveTo(x(t0), y(0));
      for (const [t, v] of track.points) {
        const b = v[k][r] || 0;
        g.lineTo(x(t), y(prev)); g.lineTo(x(t), y(b)); prev = b;
      }
      g.lineTo(x(t1), y(prev));
      g.stroke();
      drawnSeries++;
    }
  }
  g.setLineDash([]);
}

function main() {
  if (!DATA) { document.getElementById("status").textContent = "no data"; return; }
  const contexts = build(DATA.events);
  const meta = document.getElementById("meta");
  meta.textContent = DATA.events.length + " events from " + DATA.source + "; " + contexts.size + " context(s)" +
    (DATA.dropped ? "; " + DATA.dropped + " events were dropped past the trace's limit" : "") +
    ". Solid: live; dashed: pending (released, not yet retired); dotted: cached. Vertical lines: refusals (red), pressure (orange), abandoned releases (brown), retire and teardown (dashed grey, black).";
  const legend = document.getElementById("legend");
  for (const r of ROLES) {
    const s = document.createElement("span");
    s.innerHTML = '<i style="background:' + COLORS[r] + '"></i>' + r;
    legend.appendChild(s);
  }
  const charts = document.getElementById("charts");
  for (const ctx of contexts.values()) {
    const whole = ctx.tracks.get("") || {points: [], peak: 0};
    chart(charts, "context " + ctx.name, ctx, whole, 260);
    for (const [scope, tr] of ctx.tracks) if (scope !== "") chart(charts, "stream " + scope, ctx, tr, 140);
    const counts = {};
    for (const m of ctx.marks) counts[m.kind] = (counts[m.kind] || 0) + 1;
    const tbl = document.createElement("table");
    tbl.innerHTML = "<tr><th>event</th><th>count</th></tr>" +
      Object.keys(MARKS).map(k => "<tr><td>" + k + "</td><td>" + (counts[k] || 0) + "</td></tr>").join("");
    charts.appendChild(tbl);
  }
  document.getElementById("status").textContent =
    "drew " + drawnSeries + " series and " + drawnMarks + " markers for " + contexts.size + " context(s)";
}
main();
</script>
</body>
</html>
"##;
