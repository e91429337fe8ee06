//! Graph capture on a context's arena: a capture pool mapped and reserved
//! before `cuStreamBeginCapture_v2`, carved by the allocations made during
//! capture, pinned by the graph until it is destroyed; and the process-wide
//! gate that keeps memgov's own driver calls from invalidating a capture.
//!
//! Invariants, each enforced where it is written:
//!
//! * **No driver allocation during capture.** The pool is taken from the
//!   arena (mapping its granules) in [`CudaContext::begin_capture`], before
//!   the stream begins capturing; [`CudaCapture::allocate`] only carves it,
//!   in Rust, and refuses with [`PoolExhausted`] (the capture stays valid)
//!   when it runs out.
//! * **The gate.** The driver prohibits "potentially unsafe" calls (those
//!   that change memory outside any stream, like `cudaMalloc` in its
//!   documentation) on every thread while a capture begun in
//!   `CU_STREAM_CAPTURE_MODE_GLOBAL` is under way, and invalidates the
//!   capture. The arena's map, unmap and release pass through the gate
//!   ([`memgov_backend::vmm::Gate`], one for CUDA, shared in shape with HIP):
//!   while a capture is under way they wait until the last capture ends (a
//!   public [`CudaArena::trim`](crate::CudaArena::trim) is deferred instead:
//!   it returns 0 at once and the last capture's end runs it). Captures are
//!   keyed by their capture id (`cuStreamGetCaptureInfo_v2`), not by thread;
//!   the thread that began one is remembered only so that a map it asks for
//!   itself during its own capture is refused rather than waited on
//!   forever. The gate is process-wide because the driver's rule is. A
//!   capture leaves the gate when the driver's capture is over, not when
//!   `end` is called: an end that fails with the stream still capturing (or
//!   before it reached the driver) keeps it there, and the context's
//!   teardown ends it.
//! * **Pins.** A [`CudaGraph`] owns its pool and the host buffers its
//!   copies read and write. [`CudaGraph::destroy`] synchronizes the context
//!   (so every launch finished), destroys the executable graph and the
//!   graph, and only then returns the pool to the arena. Teardown destroys
//!   the graphs still live and reports how many.

use crate::arena::Arena;
use crate::result::err;
use crate::shared::Shared;
use crate::{CudaContext, CudaStream};
use cudarc::driver::sys::{self, CUdeviceptr, CUgraph, CUgraphExec, CUstream};
use memgov_backend::vmm::{CapturePool, Gate};
use memgov_backend::{lock, BackendError, BackendErrorKind};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Allocations carved from a capture pool, and the pool itself, are
/// aligned to this, as `cuMemAlloc` aligns its allocations.
pub const CAPTURE_ALIGN: u64 = 256;
const ALIGN: u64 = CAPTURE_ALIGN;

pub use memgov_backend::capability::{CaptureConfig, CaptureMode, PoolExhausted};

/// `CUstreamCaptureMode` of a [`CaptureMode`].
fn raw_mode(mode: CaptureMode) -> sys::CUstreamCaptureMode {
    match mode {
        CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

/// Device memory carved from a capture pool: valid while the graph made by
/// the capture lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureBuffer {
    ptr: CUdeviceptr,
    bytes: u64,
}

impl CaptureBuffer {
    /// Its device address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
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
/// [`CudaGraph::read_output`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputSlot(usize);

// ---- the process-wide gate -----------------------------------------------

/// The CUDA driver's gate ([`memgov_backend::vmm::Gate`]): process-wide, as
/// the driver's rule is.
pub(crate) fn gate() -> &'static Gate {
    static GATE: OnceLock<Gate> = OnceLock::new();
    GATE.get_or_init(|| Gate::new(crate::result::BACKEND, "CudaCapture"))
}

/// The process-wide gate between CUDA stream captures begun through memgov
/// and memgov's own potentially unsafe driver calls (map, unmap, release,
/// `cuCtxSynchronize`, `cuMemHostAlloc`, `cuMemFreeHost`). A runtime that
/// makes such calls itself beside memgov's captures can pass them through
/// it ([`Gate::call`]); [`Gate::waiting`] shows calls held back by a
/// capture.
pub fn capture_gate() -> &'static Gate {
    gate()
}

// ---- pins ----------------------------------------------------------------

