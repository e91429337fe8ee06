//! Loading libvulkan, creating (or adopting) the instance and device, and
//! reading what the device is.

use crate::config::{DeviceSelector, VulkanConfig};
use crate::result::{err, error};
use crate::validation::{messenger_info, ProbeShared};
use ash::vk;
use memgov_backend::{BackendError, BackendErrorKind};
use std::ffi::{c_char, CStr};
use std::sync::Arc;

pub(crate) const VALIDATION_LAYER: &CStr = c"VK_LAYER_KHRONOS_validation";

/// Everything memgov learned about the physical device it drives.
#[derive(Debug, Clone)]
pub(crate) struct DeviceInfo {
    pub name: String,
    pub vendor_id: u32,
    pub device_type: vk::PhysicalDeviceType,
    pub api_version: u32,
    pub driver_version: u32,
    pub driver_name: String,
    pub driver_info: String,
    pub heaps: Vec<vk::MemoryHeap>,
    /// Index of the largest DEVICE_LOCAL heap.
    pub main_heap: usize,
    pub memory_budget: bool,
    pub buffer_device_address: bool,
    pub ordinal: u32,
}

pub(crate) fn version_string(v: u32) -> String {
    format!(
        "{}.{}.{}",
        vk::api_version_major(v),
        vk::api_version_minor(v),
        vk::api_version_patch(v)
    )
}

pub(crate) fn vendor_name(id: u32) -> String {
    match id {
        0x10DE => "NVIDIA".into(),
        0x1002 => "AMD".into(),
        0x8086 => "Intel".into(),
        0x13B5 => "ARM".into(),
        0x5143 => "Qualcomm".into(),
        0x106B => "Apple".into(),
        0x1010 => "Imagination".into(),
        0x10005 => "Mesa".into(),
        other => format!("vendor 0x{other:04x}"),
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl DeviceInfo {
    /// `llvmpipe (Mesa 22.3.6 (LLVM 15.0.6)), Vulkan 1.3.230, driverVersion
    /// 0x1, heaps [0: 1.94 GiB device-local], VK_EXT_memory_budget: no`
    pub(crate) fn driver_string(&self) -> String {
        let heaps: Vec<String> = self
            .heaps
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let local = if h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL) {
                    " device-local"
                } else {
                    ""
                };
                format!("{i}: {}{local}", gib(h.size))
            })
            .collect();
        format!(
            "{} ({}), Vulkan {}, driverVersion 0x{:x}, heaps [{}], VK_EXT_memory_budget: {}, bufferDeviceAddress: {}",
            self.driver_name,
            self.driver_info,
            version_string(self.api_version),
            self.driver_version,
            heaps.join(", "),
            if self.memory_budget { "yes" } else { "no (budget = heap size)" },
            if self.buffer_device_address { "yes" } else { "no" },
        )
    }
}

fn unavailable(op: &'static str, why: impl std::fmt::Display) -> BackendError {
    err(
        op,
        BackendErrorKind::Unavailable,
        format!(
            "no Vulkan loader/ICD ({why}); install libvulkan1 and a driver (for a software device: mesa-vulkan-drivers, which provides lavapipe), or check VK_ICD_FILENAMES / VK_DRIVER_FILES"
        ),
    )
}

/// Open libvulkan at run time. Its absence is an `Unavailable` error.
pub(crate) fn load_entry(config: &VulkanConfig) -> Result<ash::Entry, BackendError> {
    let loaded = match &config.loader_path {
        // SAFETY: opening a library runs its initializers and ash then calls
        // its `vkGetInstanceProcAddr` as the Vulkan one. `LoaderPath::new`
        // is unsafe and its caller promised a conforming Vulkan loader (or a
        // missing file, which fails to open without running anything). The
        // Entry keeps the library loaded for as long as it (or a clone) lives.
        Some(path) => unsafe { ash::Entry::load_from(path.path()) },
        // SAFETY: as above; `libvulkan.so.1` is by its name the Vulkan
        // loader (the system's, found by the dynamic linker's search path),
        // the same library every Vulkan program on the machine trusts.
        None => unsafe { ash::Entry::load() },
    };
    loaded.map_err(|e| {
        let which = config
            .loader_path
            .as_ref()
            .map_or("libvulkan.so.1".to_string(), |p| {
                p.path().display().to_string()
            });
        unavailable("new", format!("{which} could not be loaded: {e}"))
    })
}

