//! The Vulkan backend (feature `vulkan`): ash with libvulkan opened at run
//! time, gpu-allocator suballocation, one timeline semaphore per stream, and
//! stream-ordered frees retired by a thread blocked in `vkWaitSemaphores`.
//!
//! * A **stream** is a timeline semaphore plus a queue (streams share queues
//!   where the device has few; lavapipe has one). Every submission on a
//!   stream waits for the stream's previous value and signals the next one;
//!   values are chosen only by this module, under the stream's submit lock,
//!   so they strictly increase (lavapipe silently accepts a decreasing value
//!   from `vkQueueSubmit`, so nothing else guards it).
//! * **Memory** is a `VkBuffer` bound to a gpu-allocator suballocation, with
//!   its device address where `bufferDeviceAddress` is supported. `write` and
//!   `read` go through a per-stream staging buffer and a copy submitted on the
//!   stream ([`TransferPath::Staging`]), or through the mapping when the
//!   memory is host-visible and [`TransferPath::Auto`] is chosen.
//! * A **free** is parked at the timeline value of the last submission on its
//!   stream. The retirement thread waits (`VK_SEMAPHORE_WAIT_ANY`, infinite
//!   timeout) on the front value of every stream that has parked frees plus a
//!   wake semaphore; when a value is reached it destroys the buffer, frees the
//!   suballocation, and fires the [`RetireSignal`] with no lock held.
//! * **Device loss** (`VK_ERROR_DEVICE_LOST` from any call, or the governor's
//!   `device_lost`) drops every parked signal unfired without touching the
//!   device; teardown then only destroys.
//!
//! See `docs/backends.md` ("Vulkan") for teardown order and what was verified
//! where.
//!
//! ```no_run
//! use memgov::vulkan::{VulkanConfig, VulkanContext};
//! use memgov::{DeviceContext, RetireSignal};
//! let ctx = VulkanContext::new(VulkanConfig::default())?;
//! let s = ctx.create_stream()?;
//! let m = ctx.allocate(&s, 4096)?;
//! ctx.write(&s, &m, 0, b"abc")?;
//! ctx.free_async(&s, m, RetireSignal::from_fn(|_| {})).map_err(|(_, _, e)| e)?;
//! ctx.synchronize(&s)?;
//! ctx.destroy_stream(s)?;
//! let (probe, validation) = (ctx.probe(), ctx.validation());
//! ctx.teardown(false)?;
//! assert_eq!(probe.check_clean_teardown(), Ok(()));
//! assert_eq!(validation.validation_failures(), 0);
//! # Ok::<(), memgov::BackendError>(())
//! ```

mod access;
mod instance;
mod retire;
mod stream;
mod validation;

pub use stream::{StreamGate, VulkanStream};
pub use validation::VulkanValidation;

use access::DeviceAccess;
use ash::vk;
use gpu_allocator::vulkan::{
    AllocationCreateDesc, AllocationScheme, Allocator, AllocatorCreateDesc,
};
use gpu_allocator::{AllocationSizes, AllocatorDebugSettings, MemoryLocation};
use instance::{CreatedInstance, DeviceInfo};
use memgov_backend::{
    BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription, Execution,
    MemoryInfo, RetireSignal,
};
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use stream::StreamInner;
use validation::ProbeShared;

const BACKEND: &str = "vulkan";

pub(crate) use memgov_sync::lock;

pub(crate) fn err(
    op: &'static str,
    kind: BackendErrorKind,
    msg: impl Into<String>,
) -> BackendError {
    BackendError::new(BACKEND, op, kind, msg)
}

/// Classify a `VkResult` (without marking any context lost).
pub(crate) fn vk_error(op: &'static str, r: vk::Result, call: &str) -> BackendError {
    let kind = match r {
        vk::Result::ERROR_DEVICE_LOST => BackendErrorKind::DeviceLost,
        vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY => {
            BackendErrorKind::OutOfMemory
        }
        vk::Result::ERROR_INITIALIZATION_FAILED | vk::Result::ERROR_INCOMPATIBLE_DRIVER => {
            BackendErrorKind::Unavailable
        }
        vk::Result::ERROR_FEATURE_NOT_PRESENT | vk::Result::ERROR_EXTENSION_NOT_PRESENT => {
            BackendErrorKind::Unsupported
        }
        _ => BackendErrorKind::Other,
    };
    let hint = match kind {
        BackendErrorKind::DeviceLost => "; the device is lost: nothing queued on it will run; retire the context and create a new one",
        BackendErrorKind::OutOfMemory => memgov_backend::OUT_OF_MEMORY_HINT,
        _ => "",
    };
    BackendError::from_driver_call(
        BACKEND,
        op,
        kind,
        call,
        &format!("{r:?}"),
        i64::from(r.as_raw()),
        hint,
    )
}

/// Which physical device to drive.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceSelector {
    /// The first discrete GPU, else integrated, virtual, then CPU (lavapipe).
    #[default]
    Best,
    /// The device at this index of `vkEnumeratePhysicalDevices`.
    Index(usize),
    /// The first device whose name contains this text (case-insensitive).
    Name(String),
}

/// How `write` and `read` move bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransferPath {
    /// Through the mapping when the memory is host-visible (after waiting for
    /// the stream's last submission), else through staging.
    #[default]
    Auto,
    /// Always a staging copy submitted on the stream (what a discrete GPU
    /// needs; exercises the timeline on every write and read).
    Staging,
}

