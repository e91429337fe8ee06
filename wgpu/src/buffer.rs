//! [`GovernedBuffer`]: a `wgpu::Buffer` whose memory is a memgov allocation.

use crate::device::lock;
use memgov::vulkan::VulkanContext;
use memgov::{DeviceBuffer, Role};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Where a buffer's governed memory waits for wgpu to let go of it.
pub(crate) type Slot = Arc<Mutex<Option<DeviceBuffer<VulkanContext>>>>;

/// The wgpu handles of a device's live governed buffers, so that a forced
/// retire can destroy them through wgpu.
#[derive(Default)]
pub(crate) struct Registry {
    next: AtomicU64,
    live: Mutex<HashMap<u64, wgpu::Buffer>>,
    /// Bytes given back by wgpu's drop callbacks, ever (the pressure
    /// responder reports its difference).
    released: AtomicU64,
}

impl Registry {
    fn add(&self, buffer: &wgpu::Buffer) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.live).insert(id, buffer.clone());
        id
    }

    fn remove(&self, id: u64) -> Option<wgpu::Buffer> {
        lock(&self.live).remove(&id)
    }

    pub(crate) fn count_released(&self, bytes: u64) {
        self.released.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn released(&self) -> u64 {
        self.released.load(Ordering::Relaxed)
    }

    pub(crate) fn live(&self) -> Vec<wgpu::Buffer> {
        lock(&self.live).values().cloned().collect()
    }
}

/// A `wgpu::Buffer` (it derefs to one) in memgov-governed memory.
///
/// Dropping it (and every clone of the inner `wgpu::Buffer`) lets wgpu
/// release it: the memory goes back to memgov once wgpu's last submission
/// using the buffer has completed.
pub struct GovernedBuffer {
    buffer: wgpu::Buffer,
    label: String,
    role: Role,
    charged: u64,
    id: u64,
    slot: Slot,
    registry: Arc<Registry>,
}

impl std::fmt::Debug for GovernedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GovernedBuffer")
            .field("label", &self.label)
            .field("size", &self.buffer.size())
            .field("role", &self.role)
            .finish()
    }
}

impl GovernedBuffer {
    pub(crate) fn new(
        buffer: wgpu::Buffer,
        label: String,
        role: Role,
        charged: u64,
        slot: Slot,
        registry: Arc<Registry>,
    ) -> Self {
        let id = registry.add(&buffer);
        Self {
            buffer,
            label,
            role,
            charged,
            id,
            slot,
            registry,
        }
    }

    /// The wgpu buffer.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// The role it is charged with.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Bytes charged to the context for it.
    pub fn charged(&self) -> u64 {
        self.charged
    }

    /// The label it was created with.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Test-only: take the governed memory out now, so that dropping it
    /// frees the memory while wgpu may still use the buffer (the planted
    /// violation the validation test catches). Never use it otherwise.
    #[doc(hidden)]
    pub fn take_memory_for_test(&self) -> Option<DeviceBuffer<VulkanContext>> {
        lock(&self.slot).take()
    }

    /// Test-only: copy bytes of the governed memory through memgov's
    /// mapping (host-visible memory only; wait for wgpu's submissions
    /// first). Never use it otherwise.
    #[doc(hidden)]
    pub fn read_memory_for_test(
        &self,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), memgov::GovernorError> {
        let slot = lock(&self.slot);
        let memory = slot
            .as_ref()
            .expect("a live governed buffer has its memory");
        memory.read(offset, dst)
    }

    pub(crate) fn into_parts(self) -> (wgpu::Buffer, String, Slot) {
        (self.buffer.clone(), self.label.clone(), self.slot.clone())
    }
}

impl std::ops::Deref for GovernedBuffer {
    type Target = wgpu::Buffer;
    fn deref(&self) -> &wgpu::Buffer {
        &self.buffer
    }
}

impl Drop for GovernedBuffer {
    fn drop(&mut self) {
        drop(self.registry.remove(self.id));
    }
}
