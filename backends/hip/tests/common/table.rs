//! HIP's table for its test binaries: everything the shared cases
//! (`backends/cases/`) and the HIP tests need of HIP, in one file: the
//! stand-in's knobs, the raw runtime calls, the `StandInBackend`
//! implementation and each case file's `vendor` module (the contract is
//! `backends/cases/README.md`). CUDA's is `backends/cuda/tests/common/table.rs`.
//!
//! Every HIP test binary includes this file (`common/mod.rs` declares it;
//! `hip.rs` and `pinned.rs`, which do not use `common`, include it by
//! `#[path]`). The `vendor` modules name items of the binary that
//! instantiates them (its case file, its `common`, its children), so each
//! is a macro that the binary expands at its root: `core_table!`
//! (`hip.rs`), `capture_table!` (`capture.rs`), `arena_table!`
//! (`arena.rs`) and `common_table!` (`common/mod.rs`).

// Each binary expands only the part its cases use, and leaves the rest of
// the table (macros and the plain modules below) unused.
#![allow(dead_code, unused_macros)]

/// The stand-in's environment knobs (see `backends/stand-ins/README.md`).
pub mod knobs {
    /// Every queued operation's delay, in microseconds.
    pub const LATENCY: &str = "MEMGOV_STANDIN_HIP_LATENCY_US";
    /// Draws each delay from 0 to twice `LATENCY` with this seed.
    pub const SEED: &str = "MEMGOV_STANDIN_HIP_LATENCY_SEED";
    /// Aborts at exit on anything a torn-down context left.
    pub const EXIT_CHECK: &str = "MEMGOV_STANDIN_HIP_EXIT_CHECK";
}

/// A raw copy the HIP backend does not wait for, which the main suite and
/// the arena's cases queue to put work on a stream under the backend.
pub mod raw_copy {
    use memgov::hip::raw as hip;
    use memgov::hip::{HipMemory, HipStream};

    /// Queues a copy of `src` into `m` on `s` (a raw `hipMemcpyHtoDAsync`;
    /// device 0 is current on every thread by default) that the backend does
    /// not wait for.
    ///
    /// # Safety
    ///
    /// `m` and `s` are live, `m` mapped and accessible; `src` outlives the
    /// copy.
    pub unsafe fn copy_in_unwaited(s: &HipStream, m: &HipMemory, src: &[u8]) {
        // SAFETY: the caller's.
        let r = unsafe {
            hip::hipMemcpyHtoDAsync(
                m.device_ptr(),
                src.as_ptr() as *mut std::ffi::c_void,
                src.len(),
                s.hip_stream(),
            )
        };
        assert_eq!(r, hip::SUCCESS, "raw copy in");
    }
}

/// The raw runtime calls and stand-in hooks of the main suite (`hip.rs`)
/// and its `vendor` module.
pub mod calls {
    use memgov::hip::raw as hip;
    use std::ffi::{c_void, CStr};

