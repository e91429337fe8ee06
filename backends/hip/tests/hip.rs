//! The HIP backend against whatever HIP runtime the backend opens: the
//! stand-in from `backends/hip/stand-in/` in CI (put on `LD_LIBRARY_PATH`),
//! an AMD GPU where there is one, Debian's real runtime with no GPU, where
//! every test prints `skipped: no HIP device (...)` and passes, or none, where
//! every test prints `skipped: no HIP runtime: ...` and passes.
//!
//! Tests that need the stand-in's knobs or plant contract violations run in
//! a child process (this test binary re-executed with one ignored test and
//! an environment variable), because the stand-in reads its knobs once per
//! process and aborts the process on a violation. On anything but the
//! stand-in they print `skipped: not the stand-in (...)`.
//!
//! `cargo test --features hip --test hip` (with the stand-in:
//! `LD_LIBRARY_PATH=$(backends/stand-ins/build.sh hip)`).

#[path = "../../stand-ins/support/cache.rs"]
mod cache;
#[path = "../../stand-ins/support/cases.rs"]
mod cases;
#[path = "../../stand-ins/support/child.rs"]
mod child_process;
#[path = "../../stand-ins/support/recorded.rs"]
mod recorded;
#[path = "../../cases/core.rs"]
mod shared;

use recorded::signal;

use memgov::hip::raw as hip;
use memgov::hip::{AllocatorChoice, HipConfig, HipContext, Origin};
use memgov::{
    Alloc, BackendErrorKind, ContextConfig, DeviceContext, Execution, Governor, GovernorError,
    RetireOutcome, Role, Tier,
};
use std::ffi::c_void;
use std::time::{Duration, Instant};

#[macro_use]
#[path = "common/table.rs"]
mod table;

use table::calls::{
    current_device, hip_calls, mapped_host, ok, quiesce, raw_alloc, raw_stream, raw_write,
    stream_query,
};

memgov_conformance::conformance_tests!(hip_pool, || HipContext::new(HipConfig::default()));

memgov_conformance::conformance_tests!(hip_plain, || HipContext::new(HipConfig {
    allocator: AllocatorChoice::Plain,
    ..HipConfig::default()
}));

const LONG: Duration = Duration::from_secs(60);
/// The environment variable that makes this binary a child running one case.
const CHILD: &str = "MEMGOV_HIP_TEST_CHILD";

/// What a child prints when its case ran to the end.
const CHILD_END: &str = "child reached the end";

/// A context, or `None` after printing why there is no HIP device here.
fn context(config: HipConfig) -> Option<HipContext> {
    match HipContext::new(config) {
        Ok(c) => Some(c),
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            assert!(
                e.message.starts_with("no HIP device") || e.message.starts_with("no HIP runtime"),
                "{e}"
            );
            eprintln!("skipped: {}", e.message);
            None
        }
        Err(e) => panic!("HipContext::new failed: {e}"),
    }
}

/// A context on the stand-in, or `None` after printing why not.
fn stand_in() -> Option<HipContext> {
    let ctx = context(HipConfig::default())?;
    if ctx.describe().execution != Execution::StandIn {
        eprintln!(
            "skipped: not the stand-in ({}): this test needs its knobs",
            ctx.describe().name
        );
        let _ = ctx.teardown(false);
        return None;
    }
    Some(ctx)
}

#[test]
fn describe_names_the_allocator_and_how_it_ran() {
    let Some(ctx) = context(HipConfig::default()) else {
        return;
    };
    let d = ctx.describe();
    assert_eq!(d.backend, "hip");
    assert_eq!(d.vendor, "AMD");
    assert!(d.total_bytes > 0);
    let (ordered, why) = ctx.stream_ordered();
    assert_eq!(d.stream_ordered_reuse, ordered);
    if ordered {
        assert!(d.driver.contains("hipMallocFromPoolAsync"), "{}", d.driver);
    } else {
        assert!(d.driver.contains("fallback"), "{} ({why:?})", d.driver);
    }
    if d.name.starts_with(memgov::hip::STAND_IN_NAME_PREFIX) {
        assert_eq!(d.execution, Execution::StandIn);
        assert!(ordered, "the stand-in has a pool unless told otherwise");
    } else {
        assert_eq!(d.execution, Execution::RealHardware);
    }
    ctx.teardown(false).unwrap();
}

#[test]
fn plain_fallback_frees_after_the_event() {
    let config = HipConfig {
        allocator: AllocatorChoice::Plain,
        ..HipConfig::default()
    };
    let Some(ctx) = context(config) else { return };
    let probe = ctx.probe();
    let d = ctx.describe();
    assert!(!d.stream_ordered_reuse);
    assert!(
        d.driver.contains("hipMalloc/hipFree fallback"),
        "{}",
        d.driver
    );
    let s = ctx.create_stream().unwrap();
    let m = ctx.allocate(&s, 4096).unwrap();
    assert_eq!(m.origin(), Origin::Plain);
    ctx.write(&s, &m, 0, &[7; 4096]).unwrap();
    let mut back = [0u8; 16];
    ctx.read(&s, &m, 4080, &mut back).unwrap();
    assert_eq!(back, [7; 16]);
    let (sig, rx) = signal();
    ctx.free_async(&s, m, sig).map_err(|(_, _, e)| e).unwrap();
    let (outcome, thread) = rx.recv_timeout(LONG).expect("the free thread retired it");
    assert_eq!(outcome, RetireOutcome::Retired);
    assert_ne!(thread, std::thread::current().id());
    ctx.destroy_stream(s).unwrap();
    ctx.teardown(false).unwrap();
    probe.check_clean_teardown().unwrap();
}

#[test]
fn sticky_codes_classify_as_device_loss() {
    use hip as E;
    for code in [
        E::hipErrorIllegalAddress,
        E::hipErrorLaunchFailure,
        E::hipErrorECCNotCorrectable,
        E::hipErrorAssert,
    ] {
        let e = hip::hip_error("allocate", "hipMallocAsync", code);
        assert_eq!(e.kind, BackendErrorKind::DeviceLost, "{e}");
        assert!(e.message.contains("retire this context"), "{e}");
        assert_eq!(e.code, Some(i64::from(code)));
    }
    let oom = hip::hip_error("allocate", "hipMallocAsync", E::hipErrorOutOfMemory);
    assert_eq!(oom.kind, BackendErrorKind::OutOfMemory);
    assert!(oom.message.contains("hipErrorOutOfMemory (2)"), "{oom}");
    assert_eq!(
        hip::kind_of(E::hipErrorNoDevice),
        BackendErrorKind::Unavailable
    );
    // A code no binding lists (a newer runtime's) is read as the integer it
    // is: classified `Other`, its number kept, and never a Rust enum value.
    let unknown = hip::hip_error("allocate", "hipMallocAsync", 123_456);
    assert_eq!(unknown.kind, BackendErrorKind::Other, "{unknown}");
    assert_eq!(unknown.code, Some(123_456));
    assert!(!hip::is_device_lost(123_456));
}

