//! The embedded host backend: a simulated device that needs no GPU.
//!
//! It behaves like a driver where it matters to the governor:
//!
//! * a fixed capacity in bytes, with out-of-memory reported like a driver
//!   does, and memory that becomes free again only when its stream-ordered
//!   free has *executed*, not when it was queued;
//! * each stream is a worker thread that executes its queue in order
//!   (write, read, free and its signal, barriers), with an optional delay per
//!   operation so that pending releases really pend;
//! * contiguous, 64-byte aligned memory with a raw address
//!   ([`HostMemory::as_ptr`]) that a runtime's own CPU kernels can use, backed
//!   lazily by the operating system so that large simulated allocations cost
//!   nothing until they are touched;
//! * a [`BackendProbe`] that outlives the context and reports contract
//!   violations (free after teardown, double free, teardown with queued
//!   frees), executed frees, live allocations and streams;
//! * [`HostControls`], with which tests refuse frees or lose the device;
//! * both tiers ([`Tier`]): device memory out of the simulated capacity, and
//!   pinned host memory, the same heap flagged as the pinned tier and held
//!   to no capacity of the simulated device (the host's memory is the
//!   limit, as for page-locked memory). Its free runs on the stream worker
//!   in stream order, like a device free, so a copy queued before it always
//!   finds the memory there.
//!
//! ```
//! use memgov::host::{HostContext, HostConfig};
//! use memgov::{DeviceContext, RetireSignal};
//! let ctx = HostContext::new(HostConfig { capacity: 1 << 20, ..HostConfig::default() })?;
//! let s = ctx.create_stream()?;
//! let m = ctx.allocate(&s, 4096)?;
//! ctx.write(&s, &m, 0, b"abc")?;
//! ctx.free_async(&s, m, RetireSignal::from_fn(|_| {})).map_err(|(_, _, e)| e)?;
//! ctx.synchronize(&s)?;
//! ctx.destroy_stream(s)?;
//! let probe = ctx.probe();
//! ctx.teardown(false)?;
//! assert_eq!(probe.violations(), 0);
//! # Ok::<(), memgov::BackendError>(())
//! ```

use memgov_backend::{
    BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription, Execution,
    MemoryInfo, RetireSignal, Tier,
};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

const BACKEND: &str = "host";

/// Settings of a simulated device.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Device memory in bytes.
    pub capacity: u64,
    /// Time each queued operation takes on its stream's worker.
    pub op_delay: Duration,
    /// Device name in descriptions.
    pub name: String,
    /// Device index in descriptions.
    pub ordinal: u32,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            capacity: 1 << 30,
            op_delay: Duration::ZERO,
            name: "memgov simulated device".into(),
            ordinal: 0,
        }
    }
}

use memgov_sync::lock;

fn err(op: &'static str, kind: BackendErrorKind, msg: impl Into<String>) -> BackendError {
    BackendError::new(BACKEND, op, kind, msg)
}

/// Alignment of every host allocation, in bytes.
///
/// A cache line, and what ONNX Runtime's own CPU allocator gives its kernels
/// (`MlasGetPreferredBufferAlignment()`, 64 B on x86-64 since AVX-512), so a
/// runtime can hand [`HostMemory::as_ptr`] to vectorised kernels unchanged.
pub const HOST_ALIGN: usize = 64;

/// Device memory: one contiguous, zeroed, [`HOST_ALIGN`]-aligned region.
///
/// It comes from the system allocator's zeroed path (`calloc`), which backs
/// large regions with fresh anonymous pages the kernel maps on first touch, so
/// a simulated 16 GiB weight shard costs nothing until it is written. The
/// region is over-allocated by `HOST_ALIGN` bytes at the system allocator's
/// minimum alignment (which `calloc` serves without a `memset`) and the
/// aligned start is taken inside it.
struct Block {
    bytes: u64,
    /// The tier it was allocated in: a device block counts against the
    /// simulated capacity, a pinned host block does not.
    tier: Tier,
    /// Start of the system allocation.
    base: NonNull<u8>,
    /// `ptr - base`, below `HOST_ALIGN`.
    offset: usize,
    layout: Layout,
    /// Serialises the backend's own copies into and out of the region, so
    /// that two streams copying into one allocation through the safe API can
    /// never race. Holders of the raw address do not take it (see
    /// [`HostMemory::as_ptr`]).
    copy: Mutex<()>,
    freed: AtomicBool,
}

