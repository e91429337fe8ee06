//! Monotonic event counters of one context. `allocations`, `releases
//! queued` and `retired` are not here: they are derived from the
//! statistics, so that the allocate/release cycle does not pay for them.

use std::sync::atomic::{AtomicU64, Ordering};

/// The counters (read by snapshots and teardown reports).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub abandoned: AtomicU64,
    pub settled_lost: AtomicU64,
    pub quarantined: AtomicU64,
    pub reclaimed: AtomicU64,
    pub admission_refusals: AtomicU64,
    pub admission_waits: AtomicU64,
    pub pressure_calls: AtomicU64,
    pub backend_errors: AtomicU64,
    /// Releases that settled after teardown: must stay zero (a backend bug).
    pub late_settlements: AtomicU64,
}

/// An event counted by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Note {
    /// An admission was refused.
    Refusal,
    /// An admission waited for releases to settle.
    Wait,
    /// An admission asked the pressure responders.
    PressureCall,
    /// The backend returned an error.
    BackendError,
    /// A release settled after teardown.
    LateSettlement,
    /// A release was refused and its memory quarantined.
    Quarantined,
    /// A live buffer went with its lost device.
    SettledLost,
}

impl Counters {
    /// Count `note` once.
    #[inline]
    pub(crate) fn note(&self, note: Note) {
        let counter = match note {
            Note::Refusal => &self.admission_refusals,
            Note::Wait => &self.admission_waits,
            Note::PressureCall => &self.pressure_calls,
            Note::BackendError => &self.backend_errors,
            Note::LateSettlement => &self.late_settlements,
            Note::Quarantined => &self.quarantined,
            Note::SettledLost => &self.settled_lost,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
