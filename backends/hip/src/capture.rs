//! Graph capture on a context's arena: a capture pool mapped before
//! `hipStreamBeginCapture`, carved by the allocations made during capture,
//! pinned by the graph until it is destroyed; and the process-wide gate
//! that keeps memgov's own HIP calls from invalidating a capture.
//!
//! Invariants, each enforced where it is written:
//!
//! * **No runtime allocation during capture.** The pool is taken from the
//!   arena (mapping its granules) in [`HipContext::begin_capture`], before
//!   the stream begins capturing; [`HipCapture::allocate`] only carves it,
//!   in Rust, and refuses with [`PoolExhausted`] (the capture stays valid)
//!   when it runs out.
//! * **The gate** ([`memgov_backend::vmm::Gate`], one for HIP): the
//!   capture mode ("controls the interaction of this capture sequence with
//!   other API calls that are not safe") prohibits calls that change memory
//!   outside any stream while a `hipStreamCaptureModeGlobal` capture is
//!   under way, and such a call invalidates the capture. The arena's map,
//!   unmap and release pass through the gate and wait until the last
//!   capture ends; a public [`HipArena::trim`](crate::HipArena::trim) is
//!   deferred instead (it returns 0 at once and the last capture's end runs
//!   it); synchronizing or destroying a capturing stream is refused to its
//!   own thread and waited for on others. Captures are keyed by their id
//!   (`hipStreamGetCaptureInfo`), not by thread. A capture leaves the gate
//!   when the runtime's capture is over, not when `end` is called: an end
//!   that fails with the stream still capturing (or before it reached the
//!   runtime) keeps it there, and the context's teardown ends it.
//! * **Pins.** A [`HipGraph`] owns its pool and the host buffers its copies
//!   read and write. [`HipGraph::destroy`] waits for every stream of the
//!   context (so every launch finished), destroys the executable graph and
//!   the graph, and only then returns the pool to the arena. Teardown
//!   destroys the graphs still live and reports how many.
//! * **Where ROCm lacks the calls**, [`HipContext::begin_capture`] answers
//!   `Unsupported`, naming the first one missing.

use crate::arena::{release::quiesce, Arena};
use crate::ffi::{self, hipGraphExec_t, hipGraph_t, hipStream_t};
use crate::result::err;
use crate::shared::Shared;
use crate::{HipContext, HipStream};
use memgov_backend::vmm::{CapturePool, Gate, ALIGN};
use memgov_backend::{lock, BackendError, BackendErrorKind};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// The HIP runtime's gate: process-wide, as the runtime's rule is.
pub(crate) fn gate() -> &'static Gate {
    static GATE: OnceLock<Gate> = OnceLock::new();
    GATE.get_or_init(|| Gate::new(crate::result::BACKEND, "HipCapture"))
}

/// The process-wide gate between HIP stream captures begun through memgov
/// and memgov's own potentially unsafe runtime calls (map, unmap, release,
/// device synchronize, `hipHostMalloc`, `hipHostFree`, `hipFree`). A
/// runtime that makes such calls itself beside memgov's captures can pass
/// them through it ([`Gate::call`]); [`Gate::waiting`] shows calls held
/// back by a capture.
pub fn capture_gate() -> &'static Gate {
    gate()
}

pub use memgov_backend::capability::{CaptureConfig, CaptureMode, PoolExhausted};

/// `hipStreamCaptureMode` of a [`CaptureMode`].
fn raw_mode(mode: CaptureMode) -> i32 {
    match mode {
        CaptureMode::Global => ffi::hipStreamCaptureModeGlobal,
        CaptureMode::ThreadLocal => ffi::hipStreamCaptureModeThreadLocal,
        CaptureMode::Relaxed => ffi::hipStreamCaptureModeRelaxed,
    }
}

/// Device memory carved from a capture pool: valid while the graph made by
/// the capture lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureBuffer {
    ptr: u64,
    bytes: u64,
}

impl CaptureBuffer {
    /// Its device address.
    pub fn device_ptr(&self) -> ffi::hipDeviceptr_t {
        self.ptr as ffi::hipDeviceptr_t
    }

