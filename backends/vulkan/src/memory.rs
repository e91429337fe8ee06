//! Memory: a `VkBuffer` bound to a gpu-allocator suballocation
//! ([`VulkanMemory`]), its creation and destruction, and the context's
//! `allocate`, `allocate_in` and `memory_info`. The allocator and the books
//! of live buffers these work on are `allocator.rs`'s.
//!
//! The device tier is `MemoryLocation::GpuOnly` (a `DEVICE_LOCAL` type).
//! Pinned host memory ([`Tier::PinnedHost`]) is `MemoryLocation::GpuToCpu`:
//! a `HOST_VISIBLE | HOST_COHERENT` type, `HOST_CACHED` preferred, which on
//! a discrete GPU is system memory rather than the device-local window
//! (`CpuToGpu` would prefer `DEVICE_LOCAL`). It is persistently mapped, so
//! `write` and `read` copy through the mapping once the stream's earlier
//! work has completed, and it is freed like every buffer: destroyed after
//! the stream's timeline passes the release, never under queued work.

use crate::allocator::{Live, MemState};
use crate::result::err;
use crate::shared::Shared;
use crate::stream_state::StreamState;
use crate::VulkanContext;
use ash::vk;
use gpu_allocator::vulkan::{AllocationCreateDesc, AllocationScheme};
use gpu_allocator::MemoryLocation;
use memgov_backend::{lock, BackendError, BackendErrorKind, MemoryInfo, Tier};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// A raw allocation: a `VkBuffer` bound to a suballocation. A plain handle:
/// dropping it does nothing; only `free_async` or teardown release it.
#[derive(Debug)]
pub struct VulkanMemory {
    pub(crate) id: u64,
    pub(crate) context: u64,
    pub(crate) buffer: vk::Buffer,
    pub(crate) bytes: u64,
    pub(crate) device_address: Option<u64>,
    /// Host address of the mapping, when host-visible.
    pub(crate) mapped: Option<usize>,
    /// The tier it was allocated in.
    pub(crate) tier: Tier,
    /// Held across every host copy through the mapping: `write` and `read`
    /// take the memory by shared reference, so two threads may copy into
    /// (or out of) the same bytes at once, and unsynchronized access to the
    /// same bytes is a data race. Copies of one allocation are serialized,
    /// as the host backend's are; different allocations do not contend.
    pub(crate) host_access: Mutex<()>,
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
    /// The tier it was allocated in.
    pub fn tier(&self) -> Tier {
        self.tier
    }
}

impl Shared {
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
        usage |= self.config.buffer_usage;
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

impl VulkanContext {
    pub(crate) fn memory_info_impl(&self) -> Result<MemoryInfo, BackendError> {
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

    pub(crate) fn allocate_impl(
        &self,
        stream: &StreamState,
        bytes: u64,
        tier: Tier,
    ) -> Result<VulkanMemory, BackendError> {
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
        let (location, name) = match tier {
            Tier::Device => (MemoryLocation::GpuOnly, "memgov"),
            _ => (MemoryLocation::GpuToCpu, "memgov pinned host"),
        };
        let live = shared.create_buffer("allocate", bytes, location, name)?;
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
            tier,
            host_access: Mutex::new(()),
        };
        shared.probe.common.allocated(live.allocation.size());
        lock(&shared.mem).live.insert(id, live);
        Ok(memory)
    }
}
