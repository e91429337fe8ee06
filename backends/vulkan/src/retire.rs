//! The free thread. While no free is parked it sleeps on a condition
//! variable; while one stream has parked frees it waits on that stream's
//! timeline alone, 2 ms at a time (validation layer off); while several do,
//! it waits in one `vkWaitSemaphores` (wait-any, infinite timeout) on the
//! front parked value of each plus a wake semaphore. Callers wake it
//! (host-signal the wake semaphore and notify the condition variable) when
//! a stream gets its first parked free, on device loss and at teardown.
//!
//! Why not always the one wait-any: over several timelines it is a busy
//! poll in Mesa's common runtime wherever the timelines have no native
//! wait-any (lavapipe's), so a thread parked there spins a core, for the
//! context's whole life when nothing is in flight. A wait on one timeline
//! blocks in every driver. With frees in flight on several streams at once
//! a driver like that still polls until one of them retires.

use crate::memory::VulkanMemory;
use crate::result::{err, BACKEND};
use crate::shared::Shared;
use crate::stream::VulkanStream;
use crate::stream_state::{Parked, StreamState};
use crate::VulkanContext;
use ash::vk;
use memgov_backend::lock;
use memgov_backend::{BackendError, BackendErrorKind, RetireSignal};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

pub(crate) fn spawn(shared: Arc<Shared>) -> Result<(JoinHandle<()>, Receiver<()>), BackendError> {
    let (tx, rx) = channel();
    let id = shared.id;
    let join = std::thread::Builder::new()
        .name(format!("memgov-vk-free-{id}"))
        .spawn(move || {
            // For `VulkanValidation::free_thread_cpu` (Linux only).
            if let Some(tid) = std::fs::read_link("/proc/thread-self")
                .ok()
                .and_then(|p| p.file_name()?.to_str()?.parse::<u64>().ok())
            {
                shared.probe.retire_tid.store(tid, Ordering::SeqCst);
            }
            run(&shared);
            let _ = tx.send(());
        })
        .map_err(|e| {
            err(
                "new",
                BackendErrorKind::Other,
                format!("could not spawn the free thread: {e}"),
            )
        })?;
    Ok((join, rx))
}

fn run(shared: &Shared) {
    let device = &shared.device;
    // Wake values up to `seen` have been observed; the next wait targets
    // seen + 1, so a wake signalled after this read is never missed.
    let mut seen = 0u64;
    let mut sems: Vec<vk::Semaphore> = Vec::new();
    let mut vals: Vec<u64> = Vec::new();
    loop {
        if shared.is_lost() {
            shared.drain_parked();
            return;
        }
        let streams: Vec<Arc<StreamState>> = lock(&shared.streams).clone();
        sems.clear();
        vals.clear();
        sems.push(shared.wake_semaphore);
        vals.push(seen + 1);
        sems.push(shared.never_semaphore);
        vals.push(1);
        for s in &streams {
            if let Some(front) = lock(&s.park).queue.front() {
                sems.push(s.timeline);
                vals.push(front.value);
            }
        }
        if sems.len() == 2 {
            if shared.shutdown.load(Ordering::SeqCst) {
                return;
            }
            // Nothing parked: sleep off the driver until a wake. A stream
            // parks its first free before it wakes us, and every wake bumps
            // `wake_value` (or, when the host signal failed, leaves a parked
            // free to find), so checking under the lock misses none.
            let mut v = lock(&shared.wake_value);
            while *v == seen
                && !shared.is_lost()
                && !shared.shutdown.load(Ordering::SeqCst)
                && !any_parked(shared)
            {
                v = shared.idle.wait(v).unwrap_or_else(|e| e.into_inner());
            }
            seen = *v;
            continue;
        }
        // One stream with parked frees (the common case): wait on its
        // timeline alone, which blocks in every driver, for at most
        // `SINGLE_WAIT_NS`, and look again: a wake (another stream's first
        // free, loss, teardown) is then seen within that bound. Several
        // streams, or the validation layer on (whose single-semaphore wait
        // can deadlock against a host signal of that semaphore, which the
        // device-loss tests make on purpose): one wait-any over them, the
        // wake semaphore and the never semaphore.
        let single = sems.len() == 3 && !shared.config.validation;
        let (from, flags, timeout) = if single {
            (2, vk::SemaphoreWaitFlags::empty(), SINGLE_WAIT_NS)
        } else {
            (0, vk::SemaphoreWaitFlags::ANY, u64::MAX)
        };
        let info = vk::SemaphoreWaitInfo::default()
            .flags(flags)
            .semaphores(&sems[from..])
            .values(&vals[from..]);
        // SAFETY: every semaphore is alive: the wake semaphore until after
        // this thread is joined; a stream's timeline until its stream is
        // destroyed, which happens only once it has no parked free (so it is
        // not in this wait) or after this thread is joined (teardown).
        let r = unsafe { device.wait_semaphores(&info, timeout) };
        shared.probe.retire_waits.fetch_add(1, Ordering::Relaxed);
        match r {
            Ok(()) => {}
            Err(vk::Result::TIMEOUT) => continue,
            Err(vk::Result::ERROR_DEVICE_LOST) => {
                shared.on_lost(
                    "vkWaitSemaphores returned VK_ERROR_DEVICE_LOST on the free thread",
                    false,
                );
                return;
            }
            Err(r) => {
                // Nothing to return the error to: record it and stop retiring
                // (signals are abandoned, never fired early).
                shared.on_lost(&format!("vkWaitSemaphores returned {r:?} on the free thread; treating the device as lost"), false);
                return;
            }
        }
        // Every wake up to the recorded value has been signalled (wakers
        // record under the lock after their signal returns). Reading our own
        // record instead of vkGetSemaphoreCounterValue(wake) also avoids a
        // deadlock in VK_LAYER_KHRONOS_validation 1.3.239 between that call
        // and a concurrent vkSignalSemaphore of the same semaphore.
        seen = *lock(&shared.wake_value);
        retire_reached(shared, &streams);
    }
}

