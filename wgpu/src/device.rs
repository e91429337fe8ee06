//! [`GovernedDevice`]: one `VkDevice` shared by a `wgpu::Device` and a memgov
//! Vulkan context, and the [`Keeper`] that destroys it once both are done.

use crate::buffer::{GovernedBuffer, Registry, Slot};
use crate::Error;
use ash::vk;
use memgov::vulkan::{
    AdoptedDevice, ValidationMessenger, VulkanConfig, VulkanContext, VulkanValidation,
};
use memgov::{
    Alloc, BackendProbe, ContextConfig, ContextHandle, DeviceBuffer, GovernedStream, Governor,
    Role, TeardownReport,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use wgpu::hal::api::Vulkan;

/// The label a buffer of [`GovernedDevice::create_buffer`] is counted
/// under, beside its caller's line, with call-site attribution on.
pub const BUFFER_LABEL: &str = "wgpu buffer";

/// Settings of a [`GovernedDevice`].
#[derive(Debug, Clone)]
pub struct WgpuConfig {
    /// Turn on `VK_LAYER_KHRONOS_validation` (wgpu's `InstanceFlags::VALIDATION`)
    /// and count every message in [`GovernedDevice::validation`]. Opening
    /// fails when it is asked for and not installed.
    pub validation: bool,
    /// Which Vulkan adapter of `wgpu::Instance::enumerate_adapters`, in
    /// order (0: the first).
    pub adapter: usize,
    /// Features the wgpu device is created with.
    pub features: wgpu::Features,
    /// Limits the wgpu device is created with.
    pub limits: wgpu::Limits,
    /// The memgov context's settings: budget, label, admission.
    pub context: ContextConfig,
    /// Register a pressure responder that lets wgpu give back what it still
    /// holds: buffers dropped by the caller whose last submission wgpu has
    /// not yet seen complete. Asked when an allocation does not fit, it
    /// flushes wgpu's queue, waits for it, lets wgpu release those buffers,
    /// and reports the bytes that came back.
    pub poll_on_pressure: bool,
}

impl Default for WgpuConfig {
    fn default() -> Self {
        Self {
            validation: false,
            adapter: 0,
            features: wgpu::Features::empty(),
            limits: wgpu::Limits::default(),
            context: ContextConfig::new().label("wgpu"),
            poll_on_pressure: true,
        }
    }
}

/// How [`GovernedDevice::retire`] treats buffers that wgpu still holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetireMode {
    /// Wait, polling wgpu, until every governed buffer has been dropped and
    /// wgpu's last submission using it has completed.
    Wait,
    /// Destroy every governed buffer still alive through wgpu
    /// (`wgpu::Buffer::destroy`: wgpu lets its submissions finish, then
    /// lets go, and a later use is a wgpu validation error, never a use of
    /// freed memory), then wait as [`Wait`](Self::Wait) does.
    Force,
}

/// Keeps the shared `VkDevice` (and, through the adapter, the instance)
/// alive until both wgpu and memgov are done with it; the last of the two
/// drops it, which destroys the device and then the validation messenger.
struct Keeper {
    device: ash::Device,
    messenger: Mutex<Option<ValidationMessenger>>,
    /// Holds wgpu's instance (and its loader) alive past the device.
    _adapter: wgpu::Adapter,
}

impl Drop for Keeper {
    fn drop(&mut self) {
        // SAFETY: the Keeper is dropped by the last of wgpu's device drop
        // callback (wgpu-hal has destroyed everything it created on the
        // device) and memgov's after-teardown hook (memgov has destroyed
        // everything it created and joined its thread): nothing else uses
        // or holds the device.
        unsafe { self.device.destroy_device(None) };
        let messenger = self
            .messenger
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(m) = messenger {
            // SAFETY: the instance is alive: `_adapter` holds it and is
            // dropped only after this body.
            unsafe { m.destroy() };
        }
    }
}

