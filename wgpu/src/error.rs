//! [`Error`]: what opening a device, creating a buffer, moving buffers and
//! retiring can fail with.

use memgov::{BackendError, GovernorError, RetireError};

/// Why an operation of this crate failed. Nothing here is a device loss or a
/// panic: a refused allocation leaves the device and every other buffer as
/// they were.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// memgov refused the allocation (its budget, a shared budget, a
    /// retiring context): the message carries the numbers and the way out.
    #[error("memgov refused the buffer: {0}")]
    Refused(#[source] GovernorError),
    /// The Vulkan backend failed (opening the loader, adopting the device).
    #[error("memgov's Vulkan backend: {0}")]
    Backend(#[source] BackendError),
    /// wgpu could not open a Vulkan adapter or device.
    #[error("wgpu: {0}")]
    Wgpu(String),
    /// No Vulkan adapter: nothing to share.
    #[error("no Vulkan adapter found by wgpu ({0}); install libvulkan1 and a driver (mesa-vulkan-drivers for lavapipe)")]
    NoAdapter(String),
    /// A governed buffer cannot be mapped by wgpu (wgpu maps only buffers
    /// it allocated itself).
    #[error("{usage:?} asks for mapping (MAP_READ / MAP_WRITE or mapped_at_creation); wgpu maps only its own buffers: create the staging buffer with wgpu::Device::create_buffer and copy")]
    Mappable {
        /// The usage asked for.
        usage: wgpu::BufferUsages,
    },
    /// A zero-byte buffer.
    #[error("zero-byte buffer '{0}'; wgpu and memgov need at least one byte")]
    ZeroSized(String),
    /// The device was retired: no buffer can be created on it.
    #[error("the governed device was retired; open another one")]
    Retired,
    /// Retiring did not finish by its deadline (the holders are listed).
    #[error("retiring the governed device: {0}")]
    Retire(#[source] RetireError),
    /// wgpu's poll failed while waiting for its submissions.
    #[error("waiting for wgpu's submissions: {0}")]
    Poll(String),
    /// Moving buffers to another device failed; every buffer is back on the
    /// device it came from.
    #[error("moving {count} buffer(s) failed: {source}; every buffer stays on its device, with its contents")]
    Migrate {
        /// How many buffers were to move.
        count: usize,
        /// Why.
        #[source]
        source: GovernorError,
    },
}