    /// Its size in bytes.
    pub fn len(&self) -> u64 {
        self.bytes
    }

    /// Whether it is zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

/// A host buffer a captured download writes into, read with
/// [`HipGraph::read_output`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputSlot(usize);

// ---- pins ----------------------------------------------------------------

/// The executable graphs of a context still live, destroyed by teardown if
/// their owners did not.
#[derive(Default)]
pub(crate) struct Pins {
    live: Mutex<PinState>,
    /// Captures whose end failed while the runtime still captured (or
    /// could not be asked): their id and stream. The gate keeps them under
    /// way until a later end reaches the runtime or teardown destroys them
    /// with the context's streams.
    stranded: Mutex<Vec<(u64, usize)>>,
}

#[derive(Default)]
struct PinState {
    next: u64,
    graphs: HashMap<u64, (RawGraph, u64)>,
    /// Host buffers of graphs dropped without a successful destroy: a
    /// launch may still read or write them, so they live as long as the
    /// pins (past teardown, which waits for every launch).
    orphans: Vec<HostBuffers>,
}

/// The host memory a graph's recorded copies read and write.
#[derive(Default)]
struct HostBuffers {
    /// Read by the runtime through the recorded copies, never by Rust.
    _inputs: Vec<Box<[u8]>>,
    outputs: Vec<Box<[u8]>>,
}

#[derive(Clone, Copy)]
struct RawGraph {
    exec: hipGraphExec_t,
    graph: hipGraph_t,
}

// SAFETY: runtime handles, usable from any host thread; the struct holds no
// thread-bound state.
unsafe impl Send for RawGraph {}

impl Pins {
    /// First in teardown: the captures a failed end left live are ended in
    /// the runtime (unless the context is lost) and their graphs discarded;
    /// then the gate forgets them, whatever the runtime answered, since
    /// teardown destroys the context's streams and their captures with them
    /// (a capture the runtime still holds here, one begun in global or
    /// thread-local mode on another thread, is abandoned with its stream).
    pub(crate) fn end_stranded(&self, s: &Shared, lost: bool) {
        let stranded = std::mem::take(&mut *lock(&self.stranded));
        for (id, stream) in stranded {
            if !lost {
                if let Ok(_device) = s.make_current("teardown") {
                    let mut graph: hipGraph_t = std::ptr::null_mut();
                    // SAFETY: a stream of this context still captured (its
                    // streams are destroyed later in teardown); valid out
                    // pointer.
                    let r = unsafe { ffi::hipStreamEndCapture(stream as hipStream_t, &mut graph) };
                    if r == ffi::SUCCESS && !graph.is_null() {
                        // SAFETY: the graph just made, never instantiated.
                        let _ = unsafe { ffi::hipGraphDestroy(graph) };
                    }
                }
            }
            gate().end(id);
        }
    }

    /// Teardown of a lost context: forget the graphs without runtime calls
    /// (they go with the device); later destroys do nothing.
    pub(crate) fn close(&self) {
        lock(&self.live).graphs.clear();
    }