/// Settings of a Vulkan context.
#[derive(Debug, Clone)]
pub struct VulkanConfig {
    /// Which device.
    pub device: DeviceSelector,
    /// Enable `VK_LAYER_KHRONOS_validation` with a debug messenger whose
    /// counts [`VulkanValidation`] reports.
    pub validation: bool,
    /// With validation, also enable synchronization validation.
    pub sync_validation: bool,
    /// How `write` and `read` move bytes.
    pub transfer: TransferPath,
    /// Size of each stream's staging buffer (larger transfers are chunked).
    pub staging_bytes: u64,
    /// gpu-allocator block size for device memory (clamped to 4..=256 MiB).
    pub block_bytes: u64,
    /// At most this many queues of the chosen family; streams share them.
    pub max_queues: u32,
    /// Load this libvulkan instead of `libvulkan.so.1`. Built only by the
    /// `unsafe` [`LoaderPath::new`]: loading a library runs its code.
    pub loader_path: Option<LoaderPath>,
    /// Host waits (write, read, synchronize, destroy_stream) give up after
    /// this long with an error naming the stream and timeline values.
    pub wait_timeout: Duration,
}

impl Default for VulkanConfig {
    fn default() -> Self {
        Self {
            device: DeviceSelector::Best,
            validation: false,
            sync_validation: true,
            transfer: TransferPath::Auto,
            staging_bytes: 4 << 20,
            block_bytes: 64 << 20,
            max_queues: 4,
            loader_path: None,
            wait_timeout: Duration::from_secs(120),
        }
    }
}

impl VulkanConfig {
    /// The default config with validation (and synchronization validation)
    /// enabled.
    pub fn validated() -> Self {
        Self {
            validation: true,
            ..Self::default()
        }
    }
}

/// A Vulkan loader library to open instead of `libvulkan.so.1`, for
/// [`VulkanConfig::loader_path`].
///
/// Opening a shared library runs its initializers, and memgov then calls the
/// `vkGetInstanceProcAddr` it exports with the signature the Vulkan
/// specification gives it, and every function that one returns likewise.
/// Rust cannot check any of that: a library that is not a conforming Vulkan
/// loader (or ICD exporting the loader interface) is undefined behaviour the
/// moment it is opened or called. Hence the `unsafe` constructor: the
/// promise is made where the path is chosen, and [`VulkanContext::new`]
/// relies on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderPath(PathBuf);

