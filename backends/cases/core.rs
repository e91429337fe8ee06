//! Cases of the CUDA and HIP main suites (`tests/cuda.rs`, `tests/hip.rs`)
//! written once against the `vendor` module of the test binary that
//! includes this file (see `README.md` beside it). The bodies of the cases
//! every GPU backend runs through one trait (`StandInBackend`) are in
//! `backends/stand-ins/support/`; their tests are here.

use crate::cases::{self as backend, StandInBackend};
use crate::recorded::signal;
use crate::vendor::{self, Context, LATENCY};
use memgov::{
    Alloc, BackendErrorKind, ContextConfig, ContextState, DeviceContext, Execution, Governor,
    GovernorError, RetireOutcome, Role, Tier,
};
use std::time::{Duration, Instant};

/// A way to open a vendor's context.
pub type Factory = fn() -> Result<Context, memgov::BackendError>;

/// Declares, in a vendor's `vendor` module, what these cases assert of the
/// vendor, from a table: `backend`, the name a context's refusals and
/// reports carry (`BACKEND`); `VENDOR`, the vendor's upper-case name in
/// the stand-in's knobs, which gives the device memory limit in bytes
/// `OOM_AFTER_BYTES` and the exit check `EXIT_CHECK` (anything left at
/// exit aborts); then, by the names these cases use, `FAIL_CALLBACK_AT`,
/// the knob with which the stand-in refuses the Nth completion callback,
/// `OUT_OF_MEMORY`, how an out-of-memory refusal names the driver's code,
/// and how the stand-in names the planted violations: a double free, a
/// free of a pointer it never allocated, a copy out of bounds, a free of
/// page-locked host memory under a copy, an event recorded after its
/// destroy (`DOUBLE_FREE`, `UNKNOWN_FREE`, `OUT_OF_BOUNDS`,
/// `HOST_FREE_UNDER_COPY`, `EVENT_AFTER_DESTROY`).
macro_rules! core_vendor {
    (
        backend: $backend:literal,
        VENDOR: $upper:literal,
        $($name:ident: $text:literal),* $(,)?
    ) => {
        pub const BACKEND: &str = $backend;
        /// The vendor's upper-case name, as its messages spell it.
        pub const VENDOR: &str = $upper;
        pub const OOM_AFTER_BYTES: &str = concat!("MEMGOV_STANDIN_", $upper, "_OOM_AFTER_BYTES");
        pub const EXIT_CHECK: &str = concat!("MEMGOV_STANDIN_", $upper, "_EXIT_CHECK");
        $(pub const $name: &str = $text;)*
    };
}
pub(crate) use core_vendor;

/// How long a child waits for a signal that must fire.
const SETTLE: Duration = Duration::from_secs(10);

/// Without a usable driver a context is `Unavailable` with the vendor's
/// reason (printed as `skipped: <reason>`), never a panic; with one, the
/// context describes the backend, its memory and how it runs (the
/// stand-in or real hardware). Then the vendor's own cases of a missing or
/// unusable driver.
#[test]
fn a_missing_driver_is_unavailable_not_a_panic() {
    match vendor::SUITE_CONFIGS[0].1() {
        Ok(ctx) => {
            let d = ctx.describe();
            assert_eq!(d.backend, vendor::BACKEND);
            assert!(d.total_bytes > 0);
            if vendor::is_stand_in(&ctx) {
                assert_eq!(d.execution, Execution::StandIn);
                assert!(d.name.starts_with("memgov stand-in"), "{}", d.name);
                assert!(d.stream_ordered_reuse, "the stand-in's default");
            } else {
                assert_eq!(d.execution, Execution::RealHardware);
                assert!(d.stream_ordered_reuse || !vendor::ALWAYS_STREAM_ORDERED);
            }
            ctx.teardown(false).expect("teardown");
        }
        Err(e) => {
            assert_eq!(e.kind, BackendErrorKind::Unavailable, "{e}");
            assert!(
                vendor::UNAVAILABLE
                    .iter()
                    .any(|why| e.message.starts_with(why)),
                "{e}"
            );
            println!("skipped: {}", e.message);
        }
    }
    vendor::missing_driver_cases();
}

#[test]
fn free_retires_on_a_driver_thread() {
    backend::free_retires_on_a_driver_thread::<Context>();
}

/// The identity comes from the driver's UUID and PCI address, the same for
/// one device in every process; on the stand-in, device 0 has the UUID and
/// PCI address the vendor's stand-in documents (CUDA's "memgov-standin",
/// 0, 0 at 0000:10:00.0; HIP's "memgov-standin", 'h', 0 at 0000:20:00.0),
/// and that key.
#[test]
fn identity_is_the_drivers_uuid_and_pci_address() {
    backend::identity_is_the_drivers_uuid_and_pci_address::<Context>();
}

