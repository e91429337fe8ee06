//! The debug messenger and the [`VulkanProbe`] that counts what it hears.
//!
//! The callback is called by the validation layer (and the loader) on any
//! thread, from inside a Vulkan call. It must not unwind into C: its body runs
//! inside `catch_unwind`, only touches atomics and a mutex it never holds
//! while calling anything, and always returns `VK_FALSE`.

use ash::vk;
use std::ffi::{c_void, CStr};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// How many messages the probe keeps verbatim (counts are never capped).
const KEPT_MESSAGES: usize = 256;

/// What a probe observed. Shared between the context, its retirement thread,
/// the debug callback and every [`VulkanProbe`] clone.
#[derive(Default)]
pub(crate) struct ProbeShared {
    pub validation_errors: AtomicU64,
    pub validation_warnings: AtomicU64,
    pub validation_infos: AtomicU64,
    pub loader_messages: AtomicU64,
    pub messages: Mutex<Vec<String>>,
    pub print: AtomicBool,
    pub frees_retired: AtomicU64,
    pub frees_abandoned: AtomicU64,
    pub live_allocations: AtomicU64,
    pub live_streams: AtomicU64,
    pub teardowns: AtomicU32,
    pub torn_down: AtomicBool,
    pub lost: AtomicBool,
    pub wakeups: AtomicU64,
    pub retire_waits: AtomicU64,
    pub notes: Mutex<Vec<String>>,
}

impl ProbeShared {
    pub(crate) fn note(&self, what: String) {
        if let Ok(mut n) = self.notes.lock() {
            if n.len() < KEPT_MESSAGES {
                n.push(what);
            }
        }
    }
}

/// Observes a [`VulkanContext`](super::VulkanContext) from outside, before and
/// after its teardown: validation messages by severity, frees retired and
/// abandoned, live allocations and streams, device loss.
#[derive(Clone)]
pub struct VulkanProbe(pub(crate) Arc<ProbeShared>);

impl fmt::Debug for VulkanProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VulkanProbe")
            .field("validation_errors", &self.validation_errors())
            .field("validation_warnings", &self.validation_warnings())
            .field("frees_retired", &self.frees_retired())
            .field("frees_abandoned", &self.frees_abandoned())
            .field("lost", &self.lost())
            .finish()
    }
}

