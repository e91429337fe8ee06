//! One granule's HIP steps, each undone on failure: map is `hipMemCreate`,
//! `hipMemMap`, `hipMemSetAccess`; unmap is `hipMemUnmap`, `hipMemRelease`.
//! The caller has the arena's device current.

use super::Arena;
use crate::ffi::{self, hipMemGenericAllocationHandle_t};
use crate::shared::Shared;
use memgov_backend::vmm::{MapError, Slot};
use memgov_backend::BackendError;
use std::ffi::c_void;

/// A `hipMemGenericAllocationHandle_t` that may cross threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handle(pub(crate) hipMemGenericAllocationHandle_t);

// SAFETY: an opaque runtime handle that HIP accepts from any host thread;
// this type only carries the value.
unsafe impl Send for Handle {}
// SAFETY: as above; shared references only copy the handle.
unsafe impl Sync for Handle {}

/// Back granule `g` with fresh physical memory, accessible read-write from
/// the arena's device. On failure the mapping (if made) is unmapped and the
/// handle released; an undo the runtime refuses is reported by the error's
/// message and the slot returned with it.
pub(crate) fn map(
    s: &Shared,
    arena: &Arena,
    g: usize,
    op: &'static str,
) -> Result<Handle, MapError<Handle>> {
    // Held until the granule is mapped: no capture begins in between.
    let _call = crate::capture::gate()
        .call(op, true)
        .map_err(|e| (e, None))?;
    let at = (arena.base + g as u64 * arena.granule) as *mut c_void;
    let size = arena.granule as usize;
    let mut h: hipMemGenericAllocationHandle_t = std::ptr::null_mut();
    let prop = arena.prop();
    // SAFETY: valid out pointer; the properties live until the call
    // returns, in the loaded runtime's layout; the device is current.
    let r = unsafe { ffi::hipMemCreate(&mut h, size, prop.as_ptr(), 0) };
    s.checked(op, "hipMemCreate", r).map_err(|e| (e, None))?;
    let h = Handle(h);
    // SAFETY: `at` is a granule-aligned granule of the arena's reservation
    // that this thread owns (marked Mapping), so nothing is mapped there;
    // `h` is the handle just created, of exactly one granule.
    let r = unsafe { ffi::hipMemMap(at, size, 0, h.0, 0) };
    if let Err(e) = s.checked(op, "hipMemMap", r) {
        return Err(undo(s, h, None, e, op));
    }
    let desc = ffi::hipMemAccessDesc {
        location: prop.location(),
        flags: ffi::hipMemAccessFlagsProtReadWrite,
    };
    // SAFETY: [at, at + size) is exactly the mapping made above; one
    // descriptor.
    let r = unsafe { ffi::hipMemSetAccess(at, size, &desc, 1) };
    if let Err(e) = s.checked(op, "hipMemSetAccess", r) {
        return Err(undo(s, h, Some((at, size)), e, op));
    }
    Ok(h)
}

/// Undo a half-made granule: unmap (when mapped) and release. The error
/// says what could not be undone.
fn undo(
    s: &Shared,
    h: Handle,
    mapped: Option<(*mut c_void, usize)>,
    e: BackendError,
    op: &'static str,
) -> MapError<Handle> {
    if let Some((at, size)) = mapped {
        // SAFETY: the mapping made by the caller, unused (its access was
        // never granted), unmapped once.
        let r = unsafe { ffi::hipMemUnmap(at, size) };
        if let Err(u) = s.checked(op, "hipMemUnmap", r) {
            let why = format!("its mapping at {at:p} stays ({})", u.message);
            let slot = Slot::Quarantined {
                handle: Some(h),
                mapped: true,
            };
            return (with(e, why), Some(slot));
        }
    }
    match release(s, h, op) {
        Ok(()) => (e, None),
        Err(u) => {
            let why = format!("its handle stays unreleased ({})", u.message);
            let slot = Slot::Quarantined {
                handle: Some(h),
                mapped: false,
            };
            (with(e, why), Some(slot))
        }
    }
}

fn with(e: BackendError, why: String) -> BackendError {
    BackendError {
        message: format!(
            "{}; undoing the granule failed: {why} (quarantined)",
            e.message
        ),
        ..e
    }
}

/// Release a handle (its memory goes once no mapping uses it).
pub(crate) fn release(s: &Shared, h: Handle, op: &'static str) -> Result<(), BackendError> {
    let _call = crate::capture::gate().call(op, false)?;
    // SAFETY: a handle of this arena, released once: every caller takes it
    // out of the granule's slot first.
    let r = unsafe { ffi::hipMemRelease(h.0) };
    s.checked(op, "hipMemRelease", r)
}

/// Unmap granule `g` (backed by `h`) and release `h`. `Err` carries the
/// slot to quarantine it in: still mapped, or unmapped but unreleased.
pub(crate) fn unmap(
    s: &Shared,
    arena: &Arena,
    g: usize,
    h: Handle,
    op: &'static str,
) -> Result<(), Slot<Handle>> {
    // Never refused (`refuse_own` is false): waits while a capture is under
    // way on another thread.
    let _call = crate::capture::gate().call(op, false);
    let at = (arena.base + g as u64 * arena.granule) as *mut c_void;
    // SAFETY: granule `g` is mapped with `h` and owned by this thread
    // (Unmapping, or undone before anyone used it); no allocation overlaps
    // it, and every stream passed the release of the last that did.
    let r = unsafe { ffi::hipMemUnmap(at, arena.granule as usize) };
    if s.checked(op, "hipMemUnmap", r).is_err() {
        return Err(Slot::Quarantined {
            handle: Some(h),
            mapped: true,
        });
    }
    release(s, h, op).map_err(|_| Slot::Quarantined {
        handle: Some(h),
        mapped: false,
    })
}