fn layer_present(entry: &ash::Entry, name: &CStr) -> Result<bool, BackendError> {
    // SAFETY: a valid Entry; the call has no other preconditions.
    let layers = unsafe { entry.enumerate_instance_layer_properties() }
        .map_err(|r| error("new", "vkEnumerateInstanceLayerProperties", r))?;
    Ok(layers
        .iter()
        .any(|l| l.layer_name_as_c_str().is_ok_and(|n| n == name)))
}

/// The instance and, when validation is on, its debug messenger.
pub(crate) struct CreatedInstance {
    pub instance: ash::Instance,
    pub debug: Option<(ash::ext::debug_utils::Instance, vk::DebugUtilsMessengerEXT)>,
}

pub(crate) fn create_instance(
    entry: &ash::Entry,
    config: &VulkanConfig,
    probe: &Arc<ProbeShared>,
) -> Result<CreatedInstance, BackendError> {
    // SAFETY: a valid Entry; no preconditions.
    let instance_version = unsafe { entry.try_enumerate_instance_version() }
        .map_err(|r| error("new", "vkEnumerateInstanceVersion", r))?
        .unwrap_or(vk::API_VERSION_1_0);
    if instance_version < vk::API_VERSION_1_2 {
        return Err(err(
            "new",
            BackendErrorKind::Unsupported,
            format!(
                "the Vulkan loader offers instance version {}; memgov needs 1.2 (timeline semaphores): update libvulkan1",
                version_string(instance_version)
            ),
        ));
    }
    let mut layers: Vec<*const c_char> = Vec::new();
    let mut extensions: Vec<*const c_char> = Vec::new();
    if config.validation {
        if !layer_present(entry, VALIDATION_LAYER)? {
            return Err(err(
                "new",
                BackendErrorKind::Unavailable,
                "validation was requested but VK_LAYER_KHRONOS_validation is not installed: install vulkan-validationlayers (or set VulkanConfig::validation = false)",
            ));
        }
        layers.push(VALIDATION_LAYER.as_ptr());
        extensions.push(ash::ext::debug_utils::NAME.as_ptr());
        extensions.push(ash::ext::validation_features::NAME.as_ptr());
    }
    let app = vk::ApplicationInfo::default()
        .application_name(c"memgov")
        .engine_name(c"memgov")
        .api_version(instance_version.min(vk::API_VERSION_1_3));
    let mut messenger = messenger_info(probe);
    let enables = [vk::ValidationFeatureEnableEXT::SYNCHRONIZATION_VALIDATION];
    let mut features = vk::ValidationFeaturesEXT::default().enabled_validation_features(&enables);
    let mut info = vk::InstanceCreateInfo::default()
        .application_info(&app)
        .enabled_layer_names(&layers)
        .enabled_extension_names(&extensions);
    if config.validation {
        info = info.push_next(&mut messenger);
        if config.sync_validation {
            info = info.push_next(&mut features);
        }
    }
    // SAFETY: every pointer in `info` (names, app info, chained structs)
    // lives until the call returns; the messenger's user data outlives the
    // instance (the caller keeps `probe` alive until after destroy).
    let instance = unsafe { entry.create_instance(&info, None) }.map_err(|r| match r {
        vk::Result::ERROR_INCOMPATIBLE_DRIVER => unavailable("new", "vkCreateInstance: VK_ERROR_INCOMPATIBLE_DRIVER"),
        vk::Result::ERROR_LAYER_NOT_PRESENT | vk::Result::ERROR_EXTENSION_NOT_PRESENT => err(
            "new",
            BackendErrorKind::Unavailable,
            format!("vkCreateInstance: {r:?}: the validation layer or VK_EXT_debug_utils is missing; install vulkan-validationlayers or disable validation"),
        )
        .with_code(r.as_raw() as i64),
        r => error("new", "vkCreateInstance", r),
    })?;
    let mut created = CreatedInstance {
        instance,
        debug: None,
    };
    if config.validation {
        let du = ash::ext::debug_utils::Instance::new(entry, &created.instance);
        let info = messenger_info(probe);
        // SAFETY: a valid instance with VK_EXT_debug_utils enabled; the user
        // data outlives the messenger (destroyed before the instance).
        match unsafe { du.create_debug_utils_messenger(&info, None) } {
            Ok(m) => created.debug = Some((du, m)),
            Err(r) => {
                // SAFETY: nothing else was created from this instance.
                unsafe { created.instance.destroy_instance(None) };
                return Err(error("new", "vkCreateDebugUtilsMessengerEXT", r));
            }
        }
    }
    Ok(created)
}

