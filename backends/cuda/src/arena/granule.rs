//! One granule's driver steps, each undone on failure: map is
//! `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`; unmap is `cuMemUnmap`,
//! `cuMemRelease`. The caller has the context current.

use super::state::Slot;
use super::Arena;
use crate::shared::Shared;
use cudarc::driver::sys::{self, CUmemGenericAllocationHandle};
use memgov_backend::BackendError;

/// Pinned device memory of device `ordinal`, no shareable handle.
pub(crate) fn prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero bytes are valid (null
    // pointer, zero enums and flags); the fields that matter are set below.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = ordinal;
    p
}

/// Why a granule could not be mapped, and, when undoing its own steps
/// failed too, the slot to quarantine it in (`None`: nothing of it is left).
pub(crate) type MapError = (BackendError, Option<Slot>);

/// Back granule `g` with fresh physical memory, accessible read-write from
/// the arena's device. On failure the mapping (if made) is unmapped and the
/// handle released; an undo the driver refuses is reported by the error's
/// message and the slot returned with it.
pub(crate) fn map(
    s: &Shared,
    arena: &Arena,
    g: usize,
    op: &'static str,
) -> Result<CUmemGenericAllocationHandle, MapError> {
    // Held until the granule is mapped: no capture begins in between.
    let _call = crate::capture::gate()
        .call(op, true)
        .map_err(|e| (e, None))?;
    let at = arena.base + g as u64 * arena.granule;
    let size = arena.granule as usize;
    let mut h: CUmemGenericAllocationHandle = 0;
    let prop = prop(arena.ordinal);
    // SAFETY: valid out pointer and properties; the context is current.
    let r = unsafe { sys::cuMemCreate(&mut h, size, &prop, 0) };
    s.checked(op, "cuMemCreate", r).map_err(|e| (e, None))?;
    // SAFETY: `at` is a granule-aligned granule of the arena's reservation
    // that this thread owns (marked Mapping), so nothing is mapped there;
    // `h` is the handle just created, of exactly one granule.
    let r = unsafe { sys::cuMemMap(at, size, 0, h, 0) };
    if let Err(e) = s.checked(op, "cuMemMap", r) {
        return Err(undo(s, h, None, e, op));
    }
    let desc = sys::CUmemAccessDesc {
        location: prop.location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: [at, at + size) is exactly the mapping made above; one
    // descriptor.
    let r = unsafe { sys::cuMemSetAccess(at, size, &desc, 1) };
    if let Err(e) = s.checked(op, "cuMemSetAccess", r) {
        return Err(undo(s, h, Some((at, size)), e, op));
    }
    Ok(h)
}

/// Undo a half-made granule: unmap (when mapped) and release. The error
/// says what could not be undone.
fn undo(
    s: &Shared,
    h: CUmemGenericAllocationHandle,
    mapped: Option<(u64, usize)>,
    e: BackendError,
    op: &'static str,
) -> MapError {
    if let Some((at, size)) = mapped {
        // SAFETY: the mapping made by the caller, unused (its access was
        // never granted), unmapped once.
        let r = unsafe { sys::cuMemUnmap(at, size) };
        if let Err(u) = s.checked(op, "cuMemUnmap", r) {
            let why = format!("its mapping at {at:#x} stays ({})", u.message);
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
pub(crate) fn release(
    s: &Shared,
    h: CUmemGenericAllocationHandle,
    op: &'static str,
) -> Result<(), BackendError> {
    let _call = crate::capture::gate().call(op, false)?;
    // SAFETY: a handle of this arena, released once: every caller takes it
    // out of the granule's slot first.
    let r = unsafe { sys::cuMemRelease(h) };
    s.checked(op, "cuMemRelease", r)
}

/// Unmap granule `g` (backed by `h`) and release `h`. `Err` carries the
/// slot to quarantine it in: still mapped, or unmapped but unreleased.
pub(crate) fn unmap(
    s: &Shared,
    arena: &Arena,
    g: usize,
    h: CUmemGenericAllocationHandle,
    op: &'static str,
) -> Result<(), Slot> {
    // Never refused (`refuse_own` is false): waits while a capture is under
    // way on another thread.
    let _call = crate::capture::gate().call(op, false);
    let at = arena.base + g as u64 * arena.granule;
    // SAFETY: granule `g` is mapped with `h` and owned by this thread
    // (Unmapping, or undone before anyone used it); no allocation overlaps
    // it, and every stream passed the release of the last that did.
    let r = unsafe { sys::cuMemUnmap(at, arena.granule as usize) };
    if s.checked(op, "cuMemUnmap", r).is_err() {
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
