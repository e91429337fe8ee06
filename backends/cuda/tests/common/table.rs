//! CUDA's table for its test binaries: everything the shared cases
//! (`backends/cases/`) and the CUDA tests need of CUDA, in one file: the
//! stand-in's knobs, the raw driver calls, the `StandInBackend`
//! implementation and each case file's `vendor` module (the contract is
//! `backends/cases/README.md`). HIP's is `backends/hip/tests/common/table.rs`.
//!
//! Every CUDA test binary includes this file (`common/mod.rs` declares it;
//! `cuda.rs`, which does not use `common`, includes it by `#[path]`). The
//! `vendor` modules name items of the binary that instantiates them (its
//! case file, its `common`, its children), so each is a macro that the
//! binary expands at its root: `core_table!` (`cuda.rs`),
//! `capture_table!` (`capture.rs`), `arena_table!` (`arena.rs`) and
//! `common_table!` (`common/mod.rs`).

// Each binary expands only the part its cases use, and leaves the rest of
// the table (macros and the plain modules below) unused.
#![allow(dead_code, unused_macros)]

/// The stand-in's environment knobs (see `backends/stand-ins/README.md`).
pub mod knobs {
    /// Every queued operation's delay, in microseconds.
    pub const LATENCY: &str = "MEMGOV_STANDIN_CUDA_LATENCY_US";
    /// Draws each delay from 0 to twice `LATENCY` with this seed.
    pub const SEED: &str = "MEMGOV_STANDIN_CUDA_LATENCY_SEED";
    /// Aborts at exit on anything a torn-down context left.
    pub const EXIT_CHECK: &str = "MEMGOV_STANDIN_CUDA_EXIT_CHECK";
}

/// A raw copy the CUDA backend does not wait for, which the main suite and
/// the arena's cases queue to put work on a stream under the backend.
pub mod raw_copy {
    use cudarc::driver::sys::{self, CUresult};
    use memgov::cuda::{CudaMemory, CudaStream};

    /// Queues a copy of `src` into `m` on `s` (a raw `cuMemcpyHtoDAsync_v2`,
    /// the context `ctx` pushed current around it) that the backend does not
    /// wait for.
    ///
    /// # Safety
    ///
    /// `ctx` is a live context; `m` and `s` are live, `m` mapped and
    /// accessible; `src` outlives the copy.
    pub unsafe fn copy_in_unwaited(
        ctx: sys::CUcontext,
        s: &CudaStream,
        m: &CudaMemory,
        src: &[u8],
    ) {
        // SAFETY: the caller's: a live context, popped below.
        let r = unsafe { sys::cuCtxPushCurrent_v2(ctx) };
        assert_eq!(r, CUresult::CUDA_SUCCESS, "push");
        // SAFETY: the caller's: `m` and `s` live, `src` alive until the copy
        // ran.
        let copy = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                m.device_ptr(),
                src.as_ptr().cast(),
                src.len(),
                s.cu_stream(),
            )
        };
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: balances the push.
        let r = unsafe { sys::cuCtxPopCurrent_v2(&mut prev) };
        assert_eq!(r, CUresult::CUDA_SUCCESS, "pop");
        assert_eq!(copy, CUresult::CUDA_SUCCESS, "raw copy in");
    }
}

/// The raw driver calls and stand-in queries of the main suite's children
/// (`cuda.rs`'s `children`) and its `vendor` module.
pub mod calls {
    use cudarc::driver::sys;
    use memgov::cuda::CudaContext;

    /// The call succeeded.
    pub fn ok(r: sys::CUresult, what: &str) {
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
    }

    /// The stand-in context and one raw stream of it, current on this thread.
    pub fn raw_setup() -> (CudaContext, sys::CUstream) {
        let ctx = CudaContext::new(Default::default()).expect("context");
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: the context was just retained; the stand-in checks the rest.
        unsafe {
            ok(sys::cuCtxSetCurrent(ctx.cu_context()), "set current");
            ok(sys::cuStreamCreate(&mut s, 1), "stream");
        }
        (ctx, s)
    }

    /// `cuMemAllocAsync` of `bytes` on `s`.
    pub fn alloc(s: sys::CUstream, bytes: usize) -> sys::CUdeviceptr {
        let mut p = 0;
        // SAFETY: the stand-in checks the stream; p is a valid out pointer.
        ok(unsafe { sys::cuMemAllocAsync(&mut p, bytes, s) }, "alloc");
        p
    }

