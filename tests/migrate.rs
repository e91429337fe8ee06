//! Moving live buffers between contexts (`ContextHandle::migrate`): data,
//! roles and budgets on both sides, the all-or-nothing failure path, and
//! retiring the old context afterwards.

use memgov::host::{HostConfig, HostContext};
use memgov::null::NullContext;
use memgov::{
    Alloc, ContextConfig, DeviceBuffer, DeviceContext, Governor, GovernorError, PinKind,
    ProviderContextPinError, RetireError, Role, Tier,
};
use memgov_conformance::Watched;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

fn host(delay: Duration) -> HostContext {
    HostContext::new(HostConfig {
        capacity: 256 * MIB,
        op_delay: delay,
        ..HostConfig::default()
    })
    .unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn read_all<C: DeviceContext>(b: &DeviceBuffer<C>) -> Vec<u8> {
    let mut v = vec![0u8; b.len() as usize];
    b.read(0, &mut v).unwrap();
    v
}

#[test]
fn host_move_keeps_data_and_roles_and_moves_the_charge() {
    let gov = Governor::new();
    // The old device's retirements are held, so its releases are still
    // pending when it is retired, however the threads are scheduled.
    let old_device = Watched::new(host(Duration::ZERO));
    let old_log = old_device.log();
    old_log.hold_retirements(true);
    let old = gov.register(
        old_device,
        ContextConfig::new().label("gpu0").budget(64 * MIB),
    );
    let new = gov.register(
        Watched::new(host(Duration::ZERO)),
        ContextConfig::new().label("gpu1").budget(64 * MIB),
    );
    let s0 = old.create_stream("load").unwrap();
    let s1 = new.create_stream("load").unwrap();
    // One buffer larger than the move's host chunk, so it is copied in pieces.
    let specs = [
        (20 * MIB, Role::Weights, 1u8),
        (4096, Role::KvCache, 2),
        (3 * MIB + 5, Role::Activation, 3),
    ];
    let mut sources = Vec::new();
    for (bytes, role, seed) in specs {
        let b = old.allocate(&s0, Alloc::new(bytes, role)).unwrap();
        b.write(0, &pattern(seed, bytes as usize)).unwrap();
        sources.push(b);
    }
    let total: u64 = specs.iter().map(|s| s.0).sum();
    assert_eq!(old.snapshot().charged, total);
    assert_eq!(new.snapshot().charged, 0);

    let moved = new.migrate(&s1, sources).unwrap();

    // The originals are released, not live: at most pending on the old device.
    let source = old.snapshot();
    assert_eq!(source.total().live_count, 0);
    assert_eq!(source.charged, source.total().pending_bytes);

    // Retire the old context: only its stream and the pending frees hold it,
    // no live buffer.
    let retire = old.retire();
    let early = retire.wait(Instant::now() + Duration::from_millis(1));
    let Err(RetireError::Outstanding { outstanding, .. }) = &early else {
        panic!("retirements are held, yet the old context finished: {early:?}");
    };
    assert!(
        outstanding
            .items
            .iter()
            .all(|i| matches!(i.kind, PinKind::PendingRelease | PinKind::Stream)),
        "{outstanding:?}"
    );
    assert!(
        outstanding
            .items
            .iter()
            .any(|i| i.kind == PinKind::PendingRelease),
        "{outstanding:?}"
    );

    // The copies carry the data, the roles and the charge.
    assert_eq!(moved.len(), 3);
    for (b, (bytes, role, seed)) in moved.iter().zip(specs) {
        assert_eq!(b.context(), new.id());
        assert_eq!((b.len(), b.role()), (bytes, role));
        assert!(read_all(b) == pattern(seed, bytes as usize), "{role} data");
    }
    let target = new.snapshot();
    assert_eq!(target.charged, total);
    assert_eq!(target.role(Role::Weights).live_bytes, 20 * MIB);
    assert_eq!(target.total().live_count, 3);
    // Every free queued on `s0` has executed once it is synchronised, so
    // every signal is parked: let them go, and the rest through.
    s0.synchronize().unwrap();
    old_log.hold_retirements(false);
    assert_eq!(old_log.release_held(), 3);
    drop(s0);
    let report = retire.wait(soon()).unwrap();
    assert_eq!(report.retired_releases, 3);
    assert_eq!(old.snapshot().charged, 0);

    // The moved buffers are fully usable and retire with their new context.
    moved[1].write(0, b"still here").unwrap();
    drop(moved);
    drop(s1);
    let report = new.retire().wait(soon()).unwrap();
    assert_eq!(report.retired_releases, 3);
}

#[test]
fn a_refused_move_returns_every_source_and_leaves_nothing_on_the_target() {
    let gov = Governor::new();
    let old = gov.register(host(Duration::ZERO), ContextConfig::new().label("gpu0"));
    // Room for the first two buffers only.
    let new = gov.register(
        host(Duration::ZERO),
        ContextConfig::new().label("gpu1").budget(3 * MIB),
    );
    let s0 = old.create_stream("s").unwrap();
    let s1 = new.create_stream("s").unwrap();
    let mut sources = Vec::new();
    for seed in 0..3u8 {
        let b = old
            .allocate(&s0, Alloc::new(MIB + 1, Role::Weights))
            .unwrap();
        b.write(0, &pattern(seed, (MIB + 1) as usize)).unwrap();
        sources.push(b);
    }
    let charged_before = old.snapshot().charged;

    let e = new.migrate(&s1, sources).unwrap_err();

    assert_eq!((e.index, e.undone), (2, 2));
    assert!(
        matches!(e.error, GovernorError::BudgetExceeded(_)),
        "{:?}",
        e.error
    );
    let msg = e.to_string();
    assert!(
        msg.contains("moving buffer 3 of 3") && msg.contains("returned unchanged"),
        "{msg}"
    );
    // The sources are back, in order, intact and still charged.
    assert_eq!(e.buffers.len(), 3);
    for (seed, b) in e.buffers.iter().enumerate() {
        assert_eq!(b.context(), old.id());
        assert!(read_all(b) == pattern(seed as u8, (MIB + 1) as usize));
    }
    assert_eq!(old.snapshot().charged, charged_before);
    // The two copies made were released on the target.
    s1.synchronize().unwrap();
    let target = new.snapshot();
    assert_eq!(target.charged, 0);
    assert_eq!(target.total().live_count, 0);
    assert_eq!(target.counters.retired, 2);

    // Make room and move again: it succeeds with the same buffers.
    new.set_budget(Tier::Device, 8 * MIB);
    let moved = new.migrate(&s1, e.buffers).unwrap();
    assert!(read_all(&moved[2]) == pattern(2, (MIB + 1) as usize));
    drop((moved, s0, s1));
    for ctx in [old, new] {
        ctx.retire().wait(soon()).unwrap();
    }
}

#[test]
fn a_stream_of_another_context_is_refused_before_anything_moves() {
    let gov = Governor::new();
    let a = gov.register(host(Duration::ZERO), ContextConfig::new().label("a"));
    let b = gov.register(host(Duration::ZERO), ContextConfig::new().label("b"));
    let sa = a.create_stream("s").unwrap();
    let buf = a.allocate(&sa, Alloc::new(64, Role::Workspace)).unwrap();
    let e = b.migrate(&sa, vec![buf]).unwrap_err();
    assert!(matches!(e.error, GovernorError::WrongContext { .. }), "{e}");
    assert_eq!(e.buffers.len(), 1);
    assert_eq!(e.buffers[0].context(), a.id());
    assert_eq!(b.snapshot().counters.allocations, 0);
}

#[test]
fn null_move_carries_budgets_and_the_old_context_retires() {
    let gov = Governor::new();
    let old = gov.register(
        NullContext::new(),
        ContextConfig::new().label("n0").budget(16 * MIB),
    );
    let new = gov.register(
        NullContext::new(),
        ContextConfig::new().label("n1").budget(16 * MIB),
    );
    let s0 = old.create_stream("s").unwrap();
    let s1 = new.create_stream("s").unwrap();
    let sources: Vec<_> = [(MIB, Role::Weights), (2 * MIB, Role::KvCache)]
        .into_iter()
        .map(|(n, r)| old.allocate(&s0, Alloc::new(n, r)).unwrap())
        .collect();
    let moved = new.migrate(&s1, sources).unwrap();
    assert_eq!(new.snapshot().charged, 3 * MIB);
    assert_eq!(new.snapshot().role(Role::KvCache).live_bytes, 2 * MIB);
    assert_eq!(old.snapshot().charged, 0, "null frees retire inline");
    drop(s0);
    let report = old.retire().wait(soon()).unwrap();
    assert_eq!(report.retired_releases, 2);

    // A retiring target refuses the move; the buffers come back.
    let back = new.retire();
    let e = new.migrate(&s1, moved).unwrap_err();
    assert!(
        matches!(
            e.error,
            GovernorError::Pin {
                refusal: ProviderContextPinError::ContextUnavailable(_),
                ..
            }
        ),
        "{e}"
    );
    assert_eq!((e.buffers.len(), e.undone), (2, 0));
    drop(e);
    drop(s1);
    let report = back.wait(soon()).unwrap();
    assert_eq!(report.retired_releases, 2);
    assert_eq!(gov.snapshot().total(), Default::default());
}
