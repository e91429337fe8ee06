//! Status codes, the per-thread error message, and the guard every entry
//! point runs in (no panic crosses the boundary).

use memgov::{BackendError, BackendErrorKind, GovernorError, ProviderContextPinError};
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What every call returns (`int32_t` in C; the `MEMGOV_*` constants).
pub type Status = i32;

/// The call did what it says.
pub const MEMGOV_OK: Status = 0;
/// A handle that is not live: null, never issued, already released or
/// destroyed, or of another kind.
pub const MEMGOV_ERR_INVALID_HANDLE: Status = 1;
/// An argument is out of range (zero size, unknown role, null out-pointer,
/// a struct whose `size` is too small, a stream of another context, ...).
pub const MEMGOV_ERR_INVALID_ARGUMENT: Status = 2;
/// The allocation does not fit its budget or the device's memory.
pub const MEMGOV_ERR_OUT_OF_MEMORY: Status = 3;
/// The context is retiring, terminated or force-retired, or the plugin is
/// being unloaded: no new work is accepted.
pub const MEMGOV_ERR_RETIRING: Status = 4;
/// The device was lost.
pub const MEMGOV_ERR_DEVICE_LOST: Status = 5;
/// A deadline passed with work still outstanding.
pub const MEMGOV_ERR_TIMEOUT: Status = 6;
/// Something is still outstanding (plugin unload, allocator destroy): the
/// counts say what.
pub const MEMGOV_ERR_BUSY: Status = 7;
/// The backend has no such thing (a raw pointer of the null backend).
pub const MEMGOV_ERR_UNSUPPORTED: Status = 8;
/// The backend is not compiled in, or its driver or device is absent.
pub const MEMGOV_ERR_UNAVAILABLE: Status = 9;
/// The backend reported an error of another kind.
pub const MEMGOV_ERR_BACKEND: Status = 10;
/// A plugin could not be loaded, or its init function failed.
pub const MEMGOV_ERR_PLUGIN: Status = 11;
/// Too many pins outstanding on the context.
pub const MEMGOV_ERR_LIMIT: Status = 12;
/// memgov panicked inside the call; the message says where. The call had no
/// effect beyond what the message says, and the library stays usable.
pub const MEMGOV_ERR_PANIC: Status = 13;

/// Every status with its name, in order.
pub const STATUS_NAMES: [(Status, &str); 14] = [
    (MEMGOV_OK, "MEMGOV_OK"),
    (MEMGOV_ERR_INVALID_HANDLE, "MEMGOV_ERR_INVALID_HANDLE"),
    (MEMGOV_ERR_INVALID_ARGUMENT, "MEMGOV_ERR_INVALID_ARGUMENT"),
    (MEMGOV_ERR_OUT_OF_MEMORY, "MEMGOV_ERR_OUT_OF_MEMORY"),
    (MEMGOV_ERR_RETIRING, "MEMGOV_ERR_RETIRING"),
    (MEMGOV_ERR_DEVICE_LOST, "MEMGOV_ERR_DEVICE_LOST"),
    (MEMGOV_ERR_TIMEOUT, "MEMGOV_ERR_TIMEOUT"),
    (MEMGOV_ERR_BUSY, "MEMGOV_ERR_BUSY"),
    (MEMGOV_ERR_UNSUPPORTED, "MEMGOV_ERR_UNSUPPORTED"),
    (MEMGOV_ERR_UNAVAILABLE, "MEMGOV_ERR_UNAVAILABLE"),
    (MEMGOV_ERR_BACKEND, "MEMGOV_ERR_BACKEND"),
    (MEMGOV_ERR_PLUGIN, "MEMGOV_ERR_PLUGIN"),
    (MEMGOV_ERR_LIMIT, "MEMGOV_ERR_LIMIT"),
    (MEMGOV_ERR_PANIC, "MEMGOV_ERR_PANIC"),
];

/// A failed call: its status and the message for `memgov_last_error_message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// The status returned.
    pub status: Status,
    /// What went wrong, with the numbers and the way out.
    pub message: String,
}

impl Error {
    pub(crate) fn new(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(MEMGOV_ERR_INVALID_ARGUMENT, message)
    }
}

pub(crate) type Result<T> = std::result::Result<T, Error>;

fn backend_status(kind: BackendErrorKind) -> Status {
    match kind {
        BackendErrorKind::OutOfMemory => MEMGOV_ERR_OUT_OF_MEMORY,
        BackendErrorKind::DeviceLost => MEMGOV_ERR_DEVICE_LOST,
        BackendErrorKind::InvalidArgument => MEMGOV_ERR_INVALID_ARGUMENT,
        BackendErrorKind::Unsupported => MEMGOV_ERR_UNSUPPORTED,
        BackendErrorKind::Unavailable => MEMGOV_ERR_UNAVAILABLE,
        _ => MEMGOV_ERR_BACKEND,
    }
}

impl From<BackendError> for Error {
    fn from(e: BackendError) -> Self {
        Self::new(backend_status(e.kind), e.to_string())
    }
}

