//! `memgov report TRACE -o timeline.html`: one self-contained HTML page (no
//! network, no external script) that plots a memgov trace on one time axis
//! for every context: live bytes stacked by role, the bytes its block cache
//! keeps (`cached` events in, `reused` and role-bearing `trimmed` out) as a
//! band of their own above them, with pending and reserved bytes above
//! those, per context and per stream; refusals, pressure, sleeps, wakes,
//! trims (of the cache, and for another process), abandoned releases,
//! retire and teardown marked; a count of every
//! event kind per context; and, when the trace's events name their call
//! sites (a `site` field, an optional `label`: `memgov run --trace`, and a
//! trace of contexts with attribution on), a table per site and label (each
//! row's exact live and peak bytes in its `data-live` and `data-peak`), or the
//! figures per site of a trace's `memgovSites` array (objects with
//! `context`, `site`, `label`, `live_bytes`, `live_count`, `peak_bytes`,
//! `allocations`, `refusals`) where it has them. A site's row counts its
//! buffers while they are live: a `reused` block is an allocation at the
//! site that asked for it, a `cached` one a release at the site that held
//! it; a block in the cache belongs to no site (as in the snapshot's
//! `sites`, which the cache's own figures sit beside).
//!
//! Each chart's title states the peak of live and cached bytes that chart
//! plots (the books count a cached block as live: it keeps its charge); the
//! page compares each context's with the peak computed here from the same
//! events ([`live_peaks`], which the snapshot's `peak` equals) and says in
//! `#status` whether they agree (`drew N series and M markers for K
//! context(s); peaks agree`), which the suite reads back from headless
//! Chromium along with a screenshot.

use clap::Args;
use serde_json::Value;
use std::collections::BTreeMap;
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
        "peaks": live_peaks(events),
        "sites": trace.get("memgovSites").cloned().unwrap_or(Value::Null),
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

