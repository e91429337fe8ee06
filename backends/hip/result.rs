//! The one place `hipError_t` codes become [`BackendError`]s: the kind each
//! code maps to, which codes mean the device is lost, and the driver's own
//! name for a code in every message.

use crate::context::OUT_OF_MEMORY_HINT;
use crate::{BackendError, BackendErrorKind};
use hip_sys::hiprt::{hipError_t, hipGetErrorName};
use std::ffi::CStr;

/// Backend name in every error and description.
pub(crate) const BACKEND: &str = "hip";

/// Codes after which nothing queued on the device will run: the HIP runtime
/// reports them sticky, for every later call of the process on that device.
const DEVICE_LOST: &[hipError_t] = &[
    hipError_t::hipErrorIllegalAddress,
    hipError_t::hipErrorLaunchFailure,
    hipError_t::hipErrorPriorLaunchFailure,
    hipError_t::hipErrorLaunchTimeOut,
    hipError_t::hipErrorECCNotCorrectable,
    hipError_t::hipErrorAssert,
    hipError_t::hipErrorContextIsDestroyed,
    hipError_t::hipErrorDeinitialized,
];

/// Whether `code` means the device (or the process's hold on it) is lost.
pub fn is_device_lost(code: hipError_t) -> bool {
    DEVICE_LOST.contains(&code)
}

/// The classification of a `hipError_t` code.
pub fn kind_of(code: hipError_t) -> BackendErrorKind {
    use hipError_t as E;
    if is_device_lost(code) {
        return BackendErrorKind::DeviceLost;
    }
    match code {
        E::hipErrorOutOfMemory => BackendErrorKind::OutOfMemory,
        E::hipErrorNoDevice
        | E::hipErrorInsufficientDriver
        | E::hipErrorNotInitialized
        | E::hipErrorNoBinaryForGpu => BackendErrorKind::Unavailable,
        E::hipErrorNotSupported => BackendErrorKind::Unsupported,
        E::hipErrorInvalidValue
        | E::hipErrorInvalidDevicePointer
        | E::hipErrorInvalidDevice
        | E::hipErrorInvalidHandle
        | E::hipErrorInvalidMemcpyDirection
        | E::hipErrorInvalidContext => BackendErrorKind::InvalidArgument,
        _ => BackendErrorKind::Other,
    }
}

/// The runtime's name for a code (`"hipErrorOutOfMemory"`).
pub fn error_name(code: hipError_t) -> String {
    // SAFETY: hipGetErrorName takes any listed code and returns a pointer to
    // a static NUL-terminated string (or null, handled below); it touches no
    // device state and is allowed before any other HIP call.
    let p = unsafe { hipGetErrorName(code) };
    if p.is_null() {
        return format!("{code:?}");
    }
    // SAFETY: non-null pointers from hipGetErrorName point at static,
    // NUL-terminated strings that live as long as the library.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A [`BackendError`] for `call` returning `code` during `op`, carrying the
/// code, its name, and what to do next.
pub fn hip_error(op: &'static str, call: &str, code: hipError_t) -> BackendError {
    let kind = kind_of(code);
    let hint = match kind {
        BackendErrorKind::DeviceLost => {
            "; the device is lost: nothing queued on it will run; retire this context (the process must restart to use the device again)"
        }
        BackendErrorKind::OutOfMemory => OUT_OF_MEMORY_HINT,
        BackendErrorKind::Unavailable => "; no usable AMD GPU through libamdhip64 on this machine",
        _ => "",
    };
    BackendError::from_driver_call(
        BACKEND,
        op,
        kind,
        call,
        &error_name(code),
        i64::from(code as u32),
        hint,
    )
}

/// `Ok` on `hipSuccess`, else the classified error.
pub fn check(op: &'static str, call: &str, code: hipError_t) -> Result<(), BackendError> {
    if code == hipError_t::hipSuccess {
        Ok(())
    } else {
        Err(hip_error(op, call, code))
    }
}

/// An error that did not come from a HIP call.
pub(crate) fn err(
    op: &'static str,
    kind: BackendErrorKind,
    msg: impl Into<String>,
) -> BackendError {
    BackendError::new(BACKEND, op, kind, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_codes_are_device_loss_and_others_are_not() {
        assert!(is_device_lost(hipError_t::hipErrorIllegalAddress));
        assert_eq!(
            kind_of(hipError_t::hipErrorLaunchFailure),
            BackendErrorKind::DeviceLost
        );
        assert_eq!(
            kind_of(hipError_t::hipErrorOutOfMemory),
            BackendErrorKind::OutOfMemory
        );
        assert_eq!(
            kind_of(hipError_t::hipErrorNoDevice),
            BackendErrorKind::Unavailable
        );
        assert_eq!(
            kind_of(hipError_t::hipErrorNotSupported),
            BackendErrorKind::Unsupported
        );
        assert_eq!(
            kind_of(hipError_t::hipErrorNotReady),
            BackendErrorKind::Other
        );
        assert!(!is_device_lost(hipError_t::hipErrorOutOfMemory));
    }
}
