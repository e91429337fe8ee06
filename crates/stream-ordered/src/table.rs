//! The vendor table: a vendor's entry points under the core's neutral
//! names, each part in a trait of its own ([`VmmTable`] for the
//! virtual-memory arena and its copies, [`CaptureTable`] for stream capture
//! and graphs, both on the vendor type beside its [`Vendor`] results), the
//! names its messages use ([`VmmNames`], [`CaptureNames`]), and the context
//! the calls run in ([`Context`], on the vendor's shared state).
//!
//! Handles cross the table as the vendor's own types (`CUstream`,
//! `hipStream_t`, ...), device addresses as `u64` and host addresses as
//! `usize`; [`Raw`] carries a handle across threads.

use crate::result::{Checked, Vendor};
pub use crate::state::Raw;
use crate::state::State;
use memgov_backend::capability::CaptureMode;
use memgov_backend::shell::{self, Current, MakeCurrent, Shell};
use memgov_backend::vmm::{self, Gate};
use memgov_backend::{BackendError, BackendProbe};
use std::fmt::Debug;
use std::ops::Deref;
use std::time::Duration;

/// The vendor's names of its virtual-memory, copy and stream calls, for
/// messages (`cuMemMap` / `hipMemMap`: tests and CI scripts grep them).
#[derive(Debug, Clone, Copy)]
pub struct VmmNames {
    /// The public arena handle (the arena module's `ArenaHandle`
    /// under the vendor's name, `CudaArena`), which errors point to.
    pub arena: &'static str,
    /// [`VmmTable::mem_granularity`] (`cuMemGetAllocationGranularity`).
    pub mem_granularity: &'static str,
    /// [`VmmTable::mem_address_reserve`] (`cuMemAddressReserve`).
    pub mem_address_reserve: &'static str,
    /// [`VmmTable::mem_address_free`] (`cuMemAddressFree`).
    pub mem_address_free: &'static str,
    /// [`VmmTable::mem_get_info`] (`cuMemGetInfo_v2`).
    pub mem_get_info: &'static str,
    /// [`VmmTable::stream_query`] (`cuStreamQuery`).
    pub stream_query: &'static str,
    /// [`VmmTable::mem_create`] (`cuMemCreate`).
    pub mem_create: &'static str,
    /// [`VmmTable::mem_map`] (`cuMemMap`).
    pub mem_map: &'static str,
    /// [`VmmTable::mem_set_access`] (`cuMemSetAccess`).
    pub mem_set_access: &'static str,
    /// [`VmmTable::mem_unmap`] (`cuMemUnmap`).
    pub mem_unmap: &'static str,
    /// [`VmmTable::mem_release`] (`cuMemRelease`).
    pub mem_release: &'static str,
    /// [`VmmTable::host_alloc`] (`cuMemHostAlloc`).
    pub host_alloc: &'static str,
    /// [`VmmTable::host_free`] (`cuMemFreeHost`).
    pub host_free: &'static str,
    /// [`VmmTable::stream_create`] (`cuStreamCreate`).
    pub stream_create: &'static str,
    /// [`VmmTable::stream_sync`] (`cuStreamSynchronize`).
    pub stream_sync: &'static str,
    /// [`VmmTable::copy_dtoh_async`] (`cuMemcpyDtoHAsync_v2`).
    pub copy_dtoh_async: &'static str,
    /// [`VmmTable::copy_htod_async`] (`cuMemcpyHtoDAsync_v2`).
    pub copy_htod_async: &'static str,
}

/// A vendor's entry points for the arena: physical memory, its mapping into
/// a reserved range, page-locked host memory, and the copy stream. Each
/// returns the driver's code (and, for a constructor, the value written to
/// its out parameter, meaningful only on success). The caller has the
/// arena's device current.
pub trait VmmTable: Vendor {
    /// A handle of physical memory (`CUmemGenericAllocationHandle`).
    type Handle: Copy + Eq + Debug + Send + Sync + 'static;
    /// A raw stream handle (`CUstream`, `hipStream_t`).
    type Stream: Copy;
    /// What a granule is created with: the allocation properties, which name
    /// the device (and, on HIP, are in the loaded runtime's layout).
    type Prop;

    /// The calls' names, for messages.
    const NAMES: VmmNames;

