#!/usr/bin/env bash
# The declared MSRVs are true: no locked normal or build dependency of a
# workspace crate, direct or transitive, declares a higher `rust-version`
# than the crate itself. Checked for each platform a crate is built on
# (Linux, Windows, macOS), so a dependency one of them pulls in counts too;
# every feature is on; dev-dependencies and `cfg(loom)` dependencies only
# build the tests and are left out. A crate's own use of the standard library
# is held to its `rust-version` by clippy's `incompatible_msrv` lint.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust

metadata="$(mktemp)"
trap 'rm -f "$metadata"' EXIT
for target in x86_64-unknown-linux-gnu x86_64-pc-windows-msvc aarch64-apple-darwin; do
    cargo metadata --locked --all-features --format-version 1 --filter-platform "$target" >"$metadata"
    python3 - "$target" "$metadata" <<'PY'
import json, sys

target, path = sys.argv[1:]
meta = json.load(open(path))
packages = {p['id']: p for p in meta['packages']}
nodes = {n['id']: n for n in meta['resolve']['nodes']}

def version(v):
    return tuple(int(x) for x in v.split(".")) if v else None

members = set(meta["workspace_members"])
violations = 0
for member in sorted(meta["workspace_members"], key=lambda i: packages[i]["name"]):
    crate = packages[member]
    floor = version(crate.get("rust_version"))
    if floor is None:
        print(f"msrv: {crate['name']} declares no rust-version")
        violations += 1
        continue
    # Walk normal and build edges only; remember who pulled each package in.
    parent, stack = {}, [member]
    while stack:
        node = stack.pop()
        for dep in nodes[node]["deps"]:
            kinds = {k['kind'] for k in dep['dep_kinds']}
            if not kinds & {None, "build"} or dep["pkg"] in parent:
                continue
            parent[dep["pkg"]] = node
            stack.append(dep["pkg"])
    worst = None
    for dep in parent:
        needs = version(packages[dep].get("rust_version"))
        if needs is None:
            continue
        if needs > floor:
            chain, at = [], dep
            while at != member:
                chain.append(f"{packages[at]['name']} {packages[at]['version']}")
                at = parent[at]
            print(f"msrv: {crate['name']} declares rust-version {crate['rust_version']}, "
                  f"but {chain[0]} needs {packages[dep]['rust_version']} on {target} "
                  f"(through {' <- '.join(chain[1:]) or 'a direct dependency'}); "
                  f"raise the crate's rust-version or lock an older {packages[dep]['name']}")
            violations += 1
        if dep not in members and (worst is None or needs > worst[0]):
            worst = (needs, packages[dep]["name"], packages[dep]["rust_version"])
    if worst:
        print(f"msrv: {target}: {crate['name']} {crate['rust_version']}: "
              f"highest floor of a third-party dependency {worst[2]} ({worst[1]})")
if violations:
    print(f"msrv: FAILED: {violations} violation(s) on {target}")
    sys.exit(1)
PY
done
echo "msrv: every crate's rust-version covers its locked dependencies on every platform"
