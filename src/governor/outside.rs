//! Memory a runtime allocated outside memgov, recorded against a level of
//! the budget tree.
//!
//! Some of what a runtime keeps cannot be routed through
//! [`ContextHandle::allocate`]: ONNX Runtime, for example, keeps part of a
//! model's weights in its own heap whatever allocator it is given, and a
//! BLAS library allocates its workspace itself. That memory is on the
//! device all the same, so it is recorded where it lives and **charged**
//! there, and on every level above (context, device, process): an
//! allocation that would take a level over its limit with it is refused,
//! and the refusal shows it as "outside memgov". Snapshots show it too
//! ([`ContextSnapshot::outside_bytes`], [`SharedBudget::outside`],
//! [`ProcessBudget::outside`]): nothing is hidden.
//!
//! Recording never fails: the runtime records memory it already has, which
//! memgov can neither refuse nor free. A record that does not fit is
//! charged anyway and takes its level over the limit; every allocation
//! there is refused until enough comes back. The bytes come back when the
//! record returned by `report_outside` is dropped, exactly once (the guard
//! is the only handle on them); a context's teardown leaves them charged,
//! since the runtime, not the teardown, frees them.
//!
//! [`ContextSnapshot::outside_bytes`]: super::ContextSnapshot::outside_bytes

use super::ledger::{self, ProcessBudget, SharedBudget};

use super::handle::ContextHandle;
use super::record::ContextInner;
use crate::DeviceContext;
use std::fmt;
use std::sync::Arc;

/// Bytes allocated outside memgov for a context, charged to it (and to the
/// levels above it) until this record is dropped. Made by
/// [`ContextHandle::report_outside`]. Like a [`ContextHandle`], it does not
/// hold the context against retirement.
#[must_use = "the bytes are charged only while the record lives"]
pub struct OutsideUsage<C: DeviceContext> {
    inner: Arc<ContextInner<C>>,
    bytes: u64,
}

impl<C: DeviceContext> OutsideUsage<C> {
    /// The bytes this record charges.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl<C: DeviceContext> Drop for OutsideUsage<C> {
    fn drop(&mut self) {
        self.inner.ledger.return_outside(self.bytes);
        // Allocations of this context waiting for room look again.
        self.inner.announce_settlement();
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
    /// Record `bytes` allocated for this context outside memgov (memory a
    /// runtime keeps in its own heap): charged to the context's budget and
    /// to the levels above it until the returned record is dropped, shown
    /// as the snapshot's `outside_bytes` and as "outside memgov" in a
    /// refusal. Never refused: the runtime already has the memory, so a
    /// record that does not fit takes the budget over its limit, and
    /// allocations there are refused until enough comes back. Dropping the
    /// record returns the bytes, once; the context's teardown does not
    /// (the runtime frees its own memory).
    ///
    /// ```
    /// use memgov::{Alloc, ContextConfig, Governor, Role, host::{HostConfig, HostContext}};
    /// let gov = Governor::new();
    /// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().budget(4 << 20));
    /// // ONNX Runtime kept 3 MiB of weights in its own heap.
    /// let weights = ctx.report_outside(3 << 20);
    /// let s = ctx.create_stream("s")?;
    /// let err = ctx.allocate(&s, Alloc::new(2 << 20, Role::Activation)).unwrap_err();
    /// assert!(err.to_string().contains("outside memgov"), "{err}");
    /// drop(weights);
    /// let _b = ctx.allocate(&s, Alloc::new(2 << 20, Role::Activation))?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn report_outside(&self, bytes: u64) -> OutsideUsage<C> {
        self.inner.ledger.record_outside(bytes);
        OutsideUsage {
            inner: self.inner.clone(),
            bytes,
        }
    }
}

/// The level an [`OutsideRecord`] is charged to.
enum At {
    Shared(SharedBudget),
    Process(ProcessBudget),
}

/// Bytes allocated outside memgov recorded on a device's [`SharedBudget`]
/// (and the process level above it) or on a [`ProcessBudget`], charged
/// until this record is dropped. Made by [`SharedBudget::report_outside`]
/// and [`ProcessBudget::report_outside`].
#[must_use = "the bytes are charged only while the record lives"]
pub struct OutsideRecord {
    at: At,
    bytes: u64,
}

