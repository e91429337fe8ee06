//! The pin contract's implementations: a borrowed pin for code that holds a
//! handle, and boxed pins from a labelled source for external holders.

use super::record::{ContextInner, GLOBAL};
use crate::sync::lock;
use crate::{
    DeviceContext, ProviderContextIdentity, ProviderContextPin, ProviderContextPinError,
    ProviderContextPinSource,
};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
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

pub(crate) struct PinSourceInner<C: DeviceContext> {
    pub ctx: Arc<ContextInner<C>>,
    pub label: Option<String>,
    pub outstanding: AtomicU64,
}

/// The source handed to external holders.
pub(crate) struct PinSource<C: DeviceContext>(pub Arc<PinSourceInner<C>>);

impl<C: DeviceContext> PinSource<C> {
    pub(crate) fn new(ctx: &Arc<ContextInner<C>>, label: Option<String>) -> Self {
        let inner = Arc::new(PinSourceInner {
            ctx: ctx.clone(),
            label,
            outstanding: AtomicU64::new(0),
        });
        let mut sources = lock(&ctx.sources);
        sources.retain(|w| w.strong_count() > 0);
        sources.push(Arc::downgrade(&inner));
        Self(inner)
    }
}

impl<C: DeviceContext> fmt::Debug for PinSource<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinSource")
            .field("context", &self.0.ctx.id)
            .field("holder", &self.0.label)
            .field("outstanding", &self.0.outstanding.load(Ordering::Relaxed))
            .finish()
    }
}

impl<C: DeviceContext> ProviderContextPinSource for PinSource<C> {
    fn context(&self) -> ProviderContextIdentity {
        self.0.ctx.id
    }

    fn pin(&self) -> Result<Box<dyn ProviderContextPin>, ProviderContextPinError> {
        self.0.ctx.acquire_pin()?;
        self.0.outstanding.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(ExternalPin(self.0.clone())))
    }
}

/// A pin held by an external holder. Keeps its source (and so the context
/// record) alive; dropping it releases the claim.
struct ExternalPin<C: DeviceContext>(Arc<PinSourceInner<C>>);

impl<C: DeviceContext> Drop for ExternalPin<C> {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
        self.0.ctx.release_pin();
    }
}

impl<C: DeviceContext> fmt::Debug for ExternalPin<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExternalPin")
            .field("context", &self.0.ctx.id)
            .field("holder", &self.0.label)
            .finish()
    }
}

impl<C: DeviceContext> ProviderContextPin for ExternalPin<C> {
    fn context(&self) -> ProviderContextIdentity {
        self.0.ctx.id
    }
}
