//! The structs and constants of `include/memgov.h`, as Rust declares them.
//! The ABI layout test compiles the header and compares every size and
//! offset with these.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_void};

/// The ABI version `memgov_abi_version()` returns: raised on every change
/// that is not an addition at the end of a sized struct or a new function.
pub const MEMGOV_ABI_VERSION: u32 = 2;

/// A budget of no limit beyond the device (`memgov_context_options.budget`,
/// `memgov_context_set_budget`; `memgov_snapshot.budget_limit` of such a
/// context). A budget of 0 admits nothing, as in Rust's
/// `ContextConfig::budget(0)`.
pub const MEMGOV_UNLIMITED: u64 = u64::MAX;

/// Capability bit: the host backend is compiled in.
pub const MEMGOV_CAP_BACKEND_HOST: u64 = 1 << 0;
/// Capability bit: the null backend is compiled in.
pub const MEMGOV_CAP_BACKEND_NULL: u64 = 1 << 1;
/// Capability bit: the CUDA backend is compiled in.
pub const MEMGOV_CAP_BACKEND_CUDA: u64 = 1 << 2;
/// Capability bit: the HIP backend is compiled in.
pub const MEMGOV_CAP_BACKEND_HIP: u64 = 1 << 3;
/// Capability bit: the Vulkan backend is compiled in.
pub const MEMGOV_CAP_BACKEND_VULKAN: u64 = 1 << 4;
/// Capability bit: `memgov_buffer_record_stream` and `memgov_buffer_release_on`.
pub const MEMGOV_CAP_RECORD_STREAM: u64 = 1 << 8;
/// Capability bit: `memgov_pressure_callback_add`.
pub const MEMGOV_CAP_PRESSURE_CALLBACKS: u64 = 1 << 9;
/// Capability bit: the plugin registry, unload gate and loader.
pub const MEMGOV_CAP_PLUGIN_LOADER: u64 = 1 << 10;
/// Capability bit: `memgov_torch_alloc` / `memgov_torch_free`.
pub const MEMGOV_CAP_TORCH_ALLOCATOR: u64 = 1 << 11;
/// Capability bit: `memgov_ort_allocator_create`.
pub const MEMGOV_CAP_ORT_ALLOCATOR: u64 = 1 << 12;
/// Capability bit: capacity reservations (not in the C ABI yet, though the
/// Rust API has `ContextHandle::reserve`; never set).
pub const MEMGOV_CAP_RESERVATIONS: u64 = 1 << 13;

/// Roles, as `uint32_t` in C.
pub const MEMGOV_ROLE_WEIGHTS: u32 = 0;
/// Attention key/value cache.
pub const MEMGOV_ROLE_KV_CACHE: u32 = 1;
/// Activations.
pub const MEMGOV_ROLE_ACTIVATION: u32 = 2;
/// Kernel scratch space.
pub const MEMGOV_ROLE_WORKSPACE: u32 = 3;
/// Anything else.
pub const MEMGOV_ROLE_OTHER: u32 = 4;
/// Number of roles (length of `memgov_snapshot.by_role`).
pub const MEMGOV_ROLE_COUNT: usize = 5;

/// Lifecycle values of `memgov_snapshot.lifecycle`.
pub const MEMGOV_LIFECYCLE_ACTIVE: u32 = 0;
/// Refusing new work, waiting for outstanding work.
pub const MEMGOV_LIFECYCLE_RETIRING: u32 = 1;
/// Device lost.
pub const MEMGOV_LIFECYCLE_LOST: u32 = 2;
/// Torn down.
pub const MEMGOV_LIFECYCLE_TERMINATED: u32 = 3;

/// Options of `memgov_context_open`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct memgov_context_options {
    /// `sizeof(memgov_context_options)`.
    pub size: u32,
    /// Zero.
    pub reserved: u32,
    /// Backend name: "host", "null", "cuda", "hip", "vulkan".
    pub backend: *const c_char,
    /// Label in messages and snapshots; NULL: `backend:ordinal`.
    pub label: *const c_char,
    /// Bytes the context may hold: 0 admits nothing; [`MEMGOV_UNLIMITED`]:
    /// no budget beyond the device.
    pub budget: u64,
    /// 0: an allocation that does not fit fails at once; otherwise it waits
    /// up to this long for pending releases to retire.
    pub wait_for_pending_ms: u64,
    /// Host backend only: simulated time each queued operation takes.
    pub host_op_delay_us: u64,
}

impl Default for memgov_context_options {
    fn default() -> Self {
        Self {
            size: 0,
            reserved: 0,
            backend: std::ptr::null(),
            label: std::ptr::null(),
            budget: MEMGOV_UNLIMITED,
            wait_for_pending_ms: 0,
            host_op_delay_us: 0,
        }
    }
}

/// What a pressure callback is asked for.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct memgov_pressure_request {
    /// `sizeof(memgov_pressure_request)` of the library.
    pub size: u32,
    /// Role of the allocation that did not fit.
    pub role: u32,
    /// Its size.
    pub requested: u64,
    /// Bytes that would have to be given back for it to fit.
    pub shortfall: u64,
}

/// A pressure callback: returns the bytes it gave back (an estimate).
pub type memgov_pressure_fn =
    Option<unsafe extern "C" fn(request: *const memgov_pressure_request, user: *mut c_void) -> u64>;

/// A plugin's init function (`memgov_plugin_open`): 0 on success.
pub type memgov_plugin_init_fn =
    Option<unsafe extern "C" fn(plugin: *mut crate::memgov_plugin, host_data: *mut c_void) -> i32>;

