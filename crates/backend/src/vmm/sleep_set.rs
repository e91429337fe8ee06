//! Sleep and wake of a chosen set of an arena's allocations (the weights,
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
//!   `Asleep` in [`Arena::sleep_ranges`] and `Asleep` → `Mapped` in
//!   [`Arena::wake_ranges`] (or [`Arena::wake`]), under the arena's lock
//!   and marked in transition between, so no handle is released twice and
//!   none is forgotten; a second sleep of the same set releases nothing;
//!   teardown frees what is still asleep.
//! * **No allocation lands in a sleeping granule.** Its free space is
//!   carved out of the free list while it sleeps and until the wake that
//!   maps it commits (it is held out, `Granule::held_out`), and a block
//!   that retires meanwhile, during that wake too, is carved out again
//!   ([`State::keep_out`], called by [`Arena::retire`]); the wake's commit
//!   gives the gaps back once, and a wake that fails leaves them out.
//! * **Only what is used is mapped again.** A wake maps the sleeping
//!   granules that live allocations overlap; one whose allocations were all
//!   released while it slept is dropped (its host copy freed, its space
//!   free again) instead of mapped.
//! * **Sleeping memory is not touched.** Copies to or from an allocation
//!   that overlaps a sleeping granule, or a granule quarantined unmapped
//!   (its memory is gone), are refused ([`Arena::check_awake`]).
//! * **The whole arena or a set, not both.** [`Arena::sleep`] is refused
//!   while a set sleeps, and a set's sleep or wake while the arena sleeps
//!   (the whole sleep never carved its granules' free space); each checks
//!   after waiting for the granules in transition, so a sleep that finished
//!   meanwhile is seen.

use super::state::{Slot, State};
use super::{closed, Arena, SleepDriver};
use crate::capability::SleepReport;
use crate::{lock, BackendError, BackendErrorKind};
use std::fmt::Debug;

impl<H: Copy> State<H> {
    /// Whether a set sleeps: the whole arena is awake and some granule is
    /// `Asleep`.
    pub fn set_asleep(&self) -> bool {
        !self.asleep
            && self
                .slots
                .iter()
                .any(|g| matches!(g.slot, Slot::Asleep { .. }))
    }

    /// The free gaps of granule `g`: its range less the live blocks in it.
    fn gaps(&self, g: usize) -> Vec<(u64, u64)> {
        let granule = self.granule();
        let (start, end) = (g as u64 * granule, (g as u64 + 1) * granule);
        let mut taken: Vec<(u64, u64)> = self
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
}

impl<H: Copy + Eq + Debug> Arena<H> {
    /// The error a set's sleep or wake returns while the whole arena sleeps.
    fn whole_asleep(&self, backend: &'static str, op: &'static str) -> BackendError {
        let h = self.handle;
        BackendError::new(
            backend,
            op,
            BackendErrorKind::InvalidArgument,
            format!(
                "the whole arena is asleep ({h}::sleep); wake it whole first ({h}::wake): a set \
                 is slept and woken only while the arena is awake"
            ),
        )
    }

    /// The `(offset, len)` of each of `ptrs`, each the address of a live
    /// allocation of this arena.
    fn blocks_of(
        &self,
        st: &State<H>,
        backend: &'static str,
        op: &'static str,
        ptrs: &[u64],
    ) -> Result<Vec<(u64, u64)>, BackendError> {
        ptrs.iter()
            .map(|&p| {
                let len = self
                    .contains(p)
                    .then(|| st.blocks.get(&(p - self.base)).copied())
                    .flatten()
                    .ok_or_else(|| {
                        BackendError::new(
                            backend,
                            op,
                            BackendErrorKind::InvalidArgument,
                            format!(
                                "{p:#x} is not the address of a live allocation of this arena: \
                                 pass the device addresses of allocations it made"
                            ),
                        )
                    })?;
                Ok((p - self.base, len))
            })
            .collect()
    }

