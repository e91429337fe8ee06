//! Stream-ordered release of arena memory, and the arena's part of device
//! loss and teardown.
//!
//! A release queues a host function on the releasing stream; when it runs,
//! the stream has passed the memory's last use (and, through `order_after`,
//! so has every other stream that used it), and the host function gives the
//! range back to the arena and fires the [`RetireSignal`]. It makes no
//! driver call: unmapping is left to trim, sleep and teardown, which run on
//! a caller's thread. The signal waits in the arena's table under a ticket,
//! so that `device_lost` can take it (unfired) instead, as for the pool's
//! frees.

use super::Arena;
use crate::result::BACKEND;
use crate::shared::{RawStream, Shared};
use crate::{CudaContext, CudaMemory, CudaStream};
use cudarc::driver::sys::{self, CUdeviceptr, CUresult};
use memgov_backend::{lock, BackendError, BackendErrorKind, BackendProbe, RetireSignal};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Releases queued whose host function has not run: ticket -> (signal,
/// bytes, address).
#[derive(Default)]
pub(crate) struct Releases(Mutex<HashMap<u64, (RetireSignal, u64, CUdeviceptr)>>);

impl Releases {
    /// Drop every waiting signal unfired (the device is lost).
    pub(crate) fn abandon_all(&self, probe: &BackendProbe) {
        let all: Vec<_> = lock(&self.0).drain().map(|(_, v)| v).collect();
        for (signal, bytes, _) in all {
            probe.free_abandoned(bytes);
            drop(signal);
        }
    }
}

struct HostFnData {
    arena: Arc<Arena>,
    probe: BackendProbe,
    ticket: u64,
}

/// # Safety
///
/// `user` comes from `Box::into_raw(Box<HostFnData>)` handed to exactly one
/// successful `cuLaunchHostFunc`; the driver calls this once.
unsafe extern "C" fn arena_retired(user: *mut c_void) {
    // SAFETY: see the function's contract; reclaimed once.
    let data = unsafe { Box::from_raw(user.cast::<HostFnData>()) };
    let taken = lock(&data.arena.releases.0).remove(&data.ticket);
    if let Some((signal, bytes, ptr)) = taken {
        data.arena.retire(ptr);
        data.probe.free_retired(bytes);
        signal.retire();
    }
}

/// How long a teardown of a context declared lost (whose driver answers)
/// waits for queued work before it leaves the arena mapped.
const LOST_DRAIN: Duration = Duration::from_secs(5);

/// Wait until the work queued on every stream of the context has run: the
/// live streams and those destroyed with work still queued (taken out of
/// the retired list while waited on, so that the watcher does not destroy
/// one under the wait, and put back after). With `poll`, ask
/// (`cuStreamQuery`) until that deadline passes instead of blocking: the
/// error then says work is still running. The context must be current.
pub(crate) fn quiesce(
    s: &Shared,
    op: &'static str,
    poll: Option<Duration>,
) -> Result<(), BackendError> {
    let live: Vec<sys::CUstream> = lock(&s.streams).values().map(|&(raw, _)| raw).collect();
    let retired: Vec<RawStream> = std::mem::take(&mut *lock(&s.retired_streams));
    let deadline = poll.map(|d| Instant::now() + d);
    let mut result = Ok(());
    for raw in live.iter().copied().chain(retired.iter().map(|r| r.0)) {
        if result.is_err() {
            break;
        }
        result = match deadline {
            // SAFETY: a live stream of this context, or a retired one held
            // out of the watcher's reach above; the context is current.
            None => s.checked(op, "cuStreamSynchronize", unsafe {
                sys::cuStreamSynchronize(raw)
            }),
            Some(deadline) => loop {
                // SAFETY: as above.
                let r = unsafe { sys::cuStreamQuery(raw) };
                if r != CUresult::CUDA_ERROR_NOT_READY {
                    break s.checked(op, "cuStreamQuery", r);
                }
                if Instant::now() >= deadline {
                    break Err(crate::result::err(
                        op,
                        BackendErrorKind::DeviceLost,
                        "work was still queued 5 s into a lost teardown: the arena's memory \
                         stays mapped (unmapping it under running work is undefined)",
                    ));
                }
                std::thread::sleep(crate::shared::WATCH_INTERVAL);
            },
        };
    }
    lock(&s.retired_streams).extend(retired);
    result
}

impl CudaContext {
    /// `free_async` of memory in the arena.
    #[allow(clippy::result_large_err)]
    pub(crate) fn arena_free_async(
        &self,
        arena: &Arc<Arena>,
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
        let live = (memory.context == s.id)
            .then(|| lock(&s.live).remove(&memory.id))
            .flatten();
        let Some(live) = live else {
            if memory.context == s.id {
                s.probe().violation(
                    BACKEND,
                    format!(
                        "free_async of arena allocation {} that is not live",
                        memory.id
                    ),
                );
            }
            let e = crate::result::err(
                "free_async",
                BackendErrorKind::InvalidArgument,
                format!(
                    "arena allocation {} ({} B at {:#x}) is not live in CUDA context {} (freed \
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
        let ticket = s.next_id();
        lock(&arena.releases.0).insert(ticket, (signal, memory.bytes, memory.ptr));
        let data = Box::into_raw(Box::new(HostFnData {
            arena: arena.clone(),
            probe: s.probe().clone(),
            ticket,
        }));
        // SAFETY: `arena_retired` makes no CUDA call; `data` is a fresh box
        // for this launch only; the stream is live and the context current.
        let r = unsafe { sys::cuLaunchHostFunc(stream.raw, Some(arena_retired), data.cast()) };
        if r == CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        let _current = current;
        // SAFETY: the launch failed, so the driver never took `data`.
        drop(unsafe { Box::from_raw(data) });
        let launch = s.checked("free_async", "cuLaunchHostFunc", r);
        let Some((signal, bytes, ptr)) = lock(&arena.releases.0).remove(&ticket) else {
            return Ok(());
        };
        if !launch.is_err_and(|e| e.is_device_lost()) {
            // SAFETY: the stream is live; the context is current.
            let r = unsafe { sys::cuStreamSynchronize(stream.raw) };
            if s.checked("free_async", "cuStreamSynchronize", r).is_ok() {
                // The stream has passed the memory's last use.
                arena.retire(ptr);
                s.probe().free_retired(bytes);
                signal.retire();
                return Ok(());
            }
        }
        s.probe().free_abandoned(bytes);
        drop(signal);
        Ok(())
    }

    /// The arena's part of teardown, before the context's own: wait for
    /// every stream (so every queued release has retired), forget what a
    /// forced retire left, unmap and release every granule and free the
    /// reservation. On a dead device nothing is called: the memory goes with
    /// the device. A context declared lost whose driver answers is polled
    /// (`cuStreamQuery`, at most 5 s) instead of synchronized.
    pub(crate) fn arena_teardown(
        &self,
        arena: &Arc<Arena>,
        lost: bool,
    ) -> Result<(), BackendError> {
        let s = &*self.shared;
        let leftover: Vec<u64> = {
            let mut live = lock(&s.live);
            let ids: Vec<u64> = live
                .iter()
                .filter(|(_, l)| l.host == 0 && arena.contains(l.ptr))
                .map(|(&id, _)| id)
                .collect();
            ids.iter()
                .filter_map(|id| live.remove(id))
                .map(|l| l.bytes)
                .collect()
        };
        for bytes in leftover {
            s.probe().freed(bytes);
        }
        let lost = lost || s.is_lost();
        if s.shell.is_dead() {
            arena.releases.abandon_all(s.probe());
            return Ok(());
        }
        let current = s.make_current("teardown")?;
        if let Err(e) = quiesce(s, "teardown", lost.then_some(LOST_DRAIN)) {
            arena.releases.abandon_all(s.probe());
            return Err(e);
        }
        // Every host function queued before has run; any signal still here
        // was launched on no stream that exists (cannot happen) or lost.
        arena.releases.abandon_all(s.probe());
        let r = arena.teardown(s);
        drop(current);
        r
    }
}
