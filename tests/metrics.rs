//! The metrics pages (feature `metrics`, docs/metrics.md): every series on
//! them is documented, every documented series is on them, and every
//! expression of the Grafana dashboard (docs/grafana/memgov.json) names
//! only series they emit. What Prometheus stores of them is checked by
//! `scripts/ci/68-prometheus.sh` against a real Prometheus.

use memgov::host::{HostConfig, HostContext};
use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
use memgov::metrics::{render, render_ledgers, LedgerFigures};
use memgov::{Alloc, ContextConfig, Governor, MemoryInfo, ProcessBudget, Role, SharedBudget};
use std::collections::BTreeSet;
use std::path::PathBuf;

const MIB: u64 = 1 << 20;

/// Series documented to exist only where a management library (NVML, ROCm
/// SMI) reports processes on the device: not emitted on a host ledger.
const NEEDS_A_MANAGEMENT_LIBRARY: &[&str] = &["memgov_device_outside_process_bytes"];

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "memgov-metrics-{name}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The two pages with every series they can have on a host: a ledger with
/// a limited and an unlimited process and an observed device, and a
/// governor with a limited context that allocated and was refused.
fn pages() -> (String, String) {
    let dir = TempDir::new("pages");
    let ledger =
        MachineLedger::open(&LedgerOptions::new("metrics-test", 1 << 30).path(dir.0.join("seg")))
            .unwrap();
    ledger.observe_device(MemoryInfo {
        free: 512 * MIB,
        total: 1024 * MIB,
    });
    let a = ledger
        .join(JoinOptions::new("a").lease_chunk(0).limit(64 * MIB))
        .unwrap();
    let _b = ledger.join(JoinOptions::new("b").lease_chunk(0)).unwrap();
    let process = ProcessBudget::with_machine("a", 512 * MIB, a);
    let device = SharedBudget::with_parent("gpu", u64::MAX, &process);
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new()
            .label("weights")
            .shared_budget(device)
            .budget(8 * MIB),
    );
    let stream = ctx.create_stream("s").unwrap();
    let _held = ctx
        .allocate(&stream, Alloc::new(MIB, Role::Weights))
        .unwrap();
    assert!(ctx
        .allocate(&stream, Alloc::new(16 * MIB, Role::KvCache))
        .is_err());
    let ledger_page = render_ledgers(&[LedgerFigures::read(&ledger)], 0);
    let gov_page = render(&gov);
    (ledger_page, gov_page)
}