    /// Refuse a copy touching `[ptr, ptr + len)` while
    /// the whole arena sleeps or a granule under it sleeps with a set:
    /// nothing is mapped there.
    pub fn check_awake(
        &self,
        backend: &'static str,
        op: &'static str,
        ptr: u64,
        len: u64,
    ) -> Result<(), BackendError> {
        let st = lock(&self.state);
        if st.asleep {
            return Err(self.asleep_error(backend, op));
        }
        // Memory outside the reservation (another context's) is the
        // caller's to refuse.
        if !self.contains(ptr) {
            return Ok(());
        }
        let under = st.granules_of(ptr - self.base, len.max(1));
        let slot_of = |g: usize| st.slots.get(g).map(|s| s.slot);
        let h = self.handle;
        if under
            .clone()
            .any(|g| matches!(slot_of(g), Some(Slot::Asleep { .. })))
        {
            return Err(BackendError::new(
                backend,
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "the allocation at {ptr:#x} ({len} B) was put to sleep with a set \
                     ({h}::sleep_ranges): its memory is released; wake it first \
                     ({h}::wake_ranges)"
                ),
            ));
        }
        if let Some(g) = under
            .clone()
            .find(|&g| matches!(slot_of(g), Some(Slot::Quarantined { mapped: false, .. })))
        {
            let at = self.base + g as u64 * self.granule;
            return Err(BackendError::new(
                backend,
                op,
                BackendErrorKind::Other,
                format!(
                    "the allocation at {ptr:#x} ({len} B) lies on the granule at {at:#x}, which \
                     was unmapped and then quarantined when the driver refused to release it \
                     (listed in {h}::snapshot): its memory is gone; release the allocation and \
                     allocate anew"
                ),
            ));
        }
        Ok(())
    }