#[test]
fn teardown_trims_the_pool() {
    if !on_stand_in() {
        return;
    }
    // In a child: other tests' teardowns would trim the shared pool too.
    expect_pass("trim", &[]);
}

// ---- child processes: knobs and planted violations ---------------------

// The stand-in's knobs (see `backends/stand-ins/README.md`), from the table.
use table::knobs::{LATENCY, SEED};

/// Run `case` in a child with `env`. A child that sets its own latency gets
/// exactly that latency: a latency seed the parent runs with (which would
/// draw each delay from 0 to twice the latency) is not passed on, unless the
/// child's environment names one itself.
fn child(case: &str, env: &[(&str, &str)]) -> child_process::ChildRun {
    let mut env = env.to_vec();
    if env.iter().any(|(k, _)| *k == LATENCY) && !env.iter().any(|(k, _)| *k == SEED) {
        env.push((SEED, ""));
    }
    child_process::run(CHILD, case, &env)
}

/// Whether this process runs on the stand-in; prints why not.
fn on_stand_in() -> bool {
    stand_in().map(|c| c.teardown(false).unwrap()).is_some()
}

/// Run `case` in a child that the stand-in must abort with a contract
/// violation naming `message`.
fn expect_abort(case: &str, env: &[(&str, &str)], message: &str) {
    let run = child(case, env);
    child_process::assert_aborted(
        case,
        &run,
        "memgov libamdhip64 stand-in: contract violation",
        message,
        CHILD_END,
    );
}

/// Run `case` in a child that must pass, with the stand-in's exit check on:
/// anything the case leaves allocated aborts the child.
fn expect_pass(case: &str, env: &[(&str, &str)]) -> String {
    let mut env = env.to_vec();
    env.push(("MEMGOV_STANDIN_HIP_EXIT_CHECK", "1"));
    let run = child(case, &env);
    child_process::assert_passed(case, &run, CHILD_END);
    run.output()
}

#[test]
fn pinned_memory_hands_out_its_host_pointer_and_its_device_pointer() {
    // The stand-in gives mapped host memory a device pointer that differs
    // from its host pointer and aborts on a copy whose pointers do not
    // match its kind. Both reach the same bytes: the tier's write (through
    // the device pointer) shows at the host pointer, host code's store
    // through the host pointer shows in the tier's read and in a raw copy
    // from the device pointer. (`tests/pinned.rs` drives the tier through
    // the governor alone.)
    let Some(backend) = context(HipConfig::default()) else {
        return;
    };
    let stand_in = backend.is_stand_in();
    let gov = Governor::new();
    let ctx = gov.register(backend, ContextConfig::new().label("pinned"));
    let stream = ctx.create_stream("s").expect("stream");
    let buf = ctx
        .allocate(
            &stream,
            Alloc::new(1 << 20, Role::Other).tier(Tier::PinnedHost),
        )
        .expect("pinned allocation");
    let (host, device) = {
        let mem = buf.raw().expect("live buffer");
        (mem.host_ptr().expect("a host pointer"), mem.device_ptr())
    };
    if stand_in {
        assert_ne!(device, host, "the stand-in's device view differs");
    }
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    buf.write(1 << 19, &data).expect("write");
    let mut seen = vec![0u8; data.len()];
    // SAFETY: `host` is the buffer's page-locked host memory, live and 1 MiB
    // long; the write above has completed (it synchronizes its stream) and
    // nothing else is queued on it.
    unsafe {
        std::ptr::copy_nonoverlapping((host as *const u8).add(1 << 19), seen.as_mut_ptr(), 4096)
    };
    assert!(seen == data, "the tier's write shows at the host pointer");
    let stored: Vec<u8> = data.iter().map(|b| b ^ 0x5a).collect();
    // SAFETY: as above; host code may store to page-locked host memory.
    unsafe { std::ptr::copy_nonoverlapping(stored.as_ptr(), host as *mut u8, 4096) };
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).expect("read");
    assert!(back == stored, "the host's store shows in the tier's read");
    let raw = stream.raw().expect("live stream").hip_stream();
    let mut copied = vec![0u8; 4096];
    // SAFETY: `device` is the buffer's device pointer, valid for 1 MiB; the
    // stream is the buffer's own, alive; `copied` outlives the synchronize.
    unsafe {
        ok(hip::hipMemcpyDtoHAsync(
            copied.as_mut_ptr() as *mut c_void,
            device,
            4096,
            raw,
        ));
        ok(hip::hipStreamSynchronize(raw));
    }
    assert!(copied == stored, "a raw copy from the device pointer");
    buf.release_on(&stream).expect("release");
    drop(stream);
    let report = ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(30))
        .expect("retire");
    assert!(report.backend_result.is_ok(), "{:?}", report.backend_result);
}

#[test]
fn planted_violations_abort_the_stand_in() {
    if !on_stand_in() {
        return;
    }
    expect_abort(
        "destroy_with_pending_work",
        &[("MEMGOV_STANDIN_HIP_LATENCY_US", "200000")],
        "hipStreamDestroy of stream",
    );
    expect_abort(
        "live_memory_at_exit",
        &[("MEMGOV_STANDIN_HIP_EXIT_CHECK", "1")],
        "process exits with 1 allocations (4096 bytes) still live on device 0",
    );
    expect_abort(
        "reset_with_live_memory",
        &[],
        "hipDeviceReset with 1 allocations (64 bytes)",
    );
    expect_abort(
        "call_inside_callback",
        &[],
        "called from inside a stream callback",
    );
    // The control: the same steps done right pass.
    expect_pass("control", &[("MEMGOV_STANDIN_HIP_LATENCY_US", "2000")]);
}

