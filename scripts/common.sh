# Shared set-up for scripts/main.sh and scripts/test.sh. Sourced, not run.
#
# Installing is the CI's set-up, not the tests': `suite_setup` installs
# everything the suite needs up front (scripts/test.sh calls it, as does
# `cargo xtask setup`). With MEMGOV_INSTALL=0 (`cargo xtask test` sets it)
# nothing is installed: a missing package is an error that names the command
# that installs it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi
}

apt_updated=0
apt_install() {
    # Install the Debian packages named, those that are missing only.
    local missing=()
    for p in "$@"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "${MEMGOV_INSTALL:-1}" = 0 ]; then
        echo "memgov setup: missing Debian package(s): ${missing[*]}; MEMGOV_INSTALL=0 installs nothing:" \
            "run \`cargo xtask setup\` (or \`apt-get install ${missing[*]}\`) as root" >&2
        return 1
    fi
    echo "memgov setup: installing ${missing[*]}"
    if [ $apt_updated -eq 0 ]; then
        as_root apt-get update -qq
        apt_updated=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

ensure_rust() {
    if [ -f "$HOME/.cargo/env" ]; then
        # shellcheck disable=SC1091
        . "$HOME/.cargo/env"
    fi
    if ! command -v cargo >/dev/null; then
        echo "memgov setup: cargo not found; installing Debian's rust toolchain"
        apt_install cargo rustc gcc libc6-dev
    fi
    apt_install gcc libc6-dev pkg-config
    cargo --version
}

# Everything the whole suite installs, in one place: the cross-vendor matrix
# (Mesa's lavapipe, the Vulkan loader and the Khronos validation layers;
# ROCm's HIP header, which the HIP stand-in is compiled against, and Debian's
# real runtime for the clean-skip runs), the C ABI's C++ and valgrind checks,
# pip for the ONNX Runtime wheels, PyYAML and kubernetes-validate for the
# Kubernetes manifests, the headless browser of the timeline step, and the
# nightly toolchain's Miri. The steps that use them find them
# installed; on a machine prepared once, a run installs nothing.
suite_setup() {
    apt_install mesa-vulkan-drivers libvulkan1 vulkan-validationlayers libamdhip64-dev g++ prometheus
    command -v valgrind >/dev/null || apt_install valgrind ||
        echo "memgov setup: valgrind is not installable: its checks will print skipped"
    python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
    kubernetes_validate_setup
    command -v chromium-headless-shell >/dev/null || apt_install chromium-headless-shell
    if ! cargo +nightly miri --version >/dev/null 2>&1 && command -v rustup >/dev/null; then
        echo "memgov setup: installing the nightly toolchain's miri and rust-src components"
        rustup toolchain install nightly --profile minimal --component miri,rust-src ||
            echo "memgov setup: could not install Miri (no network to the toolchain server?): its step will print skipped"
    fi
}

# The Kubernetes manifests' checks (scripts/ci/68-kubernetes.sh): PyYAML
# from Debian, and the schema validator `kubernetes-validate` from PyPI
# (pinned; it carries Kubernetes' schemas, so validating needs no cluster
# and no network) in a virtual environment under the build directory.
KUBERNETES_VALIDATE_VERSION=1.37.0
kubernetes_validate_venv() {
    echo "$(cargo_target_dir)/kubernetes-validate-$KUBERNETES_VALIDATE_VERSION"
}
kubernetes_validate_setup() {
    python3 -c 'import yaml' 2>/dev/null || apt_install python3-yaml
    local venv
    venv="$(kubernetes_validate_venv)"
    [ -x "$venv/bin/kubernetes-validate" ] && return 0
    if [ "${MEMGOV_INSTALL:-1}" = 0 ]; then
        echo "memgov setup: kubernetes-validate is not installed in $venv; MEMGOV_INSTALL=0 installs nothing:" \
            "run \`cargo xtask setup\`" >&2
        return 1
    fi
    python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
    echo "memgov setup: installing kubernetes-validate==$KUBERNETES_VALIDATE_VERSION in $venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
}

# The directory cargo builds into: CARGO_TARGET_DIR, a cargo config's
# build.target-dir, or ./target. Every script finds build output there and
# writes its logs there, never under a literal `target/`.
cargo_target_dir() {
    cargo metadata --locked --format-version 1 --no-deps |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])'
}