impl LoaderPath {
    /// Name the loader library to open.
    ///
    /// # Safety
    ///
    /// `path` names a conforming Vulkan loader (an implementation of
    /// `libvulkan.so.1`'s interface, such as the Khronos loader or a driver
    /// that exports it), or no file at all: opening then fails cleanly with
    /// an `Unavailable` error. Its initializers must be sound to run on the
    /// thread that calls [`VulkanContext::new`].
    pub unsafe fn new(path: impl Into<PathBuf>) -> Self {
        Self(path.into())
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

/// A raw allocation: a `VkBuffer` bound to a suballocation. A plain handle:
/// dropping it does nothing; only `free_async` or teardown release it.
#[derive(Debug)]
pub struct VulkanMemory {
    id: u64,
    context: u64,
    buffer: vk::Buffer,
    bytes: u64,
    device_address: Option<u64>,
    /// Host address of the mapping, when host-visible.
    mapped: Option<usize>,
    /// Held across every host copy through the mapping: `write` and `read`
    /// take the memory by shared reference, so two threads may copy into
    /// (or out of) the same bytes at once, and unsynchronized access to the
    /// same bytes is a data race. Copies of one allocation are serialized,
    /// as the host backend's are; different allocations do not contend.
    host_access: Mutex<()>,
}

impl VulkanMemory {
    /// The buffer, for descriptors and copies of your own. Valid until the
    /// memory is freed or its context torn down (using it is `unsafe` in ash:
    /// the caller vouches for that).
    pub fn buffer(&self) -> vk::Buffer {
        self.buffer
    }
    /// Size in bytes as requested.
    pub fn len(&self) -> u64 {
        self.bytes
    }
    /// Always false: zero-byte allocations are refused.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
    /// `vkGetBufferDeviceAddress`, where the device supports it.
    pub fn device_address(&self) -> Option<u64> {
        self.device_address
    }
    /// Whether the memory is host-visible (mapped).
    pub fn is_mapped(&self) -> bool {
        self.mapped.is_some()
    }
}

pub(crate) struct Live {
    pub buffer: vk::Buffer,
    pub allocation: gpu_allocator::vulkan::Allocation,
}

pub(crate) struct MemState {
    /// `None` once dropped in teardown (before `vkDestroyDevice`).
    pub allocator: Option<Allocator>,
    pub live: HashMap<u64, Live>,
}

struct GateRecord {
    semaphore: vk::Semaphore,
    opened: Arc<AtomicBool>,
}

pub(crate) fn quiet_debug_settings() -> AllocatorDebugSettings {
    let mut d = AllocatorDebugSettings::default();
    d.log_leaks_on_shutdown = false;
    d
}

static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);

/// State shared by the context, its streams, gates and retirement thread.
/// Dropping it calls no Vulkan function: teardown destroys explicitly.
pub(crate) struct Shared {
    pub id: u64,
    /// Keeps the loader library mapped for as long as any handle of it
    /// exists. It does not keep the driver: the loader unloads the ICD when
    /// teardown destroys the instance, after which `device`'s function
    /// pointers dangle. Calls on behalf of handles therefore pass `access`.
    #[allow(dead_code)]
    pub entry: ash::Entry,
    pub instance: ash::Instance,
    pub physical: vk::PhysicalDevice,
    pub device: ash::Device,
    pub info: DeviceInfo,
    pub config: VulkanConfig,
    pub queue_family: u32,
    pub queues: Vec<Mutex<vk::Queue>>,
    pub lost: AtomicBool,
    pub closing: AtomicBool,
    pub shutdown: AtomicBool,
    pub probe: Arc<ProbeShared>,
    pub mem: Mutex<MemState>,
    pub streams: Mutex<Vec<Arc<StreamInner>>>,
    pub wake_semaphore: vk::Semaphore,
    /// A timeline semaphore that is never signalled. The retirement thread
    /// always waits on at least two semaphores with WAIT_ANY: with a single
    /// semaphore, VK_LAYER_KHRONOS_validation 1.3.239 waits inside
    /// vkWaitSemaphores for the host signal's bookkeeping while holding a
    /// lock that the signalling thread needs (a deadlock, seen on lavapipe).
    pub never_semaphore: vk::Semaphore,
    /// Last value host-signalled on the wake semaphore. Held across the
    /// signal: two concurrent wakers must not signal out of order (a lower
    /// host-signalled value loses the device on lavapipe).
    pub wake_value: Mutex<u64>,
    pub next_id: AtomicU64,
    gates: Mutex<Vec<GateRecord>>,
    pub has_memory_budget: bool,
    /// Device calls made by stream and gate handles, which can outlive the
    /// context: teardown closes it and waits for them before destroying.
    pub access: DeviceAccess,
}

impl Shared {
    /// Refuse work on a lost or closing context.
    pub(crate) fn check_usable(&self, op: &'static str) -> Result<(), BackendError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(err(
                op,
                BackendErrorKind::DeviceLost,
                "the Vulkan device was lost (VK_ERROR_DEVICE_LOST); retire this context and create a new one",
            ));
        }
        if self.closing.load(Ordering::Acquire) {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                "the context is being torn down; no new work is accepted",
            ));
        }
        Ok(())
    }

    /// Refuse a stream of another context: its device may already be
    /// destroyed (a context's own streams cannot be, while the context is
    /// borrowed: teardown takes it by value).
    pub(crate) fn own_stream(
        &self,
        op: &'static str,
        stream: &VulkanStream,
    ) -> Result<(), BackendError> {
        if stream.inner.shared.id != self.id {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "stream {} belongs to Vulkan context {}, not to context {}; pass a stream of the context you call",
                    stream.inner.id, stream.inner.shared.id, self.id
                ),
            ));
        }
        Ok(())
    }

    /// Classify a failed call; `VK_ERROR_DEVICE_LOST` marks the context lost
    /// (parked frees are dropped unfired) and wakes the retirement thread.
    pub(crate) fn fail(&self, op: &'static str, r: vk::Result, call: &str) -> BackendError {
        let e = vk_error(op, r, call);
        if r == vk::Result::ERROR_DEVICE_LOST {
            self.on_lost(
                &format!("{call} returned VK_ERROR_DEVICE_LOST during {op}"),
                true,
            );
        }
        e
    }

    /// Mark lost; drop every parked signal unfired. With `wake`, also
    /// host-signal the wake semaphore so that the retirement thread leaves
    /// `vkWaitSemaphores` (on lavapipe a blocked wait does not return by
    /// itself when the device is lost; the host signal still succeeds).
    pub(crate) fn on_lost(&self, why: &str, wake: bool) {
        if !self.lost.swap(true, Ordering::AcqRel) {
            self.probe.common.device_lost();
            self.probe.note(format!("device lost: {why}"));
        }
        self.drain_parked();
        if wake {
            self.wake();
        }
    }

    /// Give up every parked free: signals are dropped (Abandoned) after the
    /// locks are released; the memory stays in `live` for teardown to destroy.
    pub(crate) fn drain_parked(&self) {
        let streams: Vec<_> = lock(&self.streams).clone();
        for s in streams {
            let taken = std::mem::take(&mut lock(&s.park).queue);
            if taken.is_empty() {
                continue;
            }
            for _ in 0..taken.len() {
                // The memory stays in `live`; teardown reclaims it.
                self.probe.common.count_abandoned();
            }
            drop(taken);
            s.parked_cv.notify_all();
        }
    }

    /// Wake the retirement thread: host-signal the next wake value.
    pub(crate) fn wake(&self) {
        let mut v = lock(&self.wake_value);
        let next = *v + 1;
        let info = vk::SemaphoreSignalInfo::default()
            .semaphore(self.wake_semaphore)
            .value(next);
        // SAFETY: the wake semaphore is a timeline semaphore of this device,
        // destroyed only in teardown after the retirement thread has been
        // joined and no waker can run (teardown owns the context). The value
        // strictly increases because it is chosen and signalled under `v`.
        match unsafe { self.device.signal_semaphore(&info) } {
            Ok(()) => {
                *v = next;
                self.probe.wakeups.fetch_add(1, Ordering::Relaxed);
            }
            Err(r) => {
                drop(v);
                self.probe.note(format!(
                    "waking the retirement thread: vkSignalSemaphore returned {r:?}"
                ));
            }
        }
    }

    pub(crate) fn host_wait(
        &self,
        op: &'static str,
        semaphore: vk::Semaphore,
        value: u64,
        what: &str,
    ) -> Result<(), BackendError> {
        let sems = [semaphore];
        let vals = [value];
        let info = vk::SemaphoreWaitInfo::default()
            .semaphores(&sems)
            .values(&vals);
        let timeout = u64::try_from(self.config.wait_timeout.as_nanos()).unwrap_or(u64::MAX);
        // SAFETY: callers pass the timeline of a stream of this context
        // (`own_stream` checked it) that they borrow for the call, from a
        // `DeviceContext` method that borrows the context: `destroy_stream`
        // and `teardown` take those by value, so neither the semaphore nor
        // the device can be destroyed during the wait.
        match unsafe { self.device.wait_semaphores(&info, timeout) } {
            Ok(()) => Ok(()),
            Err(vk::Result::TIMEOUT) => {
                // SAFETY: as above.
                let now =
                    unsafe { self.device.get_semaphore_counter_value(semaphore) }.unwrap_or(0);
                Err(err(
                    op,
                    BackendErrorKind::Other,
                    format!(
                        "{what}: timeline value {value} not reached after {} ms (at {now}); work queued before it has not finished (a StreamGate left closed?); open it or raise VulkanConfig::wait_timeout",
                        self.config.wait_timeout.as_millis()
                    ),
                ))
            }
            Err(r) => Err(self.fail(op, r, "vkWaitSemaphores")),
        }
    }

    /// Create a buffer of `bytes` bound to a fresh suballocation.
    pub(crate) fn create_buffer(
        &self,
        op: &'static str,
        bytes: u64,
        location: MemoryLocation,
        name: &str,
    ) -> Result<Live, BackendError> {
        let mut usage = vk::BufferUsageFlags::TRANSFER_SRC
            | vk::BufferUsageFlags::TRANSFER_DST
            | vk::BufferUsageFlags::STORAGE_BUFFER;
        if self.info.buffer_device_address {
            usage |= vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS;
        }
        let info = vk::BufferCreateInfo::default()
            .size(bytes)
            .usage(usage)
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        // SAFETY: a valid device and create info.
        let buffer = unsafe { self.device.create_buffer(&info, None) }
            .map_err(|r| self.fail(op, r, "vkCreateBuffer"))?;
        // SAFETY: the buffer was just created on this device.
        let requirements = unsafe { self.device.get_buffer_memory_requirements(buffer) };
        let desc = AllocationCreateDesc {
            name,
            requirements,
            location,
            linear: true,
            allocation_scheme: AllocationScheme::GpuAllocatorManaged,
        };
        let mut mem = lock(&self.mem);
        let allocated = match mem.allocator.as_mut() {
            Some(a) => a.allocate(&desc).map_err(|e| {
                let heap = &self.info.heaps[self.info.main_heap];
                let kind = match e {
                    gpu_allocator::AllocationError::OutOfMemory => BackendErrorKind::OutOfMemory,
                    gpu_allocator::AllocationError::NoCompatibleMemoryTypeFound => BackendErrorKind::Unsupported,
                    _ => BackendErrorKind::Other,
                };
                err(
                    op,
                    kind,
                    format!(
                        "gpu-allocator could not place {bytes} B ({} B with alignment {}): {e}; {} B of blocks reserved, heap {} has {} B; free memory and retry",
                        requirements.size, requirements.alignment, a.capacity(), self.info.main_heap, heap.size
                    ),
                )
            }),
            None => Err(err(op, BackendErrorKind::InvalidArgument, "the allocator was dropped (context torn down)")),
        };
        let allocation = match allocated {
            Ok(a) => a,
            Err(e) => {
                drop(mem);
                // SAFETY: created above, never bound or used.
                unsafe { self.device.destroy_buffer(buffer, None) };
                return Err(e);
            }
        };
        // SAFETY: the allocation's memory and offset satisfy `requirements`
        // (gpu-allocator chose a compatible type and alignment); the buffer is
        // unbound.
        let bound = unsafe {
            self.device
                .bind_buffer_memory(buffer, allocation.memory(), allocation.offset())
        };
        if let Err(r) = bound {
            if let Some(a) = mem.allocator.as_mut() {
                let _ = a.free(allocation);
            }
            drop(mem);
            // SAFETY: never used by any submission.
            unsafe { self.device.destroy_buffer(buffer, None) };
            return Err(self.fail(op, r, "vkBindBufferMemory"));
        }
        Ok(Live { buffer, allocation })
    }

    /// Destroy a buffer and free its suballocation (`free_memory` false on a
    /// lost device: the allocator's drop releases the block instead).
    ///
    /// # Safety
    ///
    /// No pending or future submission uses the buffer.
    pub(crate) unsafe fn destroy_live(&self, mem: &mut MemState, live: Live, free_memory: bool) {
        // SAFETY: per this function's contract.
        unsafe { self.device.destroy_buffer(live.buffer, None) };
        if free_memory {
            if let Some(a) = mem.allocator.as_mut() {
                if let Err(e) = a.free(live.allocation) {
                    self.probe.note(format!("gpu-allocator free failed: {e}"));
                }
            }
        }
    }
}

