//! The debug messenger and the [`VulkanValidation`] that counts what it
//! hears; the backend's bookkeeping goes to its [`BackendProbe`].
//!
//! The callback is called by the validation layer (and the loader) on any
//! thread, from inside a Vulkan call. It must not unwind into C: its body runs
//! inside `catch_unwind`, only touches atomics and a mutex it never holds
//! while calling anything, and always returns `VK_FALSE`.

use ash::vk;
use memgov_backend::BackendProbe;
use std::ffi::{c_void, CStr};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// How many messages the probe keeps verbatim (counts are never capped).
const KEPT_MESSAGES: usize = 256;

/// What the context observed. Shared between the context, its free
/// thread, the debug callback, every [`VulkanValidation`] clone and (its
/// `common` part) every [`BackendProbe`] clone.
#[derive(Default)]
pub(crate) struct ProbeShared {
    /// The bookkeeping every backend reports; validation warnings and errors
    /// count there as violations too.
    pub common: BackendProbe,
    pub validation_errors: AtomicU64,
    pub validation_warnings: AtomicU64,
    pub validation_infos: AtomicU64,
    pub loader_messages: AtomicU64,
    pub messages: Mutex<Vec<String>>,
    pub print: AtomicBool,
    pub wakeups: AtomicU64,
    pub retire_waits: AtomicU64,
    /// The free thread's kernel thread id (Linux; 0 elsewhere or
    /// before it started).
    pub retire_tid: AtomicU64,
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

/// What only a Vulkan context observes, from outside, before and after its
/// teardown: validation messages by severity, loader messages, the
/// free thread's waits and wake-ups, backend notes. The bookkeeping
/// every backend reports is in [`VulkanContext::probe`](super::VulkanContext::probe).
#[derive(Clone)]
pub struct VulkanValidation(pub(crate) Arc<ProbeShared>);

impl fmt::Debug for VulkanValidation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VulkanValidation")
            .field("validation_errors", &self.validation_errors())
            .field("validation_warnings", &self.validation_warnings())
            .field("loader_messages", &self.loader_messages())
            .finish()
    }
}

impl VulkanValidation {
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
    /// Times the free thread returned from `vkWaitSemaphores`.
    pub fn retire_waits(&self) -> u64 {
        self.0.retire_waits.load(Ordering::SeqCst)
    }
    /// Times a caller woke the free thread (host signal of its wake
    /// semaphore).
    pub fn wakeups(&self) -> u64 {
        self.0.wakeups.load(Ordering::SeqCst)
    }
    /// CPU time the free thread has used so far, read from
    /// `/proc/self/task/<tid>/stat` at the kernel's 10 ms tick: `None` off
    /// Linux, before the thread started or after it exited. A context with
    /// nothing in flight should cost none: a thread left in a driver's
    /// busy-polling wait shows here, not in [`retire_waits`](Self::retire_waits).
    pub fn free_thread_cpu(&self) -> Option<std::time::Duration> {
        let tid = self.0.retire_tid.load(Ordering::SeqCst);
        if tid == 0 {
            return None;
        }
        let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
        // Fields after the parenthesised name: state is the first, utime
        // the twelfth and stime the thirteenth (14 and 15 of proc(5)).
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        // USER_HZ is 100 on every Linux architecture memgov builds for.
        Some(std::time::Duration::from_millis(ticks * 10))
    }
    /// Backend notes: device loss, teardown anomalies, errors the free
    /// thread could not return to anyone.
    pub fn notes(&self) -> Vec<String> {
        self.0.notes.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

/// # Safety
///
/// `cstr` is null or points to a NUL-terminated string valid for the call.
/// A debug messenger that memgov adds to an instance it did not create,
/// counting what the validation layer says about everything done on that
/// instance (a runtime's work and memgov's alike) into a
/// [`VulkanValidation`] of its own, with the same rules as a context's:
/// loader notices apart, every warning or error a violation.
///
/// It must be [`destroy`](Self::destroy)ed before the instance is: dropping
/// it without that leaks the messenger (and the counts stay readable).
pub struct ValidationMessenger {
    debug_utils: ash::ext::debug_utils::Instance,
    messenger: vk::DebugUtilsMessengerEXT,
    probe: Arc<ProbeShared>,
    destroyed: bool,
}

impl fmt::Debug for ValidationMessenger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ValidationMessenger")
            .field("validation", &self.validation())
            .finish()
    }
}

