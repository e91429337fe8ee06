//! The parts of a vendor's public context (`CudaContext`, `HipContext`):
//! the state its threads share, its virtual-memory arena and the pins of
//! its captures' graphs ([`Parts`]), and what is read from them the same
//! way on every vendor.

use crate::arena::ArenaHandle;
use crate::capture::Pins;
use crate::result::Vendor;
use crate::state::{Block, Origin};
use crate::table::Context;
use memgov_backend::{BackendError, BackendProbe, Execution};
use std::sync::Arc;

/// A vendor context's parts: the shared state (the caller's, the
/// callbacks' and the free thread's), the arena device memory comes from
/// when the context's configuration asked for one, and the executable
/// graphs made by captures on the arena that are still live.
pub struct Parts<C: Context> {
    /// The state the context's threads share.
    pub shared: Arc<C>,
    /// The virtual-memory arena, when configured.
    pub arena: Option<Arc<C::Arena>>,
    /// The live executable graphs of captures on the arena.
    pub pins: Arc<Pins<C::Table>>,
}

impl<C: Context> Parts<C> {
    /// The parts of a context just opened, with no arena yet.
    pub fn new(shared: C) -> Self {
        Self {
            shared: Arc::new(shared),
            arena: None,
            pins: Arc::default(),
        }
    }

    /// A handle on the context's virtual-memory arena (snapshot, trim,
    /// limit, sleep and wake), or `None` when none was configured.
    pub fn arena_handle(&self) -> Option<ArenaHandle<C>> {
        self.arena
            .as_ref()
            .map(|a| ArenaHandle::new(a.clone(), self.shared.clone()))
    }

    /// The probe every backend reports through; it outlives teardown.
    pub fn probe(&self) -> BackendProbe {
        self.shared.probe().clone()
    }

    /// Whether the driver is memgov's stand-in rather than the vendor's.
    pub fn is_stand_in(&self) -> bool {
        self.shared.state().device.execution == Execution::StandIn
    }

    /// Refuse a copy to or from arena memory while the arena, or a set the
    /// memory is in, sleeps (its addresses are reserved but nothing is
    /// mapped behind them).
    pub fn check_awake(&self, op: &'static str, memory: &Block) -> Result<(), BackendError> {
        match &self.arena {
            Some(a) if memory.origin == Origin::Arena => {
                a.check_awake(C::Table::BACKEND, op, memory.device, memory.bytes)
            }
            _ => Ok(()),
        }
    }
}