// SAFETY: `Block` owns its region exclusively (nothing else frees it, and the
// raw address handed out by `HostMemory::as_ptr` is documented as borrowed).
// Every access the backend itself makes goes through `write`/`read` below,
// which hold `copy` for the whole copy, so shared references from several
// threads never produce a data race through safe code.
unsafe impl Send for Block {}
// SAFETY: as for `Send`: all shared access is serialised by `copy`.
unsafe impl Sync for Block {}

impl Block {
    /// A zeroed region of `bytes`, or `None` when the system allocator has no
    /// room (or `bytes` does not fit the address space).
    fn new(bytes: u64, tier: Tier) -> Option<Self> {
        let len = usize::try_from(bytes).ok()?.checked_add(HOST_ALIGN)?;
        // `align_of::<u64>()` is at or below every platform's minimum malloc
        // alignment, so `alloc_zeroed` goes to `calloc` (lazily zeroed pages)
        // instead of an aligned allocation followed by a `memset` that would
        // touch every page.
        let layout = Layout::from_size_align(len, std::mem::align_of::<u64>()).ok()?;
        // SAFETY: `layout` has a nonzero size (`len >= HOST_ALIGN`).
        let base = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        // Integer arithmetic rather than `align_offset`, which may answer
        // "impossible" (usize::MAX) under Miri.
        let offset = (HOST_ALIGN - base.as_ptr() as usize % HOST_ALIGN) % HOST_ALIGN;
        Some(Self {
            bytes,
            tier,
            base,
            offset,
            layout,
            copy: Mutex::new(()),
            freed: AtomicBool::new(false),
        })
    }

    fn ptr(&self) -> *mut u8 {
        // SAFETY: `offset < HOST_ALIGN` and the allocation is
        // `bytes + HOST_ALIGN` long, so the result stays inside it.
        unsafe { self.base.as_ptr().add(self.offset) }
    }

    /// Copy `src` in at `offset`. The governor checked
    /// `offset + src.len() <= bytes`; a direct backend caller that did not is
    /// refused here rather than trusted.
    fn write(&self, offset: u64, src: &[u8]) -> bool {
        if !self.fits(offset, src.len()) {
            return false;
        }
        let _copy = lock(&self.copy);
        // SAFETY: the range `[offset, offset + len)` lies inside the region
        // (checked by `fits`), `src` is a distinct Rust slice, and `copy` is
        // held, so no other backend copy touches the region meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr().add(offset as usize), src.len())
        };
        true
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> bool {
        if !self.fits(offset, dst.len()) {
            return false;
        }
        let _copy = lock(&self.copy);
        // SAFETY: as in `write`, with the copy going the other way.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        true
    }

    fn fits(&self, offset: u64, len: usize) -> bool {
        offset
            .checked_add(len as u64)
            .is_some_and(|end| end <= self.bytes)
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: `base` came from `alloc_zeroed(self.layout)` and is freed
        // only here, once, when the last `Arc<Block>` (the `HostMemory` or a
        // copy still queued on a stream) is gone.
        unsafe { dealloc(self.base.as_ptr(), self.layout) }
    }
}

fn check_range(
    op: &'static str,
    memory: &HostMemory,
    offset: u64,
    len: usize,
) -> Result<(), BackendError> {
    if memory.block.fits(offset, len) {
        Ok(())
    } else {
        Err(err(
            op,
            BackendErrorKind::InvalidArgument,
            format!(
                "{len} B at offset {offset} run past the end of a {} B allocation",
                memory.block.bytes
            ),
        ))
    }
}

/// A raw allocation on the simulated device.
pub struct HostMemory {
    block: Arc<Block>,
    /// The context that allocated it ([`Shared::id`]).
    context: u64,
}

impl fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMemory")
            .field("bytes", &self.block.bytes)
            .field("ptr", &self.block.ptr())
            .finish()
    }
}

