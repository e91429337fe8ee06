//! The CUDA backend's virtual-memory arena and sleep/wake, and the stand-in
//! driver's virtual memory management rules, each with a planted violation.
//!
//! Every case runs in a child process (this binary re-executed with
//! `MEMGOV_ARENA_CHILD` set): the stand-in reads its knobs once per process
//! and aborts the process on a violation. Without the stand-in every test
//! prints `skipped: ...` and passes.
//!
//! `MEMGOV_ARENA_SLEEP_MIB` sets the size of the sleep/wake set (default 16,
//! for CI time; the full check is 1024).

mod common;

use common::{BANNER, EXIT_CHECK, LATENCY, SEED};

use memgov::cuda::{ArenaConfig, CudaArena, CudaConfig, CudaContext};
use memgov::{Alloc, BackendErrorKind, DeviceContext, RetireSignal};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const CHILD: &str = "MEMGOV_ARENA_CHILD";
const MIB: u64 = 1 << 20;

/// A context whose device memory comes from an arena of 1 GiB of address
/// space and at most 512 MiB mapped: the whole conformance suite runs on it.
fn arena_factory() -> Result<CudaContext, memgov::BackendError> {
    CudaContext::new(CudaConfig {
        arena: Some(ArenaConfig {
            reserve_bytes: 1 << 30,
            limit_bytes: 512 * MIB,
        }),
        ..CudaConfig::default()
    })
}

memgov_conformance::conformance_tests!(conformance, super::arena_factory);

fn arena(ctx: &CudaContext) -> CudaArena {
    ctx.arena().expect("the context has an arena")
}

fn arena_context(reserve: u64, limit: u64) -> CudaContext {
    CudaContext::new(CudaConfig {
        arena: Some(ArenaConfig {
            reserve_bytes: reserve,
            limit_bytes: limit,
        }),
        ..CudaConfig::default()
    })
    .expect("a context with an arena")
}

fn passes(case: &str, env: &[(&str, &str)]) {
    common::passes(CHILD, case, env);
}

fn aborts(case: &str, env: &[(&str, &str)], what: &str) {
    common::aborts(CHILD, case, env, what);
}

/// One case of `memgov_conformance::arena_faults` in a child of its own.
fn arena_fault(case: &str) {
    passes(&format!("arena_fault:{case}"), &[(EXIT_CHECK, "1")]);
}

#[test]
fn a_granule_quarantined_under_a_sleeping_allocation_stays_out_of_the_allocator() {
    // cuMemRelease refused during a set's sleep.
    arena_fault("quarantined_granule_in_use_stays_out_of_the_allocator");
}

#[test]
fn a_refused_release_counts_against_the_arena_s_limit() {
    arena_fault("refused_release_counts_against_the_limit");
}

