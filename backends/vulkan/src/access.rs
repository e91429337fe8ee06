//! The device-access gate: what lets a stream or gate handle, which can
//! outlive its context, call into the device only while the device exists.
//!
//! A `VulkanStream` is a plain value the caller owns
//! (and the governor lends out by reference from `GovernedStream::raw`), so
//! it can still be in reach when its context is torn down, even on another
//! thread during a force-retire. Teardown destroys the device and, with the
//! instance, unloads the driver: after that, any call through the device's
//! function table jumps into unmapped code. Every call that such a handle
//! makes on the device therefore holds a [`DeviceUse`] for its whole
//! duration; teardown [closes](DeviceAccess::close_and_drain) the gate and
//! waits for the uses in flight to end before it touches anything. A use
//! attempted after that is refused with an error.
//!
//! The calls that pass through it do not block on the device (they query,
//! create a semaphore, or submit), so teardown's wait is short. No lock is
//! held across a device call: the count is one atomic word; the mutex below
//! only carries the "last use ended" wake-up to teardown.

use crate::result::err;
use memgov_backend::lock;
use memgov_backend::{BackendError, BackendErrorKind};
use memgov_sync::{AcquireError, ClaimCounter, MAX_CLAIMS};
use std::sync::{Condvar, Mutex};

/// Counts device uses by handles, with a closed bit (see the module docs).
pub(crate) struct DeviceAccess {
    uses: ClaimCounter,
    /// Set by the use that ends last after closing (exactly one does).
    drained: Mutex<bool>,
    drained_cv: Condvar,
}

impl DeviceAccess {
    pub(crate) fn new() -> Self {
        Self {
            uses: ClaimCounter::new(MAX_CLAIMS),
            drained: Mutex::new(false),
            drained_cv: Condvar::new(),
        }
    }

    /// Begin a device call on behalf of a handle, or refuse it once teardown
    /// has begun. The device stays alive until the returned use is dropped.
    pub(crate) fn enter(&self, op: &'static str) -> Result<DeviceUse<'_>, BackendError> {
        match self.uses.try_acquire() {
            Ok(()) => Ok(DeviceUse(self)),
            Err(AcquireError::Closed) => Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                "the stream's context has been torn down (or is being): its device is gone; use a stream of a live context",
            )),
            Err(AcquireError::Overflow) => Err(err(
                op,
                BackendErrorKind::Other,
                format!("{MAX_CLAIMS} device uses in flight at once; this cannot happen without a leak of DeviceUse"),
            )),
        }
    }

    /// Refuse every later [`enter`](Self::enter) and wait until every use in
    /// flight has ended. Called once, by teardown, before it destroys
    /// anything.
    pub(crate) fn close_and_drain(&self) {
        if self.uses.close() {
            return;
        }
        let mut drained = lock(&self.drained);
        while !*drained {
            drained = self
                .drained_cv
                .wait(drained)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    fn leave(&self) {
        if self.uses.release() {
            // The last use of a closed gate: exactly one caller gets here.
            *lock(&self.drained) = true;
            self.drained_cv.notify_all();
        }
    }
}

/// One device call in flight on behalf of a handle (see [`DeviceAccess`]).
pub(crate) struct DeviceUse<'a>(&'a DeviceAccess);

impl Drop for DeviceUse<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn closing_refuses_new_uses_and_waits_for_those_in_flight() {
        let access = Arc::new(DeviceAccess::new());
        let held = access.enter("test").expect("open gate");
        let closer = {
            let a = access.clone();
            std::thread::spawn(move || a.close_and_drain())
        };
        // The closer cannot return while `held` is alive.
        std::thread::sleep(Duration::from_millis(50));
        assert!(!closer.is_finished(), "teardown did not wait for the use");
        while !access.uses.is_closed() {
            std::thread::yield_now();
        }
        let refused = access.enter("test").err().expect("closed gate refuses");
        assert_eq!(refused.kind, BackendErrorKind::InvalidArgument);
        assert!(refused.message.contains("torn down"), "{refused}");
        drop(held);
        closer.join().unwrap();
        assert!(access.uses.is_drained());
    }

    #[test]
    fn closing_an_idle_gate_returns_at_once() {
        let access = DeviceAccess::new();
        drop(access.enter("test").unwrap());
        access.close_and_drain();
        assert!(access.enter("test").is_err());
    }
}
