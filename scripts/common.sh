# Shared set-up for scripts/main.sh and scripts/test.sh. Sourced, not run.
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