#[test]
fn a_sleep_whose_page_locked_copy_fails_leaves_the_arena_awake() {
    // cuMemHostAlloc refused for the second granule's copy.
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
fn capability_arena_cases_pass_on_the_cuda_arena() {
    passes(
        "capability_arena",
        &[(LATENCY, "300"), (SEED, "1"), (EXIT_CHECK, "1")],
    );
}

#[test]
fn fault_matrix_cells_map_unmap_set_access_create_release_at_each_position() {
    common::fault_cells(
        CHILD,
        &[
            ("cuMemCreate", 8),
            ("cuMemMap", 8),
            ("cuMemSetAccess", 8),
            ("cuMemUnmap", 8),
            ("cuMemRelease", 8),
        ],
    );
}

#[test]
fn arena_grows_to_its_limit_and_shrinks_with_16_threads_on_4_streams() {
    for seed in ["1", "2", "3"] {
        passes(
            "grow_shrink",
            &[(LATENCY, "300"), (SEED, seed), (EXIT_CHECK, "1")],
        );
    }
}

#[test]
fn governed_arena_grows_to_the_budget_and_shrinks_with_16_threads_on_4_streams() {
    for seed in ["1", "2", "3"] {
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
fn a_set_of_allocations_sleeps_and_wakes_leaving_the_others_mapped_and_usable() {
    passes(
        "sleep_set",
        &[(LATENCY, "300"), (SEED, "3"), (EXIT_CHECK, "1")],
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
        &[(EXIT_CHECK, "1"), ("MEMGOV_STANDIN_CUDA_FAIL_VMM_AT", "20")],
    );
}

#[test]
fn a_map_failing_half_way_leaves_no_granule_behind() {
    // The 5-granule allocation's third granule fails at its set-access.
    passes(
        "map_fails_half_way",
        &[(EXIT_CHECK, "1"), ("MEMGOV_STANDIN_CUDA_FAIL_VMM_AT", "9")],
    );
}

#[test]
fn a_map_whose_undo_fails_quarantines_the_granule() {
    // The first granule's set-access fails, then its undo's unmap.
    passes(
        "map_undo_fails",
        &[
            (EXIT_CHECK, "1"),
            ("MEMGOV_STANDIN_CUDA_FAIL_VMM_AT", "3"),
            ("MEMGOV_STANDIN_CUDA_FAIL_UNMAP_AT", "1"),
        ],
    );
}

#[test]
fn a_refused_unmap_is_quarantined_and_reported() {
    passes(
        "unmap_refused",
        &[
            (EXIT_CHECK, "1"),
            ("MEMGOV_STANDIN_CUDA_FAIL_UNMAP_AT", "1"),
        ],
    );
}

#[test]
fn release_orders_the_unmap_after_every_stream_that_used_the_memory() {
    passes(
        "cross_stream_release",
        &[(LATENCY, "20000"), (EXIT_CHECK, "1")],
    );
}

// ---- the stand-in's rules, each planted --------------------------------

#[test]
fn stand_in_refuses_unaligned_and_stray_maps_with_the_drivers_code() {
    passes("refused_codes", &[]);
}

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
fn a_context_synchronize_outlives_a_stream_reaped_while_it_waits() {
    // The synchronize held by the pause knob between its snapshot of the
    // queues and its waits while a drained stream is reaped.
    passes("sync_during_reap", &[]);
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
    if let Some(run) = common::child(CHILD, "leftovers", &[(EXIT_CHECK, "1")]) {
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

/// Entry point of the re-executed binary; does nothing in a normal run.
#[test]
#[ignore = "runs only as the child process of another test"]
fn child_entry() {
    let Ok(case) = std::env::var(CHILD) else {
        return;
    };
    cases::run(&case);
    println!("child {case}: ok");
}

mod cases {
    use super::*;
    use cudarc::driver::sys::{self, CUresult};
    use memgov::cuda::{CudaMemory, CudaStream};

    const G: usize = 2 << 20;

    pub(super) use crate::common::vmm;

    fn pattern(seed: u64, len: usize) -> Vec<u8> {
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
    fn release(ctx: &CudaContext, s: &CudaStream, m: CudaMemory, retired: &Arc<AtomicU64>) {
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

    fn settle(ctx: &CudaContext, streams: &[CudaStream], retired: &AtomicU64, want: u64) {
        for s in streams {
            ctx.synchronize(s).expect("synchronize");
        }
        assert_eq!(
            retired.load(Ordering::SeqCst),
            want,
            "every release retired"
        );
    }

    fn finish(ctx: CudaContext, streams: Vec<CudaStream>) {
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
    type Held = (CudaMemory, u64, usize, Vec<u8>);

    fn grow_shrink() {
        const LIMIT: u64 = 48 * MIB;
        let ctx = Arc::new(arena_context(256 * MIB, LIMIT));
        let streams: Arc<Vec<CudaStream>> = Arc::new(
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
                                let bytes =
                                    [4096, 100_000, MIB + 17, 3 * MIB][((t + i) % 4) as usize];
                                match ctx.allocate(s, bytes) {
                                    Ok(m) => {
                                        let data = pattern(
                                            round * 1_000_000 + t * 1000 + i,
                                            bytes as usize,
                                        );
                                        ctx.write(s, &m, 0, &data).expect("write");
                                        let at = m.device_ptr();
                                        mine.push((m, at, (t % 4) as usize, data));
                                    }
                                    Err(e) if e.kind == BackendErrorKind::OutOfMemory => break,
                                    Err(e) => panic!("allocate: {e}"),
                                }
                                let snap = arena(&ctx).snapshot();
                                assert!(
                                    snap.mapped <= LIMIT,
                                    "mapped {} over {LIMIT}",
                                    snap.mapped
                                );
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
            for (m, at, si, data) in held.into_iter().flatten() {
                assert_eq!(m.device_ptr(), at);
                let mut back = vec![0u8; data.len()];
                ctx.read(&streams[si], &m, 0, &mut back).expect("read");
                assert!(back == data, "the bytes at {at:#x} changed");
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
    fn governed_grow_shrink() {
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
                                let bytes =
                                    [4096, 100_000, MIB + 17, 3 * MIB][((t + i) % 4) as usize];
                                match handle
                                    .allocate(&streams[si], Alloc::new(bytes, Role::Activation))
                                {
                                    Ok(buf) => {
                                        let data =
                                            pattern(round << 32 | t << 16 | i, bytes as usize);
                                        buf.write(0, &data).expect("write");
                                        let at = buf.raw().expect("device memory").device_ptr();
                                        mine.push((buf, at, si, data));
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
            for (buf, at, si, data) in held {
                assert_eq!(buf.raw().expect("device memory").device_ptr(), at);
                let mut back = vec![0u8; data.len()];
                buf.read(0, &mut back).expect("read");
                assert!(back == data, "the bytes at {at:#x} changed");
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

    fn sleep_wake() {
        let mib: u64 = std::env::var("MEMGOV_ARENA_SLEEP_MIB")
            .ok()
            .map_or(16, |v| v.parse().expect("MEMGOV_ARENA_SLEEP_MIB"));
        let set = mib * MIB;
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
            held.push((m.device_ptr(), m, data));
            total += bytes;
        }
        let awake = arena(&ctx).snapshot().mapped;
        let started = std::time::Instant::now();
        for cycle in 0..100 {
            let report = arena(&ctx).sleep(true).expect("sleep");
            assert_eq!(report.released, awake);
            let snap = arena(&ctx).snapshot();
            assert_eq!((snap.mapped, snap.asleep), (0, awake), "cycle {cycle}");
            assert_eq!(vmm()[2..], [0; 4], "cycle {cycle}: asleep, nothing held");
            let e = ctx
                .write(&s, &held[0].1, 0, b"x")
                .expect_err("a copy while asleep");
            assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
            assert_eq!(arena(&ctx).wake().expect("wake"), awake);
            for (at, m, data) in &held {
                assert_eq!(m.device_ptr(), *at);
                let mut back = vec![0u8; data.len()];
                ctx.read(&s, m, 0, &mut back).expect("read");
                assert!(back == *data, "cycle {cycle}: the bytes at {at:#x} changed");
            }
        }
        println!(
            "sleep/wake: {total} B in {} allocations, 100 cycles in {:.2?}, same addresses, every byte restored",
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

    fn release_while_asleep() {
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

    fn wake_refused() {
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

    fn wake_fails_half_way() {
        let ctx = arena_context(64 * MIB, 64 * MIB);
        let s = ctx.create_stream().expect("stream");
        let m = ctx.allocate(&s, 8 * MIB).expect("allocate");
        let data = pattern(3, 8 * MIB as usize);
        ctx.write(&s, &m, 0, &data).expect("write");
        arena(&ctx).sleep(true).expect("sleep");
        let e = arena(&ctx).wake().expect_err("the injected failure");
        // The driver's own code for a failed map, passed up.
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
        assert!(e.message.contains("cuMemMap"), "{e}");
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

    fn map_fails_half_way() {
        let ctx = arena_context(64 * MIB, 64 * MIB);
        let s = ctx.create_stream().expect("stream");
        let e = ctx
            .allocate(&s, 10 * MIB)
            .expect_err("the injected failure");
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
        assert!(e.message.contains("cuMemSetAccess"), "{e}");
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

    fn map_undo_fails() {
        let ctx = arena_context(64 * MIB, 64 * MIB);
        let s = ctx.create_stream().expect("stream");
        let e = ctx.allocate(&s, 3 * MIB).expect_err("the injected failure");
        assert!(e.message.contains("cuMemSetAccess"), "{e}");
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
        assert!(
            m.device_ptr() >= q + 2 * MIB,
            "not in the quarantined granule"
        );
        let retired = Arc::new(AtomicU64::new(0));
        release(&ctx, &s, m, &retired);
        settle(&ctx, std::slice::from_ref(&s), &retired, 1);
        // Teardown unmaps the quarantined granule (the knob failed once).
        finish(ctx, vec![s]);
    }

    fn unmap_refused() {
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
        assert!(m.device_ptr() + MIB <= q || m.device_ptr() >= q + 2 * MIB);
        release(&ctx, &s, m, &retired);
        settle(&ctx, std::slice::from_ref(&s), &retired, 2);
        // Teardown retries the quarantined granule (the knob failed once).
        finish(ctx, vec![s]);
    }

    fn cross_stream_release() {
        let ctx = arena_context(64 * MIB, 64 * MIB);
        let streams = vec![ctx.create_stream().unwrap(), ctx.create_stream().unwrap()];
        let (a, b) = (&streams[0], &streams[1]);
        let m = ctx.allocate(a, 2 * MIB).expect("allocate");
        let ptr = m.device_ptr();
        let src = pattern(1, 2 * MIB as usize);
        // A copy queued on stream a (20 ms latency) that the backend does
        // not wait for; the release goes on stream b, ordered after a.
        // SAFETY: the arena's mapped, accessible memory; `src` outlives the
        // copy (the streams are synchronized below).
        unsafe {
            let _g = Current::push(&ctx);
            let r = sys::cuMemcpyHtoDAsync_v2(ptr, src.as_ptr().cast(), src.len(), a.cu_stream());
            assert_eq!(r, CUresult::CUDA_SUCCESS);
        }
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

    /// The context pushed current on this thread until dropped.
    struct Current;
    impl Current {
        fn push(ctx: &CudaContext) -> Self {
            // SAFETY: a live context; popped in drop.
            let r = unsafe { sys::cuCtxPushCurrent_v2(ctx.cu_context()) };
            assert_eq!(r, CUresult::CUDA_SUCCESS);
            Current
        }
    }
    impl Drop for Current {
        fn drop(&mut self) {
            let mut c = std::ptr::null_mut();
            // SAFETY: balances the push.
            unsafe { sys::cuCtxPopCurrent_v2(&mut c) };
        }
    }

    // ---- raw driver calls for the planted cases -----------------------

    fn ok(r: CUresult, what: &str) {
        assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
    }

    fn prop() -> sys::CUmemAllocationProp {
        // SAFETY: plain C struct, all-zero valid.
        let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        p.location.id = 0;
        p
    }

    struct Raw {
        ctx: CudaContext,
        s: sys::CUstream,
        base: u64,
    }

    /// A context current on this thread, a raw stream and a 4-granule
    /// reservation.
    fn raw() -> Raw {
        let ctx = CudaContext::new(CudaConfig::default()).expect("context");
        let mut s = std::ptr::null_mut();
        let mut base = 0;
        // SAFETY: raw calls on the stand-in with valid out pointers.
        unsafe {
            ok(sys::cuCtxSetCurrent(ctx.cu_context()), "current");
            ok(sys::cuStreamCreate(&mut s, 1), "stream");
            ok(
                sys::cuMemAddressReserve(&mut base, 4 * G, 0, 0, 0),
                "reserve",
            );
        }
        Raw { ctx, s, base }
    }

    fn create(size: usize) -> (CUresult, sys::CUmemGenericAllocationHandle) {
        let mut h = 0;
        // SAFETY: valid out pointer and properties.
        let r = unsafe { sys::cuMemCreate(&mut h, size, &prop(), 0) };
        (r, h)
    }

    fn access(at: u64, size: usize) {
        let desc = sys::CUmemAccessDesc {
            location: prop().location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one valid descriptor.
        ok(
            unsafe { sys::cuMemSetAccess(at, size, &desc, 1) },
            "set access",
        );
    }

    fn mapped(r: &Raw) -> sys::CUmemGenericAllocationHandle {
        let (c, h) = create(G);
        ok(c, "create");
        // SAFETY: the reservation's first granule, unmapped.
        ok(unsafe { sys::cuMemMap(r.base, G, 0, h, 0) }, "map");
        h
    }

    /// Read all of `m` and compare it with `want`.
    fn check_bytes(ctx: &CudaContext, s: &CudaStream, m: &CudaMemory, want: &[u8], what: &str) {
        let mut back = vec![0u8; want.len()];
        ctx.read(s, m, 0, &mut back).expect("read");
        assert!(back == want, "{what}: bytes differ");
    }

    /// Sleep and wake of a set of allocations: the granules only the set
    /// uses are released, a granule it shares stays mapped, the others stay
    /// usable and untouched, nothing lands in a sleeping granule, nothing is
    /// released twice, every byte comes back at the same address.
    fn sleep_set() {
        let ctx = arena_context(1 << 30, 256 * MIB);
        let arena = arena(&ctx);
        let s = ctx.create_stream().expect("stream");
        let g = 2 * MIB;
        let retired = Arc::new(AtomicU64::new(0));
        // A: granules 0-2; B: granules 3, 4 and the start of 5; C shares
        // granule 5 with B.
        let (la, lb, lc) = (3 * g, 2 * g + 4096, 8192);
        let a = ctx.allocate(&s, la).expect("a");
        let b = ctx.allocate(&s, lb).expect("b");
        let c = ctx.allocate(&s, lc).expect("c");
        let base = arena.snapshot().mapped;
        assert_eq!(base, 6 * g);
        let (pa, pb, pc) = (
            pattern(1, la as usize),
            pattern(2, lb as usize),
            pattern(3, lc as usize),
        );
        ctx.write(&s, &a, 0, &pa).expect("write a");
        ctx.write(&s, &b, 0, &pb).expect("write b");
        ctx.write(&s, &c, 0, &pc).expect("write c");
        let (at_a, at_b) = (a.device_ptr(), b.device_ptr());
        let before = vmm();

        let report = arena
            .sleep_ranges(&[at_a, at_b], true)
            .expect("sleep the set");
        assert_eq!(
            (report.released, report.offloaded),
            (5 * g, 5 * g),
            "granules 0-4 released, granule 5 (shared with c) kept"
        );
        let snap = arena.snapshot();
        assert_eq!((snap.mapped, snap.asleep), (g, 5 * g), "{snap:?}");
        let held = vmm();
        assert_eq!(
            (before[2] - held[2], before[4] - held[4]),
            (5, 5),
            "5 handles released and 5 mappings gone in the driver"
        );
        // The awake set is untouched and usable.
        check_bytes(&ctx, &s, &c, &pc, "c after the sleep");
        let pc2 = pattern(4, lc as usize);
        ctx.write(&s, &c, 0, &pc2).expect("c is usable");
        check_bytes(&ctx, &s, &c, &pc2, "c rewritten");
        // A new allocation lands outside the sleeping granules.
        let d = ctx.allocate(&s, g).expect("d");
        assert!(
            d.device_ptr() >= at_a + 5 * g,
            "d landed in a sleeping granule"
        );
        let pd = pattern(5, g as usize);
        ctx.write(&s, &d, 0, &pd).expect("write d");
        check_bytes(&ctx, &s, &d, &pd, "d");
        // The sleeping set is refused, not touched.
        for m in [&a, &b] {
            let e = ctx.write(&s, m, 0, &[0; 16]).expect_err("asleep");
            assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
            assert!(e.message.contains("wake_ranges"), "{e}");
        }
        // Nothing is released twice: a second sleep of the set finds nothing.
        let again = arena.sleep_ranges(&[at_a, at_b], true).expect("again");
        assert_eq!(again.released, 0);
        assert_eq!(vmm()[2], held[2] + 1, "only d's granule was added");
        let e = arena
            .sleep(true)
            .expect_err("the whole arena while a set sleeps");
        assert!(e.message.contains("sleep_ranges"), "{e}");
        let e = arena
            .sleep_ranges(&[at_a + 256], true)
            .expect_err("not a block");
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument);

        // Wake the set: same addresses, every byte back.
        assert_eq!(arena.wake_ranges(&[at_a, at_b]).expect("wake"), 5 * g);
        assert_eq!((a.device_ptr(), b.device_ptr()), (at_a, at_b));
        check_bytes(&ctx, &s, &a, &pa, "a after the wake");
        check_bytes(&ctx, &s, &b, &pb, "b after the wake");
        check_bytes(&ctx, &s, &c, &pc2, "c after the wake");
        check_bytes(&ctx, &s, &d, &pd, "d after the wake");
        assert_eq!(arena.snapshot().asleep, 0);

        // Round two: b released while asleep, its granules kept out of the
        // allocator; a woken alone, then the rest by wake().
        arena
            .sleep_ranges(&[at_a, at_b], true)
            .expect("sleep again");
        release(&ctx, &s, b, &retired);
        settle(&ctx, std::slice::from_ref(&s), &retired, 1);
        let e2 = ctx.allocate(&s, 2 * g).expect("e");
        assert!(
            e2.device_ptr() >= at_a + 5 * g,
            "e landed in a granule that sleeps"
        );
        assert_eq!(arena.wake_ranges(&[at_a]).expect("wake a"), 3 * g);
        check_bytes(&ctx, &s, &a, &pa, "a after the second wake");
        assert_eq!(arena.snapshot().asleep, 2 * g, "b's granules still asleep");
        // b's granules have no users left: dropped, not mapped.
        assert_eq!(arena.wake().expect("wake the rest"), 0);
        assert_eq!(arena.snapshot().asleep, 0);
        // The gaps came back: a 4 MiB allocation fits where b was.
        let f = ctx.allocate(&s, 2 * g).expect("f");
        assert_eq!(f.device_ptr(), at_b, "b's range is free again");
        check_bytes(&ctx, &s, &c, &pc2, "c at the end");
        // The whole arena asleep: a set's wake is refused, the whole wake
        // restores everything.
        arena.sleep(true).expect("sleep the whole arena");
        let e = arena
            .wake_ranges(&[at_a])
            .expect_err("the whole arena sleeps");
        assert!(e.message.contains("wake it whole"), "{e}");
        arena.wake().expect("wake the whole arena");
        check_bytes(&ctx, &s, &a, &pa, "a after the whole arena's wake");
        check_bytes(&ctx, &s, &c, &pc2, "c after the whole arena's wake");
        for m in [a, c, d, e2, f] {
            release(&ctx, &s, m, &retired);
        }
        settle(&ctx, std::slice::from_ref(&s), &retired, 6);
        finish(ctx, vec![s]);
        println!("sleep_set: 5 granules slept and woke twice, the shared granule kept, c and d untouched");
    }

    pub(super) fn run(case: &str) {
        // SAFETY: raw driver calls on the stand-in, each valid or the
        // violation the case plants on purpose; the stand-in aborts before
        // anything undefined happens.
        unsafe {
            match case {
                "grow_shrink" => grow_shrink(),
                "sleep_set" => sleep_set(),
                "capability_arena" => memgov_conformance::capability::report_cases(
                    memgov_conformance::capability::run_arena_cases(common::capability_factory),
                ),
                "fault_cells" => common::fault_cells_child(),
                c if c.starts_with("arena_stress:") => {
                    common::arena_stress_child(c["arena_stress:".len()..].parse().expect("a seed"))
                }
                c if c.starts_with("arena_fault:") => {
                    common::arena_fault_child(&c["arena_fault:".len()..])
                }
                "governed_grow_shrink" => governed_grow_shrink(),
                "sleep_wake" => sleep_wake(),
                "wake_refused" => wake_refused(),
                "release_while_asleep" => release_while_asleep(),
                "wake_fails_half_way" => wake_fails_half_way(),
                "map_fails_half_way" => map_fails_half_way(),
                "unmap_refused" => unmap_refused(),
                "map_undo_fails" => map_undo_fails(),
                "cross_stream_release" => cross_stream_release(),
                "refused_codes" => {
                    let r = raw();
                    let inval = CUresult::CUDA_ERROR_INVALID_VALUE;
                    assert_eq!(create(G / 2).0, inval, "cuMemCreate of half a granule");
                    let mut p = 0;
                    assert_eq!(sys::cuMemAddressReserve(&mut p, G + 4096, 0, 0, 0), inval);
                    let h = mapped(&r);
                    let (c, h2) = create(G);
                    ok(c, "create");
                    assert_eq!(sys::cuMemMap(r.base, G, 0, h2, 0), inval, "over a mapping");
                    assert_eq!(
                        sys::cuMemMap(r.base + G as u64 + 4096, G, 0, h2, 0),
                        inval,
                        "unaligned"
                    );
                    assert_eq!(
                        sys::cuMemMap(r.base + 3 * G as u64, 2 * G, 0, h2, 0),
                        inval,
                        "past the reservation"
                    );
                    assert_eq!(
                        sys::cuMemMap(r.base + G as u64, G, G, h2, 0),
                        inval,
                        "past the handle"
                    );
                    let outside = r.base + 64 * G as u64;
                    assert_eq!(
                        sys::cuMemMap(outside, G, 0, h2, 0),
                        inval,
                        "outside any reservation"
                    );
                    assert_eq!(sys::cuMemUnmap(r.base, G / 2), inval, "part of a mapping");
                    ok(sys::cuMemUnmap(r.base, G), "unmap");
                    ok(sys::cuMemRelease(h), "release");
                    ok(sys::cuMemRelease(h2), "release");
                    ok(sys::cuMemAddressFree(r.base, 4 * G), "address free");
                    ok(sys::cuStreamDestroy_v2(r.s), "destroy");
                    ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear");
                    r.ctx.teardown(false).expect("teardown");
                    assert_eq!(vmm(), [0; 6]);
                }
                "no_access" => {
                    let r = raw();
                    mapped(&r);
                    let src = [1u8; 64];
                    let _ = sys::cuMemcpyHtoDAsync_v2(r.base, src.as_ptr().cast(), 64, r.s);
                }
                "unmapped_copy" => {
                    let r = raw();
                    let src = [1u8; 64];
                    let _ =
                        sys::cuMemcpyHtoDAsync_v2(r.base + G as u64, src.as_ptr().cast(), 64, r.s);
                }
                "unmap_under_work" | "unmap_after_sync" => {
                    let r = raw();
                    let h = mapped(&r);
                    access(r.base, G);
                    let src = vec![1u8; 4096];
                    ok(
                        sys::cuMemcpyHtoDAsync_v2(r.base, src.as_ptr().cast(), 4096, r.s),
                        "copy",
                    );
                    if case == "unmap_after_sync" {
                        ok(sys::cuStreamSynchronize(r.s), "sync");
                    }
                    ok(sys::cuMemUnmap(r.base, G), "unmap");
                    ok(sys::cuMemRelease(h), "release");
                    ok(sys::cuMemAddressFree(r.base, 4 * G), "address free");
                    ok(sys::cuStreamSynchronize(r.s), "sync");
                    ok(sys::cuStreamDestroy_v2(r.s), "destroy");
                    ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear");
                    r.ctx.teardown(false).expect("teardown");
                }
                "free_mapped_range" => {
                    let r = raw();
                    mapped(&r);
                    let _ = sys::cuMemAddressFree(r.base, 4 * G);
                }
                "sync_during_reap" => {
                    let r = raw();
                    let mut drained = std::ptr::null_mut();
                    ok(sys::cuStreamCreate(&mut drained, 1), "stream");
                    // Destroyed with nothing queued: drained, reaped by the
                    // next stream creation.
                    ok(sys::cuStreamDestroy_v2(drained), "destroy");
                    common::pause_entry(Some(("cuCtxSynchronize:waits", 1)));
                    let ctx = r.ctx.cu_context() as usize;
                    // The closure's raw calls are under the case's unsafe
                    // block: a live context (the parent keeps it) made
                    // current on this thread, then a synchronize.
                    let syncing = std::thread::spawn(move || {
                        ok(sys::cuCtxSetCurrent(ctx as sys::CUcontext), "current");
                        let r = sys::cuCtxSynchronize();
                        ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear");
                        r
                    });
                    while !common::entry_paused() {
                        std::thread::yield_now();
                    }
                    common::pause_entry(None);
                    // Reaps the drained stream, whose queue the held
                    // synchronize is about to wait on.
                    let mut another = std::ptr::null_mut();
                    ok(sys::cuStreamCreate(&mut another, 1), "stream");
                    common::resume_entry();
                    ok(
                        syncing.join().expect("the synchronizing thread"),
                        "synchronize",
                    );
                    ok(sys::cuStreamDestroy_v2(another), "destroy");
                    ok(sys::cuStreamDestroy_v2(r.s), "destroy");
                    ok(sys::cuMemAddressFree(r.base, 4 * G), "address free");
                    ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear");
                    r.ctx.teardown(false).expect("teardown");
                    println!("sync_during_reap: the synchronize waited on every queue it took");
                }
                "double_release" => {
                    let r = raw();
                    let h = mapped(&r);
                    access(r.base, G);
                    // Released while mapped: legal, the memory stays.
                    ok(sys::cuMemRelease(h), "release while mapped");
                    let src = [9u8; 64];
                    ok(
                        sys::cuMemcpyHtoDAsync_v2(r.base, src.as_ptr().cast(), 64, r.s),
                        "copy",
                    );
                    ok(sys::cuStreamSynchronize(r.s), "sync");
                    let _ = sys::cuMemRelease(h);
                }
                "map_released" => {
                    let r = raw();
                    let (c, h) = create(G);
                    ok(c, "create");
                    ok(sys::cuMemRelease(h), "release");
                    let _ = sys::cuMemMap(r.base, G, 0, h, 0);
                }
                "leftovers" => {
                    let r = raw();
                    ok(sys::cuStreamDestroy_v2(r.s), "destroy");
                    ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear");
                    r.ctx.teardown(false).expect("teardown");
                    // The reservation is left on purpose.
                }
                other => panic!("unknown case {other}"),
            }
        }
    }
}