impl ValidationMessenger {
    /// Create the messenger on `instance`.
    ///
    /// # Safety
    ///
    /// `instance` was created from `entry` with `VK_EXT_debug_utils`
    /// enabled, and outlives the messenger (see [`destroy`](Self::destroy)).
    ///
    /// # Errors
    ///
    /// The driver's error from `vkCreateDebugUtilsMessengerEXT`.
    pub unsafe fn attach(
        entry: &ash::Entry,
        instance: &ash::Instance,
    ) -> Result<Self, memgov_backend::BackendError> {
        let probe = Arc::new(ProbeShared::default());
        let debug_utils = ash::ext::debug_utils::Instance::new(entry, instance);
        let info = messenger_info(&probe);
        // SAFETY: per this function's contract the instance has
        // VK_EXT_debug_utils; the user data (`probe`) is kept by `Self` and
        // outlives the messenger, which `destroy` destroys first (or which
        // is leaked, together with a clone of `probe`, when never destroyed).
        let messenger = unsafe { debug_utils.create_debug_utils_messenger(&info, None) }
            .map_err(|r| crate::result::error("attach", "vkCreateDebugUtilsMessengerEXT", r))?;
        Ok(Self {
            debug_utils,
            messenger,
            probe,
            destroyed: false,
        })
    }

    /// What the messenger heard (a handle that stays readable after
    /// [`destroy`](Self::destroy)).
    pub fn validation(&self) -> VulkanValidation {
        VulkanValidation(self.probe.clone())
    }

    /// Destroy the messenger.
    ///
    /// # Safety
    ///
    /// The instance it was attached to is still alive.
    pub unsafe fn destroy(mut self) {
        // SAFETY: per this function's contract the instance is alive; the
        // messenger is destroyed once (`self` is consumed).
        unsafe {
            self.debug_utils
                .destroy_debug_utils_messenger(self.messenger, None)
        };
        self.destroyed = true;
    }
}

impl Drop for ValidationMessenger {
    fn drop(&mut self) {
        if !self.destroyed {
            // Never destroyed: the messenger may still call back, so its
            // user data must stay alive for good.
            std::mem::forget(self.probe.clone());
        }
    }
}

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
    // The loader speaks through the same messenger: its notices (at WARNING
    // for "VK_INSTANCE_LAYERS defined and adding layers", the usual way to
    // turn validation on) are about the environment, not about memgov's use
    // of the API. Counted apart, never as validation failures.
    if is_loader_message(&id_name, &message) {
        probe.loader_messages.fetch_add(1, Ordering::SeqCst);
        return;
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
    probe
        .common
        .violation_unprinted(format!("validation {line}"));
    if let Ok(mut m) = probe.messages.lock() {
        if m.len() < KEPT_MESSAGES {
            m.push(line);
        }
    }
}

/// Whether a message comes from the Vulkan loader rather than a layer: the
/// loader names its messages "Loader Message" (older loaders leave the id
/// empty and start the text with "loader").
fn is_loader_message(id_name: &str, message: &str) -> bool {
    id_name == "Loader Message"
        || (id_name.is_empty()
            && message
                .trim_start()
                .to_ascii_lowercase()
                .starts_with("loader"))
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

#[cfg(test)]
mod tests {
    use super::*;
    use vk::DebugUtilsMessageSeverityFlagsEXT as S;
    use vk::DebugUtilsMessageTypeFlagsEXT as T;

    #[test]
    fn loader_notices_are_counted_apart_and_layer_messages_fail() {
        let probe = ProbeShared::default();
        record(
            &probe,
            S::WARNING,
            T::GENERAL,
            "Loader Message".into(),
            "windows_read_data_files_in_registry: Registry lookup failed".into(),
        );
        record(
            &probe,
            S::WARNING,
            T::GENERAL,
            "Loader Message".into(),
            "env var 'VK_INSTANCE_LAYERS' defined and adding layers \"VK_LAYER_KHRONOS_validation\"".into(),
        );
        assert_eq!(probe.loader_messages.load(Ordering::SeqCst), 2);
        assert_eq!(probe.validation_warnings.load(Ordering::SeqCst), 0);
        assert_eq!(probe.common.violations(), 0);

        record(
            &probe,
            S::ERROR,
            T::VALIDATION,
            "VUID-vkDestroyDevice-device-05137".into(),
            "OBJ ERROR : For VkDevice 0x1, VkBuffer 0x2 has not been destroyed.".into(),
        );
        assert_eq!(probe.validation_errors.load(Ordering::SeqCst), 1);
        assert_eq!(probe.common.violations(), 1);
        assert!(probe.common.violation_log()[0].contains("VUID-vkDestroyDevice"));
    }
}