impl HostMemory {
    /// The allocation's address: `len()` contiguous bytes, aligned to
    /// [`HOST_ALIGN`], zero until written. This is what a runtime hands its
    /// own kernels (ONNX Runtime's CPU kernels, through `memgov-onnxruntime`).
    ///
    /// The pointer is borrowed, not owned. Whoever holds it must not:
    ///
    /// * use it after the buffer is released: dropping the `DeviceBuffer`
    ///   queues the free, which runs on the stream worker at any time after
    ///   the work already queued, and the region is returned to the system
    ///   then;
    /// * access it while a `write` or `read` queued on a stream may still be
    ///   running on the same bytes: those copies run on the stream's worker
    ///   thread. Synchronise the stream first (`GovernedStream::synchronize`);
    /// * free it, or write past `len()`.
    pub fn as_ptr(&self) -> *mut u8 {
        self.block.ptr()
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.block.bytes
    }

    /// Always false: zero-byte allocations are refused.
    pub fn is_empty(&self) -> bool {
        self.block.bytes == 0
    }

    /// The tier it was allocated in.
    pub fn tier(&self) -> Tier {
        self.block.tier
    }
}

/// One side of [`DeviceContext::order_after`]: set by the worker of the
/// stream ordered after, waited for by the worker of the stream that waits
/// (the host's event).
#[derive(Default)]
struct Latch {
    set: Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Latch {
    fn set(&self) {
        *lock(&self.set) = true;
        self.cv.notify_all();
    }

    fn wait(&self) {
        let mut set = lock(&self.set);
        while !*set {
            set = self.cv.wait(set).unwrap_or_else(|e| e.into_inner());
        }
    }
}

enum Op {
    Free(HostMemory, RetireSignal),
    /// Reached by the stream that another is ordered after.
    Signal(Arc<Latch>),
    /// Everything queued after it waits for the latch.
    Wait(Arc<Latch>),
    Write(Arc<Block>, u64, Vec<u8>, SyncSender<()>),
    Read(Arc<Block>, u64, usize, SyncSender<Vec<u8>>),
    Barrier(SyncSender<()>),
    Stop,
}

struct Worker {
    id: u64,
    tx: Sender<Op>,
    join: Mutex<Option<JoinHandle<()>>>,
}

/// A stream: one worker thread executing its queue in order.
pub struct HostStream {
    worker: Arc<Worker>,
    /// The context that created it ([`Shared::id`]).
    context: u64,
}

impl fmt::Debug for HostStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostStream")
            .field("id", &self.worker.id)
            .finish()
    }
}

struct Shared {
    /// Unique per context in this process: stamped into its streams and
    /// memory, so that another context's handles are refused.
    id: u64,
    config: HostConfig,
    /// Device-tier bytes allocated and not freed (against the capacity).
    used: AtomicU64,
    /// Pinned-host-tier bytes allocated and not freed.
    pinned_used: AtomicU64,
    lost: AtomicBool,
    torn_down: AtomicBool,
    refuse_frees: AtomicU32,
    probe: BackendProbe,
    next_stream: AtomicU64,
    workers: Mutex<Vec<Arc<Worker>>>,
}

impl Shared {
    fn violation(&self, what: String) {
        self.probe.violation(BACKEND, what);
    }

    fn check_usable(&self, op: &'static str) -> Result<(), BackendError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(err(
                op,
                BackendErrorKind::DeviceLost,
                "the simulated device was lost",
            ));
        }
        Ok(())
    }

    /// Refuse a stream or memory of another context: the host backend's
    /// handles are its own objects, and another context's worker or block
    /// must never be used (or freed) under this one's accounting.
    fn check_own(
        &self,
        op: &'static str,
        stream: Option<&HostStream>,
        memory: Option<&HostMemory>,
    ) -> Result<(), BackendError> {
        if let Some(s) = stream.filter(|s| s.context != self.id) {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "stream {} belongs to host context {}, not to context {}; pass a stream of the context you call",
                    s.worker.id, s.context, self.id
                ),
            ));
        }
        if let Some(m) = memory.filter(|m| m.context != self.id) {
            return Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "the {} B allocation belongs to host context {}, not to context {}; pass memory of the context you call",
                    m.block.bytes, m.context, self.id
                ),
            ));
        }
        Ok(())
    }

    fn execute_free(&self, memory: HostMemory, signal: RetireSignal) {
        if self.lost.load(Ordering::Acquire) {
            // A lost device runs nothing: the signal is dropped unfired.
            self.probe.free_abandoned(memory.block.bytes);
            drop(signal);
            return;
        }
        if self.torn_down.load(Ordering::Acquire) {
            self.violation(format!(
                "free of {} B executed after teardown",
                memory.block.bytes
            ));
        }
        let bytes = memory.block.bytes;
        if memory.block.freed.swap(true, Ordering::AcqRel) {
            self.violation(format!("double free of {bytes} B"));
            drop(memory);
        } else {
            match memory.block.tier {
                Tier::Device => self.used.fetch_sub(bytes, Ordering::AcqRel),
                _ => self.pinned_used.fetch_sub(bytes, Ordering::AcqRel),
            };
            drop(memory);
            self.probe.free_retired(bytes);
        }
        signal.retire();
    }
}

