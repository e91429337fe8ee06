//! Settings of a Vulkan context, and what a runtime lends memgov when it
//! adopts a device the runtime already created.

use ash::vk;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    /// counts [`VulkanValidation`](crate::VulkanValidation) reports.
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
    /// Usage flags added to every buffer memgov allocates, beyond the
    /// `TRANSFER_SRC | TRANSFER_DST | STORAGE_BUFFER` it always sets: for a
    /// runtime that binds governed buffers as uniform, vertex, index or
    /// indirect buffers (a buffer may only be bound as what its usage says).
    pub buffer_usage: vk::BufferUsageFlags,
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
            buffer_usage: vk::BufferUsageFlags::empty(),
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
/// promise is made where the path is chosen, and [`VulkanContext::new`](crate::VulkanContext::new)
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
    /// thread that calls [`VulkanContext::new`](crate::VulkanContext::new).
    pub unsafe fn new(path: impl Into<PathBuf>) -> Self {
        Self(path.into())
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

/// A device that the runtime already created, handed to
/// [`VulkanContext::adopt`](crate::VulkanContext::adopt).
///
/// With `queue_count` 0 the runtime keeps the device's queues to itself:
/// memgov then submits nothing (a queue needs external synchronization that
/// memgov cannot share with another runtime's own lock). No stream has work
/// of memgov's to wait behind, so a free executes at once, inside
/// `free_async`: the runtime releases a buffer only once its own last
/// submission using it has completed. `write` and `read` go through
/// the mapping (host-visible memory, [`TransferPath::Auto`]) and are refused
/// otherwise, as are [`VulkanStream::submit`](crate::VulkanStream::submit)
/// and [`VulkanStream::gate`](crate::VulkanStream::gate); teardown does not
/// wait for the device to go idle (nothing of memgov's can be pending).
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
    /// How many queues of that family memgov may submit to (it uses all of
    /// them, and nobody else may); 0: none, the runtime keeps the queues.
    pub queue_count: u32,
    /// Whether `bufferDeviceAddress` was enabled at device creation.
    pub buffer_device_address: bool,
    /// Whether `VK_EXT_memory_budget` was enabled at device creation.
    pub memory_budget: bool,
    /// Whether teardown destroys the device and the instance. With `false`
    /// the runtime keeps them and destroys them after memgov's teardown.
    pub destroy_on_teardown: bool,
    /// Called once when teardown has finished with the device: everything
    /// memgov created on it is destroyed and no thread of memgov's touches
    /// it any more (the device itself too, with `destroy_on_teardown`). A
    /// runtime that shares the device keeps it alive until then. Not called
    /// (and leaked, with what it holds) when teardown has to leak the device
    /// to stay sound; dropped uncalled when adoption fails.
    pub after_teardown: Option<AfterTeardown>,
}

/// The hook of [`AdoptedDevice::after_teardown`].
pub type AfterTeardown = Box<dyn FnOnce() + Send>;