/// Each context's highest total of live and cached bytes over the trace's
/// events (`allocated` adds, `released` and a block's `trimmed` take away;
/// `cached` and `reused` move bytes between live and cached, and a move
/// between streams changes no context's total): what the context's
/// snapshot reports as its `peak`
/// when the trace holds every event (with `Tuning::exact_peak`, or one
/// stream), and what the page's title for the context must show.
pub fn live_peaks(events: &[Value]) -> BTreeMap<String, u64> {
    let mut now: BTreeMap<String, (i128, u64)> = BTreeMap::new();
    for e in events {
        let (Some(context), Some(kind)) = (
            e.get("context").and_then(Value::as_str),
            e.get("kind").and_then(Value::as_str),
        ) else {
            continue;
        };
        let bytes = i128::from(e.get("bytes").and_then(Value::as_u64).unwrap_or(0));
        let entry = now.entry(context.to_owned()).or_default();
        // A trim with no role is a process trim's summary: its blocks are
        // role-bearing trims of their own.
        let has_role = e.get("role").is_some_and(|r| !r.is_null());
        match kind {
            "allocated" => entry.0 += bytes,
            "released" => entry.0 -= bytes,
            "trimmed" if has_role => entry.0 -= bytes,
            _ => continue,
        }
        entry.1 = entry.1.max(u64::try_from(entry.0).unwrap_or(0));
    }
    now.into_iter().map(|(c, (_, peak))| (c, peak)).collect()
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
  h3 { font-size: 14px; margin: 10px 0 2px; }
  .meta { color: #555; margin: 0 0 8px; }
  canvas { border: 1px solid #ddd; display: block; margin: 4px 0; }
  .legend span { display: inline-block; margin-right: 14px; }
  .legend i { display: inline-block; width: 14px; height: 10px; vertical-align: middle; margin-right: 4px; }
  table { border-collapse: collapse; margin: 6px 16px 6px 0; display: inline-table; vertical-align: top; }
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
// Vertical lines; every other kind is counted in the context's table.
const CACHED = "#c5b0d5";
const MARKS = {"refused": "#d62728", "pressure": "#ff9900", "abandoned": "#8c564b", "slept": "#e377c2", "woke": "#17becf", "trimmed": "#bcbd22", "retire begun": "#555555", "torn down": "#000000"};

function fmtBytes(b) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, v = b;
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + u[i];
}

// Per context: tracks by scope ("" the context, else a stream), each a list
// of points [t_us, {live: {role: bytes}, cached, pending, reserved}] after every
// event that changed it; the marks; a count per event kind; per-site figures.
function build(events) {
  const contexts = new Map();
  let t0 = Infinity, t1 = -Infinity;
  const ctxOf = (name) => {
    if (!contexts.has(name)) contexts.set(name, {name, tracks: new Map(), marks: [], counts: {}, sites: new Map(), t0: Infinity, t1: -Infinity});
    return contexts.get(name);
  };
  for (const e of events) {
    t0 = Math.min(t0, e.t_us); t1 = Math.max(t1, e.t_us);
    const c = ctxOf(e.context);
    c.t0 = Math.min(c.t0, e.t_us); c.t1 = Math.max(c.t1, e.t_us);
    c.counts[e.kind] = (c.counts[e.kind] || 0) + 1;
    if (MARKS[e.kind]) c.marks.push(e);
    if (e.site) site(c, e);
    // [what, role, delta, streams too]
    const d = [];
    if (e.role) {
      if (e.kind === "allocated" || e.kind === "moved in") d.push(["live", e.role, e.bytes, true]);
      else if (e.kind === "moved out") d.push(["live", e.role, -e.bytes, true]);
      else if (e.kind === "released") d.push(["live", e.role, -e.bytes, true], ["pending", null, e.bytes, true]);
      else if (e.kind === "cached") d.push(["live", e.role, -e.bytes, true], ["cached", null, e.bytes, true]);
      else if (e.kind === "reused") d.push(["cached", null, -e.bytes, true], ["live", e.role, e.bytes, true]);
      else if (e.kind === "trimmed") d.push(["cached", null, -e.bytes, true], ["pending", null, e.bytes, true]);
      else if (e.kind === "retired" || e.kind === "abandoned") d.push(["pending", null, -e.bytes, true]);
    }
    // An allocation out of a reservation names it: its bytes leave the reserved ones.
    if (e.kind === "allocated" && e.note != null) d.push(["reserved", null, -e.bytes, false]);
    if (e.kind === "reserved") d.push(["reserved", null, e.bytes, false]);
    if (e.kind === "unreserved") d.push(["reserved", null, -e.bytes, false]);
    if (!d.length) continue;
    for (const scope of e.stream ? ["", e.stream] : [""]) {
      if (!c.tracks.has(scope)) c.tracks.set(scope, {cur: {live: {}, cached: 0, pending: 0, reserved: 0}, points: []});
      const tr = c.tracks.get(scope);
      for (const [what, role, delta, streams] of d) {
        if (scope !== "" && !streams) continue;
        if (role) tr.cur.live[role] = Math.max(0, (tr.cur.live[role] || 0) + delta);
        else tr.cur[what] = Math.max(0, tr.cur[what] + delta);
      }
      tr.points.push([e.t_us, {live: Object.assign({}, tr.cur.live), cached: tr.cur.cached, pending: tr.cur.pending, reserved: tr.cur.reserved}]);
    }
  }
  return {contexts, t0, t1: Math.max(t1, t0 + 1)};
}

// One row per (site, label), as a snapshot's `sites` has them.
function site(c, e) {
  const key = e.site + "\n" + (e.label || "");
  if (!c.sites.has(key)) c.sites.set(key, {site: e.site, label: e.label || "", live: 0, count: 0, peak: 0, allocations: 0, refusals: 0});
  const s = c.sites.get(key);
  if (e.kind === "allocated" || e.kind === "reused") { s.allocations++; s.count++; s.live += e.bytes; s.peak = Math.max(s.peak, s.live); }
  else if (e.kind === "released" || e.kind === "cached") { s.count = Math.max(0, s.count - 1); s.live = Math.max(0, s.live - e.bytes); }
  else if (e.kind === "refused") s.refusals++;
}

let drawnSeries = 0, drawnMarks = 0;

// One chart on the page's time axis [t0, t1]: live bytes stacked by role
// (filled), cached bytes above them (filled, hatched), pending above those
// (dashed), reserved above those (dotted). Returns the highest stack of live
// and cached bytes it drew.
function chart(parent, heading, title, ctx, track, axis, height) {
  const h = document.createElement(heading);
  parent.appendChild(h);
  const cv = document.createElement("canvas");
  const W = 1100, H = height, L = 70, R = 10, T = 8, B = 24;
  cv.width = W; cv.height = H;
  parent.appendChild(cv);
  const g = cv.getContext("2d");
  const {t0, t1} = axis;
  const liveOf = (v) => ROLES.reduce((a, r) => a + (v.live[r] || 0), 0);
  const heldOf = (v) => liveOf(v) + v.cached;
  let ymax = 1;
  for (const [, v] of track.points) ymax = Math.max(ymax, heldOf(v) + v.pending + v.reserved);
  const x = (t) => L + (t - t0) / (t1 - t0) * (W - L - R);
  const y = (b) => H - B - b / ymax * (H - T - B);
  g.fillStyle = "#fff"; g.fillRect(0, 0, W, H);
  // Before the context's first event and after its last: shaded.
  g.fillStyle = "#f3f3f3";
  g.fillRect(L, T, x(ctx.t0) - L, H - T - B);
  g.fillRect(x(ctx.t1), T, W - R - x(ctx.t1), H - T - B);
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
  // A step function through the points: f(v) bytes from each point on.
  const steps = (f) => {
    const out = [[t0, 0]];
    for (const [t, v] of track.points) out.push([t, f(v)]);
    return out;
  };
  // The bands bottom up: each role's live bytes, then the cached bytes.
  const BANDS = [...ROLES, "cached"];
  const amount = (r, v) => (r === "cached" ? v.cached : v.live[r]) || 0;
  const below = (r, v) => BANDS.slice(0, BANDS.indexOf(r)).reduce((a, q) => a + amount(q, v), 0);
  let peak = 0;
  for (const r of BANDS) {
    if (!track.points.some(([, v]) => amount(r, v) > 0)) continue;
    const top = steps((v) => below(r, v) + amount(r, v));
    const bottom = steps((v) => below(r, v));
    g.beginPath();
    let prev = 0;
    g.moveTo(x(t0), y(0));
    for (const [t, b] of top) { g.lineTo(x(t), y(prev)); g.lineTo(x(t), y(b)); prev = b; peak = Math.max(peak, b); }
    g.lineTo(x(t1), y(prev));
    // Back along the bottom: bottom[i]'s value holds from its time to the next one's.
    g.lineTo(x(t1), y(bottom[bottom.length - 1][1]));
    for (let i = bottom.length - 1; i > 0; i--) {
      g.lineTo(x(bottom[i][0]), y(bottom[i][1]));
      g.lineTo(x(bottom[i][0]), y(bottom[i - 1][1]));
    }
    g.lineTo(x(t0), y(0));
    g.closePath();
    g.fillStyle = r === "cached" ? CACHED : COLORS[r]; g.fill();
    if (r === "cached") {
      // Hatched: bytes still charged, held by no buffer.
      g.save(); g.clip();
      g.strokeStyle = "#ffffff"; g.lineWidth = 1;
      for (let hx = L - H; hx < W; hx += 8) { g.beginPath(); g.moveTo(hx, H); g.lineTo(hx + H, 0); g.stroke(); }
      g.restore();
    }
    drawnSeries++;
  }
  const lines = [["pending", (v) => heldOf(v) + v.pending, [6, 4]], ["reserved", (v) => heldOf(v) + v.pending + v.reserved, [2, 2]]];
  for (const [what, f, dash] of lines) {
    if (!track.points.some(([, v]) => v[what] > 0)) continue;
    g.strokeStyle = "#222"; g.lineWidth = 1.5; g.setLineDash(dash);
    g.beginPath();
    let prev = 0;
    g.moveTo(x(t0), y(0));
    for (const [t, b] of steps(f)) { g.lineTo(x(t), y(prev)); g.lineTo(x(t), y(b)); prev = b; }
    g.lineTo(x(t1), y(prev));
    g.stroke();
    drawnSeries++;
  }
  g.setLineDash([]);
  for (const m of ctx.marks) {
    if (heading === "h3" && m.stream && ("stream " + m.stream) !== title) continue;
    g.strokeStyle = MARKS[m.kind]; g.lineWidth = 1;
    g.setLineDash(m.kind === "retire begun" || m.kind === "torn down" ? [2, 3] : []);
    g.beginPath(); g.moveTo(x(m.t_us), T); g.lineTo(x(m.t_us), H - B); g.stroke();
    drawnMarks++;
  }
  g.setLineDash([]);
  const cached = track.points.some(([, v]) => v.cached > 0);
  h.textContent = title + " — peak " + (cached ? "live + cached " : "live ") + fmtBytes(peak) + " (" + peak + " bytes)";
  h.dataset.peak = String(peak);
  return peak;
}

function table(parent, head, rows) {
  const tbl = document.createElement("table");
  const cell = (tag, s) => { const c = document.createElement(tag); c.textContent = s; return c; };
  const tr = document.createElement("tr");
  for (const s of head) tr.appendChild(cell("th", s));
  tbl.appendChild(tr);
  for (const row of rows) {
    const r = document.createElement("tr");
    for (const s of row) r.appendChild(cell("td", s));
    tbl.appendChild(r);
  }
  parent.appendChild(tbl);
  return tbl;
}

function main() {
  if (!DATA) { document.getElementById("status").textContent = "no data"; return; }
  const {contexts, t0, t1} = build(DATA.events);
  const axis = {t0, t1};
  const meta = document.getElementById("meta");
  meta.textContent = DATA.events.length + " events from " + DATA.source + "; " + contexts.size + " context(s) on one time axis (" +
    ((t1 - t0) / 1000).toFixed(1) + " ms; shaded: before a context's first event and after its last)" +
    (DATA.dropped ? "; " + DATA.dropped + " events were dropped past the trace's limit" : "") +
    ". Filled: live bytes stacked by role, and above them (hatched) the bytes the block cache keeps: still charged, held by no buffer; " +
    "dashed: live + cached + pending (released or trimmed, not yet retired); dotted: live + cached + pending + reserved. " +
    "Vertical lines: refusals (red), pressure (orange), sleeps (pink), wakes (cyan), trims of the block cache or for another process (olive), abandoned releases (brown), retire and teardown (dashed grey, black).";
  const legend = document.getElementById("legend");
  for (const r of ROLES) {
    const s = document.createElement("span");
    s.innerHTML = '<i style="background:' + COLORS[r] + '"></i>' + r;
    legend.appendChild(s);
  }
  const cachedKey = document.createElement("span");
  cachedKey.innerHTML = '<i style="background:' + CACHED + '"></i>cached (block cache)';
  legend.appendChild(cachedKey);
  const charts = document.getElementById("charts");
  const disagree = [];
  for (const ctx of contexts.values()) {
    const section = document.createElement("section");
    section.className = "context";
    section.dataset.context = ctx.name;
    charts.appendChild(section);
    const whole = ctx.tracks.get("") || {points: []};
    const peak = chart(section, "h2", "context " + ctx.name, ctx, whole, axis, 260);
    const expected = DATA.peaks ? DATA.peaks[ctx.name] : undefined;
    if (expected !== undefined && expected !== peak) disagree.push(ctx.name + ": drew " + peak + ", the trace's peak is " + expected);
    for (const [scope, tr] of ctx.tracks) if (scope !== "") chart(section, "h3", "stream " + scope, ctx, tr, axis, 140);
    table(section, ["event", "count"], Object.keys(ctx.counts).sort().map(k => [k, String(ctx.counts[k])])).className = "events";
    // Figures per site a snapshot gave (`memgovSites`) win over those summed here.
    const given = Array.isArray(DATA.sites) ? DATA.sites.filter(u => u.context === ctx.name) : [];
    if (given.length) {
      ctx.sites = new Map(given.map(u => [u.site + "\n" + (u.label || ""), {site: u.site, label: u.label || "", live: u.live_bytes || 0,
        count: u.live_count || 0, peak: u.peak_bytes || 0, allocations: u.allocations || 0, refusals: u.refusals || 0}]));
    }
    if (ctx.sites.size) {
      const sites = [...ctx.sites.values()].sort((a, b) => b.peak - a.peak || b.live - a.live);
      const rows = sites.map(v => [v.site, v.label, fmtBytes(v.live), String(v.count), fmtBytes(v.peak), String(v.allocations), String(v.refusals)]);
      const tbl = table(section, ["site", "label", "live at the end", "buffers at the end", "peak live", "allocations", "refusals"], rows);
      tbl.className = "sites";
      // The exact bytes behind each row's rounded figures.
      sites.forEach((v, i) => { tbl.rows[i + 1].dataset.live = v.live; tbl.rows[i + 1].dataset.peak = v.peak; });
    }
  }
  document.getElementById("status").textContent =
    "drew " + drawnSeries + " series and " + drawnMarks + " markers for " + contexts.size + " context(s); " +
    (disagree.length ? "peaks disagree: " + disagree.join("; ") : "peaks agree");
}
main();
</script>
</body>
</html>
"##;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peak_counts_live_bytes_only_per_context() {
        let e = |context: &str, kind: &str, bytes: u64| serde_json::json!({"t_us": 0.0, "context": context, "stream": "s", "role": "weights", "kind": kind, "bytes": bytes});
        // A release leaves its bytes pending, not live: allocating again
        // before they retire does not raise the peak of live bytes.
        let events = [
            e("a", "allocated", 100),
            e("b", "allocated", 7),
            e("a", "released", 100),
            e("a", "allocated", 100),
            e("a", "moved out", 100),
            e("a", "moved in", 100),
            e("a", "retired", 100),
            e("a", "allocated", 50),
        ];
        let peaks = live_peaks(&events);
        assert_eq!(peaks.get("a"), Some(&150));
        assert_eq!(peaks.get("b"), Some(&7));
    }

    #[test]
    fn a_peak_counts_cached_bytes_until_a_trim_gives_them_back() {
        let e = |kind: &str, role: Option<&str>, bytes: u64| serde_json::json!({"t_us": 0.0, "context": "c", "stream": "s", "role": role, "kind": kind, "bytes": bytes});
        let w = Some("workspace");
        // Cached bytes stay charged: they count toward the peak as the
        // snapshot's does; reuse changes nothing; a block's trim, and only
        // it (a process trim's summary has no role), takes them away.
        let events = [
            e("allocated", w, 100),
            e("cached", w, 100),
            e("allocated", w, 50),
            e("reused", w, 100),
            e("cached", w, 100),
            e("trimmed", w, 100),
            e("trimmed", None, 100),
            e("allocated", w, 90),
            e("allocated", w, 20),
        ];
        assert_eq!(live_peaks(&events).get("c"), Some(&160));
    }
}