#[test]
fn foreign_or_double_free_is_refused_and_counted() {
    backend::foreign_or_double_free_is_refused_and_counted::<Context>();
}

/// The governor's block cache on this backend: blocks reused on their own
/// stream only (a block released on the other stream is freed there,
/// ordered after its own), each reused block written and read back. The
/// stand-in's stream-ordering checks must see nothing to report.
#[test]
fn block_cache_reuses_blocks_only_on_their_stream() {
    let Some(ctx) = Context::open() else { return };
    let probe = StandInBackend::probe(&ctx);
    crate::cache::reuses_blocks_only_on_their_stream(ctx, probe, vendor::BACKEND);
}

/// The conformance suite on each of the vendor's configurations, with the
/// governor's block cache off and on: every case passes on a device (none
/// skips), every case skips without one. Prints `<label>: <report>`. Each
/// suite's `#[test]` of the same name calls it (`scripts/gpu-check.sh` runs
/// CUDA's by its exact name).
pub(crate) fn whole_suite_report() {
    use memgov_conformance::{run_suite_with, SuiteOptions};
    for (label, factory) in vendor::SUITE_CONFIGS {
        let cached = SuiteOptions::new().cache(memgov::CacheConfig::new(64 << 20));
        for options in [SuiteOptions::new(), cached] {
            let report = run_suite_with(&options, factory);
            println!("{label}: {report}");
            assert!(report.all_passed(), "{report}");
            let (passed, failed, skipped) = report.counts();
            if report.execution.is_none() {
                assert_eq!(skipped, report.cases.len(), "{report}");
                println!("{}", report.cases[0].outcome);
            } else {
                assert_eq!(
                    (passed, failed, skipped),
                    (report.cases.len(), 0, 0),
                    "no case may fail or skip on a device: {report}"
                );
            }
        }
    }
}

/// With the stand-in's device limited to 1 MiB, an allocation past it is
/// `OutOfMemory` with the driver's code and name, not device loss, and the
/// context goes on: the memory freed makes room again, and work queued
/// before a stream's destroy still runs, its free's signal included.
#[test]
fn out_of_memory_is_classified() {
    vendor::passes("oom", &[(vendor::OOM_AFTER_BYTES, "1048576")]);
}

/// The driver refuses the completion callback queued behind a free (CUDA's
/// host function, HIP's stream callback): the free is already queued and no
/// longer the caller's, so `free_async` accepts it and settles its signal
/// itself by waiting on the stream, before it returns, on the caller's
/// thread. The next free goes through the callback again.
#[test]
fn a_refused_callback_still_settles_the_free() {
    vendor::passes("refused_callback", &[(vendor::FAIL_CALLBACK_AT, "1")]);
}

#[test]
fn pinned_host_release_waits_for_copies_queued_outside_the_governor() {
    // A runtime's own copy into a pinned staging buffer, queued on the
    // buffer's stream (slow), then the buffer dropped: the backend must
    // free it only once the copy has run, or the stand-in aborts.
    vendor::passes("governed_pinned_behind_raw_copy", &[(LATENCY, "200000")]);
}

/// The governor declares a healthy device lost with memory live (64 MiB
/// kept, a free queued behind a copy on another stream): the lost teardown
/// settles the free's signal before it returns (abandoned where the free
/// was stream-ordered: the pool's is queued behind the copy; the fallback's
/// may already be in its free thread's hands, which completes it), frees
/// every allocation and destroys every stream, and the stand-in finds
/// nothing of memgov's left (its exit check on), on each of the vendor's
/// configurations.
#[test]
fn lost_teardown_of_a_healthy_device_releases_everything() {
    for (label, _) in vendor::SUITE_CONFIGS {
        vendor::passes(
            &format!("healthy_lost_teardown:{label}"),
            &[(LATENCY, "20000"), (vendor::EXIT_CHECK, "1")],
        );
    }
}

/// A governed buffer's and stream's raw handles are the driver's: the
/// device pointer and stream (neither null) serve a raw copy out of what
/// the governor wrote, and on the stand-in, whose device memory is host
/// memory, the pointer is the allocation itself.
#[test]
fn raw_accessors_name_the_driver_objects() {
    const TEXT: &[u8; 23] = b"through the raw handles";
    let Some(ctx) = Context::open() else { return };
    let stand_in = ctx.describe().execution == Execution::StandIn;
    let current = vendor::current(&ctx);
    let gov = Governor::new();
    let handle = gov.register(ctx, ContextConfig::new().label("raw"));
    let stream = handle.create_stream("main").expect("stream");
    let buf = handle
        .allocate(&stream, Alloc::new(256, Role::Workspace))
        .expect("allocate");
    buf.write(0, TEXT).expect("write");
    let mem = buf.raw().expect("live buffer");
    let raw_stream = stream.raw().expect("live stream");
    let ptr = vendor::device_address(mem);
    assert_ne!(ptr, 0);
    assert!(!vendor::stream_handle(raw_stream).is_null());
    assert_eq!(mem.len(), 256);
    let mut back = [0u8; 23];
    // SAFETY: the memory and stream come from live governed handles, the
    // copy stays within the 256-byte allocation, and it is waited for.
    unsafe { vendor::copy_out_waited(&current, raw_stream, mem, &mut back) };
    assert_eq!(&back, TEXT);
    if stand_in {
        // SAFETY: the stand-in's device pointer is the host address of a
        // live 256-byte allocation; the write above was synchronized.
        let seen = unsafe { std::slice::from_raw_parts(ptr as usize as *const u8, TEXT.len()) };
        assert_eq!(seen, TEXT);
    }
    drop((buf, stream));
    let report = handle.retire().wait_timeout(SETTLE).expect("retire");
    assert!(report.backend_result.is_ok(), "{:?}", report.backend_result);
    assert_eq!(report.retired_releases, 1);
}

