#!/usr/bin/env bash
# The metrics (docs/metrics.md) stored by a real Prometheus (Debian's
# `prometheus`, installed by suite_setup): three worker processes
# (examples/metrics_worker.rs) join one machine ledger on the host backend
# and two more one ledger on the CUDA stand-in (with NVML's stand-in),
# allocate, have allocations refused and serve their governors' metrics
# (memgov::metrics::render); `memgov exporter` serves the ledger. Prometheus
# runs on the loopback, scraping all six every second, and every check
# reads what it stored through its HTTP API (/api/v1/query), never the
# exporter's text:
# * per-process charged bytes on the ledger sum to the ledger's total, and
#   each process's ledger charge equals its contexts' charges as its own page
#   reports them, on both ledgers;
# * the process NVML reports on the device outside the ledger is stored with
#   its bytes, and the process on the ledger is not listed as outside;
# * the refusals the workers had are counted;
# * a worker killed with SIGKILL: its own target goes down, and once the
#   survivors' sweep reclaims its slot its ledger series are gone (stale in
#   Prometheus), the reclaim is counted and the total is the survivors' sum;
# * a ledger created after the exporter started is served, and once its
#   segment is removed it is not.
# Each wait is bounded (120 s); Prometheus and every process started here
# are stopped at the end. Nothing listens beyond 127.0.0.1.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
ensure_rust
command -v prometheus >/dev/null || {
    echo "FAILED: no prometheus binary; suite_setup installs it (apt-get install prometheus)"
    exit 1
}
target="$(cargo_target_dir)"
# Every series documented, every documented one emitted, and the Grafana
# dashboard naming only emitted series (tests/metrics.rs).
# (The test step's debug build: the tool enables the feature; nothing is
# compiled again.)
debug_test --test metrics
# The worker governs a host context, or a CUDA one on the CUDA stand-in
# (MEMGOV_WORKER_BACKEND=cuda).
# (Built with the feature set of the test step's governor run and GPU
# examples, metrics and cuda among them: nothing is compiled again.)
cargo build --locked -p memgov --features "$MEMGOV_DEBUG_FEATURES" --example metrics_worker
standins="$(backends/stand-ins/build.sh cuda nvml)"
memgov="$(debug_memgov)"
worker="$target/debug/examples/metrics_worker"

tmp="$(mktemp -d)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT

# The address a started process prints on its first line of stdout.
address_of() {
    local out="$1" i
    for i in $(seq 1 600); do
        if grep -q "listening \|serving http://" "$out" 2>/dev/null; then
            sed -n 's/^listening //p; s|^memgov exporter: serving http://\(.*\)/metrics$|\1|p' "$out" | head -1
            return 0
        fi
        sleep 0.1
    done
    echo "FAILED: no address in $out" >&2
    cat "$out" >&2
    return 1
}

mkdir -p "$tmp/shm"
ledger="$tmp/shm/memgov-prom-test"
key=prom-test
# name, MiB allocated, process limit (MiB), refusals
"$worker" "$ledger" $key alpha 3 16 2 >"$tmp/alpha.out" 2>&1 &
pids+=($!)
alpha_addr="$(address_of "$tmp/alpha.out")"
"$worker" "$ledger" $key beta 5 16 0 >"$tmp/beta.out" 2>&1 &
pids+=($!)
beta_addr="$(address_of "$tmp/beta.out")"
"$worker" "$ledger" $key victim 4 16 1 >"$tmp/victim.out" 2>&1 &
victim=$!
pids+=($victim)
victim_addr="$(address_of "$tmp/victim.out")"
# Two workers on the CUDA stand-in, on the ledger keyed by the stand-in
# device's UUID (as the CUDA driver reports it).
cuda_key=gpu-6d656d67-6f76-2d73-7461-6e64696e0000
MEMGOV_WORKER_BACKEND=cuda LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$worker" "$tmp/shm/memgov-$cuda_key" $cuda_key cuda-a 3 16 1 >"$tmp/cuda-a.out" 2>&1 &
cuda_a=$!
pids+=($cuda_a)
cuda_a_addr="$(address_of "$tmp/cuda-a.out")"
MEMGOV_WORKER_BACKEND=cuda LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$worker" "$tmp/shm/memgov-$cuda_key" $cuda_key cuda-b 2 16 0 >"$tmp/cuda-b.out" 2>&1 &
pids+=($!)
cuda_b_addr="$(address_of "$tmp/cuda-b.out")"
# What NVML's stand-in reports on the device: cuda-a (on the ledger) and a
# process outside memgov with 200 MiB.
printf '0 %s 3145728\n0 4000001 209715200\n' "$cuda_a" >"$tmp/nvml-processes"
MEMGOV_STANDIN_NVML_PROCESSES="$tmp/nvml-processes" \
    LD_LIBRARY_PATH="$standins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$memgov" exporter --listen 127.0.0.1:0 --dir "$tmp/shm" >"$tmp/exporter.out" 2>&1 &
