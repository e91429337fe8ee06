//! The one place Vulkan results become [`BackendError`]s.
//!
//! `VK_ERROR_DEVICE_LOST` is [`BackendErrorKind::DeviceLost`], so the
//! governor marks the context lost and settles pending releases without
//! further device calls; the context marks itself lost through
//! `Shared::fail`. [`Vk`] is the [`Driver`] of the context's
//! [`Shell`](memgov_backend::Shell) (the lost and closing state and the
//! usable check every GPU backend shares).

use ash::vk;
use memgov_backend::shell::Driver;
use memgov_backend::{BackendError, BackendErrorKind, OUT_OF_MEMORY_HINT};

pub(crate) const BACKEND: &str = "vulkan";

/// Vulkan as the shell sees it: `VkResult`s, classified by [`error`].
pub(crate) enum Vk {}

impl Driver for Vk {
    const BACKEND: &'static str = BACKEND;
    type Code = vk::Result;

    fn check(op: &'static str, call: &str, code: vk::Result) -> Result<(), BackendError> {
        if code == vk::Result::SUCCESS {
            Ok(())
        } else {
            Err(error(op, call, code))
        }
    }
}

pub(crate) fn err(
    op: &'static str,
    kind: BackendErrorKind,
    msg: impl Into<String>,
) -> BackendError {
    BackendError::new(BACKEND, op, kind, msg)
}

/// How a `VkResult` is classified: `VK_ERROR_DEVICE_LOST` is the one code
/// after which nothing queued on the device runs.
pub(crate) fn kind_of(r: vk::Result) -> BackendErrorKind {
    match r {
        vk::Result::ERROR_DEVICE_LOST => BackendErrorKind::DeviceLost,
        vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY => {
            BackendErrorKind::OutOfMemory
        }
        vk::Result::ERROR_INITIALIZATION_FAILED | vk::Result::ERROR_INCOMPATIBLE_DRIVER => {
            BackendErrorKind::Unavailable
        }
        vk::Result::ERROR_FEATURE_NOT_PRESENT | vk::Result::ERROR_EXTENSION_NOT_PRESENT => {
            BackendErrorKind::Unsupported
        }
        _ => BackendErrorKind::Other,
    }
}

/// An error for `op` from Vulkan call `call` returning `r`, with the code,
/// its name and the way out. Marks no context lost: `Shared::fail` does that
/// for calls on a context (the shared state is above this module).
pub(crate) fn error(op: &'static str, call: &str, r: vk::Result) -> BackendError {
    let kind = kind_of(r);
    let hint = match kind {
        BackendErrorKind::DeviceLost => {
            "; the device is lost: nothing queued on it will run; retire the context and \
             create a new one"
        }
        BackendErrorKind::OutOfMemory => OUT_OF_MEMORY_HINT,
        _ => "",
    };
    BackendError::from_driver_call(
        BACKEND,
        op,
        kind,
        call,
        &format!("{r:?}"),
        i64::from(r.as_raw()),
        hint,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lost_is_the_sticky_code_and_others_are_not() {
        assert_eq!(
            kind_of(vk::Result::ERROR_DEVICE_LOST),
            BackendErrorKind::DeviceLost
        );
        assert!(error("allocate", "vkQueueSubmit", vk::Result::ERROR_DEVICE_LOST).is_device_lost());
        assert_eq!(
            kind_of(vk::Result::ERROR_OUT_OF_DEVICE_MEMORY),
            BackendErrorKind::OutOfMemory
        );
        assert_eq!(
            kind_of(vk::Result::ERROR_INCOMPATIBLE_DRIVER),
            BackendErrorKind::Unavailable
        );
        assert_eq!(
            kind_of(vk::Result::ERROR_FRAGMENTED_POOL),
            BackendErrorKind::Other
        );
    }

    #[test]
    fn message_names_the_call_the_code_and_the_way_out() {
        let e = error("free_async", "vkQueueSubmit", vk::Result::ERROR_DEVICE_LOST);
        let s = e.to_string();
        assert!(
            s.contains("vkQueueSubmit returned ERROR_DEVICE_LOST (-4)"),
            "{s}"
        );
        assert!(s.contains("retire the context"), "{s}");
        assert_eq!(e.code, Some(-4));
    }
}