/// The sample names on a page (the names Prometheus stores).
fn samples(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

/// Every `memgov_...` name in a text.
fn names_in(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("memgov_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

/// The series documented in docs/metrics.md's tables (a row's first cell).
fn documented() -> BTreeSet<String> {
    repo_file("docs/metrics.md")
        .lines()
        .filter_map(|l| l.strip_prefix("| `memgov_"))
        .map(|l| format!("memgov_{}", l.split('`').next().unwrap()))
        .collect()
}

#[test]
fn every_series_is_documented_and_every_documented_series_emitted() {
    let (ledger_page, gov_page) = pages();
    let emitted: BTreeSet<String> = samples(&ledger_page)
        .union(&samples(&gov_page))
        .cloned()
        .collect();
    let documented = documented();
    assert!(
        emitted.len() >= 30,
        "only {} series emitted: {emitted:?}",
        emitted.len()
    );
    let undocumented: Vec<_> = emitted.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "series emitted but not documented in docs/metrics.md: {undocumented:?}"
    );
    let missing: Vec<_> = documented
        .difference(&emitted)
        .filter(|n| !NEEDS_A_MANAGEMENT_LIBRARY.contains(&n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "series documented in docs/metrics.md but not emitted: {missing:?}"
    );
    // Each page's HELP/TYPE text, and the page's end.
    for page in [&ledger_page, &gov_page] {
        assert!(page.ends_with("# EOF\n"));
        for name in samples(page) {
            let family = name.strip_suffix("_total").unwrap_or(&name);
            assert!(
                page.contains(&format!("# HELP {family} ")),
                "{name} has no HELP line"
            );
        }
    }
}

#[test]
fn the_pages_carry_the_figures() {
    let (ledger_page, gov_page) = pages();
    assert!(
        ledger_page.contains("memgov_ledger_charged_bytes{device=\"metrics-test\"} 1048576"),
        "{ledger_page}"
    );
    assert!(
        ledger_page.contains("memgov_process_limit_bytes{device=\"metrics-test\",process=\"a\""),
    );
    assert!(
        !ledger_page.contains("memgov_process_limit_bytes{device=\"metrics-test\",process=\"b\""),
        "an unlimited process has no limit series: {ledger_page}"
    );
    assert!(ledger_page
        .contains("memgov_ledger_device_total_bytes{device=\"metrics-test\"} 1073741824"));
    let refusals = gov_page
        .lines()
        .find(|l| l.starts_with("memgov_context_refusals_total{"))
        .unwrap();
    assert!(refusals.contains("context=\"weights\""), "{refusals}");
    assert!(refusals.ends_with(" 1"), "{refusals}");
    let live = gov_page
        .lines()
        .find(|l| l.starts_with("memgov_context_live_bytes{") && l.contains("role=\"weights\""))
        .unwrap();
    assert!(live.ends_with(" 1048576"), "{live}");
    // The process level's limit, set by the program.
    let level = gov_page
        .lines()
        .find(|l| l.starts_with("memgov_process_budget_limit_bytes{"))
        .unwrap();
    assert!(
        level.ends_with(",budget=\"a\",limit_from=\"program\"} 536870912"),
        "{level}"
    );
}

/// A process level the cluster granted names the variable on the page.
#[test]
fn the_page_names_the_variable_a_process_limit_came_from() {
    let env = |name: &str| (name == "CUDA_DEVICE_MEMORY_LIMIT_0").then(|| "3000m".to_owned());
    let grant = memgov::granted::granted_limit(0, None, env)
        .unwrap()
        .unwrap();
    let process = ProcessBudget::granted("worker", u64::MAX, &grant);
    let gov = Governor::new();
    let _a = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new().shared_budget(SharedBudget::with_parent("gpu0", u64::MAX, &process)),
    );
    let _b = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new().shared_budget(SharedBudget::with_parent("gpu0b", u64::MAX, &process)),
    );
    let page = render(&gov);
    let levels: Vec<&str> = page
        .lines()
        .filter(|l| l.starts_with("memgov_process_budget_limit_bytes{"))
        .collect();
    // One series for the level, however many contexts are under it.
    assert_eq!(levels.len(), 1, "{page}");
    assert!(
        levels[0]
            .ends_with(",budget=\"worker\",limit_from=\"CUDA_DEVICE_MEMORY_LIMIT_0\"} 3145728000"),
        "{}",
        levels[0]
    );
}

#[test]
fn the_dashboard_names_only_emitted_series() {
    let (ledger_page, gov_page) = pages();
    let mut emitted: BTreeSet<String> = samples(&ledger_page)
        .union(&samples(&gov_page))
        .cloned()
        .collect();
    emitted.extend(NEEDS_A_MANAGEMENT_LIBRARY.iter().map(|s| s.to_string()));
    let dashboard: serde_json::Value =
        serde_json::from_str(&repo_file("docs/grafana/memgov.json")).unwrap();
    let mut exprs = Vec::new();
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(o) => {
                for (k, v) in o {
                    match (k.as_str(), v) {
                        ("expr" | "definition", serde_json::Value::String(s)) => {
                            out.push(s.clone())
                        }
                        ("query", serde_json::Value::String(s)) if s.contains("memgov_") => {
                            out.push(s.clone())
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&dashboard, &mut exprs);
    assert!(exprs.len() >= 10, "only {} expressions found", exprs.len());
    for e in &exprs {
        let names = names_in(e);
        assert!(!names.is_empty(), "expression names no memgov series: {e}");
        for n in names {
            assert!(
                emitted.contains(&n),
                "the dashboard's expression `{e}` names {n}, which no page emits"
            );
        }
    }
}
