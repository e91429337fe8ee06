//! The words of pressure: what a responder is asked ([`PressureRequest`]),
//! for which level of the budget tree ([`PressureLevel`]), and the
//! responders with their priorities.
//!
//! Imports nothing from its neighbours but [`Role`].

use super::role::Role;
use std::sync::Arc;

/// What a pressure responder is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PressureRequest {
    /// The context whose allocation did not fit. On a shared level (a
    /// device's [`SharedBudget`](super::SharedBudget), a
    /// [`ProcessBudget`](super::ProcessBudget), the device's memory) it may
    /// be another context than the responder's: see [`level`](Self::level).
    pub context: crate::ProviderContextIdentity,
    /// The level of the budget tree that refused the allocation.
    pub level: PressureLevel,
    /// The role of the allocation that did not fit.
    pub role: Role,
    /// The size of that allocation.
    pub requested: u64,
    /// How many bytes would have to be given back for it to fit.
    pub shortfall: u64,
}

/// Which level of the budget tree refused the allocation a
/// [`PressureRequest`] is for, and so whose responders are asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PressureLevel {
    /// The requesting context's own budget: only its responders are asked.
    Context,
    /// The device's [`SharedBudget`](super::SharedBudget): the responders of
    /// every context on it are asked, lowest priority first.
    Shared,
    /// The [`ProcessBudget`](super::ProcessBudget): the responders of every
    /// context under it are asked, lowest priority first.
    Process,
    /// The device itself (the backend is out of memory): the responders of
    /// every context on the requester's shared budget (only its own without
    /// one), lowest priority first.
    Device,
    /// The machine ledger shared by every process on the device: the
    /// responders of every context under the requester's process budget,
    /// lowest priority first; and, in another process asked to trim through
    /// the ledger's doorbell, that process's (then `context` is the
    /// responder's own context: the requester is in another process).
    Machine,
}

/// A callback asked to give memory back when an allocation does not fit.
///
/// It is called with no lock held, on the allocating thread (which may be
/// another context's: see [`PressureLevel`]), and returns how many bytes it
/// released (an estimate is fine; it is reported, and a round in which every
/// responder says 0 ends the asking).
pub type PressureResponder = Arc<dyn Fn(&PressureRequest) -> u64 + Send + Sync>;

/// The priority [`ContextHandle::add_pressure_responder`] gives: a
/// responder with a lower priority is asked first, one with a higher
/// priority only if the lower ones did not free enough.
///
/// [`ContextHandle::add_pressure_responder`]: super::ContextHandle::add_pressure_responder
pub const DEFAULT_PRESSURE_PRIORITY: u32 = 100;

/// A responder with the priority it was registered with.
#[derive(Clone)]
pub(crate) struct RegisteredResponder {
    pub priority: u32,
    pub responder: PressureResponder,
}
