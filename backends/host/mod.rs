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
//! * sparse storage (64 KiB pages allocated on first write), so it can stand
//!   in for an 80 GiB device on a small machine;
//! * a [`BackendProbe`] that outlives the context and reports contract
//!   violations (free after teardown, double free, teardown with queued
//!   frees), executed frees, live allocations and streams;
//! * [`HostControls`], with which tests refuse frees or lose the device.
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

use crate::{
    BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription, Execution,
    MemoryInfo, RetireSignal,
};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

const PAGE: u64 = 64 * 1024;
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

use crate::sync::lock;

fn err(op: &'static str, kind: BackendErrorKind, msg: impl Into<String>) -> BackendError {
    BackendError::new(BACKEND, op, kind, msg)
}

/// Device memory: sparse pages, zero until written.
struct Block {
    bytes: u64,
    pages: Mutex<BTreeMap<u64, Box<[u8]>>>,
    freed: AtomicBool,
}

impl Block {
    fn write(&self, offset: u64, src: &[u8]) {
        let mut pages = lock(&self.pages);
        let mut done = 0usize;
        while done < src.len() {
            let at = offset + done as u64;
            let (page, within) = (at / PAGE, (at % PAGE) as usize);
            let n = (PAGE as usize - within).min(src.len() - done);
            let p = pages
                .entry(page)
                .or_insert_with(|| vec![0u8; PAGE as usize].into_boxed_slice());
            p[within..within + n].copy_from_slice(&src[done..done + n]);
            done += n;
        }
    }

    fn read(&self, offset: u64, dst: &mut [u8]) {
        let pages = lock(&self.pages);
        let mut done = 0usize;
        while done < dst.len() {
            let at = offset + done as u64;
            let (page, within) = (at / PAGE, (at % PAGE) as usize);
            let n = (PAGE as usize - within).min(dst.len() - done);
            match pages.get(&page) {
                Some(p) => dst[done..done + n].copy_from_slice(&p[within..within + n]),
                None => dst[done..done + n].fill(0),
            }
            done += n;
        }
    }
}

/// A raw allocation on the simulated device.
pub struct HostMemory {
    block: Arc<Block>,
}

impl fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostMemory")
            .field("bytes", &self.block.bytes)
            .finish()
    }
}

enum Op {
    Free(HostMemory, RetireSignal),
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
}

impl fmt::Debug for HostStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostStream")
            .field("id", &self.worker.id)
            .finish()
    }
}

struct Shared {
    config: HostConfig,
    used: AtomicU64,
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
            self.used.fetch_sub(bytes, Ordering::AcqRel);
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
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                used: AtomicU64::new(0),
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
                            b.write(off, &data);
                            let _ = done.send(());
                        }
                        Op::Read(b, off, len, reply) => {
                            let mut out = vec![0u8; len];
                            b.read(off, &mut out);
                            let _ = reply.send(out);
                        }
                        Op::Barrier(done) => {
                            let _ = done.send(());
                        }
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
        Ok(HostStream { worker })
    }

    fn destroy_stream(&self, stream: HostStream) -> Result<(), BackendError> {
        // Queued work (frees included) runs before the worker stops.
        Self::stop_worker(&stream.worker);
        lock(&self.shared.workers).retain(|w| w.id != stream.worker.id);
        self.shared.probe.stream_destroyed();
        Ok(())
    }

    fn allocate(&self, _stream: &HostStream, bytes: u64) -> Result<HostMemory, BackendError> {
        self.shared.check_usable("allocate")?;
        if bytes == 0 {
            return Err(err(
                "allocate",
                BackendErrorKind::InvalidArgument,
                "zero-byte allocation",
            ));
        }
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
        self.shared.probe.allocated(bytes);
        Ok(HostMemory {
            block: Arc::new(Block {
                bytes,
                pages: Mutex::new(BTreeMap::new()),
                freed: AtomicBool::new(false),
            }),
        })
    }

    fn free_async(
        &self,
        stream: &HostStream,
        memory: HostMemory,
        retired: RetireSignal,
    ) -> Result<(), (HostMemory, RetireSignal, BackendError)> {
        if let Err(e) = self.shared.check_usable("free_async") {
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
        shared.probe.reclaim_rest();
        shared.probe.torn_down_now();
        Ok(())
    }
}
