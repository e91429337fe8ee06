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
    /// The name of the backend's arena handle, for the way out errors name
    /// (`"CudaArena"`: `CudaArena::wake`).
    pub(super) handle: &'static str,
}

impl<H: Copy + Eq + Debug> Arena<H> {
    /// The books of a reservation just made: `size` bytes at `base` in
    /// granules of `granule` (a power of two dividing `size`), at most
    /// `limit` bytes mapped (rounded down to whole granules). `handle`
    /// names the backend's arena handle, whose methods errors point to
    /// (`"CudaArena"`: `CudaArena::wake`).
    pub fn new(base: u64, size: u64, granule: u64, limit: u64, handle: &'static str) -> Self {
        debug_assert!(granule.is_power_of_two() && size % granule == 0);
        Self {
            base,
            size,
            granule,
            limit: (limit / granule * granule).into(),
            state: Mutex::new(State::new(size, granule)),
            changed: Condvar::new(),
            handle,
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

    /// Wait (the lock released) until a granule leaves its transition or a
    /// range is freed; counted in `State::waiting` while parked.
    pub(super) fn wait_changed<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, State<H>>,
    ) -> std::sync::MutexGuard<'a, State<H>> {
        st.waiting += 1;
        let mut st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        st.waiting -= 1;
        st
    }