/// The copy entry points the stand-in implements, by case name: the HIP
/// function and whether the kind makes each side (destination, source) a
/// device side.
const COPY_ENTRIES: [(&str, &str, bool, bool); 7] = [
    ("htod", "hipMemcpyHtoDAsync", true, false),
    ("dtoh", "hipMemcpyDtoHAsync", false, true),
    ("async_htoh", "hipMemcpyAsync", false, false),
    ("async_htod", "hipMemcpyAsync", true, false),
    ("async_dtoh", "hipMemcpyAsync", false, true),
    ("async_dtod", "hipMemcpyAsync", true, true),
    // hipMemcpyDefault: each side's kind is what its address is.
    ("async_default", "hipMemcpyAsync", false, false),
];

/// Pointers of the wrong kind for one side of a copy: the case name, whether
/// it is planted on a side the kind makes a device side, and what the
/// stand-in says about it.
const WRONG_POINTERS: [(&str, bool, &str); 4] = [
    (
        "pinned_host_pointer",
        true,
        "is a host pointer (page-locked host memory), where the copy's kind takes a device pointer",
    ),
    (
        "pageable_host_pointer",
        true,
        "the copy's kind takes a device pointer there",
    ),
    (
        "device_view",
        false,
        "is the device pointer of page-locked host memory, where the copy's kind takes a host pointer",
    ),
    (
        "device_memory",
        false,
        "is device memory, where the copy's kind takes a host pointer",
    ),
];

#[test]
fn planted_copies_of_the_wrong_kind_abort_the_stand_in() {
    // HIP documents a copy whose pointers do not match its hipMemcpyKind as
    // undefined behaviour, and the device pointer of mapped host memory as
    // the one hipHostGetDevicePointer returns, which may differ from the
    // host pointer (the stand-in's does). Every entry point, every side,
    // every pointer of the wrong kind for it: one child each.
    if !on_stand_in() {
        return;
    }
    let mut planted = 0;
    for (entry, function, dst_device, src_device) in COPY_ENTRIES {
        if entry == "async_default" {
            continue; // no pointer is of the wrong kind for it
        }
        for (side, device) in [("destination", dst_device), ("source", src_device)] {
            for (wrong, on_device_side, says) in WRONG_POINTERS {
                if on_device_side != device {
                    continue;
                }
                let case = format!("kind:{entry}:{side}:{wrong}");
                let run = child(&case, &[]);
                // Which call and side: memory the stand-in does not know
                // is named as such, with the side.
                let whose = if wrong == "pageable_host_pointer" {
                    format!("{function} of 4096 bytes at unknown device pointer 0x")
                } else {
                    format!("{function}: the {side} 0x")
                };
                let says = if wrong == "pageable_host_pointer" {
                    format!("(the {side}; {says})")
                } else {
                    says.to_string()
                };
                for what in [&whose, &says] {
                    child_process::assert_aborted(
                        &case,
                        &run,
                        "memgov libamdhip64 stand-in: contract violation",
                        what,
                        CHILD_END,
                    );
                }
                planted += 1;
            }
        }
    }
    assert_eq!(planted, 24, "6 entries, 2 sides, 2 wrong pointers a side");
    // The control: every entry, hipMemcpyDefault included, with every
    // pointer of the right kind on each side, bytes checked.
    expect_pass("kind_controls", &[]);
}

#[test]
fn releases_really_pend_with_latency() {
    if !on_stand_in() {
        return;
    }
    expect_pass(
        "pending_with_latency",
        &[("MEMGOV_STANDIN_HIP_LATENCY_US", "50000")],
    );
}

#[test]
fn no_mempool_falls_back_to_hip_malloc() {
    if !on_stand_in() {
        return;
    }
    expect_pass("no_mempool", &[("MEMGOV_STANDIN_HIP_NO_MEMPOOL", "1")]);
}

#[test]
fn refused_malloc_async_falls_back_at_creation() {
    if !on_stand_in() {
        return;
    }
    expect_pass(
        "malloc_async_refused",
        &[("MEMGOV_STANDIN_HIP_NO_MEMPOOL", "2")],
    );
}

#[test]
fn no_device_is_unavailable_not_a_panic() {
    if !on_stand_in() {
        return;
    }
    expect_pass("no_device", &[("MEMGOV_STANDIN_HIP_DEVICES", "0")]);
}

#[test]
fn planted_stand_in_checks_abort() {
    if !on_stand_in() {
        return;
    }
    expect_abort(
        "unordered_cross_stream_free",
        &[("MEMGOV_STANDIN_HIP_LATENCY_US", "100000")],
        "missing stream ordering",
    );
    expect_abort(
        "wait_on_destroyed_event",
        &[],
        "hipStreamWaitEvent on destroyed event",
    );
    expect_abort(
        "other_devices_memory",
        &[("MEMGOV_STANDIN_HIP_DEVICES", "2")],
        "memory of device 1, on a stream of device 0",
    );
    expect_abort(
        "pool_left_at_exit",
        &[("MEMGOV_STANDIN_HIP_EXIT_CHECK", "1")],
        "process exits with 1 memory pools of device 0 never destroyed",
    );
    expect_abort(
        "default_pool_threshold_changed",
        &[("MEMGOV_STANDIN_HIP_EXIT_CHECK", "1")],
        "release threshold of device 0's default memory pool",
    );
    // The other thread is inside hipStreamSynchronize when the hook runs
    // (or, should it be slower than the sleep, calls it just after): both
    // are the same violation.
    expect_abort(
        "call_in_flight_at_quiesce",
        &[("MEMGOV_STANDIN_HIP_LATENCY_US", "300000")],
        "a backend thread still calls HIP after teardown returned",
    );
    expect_abort(
        "call_after_quiesce",
        &[],
        "called from another thread after memgov_standin_hip_quiesce()",
    );
    // The controls: the same steps done right pass.
    expect_pass(
        "ordered_cross_stream_free",
        &[("MEMGOV_STANDIN_HIP_LATENCY_US", "100000")],
    );
}

#[test]
fn lost_teardown_of_the_fallback_joins_the_free_thread_and_frees() {
    if !on_stand_in() {
        return;
    }
    for latency in ["0", "2000", "200000"] {
        expect_pass(
            "lost_fallback_teardown",
            &[("MEMGOV_STANDIN_HIP_LATENCY_US", latency)],
        );
    }
}

#[test]
fn the_default_memory_pool_is_never_changed() {
    if !on_stand_in() {
        return;
    }
    expect_pass("default_pool_untouched", &[]);
}

