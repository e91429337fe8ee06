//! A pin source's shared record: what a `PinSource` and every pin from it
//! hold, and what the context's `sources` list points to. The pins
//! themselves are `pin_source.rs`'s.

use super::ContextInner;
use crate::DeviceContext;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

/// What a pin source and every pin from it share: the context they pin and
/// the holder's label.
///
/// How many pins are held is not counted on the pin's path: every pin holds
/// one strong reference to this record and the source holds one more while
/// it exists, so the pins held are the strong count less the source's
/// reference (see [`PinSourceInner::upgrade_counted`]). A pin thus costs the
/// context pin's own claim plus a `Box` holding an `Arc` clone, which is the
/// floor under any `Box<dyn ProviderContextPin>` that keeps its context alive.
pub(crate) struct PinSourceInner<C: DeviceContext> {
    pub ctx: Arc<ContextInner<C>>,
    pub label: Option<String>,
    /// Whether the `PinSource` still exists and holds its strong reference.
    /// Cleared by its `Drop`, just before that reference goes.
    pub source_alive: AtomicBool,
}

impl<C: DeviceContext> PinSourceInner<C> {
    /// The source behind `entry` (an entry of the context's `sources`), with
    /// the number of pins held from it now; `None` once the source and every
    /// pin from it are gone.
    ///
    /// Counted from the strong count: the reference returned here, the
    /// source's own while it lives, and one per pin. Call with the context's
    /// `sources` lock held: that lock is the only place this record is
    /// upgraded, so no other transient reference inflates the count. A
    /// snapshot, as any count of a concurrent holder is: while the source
    /// itself is being dropped it can read one high for the few instructions
    /// between its flag clearing and its reference going.
    pub(crate) fn upgrade_counted(entry: &Weak<Self>) -> Option<(Arc<Self>, u64)> {
        let this = entry.upgrade()?;
        let source = usize::from(this.source_alive.load(Ordering::Acquire));
        let pins = (Arc::strong_count(&this) - 1).saturating_sub(source);
        Some((this, pins as u64))
    }
}