/// A governed soak: on each of 3 contexts in turn, 2 threads allocate
/// (various sizes, under a budget), write, read back and release on their 2
/// streams, a third of the releases on the other stream; each retire
/// retires every release, abandons none, and leaves the backend clean. On
/// the stand-in it runs in a child with the exit check on (so the driver's
/// books must end at zero too), at the latency this process runs with (20
/// us when none); on a device, here. Prints `soak: <backend>: ...`.
#[test]
fn short_soak() {
    let Some(ctx) = Context::open() else { return };
    if ctx.describe().execution != Execution::StandIn {
        soak(Some(ctx));
        return;
    }
    ctx.teardown(false).expect("teardown");
    let mut env = vec![(vendor::EXIT_CHECK, "1")];
    if std::env::var_os(LATENCY).is_none() {
        env.push((LATENCY, "20"));
    }
    let out = vendor::passes("soak", &env).expect("a child on the stand-in");
    let line = out.lines().find_map(|l| l.find("soak:").map(|i| &l[i..]));
    println!("{}", line.expect("the child prints its soak line"));
}

/// `order_after` queues a device-side wait instead of blocking: a slow copy
/// on the other stream (500 ms per queued operation) is still running when
/// it returns, and a free on the ordered stream passes the stand-in's
/// cross-stream check and runs after the copy. Ordering a stream after
/// itself is a no-op; after another context's stream, refused. On each of
/// the vendor's configurations.
#[test]
fn order_after_orders_a_cross_stream_free_without_waiting() {
    for (label, _) in vendor::SUITE_CONFIGS {
        vendor::passes(&format!("order_after:{label}"), &[(LATENCY, "500000")]);
    }
}

/// A sticky error (every driver call from the 40th on fails as after an
/// illegal address) surfaces through the governor as `DeviceLost` naming
/// the driver's code: the context is marked lost, its retire abandons what
/// is pending and tears down clean, with nothing charged or pending left;
/// then the vendor's own checks of the lost device (CUDA: the kept
/// allocations went with the context; HIP: a free queued before the error
/// is abandoned, the first reason carried, counted at exact call numbers).
#[test]
fn a_sticky_error_is_device_loss_and_abandons_pending_frees() {
    vendor::passes("sticky", &[(vendor::STICKY_ERROR_AT_OP, "40")]);
    vendor::sticky_error_cases();
}

/// A runtime has another device current on its thread (CUDA: device 1's
/// primary context; HIP: device 1); memgov works on device 0 and hands the
/// thread back as it found it after every call, teardown of a stream and an
/// allocation left to it included, on each of the vendor's configurations;
/// threads that had nothing current are left with nothing. And the other
/// way round: a context of device 1 on a thread where device 0's is
/// current.
#[test]
fn the_callers_current_context_is_restored() {
    vendor::passes(
        "current_restored",
        &[(vendor::DEVICES, "2"), (LATENCY, "1000")],
    );
}

/// An ordinal past the driver's device count is `InvalidArgument` naming
/// the ordinal and the count, and opens nothing.
#[test]
fn an_ordinal_past_the_device_count_is_invalid_naming_the_count() {
    match vendor::SUITE_CONFIGS[0].1() {
        Ok(ctx) => ctx.teardown(false).expect("teardown"),
        Err(e) => return println!("skipped: {}", e.message),
    }
    let e = vendor::open_on(1000).expect_err("ordinal 1000");
    assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
    let head = format!(
        "{} device ordinal 1000 is out of range: the ",
        vendor::VENDOR
    );
    assert!(e.message.starts_with(&head), "{e}");
    assert!(e.message.contains(" devices (0.."), "{e}");
}

// ---- the stand-in's planted violations on raw driver calls -------------------