/// A device that the runtime already created, handed to
/// [`VulkanContext::adopt`].
pub struct AdoptedDevice {
    /// The loader entry the instance was created with.
    pub entry: ash::Entry,
    /// The instance (Vulkan 1.2 or later).
    pub instance: ash::Instance,
    /// The physical device `device` was created from.
    pub physical_device: vk::PhysicalDevice,
    /// The logical device, created with `timelineSemaphore` enabled.
    pub device: ash::Device,
    /// A queue family with transfer (and compute) support.
    pub queue_family_index: u32,
    /// How many queues of that family were created (memgov uses all).
    pub queue_count: u32,
    /// Whether `bufferDeviceAddress` was enabled at device creation.
    pub buffer_device_address: bool,
    /// Whether `VK_EXT_memory_budget` was enabled at device creation.
    pub memory_budget: bool,
    /// Whether teardown destroys the device and the instance. With `false`
    /// the runtime keeps them and destroys them after memgov's teardown.
    pub destroy_on_teardown: bool,
}

/// A Vulkan device context.
pub struct VulkanContext {
    shared: Arc<Shared>,
    /// The instance and messenger memgov created (None when adopted).
    created: Option<CreatedInstance>,
    owns_device: bool,
    retire_thread: Mutex<Option<(JoinHandle<()>, Receiver<()>)>>,
}

impl fmt::Debug for VulkanContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VulkanContext")
            .field("device", &self.shared.info.name)
            .field("validation", &self.shared.config.validation)
            .field("lost", &self.shared.lost.load(Ordering::Relaxed))
            .finish()
    }
}

