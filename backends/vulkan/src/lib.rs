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
//!   stream. The free thread waits for the front value of every stream
//!   that has parked frees (off the driver while there are none, so that an
//!   idle context costs no CPU); when a value is reached it destroys the
//!   buffer, frees the suballocation, and fires the [`RetireSignal`] with no
//!   lock held.
//! * **Device loss** (`VK_ERROR_DEVICE_LOST` from any call, or the governor's
//!   `device_lost`) drops every parked signal unfired without touching the
//!   device; teardown then only destroys.
//!
//! See `docs/backends/vulkan.md` for teardown order and what was verified
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

// The modules form layers: each names (in code and doc links, through
// `crate::` or `super::`) only modules of the layers below its own, so none
// imports another in a circle (the workspace's `tests/layering.rs` checks
// that no circle exists). Bottom to top:
// 1. config, result, allocator: settings, the mapping of `VkResult`s to
//    errors, the allocator and its live buffers
// 2. access, validation, stream_state: the device-access gate, the debug
//    messenger and its counts, a stream's state
// 3. instance: loading Vulkan, creating the instance and the device
// 4. shared: the state the context's threads share, and the calls on it
// 5. memory: creating and destroying buffers; allocate, memory_info
// 6. stream: the stream handles; submissions, transfers, parking frees
// 7. retire: the free thread; free_async
// 8. teardown: destroying everything, in order
mod access;
mod allocator;
mod config;
mod instance;
mod memory;
mod result;
mod retire;
mod shared;
mod stream;
mod stream_state;
mod teardown;
mod validation;

pub use config::{
    AdoptedDevice, AfterTeardown, DeviceSelector, LoaderPath, TransferPath, VulkanConfig,
};
pub use memory::VulkanMemory;
pub use stream::{StreamGate, VulkanStream};
pub use validation::{ValidationMessenger, VulkanValidation};

use access::DeviceAccess;
use allocator::{quiet_debug_settings, MemState};
use ash::vk;
use gpu_allocator::vulkan::{Allocator, AllocatorCreateDesc};
use gpu_allocator::AllocationSizes;
use instance::CreatedInstance;
use memgov_backend::{
    lock, BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription,
    Execution, MemoryInfo, RetireSignal, Shell, Tier,
};
use result::{err, error, BACKEND};
use shared::Shared;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use validation::ProbeShared;

static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);

/// A Vulkan device context.
pub struct VulkanContext {
    shared: Arc<Shared>,
    /// The instance and messenger memgov created (None when adopted).
    created: Option<CreatedInstance>,
    owns_device: bool,
    retire_thread: Mutex<Option<(JoinHandle<()>, Receiver<()>)>>,
    /// [`AdoptedDevice::after_teardown`], run at the end of teardown.
    /// (A mutex only to make the context `Sync`: teardown owns it.)
    after_teardown: Mutex<Option<AfterTeardown>>,
}

impl fmt::Debug for VulkanContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VulkanContext")
            .field("device", &self.shared.info.name)
            .field("validation", &self.shared.config.validation)
            .field("lost", &self.shared.is_lost())
            .finish()
    }
}

impl VulkanContext {
    /// Open libvulkan, create an instance (with validation if asked) and a
    /// device, and start the free thread.
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
    ///   its own mutexes, which other code cannot see); with `queue_count`
    ///   0, every buffer is released only after the runtime's last
    ///   submission using it has completed (memgov cannot see the runtime's
    ///   queue, so nothing else orders the free);
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
            after_teardown,
        } = adopted;
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
        let mut ctx = Self::assemble(
            entry,
            instance,
            created,
            physical_device,
            dev,
            config,
            probe,
            destroy_on_teardown,
        )?;
        ctx.after_teardown = Mutex::new(after_teardown);
        Ok(ctx)
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
                return Err(error("new", "vkCreateSemaphore (wake)", r));
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
                return Err(error("new", "vkCreateSemaphore (never)", r));
            }
        };
        let has_memory_budget = info.memory_budget;
        let shell = Shell::new(format!("Vulkan device {}", info.name), probe.common.clone());
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
            shell,
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
            idle: std::sync::Condvar::new(),
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
            after_teardown: Mutex::new(None),
        })
    }

    /// A probe that observes this context's bookkeeping, before and after
    /// teardown. With validation on, every validation warning or error is a
    /// violation there too.
    pub fn probe(&self) -> BackendProbe {
        self.shared.probe.common.clone()
    }

    /// What only Vulkan observes: validation messages by severity, loader
    /// messages, the free thread's waits, backend notes.
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

    /// Number of queues the streams share (0 for a device adopted without
    /// queues: memgov submits nothing).
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
        self.tear_down_leaking(false, true)
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
        self.memory_info_impl()
    }

    fn create_stream(&self) -> Result<VulkanStream, BackendError> {
        self.create_stream_impl()
    }

    fn destroy_stream(&self, stream: VulkanStream) -> Result<(), BackendError> {
        self.destroy_stream_impl(stream)
    }

    fn allocate(&self, stream: &VulkanStream, bytes: u64) -> Result<VulkanMemory, BackendError> {
        self.allocate_impl(&stream.inner, bytes, Tier::Device)
    }

    fn allocate_in(
        &self,
        stream: &VulkanStream,
        bytes: u64,
        tier: Tier,
    ) -> Result<VulkanMemory, BackendError> {
        self.allocate_impl(&stream.inner, bytes, tier)
    }

    fn free_async(
        &self,
        stream: &VulkanStream,
        memory: VulkanMemory,
        retired: RetireSignal,
    ) -> Result<(), (VulkanMemory, RetireSignal, BackendError)> {
        self.free_async_impl(stream, memory, retired)
    }

    fn write(
        &self,
        stream: &VulkanStream,
        memory: &VulkanMemory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.shared.check_usable("write")?;
        self.shared.own_stream("write", &stream.inner)?;
        stream.transfer_in(memory, offset, src)
    }

    fn read(
        &self,
        stream: &VulkanStream,
        memory: &VulkanMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        self.shared.check_usable("read")?;
        self.shared.own_stream("read", &stream.inner)?;
        stream.transfer_out(memory, offset, dst)
    }

    fn synchronize(&self, stream: &VulkanStream) -> Result<(), BackendError> {
        self.shared.check_usable("synchronize")?;
        self.shared.own_stream("synchronize", &stream.inner)?;
        stream.synchronize_inner("synchronize")
    }

    /// Blocks until `after`'s submissions have executed and the frees parked
    /// on it have retired, like `synchronize(after)`. A free parked on
    /// `stream` afterwards then retires after all of that.
    ///
    /// (A batch on `stream` that waits on `after`'s timeline would order the
    /// device without blocking, but frees parked on `after` could then still
    /// retire after the free on `stream`: the free thread fires each
    /// stream's frees when that stream's timeline reaches them.)
    fn order_after(&self, stream: &VulkanStream, after: &VulkanStream) -> Result<(), BackendError> {
        self.shared.check_usable("order_after")?;
        self.shared.own_stream("order_after", &stream.inner)?;
        self.shared.own_stream("order_after", &after.inner)?;
        after.synchronize_inner("order_after")
    }

    fn device_lost(&self) {
        // Declared by the governor: drop parked signals, touch nothing.
        self.shared.on_lost("declared lost by the governor", false);
    }

    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        self.tear_down(lost)
    }
}
