//! Stream-ordered free and its retirement: `cuMemFreeAsync`, then
//! `cuLaunchHostFunc` whose callback fires the [`RetireSignal`].
//!
//! Page-locked host memory (`cuMemHostAlloc`) is freed with `cuMemFreeHost`,
//! which is synchronous: called at once it could free the buffer under a
//! copy still queued on the stream. So its free is queued the same way, as a
//! host function behind the stream's work, but that host function does not
//! free (it may make no CUDA call): it hands the buffer to the context's
//! watcher thread and wakes it, and the watcher calls `cuMemFreeHost` and
//! then fires the signal. The free runs after every copy queued before it,
//! the signal after the free, and teardown (which stops the watcher, waits
//! for every stream, then frees what the watcher had not) never destroys the
//! context under one.
//!
//! The signal does not travel through the driver: it waits in the context's
//! [`PendingFrees`] under a ticket, and the host function carries only the
//! ticket (and an `Arc` of the table). So a signal is reachable from both
//! sides, and exactly one side takes it:
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
use crate::shared::{Shared, Watch};
use crate::{CudaContext, CudaMemory, CudaStream};
use cudarc::driver::sys;
use memgov_backend::lock;
use memgov_backend::{BackendError, BackendProbe, RetireSignal};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex};

/// Signals of frees queued on the device whose host function has not run.
#[derive(Default)]
pub(crate) struct PendingFrees {
    waiting: Mutex<HashMap<u64, (RetireSignal, u64)>>,
    /// Page-locked host frees whose host function has run: (ticket, host
    /// address, stream id), for the watcher (or teardown, or a
    /// `synchronize`) to `cuMemFreeHost`.
    host_ready: Mutex<Vec<(u64, usize, u64)>>,
    /// Page-locked host frees queued per stream whose signal has not been
    /// settled: `synchronize` waits for its stream's to reach none, since
    /// their free runs off the stream (on the watcher) after the stream has
    /// passed it.
    host_queued: Mutex<HashMap<u64, u64>>,
    host_settled: Condvar,
}

impl PendingFrees {
    fn park(&self, ticket: u64, signal: RetireSignal, bytes: u64) {
        lock(&self.waiting).insert(ticket, (signal, bytes));
    }

    fn take(&self, ticket: u64) -> Option<(RetireSignal, u64)> {
        lock(&self.waiting).remove(&ticket)
    }

    /// Every waiting signal, removed (to drop after the lock is released).
    pub(crate) fn take_all(&self) -> Vec<(RetireSignal, u64)> {
        lock(&self.waiting).drain().map(|(_, v)| v).collect()
    }

    pub(crate) fn len(&self) -> usize {
        lock(&self.waiting).len()
    }

    /// Whether page-locked host frees wait for the watcher.
    pub(crate) fn host_ready(&self) -> bool {
        !lock(&self.host_ready).is_empty()
    }

    /// The page-locked host frees whose host function has run, removed.
    pub(crate) fn take_host_ready(&self) -> Vec<(u64, usize, u64)> {
        std::mem::take(&mut *lock(&self.host_ready))
    }

    /// A page-locked host free was queued on `stream`.
    fn host_queued(&self, stream: u64) {
        *lock(&self.host_queued).entry(stream).or_default() += 1;
    }

    /// A page-locked host free queued on `stream` settled (its signal fired
    /// or was dropped).
    fn host_settled(&self, stream: u64) {
        let mut q = lock(&self.host_queued);
        if let Some(n) = q.get_mut(&stream) {
            *n -= 1;
            if *n == 0 {
                q.remove(&stream);
            }
        }
        drop(q);
        self.host_settled.notify_all();
    }

    /// Forget every queued page-locked host free (their signals were
    /// abandoned) and wake the waiters.
    pub(crate) fn clear_host_queued(&self) {
        lock(&self.host_queued).clear();
        self.host_settled.notify_all();
    }