impl VulkanProbe {
    /// Validation-layer messages of severity ERROR.
    pub fn validation_errors(&self) -> u64 {
        self.0.validation_errors.load(Ordering::SeqCst)
    }
    /// Validation-layer messages of severity WARNING.
    pub fn validation_warnings(&self) -> u64 {
        self.0.validation_warnings.load(Ordering::SeqCst)
    }
    /// Validation-layer messages of severity INFO or VERBOSE (not failures).
    pub fn validation_infos(&self) -> u64 {
        self.0.validation_infos.load(Ordering::SeqCst)
    }
    /// Messages from the Vulkan loader (`"Loader Message"`), filtered out of
    /// the validation counts.
    pub fn loader_messages(&self) -> u64 {
        self.0.loader_messages.load(Ordering::SeqCst)
    }
    /// Warnings and errors together: zero in a correct run.
    pub fn validation_failures(&self) -> u64 {
        self.validation_errors() + self.validation_warnings()
    }
    /// The first 256 warning and error messages, verbatim, with their
    /// severity and message id.
    pub fn messages(&self) -> Vec<String> {
        self.0
            .messages
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default()
    }
    /// Print every counted message to stderr as it arrives.
    pub fn set_print(&self, on: bool) {
        self.0.print.store(on, Ordering::SeqCst);
    }
    /// Stream-ordered frees that executed (their signal fired).
    pub fn frees_retired(&self) -> u64 {
        self.0.frees_retired.load(Ordering::SeqCst)
    }
    /// Stream-ordered frees given up because the device was lost (their
    /// signal was dropped unfired).
    pub fn frees_abandoned(&self) -> u64 {
        self.0.frees_abandoned.load(Ordering::SeqCst)
    }
    /// Allocations alive in the backend (allocated, not yet freed).
    pub fn live_allocations(&self) -> u64 {
        self.0.live_allocations.load(Ordering::SeqCst)
    }
    /// Streams alive in the backend.
    pub fn live_streams(&self) -> u64 {
        self.0.live_streams.load(Ordering::SeqCst)
    }
    /// Times `teardown` ran: exactly one after a correct teardown.
    pub fn teardowns(&self) -> u32 {
        self.0.teardowns.load(Ordering::SeqCst)
    }
    /// Whether teardown has finished.
    pub fn torn_down(&self) -> bool {
        self.0.torn_down.load(Ordering::SeqCst)
    }
    /// Whether the backend saw (or was told of) device loss.
    pub fn lost(&self) -> bool {
        self.0.lost.load(Ordering::SeqCst)
    }
    /// Times the retirement thread returned from `vkWaitSemaphores`.
    pub fn retire_waits(&self) -> u64 {
        self.0.retire_waits.load(Ordering::SeqCst)
    }
    /// Times a caller woke the retirement thread (host signal of its wake
    /// semaphore).
    pub fn wakeups(&self) -> u64 {
        self.0.wakeups.load(Ordering::SeqCst)
    }
    /// Backend notes: device loss, teardown anomalies, errors the retirement
    /// thread could not return to anyone.
    pub fn notes(&self) -> Vec<String> {
        self.0.notes.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

/// # Safety
///
/// `cstr` is null or points to a NUL-terminated string valid for the call.
unsafe fn lossy(cstr: *const std::ffi::c_char) -> String {
    if cstr.is_null() {
        String::new()
    } else {
        // SAFETY: non-null and NUL-terminated per this function's contract
        // (the Vulkan spec guarantees it for callback data strings).
        unsafe { CStr::from_ptr(cstr) }
            .to_string_lossy()
            .into_owned()
    }
}

fn record(
    probe: &ProbeShared,
    severity: vk::DebugUtilsMessageSeverityFlagsEXT,
    types: vk::DebugUtilsMessageTypeFlagsEXT,
    id_name: String,
    message: String,
) {
    use vk::DebugUtilsMessageSeverityFlagsEXT as S;
    if id_name == "Loader Message" {
        probe.loader_messages.fetch_add(1, Ordering::SeqCst);
        if !severity.intersects(S::WARNING | S::ERROR) {
            return;
        }
    }
    let label = if severity.contains(S::ERROR) {
        probe.validation_errors.fetch_add(1, Ordering::SeqCst);
        "ERROR"
    } else if severity.contains(S::WARNING) {
        probe.validation_warnings.fetch_add(1, Ordering::SeqCst);
        "WARNING"
    } else {
        probe.validation_infos.fetch_add(1, Ordering::SeqCst);
        return;
    };
    let line = format!("[{label} {types:?}] {id_name}: {message}");
    if probe.print.load(Ordering::Relaxed) {
        eprintln!("memgov vulkan validation: {line}");
    }
    if let Ok(mut m) = probe.messages.lock() {
        if m.len() < KEPT_MESSAGES {
            m.push(line);
        }
    }
}

/// The `PFN_vkDebugUtilsMessengerCallbackEXT` of every memgov messenger.
/// `user_data` is `Arc::as_ptr` of the context's `ProbeShared`, which the
/// context keeps alive until after the messenger and instance are destroyed.
pub(crate) unsafe extern "system" fn messenger_callback(
    severity: vk::DebugUtilsMessageSeverityFlagsEXT,
    types: vk::DebugUtilsMessageTypeFlagsEXT,
    data: *const vk::DebugUtilsMessengerCallbackDataEXT<'_>,
    user_data: *mut c_void,
) -> vk::Bool32 {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if user_data.is_null() || data.is_null() {
            return;
        }
        // SAFETY: user_data is the ProbeShared pointer we registered, alive
        // for as long as the messenger exists (see above); data is valid for
        // the duration of the callback per the Vulkan spec.
        let (probe, data) = unsafe { (&*(user_data as *const ProbeShared), &*data) };
        // SAFETY: the spec guarantees these are null or NUL-terminated strings
        // valid during the callback.
        let (id_name, message) = unsafe { (lossy(data.p_message_id_name), lossy(data.p_message)) };
        record(probe, severity, types, id_name, message);
    }));
    vk::FALSE
}

/// The messenger create info used both chained into `VkInstanceCreateInfo`
/// (to hear instance creation and destruction) and for the messenger itself.
pub(crate) fn messenger_info(
    probe: &Arc<ProbeShared>,
) -> vk::DebugUtilsMessengerCreateInfoEXT<'static> {
    use vk::DebugUtilsMessageSeverityFlagsEXT as S;
    use vk::DebugUtilsMessageTypeFlagsEXT as T;
    vk::DebugUtilsMessengerCreateInfoEXT::default()
        .message_severity(S::ERROR | S::WARNING | S::INFO)
        .message_type(T::GENERAL | T::VALIDATION | T::PERFORMANCE)
        .pfn_user_callback(Some(messenger_callback))
        .user_data(Arc::as_ptr(probe) as *mut c_void)
}
