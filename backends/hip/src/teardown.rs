//! Teardown: [`HipContext::tear_down`], called by
//! [`DeviceContext::teardown`](memgov_backend::DeviceContext::teardown), and
//! the same release for a context dropped without it.

use crate::ffi::{self, hipStreamSynchronize};
use crate::memory::{self, Origin};
use crate::{retire, HipContext};
use memgov_backend::{lock, BackendError};
use memgov_stream_ordered::table::VmmTable;
use std::ffi::c_void;

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
        // anything here waits at the gate they hold closed.
        self.pins
            .end_stranded(&*self.shared, lost || self.shared.is_dead());
        // The arena first: its releases retire on the streams torn down below.
        let arena = self.arena_teardown(lost);
        let shared = &self.shared;
        shared.shell.close();
        if lost {
            shared.mark_lost("torn down as lost");
        }
        let result = if shared.is_lost() {
            // Every signal still held is dropped unfired; the fallback frees
            // the free thread had not started come back to be freed here
            // (their signals dropped too), and the thread is joined below.
            let taken = retire::abandon_all(shared);
            self.release_everything(taken)
        } else {
            let pending = self.pending_frees();
            if pending > 0 {
                shared.probe().violation(
                    "hip",
                    format!("teardown with {pending} stream-ordered frees not yet retired"),
                );
            }
            self.release_everything(Vec::new())
        };
        if shared.is_dead() {
            // A sticky code found mid-teardown: the frees still queued will
            // not execute, and their callbacks may never run. Their signals
            // are dropped now, not whenever the runtime gets to them.
            retire::abandon_all(shared);
        }
        retire::forget_routes(shared);
        shared.probe().torn_down_now();
        arena.and(result)
    }

    /// Synchronize and destroy the streams left, free the memory left (and
    /// the fallback frees a lost teardown took from the free thread), trim and
    /// destroy the pool. Stops calling HIP at the first sticky code (or at
    /// once on a dead device): what is left then dies with the device, and
    /// is only counted.
    fn release_everything(&self, taken: Vec<retire::Taken>) -> Result<(), BackendError> {
        let shared = &self.shared;
        // Teardown's synchronizes and frees are potentially unsafe calls:
        // they wait for the captures under way anywhere in the process to
        // end (on a capturing thread they go ahead: teardown cannot be
        // refused, and the runtime decides).
        let _call = crate::shared::gate().call("teardown", false);
        let mut first_err: Option<BackendError> = None;
        let mut keep = |r: Result<(), BackendError>| {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        };
        let streams: Vec<ffi::hipStream_t> =
            shared.streams.drain().into_iter().map(|(s, _)| s).collect();
        let left: Vec<(usize, (u64, Origin))> = lock(&shared.live).drain().collect();
        let device = if shared.is_dead() {
            None
        } else {
            match shared.make_current("teardown") {
                Ok(d) => Some(d),
                Err(e) => {
                    keep(Err(e));
                    None
                }
            }
        };
        if device.is_some() {
            for s in &streams {
                if shared.is_dead() {
                    break;
                }
                // SAFETY: the stream is alive (just taken out of the table).
                let r = unsafe { hipStreamSynchronize(*s) };
                keep(shared.checked("teardown", "hipStreamSynchronize", r));
            }
        }
        // The free thread finishes what is queued (or, on a dead device,
        // settles it without a call) and is joined: no thread of this
        // context calls HIP after teardown.
        retire::stop_free_thread(shared);
        for s in streams {
            if device.is_some() && !shared.is_dead() {
                keep(memgov_stream_ordered::stream::destroy_raw(
                    &**shared, "teardown", s,
                ));
            } else {
                shared.probe().stream_destroyed();
            }
        }
        if device.is_some() && !shared.is_dead() {
            for t in &taken {
                keep(retire::free_taken(shared, t));
            }
        }
        if device.is_some()
            && !shared.is_dead()
            && left.iter().any(|(_, (_, o))| *o == Origin::Pool)
        {
            keep(self.free_pool_leftovers(&left));
        }
        for (ptr, (bytes, origin)) in &left {
            if *origin != Origin::Pool && device.is_some() && !shared.is_dead() {
                // SAFETY: the pointer came from hipMalloc / hipHostMalloc of
                // this context, as its origin says; every stream is
                // synchronized and destroyed, so no work uses it.
                keep(unsafe { retire::free_synchronous(shared, "teardown", *ptr, *origin) });
            }
            shared.probe().freed(*bytes);
        }
        if let Some(pool) = shared.pool() {
            if device.is_some() && !shared.is_dead() {
                keep(memory::trim_pool(pool));
                if !shared.is_dead() {
                    keep(memory::destroy_pool(pool).map_err(|e| BackendError {
                        operation: "teardown",
                        ..e
                    }));
                }
            }
        }
        if shared.is_dead() {
            shared.note(
                "teardown stopped calling HIP at a sticky error: what was left dies with the device"
                    .to_owned(),
            );
        }
        drop(device);
        first_err.map_or(Ok(()), Err)
    }

    /// Pool allocations the governor abandoned (force): free them on a
    /// temporary stream and wait.
    fn free_pool_leftovers(&self, left: &[(usize, (u64, Origin))]) -> Result<(), BackendError> {
        // SAFETY: the caller (teardown) has the device current.
        let (r, s) = unsafe { <crate::result::Hip as VmmTable>::stream_create() };
        self.shared
            .checked("teardown", "hipStreamCreateWithFlags", r)?;
        let mut result = Ok(());
        for (ptr, (_, origin)) in left {
            if *origin == Origin::Pool && !self.shared.is_dead() {
                // SAFETY: the pointer came from hipMallocFromPoolAsync of
                // this context; every stream that used it is synchronized.
                let r = unsafe { ffi::hipFreeAsync(*ptr as *mut c_void, s) };
                result = result.and(self.shared.checked("teardown", "hipFreeAsync", r));
            }
        }
        if self.shared.is_dead() {
            return result;
        }
        // SAFETY: the temporary stream is alive until destroyed below.
        let r = unsafe { hipStreamSynchronize(s) };
        result = result.and(self.shared.checked("teardown", "hipStreamSynchronize", r));
        if self.shared.is_dead() {
            return result;
        }
        // SAFETY: synchronized above; nothing else knows this stream.
        let r = unsafe { ffi::hipStreamDestroy(s) };
        result.and(self.shared.checked("teardown", "hipStreamDestroy", r))
    }
}

/// A context dropped without `teardown` (a probe that only checked for a
/// device, a panic unwinding past it) is torn down here, as by
/// `teardown(false)` (or as lost, if it is): its pool, streams and memory are
/// released, and its free thread joined. The result has no one to go to; the
/// probe and `notes()` keep what went wrong.
impl Drop for HipContext {
    fn drop(&mut self) {
        if !self.shared.shell.is_closing() {
            let _ = self.close(false);
        }
    }
}
