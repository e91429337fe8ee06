//! Whether a context's memory sleeps: the state word its record holds.
//! Putting memory to sleep and waking it is `suspend.rs`'s.

use crate::governor::snapshot::SleepState;
use std::sync::atomic::{AtomicU8, Ordering};

/// A context's sleep state word (see `suspend.rs`).
#[derive(Debug, Default)]
pub(crate) struct SleepWord(AtomicU8);

impl SleepWord {
    pub(crate) fn get(&self) -> SleepState {
        SleepState::ALL[usize::from(self.0.load(Ordering::Acquire))]
    }

    /// Move from `from` to `to`, or say which state was found instead.
    pub(crate) fn step(&self, from: SleepState, to: SleepState) -> Result<(), SleepState> {
        self.0
            .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
            .map(drop)
            .map_err(|found| SleepState::ALL[usize::from(found)])
    }

    pub(crate) fn set(&self, to: SleepState) {
        self.0.store(to as u8, Ordering::Release);
    }
}
