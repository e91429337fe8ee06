//! A backend's virtual-memory arena and sleep/wake, and the stand-in's
//! virtual memory management rules, each with a planted violation: the
//! cases the CUDA and HIP backends share, written once against the `vendor`
//! module of the test binary that includes this file (see `README.md`
//! beside it). The conformance suite runs on an arena context.
//!
//! Every case runs in a child process (the test binary re-executed with
//! the vendor's child variable set): the stand-in reads its knobs once per
//! process and aborts the process on a violation. Without the stand-in
//! every test prints `skipped: ...` and passes. The stand-in cases call
//! the driver raw, through the vendor's `raw` module.
//!
//! `MEMGOV_ARENA_SLEEP_MIB` sets the size of the sleep/wake set (default
//! 16, for CI time; the full check is 1024) and `MEMGOV_ARENA_SLEEP_CYCLES`
//! the cycles (default: the vendor's `SLEEP_CYCLES`; the full check is 100).

use crate::common;
use crate::vendor::{
    self, aborts, at, passes, vmm, Arena, Config, Context, Memory, Stream, ARENA_NAME, BANNER,
    CREATE_ENTRY, DESTROY_STREAM_FINISHES_ITS_WORK, EXIT_CHECK, FAIL_UNMAP_AT, FAIL_VMM_AT,
    GOVERNED_GROW_SHRINK_SEEDS, GROW_SHRINK_SEEDS, LATENCY, MAP_ENTRY, RELEASE_ENTRY, SEED,
    SET_ACCESS_ENTRY, SLEEP_CYCLES, UNMAP_ENTRY,
};
use memgov::{Alloc, BackendErrorKind, DeviceContext, RetireSignal};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) const MIB: u64 = 1 << 20;
/// A granule of the stand-ins' virtual memory (both vendors': 2 MiB).
pub(crate) const G: usize = 2 << 20;

/// A context whose device memory comes from an arena of 1 GiB of address
/// space and at most 512 MiB mapped: the whole conformance suite runs on it.
fn arena_factory() -> Result<Context, memgov::BackendError> {
    Context::new(Config {
        arena: Some(vendor::ArenaConfig {
            reserve_bytes: 1 << 30,
            limit_bytes: 512 * MIB,
        }),
        ..Config::default()
    })
}

memgov_conformance::conformance_tests!(conformance, super::arena_factory);

pub(crate) fn arena(ctx: &Context) -> Arena {
    ctx.arena().expect("the context has an arena")
}

pub(crate) fn arena_context(reserve: u64, limit: u64) -> Context {
    Context::new(Config {
        arena: Some(vendor::ArenaConfig {
            reserve_bytes: reserve,
            limit_bytes: limit,
        }),
        ..Config::default()
    })
    .expect("a context with an arena")
}

/// The capability cases of `memgov_conformance` on the arena, under a
/// jittered latency with the exit check on.
#[test]
fn capability_arena_cases_pass_on_the_arena() {
    passes(
        "capability_arena",
        &[(LATENCY, "300"), (SEED, "1"), (EXIT_CHECK, "1")],
    );
}

