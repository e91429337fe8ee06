//! The HIP backend's virtual-memory arena and sleep/wake: the cases HIP
//! shares with CUDA (`backends/cases/arena.rs`, the conformance suite on an
//! arena and its capability cases among them, instantiated here through the
//! `vendor` module), and HIP's own: the arena's device made current and the
//! thread's restored, a runtime without the virtual memory calls, and the
//! stand-in runtime's virtual memory management rules called raw
//! (`memgov::hip::raw`), each with a planted violation.
//!
//! Every case runs in a child process (this binary re-executed with
//! `MEMGOV_HIP_ARENA_CHILD` set): the stand-in reads its knobs once per
//! process and aborts the process on a violation. Without the stand-in
//! every test prints `skipped: ...` and passes.
//!
//! `MEMGOV_ARENA_SLEEP_MIB` sets the size of the sleep/wake set (default 16,
//! for CI time; the full check is 1024) and `MEMGOV_ARENA_SLEEP_CYCLES` the
//! cycles (default 20; the full check is 100).

#[path = "../../cases/arena.rs"]
mod cases;
#[macro_use]
mod common;
arena_table!();

use memgov::hip::raw as hip;
use memgov::hip::{HipConfig, HipContext};
use memgov::{BackendErrorKind, DeviceContext};

pub(crate) use common::{aborts, child, passes, BANNER, EXIT_CHECK, LATENCY, SEED};

const CHILD: &str = "MEMGOV_HIP_ARENA_CHILD";

#[test]
fn every_arena_call_runs_on_the_arena_device_and_restores_the_threads() {
    passes(
        "current_device_restored",
        &[("MEMGOV_STANDIN_HIP_DEVICES", "2"), (EXIT_CHECK, "1")],
    );
}

/// A ROCm without the virtual memory calls: the stand-in built without its
/// `vmm.c` (so `hipMemGetAllocationGranularity` and the rest are not
/// exported). An arena is `Unsupported`, naming the first missing symbol;
/// the pool still works.
#[test]
fn a_runtime_lacking_the_vmm_calls_makes_the_arena_unsupported() {
    common::passes_on_partial_stand_in("hip-without-vmm", &[], "no_vmm");
}

#[test]
fn stand_in_refuses_unaligned_and_stray_maps_with_the_runtimes_code() {
    passes("refused_codes", &[]);
}

common::child_process::child_entry!(CHILD, cases::run, own::run);

/// HIP's own cases: the thread's device restored, a runtime without the
/// virtual memory calls, and the stand-in runtime's rules called raw.
mod own {
    use super::*;
    use crate::cases::{arena, arena_context, finish, pattern, release, settle, G, MIB};
    use crate::common::vmm;
    use memgov::hip::ArenaConfig;
    use std::ffi::c_void;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    fn current_device() -> i32 {
        let mut d = -1;
        // SAFETY: valid out pointer.
        ok(unsafe { hip::hipGetDevice(&mut d) }, "hipGetDevice");
        d
    }

    /// The thread's device is 1; the arena's is 0: every call makes 0
    /// current for its HIP calls (the stand-in's copies and maps check the
    /// stream's and the properties' device) and sets 1 back.
    fn current_device_restored() {
        // SAFETY: plain call with a valid ordinal (two devices).
        ok(unsafe { hip::hipSetDevice(1) }, "hipSetDevice");
        let check = |what: &str| assert_eq!(current_device(), 1, "after {what}");
        let ctx = arena_context(64 * MIB, 64 * MIB);
        check("HipContext::new");
        let s = ctx.create_stream().expect("stream");
        let m = ctx.allocate(&s, 3 * MIB).expect("allocate");
        check("allocate");
        let data = pattern(11, 3 * MIB as usize);
        ctx.write(&s, &m, 0, &data).expect("write");
        check("write");
        arena(&ctx).sleep(true).expect("sleep");
        check("sleep");
        arena(&ctx).wake().expect("wake");
        check("wake");
        let mut back = vec![0u8; data.len()];
        ctx.read(&s, &m, 0, &mut back).expect("read");
        assert!(back == data);
        let retired = Arc::new(AtomicU64::new(0));
        release(&ctx, &s, m, &retired);
        check("free_async");
        settle(&ctx, std::slice::from_ref(&s), &retired, 1);
        assert_eq!(arena(&ctx).trim().expect("trim"), 4 * MIB);
        check("trim");
        finish(ctx, vec![s]);
        check("teardown");
    }