/// A `wgpu::Device` and a memgov Vulkan context on one `VkDevice`: buffers
/// made with [`create_buffer`](Self::create_buffer) are memgov allocations,
/// charged with a role under the context's budgets, that wgpu uses as its
/// own.
pub struct GovernedDevice {
    device: wgpu::Device,
    queue: wgpu::Queue,
    context: ContextHandle<VulkanContext>,
    stream: Mutex<Option<GovernedStream<VulkanContext>>>,
    registry: Arc<Registry>,
    /// What the pressure responder polls; emptied when this is dropped, so
    /// that the memgov context (which keeps its responders until teardown)
    /// does not keep the wgpu device alive.
    polled: Arc<Mutex<Option<(wgpu::Device, wgpu::Queue)>>>,
    probe: BackendProbe,
    validation: Option<VulkanValidation>,
    name: String,
    /// The shared `VkDevice`, for the zero-fill recorded on wgpu's command
    /// buffers (kept alive by `device`, whose drop callback holds the Keeper).
    raw: ash::Device,
    /// Test-only: zero new buffers on the GPU even where the memory is
    /// host-visible (the path every device-local memory takes).
    zero_on_gpu: AtomicBool,
}

impl Drop for GovernedDevice {
    fn drop(&mut self) {
        drop(lock(&self.polled).take());
    }
}

impl std::fmt::Debug for GovernedDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GovernedDevice")
            .field("adapter", &self.name)
            .field("context", &self.context.label())
            .finish()
    }
}

/// wgpu's Vulkan instance. With validation, the hal instance gets
/// `VALIDATION | DEBUG` (DEBUG is what makes wgpu-hal enable
/// `VK_EXT_debug_utils`, which the messenger needs), and the wgpu-core
/// instance wrapped around it keeps its default flags: with DEBUG there,
/// every shader would carry its WGSL source as SPIR-V debug info, whose
/// source language (WGSL, 10) validation layers older than SPIR-V 1.6's
/// registry reject as invalid SPIR-V.
fn instance(validation: bool) -> Result<wgpu::Instance, Error> {
    use wgpu::hal::Instance as _;
    let flags = if validation {
        wgpu::InstanceFlags::VALIDATION | wgpu::InstanceFlags::DEBUG
    } else {
        wgpu::InstanceFlags::empty()
    };
    let desc = wgpu::hal::InstanceDescriptor {
        name: "memgov-wgpu",
        flags,
        memory_budget_thresholds: Default::default(),
        backend_options: Default::default(),
        telemetry: None,
        display: None,
    };
    // SAFETY: no display handle; the descriptor lives for the call.
    let hal = unsafe { wgpu::hal::vulkan::Instance::init(&desc) }.map_err(|e| {
        Error::NoAdapter(format!("wgpu-hal could not create a Vulkan instance: {e}"))
    })?;
    // SAFETY: a Vulkan hal instance, handed over whole.
    Ok(unsafe { wgpu::Instance::from_hal::<Vulkan>(hal) })
}

