//! Streams: the handles ([`VulkanStream`], [`StreamGate`]) and what moves
//! work on a stream: creating its objects, submitting batches in timeline
//! order, transfers through the mapping or the staging buffer, parking
//! frees, synchronizing, destroying. What a stream is (its timeline, parked
//! frees and transfer objects, which the context's shared state keeps for
//! the free thread and teardown) is `stream_state.rs`'s.

use crate::config::TransferPath;
use crate::memory::VulkanMemory;
use crate::result::err;
use crate::shared::{GateRecord, Shared};
use crate::stream_state::{Parked, Staging, StreamState, Xfer};
use crate::VulkanContext;
use ash::vk;
use gpu_allocator::MemoryLocation;
use memgov_backend::lock;
use memgov_backend::{BackendError, BackendErrorKind, RetireSignal};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A stream: a timeline semaphore on a (possibly shared) queue. A plain
/// handle: dropping it does nothing; `destroy_stream` or teardown destroy it.
///
/// It can outlive its context (teardown destroys the device and unloads the
/// driver): its own device calls ([`completed_value`](Self::completed_value),
/// [`gate`](Self::gate), [`submit`](Self::submit)) are then refused with an
/// error, and one in flight on another thread delays teardown until it
/// returns, so none reaches a destroyed device.
pub struct VulkanStream {
    /// The context's shared state (kept alive by the handle).
    pub(crate) shared: Arc<Shared>,
    /// The stream's own, which the context also keeps while it is alive.
    pub(crate) inner: Arc<StreamState>,
}

impl fmt::Debug for VulkanStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VulkanStream")
            .field("id", &self.inner.id)
            .field("queue", &self.inner.queue)
            .field("last_submitted", &self.last_submitted())
            .finish()
    }
}

