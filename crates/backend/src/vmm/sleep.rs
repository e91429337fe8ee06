//! Sleep and wake of an arena: its physical memory unmapped and released
//! (its contents kept in page-locked host memory when asked) while the
//! addresses stay reserved, then mapped again at the same addresses with
//! the contents restored.
//!
//! Each granule's slot is its mapped state: `Mapped` → `Asleep` on sleep,
//! `Asleep` → `Mapped` on wake, each step taken once, so no handle is
//! released twice and none is forgotten. A wake that would pass the arena's
//! limit is refused (`OutOfMemory`, with the numbers) before any granule is
//! mapped; one that fails half-way unmaps what it mapped and stays asleep.
//! A sleep copies every granule in use to host memory before it unmaps
//! any: a copy that fails refuses the sleep with nothing released and the
//! arena awake. The whole arena sleeps only while no set of its allocations
//! sleeps ([`sleep_set`](super::sleep_set)); its wake also wakes such a
//! set.
//!
//! # Governed host copies
//!
//! The page-locked host memory that keeps sleeping contents is charged to
//! the [`HostCopyBudget`] installed on the calling thread, if any (the
//! governor's `ContextHandle::sleep_with` and `wake_with` install the
//! context's pinned host tier around their backend call): a sleep charges
//! every copy it will make before it makes the first, and is refused with
//! nothing released when the budget cannot hold them; each copy freed (by
//! a wake, or by a sleep that could not release its granule) is given
//! back. Teardown frees the copies left with no budget installed: their
//! owner returns their charge at its own teardown.

use super::state::Slot;
use super::{closed, Arena, GranuleDriver, SleepDriver};
use crate::capability::SleepReport;
use crate::{lock, BackendError, BackendErrorKind};
use std::cell::RefCell;
use std::fmt::Debug;
use std::rc::Rc;

/// Where the page-locked host copies of a sleep are charged: the
/// governor's pinned host tier of the context sleeping.
pub trait HostCopyBudget {
    /// Charge `bytes` of page-locked host memory about to hold sleeping
    /// contents. `Err` (kind `OutOfMemory`, naming the numbers and the way
    /// out): refused, nothing charged.
    fn charge(&self, bytes: u64) -> Result<(), BackendError>;

    /// `bytes` of host copies were freed (or not made after all). Copies
    /// made while no budget was installed are given back too: a budget
    /// gives back at most what it holds.
    fn give_back(&self, bytes: u64);
}

thread_local! {
    static HOST_COPIES: RefCell<Option<Rc<dyn HostCopyBudget>>> = const { RefCell::new(None) };
}

/// Run `f` with `budget` charged for the host copies every sleep and wake
/// of an arena on this thread makes or frees; the budget installed before
/// is back when `f` returns or unwinds.
pub fn with_host_copy_budget<R>(budget: Rc<dyn HostCopyBudget>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Rc<dyn HostCopyBudget>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0.take();
            HOST_COPIES.with(|b| *b.borrow_mut() = before);
        }
    }
    let _restore = Restore(HOST_COPIES.with(|b| b.borrow_mut().replace(budget)));
    f()
}

/// The budget installed on this thread, if any.
fn host_copy_budget() -> Option<Rc<dyn HostCopyBudget>> {
    HOST_COPIES.with(|b| b.borrow().clone())
}

/// What [`Arena::release_granules`] did: each granule's next slot, what
/// was given back, and the first error.
type Released<H> = (Vec<(usize, Slot<H>)>, SleepReport, Option<BackendError>);

