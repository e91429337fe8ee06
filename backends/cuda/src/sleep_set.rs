//! Sleep and wake of a chosen set of the arena's allocations (the weights,
//! say, or one model's KV cache), leaving the others mapped and usable.
//!
//! A granule sleeps with the set when every allocation that overlaps it is
//! in the set: its physical memory is unmapped and released (its contents
//! kept in page-locked host memory when asked), its address stays
//! reserved. A granule shared with an allocation outside the set stays
//! mapped, so the others never lose a byte. Invariants, each enforced
//! here:
//!
//! * **Per-granule state, each step once.** A granule goes `Mapped` →
//!   `Asleep` in [`CudaArena::sleep_ranges`] and `Asleep` → `Mapped` in
//!   [`CudaArena::wake_ranges`] (or [`CudaArena::wake`]), under the arena's
//!   lock and marked in transition between, so no handle is released twice
//!   and none is forgotten; teardown frees what is still asleep.
//! * **No allocation lands in a sleeping granule.** Its free space is
//!   carved out of the free list while it sleeps, and a block released
//!   meanwhile is carved out again ([`keep_asleep_out`], called when a
//!   release retires); the wake gives the gaps back.
//! * **Sleeping memory is not touched.** Copies to or from an allocation
//!   that overlaps a sleeping granule are refused ([`check_awake`]).
//! * **The whole arena or a set, not both.** [`CudaArena::sleep`] is refused
//!   while a set sleeps, and a set's sleep while the arena sleeps.

use crate::arena::state::{Slot, State};
use crate::arena::{closed, granule, Arena, CudaArena};
use crate::result::err;
use crate::sleep::{free_host, offload, CopyStream, SleepReport};
use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle};
use memgov_backend::{lock, BackendError, BackendErrorKind};
use std::ffi::c_void;

/// Whether a granule of this arena sleeps with a set (the whole arena is
/// awake and some granule is `Asleep`).
pub(crate) fn set_asleep(st: &State) -> bool {
    !st.asleep
        && st
            .slots
            .iter()
            .any(|g| matches!(g.slot, Slot::Asleep { .. }))
}

/// When a block `[offset, offset + len)` retires while a set sleeps: carve
/// what it gave back inside sleeping granules out of the free list again.
pub(crate) fn keep_asleep_out(st: &mut State, offset: u64, len: u64, granule: u64) {
    if st.asleep {
        return;
    }
    for g in st.granules_of(offset, len) {
        if let slot @ Slot::Asleep { .. } = st.slots[g].slot {
            // `quarantine` keeps the slot as given and carves the granule's
            // free space; an `Asleep` slot changes no count.
            st.quarantine(g, slot, 0, granule);
        }
    }
}

/// Refuse a copy touching `[ptr, ptr + len)` while any granule under it
/// sleeps (nothing is mapped there).
pub(crate) fn check_awake(
    arena: &Arena,
    op: &'static str,
    ptr: CUdeviceptr,
    len: u64,
) -> Result<(), BackendError> {
    let st = lock(&arena.state);
    if st.asleep {
        return Err(crate::arena::asleep(op));
    }
    let offset = ptr - arena.base;
    let asleep = st
        .granules_of(offset, len.max(1))
        .any(|g| matches!(st.slots[g].slot, Slot::Asleep { .. }));
    if asleep {
        return Err(err(
            op,
            BackendErrorKind::InvalidArgument,
            format!(
                "the allocation at {ptr:#x} ({len} B) was put to sleep with a set \
                 (CudaArena::sleep_ranges): its memory is released; wake it first \
                 (CudaArena::wake_ranges)"
            ),
        ));
    }
    Ok(())
}

/// The free gaps of granule `g`: its range less the live blocks in it.
fn gaps(st: &State, g: usize, granule: u64) -> Vec<(u64, u64)> {
    let (start, end) = (g as u64 * granule, (g as u64 + 1) * granule);
    let mut taken: Vec<(u64, u64)> = st
        .blocks
        .iter()
        .map(|(&o, &l)| (o.max(start), (o + l).min(end)))
        .filter(|(s, e)| s < e)
        .collect();
    taken.sort_unstable();
    let mut out = Vec::new();
    let mut at = start;
    for (s, e) in taken {
        if s > at {
            out.push((at, s - at));
        }
        at = at.max(e);
    }
    if at < end {
        out.push((at, end - at));
    }
    out
}

impl CudaArena {
    /// The block offsets of `ptrs`, each a live allocation of this arena.
    fn blocks_of(
        st: &State,
        arena: &Arena,
        op: &'static str,
        ptrs: &[CUdeviceptr],
    ) -> Result<Vec<(u64, u64)>, BackendError> {
        ptrs.iter()
            .map(|&p| {
                let len = arena
                    .contains(p)
                    .then(|| st.blocks.get(&(p - arena.base)).copied())
                    .flatten()
                    .ok_or_else(|| {
                        err(
                            op,
                            BackendErrorKind::InvalidArgument,
                            format!(
                                "{p:#x} is not the address of a live allocation of this arena: \
                                 pass the device pointers of allocations it made \
                                 (CudaMemory::device_ptr)"
                            ),
                        )
                    })?;
                Ok((p - arena.base, len))
            })
            .collect()
    }