pids+=($!)
exporter_addr="$(address_of "$tmp/exporter.out")"

prom_port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
cat >"$tmp/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: memgov-exporter
    static_configs:
      - targets: ['$exporter_addr']
  - job_name: memgov-workers
    static_configs:
      - targets: ['$alpha_addr', '$beta_addr', '$victim_addr', '$cuda_a_addr', '$cuda_b_addr']
EOF
prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/data" \
    --web.listen-address="127.0.0.1:$prom_port" >"$tmp/prometheus.log" 2>&1 &
pids+=($!)

check() {
    python3 - "$prom_port" "$@" <<'PY'
import json, os, sys, time, urllib.parse, urllib.request

port, phase = sys.argv[1], sys.argv[2]
args = sys.argv[3:]
MIB = 1 << 20
WAIT = float(os.environ.get("MEMGOV_PROM_WAIT_S", "120"))
DEADLINE = time.monotonic() + WAIT

def query(q):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{q}: {body}")
    return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]]

def one(q):
    r = query(q)
    return r[0][1] if len(r) == 1 else None

def wait(what, f):
    last = None
    while time.monotonic() < DEADLINE:
        try:
            ok, last = f()
        except OSError as e:  # Prometheus not up yet
            ok, last = False, repr(e)
        if ok:
            print(f"prometheus: {what}: {last}")
            return
        time.sleep(0.5)
    sys.exit(f"FAILED: prometheus: {what}: still {last} after {WAIT:.0f} s")

L = 'device="prom-test"'
if phase == "running":
    def all_scraped():
        up = query('up')
        return len(up) == 6 and all(v == 1 for _, v in up), up
    wait("the exporter and the five workers are up", all_scraped)

    def sums():
        total = one(f'memgov_ledger_charged_bytes{{{L}}}')
        procs = query(f'memgov_process_charged_bytes{{{L}}}')
        s = sum(v for _, v in procs)
        return (len(procs) == 3 and total == s == 12 * MIB), (total, s, len(procs))
    wait("the processes' charged bytes sum to the ledger's total (12 MiB, 3 processes)", sums)

    def joined():
        ledger = {m["pid"]: v for m, v in query(f'memgov_process_charged_bytes{{{L}}}')}
        own = {m["pid"]: v for m, v in query('sum by (pid) (memgov_context_charged_bytes{job="memgov-workers"})')}
        ledger.update({m["pid"]: v for m, v in query('memgov_process_charged_bytes{device="gpu-6d656d67-6f76-2d73-7461-6e64696e0000"}')})
        return (len(ledger) == 5 and ledger == own), (ledger, own)
    wait("each process's ledger charge equals its contexts' charge on its own page", joined)

    def refusals():
        by = {m["context"]: v for m, v in query('memgov_context_refusals_total')}
        return by == {"alpha": 2.0, "beta": 0.0, "victim": 1.0, "cuda-a": 1.0, "cuda-b": 0.0}, by
    wait("the refusals are counted (alpha 2, beta 0, victim 1, cuda-a 1, cuda-b 0)", refusals)

    K = 'device="gpu-6d656d67-6f76-2d73-7461-6e64696e0000"'
    def cuda_sums():
        total = one(f'memgov_ledger_charged_bytes{{{K}}}')
        procs = query(f'memgov_process_charged_bytes{{{K}}}')
        s = sum(v for _, v in procs)
        backends = {m["backend"] for m, _ in query('memgov_context_charged_bytes{job="memgov-workers"}')}
        return (len(procs) == 2 and total == s == 5 * MIB and backends == {"host", "cuda"}), (total, s, len(procs), backends)
    wait("on the CUDA stand-in's ledger the processes' charged bytes sum to its total (5 MiB, 2 processes)", cuda_sums)
    def nvml():
        r = query(f'memgov_device_outside_process_bytes{{{K}}}')
        got = [(m["pid"], m["library"], v) for m, v in r]
        return got == [("4000001", "nvml", 200.0 * MIB)], got
    wait("NVML's process outside the ledger is stored, the one on the ledger is not", nvml)