    /// A test hook the stand-in exports (absent from the real runtime, so it is
    /// looked up at run time).
    pub fn standin_hook(name: &CStr) -> unsafe extern "C" fn() -> u64 {
        let p = hip::symbol(name).unwrap_or_else(|| panic!("the stand-in exports {name:?}"));
        // SAFETY: the stand-in's hooks take nothing and return an integer (the
        // quiesce hook returns void; its result register is ignored).
        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> u64>(p) }
    }

    /// Tell the stand-in that no other thread may call HIP from now on.
    pub fn quiesce() {
        // SAFETY: the hook takes nothing; see `standin_hook`.
        unsafe { standin_hook(c"memgov_standin_hip_quiesce")() };
    }

    /// HIP calls made so far in this process.
    pub fn hip_calls() -> u64 {
        // SAFETY: the hook takes nothing and returns a uint64_t.
        unsafe { standin_hook(c"memgov_standin_hip_calls")() }
    }

    /// The thread's device (`hipGetDevice`).
    pub fn current_device() -> i32 {
        let mut d = -1;
        // SAFETY: valid out-pointer.
        ok(unsafe { hip::hipGetDevice(&mut d) });
        d
    }

    /// Queue a host-to-device copy on `s` by hand (pending with latency).
    pub fn raw_write(s: hip::hipStream_t, p: *mut c_void, src: &'static [u8]) {
        // SAFETY: `p` is a live allocation of at least `src.len()` bytes; the
        // source is static, so it outlives the queued copy.
        ok(unsafe { hip::hipMemcpyHtoDAsync(p, src.as_ptr() as *mut c_void, src.len(), s) });
    }

    /// `hipStreamQuery` of `s`.
    pub fn stream_query(s: hip::hipStream_t) -> hip::HipResult {
        // SAFETY: a live stream.
        unsafe { hip::hipStreamQuery(s) }
    }

    /// The call succeeded.
    pub fn ok(r: hip::HipResult) {
        assert_eq!(r, hip::hipSuccess);
    }

    /// `bytes` of mapped page-locked host memory: (host pointer, device
    /// pointer from `hipHostGetDevicePointer`).
    pub fn mapped_host(bytes: usize) -> (*mut c_void, *mut c_void) {
        let (mut host, mut device): (*mut c_void, *mut c_void) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid out-pointers; the flags and the host pointer are the
        // documented ones.
        unsafe {
            ok(hip::hipHostMalloc(
                &mut host,
                bytes,
                hip::hipHostMallocMapped,
            ));
            ok(hip::hipHostGetDevicePointer(&mut device, host, 0));
        }
        (host, device)
    }

    /// A raw non-blocking stream on the thread's device.
    pub fn raw_stream() -> hip::hipStream_t {
        let mut s: hip::hipStream_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { hip::hipStreamCreateWithFlags(&mut s, hip::hipStreamNonBlocking) });
        s
    }

    /// `hipMallocAsync` of `bytes` on `s`.
    pub fn raw_alloc(bytes: usize, s: hip::hipStream_t) -> *mut c_void {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer and stream.
        ok(unsafe { hip::hipMallocAsync(&mut p, bytes, s) });
        p
    }
}

