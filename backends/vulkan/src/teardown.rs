//! Teardown: [`VulkanContext::tear_down`], called by
//! [`DeviceContext::teardown`](memgov_backend::DeviceContext::teardown).

use crate::result::{err, BACKEND};
use crate::stream::destroy_objects;
use crate::{instance, VulkanContext};
use ash::vk;
use memgov_backend::{lock, BackendError, BackendErrorKind};
use std::sync::atomic::Ordering;
use std::time::Duration;

impl VulkanContext {
    /// Teardown, as `DeviceContext::teardown`.
    pub(crate) fn tear_down(self, lost: bool) -> Result<(), BackendError> {
        self.tear_down_leaking(lost, false)
    }

    /// Teardown; with `leak_buffers`, live buffers are left alive at
    /// `vkDestroyDevice` (see `teardown_leaking_buffers_for_test`).
    pub(crate) fn tear_down_leaking(
        mut self,
        lost: bool,
        leak_buffers: bool,
    ) -> Result<(), BackendError> {
        let shared = self.shared.clone();
        let probe = &shared.probe;
        if probe.common.teardowns() > 0 {
            probe
                .common
                .violation(BACKEND, "teardown called twice".into());
        }
        // 1. Refuse new work, and wait for the device calls that stream and
        // gate handles have in flight (they can outlive this context, and may
        // run on other threads): none can start from here on, so nothing but
        // this function and the free thread touches the device.
        shared.access.close_and_drain();
        shared.shell.close();
        let mut first_error: Option<BackendError> = None;
        if lost {
            // The device is gone: drop parked signals unfired.
            shared.on_lost("teardown(lost = true)", false);
        }
        // 2. Let gated work run (a host signal of memgov's own gate
        // semaphores), then wait for the device to go idle. On a lost device
        // vkDeviceWaitIdle must return in finite time (the spec requires it;
        // lavapipe returns VK_ERROR_DEVICE_LOST at once), and the spec counts
        // that result as VK_SUCCESS for whether anything is still pending or
        // in use: after it, destroying the semaphores and buffers of batches
        // queued before the loss is valid. (The validation layer 1.3.239
        // ignores a wait that failed, so it may still report those
        // semaphores in use: a false positive on a lost device.)
        let closed: Vec<vk::Semaphore> = lock(&shared.gates)
            .iter()
            .filter(|g| !g.opened.swap(true, Ordering::SeqCst))
            .map(|g| g.semaphore)
            .collect();
        if !closed.is_empty() && !lost {
            probe.note(format!(
                "{} StreamGate(s) still closed at teardown; opened them",
                closed.len()
            ));
        }
        for semaphore in closed {
            let info = vk::SemaphoreSignalInfo::default()
                .semaphore(semaphore)
                .value(1);
            // SAFETY: the gate semaphore is alive (destroyed in step 6) and
            // was never signalled: `opened` was false, and every signal of a
            // gate first swaps it to true.
            if let Err(r) = unsafe { shared.device.signal_semaphore(&info) } {
                if !lost {
                    first_error.get_or_insert(shared.fail(
                        "teardown",
                        r,
                        "vkSignalSemaphore (gate)",
                    ));
                }
            }
        }
        // Adopted without queues, memgov submitted nothing and cannot lock
        // the runtime's queue (vkDeviceWaitIdle needs every queue
        // externally synchronized): nothing of its own is pending.
        if !shared.queues.is_empty() {
            // vkDeviceWaitIdle requires external sync of every queue: hold
            // their locks (no stream operation can run anyway: the governor
            // drained and `closing` refuses new ones).
            let guards: Vec<_> = shared.queues.iter().map(lock).collect();
            // SAFETY: a valid device; queues externally synchronized above.
            let idle = unsafe { shared.device.device_wait_idle() };
            drop(guards);
            if let Err(r) = idle {
                if !lost {
                    first_error.get_or_insert(shared.fail("teardown", r, "vkDeviceWaitIdle"));
                }
            }
        }
        let lost = lost || shared.is_lost();
        // 3. Stop the free thread. It retires what is parked (all of it
        // reached: the device is idle) and leaves. The wake is a host signal
        // of memgov's own semaphore: the one non-destroy call made on a lost
        // device, because a blocked vkWaitSemaphores does not return by
        // itself there (verified on lavapipe).
        shared.shutdown.store(true, Ordering::SeqCst);
        let thread = lock(&self.retire_thread).take();
        if let Some((join, done)) = thread {
            shared.wake();
            let limit = shared.config.wait_timeout.max(Duration::from_secs(10));
            match done.recv_timeout(limit) {
                Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    let _ = join.join();
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    // The thread may still be inside a Vulkan call: destroying
                    // anything would be unsound. Leak the device instead.
                    probe.note("free thread did not return; device leaked".into());
                    self.created = None;
                    // The runtime must not destroy the device either.
                    std::mem::forget(lock(&self.after_teardown).take());
                    return Err(err(
                        "teardown",
                        BackendErrorKind::Other,
                        format!(
                            "the free thread did not leave vkWaitSemaphores within {} ms; the device, instance and {} live allocation(s) were leaked to stay sound",
                            limit.as_millis(),
                            lock(&shared.mem).live.len()
                        ),
                    ));
                }
            }
        }
        if lost {
            shared.drain_parked();
        }
        // 4. Free what is left: streams and memory the governor abandoned
        // (force-retire), staging buffers, gates.
        let streams: Vec<_> = std::mem::take(&mut *lock(&shared.streams));
        let leftover_streams = streams.len();
        for s in streams {
            // SAFETY: the device is idle (or lost) and the free thread
            // has been joined: nothing uses the stream's objects.
            unsafe { destroy_objects(&shared, &s, !lost) };
        }
        let mut mem = lock(&shared.mem);
        let live: Vec<_> = mem.live.drain().collect();
        let leftover_memory = live.len();
        for (_, l) in live {
            if leak_buffers {
                // The buffer stays alive into vkDestroyDevice on purpose; its
                // memory block is freed with the allocator below.
                drop(l);
                continue;
            }
            // SAFETY: the device is idle or lost; no submission can run.
            unsafe { shared.destroy_live(&mut mem, l, !lost) };
        }
        probe.common.reclaim_rest();
        if leftover_streams + leftover_memory > 0 {
            probe.note(format!("teardown destroyed {leftover_streams} stream(s) and {leftover_memory} allocation(s) left by the governor (force-retire or device loss)"));
        }
        // 5. Drop the allocator (frees its blocks) before vkDestroyDevice.
        drop(mem.allocator.take());
        drop(mem);
        // 6. Destroy semaphores, the device, the messenger, the instance.
        // Every gate was opened in step 2 (on a lost device too: the host
        // signal of memgov's own semaphore is what releases a batch waiting
        // on it, which otherwise keeps lavapipe's submit thread, and
        // vkDestroySemaphore, waiting for ever), and none can be created or
        // opened from outside since step 1.
        let gates = std::mem::take(&mut *lock(&shared.gates));
        debug_assert!(gates.iter().all(|g| g.opened.load(Ordering::SeqCst)));
        // SAFETY: device idle or lost, thread joined: no wait or submission
        // refers to these semaphores any more.
        unsafe {
            for g in gates {
                shared.device.destroy_semaphore(g.semaphore, None);
            }
            shared.device.destroy_semaphore(shared.wake_semaphore, None);
            shared
                .device
                .destroy_semaphore(shared.never_semaphore, None);
        }
        if self.owns_device {
            // SAFETY: every object created from the device has been destroyed
            // above (except, in the leak test, the buffers on purpose), and
            // the allocator is gone.
            unsafe { shared.device.destroy_device(None) };
            if let Some(created) = self.created.take() {
                // SAFETY: the device was the only child of the instance.
                unsafe { instance::destroy_instance(created) };
            }
        }
        probe.common.torn_down_now();
        let done = lock(&self.after_teardown).take();
        if let Some(done) = done {
            done();
        }
        match first_error {
            Some(e) if !e.is_device_lost() => Err(e),
            _ => Ok(()),
        }
    }
}