/// A call on a destroyed stream: a synchronize, and a free of memory
/// allocated on it before its destroy.
#[test]
fn negative_call_on_destroyed_stream_aborts() {
    for (case, entry) in [
        ("destroyed_stream_sync", vendor::raw::SYNC),
        ("destroyed_stream_free", vendor::raw::FREE_ASYNC),
    ] {
        vendor::aborts(case, &[], &format!("{entry} on destroyed stream"));
    }
}

/// A destroyed memory pool trimmed, and allocated from.
#[test]
fn negative_memory_pool_after_destroy_aborts() {
    for (case, entry) in [
        ("pool_trim_after_destroy", vendor::raw::POOL_TRIM),
        ("pool_alloc_after_destroy", vendor::raw::POOL_ALLOC),
    ] {
        vendor::aborts(case, &[], &format!("{entry} on destroyed memory pool"));
    }
}

/// A second free of the same stream-ordered allocation.
#[test]
fn negative_double_free_aborts() {
    vendor::aborts("double_free", &[], vendor::DOUBLE_FREE);
}

/// A free of an address the driver never allocated.
#[test]
fn negative_free_of_unknown_pointer_aborts() {
    vendor::aborts("free_unknown", &[], vendor::UNKNOWN_FREE);
}

/// A copy that runs past the end of its allocation: 64 bytes 50 bytes into
/// a 100-byte block.
#[test]
fn negative_copy_out_of_bounds_aborts() {
    vendor::aborts("copy_out_of_bounds", &[], vendor::OUT_OF_BOUNDS);
}

/// A free queued through the backend on another stream than its
/// allocation's, without `order_after` (100 ms per queued operation, so
/// the allocation is still pending): the stand-in aborts, naming the
/// stream and the missing ordering. The control: the same free after a
/// copy on the allocation's stream and `order_after` retires.
#[test]
fn negative_cross_stream_free_without_ordering_aborts() {
    let env = [(LATENCY, "100000")];
    for what in [
        "freed on stream #",
        "before its stream-ordered allocation completed - missing stream ordering",
    ] {
        vendor::aborts("cross_stream_free_unordered", &env, what);
    }
    vendor::passes("cross_stream_free_ordered", &env);
}

/// A copy on another stream into memory whose allocation (and first write)
/// is still queued on its own stream, with nothing ordering the two.
#[test]
fn negative_cross_stream_copy_without_ordering_aborts() {
    vendor::aborts(
        "cross_stream_copy_unordered",
        &[(LATENCY, "100000")],
        "missing stream ordering",
    );
}

/// An event recorded after it was destroyed.
#[test]
fn negative_event_after_destroy_aborts() {
    vendor::aborts("event_after_destroy", &[], vendor::EVENT_AFTER_DESTROY);
}

/// The control of the next test: the same copy into page-locked memory,
/// synchronized before the memory is freed.
#[test]
fn pinned_host_free_after_its_copy_completed_passes() {
    vendor::passes("host_free_synced", &[(LATENCY, "200000")]);
}

/// Freeing page-locked host memory is synchronous: called while a copy that
/// uses it is still queued, it frees the memory under the copy.
#[test]
fn negative_pinned_host_free_under_a_queued_copy_aborts() {
    vendor::aborts(
        "host_free_during_copy",
        &[(LATENCY, "200000")],
        vendor::HOST_FREE_UNDER_COPY,
    );
}

/// In the child: runs the shared case `case`; false when it is not one of
/// these (the vendor's own cases then).
pub(crate) fn run(case: &str) -> bool {
    match case {
        "governed_pinned_behind_raw_copy" => governed_pinned_behind_raw_copy(),
        "oom" => oom(),
        "refused_callback" => refused_callback(),
        "soak" => soak(None),
        "sticky" => sticky(),
        "cross_stream_free_unordered" => cross_stream_free(false),
        "cross_stream_free_ordered" => cross_stream_free(true),
        "current_restored" => current_restored(),
        "double_free"
        | "free_unknown"
        | "copy_out_of_bounds"
        | "cross_stream_copy_unordered"
        | "event_after_destroy"
        | "destroyed_stream_sync"
        | "destroyed_stream_free"
        | "pool_trim_after_destroy"
        | "pool_alloc_after_destroy" => planted(case),
        "host_free_synced" => host_free(true),
        "host_free_during_copy" => host_free(false),
        _ => match case.split_once(':') {
            Some(("healthy_lost_teardown", label)) => healthy_lost_teardown(factory(label)),
            Some(("order_after", label)) => order_after(factory(label)),
            _ => return false,
        },
    }
    true
}

