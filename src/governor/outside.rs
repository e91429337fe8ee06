//! Memory a runtime uses for a context outside memgov's allocations.
//!
//! Some of what a runtime keeps for a context cannot be routed through
//! [`ContextHandle::allocate`]: ONNX Runtime, for example, keeps part of a
//! model's weights in its own heap whatever allocator it is given. Hiding
//! those bytes would make a snapshot look smaller than the footprint it is
//! used to size. The glue measures them and reports them here; the context's
//! snapshot shows the sum as [`ContextSnapshot::outside_bytes`]. They are not
//! charged to any budget: memgov did not allocate them and cannot refuse or
//! release them.
//!
//! [`ContextSnapshot::outside_bytes`]: super::ContextSnapshot::outside_bytes

use super::handle::ContextHandle;
use super::record::ContextInner;
use crate::DeviceContext;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The sum of the live [`OutsideUsage`] reports of one context.
#[derive(Debug, Default)]
pub(crate) struct Outside(AtomicU64);

impl Outside {
    pub(crate) fn bytes(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Bytes used for a context outside memgov's allocations, shown in its
/// snapshot until this report is dropped. Made by
/// [`ContextHandle::report_outside`]. Like a [`ContextHandle`], it does not
/// hold the context against retirement.
#[must_use = "the bytes are reported only while the report lives"]
pub struct OutsideUsage<C: DeviceContext> {
    inner: Arc<ContextInner<C>>,
    bytes: u64,
}

impl<C: DeviceContext> OutsideUsage<C> {
    /// The bytes this report adds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl<C: DeviceContext> Drop for OutsideUsage<C> {
    fn drop(&mut self) {
        self.inner
            .outside
            .0
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl<C: DeviceContext> fmt::Debug for OutsideUsage<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutsideUsage")
            .field("context", &self.inner.label())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl<C: DeviceContext> ContextHandle<C> {
    /// Report `bytes` used for this context outside memgov's allocations
    /// (memory a runtime keeps in its own heap): the snapshot's
    /// `outside_bytes` includes them until the returned report is dropped.
    /// Nothing is charged, admitted or refused.
    pub fn report_outside(&self, bytes: u64) -> OutsideUsage<C> {
        self.inner.outside.0.fetch_add(bytes, Ordering::Relaxed);
        OutsideUsage {
            inner: self.inner.clone(),
            bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::host::{HostConfig, HostContext};
    use crate::{ContextConfig, Governor};

    #[test]
    fn outside_bytes_show_in_the_snapshot_while_reported_and_are_never_charged() {
        let gov = Governor::new();
        let ctx = gov.register(
            HostContext::new(HostConfig::default()).unwrap(),
            ContextConfig::new().label("outside").budget(1024),
        );
        let a = ctx.report_outside(3000);
        let b = ctx.report_outside(500);
        let snap = ctx.snapshot();
        assert_eq!((snap.outside_bytes, snap.charged), (3500, 0));
        assert_eq!(a.bytes(), 3000);
        drop(a);
        assert_eq!(ctx.snapshot().outside_bytes, 500);
        drop(b);
        assert_eq!(ctx.snapshot().outside_bytes, 0);
    }
}
