#!/usr/bin/env bash
# Ready for crates.io and for a machine without GPU runtimes:
# * every publishable crate of the workspace packages and builds from its
#   package alone (`cargo publish --workspace --dry-run`);
# * the docs build with docs.rs's settings (nightly, `--cfg docsrs`, the
#   features in `[package.metadata.docs.rs]`) and have a page per backend,
#   each marked with the feature that builds it;
# * a `memgov` built with every backend links no GPU runtime (CUDA, HIP and
#   Vulkan are all opened at run time) and starts with none on the library
#   path.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust
target_dir="$(cargo_target_dir)"
mkdir -p "$target_dir"

echo "--- cargo publish --workspace --dry-run"
# The dry run verifies each crate against the ones packaged before it, through
# a temporary registry under the target directory. Cargo unpacks those crates
# into $CARGO_HOME/registry/src/<hash of that registry's path>/ and reuses an
# unpacked crate of the same name and version without looking at its contents,
# so with a fixed target directory a machine that keeps its cargo home between
# runs verifies memgov-cuda against an earlier run's memgov-backend. A target
# directory of this run's own gives the registry a path, and the unpacked
# crates a folder, no earlier run had; both are removed afterwards.
cargo_home="${CARGO_HOME:-$HOME/.cargo}"
started="$(mktemp)"
publish_target="$(mktemp -d "${TMPDIR:-/tmp}/memgov-publish.XXXXXX")"
trap 'rm -rf "$publish_target" "$started"' EXIT
set +e
CARGO_TARGET_DIR="$publish_target" cargo publish --workspace --dry-run --locked --allow-dirty 2>&1 | tee "$target_dir/publish.log"
publish_rc=${PIPESTATUS[0]}
set -e
# Local registries unpack into folders named "-<hash>"; the ones this run
# wrote to are newer than the file made when it started.
find "$cargo_home/registry/src" -mindepth 1 -maxdepth 1 -name '-*' -newer "$started" \
    -exec rm -rf {} + 2>/dev/null || true
[ "$publish_rc" -eq 0 ] || { echo "FAILED: cargo publish --workspace --dry-run exited with $publish_rc"; exit 1; }
crates=(memgov-api memgov-sync memgov-backend memgov-stream-ordered memgov-host memgov-null memgov-cuda memgov-hip memgov-vulkan memgov memgov-conformance memgov-cli)
for c in "${crates[@]}"; do
    grep -Eq "Packaging $c v" "$target_dir/publish.log" || { echo "FAILED: $c was not packaged"; exit 1; }
done
if grep -q "Packaging memgov-capi" "$target_dir/publish.log"; then
    echo "FAILED: memgov-capi is publish = false and must not be packaged"; exit 1
fi
# Stand-in drivers and CI scripts stay in the repository.
for c in "${crates[@]}"; do
    if cargo package --locked --allow-dirty --no-verify -p "$c" --list 2>/dev/null | grep -Eq '^(scripts/|stand-in/|.*\.c$)'; then
        echo "FAILED: $c ships CI scripts or stand-in sources"; exit 1
    fi
done
echo "publish: ${#crates[@]} crates packaged and verified"

echo "--- docs with docs.rs's settings"
features="$(python3 -c 'import tomllib; print(",".join(tomllib.load(open("Cargo.toml","rb"))["package"]["metadata"]["docs"]["rs"]["features"]))')"
if cargo +nightly --version >/dev/null 2>&1; then
    RUSTDOCFLAGS="--cfg docsrs -D warnings" cargo +nightly doc --locked -p memgov --no-deps --features "$features"
    for b in host null cuda hip vulkan; do
        page="$target_dir/doc/memgov/$b/index.html"
        [ -f "$page" ] || { echo "FAILED: no docs page for the $b backend ($page)"; exit 1; }
    done
    for b in cuda hip vulkan; do
        grep -q "crate feature <code>$b</code>" "$target_dir/doc/memgov/$b/index.html" ||
            { echo "FAILED: the $b page does not say which feature builds it"; exit 1; }
    done
    echo "docs: a page per backend, GPU ones marked with their feature ($features)"
else
    echo "skipped: docs.rs settings need a nightly toolchain (cargo +nightly), which is not installed"
fi

echo "--- memgov with every backend, on a machine with no GPU runtime"
bin="$(release_memgov)"
if ldd "$bin" | grep -Ei 'libcuda|libamdhip|libhsa|libvulkan|libnvidia'; then
    echo "FAILED: memgov links a GPU runtime at load time"; exit 1
fi
# An empty library path and no runtime names: whatever the machine has is
# not on the path the binary searches first, and it must still start.
MEMGOV_HIP_RUNTIME=/nonexistent/libamdhip64.so LD_LIBRARY_PATH="" "$bin" info | tee "$target_dir/info-no-runtime.log"
grep -q "^host " "$target_dir/info-no-runtime.log"
echo "memgov with cuda, hip and vulkan: links no GPU runtime, starts and prints its backends"