/// `hip.rs`'s: the `StandInBackend` implementation and the `vendor`
/// module of the shared core cases (`backends/cases/core.rs`).
macro_rules! core_table {
    () => {
        impl crate::cases::StandInBackend for memgov::hip::HipContext {
            fn open() -> Option<Self> {
                crate::context(memgov::hip::HipConfig::default())
            }

            fn probe(&self) -> memgov::BackendProbe {
                memgov::hip::HipContext::probe(self)
            }

            fn pending_frees(&self) -> usize {
                memgov::hip::HipContext::pending_frees(self)
            }

            const STAND_IN_UUID_PREFIX: &'static [u8] = b"memgov-standinh";
            const STAND_IN_PCI: &'static str = "0000:20:00.0";
            const STAND_IN_KEY: &'static str = "gpu-6d656d67-6f76-2d73-7461-6e64696e6800";

            /// The default configuration allocates from memgov's own pool.
            fn check_allocation(&self, memory: &memgov::hip::HipMemory) {
                assert_eq!(memory.origin(), memgov::hip::Origin::Pool);
            }
        }

        /// What the shared cases (`backends/cases/core.rs`) need of HIP.
        mod vendor {
            use memgov::hip::raw as hip;
            use memgov::hip::{HipConfig, HipContext, HipMemory, HipStream};

            pub(crate) use crate::LATENCY;
            pub use memgov::hip::HipContext as Context;

            pub(crate) use crate::shared::Factory;

            /// The configurations the conformance suite runs on, by label: memgov's
            /// pool and the hipMalloc/hipFree fallback.
            pub const SUITE_CONFIGS: &[(&str, Factory)] = &[
                ("pool", || HipContext::new(HipConfig::default())),
                ("plain", || {
                    HipContext::new(HipConfig {
                        allocator: memgov::hip::AllocatorChoice::Plain,
                        ..HipConfig::default()
                    })
                }),
            ];

            crate::shared::core_vendor! {
                backend: "hip",
                VENDOR: "HIP",
                FAIL_CALLBACK_AT: "MEMGOV_STANDIN_HIP_FAIL_CALLBACK_AT",
                OUT_OF_MEMORY: "hipErrorOutOfMemory (2)",
                DOUBLE_FREE: "hipFreeAsync of already freed pointer",
                UNKNOWN_FREE: "hipFree of unknown pointer",
                OUT_OF_BOUNDS: "hipMemcpyHtoDAsync of 64 bytes at out of bounds",
                HOST_FREE_UNDER_COPY: "hipHostFree: page-locked host allocation",
                EVENT_AFTER_DESTROY: "hipEventRecord on destroyed event",
            }

            /// The child was aborted by the stand-in with a contract violation
            /// that names `what` (on the stand-in only).
            pub fn aborts(case: &str, env: &[(&str, &str)], what: &str) {
                if crate::on_stand_in() {
                    crate::expect_abort(case, env, what);
                }
            }

            /// Raw runtime calls for the planted cases, on device 0 (current by
            /// default).
            pub mod raw {
                use memgov::hip::raw as hip;
                use std::ffi::c_void;

                include!("../../cases/forward.rs");

                pub(crate) type Code = hip::HipResult;
                pub const SUCCESS: Code = hip::hipSuccess;

                /// The entry points whose names the stand-in's messages carry.
                pub const SYNC: &str = "hipStreamSynchronize";
                pub const FREE_ASYNC: &str = "hipFreeAsync";
                pub const POOL_TRIM: &str = "hipMemPoolTrimTo";
                pub const POOL_ALLOC: &str = "hipMallocFromPoolAsync";

                /// Two raw streams (`s`, and `t` for the other stream).
                pub struct Raw {
                    s: hip::hipStream_t,
                    t: hip::hipStream_t,
                }

                forward! {
                    free(r: &Raw, p: *mut c_void) => hip::hipFreeAsync(p, r.s);
                    // A live local the runtime never allocated.
                    free_unknown(_r: &Raw) => hip::hipFree((&mut 0u64 as *mut u64).cast());
                    htod(r: &Raw, p: *mut c_void, src: &[u8]) =>
                        hip::hipMemcpyHtoDAsync(p, src.as_ptr() as *mut c_void, src.len(), r.s);
                    htod_other(r: &Raw, p: *mut c_void, src: &[u8]) =>
                        hip::hipMemcpyHtoDAsync(p, src.as_ptr() as *mut c_void, src.len(), r.t);
                    sync(r: &Raw) => hip::hipStreamSynchronize(r.s);
                    stream_destroy(r: &Raw) => hip::hipStreamDestroy(r.s);
                    event_destroy(e: hip::hipEvent_t) => hip::hipEventDestroy(e);
                    event_record(r: &Raw, e: hip::hipEvent_t) => hip::hipEventRecord(e, r.s);
                    pool_destroy(pool: hip::hipMemPool_t) => hip::hipMemPoolDestroy(pool);
                    pool_trim(pool: hip::hipMemPool_t) => hip::hipMemPoolTrimTo(pool, 0);
                    pool_alloc(r: &Raw, pool: hip::hipMemPool_t, bytes: usize) =>
                        hip::hipMallocFromPoolAsync(&mut std::ptr::null_mut(), bytes, pool, r.s);
                    host_free(host: *mut c_void) => hip::hipHostFree(host);
                }

                /// `p` moved `n` bytes on.
                pub fn offset(p: *mut c_void, n: usize) -> *mut c_void {
                    p.cast::<u8>().wrapping_add(n).cast()
                }

                /// Page-locked host memory, mapped: its host and device pointers.
                pub fn host_alloc(bytes: usize) -> (*mut c_void, *mut c_void) {
                    crate::mapped_host(bytes)
                }

                impl Raw {
                    pub fn open() -> Self {
                        Raw {
                            s: crate::raw_stream(),
                            t: crate::raw_stream(),
                        }
                    }

                    /// `hipMallocAsync` of `bytes` on `s`.
                    pub fn alloc(&self, bytes: usize) -> *mut c_void {
                        crate::raw_alloc(bytes, self.s)
                    }

                    /// `hipEventCreateWithFlags` (timing disabled).
                    pub fn event_create(&self) -> hip::hipEvent_t {
                        let mut e = std::ptr::null_mut();
                        // SAFETY: a valid out pointer.
                        crate::ok(unsafe { hip::hipEventCreateWithFlags(&mut e, 2) });
                        e
                    }

                    /// `hipMemPoolCreate` of a device pool on device 0.
                    pub fn pool_create(&self) -> hip::hipMemPool_t {
                        let props = hip::hipMemPoolProps {
                            allocType: hip::hipMemAllocationTypePinned,
                            handleTypes: hip::hipMemHandleTypeNone,
                            location: hip::hipMemLocation {
                                type_: hip::hipMemLocationTypeDevice,
                                id: 0,
                            },
                            win32SecurityAttributes: std::ptr::null_mut(),
                            reserved: [0; 64],
                        };
                        let mut pool = std::ptr::null_mut();
                        // SAFETY: valid properties and out pointer.
                        crate::ok(unsafe { hip::hipMemPoolCreate(&mut pool, &props) });
                        pool
                    }

                    /// Destroys the streams.
                    pub fn close(self) {
                        // SAFETY: the live streams, each destroyed once.
                        unsafe {
                            crate::ok(hip::hipStreamDestroy(self.s));
                            crate::ok(hip::hipStreamDestroy(self.t));
                        }
                    }
                }
            }

            /// How many devices the stand-in has.
            pub const DEVICES: &str = "MEMGOV_STANDIN_HIP_DEVICES";

            /// Open device `device` with the default settings.
            pub fn open_on(device: u32) -> Result<HipContext, memgov::BackendError> {
                HipContext::new(HipConfig {
                    device,
                    ..HipConfig::default()
                })
            }

            /// A context of configuration `label` on device `device`.
            pub fn context_on(label: &str, device: u32) -> HipContext {
                let allocator = match label {
                    "pool" => memgov::hip::AllocatorChoice::Auto,
                    "plain" => memgov::hip::AllocatorChoice::Plain,
                    other => panic!("no configuration {other}"),
                };
                HipContext::new(HipConfig {
                    device,
                    allocator,
                    ..HipConfig::default()
                })
                .expect("context")
            }

            /// What a runtime has current on its thread: a device.
            pub struct Caller(i32);

            impl Caller {
                /// Makes device `device` the thread's.
                pub fn on_device(device: i32) -> Self {
                    // SAFETY: a plain call with a valid ordinal.
                    crate::ok(unsafe { hip::hipSetDevice(device) });
                    Caller(device)
                }

                /// Its device is still the thread's.
                pub fn is_current(&self) -> bool {
                    crate::current_device() == self.0
                }

                /// A thread that never set a device has device 0, the default.
                pub fn fresh_thread_untouched() -> bool {
                    crate::current_device() == 0
                }

                /// Nothing to release.
                pub fn release(self) {}
            }

            /// How an unavailable context's reason starts.
            pub const UNAVAILABLE: &[&str] = &["no HIP device", "no HIP runtime"];
            /// A runtime without memory pools gets the hipMalloc/hipFree fallback.
            pub const ALWAYS_STREAM_ORDERED: bool = false;

            /// Whether `ctx` runs on memgov's stand-in runtime.
            pub fn is_stand_in(ctx: &HipContext) -> bool {
                use memgov::DeviceContext;
                ctx.describe()
                    .name
                    .starts_with(memgov::hip::STAND_IN_NAME_PREFIX)
            }

            /// HIP's own, on any machine: a child pointed at a library that is not
            /// there, and at one that is not HIP, finds no runtime and calls no HIP
            /// function.
            pub fn missing_driver_cases() {
                for (case, library) in [
                    ("no_runtime", "/nonexistent/libamdhip64.so.5"),
                    ("runtime_without_hip", "libm.so.6"),
                ] {
                    let run = crate::child(case, &[("MEMGOV_HIP_RUNTIME", library)]);
                    crate::child_process::assert_passed(case, &run, crate::CHILD_END);
                }
            }

            /// The stand-in fails runtime call N and all later as after an illegal
            /// address.
            pub const STICKY_ERROR_AT_OP: &str = "MEMGOV_STANDIN_HIP_STICKY_ERROR_AT_OP";
            /// How a sticky error names the runtime's code.
            pub const ILLEGAL_ADDRESS: &str = "hipErrorIllegalAddress (700)";

            /// HIP's own sticky-error case, on the backend at exact call numbers:
            /// calls 1..=23 open the context, a stream, an allocation and its free;
            /// call 24 (the next one) and all later fail as after an illegal
            /// address, with the free still queued behind the latency.
            pub fn sticky_error_cases() {
                passes(
                    "device_loss",
                    &[(LATENCY, "100000"), (STICKY_ERROR_AT_OP, "24")],
                );
            }

            /// Nothing more: the exit check (on) sees what the lost context left.
            pub fn after_sticky_retire() {}

            /// One lost teardown: the stand-in is quiesced after it.
            pub const LOST_TEARDOWN_ROUNDS: usize = 1;

            /// After a lost teardown: no thread of memgov's calls HIP any more (the
            /// stand-in aborts on a call from another thread after its quiesce
            /// hook); its exit check finds no memory, stream or pool left.
            pub fn nothing_left_after_lost_teardown(_round: usize) {
                crate::quiesce();
            }

            /// The child ran `case` to its end, with the stand-in's exit check on:
            /// what it printed, `None` (after printing why) off the stand-in.
            pub fn passes(case: &str, env: &[(&str, &str)]) -> Option<String> {
                crate::on_stand_in().then(|| crate::expect_pass(case, env))
            }

            /// A context on the runtime found.
            pub fn context() -> HipContext {
                HipContext::new(HipConfig::default()).expect("context")
            }

            /// Nothing: device 0 is current on every thread by default.
            pub struct Current;

            pub fn current(_: &HipContext) -> Current {
                Current
            }

            /// The memory's device pointer.
            pub fn device_address(m: &HipMemory) -> u64 {
                m.device_ptr() as u64
            }

            /// The stream's runtime handle.
            pub fn stream_handle(s: &HipStream) -> *const std::ffi::c_void {
                s.hip_stream().cast_const().cast()
            }

            /// Copies `m`'s first bytes into `dst` (a raw `hipMemcpyDtoHAsync` on
            /// `s`, then `hipStreamSynchronize`).
            ///
            /// # Safety
            ///
            /// `m` and `s` are live; `m` holds at least `dst.len()` bytes.
            pub unsafe fn copy_out_waited(
                _: &Current,
                s: &HipStream,
                m: &HipMemory,
                dst: &mut [u8],
            ) {
                // SAFETY: the caller's; `dst` outlives the copy, which the
                // synchronize completes.
                let (copy, sync) = unsafe {
                    (
                        hip::hipMemcpyDtoHAsync(
                            dst.as_mut_ptr().cast(),
                            m.device_ptr(),
                            dst.len(),
                            s.hip_stream(),
                        ),
                        hip::hipStreamSynchronize(s.hip_stream()),
                    )
                };
                assert_eq!((copy, sync), (hip::SUCCESS, hip::SUCCESS), "raw copy out");
            }

            /// Whether `s`'s work has all run (`hipStreamQuery`: `hipSuccess` or
            /// `hipErrorNotReady`; any other result is returned as it is).
            pub fn stream_done(_: &Current, s: &HipStream) -> Result<bool, hip::HipResult> {
                match crate::stream_query(s.hip_stream()) {
                    hip::hipSuccess => Ok(true),
                    hip::hipErrorNotReady => Ok(false),
                    r => Err(r),
                }
            }

            /// Queues a copy of `src` into `m` on `s` (a raw `hipMemcpyHtoDAsync`)
            /// that the backend does not wait for.
            ///
            /// # Safety
            ///
            /// `m` and `s` are live; `src` outlives the copy.
            pub unsafe fn copy_in_unwaited(_: &Current, s: &HipStream, m: &HipMemory, src: &[u8]) {
                // SAFETY: the caller's.
                unsafe { crate::table::raw_copy::copy_in_unwaited(s, m, src) }
            }
        }
    };
}