    // ---- raw runtime calls for the planted cases ----------------------

    pub(crate) fn ok(r: i32, what: &str) {
        assert_eq!(r, hip::SUCCESS, "{what}");
    }

    fn prop() -> hip::AllocationProp {
        let mut v = 0;
        // SAFETY: valid out pointer.
        ok(unsafe { hip::hipRuntimeGetVersion(&mut v) }, "version");
        hip::allocation_prop(0, v)
    }

    pub(crate) struct Raw {
        ctx: HipContext,
        s: hip::hipStream_t,
        pub(crate) base: u64,
    }

    fn va(a: u64) -> *mut c_void {
        a as *mut c_void
    }

    /// A context, a raw stream and a 4-granule reservation (device 0 is
    /// current on every thread by default).
    pub(crate) fn raw() -> Raw {
        let ctx = HipContext::new(HipConfig::default()).expect("context");
        let mut s = std::ptr::null_mut();
        let mut base = std::ptr::null_mut();
        // SAFETY: raw calls on the stand-in with valid out pointers.
        unsafe {
            ok(
                hip::hipStreamCreateWithFlags(&mut s, hip::hipStreamNonBlocking),
                "stream",
            );
            ok(
                hip::hipMemAddressReserve(&mut base, 4 * G, 0, std::ptr::null_mut(), 0),
                "reserve",
            );
        }
        Raw {
            ctx,
            s,
            base: base as u64,
        }
    }

    pub(crate) fn create(size: usize) -> (i32, hip::hipMemGenericAllocationHandle_t) {
        let mut h = std::ptr::null_mut();
        let p = prop();
        // SAFETY: valid out pointer and properties.
        let r = unsafe { hip::hipMemCreate(&mut h, size, p.as_ptr(), 0) };
        (r, h)
    }

    pub(crate) fn access(a: u64, size: usize) {
        let desc = hip::hipMemAccessDesc {
            location: prop().location(),
            flags: hip::hipMemAccessFlagsProtReadWrite,
        };
        // SAFETY: one valid descriptor.
        ok(
            unsafe { hip::hipMemSetAccess(va(a), size, &desc, 1) },
            "set access",
        );
    }

    pub(crate) fn mapped(r: &Raw) -> hip::hipMemGenericAllocationHandle_t {
        let (c, h) = create(G);
        ok(c, "create");
        // SAFETY: the reservation's first granule, unmapped.
        ok(unsafe { hip::hipMemMap(va(r.base), G, 0, h, 0) }, "map");
        h
    }

    include!("../../cases/forward.rs");

    pub(crate) type Code = i32;

    // The planted cases' copies: the stand-in checks the destination (and
    // aborts where the case plants a violation).
    forward! {
        sync(r: &Raw) => hip::hipStreamSynchronize(r.s);
        unmap(a: u64, size: usize) => hip::hipMemUnmap(va(a), size);
        mem_release(h: hip::hipMemGenericAllocationHandle_t) => hip::hipMemRelease(h);
        map(a: u64, h: hip::hipMemGenericAllocationHandle_t) => hip::hipMemMap(va(a), G, 0, h, 0);
        address_free(a: u64, size: usize) => hip::hipMemAddressFree(va(a), size);
        copy_in(r: &Raw, a: u64, src: &[u8]) =>
            hip::hipMemcpyHtoDAsync(va(a), src.as_ptr() as *mut c_void, src.len(), r.s);
    }