# Every release-mode step (tests, benches, the tool with every backend)
# builds the same packages with the same features, so cargo compiles memgov,
# its backends and their dependencies in release mode once for the whole
# suite: each other package set or feature set is a full recompile of the
# library and its backends (minutes on a 2-core machine). The plain tool of
# the README (`cargo build --release -p memgov-cli`) is the one other set.
# Selecting a test or bench by name picks it from whichever of these
# packages has it.
MEMGOV_RELEASE_PACKAGES=(-p memgov -p memgov-cli -p memgov-cuda -p memgov-vulkan)
MEMGOV_RELEASE_FEATURES="memgov/serde,memgov/metrics,memgov-cli/vulkan,memgov-cli/cuda,memgov-cli/hip"
release_test() {
    cargo test --locked --release "${MEMGOV_RELEASE_PACKAGES[@]}" --features "$MEMGOV_RELEASE_FEATURES" "$@"
}
release_bench() {
    cargo bench --locked "${MEMGOV_RELEASE_PACKAGES[@]}" --features "$MEMGOV_RELEASE_FEATURES" "$@"
}
# The debug build of the suite's build step, which its test step runs: the
# packages below, selected together. Every later debug run of their tests
# selects the same packages (`debug_test`), so that it finds that build
# fresh: another selection unifies other features and recompiles the
# library and the test kit.
MEMGOV_TEST_PACKAGES=(-p memgov -p memgov-api -p memgov-sync -p memgov-backend -p memgov-stream-ordered
    -p memgov-conformance -p memgov-host -p memgov-null -p memgov-cli)
debug_test() {
    cargo test --locked "${MEMGOV_TEST_PACKAGES[@]}" "$@"
}
# The memgov package alone in debug, for what needs its optional features
# (the governor's tests with serde and tracing, the GPU examples, the
# metrics worker): one feature set with all of them, built once.
MEMGOV_DEBUG_FEATURES="serde,tracing,metrics,vulkan,cuda,hip"

# The path of the memgov tool of the release build (Vulkan, CUDA and HIP
# compiled in), built if needed: the binary cargo builds for the tool's own
# integration tests, found in cargo's JSON messages, copied beside the
# build.
release_memgov() {
    memgov_of release_test memgov-every-backend
}
# The same for the debug build of the test step (the tool's default
# features), for the steps that only read its help or run it briefly.
debug_memgov() {
    memgov_of debug_test memgov-debug
}
memgov_of() { # BUILD COPY-NAME
    local exe
    exe="$("$1" --no-run --test cli --message-format=json |
        python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and t.get("name") == "memgov" and "bin" in t.get("kind", []):
        print(m["executable"])')"
    [ -n "$exe" ] && [ -x "$exe" ] || { echo "FAILED: cargo reported no memgov binary for the $1 build" >&2; return 1; }
    # Cargo reports target/<profile>/memgov, which the README's plain build
    # replaces: the steps run a copy of their own.
    local copy
    copy="$(cargo_target_dir)/$2"
    cp "$exe" "$copy.tmp" && mv "$copy.tmp" "$copy"
    echo "$copy"
}

# Runs that mostly wait (a stand-in's queued latency, a test's timeouts) use
# a core for a fraction of their time: a step starts them together with
# `in_background LOG CMD...` (the command's output to LOG alone), does its
# other work meanwhile, and `wait_background` waits for every one, prints
# each LOG in the order they were started, and fails naming each run that
# failed. Only runs of what is already built go there: cargo builds one
# at a time, and a run that waits on the build lock waits on another's build.
background_pids=()
background_logs=()
background_what=()
in_background() {
    local log=$1
    shift
    "$@" >"$log" 2>&1 &
    background_pids+=("$!")
    background_logs+=("$log")
    background_what+=("$*")
}
wait_background() {
    local i failed=0
    for i in "${!background_pids[@]}"; do
        if wait "${background_pids[$i]}"; then
            echo "--- (background) ${background_what[$i]}: passed; its output:"
            cat "${background_logs[$i]}"
        else
            cat "${background_logs[$i]}"
            echo "FAILED: (background) ${background_what[$i]} (output above, in ${background_logs[$i]})"
            failed=$((failed + 1))
        fi
    done
    background_pids=()
    background_logs=()
    background_what=()
    [ "$failed" -eq 0 ] || { echo "FAILED: $failed background run(s)"; return 1; }
}

# Each suite run prints "N passed, F failed, S skipped": in LOG, a line where
# every case ran and passed (N > 0). The Rust test asserts N is the number of
# cases the suite has; this proves the run reached a device.
expect_all_passed() {
    local log="$1" what="$2"
    grep -Eq "^ *[1-9][0-9]* passed, 0 failed, 0 skipped$" "$log" ||
        { echo "FAILED: $what: no suite run in $log with every case passed"; exit 1; }
}

# The fault matrix prints "fault matrix: LABEL: N tried, M survived": in LOG,
# the line for LABEL with N > 0 and M = N. The Rust test asserts N is the
# number of cells the matrix has.
expect_matrix_survived() {
    local log="$1" label="$2"
    grep -Fq "fault matrix: $label: " "$log" ||
        { echo "FAILED: no fault matrix line for '$label' in $log"; exit 1; }
    grep -F "fault matrix: $label: " "$log" | grep -Eq ": ([1-9][0-9]*) tried, \1 survived$" ||
        { echo "FAILED: fault matrix '$label': not every cell survived (see $log)"; exit 1; }
}
