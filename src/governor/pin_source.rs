//! The pin contract's implementations: a borrowed pin for code that holds a
//! handle, and boxed pins from a labelled source for external holders.

use super::record::pin_source::PinSourceInner;
use super::record::ContextInner;
use super::shards::GLOBAL;
use crate::sync::lock;
use crate::{
    DeviceContext, ProviderContextIdentity, ProviderContextPin, ProviderContextPinError,
    ProviderContextPinSource,
};
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A pin borrowed from a [`ContextHandle`](super::ContextHandle): the cheapest
/// form, one compare-and-swap to take and one atomic subtraction to drop.
#[must_use = "a pin is released when dropped"]
pub struct ContextPin<'a, C: DeviceContext> {
    pub(crate) ctx: &'a ContextInner<C>,
    /// Where the pin goes back to: a stream shard's pin lease, or the pin
    /// word ([`GLOBAL`]).
    pub(crate) shard: usize,
}

impl<'a, C: DeviceContext> ContextPin<'a, C> {
    /// Take a pin that is released when the returned guard drops, unless
    /// [`transfer`](Self::transfer) hands it to its long-term owner first.
    ///
    /// Every path that takes a pin and then runs code that can unwind (a
    /// backend call, a pressure responder) holds the pin in one of these, so
    /// that a panic there releases the pin instead of leaking it: a leaked
    /// pin would keep the context from ever tearing down.
    #[inline]
    pub(crate) fn acquire(ctx: &'a ContextInner<C>) -> Result<Self, ProviderContextPinError> {
        ctx.acquire_pin()?;
        Ok(Self { ctx, shard: GLOBAL })
    }

    /// [`acquire`](Self::acquire) for an allocation on a stream of `shard`:
    /// out of that shard's pin lease.
    #[inline]
    pub(crate) fn acquire_on(
        ctx: &'a ContextInner<C>,
        shard: usize,
    ) -> Result<Self, ProviderContextPinError> {
        ctx.acquire_pin_on(shard)?;
        Ok(Self { ctx, shard })
    }

    /// Guard a pin already held (a live buffer's), for the length of a call
    /// that can unwind before the pin reaches its next owner; it goes back
    /// through `shard` (pins are interchangeable: any shard's lease or the
    /// pin word may take back any pin).
    #[inline]
    pub(crate) fn adopt(ctx: &'a ContextInner<C>, shard: usize) -> Self {
        Self { ctx, shard }
    }

    /// The pin now belongs to something else (a buffer, a stream, a pending
    /// release, or a path that releases it itself): do not release it here.
    #[inline]
    pub(crate) fn transfer(self) {
        std::mem::forget(self);
    }
}

impl<C: DeviceContext> Drop for ContextPin<'_, C> {
    #[inline]
    fn drop(&mut self) {
        self.ctx.release_pin_on(self.shard);
    }
}

impl<C: DeviceContext> fmt::Debug for ContextPin<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ContextPin").field(&self.ctx.id).finish()
    }
}

impl<C: DeviceContext> ProviderContextPin for ContextPin<'_, C> {
    fn context(&self) -> ProviderContextIdentity {
        self.ctx.id
    }
}

/// The source handed to external holders.
pub(crate) struct PinSource<C: DeviceContext>(Arc<PinSourceInner<C>>);

impl<C: DeviceContext> PinSource<C> {
    pub(crate) fn new(ctx: &Arc<ContextInner<C>>, label: Option<String>) -> Self {
        let inner = Arc::new(PinSourceInner {
            ctx: ctx.clone(),
            label,
            source_alive: AtomicBool::new(true),
        });
        let mut sources = lock(&ctx.sources);
        sources.retain(|w| w.strong_count() > 0);
        sources.push(Arc::downgrade(&inner));
        Self(inner)
    }

    /// Pins held from this source now: every strong reference but its own.
    fn pins_held(&self) -> usize {
        Arc::strong_count(&self.0) - 1
    }
}

impl<C: DeviceContext> Drop for PinSource<C> {
    fn drop(&mut self) {
        // From here on the strong references left are the pins' (once the
        // field below drops, right after this).
        self.0.source_alive.store(false, Ordering::Release);
    }
}

impl<C: DeviceContext> fmt::Debug for PinSource<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinSource")
            .field("context", &self.0.ctx.id)
            .field("holder", &self.0.label)
            .field("outstanding", &self.pins_held())
            .finish()
    }
}

