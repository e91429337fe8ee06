//! A device the runtime created, adopted without queues (the runtime keeps
//! its queue and memgov submits nothing), with the runtime's own instance
//! heard by a [`ValidationMessenger`], and the after-teardown hook that tells
//! the runtime when it may destroy the device.
//!
//! Without a Vulkan loader, driver or validation layer each test prints
//! `skipped: <why>` and returns.

use ash::vk;
use memgov::vulkan::{AdoptedDevice, ValidationMessenger, VulkanConfig, VulkanContext};
use memgov::{BackendErrorKind, DeviceContext, RetireSignal};
use std::ffi::c_char;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// What a runtime would have created: instance (validation layer and
/// VK_EXT_debug_utils on), a device with timeline semaphores and one queue.
struct Runtime {
    entry: ash::Entry,
    instance: ash::Instance,
    physical: vk::PhysicalDevice,
    device: ash::Device,
    messenger: Option<ValidationMessenger>,
}

fn runtime() -> Option<Runtime> {
    // SAFETY: libvulkan.so.1 is the system's Vulkan loader.
    let entry = match unsafe { ash::Entry::load() } {
        Ok(e) => e,
        Err(e) => {
            println!("skipped: no Vulkan loader ({e})");
            return None;
        }
    };
    let layer = c"VK_LAYER_KHRONOS_validation";
    // SAFETY: a loaded entry.
    let layers = unsafe { entry.enumerate_instance_layer_properties() }.unwrap_or_default();
    if !layers.iter().any(|l| l.layer_name_as_c_str() == Ok(layer)) {
        println!("skipped: VK_LAYER_KHRONOS_validation is not installed (vulkan-validationlayers)");
        return None;
    }
    let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_2);
    let layer_names = [layer.as_ptr()];
    let ext_names: [*const c_char; 1] = [ash::ext::debug_utils::NAME.as_ptr()];
    let info = vk::InstanceCreateInfo::default()
        .application_info(&app)
        .enabled_layer_names(&layer_names)
        .enabled_extension_names(&ext_names);
    // SAFETY: every pointer in `info` lives for the call.
    let instance = match unsafe { entry.create_instance(&info, None) } {
        Ok(i) => i,
        Err(r) => {
            println!("skipped: vkCreateInstance returned {r:?} (no Vulkan driver)");
            return None;
        }
    };
    // SAFETY: the instance has VK_EXT_debug_utils and outlives the
    // messenger (destroyed in `destroy`).
    let messenger = unsafe { ValidationMessenger::attach(&entry, &instance) }.expect("messenger");
    messenger.validation().set_print(true);
    // SAFETY: a valid instance.
    let physical = unsafe { instance.enumerate_physical_devices() }.expect("devices")[0];
    let priorities = [1.0f32];
    let queues = [vk::DeviceQueueCreateInfo::default()
        .queue_family_index(0)
        .queue_priorities(&priorities)];
    let mut v12 = vk::PhysicalDeviceVulkan12Features::default().timeline_semaphore(true);
    let info = vk::DeviceCreateInfo::default()
        .queue_create_infos(&queues)
        .push_next(&mut v12);
    // SAFETY: the physical device belongs to the instance; pointers live for
    // the call; lavapipe (and any Vulkan 1.2 device) has timelineSemaphore.
    let device = unsafe { instance.create_device(physical, &info, None) }.expect("device");
    Some(Runtime {
        entry,
        instance,
        physical,
        device,
        messenger: Some(messenger),
    })
}

impl Runtime {
    fn adopted(&self, after_teardown: Option<memgov::vulkan::AfterTeardown>) -> AdoptedDevice {
        AdoptedDevice {
            entry: self.entry.clone(),
            instance: self.instance.clone(),
            physical_device: self.physical,
            device: self.device.clone(),
            queue_family_index: 0,
            queue_count: 0,
            buffer_device_address: false,
            memory_budget: false,
            destroy_on_teardown: false,
            after_teardown,
        }
    }

    /// Destroy the device, the messenger and the instance; return how many
    /// validation failures the messenger counted over their whole life.
    fn destroy(mut self) -> (u64, Vec<String>) {
        let messenger = self.messenger.take().expect("messenger");
        let validation = messenger.validation();
        // SAFETY: memgov's context was torn down (its hook ran); nothing else
        // was created on the device; the messenger goes before the instance.
        unsafe {
            self.device.destroy_device(None);
            messenger.destroy();
            self.instance.destroy_instance(None);
        }
        (validation.validation_failures(), validation.messages())
    }
}

