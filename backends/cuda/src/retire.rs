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
//! The signal does not travel through the driver: it waits in the context's
//! [`PendingFrees`] under a ticket ([`memgov_backend::Tickets`]), and the
//! host function carries only the ticket (and an `Arc` of the table). So a
//! signal is reachable from both sides, and exactly one side takes it:
//!
//! * the host function, on the driver's callback thread, when the free has
//!   executed: it takes the signal and fires it. It makes no CUDA call (the
//!   driver forbids calls from host functions) and takes one short lock that
//!   no driver call is ever made under;
//! * `device_lost`, when the governor declares the device lost: it takes every
//!   signal still waiting and drops it unfired (abandoned). A host function
//!   that runs later finds its ticket gone and does nothing.
//!
//! If `cuLaunchHostFunc` fails after the free was queued, the free still
//! happens and the memory is no longer the caller's, so `free_async` cannot
//! refuse: it synchronizes the stream instead (the free has then executed)
//! and fires the signal itself; if that wait fails too (or the launch failed
//! with a device-lost code) the signal is dropped unfired, as for a lost
//! device. Either way `free_async` returns `Ok`.

use crate::result::BACKEND;
use crate::shared::{HostFree, Live, PendingFrees, Shared};
use crate::{CudaContext, CudaMemory, CudaStream};
use cudarc::driver::sys;
use memgov_backend::shell::Current;
use memgov_backend::{lock, BackendError, BackendErrorKind, BackendProbe, RetireSignal, Tickets};
use std::ffi::c_void;
use std::sync::Arc;

/// What one host function carries: boxed, handed to the driver as
/// `userData`, and reclaimed by the callback (or by `free_async` when the
/// launch fails).
struct HostFnData {
    pending: Arc<PendingFrees>,
    probe: BackendProbe,
    ticket: u64,
    /// For a page-locked host free: the host address and the stream's id.
    host: Option<(usize, u64)>,
}