    /// Destroy the graphs still live after waiting for every stream,
    /// returning their pools to the arena; returns how many there were.
    /// Later [`HipGraph::destroy`] calls do nothing.
    pub(crate) fn teardown(&self, s: &Shared, arena: &Arena) -> Result<usize, BackendError> {
        let graphs: Vec<(RawGraph, u64)> =
            lock(&self.live).graphs.drain().map(|(_, v)| v).collect();
        if graphs.is_empty() {
            return Ok(0);
        }
        let _call = gate().call("teardown", false)?;
        let _device = s.make_current("teardown")?;
        quiesce(s, "teardown", None)?;
        let n = graphs.len();
        for (raw, pool) in graphs {
            destroy_raw(s, raw, "teardown")?;
            arena.retire(pool);
        }
        Ok(n)
    }
}

fn destroy_raw(s: &Shared, raw: RawGraph, op: &'static str) -> Result<(), BackendError> {
    // SAFETY: handles made by end(), destroyed once (taken out of the pins
    // first); every launch has finished (the caller waited).
    let r = unsafe { ffi::hipGraphExecDestroy(raw.exec) };
    s.checked(op, "hipGraphExecDestroy", r)?;
    // SAFETY: as above.
    let r = unsafe { ffi::hipGraphDestroy(raw.graph) };
    s.checked(op, "hipGraphDestroy", r)
}

// ---- capture -------------------------------------------------------------

/// A stream capture under way ([`HipContext::begin_capture`]): allocations
/// carved from its pool and copies recorded on its stream, then
/// [`end`](Self::end) makes the graph.
///
/// ```no_run
/// use memgov::hip::{ArenaConfig, CaptureConfig, CaptureMode, HipConfig, HipContext};
/// use memgov::DeviceContext;
/// let ctx = HipContext::new(HipConfig { arena: Some(ArenaConfig::default()), ..HipConfig::default() })?;
/// let s = ctx.create_stream()?;
/// let mut capture = ctx.begin_capture(&s, CaptureConfig { pool_bytes: 1 << 20, mode: CaptureMode::Global })?;
/// let buf = capture.allocate(4096)?; // carved, no runtime call
/// capture.upload(&buf, 0, vec![7; 4096])?;
/// let out = capture.download(&buf, 0, 4096)?;
/// let mut graph = capture.end()?;
/// graph.launch(&s)?;
/// assert_eq!(graph.read_output(out)?, vec![7; 4096]);
/// graph.destroy()?;
/// ctx.destroy_stream(s)?;
/// ctx.teardown(false)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct HipCapture<'a> {
    ctx: &'a HipContext,
    arena: Arc<Arena>,
    stream: hipStream_t,
    id: u64,
    pool: CapturePool,
    inputs: Vec<Box<[u8]>>,
    outputs: Vec<Box<[u8]>>,
    /// Set by end(): nothing left for Drop to undo.
    done: bool,
}

impl std::fmt::Debug for HipCapture<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipCapture")
            .field("id", &self.id)
            .field("pool", &self.pool.bytes())
            .field("used", &self.pool.used())
            .finish()
    }
}

/// `Ok` when the loaded HIP runtime has every call a capture needs;
/// otherwise `Unavailable` (no runtime) or `Unsupported`, naming the first
/// call missing. A capture also needs a context with an arena.
pub fn capture_supported() -> Result<(), BackendError> {
    if let Some(why) = ffi::runtime_missing() {
        return Err(err("begin_capture", BackendErrorKind::Unavailable, why));
    }
    match ffi::missing(&ffi::CAPTURE_SYMBOLS) {
        None => Ok(()),
        Some(symbol) => Err(err(
            "begin_capture",
            BackendErrorKind::Unsupported,
            format!(
                "a stream capture needs {symbol}, which the loaded HIP runtime does not export \
                 (ROCm 4.3 or newer has HIP's graph calls)"
            ),
        )),
    }
}

impl HipContext {
    /// The size of the pool [`begin_capture`](Self::begin_capture) takes for
    /// `pool_bytes`: at least 1, rounded up to 256 bytes, checked
    /// (`PoolTooLarge`, an `InvalidArgument`, when that passes `u64::MAX`).
    pub fn capture_pool_bytes(pool_bytes: u64) -> Result<u64, BackendError> {
        Ok(CapturePool::size_for(
            crate::result::BACKEND,
            pool_bytes,
            ALIGN,
        )?)
    }