    /// Put the allocations at `ptrs` (device pointers of live allocations of
    /// this arena) to sleep: wait for every stream of the context, then
    /// unmap and release each granule that only they use, copying its
    /// contents to page-locked host memory first when `keep_contents` is
    /// set. Granules shared with other allocations stay mapped; the other
    /// allocations stay usable. Copies to and from the set are refused
    /// until [`wake_ranges`](Self::wake_ranges).
    ///
    /// ```no_run
    /// use memgov::cuda::{ArenaConfig, CudaConfig, CudaContext};
    /// use memgov::DeviceContext;
    /// let ctx = CudaContext::new(CudaConfig { arena: Some(ArenaConfig::default()), ..CudaConfig::default() })?;
    /// let s = ctx.create_stream()?;
    /// let weights = ctx.allocate(&s, 64 << 20)?;
    /// let kv = ctx.allocate(&s, 16 << 20)?;
    /// let arena = ctx.arena().expect("configured");
    /// arena.sleep_ranges(&[weights.device_ptr()], true)?; // kv stays usable
    /// ctx.write(&s, &kv, 0, &[1; 4096])?;
    /// arena.wake_ranges(&[weights.device_ptr()])?;        // same address, same bytes
    /// # Ok::<(), memgov::BackendError>(())
    /// ```
    pub fn sleep_ranges(
        &self,
        ptrs: &[CUdeviceptr],
        keep_contents: bool,
    ) -> Result<SleepReport, BackendError> {
        const OP: &str = "sleep_ranges";
        let (arena, s) = (&*self.arena, &*self.shared);
        s.check_usable(OP)?;
        let _call = crate::capture::gate().call(OP, true)?;
        let _current = s.make_current(OP)?;
        crate::arena::quiesce(s, OP, None)?;
        let taken: Vec<(usize, CUmemGenericAllocationHandle)> = {
            let mut st = lock(&arena.state);
            if st.closed {
                return Err(closed(OP));
            }
            if st.asleep {
                return Err(err(
                    OP,
                    BackendErrorKind::InvalidArgument,
                    "the whole arena is asleep; wake it first (CudaArena::wake)",
                ));
            }
            while st.slots.iter().any(|g| g.slot.in_transition()) {
                st = arena.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            let set = Self::blocks_of(&st, arena, OP, ptrs)?;
            // A granule sleeps when every block overlapping it is in the set.
            let mut in_set = vec![0u32; st.slots.len()];
            for &(o, l) in &set {
                for g in st.granules_of(o, l) {
                    in_set[g] += 1;
                }
            }
            let v: Vec<_> = (0..st.slots.len())
                .filter(|&g| in_set[g] > 0 && in_set[g] == st.slots[g].users)
                .filter_map(|g| match st.slots[g].slot {
                    Slot::Mapped(h) => Some((g, h)),
                    _ => None,
                })
                .collect();
            for &(g, _) in &v {
                st.slots[g].slot = Slot::Unmapping;
            }
            v
        };
        let copies = CopyStream::new(s, OP);
        let mut outcome: Vec<(usize, Slot)> = Vec::new();
        let mut first_err = None;
        let mut report = SleepReport {
            released: 0,
            offloaded: 0,
        };
        for (g, h) in taken {
            let at = arena.base + g as u64 * arena.granule;
            let mut host = 0usize;
            if keep_contents {
                if first_err.is_none() {
                    match offload(s, &copies, at, arena.granule) {
                        Ok(p) => host = p,
                        Err(e) => first_err = Some(e),
                    }
                }
                if host == 0 {
                    // Contents that could not be kept stay mapped.
                    outcome.push((g, Slot::Mapped(h)));
                    continue;
                }
            }
            match granule::unmap(s, arena, g, h, OP) {
                Ok(()) => {
                    report.released += arena.granule;
                    if host != 0 {
                        report.offloaded += arena.granule;
                    }
                    outcome.push((g, Slot::Asleep { host }));
                }
                Err(q) => {
                    free_host(s, host);
                    first_err.get_or_insert_with(|| {
                        err(
                            OP,
                            BackendErrorKind::Other,
                            format!(
                                "the driver refused to give back the granule at {at:#x}; it is \
                                 quarantined"
                            ),
                        )
                    });
                    outcome.push((g, q));
                }
            }
        }
        drop(copies);
        let mut st = lock(&arena.state);
        for (g, slot) in outcome {
            match slot {
                Slot::Mapped(_) => st.slots[g].slot = slot,
                Slot::Asleep { .. } => {
                    st.mapped -= arena.granule;
                    // Sets the slot and carves the granule's free space.
                    st.quarantine(g, slot, arena.base, arena.granule);
                }
                q => st.quarantine(g, q, arena.base, arena.granule),
            }
        }
        drop(st);
        arena.changed.notify_all();
        match first_err {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Wake the allocations at `ptrs`: map every sleeping granule under them
    /// again at its address and copy back the contents kept. Refused with
    /// `OutOfMemory` before any mapping when they do not fit the arena's
    /// limit; one that fails half-way unmaps what it mapped and leaves the
    /// set asleep. Returns the bytes mapped.
    pub fn wake_ranges(&self, ptrs: &[CUdeviceptr]) -> Result<u64, BackendError> {
        const OP: &str = "wake_ranges";
        let arena = &*self.arena;
        let chosen: Vec<usize> = {
            let st = lock(&arena.state);
            let set = Self::blocks_of(&st, arena, OP, ptrs)?;
            let mut gs: Vec<usize> = set
                .iter()
                .flat_map(|&(o, l)| st.granules_of(o, l))
                .filter(|&g| matches!(st.slots[g].slot, Slot::Asleep { .. }))
                .collect();
            gs.sort_unstable();
            gs.dedup();
            gs
        };
        self.wake_granules(OP, Some(&chosen))
    }

    /// Wake the granules `chosen` (every sleeping one when `None`) of a set
    /// asleep; see [`wake_ranges`](Self::wake_ranges).
    pub(crate) fn wake_granules(
        &self,
        op: &'static str,
        chosen: Option<&[usize]>,
    ) -> Result<u64, BackendError> {
        let (arena, s) = (&*self.arena, &*self.shared);
        s.check_usable(op)?;
        let _call = crate::capture::gate().call(op, true)?;
        let _current = s.make_current(op)?;
        let sleeping: Vec<(usize, usize)> = {
            let mut st = lock(&arena.state);
            if st.closed {
                return Err(closed(op));
            }
            if st.asleep {
                // Its granules' free space was never carved: only the
                // whole-arena wake may map them.
                return Err(err(
                    op,
                    BackendErrorKind::InvalidArgument,
                    "the whole arena is asleep (CudaArena::sleep); wake it whole (CudaArena::wake)",
                ));
            }
            while st.slots.iter().any(|g| g.slot.in_transition()) {
                st = arena.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            let all: Vec<usize> = (0..st.slots.len()).collect();
            let v: Vec<_> = chosen
                .unwrap_or(&all)
                .iter()
                .filter_map(|&g| match st.slots[g].slot {
                    Slot::Asleep { host } => Some((g, host)),
                    _ => None,
                })
                .collect();
            let needed = v.len() as u64 * arena.granule;
            if st.mapped + st.mapping + needed > arena.limit() {
                return Err(err(
                    op,
                    BackendErrorKind::OutOfMemory,
                    format!(
                        "waking needs {needed} B mapped, but the arena holds {} B of its {} B \
                         limit; nothing was mapped and the set stays asleep (free memory or \
                         raise the limit with CudaArena::set_limit)",
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
        let mut lost: Vec<(usize, Slot)> = Vec::new();
        for &(g, host) in &sleeping {
            match granule::map(s, arena, g, op) {
                Ok(h) => mapped.push((g, host, h)),
                Err((e, leftover)) => {
                    if let Some(q) = leftover {
                        lost.push((g, q));
                    }
                    failure = Some(e);
                    break;
                }
            }
        }
        if failure.is_none() {
            let restored = CopyStream::new(s, op).and_then(|copies| {
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
                        s.checked(op, "cuMemcpyHtoDAsync_v2", r)?;
                    }
                }
                copies.sync(op)
            });
            if let Err(e) = restored {
                failure = Some(e);
            }
        }
        let Some(e) = failure else {
            let mut st = lock(&arena.state);
            st.mapping -= sleeping.len() as u64 * arena.granule;
            let mut hosts = Vec::new();
            for (g, host, h) in mapped {
                hosts.push(host);
                st.slots[g].slot = Slot::Mapped(h);
                st.mapped += arena.granule;
                // The free space carved while it slept comes back.
                for (o, l) in gaps(&st, g, arena.granule) {
                    st.put_range(o, l);
                }
            }
            drop(st);
            arena.changed.notify_all();
            hosts.into_iter().for_each(|host| free_host(s, host));
            return Ok(sleeping.len() as u64 * arena.granule);
        };
        // Undo what this wake mapped, one granule at a time.
        let mut undone: Vec<(usize, Result<(), Slot>)> = Vec::new();
        for &(g, _, h) in &mapped {
            undone.push((g, granule::unmap(s, arena, g, h, op)));
        }
        let mut st = lock(&arena.state);
        st.mapping -= sleeping.len() as u64 * arena.granule;
        for &(g, host) in &sleeping {
            st.slots[g].slot = Slot::Asleep { host };
        }
        let mut hosts = Vec::new();
        for (g, q) in lost.into_iter().chain(
            undone
                .into_iter()
                .filter_map(|(g, r)| r.err().map(|q| (g, q))),
        ) {
            // Its contents cannot return: quarantined, counted mapped until
            // the quarantine says otherwise.
            if let Slot::Asleep { host } = st.slots[g].slot {
                hosts.push(host);
            }
            st.mapped += arena.granule;
            st.quarantine(g, q, arena.base, arena.granule);
        }
        drop(st);
        arena.changed.notify_all();
        hosts.into_iter().for_each(|host| free_host(s, host));
        Err(e)
    }
}
