//! Stream-ordered free and its retirement: `cuMemFreeAsync`, then
//! `cuLaunchHostFunc` whose callback fires the [`RetireSignal`].
//!
//! Page-locked host memory (`cuMemHostAlloc`) is freed with `cuMemFreeHost`,
//! which is synchronous: called at once it could free the buffer under a
//! copy still queued on the stream. So its free is queued the same way, as a
//! host function behind the stream's work, but that host function does not
//! free (it may make no CUDA call): it hands the buffer to the context's
//! free thread ([`memgov_backend::FreeThread`]), which calls `cuMemFreeHost`
//! and then fires the signal. The free runs after every copy queued before
//! it, the signal after the free, and teardown (which stops the free thread,
//! waits for every stream, then frees what the thread had not) never
//! destroys the context under one.
//!
//! The signal waits in the context's
//! [`PendingFrees`](crate::shared::PendingFrees) under a ticket, and the
//! host function carries only the ticket number: the core's
//! [`retire`](memgov_stream_ordered::retire) routes it back to the context
//! ([`Settle`]), parks and claims, and handles a failed launch and device
//! loss. CUDA's part is the table's entry point (`cuLaunchHostFunc` and its
//! trampoline, which makes no CUDA call: [`crate::table`]) and, here, what
//! settling a ticket means: retire a pool free's signal, or hand a
//! page-locked host free to the free thread.

use crate::shared::{HostFree, Shared};
use crate::{CudaContext, CudaMemory, CudaStream};
use cudarc::driver::sys;
use memgov_backend::{lock, BackendError, RetireSignal};
use memgov_stream_ordered::parts;
use memgov_stream_ordered::retire::{self, Queued, Settle};
use memgov_stream_ordered::table::Context as _;
use std::ffi::c_void;
use std::sync::Arc;

/// A host function ran on a driver thread once the free before it on the
/// stream has executed. It makes no CUDA call and takes short locks that no
/// driver call is made under.
impl Settle for Shared {
    fn settle(&self, ticket: u64, _ok: bool) {
        let host = lock(&self.pending.host_queued).remove(&ticket);
        if let Some((host, stream)) = host {
            // The stream has passed the buffer's last use; the free itself
            // is a driver call, which a host function may not make: the
            // free thread's (which settles the signal, if device loss has
            // not).
            self.pending.host.push(HostFree {
                ticket,
                host,
                stream,
            });
        } else if let Some(claim) = self.pending.waiting.claim(ticket) {
            // The governor's sink touches atomics and wakes waiters.
            claim.retire(self.probe());
        }
    }
}

impl Shared {
    /// Free the page-locked host buffers whose host function has run (the
    /// stream passed their last use) and the free thread has not taken, then
    /// fire their signals. Called by `synchronize` after its stream drained,
    /// and by teardown once every stream is synchronized.
    pub(crate) fn free_ready_host(&self, op: &'static str) -> Result<(), BackendError> {
        if self.pending.host.is_empty() || self.shell.is_dead() {
            return Ok(());
        }
        self.free_host(op, self.pending.host.take_queued())
    }

    /// `cuMemFreeHost` each of `frees`, then settle its signal. A context
    /// declared lost whose driver still answers frees them too (their
    /// signals, abandoned, are not fired); on a dead device nothing is
    /// freed: the buffers go with the context (and their signals were
    /// abandoned when it died). When the context cannot be made current the
    /// frees go back to the free thread's queue, for a later round or
    /// teardown.
    ///
    /// `cuMemFreeHost` is a potentially unsafe call, which a global-mode
    /// capture on any thread forbids: the frees pass through the capture
    /// gate, waiting while a capture is under way (the free thread, and
    /// teardown, wait; a `synchronize` on a thread whose own capture is
    /// under way is refused, its frees back in the queue).
    pub(crate) fn free_host(
        &self,
        op: &'static str,
        frees: Vec<HostFree>,
    ) -> Result<(), BackendError> {
        if frees.is_empty() || self.shell.is_dead() {
            return Ok(());
        }
        // Teardown cannot be refused: on the capturing thread it goes ahead
        // and the driver decides.
        let _call = match crate::shared::gate().call(op, op != "teardown") {
            Ok(c) => c,
            Err(e) => {
                self.pending.host.put_back(frees);
                return Err(e);
            }
        };
        let _current = match self.make_current(op) {
            Ok(c) => c,
            Err(e) => {
                self.pending.host.put_back(frees);
                return Err(e);
            }
        };
        let mut result = Ok(());
        for HostFree {
            ticket,
            host,
            stream,
        } in frees
        {
            // SAFETY: a page-locked allocation of this context, taken out of
            // the live set by its `free_async` and handed here once; the host
            // function queued behind its last use has run; the context is
            // current.
            let r = unsafe { sys::cuMemFreeHost(host as *mut c_void) };
            let freed = self.checked(op, "cuMemFreeHost", r);
            if let Some(claim) = self.pending.waiting.claim(ticket) {
                if freed.is_ok() {
                    claim.retire(self.probe());
                } else {
                    claim.abandon(self.probe());
                }
            }
            self.pending.host_unsettled.settle(stream);
            result = result.and(freed);
        }
        result
    }
}