    /// Block until every page-locked host free queued on `stream` so far has
    /// settled, or `lost` holds (then nothing more settles: the signals are
    /// abandoned). Looks at `lost` again at least every `WATCH_INTERVAL`.
    pub(crate) fn wait_host(&self, stream: u64, lost: impl Fn() -> bool) {
        let mut q = lock(&self.host_queued);
        while q.contains_key(&stream) && !lost() {
            q = self
                .host_settled
                .wait_timeout(q, crate::shared::WATCH_INTERVAL)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

/// A page-locked host free counted as queued on its stream until `free_async`
/// hands it on (forgotten) or settles it itself (dropped).
struct HostQueued<'a> {
    pending: &'a PendingFrees,
    stream: u64,
}

impl Drop for HostQueued<'_> {
    fn drop(&mut self) {
        self.pending.host_settled(self.stream);
    }
}

/// What one host function carries: boxed, handed to the driver as
/// `userData`, and reclaimed by the callback (or by `free_async` when the
/// launch fails).
struct HostFnData {
    pending: Arc<PendingFrees>,
    probe: BackendProbe,
    ticket: u64,
    /// For a page-locked host free: the host address, the stream's id, and
    /// the watcher that frees it.
    host: Option<(usize, u64, Arc<Watch>)>,
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
    if let Some((host, stream, watch)) = &data.host {
        // The stream has passed the buffer's last use; the free itself is a
        // driver call, which a host function may not make: the watcher's.
        lock(&data.pending.host_ready).push((data.ticket, *host, *stream));
        watch.wake();
        return;
    }
    if let Some((signal, bytes)) = data.pending.take(data.ticket) {
        data.probe.free_retired(bytes);
        // The governor's sink touches atomics and wakes waiters only.
        signal.retire();
    }
}

impl Shared {
    /// Free the page-locked host buffers whose host function has run (the
    /// stream passed their last use), then fire their signals. Called by the
    /// watcher, by `synchronize` after its stream drained, and by teardown
    /// once every stream is synchronized. A context declared lost whose
    /// driver still answers frees them too (their signals, abandoned, are
    /// not fired); on a dead device nothing is freed: the buffers go with
    /// the context.
    pub(crate) fn free_ready_host(&self, op: &'static str) -> Result<(), BackendError> {
        if !self.pending.host_ready() || self.shell.is_dead() {
            return Ok(());
        }
        let _current = self.make_current(op)?;
        let mut result = Ok(());
        for (ticket, host, stream) in self.pending.take_host_ready() {
            // SAFETY: a page-locked allocation of this context, taken out of
            // the live set by its `free_async` and handed here once; the host
            // function queued behind its last use has run; the context is
            // current.
            let r = unsafe { sys::cuMemFreeHost(host as *mut c_void) };
            let freed = self.checked(op, "cuMemFreeHost", r);
            if let Some((signal, bytes)) = self.pending.take(ticket) {
                if freed.is_ok() {
                    self.probe().free_retired(bytes);
                    signal.retire();
                } else {
                    self.probe().free_abandoned(bytes);
                    drop(signal);
                }
            }
            self.pending.host_settled(stream);
            result = result.and(freed);
        }
        result
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
    ) -> Result<(), (CudaMemory, RetireSignal, BackendError)> {
        let s = &*self.shared;
        if let Err(e) = s.check_usable("free_async") {
            return Err((memory, signal, e));
        }
        if let Err(e) = s.check_stream("free_async", stream) {
            return Err((memory, signal, e));
        }
        // Taken out of the live set before the driver sees it: a second free
        // of the same allocation, or another context's, is refused here and
        // never reaches cuMemFreeAsync.
        let live = if memory.context == s.id {
            lock(&s.live).remove(&memory.id)
        } else {
            None
        };
        let Some(live) = live else {
            // Another context's memory is the caller's mistake, refused
            // below and reported to the caller only; an allocation of this
            // context that is no longer live is a second free, which the
            // probe counts.
            if memory.context == s.id {
                s.probe().violation(
                    BACKEND,
                    format!(
                        "free_async of allocation {} (context {}) that is not live in context {}",
                        memory.id, memory.context, s.id
                    ),
                );
            }
            let e = crate::result::err(
                "free_async",
                memgov_backend::BackendErrorKind::InvalidArgument,
                format!(
                    "allocation {} ({} B at {:#x}) is not live in CUDA context {} (freed \
                     already, or another context's)",
                    memory.id, memory.bytes, memory.ptr, s.id
                ),
            );
            return Err((memory, signal, e));
        };
        let current = match s.make_current("free_async") {
            Ok(c) => c,
            Err(e) => {
                lock(&s.live).insert(memory.id, live);
                return Err((memory, signal, e));
            }
        };
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
        // owned by the host function below and then the watcher): the
        // memory is no longer the caller's.
        let ticket = s.next_id();
        s.pending.park(ticket, signal, memory.bytes);
        // Counted before the launch: the watcher may settle it before the
        // launch has returned.
        let queued = (host != 0).then(|| {
            s.pending.host_queued(stream.id);
            HostQueued {
                pending: &s.pending,
                stream: stream.id,
            }
        });
        let data = Box::into_raw(Box::new(HostFnData {
            pending: s.pending.clone(),
            probe: s.probe().clone(),
            ticket,
            host: (host != 0).then(|| (host, stream.id, s.watch.clone())),
        }));
        // SAFETY: `free_retired` upholds the host-function rules (no CUDA
        // call); `data` is a fresh box handed to this launch only; the
        // stream is live and the context current.
        let r = unsafe { sys::cuLaunchHostFunc(stream.raw, Some(free_retired), data.cast()) };
        if r == sys::CUresult::CUDA_SUCCESS {
            if host != 0 {
                // The watcher settles it (`free_ready_host`).
                std::mem::forget(queued);
                // Started once; the host function wakes it.
                self.shared.watch_retired();
            }
            return Ok(());
        }
        // Settled below, one way or the other: counted until this returns.
        let _queued = queued;
        let _current = current;
        // SAFETY: the launch failed, so the driver never took `data`.
        drop(unsafe { Box::from_raw(data) });
        let launch = s.checked("free_async", "cuLaunchHostFunc", r);
        let Some((signal, bytes)) = s.pending.take(ticket) else {
            // `device_lost` took it already (and abandoned it).
            return Ok(());
        };
        if !launch.is_err_and(|e| e.is_device_lost()) {
            // SAFETY: the stream is live; the context is current.
            let r = unsafe { sys::cuStreamSynchronize(stream.raw) };
            if r == sys::CUresult::CUDA_SUCCESS {
                // The stream has passed the memory's last use: a page-locked
                // host buffer is freed now, on this (the caller's) thread.
                if host != 0 {
                    // SAFETY: a live page-locked allocation of this context,
                    // taken out of the live set above so freed once; every
                    // copy queued before has completed (synchronized).
                    let r = unsafe { sys::cuMemFreeHost(host as *mut c_void) };
                    if s.checked("free_async", "cuMemFreeHost", r).is_err() {
                        s.probe().free_abandoned(bytes);
                        drop(signal);
                        return Ok(());
                    }
                }
                // The free has executed.
                s.probe().free_retired(bytes);
                signal.retire();
                return Ok(());
            }
            let _ = s.checked("free_async", "cuStreamSynchronize", r);
        }
        s.probe().free_abandoned(bytes);
        drop(signal);
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
