//! The null backend under the governor.

use memgov::null::NullContext;
use memgov::{Alloc, ContextConfig, Governor, Role};
use std::time::{Duration, Instant};

#[test]
fn inline_release_retires_at_once() {
    let gov = Governor::new();
    let null = NullContext::new();
    let probe = null.probe();
    let ctx = gov.register(null, ContextConfig::new().budget(1 << 20));
    let s = ctx.create_stream("s").unwrap();
    for _ in 0..10 {
        drop(ctx.allocate(&s, Alloc::new(1 << 19, Role::Other)).unwrap());
    }
    assert_eq!(probe.frees_retired(), 10);
    drop(s);
    let r = ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(1))
        .unwrap();
    assert_eq!(r.retired_releases, 10);
    assert!(probe.torn_down());
}

#[test]
fn deferred_releases_pend_until_retired() {
    let gov = Governor::new();
    let null = NullContext::deferred(4);
    let controls = null.controls();
    let probe = null.probe();
    let ctx = gov.register(null, ContextConfig::new());
    let s = ctx.create_stream("s").unwrap();
    for _ in 0..4 {
        drop(ctx.allocate(&s, Alloc::new(64, Role::Other)).unwrap());
    }
    drop(s);
    let h = ctx.retire();
    assert!(h.try_finish().is_err(), "four releases are pending");
    assert_eq!(controls.retire_parked(), 4);
    let r = h.wait(Instant::now() + Duration::from_secs(1)).unwrap();
    assert_eq!(r.retired_releases, 4);
    assert_eq!(probe.check_clean_teardown(), Ok(()));
}

#[test]
fn two_threads_on_two_governed_streams_sum_exactly() {
    // Under Miri, enough cycles to interleave the two threads, no more.
    const N: u64 = if cfg!(miri) { 50 } else { 5_000 };
    let gov = Governor::new();
    let null = NullContext::new();
    let probe = null.probe();
    let ctx = gov.register(null, ContextConfig::new());
    let streams = [
        ctx.create_stream("a").unwrap(),
        ctx.create_stream("b").unwrap(),
    ];
    std::thread::scope(|sc| {
        for s in &streams {
            let ctx = &ctx;
            sc.spawn(move || {
                for _ in 0..N {
                    drop(ctx.allocate(s, Alloc::new(4096, Role::Other)).unwrap());
                }
            });
        }
    });
    assert_eq!(probe.frees_retired(), 2 * N);
    let [a, b] = streams;
    drop(a);
    assert_eq!(probe.frees_retired(), 2 * N);
    drop(ctx.allocate(&b, Alloc::new(4096, Role::Other)).unwrap());
    assert_eq!(probe.frees_retired(), 2 * N + 1);
    drop(b);
    let r = ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(5))
        .unwrap();
    assert_eq!(r.retired_releases, 2 * N + 1);
    assert_eq!(probe.frees_retired(), 2 * N + 1);
    assert_eq!(probe.check_clean_teardown(), Ok(()));
}