    /// Begin capturing `stream` into a graph, with a pool of
    /// `config.pool_bytes` taken from the context's arena first (mapped
    /// now, so nothing maps during the capture). Needs an arena
    /// ([`HipConfig::arena`](crate::HipConfig::arena)) and a runtime with
    /// the capture calls (`Unsupported` otherwise, naming what is missing).
    ///
    /// Waits for memgov's maps and unmaps under way to finish; while the
    /// capture is under way, later ones wait for it to end.
    pub fn begin_capture(
        &self,
        stream: &HipStream,
        config: CaptureConfig,
    ) -> Result<HipCapture<'_>, BackendError> {
        const OP: &str = "begin_capture";
        let s = &*self.shared;
        s.check_usable(OP)?;
        s.check_stream(OP, stream)?;
        capture_supported()?;
        let Some(arena) = self.arena.clone() else {
            return Err(err(
                OP,
                BackendErrorKind::Unsupported,
                "a capture pool comes from the context's arena, and this context has none: \
                 create it with HipConfig::arena",
            ));
        };
        let pool_bytes = Self::capture_pool_bytes(config.pool_bytes)?;
        let device = s.make_current(OP)?;
        let pool = arena.allocate(s, pool_bytes)?;
        let g = gate();
        g.begin();
        let raw = stream.raw.0;
        // SAFETY: a live stream of this context (checked above); its device
        // is current.
        let r = unsafe { ffi::hipStreamBeginCapture(raw, raw_mode(config.mode)) };
        let begun = s.checked(OP, "hipStreamBeginCapture", r).and_then(|()| {
            let (mut status, mut id) = (0i32, 0u64);
            // SAFETY: valid out pointers; the stream is live.
            let r = unsafe { ffi::hipStreamGetCaptureInfo(raw, &mut status, &mut id) };
            s.checked(OP, "hipStreamGetCaptureInfo", r).map(|()| id)
        });
        g.begun(begun.as_ref().ok().copied(), raw as usize);
        drop(device);
        match begun {
            Ok(id) => Ok(HipCapture {
                ctx: self,
                arena,
                stream: raw,
                id,
                pool: CapturePool::new(pool, pool_bytes),
                inputs: Vec::new(),
                outputs: Vec::new(),
                done: false,
            }),
            Err(e) => {
                // Nothing used the pool: back to the arena at once.
                arena.retire(pool);
                Err(e)
            }
        }
    }

    /// The context's part of teardown for its graphs (before the arena's):
    /// destroy the live ones after their launches, and say how many there
    /// were; on a lost context forget them.
    pub(crate) fn graphs_teardown(&self, arena: &Arena, lost: bool) -> Result<(), BackendError> {
        if lost || self.shared.is_lost() {
            self.pins.close();
            return Ok(());
        }
        match self.pins.teardown(&self.shared, arena)? {
            0 => Ok(()),
            n => Err(err(
                "teardown",
                BackendErrorKind::InvalidArgument,
                format!(
                    "{n} executable graph(s) were still live at teardown: they were destroyed \
                     after their launches finished and their capture pools given back; destroy \
                     graphs with HipGraph::destroy before teardown"
                ),
            )),
        }
    }
}

