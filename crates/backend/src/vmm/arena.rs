//! [`Arena`]: the books of one reservation and the transactions on them
//! (allocate, retire, trim, teardown), each driver step made through a
//! [`GranuleDriver`].

use super::state::{ArenaSnapshot, Slot, State};
use super::{asleep, closed, quarantine_error, GranuleDriver};
use crate::{lock, BackendError, BackendErrorKind};
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

/// Device allocations are aligned to this within the arena, as
/// `cuMemAlloc` and `hipMalloc` align theirs.
pub const ALIGN: u64 = 256;

/// One context's arena: a reservation of `size` bytes at `base`, in
/// granules of `granule` bytes. Lives in an `Arc` shared with the backend's
/// stream callbacks, which touch only [`retire`](Self::retire).
pub struct Arena<H> {
    /// The reservation's first device address.
    pub base: u64,
    /// The reservation's length, whole granules.
    pub size: u64,
    /// The granule size: the driver's recommended granularity.
    pub granule: u64,
    limit: AtomicU64,
    /// The books.
    pub state: Mutex<State<H>>,
    /// Signalled when a granule leaves a transition or a range is freed.
    pub changed: Condvar,
    /// The call a caller makes to wake the arena, for errors.
    wake_hint: &'static str,
}

impl<H: Copy + Eq + Debug> Arena<H> {
    /// The books of a reservation just made: `size` bytes at `base` in
    /// granules of `granule` (a power of two dividing `size`), at most
    /// `limit` bytes mapped (rounded down to whole granules). `wake_hint`
    /// names the call that wakes the arena (`"CudaArena::wake"`).
    pub fn new(base: u64, size: u64, granule: u64, limit: u64, wake_hint: &'static str) -> Self {
        debug_assert!(granule.is_power_of_two() && size % granule == 0);
        Self {
            base,
            size,
            granule,
            limit: (limit / granule * granule).into(),
            state: Mutex::new(State::new(size, granule)),
            changed: Condvar::new(),
            wake_hint,
        }
    }

