//! The state a context's threads share (the caller's, stream and gate
//! handles', the free thread's): [`Shared`].
//!
//! It holds data whose types come from the modules below it (the device's
//! description, the allocator's books, each stream's state, the probe, the
//! access gate) and the few calls every layer above makes on it: the usable
//! check, the owner check, failure classification and loss, the free
//! thread's wake-up, a host wait. What moves work (buffers, streams, the
//! free thread, teardown) is above it and calls into it.

use crate::access::DeviceAccess;
use crate::allocator::MemState;
use crate::config::VulkanConfig;
use crate::instance::DeviceInfo;
use crate::result::{err, error, Vk};
use crate::stream_state::StreamState;
use crate::validation::ProbeShared;
use ash::vk;
use memgov_backend::{lock, BackendError, BackendErrorKind, Shell};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

pub(crate) struct GateRecord {
    pub(crate) semaphore: vk::Semaphore,
    pub(crate) opened: Arc<AtomicBool>,
}

/// State shared by the context, its streams, gates and free thread.
/// Dropping it calls no Vulkan function: teardown destroys explicitly.
pub(crate) struct Shared {
    pub id: u64,
    /// Keeps the loader library mapped for as long as any handle of it
    /// exists. It does not keep the driver: the loader unloads the ICD when
    /// teardown destroys the instance, after which `device`'s function
    /// pointers dangle. Calls on behalf of handles therefore pass `access`.
    #[allow(dead_code)]
    pub entry: ash::Entry,
    pub instance: ash::Instance,
    pub physical: vk::PhysicalDevice,
    pub device: ash::Device,
    pub info: DeviceInfo,
    pub config: VulkanConfig,
    pub queue_family: u32,
    pub queues: Vec<Mutex<vk::Queue>>,
    /// Lost (declared by the governor, or `VK_ERROR_DEVICE_LOST` from a
    /// call, whose first reason is kept) and closing, reported to the
    /// probe's common part: the state every GPU backend keeps.
    pub shell: Shell<Vk>,
    pub shutdown: AtomicBool,
    pub probe: Arc<ProbeShared>,
    pub mem: Mutex<MemState>,
    pub streams: Mutex<Vec<Arc<StreamState>>>,
    pub wake_semaphore: vk::Semaphore,
    /// A timeline semaphore that is never signalled. The free thread
    /// always waits on at least two semaphores with WAIT_ANY: with a single
    /// semaphore, VK_LAYER_KHRONOS_validation 1.3.239 waits inside
    /// vkWaitSemaphores for the host signal's bookkeeping while holding a
    /// lock that the signalling thread needs (a deadlock, seen on lavapipe).
    pub never_semaphore: vk::Semaphore,
    /// Last value host-signalled on the wake semaphore. Held across the
    /// signal: two concurrent wakers must not signal out of order (a lower
    /// host-signalled value loses the device on lavapipe).
    pub wake_value: Mutex<u64>,
    /// Where the free thread sleeps while no stream has a parked free
    /// (paired with `wake_value`; `wake` notifies it). A `vkWaitSemaphores`
    /// with WAIT_ANY over several timelines is a busy poll in Mesa's common
    /// runtime wherever the timelines have no native wait-any (lavapipe's
    /// emulated ones): waiting there with nothing to retire would spin a
    /// core for as long as the context lives.
    pub idle: Condvar,
    pub next_id: AtomicU64,
    pub gates: Mutex<Vec<GateRecord>>,
    pub has_memory_budget: bool,
    /// Device calls made by stream and gate handles, which can outlive the
    /// context: teardown closes it and waits for them before destroying.
    pub access: DeviceAccess,
}

impl Shared {
    /// Refuse work on a lost (`DeviceLost`, with the first reason) or
    /// closing (`InvalidArgument`) context, with no Vulkan call.
    pub(crate) fn check_usable(&self, op: &'static str) -> Result<(), BackendError> {
        self.shell.check_usable(op)
    }

    /// Whether the context is lost.
    pub(crate) fn is_lost(&self) -> bool {
        self.shell.is_lost()
    }

