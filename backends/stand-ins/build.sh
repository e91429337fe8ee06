#!/usr/bin/env bash
# Builds every stand-in driver library with the system C compiler into
# stand-ins/ under cargo's target directory (git-ignored) and prints that directory, to be put on
# LD_LIBRARY_PATH:
#
#   export LD_LIBRARY_PATH="$(backends/stand-ins/build.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#
# Each stand-in's sources sit beside the backend it stands in for, in
# backends/<name>/stand-in/ (another library of the same vendor in
# backends/<backend>/stand-in-<name>/): its C sources and a `build.conf` (sourced with
# $dir set to that directory) that sets SONAME (the file name the loader
# looks for, e.g. libcuda.so.1) and optionally LINKS (extra names symlinked
# to it) and EXTRA_FLAGS (extra compiler and linker flags). Every stand-in is
# linked with backends/stand-ins/common/standin.c. CC and CFLAGS are
# honoured.
#
# With arguments, builds only the stand-ins named by their backend
# (`build.sh cuda`); a name with no stand-in is an error.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# cargo_target_dir: cargo's target directory (CARGO_TARGET_DIR, a configured
# build.target-dir, or ./target).
source "$root/scripts/common.sh"
out="${MEMGOV_STANDIN_DIR:-$(cargo_target_dir)/stand-ins}"
cc="${CC:-cc}"
cflags="${CFLAGS:--O2 -g}"

# A backend's own driver stands in backends/<name>/stand-in/; another
# library of the same vendor beside it, in backends/<backend>/stand-in-<name>/
# (NVML: backends/cuda/stand-in-nvml/, named `nvml`).
name_of() {
    local base
    base="$(basename "$1")"
    if [ "$base" = stand-in ]; then basename "$(dirname "$1")"; else echo "${base#stand-in-}"; fi
}
known=""
for dir in "$root"/backends/*/stand-in/ "$root"/backends/*/stand-in-*/; do
    [ -f "$dir/build.conf" ] && known="$known $(name_of "${dir%/}")"
done
for name in "$@"; do
    if [[ " $known " != *" $name "* ]]; then
        echo "build.sh: no stand-in named $name (stand-ins:$known)" >&2
        exit 1
    fi
done

mkdir -p "$out"
for dir in "$root"/backends/*/stand-in/ "$root"/backends/*/stand-in-*/; do
    dir="${dir%/}"
    [ -f "$dir/build.conf" ] || continue
    name="$(name_of "$dir")"
    if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then
        continue
    fi
    SONAME="" LINKS="" EXTRA_FLAGS=""
    # shellcheck source=/dev/null
    . "$dir/build.conf"
    if [ -z "$SONAME" ]; then
        echo "build.sh: $dir/build.conf sets no SONAME" >&2
        exit 1
    fi
    # shellcheck disable=SC2086
    "$cc" -std=gnu11 -Wall -Wextra -Werror $cflags -fPIC -shared -pthread \
        -I"$here/common" -Wl,-soname,"$SONAME" $EXTRA_FLAGS \
        -o "$out/$SONAME.tmp" "$dir"/*.c "$here/common/standin.c"
    mv -f "$out/$SONAME.tmp" "$out/$SONAME"
    for link in $LINKS; do
        ln -sf "$SONAME" "$out/$link"
    done
    echo "build.sh: built $name stand-in: $out/$SONAME" >&2
done
echo "$out"
