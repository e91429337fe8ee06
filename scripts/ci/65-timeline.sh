#!/usr/bin/env bash
# The memory timeline: `memgov run --trace` records a workload, `memgov
# report` turns it into one HTML page, and headless Chromium draws that page
# with the network off: the trace must count what the run counts, the page
# must say what it drew with each context's peak the snapshot's, list the
# call sites the trace names with the figures the run's snapshot gives them,
# and its screenshot must hold the plot (pixels of the role colours inside
# the chart); and where the run's snapshot says a block cache was used, the
# trace and the page must show it (cached blocks, and their reuse or trim).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust
command -v chromium-headless-shell >/dev/null || apt_install chromium-headless-shell

target="$(cargo_target_dir)"
dir="$target/timeline"
rm -rf "$dir" && mkdir -p "$dir"
cargo build --locked --release -p memgov-cli
memgov="$target/release/memgov"
"$memgov" run --json --trace "$dir/trace.json" --snapshot "$dir/snapshot.json" > "$dir/run.json"
# What the run counts, per context, its trace counts too.
python3 - "$dir/trace.json" "$dir/run.json" <<'PY'
import json, sys
t, run = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
events = t["memgovEvents"]
kinds = {}
for e in events:
    kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
print("trace:", len(t["traceEvents"]), "Chrome trace events;", ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
for k in ("registered", "stream created", "allocated", "released", "retired", "refused", "pressure",
          "reserved", "retire begun", "torn down"):
    assert kinds.get(k), f"the trace has no '{k}' event"
assert any(e.get("ph") == "C" for e in t["traceEvents"]), "no counter track"
provoked = {r["error"] for r in run["expected_refusals"]}
def count(ctx, kind):
    return sum(1 for e in events if e["context"] == ctx and e["kind"] == kind and e.get("note") not in provoked)
for c in run["per_context"]:
    name = c["context"]
    for kind, figure in (("allocated", "allocations"), ("pressure", "pressure_events"), ("refused", "refusals"),
                         ("retired", "retired"), ("abandoned", "abandoned")):
        assert count(name, kind) == c[figure], f"{name}: {count(name, kind)} '{kind}' events, the run counts {c[figure]} {figure}"
    # Every backend allocation ends in a release, or, kept by the block
    # cache, in a trim of its block (the run ends with every cache empty);
    # every cached block was reused or trimmed.
    blocks = sum(1 for e in events if e["context"] == name and e["kind"] == "trimmed" and e["role"] is not None)
    assert count(name, "released") + blocks == count(name, "allocated"), \
        f"{name}: {count(name, 'allocated')} allocated, {count(name, 'released')} released and {blocks} cached blocks trimmed do not balance"
    assert count(name, "cached") == count(name, "reused") + blocks, \
        f"{name}: {count(name, 'cached')} cached, {count(name, 'reused')} reused and {blocks} trimmed do not balance"
reused = sum(1 for e in events if e["kind"] == "reused")
assert reused == run["cache"]["hits"], f"the trace has {reused} 'reused' events, the run counts {run['cache']['hits']} cache hits"
kv = run["kv_reservations"]
assert kinds["reserved"] == kv["reserved"] + kv["reserved_after_eviction"], (kinds["reserved"], kv)
print("trace: every figure of the run per context is in it")
PY
"$memgov" report "$dir/trace.json" -o "$dir/timeline.html"
if grep -Eq '(src|href)="(https?:)?//' "$dir/timeline.html"; then
    echo "FAILED: the page loads something from the network"; exit 1
fi
browse() {
    chromium-headless-shell --no-sandbox --disable-gpu --hide-scrollbars \
        --proxy-server='127.0.0.1:9' --window-size=1200,900 "$@" "file://$dir/timeline.html" 2>/dev/null
}
browse --dump-dom > "$dir/dom.html"
status="$(grep -o '<p id="status">[^<]*' "$dir/dom.html" | sed 's/.*>//')"
echo "page: $status"
[[ "$status" =~ ^drew\ ([1-9][0-9]*)\ series\ and\ ([0-9]+)\ markers\ for\ 3\ context\(s\)\;\ peaks\ agree$ ]] || { echo "FAILED: the page did not draw, or its peaks disagree with the trace's"; exit 1; }
# Each context's chart, titled with the peak its snapshot reports, in the
# order the contexts began (one time axis: the swap's source first).
python3 - "$dir/dom.html" "$dir/run.json" <<'PY'
import json, re, sys
dom, run = open(sys.argv[1]).read(), json.load(open(sys.argv[2]))
drawn = re.findall(r'<section class="context" data-context="([^"]*)"><h2 data-peak="(\d+)">([^<]*)</h2><canvas', dom)
print("page: charts", [(c, int(p)) for c, p, _ in drawn])
want = [(c["context"], c["peak"]) for c in run["peak_bytes"]["per_context"]]
assert sorted((c, int(p)) for c, p, _ in drawn) == sorted(want), f"the page's peaks {drawn} are not the snapshot's {want}"
for c, p, title in drawn:
    assert f"({p} bytes)" in title, title
assert [c for c, _, _ in drawn][:1] == ["llm@gpu0"], drawn
PY
# The block cache on the page: each context whose snapshot says its cache
# kept or served a block has, in its table of events, 'cached' blocks and
# their reuse or trim.
python3 - "$dir/dom.html" "$dir/snapshot.json" <<'PY'
import html, json, re, sys
dom, snap = open(sys.argv[1]).read(), json.load(open(sys.argv[2]))
used = [c["label"] for c in snap["contexts"] if c["cache"]["hits"] or c["cache"]["cached_bytes"]]
assert used, "the run's snapshot shows no block cache in use: the page's cache band is not checked"
for ctx, body in re.findall(r'<section class="context" data-context="([^"]*)">(.*?)</section>', dom, re.S):
    ctx = html.unescape(ctx)
    if ctx not in used:
        continue
    table = re.search(r'<table class="events">(.*?)</table>', body, re.S)
    counts = {k: int(n) for k, n in re.findall(r"<tr><td>([^<]*)</td><td>(\d+)</td></tr>", table.group(1) if table else "")}
    print(f"page: {ctx}: the block cache: cached {counts.get('cached', 0)}, reused {counts.get('reused', 0)}, trimmed {counts.get('trimmed', 0)}")
    assert counts.get("cached", 0) > 0, f"{ctx}: its snapshot shows the block cache in use, the page has no 'cached' event: {counts}"
    assert counts.get("reused", 0) + counts.get("trimmed", 0) > 0, f"{ctx}: no 'reused' or 'trimmed' event on the page: {counts}"
    used.remove(ctx)
assert not used, f"no chart for the contexts whose cache was used: {used}"
PY
# The per-site table, from the run's own trace: the page drawn from the
# trace's events up to the moment the run took its snapshot lists, per
# context, the snapshot's sites (site and label) with the same live bytes,
# buffers, peak, allocations and refusals.
python3 - "$dir/trace.json" "$dir/run.json" "$dir/at-snapshot.json" <<'PY'
import json, sys
t, run = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
at = run["snapshot"]["trace_t_us"]
assert at is not None, run["snapshot"]
events = t["memgovEvents"]
sited = {e["kind"] for e in events if e.get("site")}
print("trace: event kinds that name their site:", sorted(sited))
assert {"allocated", "released"} <= sited, "the run's trace does not name its sites"
t["memgovEvents"] = [e for e in events if e["t_us"] <= at]
print(f"trace: {len(t['memgovEvents'])} of {len(events)} events up to the snapshot at {at:.0f} us")
json.dump(t, open(sys.argv[3], "w"))
PY
"$memgov" report "$dir/at-snapshot.json" -o "$dir/sites.html" >/dev/null
chromium-headless-shell --no-sandbox --disable-gpu --proxy-server='127.0.0.1:9' --dump-dom "file://$dir/sites.html" 2>/dev/null > "$dir/sites-dom.html"
python3 - "$dir/sites-dom.html" "$dir/snapshot.json" <<'PY'
import html, json, re, sys
dom, snap = open(sys.argv[1]).read(), json.load(open(sys.argv[2]))
row = re.compile(r'<tr data-live="(\d+)" data-peak="(\d+)"><td>([^<]*)</td><td>([^<]*)</td><td>[^<]*</td>'
                 r'<td>(\d+)</td><td>[^<]*</td><td>(\d+)</td><td>(\d+)</td></tr>')
page = {}
for ctx, body in re.findall(r'<section class="context" data-context="([^"]*)">(.*?)</section>', dom, re.S):
    tables = re.findall(r'<table class="sites">(.*?)</table>', body, re.S)
    assert len(tables) <= 1, tables
    page[html.unescape(ctx)] = sorted(
        (html.unescape(site), html.unescape(label), int(live), int(n), int(peak), int(a), int(r))
        for live, peak, site, label, n, a, r in row.findall(tables[0] if tables else ""))
want = {c["label"]: sorted((s["site"], s["label"] or "", s["live_bytes"], s["live_count"], s["peak_bytes"],
                            s["allocations"], s["refusals"]) for s in c["sites"])
        for c in snap["contexts"]}
for name in sorted(set(page) | set(want)):
    print(f"page: {name}: {len(page.get(name, []))} sites, {sum(r[2] for r in page.get(name, []))} bytes live;",
          f"snapshot: {len(want.get(name, []))} sites, {sum(r[2] for r in want.get(name, []))} bytes live")
    assert page.get(name, []) == want.get(name, []), f"{name}: the page's sites {page.get(name)} are not the snapshot's {want.get(name)}"
assert any(r[2] > 0 for rows in page.values() for r in rows), "no site holds live bytes at the snapshot"
PY
browse --screenshot="$dir/timeline.png" >/dev/null
python3 - "$dir/timeline.png" <<'PY'
# A PNG decoder small enough to read here (8-bit RGB/RGBA, no interlace),
# then count pixels of the role colours the page draws with.
import struct, sys, zlib
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
pos, idat, w = 8, b"", 0
while pos < len(data):
    n, kind = struct.unpack(">I4s", data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + n]
    if kind == b"IHDR":
        w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
        assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
        bpp = 3 if ctype == 2 else 4
    elif kind == b"IDAT":
        idat += body
    pos += 12 + n
raw, stride = zlib.decompress(idat), w * bpp
prev, rows, i = bytearray(stride), [], 0
for _ in range(h):
    f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride]); i += 1 + stride
    for x in range(stride):
        a = line[x - bpp] if x >= bpp else 0
        b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
        if f == 1: line[x] = (line[x] + a) & 255
        elif f == 2: line[x] = (line[x] + b) & 255
        elif f == 3: line[x] = (line[x] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c; pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    rows.append(line); prev = line
colours = {"weights": (0x1f, 0x77, 0xb4), "kv-cache": (0x94, 0x67, 0xbd), "activation": (0x2c, 0xa0, 0x2c)}
# Only inside the first chart (below the legend), so the legend's swatches do not count.
counts = {k: 0 for k in colours}
for y in range(170, min(h, 430)):
    row = rows[y]
    for x in range(90, min(w, 1120)):
        px = tuple(row[x * bpp:x * bpp + 3])
        for k, c in colours.items():
            if all(abs(px[j] - c[j]) <= 24 for j in range(3)):
                counts[k] += 1
print("screenshot:", w, "x", h, "; plot pixels per role:", counts)
assert sum(counts.values()) > 500, "the screenshot has no plot in it"
PY
echo "timeline: trace, report and screenshot checked ($dir/timeline.png)"