impl From<GovernorError> for Error {
    fn from(e: GovernorError) -> Self {
        let status = match &e {
            GovernorError::Pin {
                refusal: ProviderContextPinError::ContextUnavailable(_),
                ..
            } => MEMGOV_ERR_RETIRING,
            GovernorError::Pin {
                refusal: ProviderContextPinError::PinCountOverflow(_),
                ..
            } => MEMGOV_ERR_LIMIT,
            GovernorError::BudgetExceeded(_) => MEMGOV_ERR_OUT_OF_MEMORY,
            GovernorError::ZeroSized { .. }
            | GovernorError::OutOfBounds { .. }
            | GovernorError::WrongContext { .. } => MEMGOV_ERR_INVALID_ARGUMENT,
            GovernorError::DeviceLost { .. } => MEMGOV_ERR_DEVICE_LOST,
            GovernorError::Reclaimed { .. } => MEMGOV_ERR_RETIRING,
            GovernorError::Backend { source, .. } => backend_status(source.kind),
            _ => MEMGOV_ERR_BACKEND,
        };
        Self::new(status, e.to_string())
    }
}

impl From<ProviderContextPinError> for Error {
    fn from(e: ProviderContextPinError) -> Self {
        let status = match e {
            ProviderContextPinError::ContextUnavailable(_) => MEMGOV_ERR_RETIRING,
            ProviderContextPinError::PinCountOverflow(_) => MEMGOV_ERR_LIMIT,
        };
        Self::new(status, e.to_string())
    }
}

thread_local! {
    static LAST_MESSAGE: RefCell<CString> = RefCell::new(CString::default());
}

/// Store `message` as this thread's last message (NULs become spaces).
pub(crate) fn set_message(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; the message is
    // then lost, never a panic.
    let _ = LAST_MESSAGE.try_with(|m| *m.borrow_mut() = c);
}

/// This thread's last message. Valid until the next memgov call on this
/// thread.
pub(crate) fn message_ptr() -> *const c_char {
    LAST_MESSAGE
        .try_with(|m| m.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// Copy this thread's last message into `buf` (`len` bytes): at most
/// `len - 1` bytes of it and a NUL, nothing when `buf` is NULL or `len` is 0.
/// Returns the message's full length in bytes, without the NUL (as
/// `snprintf` does): the copy was whole if that is below `len`.
///
/// # Safety
///
/// `buf` is NULL or valid for writes of `len` bytes.
pub(crate) unsafe fn copy_message(buf: *mut c_char, len: usize) -> usize {
    let write = |bytes: &[u8]| {
        if !buf.is_null() && len > 0 {
            let n = bytes.len().min(len - 1);
            // SAFETY: `buf` is valid for `len` bytes (the caller's contract)
            // and `n < len`: `n` bytes and the NUL after them fit; the
            // message is ours, so the two do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
                buf.add(n).write(0);
            }
        }
        bytes.len()
    };
    LAST_MESSAGE
        .try_with(|m| write(m.borrow().as_bytes()))
        .unwrap_or_else(|_| write(b""))
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a payload that is not text".to_owned()
    }
}

/// Run an entry point's body: its error becomes the status and the thread's
/// message; a panic becomes `MEMGOV_ERR_PANIC`. A call that succeeds clears
/// the message.
pub(crate) fn guard(name: &str, f: impl FnOnce() -> Result<()>) -> Status {
    // Asserted: after a panic the objects touched are left as the panic left
    // them, and every later call checks its handles again.
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_message("");
            MEMGOV_OK
        }
        Ok(Err(e)) => {
            set_message(&format!("{name}: {}", e.message));
            e.status
        }
        Err(payload) => {
            set_message(&format!(
                "{name}: memgov panicked: {}; the call was abandoned, the library stays usable",
                panic_text(&*payload)
            ));
            MEMGOV_ERR_PANIC
        }
    }
}

/// [`guard`] for entry points whose C shape returns a value instead of a
/// status (the runtimes' allocator functions): `fallback` on error or panic.
pub(crate) fn guard_value<T>(name: &str, fallback: T, f: impl FnOnce() -> Result<T>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => {
            set_message("");
            v
        }
        Ok(Err(e)) => {
            set_message(&format!("{name}: {}", e.message));
            fallback
        }
        Err(payload) => {
            set_message(&format!(
                "{name}: memgov panicked: {}",
                panic_text(&*payload)
            ));
            fallback
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: never NULL; NUL-terminated.
        unsafe { CStr::from_ptr(message_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_status_and_a_message() {
        let rc = guard("memgov_test", || panic!("boom {}", 42));
        assert_eq!(rc, MEMGOV_ERR_PANIC);
        assert!(
            last().starts_with("memgov_test: memgov panicked: boom 42"),
            "{}",
            last()
        );
        let v = guard_value("memgov_test_value", 7u32, || panic!("again"));
        assert_eq!(v, 7);
        assert!(last().contains("panicked: again"), "{}", last());
        // The thread is usable afterwards, and success clears the message.
        assert_eq!(guard("memgov_test", || Ok(())), MEMGOV_OK);
        assert_eq!(last(), "");
    }

    #[test]
    fn the_message_is_copied_truncated_and_terminated() {
        set_message("abcdef");
        let mut buf = [0x55 as c_char; 4];
        // SAFETY: `buf` has 4 writable bytes; NULL with 0 writes nothing.
        unsafe {
            assert_eq!(copy_message(std::ptr::null_mut(), 0), 6);
            assert_eq!(copy_message(buf.as_mut_ptr(), buf.len()), 6);
        }
        assert_eq!(buf.map(|c| c as u8), *b"abc\0");
        assert_eq!(last(), "abcdef");
    }

    #[test]
    fn errors_set_the_message_with_the_function_name() {
        let rc = guard("memgov_test", || Err(Error::invalid("bad\0thing")));
        assert_eq!(rc, MEMGOV_ERR_INVALID_ARGUMENT);
        assert_eq!(last(), "memgov_test: bad thing");
    }
}