    /// The thread's current context (`cuCtxGetCurrent`).
    pub fn current() -> sys::CUcontext {
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        ok(unsafe { sys::cuCtxGetCurrent(&mut c) }, "get current");
        c
    }

    /// One of the stand-in's test hooks that report {device allocations,
    /// device bytes, page-locked host allocations, host bytes} for device
    /// `dev`: `memgov_standin_cuda_live` (what its primary context holds;
    /// `None` when it is not retained) or `memgov_standin_cuda_reclaimed`
    /// (what its destroyed primary contexts took with them).
    pub fn stand_in_query(hook: &str, dev: i32) -> Option<[u64; 4]> {
        use libloading::os::unix::{Library, RTLD_LAZY};
        /// glibc's `RTLD_NOLOAD`: find a loaded library, never load one.
        const RTLD_NOLOAD: std::os::raw::c_int = 4;
        // SAFETY: the stand-in is loaded already (cudarc opened it); NOLOAD
        // only finds it, and both hooks have the declared signature
        // (`int (int, unsigned long long out[4])`).
        unsafe {
            let lib = Library::open(Some("libcuda.so.1"), RTLD_NOLOAD | RTLD_LAZY)
                .expect("the stand-in libcuda is loaded");
            let query: libloading::os::unix::Symbol<unsafe extern "C" fn(i32, *mut u64) -> i32> =
                lib.get(hook.as_bytes()).expect(hook);
            let mut out = [u64::MAX; 4];
            (query(dev, out.as_mut_ptr()) == 0).then_some(out)
        }
    }

    /// What the stand-in's primary context of `dev` holds: {device
    /// allocations, device bytes, page-locked host allocations, host bytes}.
    pub fn stand_in_live(dev: i32) -> [u64; 4] {
        stand_in_query("memgov_standin_cuda_live", dev)
            .unwrap_or_else(|| panic!("device {dev} not retained"))
    }
}

