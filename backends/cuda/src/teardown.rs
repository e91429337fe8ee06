//! Teardown: [`CudaContext::tear_down`], called by
//! [`DeviceContext::teardown`](memgov_backend::DeviceContext::teardown).

use crate::result::{check, Cuda};
use crate::shared::Live;
use crate::CudaContext;
use cudarc::driver::sys::{self, CUstream};
use memgov_backend::{lock, BackendError};
use memgov_stream_ordered::pool;
use memgov_stream_ordered::table::Context as _;
use memgov_stream_ordered::teardown::{self, FirstError};

/// What a lost teardown whose drain timed out keeps, and how to reclaim
/// it ([`teardown::drain_lost`]'s message).
const KEPT: &str = "the primary context reference (with memgov's allocations) is kept rather \
                    than released under running work; reset the device \
                    (cuDevicePrimaryCtxReset) to reclaim it";

impl CudaContext {
    pub(crate) fn tear_down(self, lost: bool) -> Result<(), BackendError> {
        let s = &*self.parts.shared;
        // No new work from here on; and first of all: no backend thread
        // calls the driver from here on but this one, and none after
        // teardown returns.
        s.shell.close();
        s.stop_free_thread();
        // Teardown's synchronizes and frees (`cuMemFreeHost` among them)
        // are potentially unsafe calls: they wait for the captures under
        // way anywhere in the process to end. On a thread whose own capture
        // is under way they go ahead (teardown cannot be refused) and the
        // driver decides.
        let _call = crate::shared::gate().call("teardown", false);
        let mut errors = FirstError::default();
        let lost = lost || s.is_lost();
        if lost {
            self.teardown_lost(&mut errors);
        } else {
            // Every stream is synchronized below before anything is freed.
            teardown::report_pending(s, s.pending.len(), "still pending");
            self.release_all(&mut errors);
        }
        // A host function the driver never runs (a dead device) leaves its
        // route behind.
        teardown::finish(s);
        errors.into_result()
    }

