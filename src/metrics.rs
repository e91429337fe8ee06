//! Prometheus metrics (feature `metrics`): a governor's snapshot and the
//! machine ledgers' snapshots rendered in Prometheus's text exposition
//! format, through the `prometheus-client` crate. Every series, its type,
//! labels and unit are listed in `docs/metrics.md`.
//!
//! * [`render`]: the contexts of one governor, for a process that already
//!   serves a `/metrics` page (the C ABI's `memgov_metrics_render` is the
//!   same call).
//! * [`render_ledgers`]: the machine ledgers' processes, as `memgov
//!   exporter` serves them and `memgov top --prometheus` writes them.
//!
//! Rendering reads snapshots only: the governor's (as
//! [`Governor::snapshot`] takes it, less each cache's count by size class,
//! which would take the per-stream cache lock a cached allocation takes)
//! and the ledger's atomics ([`MachineLedger::snapshot`]).
//!
//! The text is OpenMetrics-compatible Prometheus text: a counter's
//! `# TYPE` line names the family without `_total`, its samples end in
//! `_total`, and the page ends with `# EOF`. [`CONTENT_TYPE`] is the
//! header to serve it with. [`textfile`] turns it into the plain
//! Prometheus text format (0.0.4) node-exporter's textfile collector
//! parses.
//!
//! [`MachineLedger::snapshot`]: crate::machine::MachineLedger::snapshot

use crate::{DeviceContext, Governor, GovernorSnapshot, Role};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::AtomicU64;

/// The `Content-Type` a `/metrics` page rendered here is served with.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;
type GaugeFamily = Family<Labels, Gauge<u64, AtomicU64>>;
type CounterFamily = Family<Labels, Counter<u64, AtomicU64>>;

/// One page being built: the registry and the families registered in it.
struct Page {
    registry: Registry,
}

impl Page {
    fn new() -> Self {
        Self {
            registry: Registry::default(),
        }
    }

    fn gauge(&mut self, name: &str, help: &str, unit: Option<Unit>) -> GaugeFamily {
        let f = GaugeFamily::default();
        match unit {
            Some(u) => self.registry.register_with_unit(name, help, u, f.clone()),
            None => self.registry.register(name, help, f.clone()),
        }
        f
    }

    fn counter(&mut self, name: &str, help: &str, unit: Option<Unit>) -> CounterFamily {
        let f = CounterFamily::default();
        match unit {
            Some(u) => self.registry.register_with_unit(name, help, u, f.clone()),
            None => self.registry.register(name, help, f.clone()),
        }
        f
    }