/// `capture.rs`'s: the `vendor` module of the shared capture cases
/// (`backends/cases/capture.rs`).
macro_rules! capture_table {
    () => {
        /// What the shared cases (`backends/cases/capture.rs`) need of HIP.
        mod vendor {
            pub use crate::common::{
                capture_stats as stats, entry_paused, fail_entry, fault_cells, pause_entry,
                resume_entry,
            };
            pub(crate) use crate::{aborts, passes, EXIT_CHECK, LATENCY, SEED};
            pub use memgov::hip::{
                capture_gate, ArenaConfig, CaptureConfig, CaptureMode, HipArena as Arena,
                HipConfig as Config, HipContext as Context, HipMemory as Memory,
                HipStream as Stream, PoolExhausted,
            };

            crate::cases::capture_vendor! {
                backend: "hip",
                make_current: "hipGetDevice",
                htod: c"hipMemcpyHtoDAsync",
                graph_launch: c"hipGraphLaunch",
                begin_capture: "hipStreamBeginCapture",
                end_capture: "hipStreamEndCapture",
                destroy_capturing_abort: "while it is capturing",
                launch_freed_abort: "hipGraphLaunch of 4096 bytes at already freed device pointer",
                churn_seeds: ["1", "2"],
            }

            /// The raw runtime calls the stand-in capture cases make.
            pub mod raw {
                use super::Context;
                use memgov::hip::raw as hip;
                use std::ffi::c_void;

                pub type Code = i32;
                pub type Status = i32;
                pub type RawStream = hip::hipStream_t;

                pub(crate) use crate::cases::G;
                /// The capture modes, results and statuses, under neutral names.
                pub use hip::{
                    hipErrorStreamCaptureInvalidated as INVALIDATED,
                    hipErrorStreamCaptureUnsupported as UNSUPPORTED,
                    hipErrorStreamCaptureWrongThread as WRONG_THREAD,
                    hipStreamCaptureModeGlobal as GLOBAL, hipStreamCaptureModeRelaxed as RELAXED,
                    hipStreamCaptureModeThreadLocal as LOCAL,
                    hipStreamCaptureStatusActive as ACTIVE, hipStreamCaptureStatusNone as NONE,
                };
                /// `hipStreamCaptureStatusInvalidated`, which the raw module does
                /// not name.
                pub const STATUS_INVALIDATED: Status = 2;

                pub fn ok(r: Code, what: &str) {
                    assert_eq!(r, hip::SUCCESS, "{what}");
                }

                pub struct Raw {
                    _ctx: Context,
                    pub s: RawStream,
                }

                /// A context and a raw stream (device 0 is current on every thread
                /// by default).
                pub fn raw() -> Raw {
                    let ctx = Context::new(Default::default()).expect("context");
                    let mut s = std::ptr::null_mut();
                    ok(
                        // SAFETY: valid out pointer.
                        unsafe { hip::hipStreamCreateWithFlags(&mut s, hip::hipStreamNonBlocking) },
                        "stream",
                    );
                    Raw { _ctx: ctx, s }
                }

                pub fn alloc(r: &Raw, bytes: usize) -> *mut c_void {
                    let mut p = std::ptr::null_mut();
                    // SAFETY: valid out pointer, live stream.
                    ok(unsafe { hip::hipMallocAsync(&mut p, bytes, r.s) }, "alloc");
                    p
                }

                pub fn begin(s: RawStream, mode: i32) {
                    // SAFETY: a live stream.
                    ok(unsafe { hip::hipStreamBeginCapture(s, mode) }, "begin");
                }

                pub fn end(s: RawStream) -> (Code, hip::hipGraph_t) {
                    let mut g = std::ptr::null_mut();
                    // SAFETY: a live stream, valid out pointer.
                    let r = unsafe { hip::hipStreamEndCapture(s, &mut g) };
                    (r, g)
                }

                /// The stream's capture status and, while it captures, the
                /// capture's id.
                pub fn capture_info(s: RawStream) -> (Status, u64) {
                    let (mut st, mut id) = (-1, 0);
                    ok(
                        // SAFETY: a live stream, valid out pointers.
                        unsafe { hip::hipStreamGetCaptureInfo(s, &mut st, &mut id) },
                        "capture info",
                    );
                    (st, id)
                }

                pub fn instantiate(g: hip::hipGraph_t) -> hip::hipGraphExec_t {
                    let mut e = std::ptr::null_mut();
                    ok(
                        // SAFETY: a graph from hipStreamEndCapture, valid out pointer.
                        unsafe {
                            hip::hipGraphInstantiate(
                                &mut e,
                                g,
                                std::ptr::null_mut(),
                                std::ptr::null_mut(),
                                0,
                            )
                        },
                        "instantiate",
                    );
                    e
                }

                /// A physical allocation of a granule on device 0.
                pub fn create_handle() -> (Code, hip::hipMemGenericAllocationHandle_t) {
                    let mut v = 0;
                    // SAFETY: valid out pointer.
                    ok(unsafe { hip::hipRuntimeGetVersion(&mut v) }, "version");
                    let p = hip::allocation_prop(0, v);
                    let mut h = std::ptr::null_mut();
                    // SAFETY: valid out pointer and properties.
                    let r = unsafe { hip::hipMemCreate(&mut h, G, p.as_ptr(), 0) };
                    (r, h)
                }

                /// What another thread runs before its raw calls on `r`: nothing
                /// (device 0 is current on every thread by default).
                pub fn enter(_: &Raw) -> impl FnOnce() + Send + 'static {
                    || {}
                }

                include!("../../cases/forward.rs");

                forward! {
                    htod(d: *mut c_void, src: &[u8], s: RawStream) =>
                        hip::hipMemcpyHtoDAsync(d, src.as_ptr() as *mut c_void, src.len(), s);
                    dtoh(dst: &mut [u8], d: *mut c_void, s: RawStream) =>
                        hip::hipMemcpyDtoHAsync(dst.as_mut_ptr().cast(), d, dst.len(), s);
                    graph_destroy(g: hip::hipGraph_t) => hip::hipGraphDestroy(g);
                    exec_destroy(x: hip::hipGraphExec_t) => hip::hipGraphExecDestroy(x);
                    launch(x: hip::hipGraphExec_t, s: RawStream) => hip::hipGraphLaunch(x, s);
                    sync(s: RawStream) => hip::hipStreamSynchronize(s);
                    query(s: RawStream) => hip::hipStreamQuery(s);
                    free_async(d: *mut c_void, s: RawStream) => hip::hipFreeAsync(d, s);
                    stream_destroy(s: RawStream) => hip::hipStreamDestroy(s);
                    host_alloc(p: &mut *mut c_void, bytes: usize) =>
                        hip::hipHostMalloc(p, bytes, hip::hipHostMallocDefault);
                    host_free(p: *mut c_void) => hip::hipHostFree(p);
                    mem_release(h: hip::hipMemGenericAllocationHandle_t) => hip::hipMemRelease(h);
                    map(base: *mut c_void, size: usize, h: hip::hipMemGenericAllocationHandle_t) =>
                        hip::hipMemMap(base, size, 0, h, 0);
                    unmap(base: *mut c_void, size: usize) => hip::hipMemUnmap(base, size);
                }

                /// An address range of `size` bytes reserved.
                pub fn reserve(size: usize) -> *mut c_void {
                    let mut base = std::ptr::null_mut();
                    ok(
                        // SAFETY: valid out pointer.
                        unsafe {
                            hip::hipMemAddressReserve(&mut base, size, 0, std::ptr::null_mut(), 0)
                        },
                        "reserve",
                    );
                    base
                }

                /// Read-write access to `size` bytes at `base` for device 0.
                ///
                /// # Safety
                ///
                /// The runtime's: a mapped range.
                pub unsafe fn set_access(base: *mut c_void, size: usize) -> Code {
                    let desc = hip::hipMemAccessDesc {
                        location: hip::hipMemLocation {
                            type_: hip::hipMemLocationTypeDevice,
                            id: 0,
                        },
                        flags: hip::hipMemAccessFlagsProtReadWrite,
                    };
                    // SAFETY: the caller's; one valid descriptor.
                    unsafe { hip::hipMemSetAccess(base, size, &desc, 1) }
                }
            }
        }
    };
}