    /// Give everything back to a driver that answers, then release the
    /// reference to the primary context: synchronize and destroy every
    /// stream, free page-locked host memory and what a forced retire left
    /// live, trim and destroy memgov's pool. Nothing of memgov's is queued or
    /// allocated in the context when the reference goes.
    fn release_all(&self, errors: &mut FirstError) {
        let s = &*self.parts.shared;
        let current = match s.make_current("teardown") {
            Ok(c) => Some(c),
            Err(e) => {
                errors.keep(Err(e));
                None
            }
        };
        let streams = s.streams.drain();
        let raw: Vec<CUstream> = streams.iter().map(|&(raw, _)| raw).collect();
        teardown::sync_streams(s, "teardown", &raw, errors);
        // Destroyed streams whose work may still run (CUDA retires them:
        // `cuStreamDestroy` returns before their host functions ran): wait,
        // then destroy, before the leftovers are freed (that work may use
        // them).
        teardown::destroy_retired(s, "teardown", errors);
        // Page-locked host frees whose host function ran (every stream was
        // synchronized above) and that the stopped free thread had not done.
        errors.keep(s.free_ready_host("teardown"));
        // Memory a forced retire left live: free it on a stream of its own
        // and wait, so the pool gets it back before the context goes. Every
        // stream that used it was synchronized above, which orders the frees
        // after that use. Page-locked host memory is freed at once, for the
        // same reason.
        let (host, leftover): (Vec<Live>, Vec<Live>) = lock(&s.live)
            .drain()
            .map(|(_, l)| l)
            .partition(|l| l.host != 0);
        for l in host {
            // SAFETY: a live page-locked allocation of this context, drained
            // from the live set so freed once; every stream that used it was
            // synchronized; the context is current.
            let r = unsafe { sys::cuMemFreeHost(l.host as *mut std::ffi::c_void) };
            match s.checked("teardown", "cuMemFreeHost", r) {
                Ok(()) => s.probe().freed(l.bytes),
                Err(e) => errors.keep(Err(e)),
            }
        }
        if !leftover.is_empty() {
            let leftover = leftover.iter().map(|l| (l.ptr, l.bytes));
            errors.keep(teardown::free_leftovers(s, "teardown", leftover, |bytes| {
                s.probe().freed(bytes)
            }));
        }
        // Those memgov created (an adopted one is the runtime's).
        teardown::destroy_streams(s, "teardown", streams, true, errors);
        for claim in s.pending.waiting.claim_all() {
            claim.abandon(s.probe());
        }
        // SAFETY: memgov's own pool, destroyed once, here; every allocation
        // from it was freed and every free has executed (all streams
        // synchronized); the context is current.
        unsafe { pool::release(s, "teardown", s.pool, errors) };
        // The thread's previous context is current again before the release.
        drop(current);
        if s.retained {
            // SAFETY: balanced with the retain in `new`; every stream memgov
            // queued work on was synchronized, so no free or host function
            // of memgov's is pending and no memory of memgov's is allocated.
            let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(s.cu_device) };
            errors.keep(s.checked("teardown", "cuDevicePrimaryCtxRelease_v2", r));
        }
    }

    /// Teardown of a lost context. The pending frees' signals are dropped
    /// unfired (the governor settles them as abandoned); what happens to the
    /// memory depends on whether the driver still answers:
    ///
    /// * when only the caller declared the loss and the driver still answers,
    ///   the queued work of memgov's streams is waited for, polled with
    ///   `cuStreamQuery` (no blocking call) for at most the core's
    ///   `LOST_DRAIN` ([`teardown::drain_lost`]); then
    ///   everything is given back as in a healthy teardown ([`release_all`]:
    ///   live allocations freed, page-locked host memory freed, streams and
    ///   the pool destroyed) before the reference to the primary context is
    ///   released, so nothing of memgov's stays allocated in a context the
    ///   runtime may still hold. If the work is still running at the
    ///   deadline, nothing is freed and the reference is kept (freeing or
    ///   releasing under running work is undefined) and the error says so;
    /// * when the driver reported the loss (a sticky error), nothing can be
    ///   freed: queued work no longer executes and every call fails. memgov's
    ///   allocations and streams go with its reference to the primary
    ///   context, which is released at once (the last reference destroys the
    ///   context with them; a runtime still holding it resets the device).
    ///
    /// An adopted context is the runtime's: its reference is never released.
    /// With the driver answering, memgov's memory in it is still freed.
    ///
    /// [`release_all`]: Self::release_all
    fn teardown_lost(&self, errors: &mut FirstError) {
        let s = &*self.parts.shared;
        s.shell.mark_lost(None);
        s.abandon_pending();
        if !s.shell.is_dead() {
            // Unlike HIP, which releases a lost context's memory at once
            // (it has no primary context a runtime may still hold), CUDA
            // waits for the queued work of memgov's streams first.
            match teardown::drain_lost(s, "teardown", KEPT) {
                Ok(()) if !s.shell.is_dead() => {
                    // Nothing of memgov's runs on the device any more: give
                    // everything back, then release the reference.
                    self.release_all(errors);
                    return;
                }
                // A sticky error while draining: the device really is gone.
                Ok(()) => {}
                Err(e) => {
                    // Still running at the deadline: free nothing, keep the
                    // reference (with memgov's allocations) rather than
                    // release it under running work.
                    errors.keep(Err(e));
                    self.forget_all();
                    return;
                }
            }
        }
        self.forget_all();
        // SAFETY: memgov's own pool, destroyed once, here. The call does not
        // wait: with allocations or frees outstanding the driver releases the
        // pool once they are gone (with the context, when it is released
        // below). On a device in the sticky state it fails harmlessly.
        let _ = unsafe { pool::destroy::<Cuda>("teardown", s.pool) };
        if s.retained {
            // SAFETY: balanced with the retain in `new`; the device no longer
            // executes any work (a sticky error). Releasing the last
            // reference destroys the context with memgov's allocations and
            // streams.
            let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(s.cu_device) };
            errors.keep(check("teardown", "cuDevicePrimaryCtxRelease_v2", r));
        }
    }

    /// Count memgov's allocations and streams as gone without calling the
    /// driver: on a dead device they go with the context; on one still
    /// running memgov's work at the drain deadline they stay with the
    /// reference teardown keeps.
    fn forget_all(&self) {
        let s = &*self.parts.shared;
        let live: Vec<u64> = lock(&s.live).drain().map(|(_, l)| l.bytes).collect();
        teardown::forget_all(s, live);
    }
}