#[test]
fn adopted_without_queues_submits_nothing_and_calls_the_hook_after_teardown() {
    let Some(rt) = runtime() else { return };
    let calls = Arc::new(AtomicU32::new(0));
    let seen = calls.clone();
    let config = VulkanConfig {
        buffer_usage: vk::BufferUsageFlags::UNIFORM_BUFFER,
        ..VulkanConfig::default()
    };
    let hook: memgov::vulkan::AfterTeardown = Box::new(move || {
        seen.fetch_add(1, Ordering::SeqCst);
    });
    // SAFETY: the device was created from `physical` of `instance` with
    // timelineSemaphore; no queues are lent; the device and instance outlive
    // teardown (destroyed by `rt.destroy()` after it).
    let ctx = unsafe { VulkanContext::adopt(rt.adopted(Some(hook)), config) }.expect("adopt");
    assert_eq!(ctx.queue_count(), 0);
    let probe = ctx.probe();
    let s = ctx.create_stream().expect("stream");
    let m = ctx.allocate(&s, 4096).expect("allocate");
    assert!(m.is_mapped(), "lavapipe's memory is host-visible");
    // write and read go through the mapping: no submission.
    ctx.write(&s, &m, 8, b"governed").expect("write");
    let mut back = [0u8; 8];
    ctx.read(&s, &m, 8, &mut back).expect("read");
    assert_eq!(&back, b"governed");
    assert_eq!(s.last_submitted(), 0, "memgov submitted nothing");
    // Submissions of its own are refused with the reason.
    // SAFETY: no command buffers: nothing to vouch for.
    let e = unsafe { s.submit(&[]) }.unwrap_err();
    assert_eq!(e.kind, BackendErrorKind::Unsupported, "{e}");
    assert!(e.message.contains("queue_count 0"), "{e}");
    let e = s.gate().unwrap_err();
    assert_eq!(e.kind, BackendErrorKind::Unsupported, "{e}");
    let (tx, rx) = std::sync::mpsc::channel();
    ctx.free_async(
        &s,
        m,
        RetireSignal::from_fn(move |o| {
            let _ = tx.send(o);
        }),
    )
    .map_err(|(_, _, e)| e)
    .expect("free");
    rx.try_recv()
        .expect("the free executed inside free_async: no queue to wait behind");
    ctx.destroy_stream(s).expect("destroy stream");
    assert_eq!(calls.load(Ordering::SeqCst), 0, "not before teardown");
    ctx.teardown(false).expect("teardown");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "once, after teardown");
    assert_eq!(probe.check_clean_teardown(), Ok(()));
    let (failures, messages) = rt.destroy();
    assert_eq!(failures, 0, "{messages:#?}");
}

/// The messenger on the runtime's instance hears what memgov leaves behind:
/// a buffer still alive at `vkDestroyDevice` (planted with the backend's
/// test-only leaking teardown) is reported.
#[test]
fn the_messenger_on_the_runtime_instance_hears_a_leaked_buffer() {
    let Some(rt) = runtime() else { return };
    rt.messenger
        .as_ref()
        .expect("on")
        .validation()
        .set_print(false);
    // SAFETY: as above; no hook.
    let ctx =
        unsafe { VulkanContext::adopt(rt.adopted(None), VulkanConfig::default()) }.expect("adopt");
    let s = ctx.create_stream().expect("stream");
    // Never freed: a plain handle, the buffer stays live in the context.
    let _live = ctx.allocate(&s, 4096).expect("allocate");
    drop(s);
    // SAFETY: lavapipe tolerates destroying a device with a live buffer;
    // nothing uses the context afterwards.
    unsafe { ctx.teardown_leaking_buffers_for_test() }.expect("teardown");
    let (failures, messages) = rt.destroy();
    assert!(failures > 0, "the leaked buffer was not reported");
    assert!(
        messages.iter().any(|m| m.contains("vkDestroyDevice")),
        "{messages:#?}"
    );
}

/// The conformance suite on contexts adopted without queues, each on a
/// device of its own that the after-teardown hook destroys (with the
/// runtime's messenger and instance), as a runtime sharing the device would.
#[test]
fn conformance_suite_on_devices_adopted_without_queues() {
    let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
    let destroyed = Arc::new(AtomicU32::new(0));
    let (h, d) = (heard.clone(), destroyed.clone());
    let report =
        memgov_conformance::run_suite_with(&memgov_conformance::SuiteOptions::new(), move || {
            let Some(rt) = runtime() else {
                return Err(memgov::BackendError::new(
                    "vulkan",
                    "adopt",
                    BackendErrorKind::Unavailable,
                    "no Vulkan loader/ICD or validation layer",
                ));
            };
            h.lock()
                .unwrap()
                .push(rt.messenger.as_ref().expect("on").validation());
            let adopted = rt.adopted(None);
            let d = d.clone();
            let hook: memgov::vulkan::AfterTeardown = Box::new(move || {
                drop(rt.destroy());
                d.fetch_add(1, Ordering::SeqCst);
            });
            let adopted = AdoptedDevice {
                after_teardown: Some(hook),
                ..adopted
            };
            // SAFETY: as in the first test; the hook destroys the device only
            // after memgov's teardown has finished with it.
            unsafe { VulkanContext::adopt(adopted, VulkanConfig::default()) }
        });
    println!("{report}");
    if report.execution.is_none() {
        println!("skipped: {}", report.device);
        return;
    }
    assert!(report.all_passed(), "{report}");
    let heard = heard.lock().unwrap();
    assert!(!heard.is_empty());
    // Teardown may finish on a reaper thread after a case returns.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while (destroyed.load(Ordering::SeqCst) as usize) < heard.len()
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(
        destroyed.load(Ordering::SeqCst) as usize,
        heard.len(),
        "every adopted device was handed back by its after-teardown hook"
    );
    for v in heard.iter() {
        assert_eq!(v.validation_failures(), 0, "{:#?}", v.messages());
    }
}