/// `cuda.rs`'s: the `StandInBackend` implementation and the `vendor`
/// module of the shared core cases (`backends/cases/core.rs`).
macro_rules! core_table {
    () => {
        impl crate::cases::StandInBackend for memgov::cuda::CudaContext {
            fn open() -> Option<Self> {
                crate::context()
            }

            fn probe(&self) -> memgov::BackendProbe {
                memgov::cuda::CudaContext::probe(self)
            }

            fn pending_frees(&self) -> usize {
                memgov::cuda::CudaContext::pending_frees(self)
            }

            const STAND_IN_UUID_PREFIX: &'static [u8] = b"memgov-standin";
            const STAND_IN_PCI: &'static str = "0000:10:00.0";
            const STAND_IN_KEY: &'static str = "gpu-6d656d67-6f76-2d73-7461-6e64696e0000";
        }

        /// What the shared cases (`backends/cases/core.rs`) need of CUDA.
        mod vendor {
            use cudarc::driver::sys::{self, CUresult};
            use memgov::cuda::{CudaContext, CudaMemory, CudaStream};

            pub(crate) use crate::LATENCY;
            pub use memgov::cuda::CudaContext as Context;

            pub(crate) use crate::shared::Factory;

            /// The configurations the conformance suite runs on, by label.
            pub const SUITE_CONFIGS: &[(&str, Factory)] = &[("default", crate::factory)];

            crate::shared::core_vendor! {
                backend: "cuda",
                VENDOR: "CUDA",
                FAIL_CALLBACK_AT: "MEMGOV_STANDIN_CUDA_FAIL_HOST_FUNC_AT",
                OUT_OF_MEMORY: "CUDA_ERROR_OUT_OF_MEMORY (2)",
                DOUBLE_FREE: "cuMemFreeAsync of already freed pointer",
                UNKNOWN_FREE: "cuMemFreeAsync of unknown pointer",
                OUT_OF_BOUNDS: "out of bounds device pointer",
                HOST_FREE_UNDER_COPY: "cuMemFreeHost: page-locked host allocation",
                EVENT_AFTER_DESTROY: "cuEventRecord on destroyed event",
            }

            /// The child was aborted by the stand-in with a contract violation
            /// that names `what` (on the stand-in only).
            pub fn aborts(scenario: &str, env: &[(&str, &str)], what: &str) {
                crate::assert_stand_in_aborts(scenario, env, what);
            }

            /// Raw driver calls for the planted cases, on a context current on
            /// this thread.
            pub mod raw {
                use super::{ok, CUresult};
                use cudarc::driver::sys;
                use memgov::cuda::CudaContext;
                use memgov::DeviceContext;
                use std::ffi::c_void;

                include!("../../cases/forward.rs");

                pub(crate) type Code = CUresult;
                pub const SUCCESS: Code = CUresult::CUDA_SUCCESS;

                /// The entry points whose names the stand-in's messages carry.
                pub const SYNC: &str = "cuStreamSynchronize";
                pub const FREE_ASYNC: &str = "cuMemFreeAsync";
                pub const POOL_TRIM: &str = "cuMemPoolTrimTo";
                pub const POOL_ALLOC: &str = "cuMemAllocFromPoolAsync";

                /// A context and two raw streams of it (`s`, and `t` for the other
                /// stream), current on this thread.
                pub struct Raw {
                    ctx: CudaContext,
                    s: sys::CUstream,
                    t: sys::CUstream,
                }

                forward! {
                    free(r: &Raw, p: sys::CUdeviceptr) => sys::cuMemFreeAsync(p, r.s);
                    free_unknown(r: &Raw) => sys::cuMemFreeAsync(0xdead_0000, r.s);
                    htod(r: &Raw, p: sys::CUdeviceptr, src: &[u8]) =>
                        sys::cuMemcpyHtoDAsync_v2(p, src.as_ptr().cast(), src.len(), r.s);
                    htod_other(r: &Raw, p: sys::CUdeviceptr, src: &[u8]) =>
                        sys::cuMemcpyHtoDAsync_v2(p, src.as_ptr().cast(), src.len(), r.t);
                    sync(r: &Raw) => sys::cuStreamSynchronize(r.s);
                    stream_destroy(r: &Raw) => sys::cuStreamDestroy_v2(r.s);
                    event_destroy(e: sys::CUevent) => sys::cuEventDestroy_v2(e);
                    event_record(r: &Raw, e: sys::CUevent) => sys::cuEventRecord(e, r.s);
                    pool_destroy(pool: sys::CUmemoryPool) => sys::cuMemPoolDestroy(pool);
                    pool_trim(pool: sys::CUmemoryPool) => sys::cuMemPoolTrimTo(pool, 0);
                    pool_alloc(r: &Raw, pool: sys::CUmemoryPool, bytes: usize) =>
                        sys::cuMemAllocFromPoolAsync(&mut 0, bytes, pool, r.s);
                    host_free(host: *mut c_void) => sys::cuMemFreeHost(host);
                }

                /// `p` moved `n` bytes on.
                pub fn offset(p: sys::CUdeviceptr, n: u64) -> sys::CUdeviceptr {
                    p + n
                }

                /// Page-locked host memory, mapped: its host and device pointers.
                pub fn host_alloc(bytes: usize) -> (*mut c_void, sys::CUdeviceptr) {
                    let (mut host, mut p) = (std::ptr::null_mut(), 0);
                    // SAFETY: valid out pointers, the documented flags (portable,
                    // mapped); a context is current (`Raw::open`).
                    unsafe {
                        ok(sys::cuMemHostAlloc(&mut host, bytes, 3), "cuMemHostAlloc");
                        ok(
                            sys::cuMemHostGetDevicePointer_v2(&mut p, host, 0),
                            "device pointer",
                        );
                    }
                    (host, p)
                }

                impl Raw {
                    pub fn open() -> Self {
                        let (ctx, s) = crate::table::calls::raw_setup();
                        let mut t = std::ptr::null_mut();
                        // SAFETY: a valid out pointer; the context is current.
                        ok(unsafe { sys::cuStreamCreate(&mut t, 1) }, "stream");
                        Raw { ctx, s, t }
                    }

                    /// `cuMemAllocAsync` of `bytes` on `s`.
                    pub fn alloc(&self, bytes: usize) -> sys::CUdeviceptr {
                        crate::table::calls::alloc(self.s, bytes)
                    }

                    /// `cuEventCreate` (timing disabled).
                    pub fn event_create(&self) -> sys::CUevent {
                        let mut e = std::ptr::null_mut();
                        // SAFETY: a valid out pointer; the context is current.
                        ok(unsafe { sys::cuEventCreate(&mut e, 2) }, "event");
                        e
                    }

                    /// `cuMemPoolCreate` of a device pool on device 0.
                    pub fn pool_create(&self) -> sys::CUmemoryPool {
                        let mut pool = std::ptr::null_mut();
                        // SAFETY: zeroed properties are valid before the two set;
                        // a valid out pointer.
                        unsafe {
                            let mut props: sys::CUmemPoolProps = std::mem::zeroed();
                            props.allocType =
                                sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
                            props.location.type_ =
                                sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                            ok(sys::cuMemPoolCreate(&mut pool, &props), "pool");
                        }
                        pool
                    }

                    /// Destroys the streams, clears the thread's current context and
                    /// tears the context down.
                    pub fn close(self) {
                        // SAFETY: the live streams, each destroyed once; the current
                        // context cleared before the teardown releases it.
                        unsafe {
                            ok(sys::cuStreamDestroy_v2(self.s), "destroy");
                            ok(sys::cuStreamDestroy_v2(self.t), "destroy");
                            ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear current");
                        }
                        self.ctx.teardown(false).expect("teardown");
                    }
                }
            }

            /// How many devices the stand-in has.
            pub const DEVICES: &str = "MEMGOV_STANDIN_CUDA_DEVICES";

            /// Open device `ordinal` with the default settings.
            pub fn open_on(ordinal: u32) -> Result<CudaContext, memgov::BackendError> {
                let config = memgov::cuda::CudaConfig::default();
                CudaContext::new(memgov::cuda::CudaConfig { ordinal, ..config })
            }

            /// A context of configuration `label` on device `ordinal`.
            pub fn context_on(label: &str, ordinal: u32) -> CudaContext {
                assert_eq!(label, "default");
                CudaContext::new(memgov::cuda::CudaConfig {
                    ordinal,
                    ..memgov::cuda::CudaConfig::default()
                })
                .expect("context")
            }

            /// What a runtime has current on its thread: a device's retained
            /// primary context.
            pub struct Caller {
                device: sys::CUdevice,
                context: sys::CUcontext,
            }

            use crate::table::calls::{current as current_context, ok};

            impl Caller {
                /// Retains device `ordinal`'s primary context and makes it current.
                pub fn on_device(ordinal: i32) -> Self {
                    let (mut device, mut context) = (0, std::ptr::null_mut());
                    // SAFETY: plain driver calls with valid out pointers.
                    unsafe {
                        ok(sys::cuInit(0), "init");
                        ok(sys::cuDeviceGet(&mut device, ordinal), "device");
                        ok(
                            sys::cuDevicePrimaryCtxRetain(&mut context, device),
                            "retain",
                        );
                        ok(sys::cuCtxSetCurrent(context), "current");
                    }
                    Caller { device, context }
                }

                /// Its context is still the thread's current one.
                pub fn is_current(&self) -> bool {
                    current_context() == self.context
                }

                /// A thread that never had a context has none.
                pub fn fresh_thread_untouched() -> bool {
                    current_context().is_null()
                }

                /// Clears the thread's current context and releases the retained
                /// one.
                pub fn release(self) {
                    // SAFETY: the context retained in `on_device`, released once.
                    unsafe {
                        ok(sys::cuCtxSetCurrent(std::ptr::null_mut()), "clear");
                        ok(sys::cuDevicePrimaryCtxRelease_v2(self.device), "release");
                    }
                }
            }

            /// How an unavailable context's reason starts.
            pub const UNAVAILABLE: &[&str] = &["no CUDA driver", "no CUDA device"];
            /// Every CUDA context frees stream-ordered (`cuMemFreeAsync`).
            pub const ALWAYS_STREAM_ORDERED: bool = true;

            /// Whether `ctx` runs on memgov's stand-in driver.
            pub fn is_stand_in(ctx: &CudaContext) -> bool {
                ctx.is_stand_in()
            }

            /// CUDA's own: none beyond the shared case (CI runs it on a libcuda
            /// lacking entry points too).
            pub fn missing_driver_cases() {}

            /// The stand-in fails driver call N and all later as after an illegal
            /// address.
            pub const STICKY_ERROR_AT_OP: &str = "MEMGOV_STANDIN_CUDA_STICKY_ERROR_AT_OP";
            /// How a sticky error names the driver's code.
            pub const ILLEGAL_ADDRESS: &str = "CUDA_ERROR_ILLEGAL_ADDRESS (700)";

            /// CUDA's own sticky-error cases: none beyond the shared one.
            pub fn sticky_error_cases() {}

            /// After the lost context's retire: the driver answers no more, so
            /// nothing was freed, and the kept allocations went with the context
            /// at memgov's (last) release.
            pub fn after_sticky_retire() {
                let gone = crate::table::calls::stand_in_query("memgov_standin_cuda_reclaimed", 0)
                    .expect("device 0");
                assert!(gone[0] >= 1 && gone[1] >= 4096, "{gone:?}");
            }

            /// Lost teardowns in a row (each releases the last reference to the
            /// primary context, which the next context retains again).
            pub const LOST_TEARDOWN_ROUNDS: usize = 3;

            /// After a lost teardown on a healthy device: memgov freed its memory
            /// before releasing the primary context (whose destruction took nothing
            /// with it), and released that context (the last reference).
            pub fn nothing_left_after_lost_teardown(round: usize) {
                assert_eq!(
                    crate::table::calls::stand_in_query("memgov_standin_cuda_reclaimed", 0),
                    Some([0, 0, 0, 0]),
                    "round {round}: memory went with the context"
                );
                assert_eq!(
                    crate::table::calls::stand_in_query("memgov_standin_cuda_live", 0),
                    None,
                    "round {round}: the primary context is still retained"
                );
            }

            /// The child ran `scenario` to its end: what it printed, `None` (after
            /// printing why) off the stand-in.
            pub fn passes(scenario: &str, env: &[(&str, &str)]) -> Option<String> {
                let run = crate::child(scenario, env)?;
                let end = format!("child {scenario}: ok");
                crate::child_process::assert_passed(scenario, &run, &end);
                Some(run.output())
            }

            /// A context on the driver found.
            pub fn context() -> CudaContext {
                crate::factory().expect("context")
            }

            /// What a raw call on `ctx`'s memory needs current on the thread.
            pub struct Current(sys::CUcontext);

            pub fn current(ctx: &CudaContext) -> Current {
                Current(ctx.cu_context())
            }

            /// The memory's device pointer.
            pub fn device_address(m: &CudaMemory) -> u64 {
                m.device_ptr()
            }

            /// The stream's driver handle.
            pub fn stream_handle(s: &CudaStream) -> *const std::ffi::c_void {
                s.cu_stream().cast_const().cast()
            }

            /// Copies `m`'s first bytes into `dst` (a raw `cuMemcpyDtoHAsync_v2` on
            /// `s`, then `cuStreamSynchronize`, the context pushed current around
            /// them).
            ///
            /// # Safety
            ///
            /// `m` and `s` are live; `m` holds at least `dst.len()` bytes.
            pub unsafe fn copy_out_waited(
                c: &Current,
                s: &CudaStream,
                m: &CudaMemory,
                dst: &mut [u8],
            ) {
                let mut prev: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: a live context, popped below.
                let r = unsafe { sys::cuCtxPushCurrent_v2(c.0) };
                assert_eq!(r, CUresult::CUDA_SUCCESS, "push");
                // SAFETY: the caller's; `dst` outlives the copy, which the
                // synchronize completes.
                let (copy, sync) = unsafe {
                    (
                        sys::cuMemcpyDtoHAsync_v2(
                            dst.as_mut_ptr().cast(),
                            m.device_ptr(),
                            dst.len(),
                            s.cu_stream(),
                        ),
                        sys::cuStreamSynchronize(s.cu_stream()),
                    )
                };
                assert_eq!(
                    (copy, sync),
                    (CUresult::CUDA_SUCCESS, CUresult::CUDA_SUCCESS),
                    "raw copy out"
                );
                // SAFETY: balances the push.
                let r = unsafe { sys::cuCtxPopCurrent_v2(&mut prev) };
                assert_eq!(r, CUresult::CUDA_SUCCESS, "pop");
            }

            /// Whether `s`'s work has all run (`cuStreamQuery`: `CUDA_SUCCESS` or
            /// `CUDA_ERROR_NOT_READY`; any other result is returned as it is).
            pub fn stream_done(c: &Current, s: &CudaStream) -> Result<bool, CUresult> {
                let mut prev: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: a live context, popped below; a query of a live stream.
                let r = unsafe {
                    assert_eq!(sys::cuCtxPushCurrent_v2(c.0), CUresult::CUDA_SUCCESS);
                    let r = sys::cuStreamQuery(s.cu_stream());
                    assert_eq!(sys::cuCtxPopCurrent_v2(&mut prev), CUresult::CUDA_SUCCESS);
                    r
                };
                match r {
                    CUresult::CUDA_SUCCESS => Ok(true),
                    CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                    r => Err(r),
                }
            }

            /// Queues a copy of `src` into `m` on `s` (a raw
            /// `cuMemcpyHtoDAsync_v2`, the context pushed current around it) that
            /// the backend does not wait for.
            ///
            /// # Safety
            ///
            /// `m` and `s` are live; `src` outlives the copy.
            pub unsafe fn copy_in_unwaited(
                c: &Current,
                s: &CudaStream,
                m: &CudaMemory,
                src: &[u8],
            ) {
                // SAFETY: the caller's, and `c`'s context is live.
                unsafe { crate::table::raw_copy::copy_in_unwaited(c.0, s, m, src) }
            }
        }
    };
}