/// A refused free: the memory and the signal go back to the caller, as
/// `DeviceContext::free_async` requires (hence the large `Err` variants,
/// which clippy flags).
/// A refused free: the memory and its signal handed back, with why.
type Refused = memgov_stream_ordered::parts::Refused<CudaMemory>;

impl CudaContext {
    // The shape of `DeviceContext::free_async`, which hands the memory and
    // the signal back on refusal.
    #[allow(clippy::result_large_err)]
    pub(crate) fn free_async_impl(
        &self,
        stream: &CudaStream,
        memory: CudaMemory,
        signal: RetireSignal,
    ) -> Result<(), Refused> {
        let s = &*self.parts.shared;
        // The free's checks, the memory out of the books, the context
        // current: the core's, as for an arena allocation.
        let (live, _current, memory, signal) =
            parts::begin_free(s, stream, memory, signal, "allocation")?;
        let host = live.host;
        if host == 0 {
            // SAFETY: the memory is a live allocation of this context, taken
            // out of the live set above so freed once; the stream is a live
            // stream of this context; the context is current.
            let r = unsafe { sys::cuMemFreeAsync(memory.device, stream.raw()) };
            if let Err(e) = s.checked("free_async", "cuMemFreeAsync", r) {
                lock(&s.live).insert(memory.id, live);
                return Err((memory, signal, e));
            }
        }
        // From here the free is queued (or, for page-locked host memory,
        // owned by the host function below and then the free thread): the
        // memory is no longer the caller's.
        // Counted before the launch: the free thread may settle it before
        // the launch has returned; settled on return unless handed on.
        let queued = (host != 0).then(|| s.pending.host_unsettled.add_guarded(stream.id()));
        let ticket = retire::next_ticket();
        if host != 0 {
            lock(&s.pending.host_queued).insert(ticket, (host, stream.id()));
        }
        let free_host_now = |_: &()| {
            if host == 0 {
                return true;
            }
            // The stream was synchronized: a page-locked host buffer is
            // freed now, on this (the caller's) thread, once no capture is
            // under way (on the capturing thread itself it goes ahead: the
            // memory is no longer the caller's to hand back).
            let _call = crate::shared::gate().call("free_async", false);
            // SAFETY: a live page-locked allocation of this context, taken
            // out of the live set above so freed once; every copy queued
            // before has completed (synchronized).
            let r = unsafe { sys::cuMemFreeHost(host as *mut c_void) };
            s.checked("free_async", "cuMemFreeHost", r).is_ok()
        };
        let owner = Arc::downgrade(&self.parts.shared);
        // SAFETY: the stream is a live stream of this context (checked);
        // the context is current; the free is queued (or the host buffer
        // owned by this release).
        let queued_behind = matches!(
            unsafe {
                retire::queue(
                    s,
                    s.probe(),
                    owner,
                    &s.pending.waiting,
                    stream.raw(),
                    (ticket, signal, memory.bytes, ()),
                    free_host_now,
                )
            },
            Queued::Behind
        );
        if !queued_behind {
            // The host function will not run: the buffer was freed above
            // (or, when device loss took the ticket first, is left to the
            // context).
            lock(&s.pending.host_queued).remove(&ticket);
        }
        if let Some(queued) = queued.filter(|_| queued_behind) {
            // The free thread settles it (`free_host`).
            queued.hand_on();
            // Started once; the host function wakes it.
            self.parts.shared.start_free_thread();
        }
        Ok(())
    }

    pub(crate) fn device_lost_impl(&self) {
        let s = &*self.parts.shared;
        s.shell.mark_lost(None);
        // Dropped unfired, with no lock held: the governor settles them as
        // abandoned.
        s.abandon_pending();
    }
}
