//! The CUDA backend's virtual-memory arena and sleep/wake: the cases CUDA
//! shares with HIP (`backends/cases/arena.rs`, the conformance suite on an
//! arena and its capability cases among them, instantiated here through
//! the `vendor` module), and CUDA's own: the sleep of a set, a synchronize
//! outliving a reaped stream, and the stand-in driver's virtual memory
//! management rules called raw (`cudarc`'s `sys`), each with a planted
//! violation.
//!
//! Every case runs in a child process (this binary re-executed with
//! `MEMGOV_ARENA_CHILD` set): the stand-in reads its knobs once per process
//! and aborts the process on a violation. Without the stand-in every test
//! prints `skipped: ...` and passes.
//!
//! `MEMGOV_ARENA_SLEEP_MIB` sets the size of the sleep/wake set (default 16,
//! for CI time; the full check is 1024) and `MEMGOV_ARENA_SLEEP_CYCLES` the
//! cycles (default 100).

#[path = "../../cases/arena.rs"]
mod cases;
#[macro_use]
mod common;
arena_table!();

use common::{EXIT_CHECK, LATENCY, SEED};

const CHILD: &str = "MEMGOV_ARENA_CHILD";

use vendor::passes;

#[test]
fn a_set_of_allocations_sleeps_and_wakes_leaving_the_others_mapped_and_usable() {
    passes(
        "sleep_set",
        &[(LATENCY, "300"), (SEED, "3"), (EXIT_CHECK, "1")],
    );
}

#[test]
fn stand_in_refuses_unaligned_and_stray_maps_with_the_drivers_code() {
    passes("refused_codes", &[]);
}

#[test]
fn a_context_synchronize_outlives_a_stream_reaped_while_it_waits() {
    // The synchronize held by the pause knob between its snapshot of the
    // queues and its waits while a drained stream is reaped.
    passes("sync_during_reap", &[]);
}

common::child_process::child_entry!(CHILD, cases::run, own::run);

/// CUDA's own cases: the sleep of a set, a synchronize outliving a reaped
/// stream, and the stand-in driver's rules called raw.
mod own {
    use crate::cases::{arena, arena_context, finish, pattern, release, settle, G, MIB};
    use crate::common;
    use crate::vendor::vmm;
    use cudarc::driver::sys::{self, CUresult};
    use memgov::cuda::{CudaConfig, CudaContext, CudaMemory, CudaStream};
    use memgov::{BackendErrorKind, DeviceContext};
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    // ---- raw driver calls for the planted cases -----------------------

    pub(crate) fn ok(r: CUresult, what: &str) {
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

    pub(crate) struct Raw {
        ctx: CudaContext,
        s: sys::CUstream,
        pub(crate) base: u64,
    }

    /// A context current on this thread, a raw stream and a 4-granule
    /// reservation.
    pub(crate) fn raw() -> Raw {
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

    pub(crate) fn create(size: usize) -> (CUresult, sys::CUmemGenericAllocationHandle) {
        let mut h = 0;
        // SAFETY: valid out pointer and properties.
        let r = unsafe { sys::cuMemCreate(&mut h, size, &prop(), 0) };
        (r, h)
    }

    pub(crate) fn access(at: u64, size: usize) {
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

    pub(crate) fn mapped(r: &Raw) -> sys::CUmemGenericAllocationHandle {
        let (c, h) = create(G);
        ok(c, "create");
        // SAFETY: the reservation's first granule, unmapped.
        ok(unsafe { sys::cuMemMap(r.base, G, 0, h, 0) }, "map");
        h
    }

    include!("../../cases/forward.rs");

    pub(crate) type Code = CUresult;

    forward! {
        sync(r: &Raw) => sys::cuStreamSynchronize(r.s);
        unmap(at: u64, size: usize) => sys::cuMemUnmap(at, size);
        mem_release(h: sys::CUmemGenericAllocationHandle) => sys::cuMemRelease(h);
        map(at: u64, h: sys::CUmemGenericAllocationHandle) => sys::cuMemMap(at, G, 0, h, 0);
        address_free(at: u64, size: usize) => sys::cuMemAddressFree(at, size);
        copy_in(r: &Raw, at: u64, src: &[u8]) =>
            sys::cuMemcpyHtoDAsync_v2(at, src.as_ptr().cast(), src.len(), r.s);
    }

    /// The case's end: its stream synchronized and destroyed, the context
    /// no longer current, then torn down.
    pub(crate) fn raw_finish(r: Raw) {
        // SAFETY: the case's own stream, synchronized before its destroy.
        unsafe {
            ok(sys::cuStreamSynchronize(r.s), "sync");
            ok(sys::cuStreamDestroy_v2(r.s), "destroy");
            ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear");
        }
        r.ctx.teardown(false).expect("teardown");
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
                "sleep_set" => sleep_set(),
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
                other => panic!("unknown case {other}"),
            }
        }
    }
}
