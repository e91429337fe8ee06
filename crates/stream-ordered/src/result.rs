//! The vendor table's results: how a vendor's code is classified
//! ([`Class`]), and the one place a driver result becomes a
//! [`BackendError`] for every vendor ([`error`], [`check`]).
//!
//! The classification is the vendor's (its documentation says which codes
//! are sticky); what the core does with a class is written here once: a
//! [`Class::DeviceLost`] code is [`BackendErrorKind::DeviceLost`], so the
//! governor marks the context lost and settles pending releases without
//! further driver calls; the message names the call, the driver's name for
//! the code, its number and the way out. Building a message never calls
//! into the driver beyond what [`Vendor::name`] does (a driver that may be
//! broken is not asked to do more).

use memgov_backend::shell::Driver;
use memgov_backend::{BackendError, BackendErrorKind, OUT_OF_MEMORY_HINT};
use std::marker::PhantomData;

/// What a vendor's result code means to the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// The call succeeded.
    Success,
    /// The queried work has not completed (`cuStreamQuery`,
    /// `hipEventQuery`): not an error for a query, an error elsewhere.
    NotReady,
    /// The device (or pool) has no memory for the request.
    OutOfMemory,
    /// The device or driver does not support the call.
    NotSupported,
    /// A sticky error: the context is unusable, nothing queued will run.
    DeviceLost,
    /// No usable driver or device (not initialized, no device, wrong
    /// driver).
    Unavailable,
    /// A handle, pointer or value the driver refused.
    InvalidArgument,
    /// A call that would have broken a graph capture under way broke it.
    CaptureInvalidated,
    /// Anything else, a code newer than the vendor's table included.
    Other,
}

impl Class {
    /// The [`BackendErrorKind`] of an error with this class (`None` for
    /// [`Class::Success`]). Not-ready and a broken capture are
    /// [`BackendErrorKind::Other`]: neither is a device fault or a
    /// refusal the governor acts on.
    pub fn kind(self) -> Option<BackendErrorKind> {
        Some(match self {
            Class::Success => return None,
            Class::OutOfMemory => BackendErrorKind::OutOfMemory,
            Class::NotSupported => BackendErrorKind::Unsupported,
            Class::DeviceLost => BackendErrorKind::DeviceLost,
            Class::Unavailable => BackendErrorKind::Unavailable,
            Class::InvalidArgument => BackendErrorKind::InvalidArgument,
            Class::NotReady | Class::CaptureInvalidated | Class::Other => BackendErrorKind::Other,
        })
    }
}

/// The vendor's own words for the way out of an error of a kind, appended
/// to the message (each starts with `"; "`).
#[derive(Debug, Clone, Copy)]
pub struct Hints {
    /// After a sticky code: what became of the context and what to do.
    pub device_lost: &'static str,
    /// When no driver or device is usable: what to check.
    pub unavailable: &'static str,
}

/// A stream-ordered driver API as the core sees it: its name, its result
/// codes and how they are classified and named.
///
/// Implemented by a unit type of the vendor crate (`Cuda`, `Hip`). The
/// vendor's entry points for each part of the core are further traits
/// (`arena::VmmTable`), so a vendor provides what it uses.
pub trait Vendor: 'static {
    /// The backend's name in errors (`"cuda"`, `"hip"`).
    const BACKEND: &'static str;

    /// The vendor's name in messages (`"CUDA"`, `"HIP"`: "not a live stream
    /// of CUDA context 3", "no HIP device"; tests and CI scripts grep it).
    const NAME: &'static str;

    /// What the vendor's documentation calls the library memgov calls
    /// (`"driver"`, `"runtime"`), in messages.
    const DRIVER: &'static str;

    /// What a driver call returns (`CUresult`, `hipError_t`).
    type Code: Copy + PartialEq + Send + Sync + 'static;

    /// The vendor's success code.
    const SUCCESS: Self::Code;

    /// The ways out the vendor's errors name.
    const HINTS: Hints;

    /// How `code` is classified. A code the vendor does not know (from a
    /// newer driver) is [`Class::Other`].
    fn classify(code: Self::Code) -> Class;

    /// The driver's name for `code` (`CUDA_ERROR_ILLEGAL_ADDRESS`,
    /// `hipErrorOutOfMemory`).
    fn name(code: Self::Code) -> String;

    /// The code's number, as the driver's header gives it.
    fn number(code: Self::Code) -> i64;
}

/// How `code` of vendor `V` is classified as an error kind (`Other` for
/// success, which is no error).
pub fn kind_of<V: Vendor>(code: V::Code) -> BackendErrorKind {
    V::classify(code).kind().unwrap_or(BackendErrorKind::Other)
}