    /// Refuse a stream of another context: its device may already be
    /// destroyed (a context's own streams cannot be, while the context is
    /// borrowed: teardown takes it by value).
    pub(crate) fn own_stream(
        &self,
        op: &'static str,
        stream: &StreamState,
    ) -> Result<(), BackendError> {
        if stream.context != self.id {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "stream {} belongs to Vulkan context {}, not to context {}; pass a stream of the context you call",
                    stream.id, stream.context, self.id
                ),
            ));
        }
        Ok(())
    }

    /// Classify a failed call; `VK_ERROR_DEVICE_LOST` marks the context lost
    /// (parked frees are dropped unfired) and wakes the free thread.
    pub(crate) fn fail(&self, op: &'static str, r: vk::Result, call: &str) -> BackendError {
        let e = error(op, call, r);
        if r == vk::Result::ERROR_DEVICE_LOST {
            self.on_lost(
                &format!("{call} returned VK_ERROR_DEVICE_LOST during {op}"),
                true,
            );
        }
        e
    }

    /// Mark lost; drop every parked signal unfired. With `wake`, also
    /// host-signal the wake semaphore so that the free thread leaves
    /// `vkWaitSemaphores` (on lavapipe a blocked wait does not return by
    /// itself when the device is lost; the host signal still succeeds).
    pub(crate) fn on_lost(&self, why: &str, wake: bool) {
        // The shell reports the loss to the probe once.
        if self.shell.mark_lost(Some(why)) {
            self.probe.note(format!("device lost: {why}"));
        }
        self.drain_parked();
        if wake {
            self.wake();
        }
    }

    /// Give up every parked free: signals are dropped (Abandoned) after the
    /// locks are released; the memory stays in `live` for teardown to destroy.
    pub(crate) fn drain_parked(&self) {
        let streams: Vec<_> = lock(&self.streams).clone();
        for s in streams {
            let taken = std::mem::take(&mut lock(&s.park).queue);
            if taken.is_empty() {
                continue;
            }
            for _ in 0..taken.len() {
                // The memory stays in `live`; teardown reclaims it.
                self.probe.common.count_abandoned();
            }
            drop(taken);
            s.parked_cv.notify_all();
        }
    }

    /// Wake the free thread: host-signal the next wake value.
    pub(crate) fn wake(&self) {
        let mut v = lock(&self.wake_value);
        let next = *v + 1;
        let info = vk::SemaphoreSignalInfo::default()
            .semaphore(self.wake_semaphore)
            .value(next);
        // SAFETY: the wake semaphore is a timeline semaphore of this device,
        // destroyed only in teardown after the free thread has been
        // joined and no waker can run (teardown owns the context). The value
        // strictly increases because it is chosen and signalled under `v`.
        match unsafe { self.device.signal_semaphore(&info) } {
            Ok(()) => {
                *v = next;
                self.probe.wakeups.fetch_add(1, Ordering::Relaxed);
                drop(v);
                self.idle.notify_all();
            }
            Err(r) => {
                drop(v);
                // An idle free thread still looks for parked frees.
                self.idle.notify_all();
                self.probe.note(format!(
                    "waking the free thread: vkSignalSemaphore returned {r:?}"
                ));
            }
        }
    }

    pub(crate) fn host_wait(
        &self,
        op: &'static str,
        semaphore: vk::Semaphore,
        value: u64,
        what: &str,
    ) -> Result<(), BackendError> {
        let sems = [semaphore];
        let vals = [value];
        let info = vk::SemaphoreWaitInfo::default()
            .semaphores(&sems)
            .values(&vals);
        let timeout = u64::try_from(self.config.wait_timeout.as_nanos()).unwrap_or(u64::MAX);
        // SAFETY: callers pass the timeline of a stream of this context
        // (`own_stream` checked it) that they borrow for the call, from a
        // `DeviceContext` method that borrows the context: `destroy_stream`
        // and `teardown` take those by value, so neither the semaphore nor
        // the device can be destroyed during the wait.
        match unsafe { self.device.wait_semaphores(&info, timeout) } {
            Ok(()) => Ok(()),
            Err(vk::Result::TIMEOUT) => {
                // SAFETY: as above.
                let now =
                    unsafe { self.device.get_semaphore_counter_value(semaphore) }.unwrap_or(0);
                Err(err(
                    op,
                    BackendErrorKind::Other,
                    format!(
                        "{what}: timeline value {value} not reached after {} ms (at {now}); work queued before it has not finished (a StreamGate left closed?); open it or raise VulkanConfig::wait_timeout",
                        self.config.wait_timeout.as_millis()
                    ),
                ))
            }
            Err(r) => Err(self.fail(op, r, "vkWaitSemaphores")),
        }
    }
}