/// The executable graphs of a context still live, destroyed by teardown if
/// their owners did not.
#[derive(Default)]
pub(crate) struct Pins {
    live: Mutex<PinState>,
    /// Captures whose end failed while the driver still captured (or could
    /// not be asked): their id and stream. The gate keeps them under way
    /// until a later end reaches the driver or teardown destroys them with
    /// the context.
    stranded: Mutex<Vec<(u64, usize)>>,
}

#[derive(Default)]
struct PinState {
    next: u64,
    graphs: HashMap<u64, (RawGraph, CUdeviceptr)>,
    closed: bool,
    /// Host buffers of graphs dropped without a successful destroy: a
    /// launch may still read or write them, so they live as long as the
    /// pins (past teardown, which waits for every launch).
    orphans: Vec<HostBuffers>,
}

/// The host memory a graph's recorded copies read and write.
#[derive(Default)]
struct HostBuffers {
    /// Read by the driver through the recorded copies, never by Rust.
    _inputs: Vec<Box<[u8]>>,
    outputs: Vec<Box<[u8]>>,
}

#[derive(Clone, Copy)]
struct RawGraph {
    exec: CUgraphExec,
    graph: CUgraph,
}

// SAFETY: driver handles, used only with the context current on the calling
// thread; the struct holds no thread-bound state.
unsafe impl Send for RawGraph {}

impl Pins {
    /// First in teardown: the captures a failed end left live are ended in
    /// the driver (unless the context is lost) and their graphs discarded;
    /// then the gate forgets them, whatever the driver answered, since the
    /// context's release destroys its streams and their captures with it
    /// (a capture the driver still holds here, one begun in global or
    /// thread-local mode on another thread, is abandoned with the context).
    pub(crate) fn end_stranded(&self, s: &Shared, lost: bool) {
        let stranded = std::mem::take(&mut *lock(&self.stranded));
        for (id, stream) in stranded {
            if !lost {
                if let Ok(_current) = s.make_current("teardown") {
                    let mut graph: CUgraph = std::ptr::null_mut();
                    // SAFETY: a stream of this context still captured (its
                    // streams are destroyed later in teardown); the context
                    // is current; valid out pointer.
                    let r = unsafe { sys::cuStreamEndCapture(stream as CUstream, &mut graph) };
                    if r == sys::CUresult::CUDA_SUCCESS && !graph.is_null() {
                        // SAFETY: the graph just made, never instantiated.
                        let _ = unsafe { sys::cuGraphDestroy(graph) };
                    }
                }
            }
            gate().end(id);
        }
    }

    /// Teardown of a lost context: forget the graphs without driver calls
    /// (they go with the context); later destroys do nothing.
    pub(crate) fn close(&self) {
        let mut st = lock(&self.live);
        st.closed = true;
        st.graphs.clear();
    }

    /// Destroy the graphs still live (after every stream was synchronized:
    /// called first in teardown, which waits for queued work), returning
    /// their pools to the arena; returns how many there were. Later
    /// [`CudaGraph::destroy`] calls do nothing.
    pub(crate) fn teardown(&self, s: &Shared, arena: &Arena) -> Result<usize, BackendError> {
        let graphs: Vec<(RawGraph, CUdeviceptr)> = {
            let mut st = lock(&self.live);
            st.closed = true;
            st.graphs.drain().map(|(_, v)| v).collect()
        };
        if graphs.is_empty() {
            return Ok(0);
        }
        let _call = gate().call("teardown", false)?;
        let _current = s.make_current("teardown")?;
        // SAFETY: the context is current; waits for every launch.
        let r = unsafe { sys::cuCtxSynchronize() };
        s.checked("teardown", "cuCtxSynchronize", r)?;
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
    // first); the context is current.
    let r = unsafe { sys::cuGraphExecDestroy(raw.exec) };
    s.checked(op, "cuGraphExecDestroy", r)?;
    // SAFETY: as above.
    let r = unsafe { sys::cuGraphDestroy(raw.graph) };
    s.checked(op, "cuGraphDestroy", r)
}

// ---- capture -------------------------------------------------------------

/// A stream capture under way ([`CudaContext::begin_capture`]): allocations
/// carved from its pool and copies recorded on its stream, then
/// [`end`](Self::end) makes the graph.
///
/// ```no_run
/// use memgov::cuda::{ArenaConfig, CaptureConfig, CaptureMode, CudaConfig, CudaContext};
/// use memgov::DeviceContext;
/// let ctx = CudaContext::new(CudaConfig { arena: Some(ArenaConfig::default()), ..CudaConfig::default() })?;
/// let s = ctx.create_stream()?;
/// let mut cap = ctx.begin_capture(&s, CaptureConfig { pool_bytes: 4 << 20, mode: CaptureMode::Global })?;
/// let buf = cap.allocate(4096)?;
/// cap.upload(&buf, 0, vec![7; 4096])?;
/// let out = cap.download(&buf, 0, 4096)?;
/// let mut graph = cap.end()?;
/// for _ in 0..10 {
///     graph.launch(&s)?;
/// }
/// assert_eq!(graph.read_output(out)?, vec![7; 4096]);
/// graph.destroy()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CudaCapture<'a> {
    ctx: &'a CudaContext,
    arena: Arc<Arena>,
    stream: CUstream,
    id: u64,
    pool: CapturePool,
    inputs: Vec<Box<[u8]>>,
    outputs: Vec<Box<[u8]>>,
    /// Set by end(): nothing left for Drop to undo.
    done: bool,
}