    pub(crate) fn raw_finish(r: Raw) {
        // SAFETY: the case's own stream, synchronized before its destroy.
        unsafe {
            ok(hip::hipStreamSynchronize(r.s), "sync");
            ok(hip::hipStreamDestroy(r.s), "destroy");
        }
        r.ctx.teardown(false).expect("teardown");
    }

    pub(super) fn run(case: &str) {
        // SAFETY: raw runtime calls on the stand-in, each valid or the
        // violation the case plants on purpose; the stand-in aborts before
        // anything undefined happens.
        unsafe {
            match case {
                "current_device_restored" => current_device_restored(),
                "no_vmm" => {
                    let e = HipContext::new(HipConfig {
                        arena: Some(ArenaConfig::default()),
                        ..HipConfig::default()
                    })
                    .expect_err("no arena without the VMM calls");
                    assert_eq!(e.kind, BackendErrorKind::Unsupported, "{e}");
                    assert!(
                        e.message.contains(
                            "needs hipMemGetAllocationGranularity, which the loaded HIP runtime \
                             does not export"
                        ),
                        "names the missing symbol, before any call: {e}"
                    );
                    println!("no VMM calls: {e}");
                    assert_eq!(
                        hip::missing(&hip::VMM_SYMBOLS),
                        Some("hipMemGetAllocationGranularity")
                    );
                    // The pool still works on that runtime.
                    let ctx = HipContext::new(HipConfig::default()).expect("the pool context");
                    let s = ctx.create_stream().expect("stream");
                    let m = ctx.allocate(&s, 4096).expect("allocate");
                    let retired = Arc::new(AtomicU64::new(0));
                    release(&ctx, &s, m, &retired);
                    settle(&ctx, std::slice::from_ref(&s), &retired, 1);
                    ctx.destroy_stream(s).expect("destroy");
                    ctx.teardown(false).expect("teardown");
                }
                "refused_codes" => {
                    let r = raw();
                    let inval = hip::hipErrorInvalidValue;
                    assert_eq!(create(G / 2).0, inval, "hipMemCreate of half a granule");
                    let mut p = std::ptr::null_mut();
                    assert_eq!(
                        hip::hipMemAddressReserve(&mut p, G + 4096, 0, std::ptr::null_mut(), 0),
                        inval
                    );
                    let h = mapped(&r);
                    let (c, h2) = create(G);
                    ok(c, "create");
                    assert_eq!(
                        hip::hipMemMap(va(r.base), G, 0, h2, 0),
                        inval,
                        "over a mapping"
                    );
                    let g = G as u64;
                    assert_eq!(
                        hip::hipMemMap(va(r.base + g + 4096), G, 0, h2, 0),
                        inval,
                        "unaligned"
                    );
                    assert_eq!(
                        hip::hipMemMap(va(r.base + 3 * g), 2 * G, 0, h2, 0),
                        inval,
                        "past the reservation"
                    );
                    assert_eq!(
                        hip::hipMemMap(va(r.base + g), G, G, h2, 0),
                        inval,
                        "a nonzero offset (HIP: currently must be zero)"
                    );
                    assert_eq!(
                        hip::hipMemMap(va(r.base + g), G, 0, h2, 1),
                        inval,
                        "nonzero flags"
                    );
                    assert_eq!(
                        hip::hipMemMap(va(r.base + 64 * g), G, 0, h2, 0),
                        inval,
                        "outside any reservation"
                    );
                    assert_eq!(
                        hip::hipMemUnmap(va(r.base), G / 2),
                        inval,
                        "part of a mapping"
                    );
                    ok(hip::hipMemUnmap(va(r.base), G), "unmap");
                    ok(hip::hipMemRelease(h), "release");
                    ok(hip::hipMemRelease(h2), "release");
                    assert_eq!(hip::hipMemAddressFree(va(r.base), G), inval, "part of it");
                    ok(hip::hipMemAddressFree(va(r.base), 4 * G), "address free");
                    raw_finish(r);
                    assert_eq!(vmm(), [0; 6]);
                }
                other => panic!("unknown case {other}"),
            }
        }
    }
}