/// `capture.rs`'s: the `vendor` module of the shared capture cases
/// (`backends/cases/capture.rs`).
macro_rules! capture_table {
    () => {
        /// What the shared cases (`backends/cases/capture.rs`) need of CUDA.
        mod vendor {
            pub use crate::common::{
                aborts, entry_paused, fail_entry, fault_cells, passes, pause_entry, resume_entry,
                EXIT_CHECK, LATENCY, SEED,
            };
            pub use memgov::cuda::{
                capture_gate, ArenaConfig, CaptureConfig, CaptureMode, CudaArena as Arena,
                CudaConfig as Config, CudaContext as Context, CudaMemory as Memory, CudaStream as Stream,
                PoolExhausted,
            };

            crate::cases::capture_vendor! {
                backend: "cuda",
                make_current: "cuCtxPushCurrent_v2",
                htod: c"cuMemcpyHtoDAsync_v2",
                graph_launch: c"cuGraphLaunch",
                begin_capture: "cuStreamBeginCapture_v2",
                end_capture: "cuStreamEndCapture",
                destroy_capturing_abort: "in a capture sequence",
                launch_freed_abort: "cuGraphLaunch of 4096 bytes at already freed device pointer",
                churn_seeds: ["1", "2", "3"],
            }

            /// The stand-in's capture counters.
            pub use crate::common::capture_stats as stats;

            /// The raw driver calls the stand-in capture cases make.
            pub mod raw {
                use super::Context;
                use cudarc::driver::sys::{self, CUresult};
                use std::ffi::c_void;

                pub type Code = CUresult;
                pub type Status = sys::CUstreamCaptureStatus;
                pub type RawStream = sys::CUstream;

                pub(crate) use crate::cases::G;
                /// The capture modes, results and statuses, under neutral names.
                pub use sys::CUstreamCaptureMode::{
                    CU_STREAM_CAPTURE_MODE_GLOBAL as GLOBAL, CU_STREAM_CAPTURE_MODE_RELAXED as RELAXED,
                    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL as LOCAL,
                };
                pub use sys::CUstreamCaptureStatus::{
                    CU_STREAM_CAPTURE_STATUS_ACTIVE as ACTIVE,
                    CU_STREAM_CAPTURE_STATUS_INVALIDATED as STATUS_INVALIDATED,
                    CU_STREAM_CAPTURE_STATUS_NONE as NONE,
                };
                pub use CUresult::{
                    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED as INVALIDATED,
                    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED as UNSUPPORTED,
                    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD as WRONG_THREAD,
                };

                pub fn ok(r: Code, what: &str) {
                    assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
                }

                pub struct Raw {
                    ctx: Context,
                    pub s: RawStream,
                }

                /// A context current on this thread and a raw stream.
                pub fn raw() -> Raw {
                    let ctx = Context::new(Default::default()).expect("context");
                    let mut s = std::ptr::null_mut();
                    // SAFETY: raw calls on the stand-in with valid out pointers.
                    unsafe {
                        ok(sys::cuCtxSetCurrent(ctx.cu_context()), "current");
                        ok(sys::cuStreamCreate(&mut s, 1), "stream");
                    }
                    Raw { ctx, s }
                }

                pub fn alloc(r: &Raw, bytes: usize) -> u64 {
                    let mut p = 0;
                    // SAFETY: valid out pointer, live stream.
                    ok(unsafe { sys::cuMemAllocAsync(&mut p, bytes, r.s) }, "alloc");
                    p
                }

                pub fn begin(s: RawStream, mode: sys::CUstreamCaptureMode) {
                    // SAFETY: a live stream.
                    ok(unsafe { sys::cuStreamBeginCapture_v2(s, mode) }, "begin");
                }

                pub fn end(s: RawStream) -> (Code, sys::CUgraph) {
                    let mut g = std::ptr::null_mut();
                    // SAFETY: a live stream, valid out pointer.
                    let r = unsafe { sys::cuStreamEndCapture(s, &mut g) };
                    (r, g)
                }

                /// The stream's capture status (`cuStreamIsCapturing`) and, while
                /// it captures, the capture's id (`cuStreamGetCaptureInfo_v2`,
                /// which must report the same status).
                pub fn capture_info(s: RawStream) -> (Status, u64) {
                    let mut st = NONE;
                    ok(
                        // SAFETY: a live stream, valid out pointer.
                        unsafe { sys::cuStreamIsCapturing(s, &mut st) },
                        "is capturing",
                    );
                    if st != ACTIVE {
                        return (st, 0);
                    }
                    let (mut info, mut id) = (NONE, 0);
                    ok(
                        // SAFETY: a live stream, valid out pointers, the optional ones
                        // null.
                        unsafe {
                            sys::cuStreamGetCaptureInfo_v2(
                                s,
                                &mut info,
                                &mut id,
                                std::ptr::null_mut(),
                                std::ptr::null_mut(),
                                std::ptr::null_mut(),
                            )
                        },
                        "info",
                    );
                    assert_eq!(info, st, "both calls report the same status");
                    (st, id)
                }

                pub fn instantiate(g: sys::CUgraph) -> sys::CUgraphExec {
                    let mut e = std::ptr::null_mut();
                    ok(
                        // SAFETY: a graph from cuStreamEndCapture, valid out pointer.
                        unsafe { sys::cuGraphInstantiateWithFlags(&mut e, g, 0) },
                        "instantiate",
                    );
                    e
                }

                /// A physical allocation of a granule on device 0.
                pub fn create_handle() -> (Code, sys::CUmemGenericAllocationHandle) {
                    // SAFETY: plain C struct, all-zero valid.
                    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
                    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
                    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                    let mut h = 0;
                    // SAFETY: valid out pointer and properties.
                    let r = unsafe { sys::cuMemCreate(&mut h, G, &p, 0) };
                    (r, h)
                }

                /// What another thread runs before its raw calls on `r`: `r`'s
                /// context made current there.
                pub fn enter(r: &Raw) -> impl FnOnce() + Send + 'static {
                    // The handle as an address, which a closure may carry.
                    let c = r.ctx.cu_context() as usize;
                    move || {
                        ok(
                            // SAFETY: `r`'s context, alive while the thread runs.
                            unsafe { sys::cuCtxSetCurrent(c as sys::CUcontext) },
                            "current",
                        );
                    }
                }

                include!("../../cases/forward.rs");

                forward! {
                    htod(d: u64, src: &[u8], s: RawStream) =>
                        sys::cuMemcpyHtoDAsync_v2(d, src.as_ptr().cast(), src.len(), s);
                    dtoh(dst: &mut [u8], d: u64, s: RawStream) =>
                        sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), d, dst.len(), s);
                    graph_destroy(g: sys::CUgraph) => sys::cuGraphDestroy(g);
                    exec_destroy(x: sys::CUgraphExec) => sys::cuGraphExecDestroy(x);
                    launch(x: sys::CUgraphExec, s: RawStream) => sys::cuGraphLaunch(x, s);
                    sync(s: RawStream) => sys::cuStreamSynchronize(s);
                    query(s: RawStream) => sys::cuStreamQuery(s);
                    free_async(d: u64, s: RawStream) => sys::cuMemFreeAsync(d, s);
                    stream_destroy(s: RawStream) => sys::cuStreamDestroy_v2(s);
                    host_alloc(p: &mut *mut c_void, bytes: usize) => sys::cuMemHostAlloc(p, bytes, 0);
                    host_free(p: *mut c_void) => sys::cuMemFreeHost(p);
                    mem_release(h: sys::CUmemGenericAllocationHandle) => sys::cuMemRelease(h);
                    map(base: u64, size: usize, h: sys::CUmemGenericAllocationHandle) =>
                        sys::cuMemMap(base, size, 0, h, 0);
                    unmap(base: u64, size: usize) => sys::cuMemUnmap(base, size);
                }

                /// An address range of `size` bytes reserved.
                pub fn reserve(size: usize) -> u64 {
                    let mut base = 0;
                    ok(
                        // SAFETY: valid out pointer.
                        unsafe { sys::cuMemAddressReserve(&mut base, size, 0, 0, 0) },
                        "reserve",
                    );
                    base
                }

                /// Read-write access to `size` bytes at `base` for device 0.
                ///
                /// # Safety
                ///
                /// The driver's: a mapped range.
                pub unsafe fn set_access(base: u64, size: usize) -> Code {
                    let desc = sys::CUmemAccessDesc {
                        location: sys::CUmemLocation {
                            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                            id: 0,
                        },
                        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                    };
                    // SAFETY: the caller's; one valid descriptor.
                    unsafe { sys::cuMemSetAccess(base, size, &desc, 1) }
                }
            }
        }
    };
}

