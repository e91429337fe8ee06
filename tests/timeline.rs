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