impl std::fmt::Debug for CudaCapture<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCapture")
            .field("id", &self.id)
            .field("pool", &self.pool.bytes())
            .field("used", &self.pool.used())
            .finish()
    }
}

impl CudaContext {
    /// The size of the pool [`begin_capture`](Self::begin_capture) takes for
    /// `pool_bytes`: at least 1, rounded up to [`CAPTURE_ALIGN`], checked
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
    /// ([`CudaConfig::arena`](crate::CudaConfig::arena)).
    ///
    /// Waits for memgov's maps and unmaps under way to finish; while the
    /// capture is under way, later ones wait for it to end.
    pub fn begin_capture(
        &self,
        stream: &CudaStream,
        config: CaptureConfig,
    ) -> Result<CudaCapture<'_>, BackendError> {
        const OP: &str = "begin_capture";
        let s = &*self.shared;
        s.check_usable(OP)?;
        s.check_stream(OP, stream)?;
        let Some(arena) = self.arena.clone() else {
            return Err(err(
                OP,
                BackendErrorKind::Unsupported,
                "a capture pool comes from the context's arena, and this context has none: \
                 create it with CudaConfig::arena",
            ));
        };
        let pool_bytes = Self::capture_pool_bytes(config.pool_bytes)?;
        let current = s.make_current(OP)?;
        let pool = arena.allocate(s, pool_bytes)?;
        let g = gate();
        g.begin();
        // SAFETY: a live stream of this context (checked above), which is
        // current.
        let r = unsafe { sys::cuStreamBeginCapture_v2(stream.raw, raw_mode(config.mode)) };
        let begun = s.checked(OP, "cuStreamBeginCapture_v2", r).and_then(|()| {
            let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            let mut id: u64 = 0;
            // SAFETY: valid out pointers; the optional ones are null.
            let r = unsafe {
                sys::cuStreamGetCaptureInfo_v2(
                    stream.raw,
                    &mut status,
                    &mut id,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            };
            s.checked(OP, "cuStreamGetCaptureInfo_v2", r).map(|()| id)
        });
        g.begun(begun.as_ref().ok().copied(), stream.raw as usize);
        drop(current);
        match begun {
            Ok(id) => Ok(CudaCapture {
                ctx: self,
                arena,
                stream: stream.raw,
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
}

impl CudaCapture<'_> {
    /// The driver's id of this capture.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes of the pool not carved yet.
    pub fn pool_free(&self) -> u64 {
        self.pool.free()
    }

    /// Carve `bytes` from the pool: no driver call. Refused with
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
        let _current = s.make_current(OP)?;
        // SAFETY: the destination lies in the pool (checked above), which the
        // graph pins; the source is owned by the graph from here on (a boxed
        // slice does not move when the Vec holding it grows).
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                buf.ptr + offset,
                data.as_ptr().cast(),
                data.len(),
                self.stream,
            )
        };
        s.checked(OP, "cuMemcpyHtoDAsync_v2", r)?;
        self.inputs.push(data);
        Ok(())
    }

