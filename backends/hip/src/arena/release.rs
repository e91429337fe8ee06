//! Stream-ordered release of arena memory, and the arena's part of device
//! loss and teardown.
//!
//! A release queues a stream callback (`hipStreamAddCallback`) on the
//! releasing stream; when it runs, the stream has passed the memory's last
//! use (and, through `order_after`, so has every other stream that used
//! it), and the callback gives the range back to the arena and fires the
//! [`RetireSignal`]. It makes no HIP call (the runtime forbids it):
//! unmapping is left to trim, sleep and teardown, which run on a caller's
//! thread. As for the pool's frees (`retire.rs`), the callback's user data
//! is a number, a ticket that a process-wide table routes to its arena, and
//! the signal waits in the arena's table under it, so that device loss can
//! take it (unfired) and a runtime that drops callbacks leaks nothing.

use super::Arena;
use crate::ffi::{self, hipStream_t, HipResult, SUCCESS};
use crate::memory::{HipMemory, Origin};
use crate::result::err;
use crate::stream::HipStream;
use crate::HipContext;
use memgov_backend::{lock, BackendError, BackendErrorKind, BackendProbe, RetireSignal};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// Tickets are unique in the process: a callback's user data names one.
static NEXT_TICKET: AtomicU64 = AtomicU64::new(1);

