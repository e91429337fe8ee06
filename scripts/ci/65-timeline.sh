#!/usr/bin/env bash
# The memory timeline: `memgov run --trace` records a workload, `memgov
# report` turns it into one HTML page, and headless Chromium draws that page
# with the network off: the trace must count what the run counts, the page
# must say what it drew with each context's peak the snapshot's, list the
# call sites a trace names, and its screenshot must hold the plot (pixels of
# the role colours inside the chart).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust
command -v chromium-headless-shell >/dev/null || apt_install chromium-headless-shell

target="$(cargo_target_dir)"
dir="$target/timeline"
rm -rf "$dir" && mkdir -p "$dir"
cargo build --locked --release -p memgov-cli
memgov="$target/release/memgov"
"$memgov" run --json --trace "$dir/trace.json" > "$dir/run.json"
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
    assert count(name, "released") == count(name, "allocated"), f"{name}: allocated and released do not balance"
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
# The per-site table, on a copy of the trace whose allocations and releases
# this step gives three call sites (the largest holder first on the page),
# and whose `memgovSites` gives one context's figures per site.
python3 - "$dir/trace.json" "$dir/sites.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
site_of = {"weights": "src/load.rs:10:5", "kv-cache": "src/kv.rs:42:9", "activation": "src/step.rs:7:13"}
for e in t["memgovEvents"]:
    if e["kind"] in ("allocated", "released") and e["role"] in site_of:
        e["site"] = site_of[e["role"]]
# Figures per site as a snapshot gives them, for one context.
t["memgovSites"] = [{"context": "embedder@gpu0", "site": "src/embed.rs:3:1", "label": "embedder weights",
                     "live_bytes": 0, "live_count": 0, "peak_bytes": 41943040, "allocations": 26, "refusals": 0}]
json.dump(t, open(sys.argv[2], "w"))
PY
"$memgov" report "$dir/sites.json" -o "$dir/sites.html" >/dev/null
chromium-headless-shell --no-sandbox --disable-gpu --proxy-server='127.0.0.1:9' --dump-dom "file://$dir/sites.html" 2>/dev/null > "$dir/sites-dom.html"
python3 - "$dir/sites-dom.html" <<'PY'
import re, sys
dom = open(sys.argv[1]).read()
tables = re.findall(r'<table class="sites">(.*?)</table>', dom)
assert len(tables) == 3, f"{len(tables)} site tables, not one per context"
first = re.findall(r'<tr><td>([^<]*)</td>', tables[0])
print("page: sites of the first context, largest peak first:", first)
assert first[0] == "src/kv.rs:42:9", first
second = re.findall(r'<tr><td>([^<]*)</td><td>([^<]*)</td>', tables[1])
assert second == [("src/embed.rs:3:1", "embedder weights")], second
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