/// The host function. Runs on a driver thread once the free before it on
/// the stream has executed.
///
/// # Safety
///
/// `user` is a pointer from `Box::into_raw(Box<HostFnData>)` handed to
/// exactly one successful `cuLaunchHostFunc`; the driver calls this once.
unsafe extern "C" fn free_retired(user: *mut c_void) {
    // SAFETY: see the function's contract; the box is reclaimed once.
    let data = unsafe { Box::from_raw(user.cast::<HostFnData>()) };
    if let Some((host, stream)) = data.host {
        // The stream has passed the buffer's last use; the free itself is a
        // driver call, which a host function may not make: the free
        // thread's.
        data.pending.host.push(HostFree {
            ticket: data.ticket,
            host,
            stream,
        });
        return;
    }
    if let Some(claim) = data.pending.waiting.claim(data.ticket) {
        // The governor's sink touches atomics and wakes waiters only.
        claim.retire(&data.probe);
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
pub(crate) type Refused = (CudaMemory, RetireSignal, BackendError);

impl Shared {
    /// The first steps of every `free_async` (pool, page-locked host,
    /// arena): refuse on a lost context or a stream not of this context,
    /// take `memory` out of the live set (so a second free, or another
    /// context's memory, never reaches the driver), and make the context
    /// current. On refusal the memory and the signal go back to the caller
    /// and the live set is as it was. `what` names the memory in messages.
    #[allow(clippy::result_large_err)]
    pub(crate) fn begin_free(
        &self,
        stream: &CudaStream,
        memory: CudaMemory,
        signal: RetireSignal,
        what: &str,
    ) -> Result<(Live, Current<'_, Self>, CudaMemory, RetireSignal), Refused> {
        if let Err(e) = self
            .check_usable("free_async")
            .and_then(|()| self.check_stream("free_async", stream))
        {
            return Err((memory, signal, e));
        }
        let live = (memory.context == self.id)
            .then(|| lock(&self.live).remove(&memory.id))
            .flatten();
        let Some(live) = live else {
            // Another context's memory is the caller's mistake, refused
            // below and reported to the caller only; an allocation of this
            // context that is no longer live is a second free, which the
            // probe counts.
            if memory.context == self.id {
                self.probe().violation(
                    BACKEND,
                    format!(
                        "free_async of {what} {} (context {}) that is not live in context {}",
                        memory.id, memory.context, self.id
                    ),
                );
            }
            let e = crate::result::err(
                "free_async",
                BackendErrorKind::InvalidArgument,
                format!(
                    "{what} {} ({} B at {:#x}) is not live in CUDA context {} (freed \
                     already, or another context's)",
                    memory.id, memory.bytes, memory.ptr, self.id
                ),
            );
            return Err((memory, signal, e));
        };
        match self.make_current("free_async") {
            Ok(current) => Ok((live, current, memory, signal)),
            Err(e) => {
                lock(&self.live).insert(memory.id, live);
                Err((memory, signal, e))
            }
        }
    }

    /// Queue the host function `settle(data)` on `stream` behind a free
    /// whose signal is parked in `tickets` under `ticket`. Returns whether
    /// it was queued. If the launch fails the free is queued already and
    /// the memory is no longer the caller's, so nothing is refused: unless
    /// the launch reported a lost device, the stream is synchronized (the
    /// free has then executed), `finish` completes the release on this
    /// thread (`false`: it failed) and the signal fires; otherwise it is
    /// dropped unfired. A ticket device loss claimed already is left alone.
    /// The context must be current.
    ///
    /// # Safety
    ///
    /// `settle` upholds the host-function rules (no CUDA call) and reclaims
    /// `data` with `Box::from_raw` exactly once; `stream` is a live stream
    /// of this context.
    pub(crate) unsafe fn launch_settle<D, T>(
        &self,
        stream: sys::CUstream,
        settle: unsafe extern "C" fn(*mut c_void),
        data: D,
        tickets: &Tickets<T>,
        ticket: u64,
        finish: impl FnOnce(&T) -> bool,
    ) -> bool {
        let data = Box::into_raw(Box::new(data));
        // SAFETY: the caller's contract: `settle` makes no CUDA call and
        // reclaims `data`, a fresh box handed to this launch only; the
        // stream is live and the context current.
        let r = unsafe { sys::cuLaunchHostFunc(stream, Some(settle), data.cast()) };
        if r == sys::CUresult::CUDA_SUCCESS {
            return true;
        }
        // SAFETY: the launch failed, so the driver never took `data`.
        drop(unsafe { Box::from_raw(data) });
        let launch = self.checked("free_async", "cuLaunchHostFunc", r);
        let Some(claim) = tickets.claim(ticket) else {
            // `device_lost` took it already (and abandoned it).
            return false;
        };
        if !launch.is_err_and(|e| e.is_device_lost()) {
            // SAFETY: the stream is live; the context is current.
            let r = unsafe { sys::cuStreamSynchronize(stream) };
            if self.checked("free_async", "cuStreamSynchronize", r).is_ok() {
                // The stream has passed the memory's last use.
                if finish(claim.item()) {
                    claim.retire(self.probe());
                } else {
                    claim.abandon(self.probe());
                }
                return false;
            }
        }
        claim.abandon(self.probe());
        false
    }
}

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
        let s = &*self.shared;
        let (live, _current, memory, signal) =
            s.begin_free(stream, memory, signal, "allocation")?;
        let host = live.host;
        if host == 0 {
            // SAFETY: the memory is a live allocation of this context, taken
            // out of the live set above so freed once; the stream is a live
            // stream of this context; the context is current.
            let r = unsafe { sys::cuMemFreeAsync(memory.ptr, stream.raw) };
            if let Err(e) = s.checked("free_async", "cuMemFreeAsync", r) {
                lock(&s.live).insert(memory.id, live);
                return Err((memory, signal, e));
            }
        }
        // From here the free is queued (or, for page-locked host memory,
        // owned by the host function below and then the free thread): the
        // memory is no longer the caller's.
        let ticket = s.next_id();
        s.pending.waiting.park(ticket, signal, memory.bytes, ());
        // Counted before the launch: the free thread may settle it before
        // the launch has returned; settled on return unless handed on.
        let queued = (host != 0).then(|| s.pending.host_unsettled.add_guarded(stream.id));
        let data = HostFnData {
            pending: s.pending.clone(),
            probe: s.probe().clone(),
            ticket,
            host: (host != 0).then_some((host, stream.id)),
        };
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
        // SAFETY: `free_retired` makes no CUDA call and reclaims its box
        // once; the stream is a live stream of this context (checked).
        let launched = unsafe {
            s.launch_settle(
                stream.raw,
                free_retired,
                data,
                &s.pending.waiting,
                ticket,
                free_host_now,
            )
        };
        if let Some(queued) = queued.filter(|_| launched) {
            // The free thread settles it (`free_host`).
            queued.hand_on();
            // Started once; the host function wakes it.
            self.shared.start_free_thread();
        }
        Ok(())
    }

    pub(crate) fn device_lost_impl(&self) {
        let s = &*self.shared;
        s.shell.mark_lost(None);
        // Dropped unfired, with no lock held: the governor settles them as
        // abandoned.
        s.abandon_pending();
    }
}
