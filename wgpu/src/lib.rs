//! A `wgpu::Device` whose buffers live in memgov-governed Vulkan memory.
//!
//! [`GovernedDevice::open`] creates one `VkDevice` and hands it to both
//! wgpu (`wgpu_hal::vulkan::Adapter::device_from_raw`, then
//! `wgpu::Adapter::create_device_from_hal`) and memgov
//! (`VulkanContext::adopt`). [`GovernedDevice::create_buffer`] allocates in
//! memgov, charged with a [`Role`](memgov::Role) under the context's budget,
//! and gives wgpu the `VkBuffer` (`Buffer::from_raw_externally_owned`,
//! `wgpu::Device::create_buffer_from_hal`): shaders, copies and bind groups
//! use it like any wgpu buffer.
//!
//! # Who creates the device, and why this crate
//!
//! This crate creates the `VkDevice` itself, with exactly the extensions and
//! features wgpu-hal asks for, and lends it to both. Neither direction of
//! plain adoption works:
//!
//! * memgov creating the device does not know the extensions and features
//!   wgpu needs (wgpu-hal computes them per adapter);
//! * wgpu creating it owns it: dropping the `wgpu::Device` destroys the
//!   `VkDevice` while memgov's context (its timelines, its allocator, the
//!   frees it has in flight) still lives on it.
//!
//! Here the device belongs to a keeper that both hold: wgpu's drop callback
//! and memgov's after-teardown hook each let go of it, and the last one
//! destroys it. Either side may therefore go first.
//!
//! # The queue
//!
//! wgpu owns the device's queue; memgov adopts the device without queues and
//! submits nothing (a queue needs external synchronization, and wgpu's lock
//! is its own). Transfers go through wgpu (`Queue::write_buffer`, copies),
//! or through memgov's mapping on host-visible memory. A new buffer whose
//! memory is not host-visible is zeroed on wgpu's queue, by a fill recorded
//! on a wgpu command buffer that wgpu tracks as using the buffer.
//!
//! # When memory goes back
//!
//! A governed buffer's memory is released from wgpu-hal's drop callback:
//! wgpu-core destroys a hal buffer only once every handle is gone and its
//! last submission using it has completed (it finds out when it polls,
//! submits, or is dropped). The GPU never reads freed memory, and the
//! validation layer sees no buffer destroyed in use.
//!
//! # Refusal, pressure and teardown
//!
//! A budget refusal is [`Error::Refused`], returned before anything is
//! created: no panic, no device loss, the device and its other buffers as
//! they were. It is not reported to wgpu's error scopes (wgpu has no way
//! to raise an error into them): where wgpu code pops an
//! `ErrorFilter::OutOfMemory` scope, match on
//! [`Error::wgpu_error_filter`] instead, or turn the refusal into the
//! `wgpu::Error::OutOfMemory` wgpu would have reported with
//! [`Error::into_wgpu_error`]. Before refusing, memgov asks the pressure
//! responder this crate registers ([`WgpuConfig::poll_on_pressure`]): it
//! flushes wgpu's queue and waits for it, so that buffers the caller
//! dropped but wgpu still held come back first. [`GovernedDevice::retire`]
//! retires the memgov context while wgpu may still hold buffers: it waits
//! for them, or with [`RetireMode::Force`] destroys them through wgpu first
//! (a later use is a wgpu error, never a use of freed memory). Dropping the
//! wgpu device first releases the buffers it held; the `VkDevice` stays
//! until the memgov context is torn down.
//!
//! ```no_run
//! use memgov::{Governor, Role};
//! use memgov_wgpu::{GovernedDevice, RetireMode, WgpuConfig};
//! use std::time::{Duration, Instant};
//!
//! let gov = Governor::new();
//! let dev = GovernedDevice::open(&gov, WgpuConfig {
//!     context: memgov::ContextConfig::new().label("wgpu").budget(64 << 20),
//!     ..WgpuConfig::default()
//! })?;
//! let buf = dev.create_buffer(&wgpu::BufferDescriptor {
//!     label: Some("activations"),
//!     size: 1 << 20,
//!     usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
//!     mapped_at_creation: false,
//! }, Role::Activation)?;
//! dev.queue().write_buffer(&buf, 0, &[1, 2, 3, 4]);
//! dev.queue().submit([]);
//! drop(buf); // released once wgpu's submissions using it have completed
//! let report = dev.retire(Instant::now() + Duration::from_secs(10), RetireMode::Wait)?;
//! println!("{report:?}");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod buffer;
mod device;
mod error;

pub use buffer::GovernedBuffer;
pub use device::{GovernedDevice, RetireMode, WgpuConfig, BUFFER_LABEL};
pub use error::Error;
