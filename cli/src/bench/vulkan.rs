//! The Vulkan row: the governed allocate + write + stream-ordered free
//! cycle against the same work done with raw ash and gpu-allocator, for
//! `memgov bench` and `benches/vulkan_cycle.rs` (which includes this file).
//!
//! Both sides use the same device setup (validation off), the same allocator
//! settings, a staging copy submitted on a timeline semaphore for the write,
//! and a free that waits for the timeline: the raw side retires its frees
//! inline at the start of the next cycle, the governed side through the
//! backend's free thread. The raw side borrows the device of an
//! ungoverned `VulkanContext` (public accessors only) and does everything
//! else by hand.

use ash::vk;
use gpu_allocator::vulkan::{
    Allocation, AllocationCreateDesc, AllocationScheme, Allocator, AllocatorCreateDesc,
};
use gpu_allocator::{AllocationSizes, AllocatorDebugSettings, MemoryLocation};
use memgov::vulkan::{TransferPath, VulkanConfig, VulkanContext};
use memgov::{
    Alloc, BackendError, BackendErrorKind, ContextConfig, ContextHandle, DeviceContext,
    GovernedStream, Governor, Role,
};
use std::collections::VecDeque;

fn err(op: &'static str, kind: BackendErrorKind, message: impl Into<String>) -> BackendError {
    BackendError::new("vulkan", op, kind, message)
}

fn vk_error(op: &'static str, r: vk::Result, call: &str) -> BackendError {
    let kind = match r {
        vk::Result::ERROR_DEVICE_LOST => BackendErrorKind::DeviceLost,
        vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY => {
            BackendErrorKind::OutOfMemory
        }
        _ => BackendErrorKind::Other,
    };
    err(op, kind, format!("{call} failed: {r:?}"))
}

/// Bytes allocated per cycle.
pub const CYCLE_BYTES: u64 = 64 << 10;
/// Bytes written per cycle.
pub const CYCLE_WRITE: usize = 4 << 10;

fn bench_config() -> VulkanConfig {
    VulkanConfig {
        validation: false,
        transfer: TransferPath::Staging,
        staging_bytes: 1 << 20,
        ..VulkanConfig::default()
    }
}

fn gov_err(e: impl std::fmt::Display) -> BackendError {
    super::cycle::governed_error("vulkan", e)
}

/// The governed cycle: `Governor<VulkanContext>`, one stream, allocate +
/// write + drop (stream-ordered free).
pub struct GovernedCycle {
    _gov: Governor<VulkanContext>,
    ctx: ContextHandle<VulkanContext>,
    stream: Option<GovernedStream<VulkanContext>>,
    data: Vec<u8>,
}

impl GovernedCycle {
    /// Create the device, governor, context and stream.
    pub fn new() -> Result<Self, BackendError> {
        let gov = Governor::new();
        let ctx = gov.register(
            VulkanContext::new(bench_config())?,
            ContextConfig::new().label("bench-governed"),
        );
        let stream = ctx.create_stream("bench").map_err(gov_err)?;
        Ok(Self {
            _gov: gov,
            ctx,
            stream: Some(stream),
            data: vec![0x5a; CYCLE_WRITE],
        })
    }

    /// One cycle.
    pub fn cycle(&mut self) -> Result<(), BackendError> {
        let stream = self.stream.as_ref().expect("stream until finish");
        let buf = self
            .ctx
            .allocate(stream, Alloc::new(CYCLE_BYTES, Role::Workspace))
            .map_err(gov_err)?;
        buf.write(0, &self.data).map_err(gov_err)?;
        drop(buf);
        Ok(())
    }

    /// Synchronize, retire and tear down.
    pub fn finish(mut self) -> Result<(), BackendError> {
        super::cycle::retire("vulkan", &self.ctx, self.stream.take())
    }
}

/// The raw cycle: ash + gpu-allocator by hand, same work.
pub struct RawCycle {
    /// The device's owner. It is never governed and creates no stream, so
    /// nothing but this cycle submits to its queue 0.
    context: Option<VulkanContext>,
    device: ash::Device,
    queue: vk::Queue,
    allocator: Option<Allocator>,
    timeline: vk::Semaphore,
    value: u64,
    pool: vk::CommandPool,
    cmd: vk::CommandBuffer,
    staging: Option<(vk::Buffer, Allocation)>,
    parked: VecDeque<(u64, vk::Buffer, Allocation)>,
    data: Vec<u8>,
    bda: bool,
}