impl HipCapture<'_> {
    /// The runtime's id of this capture.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes of the pool not carved yet.
    pub fn pool_free(&self) -> u64 {
        self.pool.free()
    }

    /// Carve `bytes` from the pool: no runtime call. Refused with
    /// [`PoolExhausted`] when they do not fit; the capture stays valid.
    pub fn allocate(&mut self, bytes: u64) -> Result<CaptureBuffer, PoolExhausted> {
        let ptr = self.pool.carve(crate::result::BACKEND, bytes, ALIGN)?;
        Ok(CaptureBuffer { ptr, bytes })
    }

    fn check_range(
        &self,
        op: &'static str,
        buf: &CaptureBuffer,
        offset: u64,
        len: u64,
    ) -> Result<(), BackendError> {
        if self.pool.holds(buf.ptr, buf.bytes, offset, len) {
            Ok(())
        } else {
            Err(err(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "{len} B at offset {offset} of a {} B capture buffer at {:#x} is not inside \
                     this capture's pool: use buffers this capture allocated, within their length",
                    buf.bytes, buf.ptr
                ),
            ))
        }
    }

    /// Record a copy of `data` into `buf` at `offset`; every launch of the
    /// graph repeats it. The graph keeps `data`.
    pub fn upload(
        &mut self,
        buf: &CaptureBuffer,
        offset: u64,
        data: Vec<u8>,
    ) -> Result<(), BackendError> {
        const OP: &str = "capture_upload";
        self.check_range(OP, buf, offset, data.len() as u64)?;
        let data = data.into_boxed_slice();
        let s = &*self.ctx.shared;
        let _device = s.make_current(OP)?;
        // SAFETY: the destination lies in the pool (checked above), which
        // the graph pins; the source is owned by the graph from here on (a
        // boxed slice does not move when the Vec holding it grows); HIP
        // does not write through the source pointer.
        let r = unsafe {
            ffi::hipMemcpyHtoDAsync(
                (buf.ptr + offset) as *mut c_void,
                data.as_ptr() as *mut c_void,
                data.len(),
                self.stream,
            )
        };
        s.checked(OP, "hipMemcpyHtoDAsync", r)?;
        self.inputs.push(data);
        Ok(())
    }

    /// Record a copy of `len` bytes of `buf` at `offset` into a host buffer
    /// the graph owns; read it after a launch with
    /// [`HipGraph::read_output`].
    pub fn download(
        &mut self,
        buf: &CaptureBuffer,
        offset: u64,
        len: usize,
    ) -> Result<OutputSlot, BackendError> {
        const OP: &str = "capture_download";
        self.check_range(OP, buf, offset, len as u64)?;
        let mut host = vec![0u8; len].into_boxed_slice();
        let s = &*self.ctx.shared;
        let _device = s.make_current(OP)?;
        // SAFETY: the source lies in the pool (checked above); the
        // destination is owned by the graph, which outlives every launch
        // (destroy waits for every stream first).
        let r = unsafe {
            ffi::hipMemcpyDtoHAsync(
                host.as_mut_ptr().cast(),
                (buf.ptr + offset) as *mut c_void,
                len,
                self.stream,
            )
        };
        s.checked(OP, "hipMemcpyDtoHAsync", r)?;
        self.outputs.push(host);
        Ok(OutputSlot(self.outputs.len() - 1))
    }

    /// End the capture and instantiate its graph. The pool is pinned by the
    /// graph until [`HipGraph::destroy`] (or teardown).
    pub fn end(mut self) -> Result<HipGraph, BackendError> {
        const OP: &str = "end_capture";
        self.done = true;
        let s = self.ctx.shared.clone();
        let graph = match self.end_raw(&s) {
            Ok(g) => g,
            Err(e) => {
                // Nothing was or will be launched: the pool goes back at
                // once (a capture the runtime still holds records no more
                // work, and its graph is discarded when it ends).
                self.arena.retire(self.pool.base());
                return Err(e);
            }
        };
        let mut exec: hipGraphExec_t = std::ptr::null_mut();
        let instantiated = s.make_current(OP).and_then(|_device| {
            // SAFETY: a graph the runtime just returned; valid out pointer;
            // no error node or log asked for.
            let r = unsafe {
                ffi::hipGraphInstantiate(
                    &mut exec,
                    graph,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                )
            };
            s.checked(OP, "hipGraphInstantiate", r)
        });
        if let Err(e) = instantiated {
            // SAFETY: the graph just made, destroyed once; never launched.
            let _ = unsafe { ffi::hipGraphDestroy(graph) };
            self.arena.retire(self.pool.base());
            return Err(e);
        }
        let raw = RawGraph { exec, graph };
        let key = {
            let mut st = lock(&self.ctx.pins.live);
            st.next += 1;
            let key = st.next;
            st.graphs.insert(key, (raw, self.pool.base()));
            key
        };
        Ok(HipGraph {
            shared: s,
            arena: self.arena.clone(),
            pins: self.ctx.pins.clone(),
            key,
            pool_bytes: self.pool.bytes(),
            used: self.pool.used(),
            host: HostBuffers {
                _inputs: std::mem::take(&mut self.inputs),
                outputs: std::mem::take(&mut self.outputs),
            },
            destroyed: false,
        })
    }

    /// `hipStreamEndCapture`, then, once the runtime's capture is over, the
    /// gate learns it ended (which runs deferred trims when it was the
    /// last). After a failed end the runtime is asked
    /// (`hipStreamGetCaptureInfo`'s status): a stream still capturing
    /// (active, or invalidated and still to be ended), or a device that
    /// could not be made current, keeps the gate's record, so that no other
    /// thread's gated call invalidates the capture; the context's teardown
    /// ends it.
    fn end_raw(&self, s: &Shared) -> Result<hipGraph_t, BackendError> {
        const OP: &str = "end_capture";
        let mut graph: hipGraph_t = std::ptr::null_mut();
        let mut over = false;
        let r = s.make_current(OP).and_then(|_device| {
            // SAFETY: the capturing stream; valid out pointer.
            let r = unsafe { ffi::hipStreamEndCapture(self.stream, &mut graph) };
            let r = s.checked(OP, "hipStreamEndCapture", r);
            over = r.is_ok() || !self.still_capturing();
            r
        });
        if over {
            // Out of capture (ended, or invalidated and ended): the gate
            // lets gated calls run again.
            lock(&self.ctx.pins.stranded).retain(|&(id, _)| id != self.id);
            gate().end(self.id);
        } else {
            let mut stranded = lock(&self.ctx.pins.stranded);
            if !stranded.iter().any(|&(id, _)| id == self.id) {
                stranded.push((self.id, self.stream as usize));
            }
        }
        r.map(|()| graph)
    }

    /// Whether the runtime still captures the stream (status active, or
    /// invalidated and not yet ended); also when it cannot say. The device
    /// is current.
    fn still_capturing(&self) -> bool {
        let (mut status, mut id) = (0, 0u64);
        // SAFETY: a live stream of this context; valid out pointers.
        let r = unsafe { ffi::hipStreamGetCaptureInfo(self.stream, &mut status, &mut id) };
        r != ffi::SUCCESS || status != ffi::hipStreamCaptureStatusNone
    }
}

