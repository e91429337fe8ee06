//! A pending release as the record holds it: the box a release's signal
//! carries until it settles, and the spare slots that recycle those boxes.
//! The release path itself (queueing, settling, refusing) is `release.rs`'s.

use super::ContextInner;
use crate::governor::role::Role;
use crate::governor::shards::SHARDS;
use crate::sync::{slot_index, Slot};
use crate::{DeviceContext, Tier};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// The governor's side of one pending release. Boxed once per release; the
/// box is recycled, *with its `Arc` of the context*, through its shard's
/// spare [`Slot`], so that in the steady state a release neither allocates
/// nor touches the context's reference count.
pub(crate) struct PendingRelease<C: DeviceContext> {
    pub ctx: Arc<ContextInner<C>>,
    pub stream_pending: Option<Arc<AtomicU64>>,
    pub bytes: u64,
    pub role: Role,
    /// The tier whose budget the bytes return to.
    pub tier: Tier,
    /// Shard of the stream the release was queued on: its pending counts.
    /// (`u8`: keeps the box at 32 bytes.)
    pub shard: u8,
}

/// The spare slots of one context: one cached [`PendingRelease`] box per
/// shard, each slot on a cache line of its own.
pub(crate) struct Spares<C: DeviceContext>([Spare<C>; SHARDS]);

#[repr(align(128))]
struct Spare<C: DeviceContext>(Slot<PendingRelease<C>>);

impl<C: DeviceContext> Spares<C> {
    pub(crate) fn new() -> Self {
        Self(std::array::from_fn(|_| Spare(Slot::new())))
    }

    /// The slot of `shard`.
    #[inline]
    pub(crate) fn of(&self, shard: usize) -> &Slot<PendingRelease<C>> {
        &self.0[slot_index::<SHARDS>(shard)].0
    }

    /// Whether any slot holds a box (none can once the record is dropped:
    /// the box would hold an `Arc` of it).
    pub(crate) fn any_filled(&self) -> bool {
        self.0.iter().any(|s| s.0.is_filled())
    }

    /// Close every slot for good and drop the boxes cached there (and their
    /// `Arc`s of the context), breaking the reference cycle a cached box
    /// makes. Called by `begin_retire`, whose caller holds its own `Arc` of
    /// the context, so none of these is the last.
    pub(crate) fn close(&self) {
        for spare in &self.0 {
            drop(spare.0.close());
        }
    }
}
