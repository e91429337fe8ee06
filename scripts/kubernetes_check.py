#!/usr/bin/env python3
"""Cross-check the Kubernetes manifests in deploy/kubernetes against memgov.

Usage: kubernetes_check.py MANIFEST_DIR MEMGOV_BINARY

Every file is parsed with PyYAML; then, beyond what a schema can say:

* every `memgov` command line in a container names a subcommand and flags
  that `memgov --help` / `memgov SUB --help` list (the exporter's, while
  this build has no `exporter` subcommand, are skipped with the reason
  printed);
* the exporter's --listen port is its container's `metrics` port, the
  Service's target and the scrape annotations' port;
* the Service selects the exporter's pods, and a ServiceMonitor selects the
  Service and scrapes a port it has;
* every pod that mounts the host's /dev/shm (a shared machine ledger) runs
  in the host's pid namespace (NVML's pids are the slots' pids) and as one
  uid (memgov opens no other user's segment); the exporter takes no GPU;
* every environment variable of the granted-limit family is one memgov
  reads (a misspelt one would be ignored).

Prints one line per check and "N passed, N failed"; exits 1 on a failure.
"""

import re
import subprocess
import sys
from pathlib import Path

import yaml

GRANTED = re.compile(r"^(MEMGOV_DEVICE_LIMIT|CUDA_DEVICE_MEMORY_LIMIT(_[0-9]+)?|CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)$")
FAMILY = re.compile(r"^(MEMGOV_|CUDA_DEVICE_MEMORY|CUDA_MPS_PINNED)")
POD_TEMPLATES = {"DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job"}

passed = 0
failed = 0


def ok(what):
    global passed
    passed += 1
    print(f"ok: {what}")


def fail(what):
    global failed
    failed += 1
    print(f"FAILED: {what}")


def check(cond, what):
    if cond:
        ok(what)
    else:
        fail(what)


