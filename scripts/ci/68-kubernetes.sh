#!/usr/bin/env bash
# The Kubernetes recipe's manifests (deploy/kubernetes/, docs/kubernetes.md):
# * schema-checked, strictly (no field Kubernetes does not define), with
#   kubernetes-validate against the Kubernetes schemas it carries; a kind
#   it has no schema for is allowed only for the Prometheus Operator's
#   ServiceMonitor, which the cross-check below covers;
# * cross-checked against memgov by scripts/kubernetes_check.py: every
#   `memgov` command line and flag exists in the built tool's --help, the
#   ports, selectors and scrape annotations agree, and every pod on a shared
#   ledger runs in the host's pid namespace and as one uid;
# * and each check shown to catch a planted fault in a copy of the
#   manifests (a field Kubernetes does not define, a port that disagrees, a
#   pod on the shared /dev/shm in its own pid namespace, a misspelt limit
#   variable, a flag the tool does not have).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust

if [ "${MEMGOV_INSTALL:-1}" != 0 ]; then
    kubernetes_validate_setup
fi
python3 -c 'import yaml' ||
    { echo "FAILED: PyYAML is missing: run \`cargo xtask setup\` (or \`apt-get install python3-yaml\`)"; exit 1; }
validate="$(kubernetes_validate_venv)/bin/kubernetes-validate"
[ -x "$validate" ] ||
    { echo "FAILED: $validate is missing: run \`cargo xtask setup\`"; exit 1; }

target="$(cargo_target_dir)"
# The tool of the test step's debug build (its help is what is read).
memgov="$(debug_memgov)"
manifests=deploy/kubernetes