    /// Record a copy of `len` bytes of `buf` at `offset` into a host buffer
    /// the graph owns; read it after a launch with
    /// [`CudaGraph::read_output`].
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
        let _current = s.make_current(OP)?;
        // SAFETY: the source lies in the pool (checked above); the
        // destination is owned by the graph, which outlives every launch
        // (destroy synchronizes first).
        let r = unsafe {
            sys::cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), buf.ptr + offset, len, self.stream)
        };
        s.checked(OP, "cuMemcpyDtoHAsync_v2", r)?;
        self.outputs.push(host);
        Ok(OutputSlot(self.outputs.len() - 1))
    }

    /// End the capture and instantiate its graph. The pool is pinned by the
    /// graph until [`CudaGraph::destroy`] (or teardown).
    pub fn end(mut self) -> Result<CudaGraph, BackendError> {
        const OP: &str = "end_capture";
        self.done = true;
        let s = self.ctx.shared.clone();
        let ended = self.end_raw(&s);
        let graph = match ended {
            Ok(g) => g,
            Err(e) => {
                // Nothing was or will be launched: the pool goes back at
                // once (a capture the driver still holds records no more
                // work, and its graph is discarded when it ends).
                self.arena.retire(self.pool.base());
                return Err(e);
            }
        };
        let mut exec: CUgraphExec = std::ptr::null_mut();
        let instantiated = s.make_current(OP).and_then(|_current| {
            // SAFETY: a graph the driver just returned; valid out pointer;
            // the context is current.
            let r = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
            s.checked(OP, "cuGraphInstantiateWithFlags", r)
        });
        if let Err(e) = instantiated {
            // SAFETY: the graph just made, destroyed once; never launched.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
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
        Ok(CudaGraph {
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

    /// `cuStreamEndCapture`, then, once the driver's capture is over, the
    /// gate learns it ended (which runs deferred trims when it was the
    /// last). After a failed end the driver is asked
    /// (`cuStreamIsCapturing`): a stream still capturing (active, or
    /// invalidated and still to be ended), or a context that could not be
    /// made current, keeps the gate's record, so that no other thread's
    /// gated call invalidates the capture; the context's teardown ends it.
    fn end_raw(&self, s: &Shared) -> Result<CUgraph, BackendError> {
        const OP: &str = "end_capture";
        let mut graph: CUgraph = std::ptr::null_mut();
        let mut over = false;
        let r = s.make_current(OP).and_then(|_c| {
            // SAFETY: the capturing stream, current context; valid out
            // pointer.
            let r = unsafe { sys::cuStreamEndCapture(self.stream, &mut graph) };
            let r = s.checked(OP, "cuStreamEndCapture", r);
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

    /// Whether the driver still captures the stream (`cuStreamIsCapturing`:
    /// active, or invalidated and not yet ended); also when it cannot say.
    /// The context is current.
    fn still_capturing(&self) -> bool {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream of the current context; valid out pointer.
        let r = unsafe { sys::cuStreamIsCapturing(self.stream, &mut status) };
        r != sys::CUresult::CUDA_SUCCESS
            || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }
}

impl Drop for CudaCapture<'_> {
    /// A capture dropped without `end` is ended and its graph discarded.
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let s = self.ctx.shared.clone();
        if let Ok(graph) = self.end_raw(&s) {
            if let Ok(_current) = s.make_current("end_capture") {
                // SAFETY: the graph just made, never instantiated or launched.
                let _ = unsafe { sys::cuGraphDestroy(graph) };
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
pub struct CudaGraph {
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

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGraph")
            .field("pool", &self.pool_bytes)
            .field("used", &self.used)
            .finish()
    }
}

impl CudaGraph {
    fn raw(&self, op: &'static str) -> Result<RawGraph, BackendError> {
        self.raw_and_pool(op).map(|(r, _)| r)
    }

    /// The graph's handles and its pool's device address.
    fn raw_and_pool(&self, op: &'static str) -> Result<(RawGraph, CUdeviceptr), BackendError> {
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

    /// Bytes of device memory the graph's own allocation nodes take: the
    /// sum of `bytesize` over its `CU_GRAPH_NODE_TYPE_MEM_ALLOC` nodes
    /// (`cuGraphGetNodes`, `cuGraphNodeGetType`,
    /// `cuGraphMemAllocNodeGetParams`). Such nodes come from stream-ordered
    /// allocations (`cuMemAllocAsync`) a runtime queued on the capturing
    /// stream itself; memgov's capture makes none (its allocations carve
    /// the pool). The driver keeps that memory for the graph while it may
    /// launch, so the sum is what the graph holds at most (the driver may
    /// reuse memory between allocations whose lifetimes do not overlap).
    pub fn graph_memory_bytes(&self) -> Result<u64, BackendError> {
        const OP: &str = "graph_memory";
        let s = &*self.shared;
        s.check_usable(OP)?;
        let raw = self.raw(OP)?;
        let _current = s.make_current(OP)?;
        let mut n: usize = 0;
        // SAFETY: a live graph of this context (pinned until destroy);
        // a null node array asks for the count only; the context is current.
        let r = unsafe { sys::cuGraphGetNodes(raw.graph, std::ptr::null_mut(), &mut n) };
        s.checked(OP, "cuGraphGetNodes", r)?;
        if n == 0 {
            return Ok(0);
        }
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
        // SAFETY: `nodes` holds `n` entries, the count passed in.
        let r = unsafe { sys::cuGraphGetNodes(raw.graph, nodes.as_mut_ptr(), &mut n) };
        s.checked(OP, "cuGraphGetNodes", r)?;
        let mut bytes = 0u64;
        for &node in &nodes[..n.min(nodes.len())] {
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a node the driver just listed; valid out pointer.
            let r = unsafe { sys::cuGraphNodeGetType(node, &mut kind) };
            s.checked(OP, "cuGraphNodeGetType", r)?;
            if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC {
                continue;
            }
            // SAFETY: all-zero is a valid value of this plain-data struct
            // (null pointers, zero sizes, the first enum variants).
            let mut params: sys::CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
            // SAFETY: an allocation node (its type checked above); valid out
            // pointer.
            let r = unsafe { sys::cuGraphMemAllocNodeGetParams(node, &mut params) };
            s.checked(OP, "cuGraphMemAllocNodeGetParams", r)?;
            bytes = bytes.saturating_add(params.bytesize as u64);
        }
        Ok(bytes)
    }

    /// Queue one run of the graph on `stream` (`cuGraphLaunch`).
    ///
    /// Refused with `InvalidArgument` while the arena sleeps (the pool's
    /// memory is reserved, not mapped: the graph's copies would fault), as
    /// copies to sleeping memory are; wake the arena first. A sleep asked
    /// for meanwhile waits until the launch is queued, then waits for it.
    pub fn launch(&self, stream: &CudaStream) -> Result<(), BackendError> {
        const OP: &str = "graph_launch";
        let s = &*self.shared;
        s.check_usable(OP)?;
        s.check_stream(OP, stream)?;
        let (raw, pool) = self.raw_and_pool(OP)?;
        let _use = s.sleep_gate.enter();
        self.arena
            .check_awake(crate::result::BACKEND, OP, pool, self.pool_bytes)?;
        let _current = s.make_current(OP)?;
        // SAFETY: a live executable graph of this context (pinned until
        // destroy); a live stream of it, current.
        let r = unsafe { sys::cuGraphLaunch(raw.exec, stream.raw) };
        s.checked(OP, "cuGraphLaunch", r)
    }

    /// Wait for every launch of the context (`cuCtxSynchronize`, admitted
    /// by the gate) and copy out what the graph's download `slot` holds.
    /// `&mut self`: no launch of this graph can be queued meanwhile.
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
            let _current = s.make_current(OP)?;
            // SAFETY: the context is current; waits for every launch.
            let r = unsafe { sys::cuCtxSynchronize() };
            s.checked(OP, "cuCtxSynchronize", r)?;
        }
        Ok(self.host.outputs[slot.0].to_vec())
    }

    /// Wait for every launch (`cuCtxSynchronize`, admitted by the gate),
    /// destroy the executable graph and the graph, and only then return the
    /// pool to the arena and free the host buffers.
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
        let _current = s.make_current(op)?;
        // SAFETY: the context is current; waits for every launch.
        let r = unsafe { sys::cuCtxSynchronize() };
        s.checked(op, "cuCtxSynchronize", r)?;
        let taken = lock(&self.pins.live).graphs.remove(&self.key);
        self.destroyed = true;
        if let Some((_, pool)) = taken {
            destroy_raw(s, raw, op)?;
            self.arena.retire(pool);
        }
        Ok(())
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if self.destroy_now("graph_drop").is_err() && !self.destroyed {
            let host = std::mem::take(&mut self.host);
            lock(&self.pins.live).orphans.push(host);
        }
    }
}