    /// The recommended granularity of memory created with `prop`.
    ///
    /// # Safety
    ///
    /// The device is current.
    unsafe fn mem_granularity(prop: &Self::Prop) -> (Self::Code, usize);

    /// Reserve `bytes` of device address space aligned to `align`; returns
    /// its base.
    ///
    /// # Safety
    ///
    /// The device is current; the reservation is freed once, with
    /// [`mem_address_free`](Self::mem_address_free).
    unsafe fn mem_address_reserve(bytes: usize, align: usize) -> (Self::Code, u64);

    /// Free the reservation at `at` of `bytes`.
    ///
    /// # Safety
    ///
    /// Nothing is mapped in it; freed once.
    unsafe fn mem_address_free(at: u64, bytes: usize) -> Self::Code;

    /// The device's free and total memory in bytes.
    ///
    /// # Safety
    ///
    /// The device is current.
    unsafe fn mem_get_info() -> (Self::Code, usize, usize);

    /// Whether everything queued on `stream` ran (the vendor's success), is
    /// still running ([`Class::NotReady`](crate::Class::NotReady)), or failed.
    ///
    /// # Safety
    ///
    /// `stream` is live.
    unsafe fn stream_query(stream: Self::Stream) -> Self::Code;

    /// Create `bytes` of pinned device memory with `prop`.
    ///
    /// # Safety
    ///
    /// The device is current; `bytes` is a multiple of the granularity.
    unsafe fn mem_create(bytes: usize, prop: &Self::Prop) -> (Self::Code, Self::Handle);

    /// Map handle `h` (of exactly `bytes`) at `at`.
    ///
    /// # Safety
    ///
    /// `[at, at + bytes)` lies in a reservation and nothing is mapped there.
    unsafe fn mem_map(at: u64, bytes: usize, h: Self::Handle) -> Self::Code;

    /// Make `[at, at + bytes)` readable and writable from the device
    /// `prop` names.
    ///
    /// # Safety
    ///
    /// The range is exactly one mapping made by [`mem_map`](Self::mem_map).
    unsafe fn mem_set_access(at: u64, bytes: usize, prop: &Self::Prop) -> Self::Code;

    /// Unmap `[at, at + bytes)`.
    ///
    /// # Safety
    ///
    /// The range is one mapping no allocation or queued work uses.
    unsafe fn mem_unmap(at: u64, bytes: usize) -> Self::Code;

    /// Release handle `h`.
    ///
    /// # Safety
    ///
    /// `h` was created by [`mem_create`](Self::mem_create) and is released
    /// once.
    unsafe fn mem_release(h: Self::Handle) -> Self::Code;

    /// Allocate `bytes` of page-locked host memory usable from any context;
    /// returns its address.
    ///
    /// # Safety
    ///
    /// The device is current.
    unsafe fn host_alloc(bytes: usize) -> (Self::Code, usize);

    /// Free page-locked host memory.
    ///
    /// # Safety
    ///
    /// `host` came from [`host_alloc`](Self::host_alloc), is freed once,
    /// and no queued copy uses it.
    unsafe fn host_free(host: usize) -> Self::Code;

    /// Create a non-blocking stream on the current device.
    ///
    /// # Safety
    ///
    /// The device is current.
    unsafe fn stream_create() -> (Self::Code, Self::Stream);

    /// Wait for everything queued on `stream`.
    ///
    /// # Safety
    ///
    /// `stream` is live.
    unsafe fn stream_sync(stream: Self::Stream) -> Self::Code;

    /// Destroy `stream` (its queued work runs first).
    ///
    /// # Safety
    ///
    /// `stream` is live and destroyed once.
    unsafe fn stream_destroy(stream: Self::Stream) -> Self::Code;

    /// Queue a copy of `bytes` from device address `at` to host address
    /// `host` on `stream`.
    ///
    /// # Safety
    ///
    /// Both ranges are valid for `bytes` until the copy completes; the
    /// stream is live.
    unsafe fn copy_dtoh_async(
        host: usize,
        at: u64,
        bytes: usize,
        stream: Self::Stream,
    ) -> Self::Code;