/// `arena.rs`'s: the `vendor` module of the shared arena cases
/// (`backends/cases/arena.rs`).
macro_rules! arena_table {
    () => {
        /// What the shared cases (`backends/cases/arena.rs`) need of HIP.
        mod vendor {
            pub use crate::common::{fault_cells, vmm};
            pub(crate) use crate::{aborts, child, passes, BANNER, EXIT_CHECK, LATENCY, SEED};
            pub use memgov::hip::{
                ArenaConfig, HipArena as Arena, HipConfig as Config, HipContext as Context,
                HipMemory as Memory, HipStream as Stream,
            };

            /// The arena's name in its messages.
            pub const ARENA_NAME: &str = "HipArena";
            /// The runtime's virtual memory calls, as their fault cells and
            /// messages name them.
            pub use crate::common::{
                CREATE_ENTRY, MAP_ENTRY, RELEASE_ENTRY, SET_ACCESS_ENTRY, UNMAP_ENTRY,
            };
            /// The stand-in's knobs failing the `n`th virtual memory call, and the
            /// `n`th unmap.
            pub use crate::common::{FAIL_UNMAP_AT, FAIL_VMM_AT};
            /// The latency seeds of the growth and shrinking, plain and governed.
            pub const GROW_SHRINK_SEEDS: &[&str] = &["1", "2"];
            pub const GOVERNED_GROW_SHRINK_SEEDS: &[&str] = &["3"];
            /// Whether `destroy_stream` returns only once the stream's queued work
            /// ran and its signals fired (the trait allows either).
            pub const DESTROY_STREAM_FINISHES_ITS_WORK: bool = true;
            /// The raw runtime calls the stand-in's virtual memory cases make.
            pub(crate) use crate::own as raw;

            /// The sleep/wake cycles when `MEMGOV_ARENA_SLEEP_CYCLES` is not set.
            pub const SLEEP_CYCLES: u64 = 20;

            /// The device address of `m`.
            pub fn at(m: &Memory) -> u64 {
                m.device_ptr() as u64
            }

            /// Queues a copy of `src` into `m` on `s` that the backend does not
            /// wait for (a raw `hipMemcpyHtoDAsync`; device 0 is current).
            ///
            /// # Safety
            ///
            /// `m` is mapped and accessible; `src` outlives the copy.
            pub unsafe fn copy_in_unwaited(_ctx: &Context, s: &Stream, m: &Memory, src: &[u8]) {
                // SAFETY: the caller's.
                unsafe { crate::common::table::raw_copy::copy_in_unwaited(s, m, src) }
            }
        }
    };
}

