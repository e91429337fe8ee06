//! Sleep and wake of a context's arena: its physical memory unmapped and
//! released (its contents kept in page-locked host memory when asked) while
//! the addresses stay reserved, then mapped again at the same addresses with
//! the contents restored.
//!
//! Each granule's slot is its mapped state: `Mapped` → `Asleep` on sleep,
//! `Asleep` → `Mapped` on wake, each step taken once, so no handle is
//! released twice and none is forgotten. A wake that would pass the arena's
//! limit is refused (`OutOfMemory`, with the numbers) before any granule is
//! mapped; one that fails half-way unmaps what it mapped and stays asleep.
//! While asleep, allocation, copies to and from arena memory are refused
//! (`InvalidArgument`), and releases retire as usual.

use crate::arena::state::Slot;
use crate::arena::{closed, granule, CudaArena};
use crate::result::err;
use crate::shared::Shared;
use cudarc::driver::sys::{self, CUmemGenericAllocationHandle, CUstream};
use memgov_backend::{lock, BackendError, BackendErrorKind};
use std::ffi::c_void;

pub use memgov_backend::capability::SleepReport;

/// A stream of the arena's own for the copies of sleep and wake, destroyed
/// (after a synchronize) when dropped.
pub(crate) struct CopyStream<'a> {
    s: &'a Shared,
    pub(crate) raw: CUstream,
}

impl<'a> CopyStream<'a> {
    pub(crate) fn new(s: &'a Shared, op: &'static str) -> Result<Self, BackendError> {
        let mut raw: CUstream = std::ptr::null_mut();
        // SAFETY: valid out pointer; the context is current (caller).
        let r = unsafe { sys::cuStreamCreate(&mut raw, 1) };
        s.checked(op, "cuStreamCreate", r)?;
        Ok(Self { s, raw })
    }

    pub(crate) fn sync(&self, op: &'static str) -> Result<(), BackendError> {
        // SAFETY: the stream made in `new`; the context is current.
        let r = unsafe { sys::cuStreamSynchronize(self.raw) };
        self.s.checked(op, "cuStreamSynchronize", r)
    }
}

impl Drop for CopyStream<'_> {
    fn drop(&mut self) {
        // SAFETY: the stream made in `new`, destroyed once; the context is
        // still current (the guard outlives this value in every caller).
        unsafe {
            let _ = sys::cuStreamSynchronize(self.raw);
            let _ = sys::cuStreamDestroy_v2(self.raw);
        }
    }
}