impl Drop for HipCapture<'_> {
    /// A capture dropped without `end` is ended and its graph discarded.
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let s = self.ctx.shared.clone();
        if let Ok(graph) = self.end_raw(&s) {
            if let Ok(_device) = s.make_current("end_capture") {
                // SAFETY: the graph just made, never instantiated or launched.
                let _ = unsafe { ffi::hipGraphDestroy(graph) };
            }
        }
        self.arena.retire(self.pool.base());
    }
}

/// An instantiated graph made by a capture: launched any number of times on
/// any stream of its context, then destroyed. It pins its pool and its host
/// buffers until then.
///
/// Dropping it destroys it as [`destroy`](Self::destroy) does; when that is
/// refused (on a thread whose own capture is under way) the graph stays
/// pinned, its host buffers kept, until teardown.
pub struct HipGraph {
    shared: Arc<Shared>,
    arena: Arc<Arena>,
    pins: Arc<Pins>,
    key: u64,
    pool_bytes: u64,
    used: u64,
    host: HostBuffers,
    /// Every launch finished and the graph is out of the pins: the host
    /// buffers may go.
    destroyed: bool,
}

impl std::fmt::Debug for HipGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipGraph")
            .field("pool", &self.pool_bytes)
            .field("used", &self.used)
            .finish()
    }
}

impl HipGraph {
    fn raw(&self, op: &'static str) -> Result<RawGraph, BackendError> {
        self.raw_and_pool(op).map(|(r, _)| r)
    }

    /// The graph's handles and its pool's device address.
    fn raw_and_pool(&self, op: &'static str) -> Result<(RawGraph, u64), BackendError> {
        let st = lock(&self.pins.live);
        st.graphs.get(&self.key).copied().ok_or_else(|| {
            err(
                op,
                BackendErrorKind::InvalidArgument,
                "the graph was destroyed by its context's teardown",
            )
        })
    }

    /// Bytes of the pool the capture carved, and the pool's size.
    pub fn pool_usage(&self) -> (u64, u64) {
        (self.used, self.pool_bytes)
    }