#[test]
fn dropped_callbacks_leak_no_context() {
    if !on_stand_in() {
        return;
    }
    // Calls 1-17 open the context, 18-19 a stream, 20-21 an allocation,
    // 22-23 its free; 24 is sticky, and the queued callback is dropped.
    expect_pass(
        "dropped_callback",
        &[
            ("MEMGOV_STANDIN_HIP_LATENCY_US", "50000"),
            ("MEMGOV_STANDIN_HIP_STICKY_ERROR_AT_OP", "24"),
            ("MEMGOV_STANDIN_HIP_DROP_CALLBACKS", "1"),
        ],
    );
}

/// A context dropped without teardown (a device probe, a panic unwinding)
/// releases its pool, streams and memory: the exit check finds nothing.
#[test]
fn a_dropped_context_releases_what_it_holds() {
    if !on_stand_in() {
        return;
    }
    expect_pass("dropped_without_teardown", &[]);
}

#[test]
fn a_nearly_full_device_still_opens() {
    if !on_stand_in() {
        return;
    }
    expect_pass(
        "nearly_full",
        &[("MEMGOV_STANDIN_HIP_OOM_AFTER_BYTES", "100")],
    );
}

#[test]
fn teardown_stops_calling_hip_at_a_sticky_error() {
    if !on_stand_in() {
        return;
    }
    // Calls 1-17 open the context, 18-21 two streams, 22-25 an allocation
    // and its free (pending behind the latency); teardown's first call
    // (hipGetDevice, 26) succeeds and its first synchronize (27) is sticky:
    // nothing after it may reach HIP, and the pending free's signal, whose
    // callback the runtime drops, is settled as abandoned before teardown
    // returns.
    expect_pass(
        "sticky_mid_teardown",
        &[
            ("MEMGOV_STANDIN_HIP_STICKY_ERROR_AT_OP", "27"),
            ("MEMGOV_STANDIN_HIP_LATENCY_US", "100000"),
            ("MEMGOV_STANDIN_HIP_DROP_CALLBACKS", "1"),
        ],
    );
}

/// Queue the copy of case name `entry` (see `COPY_ENTRIES`) on `s`.
///
/// # Safety
///
/// The pointers must be valid for `bytes` as the entry's kind says, or the
/// stand-in must abort first (a planted case).
unsafe fn copy(
    entry: &str,
    dst: *mut c_void,
    src: *mut c_void,
    bytes: usize,
    s: hip::hipStream_t,
) -> hip::HipResult {
    // SAFETY: as the caller promises.
    unsafe {
        match entry {
            "htod" => hip::hipMemcpyHtoDAsync(dst, src, bytes, s),
            "dtoh" => hip::hipMemcpyDtoHAsync(dst, src, bytes, s),
            "async_htoh" => hip::hipMemcpyAsync(dst, src, bytes, hip::hipMemcpyHostToHost, s),
            "async_htod" => hip::hipMemcpyAsync(dst, src, bytes, hip::hipMemcpyHostToDevice, s),
            "async_dtoh" => hip::hipMemcpyAsync(dst, src, bytes, hip::hipMemcpyDeviceToHost, s),
            "async_dtod" => hip::hipMemcpyAsync(dst, src, bytes, hip::hipMemcpyDeviceToDevice, s),
            "async_default" => hip::hipMemcpyAsync(dst, src, bytes, hip::hipMemcpyDefault, s),
            other => panic!("unknown copy entry {other}"),
        }
    }
}

/// The child of a planted copy `kind:<entry>:<side>:<wrong pointer>`: every
/// pointer of the right kind but the one named, which is of the wrong kind
/// for its side. The stand-in must abort in the copy.
///
/// # Safety
///
/// Raw HIP calls on handles made here; the one wrong pointer is caught by
/// the stand-in before anything is copied.
unsafe fn planted_kind(case: &str) {
    let parts: Vec<&str> = case.split(':').collect();
    let [_, entry, side, wrong] = parts[..] else {
        panic!("malformed planted case {case}");
    };
    let (_, _, dst_device, src_device) = COPY_ENTRIES
        .iter()
        .copied()
        .find(|e| e.0 == entry)
        .expect("a known entry");
    let s = raw_stream();
    let (host, view) = mapped_host(4096);
    assert_ne!(view, host, "the stand-in's device view differs");
    let mut pageable = [vec![1u8; 4096], vec![2u8; 4096]];
    let p0 = pageable[0].as_mut_ptr() as *mut c_void;
    let p1 = pageable[1].as_mut_ptr() as *mut c_void;
    let right = |device: bool, pageable: *mut c_void| {
        if device {
            raw_alloc(4096, s)
        } else {
            pageable
        }
    };
    let (mut dst, mut src) = (right(dst_device, p0), right(src_device, p1));
    let planted = match wrong {
        "pinned_host_pointer" => host,
        "pageable_host_pointer" if side == "destination" => p0,
        "pageable_host_pointer" => p1,
        "device_view" => view,
        "device_memory" => raw_alloc(4096, s),
        other => panic!("unknown wrong pointer {other}"),
    };
    match side {
        "destination" => dst = planted,
        _ => src = planted,
    }
    // SAFETY: every pointer is valid for 4096 bytes; the one of the wrong
    // kind makes the stand-in abort.
    let _ = unsafe { copy(entry, dst, src, 4096, s) };
    // SAFETY: a live stream.
    let _ = unsafe { hip::hipStreamSynchronize(s) };
}