impl<H: Copy + Eq + Debug> Arena<H> {
    /// Put the arena to sleep: wait for every stream of the context, then
    /// unmap and release every granule, copying the contents of those in
    /// use to page-locked host memory first when `keep_contents` is set.
    /// Addresses stay reserved and allocations stay live (unusable until
    /// [`wake`](Self::wake)).
    pub fn sleep<D: SleepDriver<Handle = H>>(
        &self,
        d: &D,
        keep_contents: bool,
    ) -> Result<SleepReport, BackendError> {
        let backend = d.backend();
        let _current = d.make_current("sleep")?;
        d.quiesce("sleep")?;
        let taken: Vec<(usize, H, bool)> = {
            // Checked after the wait: a set's sleep may finish meanwhile.
            let mut st = self.wait_settled(lock(&self.state));
            if st.closed {
                return Err(closed(backend, "sleep"));
            }
            if st.asleep {
                return Err(BackendError::new(
                    backend,
                    "sleep",
                    BackendErrorKind::InvalidArgument,
                    "the arena is asleep already; wake it first",
                ));
            }
            if st.set_asleep() {
                let h = self.handle;
                return Err(BackendError::new(
                    backend,
                    "sleep",
                    BackendErrorKind::InvalidArgument,
                    format!(
                        "a set of the arena's allocations is asleep ({h}::sleep_ranges); wake it \
                         first ({h}::wake_ranges or {h}::wake)"
                    ),
                ));
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
        let (outcome, report, first_err) = self.release_granules(d, "sleep", taken, keep_contents);
        let mut st = lock(&self.state);
        if first_err.is_some() && outcome.iter().all(|(_, s)| matches!(s, Slot::Mapped(_))) {
            // Refused before anything was released (the host copies were
            // refused, or a copy failed): the arena stays awake, every
            // granule mapped, as the caller is told.
            st.asleep = false;
        }
        for (g, slot) in outcome {
            match slot {
                Slot::Mapped(_) => {}
                Slot::Quarantined { .. } => st.quarantine(g, slot, self.base, self.granule),
                _ => st.mapped -= self.granule,
            }
            if !matches!(slot, Slot::Quarantined { .. }) {
                st.slots[g].slot = slot;
            }
        }
        drop(st);
        self.changed.notify_all();
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
    pub fn wake<D: SleepDriver<Handle = H>>(&self, d: &D) -> Result<u64, BackendError> {
        let whole = !lock(&self.state).set_asleep();
        self.wake_granules(d, "wake", None, whole)
    }

    /// Unmap and release the granules `taken` (each marked `Unmapping`, with
    /// its handle and whether an allocation uses it), copying the contents
    /// of those in use to page-locked host memory first when
    /// `keep_contents` is set (every copy before any unmap). Returns each
    /// granule's next slot (`Asleep` when in use, `Unmapped` when cached,
    /// the quarantine the driver's refusal left; every one `Mapped`, nothing
    /// released, when a copy failed), what was given back, and the first
    /// error. No lock is held.
    pub(super) fn release_granules<D: SleepDriver<Handle = H>>(
        &self,
        d: &D,
        op: &'static str,
        taken: Vec<(usize, H, bool)>,
        keep_contents: bool,
    ) -> Released<H> {
        let mut outcome: Vec<(usize, Slot<H>)> = Vec::new();
        let mut first_err = None;
        let mut report = SleepReport {
            released: 0,
            offloaded: 0,
        };
        // Every copy is charged before the first is made: a refusal leaves
        // every granule mapped.
        let copies = if keep_contents {
            taken.iter().filter(|t| t.2).count() as u64 * self.granule
        } else {
            0
        };
        let budget = host_copy_budget().filter(|_| copies > 0);
        if let Some(b) = &budget {
            if let Err(e) = b.charge(copies) {
                let kept = taken.into_iter().map(|(g, h, _)| (g, Slot::Mapped(h)));
                return (kept.collect(), report, Some(e));
            }
        }
        // Copies next, all of them: one that fails leaves every granule
        // mapped and nothing released, so the sleep is refused cleanly.
        let mut hosts = vec![0usize; taken.len()];
        if keep_contents {
            for (i, &(g, _, in_use)) in taken.iter().enumerate() {
                if !in_use {
                    continue;
                }
                match d.offload(self.base + g as u64 * self.granule, self.granule) {
                    Ok(p) => hosts[i] = p,
                    Err(e) => {
                        first_err = Some(e);
                        break;
                    }
                }
            }
            if first_err.is_some() {
                for &host in hosts.iter().filter(|&&h| h != 0) {
                    d.free_host(host, op);
                }
                // Nothing kept: the whole charge goes back.
                if let Some(b) = &budget {
                    b.give_back(copies);
                }
                let outcome = taken
                    .into_iter()
                    .map(|(g, h, _)| (g, Slot::Mapped(h)))
                    .collect();
                return (outcome, report, first_err);
            }
        }
        for ((g, h, in_use), host) in taken.into_iter().zip(hosts) {
            let at = self.base + g as u64 * self.granule;
            match d.unmap(g, h, op) {
                Ok(()) => {
                    report.released += self.granule;
                    if host != 0 {
                        report.offloaded += self.granule;
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
                    if host != 0 {
                        d.free_host(host, op);
                    }
                    first_err.get_or_insert_with(|| {
                        BackendError::new(
                            d.backend(),
                            op,
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
        // The copies not kept (not made, or freed with a granule the driver
        // would not give back) are given back.
        if let Some(b) = budget {
            if copies > report.offloaded {
                b.give_back(copies - report.offloaded);
            }
        }
        (outcome, report, first_err)
    }

    /// Free the host copies at `hosts` (0: none kept), one granule each,
    /// and give their charge back to the budget installed, if any.
    pub(super) fn free_copies<D: GranuleDriver>(&self, d: &D, hosts: Vec<usize>, op: &'static str) {
        let mut freed = 0;
        for host in hosts.into_iter().filter(|&h| h != 0) {
            d.free_host(host, op);
            freed += self.granule;
        }
        if freed > 0 {
            if let Some(b) = host_copy_budget() {
                b.give_back(freed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmm::{GranuleDriver, MapError};
    use std::cell::Cell;

    const G: u64 = 2 << 20;

    /// A driver whose handles are granule numbers, whose host copies are
    /// counted, and whose `fail_offload`th offload fails (from 1; 0: none).
    #[derive(Default)]
    struct Fake {
        mapped: Cell<u32>,
        hosts: Cell<u32>,
        offloads: Cell<u32>,
        fail_offload: u32,
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
        fn map(&self, g: usize, _: &'static str) -> Result<u64, MapError<u64>> {
            self.mapped.set(self.mapped.get() + 1);
            Ok(g as u64)
        }
        fn unmap(&self, _: usize, _: u64, _: &'static str) -> Result<(), Slot<u64>> {
            self.mapped.set(self.mapped.get() - 1);
            Ok(())
        }
        fn release(&self, _: u64, _: &'static str) -> Result<(), BackendError> {
            Ok(())
        }
        fn free_host(&self, _: usize, _: &'static str) {
            self.hosts.set(self.hosts.get() - 1);
        }
    }

    impl SleepDriver for Fake {
        fn quiesce(&self, _: &'static str) -> Result<(), BackendError> {
            Ok(())
        }
        fn offload(&self, _: u64, _: u64) -> Result<usize, BackendError> {
            self.offloads.set(self.offloads.get() + 1);
            if self.offloads.get() == self.fail_offload {
                return Err(BackendError::new(
                    "fake",
                    "sleep",
                    BackendErrorKind::OutOfMemory,
                    "planted",
                ));
            }
            self.hosts.set(self.hosts.get() + 1);
            Ok(0x1000 * self.hosts.get() as usize)
        }
        fn restore(&self, _: u64, _: usize, _: u64) -> Result<(), BackendError> {
            Ok(())
        }
    }

    /// A budget of `limit` bytes that counts what it holds.
    struct Budget {
        limit: u64,
        held: Cell<u64>,
    }

    impl HostCopyBudget for Budget {
        fn charge(&self, bytes: u64) -> Result<(), BackendError> {
            if self.held.get() + bytes > self.limit {
                return Err(BackendError::new(
                    "fake",
                    "sleep",
                    BackendErrorKind::OutOfMemory,
                    "over the budget",
                ));
            }
            self.held.set(self.held.get() + bytes);
            Ok(())
        }
        fn give_back(&self, bytes: u64) {
            // Copies made with no budget installed were never charged.
            self.held.set(self.held.get().saturating_sub(bytes));
        }
    }

    fn budget(limit: u64) -> Rc<Budget> {
        Rc::new(Budget {
            limit,
            held: Cell::new(0),
        })
    }

    #[test]
    fn copies_the_budget_cannot_hold_leave_everything_mapped_and_awake() {
        let d = Fake::default();
        let a = Arena::<u64>::new(0x10_0000_0000, 16 * G, G, u64::MAX, "Fake");
        let p = a.allocate(&d, 4 * G).expect("4 granules");
        let b = budget(3 * G);
        let e = with_host_copy_budget(b.clone(), || a.sleep(&d, true))
            .expect_err("4 granules of copies under a budget of 3");
        assert_eq!(e.message, "over the budget");
        assert_eq!((b.held.get(), d.offloads.get(), d.mapped.get()), (0, 0, 4));
        assert!(!a.is_asleep(), "nothing was put to sleep");
        assert_eq!(a.snapshot().mapped, 4 * G);
        a.check_awake("fake", "read", p, 4 * G)
            .expect("still readable");
        // The same for a set.
        with_host_copy_budget(b.clone(), || a.sleep_ranges(&d, &[p], true)).expect_err("refused");
        assert_eq!((b.held.get(), a.snapshot().asleep), (0, 0));
    }

    #[test]
    fn copies_are_charged_while_asleep_and_given_back_by_the_wake() {
        let d = Fake::default();
        let a = Arena::<u64>::new(0x10_0000_0000, 16 * G, G, u64::MAX, "Fake");
        let p = a.allocate(&d, 4 * G).expect("4 granules");
        let b = budget(4 * G);
        with_host_copy_budget(b.clone(), || a.sleep(&d, true)).expect("fits");
        assert_eq!((b.held.get(), d.hosts.get()), (4 * G, 4));
        with_host_copy_budget(b.clone(), || a.wake(&d)).expect("wake");
        assert_eq!((b.held.get(), d.hosts.get()), (0, 0));
        // Discarded contents cost nothing.
        let q = a.allocate(&d, G).expect("another");
        with_host_copy_budget(b.clone(), || a.sleep_ranges(&d, &[q], false)).expect("discard");
        assert_eq!(b.held.get(), 0);
        with_host_copy_budget(b.clone(), || a.wake_ranges(&d, &[q])).expect("wake");
        // Without a budget installed nothing is charged.
        a.sleep_ranges(&d, &[p], true).expect("ungoverned");
        assert_eq!((b.held.get(), d.hosts.get()), (0, 4));
        with_host_copy_budget(b.clone(), || a.wake_ranges(&d, &[p])).expect("wake");
        assert_eq!((b.held.get(), d.hosts.get()), (0, 0));
    }

    #[test]
    fn a_copy_failing_part_way_keeps_nothing_and_gives_the_charge_back() {
        let d = Fake {
            fail_offload: 3,
            ..Fake::default()
        };
        let a = Arena::<u64>::new(0x10_0000_0000, 16 * G, G, u64::MAX, "Fake");
        let p = a.allocate(&d, 4 * G).expect("4 granules");
        let b = budget(u64::MAX);
        let e = with_host_copy_budget(b.clone(), || a.sleep_ranges(&d, &[p], true))
            .expect_err("the third copy fails");
        assert_eq!(e.message, "planted");
        // Every copy comes before any unmap: the two made are freed, the
        // whole charge given back, and every granule is still mapped.
        assert_eq!((b.held.get(), d.hosts.get()), (0, 0));
        assert_eq!(d.mapped.get(), 4);
        assert_eq!((b.held.get(), d.hosts.get()), (0, 0));
    }
}