impl CudaArena {
    /// Put the arena to sleep: wait for every stream of the context, then
    /// unmap and release every granule, copying the contents of those in
    /// use to page-locked host memory first when `keep_contents` is set.
    /// Addresses stay reserved and allocations stay live (but unusable until
    /// [`wake`](Self::wake)).
    pub fn sleep(&self, keep_contents: bool) -> Result<SleepReport, BackendError> {
        let (arena, s) = (&*self.arena, &*self.shared);
        s.check_usable("sleep")?;
        // No capture begins while the arena sleeps; one under way is waited for.
        let _call = crate::capture::gate().call("sleep", true)?;
        let _current = s.make_current("sleep")?;
        crate::arena::quiesce(s, "sleep", None)?;
        let taken: Vec<(usize, CUmemGenericAllocationHandle, bool)> = {
            let mut st = lock(&arena.state);
            if st.closed {
                return Err(closed("sleep"));
            }
            if st.asleep {
                return Err(err(
                    "sleep",
                    BackendErrorKind::InvalidArgument,
                    "the arena is asleep already; wake it first",
                ));
            }
            if crate::sleep_set::set_asleep(&st) {
                return Err(err(
                    "sleep",
                    BackendErrorKind::InvalidArgument,
                    "a set of the arena's allocations is asleep (CudaArena::sleep_ranges); wake \
                     it first (CudaArena::wake_ranges or CudaArena::wake)",
                ));
            }
            while st.slots.iter().any(|g| g.slot.in_transition()) {
                st = arena.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            st.asleep = true;
            let v: Vec<_> = (0..st.slots.len())
                .filter_map(|g| match st.slots[g].slot {
                    Slot::Mapped(h) => Some((g, h, st.slots[g].users > 0)),
                    _ => None,
                })
                .collect();
            for &(g, _, _) in &v {
                st.slots[g].slot = Slot::Unmapping;
            }
            v
        };
        let copies = CopyStream::new(s, "sleep");
        let mut outcome: Vec<(usize, Slot)> = Vec::new();
        let mut first_err = None;
        let mut report = SleepReport {
            released: 0,
            offloaded: 0,
        };
        for (g, h, in_use) in taken {
            let at = arena.base + g as u64 * arena.granule;
            let mut host = 0usize;
            if in_use && keep_contents && first_err.is_none() {
                match offload(s, &copies, at, arena.granule) {
                    Ok(p) => host = p,
                    Err(e) => first_err = Some(e),
                }
            }
            if in_use && keep_contents && host == 0 {
                // Contents that could not be kept stay mapped.
                outcome.push((g, Slot::Mapped(h)));
                continue;
            }
            match granule::unmap(s, arena, g, h, "sleep") {
                Ok(()) => {
                    report.released += arena.granule;
                    if host != 0 {
                        report.offloaded += arena.granule;
                    }
                    outcome.push((
                        g,
                        if in_use {
                            Slot::Asleep { host }
                        } else {
                            Slot::Unmapped
                        },
                    ));
                }
                Err(q) => {
                    free_host(s, host);
                    first_err.get_or_insert_with(|| {
                        err(
                            "sleep",
                            BackendErrorKind::Other,
                            format!("the driver refused to give back the granule at {at:#x}; it is quarantined"),
                        )
                    });
                    outcome.push((g, q));
                }
            }
        }
        let mut st = lock(&arena.state);
        for (g, slot) in outcome {
            match slot {
                Slot::Mapped(_) => {}
                Slot::Quarantined { .. } => st.quarantine(g, slot, arena.base, arena.granule),
                _ => st.mapped -= arena.granule,
            }
            if !matches!(slot, Slot::Quarantined { .. }) {
                st.slots[g].slot = slot;
            }
        }
        drop(st);
        arena.changed.notify_all();
        match first_err {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Wake the arena: map every sleeping granule again at its address and
    /// copy back the contents kept. Refused with `OutOfMemory` before any
    /// mapping when the granules do not fit the arena's limit. Returns the
    /// bytes mapped. Also wakes a set put to sleep with
    /// [`sleep_ranges`](Self::sleep_ranges), whole.
    pub fn wake(&self) -> Result<u64, BackendError> {
        let (arena, s) = (&*self.arena, &*self.shared);
        if crate::sleep_set::set_asleep(&lock(&arena.state)) {
            return self.wake_granules("wake", None);
        }
        s.check_usable("wake")?;
        let _call = crate::capture::gate().call("wake", true)?;
        let _current = s.make_current("wake")?;
        let sleeping: Vec<(usize, usize)> = {
            let mut st = lock(&arena.state);
            if st.closed {
                return Err(closed("wake"));
            }
            if !st.asleep {
                return Ok(0);
            }
            let v: Vec<_> = (0..st.slots.len())
                .filter_map(|g| match st.slots[g].slot {
                    Slot::Asleep { host } => Some((g, host)),
                    _ => None,
                })
                .collect();
            let needed = v.len() as u64 * arena.granule;
            if st.mapped + st.mapping + needed > arena.limit() {
                return Err(err(
                    "wake",
                    BackendErrorKind::OutOfMemory,
                    format!(
                        "waking needs {needed} B mapped, but the arena holds {} B of its {} B \
                         limit; nothing was mapped and the arena stays asleep (free memory or \
                         raise ArenaConfig::limit_bytes)",
                        st.mapped + st.mapping,
                        arena.limit()
                    ),
                ));
            }
            for &(g, _) in &v {
                st.slots[g].slot = Slot::Mapping;
            }
            st.mapping += needed;
            v
        };
        let mut mapped: Vec<(usize, usize, CUmemGenericAllocationHandle)> = Vec::new();
        let mut failure = None;
        for &(g, host) in &sleeping {
            match granule::map(s, arena, g, "wake") {
                Ok(h) => mapped.push((g, host, h)),
                Err((e, leftover)) => {
                    if let Some(q) = leftover {
                        let mut st = lock(&arena.state);
                        st.mapped += arena.granule;
                        st.quarantine(g, q, arena.base, arena.granule);
                    }
                    failure = Some(e);
                    break;
                }
            }
        }
        if failure.is_none() {
            let restored = CopyStream::new(s, "wake").and_then(|copies| {
                for &(g, host, _) in &mapped {
                    if host != 0 {
                        let at = arena.base + g as u64 * arena.granule;
                        // SAFETY: `host` holds one granule of contents; the
                        // granule at `at` was just mapped read-write; the
                        // host memory outlives the copy (synchronized below).
                        let r = unsafe {
                            sys::cuMemcpyHtoDAsync_v2(
                                at,
                                host as *const c_void,
                                arena.granule as usize,
                                copies.raw,
                            )
                        };
                        s.checked("wake", "cuMemcpyHtoDAsync_v2", r)?;
                    }
                }
                copies.sync("wake")
            });
            if let Err(e) = restored {
                failure = Some(e);
            }
        }
        let mut st = lock(&arena.state);
        st.mapping -= sleeping.len() as u64 * arena.granule;
        let Some(e) = failure else {
            for (g, host, h) in mapped {
                free_host(s, host);
                st.slots[g].slot = Slot::Mapped(h);
                st.mapped += arena.granule;
            }
            st.asleep = false;
            drop(st);
            arena.changed.notify_all();
            return Ok(sleeping.len() as u64 * arena.granule);
        };
        let mut lost = Vec::new();
        for &(g, host) in &sleeping {
            if matches!(st.slots[g].slot, Slot::Quarantined { .. }) {
                // Its undo failed: quarantined; its contents cannot return.
                lost.push(host);
            } else {
                st.slots[g].slot = Slot::Asleep { host };
            }
        }
        drop(st);
        lost.into_iter().for_each(|host| free_host(s, host));
        // Undo what this wake mapped, one granule at a time.
        for (g, host, h) in mapped {
            if let Err(q) = granule::unmap(s, arena, g, h, "wake") {
                let mut st = lock(&arena.state);
                // Counted as mapped until the quarantine says otherwise.
                st.mapped += arena.granule;
                st.quarantine(g, q, arena.base, arena.granule);
                free_host(s, host);
            }
        }
        arena.changed.notify_all();
        Err(e)
    }
}

/// Copy one granule at `at` to fresh page-locked host memory; returns its
/// address.
pub(crate) fn offload(
    s: &Shared,
    copies: &Result<CopyStream<'_>, BackendError>,
    at: u64,
    bytes: u64,
) -> Result<usize, BackendError> {
    let copies = copies.as_ref().map_err(Clone::clone)?;
    let mut host: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out pointer; the context is current.
    let r =
        unsafe { sys::cuMemHostAlloc(&mut host, bytes as usize, sys::CU_MEMHOSTALLOC_PORTABLE) };
    s.checked("sleep", "cuMemHostAlloc", r)?;
    // SAFETY: the granule at `at` is mapped read-write; `host` holds `bytes`
    // and outlives the copy (synchronized below).
    let r = unsafe { sys::cuMemcpyDtoHAsync_v2(host, at, bytes as usize, copies.raw) };
    let copied = s
        .checked("sleep", "cuMemcpyDtoHAsync_v2", r)
        .and_then(|()| copies.sync("sleep"));
    if let Err(e) = copied {
        free_host(s, host as usize);
        return Err(e);
    }
    Ok(host as usize)
}

pub(crate) fn free_host(s: &Shared, host: usize) {
    if host != 0 {
        // SAFETY: page-locked memory from `offload`, freed once (its slot
        // is being replaced); no queued copy uses it (synchronized).
        let r = unsafe { sys::cuMemFreeHost(host as *mut c_void) };
        let _ = s.checked("wake", "cuMemFreeHost", r);
    }
}