    /// Wait until no granule is in transition.
    pub(super) fn wait_settled<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, State<H>>,
    ) -> std::sync::MutexGuard<'a, State<H>> {
        while st.slots.iter().any(|g| g.slot.in_transition()) {
            st = self.wait_changed(st);
        }
        st
    }

    /// The error an operation refused while the arena sleeps returns.
    pub fn asleep_error(&self, backend: &'static str, op: &'static str) -> BackendError {
        asleep(backend, op, &format!("{}::wake", self.handle))
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
                // The granule's owner may be waiting at the gate for this
                // thread's own capture to end: refused, not waited on.
                drop(st);
                d.refuse_own_capture("allocate")?;
                let st = lock(&self.state);
                if st.slots[granules.clone()]
                    .iter()
                    .any(|g| g.slot.in_transition())
                {
                    drop(self.wait_changed(st));
                }
                continue;
            }
            let need: Vec<usize> = granules
                .clone()
                .filter(|&g| matches!(st.slots[g].slot, Slot::Unmapped))
                .collect();
            let adding = need.len() as u64 * self.granule;
            if st.held() + adding > self.limit() {
                st.put_range(offset, len);
                let cached = st.cached();
                drop(st);
                if !trimmed && cached > 0 {
                    trimmed = true;
                    // Unmapping would invalidate this thread's own capture.
                    d.refuse_own_capture("allocate")?;
                    self.trim(d, "allocate")?;
                    continue;
                }
                let st = lock(&self.state);
                return Err(err(
                    BackendErrorKind::OutOfMemory,
                    format!(
                        "{bytes} B needs {adding} B more mapped, but the arena holds {} B of its \
                         {} B limit ({} B in use); release memory or raise ArenaConfig::limit_bytes",
                        st.held(),
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
            // Inside a granule that sleeps with a set or is quarantined, the
            // space stays out.
            st.keep_out(offset, len);
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
        // Unmapping would invalidate the calling thread's own capture.
        d.refuse_own_capture(op)?;
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
        // Current before the slots are taken: a failure here leaves every
        // handle in the books for a later teardown.
        let _current = d.make_current("teardown")?;
        let held: Vec<(usize, Slot<H>)> = {
            let mut st = lock(&self.state);
            st.closed = true;
            // A trim, sleep or wake under way finishes its granules first.
            let mut st = self.wait_settled(st);
            st.blocks.clear();
            (0..st.slots.len())
                .filter_map(|g| {
                    let slot = std::mem::replace(&mut st.slots[g].slot, Slot::Unmapped);
                    (!matches!(slot, Slot::Unmapped)).then_some((g, slot))
                })
                .collect()
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmm::{MapError, SleepDriver};
    use std::cell::{Cell, RefCell};

    const G: u64 = 2 << 20;

    /// A driver whose handles are numbers, which fails the `fail_map`th
    /// map (counting from 1) and refuses unmaps listed in `refuse_unmap`.
    #[derive(Default)]
    struct Fake {
        maps: Cell<u32>,
        fail_map: u32,
        refuse_unmap: RefCell<Vec<usize>>,
        mapped: RefCell<Vec<usize>>,
        host: RefCell<Vec<(u64, usize)>>,
    }

    impl GranuleDriver for Fake {
        type Handle = u64;
        type Current = ();

        fn backend(&self) -> &'static str {
            "fake"
        }
        fn make_current(&self, _: &'static str) -> Result<(), BackendError> {
            Ok(())
        }
        fn map(&self, g: usize, op: &'static str) -> Result<u64, MapError<u64>> {
            self.maps.set(self.maps.get() + 1);
            if self.maps.get() == self.fail_map {
                let e = BackendError::new("fake", op, BackendErrorKind::OutOfMemory, "planted");
                return Err((e, None));
            }
            self.mapped.borrow_mut().push(g);
            Ok(100 + g as u64)
        }
        fn unmap(&self, g: usize, h: u64, _: &'static str) -> Result<(), Slot<u64>> {
            assert_eq!(h, 100 + g as u64, "the handle mapped at that granule");
            let mut refuse = self.refuse_unmap.borrow_mut();
            if let Some(i) = refuse.iter().position(|&r| r == g) {
                refuse.remove(i);
                return Err(Slot::Quarantined {
                    handle: Some(h),
                    mapped: true,
                });
            }
            let mut mapped = self.mapped.borrow_mut();
            let i = mapped
                .iter()
                .position(|&m| m == g)
                .expect("unmap of a mapped granule");
            mapped.remove(i);
            Ok(())
        }
        fn release(&self, _: u64, _: &'static str) -> Result<(), BackendError> {
            Ok(())
        }
        fn free_host(&self, host: usize, _: &'static str) {
            self.host.borrow_mut().retain(|&(_, h)| h != host);
        }
    }

    impl SleepDriver for Fake {
        fn quiesce(&self, _: &'static str) -> Result<(), BackendError> {
            Ok(())
        }
        fn offload(&self, at: u64, _: u64) -> Result<usize, BackendError> {
            let host = 0x1000 + self.host.borrow().len();
            self.host.borrow_mut().push((at, host));
            Ok(host)
        }
        fn restore(&self, at: u64, host: usize, _: u64) -> Result<(), BackendError> {
            assert!(
                self.host.borrow().contains(&(at, host)),
                "restored where it was"
            );
            Ok(())
        }
    }

    #[test]
    fn a_map_failing_half_way_undoes_the_granules_it_mapped() {
        let d = Fake {
            fail_map: 3,
            ..Fake::default()
        };
        let a = Arena::<u64>::new(0x10_0000_0000, 16 * G, G, u64::MAX, "Fake");
        let e = a.allocate(&d, 4 * G).expect_err("the third granule fails");
        assert_eq!(e.kind, BackendErrorKind::OutOfMemory);
        assert!(
            d.mapped.borrow().is_empty(),
            "granules 0 and 1 unmapped again"
        );
        let s = a.snapshot();
        assert_eq!((s.mapped, s.in_use, s.blocks), (0, 0, 0));
        // The whole range is free again: the same allocation lands at the base.
        assert_eq!(a.allocate(&d, 4 * G).expect("no failure now"), a.base);
    }

    #[test]
    fn the_limit_trims_cached_granules_then_refuses_with_the_numbers() {
        let d = Fake::default();
        let a = Arena::<u64>::new(0x10_0000_0000, 16 * G, G, 4 * G, "Fake");
        let p = a.allocate(&d, 2 * G).expect("granules 0 and 1");
        let q = a.allocate(&d, G).expect("granule 2");
        a.retire(p);
        assert_eq!((a.snapshot().cached, a.snapshot().mapped), (2 * G, 3 * G));
        // Three granules past granule 2: 3 + 3 mapped would pass the limit
        // of 4, so the two cached ones are given back first.
        let r = a.allocate(&d, 3 * G).expect("trimmed, then fits");
        assert_eq!(r, a.base + 3 * G);
        assert_eq!(*d.mapped.borrow(), vec![2, 3, 4, 5]);
        let e = a
            .allocate(&d, G)
            .expect_err("over the limit, nothing cached");
        assert_eq!(e.kind, BackendErrorKind::OutOfMemory);
        assert!(
            e.message.contains("holds 8388608 B of its 8388608 B limit"),
            "{e}"
        );
        a.retire(q);
        a.retire(r);
        assert_eq!(a.trim(&d, "trim").expect("trim"), 4 * G);
        assert!(d.mapped.borrow().is_empty());
    }

    #[test]
    fn a_refused_unmap_is_quarantined_and_never_handed_out_again() {
        let d = Fake::default();
        let a = Arena::<u64>::new(0x10_0000_0000, 4 * G, G, u64::MAX, "Fake");
        let p = a.allocate(&d, G).expect("one granule");
        a.retire(p);
        d.refuse_unmap.borrow_mut().push(0);
        let e = a.trim(&d, "trim").expect_err("refused");
        assert!(e.message.contains("quarantined"), "{e}");
        let s = a.snapshot();
        assert_eq!(s.quarantined.len(), 1);
        assert_eq!(s.quarantined[0].address, a.base);
        for _ in 0..3 {
            let q = a.allocate(&d, G).expect("another granule");
            assert_ne!(q, a.base, "never the quarantined granule");
            a.retire(q);
        }
        // Teardown retries it (the refusal was once).
        a.teardown(&d).expect("teardown");
        assert!(d.mapped.borrow().is_empty());
    }

    #[test]
    fn sleep_and_wake_keep_each_granule_s_state_and_refuse_a_wake_over_the_limit() {
        let d = Fake::default();
        let a = Arena::<u64>::new(0x10_0000_0000, 8 * G, G, 8 * G, "Fake");
        let p = a.allocate(&d, 3 * G - 5).expect("three granules");
        let r = a.sleep(&d, true).expect("sleep");
        assert_eq!((r.released, r.offloaded), (3 * G, 3 * G));
        assert!(d.mapped.borrow().is_empty());
        let e = a.allocate(&d, 1).expect_err("asleep");
        assert!(e.message.contains("Fake::wake"), "{e}");
        a.set_limit(2 * G);
        let e = a.wake(&d).expect_err("does not fit");
        assert_eq!(e.kind, BackendErrorKind::OutOfMemory);
        assert!(d.mapped.borrow().is_empty(), "refused before any map");
        a.set_limit(8 * G);
        assert_eq!(a.wake(&d).expect("wake"), 3 * G);
        assert!(d.host.borrow().is_empty(), "every host copy freed once");
        assert_eq!(a.snapshot().mapped, 3 * G);
        a.retire(p);
        a.teardown(&d).expect("teardown");
        assert!(d.mapped.borrow().is_empty());
    }

    #[test]
    fn a_set_sleeps_granule_by_granule_and_keeps_its_space_out_of_the_allocator() {
        let d = Fake::default();
        let a = Arena::<u64>::new(0x10_0000_0000, 16 * G, G, u64::MAX, "Fake");
        // p: granules 0 and 1; q: granule 2 and the start of 3; r shares 3.
        let p = a.allocate(&d, 2 * G).expect("p");
        let q = a.allocate(&d, G + 4096).expect("q");
        let r = a.allocate(&d, 4096).expect("r");
        let rep = a.sleep_ranges(&d, &[p, q], true).expect("sleep p and q");
        assert_eq!(
            (rep.released, rep.offloaded),
            (3 * G, 3 * G),
            "granules 0-2 released; 3, shared with r, kept"
        );
        assert_eq!(*d.mapped.borrow(), vec![3]);
        assert_eq!(a.snapshot().asleep, 3 * G);
        // A second sleep of the set releases nothing.
        assert_eq!(
            a.sleep_ranges(&d, &[p, q], true).expect("again").released,
            0
        );
        // Copies: the set refused, r allowed.
        let e = a.check_awake("fake", "write", q, 16).expect_err("q sleeps");
        assert!(e.message.contains("Fake::wake_ranges"), "{e}");
        a.check_awake("fake", "write", r, 16).expect("r is awake");
        // The whole arena and a set refuse each other.
        let e = a.sleep(&d, false).expect_err("a set sleeps");
        assert!(e.message.contains("Fake::sleep_ranges"), "{e}");
        // q retires while asleep: its space in granule 2 stays out.
        a.retire(q);
        let s = a.allocate(&d, G).expect("s");
        assert_eq!(s, r + 4096, "after r, past the sleeping granules");
        assert_eq!(a.wake_ranges(&d, &[p]).expect("wake p"), 2 * G);
        assert_eq!(a.snapshot().asleep, G, "q's granule still asleep");
        // Nobody uses q's granule any more: dropped, not mapped.
        assert_eq!(a.wake(&d).expect("wake the rest"), 0);
        assert_eq!(a.snapshot().asleep, 0);
        assert!(d.host.borrow().is_empty(), "every host copy freed once");
        // q's range is free again: the next allocation of its size lands there.
        let t = a.allocate(&d, G).expect("t");
        assert_eq!(t, a.base + 2 * G);
        a.sleep(&d, false).expect("the whole arena");
        let e = a.wake_ranges(&d, &[p]).expect_err("the whole arena sleeps");
        assert!(e.message.contains("wake it whole"), "{e}");
        a.wake(&d).expect("wake");
        for x in [p, r, s, t] {
            a.retire(x);
        }
        a.teardown(&d).expect("teardown");
        assert!(d.mapped.borrow().is_empty());
    }
}