/// The control of the planted copies: every entry with every pointer of the
/// right kind on each side (device memory or the device's view of mapped
/// page-locked memory on a device side, pageable or page-locked host memory
/// on a host side), the destination read back after each copy. Everything
/// is freed: the exit check is on.
///
/// # Safety
///
/// Raw HIP calls on handles made here, each pointer valid for 4096 bytes.
unsafe fn kind_controls() {
    const N: usize = 4096;
    let s = raw_stream();
    let (d0, d1) = (raw_alloc(N, s), raw_alloc(N, s));
    let ((h0, v0), (h1, v1)) = (mapped_host(N), mapped_host(N));
    let mut pageable = [vec![0u8; N], vec![0u8; N]];
    let p0 = pageable[0].as_mut_ptr() as *mut c_void;
    let p1 = pageable[1].as_mut_ptr() as *mut c_void;
    // (pointer, device side?) choices for a destination and a source.
    let sides = |device: bool, index: usize| -> [(*mut c_void, bool); 2] {
        match (device, index) {
            (true, 0) => [(d0, true), (v0, true)],
            (true, _) => [(d1, true), (v1, true)],
            (false, 0) => [(p0, false), (h0, false)],
            (false, _) => [(p1, false), (h1, false)],
        }
    };
    // Fill `n` bytes at `p` with `data`: a device side by a copy, a host
    // side by the host.
    let fill = |p: *mut c_void, device: bool, data: &[u8]| {
        if device {
            // SAFETY: `p` is a device side of N bytes; `data` outlives the
            // synchronize below.
            ok(unsafe { hip::hipMemcpyHtoDAsync(p, data.as_ptr() as *mut c_void, N, s) });
            // SAFETY: a live stream.
            ok(unsafe { hip::hipStreamSynchronize(s) });
        } else {
            // SAFETY: `p` is host memory of N bytes, no copy in flight.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p as *mut u8, N) };
        }
    };
    let fetch = |p: *mut c_void, device: bool| -> Vec<u8> {
        let mut out = vec![0u8; N];
        if device {
            // SAFETY: `p` is a device side of N bytes; `out` outlives the
            // synchronize below.
            ok(unsafe { hip::hipMemcpyDtoHAsync(out.as_mut_ptr() as *mut c_void, p, N, s) });
            // SAFETY: a live stream.
            ok(unsafe { hip::hipStreamSynchronize(s) });
        } else {
            // SAFETY: `p` is host memory of N bytes, no copy in flight.
            unsafe { std::ptr::copy_nonoverlapping(p as *const u8, out.as_mut_ptr(), N) };
        }
        out
    };
    let mut copies = 0u8;
    for (entry, _, dst_device, src_device) in COPY_ENTRIES {
        // hipMemcpyDefault: every pairing of kinds.
        let pairs: &[(bool, bool)] = if entry == "async_default" {
            &[(false, false), (true, false), (false, true), (true, true)]
        } else {
            &[(dst_device, src_device)]
        };
        for &(dst_kind, src_kind) in pairs {
            for (dst, dst_dev) in sides(dst_kind, 0) {
                for (src, src_dev) in sides(src_kind, 1) {
                    copies += 1;
                    let data: Vec<u8> = (0..N).map(|i| (i as u8) ^ copies).collect();
                    fill(src, src_dev, &data);
                    // SAFETY: both pointers valid for N bytes as the kind says.
                    ok(unsafe { copy(entry, dst, src, N, s) });
                    // SAFETY: a live stream.
                    ok(unsafe { hip::hipStreamSynchronize(s) });
                    assert!(fetch(dst, dst_dev) == data, "{entry}: copy {copies}");
                }
            }
        }
    }
    assert_eq!(
        copies, 40,
        "6 entries and 4 pairings of hipMemcpyDefault, 4 each"
    );
    // SAFETY: every pointer was made above, each freed once, nothing queued
    // after the synchronize.
    unsafe {
        ok(hip::hipFreeAsync(d0, s));
        ok(hip::hipFreeAsync(d1, s));
        ok(hip::hipStreamSynchronize(s));
        ok(hip::hipHostFree(h0));
        ok(hip::hipHostFree(h1));
        ok(hip::hipStreamDestroy(s));
    }
    drop(pageable);
}

unsafe extern "C" fn calls_hip(_s: hip::hipStream_t, _status: hip::HipResult, _u: *mut c_void) {
    let mut n = 0;
    // SAFETY: deliberately forbidden (a HIP call inside a callback): the
    // stand-in must abort here.
    let _ = unsafe { hip::hipGetDeviceCount(&mut n) };
}

/// The conformance suite on every configuration (`shared`'s case, under
/// its own name here).
#[test]
fn whole_suite_report() {
    shared::whole_suite_report();
}

// What the shared cases (`backends/cases/core.rs`) need of HIP, and the
// `StandInBackend` implementation: HIP's table (`common/table.rs`).
core_table!();