impl RawCycle {
    /// Create the device (same selection and features as the governed side).
    pub fn new() -> Result<Self, BackendError> {
        let config = bench_config();
        let context = VulkanContext::new(config.clone())?;
        let device = context.device().clone();
        let bda = context.buffer_device_address();
        let mut debug_settings = AllocatorDebugSettings::default();
        debug_settings.log_leaks_on_shutdown = false;
        let allocator = Allocator::new(&AllocatorCreateDesc {
            instance: context.instance().clone(),
            device: device.clone(),
            physical_device: context.physical_device(),
            debug_settings,
            buffer_device_address: bda,
            allocation_sizes: AllocationSizes::new(config.block_bytes, config.block_bytes / 4)
                .with_max_device_memblock_size(256 << 20),
        })
        .map_err(|e| err("bench", BackendErrorKind::Other, e.to_string()))?;
        let mut ti =
            vk::SemaphoreTypeCreateInfo::default().semaphore_type(vk::SemaphoreType::TIMELINE);
        let queue_family = context.queue_family_index();
        // SAFETY: valid device with timeline semaphores (memgov requires
        // them); queue 0 of the family exists (the context uses it); objects
        // are destroyed in `finish` after the device is idle, before the
        // context tears the device down.
        let (timeline, pool, cmd, queue) = unsafe {
            let timeline = device
                .create_semaphore(&vk::SemaphoreCreateInfo::default().push_next(&mut ti), None)
                .map_err(|r| vk_error("bench", r, "vkCreateSemaphore"))?;
            let pool = device
                .create_command_pool(
                    &vk::CommandPoolCreateInfo::default()
                        .flags(
                            vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER
                                | vk::CommandPoolCreateFlags::TRANSIENT,
                        )
                        .queue_family_index(queue_family),
                    None,
                )
                .map_err(|r| vk_error("bench", r, "vkCreateCommandPool"))?;
            let cmd = device
                .allocate_command_buffers(
                    &vk::CommandBufferAllocateInfo::default()
                        .command_pool(pool)
                        .command_buffer_count(1),
                )
                .map_err(|r| vk_error("bench", r, "vkAllocateCommandBuffers"))?[0];
            (
                timeline,
                pool,
                cmd,
                device.get_device_queue(queue_family, 0),
            )
        };
        let mut me = Self {
            context: Some(context),
            device,
            queue,
            allocator: Some(allocator),
            timeline,
            value: 0,
            pool,
            cmd,
            staging: None,
            parked: VecDeque::new(),
            data: vec![0x5a; CYCLE_WRITE],
            bda,
        };
        let staging = me.buffer(config.staging_bytes, MemoryLocation::CpuToGpu)?;
        me.staging = Some(staging);
        Ok(me)
    }

    fn buffer(
        &mut self,
        bytes: u64,
        location: MemoryLocation,
    ) -> Result<(vk::Buffer, Allocation), BackendError> {
        let mut usage = vk::BufferUsageFlags::TRANSFER_SRC
            | vk::BufferUsageFlags::TRANSFER_DST
            | vk::BufferUsageFlags::STORAGE_BUFFER;
        if self.bda {
            usage |= vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS;
        }
        let info = vk::BufferCreateInfo::default().size(bytes).usage(usage);
        // SAFETY: valid device; the buffer is bound right below and destroyed
        // before the allocator and the device.
        unsafe {
            let buffer = self
                .device
                .create_buffer(&info, None)
                .map_err(|r| vk_error("bench", r, "vkCreateBuffer"))?;
            let requirements = self.device.get_buffer_memory_requirements(buffer);
            let allocation = self
                .allocator
                .as_mut()
                .expect("allocator until finish")
                .allocate(&AllocationCreateDesc {
                    name: "raw",
                    requirements,
                    location,
                    linear: true,
                    allocation_scheme: AllocationScheme::GpuAllocatorManaged,
                })
                .map_err(|e| err("bench", BackendErrorKind::OutOfMemory, e.to_string()))?;
            self.device
                .bind_buffer_memory(buffer, allocation.memory(), allocation.offset())
                .map_err(|r| vk_error("bench", r, "vkBindBufferMemory"))?;
            Ok((buffer, allocation))
        }
    }

    fn retire_reached(&mut self) -> Result<(), BackendError> {
        if self.parked.is_empty() {
            return Ok(());
        }
        // SAFETY: valid timeline semaphore.
        let reached = unsafe { self.device.get_semaphore_counter_value(self.timeline) }
            .map_err(|r| vk_error("bench", r, "vkGetSemaphoreCounterValue"))?;
        while self.parked.front().is_some_and(|p| p.0 <= reached) {
            let (_, buffer, allocation) = self.parked.pop_front().expect("checked");
            // SAFETY: the timeline passed the last use of the buffer.
            unsafe { self.device.destroy_buffer(buffer, None) };
            let _ = self.allocator.as_mut().expect("allocator").free(allocation);
        }
        Ok(())
    }