def help_text(memgov, args):
    r = subprocess.run([memgov, *args, "--help"], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def subcommands(memgov):
    code, text = help_text(memgov, [])
    if code != 0:
        raise SystemExit(f"FAILED: `{memgov} --help` exited {code}:\n{text}")
    # clap's "Commands:" section: two-space indent, the name, then text.
    m = re.search(r"^Commands:\n((?:  .*\n?)+)", text, re.M)
    if not m:
        raise SystemExit(f"FAILED: no Commands: section in `memgov --help`:\n{text}")
    return {line.split()[0] for line in m.group(1).splitlines() if line.strip()}


def pod_specs(doc):
    kind = doc.get("kind")
    if kind == "Pod":
        return doc.get("spec") or {}, doc.get("metadata") or {}
    if kind in POD_TEMPLATES:
        t = doc["spec"]["template"]
        return t.get("spec") or {}, t.get("metadata") or {}
    if kind == "CronJob":
        t = doc["spec"]["jobTemplate"]["spec"]["template"]
        return t.get("spec") or {}, t.get("metadata") or {}
    return None, None


def name_of(doc):
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def matches(selector, labels):
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    root, memgov = Path(sys.argv[1]), sys.argv[2]
    files = sorted(root.glob("*.yaml"))
    check(files, f"{root} holds manifests ({len(files)} files)")
    docs = []
    for f in files:
        try:
            loaded = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        except yaml.YAMLError as e:
            fail(f"{f}: does not parse: {e}")
            continue
        for d in loaded:
            good = isinstance(d, dict) and d.get("apiVersion") and d.get("kind") and (d.get("metadata") or {}).get("name")
            label = name_of(d) if isinstance(d, dict) else repr(d)
            check(good, f"{f.name}: {label} has apiVersion, kind and metadata.name")
            if good:
                d["__file"] = f.name
                docs.append(d)

    commands = subcommands(memgov)
    exporters = []  # (doc, pod spec, pod metadata, container, port)
    shm_pods = []  # (doc, pod spec, container names)
    for d in docs:
        spec, meta = pod_specs(d)
        if spec is None:
            continue
        shm_volumes = {
            v["name"]
            for v in spec.get("volumes") or []
            if (v.get("hostPath") or {}).get("path") == "/dev/shm"
        }
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            where = f"{d['__file']}: {name_of(d)} container {c['name']}"
            argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
            for e in c.get("env") or []:
                if FAMILY.match(e["name"]):
                    check(GRANTED.match(e["name"]), f"{where}: {e['name']} is a variable memgov reads")
            mounts_shm = any(
                m["name"] in shm_volumes and m["mountPath"] == "/dev/shm" for m in c.get("volumeMounts") or []
            )
            if mounts_shm:
                shm_pods.append((d, spec, c))
            if not argv or Path(argv[0]).name != "memgov":
                continue
            sub = argv[1] if len(argv) > 1 else None
            flags = [a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")]
            if sub not in commands:
                if sub == "exporter":
                    print(
                        f"skipped: {where}: this build of memgov has no `exporter` subcommand "
                        f"(`memgov --help` lists {', '.join(sorted(commands))}); its flags {flags} are not cross-checked"
                    )
                else:
                    fail(f"{where}: `memgov {sub}` is not a subcommand (`memgov --help` lists {', '.join(sorted(commands))})")
            else:
                code, text = help_text(memgov, [sub])
                known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", text))
                check(code == 0, f"{where}: `memgov {sub} --help` runs")
                for flag in flags:
                    check(flag in known, f"{where}: `memgov {sub} {flag}` is a flag of `memgov {sub} --help`")
            if sub == "exporter":
                listen = None
                for i, a in enumerate(argv):
                    if a == "--listen" and i + 1 < len(argv):
                        listen = argv[i + 1]
                    elif a.startswith("--listen="):
                        listen = a.split("=", 1)[1]
                check(listen and re.match(r"^.+:[0-9]+$", listen), f"{where}: --listen gives an address and port ({listen})")
                port = int(listen.rsplit(":", 1)[1]) if listen else None
                exporters.append((d, spec, meta, c, port))

    check(exporters, "a container runs `memgov exporter`")
    for d, spec, meta, c, port in exporters:
        where = f"{d['__file']}: {name_of(d)}"
        check(d["kind"] == "DaemonSet", f"{where}: the exporter is a DaemonSet (one per node)")
        named = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
        check(named.get("metrics") == port, f"{where}: container port 'metrics' is the --listen port {port} ({named})")
        ann = meta.get("annotations") or {}
        if "prometheus.io/scrape" in ann:
            check(ann.get("prometheus.io/port") == str(port), f"{where}: prometheus.io/port is {port}")
        limits = {**((c.get("resources") or {}).get("limits") or {}), **((c.get("resources") or {}).get("requests") or {})}
        check(not any(k.startswith("nvidia.com/") for k in limits), f"{where}: the exporter requests no GPU")
        check(any(x[1] is spec for x in shm_pods), f"{where}: the exporter mounts the host's /dev/shm at /dev/shm")
        pod_labels = meta.get("labels") or {}
        services = [s for s in docs if s["kind"] == "Service" and matches((s.get("spec") or {}).get("selector"), pod_labels)]
        check(services, f"{where}: a Service selects the exporter's pods")
        for s in services:
            sw = f"{s['__file']}: {name_of(s)}"
            for p in s["spec"].get("ports") or []:
                target = p.get("targetPort", p.get("port"))
                check(target in ("metrics", port), f"{sw}: port {p.get('name')} targets the exporter's metrics port")
            sann = (s.get("metadata") or {}).get("annotations") or {}
            if "prometheus.io/port" in sann:
                check(sann["prometheus.io/port"] == str(port), f"{sw}: prometheus.io/port is {port}")
            monitors = [
                m
                for m in docs
                if m["kind"] == "ServiceMonitor"
                and matches(((m.get("spec") or {}).get("selector") or {}).get("matchLabels"), (s.get("metadata") or {}).get("labels"))
            ]
            for m in monitors:
                mw = f"{m['__file']}: {name_of(m)}"
                ns = ((m["spec"].get("namespaceSelector") or {}).get("matchNames")) or [(m.get("metadata") or {}).get("namespace")]
                check((s.get("metadata") or {}).get("namespace") in ns, f"{mw}: looks in the Service's namespace")
                names = {p.get("name") for p in s["spec"].get("ports") or []}
                for e in m["spec"].get("endpoints") or []:
                    check(e.get("port") in names, f"{mw}: endpoint port {e.get('port')} is a port of {sw}")
    for m in (m for m in docs if m["kind"] == "ServiceMonitor"):
        sel = ((m.get("spec") or {}).get("selector") or {}).get("matchLabels")
        check(
            any(s["kind"] == "Service" and matches(sel, (s.get("metadata") or {}).get("labels")) for s in docs),
            f"{m['__file']}: {name_of(m)} selects a Service in the manifests",
        )

    check(len(shm_pods) >= 2, f"pods share the host's /dev/shm ({len(shm_pods)} containers)")
    uids = set()
    for d, spec, c in shm_pods:
        where = f"{d['__file']}: {name_of(d)} container {c['name']}"
        check(spec.get("hostPID") is True, f"{where}: mounts the host's /dev/shm and runs in the host's pid namespace, where NVML's pids are the slots' (hostPID)")
        uid = ((c.get("securityContext") or {}).get("runAsUser")) or ((spec.get("securityContext") or {}).get("runAsUser"))
        check(uid is not None, f"{where}: sets runAsUser ({uid})")
        uids.add(uid)
    check(len(uids) == 1, f"every process on the shared ledgers runs as one uid ({sorted(map(str, uids))})")

    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