impl VulkanContext {
    /// Open libvulkan, create an instance (with validation if asked) and a
    /// device, and start the retirement thread.
    ///
    /// # Errors
    ///
    /// `Unavailable` with "no Vulkan loader/ICD" when libvulkan cannot be
    /// opened, no ICD answers, or no device is found; `Unsupported` when the
    /// device lacks Vulkan 1.2 timeline semaphores; `InvalidArgument` for a
    /// device index or name that matches nothing.
    pub fn new(config: VulkanConfig) -> Result<Self, BackendError> {
        let entry = instance::load_entry(&config)?;
        let probe = Arc::new(ProbeShared::default());
        let created = instance::create_instance(&entry, &config, &probe)?;
        let result =
            instance::select_device(&created.instance, &config.device).and_then(|(pd, ordinal)| {
                instance::create_device(&created.instance, pd, ordinal, &config).map(|d| (pd, d))
            });
        let (pd, dev) = match result {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: no device was created from this instance.
                unsafe { instance::destroy_instance(created) };
                return Err(e);
            }
        };
        let instance = created.instance.clone();
        Self::assemble(entry, instance, Some(created), pd, dev, config, probe, true)
    }

    /// Govern a device that the runtime already created.
    ///
    /// # Safety
    ///
    /// * `device` was created from `physical_device` of `instance`, with the
    ///   Vulkan 1.2 `timelineSemaphore` feature enabled (and
    ///   `bufferDeviceAddress` / `VK_EXT_memory_budget` exactly as declared);
    /// * `queue_count` queues of `queue_family_index` exist, and nobody else
    ///   submits to them while this context lives (memgov locks them with
    ///   its own mutexes, which other code cannot see);
    /// * with `destroy_on_teardown == false`, the device and instance outlive
    ///   this context's teardown; with `true`, nobody else destroys them.
    pub unsafe fn adopt(
        adopted: AdoptedDevice,
        config: VulkanConfig,
    ) -> Result<Self, BackendError> {
        let AdoptedDevice {
            entry,
            instance,
            physical_device,
            device,
            queue_family_index,
            queue_count,
            buffer_device_address,
            memory_budget,
            destroy_on_teardown,
        } = adopted;
        if queue_count == 0 {
            return Err(err(
                "adopt",
                BackendErrorKind::InvalidArgument,
                "queue_count is 0; pass the number of queues created in the family",
            ));
        }
        // SAFETY: per this function's contract the queues exist.
        let queues = (0..queue_count)
            .map(|i| unsafe { device.get_device_queue(queue_family_index, i) })
            .collect();
        let info = instance::device_info(
            &instance,
            physical_device,
            0,
            memory_budget,
            buffer_device_address,
        );
        let dev = instance::CreatedDevice {
            device,
            queue_family: queue_family_index,
            queues,
            info,
        };
        let probe = Arc::new(ProbeShared::default());
        let created = if destroy_on_teardown {
            Some(CreatedInstance {
                instance: instance.clone(),
                debug: None,
            })
        } else {
            None
        };
        Self::assemble(
            entry,
            instance,
            created,
            physical_device,
            dev,
            config,
            probe,
            destroy_on_teardown,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        entry: ash::Entry,
        instance: ash::Instance,
        created: Option<CreatedInstance>,
        physical: vk::PhysicalDevice,
        dev: instance::CreatedDevice,
        config: VulkanConfig,
        probe: Arc<ProbeShared>,
        owns_device: bool,
    ) -> Result<Self, BackendError> {
        let instance::CreatedDevice {
            device,
            queue_family,
            queues,
            info,
        } = dev;
        let cleanup = |device: &ash::Device, created: Option<CreatedInstance>| {
            if owns_device {
                // SAFETY: nothing created from the device remains (callers
                // pass only what they destroyed), and the instance only had
                // this device.
                unsafe {
                    device.destroy_device(None);
                    if let Some(c) = created {
                        instance::destroy_instance(c);
                    }
                }
            }
        };
        let block = config.block_bytes.clamp(4 << 20, 256 << 20);
        let allocator = Allocator::new(&AllocatorCreateDesc {
            instance: instance.clone(),
            device: device.clone(),
            physical_device: physical,
            debug_settings: quiet_debug_settings(),
            buffer_device_address: info.buffer_device_address,
            allocation_sizes: AllocationSizes::new(block, (block / 4).max(4 << 20))
                .with_max_device_memblock_size(256 << 20),
        });
        let allocator = match allocator {
            Ok(a) => a,
            Err(e) => {
                cleanup(&device, created);
                return Err(err(
                    "new",
                    BackendErrorKind::Other,
                    format!("gpu-allocator could not start: {e}"),
                ));
            }
        };
        let mut timeline = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let sem_info = vk::SemaphoreCreateInfo::default().push_next(&mut timeline);
        // SAFETY: a valid device with timeline semaphores enabled.
        let wake_semaphore = match unsafe { device.create_semaphore(&sem_info, None) } {
            Ok(s) => s,
            Err(r) => {
                drop(allocator);
                cleanup(&device, created);
                return Err(vk_error("new", r, "vkCreateSemaphore (wake)"));
            }
        };
        // SAFETY: as above.
        let never_semaphore = match unsafe { device.create_semaphore(&sem_info, None) } {
            Ok(s) => s,
            Err(r) => {
                // SAFETY: unused.
                unsafe { device.destroy_semaphore(wake_semaphore, None) };
                drop(allocator);
                cleanup(&device, created);
                return Err(vk_error("new", r, "vkCreateSemaphore (never)"));
            }
        };
        let has_memory_budget = info.memory_budget;
        let shared = Arc::new(Shared {
            id: NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed),
            entry,
            instance,
            physical,
            device,
            info,
            config,
            queue_family,
            queues: queues.into_iter().map(Mutex::new).collect(),
            lost: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            probe,
            mem: Mutex::new(MemState {
                allocator: Some(allocator),
                live: HashMap::new(),
            }),
            streams: Mutex::new(Vec::new()),
            wake_semaphore,
            never_semaphore,
            wake_value: Mutex::new(0),
            next_id: AtomicU64::new(1),
            gates: Mutex::new(Vec::new()),
            has_memory_budget,
            access: DeviceAccess::new(),
        });
        let retire_thread = match retire::spawn(shared.clone()) {
            Ok(t) => t,
            Err(e) => {
                let mut mem = lock(&shared.mem);
                drop(mem.allocator.take());
                drop(mem);
                // SAFETY: nothing uses the semaphore (no thread started).
                unsafe {
                    shared.device.destroy_semaphore(shared.wake_semaphore, None);
                    shared
                        .device
                        .destroy_semaphore(shared.never_semaphore, None);
                }
                cleanup(&shared.device, created);
                return Err(e);
            }
        };
        Ok(Self {
            shared,
            created,
            owns_device,
            retire_thread: Mutex::new(Some(retire_thread)),
        })
    }

    /// A probe that observes this context's bookkeeping, before and after
    /// teardown. With validation on, every validation warning or error is a
    /// violation there too.
    pub fn probe(&self) -> BackendProbe {
        self.shared.probe.common.clone()
    }

    /// What only Vulkan observes: validation messages by severity, loader
    /// messages, the retirement thread's waits, backend notes.
    pub fn validation(&self) -> VulkanValidation {
        VulkanValidation(self.shared.probe.clone())
    }

    /// Whether `VK_LAYER_KHRONOS_validation` is on for this context: asked
    /// for in [`VulkanConfig::validation`] (creation fails when it is asked
    /// for and not installed). Tells a [`validation`](Self::validation) that
    /// heard nothing because the run was clean from one that had no layer to
    /// hear from.
    pub fn validation_layer_on(&self) -> bool {
        self.shared.config.validation
    }

    /// The logical device, for work of your own. Do not destroy it.
    pub fn device(&self) -> &ash::Device {
        &self.shared.device
    }

    /// The instance.
    pub fn instance(&self) -> &ash::Instance {
        &self.shared.instance
    }

    /// The physical device.
    pub fn physical_device(&self) -> vk::PhysicalDevice {
        self.shared.physical
    }

    /// The queue family every stream submits to.
    pub fn queue_family_index(&self) -> u32 {
        self.shared.queue_family
    }

    /// Number of queues the streams share.
    pub fn queue_count(&self) -> usize {
        self.shared.queues.len()
    }

    /// Whether the device was created with `bufferDeviceAddress` enabled
    /// (buffers of work of your own may then ask for device addresses).
    pub fn buffer_device_address(&self) -> bool {
        self.shared.info.buffer_device_address
    }

    /// The context `memgov check` runs the conformance suite on: the default
    /// settings with `VK_LAYER_KHRONOS_validation` on when it is installed
    /// (every validation warning or error then counts as a violation in
    /// [`probe`](Self::probe)), without it otherwise.
    pub fn for_check() -> Result<Self, BackendError> {
        match Self::new(VulkanConfig::validated()) {
            Err(e) if e.kind == BackendErrorKind::Unavailable => Self::new(VulkanConfig::default()),
            other => other,
        }
    }

    /// Test-only: tear down **without** destroying live buffers, so that the
    /// validation layer reports objects alive at `vkDestroyDevice`. Proves
    /// that the validation check in the tests can fail.
    ///
    /// # Safety
    ///
    /// Destroying a device whose buffers are alive is invalid usage of
    /// Vulkan, which the specification leaves undefined. Only for proving
    /// that the validation layer reports it, on a driver that tolerates it
    /// (lavapipe), with no other use of the context or its memory afterwards.
    #[doc(hidden)]
    pub unsafe fn teardown_leaking_buffers_for_test(self) -> Result<(), BackendError> {
        self.teardown_inner(false, true)
    }

    fn teardown_inner(mut self, lost: bool, leak_buffers: bool) -> Result<(), BackendError> {
        let shared = self.shared.clone();
        let probe = &shared.probe;
        if probe.common.teardowns() > 0 {
            probe
                .common
                .violation(BACKEND, "teardown called twice".into());
        }
        // 1. Refuse new work, and wait for the device calls that stream and
        // gate handles have in flight (they can outlive this context, and may
        // run on other threads): none can start from here on, so nothing but
        // this function and the retirement thread touches the device.
        shared.access.close_and_drain();
        shared.closing.store(true, Ordering::SeqCst);
        let mut first_error: Option<BackendError> = None;
        if lost {
            // The device is gone: drop parked signals unfired.
            shared.on_lost("teardown(lost = true)", false);
        }
        // 2. Let gated work run (a host signal of memgov's own gate
        // semaphores), then wait for the device to go idle. On a lost device
        // vkDeviceWaitIdle must return in finite time (the spec requires it;
        // lavapipe returns VK_ERROR_DEVICE_LOST at once), and the spec counts
        // that result as VK_SUCCESS for whether anything is still pending or
        // in use: after it, destroying the semaphores and buffers of batches
        // queued before the loss is valid. (The validation layer 1.3.239
        // ignores a wait that failed, so it may still report those
        // semaphores in use: a false positive on a lost device.)
        let closed: Vec<vk::Semaphore> = lock(&shared.gates)
            .iter()
            .filter(|g| !g.opened.swap(true, Ordering::SeqCst))
            .map(|g| g.semaphore)
            .collect();
        if !closed.is_empty() && !lost {
            probe.note(format!(
                "{} StreamGate(s) still closed at teardown; opened them",
                closed.len()
            ));
        }
        for semaphore in closed {
            let info = vk::SemaphoreSignalInfo::default()
                .semaphore(semaphore)
                .value(1);
            // SAFETY: the gate semaphore is alive (destroyed in step 6) and
            // was never signalled: `opened` was false, and every signal of a
            // gate first swaps it to true.
            if let Err(r) = unsafe { shared.device.signal_semaphore(&info) } {
                if !lost {
                    first_error.get_or_insert(shared.fail(
                        "teardown",
                        r,
                        "vkSignalSemaphore (gate)",
                    ));
                }
            }
        }
        {
            // vkDeviceWaitIdle requires external sync of every queue: hold
            // their locks (no stream operation can run anyway: the governor
            // drained and `closing` refuses new ones).
            let guards: Vec<_> = shared.queues.iter().map(lock).collect();
            // SAFETY: a valid device; queues externally synchronized above.
            let idle = unsafe { shared.device.device_wait_idle() };
            drop(guards);
            if let Err(r) = idle {
                if !lost {
                    first_error.get_or_insert(shared.fail("teardown", r, "vkDeviceWaitIdle"));
                }
            }
        }
        let lost = lost || shared.lost.load(Ordering::SeqCst);
        // 3. Stop the retirement thread. It retires what is parked (all of it
        // reached: the device is idle) and leaves. The wake is a host signal
        // of memgov's own semaphore: the one non-destroy call made on a lost
        // device, because a blocked vkWaitSemaphores does not return by
        // itself there (verified on lavapipe).
        shared.shutdown.store(true, Ordering::SeqCst);
        let thread = lock(&self.retire_thread).take();
        if let Some((join, done)) = thread {
            shared.wake();
            let limit = shared.config.wait_timeout.max(Duration::from_secs(10));
            match done.recv_timeout(limit) {
                Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    let _ = join.join();
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    // The thread may still be inside a Vulkan call: destroying
                    // anything would be unsound. Leak the device instead.
                    probe.note("retirement thread did not return; device leaked".into());
                    self.created = None;
                    return Err(err(
                        "teardown",
                        BackendErrorKind::Other,
                        format!(
                            "the retirement thread did not leave vkWaitSemaphores within {} ms; the device, instance and {} live allocation(s) were leaked to stay sound",
                            limit.as_millis(),
                            lock(&shared.mem).live.len()
                        ),
                    ));
                }
            }
        }
        if lost {
            shared.drain_parked();
        }
        // 4. Free what is left: streams and memory the governor abandoned
        // (force-retire), staging buffers, gates.
        let streams: Vec<_> = std::mem::take(&mut *lock(&shared.streams));
        let leftover_streams = streams.len();
        for s in streams {
            // SAFETY: the device is idle (or lost) and the retirement thread
            // has been joined: nothing uses the stream's objects.
            unsafe { s.destroy_objects(!lost) };
        }
        let mut mem = lock(&shared.mem);
        let live: Vec<_> = mem.live.drain().collect();
        let leftover_memory = live.len();
        for (_, l) in live {
            if leak_buffers {
                // The buffer stays alive into vkDestroyDevice on purpose; its
                // memory block is freed with the allocator below.
                drop(l);
                continue;
            }
            // SAFETY: the device is idle or lost; no submission can run.
            unsafe { shared.destroy_live(&mut mem, l, !lost) };
        }
        probe.common.reclaim_rest();
        if leftover_streams + leftover_memory > 0 {
            probe.note(format!("teardown destroyed {leftover_streams} stream(s) and {leftover_memory} allocation(s) left by the governor (force-retire or device loss)"));
        }
        // 5. Drop the allocator (frees its blocks) before vkDestroyDevice.
        drop(mem.allocator.take());
        drop(mem);
        // 6. Destroy semaphores, the device, the messenger, the instance.
        // Every gate was opened in step 2 (on a lost device too: the host
        // signal of memgov's own semaphore is what releases a batch waiting
        // on it, which otherwise keeps lavapipe's submit thread, and
        // vkDestroySemaphore, waiting for ever), and none can be created or
        // opened from outside since step 1.
        let gates = std::mem::take(&mut *lock(&shared.gates));
        debug_assert!(gates.iter().all(|g| g.opened.load(Ordering::SeqCst)));
        // SAFETY: device idle or lost, thread joined: no wait or submission
        // refers to these semaphores any more.
        unsafe {
            for g in gates {
                shared.device.destroy_semaphore(g.semaphore, None);
            }
            shared.device.destroy_semaphore(shared.wake_semaphore, None);
            shared
                .device
                .destroy_semaphore(shared.never_semaphore, None);
        }
        if self.owns_device {
            // SAFETY: every object created from the device has been destroyed
            // above (except, in the leak test, the buffers on purpose), and
            // the allocator is gone.
            unsafe { shared.device.destroy_device(None) };
            if let Some(created) = self.created.take() {
                // SAFETY: the device was the only child of the instance.
                unsafe { instance::destroy_instance(created) };
            }
        }
        probe.common.torn_down_now();
        match first_error {
            Some(e) if !e.is_device_lost() => Err(e),
            _ => Ok(()),
        }
    }
}