    /// One cycle.
    pub fn cycle(&mut self) -> Result<(), BackendError> {
        self.retire_reached()?;
        let (buffer, allocation) = self.buffer(CYCLE_BYTES, MemoryLocation::GpuOnly)?;
        let (staging, ptr) = {
            let (b, a) = self.staging.as_ref().expect("staging");
            (
                *b,
                a.mapped_ptr().expect("mapped staging").as_ptr() as *mut u8,
            )
        };
        let prev = self.value;
        let value = prev + 1;
        // SAFETY: the staging mapping holds at least CYCLE_WRITE bytes and is
        // idle (the previous copy was waited for); the command buffer is not
        // pending; the submission's resources live until the wait returns.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.as_ptr(), ptr, self.data.len());
            let d = &self.device;
            d.begin_command_buffer(
                self.cmd,
                &vk::CommandBufferBeginInfo::default()
                    .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
            )
            .map_err(|r| vk_error("bench", r, "vkBeginCommandBuffer"))?;
            d.cmd_copy_buffer(
                self.cmd,
                staging,
                buffer,
                &[vk::BufferCopy {
                    src_offset: 0,
                    dst_offset: 0,
                    size: self.data.len() as u64,
                }],
            );
            d.end_command_buffer(self.cmd)
                .map_err(|r| vk_error("bench", r, "vkEndCommandBuffer"))?;
            let waits = [self.timeline];
            let wait_vals = [prev];
            let stages = [vk::PipelineStageFlags::ALL_COMMANDS];
            let signal = [self.timeline];
            let signal_vals = [value];
            let n = usize::from(prev > 0);
            let mut tsi = vk::TimelineSemaphoreSubmitInfo::default()
                .wait_semaphore_values(&wait_vals[..n])
                .signal_semaphore_values(&signal_vals);
            let cmds = [self.cmd];
            let info = vk::SubmitInfo::default()
                .wait_semaphores(&waits[..n])
                .wait_dst_stage_mask(&stages[..n])
                .command_buffers(&cmds)
                .signal_semaphores(&signal)
                .push_next(&mut tsi);
            d.queue_submit(self.queue, &[info], vk::Fence::null())
                .map_err(|r| vk_error("bench", r, "vkQueueSubmit"))?;
            self.value = value;
            d.wait_semaphores(
                &vk::SemaphoreWaitInfo::default()
                    .semaphores(&signal)
                    .values(&signal_vals),
                u64::MAX,
            )
            .map_err(|r| vk_error("bench", r, "vkWaitSemaphores"))?;
        }
        // Stream-ordered free: parked at the last value, retired later.
        self.parked.push_back((self.value, buffer, allocation));
        Ok(())
    }

    /// Wait idle, free everything, destroy the device.
    pub fn finish(mut self) -> Result<(), BackendError> {
        // SAFETY: nothing else uses the device; after idle no submission is
        // pending, so every object may be destroyed, allocator before the
        // context destroys the device.
        unsafe {
            self.device
                .device_wait_idle()
                .map_err(|r| vk_error("bench", r, "vkDeviceWaitIdle"))?;
            self.retire_reached()?;
            if let Some((b, a)) = self.staging.take() {
                self.device.destroy_buffer(b, None);
                let _ = self.allocator.as_mut().expect("allocator").free(a);
            }
            drop(self.allocator.take());
            self.device.destroy_command_pool(self.pool, None);
            self.device.destroy_semaphore(self.timeline, None);
        }
        match self.context.take() {
            Some(c) => c.teardown(false),
            None => Ok(()),
        }
    }
}

/// Run `iterations` governed cycles and `iterations` raw cycles (after a
/// warm-up of each) and return nanoseconds per cycle: `(governed, raw)`.
/// The ratio `governed / raw` is the governor's overhead (target: <= 1.3).
pub fn cycle_ratio(iterations: u32) -> Result<(u64, u64), BackendError> {
    let mut pair = (GovernedCycle::new()?, RawCycle::new()?);
    let ns = super::cycle::interleaved(iterations, &mut pair, |p| p.0.cycle(), |p| p.1.cycle())?;
    let (g, r) = pair;
    g.finish()?;
    r.finish()?;
    Ok(ns)
}