/// One planted case per child process. Ignored: only `child()` runs it.
#[test]
#[ignore = "the child-process entry of the planted-violation and knob tests"]
fn child_entry() {
    let case = std::env::var(CHILD).expect("run by child() with MEMGOV_HIP_TEST_CHILD set");
    if shared::run(&case) {
        println!("{CHILD_END}");
        return;
    }
    // The raw HIP calls below are on handles each arm creates; a planted
    // case breaks the runtime's contract on purpose, which the stand-in
    // turns into an abort before anything unsound happens. Each unsafe arm
    // says which call that is.
    match case.as_str() {
        // SAFETY: handles created in this arm; destroying the stream with its free still queued is
        // the planted violation: the stand-in aborts on that violation before anything unsound
        // happens
        "destroy_with_pending_work" => unsafe {
            let s = raw_stream();
            let p = raw_alloc(64, s);
            ok(hip::hipFreeAsync(p, s));
            let _ = hip::hipStreamDestroy(s);
        },
        "live_memory_at_exit" => {
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            let s = ctx.create_stream().unwrap();
            // Leak: neither freed nor torn down (dropping either frees
            // nothing). The exit check must see it.
            let _leaked = ctx.allocate(&s, 4096).unwrap();
            ctx.destroy_stream(s).unwrap();
            std::mem::forget(ctx);
            return;
        }
        // SAFETY: handles created in this arm; the device reset with the block still live is the
        // planted violation: the stand-in aborts on that violation before anything unsound happens
        "reset_with_live_memory" => unsafe {
            let s = raw_stream();
            let _p = raw_alloc(64, s);
            ok(hip::hipStreamSynchronize(s));
            ok(hip::hipStreamDestroy(s));
            let _ = hip::hipDeviceReset();
        },
        // SAFETY: a stream created here and a callback that takes a null user pointer; its HIP call
        // from inside the callback is the planted violation: the stand-in aborts on that violation
        // before anything unsound happens
        "call_inside_callback" => unsafe {
            let s = raw_stream();
            ok(hip::hipStreamAddCallback(
                s,
                Some(calls_hip),
                std::ptr::null_mut(),
                0,
            ));
            let _ = hip::hipStreamSynchronize(s);
        },
        // SAFETY: `planted_kind` makes raw calls on handles it creates and plants the violation its
        // case names: the stand-in aborts on that violation before anything unsound happens
        planted if planted.starts_with("kind:") => unsafe { planted_kind(planted) },
        // SAFETY: `kind_controls` makes only valid raw calls on handles it creates
        "kind_controls" => unsafe { kind_controls() },

        // SAFETY: handles created in this arm, each used while live and in order: the control case
        // plants nothing
        "control" => unsafe {
            let s = raw_stream();
            let p = raw_alloc(100, s);
            let src = [1u8; 50];
            ok(hip::hipMemcpyHtoDAsync(
                p,
                src.as_ptr() as *mut c_void,
                50,
                s,
            ));
            ok(hip::hipFreeAsync(p, s));
            ok(hip::hipStreamSynchronize(s));
            ok(hip::hipStreamDestroy(s));
            ok(hip::hipDeviceReset());
        },
        "pending_with_latency" => {
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            let s = ctx.create_stream().unwrap();
            let m = ctx.allocate(&s, 4096).unwrap();
            let (sig, rx) = signal();
            ctx.free_async(&s, m, sig).map_err(|(_, _, e)| e).unwrap();
            assert_eq!(
                ctx.pending_frees(),
                1,
                "the free is queued behind 50 ms of latency"
            );
            assert!(rx.try_recv().is_err(), "not retired before it executed");
            ctx.synchronize(&s).unwrap();
            assert_eq!(rx.recv_timeout(LONG).unwrap().0, RetireOutcome::Retired);
            assert_eq!(ctx.pending_frees(), 0);
            ctx.destroy_stream(s).unwrap();
            ctx.teardown(false).unwrap();
        }
        "no_mempool" => {
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            let probe = ctx.probe();
            let (ordered, why) = ctx.stream_ordered();
            assert!(!ordered);
            let why = why.unwrap();
            assert!(why.contains("MemoryPoolsSupported is 0"), "{why}");
            let d = ctx.describe();
            assert!(!d.stream_ordered_reuse);
            assert!(d.driver.contains("fallback"), "{}", d.driver);
            let s = ctx.create_stream().unwrap();
            let m = ctx.allocate(&s, 4096).unwrap();
            assert_eq!(m.origin(), Origin::Plain);
            let (sig, rx) = signal();
            ctx.free_async(&s, m, sig).map_err(|(_, _, e)| e).unwrap();
            assert_eq!(rx.recv_timeout(LONG).unwrap().0, RetireOutcome::Retired);
            ctx.destroy_stream(s).unwrap();
            ctx.teardown(false).unwrap();
            probe.check_clean_teardown().unwrap();
        }
        "malloc_async_refused" => {
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            let (ordered, why) = ctx.stream_ordered();
            assert!(!ordered);
            assert_eq!(
                why.as_deref(),
                Some("hipMallocFromPoolAsync returned hipErrorNotSupported")
            );
            assert!(!ctx.describe().stream_ordered_reuse);
            let s = ctx.create_stream().unwrap();
            let m = ctx.allocate(&s, 4096).unwrap();
            assert_eq!(m.origin(), Origin::Plain);
            let (sig, rx) = signal();
            ctx.free_async(&s, m, sig).map_err(|(_, _, e)| e).unwrap();
            ctx.synchronize(&s).unwrap();
            assert_eq!(rx.try_recv().unwrap().0, RetireOutcome::Retired);
            ctx.destroy_stream(s).unwrap();
            let probe = ctx.probe();
            ctx.teardown(false).unwrap();
            probe.check_clean_teardown().unwrap();
        }
        "device_loss" => {
            // Calls 1-9 open the device (its UUID and PCI address
            // included), 10-11 create the context's pool, 12-17 try it once.
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            let probe = ctx.probe();
            let s = ctx.create_stream().unwrap(); // 18-19
            let m = ctx.allocate(&s, 4096).unwrap(); // 20-21
            let (sig, rx) = signal();
            ctx.free_async(&s, m, sig).map_err(|(_, _, e)| e).unwrap(); // 22-23
            let e = ctx.memory_info().expect_err("call 24 is sticky");
            assert_eq!(e.kind, BackendErrorKind::DeviceLost, "{e}");
            assert!(e.message.contains("hipErrorIllegalAddress"), "{e}");
            assert!(probe.lost());
            let e = ctx
                .create_stream()
                .expect_err("a lost context takes no work");
            assert_eq!(e.kind, BackendErrorKind::DeviceLost, "{e}");
            assert!(
                e.message
                    .contains("hipGetDevice returned hipErrorIllegalAddress (700)"),
                "the first reason is carried: {e}"
            );
            // The queued free never executes; its callback reports the
            // error (or teardown drops the signal first): abandoned either way.
            ctx.teardown(true).unwrap();
            assert_eq!(rx.recv_timeout(LONG).unwrap().0, RetireOutcome::Abandoned);
            assert_eq!(probe.frees_abandoned(), 1);
            assert_eq!(probe.frees_retired(), 0);
            assert_eq!(probe.teardowns(), 1);
            // Through the governor: the error is DeviceLost and the context
            // is marked lost.
            let gov = Governor::new();
            match HipContext::new(HipConfig::default()) {
                Err(e) => assert_eq!(e.kind, BackendErrorKind::DeviceLost, "{e}"),
                Ok(c) => {
                    let h = gov.register(c, ContextConfig::new());
                    assert!(matches!(
                        h.create_stream("x"),
                        Err(GovernorError::DeviceLost { .. })
                    ));
                }
            }
        }
        "trim" => {
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            let total = ctx.memory_info().unwrap().total;
            assert_eq!(ctx.memory_info().unwrap().free, total);
            let s = ctx.create_stream().unwrap();
            let m = ctx.allocate(&s, 1 << 20).unwrap();
            let (sig, rx) = signal();
            ctx.free_async(&s, m, sig).map_err(|(_, _, e)| e).unwrap();
            ctx.synchronize(&s).unwrap();
            assert_eq!(rx.recv_timeout(LONG).unwrap().0, RetireOutcome::Retired);
            let kept = ctx.memory_info().unwrap().free;
            assert_eq!(
                kept,
                total - (1 << 20),
                "the pool keeps the freed MiB until trimmed"
            );
            ctx.destroy_stream(s).unwrap();
            ctx.teardown(false).unwrap();
            let after = HipContext::new(HipConfig::default()).unwrap();
            assert_eq!(
                after.memory_info().unwrap().free,
                total,
                "teardown trimmed the pool"
            );
            after.teardown(false).unwrap();
        }
        "no_runtime" | "runtime_without_hip" => {
            assert!(!memgov::hip::driver_present());
            let e = HipContext::new(HipConfig::default()).expect_err("no HIP runtime");
            assert_eq!(e.kind, BackendErrorKind::Unavailable, "{e}");
            let expected = if case == "no_runtime" {
                "no HIP runtime: /nonexistent/libamdhip64.so.5 (from MEMGOV_HIP_RUNTIME) could not be opened"
            } else {
                "no HIP runtime usable by memgov: libm.so.6 lacks hipGetErrorName"
            };
            assert!(e.message.starts_with(expected), "{e}");
            // Codes still have names, and nothing calls into a runtime that
            // is not there.
            let oom = hip::hip_error("allocate", "hipMallocAsync", hip::hipErrorOutOfMemory);
            assert!(oom.message.contains("hipErrorOutOfMemory (2)"), "{oom}");
            assert!(hip::symbol(c"hipMalloc").is_none());
            let report = memgov_conformance::run_suite(|| HipContext::new(HipConfig::default()));
            assert!(report.all_passed());
            assert!(report
                .cases
                .iter()
                .all(|c| c.outcome.to_string().starts_with("skipped: no HIP runtime")));
        }
        "no_device" => {
            let e = HipContext::new(HipConfig::default()).expect_err("no device");
            assert_eq!(e.kind, BackendErrorKind::Unavailable, "{e}");
            assert!(e.message.starts_with("no HIP device"), "{e}");
            assert!(e.message.contains("hipErrorNoDevice"), "{e}");
            let report = memgov_conformance::run_suite(|| HipContext::new(HipConfig::default()));
            assert!(report.all_passed());
            assert!(report
                .cases
                .iter()
                .all(|c| c.outcome.to_string().starts_with("skipped: no HIP device")));
        }
        // SAFETY: handles created in this arm; freeing on a stream unordered with the writer is the
        // planted violation: the stand-in aborts on that violation before anything unsound happens
        "unordered_cross_stream_free" => unsafe {
            let (a, b) = (raw_stream(), raw_stream());
            let p = raw_alloc(64, a);
            raw_write(a, p, &[1; 64]);
            let _ = hip::hipFreeAsync(p, b);
        },
        // SAFETY: handles created in this arm, each used while live; the event orders the two
        // streams, so nothing is planted
        "ordered_cross_stream_free" => unsafe {
            let (a, b) = (raw_stream(), raw_stream());
            let p = raw_alloc(64, a);
            raw_write(a, p, &[1; 64]);
            let mut e: hip::hipEvent_t = std::ptr::null_mut();
            ok(hip::hipEventCreateWithFlags(&mut e, 2));
            ok(hip::hipEventRecord(e, a));
            ok(hip::hipStreamWaitEvent(b, e, 0));
            ok(hip::hipEventDestroy(e));
            raw_write(b, p, &[2; 64]);
            ok(hip::hipFreeAsync(p, b));
            ok(hip::hipStreamSynchronize(b));
            ok(hip::hipStreamSynchronize(a));
            ok(hip::hipStreamDestroy(a));
            ok(hip::hipStreamDestroy(b));
            let mut pool: hip::hipMemPool_t = std::ptr::null_mut();
            ok(hip::hipDeviceGetDefaultMemPool(&mut pool, 0));
            ok(hip::hipMemPoolTrimTo(pool, 0));
        },

        // SAFETY: an event created and destroyed here; waiting on it afterwards is the planted
        // violation: the stand-in aborts on that violation before anything unsound happens
        "wait_on_destroyed_event" => unsafe {
            let s = raw_stream();
            let mut e: hip::hipEvent_t = std::ptr::null_mut();
            ok(hip::hipEventCreateWithFlags(&mut e, 2));
            ok(hip::hipEventRecord(e, s));
            ok(hip::hipEventDestroy(e));
            let _ = hip::hipStreamWaitEvent(s, e, 0);
        },
        // SAFETY: handles created in this arm on two devices; copying to device 1's memory on
        // device 0's stream is the planted violation: the stand-in aborts on that violation before
        // anything unsound happens
        "other_devices_memory" => unsafe {
            ok(hip::hipSetDevice(1));
            let s1 = raw_stream();
            let p = raw_alloc(64, s1);
            ok(hip::hipSetDevice(0));
            let s0 = raw_stream();
            let src = [0u8; 16];
            let _ = hip::hipMemcpyHtoDAsync(p, src.as_ptr() as *mut c_void, 16, s0);
        },
        "pool_left_at_exit" => {
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            // Neither torn down nor dropped: the pool it created stays.
            std::mem::forget(ctx);
            return;
        }
        // SAFETY: the default pool of device 0 and a local threshold that outlives the call;
        // changing it is the planted violation the exit check aborts on
        "default_pool_threshold_changed" => unsafe {
            let mut pool: hip::hipMemPool_t = std::ptr::null_mut();
            ok(hip::hipDeviceGetDefaultMemPool(&mut pool, 0));
            let mut v = u64::MAX;
            ok(hip::hipMemPoolSetAttribute(
                pool,
                hip::hipMemPoolAttrReleaseThreshold,
                &mut v as *mut u64 as *mut c_void,
            ));
            // The exit check aborts the process after this returns.
            return;
        },

        "call_in_flight_at_quiesce" => {
            let s = raw_stream() as usize;
            // The latency keeps the copy pending while the other thread
            // waits for it inside hipStreamSynchronize.
            let p = raw_alloc(64, s as hip::hipStream_t);
            raw_write(s as hip::hipStream_t, p, &[3; 64]);
            let waiter = std::thread::spawn(move || {
                // SAFETY: a live stream.
                let _ = unsafe { hip::hipStreamSynchronize(s as hip::hipStream_t) };
            });
            std::thread::sleep(Duration::from_millis(100));
            quiesce();
            waiter.join().unwrap();
        }
        "call_after_quiesce" => {
            quiesce();
            std::thread::spawn(|| {
                let mut n = 0;
                // SAFETY: valid out-pointer.
                let _ = unsafe { hip::hipGetDeviceCount(&mut n) };
            })
            .join()
            .unwrap();
        }
        "lost_fallback_teardown" => {
            let ctx = HipContext::new(HipConfig {
                allocator: AllocatorChoice::Plain,
                ..HipConfig::default()
            })
            .unwrap();
            let probe = ctx.probe();
            let s = ctx.create_stream().unwrap();
            // One free the free thread settles, so that its thread runs, then one
            // it is waiting for (or about to) when the context is lost.
            let m = ctx.allocate(&s, 4096).unwrap();
            let (sig, rx) = signal();
            ctx.free_async(&s, m, sig).map_err(|(_, _, e)| e).unwrap();
            assert_eq!(rx.recv_timeout(LONG).unwrap().0, RetireOutcome::Retired);
            // Each free's event is recorded behind a copy (pending for the
            // latency), so the free thread holds the first inside
            // hipEventSynchronize while the second waits in its queue.
            let m = ctx.allocate(&s, 4096).unwrap();
            raw_write(s.hip_stream(), m.device_ptr(), &[6; 4096]);
            let (sig, rx) = signal();
            ctx.free_async(&s, m, sig).map_err(|(_, _, e)| e).unwrap();
            let m2 = ctx.allocate(&s, 8192).unwrap();
            raw_write(s.hip_stream(), m2.device_ptr(), &[7; 8192]);
            let (sig2, rx2) = signal();
            ctx.free_async(&s, m2, sig2).map_err(|(_, _, e)| e).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            ctx.device_lost();
            ctx.teardown(true).unwrap();
            // Every backend thread is done with HIP: the stand-in aborts if
            // another thread is inside a call now or calls later.
            quiesce();
            // Settled before teardown returned: nothing pending, nothing
            // charged, and each signal fired or dropped exactly once.
            for rx in [rx, rx2] {
                rx.try_recv().expect("settled before teardown returned");
            }
            assert_eq!(probe.used_bytes(), 0, "no bytes charged after teardown");
            assert_eq!(probe.live_allocations(), 0);
            assert_eq!(probe.frees_retired() + probe.frees_abandoned(), 3);
            std::thread::sleep(Duration::from_millis(250));
            assert_eq!(
                probe.frees_retired() + probe.frees_abandoned(),
                3,
                "no late settlement"
            );
            // The exit check (on) finds the memory freed: the device answers,
            // so a lost teardown still releases it.
        }
        // SAFETY: handles created in this arm, each used while live; the pool attribute is read
        // into a local
        "default_pool_untouched" => unsafe {
            // Another user of the device caches 1 MiB in the default pool.
            let s = raw_stream();
            let p = raw_alloc(1 << 20, s);
            ok(hip::hipFreeAsync(p, s));
            ok(hip::hipStreamSynchronize(s));
            let mut pool: hip::hipMemPool_t = std::ptr::null_mut();
            ok(hip::hipDeviceGetDefaultMemPool(&mut pool, 0));
            let threshold = |pool| {
                let mut v = 7u64;
                ok(hip::hipMemPoolGetAttribute(
                    pool,
                    hip::hipMemPoolAttrReleaseThreshold,
                    &mut v as *mut u64 as *mut c_void,
                ));
                v
            };
            let before = threshold(pool);
            let (mut free, mut total) = (0usize, 0usize);
            ok(hip::hipMemGetInfo(&mut free, &mut total));
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            let gs = ctx.create_stream().unwrap();
            let m = ctx.allocate(&gs, 1 << 16).unwrap();
            let (sig, rx) = signal();
            ctx.free_async(&gs, m, sig).map_err(|(_, _, e)| e).unwrap();
            ctx.synchronize(&gs).unwrap();
            assert_eq!(rx.recv_timeout(LONG).unwrap().0, RetireOutcome::Retired);
            ctx.destroy_stream(gs).unwrap();
            ctx.teardown(false).unwrap();
            assert_eq!(threshold(pool), before, "the default pool's attribute");
            let (mut after, mut total2) = (0usize, 0usize);
            ok(hip::hipMemGetInfo(&mut after, &mut total2));
            assert_eq!(
                after, free,
                "memgov's teardown left the other user's cached MiB in the default pool"
            );
            ok(hip::hipMemPoolTrimTo(pool, 0));
            ok(hip::hipStreamDestroy(s));
        },
        "dropped_callback" => {
            assert_eq!(memgov::hip::contexts_alive(), 0);
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            let s = ctx.create_stream().unwrap();
            let m = ctx.allocate(&s, 4096).unwrap();
            let (sig, rx) = signal();
            ctx.free_async(&s, m, sig).map_err(|(_, _, e)| e).unwrap();
            assert!(ctx.memory_info().is_err(), "call 24 is sticky");
            ctx.teardown(true).unwrap();
            assert_eq!(rx.recv_timeout(LONG).unwrap().0, RetireOutcome::Abandoned);
            // The runtime dropped (or will drop) the queued callback without
            // running it: nothing of the context may stay behind for it.
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(memgov::hip::contexts_alive(), 0);
        }
        "dropped_without_teardown" => {
            drop(HipContext::new(HipConfig::default()).unwrap());
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            let probe = ctx.probe();
            let s = ctx.create_stream().unwrap();
            let _m = ctx.allocate(&s, 4096).unwrap();
            drop(ctx);
            assert_eq!(probe.teardowns(), 1);
            assert_eq!(probe.live_allocations(), 0);
            assert_eq!(memgov::hip::contexts_alive(), 0);
        }
        "nearly_full" => {
            let ctx = HipContext::new(HipConfig::default()).expect("opens with 100 B free");
            assert!(ctx.stream_ordered().0, "the pool allocator is in use");
            let s = ctx.create_stream().unwrap();
            let m = ctx.allocate(&s, 64).unwrap();
            let e = ctx.allocate(&s, 64).expect_err("over 100 B");
            assert_eq!(e.kind, BackendErrorKind::OutOfMemory, "{e}");
            let (sig, rx) = signal();
            ctx.free_async(&s, m, sig).map_err(|(_, _, e)| e).unwrap();
            assert_eq!(rx.recv_timeout(LONG).unwrap().0, RetireOutcome::Retired);
            ctx.destroy_stream(s).unwrap();
            ctx.teardown(false).unwrap();
        }
        "sticky_mid_teardown" => {
            let ctx = HipContext::new(HipConfig::default()).unwrap();
            let probe = ctx.probe();
            let a = ctx.create_stream().unwrap();
            let _b = ctx.create_stream().unwrap();
            let m = ctx.allocate(&a, 4096).unwrap();
            let (sig, rx) = signal();
            ctx.free_async(&a, m, sig).map_err(|(_, _, e)| e).unwrap();
            assert_eq!(hip_calls(), 25);
            let e = ctx.teardown(false).expect_err("the synchronize is sticky");
            assert_eq!(e.kind, BackendErrorKind::DeviceLost, "{e}");
            assert_eq!(rx.try_recv().unwrap().0, RetireOutcome::Abandoned);
            assert_eq!(probe.frees_abandoned(), 1);
            assert_eq!(probe.live_allocations(), 0);
            assert_eq!(
                hip_calls(),
                27,
                "teardown stopped at the sticky synchronize (no second synchronize, no \
                 hipStreamDestroy, no trim or pool destroy)"
            );
            assert!(probe.lost());
            assert_eq!(probe.live_streams(), 0);
        }
        other => panic!("unknown child case {other}"),
    }
    println!("{CHILD_END}");
}