impl OutsideRecord {
    /// The bytes this record charges.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn levels(&self) -> (Option<&SharedBudget>, Option<&ProcessBudget>) {
        match &self.at {
            At::Shared(s) => (Some(s), None),
            At::Process(p) => (None, Some(p)),
        }
    }
}

impl Drop for OutsideRecord {
    fn drop(&mut self) {
        let (shared, process) = self.levels();
        ledger::return_outside_at(shared, process, self.bytes);
    }
}

impl fmt::Debug for OutsideRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let level = match &self.at {
            At::Shared(s) => format!("shared budget '{}'", s.label()),
            At::Process(p) => format!("process budget '{}'", p.label()),
        };
        f.debug_struct("OutsideRecord")
            .field("level", &level)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl SharedBudget {
    /// Record `bytes` allocated on this device outside memgov and outside
    /// any one context (a library's workspace shared by every model on the
    /// device): charged here and to the process level above until the
    /// returned record is dropped. Never refused: see
    /// [`ContextHandle::report_outside`].
    ///
    /// ```
    /// use memgov::SharedBudget;
    /// let gpu0 = SharedBudget::new("gpu0", 8 << 30);
    /// let workspace = gpu0.report_outside(256 << 20);
    /// assert_eq!((gpu0.charged(), gpu0.outside()), (256 << 20, 256 << 20));
    /// drop(workspace);
    /// assert_eq!(gpu0.charged(), 0);
    /// ```
    pub fn report_outside(&self, bytes: u64) -> OutsideRecord {
        ledger::record_outside_at(Some(self), None, bytes);
        OutsideRecord {
            at: At::Shared(self.clone()),
            bytes,
        }
    }
}

impl ProcessBudget {
    /// Record `bytes` allocated outside memgov for the whole process (and
    /// on no one device it tracks): charged here until the returned record
    /// is dropped. Never refused: see [`ContextHandle::report_outside`].
    pub fn report_outside(&self, bytes: u64) -> OutsideRecord {
        ledger::record_outside_at(None, Some(self), bytes);
        OutsideRecord {
            at: At::Process(self.clone()),
            bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::host::{HostConfig, HostContext};
    use crate::{Alloc, BudgetScope, ContextConfig, Governor, Role};

    #[test]
    fn outside_bytes_are_charged_while_recorded_even_over_the_limit() {
        let gov = Governor::new();
        let ctx = gov.register(
            HostContext::new(HostConfig::default()).unwrap(),
            ContextConfig::new().label("outside").budget(1024),
        );
        let a = ctx.report_outside(3000);
        let b = ctx.report_outside(500);
        let snap = ctx.snapshot();
        assert_eq!((snap.outside_bytes, snap.charged), (3500, 3500));
        assert_eq!(a.bytes(), 3000);
        drop(a);
        let snap = ctx.snapshot();
        assert_eq!((snap.outside_bytes, snap.charged), (500, 500));
        drop(b);
        let snap = ctx.snapshot();
        assert_eq!((snap.outside_bytes, snap.charged), (0, 0));
    }

    #[test]
    fn an_outside_record_takes_back_the_idle_leases() {
        const MIB: u64 = 1 << 20;
        let gov = Governor::new();
        let ctx = gov.register(
            HostContext::new(HostConfig::default()).unwrap(),
            ContextConfig::new()
                .budget(4 * MIB)
                .tuning(crate::Tuning::new().lease_chunk(2 * MIB)),
        );
        let s = ctx.create_stream("s").unwrap();
        // The stream's shard keeps a lease of the budget after this.
        drop(ctx.allocate(&s, Alloc::new(MIB, Role::Other)).unwrap());
        s.synchronize().unwrap();
        let _weights = ctx.report_outside(3 * MIB);
        let err = ctx
            .allocate(&s, Alloc::new(2 * MIB, Role::Other))
            .unwrap_err();
        let e = err.budget().unwrap();
        assert_eq!(
            (&e.scope, e.outside),
            (&BudgetScope::Context, 3 * MIB),
            "{err}"
        );
        drop(ctx.allocate(&s, Alloc::new(MIB, Role::Other)).unwrap());
    }
}