fn governed_pinned_behind_raw_copy() {
    let gov = Governor::new();
    let backend = vendor::context();
    let current = vendor::current(&backend);
    let ctx = gov.register(backend, ContextConfig::new());
    let stream = ctx.create_stream("copy").expect("stream");
    let buf = ctx
        .allocate(
            &stream,
            Alloc::new(1 << 16, Role::Other).tier(Tier::PinnedHost),
        )
        .expect("pinned allocation");
    let mem = buf.raw().expect("live buffer");
    assert_eq!(mem.tier(), Tier::PinnedHost);
    let src = vec![9u8; 1 << 16];
    // SAFETY: the memory and stream come from live governed handles (`buf`,
    // `stream`), and `src` outlives the copy: the retire below waits for it.
    unsafe { vendor::copy_in_unwaited(&current, stream.raw().expect("live stream"), mem, &src) };
    // Queued behind the slow copy; the backend frees after it.
    drop(buf);
    drop(stream);
    ctx.retire()
        .wait(Instant::now() + Duration::from_secs(30))
        .expect("retire");
    drop(src);
}

fn oom() {
    let ctx = vendor::context();
    let probe = ctx.probe();
    let s = ctx.create_stream().expect("stream");
    let a = ctx.allocate(&s, 768 << 10).expect("768 KiB fits in 1 MiB");
    let e = ctx
        .allocate(&s, 512 << 10)
        .expect_err("over the 1 MiB limit");
    assert_eq!(e.kind, BackendErrorKind::OutOfMemory, "{e}");
    assert_eq!(e.code, Some(2), "{e}");
    assert!(e.message.contains(vendor::OUT_OF_MEMORY), "{e}");
    assert!(!e.is_device_lost(), "{e}");
    assert!(!probe.lost());
    let (sig, rx) = signal();
    ctx.free_async(&s, a, sig)
        .map_err(|(_, _, e)| e)
        .expect("free");
    ctx.synchronize(&s).expect("synchronize");
    assert_eq!(
        rx.recv_timeout(SETTLE).expect("fired").0,
        RetireOutcome::Retired
    );
    let b = ctx.allocate(&s, 512 << 10).expect("fits after the free");
    let (sig, rx) = signal();
    ctx.free_async(&s, b, sig)
        .map_err(|(_, _, e)| e)
        .expect("free");
    ctx.destroy_stream(s).expect("destroy_stream");
    // Work queued before the destroy still runs, its callback included.
    assert_eq!(
        rx.recv_timeout(SETTLE).expect("fired").0,
        RetireOutcome::Retired
    );
    ctx.teardown(false).expect("teardown");
    probe.check_clean_teardown().expect("clean teardown");
}

fn refused_callback() {
    let ctx = vendor::context();
    let probe = ctx.probe();
    let s = ctx.create_stream().expect("stream");
    let m = ctx.allocate(&s, 4096).expect("allocate");
    let (sig, rx) = signal();
    ctx.free_async(&s, m, sig)
        .map_err(|(_, _, e)| e)
        .expect("free_async accepts");
    let (outcome, thread) = rx.try_recv().expect("settled before free_async returned");
    assert_eq!(outcome, RetireOutcome::Retired);
    assert_eq!(
        thread,
        std::thread::current().id(),
        "settled by the caller's wait"
    );
    assert_eq!(ctx.pending_frees(), 0);
    // The next free goes through the callback again.
    let m = ctx.allocate(&s, 4096).expect("allocate");
    let (sig, rx) = signal();
    ctx.free_async(&s, m, sig)
        .map_err(|(_, _, e)| e)
        .expect("free_async");
    ctx.synchronize(&s).expect("synchronize");
    let (outcome, thread) = rx.recv_timeout(SETTLE).expect("fired");
    assert_eq!(outcome, RetireOutcome::Retired);
    assert_ne!(
        thread,
        std::thread::current().id(),
        "fired by the driver's callback"
    );
    ctx.destroy_stream(s).expect("destroy_stream");
    ctx.teardown(false).expect("teardown");
    probe.check_clean_teardown().expect("clean teardown");
    assert_eq!(probe.frees_retired(), 2);
}

/// What a lost teardown's copy writes.
static LOST_TEARDOWN_BYTES: [u8; 4096] = [4; 4096];

/// The vendor's configuration `label`.
fn factory(label: &str) -> Factory {
    let (_, factory) = vendor::SUITE_CONFIGS
        .iter()
        .find(|(l, _)| *l == label)
        .expect("a configuration of this vendor's");
    *factory
}