fn wgpu_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Wgpu(format!("{what}: {e}"))
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl GovernedDevice {
    /// Open wgpu's Vulkan adapter, create the `VkDevice` with what wgpu
    /// needs, hand it to wgpu (`device_from_raw`, `create_device_from_hal`)
    /// and to memgov (`VulkanContext::adopt`, without queues: wgpu owns the
    /// queue), and register the context with `governor`.
    ///
    /// # Errors
    ///
    /// [`Error::NoAdapter`] without a Vulkan driver, [`Error::Wgpu`] when
    /// wgpu refuses the device, [`Error::Backend`] when memgov cannot adopt it.
    pub fn open(governor: &Governor<VulkanContext>, config: WgpuConfig) -> Result<Self, Error> {
        let instance = instance(config.validation)?;
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN));
        let count = adapters.len();
        let adapter = adapters.into_iter().nth(config.adapter).ok_or_else(|| {
            Error::NoAdapter(format!(
                "adapter {} asked for, {count} present",
                config.adapter
            ))
        })?;
        let name = adapter.get_info().name;
        // SAFETY: the adapter is a Vulkan one (enumerated with
        // Backends::VULKAN), so the hal type is right; the guard is dropped
        // before the adapter is used through wgpu again.
        let hal_adapter = unsafe { adapter.as_hal::<Vulkan>() }
            .ok_or_else(|| Error::NoAdapter("the adapter is not a wgpu-core Vulkan one".into()))?;
        let shared = hal_adapter.shared_instance();
        let (entry, raw_instance) = (shared.entry().clone(), shared.raw_instance().clone());
        let debug_utils = shared.extensions().contains(&ash::ext::debug_utils::NAME);
        if config.validation && !debug_utils {
            return Err(Error::Backend(memgov::BackendError::new(
                "wgpu",
                "open",
                memgov::BackendErrorKind::Unavailable,
                "validation was asked for but wgpu's instance has no VK_EXT_debug_utils: install vulkan-validationlayers",
            )));
        }
        let messenger = if config.validation {
            // SAFETY: the instance has VK_EXT_debug_utils (checked above) and
            // outlives the messenger: the Keeper destroys it before it lets
            // go of the adapter, which holds the instance.
            Some(
                unsafe { ValidationMessenger::attach(&entry, &raw_instance) }
                    .map_err(Error::Backend)?,
            )
        } else {
            None
        };
        let validation = messenger.as_ref().map(ValidationMessenger::validation);
        let physical = hal_adapter.raw_physical_device();
        let extensions = hal_adapter.required_device_extensions(config.features);
        let mut features = hal_adapter.physical_device_features(&extensions, config.features);
        // wgpu-hal opens family 0, queue 0; so does this.
        let family = 0u32;
        let priorities = [1.0f32];
        let queue_info = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&priorities)];
        let names: Vec<_> = extensions.iter().map(|e| e.as_ptr()).collect();
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queue_info)
            .enabled_extension_names(&names);
        let info = features.add_to_device_create(info);
        // SAFETY: the physical device belongs to this instance; every pointer
        // in `info` (queue infos, names, chained feature structs in
        // `features`) lives until the call returns; the extensions and
        // features are the ones wgpu-hal computed as supported.
        let raw_device = unsafe { raw_instance.create_device(physical, &info, None) }
            .map_err(|r| wgpu_err("vkCreateDevice", r))?;
        let memory_budget = extensions.contains(&ash::ext::memory_budget::NAME);
        let raw = raw_device.clone();
        let keeper = Arc::new(Keeper {
            device: raw_device.clone(),
            messenger: Mutex::new(messenger),
            _adapter: adapter.clone(),
        });
        let for_wgpu = keeper.clone();
        // SAFETY: the device was created from this adapter with family 0,
        // `extensions` (exactly `required_device_extensions`) and
        // `physical_device_features`; with a drop callback wgpu does not
        // destroy it, and the Keeper keeps it valid until the callback has
        // run (and memgov's teardown has finished).
        let open = unsafe {
            hal_adapter.device_from_raw(
                raw_device.clone(),
                Some(Box::new(move || drop(for_wgpu))),
                &extensions,
                config.features,
                &config.limits,
                &wgpu::MemoryHints::Performance,
                family,
                0,
            )
        }
        .map_err(|e| wgpu_err("device_from_raw", e))?;
        drop(hal_adapter);
        let desc = wgpu::DeviceDescriptor {
            label: Some("memgov-wgpu"),
            required_features: config.features,
            required_limits: config.limits.clone(),
            ..Default::default()
        };
        // SAFETY: `open` came from this adapter's hal adapter.
        let (device, queue) = unsafe { adapter.create_device_from_hal(open, &desc) }
            .map_err(|e| wgpu_err("create_device_from_hal", e))?;
        let for_memgov = keeper;
        let adopted = AdoptedDevice {
            entry,
            instance: raw_instance,
            physical_device: physical,
            device: raw_device,
            queue_family_index: family,
            queue_count: 0,
            buffer_device_address: false,
            memory_budget,
            destroy_on_teardown: false,
            after_teardown: Some(Box::new(move || drop(for_memgov))),
        };
        let vk_config = VulkanConfig {
            buffer_usage: vk::BufferUsageFlags::UNIFORM_BUFFER
                | vk::BufferUsageFlags::VERTEX_BUFFER
                | vk::BufferUsageFlags::INDEX_BUFFER
                | vk::BufferUsageFlags::INDIRECT_BUFFER,
            ..VulkanConfig::default()
        };
        // SAFETY: the device was created from `physical_device` of
        // `instance` with timelineSemaphore (wgpu-hal enables it on Vulkan
        // 1.2 devices, which memgov needs anyway), without
        // bufferDeviceAddress, with VK_EXT_memory_budget as declared. No
        // queues: wgpu alone submits, and `GovernedBuffer` releases memory
        // only from wgpu's drop callback, which wgpu runs once its last
        // submission using the buffer has completed. The device and instance
        // outlive teardown: the after-teardown hook holds the Keeper.
        let backend =
            unsafe { VulkanContext::adopt(adopted, vk_config) }.map_err(Error::Backend)?;
        let probe = backend.probe();
        let context = governor.register(backend, config.context);
        let stream = context.create_stream("wgpu").map_err(Error::Refused)?;
        let registry = Arc::new(Registry::default());
        let polled = Arc::new(Mutex::new(Some((device.clone(), queue.clone()))));
        if config.poll_on_pressure {
            let (polled, registry) = (polled.clone(), registry.clone());
            context.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |_| {
                let Some((device, queue)) = lock(&polled).clone() else {
                    return 0;
                };
                let before = registry.released();
                queue.submit([]);
                // A failed poll frees nothing: the allocation is refused
                // with its numbers, as without the responder.
                let _ = device.poll(wgpu::PollType::wait_indefinitely());
                registry.released() - before
            });
        }
        Ok(Self {
            device,
            queue,
            context,
            stream: Mutex::new(Some(stream)),
            registry,
            polled,
            probe,
            validation,
            name,
            raw,
            zero_on_gpu: AtomicBool::new(false),
        })
    }

    /// The wgpu device.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The wgpu queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// The memgov context: budgets, snapshots, pressure responders.
    pub fn context(&self) -> &ContextHandle<VulkanContext> {
        &self.context
    }

    /// The adapter's name (`llvmpipe (LLVM ...)` on lavapipe).
    pub fn adapter_name(&self) -> &str {
        &self.name
    }

    /// The Vulkan backend's own books: after teardown,
    /// `check_clean_teardown()` says whether every allocation was freed
    /// once, before the device went away.
    pub fn backend_probe(&self) -> BackendProbe {
        self.probe.clone()
    }

    /// What the validation layer said about everything on this device,
    /// wgpu's work and memgov's (with [`WgpuConfig::validation`]); stays
    /// readable after the device is gone.
    pub fn validation(&self) -> Option<VulkanValidation> {
        self.validation.clone()
    }

    /// Test-only: from now on, zero new buffers on the GPU, the path taken
    /// where the memory is not host-visible (a discrete GPU's device-local
    /// memory), even where it is (lavapipe has host-visible memory only).
    /// Never use it otherwise.
    #[doc(hidden)]
    pub fn zero_on_gpu_for_test(&self) {
        self.zero_on_gpu.store(true, Ordering::Relaxed);
    }

    /// A buffer in memgov-governed memory that wgpu uses as its own,
    /// charged to the context with `role`, zero-filled like wgpu's: through
    /// memgov's mapping where the memory is host-visible, else on the GPU
    /// (`vkCmdFillBuffer` over the whole `VkBuffer`, submitted on wgpu's
    /// queue before this returns, so before any submission of the caller's),
    /// whatever the size and usage. The bytes a previous holder left in the
    /// memory never show.
    ///
    /// The memory is released when wgpu lets go of the buffer: after every
    /// handle is dropped (or [`wgpu::Buffer::destroy`] is called) and wgpu's
    /// last submission using it has completed (wgpu finds that out when it
    /// polls, submits or is dropped).
    ///
    /// With call-site attribution on
    /// ([`ContextConfig::attribution`](memgov::ContextConfig::attribution),
    /// or `MEMGOV_ATTRIBUTION=1`), the buffer is counted at the line that
    /// called this (it is `#[track_caller]`: through a helper of your own
    /// marked `#[track_caller]`, that helper's caller) under the label
    /// [`BUFFER_LABEL`], so that a snapshot's `sites` and a refusal name the
    /// caller's code, not this crate's.
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] when memgov refuses the bytes (the budget's
    /// numbers are in the message; nothing was created, the device is
    /// untouched; returned, not reported to wgpu's error scopes:
    /// [`Error::wgpu_error_filter`] says which scope would have caught it), [`Error::Mappable`] for `MAP_READ`, `MAP_WRITE` or
    /// `mapped_at_creation`, [`Error::ZeroSized`], [`Error::Retired`].
    #[track_caller]
    pub fn create_buffer(
        &self,
        desc: &wgpu::BufferDescriptor<'_>,
        role: Role,
    ) -> Result<GovernedBuffer, Error> {
        let label = desc.label.unwrap_or("").to_string();
        if desc
            .usage
            .intersects(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE)
            || desc.mapped_at_creation
        {
            return Err(Error::Mappable { usage: desc.usage });
        }
        if desc.size == 0 {
            return Err(Error::ZeroSized(label));
        }
        let bytes = desc.size.next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
        // Cloned out: the allocation may ask the pressure responder, which
        // calls into wgpu, and no lock of ours is held across that.
        let stream = lock(&self.stream).clone().ok_or(Error::Retired)?;
        let memory = self
            .context
            .allocate(&stream, Alloc::new(bytes, role).label(BUFFER_LABEL))
            .map_err(Error::Refused)?;
        drop(stream);
        let mapped = memory.raw().is_some_and(|m| m.is_mapped())
            && !self.zero_on_gpu.load(Ordering::Relaxed);
        if mapped {
            self.zero_mapped(&memory)?;
            return Ok(self.wrap(memory, label, desc.size, desc.usage));
        }
        let raw = memory
            .raw()
            .map(|m| m.buffer())
            .expect("a live governed buffer has its memory");
        let buffer = self.wrap(memory, label, desc.size, desc.usage);
        self.zero_on_device(&buffer, raw)?;
        Ok(buffer)
    }

    /// Fill a new host-visible allocation with zeros through memgov's
    /// mapping (wgpu's buffers read as zero).
    fn zero_mapped(&self, memory: &DeviceBuffer<VulkanContext>) -> Result<(), Error> {
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        let mut offset = 0;
        while offset < memory.len() {
            let n = (memory.len() - offset).min(ZEROS.len() as u64);
            memory
                .write(offset, &ZEROS[..n as usize])
                .map_err(Error::Refused)?;
            offset += n;
        }
        Ok(())
    }

    /// Hand a governed allocation to wgpu.
    fn wrap(
        &self,
        memory: DeviceBuffer<VulkanContext>,
        label: String,
        size: u64,
        usage: wgpu::BufferUsages,
    ) -> GovernedBuffer {
        let raw = memory
            .raw()
            .map(|m| m.buffer())
            .expect("a live governed buffer has its memory");
        let role = memory.role();
        let charged = memory.charged();
        let slot: Slot = Arc::new(Mutex::new(Some(memory)));
        let on_drop = slot.clone();
        let registry = self.registry.clone();
        // SAFETY: `raw` is a VkBuffer of this device, alive until its
        // DeviceBuffer is released, which happens only when the callback runs
        // (wgpu-hal destroys the hal buffer only after wgpu-core saw its last
        // submission using it complete) or when `migrate_to` takes it out of
        // the slot after destroying the wgpu buffer and waiting for the
        // queue. wgpu never maps it (mapping usages are refused above); it
        // was created with every usage `usage` can ask for (memgov's
        // TRANSFER, STORAGE plus the UNIFORM, VERTEX, INDEX, INDIRECT this
        // crate configures) and `size` bytes or more.
        let hal = unsafe {
            wgpu::hal::vulkan::Buffer::from_raw_externally_owned(
                raw,
                Box::new(move || {
                    let memory = lock(&on_drop).take();
                    if let Some(memory) = memory {
                        registry.count_released(memory.charged());
                        drop(memory);
                    }
                }),
            )
        };
        let desc = wgpu::BufferDescriptor {
            label: Some(&label),
            size,
            usage,
            mapped_at_creation: false,
        };
        // SAFETY: the hal buffer is a Vulkan buffer of this device, of at
        // least `size` bytes, initialized: zeroed through the mapping before
        // this call, zeroed on the GPU by `zero_on_device` in a submission
        // before any the caller can make, or copied by a move.
        let buffer = unsafe { self.device.create_buffer_from_hal::<Vulkan>(hal, &desc) };
        GovernedBuffer::new(buffer, label, role, charged, slot, self.registry.clone())
    }

    /// Fill a new buffer whose memory is not host-visible with zeros on the
    /// GPU, in a submission on wgpu's queue made before the caller has the
    /// buffer (so before any submission of the caller's that uses it).
    ///
    /// The fill is `vkCmdFillBuffer` over the whole `VkBuffer` (offset 0,
    /// `VK_WHOLE_SIZE`), recorded on a wgpu command buffer through
    /// `CommandEncoder::as_hal_mut`: unlike wgpu's `clear_buffer` it needs
    /// neither a size that is a multiple of `COPY_BUFFER_ALIGNMENT` nor
    /// `COPY_DST` in the wgpu usage. The Vulkan rules it meets: the offset
    /// is 0; `VK_WHOLE_SIZE` fills to the end of the buffer rounded down to
    /// a multiple of 4, which is its end (the `VkBuffer` is created with the
    /// wgpu size rounded up to 4); memgov's Vulkan backend creates every
    /// buffer with `TRANSFER_DST`; the command buffer is outside any render
    /// pass and its pool is of wgpu's queue family, which runs wgpu's
    /// compute passes (the rule asks for transfer, graphics or compute).
    /// Bytes of the allocation past the `VkBuffer` (alignment
    /// padding) are reachable through no binding of this buffer.
    ///
    /// A global memory barrier after the fill makes its writes available
    /// to every later command on the queue and to the host. A second
    /// command buffer in the same submission tells wgpu (with
    /// `transition_resources`) that the buffer was last written as a copy
    /// destination: wgpu then keeps the buffer, and so its memory, until
    /// that submission has completed, even if the caller drops it at once,
    /// and its barrier before the buffer's next use starts from that write.
    fn zero_on_device(&self, buffer: &GovernedBuffer, raw: vk::Buffer) -> Result<(), Error> {
        let mut fill = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("memgov-wgpu zero-fill"),
            });
        // SAFETY: the callback records into the open command buffer wgpu
        // hands it (outside any render pass) and neither ends nor destroys
        // it, and the wgpu encoder is not touched meanwhile. `raw` is a
        // VkBuffer of `self.raw`'s device bound to memory that stays alive
        // until wgpu lets go of `buffer` (see `transition_resources` below);
        // the fill's offset, size and the buffer's TRANSFER_DST usage are
        // as the doc comment above states.
        let recorded = unsafe {
            fill.as_hal_mut::<Vulkan, _, _>(|encoder| {
                let cmd = encoder?.raw_handle();
                self.raw.cmd_fill_buffer(cmd, raw, 0, vk::WHOLE_SIZE, 0);
                let barrier = vk::MemoryBarrier::default()
                    .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                    .dst_access_mask(
                        vk::AccessFlags::MEMORY_READ
                            | vk::AccessFlags::MEMORY_WRITE
                            | vk::AccessFlags::HOST_READ,
                    );
                self.raw.cmd_pipeline_barrier(
                    cmd,
                    vk::PipelineStageFlags::TRANSFER,
                    vk::PipelineStageFlags::ALL_COMMANDS | vk::PipelineStageFlags::HOST,
                    vk::DependencyFlags::empty(),
                    &[barrier],
                    &[],
                    &[],
                );
                Some(())
            })
        };
        if recorded.is_none() {
            return Err(Error::Wgpu(
                "zero-filling a new buffer: wgpu's command encoder is not a Vulkan one".into(),
            ));
        }
        let mut track = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("memgov-wgpu zero-fill tracking"),
            });
        track.transition_resources(
            std::iter::once(wgpu::BufferTransition {
                buffer: buffer.buffer(),
                state: wgpu::BufferUses::COPY_DST,
            }),
            std::iter::empty(),
        );
        self.queue.submit([fill.finish(), track.finish()]);
        Ok(())
    }

    /// Submit what wgpu still holds back (`Queue::write_buffer` data waits
    /// for the next submission, and keeps its buffer until then), wait for
    /// every submission, and let wgpu release what it no longer uses.
    fn wait_idle(&self) -> Result<(), Error> {
        self.queue.submit([]);
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| Error::Poll(e.to_string()))
    }

    /// Move live buffers to `target` (another device, or another context on
    /// the same one) with `ContextHandle::migrate`: wgpu's submissions on
    /// this device are waited for, the buffers are destroyed here through
    /// wgpu, their governed memory is copied to `target`'s context and
    /// released stream-ordered on this one, and the copies come back as
    /// buffers of `target`'s wgpu device, same label, size and usage.
    ///
    /// # Errors
    ///
    /// [`Error::Migrate`] when `target` refuses (its budget, say): the
    /// buffers are then back on this device, contents unchanged, as new
    /// `wgpu::Buffer`s (the ones passed in were destroyed).
    pub fn migrate_to(
        &self,
        target: &GovernedDevice,
        buffers: Vec<GovernedBuffer>,
    ) -> Result<Vec<GovernedBuffer>, (Error, Vec<GovernedBuffer>)> {
        if let Err(e) = self.wait_idle() {
            return Err((e, buffers));
        }
        let mut memories = Vec::with_capacity(buffers.len());
        let mut shapes = Vec::with_capacity(buffers.len());
        for b in buffers {
            let (buffer, label, slot) = b.into_parts();
            // Take the memory before wgpu lets go: its callback finds none.
            let memory = lock(&slot)
                .take()
                .expect("a live governed buffer has its memory");
            buffer.destroy();
            shapes.push((label, buffer.size(), buffer.usage()));
            memories.push(memory);
        }
        // wgpu destroys the hal buffers it let go of (none is in use: the
        // queue was idle before they were destroyed).
        if let Err(e) = self.wait_idle() {
            let back = self.rewrap(memories, shapes);
            return Err((e, back));
        }
        let stream = lock(&target.stream).clone();
        let Some(stream) = stream else {
            let back = self.rewrap(memories, shapes);
            return Err((Error::Retired, back));
        };
        match target.context.migrate(&stream, memories) {
            Ok(moved) => Ok(moved
                .into_iter()
                .zip(shapes)
                .map(|(m, (label, size, usage))| target.wrap(m, label, size, usage))
                .collect()),
            Err(e) => {
                let e = *e;
                let count = e.buffers.len();
                let back = self.rewrap(e.buffers, shapes);
                Err((
                    Error::Migrate {
                        count,
                        source: e.error,
                    },
                    back,
                ))
            }
        }
    }

    fn rewrap(
        &self,
        memories: Vec<DeviceBuffer<VulkanContext>>,
        shapes: Vec<(String, u64, wgpu::BufferUsages)>,
    ) -> Vec<GovernedBuffer> {
        memories
            .into_iter()
            .zip(shapes)
            .map(|(m, (label, size, usage))| self.wrap(m, label, size, usage))
            .collect()
    }

    /// Retire the memgov context while wgpu may still hold buffers: no new
    /// buffer can be created, wgpu is polled so that the buffers it has let
    /// go of are released, and the context is torn down once every one is
    /// (with [`RetireMode::Force`], after destroying the rest through wgpu).
    /// The wgpu device stays usable for wgpu's own buffers; the `VkDevice`
    /// lives until wgpu's device is dropped too.
    ///
    /// # Errors
    ///
    /// [`Error::Retire`] when `deadline` passes first, listing what still
    /// holds the context (retire again later); [`Error::Poll`].
    pub fn retire(&self, deadline: Instant, mode: RetireMode) -> Result<TeardownReport, Error> {
        drop(lock(&self.stream).take());
        let handle = self.context.retire();
        if mode == RetireMode::Force {
            for buffer in self.registry.live() {
                buffer.destroy();
            }
        }
        loop {
            self.wait_idle()?;
            let step = (Instant::now() + Duration::from_millis(20)).min(deadline);
            match handle.wait(step) {
                Ok(report) => return Ok(report),
                Err(e) if Instant::now() >= deadline => return Err(Error::Retire(e)),
                Err(_) => {}
            }
        }
    }
}
