//! Teardown: [`HipContext::tear_down`], called by
//! [`DeviceContext::teardown`](memgov_backend::DeviceContext::teardown), and
//! the same release for a context dropped without it.

use crate::ffi;
use crate::memory::Origin;
use crate::{retire, HipContext};
use memgov_backend::{lock, BackendError};
use memgov_stream_ordered::pool;
use memgov_stream_ordered::table::Context as _;
use memgov_stream_ordered::teardown::{self, FirstError};

impl HipContext {
    /// Stop and join the free thread, synchronize and destroy the streams the
    /// governor left, free what it abandoned, trim and destroy the pool
    /// (see the crate documentation for a lost or dead device).
    pub(crate) fn tear_down(self, lost: bool) -> Result<(), BackendError> {
        // `close` does the work; the `Drop` that follows finds the context
        // closed and does nothing.
        self.close(lost)
    }

    /// Teardown proper; the first call closes the context, and `Drop` does
    /// nothing after it.
    fn close(&self, lost: bool) -> Result<(), BackendError> {
        // Captures a failed end left live: ended (or abandoned) before
        // anything here waits at the gate they hold closed. The arena
        // first: its releases retire on the streams torn down below.
        let dead = lost || self.parts.shared.is_dead();
        let graphs_lost = dead || self.parts.shared.is_lost();
        let arena =
            self.parts
                .close_captures_and_arena(lost, (dead, graphs_lost), "HipGraph::destroy");
        let shared = &self.parts.shared;
        shared.shell.close();
        if lost {
            shared.mark_lost("torn down as lost");
        }
        let result = if shared.is_lost() {
            // Every signal still held is dropped unfired; the fallback frees
            // the free thread had not started come back to be freed here
            // (their signals dropped too), and the thread is joined below.
            // Unlike CUDA (the core's `drain_lost`), no drain first: HIP
            // gives back at once what a device still answering takes (its
            // blocking synchronizes), stops at a sticky code, and never
            // calls `hipDeviceReset` (the process's other users' memory).
            let taken = retire::abandon_all(shared);
            self.release_everything(taken)
        } else {
            teardown::report_pending(&**shared, self.pending_frees(), "not yet retired");
            self.release_everything(Vec::new())
        };
        if shared.is_dead() {
            // A sticky code found mid-teardown: the frees still queued will
            // not execute, and their callbacks may never run. Their signals
            // are dropped now, not whenever the runtime gets to them.
            retire::abandon_all(shared);
        }
        teardown::finish(&**shared);
        arena.and(result)
    }

    /// Synchronize and destroy the streams left, free the memory left (and
    /// the fallback frees a lost teardown took from the free thread), trim and
    /// destroy the pool. Stops calling HIP at the first sticky code (or at
    /// once on a dead device): what is left then dies with the device, and
    /// is only counted.
    fn release_everything(&self, taken: Vec<retire::Taken>) -> Result<(), BackendError> {
        let shared = &self.parts.shared;
        // Teardown's synchronizes and frees are potentially unsafe calls:
        // they wait for the captures under way anywhere in the process to
        // end (on a capturing thread they go ahead: teardown cannot be
        // refused, and the runtime decides).
        let _call = crate::shared::gate().call("teardown", false);
        let mut errors = FirstError::default();
        let streams = shared.streams.drain();
        let left: Vec<(usize, (u64, Origin))> = lock(&shared.live).drain().collect();
        let device = if shared.is_dead() {
            None
        } else {
            match shared.make_current("teardown") {
                Ok(d) => Some(d),
                Err(e) => {
                    errors.keep(Err(e));
                    None
                }
            }
        };
        if device.is_some() {
            let raw: Vec<ffi::hipStream_t> = streams.iter().map(|&(s, _)| s).collect();
            teardown::sync_streams(&**shared, "teardown", &raw, &mut errors);
        }
        // The free thread finishes what is queued (or, on a dead device,
        // settles it without a call) and is joined: no thread of this
        // context calls HIP after teardown.
        retire::stop_free_thread(shared);
        teardown::destroy_streams(
            &**shared,
            "teardown",
            streams,
            device.is_some(),
            &mut errors,
        );
        if device.is_some() && !shared.is_dead() {
            for t in &taken {
                errors.keep(retire::free_taken(shared, t));
            }
        }
        if device.is_some()
            && !shared.is_dead()
            && left.iter().any(|(_, (_, o))| *o == Origin::Pool)
        {
            // Counted as freed with the rest below, whatever the free says.
            let pool = left.iter().filter(|(_, (_, o))| *o == Origin::Pool);
            let pool = pool.map(|&(ptr, (bytes, _))| (ptr as u64, bytes));
            errors.keep(teardown::free_leftovers(
                &**shared,
                "teardown",
                pool,
                |_| (),
            ));
        }
        for (ptr, (bytes, origin)) in &left {
            if *origin != Origin::Pool && device.is_some() && !shared.is_dead() {
                // SAFETY: the pointer came from hipMalloc / hipHostMalloc of
                // this context, as its origin says; every stream is
                // synchronized and destroyed, so no work uses it.
                errors.keep(unsafe { retire::free_synchronous(shared, "teardown", *ptr, *origin) });
            }
            shared.probe().freed(*bytes);
        }
        if let (Some(pool), Some(_)) = (shared.pool(), &device) {
            // SAFETY: the context's own pool, destroyed once, here; every
            // allocation from it was freed and every free executed (the
            // streams synchronized); the device is current.
            unsafe { pool::release(&**shared, "teardown", pool.0, &mut errors) };
        }
        if shared.is_dead() {
            shared.note(
                "teardown stopped calling HIP at a sticky error: what was left dies with the device"
                    .to_owned(),
            );
        }
        drop(device);
        errors.into_result()
    }
}

/// A context dropped without `teardown` (a probe that only checked for a
/// device, a panic unwinding past it) is torn down here, as by
/// `teardown(false)` (or as lost, if it is): its pool, streams and memory are
/// released, and its free thread joined. The result has no one to go to; the
/// probe and `notes()` keep what went wrong.
impl Drop for HipContext {
    fn drop(&mut self) {
        if !self.parts.shared.shell.is_closing() {
            let _ = self.close(false);
        }
    }
}