fn healthy_lost_teardown(factory: Factory) {
    for round in 0..vendor::LOST_TEARDOWN_ROUNDS {
        let ctx = factory().expect("context");
        let probe = ctx.probe();
        let ordered = ctx.describe().stream_ordered_reuse;
        let (a, b) = (
            ctx.create_stream().expect("stream"),
            ctx.create_stream().expect("stream"),
        );
        let _kept = ctx.allocate(&a, 64 << 20).expect("allocate");
        let m = ctx.allocate(&b, 4096).expect("allocate");
        let current = vendor::current(&ctx);
        // SAFETY: `m` and `b` are live handles of `ctx`, and the source is
        // static, so it outlives the copy.
        unsafe { vendor::copy_in_unwaited(&current, &b, &m, &LOST_TEARDOWN_BYTES) };
        let (sig, rx) = signal();
        ctx.free_async(&b, m, sig)
            .map_err(|(_, _, e)| e)
            .expect("free, queued behind the copy");
        // The governor declares the device lost; the driver still answers.
        ctx.device_lost();
        ctx.teardown(true).expect("lost teardown");
        let (outcome, _) = rx
            .try_recv()
            .unwrap_or_else(|e| panic!("round {round}: settled before teardown returned: {e}"));
        if ordered {
            assert_eq!(outcome, RetireOutcome::Abandoned, "round {round}");
        }
        assert!(probe.lost());
        assert_eq!(probe.live_allocations(), 0, "round {round}");
        assert_eq!(probe.live_streams(), 0, "round {round}");
        vendor::nothing_left_after_lost_teardown(round);
    }
}

/// The soak of `short_soak`, starting on `first` (or a fresh context).
fn soak(first: Option<Context>) {
    let start = Instant::now();
    let gov = Governor::new();
    let mut first = first;
    let mut cycles = 0u64;
    for epoch in 0..3u8 {
        let backend = first.take().unwrap_or_else(vendor::context);
        let probe = backend.probe();
        let config = ContextConfig::new()
            .label(format!("soak-{epoch}"))
            .budget(8 << 20);
        let handle = gov.register(backend, config);
        let n = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..2u64)
                .map(|t| {
                    let handle = &handle;
                    scope.spawn(move || {
                        let streams = [
                            handle.create_stream(format!("w{t}a")).expect("stream"),
                            handle.create_stream(format!("w{t}b")).expect("stream"),
                        ];
                        let mut n = 0u64;
                        for i in 0..200u64 {
                            let s = &streams[(i % 2) as usize];
                            let bytes = 4096 * (1 + (i * 7 + t) % 64);
                            let buf = handle
                                .allocate(s, Alloc::new(bytes, Role::Activation))
                                .expect("allocate");
                            let v = [(i % 251) as u8; 64];
                            buf.write(bytes - 64, &v).expect("write");
                            let mut back = [0u8; 64];
                            buf.read(bytes - 64, &mut back).expect("read");
                            assert_eq!(back, v);
                            match i % 3 {
                                0 => buf
                                    .release_on(&streams[((i + 1) % 2) as usize])
                                    .map_err(|e| e.error)
                                    .expect("release on the other stream"),
                                1 => buf
                                    .release_on(s)
                                    .map_err(|e| e.error)
                                    .expect("release on its stream"),
                                _ => drop(buf),
                            }
                            n += 1;
                        }
                        for s in &streams {
                            s.synchronize().expect("synchronize");
                        }
                        n
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("worker"))
                .sum::<u64>()
        });
        cycles += n;
        let report = handle
            .retire()
            .wait(Instant::now() + Duration::from_secs(60))
            .expect("retire");
        assert!(report.backend_result.is_ok(), "{:?}", report.backend_result);
        assert_eq!(report.abandoned_releases, 0);
        assert_eq!(report.retired_releases, n);
        probe.check_clean_teardown().expect("clean teardown");
    }
    println!(
        "soak: {}: {cycles} governed allocate/write/read/release cycles, 2 threads x 2 streams, 3 contexts, {:.2} s; every teardown clean",
        vendor::BACKEND,
        start.elapsed().as_secs_f64()
    );
}

/// What `order_after`'s slow copy writes.
static ORDER_AFTER_BYTES: [u8; 4096] = [9; 4096];

fn order_after(factory: Factory) {
    let ctx = factory().expect("context");
    let probe = ctx.probe();
    let current = vendor::current(&ctx);
    let (a, b) = (
        ctx.create_stream().expect("stream a"),
        ctx.create_stream().expect("stream b"),
    );
    let m = ctx.allocate(&a, 4096).expect("allocate");
    // SAFETY: `m` and `a` are live handles of `ctx`, and the source is
    // static, so it outlives the copy.
    unsafe { vendor::copy_in_unwaited(&current, &a, &m, &ORDER_AFTER_BYTES) };
    ctx.order_after(&b, &a).expect("order_after");
    assert_eq!(
        vendor::stream_done(&current, &a),
        Ok(false),
        "order_after waited for the other stream instead of ordering on the device"
    );
    // The stand-in aborts unless the free on b is ordered after a's copy.
    let (sig, rx) = signal();
    ctx.free_async(&b, m, sig)
        .map_err(|(_, _, e)| e)
        .expect("free on b");
    ctx.synchronize(&b).expect("synchronize b");
    assert_eq!(
        rx.recv_timeout(SETTLE).expect("fired").0,
        RetireOutcome::Retired
    );
    assert_eq!(
        vendor::stream_done(&current, &a),
        Ok(true),
        "the free on b ran after a's copy"
    );
    // Ordering a stream after itself is a no-op.
    ctx.order_after(&a, &a).expect("the same stream");
    // Refused: a stream of another context.
    let other = vendor::context();
    let foreign = other.create_stream().expect("stream");
    let e = ctx
        .order_after(&b, &foreign)
        .expect_err("another context's stream");
    assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
    other.destroy_stream(foreign).expect("destroy_stream");
    other.teardown(false).expect("teardown");
    ctx.destroy_stream(a).expect("destroy_stream");
    ctx.destroy_stream(b).expect("destroy_stream");
    ctx.teardown(false).expect("teardown");
    probe.check_clean_teardown().expect("clean teardown");
}