/// How a context's teardown ended.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct memgov_teardown_report {
    /// `sizeof(memgov_teardown_report)`.
    pub size: u32,
    /// 1 if the device was lost (teardown did not touch it).
    pub lost: u32,
    /// 1 if force reclaimed live buffers and streams.
    pub forced: u32,
    /// `MEMGOV_OK`, or the status of the backend's teardown error.
    pub backend_status: i32,
    /// Stream-ordered releases whose free executed.
    pub retired_releases: u64,
    /// Releases whose signal was dropped unfired.
    pub abandoned_releases: u64,
    /// Live buffers of a lost device released without calling it.
    pub settled_lost: u64,
    /// Live buffers reclaimed by force.
    pub reclaimed_buffers: u64,
    /// Bytes in quarantine that died with the context.
    pub quarantined_bytes: u64,
    /// Bytes whose free never ran on the device, returned by the teardown.
    pub awaiting_teardown_bytes: u64,
    /// Releases of a lost device the backend still held (a backend bug if
    /// nonzero).
    pub unsettled_releases: u64,
    /// From the first retire to the end of teardown, in nanoseconds.
    pub elapsed_ns: u64,
}

/// Bytes and objects of one role.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct memgov_role_usage {
    /// Bytes in live buffers.
    pub live_bytes: u64,
    /// Live buffers.
    pub live_count: u64,
    /// Bytes whose release is queued and has not retired.
    pub pending_bytes: u64,
    /// Releases queued and not retired.
    pub pending_count: u64,
    /// Bytes whose release the backend refused.
    pub quarantined_bytes: u64,
    /// Releases the backend refused.
    pub quarantined_count: u64,
}

/// One context at one moment.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct memgov_snapshot {
    /// `sizeof(memgov_snapshot)`.
    pub size: u32,
    /// `MEMGOV_LIFECYCLE_*`.
    pub lifecycle: u32,
    /// The context's budget ([`MEMGOV_UNLIMITED`]: none beyond the device).
    pub budget_limit: u64,
    /// Bytes charged (live + pending + quarantined + awaiting teardown).
    pub charged: u64,
    /// Highest `charged` seen.
    pub peak: u64,
    /// Bytes whose free never ran, charged until teardown.
    pub awaiting_teardown: u64,
    /// Every role together.
    pub total: memgov_role_usage,
    /// Per role, indexed by `MEMGOV_ROLE_*`.
    pub by_role: [memgov_role_usage; MEMGOV_ROLE_COUNT],
    /// Pins held by live streams.
    pub pins_streams: u64,
    /// Pins held by live buffers.
    pub pins_buffers: u64,
    /// Pins held by releases not retired.
    pub pins_pending_releases: u64,
    /// Pins held through pin sources.
    pub pins_external: u64,
    /// Other pins (allocations in flight).
    pub pins_other: u64,
    /// Allocations admitted.
    pub allocations: u64,
    /// Releases queued.
    pub releases_queued: u64,
    /// Releases whose free executed.
    pub retired: u64,
    /// Releases whose signal was dropped unfired.
    pub abandoned: u64,
    /// Releases the backend refused.
    pub quarantined: u64,
    /// Allocations refused for lack of room.
    pub admission_refusals: u64,
    /// Pressure callback calls.
    pub pressure_calls: u64,
    /// Backend calls that returned an error.
    pub backend_errors: u64,
}

/// What is still outstanding against a plugin.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct memgov_plugin_outstanding {
    /// `sizeof(memgov_plugin_outstanding)`.
    pub size: u32,
    /// Zero.
    pub reserved: u32,
    /// Live streams it created.
    pub streams: u64,
    /// Live buffers it allocated.
    pub buffers: u64,
    /// Their bytes.
    pub buffer_bytes: u64,
    /// Releases of its buffers queued and not known to have retired.
    pub pending_releases: u64,
    /// Live pin sources it created.
    pub pin_sources: u64,
    /// Pins it holds.
    pub pins: u64,
    /// Pressure callbacks registered and not removed, or still running.
    pub callbacks: u64,
    /// ORT allocators it created and has not destroyed.
    pub allocators: u64,
}

impl memgov_plugin_outstanding {
    /// Everything together.
    pub fn total(&self) -> u64 {
        self.streams
            + self.buffers
            + self.pending_releases
            + self.pin_sources
            + self.pins
            + self.callbacks
            + self.allocators
    }
}

/// An allocator in the shape of ONNX Runtime's `OrtAllocator` (its first
/// five members, version 18): cast a `memgov_ort_allocator*` to
/// `OrtAllocator*`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_snake_case)]
pub struct memgov_ort_allocator {
    /// `MEMGOV_ORT_ALLOCATOR_VERSION` (18: `Reserve` present, no later members).
    pub version: u32,
    /// `OrtAllocator::Alloc`.
    pub Alloc:
        Option<unsafe extern "C" fn(this: *mut memgov_ort_allocator, size: usize) -> *mut c_void>,
    /// `OrtAllocator::Free`.
    pub Free: Option<unsafe extern "C" fn(this: *mut memgov_ort_allocator, p: *mut c_void)>,
    /// `OrtAllocator::Info`: the `OrtMemoryInfo*` given at creation.
    pub Info: Option<unsafe extern "C" fn(this: *const memgov_ort_allocator) -> *const c_void>,
    /// `OrtAllocator::Reserve`: an allocation of the `weights` role.
    pub Reserve:
        Option<unsafe extern "C" fn(this: *mut memgov_ort_allocator, size: usize) -> *mut c_void>,
}

/// The `OrtAllocator::version` memgov's allocators carry.
pub const MEMGOV_ORT_ALLOCATOR_VERSION: u32 = 18;