impl<C: DeviceContext> ProviderContextPinSource for PinSource<C> {
    fn context(&self) -> ProviderContextIdentity {
        self.0.ctx.id
    }

    fn pin(&self) -> Result<Box<dyn ProviderContextPin>, ProviderContextPinError> {
        let ctx: &ContextInner<C> = &self.0.ctx;
        ctx.acquire_pin()?;
        Ok(Box::new(ExternalPin {
            ctx: NonNull::from(ctx),
            source: self.0.clone(),
        }))
    }
}

/// A pin held by an external holder. Keeps its source (and so the context
/// record) alive; dropping it releases the claim.
///
/// It also points at the record directly, so that releasing the claim does
/// not chase the source's pointer first (one dependent load fewer on a path
/// that costs a few loads and two atomic operations).
struct ExternalPin<C: DeviceContext> {
    /// The record `source.ctx` owns.
    ctx: NonNull<ContextInner<C>>,
    source: Arc<PinSourceInner<C>>,
}

// SAFETY: `ctx` is a shared reference in all but name: it points at the
// record that `source` keeps alive (through its `Arc`), and is only read as
// `&ContextInner<C>`, which is `Send + Sync` (see `record/mod.rs`). So the pin
// is `Send`/`Sync` exactly when `Arc<PinSourceInner<C>>` and
// `&ContextInner<C>` are, which they are.
unsafe impl<C: DeviceContext> Send for ExternalPin<C> {}
// SAFETY: as for `Send`.
unsafe impl<C: DeviceContext> Sync for ExternalPin<C> {}

impl<C: DeviceContext> Drop for ExternalPin<C> {
    fn drop(&mut self) {
        // SAFETY: `ctx` was made from `&*source.ctx`, and `source` (an `Arc`
        // of the record's owner) is still held: it is dropped only after
        // this body returns, so the record is alive for the whole call.
        let ctx = unsafe { self.ctx.as_ref() };
        ctx.release_pin();
    }
}

impl<C: DeviceContext> fmt::Debug for ExternalPin<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExternalPin")
            .field("context", &self.source.ctx.id)
            .field("holder", &self.source.label)
            .finish()
    }
}

impl<C: DeviceContext> ProviderContextPin for ExternalPin<C> {
    fn context(&self) -> ProviderContextIdentity {
        self.source.ctx.id
    }
}

#[cfg(test)]
mod tests {
    use crate::null::NullContext;
    use crate::{ContextConfig, Governor, OutstandingItem, PinKind};

    fn external(items: &[OutstandingItem]) -> Vec<(Option<&str>, u64)> {
        let mut v: Vec<_> = items
            .iter()
            .filter(|i| i.kind == PinKind::External)
            .map(|i| (i.holder.as_deref(), i.count))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn pins_of_a_dropped_source_are_still_named_by_its_label() {
        let gov = Governor::new();
        let ctx = gov.register(NullContext::new(), ContextConfig::new());
        let plugin = ctx.pin_source(Some("plugin"));
        let ep = ctx.pin_source(Some("ep"));
        let idle = ctx.pin_source(Some("idle"));
        let held: Vec<_> = (0..3).map(|_| plugin.pin().unwrap()).collect();
        let ep_pin = ep.pin().unwrap();
        // Clones of the handed-out source are one source, not pins.
        let plugin_again = plugin.clone();
        assert!(
            format!("{plugin:?}").contains("outstanding: 3"),
            "{plugin:?}"
        );
        drop((plugin, plugin_again, idle));

        let h = ctx.retire();
        let outstanding = h.outstanding();
        assert_eq!(
            external(&outstanding.items),
            [(Some("ep"), 1), (Some("plugin"), 3)],
            "{outstanding:?}"
        );
        assert!(
            outstanding.items.iter().all(|i| i.kind != PinKind::Other),
            "every pin is named: {outstanding:?}"
        );
        let mut held = held;
        held.pop();
        assert_eq!(
            external(&h.outstanding().items),
            [(Some("ep"), 1), (Some("plugin"), 2)]
        );
        drop(held);
        assert_eq!(external(&h.outstanding().items), [(Some("ep"), 1)]);
        // The live source's own reference is not a pin.
        drop(ep_pin);
        assert!(h.outstanding().is_empty(), "{:?}", h.outstanding());
        h.try_finish().unwrap();
        assert_eq!(ep.context(), ctx.id());
    }
}
