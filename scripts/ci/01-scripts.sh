#!/usr/bin/env bash
# The suite's own scripts find build output through cargo, never under a
# literal `target/`, so that they work with CARGO_TARGET_DIR set (a shared
# cache, a CI runner's scratch disk, a developer's setting):
# * no script of the suite (scripts/, .ci/, backends/stand-ins/) names a
#   `target/` path outside a comment;
# * the README's main job (scripts/main.sh) and the timeline step (which
#   builds, runs and writes files of its own) run in a copy of this tree with
#   CARGO_TARGET_DIR set to a directory elsewhere, and pass, and the copy has
#   no `target/` afterwards: nothing was looked for or written there. That
#   directory is this tree's own build directory (cargo_target_dir), outside
#   the copy: the copy's build of the tool is the one the later steps run
#   (the bench smoke, the timeline), not a second release build of it.
# * every Cargo.lock in the repository (the workspace's and each example
#   workspace's) is current, so that the steps that build with `--locked`
#   do not fail half an hour in on a dependency added to memgov.
# * the README's install lines: its path dependency lines resolve in a new
#   project next to the repository, its git lines name the same packages at
#   the repository Cargo.toml names, and its tool lines say how the tool is
#   installed and where a build leaves it.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust

echo "--- no literal target/ paths in the suite's scripts"
# (This script names the pattern it looks for, and is not scanned.)
scripts=$(git ls-files -co --exclude-standard -- '*.sh' .ci/run |
    grep -E '^(scripts/|\.ci/|backends/stand-ins/)' | grep -vx 'scripts/ci/01-scripts.sh')
# A `target/` not preceded by a name character, `$`, `/` or `.`: a path
# relative to the repository (`$target/x`, `foo/target/x` and `$x_target/`
# are not). Comment lines are skipped.
# shellcheck disable=SC2086
bad=$(grep -nE '(^|[^A-Za-z0-9_$/.{-])target/' $scripts | grep -vE '^[^:]+:[0-9]+:[[:space:]]*#' || true)
if [ -n "$bad" ]; then
    echo "FAILED: these lines name a target/ path; use cargo_target_dir (scripts/common.sh):"
    echo "$bad"
    exit 1
fi
echo "$(echo "$scripts" | wc -l) scripts checked: none names a target/ path"

echo "--- every Cargo.lock is current"
for lock in $(git ls-files -- 'Cargo.lock' '*/Cargo.lock'); do
    manifest="$(dirname "$lock")/Cargo.toml"
    if ! out=$(cargo tree --locked --quiet --manifest-path "$manifest" 2>&1 >/dev/null); then
        echo "$out" | tail -5
        if echo "$out" | grep -q "cannot update the lock file"; then
            echo "FAILED: $lock is stale; run \`cargo update --workspace --manifest-path $manifest\` and commit it"
        else
            echo "FAILED: cargo could not resolve $manifest with its lock file"
        fi
        exit 1
    fi
    echo "$lock: current"
done

work="$(mktemp -d "${TMPDIR:-/tmp}/memgov-scripts.XXXXXX")"
trap 'rm -rf "$work"' EXIT

echo "--- the README's install lines"
# Until the crates are published, the README gives path and git dependency
# lines and installs the tool from the clone. The path lines resolve as
# written in a new project next to the repository (reached there as
# ../memgov); the git lines name the packages the path lines do, at the
# repository Cargo.toml names; the tool's lines name the package and where
# the built tool lands (scripts/main.sh, run below, builds it there).
repository=$(cargo metadata --locked --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(next(p["repository"] for p in json.load(sys.stdin)["packages"] if p["name"] == "memgov"))')
mkdir -p "$work/readme/app/src"
ln -s "$PWD" "$work/readme/memgov"
python3 - README.md "$work/readme/app" "$repository" <<'PY'
import re, sys
readme, app, repository = sys.argv[1], sys.argv[2], sys.argv[3]
text = open(readme).read()
def block(marker, lang):
    at = text.index("<!-- readme-install: " + marker)
    return re.compile(r"```" + lang + r"\n(.*?)```", re.S).search(text, at).group(1)
def deps(toml):
    return {m.group(1): m.group(2) for m in re.finditer(r"^([A-Za-z0-9_-]+) = \{(.*)\}$", toml, re.M)}
path, git, tool = block("path", "toml"), block("git", "toml"), block("tool", "sh")
wanted = {"memgov", "memgov-wgpu"}
assert set(deps(path)) == wanted, f"the README's path lines name {sorted(deps(path))}, not {sorted(wanted)}"
assert set(deps(git)) == wanted, f"the README's git lines name {sorted(deps(git))}, not {sorted(wanted)}"
for name, spec in deps(git).items():
    url = re.search(r'git = "([^"]+)"', spec)
    assert url and url.group(1) == repository, f"{name}: git line {spec!r} does not name {repository}"
assert f"cargo install --git {repository} memgov-cli" in tool, tool
assert "cargo install --path ../memgov/cli" in tool, tool
assert "cargo build --release -p memgov-cli" in tool and "target/release/memgov" in tool, tool
open(f"{app}/Cargo.toml", "w").write(
    '[package]\nname = "readme-app"\nversion = "0.1.0"\nedition = "2021"\n\n[workspace]\n\n' + path)
open(f"{app}/src/main.rs", "w").write("fn main() {}\n")
PY
(cd "$work/readme/app" && { cargo metadata --offline --format-version 1 >/dev/null 2>&1 ||
    cargo metadata --format-version 1 >/dev/null; }) ||
    { echo "FAILED: the README's path dependency lines do not resolve in a project next to the repository"; exit 1; }
echo "README install lines: the path lines resolve next to the repository; the git lines name $repository"

echo "--- scripts/main.sh and the timeline step in a copy of the tree with CARGO_TARGET_DIR elsewhere"
mkdir -p "$work/tree"
# The tracked files and the new ones git does not ignore, as they are now (a
# file deleted in the work tree is still listed: copy what exists).
git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do
    if [ -e "$f" ]; then printf '%s\0' "$f"; fi
done | xargs -0 cp --parents -t "$work/tree"
[ ! -e "$work/tree/target" ] || { echo "FAILED: the copy already has a target/"; exit 1; }
build="$(cargo_target_dir)"
case "$build/" in "$work/tree/"*) echo "FAILED: the build directory $build is inside the copy"; exit 1 ;; esac
rm -f "$build/release/memgov"
for step in scripts/main.sh scripts/ci/65-timeline.sh; do
    log="$work/$(basename "$step").log"
    CARGO_TARGET_DIR="$build" bash "$work/tree/$step" > "$log" 2>&1 ||
        { tail -40 "$log"; echo "FAILED: $step with CARGO_TARGET_DIR set"; exit 1; }
    echo "$step: passed"
done
grep -q "memgov run: ok" "$work/main.sh.log" ||
    { tail -40 "$work/main.sh.log"; echo "FAILED: scripts/main.sh did not finish its run"; exit 1; }
[ -x "$build/release/memgov" ] && [ -s "$build/timeline/timeline.html" ] ||
    { echo "FAILED: memgov or the timeline page is not in CARGO_TARGET_DIR ($build)"; exit 1; }
if [ -e "$work/tree/target" ]; then
    echo "FAILED: with CARGO_TARGET_DIR set, something wrote under the tree's target/:"
    find "$work/tree/target" -maxdepth 2 | head -20
    exit 1
fi
echo "both passed with CARGO_TARGET_DIR=$build; the copy has no target/"
