//! The context's gpu-allocator and the buffers alive on it ([`MemState`]):
//! data the context's shared state holds. Creating and destroying buffers is
//! `memory.rs`'s.

use ash::vk;
use gpu_allocator::vulkan::Allocator;
use gpu_allocator::AllocatorDebugSettings;
use std::collections::HashMap;

/// A buffer bound to its suballocation.
pub(crate) struct Live {
    pub buffer: vk::Buffer,
    pub allocation: gpu_allocator::vulkan::Allocation,
}

pub(crate) struct MemState {
    /// `None` once dropped in teardown (before `vkDestroyDevice`).
    pub allocator: Option<Allocator>,
    pub live: HashMap<u64, Live>,
}

pub(crate) fn quiet_debug_settings() -> AllocatorDebugSettings {
    let mut d = AllocatorDebugSettings::default();
    d.log_leaks_on_shutdown = false;
    d
}
