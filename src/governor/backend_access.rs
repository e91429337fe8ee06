//! Reaching a registered context's backend for one call that the governor's
//! own API does not make.
//!
//! Some backends offer operations the generic [`DeviceContext`] trait has no
//! word for (CUDA's stream capture into a graph, say). Code layered on the
//! governor for one backend needs that backend's value while the governor
//! owns it, and needs the same guarantee every governed call has: the
//! backend is not torn down, forced or moved out from under the call.
//! [`ContextHandle::with_backend`] gives exactly that and nothing more.

use super::error::GovernorError;
use super::handle::ContextHandle;
use crate::DeviceContext;

impl<C: DeviceContext> ContextHandle<C> {
    /// Run `f` with the context's backend, under the same claim on the
    /// context that every governed backend call holds: teardown and `force`
    /// wait for `f` to return before they touch the backend. No lock of the
    /// governor is held while `f` runs.
    ///
    /// Refused, without calling `f`, once the context is retiring, torn
    /// down or lost (the error is the one an allocation gets then).
    ///
    /// `f` must not:
    /// * free, or hand to anyone else, memory the governor allocated (its
    ///   buffers are released through the governor only);
    /// * destroy the backend's streams the governor created;
    /// * wait for this context's retirement ([`RetireHandle::wait`]): the
    ///   teardown it waits for waits for `f`;
    /// * run for long: a `force` waits for it.
    ///
    /// Memory `f` allocates outside the governor is not charged to any
    /// budget; charge it with a [`reserve`](Self::reserve) made before, or
    /// record it with [`report_outside`](Self::report_outside).
    ///
    /// ```
    /// use memgov::{ContextConfig, DeviceContext, Governor, host::{HostConfig, HostContext}};
    /// let gov = Governor::new();
    /// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new());
    /// let total = ctx.with_backend(|backend| backend.memory_info().map(|m| m.total))??;
    /// assert!(total > 0);
    /// ctx.retire();
    /// assert!(ctx.with_backend(|_| ()).is_err(), "refused once retiring");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// [`RetireHandle::wait`]: super::RetireHandle::wait
    pub fn with_backend<R>(&self, f: impl FnOnce(&C) -> R) -> Result<R, GovernorError> {
        let ctx = &*self.inner;
        if !ctx.accepting() {
            return Err(ctx.unavailable_error());
        }
        // The guard's claim keeps `finish` and `force` away until it drops,
        // after `f` returned (or unwound).
        let backend = ctx.enter().ok_or_else(|| ctx.unavailable_error())?;
        Ok(f(&backend))
    }
}

#[cfg(test)]
mod tests {
    use crate::host::{HostConfig, HostContext};
    use crate::{ContextConfig, DeviceContext, Governor, GovernorError};
    use std::time::{Duration, Instant};

    #[test]
    fn the_backend_is_reached_until_retire_and_refused_after() {
        let gov = Governor::new();
        let ctx = gov.register(
            HostContext::new(HostConfig::default()).unwrap(),
            ContextConfig::new(),
        );
        let total = ctx
            .with_backend(|b| b.memory_info().unwrap().total)
            .unwrap();
        assert!(total > 0);
        ctx.mark_lost("test");
        let err = ctx.with_backend(|_| panic!("not called")).unwrap_err();
        assert!(matches!(err, GovernorError::DeviceLost { .. }), "{err}");
    }

    #[test]
    fn a_retiring_context_refuses_and_teardown_waits_for_nothing_it_refused() {
        let gov = Governor::new();
        let ctx = gov.register(
            HostContext::new(HostConfig::default()).unwrap(),
            ContextConfig::new(),
        );
        let retire = ctx.retire();
        let err = ctx.with_backend(|_| panic!("not called")).unwrap_err();
        assert!(matches!(err, GovernorError::Pin { .. }), "{err}");
        retire
            .wait(Instant::now() + Duration::from_secs(5))
            .expect("nothing holds the context");
    }
}