/// `arena.rs`'s: the `vendor` module of the shared arena cases
/// (`backends/cases/arena.rs`).
macro_rules! arena_table {
    () => {
        /// What the shared cases (`backends/cases/arena.rs`) need of CUDA.
        mod vendor {
            pub use crate::common::{
                aborts, child, fault_cells, passes, vmm, BANNER, EXIT_CHECK, LATENCY, SEED,
            };
            pub use memgov::cuda::{
                ArenaConfig, CudaArena as Arena, CudaConfig as Config, CudaContext as Context,
                CudaMemory as Memory, CudaStream as Stream,
            };

            /// The arena's name in its messages.
            pub const ARENA_NAME: &str = "CudaArena";
            /// The driver's virtual memory calls, as their fault cells and
            /// messages name them.
            pub use crate::common::{
                CREATE_ENTRY, MAP_ENTRY, RELEASE_ENTRY, SET_ACCESS_ENTRY, UNMAP_ENTRY,
            };
            /// The stand-in's knobs failing the `n`th virtual memory call, and the
            /// `n`th unmap.
            pub use crate::common::{FAIL_UNMAP_AT, FAIL_VMM_AT};
            /// The latency seeds of the growth and shrinking, plain and governed.
            pub const GROW_SHRINK_SEEDS: &[&str] = &["1", "2", "3"];
            pub const GOVERNED_GROW_SHRINK_SEEDS: &[&str] = &["1", "2", "3"];
            /// Whether `destroy_stream` returns only once the stream's queued work
            /// ran and its signals fired (the trait allows either).
            pub const DESTROY_STREAM_FINISHES_ITS_WORK: bool = false;
            /// The raw driver calls the stand-in's virtual memory cases make.
            pub(crate) use crate::own as raw;

            /// The sleep/wake cycles when `MEMGOV_ARENA_SLEEP_CYCLES` is not set.
            pub const SLEEP_CYCLES: u64 = 100;

            /// The device address of `m`.
            pub fn at(m: &Memory) -> u64 {
                m.device_ptr()
            }

            /// Queues a copy of `src` into `m` on `s` that the backend does not
            /// wait for (a raw `cuMemcpyHtoDAsync_v2`).
            ///
            /// # Safety
            ///
            /// `m` is mapped and accessible; `src` outlives the copy.
            pub unsafe fn copy_in_unwaited(ctx: &Context, s: &Stream, m: &Memory, src: &[u8]) {
                // SAFETY: the caller's, and `ctx`'s context is live.
                unsafe {
                    crate::common::table::raw_copy::copy_in_unwaited(ctx.cu_context(), s, m, src)
                }
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

        /// What the shared part needs of CUDA.
        mod vendor {
            use std::ffi::CStr;

            pub use memgov::cuda::{
                ArenaConfig, CudaArena as Arena, CudaConfig as Config, CudaContext as Context,
            };

            stand_in! {
                vendor: "cuda",
                VENDOR: "CUDA",
                library: "libcuda",
                RELEASE_ENTRY: "cuMemRelease",
                MAP_ENTRY: "cuMemMap",
                HOST_ALLOC_ENTRY: "cuMemHostAlloc",
                CREATE_ENTRY: "cuMemCreate",
                SET_ACCESS_ENTRY: "cuMemSetAccess",
                UNMAP_ENTRY: "cuMemUnmap",
            }

            /// Whether `ctx` runs on the stand-in.
            pub fn is_stand_in(ctx: &Context) -> bool {
                ctx.is_stand_in()
            }

            /// A symbol of the loaded stand-in libcuda.
            pub fn standin_symbol(name: &CStr) -> *mut std::ffi::c_void {
                use libloading::os::unix::{Library, RTLD_LAZY};
                const RTLD_NOLOAD: std::os::raw::c_int = 4;
                // SAFETY: the stand-in is loaded already (cudarc opened it); the
                // caller calls the symbol with its declared type.
                unsafe {
                    let lib = Library::open(Some("libcuda.so.1"), RTLD_NOLOAD | RTLD_LAZY)
                        .expect("the stand-in libcuda is loaded");
                    let f: libloading::os::unix::Symbol<*mut std::ffi::c_void> = lib
                        .get(name.to_bytes_with_nul())
                        .expect("the stand-in's hook");
                    *f
                }
            }
        }
    };
}