/// One case of `memgov_conformance::arena_faults` in a child of its own.
fn arena_fault(case: &str) {
    passes(&format!("arena_fault:{case}"), &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_granule_quarantined_under_a_sleeping_allocation_stays_out_of_the_allocator() {
    // The handle's release refused during a set's sleep.
    arena_fault("quarantined_granule_in_use_stays_out_of_the_allocator");
}

#[test]
fn a_refused_release_counts_against_the_arena_s_limit() {
    arena_fault("refused_release_counts_against_the_limit");
}

#[test]
fn a_sleep_whose_page_locked_copy_fails_leaves_the_arena_awake() {
    // The page-locked allocation refused for the second granule's copy.
    arena_fault("sleep_whose_copy_fails_leaves_the_arena_awake");
}

#[test]
fn the_capturing_thread_s_allocation_over_the_limit_is_refused_not_trimmed() {
    arena_fault("capturing_thread_over_the_limit_is_refused_not_trimmed");
}

#[test]
fn a_release_retiring_during_its_set_s_wake_frees_its_range_once() {
    // The wake is held inside the driver's map while the release retires.
    arena_fault("release_retiring_during_its_set_s_wake_frees_its_range_once");
}

#[test]
fn a_release_retiring_during_a_failed_wake_stays_out_of_the_allocator() {
    // Held inside the first map while the release retires; the second map
    // fails.
    arena_fault("release_retiring_during_a_failed_wake_stays_out_of_the_allocator");
}

#[test]
fn the_capturing_thread_is_refused_not_left_waiting_for_a_granule_being_mapped() {
    arena_fault("capturing_thread_is_refused_not_left_waiting_for_a_granule_being_mapped");
}

#[test]
fn arena_stress_kv_threads_sleeper_and_capture_under_a_fault_each_round() {
    // Eight KV threads, a sleeper, a capturing thread; a driver call fails
    // in every round. Three seeds, each in a child with the exit check on.
    for seed in ["1", "2", "3"] {
        passes(
            &format!("arena_stress:{seed}"),
            &[(LATENCY, "100"), (SEED, seed), (EXIT_CHECK, "1")],
        );
    }
}

#[test]
fn fault_matrix_cells_map_unmap_set_access_create_release_at_each_position() {
    vendor::fault_cells(&[
        (CREATE_ENTRY, 8),
        (MAP_ENTRY, 8),
        (SET_ACCESS_ENTRY, 8),
        (UNMAP_ENTRY, 8),
        (RELEASE_ENTRY, 8),
    ]);
}

#[test]
fn arena_grows_to_its_limit_and_shrinks_with_16_threads_on_4_streams() {
    for seed in GROW_SHRINK_SEEDS {
        passes(
            "grow_shrink",
            &[(LATENCY, "300"), (SEED, seed), (EXIT_CHECK, "1")],
        );
    }
}

#[test]
fn governed_arena_grows_to_the_budget_and_shrinks_with_16_threads_on_4_streams() {
    for seed in GOVERNED_GROW_SHRINK_SEEDS {
        passes(
            "governed_grow_shrink",
            &[(LATENCY, "300"), (SEED, seed), (EXIT_CHECK, "1")],
        );
    }
}

#[test]
fn sleep_and_wake_restore_every_byte_at_the_same_addresses() {
    passes(
        "sleep_wake",
        &[(LATENCY, "300"), (SEED, "1"), (EXIT_CHECK, "1")],
    );
}

#[test]
fn a_release_while_asleep_retires_and_the_wake_maps_only_the_granules_in_use() {
    passes(
        "release_while_asleep",
        &[(LATENCY, "2000"), (SEED, "2"), (EXIT_CHECK, "1")],
    );
}

#[test]
fn a_wake_over_the_limit_is_refused_before_any_map() {
    passes("wake_refused", &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_failed_wake_half_way_stays_asleep_and_wakes_later() {
    // Calls 1-12 map the 4 granules (create, map, set access each); the
    // wake's third granule fails at its map (call 12 + 8).
    passes(
        "wake_fails_half_way",
        &[(EXIT_CHECK, "1"), (FAIL_VMM_AT, "20")],
    );
}

#[test]
fn a_map_failing_half_way_leaves_no_granule_behind() {
    // The 5-granule allocation's third granule fails at its set-access.
    passes(
        "map_fails_half_way",
        &[(EXIT_CHECK, "1"), (FAIL_VMM_AT, "9")],
    );
}

#[test]
fn a_map_whose_undo_fails_quarantines_the_granule() {
    // The first granule's set-access fails, then its undo's unmap.
    passes(
        "map_undo_fails",
        &[(EXIT_CHECK, "1"), (FAIL_VMM_AT, "3"), (FAIL_UNMAP_AT, "1")],
    );
}

#[test]
fn a_refused_unmap_is_quarantined_and_reported() {
    passes("unmap_refused", &[(EXIT_CHECK, "1"), (FAIL_UNMAP_AT, "1")]);
}

#[test]
fn release_orders_the_unmap_after_every_stream_that_used_the_memory() {
    passes(
        "cross_stream_release",
        &[(LATENCY, "20000"), (EXIT_CHECK, "1")],
    );
}

#[test]
fn teardown_with_live_arena_memory_gives_everything_back() {
    passes("forced_teardown", &[(LATENCY, "2000"), (EXIT_CHECK, "1")]);
}

// ---- the stand-in's rules, each planted --------------------------------

#[test]
fn negative_copy_before_access_is_set_aborts() {
    aborts("no_access", &[], "whose access was not set read-write");
}

#[test]
fn negative_copy_to_an_unmapped_reserved_address_aborts() {
    aborts("unmapped_copy", &[], "that is not mapped");
}

#[test]
fn negative_unmap_under_queued_work_aborts() {
    aborts(
        "unmap_under_work",
        &[(LATENCY, "200000")],
        "while work queued on stream",
    );
}

#[test]
fn unmap_after_the_stream_passed_is_fine() {
    passes("unmap_after_sync", &[(LATENCY, "20000")]);
}

#[test]
fn negative_address_free_with_live_mappings_aborts() {
    aborts("free_mapped_range", &[], "with 1 live mapping(s)");
}

#[test]
fn negative_double_release_aborts() {
    aborts("double_release", &[], "already released");
}

#[test]
fn negative_map_of_a_released_handle_aborts() {
    aborts("map_released", &[], "which is not a live allocation handle");
}

#[test]
fn negative_leftovers_at_exit_abort() {
    // The case itself runs to its end; the exit check aborts after it.
    if let Some(run) = vendor::child("leftovers", &[(EXIT_CHECK, "1")]) {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(run.status.signal(), Some(6), "{}", run.output());
        assert!(
            run.stdout.contains("child leftovers: ok"),
            "{}",
            run.output()
        );
        assert!(
            run.stderr.contains(&format!(
                "{BANNER} at exit: 1 address reservation(s) (8388608 bytes)"
            )),
            "{}",
            run.output()
        );
    }
}

/// In the child: runs the shared case `case`; false when it is not one of
/// these (the vendor's own cases then).
pub(crate) fn run(case: &str) -> bool {
    match case {
        "fault_cells" => common::fault_cells_child(),
        "capability_arena" => memgov_conformance::capability::report_cases(
            memgov_conformance::capability::run_arena_cases(common::capability_factory),
        ),
        c if c.starts_with("arena_stress:") => {
            common::arena_stress_child(c["arena_stress:".len()..].parse().expect("a seed"))
        }
        c if c.starts_with("arena_fault:") => common::arena_fault_child(&c["arena_fault:".len()..]),
        "grow_shrink" => grow_shrink(),
        "governed_grow_shrink" => governed_grow_shrink(),
        "sleep_wake" => sleep_wake(),
        "wake_refused" => wake_refused(),
        "release_while_asleep" => release_while_asleep(),
        "wake_fails_half_way" => wake_fails_half_way(),
        "map_fails_half_way" => map_fails_half_way(),
        "unmap_refused" => unmap_refused(),
        "map_undo_fails" => map_undo_fails(),
        "cross_stream_release" => cross_stream_release(),
        "forced_teardown" => forced_teardown(),
        other => return standin::run(other),
    }
    true
}

pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Release `m` on `s` and count its retirement in `retired`.
pub(crate) fn release(ctx: &Context, s: &Stream, m: Memory, retired: &Arc<AtomicU64>) {
    let r = retired.clone();
    ctx.free_async(
        s,
        m,
        RetireSignal::from_fn(move |_| {
            r.fetch_add(1, Ordering::SeqCst);
        }),
    )
    .map_err(|(_, _, e)| e)
    .expect("free_async");
}

pub(crate) fn settle(ctx: &Context, streams: &[Stream], retired: &AtomicU64, want: u64) {
    for s in streams {
        ctx.synchronize(s).expect("synchronize");
    }
    assert_eq!(
        retired.load(Ordering::SeqCst),
        want,
        "every release retired"
    );
}

pub(crate) fn finish(ctx: Context, streams: Vec<Stream>) {
    let probe = ctx.probe();
    for s in streams {
        ctx.destroy_stream(s).expect("destroy stream");
    }
    ctx.teardown(false).expect("teardown");
    assert_eq!(probe.check_clean_teardown(), Ok(()));
    assert_eq!(vmm(), [0; 6], "nothing of the arena left in the driver");
}

/// An allocation, its address when made, its stream's index and its
/// contents.
pub(crate) type Held = (Memory, u64, usize, Vec<u8>);

pub(crate) fn grow_shrink() {
    const LIMIT: u64 = 48 * MIB;
    let ctx = Arc::new(arena_context(256 * MIB, LIMIT));
    let streams: Arc<Vec<Stream>> = Arc::new(
        (0..4)
            .map(|_| ctx.create_stream().expect("stream"))
            .collect(),
    );
    let retired = Arc::new(AtomicU64::new(0));
    let mut released = 0;
    for round in 0..2u64 {
        let held: Vec<Vec<Held>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..16u64)
                .map(|t| {
                    let (ctx, streams) = (ctx.clone(), streams.clone());
                    sc.spawn(move || {
                        let s = &streams[(t % 4) as usize];
                        let mut mine = Vec::new();
                        for i in 0u64.. {
                            let bytes = [4096, 100_000, MIB + 17, 3 * MIB][((t + i) % 4) as usize];
                            match ctx.allocate(s, bytes) {
                                Ok(m) => {
                                    let data =
                                        pattern(round * 1_000_000 + t * 1000 + i, bytes as usize);
                                    ctx.write(s, &m, 0, &data).expect("write");
                                    let a = at(&m);
                                    mine.push((m, a, (t % 4) as usize, data));
                                }
                                Err(e) if e.kind == BackendErrorKind::OutOfMemory => break,
                                Err(e) => panic!("allocate: {e}"),
                            }
                            let snap = arena(&ctx).snapshot();
                            assert!(snap.mapped <= LIMIT, "mapped {} over {LIMIT}", snap.mapped);
                        }
                        mine
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        let snap = arena(&ctx).snapshot();
        let count: usize = held.iter().map(Vec::len).sum();
        println!(
            "round {round}: {count} allocations, mapped {} B of {LIMIT} B, in use {} B, reserved {} B",
            snap.mapped, snap.in_use, snap.reserved
        );
        assert!(
            snap.mapped + 3 * MIB + 4 * snap.granule > LIMIT,
            "grew to the limit"
        );
        // Every allocation kept its address and its bytes while the
        // others mapped granules around it; each is released on the
        // next stream, ordered after its own.
        for (m, a, si, data) in held.into_iter().flatten() {
            assert_eq!(at(&m), a);
            let mut back = vec![0u8; data.len()];
            ctx.read(&streams[si], &m, 0, &mut back).expect("read");
            assert!(back == data, "the bytes at {a:#x} changed");
            let other = &streams[(si + 1) % 4];
            ctx.order_after(other, &streams[si]).expect("order_after");
            release(&ctx, other, m, &retired);
            released += 1;
        }
        settle(&ctx, &streams, &retired, released);
        let given = arena(&ctx).trim().expect("trim");
        let snap = arena(&ctx).snapshot();
        println!(
            "round {round}: trim gave back {given} B; mapped now {} B",
            snap.mapped
        );
        assert_eq!((snap.mapped, snap.in_use, snap.blocks), (0, 0, 0));
        assert_eq!(vmm()[2..], [0; 4], "every handle released, nothing mapped");
    }
    let ctx = Arc::into_inner(ctx).expect("the only reference");
    let streams = Arc::into_inner(streams).expect("the only reference");
    assert_eq!(ctx.probe().violations(), 0);
    finish(ctx, streams);
}

/// The same growth and shrinking through the governor: its budget is
/// the limit (the arena may map up to one granule per stream beyond
/// it, for rounding), a pressure responder trims the arena, releases
/// go through `release_on` on another stream than the buffer's.
pub(crate) fn governed_grow_shrink() {
    use memgov::{ContextConfig, Governor, Role};
    const BUDGET: u64 = 48 * MIB;
    let ctx = arena_context(256 * MIB, BUDGET + 16 * MIB);
    let a = arena(&ctx);
    let probe = ctx.probe();
    let gov = Governor::new();
    let handle = gov.register(ctx, ContextConfig::new().label("arena").budget(BUDGET));
    let responder = a.clone();
    handle.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |_| {
        responder.trim().unwrap_or(0)
    });
    let streams: Vec<_> = (0..4)
        .map(|i| handle.create_stream(format!("s{i}")).expect("stream"))
        .collect();
    let mut cycles = 0;
    for round in 0..2u64 {
        let held: Vec<_> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..16u64)
                .map(|t| {
                    let (handle, streams, a) = (&handle, &streams, &a);
                    sc.spawn(move || {
                        let si = (t % 4) as usize;
                        let mut mine = Vec::new();
                        for i in 0u64.. {
                            let bytes = [4096, 100_000, MIB + 17, 3 * MIB][((t + i) % 4) as usize];
                            match handle.allocate(&streams[si], Alloc::new(bytes, Role::Activation))
                            {
                                Ok(buf) => {
                                    let data = pattern(round << 32 | t << 16 | i, bytes as usize);
                                    buf.write(0, &data).expect("write");
                                    let p = at(buf.raw().expect("device memory"));
                                    mine.push((buf, p, si, data));
                                }
                                Err(e) => {
                                    assert!(
                                        e.to_string().contains("budget")
                                            || e.to_string().contains("OutOfMemory"),
                                        "a typed refusal, not {e}"
                                    );
                                    break;
                                }
                            }
                            assert!(a.snapshot().mapped <= BUDGET + 16 * MIB);
                        }
                        mine
                    })
                })
                .collect();
            hs.into_iter()
                .flat_map(|h| h.join().expect("thread"))
                .collect()
        });
        let snap = a.snapshot();
        let charged = handle.snapshot().charged;
        println!(
            "governed round {round}: {} buffers, charged {charged} B of {BUDGET} B, mapped {} B, in use {} B",
            held.len(),
            snap.mapped,
            snap.in_use
        );
        assert!(charged + 3 * MIB + 4096 > BUDGET, "grew to the budget");
        for (buf, p, si, data) in held {
            assert_eq!(at(buf.raw().expect("device memory")), p);
            let mut back = vec![0u8; data.len()];
            buf.read(0, &mut back).expect("read");
            assert!(back == data, "the bytes at {p:#x} changed");
            buf.release_on(&streams[(si + 1) % 4])
                .map_err(|e| e.error)
                .expect("release_on");
            cycles += 1;
        }
        for s in &streams {
            s.synchronize().expect("synchronize");
        }
        a.trim().expect("trim");
        let snap = a.snapshot();
        assert_eq!(
            (snap.mapped, snap.in_use, snap.blocks),
            (0, 0, 0),
            "{snap:?}"
        );
        assert_eq!(handle.snapshot().charged, 0);
        assert_eq!(vmm()[2..], [0; 4], "every handle released, nothing mapped");
    }
    drop(streams);
    let report = handle
        .retire()
        .wait_timeout(std::time::Duration::from_secs(30))
        .expect("retire");
    assert!(report.backend_result.is_ok(), "{:?}", report.backend_result);
    assert_eq!(report.retired_releases, cycles);
    probe.check_clean_teardown().expect("clean teardown");
    assert_eq!(vmm(), [0; 6], "nothing of the arena left in the driver");
    assert!(a.trim().is_err(), "the arena refuses work after teardown");
}

pub(crate) fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map_or(default, |v| v.parse().expect(name))
}

pub(crate) fn sleep_wake() {
    let set = env_u64("MEMGOV_ARENA_SLEEP_MIB", 16) * MIB;
    let cycles = env_u64("MEMGOV_ARENA_SLEEP_CYCLES", SLEEP_CYCLES);
    let ctx = arena_context(set + 64 * MIB, set + 16 * MIB);
    let s = ctx.create_stream().expect("stream");
    // Allocations of several sizes, most not granule-sized, filling the
    // set.
    let sizes = [MIB / 2, 3 * MIB + 4096, 8 * MIB, 777_777];
    let mut held = Vec::new();
    let mut total = 0;
    for i in 0.. {
        let bytes = sizes[i % sizes.len()].min(set - total);
        if bytes == 0 {
            break;
        }
        let m = ctx.allocate(&s, bytes).expect("allocate");
        let data = pattern(i as u64, bytes as usize);
        ctx.write(&s, &m, 0, &data).expect("write");
        held.push((at(&m), m, data));
        total += bytes;
    }
    let awake = arena(&ctx).snapshot().mapped;
    let started = std::time::Instant::now();
    for cycle in 0..cycles {
        let report = arena(&ctx).sleep(true).expect("sleep");
        assert_eq!(report.released, awake);
        let snap = arena(&ctx).snapshot();
        assert_eq!((snap.mapped, snap.asleep), (0, awake), "cycle {cycle}");
        assert_eq!(vmm()[2..], [0; 4], "cycle {cycle}: asleep, nothing held");
        let e = ctx
            .write(&s, &held[0].1, 0, b"x")
            .expect_err("a copy while asleep");
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
        assert!(e.message.contains(&format!("{ARENA_NAME}::wake")), "{e}");
        let e = ctx
            .allocate(&s, 4096)
            .expect_err("an allocation while asleep");
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
        assert_eq!(arena(&ctx).wake().expect("wake"), awake);
        for (a, m, data) in &held {
            assert_eq!(at(m), *a);
            let mut back = vec![0u8; data.len()];
            ctx.read(&s, m, 0, &mut back).expect("read");
            assert!(back == *data, "cycle {cycle}: the bytes at {a:#x} changed");
        }
    }
    println!(
        "sleep/wake: {total} B in {} allocations, {cycles} cycles in {:.2?}, same addresses, every byte restored",
        held.len(),
        started.elapsed()
    );
    let retired = Arc::new(AtomicU64::new(0));
    let n = held.len() as u64;
    for (_, m, _) in held {
        release(&ctx, &s, m, &retired);
    }
    settle(&ctx, std::slice::from_ref(&s), &retired, n);
    arena(&ctx).trim().expect("trim");
    finish(ctx, vec![s]);
}

pub(crate) fn release_while_asleep() {
    let ctx = arena_context(64 * MIB, 64 * MIB);
    let s = ctx.create_stream().expect("stream");
    let keep = ctx.allocate(&s, 3 * MIB).expect("allocate");
    let gone = ctx.allocate(&s, 4 * MIB).expect("allocate");
    let data = pattern(5, 3 * MIB as usize);
    ctx.write(&s, &keep, 0, &data).expect("write");
    assert_eq!(arena(&ctx).sleep(true).expect("sleep").released, 8 * MIB);
    let retired = Arc::new(AtomicU64::new(0));
    release(&ctx, &s, gone, &retired);
    settle(&ctx, std::slice::from_ref(&s), &retired, 1);
    assert_eq!(arena(&ctx).snapshot().in_use, 3 * MIB);
    // Only the granules the kept allocation overlaps are mapped again
    // (0 and 1); the released one's own (2 and 3) are dropped.
    assert_eq!(arena(&ctx).wake().expect("wake"), 4 * MIB);
    assert_eq!(vmm()[2..4], [2, 4 * MIB], "two handles, 4 MiB mapped");
    assert_eq!(arena(&ctx).trim().expect("trim"), 0, "nothing cached");
    let mut back = vec![0u8; data.len()];
    ctx.read(&s, &keep, 0, &mut back).expect("read");
    assert!(back == data);
    release(&ctx, &s, keep, &retired);
    settle(&ctx, std::slice::from_ref(&s), &retired, 2);
    finish(ctx, vec![s]);
}

pub(crate) fn wake_refused() {
    let ctx = arena_context(64 * MIB, 16 * MIB);
    let s = ctx.create_stream().expect("stream");
    let m = ctx.allocate(&s, 5 * MIB).expect("allocate");
    ctx.write(&s, &m, 0, &pattern(7, 5 * MIB as usize))
        .expect("write");
    arena(&ctx).sleep(true).expect("sleep");
    arena(&ctx).set_limit(4 * MIB);
    let e = arena(&ctx).wake().expect_err("the wake does not fit");
    assert_eq!(e.kind, BackendErrorKind::OutOfMemory);
    assert!(e.message.contains("waking needs 6291456 B"), "{e}");
    let snap = arena(&ctx).snapshot();
    assert_eq!((snap.mapped, snap.asleep), (0, 6 * MIB));
    assert_eq!(vmm()[2..], [0; 4], "nothing mapped by the refused wake");
    arena(&ctx).set_limit(16 * MIB);
    arena(&ctx).wake().expect("wake");
    let mut back = vec![0u8; 5 * MIB as usize];
    ctx.read(&s, &m, 0, &mut back).expect("read");
    assert!(back == pattern(7, 5 * MIB as usize));
    let retired = Arc::new(AtomicU64::new(0));
    release(&ctx, &s, m, &retired);
    settle(&ctx, std::slice::from_ref(&s), &retired, 1);
    finish(ctx, vec![s]);
}

pub(crate) fn wake_fails_half_way() {
    let ctx = arena_context(64 * MIB, 64 * MIB);
    let s = ctx.create_stream().expect("stream");
    let m = ctx.allocate(&s, 8 * MIB).expect("allocate");
    let data = pattern(3, 8 * MIB as usize);
    ctx.write(&s, &m, 0, &data).expect("write");
    arena(&ctx).sleep(true).expect("sleep");
    let e = arena(&ctx).wake().expect_err("the injected failure");
    // The driver's own code for a failed map, passed up.
    assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
    assert!(e.message.contains(MAP_ENTRY), "{e}");
    let snap = arena(&ctx).snapshot();
    assert_eq!(
        (snap.mapped, snap.asleep),
        (0, 8 * MIB),
        "still asleep, all of it"
    );
    assert_eq!(
        vmm()[2..],
        [0; 4],
        "the granules mapped before the failure were undone"
    );
    arena(&ctx).wake().expect("the second wake");
    let mut back = vec![0u8; data.len()];
    ctx.read(&s, &m, 0, &mut back).expect("read");
    assert!(back == data, "the contents survived the failed wake");
    let retired = Arc::new(AtomicU64::new(0));
    release(&ctx, &s, m, &retired);
    settle(&ctx, std::slice::from_ref(&s), &retired, 1);
    finish(ctx, vec![s]);
}

pub(crate) fn map_fails_half_way() {
    let ctx = arena_context(64 * MIB, 64 * MIB);
    let s = ctx.create_stream().expect("stream");
    let e = ctx
        .allocate(&s, 10 * MIB)
        .expect_err("the injected failure");
    assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
    assert!(e.message.contains(SET_ACCESS_ENTRY), "{e}");
    let snap = arena(&ctx).snapshot();
    assert_eq!((snap.mapped, snap.in_use, snap.blocks), (0, 0, 0));
    assert!(snap.quarantined.is_empty());
    assert_eq!(vmm()[2..], [0; 4], "no granule left mapped or unreleased");
    let m = ctx
        .allocate(&s, 10 * MIB)
        .expect("the same allocation, no failure");
    let retired = Arc::new(AtomicU64::new(0));
    release(&ctx, &s, m, &retired);
    settle(&ctx, std::slice::from_ref(&s), &retired, 1);
    finish(ctx, vec![s]);
}

pub(crate) fn map_undo_fails() {
    let ctx = arena_context(64 * MIB, 64 * MIB);
    let s = ctx.create_stream().expect("stream");
    let e = ctx.allocate(&s, 3 * MIB).expect_err("the injected failure");
    assert!(e.message.contains(SET_ACCESS_ENTRY), "{e}");
    assert!(
        e.message.contains("stays") && e.message.contains("quarantined"),
        "{e}"
    );
    let snap = arena(&ctx).snapshot();
    assert_eq!(snap.quarantined.len(), 1, "{snap:?}");
    assert!(snap.quarantined[0].mapped);
    assert_eq!((snap.mapped, snap.in_use), (2 * MIB, 0));
    let m = ctx
        .allocate(&s, 3 * MIB)
        .expect("allocate past the quarantined granule");
    let q = snap.quarantined[0].address;
    assert!(at(&m) >= q + 2 * MIB, "not in the quarantined granule");
    let retired = Arc::new(AtomicU64::new(0));
    release(&ctx, &s, m, &retired);
    settle(&ctx, std::slice::from_ref(&s), &retired, 1);
    // Teardown unmaps the quarantined granule (the knob failed once).
    finish(ctx, vec![s]);
}

pub(crate) fn unmap_refused() {
    let ctx = arena_context(64 * MIB, 64 * MIB);
    let s = ctx.create_stream().expect("stream");
    let m = ctx.allocate(&s, 3 * MIB).expect("allocate");
    let retired = Arc::new(AtomicU64::new(0));
    release(&ctx, &s, m, &retired);
    settle(&ctx, std::slice::from_ref(&s), &retired, 1);
    let e = arena(&ctx).trim().expect_err("the injected failure");
    assert!(e.message.contains("quarantined"), "{e}");
    let snap = arena(&ctx).snapshot();
    assert_eq!(snap.quarantined.len(), 1, "{snap:?}");
    assert!(snap.quarantined[0].mapped);
    assert_eq!(
        snap.mapped,
        2 * MIB,
        "the quarantined granule is still mapped"
    );
    // Allocation never lands in the quarantined granule.
    let m = ctx.allocate(&s, MIB).expect("allocate");
    let q = snap.quarantined[0].address;
    assert!(at(&m) + MIB <= q || at(&m) >= q + 2 * MIB);
    release(&ctx, &s, m, &retired);
    settle(&ctx, std::slice::from_ref(&s), &retired, 2);
    // Teardown retries the quarantined granule (the knob failed once).
    finish(ctx, vec![s]);
}

pub(crate) fn cross_stream_release() {
    let ctx = arena_context(64 * MIB, 64 * MIB);
    let streams = vec![ctx.create_stream().unwrap(), ctx.create_stream().unwrap()];
    let (a, b) = (&streams[0], &streams[1]);
    let m = ctx.allocate(a, 2 * MIB).expect("allocate");
    let src = pattern(1, 2 * MIB as usize);
    // A copy queued on stream a (20 ms latency) that the backend does
    // not wait for; the release goes on stream b, ordered after a.
    // SAFETY: the arena's mapped, accessible memory; `src` outlives the
    // copy (the streams are synchronized below).
    unsafe { vendor::copy_in_unwaited(&ctx, a, &m, &src) };
    ctx.order_after(b, a).expect("order_after");
    let retired = Arc::new(AtomicU64::new(0));
    release(&ctx, b, m, &retired);
    // A trim now finds the granule still in use (the release has not
    // retired): nothing is unmapped under the copy.
    assert_eq!(arena(&ctx).trim().expect("trim"), 0);
    settle(&ctx, &streams, &retired, 1);
    assert_eq!(arena(&ctx).trim().expect("trim"), 2 * MIB);
    finish(ctx, streams);
}

/// Teardown with allocations never released (as `force` leaves them)
/// and a release still queued: every granule unmapped and released,
/// the reservation freed (the exit check would abort otherwise).
pub(crate) fn forced_teardown() {
    let ctx = arena_context(64 * MIB, 64 * MIB);
    let s = ctx.create_stream().expect("stream");
    let kept = ctx.allocate(&s, 5 * MIB).expect("allocate");
    let queued = ctx.allocate(&s, 3 * MIB).expect("allocate");
    ctx.write(&s, &kept, 0, &pattern(9, 4096)).expect("write");
    let retired = Arc::new(AtomicU64::new(0));
    release(&ctx, &s, queued, &retired);
    // `kept` is never released: a plain handle, left for teardown.
    let _ = kept;
    let probe = ctx.probe();
    ctx.destroy_stream(s).expect("destroy stream");
    // A stream's work finishes before or after its destroy returns
    // (`DeviceContext::destroy_stream`): before, on the vendors that say so.
    if DESTROY_STREAM_FINISHES_ITS_WORK {
        assert_eq!(
            retired.load(Ordering::SeqCst),
            1,
            "retired by the stream's end"
        );
    }
    ctx.teardown(false).expect("teardown");
    assert_eq!(
        retired.load(Ordering::SeqCst),
        1,
        "retired by the teardown at the latest"
    );
    assert_eq!(probe.live_allocations(), 0);
    assert_eq!(vmm(), [0; 6], "nothing of the arena left in the driver");
}

/// The stand-in's virtual memory rules, driven by raw driver calls (the
/// vendor's `raw` module): each case plants a violation the stand-in must
/// abort on, or checks what it must let through.
mod standin {
    use super::G;
    use crate::vendor::raw::{
        access, address_free, copy_in, create, map, mapped, mem_release, ok, raw, raw_finish, sync,
        unmap,
    };

    /// In the child: runs the raw case `case`; false when it is not one of
    /// these.
    pub(super) fn run(case: &str) -> bool {
        // SAFETY: raw driver calls on the stand-in, each valid or the
        // violation the case plants on purpose; the stand-in aborts before
        // anything undefined happens.
        unsafe {
            match case {
                "no_access" => {
                    let r = raw();
                    mapped(&r);
                    let _ = copy_in(&r, r.base, &[1u8; 64]);
                }
                "unmapped_copy" => {
                    let r = raw();
                    let _ = copy_in(&r, r.base + G as u64, &[1u8; 64]);
                }
                "unmap_under_work" | "unmap_after_sync" => {
                    let r = raw();
                    let h = mapped(&r);
                    access(r.base, G);
                    let src = vec![1u8; 4096];
                    ok(copy_in(&r, r.base, &src), "copy");
                    if case == "unmap_after_sync" {
                        ok(sync(&r), "sync");
                    }
                    ok(unmap(r.base, G), "unmap");
                    ok(mem_release(h), "release");
                    ok(address_free(r.base, 4 * G), "address free");
                    raw_finish(r);
                }
                "free_mapped_range" => {
                    let r = raw();
                    mapped(&r);
                    let _ = address_free(r.base, 4 * G);
                }
                "double_release" => {
                    let r = raw();
                    let h = mapped(&r);
                    access(r.base, G);
                    // Released while mapped: legal, the memory stays.
                    ok(mem_release(h), "release while mapped");
                    let src = [9u8; 64];
                    ok(copy_in(&r, r.base, &src), "copy");
                    ok(sync(&r), "sync");
                    let _ = mem_release(h);
                }
                "map_released" => {
                    let r = raw();
                    let (c, h) = create(G);
                    ok(c, "create");
                    ok(mem_release(h), "release");
                    let _ = map(r.base, h);
                }
                "leftovers" => {
                    let r = raw();
                    raw_finish(r);
                    // The reservation is left on purpose.
                }
                _ => return false,
            }
        }
        true
    }
}