impl VulkanStream {
    /// Create a stream's objects on `shared`'s device (not yet registered
    /// with the context).
    pub(crate) fn create(shared: &Arc<Shared>) -> Result<Self, BackendError> {
        let device = &shared.device;
        let mut timeline_info = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let info = vk::SemaphoreCreateInfo::default().push_next(&mut timeline_info);
        // SAFETY: a valid device with timeline semaphores enabled.
        let timeline = unsafe { device.create_semaphore(&info, None) }
            .map_err(|r| shared.fail("create_stream", r, "vkCreateSemaphore (timeline)"))?;
        let pool_info = vk::CommandPoolCreateInfo::default()
            .flags(
                vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER
                    | vk::CommandPoolCreateFlags::TRANSIENT,
            )
            .queue_family_index(shared.queue_family);
        // SAFETY: a valid device and family index.
        let pool = match unsafe { device.create_command_pool(&pool_info, None) } {
            Ok(p) => p,
            Err(r) => {
                // SAFETY: just created, unused.
                unsafe { device.destroy_semaphore(timeline, None) };
                return Err(shared.fail("create_stream", r, "vkCreateCommandPool"));
            }
        };
        let alloc = vk::CommandBufferAllocateInfo::default()
            .command_pool(pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(1);
        // SAFETY: a valid pool of this device.
        let cmd = match unsafe { device.allocate_command_buffers(&alloc) } {
            Ok(c) => c[0],
            Err(r) => {
                // SAFETY: just created, unused.
                unsafe {
                    device.destroy_command_pool(pool, None);
                    device.destroy_semaphore(timeline, None);
                }
                return Err(shared.fail("create_stream", r, "vkAllocateCommandBuffers"));
            }
        };
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let queue = (id as usize).checked_rem(shared.queues.len()).unwrap_or(0);
        Ok(Self {
            shared: shared.clone(),
            inner: Arc::new(StreamState::new(id, shared.id, queue, timeline, pool, cmd)),
        })
    }

    /// Submit a batch ordered on this stream: it waits for the previous value
    /// (and `extra_wait`) and signals the next one, which is returned.
    ///
    /// # Safety
    ///
    /// `cmds` are executable command buffers of this device's queue family,
    /// not pending elsewhere, whose resources live until the value is reached.
    unsafe fn submit_batch(
        &self,
        op: &'static str,
        cmds: &[vk::CommandBuffer],
        extra_wait: Option<(vk::Semaphore, u64)>,
    ) -> Result<u64, BackendError> {
        if self.inner.destroyed.load(Ordering::Acquire) {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!("stream {} was destroyed", self.inner.id),
            ));
        }
        let Some(queue) = self.shared.queues.get(self.inner.queue) else {
            return Err(err(
                op,
                BackendErrorKind::Unsupported,
                "this context was adopted without queues (AdoptedDevice::queue_count 0): the runtime that owns the device's queue submits, memgov does not; use host-visible memory with TransferPath::Auto for write and read",
            ));
        };
        let mut last = lock(&self.inner.submit);
        let prev = *last;
        // The only place a stream's timeline value is chosen: strictly
        // increasing, under the lock, submitted in this order.
        let value = prev + 1;
        let mut wait_sems = [vk::Semaphore::null(); 2];
        let mut wait_vals = [0u64; 2];
        let stages = [vk::PipelineStageFlags::ALL_COMMANDS; 2];
        let mut n = 0;
        if prev > 0 {
            wait_sems[n] = self.inner.timeline;
            wait_vals[n] = prev;
            n += 1;
        }
        if let Some((s, v)) = extra_wait {
            wait_sems[n] = s;
            wait_vals[n] = v;
            n += 1;
        }
        let signal = [self.inner.timeline];
        let signal_vals = [value];
        let mut timeline = vk::TimelineSemaphoreSubmitInfo::default()
            .wait_semaphore_values(&wait_vals[..n])
            .signal_semaphore_values(&signal_vals);
        let info = vk::SubmitInfo::default()
            .wait_semaphores(&wait_sems[..n])
            .wait_dst_stage_mask(&stages[..n])
            .command_buffers(cmds)
            .signal_semaphores(&signal)
            .push_next(&mut timeline);
        let queue = lock(queue);
        // SAFETY: the queue is externally synchronized by its mutex; the
        // semaphores belong to this device; the caller vouches for `cmds`.
        let r = unsafe {
            self.shared
                .device
                .queue_submit(*queue, &[info], vk::Fence::null())
        };
        drop(queue);
        if let Err(r) = r {
            drop(last);
            return Err(self.shared.fail(op, r, "vkQueueSubmit"));
        }
        *last = value;
        self.inner.last.store(value, Ordering::SeqCst);
        Ok(value)
    }

    /// Park a free at the value of the last submission on this stream.
    /// Never blocks on the device; wakes the free thread only when the
    /// stream had nothing parked (otherwise it already waits on this stream).
    pub(crate) fn park(&self, memory_id: u64, signal: RetireSignal) {
        let mut p = lock(&self.inner.park);
        // Read under the park lock: `last` only grows, so the queue stays
        // sorted by value.
        let value = self.inner.last.load(Ordering::SeqCst);
        let wake = p.queue.is_empty() && p.firing == 0;
        p.queue.push_back(Parked {
            value,
            memory_id,
            signal,
        });
        drop(p);
        if self.shared.is_lost() {
            // Lost while parking: nothing will retire it.
            self.shared.drain_parked();
            return;
        }
        if wake {
            self.shared.wake();
        }
    }

    fn ensure_staging(
        &self,
        op: &'static str,
        x: &mut Xfer,
    ) -> Result<(vk::Buffer, u64, usize), BackendError> {
        if let Some(s) = &x.staging {
            return Ok((s.live.buffer, s.size, s.ptr));
        }
        let size = self.shared.config.staging_bytes.max(4096);
        let live =
            self.shared
                .create_buffer(op, size, MemoryLocation::CpuToGpu, "memgov staging")?;
        let Some(ptr) = live.allocation.mapped_ptr().map(|p| p.as_ptr() as usize) else {
            let mut mem = lock(&self.shared.mem);
            // SAFETY: never used by a submission.
            unsafe { self.shared.destroy_live(&mut mem, live, true) };
            return Err(err(op, BackendErrorKind::Unsupported, "the staging buffer is not host-mapped (no HOST_VISIBLE | HOST_COHERENT memory type)"));
        };
        let out = (live.buffer, size, ptr);
        x.staging = Some(Staging { live, size, ptr });
        Ok(out)
    }

    fn check_memory(
        &self,
        op: &'static str,
        memory: &VulkanMemory,
        offset: u64,
        len: usize,
    ) -> Result<(), BackendError> {
        if memory.context != self.shared.id {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                "the memory belongs to another Vulkan context",
            ));
        }
        match offset.checked_add(len as u64) {
            Some(end) if end <= memory.bytes => Ok(()),
            _ => Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "range {offset}+{len} exceeds the allocation of {} B",
                    memory.bytes
                ),
            )),
        }
    }

    fn wait_last(&self, op: &'static str) -> Result<(), BackendError> {
        let last = self.inner.last.load(Ordering::SeqCst);
        if last > 0 {
            self.shared.host_wait(
                op,
                self.inner.timeline,
                last,
                &format!("stream {}", self.inner.id),
            )?;
        }
        Ok(())
    }

    /// Make sure no earlier submission of the transfer command buffer is
    /// still pending: one whose wait gave up is waited for again here, and
    /// until it completes every transfer on this stream fails (with the
    /// timeout error that names the value), instead of re-recording a
    /// pending command buffer or overwriting a staging buffer the device
    /// still reads.
    fn settle(&self, op: &'static str, x: &mut Xfer) -> Result<(), BackendError> {
        if let Some(value) = x.unsettled {
            self.shared.host_wait(
                op,
                self.inner.timeline,
                value,
                &format!("stream {} earlier transfer", self.inner.id),
            )?;
            x.unsettled = None;
        }
        Ok(())
    }

    /// Record `f` into the stream's command buffer, submit it, and wait.
    /// The caller holds the xfer lock and has called [`settle`](Self::settle).
    fn run(
        &self,
        op: &'static str,
        x: &mut Xfer,
        f: impl FnOnce(&ash::Device, vk::CommandBuffer),
    ) -> Result<(), BackendError> {
        debug_assert!(x.unsettled.is_none(), "run without settle");
        let device = &self.shared.device;
        let begin = vk::CommandBufferBeginInfo::default()
            .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: the command buffer is not pending: every submission of it
        // either was waited for to completion or is recorded in `unsettled`,
        // which `settle` cleared (by waiting) under the xfer lock the caller
        // holds; its pool allows reset on begin.
        unsafe { device.begin_command_buffer(x.cmd, &begin) }
            .map_err(|r| self.shared.fail(op, r, "vkBeginCommandBuffer"))?;
        f(device, x.cmd);
        // SAFETY: recording, begun above.
        unsafe { device.end_command_buffer(x.cmd) }
            .map_err(|r| self.shared.fail(op, r, "vkEndCommandBuffer"))?;
        // SAFETY: executable, of this family; the buffers it copies between
        // live until its value is reached: the staging buffer is destroyed
        // only with the stream (after a wait for its last value, or in
        // teardown once the device is idle); the target memory is freed only
        // stream-ordered after this submission.
        let value = unsafe { self.submit_batch(op, &[x.cmd], None) }?;
        x.unsettled = Some(value);
        self.shared.host_wait(
            op,
            self.inner.timeline,
            value,
            &format!("stream {} transfer", self.inner.id),
        )?;
        x.unsettled = None;
        Ok(())
    }

    /// `write`: copy `src` into `memory` at `offset`, ordered on the stream.
    pub(crate) fn transfer_in(
        &self,
        memory: &VulkanMemory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        const OP: &str = "write";
        self.check_memory(OP, memory, offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        if let (TransferPath::Auto, Some(base)) = (self.shared.config.transfer, memory.mapped) {
            self.wait_last(OP)?;
            let _serial = lock(&memory.host_access);
            // SAFETY: `base` is the persistent mapping of the memory's
            // suballocation, alive until its free retires or its context is
            // torn down, neither of which can happen while `memory` is
            // borrowed (both take it by value; `check_memory` and the
            // caller's `own_stream` tie it to this context). The range is in
            // bounds (checked). No other host copy touches these bytes: they
            // all hold `host_access` (memory is never aliased: `VulkanMemory`
            // is not `Clone`). The stream's earlier work has completed
            // (waited above); device work of the caller's own on other
            // streams is ordered by the caller (`VulkanStream::submit`'s
            // contract).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    (base + offset as usize) as *mut u8,
                    src.len(),
                )
            };
            return Ok(());
        }
        let mut x = lock(&self.inner.xfer);
        self.settle(OP, &mut x)?;
        let (staging, size, ptr) = self.ensure_staging(OP, &mut x)?;
        let mut done = 0usize;
        while done < src.len() {
            let n = (src.len() - done).min(size as usize);
            // SAFETY: `ptr` maps `size` coherent bytes of the staging buffer,
            // which no pending submission uses (each transfer is waited for
            // under the xfer lock we hold, and `settle` waited for any whose
            // wait gave up); n <= size.
            unsafe { std::ptr::copy_nonoverlapping(src[done..].as_ptr(), ptr as *mut u8, n) };
            let region = [vk::BufferCopy {
                src_offset: 0,
                dst_offset: offset + done as u64,
                size: n as u64,
            }];
            self.run(OP, &mut x, |d, cmd| {
                // SAFETY: recording; both buffers are alive and large enough.
                unsafe { d.cmd_copy_buffer(cmd, staging, memory.buffer, &region) }
            })?;
            done += n;
        }
        Ok(())
    }

    /// `read`: copy from `memory` at `offset` into `dst`, ordered on the
    /// stream.
    pub(crate) fn transfer_out(
        &self,
        memory: &VulkanMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        const OP: &str = "read";
        self.check_memory(OP, memory, offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        if let (TransferPath::Auto, Some(base)) = (self.shared.config.transfer, memory.mapped) {
            self.wait_last(OP)?;
            let _serial = lock(&memory.host_access);
            // SAFETY: as in transfer_in (the same lock excludes concurrent
            // writers), reading instead of writing.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (base + offset as usize) as *const u8,
                    dst.as_mut_ptr(),
                    dst.len(),
                )
            };
            return Ok(());
        }
        let mut x = lock(&self.inner.xfer);
        self.settle(OP, &mut x)?;
        let (staging, size, ptr) = self.ensure_staging(OP, &mut x)?;
        let mut done = 0usize;
        while done < dst.len() {
            let n = (dst.len() - done).min(size as usize);
            let region = [vk::BufferCopy {
                src_offset: offset + done as u64,
                dst_offset: 0,
                size: n as u64,
            }];
            let barrier = [vk::BufferMemoryBarrier::default()
                .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                .dst_access_mask(vk::AccessFlags::HOST_READ)
                .src_queue_family_index(vk::QUEUE_FAMILY_IGNORED)
                .dst_queue_family_index(vk::QUEUE_FAMILY_IGNORED)
                .buffer(staging)
                .offset(0)
                .size(n as u64)];
            self.run(OP, &mut x, |d, cmd| {
                // SAFETY: recording; both buffers are alive and large enough;
                // the barrier makes the copy visible to host reads.
                unsafe {
                    d.cmd_copy_buffer(cmd, memory.buffer, staging, &region);
                    d.cmd_pipeline_barrier(
                        cmd,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::PipelineStageFlags::HOST,
                        vk::DependencyFlags::empty(),
                        &[],
                        &barrier,
                        &[],
                    );
                }
            })?;
            // SAFETY: the copy completed (waited in `run`) and was made
            // host-visible; `ptr` maps at least n coherent bytes.
            unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, dst[done..].as_mut_ptr(), n) };
            done += n;
        }
        Ok(())
    }

    /// Wait until the last submission has executed and every free parked at
    /// or before it has fired its signal.
    pub(crate) fn synchronize_inner(&self, op: &'static str) -> Result<(), BackendError> {
        let target = self.inner.last.load(Ordering::SeqCst);
        if target > 0 {
            self.shared.host_wait(
                op,
                self.inner.timeline,
                target,
                &format!("stream {}", self.inner.id),
            )?;
        }
        let deadline = Instant::now() + self.shared.config.wait_timeout;
        let mut p = lock(&self.inner.park);
        loop {
            if self.shared.is_lost() {
                return Err(err(
                    op,
                    BackendErrorKind::DeviceLost,
                    "the Vulkan device was lost; parked frees were abandoned",
                ));
            }
            let pending = p.firing > 0 || p.queue.front().is_some_and(|f| f.value <= target);
            if !pending {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(err(
                    op,
                    BackendErrorKind::Other,
                    format!(
                        "stream {} reached value {target} but {} parked free(s) did not retire within {} ms; the free thread is stuck",
                        self.inner.id,
                        p.queue.len() + p.firing,
                        self.shared.config.wait_timeout.as_millis()
                    ),
                ));
            }
            p = self
                .inner
                .parked_cv
                .wait_timeout(p, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl VulkanStream {
    /// Identifier, unique within its context.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The stream's timeline semaphore. Wait on it freely while the stream
    /// and its context live; never signal it (memgov chooses its values).
    /// The handle outlives the semaphore: using it after `destroy_stream` or
    /// the context's teardown is invalid (every ash call that takes it is
    /// `unsafe`: its caller vouches for that).
    pub fn timeline_semaphore(&self) -> vk::Semaphore {
        self.inner.timeline
    }

    /// The value the last submission on this stream signals.
    pub fn last_submitted(&self) -> u64 {
        self.inner.last.load(Ordering::SeqCst)
    }

    /// The timeline's current value (`vkGetSemaphoreCounterValue`).
    ///
    /// # Errors
    ///
    /// `InvalidArgument` once the stream's context has been torn down (the
    /// handle can outlive it: the device, and the driver, are gone then);
    /// the driver's error otherwise.
    pub fn completed_value(&self) -> Result<u64, BackendError> {
        let shared = &self.shared;
        let _use = shared.access.enter("completed_value")?;
        // SAFETY: the device and the semaphore are alive until `_use` drops:
        // teardown waits for it before destroying anything, and `enter`
        // refused if teardown had begun. The stream itself is destroyed only
        // by value (`destroy_stream`), so not while `self` is borrowed.
        unsafe {
            shared
                .device
                .get_semaphore_counter_value(self.inner.timeline)
        }
        .map_err(|r| shared.fail("completed_value", r, "vkGetSemaphoreCounterValue"))
    }

    /// The logical device, to record command buffers for [`submit`](Self::submit).
    /// Valid until the context's teardown begins; every ash call through it
    /// is `unsafe`, and its caller vouches for that.
    pub fn device(&self) -> &ash::Device {
        &self.shared.device
    }

    /// The queue family to allocate command pools from.
    pub fn queue_family_index(&self) -> u32 {
        self.shared.queue_family
    }

    /// Submit command buffers of your own, ordered on this stream after
    /// everything already on it. Returns the timeline value they signal;
    /// frees queued afterwards retire only once it is reached.
    ///
    /// # Safety
    ///
    /// The command buffers were recorded for this device and queue family,
    /// are executable and not pending elsewhere, and every resource they use
    /// lives until the returned value is reached. (A torn-down context is
    /// not the caller's concern: that is refused with an error.)
    pub unsafe fn submit(
        &self,
        command_buffers: &[vk::CommandBuffer],
    ) -> Result<u64, BackendError> {
        let shared = &self.shared;
        let _use = shared.access.enter("submit")?;
        shared.check_usable("submit")?;
        // SAFETY: forwarded from this function's contract; the device, queue
        // and timeline are alive until `_use` drops (see `completed_value`).
        unsafe { self.submit_batch("submit", command_buffers, None) }
    }

    /// Hold the stream: submit an empty batch that waits on a host-signalled
    /// gate. Everything queued after it (frees included) pends until
    /// [`StreamGate::open`]. For tests and demonstrations of stream order.
    ///
    /// While a gate is closed, do not wait for this stream (write, read,
    /// synchronize), and on a device with one queue (lavapipe) not for other
    /// streams either: the queue executes batches in order.
    ///
    /// # Errors
    ///
    /// `InvalidArgument` once the context is being torn down, `DeviceLost`
    /// on a lost device, the driver's error otherwise.
    pub fn gate(&self) -> Result<StreamGate, BackendError> {
        let shared = &self.shared;
        // Held to the end: teardown opens every registered gate and then
        // waits for the device to go idle, so a gate must not be created or
        // submitted once it has begun (the closed gate would block
        // vkDeviceWaitIdle for ever) -- checking `closing` first and
        // creating afterwards would race with it.
        let _use = shared.access.enter("gate")?;
        shared.check_usable("gate")?;
        let mut ti = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let info = vk::SemaphoreCreateInfo::default().push_next(&mut ti);
        // SAFETY: a valid device with timeline semaphores, alive until `_use`
        // drops.
        let semaphore = unsafe { shared.device.create_semaphore(&info, None) }
            .map_err(|r| shared.fail("gate", r, "vkCreateSemaphore (gate)"))?;
        let opened = Arc::new(AtomicBool::new(false));
        lock(&shared.gates).push(GateRecord {
            semaphore,
            opened: opened.clone(),
        });
        // SAFETY: no command buffers; the gate semaphore lives until teardown,
        // which opens it (registered above) before waiting for the device.
        match unsafe { self.submit_batch("gate", &[], Some((semaphore, 1))) } {
            Ok(value) => Ok(StreamGate {
                shared: shared.clone(),
                semaphore,
                opened,
                value,
            }),
            Err(e) => {
                // Not submitted: nothing to open; teardown destroys it.
                opened.store(true, Ordering::SeqCst);
                Err(e)
            }
        }
    }

    /// Test-only: host-signal the stream's timeline with `value`, bypassing
    /// memgov's monotonic values. Signalling a value not greater than the
    /// current one is invalid usage; lavapipe answers it with
    /// `VK_ERROR_DEVICE_LOST`, which this routes through the backend's
    /// normal error path (the context becomes lost).
    ///
    /// # Safety
    ///
    /// Invalid usage of Vulkan on purpose when `value` is not greater than the
    /// current value: only for testing device loss on drivers known to
    /// report it (lavapipe).
    #[doc(hidden)]
    pub unsafe fn host_signal_timeline_unchecked(&self, value: u64) -> Result<(), BackendError> {
        let shared = &self.shared;
        let _use = shared.access.enter("host_signal")?;
        let info = vk::SemaphoreSignalInfo::default()
            .semaphore(self.inner.timeline)
            .value(value);
        // SAFETY: a live semaphore of a live device (until `_use` drops); the
        // value is the caller's responsibility per this function's contract.
        unsafe { shared.device.signal_semaphore(&info) }
            .map_err(|r| shared.fail("host_signal", r, "vkSignalSemaphore"))
    }
}

/// A closed gate holding a stream (see [`VulkanStream::gate`]). Dropping it
/// opens it.
pub struct StreamGate {
    shared: Arc<Shared>,
    semaphore: vk::Semaphore,
    opened: Arc<AtomicBool>,
    value: u64,
}

impl fmt::Debug for StreamGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamGate")
            .field("stream_value", &self.value)
            .field("opened", &self.opened.load(Ordering::Relaxed))
            .finish()
    }
}

impl StreamGate {
    /// The stream timeline value that the gated batch signals.
    pub fn stream_value(&self) -> u64 {
        self.value
    }

    /// The gate's own timeline semaphore, which the gated batch waits for
    /// (value 1). Valid until the context's teardown, which destroys it;
    /// never signal it yourself (use [`open`](Self::open)): every ash call
    /// that takes it is `unsafe`, and its caller vouches for that.
    pub fn semaphore(&self) -> vk::Semaphore {
        self.semaphore
    }

    /// Let the stream run on. Once the context's teardown has begun this
    /// does nothing: teardown opens every gate itself.
    pub fn open(&self) -> Result<(), BackendError> {
        let shared = &self.shared;
        // Teardown opens every closed gate and later destroys its semaphore;
        // it waits for this use before either, and refuses it afterwards.
        let Ok(_use) = shared.access.enter("gate_open") else {
            return Ok(());
        };
        if self.opened.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let info = vk::SemaphoreSignalInfo::default()
            .semaphore(self.semaphore)
            .value(1);
        // SAFETY: the device and the semaphore are alive until `_use` drops
        // (teardown destroys gate semaphores only after waiting for it), and
        // the semaphore was never signalled: `opened` was false, and every
        // signal of a gate (here and in teardown) first swaps it to true.
        // No lock is held: a device-loss error drops parked signals, whose
        // receivers may run code of the caller's.
        unsafe { shared.device.signal_semaphore(&info) }
            .map_err(|r| shared.fail("gate_open", r, "vkSignalSemaphore (gate)"))
    }
}

impl Drop for StreamGate {
    fn drop(&mut self) {
        if !self.shared.is_lost() {
            let _ = self.open();
        }
    }
}

/// Destroy a stream's Vulkan objects (its staging buffer, command pool and
/// timeline semaphore).
///
/// # Safety
///
/// No pending submission uses them and no thread waits on the timeline;
/// called once.
pub(crate) unsafe fn destroy_objects(shared: &Shared, s: &StreamState, free_memory: bool) {
    let mut x = lock(&s.xfer);
    let device = &shared.device;
    if let Some(st) = x.staging.take() {
        let mut mem = lock(&shared.mem);
        // SAFETY: per this function's contract.
        unsafe { shared.destroy_live(&mut mem, st.live, free_memory) };
    }
    // SAFETY: per this function's contract; destroying the pool frees its
    // command buffer.
    unsafe {
        device.destroy_command_pool(x.pool, None);
        device.destroy_semaphore(s.timeline, None);
    }
    x.pool = vk::CommandPool::null();
    x.cmd = vk::CommandBuffer::null();
}

impl VulkanContext {
    pub(crate) fn create_stream_impl(&self) -> Result<VulkanStream, BackendError> {
        self.shared.check_usable("create_stream")?;
        let stream = VulkanStream::create(&self.shared)?;
        lock(&self.shared.streams).push(stream.inner.clone());
        self.shared.probe.common.stream_created();
        Ok(stream)
    }

    pub(crate) fn destroy_stream_impl(&self, stream: VulkanStream) -> Result<(), BackendError> {
        let shared = &self.shared;
        shared.own_stream("destroy_stream", &stream.inner)?;
        let s = &stream.inner;
        if s.destroyed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        if shared.is_lost() {
            // The free thread may still be blocked on this stream's
            // semaphore: teardown destroys it after joining the thread.
            return Ok(());
        }
        // Work already queued executes first, frees and their signals too.
        // On error the stream stays registered: teardown destroys it once
        // the device is idle.
        stream.synchronize_inner("destroy_stream")?;
        lock(&shared.streams).retain(|x| !Arc::ptr_eq(x, s));
        shared.probe.common.stream_destroyed();
        // SAFETY: synchronize returned: every submission on the stream has
        // completed and its parked frees have fired, so neither the device nor
        // the free thread uses its objects (the thread only waits on
        // streams with parked frees); the stream is no longer registered.
        unsafe { destroy_objects(shared, s, true) };
        Ok(())
    }
}