    /// The most bytes the arena maps.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Change the limit (rounded down to whole granules). Lowering it below
    /// what is mapped unmaps nothing: later maps and wakes are refused until
    /// enough is given back.
    pub fn set_limit(&self, bytes: u64) {
        let limit = bytes / self.granule * self.granule;
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Whether `ptr` lies in the reservation.
    pub fn contains(&self, ptr: u64) -> bool {
        ptr >= self.base && ptr - self.base < self.size
    }

    /// Whether the arena sleeps.
    pub fn is_asleep(&self) -> bool {
        lock(&self.state).asleep
    }

    /// What the arena holds.
    pub fn snapshot(&self) -> ArenaSnapshot {
        lock(&self.state).snapshot(self.base, self.size, self.granule)
    }

    /// The error an operation refused while the arena sleeps returns.
    pub fn asleep_error(&self, backend: &'static str, op: &'static str) -> BackendError {
        asleep(backend, op, self.wake_hint)
    }

    /// Take `bytes` of the arena, mapping the granules it needs; returns its
    /// device address. The arena's device must be current on the calling
    /// thread.
    pub fn allocate<D: GranuleDriver<Handle = H>>(
        &self,
        d: &D,
        bytes: u64,
    ) -> Result<u64, BackendError> {
        let backend = d.backend();
        let err = |kind, msg: String| BackendError::new(backend, "allocate", kind, msg);
        let len = bytes.checked_next_multiple_of(ALIGN).unwrap_or(u64::MAX);
        let mut trimmed = false;
        let (offset, mine) = loop {
            let mut st = lock(&self.state);
            if st.closed {
                return Err(closed(backend, "allocate"));
            }
            if st.asleep {
                return Err(self.asleep_error(backend, "allocate"));
            }
            let Some(offset) = st.take_range(len) else {
                return Err(err(
                    BackendErrorKind::OutOfMemory,
                    format!(
                        "the arena's {} B reservation has no free range of {len} B ({} B in use); \
                         release memory or reserve more with ArenaConfig::reserve_bytes",
                        self.size, st.in_use
                    ),
                ));
            };
            let granules = st.granules_of(offset, len);
            if granules.clone().any(|g| st.slots[g].slot.in_transition()) {
                st.put_range(offset, len);
                drop(self.changed.wait(st));
                continue;
            }
            let need: Vec<usize> = granules
                .clone()
                .filter(|&g| matches!(st.slots[g].slot, Slot::Unmapped))
                .collect();
            let adding = need.len() as u64 * self.granule;
            if st.mapped + st.mapping + adding > self.limit() {
                st.put_range(offset, len);
                let cached = st.cached();
                drop(st);
                if !trimmed && cached > 0 {
                    trimmed = true;
                    self.trim(d, "allocate")?;
                    continue;
                }
                let st = lock(&self.state);
                return Err(err(
                    BackendErrorKind::OutOfMemory,
                    format!(
                        "{bytes} B needs {adding} B more mapped, but the arena holds {} B of its \
                         {} B limit ({} B in use); release memory or raise ArenaConfig::limit_bytes",
                        st.mapped + st.mapping,
                        self.limit(),
                        st.in_use
                    ),
                ));
            }
            for &g in &need {
                st.slots[g].slot = Slot::Mapping;
            }
            st.mapping += adding;
            for g in granules {
                st.slots[g].users += 1;
            }
            st.in_use += len;
            st.blocks.insert(offset, len);
            break (offset, need);
        };
        // Map each granule this call owns; on failure undo them one by one.
        let mut done: Vec<(usize, H)> = Vec::new();
        let mut failure = None;
        for &g in &mine {
            match d.map(g, "allocate") {
                Ok(h) => done.push((g, h)),
                Err(e) => {
                    failure = Some((g, e));
                    break;
                }
            }
        }
        let Some((failed, (e, leftover))) = failure else {
            let mut st = lock(&self.state);
            for (g, h) in done {
                st.slots[g].slot = Slot::Mapped(h);
                st.mapping -= self.granule;
                st.mapped += self.granule;
            }
            drop(st);
            self.changed.notify_all();
            return Ok(self.base + offset);
        };
        let mut undone: Vec<(usize, Result<(), Slot<H>>)> = done
            .into_iter()
            .map(|(g, h)| (g, d.unmap(g, h, "allocate")))
            .collect();
        undone.push((failed, leftover.map_or(Ok(()), Err)));
        let mut st = lock(&self.state);
        st.blocks.remove(&offset);
        st.in_use -= len;
        for g in st.granules_of(offset, len) {
            st.slots[g].users -= 1;
        }
        for &g in &mine {
            st.mapping -= self.granule;
            st.slots[g].slot = Slot::Unmapped;
        }
        // Back to the free list first: a quarantine carves its granule out.
        st.put_range(offset, len);
        for (g, r) in undone {
            if let Err(q) = r {
                // Counted as mapped until the quarantine says otherwise.
                st.mapped += self.granule;
                st.quarantine(g, q, self.base, self.granule);
            }
        }
        drop(st);
        self.changed.notify_all();
        Err(e)
    }

    /// Give back the allocation at `ptr`: its range returns to the free list
    /// and its granules lose a user. Called once the stream passed its last
    /// use (from a stream callback: no driver call here).
    pub fn retire(&self, ptr: u64) {
        let offset = ptr - self.base;
        let mut st = lock(&self.state);
        if let Some(len) = st.blocks.remove(&offset) {
            for g in st.granules_of(offset, len) {
                st.slots[g].users -= 1;
            }
            st.in_use -= len;
            st.put_range(offset, len);
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Unmap and release every cached granule (mapped, no users). Returns
    /// the bytes given back; granules the driver refused to give back are
    /// quarantined and named in the error.
    pub fn trim<D: GranuleDriver<Handle = H>>(
        &self,
        d: &D,
        op: &'static str,
    ) -> Result<u64, BackendError> {
        // Current before any granule is marked: a failure here leaves none
        // in transition.
        let _current = d.make_current(op)?;
        let victims: Vec<(usize, H)> = {
            let mut st = lock(&self.state);
            if st.closed {
                return Err(closed(d.backend(), op));
            }
            let v: Vec<_> = (0..st.slots.len())
                .filter_map(|g| match st.slots[g].slot {
                    Slot::Mapped(h) if st.slots[g].users == 0 => Some((g, h)),
                    _ => None,
                })
                .collect();
            for &(g, _) in &v {
                st.slots[g].slot = Slot::Unmapping;
            }
            v
        };
        if victims.is_empty() {
            return Ok(0);
        }
        let results: Vec<(usize, Result<(), Slot<H>>)> = victims
            .into_iter()
            .map(|(g, h)| (g, d.unmap(g, h, op)))
            .collect();
        let mut st = lock(&self.state);
        let mut freed = 0;
        let mut refused = Vec::new();
        for (g, r) in results {
            match r {
                Ok(()) => {
                    st.slots[g].slot = Slot::Unmapped;
                    st.mapped -= self.granule;
                    freed += self.granule;
                }
                Err(q) => {
                    refused.push(self.base + g as u64 * self.granule);
                    st.quarantine(g, q, self.base, self.granule);
                }
            }
        }
        drop(st);
        self.changed.notify_all();
        if refused.is_empty() {
            Ok(freed)
        } else {
            Err(quarantine_error(
                d.backend(),
                op,
                &refused,
                self.granule,
                freed,
            ))
        }
    }

    /// Give every granule back at teardown: every mapped granule (in use or
    /// not: the caller synchronized every stream first), every handle left
    /// unreleased, the host memory of sleeping contents. `Ok` means nothing
    /// is mapped any more and the caller may free the reservation; a
    /// granule whose unmap is refused keeps it alive (freeing it under a
    /// mapping is undefined), and the error says so. The arena is closed:
    /// nothing maps or unmaps after.
    pub fn teardown<D: GranuleDriver<Handle = H>>(&self, d: &D) -> Result<(), BackendError> {
        let held: Vec<(usize, Slot<H>)> = {
            let mut st = lock(&self.state);
            st.closed = true;
            // A trim, sleep or wake under way finishes its granules first.
            while st.slots.iter().any(|g| g.slot.in_transition()) {
                st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            st.blocks.clear();
            (0..st.slots.len())
                .filter_map(|g| {
                    let slot = std::mem::replace(&mut st.slots[g].slot, Slot::Unmapped);
                    (!matches!(slot, Slot::Unmapped)).then_some((g, slot))
                })
                .collect()
        };
        let _current = d.make_current("teardown")?;
        let mut refused = Vec::new();
        for (g, slot) in held {
            let r = match slot {
                Slot::Mapped(h)
                | Slot::Quarantined {
                    handle: Some(h),
                    mapped: true,
                } => d.unmap(g, h, "teardown"),
                Slot::Quarantined {
                    handle: Some(h),
                    mapped: false,
                } => d.release(h, "teardown").map_err(|_| Slot::Unmapped),
                Slot::Asleep { host } => {
                    if host != 0 {
                        d.free_host(host, "teardown");
                    }
                    Ok(())
                }
                _ => Ok(()),
            };
            if r.is_err() {
                refused.push(self.base + g as u64 * self.granule);
            }
        }
        if refused.is_empty() {
            Ok(())
        } else {
            Err(quarantine_error(
                d.backend(),
                "teardown",
                &refused,
                self.granule,
                0,
            ))
        }
    }
}