    /// Put the allocations at `ptrs` (device addresses of live allocations
    /// of this arena) to sleep: wait for every stream of the context, then
    /// unmap and release each granule that only they use, copying its
    /// contents to page-locked host memory first when `keep_contents` is
    /// set. Granules shared with other allocations stay mapped; the other
    /// allocations stay usable. A granule already asleep is not released
    /// again.
    pub fn sleep_ranges<D: SleepDriver<Handle = H>>(
        &self,
        d: &D,
        ptrs: &[u64],
        keep_contents: bool,
    ) -> Result<SleepReport, BackendError> {
        const OP: &str = "sleep_ranges";
        let backend = d.backend();
        let _current = d.make_current(OP)?;
        d.quiesce(OP)?;
        let taken: Vec<(usize, H)> = {
            // Checked after the wait: a whole sleep may finish meanwhile.
            let mut st = self.wait_settled(lock(&self.state));
            if st.closed {
                return Err(closed(backend, OP));
            }
            if st.asleep {
                return Err(self.whole_asleep(backend, OP));
            }
            let set = self.blocks_of(&st, backend, OP, ptrs)?;
            // A granule sleeps when every block overlapping it is in the set
            // (a block named twice counts once).
            let mut set = set;
            set.sort_unstable();
            set.dedup();
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
        let taken = taken.into_iter().map(|(g, h)| (g, h, true)).collect();
        let (outcome, report, first_err) = self.release_granules(d, OP, taken, keep_contents);
        let mut st = lock(&self.state);
        for (g, slot) in outcome {
            match slot {
                Slot::Mapped(_) => st.slots[g].slot = slot,
                Slot::Asleep { .. } => {
                    st.mapped -= self.granule;
                    st.slots[g].slot = slot;
                    st.slots[g].held_out = true;
                    st.carve_granule(g);
                }
                q => st.quarantine(g, q, self.base, self.granule),
            }
        }
        drop(st);
        self.changed.notify_all();
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
    pub fn wake_ranges<D: SleepDriver<Handle = H>>(
        &self,
        d: &D,
        ptrs: &[u64],
    ) -> Result<u64, BackendError> {
        const OP: &str = "wake_ranges";
        let chosen: Vec<usize> = {
            let st = lock(&self.state);
            let set = self.blocks_of(&st, d.backend(), OP, ptrs)?;
            let mut gs: Vec<usize> = set
                .iter()
                .flat_map(|&(o, l)| st.granules_of(o, l))
                .filter(|&g| matches!(st.slots[g].slot, Slot::Asleep { .. }))
                .collect();
            gs.sort_unstable();
            gs.dedup();
            gs
        };
        self.wake_granules(d, OP, Some(&chosen), false)
    }

    /// Wake the granules `chosen` (every sleeping one when `None`): of the
    /// whole arena asleep when `whole` (which then is awake again; nothing
    /// to do when it does not sleep), else of a set asleep (whose carved
    /// free space comes back). Only the granules live allocations overlap
    /// are mapped and counted against the limit; one whose allocations were
    /// all released while it slept is dropped (its host copy freed, its
    /// space free again). See [`wake_ranges`](Self::wake_ranges) and
    /// [`wake`](Self::wake).
    pub(super) fn wake_granules<D: SleepDriver<Handle = H>>(
        &self,
        d: &D,
        op: &'static str,
        chosen: Option<&[usize]>,
        whole: bool,
    ) -> Result<u64, BackendError> {
        let backend = d.backend();
        let _current = d.make_current(op)?;
        let (sleeping, dropped) = {
            // Checked after the wait: a sleep or wake may finish meanwhile.
            let mut st = self.wait_settled(lock(&self.state));
            if st.closed {
                return Err(closed(backend, op));
            }
            if whole && !st.asleep {
                return Ok(0);
            }
            if !whole && st.asleep {
                // Its granules' free space was never carved: only the
                // whole-arena wake may map them.
                return Err(self.whole_asleep(backend, op));
            }
            let all: Vec<usize> = (0..st.slots.len()).collect();
            // (granule, host copy) of each sleeping granule, used or not.
            let (v, unused): (Vec<_>, Vec<_>) = chosen
                .unwrap_or(&all)
                .iter()
                .filter_map(|&g| match st.slots[g].slot {
                    Slot::Asleep { host } => Some((g, host)),
                    _ => None,
                })
                .partition(|&(g, _)| st.slots[g].users > 0);
            let needed = v.len() as u64 * self.granule;
            if st.held() + needed > self.limit() {
                return Err(BackendError::new(
                    backend,
                    op,
                    BackendErrorKind::OutOfMemory,
                    format!(
                        "waking needs {needed} B mapped, but the arena holds {} B of its {} B \
                         limit; nothing was mapped and the {} stays asleep (free memory or \
                         raise the limit: {}::set_limit, ArenaConfig::limit_bytes)",
                        st.held(),
                        self.limit(),
                        if whole { "arena" } else { "set" },
                        self.handle
                    ),
                ));
            }
            // Nobody uses these any more: dropped, not mapped.
            for &(g, _) in &unused {
                st.slots[g].slot = Slot::Unmapped;
                if std::mem::take(&mut st.slots[g].held_out) {
                    for (o, l) in st.gaps(g) {
                        st.put_range(o, l);
                    }
                }
            }
            for &(g, _) in &v {
                st.slots[g].slot = Slot::Mapping;
            }
            st.mapping += needed;
            (v, unused)
        };
        if !dropped.is_empty() {
            self.changed.notify_all();
        }
        // Their copies are freed and their charge given back.
        self.free_copies(d, dropped.into_iter().map(|(_, h)| h).collect(), op);
        let mut mapped: Vec<(usize, usize, H)> = Vec::new();
        let mut failure = None;
        let mut lost: Vec<(usize, Slot<H>)> = Vec::new();
        for &(g, host) in &sleeping {
            match d.map(g, op) {
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
            for &(g, host, _) in &mapped {
                if host != 0 {
                    let at = self.base + g as u64 * self.granule;
                    if let Err(e) = d.restore(at, host, self.granule) {
                        failure = Some(e);
                        break;
                    }
                }
            }
        }
        let Some(e) = failure else {
            let mut st = lock(&self.state);
            st.mapping -= sleeping.len() as u64 * self.granule;
            let mut hosts = Vec::new();
            for (g, host, h) in mapped {
                hosts.push(host);
                st.slots[g].slot = Slot::Mapped(h);
                st.mapped += self.granule;
                if std::mem::take(&mut st.slots[g].held_out) {
                    // The free space carved while it slept (including that
                    // of blocks retired during this wake) comes back, once.
                    for (o, l) in st.gaps(g) {
                        st.put_range(o, l);
                    }
                }
            }
            if whole {
                st.asleep = false;
            }
            drop(st);
            self.changed.notify_all();
            self.free_copies(d, hosts, op);
            return Ok(sleeping.len() as u64 * self.granule);
        };
        // Undo what this wake mapped, one granule at a time.
        let undone: Vec<(usize, Result<(), Slot<H>>)> = mapped
            .iter()
            .map(|&(g, _, h)| (g, d.unmap(g, h, op)))
            .collect();
        let mut st = lock(&self.state);
        st.mapping -= sleeping.len() as u64 * self.granule;
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
            st.mapped += self.granule;
            st.quarantine(g, q, self.base, self.granule);
        }
        drop(st);
        self.changed.notify_all();
        self.free_copies(d, hosts, op);
        Err(e)
    }
}