/// How long the free thread waits on a single stream's timeline
/// before it looks for wakes again: the most a wake can wait while one
/// stream's free is in flight.
const SINGLE_WAIT_NS: u64 = 2_000_000;

/// Whether any stream has a parked free.
fn any_parked(shared: &Shared) -> bool {
    lock(&shared.streams)
        .iter()
        .any(|s| !lock(&s.park).queue.is_empty())
}

/// Free and signal every parked free whose value its stream has reached.
fn retire_reached(shared: &Shared, streams: &[Arc<StreamState>]) {
    let mut ready: Vec<(&Arc<StreamState>, Vec<Parked>)> = Vec::new();
    for s in streams {
        let mut p = lock(&s.park);
        if p.queue.is_empty() {
            continue;
        }
        // SAFETY: the stream has parked frees, so it is not destroyed while
        // we hold its park lock (destroy waits for the queue to empty).
        let reached = match unsafe { shared.device.get_semaphore_counter_value(s.timeline) } {
            Ok(v) => v,
            Err(r) => {
                drop(p);
                shared.on_lost(
                    &format!("vkGetSemaphoreCounterValue returned {r:?} on the free thread"),
                    false,
                );
                break;
            }
        };
        let mut out = Vec::new();
        while p.queue.front().is_some_and(|f| f.value <= reached) {
            out.extend(p.queue.pop_front());
        }
        if !out.is_empty() {
            p.firing += out.len();
            ready.push((s, out));
        }
    }
    if ready.is_empty() {
        return;
    }
    {
        let mut mem = lock(&shared.mem);
        for (_, out) in &ready {
            for parked in out {
                if let Some(live) = mem.live.remove(&parked.memory_id) {
                    let bytes = live.allocation.size();
                    // SAFETY: the stream's timeline reached the value of the
                    // last submission made before the free was queued, so no
                    // pending work uses the buffer; later work cannot (the
                    // governor gave up the handle).
                    unsafe { shared.destroy_live(&mut mem, live, true) };
                    shared.probe.common.free_retired(bytes);
                } else {
                    shared.probe.common.violation(
                        BACKEND,
                        format!(
                            "free of unknown allocation {} (double free?)",
                            parked.memory_id
                        ),
                    );
                }
            }
        }
    }
    // Fire with no lock held.
    for (s, out) in ready {
        let n = out.len();
        for parked in out {
            parked.signal.retire();
        }
        lock(&s.park).firing -= n;
        s.parked_cv.notify_all();
    }
}

impl VulkanContext {
    // The shape of `DeviceContext::free_async`, which hands the memory and
    // the signal back on refusal.
    #[allow(clippy::result_large_err)]
    pub(crate) fn free_async_impl(
        &self,
        stream: &VulkanStream,
        memory: VulkanMemory,
        retired: RetireSignal,
    ) -> Result<(), (VulkanMemory, RetireSignal, BackendError)> {
        if let Err(e) = self.shared.check_usable("free_async") {
            return Err((memory, retired, e));
        }
        if let Err(e) = self.shared.own_stream("free_async", &stream.inner) {
            return Err((memory, retired, e));
        }
        if memory.context != self.shared.id {
            let e = err(
                "free_async",
                BackendErrorKind::InvalidArgument,
                format!(
                    "the memory belongs to Vulkan context {}, not to context {}",
                    memory.context, self.shared.id
                ),
            );
            return Err((memory, retired, e));
        }
        if self.shared.queues.is_empty() {
            self.free_now(memory, retired);
            return Ok(());
        }
        stream.park(memory.id, retired);
        Ok(())
    }

    /// A free on a context adopted without queues: memgov submitted nothing,
    /// so no stream has work for it to wait behind, and the runtime releases
    /// a buffer only once its own last submission using it has completed
    /// (`adopt`'s contract). It executes at once, on the caller's thread,
    /// with the signal fired after the lock is released: no parked queue for
    /// the free thread to catch up on, whatever the release rate.
    fn free_now(&self, memory: VulkanMemory, retired: RetireSignal) {
        let shared = &self.shared;
        let mut mem = lock(&shared.mem);
        if let Some(live) = mem.live.remove(&memory.id) {
            let bytes = live.allocation.size();
            // SAFETY: no submission of memgov's uses the buffer (it makes
            // none on this context), and per `adopt`'s contract none of the
            // runtime's pending ones does; the governor gave up the handle.
            unsafe { shared.destroy_live(&mut mem, live, true) };
            shared.probe.common.free_retired(bytes);
        } else {
            shared.probe.common.violation(
                BACKEND,
                format!("free of unknown allocation {} (double free?)", memory.id),
            );
        }
        drop(mem);
        retired.retire();
    }
}