elif phase == "killed":
    pid = args[0]
    def down():
        return one('up{job="memgov-workers",instance="%s"}' % args[1]) == 0, query('up{job="memgov-workers"}')
    wait("the killed worker's own target is down", down)
elif phase == "swept":
    pid = args[0]
    def gone():
        procs = query(f'memgov_process_charged_bytes{{{L}}}')
        pids = sorted(m["pid"] for m, _ in procs)
        total = one(f'memgov_ledger_charged_bytes{{{L}}}')
        s = sum(v for _, v in procs)
        reclaims = one(f'memgov_ledger_reclaims_total{{{L}}}')
        ok = pid not in pids and len(procs) == 2 and total == s == 8 * MIB and reclaims == 1
        return ok, (pids, total, s, reclaims)
    wait(f"after the reclaim the series of {pid} are gone, the reclaim counted, the total the survivors' 8 MiB", gone)
    def no_alive():
        return query(f'memgov_process_alive{{{L},pid="{pid}"}}') == [], query(f'memgov_process_alive{{{L}}}')
    wait(f"no memgov_process_alive series of {pid} is left", no_alive)
elif phase == "appeared":
    def seen():
        return one('memgov_process_charged_bytes{device="prom-late"}') == 2 * MIB, query('memgov_ledger_charged_bytes')
    wait("a ledger created after the exporter started is served", seen)
elif phase == "removed":
    def gone():
        r = query('memgov_ledger_limit_bytes')
        return sorted(m["device"] for m, _ in r) == ["gpu-6d656d67-6f76-2d73-7461-6e64696e0000", "prom-test"], r
    wait("a ledger whose segment was removed is no longer served", gone)
PY
}

check running
kill -KILL "$victim"
wait "$victim" 2>/dev/null || true
# The survivors' doorbell threads sweep the ledger every second
# (src/machine/member.rs): the dead slot is reclaimed without a hand here.
check killed "$victim" "$victim_addr"
check swept "$victim"
# A ledger that appears after the exporter started, and then goes.
"$worker" "$tmp/shm/memgov-prom-late" prom-late late 2 16 0 >"$tmp/late.out" 2>&1 &
late=$!
pids+=($late)
address_of "$tmp/late.out" >/dev/null
check appeared
kill -KILL "$late"
wait "$late" 2>/dev/null || true
"$memgov" top --path "$tmp/shm/memgov-prom-late" --reset >/dev/null
check removed
echo "prometheus: every check passed against the series Prometheus stored"
# The bench rows in smoke mode: rendering 64 processes x 8 contexts, and
# the two-thread row beside scrapes (benches/metrics.rs).
release_bench --bench metrics -- --test 2>&1 | tee "$tmp/bench.log"
grep -q "^metrics: two threads, one context: .* scrape ratio" "$tmp/bench.log" ||
    { echo "FAILED: the metrics bench printed no scrape ratio"; exit 1; }
