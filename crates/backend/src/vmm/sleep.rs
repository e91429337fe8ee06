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

use super::state::Slot;
use super::{closed, Arena, SleepDriver};
use crate::capability::SleepReport;
use crate::{lock, BackendError, BackendErrorKind};
use std::fmt::Debug;

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
            // Refused before anything was released (a copy failed): the
            // arena stays awake, as the caller is told.
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
        // Copies first, all of them: one that fails leaves every granule
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
        (outcome, report, first_err)
    }
}