/// `common/mod.rs`'s: the shared support (`backends/cases/common.rs`,
/// included here) and the `vendor` module it uses.
macro_rules! common_table {
    () => {
        #[macro_use]
        #[path = "../../../cases/common.rs"]
        mod shared;

        pub use shared::*;

        /// What the shared part needs of HIP.
        mod vendor {
            use std::ffi::CStr;

            pub use memgov::hip::{
                ArenaConfig, HipArena as Arena, HipConfig as Config, HipContext as Context,
            };

            stand_in! {
                vendor: "hip",
                VENDOR: "HIP",
                library: "libamdhip64",
                RELEASE_ENTRY: "hipMemRelease",
                MAP_ENTRY: "hipMemMap",
                HOST_ALLOC_ENTRY: "hipHostMalloc",
                CREATE_ENTRY: "hipMemCreate",
                SET_ACCESS_ENTRY: "hipMemSetAccess",
                UNMAP_ENTRY: "hipMemUnmap",
            }

            /// Whether `ctx` runs on the stand-in.
            pub fn is_stand_in(ctx: &Context) -> bool {
                use memgov::DeviceContext;
                ctx.describe().execution == memgov::Execution::StandIn
            }

            /// A symbol of the loaded stand-in runtime.
            pub fn standin_symbol(name: &CStr) -> *mut std::ffi::c_void {
                memgov::hip::raw::symbol(name).expect("the stand-in's hook")
            }
        }
    };
}