    /// Queue a copy of `bytes` from host address `host` to device address
    /// `at` on `stream`.
    ///
    /// # Safety
    ///
    /// As for [`copy_dtoh_async`](Self::copy_dtoh_async).
    unsafe fn copy_htod_async(
        at: u64,
        host: usize,
        bytes: usize,
        stream: Self::Stream,
    ) -> Self::Code;
}

/// The code type of a context's table.
pub type CodeOf<C> = <<C as Context>::Table as Vendor>::Code;
/// The physical-memory handle of a context's table.
pub type HandleOf<C> = <<C as Context>::Table as VmmTable>::Handle;

/// A context the core's calls run in: implemented by the vendor's shared
/// state, which makes its device current ([`MakeCurrent`]: CUDA pushes its
/// context, HIP sets the thread's device) and keeps its lost state.
pub trait Context: MakeCurrent + Sized + Send + Sync + 'static {
    /// The vendor's table.
    type Table: CaptureTable;
    /// The vendor's public stream (`CudaStream`).
    type Stream;
    /// The vendor's arena: the books ([`vmm::Arena`], reached through
    /// `Deref`) and what the vendor keeps beside them.
    type Arena: Deref<Target = vmm::Arena<HandleOf<Self>>> + Send + Sync + 'static;

    /// `Ok` for success; else the classified error. A sticky code marks the
    /// context lost and dead (the shell), then runs
    /// [`on_sticky`](Self::on_sticky).
    fn checked(
        &self,
        op: &'static str,
        call: &str,
        code: CodeOf<Self>,
    ) -> Result<(), BackendError> {
        self.shell().checked(op, call, code).inspect_err(|e| {
            if e.is_device_lost() {
                self.on_sticky();
            }
        })
    }

    /// What the vendor does once a sticky code was seen, the context marked
    /// lost and dead: queued work no longer runs after one, so CUDA drops
    /// the signals of its queued frees unfired (their host functions will
    /// never run) and HIP wakes every wait for outstanding work.
    fn on_sticky(&self) {}

    /// The process's capture gate for this vendor: a call that would break
    /// a capture under way waits (or is refused on the capturing thread).
    fn capture_gate(&self) -> &'static Gate;

    /// Wait until every stream of the context ran what is queued on it.
    fn quiesce(&self, op: &'static str) -> Result<(), BackendError>;

    /// The properties the granules of `arena` are created with.
    fn granule_prop(arena: &Self::Arena) -> <Self::Table as VmmTable>::Prop;

    /// The context's lost, dead and closing state, and its probe: the
    /// shell every checked call goes through.
    fn shell(&self) -> &Shell<Checked<Self::Table>> {
        &self.state().shell
    }

    /// What the context holds whatever the vendor ([`State`]): the vendor's
    /// shared state extends it.
    fn state(&self) -> &State<Self::Table, <Self::Table as VmmTable>::Stream>;

    /// Refuse work on a lost or closing context, with no driver call.
    fn check_usable(&self, op: &'static str) -> Result<(), BackendError> {
        self.shell().check_usable(op)
    }

    /// Whether the context was lost (declared by the governor, or a sticky
    /// code from the driver).
    fn is_lost(&self) -> bool {
        self.shell().is_lost()
    }

    /// The probe the context's driver calls, frees and violations are
    /// counted on.
    fn probe(&self) -> &BackendProbe {
        self.shell().probe()
    }

    /// Make the context current on the calling thread until the returned
    /// guard drops, which makes the thread's previous context (or device)
    /// current again ([`MakeCurrent`]; nothing is done when it is current
    /// already).
    fn make_current(&self, op: &'static str) -> Result<Current<'_, Self>, BackendError> {
        shell::make_current(self, op)
    }

    /// The raw handle of `stream` once it is checked to be a live stream of
    /// this context (`InvalidArgument` otherwise: another context's, or
    /// destroyed).
    fn raw_stream(
        &self,
        op: &'static str,
        stream: &Self::Stream,
    ) -> Result<<Self::Table as VmmTable>::Stream, BackendError>;

    /// Sleeps of the arena against copies and launches between their awake
    /// check and their enqueue.
    fn sleep_gate(&self) -> &vmm::SleepGate {
        &self.state().sleep_gate
    }

    /// Wait until every graph launch of the context finished, the device
    /// current (CUDA: `cuCtxSynchronize`; HIP, which has no such call
    /// per context: [`quiesce`](Self::quiesce)).
    fn wait_launches(&self, op: &'static str) -> Result<(), BackendError>;
}

/// A device address as a vendor's API types it ([`CaptureTable::DevicePtr`]).
pub trait DevicePtr: Copy + std::fmt::Debug + Eq {
    /// The address `at`.
    fn from_addr(at: u64) -> Self;
}

/// `CUdeviceptr`.
impl DevicePtr for u64 {
    fn from_addr(at: u64) -> Self {
        at
    }
}

/// `hipDeviceptr_t`.
impl DevicePtr for *mut std::ffi::c_void {
    fn from_addr(at: u64) -> Self {
        at as usize as Self
    }
}

/// The vendor's names of its capture and graph calls, for messages.
#[derive(Debug, Clone, Copy)]
pub struct CaptureNames {
    /// The public capture (the capture module's `Capture` under the
    /// vendor's name, `CudaCapture`).
    pub capture: &'static str,
    /// The public graph (the capture module's `Graph`, `CudaGraph`).
    pub graph: &'static str,
    /// The context setting that makes an arena (`CudaConfig::arena`), which
    /// a capture needs.
    pub arena_setting: &'static str,
    /// [`CaptureTable::begin_capture`] (`cuStreamBeginCapture_v2`).
    pub begin_capture: &'static str,
    /// [`CaptureTable::capture_id`] (`cuStreamGetCaptureInfo_v2`).
    pub capture_id: &'static str,
    /// [`CaptureTable::end_capture`] (`cuStreamEndCapture`).
    pub end_capture: &'static str,
    /// [`CaptureTable::instantiate`] (`cuGraphInstantiateWithFlags`).
    pub instantiate: &'static str,
    /// [`CaptureTable::exec_destroy`] (`cuGraphExecDestroy`).
    pub exec_destroy: &'static str,
    /// [`CaptureTable::graph_destroy`] (`cuGraphDestroy`).
    pub graph_destroy: &'static str,
    /// [`CaptureTable::launch`] (`cuGraphLaunch`).
    pub launch: &'static str,
}

/// A vendor's stream-capture and graph entry points. The caller has the
/// context's device current.
pub trait CaptureTable: VmmTable {
    /// A graph (`CUgraph`, `hipGraph_t`).
    type Graph: Copy;
    /// An executable graph (`CUgraphExec`, `hipGraphExec_t`).
    type Exec: Copy;

    /// A device address as the vendor's API types it (`CUdeviceptr`, a
    /// `u64`; `hipDeviceptr_t`, a pointer).
    type DevicePtr: DevicePtr;

    /// The calls' names, for messages.
    const CAPTURE_NAMES: CaptureNames;

    /// `Ok` when the loaded library has every call a capture needs; else
    /// why not (HIP: `Unsupported`, naming the first call a ROCm lacks).
    fn capture_supported() -> Result<(), BackendError> {
        Ok(())
    }

    /// Whether [`graph_memory`](Self::graph_memory) reads a graph's nodes;
    /// where it does not, a graph's memory is 0 with no call.
    const READS_GRAPH_NODES: bool;

    /// Bytes of device memory the allocation nodes of `graph` take (the
    /// vendor's node calls, checked in `s`).
    ///
    /// # Safety
    ///
    /// `graph` is live, its context current.
    unsafe fn graph_memory<C: Context<Table = Self>>(
        s: &C,
        graph: Self::Graph,
    ) -> Result<u64, BackendError>;

    /// Begin capturing `stream` in `mode`.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of the current context.
    unsafe fn begin_capture(stream: Self::Stream, mode: CaptureMode) -> Self::Code;

    /// The id of the capture under way on `stream`.
    ///
    /// # Safety
    ///
    /// `stream` is live.
    unsafe fn capture_id(stream: Self::Stream) -> (Self::Code, u64);

    /// End the capture of `stream`; the graph made, if any.
    ///
    /// # Safety
    ///
    /// `stream` is live.
    unsafe fn end_capture(stream: Self::Stream) -> (Self::Code, Option<Self::Graph>);

    /// Whether the driver still captures `stream` (active, or invalidated
    /// and not yet ended); also when it cannot say.
    ///
    /// # Safety
    ///
    /// `stream` is live.
    unsafe fn still_capturing(stream: Self::Stream) -> bool;

    /// Instantiate `graph`.
    ///
    /// # Safety
    ///
    /// `graph` is live.
    unsafe fn instantiate(graph: Self::Graph) -> (Self::Code, Self::Exec);

    /// Destroy an executable graph.
    ///
    /// # Safety
    ///
    /// Destroyed once, after its launches finished.
    unsafe fn exec_destroy(exec: Self::Exec) -> Self::Code;

    /// Destroy a graph.
    ///
    /// # Safety
    ///
    /// Destroyed once; no executable graph made from it is launched after.
    unsafe fn graph_destroy(graph: Self::Graph) -> Self::Code;

    /// Queue one run of `exec` on `stream`.
    ///
    /// # Safety
    ///
    /// Both live, of the current context.
    unsafe fn launch(exec: Self::Exec, stream: Self::Stream) -> Self::Code;

    /// The stream's key in the capture gate (its handle's address).
    fn stream_key(stream: Self::Stream) -> usize;
}

/// The vendor's names of its stream and event calls, for messages
/// (`cuEventRecord` / `hipEventRecord`: tests and CI scripts grep them).
/// The stream's create, synchronize and query are named in [`VmmNames`].
#[derive(Debug, Clone, Copy)]
pub struct StreamNames {
    /// [`VmmTable::stream_destroy`] (`cuStreamDestroy_v2`).
    pub stream_destroy: &'static str,
    /// [`StreamTable::event_create`] (`cuEventCreate`).
    pub event_create: &'static str,
    /// [`StreamTable::event_record`] (`cuEventRecord`).
    pub event_record: &'static str,
    /// [`StreamTable::stream_wait_event`] (`cuStreamWaitEvent`).
    pub stream_wait_event: &'static str,
    /// [`StreamTable::event_destroy`] (`cuEventDestroy_v2`).
    pub event_destroy: &'static str,
}

/// A vendor's event entry points, which order one stream after another
/// (the stream calls themselves are [`VmmTable`]'s), and what its streams
/// need that differs between the vendors. The caller has the context's
/// device current.
pub trait StreamTable: VmmTable {
    /// An event (`CUevent`, `hipEvent_t`).
    type Event: Copy;

    /// The calls' names, for messages.
    const STREAM_NAMES: StreamNames;

    /// Whether a stream call (synchronize, destroy) needs the context
    /// current: CUDA's driver calls act on the calling thread's current
    /// context; a HIP stream carries its device, and the runtime takes it
    /// from any thread, so HIP makes no `hipGetDevice` / `hipSetDevice`
    /// round trip for them.
    const STREAM_CALLS_NEED_CURRENT: bool;

    /// Whether a call is still made once a sticky code was seen (the
    /// context dead): CUDA's driver answers every call at once with the
    /// sticky code, so an event is still destroyed; the HIP runtime may
    /// block in a call waiting for work that never finishes, so after a
    /// sticky code HIP makes none.
    const CALLS_AFTER_STICKY: bool;

    /// How often a wait that must not block (a lost teardown's drain, a
    /// retired stream watched) asks the driver again.
    const POLL_INTERVAL: Duration;

    /// Create an event that only orders (timing disabled).
    ///
    /// # Safety
    ///
    /// The device is current.
    unsafe fn event_create() -> (Self::Code, Self::Event);

    /// Record `event` on `stream`: it completes when the work queued on
    /// `stream` now has run.
    ///
    /// # Safety
    ///
    /// Both live, of the current context.
    unsafe fn event_record(event: Self::Event, stream: Self::Stream) -> Self::Code;

    /// Make the work queued on `stream` from now on wait for `event`.
    ///
    /// # Safety
    ///
    /// Both live, of the current context; `event` recorded.
    unsafe fn stream_wait_event(stream: Self::Stream, event: Self::Event) -> Self::Code;

    /// Destroy `event`; legal with a wait for it still queued (the driver
    /// releases it once the wait has run).
    ///
    /// # Safety
    ///
    /// Created by [`event_create`](Self::event_create), destroyed once.
    unsafe fn event_destroy(event: Self::Event) -> Self::Code;
}
