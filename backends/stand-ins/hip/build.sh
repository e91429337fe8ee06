#!/usr/bin/env bash
# Builds the HIP runtime stand-in (libamdhip64.so.5) with the system C
# compiler into target/stand-ins/ (git-ignored) and prints that directory,
# to be put on LD_LIBRARY_PATH:
#
#   export LD_LIBRARY_PATH="$(backends/stand-ins/hip/build.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#
# Needs ROCm's headers (Debian: libamdhip64-dev) under $HIP_PATH/include
# (default /usr). Links common/standin.c with the flags build.conf sets
# (EXTRA_FLAGS: include path, version script). CC and CFLAGS are honoured.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
common="$here/../common"
root="$(cd "$here/../../.." && pwd)"
out="${MEMGOV_STANDIN_DIR:-$root/target/stand-ins}"
cc="${CC:-cc}"
cflags="${CFLAGS:--O2 -g}"
hip_include="${HIP_PATH:-/usr}/include"

if [ ! -f "$hip_include/hip/hip_runtime_api.h" ]; then
    echo "hip/build.sh: $hip_include/hip/hip_runtime_api.h not found: install libamdhip64-dev or set HIP_PATH" >&2
    exit 1
fi
SONAME="" EXTRA_FLAGS=""
dir="$here"
# shellcheck source=/dev/null
. "$dir/build.conf"
mkdir -p "$out"
# shellcheck disable=SC2086
"$cc" -std=gnu11 -Wall -Wextra -Werror $cflags -fPIC -shared -pthread \
    -I"$common" -Wl,-soname,"$SONAME" $EXTRA_FLAGS \
    -o "$out/$SONAME.tmp" "$here"/*.c "$common/standin.c"
mv -f "$out/$SONAME.tmp" "$out/$SONAME"
echo "hip/build.sh: built hip stand-in: $out/$SONAME" >&2
echo "$out"