/// An error for `op` from driver call `call` returning `code`, with the
/// code, its name and the way out.
pub fn error<V: Vendor>(op: &'static str, call: &str, code: V::Code) -> BackendError {
    let kind = kind_of::<V>(code);
    let hint = match kind {
        BackendErrorKind::DeviceLost => V::HINTS.device_lost,
        BackendErrorKind::OutOfMemory => OUT_OF_MEMORY_HINT,
        BackendErrorKind::Unavailable => V::HINTS.unavailable,
        _ => "",
    };
    BackendError::from_driver_call(
        V::BACKEND,
        op,
        kind,
        call,
        &V::name(code),
        V::number(code),
        hint,
    )
}

/// `Ok(())` for the vendor's success code, else [`error`].
pub fn check<V: Vendor>(op: &'static str, call: &str, code: V::Code) -> Result<(), BackendError> {
    if code == V::SUCCESS {
        Ok(())
    } else {
        Err(error::<V>(op, call, code))
    }
}

/// A backend error of vendor `V` without a driver code.
pub fn err<V: Vendor>(
    op: &'static str,
    kind: BackendErrorKind,
    msg: impl Into<String>,
) -> BackendError {
    BackendError::new(V::BACKEND, op, kind, msg)
}

/// A vendor crate's shorthands for its results over vendor `$vendor`, each
/// the function of this module of the same name: `check` and `error` (with
/// the visibility given) and `err` (crate-private).
#[macro_export]
macro_rules! vendor_results {
    ($vis:vis $vendor:ty) => {
        /// An error for `op` from `call` returning `code`, with the code,
        /// its name and the way out.
        $vis fn error(
            op: &'static str,
            call: &str,
            code: <$vendor as $crate::Vendor>::Code,
        ) -> ::memgov_backend::BackendError {
            $crate::result::error::<$vendor>(op, call, code)
        }
        /// `Ok(())` for the success code, else [`error`].
        $vis fn check(
            op: &'static str,
            call: &str,
            code: <$vendor as $crate::Vendor>::Code,
        ) -> Result<(), ::memgov_backend::BackendError> {
            $crate::result::check::<$vendor>(op, call, code)
        }
        /// An error that did not come from a driver call.
        pub(crate) fn err(
            op: &'static str,
            kind: ::memgov_backend::BackendErrorKind,
            msg: impl Into<String>,
        ) -> ::memgov_backend::BackendError {
            $crate::result::err::<$vendor>(op, kind, msg)
        }
    };
}

/// Vendor `V` as the driver shell ([`memgov_backend::Shell`]) sees it: its
/// results classified by [`check`].
pub struct Checked<V>(PhantomData<fn() -> V>);

impl<V: Vendor> Driver for Checked<V> {
    const BACKEND: &'static str = V::BACKEND;
    type Code = V::Code;

    fn check(op: &'static str, call: &str, code: V::Code) -> Result<(), BackendError> {
        check::<V>(op, call, code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vendor whose codes are their own classes' positions: 0 success, 1
    /// out of memory, 2 sticky, anything else unknown.
    struct Toy;

    impl Vendor for Toy {
        const BACKEND: &'static str = "toy";
        const NAME: &'static str = "Toy";
        const DRIVER: &'static str = "toy driver";
        type Code = i32;
        const SUCCESS: i32 = 0;
        const HINTS: Hints = Hints {
            device_lost: "; restart the toy",
            unavailable: "; plug the toy in",
        };

        fn classify(code: i32) -> Class {
            match code {
                0 => Class::Success,
                1 => Class::OutOfMemory,
                2 => Class::DeviceLost,
                _ => Class::Other,
            }
        }

        fn name(code: i32) -> String {
            format!("TOY_{code}")
        }

        fn number(code: i32) -> i64 {
            i64::from(code)
        }
    }

    #[test]
    fn a_sticky_code_is_device_lost_with_the_vendors_way_out() {
        let e = error::<Toy>("free_async", "toyFree", 2);
        assert!(e.is_device_lost());
        assert_eq!(e.code, Some(2));
        let s = e.to_string();
        assert!(s.contains("toyFree returned TOY_2 (2)"), "{s}");
        assert!(s.contains("restart the toy"), "{s}");
    }

    #[test]
    fn success_passes_and_unknown_codes_are_other() {
        assert!(check::<Toy>("allocate", "toyAlloc", 0).is_ok());
        let e = check::<Toy>("allocate", "toyAlloc", 77).unwrap_err();
        assert_eq!(e.kind, BackendErrorKind::Other);
        assert_eq!(e.code, Some(77));
        assert_eq!(kind_of::<Toy>(1), BackendErrorKind::OutOfMemory);
        assert!(<Checked<Toy> as Driver>::check("x", "toyX", 1)
            .unwrap_err()
            .to_string()
            .contains(OUT_OF_MEMORY_HINT.trim_start_matches("; ")));
    }

    #[test]
    fn every_class_but_success_is_an_error_kind() {
        for c in [
            Class::NotReady,
            Class::OutOfMemory,
            Class::NotSupported,
            Class::DeviceLost,
            Class::Unavailable,
            Class::InvalidArgument,
            Class::CaptureInvalidated,
            Class::Other,
        ] {
            assert!(c.kind().is_some(), "{c:?}");
        }
        assert_eq!(Class::Success.kind(), None);
    }
}