schema_check() { # DIR LOG
    local rc=0
    "$validate" --strict "$1"/*.yaml >"$2" 2>&1 || rc=$?
    cat "$2"
    if grep -v "Couldn't find schema for kind ServiceMonitor with api version monitoring.coreos.com/v1" "$2" |
        grep -q "^WARN"; then
        echo "a warning other than the ServiceMonitor's missing schema"
        return 1
    fi
    return $rc
}

echo "--- schema: kubernetes-validate --strict"
schema_check "$manifests" "$target/kubernetes-validate.log"
grep -q "passed for resource daemonset/memgov-exporter" "$target/kubernetes-validate.log" ||
    { echo "FAILED: the exporter's DaemonSet was not validated"; exit 1; }

echo "--- cross-check against memgov"
python3 scripts/kubernetes_check.py "$manifests" "$memgov"

echo "--- each check catches a planted fault"
plant() { # DESCRIPTION FILE PYTHON-REPLACEMENT (old new)
    local what=$1 file=$2 old=$3 new=$4 dir
    dir="$(mktemp -d)"
    cp "$manifests"/*.yaml "$dir"/
    python3 - "$dir/$file" "$old" "$new" <<'PY'
import sys
path, old, new = sys.argv[1:]
s = open(path).read()
assert s.count(old) >= 1, f"{old!r} not in {path}"
open(path, "w").write(s.replace(old, new, 1))
PY
    echo "$dir"
}
expect_fail() { # DESCRIPTION PATTERN COMMAND...: fails, printing PATTERN
    local what=$1 pattern=$2 log="$target/kubernetes-planted.log"
    shift 2
    if "$@" >"$log" 2>&1; then
        cat "$log"
        echo "FAILED: the planted fault went unnoticed: $what"
        exit 1
    fi
    if ! grep -Eq "$pattern" "$log"; then
        cat "$log"
        echo "FAILED: the planted fault ($what) failed without the message /$pattern/"
        exit 1
    fi
    echo "caught: $what: $(grep -Em1 "$pattern" "$log")"
}
d=$(plant x exporter.yaml "          readinessProbe:" "          readinesProbe:")
expect_fail "a field Kubernetes does not define (schema)" "^ERROR .*readinesProbe. was unexpected" schema_check "$d" "$target/kubernetes-planted-schema.log"
rm -rf "$d"
d=$(plant x exporter.yaml "containerPort: 9464" "containerPort: 9465")
expect_fail "the metrics port is not the --listen port" "^FAILED: .*container port .metrics. is the --listen port" python3 scripts/kubernetes_check.py "$d" "$memgov"
rm -rf "$d"
d=$(plant x shared-gpu-pods.yaml "      hostPID: true" "      hostPID: false")
expect_fail "a pod on the host's /dev/shm in its own pid namespace" "^FAILED: .*llm-server.*hostPID" python3 scripts/kubernetes_check.py "$d" "$memgov"
rm -rf "$d"
d=$(plant x shared-gpu-pods.yaml "name: MEMGOV_DEVICE_LIMIT" "name: MEMGOV_DEVICE_LIMITS")
expect_fail "a misspelt limit variable" "^FAILED: .*MEMGOV_DEVICE_LIMITS is a variable memgov reads" python3 scripts/kubernetes_check.py "$d" "$memgov"
rm -rf "$d"
d=$(plant x servicemonitor.yaml "    - port: metrics" "    - port: metric")
expect_fail "a ServiceMonitor endpoint on a port the Service does not have" "^FAILED: .*endpoint port metric is a port" python3 scripts/kubernetes_check.py "$d" "$memgov"
rm -rf "$d"
if "$memgov" --help | grep -Eq '^  exporter( |$)'; then
    d=$(plant x exporter.yaml '"--listen", "0.0.0.0:9464"' '"--listen", "0.0.0.0:9464", "--no-such-flag"')
    expect_fail "a flag memgov exporter does not have" "^FAILED: .*memgov exporter --no-such-flag" python3 scripts/kubernetes_check.py "$d" "$memgov"
    rm -rf "$d"
else
    d=$(plant x exporter.yaml '"memgov", "exporter"' '"memgov", "top"')
    expect_fail "a memgov subcommand without the flags given (top --listen)" "^FAILED: .*memgov top --listen. is a flag" python3 scripts/kubernetes_check.py "$d" "$memgov"
    rm -rf "$d"
fi
# The flag check of the exporter's command line, whatever this build has:
# against a stand-in tool whose help lists `exporter --listen` as clap
# prints it, the manifests pass, and a flag it does not list is caught.
fake="$(mktemp -d)/memgov"
cat >"$fake" <<'SH'
#!/bin/sh
case "$1" in
    exporter) printf 'Usage: memgov exporter [OPTIONS] [LEDGERS]...\n\nOptions:\n      --listen <ADDR>  address\n  -h, --help  Print help\n' ;;
    *) printf 'Usage: memgov <COMMAND>\n\nCommands:\n  exporter  serve the ledgers\n  top       the ledger\n  help      Print this message\n' ;;
esac
SH
chmod +x "$fake"
python3 scripts/kubernetes_check.py "$manifests" "$fake" >"$target/kubernetes-fake.log" 2>&1 ||
    { cat "$target/kubernetes-fake.log"; echo "FAILED: the manifests do not pass against a tool with \`exporter --listen\`"; exit 1; }
grep -q "ok: .*memgov exporter --listen. is a flag" "$target/kubernetes-fake.log" ||
    { cat "$target/kubernetes-fake.log"; echo "FAILED: the exporter's flags were not checked against the stand-in tool"; exit 1; }
d=$(plant x exporter.yaml '"--listen", "0.0.0.0:9464"' '"--listen", "0.0.0.0:9464", "--no-such-flag"')
expect_fail "a flag memgov exporter does not have (stand-in tool)" "^FAILED: .*memgov exporter --no-such-flag" python3 scripts/kubernetes_check.py "$d" "$fake"
rm -rf "$d" "$(dirname "$fake")"
echo "kubernetes manifests: schema-checked, cross-checked, and every planted fault caught"