/// Fault knobs of a [`HostContext`], usable while the context is governed.
#[derive(Clone)]
pub struct HostControls(Arc<Shared>);

impl fmt::Debug for HostControls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostControls")
            .field("refuse_frees", &self.0.refuse_frees.load(Ordering::Relaxed))
            .field("lost", &self.0.lost.load(Ordering::Relaxed))
            .finish()
    }
}

impl HostControls {
    /// Refuse the next `n` `free_async` calls with an `Other` error (the
    /// memory comes back to the caller), to exercise quarantine.
    pub fn refuse_next_frees(&self, n: u32) {
        self.0.refuse_frees.store(n, Ordering::SeqCst);
    }
    /// Lose the device: every call fails with `DeviceLost` from now on and
    /// queued frees are abandoned.
    pub fn lose_device(&self) {
        self.0.lost.store(true, Ordering::SeqCst);
        self.0.probe.device_lost();
    }
    /// Pinned-host-tier bytes allocated and whose free has not executed.
    pub fn pinned_in_use(&self) -> u64 {
        self.0.pinned_used.load(Ordering::Acquire)
    }
}

/// A simulated device context.
pub struct HostContext {
    shared: Arc<Shared>,
}

impl fmt::Debug for HostContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostContext")
            .field("config", &self.shared.config)
            .finish()
    }
}

impl HostContext {
    /// Take `bytes` of the simulated capacity for a device-tier block, or
    /// refuse like a driver out of memory.
    fn take_capacity(&self, bytes: u64) -> Result<(), BackendError> {
        let capacity = self.shared.config.capacity;
        let mut used = self.shared.used.load(Ordering::Acquire);
        loop {
            match used.checked_add(bytes).filter(|&n| n <= capacity) {
                None => {
                    return Err(err(
                        "allocate",
                        BackendErrorKind::OutOfMemory,
                        format!(
                            "requested {bytes} B; {used} B of {capacity} B in use (memory is free again only once its stream-ordered free has executed)"
                        ),
                    ))
                }
                Some(n) => match self.shared.used.compare_exchange_weak(used, n, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break,
                    Err(actual) => used = actual,
                },
            }
        }
        Ok(())
    }

    /// A new simulated device.
    ///
    /// # Errors
    ///
    /// `InvalidArgument` if the capacity is zero.
    pub fn new(config: HostConfig) -> Result<Self, BackendError> {
        if config.capacity == 0 {
            return Err(err(
                "new",
                BackendErrorKind::InvalidArgument,
                "capacity must be at least 1 B",
            ));
        }
        static NEXT_CONTEXT: AtomicU64 = AtomicU64::new(1);
        Ok(Self {
            shared: Arc::new(Shared {
                id: NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed),
                config,
                used: AtomicU64::new(0),
                pinned_used: AtomicU64::new(0),
                lost: AtomicBool::new(false),
                torn_down: AtomicBool::new(false),
                refuse_frees: AtomicU32::new(0),
                probe: BackendProbe::new(),
                next_stream: AtomicU64::new(0),
                workers: Mutex::new(Vec::new()),
            }),
        })
    }

    /// A probe that observes this context, before and after teardown.
    pub fn probe(&self) -> BackendProbe {
        self.shared.probe.clone()
    }

    /// Fault knobs (refuse frees, lose the device) that keep working once
    /// the context is governed.
    pub fn controls(&self) -> HostControls {
        HostControls(self.shared.clone())
    }

    fn send(&self, op: &'static str, stream: &HostStream, msg: Op) -> Result<(), BackendError> {
        stream.worker.tx.send(msg).map_err(|_| {
            err(
                op,
                BackendErrorKind::InvalidArgument,
                "stream was destroyed",
            )
        })
    }

    fn stop_worker(worker: &Worker) {
        let _ = worker.tx.send(Op::Stop);
        if let Some(j) = lock(&worker.join).take() {
            let _ = j.join();
        }
    }
}