/// Destroy the messenger and the instance (nothing else may remain).
///
/// # Safety
///
/// Every object created from the instance (devices included) is destroyed.
pub(crate) unsafe fn destroy_instance(created: CreatedInstance) {
    if let Some((du, m)) = created.debug {
        // SAFETY: per this function's contract the messenger is unused now.
        unsafe { du.destroy_debug_utils_messenger(m, None) };
    }
    // SAFETY: per this function's contract, nothing created from it remains.
    unsafe { created.instance.destroy_instance(None) };
}

fn driver_props(
    instance: &ash::Instance,
    pd: vk::PhysicalDevice,
) -> (vk::PhysicalDeviceProperties, String, String) {
    let mut driver = vk::PhysicalDeviceDriverProperties::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut driver);
    // SAFETY: pd comes from this instance; the chain is a valid 1.2 struct.
    unsafe { instance.get_physical_device_properties2(pd, &mut props2) };
    let props = props2.properties;
    let name = driver
        .driver_name_as_c_str()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    let info = driver
        .driver_info_as_c_str()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    (props, name, info)
}

fn device_name(props: &vk::PhysicalDeviceProperties) -> String {
    props
        .device_name_as_c_str()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Pick the physical device the config names.
pub(crate) fn select_device(
    instance: &ash::Instance,
    selector: &DeviceSelector,
) -> Result<(vk::PhysicalDevice, u32), BackendError> {
    // SAFETY: a valid instance.
    let devices = unsafe { instance.enumerate_physical_devices() }
        .map_err(|r| error("new", "vkEnumeratePhysicalDevices", r))?;
    if devices.is_empty() {
        return Err(unavailable("new", "the loader found no physical device"));
    }
    let described: Vec<(vk::PhysicalDevice, vk::PhysicalDeviceProperties)> = devices
        .iter()
        // SAFETY: each handle comes from this instance.
        .map(|&pd| (pd, unsafe { instance.get_physical_device_properties(pd) }))
        .collect();
    let list = || {
        described
            .iter()
            .enumerate()
            .map(|(i, (_, p))| format!("{i}: {} ({:?})", device_name(p), p.device_type))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let index = match selector {
        DeviceSelector::Index(i) => {
            if *i >= described.len() {
                return Err(err(
                    "new",
                    BackendErrorKind::InvalidArgument,
                    format!(
                        "device index {i} requested; {} device(s) present: {}",
                        described.len(),
                        list()
                    ),
                ));
            }
            *i
        }
        DeviceSelector::Name(sub) => {
            let sub_l = sub.to_lowercase();
            described
                .iter()
                .position(|(_, p)| device_name(p).to_lowercase().contains(&sub_l))
                .ok_or_else(|| {
                    err(
                        "new",
                        BackendErrorKind::InvalidArgument,
                        format!("no device name contains '{sub}'; present: {}", list()),
                    )
                })?
        }
        DeviceSelector::Best => {
            let rank = |t: vk::PhysicalDeviceType| match t {
                vk::PhysicalDeviceType::DISCRETE_GPU => 0,
                vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
                vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
                vk::PhysicalDeviceType::CPU => 3,
                _ => 4,
            };
            described
                .iter()
                .enumerate()
                .filter(|(_, (_, p))| p.api_version >= vk::API_VERSION_1_2)
                .min_by_key(|(i, (_, p))| (rank(p.device_type), *i))
                .map(|(i, _)| i)
                .unwrap_or(0)
        }
    };
    Ok((described[index].0, index as u32))
}

/// Everything created for one logical device.
pub(crate) struct CreatedDevice {
    pub device: ash::Device,
    pub queue_family: u32,
    pub queues: Vec<vk::Queue>,
    pub info: DeviceInfo,
}

fn has_extension(exts: &[vk::ExtensionProperties], name: &CStr) -> bool {
    exts.iter()
        .any(|e| e.extension_name_as_c_str().is_ok_and(|n| n == name))
}

/// Read what memgov needs to know about `pd`.
pub(crate) fn device_info(
    instance: &ash::Instance,
    pd: vk::PhysicalDevice,
    ordinal: u32,
    memory_budget: bool,
    buffer_device_address: bool,
) -> DeviceInfo {
    let (props, driver_name, driver_info) = driver_props(instance, pd);
    // SAFETY: pd comes from this instance.
    let mem = unsafe { instance.get_physical_device_memory_properties(pd) };
    let heaps: Vec<vk::MemoryHeap> = mem.memory_heaps_as_slice().to_vec();
    let main_heap = heaps
        .iter()
        .enumerate()
        .filter(|(_, h)| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
        .max_by_key(|(_, h)| h.size)
        .or_else(|| heaps.iter().enumerate().max_by_key(|(_, h)| h.size))
        .map(|(i, _)| i)
        .unwrap_or(0);
    DeviceInfo {
        name: device_name(&props),
        vendor_id: props.vendor_id,
        device_type: props.device_type,
        api_version: props.api_version,
        driver_version: props.driver_version,
        driver_name,
        driver_info,
        heaps,
        main_heap,
        memory_budget,
        buffer_device_address,
        ordinal,
    }
}

/// Create the logical device: one queue family that can transfer (and
/// compute, where offered), up to `max_queues` queues of it, timeline
/// semaphores required, buffer device address and memory budget where present.
pub(crate) fn create_device(
    instance: &ash::Instance,
    pd: vk::PhysicalDevice,
    ordinal: u32,
    config: &VulkanConfig,
) -> Result<CreatedDevice, BackendError> {
    // SAFETY: pd comes from this instance.
    let props = unsafe { instance.get_physical_device_properties(pd) };
    if props.api_version < vk::API_VERSION_1_2 {
        return Err(err(
            "new",
            BackendErrorKind::Unsupported,
            format!(
                "device '{}' offers Vulkan {}; memgov needs 1.2 with timelineSemaphore: update the driver or pick another device",
                device_name(&props),
                version_string(props.api_version)
            ),
        ));
    }
    let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
    let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut f12);
    // SAFETY: pd comes from this instance; a valid 1.2 chain.
    unsafe { instance.get_physical_device_features2(pd, &mut f2) };
    let (timeline, bda) = (
        f12.timeline_semaphore == vk::TRUE,
        f12.buffer_device_address == vk::TRUE,
    );
    if !timeline {
        return Err(err(
            "new",
            BackendErrorKind::Unsupported,
            format!("device '{}' lacks the Vulkan 1.2 timelineSemaphore feature; memgov retires frees on timeline values", device_name(&props)),
        ));
    }
    // SAFETY: pd comes from this instance.
    let exts = unsafe { instance.enumerate_device_extension_properties(pd) }
        .map_err(|r| error("new", "vkEnumerateDeviceExtensionProperties", r))?;
    let budget = has_extension(&exts, ash::ext::memory_budget::NAME);
    // SAFETY: pd comes from this instance.
    let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
    let family = families
        .iter()
        .position(|f| {
            f.queue_flags
                .contains(vk::QueueFlags::COMPUTE | vk::QueueFlags::TRANSFER)
                && f.queue_count > 0
        })
        .or_else(|| {
            families.iter().position(|f| {
                f.queue_flags
                    .intersects(vk::QueueFlags::COMPUTE | vk::QueueFlags::GRAPHICS)
                    && f.queue_count > 0
            })
        })
        .ok_or_else(|| {
            err(
                "new",
                BackendErrorKind::Unsupported,
                format!(
                    "device '{}' has no compute or transfer queue family ({} families)",
                    device_name(&props),
                    families.len()
                ),
            )
        })?;
    let count = families[family].queue_count.min(config.max_queues.max(1));
    let priorities = vec![1.0f32; count as usize];
    let queue_info = [vk::DeviceQueueCreateInfo::default()
        .queue_family_index(family as u32)
        .queue_priorities(&priorities)];
    let mut enable12 = vk::PhysicalDeviceVulkan12Features::default()
        .timeline_semaphore(true)
        .buffer_device_address(bda);
    let mut names: Vec<*const c_char> = Vec::new();
    if budget {
        names.push(ash::ext::memory_budget::NAME.as_ptr());
    }
    let info = vk::DeviceCreateInfo::default()
        .queue_create_infos(&queue_info)
        .enabled_extension_names(&names)
        .push_next(&mut enable12);
    // SAFETY: pd comes from this instance; every pointer in `info` lives
    // until the call returns; the features enabled were reported supported.
    let device = unsafe { instance.create_device(pd, &info, None) }
        .map_err(|r| error("new", "vkCreateDevice", r))?;
    // SAFETY: the family and indices were requested in `info`.
    let queues = (0..count)
        .map(|i| unsafe { device.get_device_queue(family as u32, i) })
        .collect();
    Ok(CreatedDevice {
        device,
        queue_family: family as u32,
        queues,
        info: device_info(instance, pd, ordinal, budget, bda),
    })
}