fn sticky() {
    let ctx = vendor::context();
    let probe = ctx.probe();
    let gov = Governor::new();
    let handle = gov.register(ctx, ContextConfig::new().label("sticky"));
    let stream = handle.create_stream("main").expect("stream");
    let mut kept = Vec::new();
    let mut lost = None;
    for i in 0..200 {
        match handle.allocate(&stream, Alloc::new(4096, Role::KvCache)) {
            Ok(b) if i % 2 == 0 => kept.push(b),
            Ok(b) => drop(b),
            Err(e) => {
                lost = Some(e);
                break;
            }
        }
    }
    let e = lost.expect("the sticky error at driver call 40 surfaced");
    assert!(matches!(e, GovernorError::DeviceLost { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(vendor::ILLEGAL_ADDRESS), "{msg}");
    assert_eq!(handle.lifecycle(), ContextState::Lost);
    drop((kept, stream));
    let report = handle
        .retire()
        .wait_timeout(SETTLE)
        .expect("retire a lost context");
    assert!(report.lost);
    assert!(probe.lost());
    probe.check_clean_teardown().expect("clean teardown");
    let snap = handle.snapshot();
    assert_eq!(snap.charged, 0);
    assert_eq!(snap.total().pending_count, 0);
    vendor::after_sticky_retire();
}

fn current_restored() {
    for (label, _) in vendor::SUITE_CONFIGS {
        let caller = vendor::Caller::on_device(1);
        let check = |after: &str| {
            assert!(
                caller.is_current(),
                "{label}: the caller's current context changed by {after}"
            );
        };
        let ctx = vendor::context_on(label, 0);
        check("new");
        ctx.memory_info().expect("memory_info");
        check("memory_info");
        let a = ctx.create_stream().expect("stream a");
        check("create_stream");
        let b = ctx.create_stream().expect("stream b");
        let m = ctx.allocate(&a, 4096).expect("allocate");
        check("allocate");
        ctx.write(&a, &m, 0, &[1; 64]).expect("write");
        check("write");
        let mut back = [0u8; 64];
        ctx.read(&a, &m, 0, &mut back).expect("read");
        check("read");
        assert_eq!(back, [1; 64]);
        ctx.order_after(&b, &a).expect("order_after");
        check("order_after");
        let (sig, rx) = signal();
        ctx.free_async(&b, m, sig)
            .map_err(|(_, _, e)| e)
            .expect("free_async");
        check("free_async");
        ctx.synchronize(&b).expect("synchronize");
        check("synchronize");
        assert_eq!(
            rx.recv_timeout(SETTLE).expect("fired").0,
            RetireOutcome::Retired
        );
        ctx.destroy_stream(a).expect("destroy_stream");
        check("destroy_stream");
        // Threads that had nothing current get nothing left behind.
        let ctx = std::sync::Arc::new(ctx);
        std::thread::scope(|scope| {
            for _ in 0..2 {
                let ctx = ctx.clone();
                scope.spawn(move || {
                    let s = ctx.create_stream().expect("stream");
                    let m = ctx.allocate(&s, 64).expect("allocate");
                    ctx.free_async(&s, m, signal().0)
                        .map_err(|(_, _, e)| e)
                        .expect("free_async");
                    ctx.synchronize(&s).expect("synchronize");
                    ctx.destroy_stream(s).expect("destroy_stream");
                    assert!(
                        vendor::Caller::fresh_thread_untouched(),
                        "{label}: a worker left with something current"
                    );
                });
            }
        });
        let ctx = std::sync::Arc::into_inner(ctx).expect("sole owner");
        // Left for teardown to release: a stream and an allocation.
        let _left = ctx.allocate(&b, 4096).expect("allocate");
        ctx.teardown(false).expect("teardown");
        check("teardown");
        caller.release();
    }
    // A context of device 1 on a thread where device 0's is current.
    let caller = vendor::Caller::on_device(0);
    let ctx = vendor::context_on(vendor::SUITE_CONFIGS[0].0, 1);
    let s = ctx.create_stream().expect("stream");
    let m = ctx.allocate(&s, 64).expect("allocate");
    assert!(caller.is_current(), "device 1's context left current");
    let (sig, rx) = signal();
    ctx.free_async(&s, m, sig)
        .map_err(|(_, _, e)| e)
        .expect("free_async");
    assert_eq!(
        rx.recv_timeout(SETTLE).expect("fired").0,
        RetireOutcome::Retired
    );
    ctx.destroy_stream(s).expect("destroy_stream");
    ctx.teardown(false).expect("teardown");
    assert!(caller.is_current(), "device 1's context left current");
    caller.release();
}

/// What the ordered cross-stream free's copy writes.
static CROSS_STREAM_BYTES: [u8; 4096] = [5; 4096];

/// A free on stream b of memory allocated on a: after a copy on a and
/// `order_after(b, a)` (`ordered`), or with nothing ordering the two, the
/// planted violation.
fn cross_stream_free(ordered: bool) {
    let ctx = vendor::context();
    let current = vendor::current(&ctx);
    let (a, b) = (
        ctx.create_stream().expect("stream a"),
        ctx.create_stream().expect("stream b"),
    );
    let m = ctx.allocate(&a, 4096).expect("allocate");
    if ordered {
        // SAFETY: `m` and `a` are live handles of `ctx`, and the source is
        // static, so it outlives the copy.
        unsafe { vendor::copy_in_unwaited(&current, &a, &m, &CROSS_STREAM_BYTES) };
        ctx.order_after(&b, &a).expect("order_after");
    }
    let (sig, rx) = signal();
    ctx.free_async(&b, m, sig)
        .map_err(|(_, _, e)| e)
        .expect("free on b");
    ctx.synchronize(&b).expect("synchronize b");
    assert_eq!(
        rx.recv_timeout(SETTLE).expect("fired").0,
        RetireOutcome::Retired
    );
    ctx.destroy_stream(a).expect("destroy_stream");
    ctx.destroy_stream(b).expect("destroy_stream");
    ctx.teardown(false).expect("teardown");
}

/// A planted violation on raw calls; the stand-in aborts on the last call.
fn planted(case: &str) {
    use vendor::raw::{self, SUCCESS};
    let r = raw::Raw::open();
    // SAFETY: raw calls on the stand-in, each on handles opened here, either
    // valid or the violation the case plants, on which the stand-in aborts
    // before anything undefined happens.
    unsafe {
        match case {
            "double_free" => {
                let p = r.alloc(64);
                assert_eq!(raw::free(&r, p), SUCCESS, "the first free");
                raw::free(&r, p);
            }
            "free_unknown" => {
                raw::free_unknown(&r);
            }
            "copy_out_of_bounds" => {
                let p = r.alloc(100);
                raw::htod(&r, raw::offset(p, 50), &[0; 64]);
            }
            "cross_stream_copy_unordered" => {
                let p = r.alloc(64);
                assert_eq!(raw::htod(&r, p, &[1; 64]), SUCCESS, "the first write");
                raw::htod_other(&r, p, &[2; 64]);
            }
            "event_after_destroy" => {
                let e = r.event_create();
                assert_eq!(raw::event_destroy(e), SUCCESS, "destroy");
                raw::event_record(&r, e);
            }
            "destroyed_stream_sync" => {
                assert_eq!(raw::stream_destroy(&r), SUCCESS, "destroy");
                raw::sync(&r);
            }
            "destroyed_stream_free" => {
                let p = r.alloc(64);
                assert_eq!(raw::sync(&r), SUCCESS, "synchronize");
                assert_eq!(raw::stream_destroy(&r), SUCCESS, "destroy");
                raw::free(&r, p);
            }
            "pool_trim_after_destroy" | "pool_alloc_after_destroy" => {
                let pool = r.pool_create();
                assert_eq!(raw::pool_destroy(pool), SUCCESS, "destroy");
                if case == "pool_trim_after_destroy" {
                    raw::pool_trim(pool);
                } else {
                    raw::pool_alloc(&r, pool, 64);
                }
            }
            _ => unreachable!("{case}"),
        }
    }
}

/// A copy into page-locked host memory (through its device pointer), the
/// memory freed after it (`synced`) or while it is queued.
fn host_free(synced: bool) {
    use vendor::raw::{self, SUCCESS};
    let r = raw::Raw::open();
    let src = vec![7u8; 4096];
    // SAFETY: raw calls on the stand-in on handles opened here; the copy
    // reads `src`, which outlives it (the stream is synchronized below), and
    // writes within the 4096-byte page-locked buffer. Freeing the buffer
    // under the copy is the planted violation the stand-in aborts on.
    unsafe {
        let (host, device) = raw::host_alloc(4096);
        assert_eq!(raw::htod(&r, device, &src), SUCCESS, "copy");
        if synced {
            assert_eq!(raw::sync(&r), SUCCESS, "synchronize");
        }
        assert_eq!(raw::host_free(host), SUCCESS, "free page-locked memory");
        assert_eq!(raw::sync(&r), SUCCESS, "synchronize");
    }
    r.close();
}