    fn text(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; the encoder's error is fmt's.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

fn set(f: &GaugeFamily, labels: &Labels, v: u64) {
    f.get_or_create(labels).set(v);
}

fn count(f: &CounterFamily, labels: &Labels, v: u64) {
    f.get_or_create(labels).inc_by(v);
}

/// This process's name as the kernel has it (`/proc/self/comm`), or the
/// executable's file name.
fn own_name() -> String {
    std::fs::read_to_string("/proc/self/comm")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The contexts of `gov` in Prometheus's exposition format, labelled with
/// this process's name and pid (see [`render_snapshot`]).
pub fn render<C: DeviceContext>(gov: &Governor<C>) -> String {
    render_snapshot(&gov.snapshot_for_metrics(), &own_name(), std::process::id())
}

/// The contexts of a governor snapshot in Prometheus's exposition format,
/// each series labelled `device` (the context's device), `process`
/// (`process`), `pid`, `context` (the context's label; `#<n>` for one
/// without, and a `#<n>` suffix where two share a label) and `backend`;
/// the per-role series add `role`.
pub fn render_snapshot(snap: &GovernorSnapshot, process: &str, pid: u32) -> String {
    let mut p = Page::new();
    let limit = p.gauge(
        "memgov_context_limit",
        "The context's budget limit (absent: unlimited)",
        Some(Unit::Bytes),
    );
    let charged = p.gauge(
        "memgov_context_charged",
        "Bytes charged to the context's budget: live, pending, quarantined, reserved, outside and awaiting teardown",
        Some(Unit::Bytes),
    );
    let peak = p.gauge(
        "memgov_context_peak",
        "The most bytes the context has had charged",
        Some(Unit::Bytes),
    );
    let reserved = p.gauge(
        "memgov_context_reserved",
        "Bytes held by the context's live reservations and not yet allocated out of them",
        Some(Unit::Bytes),
    );
    let outside = p.gauge(
        "memgov_context_outside",
        "Bytes allocated outside memgov and recorded on the context",
        Some(Unit::Bytes),
    );
    let suspended = p.gauge(
        "memgov_context_suspended",
        "Bytes of sleeping allocations, off every budget level until woken",
        Some(Unit::Bytes),
    );
    let cached = p.gauge(
        "memgov_context_cached",
        "Bytes in the context's block cache",
        Some(Unit::Bytes),
    );
    let live = p.gauge(
        "memgov_context_live",
        "Bytes of live allocations, by role",
        Some(Unit::Bytes),
    );
    let pending = p.gauge(
        "memgov_context_pending",
        "Bytes released and waiting for their stream to pass the release, by role",
        Some(Unit::Bytes),
    );
    let quarantined = p.gauge(
        "memgov_context_quarantined",
        "Bytes whose release the backend refused, kept off the free pool, by role",
        Some(Unit::Bytes),
    );
    let allocations = p.counter(
        "memgov_context_allocations",
        "Allocations admitted on the context",
        None,
    );
    let refusals = p.counter(
        "memgov_context_refusals",
        "Allocations and reservations refused by a budget (any level, the machine ledger's included)",
        None,
    );
    let waits = p.counter(
        "memgov_context_admission_waits",
        "Admissions that waited for pending releases to settle",
        None,
    );
    let pressure = p.counter(
        "memgov_context_pressure_calls",
        "Calls into pressure responders to make room",
        None,
    );
    let backend_errors = p.counter(
        "memgov_context_backend_errors",
        "Errors the backend returned to the governor",
        None,
    );
    let process_limit = p.gauge(
        "memgov_process_budget_limit",
        "The limit of the process level above the contexts' device budgets (absent: unlimited); limit_from names the variable the cluster set it with, or program",
        Some(Unit::Bytes),
    );
    let mut seen: Vec<String> = Vec::with_capacity(snap.contexts.len());
    let mut levels: Vec<&crate::ProcessLimit> = Vec::new();
    let pid = pid.to_string();
    for (i, c) in snap.contexts.iter().enumerate() {
        let mut name = if c.label.is_empty() {
            format!("#{i}")
        } else {
            c.label.clone()
        };
        if seen.contains(&name) {
            name = format!("{name}#{i}");
        }
        seen.push(name.clone());
        let labels: Labels = vec![
            ("device", c.device.clone()),
            ("process", process.to_owned()),
            ("pid", pid.clone()),
            ("context", name),
            ("backend", c.backend.to_owned()),
        ];
        if c.budget_limit != u64::MAX {
            set(&limit, &labels, c.budget_limit);
        }
        set(&charged, &labels, c.charged);
        set(&peak, &labels, c.peak);
        set(&reserved, &labels, c.reserved);
        set(&outside, &labels, c.outside_bytes);
        set(&suspended, &labels, c.suspended);
        set(&cached, &labels, c.cache.cached_bytes);
        for role in Role::ALL {
            let u = c.role(role);
            let mut l = labels.clone();
            l.push(("role", role.name().to_owned()));
            set(&live, &l, u.live_bytes);
            set(&pending, &l, u.pending_bytes);
            set(&quarantined, &l, u.quarantined_bytes);
        }
        count(&allocations, &labels, c.counters.allocations);
        count(&refusals, &labels, c.counters.admission_refusals);
        count(&waits, &labels, c.counters.admission_waits);
        count(&pressure, &labels, c.counters.pressure_calls);
        count(&backend_errors, &labels, c.counters.backend_errors);
        if let Some(level) = c.process_limit.as_ref() {
            if level.limit != u64::MAX && !levels.contains(&level) {
                levels.push(level);
                let from = match &level.from {
                    crate::LimitSource::Program => "program".to_owned(),
                    crate::LimitSource::Granted(v) => v.clone(),
                };
                let labels: Labels = vec![
                    ("process", process.to_owned()),
                    ("pid", pid.clone()),
                    ("budget", level.label.clone()),
                    ("limit_from", from),
                ];
                set(&process_limit, &labels, level.limit);
            }
        }
    }
    p.text()
}

/// What one machine ledger adds to a page: its snapshot and, where the
/// management library answered, the processes it found on the device.
#[cfg(target_os = "linux")]
#[derive(Debug, Clone)]
pub struct LedgerFigures {
    /// The ledger's snapshot.
    pub snapshot: crate::machine::MachineSnapshot,
    /// The processes the device's management library (NVML, ROCm SMI)
    /// reports and the library's name; `None` where it could not be asked.
    pub device_processes: Option<crate::machine::DeviceProcesses>,
}

#[cfg(target_os = "linux")]
impl LedgerFigures {
    /// The snapshot, and the management library's processes where the
    /// ledger's key names a device by UUID or PCI address and the library
    /// is there.
    pub fn read(ledger: &crate::machine::MachineLedger) -> Self {
        let snapshot = ledger.snapshot();
        let device_processes = crate::DeviceIdentity::from_key(&snapshot.key)
            .and_then(|id| crate::machine::device_processes(&id).ok());
        Self {
            snapshot,
            device_processes,
        }
    }
}

/// Machine ledgers in Prometheus's exposition format: each ledger's
/// totals labelled `device` (the ledger's key), each process slot's
/// figures labelled `device`, `process`, `pid` and `slot`, and the
/// processes the management library found on the device outside the
/// ledger labelled `device`, `pid` and `library`; `unreadable` is the
/// count of segment files that were found and could not be read as
/// ledgers (`memgov_unreadable_segments`).
#[cfg(target_os = "linux")]
pub fn render_ledgers(ledgers: &[LedgerFigures], unreadable: u64) -> String {
    let mut p = Page::new();
    let bad = p.gauge(
        "memgov_unreadable_segments",
        "Segment files found that could not be read as machine ledgers (corrupt, another layout version, no permission)",
        None,
    );
    set(&bad, &Vec::new(), unreadable);
    let limit = p.gauge(
        "memgov_ledger_limit",
        "The most the machine ledger promises its processes together",
        Some(Unit::Bytes),
    );
    let charged = p.gauge(
        "memgov_ledger_charged",
        "Bytes charged on the ledger by every process (the sum of memgov_process_charged_bytes)",
        Some(Unit::Bytes),
    );
    let outside = p.gauge(
        "memgov_ledger_outside",
        "Device bytes in use outside memgov, as last observed",
        Some(Unit::Bytes),
    );
    let available = p.gauge(
        "memgov_ledger_available",
        "What the ledger can still promise: limit less charged less outside",
        Some(Unit::Bytes),
    );
    let dev_total = p.gauge(
        "memgov_ledger_device_total",
        "The device's total memory as the ledger last observed it (absent: never observed)",
        Some(Unit::Bytes),
    );
    let dev_free = p.gauge(
        "memgov_ledger_device_free",
        "The device's free memory as the ledger last observed it (absent: never observed)",
        Some(Unit::Bytes),
    );
    let slots = p.gauge("memgov_ledger_slots", "The ledger's process slots", None);
    let processes = p.gauge(
        "memgov_ledger_processes",
        "Occupied process slots, dead processes not yet reclaimed included",
        None,
    );
    let reclaims = p.counter(
        "memgov_ledger_reclaims",
        "Dead processes' slots reclaimed (their charges given back)",
        None,
    );
    let p_charged = p.gauge(
        "memgov_process_charged",
        "Bytes the process holds on the ledger, its idle lease included",
        Some(Unit::Bytes),
    );
    let p_used = p.gauge(
        "memgov_process_used",
        "Bytes charged to the process's allocations, as it last published them",
        Some(Unit::Bytes),
    );
    let p_cached = p.gauge(
        "memgov_process_cached",
        "Bytes in the process's block caches",
        Some(Unit::Bytes),
    );
    let p_limit = p.gauge(
        "memgov_process_limit",
        "The process's limit on the ledger (absent: none)",
        Some(Unit::Bytes),
    );
    let p_floor = p.gauge(
        "memgov_process_floor",
        "Bytes the ledger keeps for the process",
        Some(Unit::Bytes),
    );
    let p_contexts = p.gauge(
        "memgov_process_contexts",
        "The process's governed contexts",
        None,
    );
    let p_priority = p.gauge(
        "memgov_process_priority",
        "The process's priority on the ledger",
        None,
    );
    let p_alive = p.gauge(
        "memgov_process_alive",
        "1 while the process lives, 0 once it died and until a sweep reclaims its slot (its series then go)",
        None,
    );
    let p_rings = p.gauge(
        "memgov_process_unanswered_rings",
        "Trim requests rung at the process and not answered yet",
        None,
    );
    let p_gave = p.counter(
        "memgov_process_gave_back",
        "Bytes the process gave back when asked through its doorbell",
        Some(Unit::Bytes),
    );
    let outside_proc = p.gauge(
        "memgov_device_outside_process",
        "Device memory of a process the management library reports on the device with no slot on the ledger",
        Some(Unit::Bytes),
    );
    for f in ledgers {
        let s = &f.snapshot;
        let l: Labels = vec![("device", s.key.clone())];
        set(&limit, &l, s.limit);
        set(&charged, &l, s.charged);
        set(&outside, &l, s.outside);
        set(&available, &l, s.available());
        if s.observed_at_ms != 0 {
            set(&dev_total, &l, s.device_total);
            set(&dev_free, &l, s.device_free);
        }
        set(&slots, &l, s.slots as u64);
        set(&processes, &l, s.processes.len() as u64);
        count(&reclaims, &l, s.reclaims);
        for pr in &s.processes {
            let l: Labels = vec![
                ("device", s.key.clone()),
                ("process", pr.name.clone()),
                ("pid", pr.pid.to_string()),
                ("slot", pr.slot.to_string()),
            ];
            set(&p_charged, &l, pr.charged);
            set(&p_used, &l, pr.used);
            set(&p_cached, &l, pr.cached);
            if pr.limit != u64::MAX {
                set(&p_limit, &l, pr.limit);
            }
            set(&p_floor, &l, pr.floor);
            set(&p_contexts, &l, pr.contexts);
            set(&p_priority, &l, u64::from(pr.priority));
            set(&p_alive, &l, u64::from(pr.alive));
            set(&p_rings, &l, u64::from(pr.unanswered_rings));
            count(&p_gave, &l, pr.gave_back);
        }
        if let Some(found) = &f.device_processes {
            for d in s.processes_outside(found) {
                if let Some(bytes) = d.bytes {
                    let l: Labels = vec![
                        ("device", s.key.clone()),
                        ("pid", d.pid.to_string()),
                        ("library", found.library.to_owned()),
                    ];
                    set(&outside_proc, &l, bytes);
                }
            }
        }
    }
    p.text()
}

/// A page rendered here in the plain Prometheus text format (0.0.4), the
/// form node-exporter's textfile collector reads: a counter's `# HELP` and
/// `# TYPE` lines name the `_total` series, and the OpenMetrics-only
/// `# UNIT` and `# EOF` lines are left out.
pub fn textfile(page: &str) -> String {
    let mut out = String::with_capacity(page.len());
    let mut counters: Vec<&str> = Vec::new();
    for line in page.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.strip_suffix(" counter") {
                counters.push(name);
            }
        }
    }
    for line in page.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        if let Some((prefix, rest)) = meta {
            let name = rest.split(' ').next().unwrap_or("");
            if counters.contains(&name) {
                out.push_str(prefix);
                out.push_str(name);
                out.push_str("_total");
                out.push_str(&rest[name.len()..]);
                out.push('\n');
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// What a test runs at the scrape's pause point.
#[cfg(test)]
type PauseHook = Box<dyn FnMut(&str)>;

#[cfg(test)]
thread_local! {
    /// Called by a scrape on this thread before each context's snapshot,
    /// with the context's label: a test holds the scrape there.
    static BEFORE_CONTEXT: std::cell::RefCell<Option<PauseHook>> =
        const { std::cell::RefCell::new(None) };
}

/// The scrape's pause point (tests only): see [`BEFORE_CONTEXT`].
#[cfg(test)]
pub(crate) fn before_context(label: &str) {
    BEFORE_CONTEXT.with(|h| {
        if let Some(f) = h.borrow_mut().as_mut() {
            f(label);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::textfile;

    /// While a scrape is held inside its render (its snapshot of the
    /// first context taken, the second's not begun), allocations complete
    /// on both contexts: from a stream's block cache, from the backend, a
    /// release into the cache, a new stream, a new context registered and
    /// allocating. The scrape holds no lock across its walk that these
    /// take. Each step runs on a thread of its own; the bound on the wait
    /// only turns a step stuck behind the scrape into a failure instead of
    /// a hung test. The scrape then completes and shows both contexts.
    #[test]
    fn allocations_complete_while_a_scrape_is_held_inside_its_render() {
        use crate::null::NullContext;
        use crate::{Alloc, CacheConfig, ContextConfig, Governor, ProcessBudget, Role};
        use crate::{DeviceBuffer, SharedBudget};
        use std::sync::mpsc::channel;
        use std::sync::{Arc, Barrier};
        use std::time::Duration;

        let process = ProcessBudget::new("worker", 1 << 30);
        let device = SharedBudget::with_parent("gpu0", 1 << 30, &process);
        let gov = Governor::new();
        let config = |label: &str| {
            ContextConfig::new()
                .label(label)
                .budget(1 << 30)
                .shared_budget(device.clone())
                .cache(CacheConfig::new(1 << 20))
                .attribution(true)
        };
        let ctxs = [
            gov.register(NullContext::new(), config("first")),
            gov.register(NullContext::new(), config("second")),
        ];
        let streams: Vec<_> = ctxs.iter().map(|c| c.create_stream("s").unwrap()).collect();
        for (c, s) in ctxs.iter().zip(&streams) {
            drop(c.allocate(s, Alloc::new(4096, Role::Activation)).unwrap());
            assert_eq!(
                c.snapshot().cache.cached_count,
                1,
                "the block was not cached"
            );
        }
        let held = Arc::new(Barrier::new(2));
        let resume = Arc::new(Barrier::new(2));
        std::thread::scope(|sc| {
            let gov = &gov;
            let (hold, go) = (Arc::clone(&held), Arc::clone(&resume));
            let scrape = sc.spawn(move || {
                super::BEFORE_CONTEXT.with(|h| {
                    *h.borrow_mut() = Some(Box::new(move |label| {
                        if label == "second" {
                            hold.wait();
                            go.wait();
                        }
                    }));
                });
                super::render(gov)
            });
            held.wait();
            // The scrape is inside its render now, until `resume`.
            let (done_tx, done) = channel();
            let (ctxs, streams, gov) = (&ctxs, &streams, gov);
            sc.spawn(move || {
                let mut kept: Vec<DeviceBuffer<NullContext>> = Vec::new();
                for (c, s) in ctxs.iter().zip(streams) {
                    // From the cache, from the backend, a release.
                    kept.push(c.allocate(s, Alloc::new(4096, Role::Activation)).unwrap());
                    kept.push(c.allocate(s, Alloc::new(1 << 16, Role::KvCache)).unwrap());
                    drop(c.allocate(s, Alloc::new(8192, Role::Activation)).unwrap());
                    let t = c.create_stream("t").unwrap();
                    kept.push(c.allocate(&t, Alloc::new(4096, Role::Weights)).unwrap());
                }
                let third = gov.register(NullContext::new(), config("third"));
                let t = third.create_stream("t").unwrap();
                kept.push(third.allocate(&t, Alloc::new(4096, Role::Weights)).unwrap());
                let _ = done_tx.send(kept.len());
                drop(kept);
            });
            let finished = done.recv_timeout(Duration::from_secs(60));
            resume.wait();
            assert_eq!(
                finished.expect("an allocation waited on the held scrape"),
                7
            );
            let page = scrape.join().unwrap();
            for label in ["first", "second"] {
                assert!(
                    page.contains(&format!("context=\"{label}\"")),
                    "{label} missing from:\n{page}"
                );
            }
        });
    }

    /// A scrape while a stream's cache lock is held (as a cached allocation
    /// or release holds it) completes: the page is rendered without that
    /// lock. The holder blocks inside the lock until the scrape is done;
    /// the bound on the wait only turns a scrape stuck behind the lock into
    /// a failure instead of a hung test.
    #[test]
    fn a_scrape_takes_no_stream_cache_lock() {
        use crate::null::NullContext;
        use crate::{Alloc, CacheConfig, ContextConfig, Governor, Role};
        use std::sync::mpsc::channel;
        use std::time::Duration;

        let gov = Governor::new();
        let ctx = gov.register(
            NullContext::new(),
            ContextConfig::new()
                .label("cached")
                .cache(CacheConfig::new(1 << 20)),
        );
        let stream = ctx.create_stream("s").unwrap();
        drop(
            ctx.allocate(&stream, Alloc::new(4096, Role::Activation))
                .unwrap(),
        );
        assert_eq!(
            ctx.snapshot().cache.cached_count,
            1,
            "the block was not cached"
        );
        let shared = ctx
            .inner
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find_map(|w| w.upgrade())
            .unwrap();
        let (entered_tx, entered) = channel();
        let (release, release_rx) = channel::<()>();
        let (done_tx, done) = channel();
        std::thread::scope(|s| {
            let bins = shared.cache.as_ref().unwrap();
            s.spawn(move || {
                // Holds the bins' lock while blocked (one block: f runs once).
                bins.for_each(|_, _| {
                    entered_tx.send(()).unwrap();
                    let _ = release_rx.recv();
                });
            });
            entered.recv().unwrap();
            let gov = &gov;
            s.spawn(move || {
                let _ = done_tx.send(super::render(gov));
            });
            let page = done.recv_timeout(Duration::from_secs(60));
            release.send(()).unwrap();
            let page = page.expect("the scrape waited on a stream's cache lock");
            assert!(page.contains("memgov_context_cached_bytes{"), "{page}");
            assert!(page.contains("context=\"cached\""), "{page}");
        });
    }

    #[test]
    fn textfile_names_counters_with_total_and_drops_openmetrics_lines() {
        let page = "# HELP a_bytes A.\n# TYPE a_bytes gauge\n# UNIT a_bytes bytes\na_bytes 1\n\
                    # HELP b B.\n# TYPE b counter\nb_total 2\n# EOF\n";
        assert_eq!(
            textfile(page),
            "# HELP a_bytes A.\n# TYPE a_bytes gauge\na_bytes 1\n\
             # HELP b_total B.\n# TYPE b_total counter\nb_total 2\n"
        );
    }
}
