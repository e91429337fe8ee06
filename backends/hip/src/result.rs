//! The one place `hipError_t` codes become [`BackendError`]s: the kind each
//! code maps to, which codes mean the device is lost, and the driver's own
//! name for a code in every message.
//!
//! Codes are plain `i32`s (see `ffi.rs`): a code this crate does not know,
//! from a newer runtime, classifies as [`BackendErrorKind::Other`] and keeps
//! its number. The `hipError_t` variants of hip-sys name the known ones
//! (`hipError_t::hipErrorOutOfMemory as i32`).

use super::ffi::{self, HipResult, SUCCESS};
use hip_sys::hiprt::hipError_t;
use memgov_backend::OUT_OF_MEMORY_HINT;
use memgov_backend::{BackendError, BackendErrorKind};
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

/// The integer of a known code.
const fn code(e: hipError_t) -> HipResult {
    e as HipResult
}

/// Whether `code` means the device (or the process's hold on it) is lost.
pub fn is_device_lost(c: HipResult) -> bool {
    DEVICE_LOST.iter().any(|&e| code(e) == c)
}

/// The classification of a HIP result code; an unknown code is `Other`.
pub fn kind_of(c: HipResult) -> BackendErrorKind {
    use hipError_t as E;
    if is_device_lost(c) {
        return BackendErrorKind::DeviceLost;
    }
    let is = |list: &[hipError_t]| list.iter().any(|&e| code(e) == c);
    if c == code(E::hipErrorOutOfMemory) {
        BackendErrorKind::OutOfMemory
    } else if is(&[
        E::hipErrorNoDevice,
        E::hipErrorInsufficientDriver,
        E::hipErrorNotInitialized,
        E::hipErrorNoBinaryForGpu,
    ]) {
        BackendErrorKind::Unavailable
    } else if c == code(E::hipErrorNotSupported) {
        BackendErrorKind::Unsupported
    } else if is(&[
        E::hipErrorInvalidValue,
        E::hipErrorInvalidDevicePointer,
        E::hipErrorInvalidDevice,
        E::hipErrorInvalidHandle,
        E::hipErrorInvalidMemcpyDirection,
        E::hipErrorInvalidContext,
    ]) {
        BackendErrorKind::InvalidArgument
    } else {
        BackendErrorKind::Other
    }
}

/// The runtime's name for a code (`"hipErrorOutOfMemory"`).
pub fn error_name(code: HipResult) -> String {
    // SAFETY: hipGetErrorName takes any integer (declared here as `int`, so
    // an unknown code is no invalid enum value) and returns a pointer to a
    // static NUL-terminated string (or null, handled below); it touches no
    // device state and is allowed before any other HIP call.
    let p = unsafe { ffi::hipGetErrorName(code) };
    if p.is_null() {
        return format!("hipError {code}");
    }
    // SAFETY: non-null pointers from hipGetErrorName point at static,
    // NUL-terminated strings that live as long as the library.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A [`BackendError`] for `call` returning `code` during `op`, carrying the
/// code, its name, and what to do next.
pub fn hip_error(op: &'static str, call: &str, code: HipResult) -> BackendError {
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
        i64::from(code),
        hint,
    )
}

/// `Ok` on `hipSuccess`, else the classified error.
pub fn check(op: &'static str, call: &str, code: HipResult) -> Result<(), BackendError> {
    if code == SUCCESS {
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
        assert!(is_device_lost(hipError_t::hipErrorIllegalAddress as i32));
        assert_eq!(
            kind_of(hipError_t::hipErrorLaunchFailure as i32),
            BackendErrorKind::DeviceLost
        );
        assert_eq!(
            kind_of(hipError_t::hipErrorOutOfMemory as i32),
            BackendErrorKind::OutOfMemory
        );
        assert_eq!(
            kind_of(hipError_t::hipErrorNoDevice as i32),
            BackendErrorKind::Unavailable
        );
        assert_eq!(
            kind_of(hipError_t::hipErrorNotSupported as i32),
            BackendErrorKind::Unsupported
        );
        assert_eq!(
            kind_of(hipError_t::hipErrorNotReady as i32),
            BackendErrorKind::Other
        );
        assert!(!is_device_lost(hipError_t::hipErrorOutOfMemory as i32));
        // A code no binding lists is an integer like any other.
        assert_eq!(kind_of(987_654), BackendErrorKind::Other);
        assert!(!is_device_lost(-3));
    }
}
