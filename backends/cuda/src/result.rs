//! The one place CUDA driver results become [`BackendError`]s.
//!
//! Codes are classified here and nowhere else: the sticky codes after which
//! the context is unusable (every later call in the process returns an error
//! until the context is destroyed) are [`BackendErrorKind::DeviceLost`], so
//! the governor marks the context lost and settles pending releases without
//! further driver calls.
//!
//! Names come from cudarc's `CUresult` enum (no driver call, so an error path
//! never calls into a driver that may be broken). The message and the way
//! out are built by the core ([`memgov_stream_ordered::result`]); this file
//! is CUDA's half of the vendor table's results.
//!
//! [`BackendError`]: memgov_backend::BackendError
//! [`BackendErrorKind::DeviceLost`]: memgov_backend::BackendErrorKind::DeviceLost

use cudarc::driver::sys::CUresult;
use memgov_stream_ordered::{Class, Hints, Vendor};

pub(crate) const BACKEND: &str = "cuda";

/// The CUDA driver API as the core sees it: its codes, classified below,
/// named by cudarc's `CUresult` enum. The driver shell sees it as
/// [`Checked<Cuda>`](memgov_stream_ordered::Checked).
pub struct Cuda;

/// Sticky errors: the context is corrupted and must be destroyed. The CUDA
/// driver documentation marks each of these as leaving the process in an
/// inconsistent state ("the context cannot be used ... must terminate and
/// relaunch").
pub(crate) const DEVICE_LOST: &[CUresult] = &[
    CUresult::CUDA_ERROR_ECC_UNCORRECTABLE,
    CUresult::CUDA_ERROR_NVLINK_UNCORRECTABLE,
    CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
    CUresult::CUDA_ERROR_LAUNCH_TIMEOUT,
    CUresult::CUDA_ERROR_ASSERT,
    CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR,
    CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION,
    CUresult::CUDA_ERROR_MISALIGNED_ADDRESS,
    CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE,
    CUresult::CUDA_ERROR_INVALID_PC,
    CUresult::CUDA_ERROR_LAUNCH_FAILED,
];

impl Vendor for Cuda {
    const BACKEND: &'static str = BACKEND;
    const NAME: &'static str = "CUDA";
    const DRIVER: &'static str = "driver";
    type Code = CUresult;
    const SUCCESS: CUresult = CUresult::CUDA_SUCCESS;
    const HINTS: Hints = Hints {
        device_lost: "; the CUDA context is in a sticky error state and nothing queued on it \
                      will run: retire this context (teardown does not wait on the device) and \
                      restart the process to use the GPU again",
        unavailable: "; check the NVIDIA driver installation and the device ordinal",
    };

    fn classify(r: CUresult) -> Class {
        use CUresult as R;
        if DEVICE_LOST.contains(&r) {
            return Class::DeviceLost;
        }
        match r {
            R::CUDA_SUCCESS => Class::Success,
            R::CUDA_ERROR_NOT_READY => Class::NotReady,
            R::CUDA_ERROR_OUT_OF_MEMORY => Class::OutOfMemory,
            R::CUDA_ERROR_NOT_INITIALIZED
            | R::CUDA_ERROR_DEINITIALIZED
            | R::CUDA_ERROR_STUB_LIBRARY
            | R::CUDA_ERROR_DEVICE_UNAVAILABLE
            | R::CUDA_ERROR_NO_DEVICE
            | R::CUDA_ERROR_INVALID_DEVICE
            | R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
            | R::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
            | R::CUDA_ERROR_SYSTEM_NOT_READY => Class::Unavailable,
            R::CUDA_ERROR_INVALID_VALUE
            | R::CUDA_ERROR_INVALID_HANDLE
            | R::CUDA_ERROR_INVALID_CONTEXT => Class::InvalidArgument,
            R::CUDA_ERROR_NOT_SUPPORTED => Class::NotSupported,
            R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => Class::CaptureInvalidated,
            _ => Class::Other,
        }
    }

    /// The enum's own name (no driver call, so an error path never calls
    /// into a driver that may be broken).
    fn name(r: CUresult) -> String {
        format!("{r:?}")
    }

    fn number(r: CUresult) -> i64 {
        i64::from(r as i32)
    }
}

/// The driver's name for a code (`CUDA_ERROR_ILLEGAL_ADDRESS`).
pub(crate) fn name(r: CUresult) -> String {
    Cuda::name(r)
}

memgov_stream_ordered::vendor_results!(pub(crate) Cuda);

#[cfg(test)]
mod tests {
    use super::*;
    use memgov_backend::BackendErrorKind;

    #[test]
    fn sticky_codes_are_device_lost_and_others_are_not() {
        use memgov_stream_ordered::result::kind_of;
        for &r in DEVICE_LOST {
            assert_eq!(kind_of::<Cuda>(r), BackendErrorKind::DeviceLost, "{r:?}");
            assert!(error("allocate", "cuMemAllocAsync", r).is_device_lost());
        }
        use {BackendErrorKind as K, CUresult as R};
        for (r, kind) in [
            (R::CUDA_ERROR_OUT_OF_MEMORY, K::OutOfMemory),
            (R::CUDA_ERROR_NO_DEVICE, K::Unavailable),
            (R::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, K::Other),
        ] {
            assert_eq!(kind_of::<Cuda>(r), kind, "{r:?}");
        }
    }

    #[test]
    fn message_names_the_call_the_code_and_the_way_out() {
        let e = error(
            "free_async",
            "cuMemFreeAsync",
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
        );
        let s = e.to_string();
        assert!(
            s.contains("cuMemFreeAsync returned CUDA_ERROR_ILLEGAL_ADDRESS (700)"),
            "{s}"
        );
        assert!(s.contains("retire this context"), "{s}");
        assert_eq!(e.code, Some(700));
    }
}