/// Ticket -> the arena that queued it, for the callbacks.
fn routes() -> &'static Mutex<HashMap<u64, Weak<Arena>>> {
    static ROUTES: OnceLock<Mutex<HashMap<u64, Weak<Arena>>>> = OnceLock::new();
    ROUTES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Releases queued whose callback has not run: ticket -> (signal, bytes,
/// address).
#[derive(Default)]
pub struct Releases(Mutex<HashMap<u64, (RetireSignal, u64, u64)>>);

impl Releases {
    /// Drop every waiting signal unfired (the device is lost, or the
    /// streams were drained and nothing will run them), and their routes.
    pub(crate) fn abandon_all(&self, probe: &BackendProbe) {
        let all: Vec<(u64, (RetireSignal, u64, u64))> = lock(&self.0).drain().collect();
        let mut r = lock(routes());
        for (ticket, _) in &all {
            r.remove(ticket);
        }
        drop(r);
        for (_, (signal, bytes, _)) in all {
            probe.free_abandoned(bytes);
            drop(signal);
        }
    }
}

/// The release's callback: the stream passed the release.
///
/// # Safety
///
/// Called by the HIP runtime with the user data given to
/// `hipStreamAddCallback`: a ticket number, never dereferenced.
unsafe extern "C" fn arena_retired(_stream: hipStream_t, status: HipResult, user: *mut c_void) {
    let ticket = user as usize as u64;
    let Some(arena) = lock(routes()).remove(&ticket).and_then(|w| w.upgrade()) else {
        return;
    };
    let Some((signal, bytes, ptr)) = lock(&arena.releases.0).remove(&ticket) else {
        return;
    };
    if status == SUCCESS {
        arena.retire(ptr);
        arena.probe.free_retired(bytes);
        signal.retire();
    } else {
        // The stream failed before it reached the release: the memory may
        // still be in use by what failed; it stays out of the free list.
        arena.probe.free_abandoned(bytes);
        drop(signal);
    }
}

/// How long a teardown of a context declared lost (whose runtime answers)
/// waits for queued work before it leaves the arena mapped.
const LOST_DRAIN: Duration = Duration::from_secs(5);

impl HipContext {
    /// `free_async` of memory in the arena.
    #[allow(clippy::result_large_err)]
    pub(crate) fn arena_free_async(
        &self,
        arena: &Arc<Arena>,
        stream: &HipStream,
        memory: HipMemory,
        signal: RetireSignal,
    ) -> Result<(), (HipMemory, RetireSignal, BackendError)> {
        let s = &*self.shared;
        let ready = s
            .check_stream("free_async", stream)
            .and_then(|()| s.check_usable("free_async"));
        if let Err(e) = ready {
            return Err((memory, signal, e));
        }
        let known = memory.context == s.id && lock(&s.live).remove(&memory.ptr).is_some();
        if !known {
            if memory.context == s.id {
                s.probe().violation(
                    crate::result::BACKEND,
                    format!(
                        "free_async of arena allocation {:#x} ({} B), which is not live",
                        memory.ptr, memory.bytes
                    ),
                );
            }
            let e = err(
                "free_async",
                BackendErrorKind::InvalidArgument,
                format!(
                    "arena allocation {:#x} ({} B) is not live in HIP context {} (freed twice, \
                     or another context's)",
                    memory.ptr, memory.bytes, s.id
                ),
            );
            return Err((memory, signal, e));
        }
        let device = match s.make_current("free_async") {
            Ok(d) => d,
            Err(e) => {
                lock(&s.live).insert(memory.ptr, (memory.bytes, Origin::Arena));
                return Err((memory, signal, e));
            }
        };
        let ticket = NEXT_TICKET.fetch_add(1, Ordering::Relaxed);
        let (bytes, ptr) = (memory.bytes, memory.ptr as u64);
        // The ticket is in both tables before the callback can run.
        lock(&arena.releases.0).insert(ticket, (signal, bytes, ptr));
        lock(routes()).insert(ticket, Arc::downgrade(arena));
        // SAFETY: the stream is live; the callback makes no HIP call and
        // has the ABI HIP expects; the user data is a number the callback
        // never dereferences.
        let r = unsafe {
            ffi::hipStreamAddCallback(
                stream.raw.0,
                Some(arena_retired),
                ticket as usize as *mut c_void,
                0,
            )
        };
        if r == SUCCESS {
            return Ok(());
        }
        // The callback will never run: learn when the stream has passed the
        // memory's last use by synchronizing it.
        lock(routes()).remove(&ticket);
        let launch = s.checked("free_async", "hipStreamAddCallback", r);
        let Some((signal, bytes, ptr)) = lock(&arena.releases.0).remove(&ticket) else {
            return Ok(());
        };
        if !launch.is_err_and(|e| e.is_device_lost()) {
            // SAFETY: the stream is live; the device is current.
            let r = unsafe { ffi::hipStreamSynchronize(stream.raw.0) };
            if s.checked("free_async", "hipStreamSynchronize", r).is_ok() {
                arena.retire(ptr);
                s.probe().free_retired(bytes);
                signal.retire();
                return Ok(());
            }
        }
        drop(device);
        s.probe().free_abandoned(bytes);
        drop(signal);
        Ok(())
    }

    /// The arena's part of teardown, before the context's own: forget what
    /// a forced retire left, wait for every stream (so every queued release
    /// has retired), unmap and release every granule and free the
    /// reservation. On a dead device nothing is called: the memory goes
    /// with the device. A context declared lost whose runtime answers is
    /// polled (`hipStreamQuery`, at most 5 s) instead of synchronized.
    pub(crate) fn arena_teardown(&self, lost: bool) -> Result<(), BackendError> {
        let Some(arena) = &self.arena else {
            return Ok(());
        };
        // Live graphs first: their pools go back to the arena after their
        // launches finished; on a lost context they are forgotten.
        let graphs = self.pins.finish(
            &*self.shared,
            Some(arena),
            lost || self.shared.is_dead() || self.shared.is_lost(),
            "HipGraph::destroy",
        );
        let s = &*self.shared;
        let leftover: Vec<u64> = {
            let mut live = lock(&s.live);
            let ptrs: Vec<usize> = live
                .iter()
                .filter(|(_, (_, o))| *o == Origin::Arena)
                .map(|(&p, _)| p)
                .collect();
            ptrs.iter()
                .filter_map(|p| live.remove(p))
                .map(|(b, _)| b)
                .collect()
        };
        for bytes in leftover {
            s.probe().freed(bytes);
        }
        let lost = lost || s.is_lost();
        if s.is_dead() {
            arena.releases.abandon_all(s.probe());
            return Ok(());
        }
        let device = s.make_current("teardown")?;
        if let Err(e) =
            memgov_stream_ordered::stream::quiesce(s, "teardown", lost.then_some(LOST_DRAIN))
        {
            arena.releases.abandon_all(s.probe());
            return Err(e);
        }
        // Every callback queued before has run; any signal still here was
        // dropped by the runtime.
        arena.releases.abandon_all(s.probe());
        let r = arena.teardown(s);
        drop(device);
        graphs.and(r)
    }
}
