#!/usr/bin/env bash
# Builds every stand-in driver library with the system C compiler into
# stand-ins/ under cargo's target directory (git-ignored) and prints that directory, to be put on
# LD_LIBRARY_PATH:
#
#   export LD_LIBRARY_PATH="$(backends/stand-ins/build.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#
# Each stand-in's sources sit beside the backend it stands in for, in
# backends/<name>/stand-in/: its C sources and a `build.conf` (sourced with
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

for name in "$@"; do
    if [ ! -f "$root/backends/$name/stand-in/build.conf" ]; then
        echo "build.sh: no stand-in named $name (no backends/$name/stand-in/build.conf)" >&2
        exit 1
    fi
done

mkdir -p "$out"
for dir in "$root"/backends/*/stand-in/; do
    dir="${dir%/}"
    name="$(basename "$(dirname "$dir")")"
    [ -f "$dir/build.conf" ] || continue
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
