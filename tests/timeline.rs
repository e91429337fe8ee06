//! The memory timeline counts everything the books count: reservations
//! (made, grown, given back, the unused remainder at drop, allocations out of
//! them), sleeps and wakes per role, and allocations and releases, so that
//! per context the events balance with what the snapshot shows.

use memgov::host::{HostConfig, HostContext};
use memgov::trace::{Event, EventKind, Trace};
use memgov::{Alloc, ContextConfig, Governor, Reserve, Role, SharedBudget, Tuning};
use std::time::Duration;

/// Where `role`'s figures are in arrays indexed like [`Role::ALL`].
fn idx(role: Role) -> usize {
    Role::ALL.iter().position(|&r| r == role).unwrap()
}

/// Sum of the bytes of the events of `kind` that `pick` keeps.
fn sum(events: &[Event], kind: EventKind, pick: impl Fn(&Event) -> bool) -> u64 {
    events
        .iter()
        .filter(|e| e.kind == kind && pick(e))
        .map(|e| e.bytes)
        .sum()
}

/// Live bytes of `role` by the timeline: allocated less released.
fn live(events: &[Event], role: Role) -> u64 {
    let of = |e: &Event| e.role == Some(role);
    sum(events, EventKind::Allocated, of) - sum(events, EventKind::Released, of)
}

/// Reserved bytes by the timeline: reserved, less given back, less what
/// allocations out of reservations took.
fn reserved(events: &[Event]) -> u64 {
    sum(events, EventKind::Reserved, |_| true)
        - sum(events, EventKind::Unreserved, |_| true)
        - sum(events, EventKind::Allocated, |e| e.note.is_some())
}

/// The highest total of live bytes the timeline reached.
fn live_peak(events: &[Event]) -> u64 {
    let (mut now, mut peak) = (0i128, 0i128);
    for e in events {
        match e.kind {
            EventKind::Allocated => now += i128::from(e.bytes),
            EventKind::Released => now -= i128::from(e.bytes),
            _ => {}
        }
        peak = peak.max(now);
    }
    peak as u64
}