    /// Queue one run of the graph on `stream` (`hipGraphLaunch`).
    ///
    /// Refused with `InvalidArgument` while the arena sleeps (the pool's
    /// memory is reserved, not mapped: the graph's copies would fault), as
    /// copies to sleeping memory are; wake the arena first. A sleep asked
    /// for meanwhile waits until the launch is queued, then waits for it.
    pub fn launch(&self, stream: &HipStream) -> Result<(), BackendError> {
        const OP: &str = "graph_launch";
        let s = &*self.shared;
        s.check_usable(OP)?;
        s.check_stream(OP, stream)?;
        let (raw, pool) = self.raw_and_pool(OP)?;
        let _use = s.sleep_gate.enter();
        self.arena
            .check_awake(crate::result::BACKEND, OP, pool, self.pool_bytes)?;
        let _device = s.make_current(OP)?;
        // SAFETY: a live executable graph of this context (pinned until
        // destroy); a live stream of it.
        let r = unsafe { ffi::hipGraphLaunch(raw.exec, stream.raw.0) };
        s.checked(OP, "hipGraphLaunch", r)
    }

    /// Wait for every stream of the context (admitted by the gate) and
    /// copy out what the graph's download `slot` holds. `&mut self`: no
    /// launch of this graph can be queued meanwhile.
    pub fn read_output(&mut self, slot: OutputSlot) -> Result<Vec<u8>, BackendError> {
        const OP: &str = "graph_read_output";
        let n = self.host.outputs.len();
        if slot.0 >= n {
            return Err(err(
                OP,
                BackendErrorKind::InvalidArgument,
                format!("output slot {} is not one of this graph's {n}", slot.0),
            ));
        }
        let s = &*self.shared;
        s.check_usable(OP)?;
        self.raw(OP)?;
        {
            let _call = gate().call(OP, true)?;
            let _device = s.make_current(OP)?;
            quiesce(s, OP, None)?;
        }
        Ok(self.host.outputs[slot.0].to_vec())
    }

    /// Wait for every stream of the context (admitted by the gate), destroy
    /// the executable graph and the graph, and only then return the pool to
    /// the arena and free the host buffers.
    pub fn destroy(mut self) -> Result<(), BackendError> {
        self.destroy_now("graph_destroy")
    }

    /// [`destroy`](Self::destroy) in place: on failure the graph is kept
    /// (still pinned, its pool still taken) so that the caller can try
    /// again; once it succeeded, later calls do nothing and
    /// [`launch`](Self::launch) is refused.
    pub fn try_destroy(&mut self) -> Result<(), BackendError> {
        self.destroy_now("graph_destroy")
    }

    /// Whether [`try_destroy`](Self::try_destroy) (or teardown) destroyed it.
    pub fn is_destroyed(&self) -> bool {
        self.destroyed || self.raw("graph_destroyed").is_err()
    }

    /// Bytes of device memory the graph's own allocation nodes take. Always
    /// 0 on HIP: memgov's capture makes no allocation nodes (its
    /// allocations carve the pool), and memgov does not read a graph's
    /// nodes on HIP, so graph memory a runtime's own `hipMallocAsync` on
    /// the capturing stream makes is not charged.
    pub fn graph_memory_bytes(&self) -> Result<u64, BackendError> {
        Ok(0)
    }

    fn destroy_now(&mut self, op: &'static str) -> Result<(), BackendError> {
        if self.destroyed {
            return Ok(());
        }
        let s = &*self.shared;
        let Ok(raw) = self.raw(op) else {
            // Teardown destroyed it after every launch, or forgot it with a
            // lost context.
            self.destroyed = true;
            return Ok(());
        };
        let _call = gate().call(op, true)?;
        let _device = s.make_current(op)?;
        quiesce(s, op, None)?;
        let taken = lock(&self.pins.live).graphs.remove(&self.key);
        self.destroyed = true;
        if let Some((_, pool)) = taken {
            destroy_raw(s, raw, op)?;
            self.arena.retire(pool);
        }
        Ok(())
    }
}

impl Drop for HipGraph {
    fn drop(&mut self) {
        if self.destroy_now("graph_drop").is_err() && !self.destroyed {
            let host = std::mem::take(&mut self.host);
            lock(&self.pins.live).orphans.push(host);
        }
    }
}
