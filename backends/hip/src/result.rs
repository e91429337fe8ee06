//! The one place `hipError_t` codes become [`BackendError`]s: the kind each
//! code maps to, which codes mean the device is lost, and the driver's own
//! name for a code in every message.
//!
//! Codes are plain `i32`s (see `ffi.rs`, which names the known ones with
//! the header's values): a code this crate does not know, from a newer
//! runtime, classifies as [`BackendErrorKind::Other`] and keeps its number.
//! This file is HIP's half of the vendor table's results; the message and
//! the way out are built by the core ([`memgov_stream_ordered::result`]).
//!
//! [`BackendError`]: memgov_backend::BackendError

use super::ffi::{self, HipResult, SUCCESS};
use memgov_backend::BackendErrorKind;
use memgov_stream_ordered::{result, Class, Hints, Vendor};
use std::ffi::CStr;

/// Backend name in every error and description.
pub(crate) const BACKEND: &str = "hip";

/// The HIP runtime as the core sees it: its results are `i32`s, classified
/// below. The driver shell sees it as
/// [`Checked<Hip>`](memgov_stream_ordered::Checked).
pub struct Hip;

impl Vendor for Hip {
    const BACKEND: &'static str = BACKEND;
    const NAME: &'static str = "HIP";
    const DRIVER: &'static str = "runtime";
    type Code = HipResult;
    const SUCCESS: HipResult = SUCCESS;
    const HINTS: Hints = Hints {
        device_lost: "; the device is lost: nothing queued on it will run; retire this context \
                      (the process must restart to use the device again)",
        unavailable: "; no usable AMD GPU through libamdhip64 on this machine",
    };

    fn classify(c: HipResult) -> Class {
        use ffi as E;
        if is_device_lost(c) {
            return Class::DeviceLost;
        }
        let is = |list: &[HipResult]| list.contains(&c);
        if c == SUCCESS {
            Class::Success
        } else if c == E::hipErrorNotReady {
            Class::NotReady
        } else if c == E::hipErrorOutOfMemory {
            Class::OutOfMemory
        } else if is(&[
            E::hipErrorNoDevice,
            E::hipErrorInsufficientDriver,
            E::hipErrorNotInitialized,
            E::hipErrorNoBinaryForGpu,
        ]) {
            Class::Unavailable
        } else if c == E::hipErrorNotSupported {
            Class::NotSupported
        } else if is(&[
            E::hipErrorInvalidValue,
            E::hipErrorInvalidDevicePointer,
            E::hipErrorInvalidDevice,
            E::hipErrorInvalidHandle,
            E::hipErrorInvalidMemcpyDirection,
            E::hipErrorInvalidContext,
        ]) {
            Class::InvalidArgument
        } else {
            Class::Other
        }
    }

    fn name(code: HipResult) -> String {
        error_name(code)
    }

    fn number(code: HipResult) -> i64 {
        i64::from(code)
    }
}

/// Codes after which nothing queued on the device will run: the HIP runtime
/// reports them sticky, for every later call of the process on that device.
const DEVICE_LOST: &[HipResult] = &[
    ffi::hipErrorIllegalAddress,
    ffi::hipErrorLaunchFailure,
    ffi::hipErrorPriorLaunchFailure,
    ffi::hipErrorLaunchTimeOut,
    ffi::hipErrorECCNotCorrectable,
    ffi::hipErrorAssert,
    ffi::hipErrorContextIsDestroyed,
    ffi::hipErrorDeinitialized,
];

/// The header's names of the codes `ffi.rs` declares.
macro_rules! named {
    ($($code:ident),* $(,)?) => { &[$((ffi::$code, stringify!($code))),*] };
}
const KNOWN_NAMES: &[(HipResult, &str)] = named! {
    hipSuccess, hipErrorInvalidValue, hipErrorOutOfMemory, hipErrorNotInitialized,
    hipErrorDeinitialized, hipErrorInvalidDevicePointer, hipErrorInvalidMemcpyDirection,
    hipErrorInsufficientDriver, hipErrorPriorLaunchFailure, hipErrorNoDevice,
    hipErrorInvalidDevice, hipErrorInvalidContext, hipErrorNoBinaryForGpu,
    hipErrorECCNotCorrectable, hipErrorInvalidHandle, hipErrorNotReady, hipErrorIllegalAddress,
    hipErrorLaunchTimeOut, hipErrorContextIsDestroyed, hipErrorAssert, hipErrorLaunchFailure,
    hipErrorNotSupported,
};

/// Whether `code` means the device (or the process's hold on it) is lost.
pub fn is_device_lost(c: HipResult) -> bool {
    DEVICE_LOST.contains(&c)
}

/// The classification of a HIP result code; an unknown code is `Other`.
pub fn kind_of(c: HipResult) -> BackendErrorKind {
    result::kind_of::<Hip>(c)
}

/// The runtime's name for a code (`"hipErrorOutOfMemory"`).
pub fn error_name(code: HipResult) -> String {
    if !ffi::driver_present() {
        // No runtime to ask (a code built by hand, as in a test): the
        // header's name where this crate knows it.
        return KNOWN_NAMES
            .iter()
            .find(|(c, _)| *c == code)
            .map_or_else(|| format!("hipError {code}"), |(_, n)| (*n).to_owned());
    }
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

memgov_stream_ordered::vendor_results!(pub Hip);

/// [`error`] under the name `raw` has always given it.
pub use self::error as hip_error;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_codes_are_device_loss_and_others_are_not() {
        use BackendErrorKind as K;
        for (code, kind) in [
            (ffi::hipErrorIllegalAddress, K::DeviceLost),
            (ffi::hipErrorLaunchFailure, K::DeviceLost),
            (ffi::hipErrorOutOfMemory, K::OutOfMemory),
            (ffi::hipErrorNoDevice, K::Unavailable),
            (ffi::hipErrorNotSupported, K::Unsupported),
            (ffi::hipErrorNotReady, K::Other),
            // A code no binding lists is an integer like any other.
            (987_654, K::Other),
            (-3, K::Other),
        ] {
            assert_eq!(kind_of(code), kind, "{code}");
            assert_eq!(is_device_lost(code), kind == K::DeviceLost, "{code}");
        }
    }
}