impl DeviceContext for HostContext {
    type Stream = HostStream;
    type Memory = HostMemory;

    fn describe(&self) -> DeviceDescription {
        let c = &self.shared.config;
        DeviceDescription {
            backend: BACKEND,
            vendor: "memgov".into(),
            name: c.name.clone(),
            ordinal: c.ordinal,
            total_bytes: c.capacity,
            driver: format!("memgov host backend {}", env!("CARGO_PKG_VERSION")),
            execution: Execution::Embedded,
            stream_ordered_reuse: false,
        }
    }

    fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        self.shared.check_usable("memory_info")?;
        let total = self.shared.config.capacity;
        Ok(MemoryInfo {
            free: total.saturating_sub(self.shared.used.load(Ordering::Acquire)),
            total,
        })
    }

    fn create_stream(&self) -> Result<HostStream, BackendError> {
        self.shared.check_usable("create_stream")?;
        let id = self.shared.next_stream.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = channel::<Op>();
        let shared = self.shared.clone();
        let delay = self.shared.config.op_delay;
        let join = std::thread::Builder::new()
            .name(format!("memgov-host-stream-{id}"))
            .spawn(move || {
                for op in rx {
                    if matches!(op, Op::Stop) {
                        break;
                    }
                    if !delay.is_zero() {
                        std::thread::sleep(delay);
                    }
                    match op {
                        Op::Free(m, s) => shared.execute_free(m, s),
                        Op::Write(b, off, data, done) => {
                            // Bounds were checked before the op was queued.
                            let _ = b.write(off, &data);
                            let _ = done.send(());
                        }
                        Op::Read(b, off, len, reply) => {
                            let mut out = vec![0u8; len];
                            let _ = b.read(off, &mut out);
                            let _ = reply.send(out);
                        }
                        Op::Barrier(done) => {
                            let _ = done.send(());
                        }
                        Op::Signal(latch) => latch.set(),
                        Op::Wait(latch) => latch.wait(),
                        Op::Stop => unreachable!(),
                    }
                }
            })
            .map_err(|e| {
                err(
                    "create_stream",
                    BackendErrorKind::Other,
                    format!("could not spawn stream worker: {e}"),
                )
            })?;
        let worker = Arc::new(Worker {
            id,
            tx,
            join: Mutex::new(Some(join)),
        });
        lock(&self.shared.workers).push(worker.clone());
        self.shared.probe.stream_created();
        Ok(HostStream {
            worker,
            context: self.shared.id,
        })
    }

    fn destroy_stream(&self, stream: HostStream) -> Result<(), BackendError> {
        self.shared
            .check_own("destroy_stream", Some(&stream), None)?;
        // Queued work (frees included) runs before the worker stops.
        Self::stop_worker(&stream.worker);
        lock(&self.shared.workers).retain(|w| w.id != stream.worker.id);
        self.shared.probe.stream_destroyed();
        Ok(())
    }

    fn allocate(&self, stream: &HostStream, bytes: u64) -> Result<HostMemory, BackendError> {
        self.allocate_in(stream, bytes, Tier::Device)
    }

    fn allocate_in(
        &self,
        stream: &HostStream,
        bytes: u64,
        tier: Tier,
    ) -> Result<HostMemory, BackendError> {
        self.shared.check_usable("allocate")?;
        self.shared.check_own("allocate", Some(stream), None)?;
        if bytes == 0 {
            return Err(err(
                "allocate",
                BackendErrorKind::InvalidArgument,
                "zero-byte allocation",
            ));
        }
        let used = match tier {
            Tier::Device => {
                self.take_capacity(bytes)?;
                &self.shared.used
            }
            _ => {
                self.shared.pinned_used.fetch_add(bytes, Ordering::AcqRel);
                &self.shared.pinned_used
            }
        };
        match Block::new(bytes, tier) {
            Some(block) => {
                self.shared.probe.allocated(bytes);
                Ok(HostMemory {
                    block: Arc::new(block),
                    context: self.shared.id,
                })
            }
            None => {
                used.fetch_sub(bytes, Ordering::AcqRel);
                Err(err(
                    "allocate",
                    BackendErrorKind::OutOfMemory,
                    format!(
                        "requested {bytes} B of {tier} memory: this machine's allocator refused to reserve that much address space; lower the allocation or the capacity"
                    ),
                ))
            }
        }
    }

    fn free_async(
        &self,
        stream: &HostStream,
        memory: HostMemory,
        retired: RetireSignal,
    ) -> Result<(), (HostMemory, RetireSignal, BackendError)> {
        if let Err(e) = self.shared.check_usable("free_async").and_then(|()| {
            self.shared
                .check_own("free_async", Some(stream), Some(&memory))
        }) {
            return Err((memory, retired, e));
        }
        let refuse =
            self.shared
                .refuse_frees
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if refuse.is_ok() {
            return Err((
                memory,
                retired,
                err(
                    "free_async",
                    BackendErrorKind::Other,
                    "free refused (injected by HostControls)",
                ),
            ));
        }
        match stream.worker.tx.send(Op::Free(memory, retired)) {
            Ok(()) => Ok(()),
            Err(std::sync::mpsc::SendError(Op::Free(m, s))) => Err((
                m,
                s,
                err(
                    "free_async",
                    BackendErrorKind::InvalidArgument,
                    "stream was destroyed",
                ),
            )),
            Err(_) => unreachable!("the op sent is the op returned"),
        }
    }

    fn write(
        &self,
        stream: &HostStream,
        memory: &HostMemory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.shared.check_usable("write")?;
        self.shared.check_own("write", Some(stream), Some(memory))?;
        check_range("write", memory, offset, src.len())?;
        let (tx, rx) = sync_channel(1);
        self.send(
            "write",
            stream,
            Op::Write(memory.block.clone(), offset, src.to_vec(), tx),
        )?;
        rx.recv().map_err(|_| {
            err(
                "write",
                BackendErrorKind::DeviceLost,
                "stream worker stopped",
            )
        })
    }

    fn read(
        &self,
        stream: &HostStream,
        memory: &HostMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        self.shared.check_usable("read")?;
        self.shared.check_own("read", Some(stream), Some(memory))?;
        check_range("read", memory, offset, dst.len())?;
        let (tx, rx) = sync_channel(1);
        self.send(
            "read",
            stream,
            Op::Read(memory.block.clone(), offset, dst.len(), tx),
        )?;
        let data = rx.recv().map_err(|_| {
            err(
                "read",
                BackendErrorKind::DeviceLost,
                "stream worker stopped",
            )
        })?;
        dst.copy_from_slice(&data);
        Ok(())
    }

    fn synchronize(&self, stream: &HostStream) -> Result<(), BackendError> {
        self.shared.check_usable("synchronize")?;
        self.shared.check_own("synchronize", Some(stream), None)?;
        let (tx, rx) = sync_channel(1);
        self.send("synchronize", stream, Op::Barrier(tx))?;
        rx.recv().map_err(|_| {
            err(
                "synchronize",
                BackendErrorKind::DeviceLost,
                "stream worker stopped",
            )
        })
    }

    /// The host's event: `after`'s worker sets a latch when it reaches it,
    /// and `stream`'s worker waits for it before running what follows.
    /// Returns at once. (No cycle can form: each call queues its set before
    /// its wait, and a stream's worker reaches a set only after everything
    /// queued before it.)
    fn order_after(&self, stream: &HostStream, after: &HostStream) -> Result<(), BackendError> {
        self.shared.check_usable("order_after")?;
        self.shared.check_own("order_after", Some(stream), None)?;
        self.shared.check_own("order_after", Some(after), None)?;
        let latch = Arc::new(Latch::default());
        self.send("order_after", after, Op::Signal(latch.clone()))?;
        // If `stream` was destroyed, the set on `after` is harmless.
        self.send("order_after", stream, Op::Wait(latch))
    }

    fn device_lost(&self) {
        self.shared.lost.store(true, Ordering::SeqCst);
        self.shared.probe.device_lost();
    }

    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        let shared = &self.shared;
        if shared.probe.teardowns() > 0 {
            shared.violation("teardown called twice".into());
        }
        if lost {
            shared.lost.store(true, Ordering::SeqCst);
            shared.probe.device_lost();
        }
        // Streams the governor still holds (force-retire or a lost device):
        // stop their workers. Frees still queued on a healthy device mean the
        // governor tore down before they retired: a violation.
        let workers: Vec<_> = std::mem::take(&mut *lock(&shared.workers));
        let executed_before = shared.probe.frees_retired();
        shared.torn_down.store(true, Ordering::SeqCst);
        for w in &workers {
            Self::stop_worker(w);
            shared.probe.stream_destroyed();
        }
        if !lost && shared.probe.frees_retired() != executed_before {
            shared.violation("teardown with stream-ordered frees still queued".into());
        }
        // Everything else dies with the context.
        shared.used.store(0, Ordering::SeqCst);
        shared.pinned_used.store(0, Ordering::SeqCst);
        shared.probe.reclaim_rest();
        shared.probe.torn_down_now();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_aligned_contiguous_and_matches_the_stream_copies() {
        let ctx = HostContext::new(HostConfig::default()).unwrap();
        let s = ctx.create_stream().unwrap();
        let mut held = Vec::new();
        for bytes in [1u64, 63, 64, 4097, 1 << 20] {
            let m = ctx.allocate(&s, bytes).unwrap();
            assert_eq!(m.as_ptr() as usize % HOST_ALIGN, 0, "{bytes} B");
            assert_eq!(m.len(), bytes);
            held.push(m);
        }
        let m = held.pop().unwrap();
        ctx.write(&s, &m, 4096, b"through the stream").unwrap();
        ctx.synchronize(&s).unwrap();
        // SAFETY: the stream is synchronised (no copy in flight) and the
        // memory is live; the range is inside the allocation.
        let seen = unsafe { std::slice::from_raw_parts(m.as_ptr().add(4096), 18) };
        assert_eq!(seen, b"through the stream");
        // SAFETY: as above; this thread is the only one touching the bytes.
        unsafe { m.as_ptr().add(100).write(7) };
        let mut back = [0u8; 2];
        ctx.read(&s, &m, 99, &mut back).unwrap();
        assert_eq!(back, [0, 7]);
        let e = ctx.write(&s, &m, (1 << 20) - 1, b"ab").unwrap_err();
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
        held.push(m);
        for m in held {
            ctx.free_async(&s, m, RetireSignal::from_fn(|_| {}))
                .map_err(|(_, _, e)| e)
                .unwrap();
        }
        ctx.destroy_stream(s).unwrap();
        ctx.teardown(false).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "4 GiB is beyond what Miri models")]
    fn a_large_allocation_costs_nothing_until_touched() {
        let ctx = HostContext::new(HostConfig {
            capacity: 8 << 30,
            ..HostConfig::default()
        })
        .unwrap();
        let s = ctx.create_stream().unwrap();
        let started = std::time::Instant::now();
        let m = ctx.allocate(&s, 4 << 30).unwrap();
        ctx.write(&s, &m, (4 << 30) - 3, b"end").unwrap();
        let mut back = [1u8; 4];
        ctx.read(&s, &m, 1 << 30, &mut back).unwrap();
        assert_eq!(back, [0; 4], "untouched memory reads as zero");
        // Zeroing 4 GiB eagerly takes over a second here; lazily it is
        // microseconds. A generous bound that still catches a `memset`.
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        ctx.free_async(&s, m, RetireSignal::from_fn(|_| {}))
            .map_err(|(_, _, e)| e)
            .unwrap();
        ctx.destroy_stream(s).unwrap();
        ctx.teardown(false).unwrap();
    }
}
