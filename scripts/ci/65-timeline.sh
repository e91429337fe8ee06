#!/usr/bin/env bash
# The memory timeline: `memgov run --trace` records a workload, `memgov
# report` turns it into one HTML page, and headless Chromium draws that page
# with the network off: the page must say what it drew, and its screenshot
# must hold the plot (pixels of the role colours inside the chart).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust
command -v chromium-headless-shell >/dev/null || apt_install chromium-headless-shell

target="$(cargo_target_dir)"
dir="$target/timeline"
rm -rf "$dir" && mkdir -p "$dir"
cargo build --locked --release -p memgov-cli
memgov="$target/release/memgov"
"$memgov" run --trace "$dir/trace.json" > "$dir/run.log"
python3 - "$dir/trace.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
kinds = {}
for e in t["memgovEvents"]:
    kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
print("trace:", len(t["traceEvents"]), "Chrome trace events;", ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
for k in ("allocated", "released", "retired", "refused", "retire begun", "torn down"):
    assert kinds.get(k), f"the trace has no '{k}' event"
assert any(e.get("ph") == "C" for e in t["traceEvents"]), "no counter track"
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
[[ "$status" =~ ^drew\ ([1-9][0-9]*)\ series\ and\ ([0-9]+)\ markers ]] || { echo "FAILED: the page did not draw"; exit 1; }
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