impl DeviceContext for VulkanContext {
    type Stream = VulkanStream;
    type Memory = VulkanMemory;

    fn describe(&self) -> DeviceDescription {
        let info = &self.shared.info;
        DeviceDescription {
            backend: BACKEND,
            vendor: instance::vendor_name(info.vendor_id),
            name: info.name.clone(),
            ordinal: info.ordinal,
            total_bytes: info.heaps.get(info.main_heap).map_or(0, |h| h.size),
            driver: info.driver_string(),
            execution: if info.device_type == vk::PhysicalDeviceType::CPU {
                Execution::SoftwareDriver
            } else {
                Execution::RealHardware
            },
            stream_ordered_reuse: false,
        }
    }

    fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        let shared = &self.shared;
        shared.check_usable("memory_info")?;
        let heap = shared.info.main_heap;
        let total = shared.info.heaps.get(heap).map_or(0, |h| h.size);
        if shared.has_memory_budget {
            let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
            let mut props = vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
            // SAFETY: a valid physical device; VK_EXT_memory_budget is enabled
            // so the chained struct is understood.
            unsafe {
                shared
                    .instance
                    .get_physical_device_memory_properties2(shared.physical, &mut props)
            };
            let (b, u) = (budget.heap_budget[heap], budget.heap_usage[heap]);
            return Ok(MemoryInfo {
                free: b.saturating_sub(u),
                total,
            });
        }
        let reserved = lock(&shared.mem)
            .allocator
            .as_ref()
            .map_or(0, |a| a.capacity());
        Ok(MemoryInfo {
            free: total.saturating_sub(reserved),
            total,
        })
    }

    fn create_stream(&self) -> Result<VulkanStream, BackendError> {
        self.shared.check_usable("create_stream")?;
        let inner = StreamInner::create(&self.shared)?;
        lock(&self.shared.streams).push(inner.clone());
        self.shared.probe.common.stream_created();
        Ok(VulkanStream { inner })
    }

    fn destroy_stream(&self, stream: VulkanStream) -> Result<(), BackendError> {
        let shared = &self.shared;
        shared.own_stream("destroy_stream", &stream)?;
        let s = &stream.inner;
        if s.destroyed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        if shared.lost.load(Ordering::SeqCst) {
            // The retirement thread may still be blocked on this stream's
            // semaphore: teardown destroys it after joining the thread.
            return Ok(());
        }
        // Work already queued executes first, frees and their signals too.
        // On error the stream stays registered: teardown destroys it once
        // the device is idle.
        s.synchronize_inner("destroy_stream")?;
        lock(&shared.streams).retain(|x| !Arc::ptr_eq(x, s));
        shared.probe.common.stream_destroyed();
        // SAFETY: synchronize returned: every submission on the stream has
        // completed and its parked frees have fired, so neither the device nor
        // the retirement thread uses its objects (the thread only waits on
        // streams with parked frees); the stream is no longer registered.
        unsafe { s.destroy_objects(true) };
        Ok(())
    }

    fn allocate(&self, stream: &VulkanStream, bytes: u64) -> Result<VulkanMemory, BackendError> {
        let shared = &self.shared;
        shared.check_usable("allocate")?;
        if bytes == 0 {
            return Err(err(
                "allocate",
                BackendErrorKind::InvalidArgument,
                "zero-byte allocation",
            ));
        }
        shared.own_stream("allocate", stream)?;
        let live = shared.create_buffer("allocate", bytes, MemoryLocation::GpuOnly, "memgov")?;
        let device_address = shared.info.buffer_device_address.then(|| {
            let info = vk::BufferDeviceAddressInfo::default().buffer(live.buffer);
            // SAFETY: the buffer was created with SHADER_DEVICE_ADDRESS usage
            // and bound to memory allocated with the DEVICE_ADDRESS flag
            // (gpu-allocator's buffer_device_address), feature enabled.
            unsafe { shared.device.get_buffer_device_address(&info) }
        });
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let memory = VulkanMemory {
            id,
            context: shared.id,
            buffer: live.buffer,
            bytes,
            device_address,
            mapped: live.allocation.mapped_ptr().map(|p| p.as_ptr() as usize),
            host_access: Mutex::new(()),
        };
        shared.probe.common.allocated(live.allocation.size());
        lock(&shared.mem).live.insert(id, live);
        Ok(memory)
    }

    fn free_async(
        &self,
        stream: &VulkanStream,
        memory: VulkanMemory,
        retired: RetireSignal,
    ) -> Result<(), (VulkanMemory, RetireSignal, BackendError)> {
        if let Err(e) = self.shared.check_usable("free_async") {
            return Err((memory, retired, e));
        }
        if let Err(e) = self.shared.own_stream("free_async", stream) {
            return Err((memory, retired, e));
        }
        if memory.context != self.shared.id {
            let e = err(
                "free_async",
                BackendErrorKind::InvalidArgument,
                format!(
                    "the memory belongs to Vulkan context {}, not to context {}",
                    memory.context, self.shared.id
                ),
            );
            return Err((memory, retired, e));
        }
        stream.inner.park(memory.id, retired);
        Ok(())
    }

    fn write(
        &self,
        stream: &VulkanStream,
        memory: &VulkanMemory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.shared.check_usable("write")?;
        self.shared.own_stream("write", stream)?;
        stream.inner.transfer_in(memory, offset, src)
    }

    fn read(
        &self,
        stream: &VulkanStream,
        memory: &VulkanMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        self.shared.check_usable("read")?;
        self.shared.own_stream("read", stream)?;
        stream.inner.transfer_out(memory, offset, dst)
    }

    fn synchronize(&self, stream: &VulkanStream) -> Result<(), BackendError> {
        self.shared.check_usable("synchronize")?;
        self.shared.own_stream("synchronize", stream)?;
        stream.inner.synchronize_inner("synchronize")
    }

    /// Blocks until `after`'s submissions have executed and the frees parked
    /// on it have retired, like `synchronize(after)`. A free parked on
    /// `stream` afterwards then retires after all of that.
    ///
    /// (A batch on `stream` that waits on `after`'s timeline would order the
    /// device without blocking, but frees parked on `after` could then still
    /// retire after the free on `stream`: the retirement thread fires each
    /// stream's frees when that stream's timeline reaches them.)
    fn order_after(&self, stream: &VulkanStream, after: &VulkanStream) -> Result<(), BackendError> {
        self.shared.check_usable("order_after")?;
        self.shared.own_stream("order_after", stream)?;
        self.shared.own_stream("order_after", after)?;
        after.inner.synchronize_inner("order_after")
    }

    fn device_lost(&self) {
        // Declared by the governor: drop parked signals, touch nothing.
        self.shared.on_lost("declared lost by the governor", false);
    }

    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        self.teardown_inner(lost, false)
    }
}