#[test]
fn reservations_sleeps_and_wakes_are_on_the_timeline_and_balance_with_the_snapshot() {
    const MIB: u64 = 1 << 20;
    let trace = Trace::new();
    let device = SharedBudget::new("gpu0", 64 * MIB);
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new()
            .label("llm")
            .shared_budget(device.clone())
            .tuning(Tuning::new().exact_peak(true))
            .trace(&trace),
    );
    let stream = ctx.create_stream("decode").unwrap();
    let weights = ctx
        .allocate(&stream, Alloc::new(8 * MIB, Role::Weights))
        .unwrap();
    let kv = ctx.reserve(Reserve::new(4 * MIB, "kv pool")).unwrap();
    let block = kv
        .allocate(&stream, Alloc::new(MIB, Role::KvCache))
        .unwrap();
    assert_eq!(kv.shrink(MIB), MIB);
    kv.grow(2 * MIB).unwrap();
    // Held now: weights 8 MiB, a KV block of 1 MiB; 4 MiB reserved unused.
    let events = trace.events();
    let snap = ctx.snapshot();
    assert_eq!(reserved(&events), snap.reserved, "{events:#?}");
    assert_eq!(snap.reserved, 4 * MIB);
    for role in Role::ALL {
        assert_eq!(
            live(&events, role),
            snap.by_role[idx(role)].live_bytes,
            "{role:?}"
        );
    }
    let allocated_from_kv = events
        .iter()
        .find(|e| e.kind == EventKind::Allocated && e.role == Some(Role::KvCache))
        .unwrap();
    assert_eq!(allocated_from_kv.note.as_deref(), Some("kv pool"));

    // The unused remainder goes back at the drop.
    drop(kv);
    let slept = ctx.sleep_with(&[], |_| Ok(())).unwrap();
    let woken = ctx.wake_with(&[], |_| Ok(())).unwrap();
    let events = trace.events();
    let unreserved: Vec<u64> = events
        .iter()
        .filter(|e| e.kind == EventKind::Unreserved)
        .map(|e| e.bytes)
        .collect();
    assert_eq!(unreserved, [MIB, 4 * MIB]);
    assert_eq!(reserved(&events), 0);
    for (kind, by_role) in [
        (EventKind::Slept, slept.by_role),
        (EventKind::Woke, woken.by_role),
    ] {
        for role in Role::ALL {
            let of = |e: &Event| e.role == Some(role);
            assert_eq!(
                sum(&events, kind, of),
                by_role[idx(role)],
                "{kind:?} {role:?}"
            );
        }
    }
    assert_eq!(slept.by_role[idx(Role::Weights)], 8 * MIB);
    assert_eq!(woken.by_role[idx(Role::KvCache)], MIB);

    drop((weights, block));
    stream.synchronize().unwrap();
    let snap = ctx.snapshot();
    let events = trace.events();
    assert_eq!(live_peak(&events), snap.peak, "{events:#?}");
    assert_eq!(snap.peak, 9 * MIB);
    for role in Role::ALL {
        assert_eq!(live(&events, role), 0, "{role:?}");
    }
    drop(stream);
    ctx.retire().wait_timeout(Duration::from_secs(5)).unwrap();
    // Every kind of event this workload makes is in the file the page reads.
    let json = trace.to_chrome_json();
    for kind in ["reserved", "unreserved", "slept", "woke"] {
        assert!(
            json.contains(&format!(r#""kind":"{kind}""#)),
            "no {kind} in {json}"
        );
    }
    assert!(json.contains(r#""kind":"allocated","bytes":1048576,"note":"kv pool""#));
}

/// A trim of the process budget (what the machine ledger asks for another
/// process) is on the timeline of each context it asked, with what that
/// context's pressure responders gave back.
#[test]
fn a_trim_of_the_process_budget_is_on_the_timeline_of_each_context_it_asked() {
    use memgov::ProcessBudget;
    use std::sync::{Arc, Mutex};
    const MIB: u64 = 1 << 20;
    let trace = Trace::new();
    let process = ProcessBudget::new("worker", 64 * MIB);
    let gpu0 = SharedBudget::with_parent("gpu0", 64 * MIB, &process);
    let gov = Governor::new();
    let register = |label: &str| {
        gov.register(
            HostContext::new(HostConfig::default()).unwrap(),
            ContextConfig::new()
                .label(label)
                .shared_budget(gpu0.clone())
                .trace(&trace),
        )
    };
    let (a, quiet) = (register("a"), register("quiet"));
    let stream = a.create_stream("s").unwrap();
    let held = Arc::new(Mutex::new(Some(
        a.allocate(&stream, Alloc::new(4 * MIB, Role::KvCache))
            .unwrap(),
    )));
    let given = held.clone();
    a.add_pressure_responder(0, move |_| {
        given.lock().unwrap().take().map_or(0, |b| b.len())
    });
    assert_eq!(process.trim(3 * MIB), 4 * MIB);
    let events = trace.events();
    let trims: Vec<(&str, u64)> = events
        .iter()
        .filter(|e| e.kind == EventKind::Trimmed)
        .map(|e| (&*e.context, e.bytes))
        .collect();
    // The context without responders or a cache was not asked.
    assert_eq!(trims, [("a", 4 * MIB)], "{events:#?}");
    let note = events
        .iter()
        .find(|e| e.kind == EventKind::Trimmed)
        .and_then(|e| e.note.clone())
        .unwrap();
    assert!(note.contains(&(3 * MIB).to_string()), "{note}");
    assert!(held.lock().unwrap().is_none());
    drop(stream);
    for ctx in [a, quiet] {
        ctx.retire().wait_timeout(Duration::from_secs(5)).unwrap();
    }
}

/// With attribution on, a traced context's allocations, releases and
/// refusals name the line that made them (and its label): the site its
/// snapshot's row names, so that a timeline's table per site is built from
/// the trace alone. Off, they name none.
#[test]
fn a_traced_context_with_attribution_on_records_the_site_of_each_allocation() {
    const KIB: u64 = 1 << 10;
    let trace = Trace::new();
    let gov = Governor::new();
    let register = |label: &str, on: bool| {
        gov.register(
            HostContext::new(HostConfig::default()).unwrap(),
            ContextConfig::new()
                .label(label)
                .budget(64 * KIB)
                .attribution(on)
                .trace(&trace),
        )
    };
    let (ctx, plain) = (register("on", true), register("off", false));
    let stream = ctx.create_stream("s").unwrap();
    let kv = Alloc::new(16 * KIB, Role::KvCache).label("kv");
    let kv_line = line!() + 1;
    let kv = ctx.allocate(&stream, kv).unwrap();
    let too_much = Alloc::new(128 * KIB, Role::Activation);
    let refused_line = line!() + 1;
    let refused = ctx.allocate(&stream, too_much);
    assert!(refused.is_err());
    let named = ctx
        .allocate(
            &stream,
            Alloc::new(4 * KIB, Role::Weights).site("model.c:42"),
        )
        .unwrap();
    let plain_stream = plain.create_stream("s").unwrap();
    drop(
        plain
            .allocate(&plain_stream, Alloc::new(4 * KIB, Role::Weights))
            .unwrap(),
    );
    drop(kv);

    let events = trace.events();
    let of = |kind: EventKind, context: &str| -> Vec<(Option<String>, Option<String>, u64)> {
        events
            .iter()
            .filter(|e| e.kind == kind && &*e.context == context)
            .map(|e| {
                (
                    e.site.as_deref().map(str::to_owned),
                    e.label.as_deref().map(str::to_owned),
                    e.bytes,
                )
            })
            .collect()
    };
    let snap = ctx.snapshot();
    let kv_site = snap
        .sites
        .iter()
        .find(|s| s.label.as_deref() == Some("kv"))
        .map(|s| s.site.clone())
        .unwrap();
    assert!(
        kv_site.starts_with(&format!("{}:{kv_line}:", file!())),
        "{kv_site} is not the kv allocation's line {kv_line}"
    );
    let kv_row = (Some(kv_site.clone()), Some("kv".to_owned()), 16 * KIB);
    let named_row = (Some("model.c:42".to_owned()), None, 4 * KIB);
    assert_eq!(of(EventKind::Allocated, "on"), [kv_row.clone(), named_row]);
    assert_eq!(of(EventKind::Released, "on"), [kv_row]);
    let refusals = of(EventKind::Refused, "on");
    assert_eq!(refusals.len(), 1, "{events:#?}");
    let refused_at = refusals[0].0.clone().unwrap();
    assert!(
        refused_at.starts_with(&format!("{}:{refused_line}:", file!())),
        "{refused_at}"
    );
    // Attribution off: no site on any event.
    assert!(
        events
            .iter()
            .filter(|e| &*e.context == "off")
            .all(|e| e.site.is_none() && e.label.is_none()),
        "{events:#?}"
    );
    // In the written trace, as the page reads them.
    let json = trace.to_chrome_json();
    assert!(
        json.contains(&format!(
            r#""kind":"allocated","bytes":16384,"site":"{kv_site}","label":"kv""#
        )),
        "{json}"
    );
    assert!(json.contains(r#""kind":"allocated","bytes":4096,"site":"model.c:42"}"#));
    drop((named, stream, plain_stream));
    for c in [ctx, plain] {
        c.retire().wait_timeout(Duration::from_secs(5)).unwrap();
    }
}

/// A trim the machine ledger asks for on behalf of another process (its
/// ring answered by this process's doorbell thread) is on the timeline of
/// the context whose responder gave the bytes back, with what the other
/// process asked for.
#[cfg(target_os = "linux")]
#[test]
fn a_trim_answered_for_the_machine_ledger_is_on_the_timeline() {
    use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
    use memgov::{Admission, ProcessBudget};
    use std::sync::{Arc, Mutex};
    use std::time::Instant;
    const MIB: u64 = 1 << 20;
    let dir = std::env::temp_dir().join(format!("memgov-timeline-trim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ledger =
        MachineLedger::open(&LedgerOptions::new("timeline", 64 * MIB).path(dir.join("ledger")))
            .unwrap();
    let member = ledger
        .join(JoinOptions::new("holder").priority(10).lease_chunk(0))
        .unwrap();
    let process = ProcessBudget::with_machine("holder", u64::MAX, member);
    let device = SharedBudget::with_parent("gpu", u64::MAX, &process);
    let trace = Trace::new();
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new()
            .label("holder")
            .shared_budget(device)
            .admission(Admission::FailFast)
            .trace(&trace),
    );
    let stream = ctx.create_stream("hold").unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    for _ in 0..48 {
        let buffer = ctx.allocate(&stream, Alloc::new(MIB, Role::KvCache));
        held.lock().unwrap().push(buffer.unwrap());
    }
    let h = Arc::clone(&held);
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |req| {
        let mut held = h.lock().unwrap();
        let mut freed = 0;
        while freed < req.shortfall && !held.is_empty() {
            held.pop();
            freed += MIB;
        }
        freed
    });
    // Another process: 32 MiB do not fit beside the holder's 48.
    let requester = ledger
        .join(JoinOptions::new("requester").priority(200).lease_chunk(0))
        .unwrap();
    assert!(requester.charge(32 * MIB).is_err());
    let unanswered = requester.make_room(32 * MIB, Instant::now() + Duration::from_secs(20));
    assert!(unanswered.is_empty(), "{unanswered:?}");
    // The holder answers once its trim (which records the event) is over:
    // wait for the answer (a state; 10 s only bounds a broken run).
    let answered = || {
        ledger
            .snapshot()
            .processes
            .into_iter()
            .find(|p| p.name == "holder")
            .is_some_and(|p| p.unanswered_rings == 0)
    };
    let until = Instant::now() + Duration::from_secs(10);
    while !answered() {
        assert!(Instant::now() < until, "the holder never answered");
        std::thread::sleep(Duration::from_millis(1));
    }
    let events = trace.events();
    let trims: Vec<&Event> = events
        .iter()
        .filter(|e| e.kind == EventKind::Trimmed)
        .collect();
    assert_eq!(trims.len(), 1, "{events:#?}");
    let freed = 48 * MIB - held.lock().unwrap().len() as u64 * MIB;
    assert!(freed > 0);
    assert_eq!((&*trims[0].context, trims[0].bytes), ("holder", freed));
    let note = trims[0].note.as_deref().unwrap_or_default();
    assert!(note.contains("asked for"), "{note}");
    held.lock().unwrap().clear();
    drop(stream);
    ctx.retire().wait_timeout(Duration::from_secs(5)).unwrap();
    drop((ctx, gov, process, requester, ledger));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A buffer whose free the backend refuses is released once on the
/// timeline, then abandoned: the events balance with the allocation.
#[test]
fn a_refused_free_is_released_once_then_abandoned_on_the_timeline() {
    use memgov::fault::{Fault, FaultInjecting, FaultPlan, Operation};
    let backend = FaultInjecting::new(
        HostContext::new(HostConfig::default()).unwrap(),
        FaultPlan::new().nth(Operation::FreeAsync, 1, Fault::Error),
    );
    let trace = Trace::new();
    let gov = Governor::new();
    let ctx = gov.register(
        backend,
        ContextConfig::new()
            .label("refused-free")
            .attribution(true)
            .trace(&trace),
    );
    let stream = ctx.create_stream("s").unwrap();
    drop(
        ctx.allocate(&stream, Alloc::new(4096, Role::Other))
            .unwrap(),
    );
    assert_eq!(ctx.snapshot().total().quarantined_bytes, 4096);
    let events = trace.events();
    let count = |kind| events.iter().filter(|e| e.kind == kind).count();
    assert_eq!(
        (
            count(EventKind::Allocated),
            count(EventKind::Released),
            count(EventKind::Abandoned)
        ),
        (1, 1, 1),
        "{events:#?}"
    );
    let released = events.iter().find(|e| e.kind == EventKind::Released);
    assert!(released.and_then(|e| e.site.as_deref()).is_some());
    drop(stream);
    ctx.retire().wait_timeout(Duration::from_secs(5)).unwrap();
}

/// The timeline's figures of a context with a block cache, by role summed:
/// live (allocated + reused − released − cached), cached (cached − reused −
/// the role-bearing trimmed) and pending (released + trimmed − retired −
/// abandoned).
fn cache_figures(events: &[Event]) -> (u64, u64, u64) {
    let of = |e: &Event| e.role.is_some();
    let s = |kind| sum(events, kind, of);
    let live = s(EventKind::Allocated) + s(EventKind::Reused)
        - s(EventKind::Released)
        - s(EventKind::Cached);
    let cached = s(EventKind::Cached) - s(EventKind::Reused) - s(EventKind::Trimmed);
    let pending = s(EventKind::Released) + s(EventKind::Trimmed)
        - s(EventKind::Retired)
        - s(EventKind::Abandoned);
    (live, cached, pending)
}

/// The highest total of live and cached bytes the timeline reached: what
/// the books count as live (a cached block keeps its charge and its place
/// in the live statistics), so what the snapshot's `peak` reads.
fn charged_peak(events: &[Event]) -> u64 {
    let (mut now, mut peak) = (0i128, 0i128);
    for e in events.iter().filter(|e| e.role.is_some()) {
        match e.kind {
            EventKind::Allocated => now += i128::from(e.bytes),
            EventKind::Released | EventKind::Trimmed => now -= i128::from(e.bytes),
            _ => {}
        }
        peak = peak.max(now);
    }
    peak as u64
}

/// A traced context keeps its block cache, and its timeline shows every
/// step of a block: cached at its release, reused by the next allocation of
/// its class, trimmed by `trim_cache`, by a refused admission and by retire,
/// each with its bytes; at every step the events balance with the
/// snapshot's live, cached and charged bytes.
#[test]
fn a_traced_context_keeps_its_cache_and_its_timeline_shows_every_block() {
    use memgov::{Admission, CacheConfig};
    const KIB: u64 = 1 << 10;
    let trace = Trace::new();
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new()
            .label("cached")
            .budget(64 * KIB)
            // The cache's blocks given back under pressure are stream-ordered
            // frees: the refused allocation waits for them to retire.
            .admission(Admission::WaitForPending {
                timeout: Duration::from_secs(10),
            })
            .cache(CacheConfig::new(64 * KIB))
            .tuning(Tuning::new().exact_peak(true))
            .attribution(true)
            .trace(&trace),
    );
    let stream = ctx.create_stream("main").unwrap();
    // Each step: the stream drained (so nothing is left pending), then the
    // timeline against the snapshot.
    let check =
        |step: &str, live: u64, cached: u64| {
            stream.synchronize().unwrap();
            let events = trace.events();
            let snap = ctx.snapshot();
            let total = snap.total();
            assert_eq!(
            cache_figures(&events),
            (total.live_bytes, snap.cache.cached_bytes, total.pending_bytes),
            "{step}: the timeline's (live, cached, pending) against the snapshot's\n{events:#?}"
        );
            assert_eq!(
                (total.live_bytes, snap.cache.cached_bytes),
                (live, cached),
                "{step}"
            );
            assert_eq!(snap.charged, live + cached, "{step}: charged");
            assert_eq!(charged_peak(&events), snap.peak, "{step}: peak");
            events
        };
    let last = |events: &[Event], kind: EventKind| {
        events
            .iter()
            .rev()
            .find(|e| e.kind == kind)
            .cloned()
            .unwrap_or_else(|| panic!("no {kind:?} event: {events:#?}"))
    };

    let a = ctx
        .allocate(&stream, Alloc::new(1000, Role::Workspace))
        .unwrap();
    check("allocated", KIB, 0);
    drop(a);
    let events = check("released into the cache", 0, KIB);
    let cached = last(&events, EventKind::Cached);
    assert_eq!((cached.bytes, cached.role), (KIB, Some(Role::Workspace)));
    assert!(cached.site.is_some(), "{cached:?}");
    assert_eq!(
        sum(&events, EventKind::Released, |_| true),
        0,
        "{events:#?}"
    );

    let b = ctx
        .allocate(&stream, Alloc::new(900, Role::Workspace))
        .unwrap();
    let events = check("reused", KIB, 0);
    assert_eq!(ctx.snapshot().cache.hits, 1);
    let reused = last(&events, EventKind::Reused);
    assert_eq!((reused.bytes, reused.role), (KIB, Some(Role::Workspace)));
    assert!(reused.site.is_some(), "{reused:?}");
    assert_eq!(
        sum(&events, EventKind::Allocated, |_| true),
        KIB,
        "no backend allocation"
    );

    // Two blocks cached; trim_cache gives the largest back.
    let c = ctx
        .allocate(&stream, Alloc::new(4 * KIB, Role::Activation))
        .unwrap();
    drop(b);
    drop(c);
    check("two blocks cached", 0, 5 * KIB);
    assert_eq!(ctx.trim_cache(1), 4 * KIB);
    let events = check("trim_cache", 0, KIB);
    let trimmed = last(&events, EventKind::Trimmed);
    assert_eq!(
        (trimmed.bytes, trimmed.role, trimmed.note.as_deref()),
        (4 * KIB, Some(Role::Activation), Some("trim_cache"))
    );
    assert_eq!(last(&events, EventKind::Retired).bytes, 4 * KIB);

    // An allocation the budget refuses while the cache holds 1 KiB: the
    // cache gives it back before anything else.
    let big = ctx
        .allocate(&stream, Alloc::new(64 * KIB - 512, Role::Activation))
        .unwrap();
    let events = check("pressure", 64 * KIB - 512, 0);
    let trimmed = last(&events, EventKind::Trimmed);
    assert_eq!(
        (trimmed.bytes, trimmed.role, trimmed.note.as_deref()),
        (KIB, Some(Role::Workspace), Some("pressure"))
    );
    assert_eq!(ctx.snapshot().cache.pressure_released, KIB);
    drop(big);
    check("cached again", 0, 64 * KIB - 512);

    // Retire empties the cache (the stream still open when it begins).
    let retiring = ctx.retire();
    drop(stream);
    retiring.wait_timeout(Duration::from_secs(5)).unwrap();
    let events = trace.events();
    let flushed: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::Trimmed && e.role.is_some())
        .map(|e| (e.bytes, e.note.as_deref().unwrap_or("")))
        .collect();
    assert_eq!(
        flushed,
        [
            (4 * KIB, "trim_cache"),
            (KIB, "pressure"),
            (64 * KIB - 512, "retire")
        ],
        "{events:#?}"
    );
    assert_eq!(cache_figures(&events), (0, 0, 0), "{events:#?}");
}

/// A trim of the process budget reaches a traced context's cache: each
/// block it gives back is on the timeline with its role, before the trim's
/// own event, and the bytes agree.
#[test]
fn a_process_trim_of_a_traced_cache_is_on_the_timeline() {
    use memgov::{CacheConfig, ProcessBudget};
    const MIB: u64 = 1 << 20;
    let trace = Trace::new();
    let process = ProcessBudget::new("worker", 64 * MIB);
    let gpu0 = SharedBudget::with_parent("gpu0", 64 * MIB, &process);
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new()
            .label("a")
            .shared_budget(gpu0.clone())
            .cache(CacheConfig::new(16 * MIB))
            .trace(&trace),
    );
    let stream = ctx.create_stream("s").unwrap();
    drop(
        ctx.allocate(&stream, Alloc::new(2 * MIB, Role::KvCache))
            .unwrap(),
    );
    assert_eq!(ctx.snapshot().cache.cached_bytes, 2 * MIB);
    assert_eq!(process.trim(MIB), 2 * MIB);
    stream.synchronize().unwrap();
    let events = trace.events();
    let trims: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::Trimmed)
        .map(|e| (e.role, e.bytes, e.note.clone().unwrap_or_default()))
        .collect();
    assert_eq!(trims.len(), 2, "{events:#?}");
    assert_eq!((trims[0].0, trims[0].1), (Some(Role::KvCache), 2 * MIB));
    assert_eq!((trims[1].0, trims[1].1), (None, 2 * MIB));
    assert!(trims[1].2.contains(&MIB.to_string()), "{trims:?}");
    let snap = ctx.snapshot();
    assert_eq!(cache_figures(&events), (0, 0, 0), "{events:#?}");
    assert_eq!((snap.cache.cached_bytes, snap.charged), (0, 0));
    drop(stream);
    ctx.retire().wait_timeout(Duration::from_secs(5)).unwrap();
}
