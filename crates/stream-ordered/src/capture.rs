//! The graph half of stream capture on a context's arena, written once over
//! the vendor's [`CaptureTable`]: a capture under way ([`CaptureCore`]:
//! begun after its pool was mapped, carving the pool, recording copies,
//! ended and instantiated), the graph it makes ([`GraphCore`]: launched,
//! read, destroyed after every launch finished, its pool returned to the
//! arena only then), and the context's [`Pins`] (the graphs still live,
//! and the captures a failed end left under way), which teardown empties.
//!
//! The public [`Capture`] and [`Graph`] over them are the vendors'
//! `CudaCapture` / `HipCapture` and `CudaGraph` / `HipGraph` (type
//! aliases); a vendor adds what is its own (the begin's checks, CUDA's
//! graph-memory count in its table).
//!
//! Invariants, each enforced where it is written:
//!
//! * **No driver allocation during capture.** The pool is taken from the
//!   arena (mapping its granules) in [`Capture::begin`], before the stream
//!   begins capturing; [`Capture::allocate`] only carves it, in Rust, and
//!   refuses with [`PoolExhausted`] (the capture stays valid) when it runs
//!   out.
//! * **The gate.** The drivers prohibit "potentially unsafe" calls (those
//!   that change memory outside any stream) on every thread while a capture
//!   begun in global mode is under way, and invalidate the capture. The
//!   arena's map, unmap and release pass through the vendor's gate
//!   ([`memgov_backend::vmm::Gate`], process-wide because the driver's rule
//!   is): while a capture is under way they wait until the last capture
//!   ends (a public arena trim is deferred instead: it returns 0 at once and
//!   the last capture's end runs it). Captures are keyed by their capture
//!   id, not by thread; the thread that began one is remembered only so
//!   that a map it asks for itself during its own capture is refused rather
//!   than waited on forever.
//! * **Leaving the gate.** A capture leaves the gate when the driver's
//!   capture is over, not when `end` is called: an end that fails with the
//!   stream still capturing (or before it reached the driver) keeps it
//!   there (as stranded in the pins), and the context's teardown ends it.
//! * **Pins.** A [`Graph`] owns its pool and the host buffers its copies
//!   read and write. [`Graph::destroy`] waits for every launch of the
//!   context ([`Context::wait_launches`]), destroys the executable graph
//!   and the graph, and only then returns the pool to the arena. Teardown
//!   destroys the graphs still live and reports how many.

use crate::result::err;
use crate::table::{CaptureTable, Context, DevicePtr, Raw, VmmTable};
use memgov_backend::capability::{CaptureConfig, PoolExhausted};
use memgov_backend::vmm::{CapturePool, ALIGN};
use memgov_backend::{lock, BackendError, BackendErrorKind};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

type TableOf<C> = <C as Context>::Table;
type StreamOf<C> = <TableOf<C> as VmmTable>::Stream;
type GraphOf<C> = <TableOf<C> as CaptureTable>::Graph;

/// The host memory a graph's recorded copies read and write.
struct HostBuffers {
    /// Read by the driver through the recorded copies, never by Rust.
    _inputs: Vec<Box<[u8]>>,
    outputs: Vec<Box<[u8]>>,
}

/// A graph's handles.
struct RawGraph<T: CaptureTable> {
    exec: Raw<T::Exec>,
    graph: Raw<T::Graph>,
}

impl<T: CaptureTable> Clone for RawGraph<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: CaptureTable> Copy for RawGraph<T> {}

struct PinState<T: CaptureTable> {
    next: u64,
    /// Key -> the graph and its pool's device address.
    graphs: HashMap<u64, (RawGraph<T>, u64)>,
    /// Host buffers of graphs dropped without a successful destroy: a
    /// launch may still read or write them, so they live as long as the
    /// pins (past teardown, which waits for every launch).
    orphans: Vec<HostBuffers>,
}

/// The executable graphs of a context still live, destroyed by teardown if
/// their owners did not, and the captures a failed end left under way.
pub struct Pins<T: CaptureTable> {
    live: Mutex<PinState<T>>,
    /// Captures whose end failed while the driver still captured (or could
    /// not be asked): their id and stream. The gate keeps them under way
    /// until a later end reaches the driver or teardown ends them.
    stranded: Mutex<Vec<(u64, Raw<T::Stream>)>>,
}

impl<T: CaptureTable> Default for Pins<T> {
    fn default() -> Self {
        Self {
            live: Mutex::new(PinState {
                next: 0,
                graphs: HashMap::new(),
                orphans: Vec::new(),
            }),
            stranded: Mutex::new(Vec::new()),
        }
    }
}

impl<T: CaptureTable> Pins<T> {
    /// First in teardown: the captures a failed end left live are ended in
    /// the driver (unless the context is lost) and their graphs discarded;
    /// then the gate forgets them, whatever the driver answered, since
    /// teardown destroys the context's streams and their captures with them
    /// (a capture the driver still holds here, one begun in global or
    /// thread-local mode on another thread, is abandoned with its stream).
    pub fn end_stranded<C: Context<Table = T>>(&self, s: &C, lost: bool) {
        let stranded = std::mem::take(&mut *lock(&self.stranded));
        for (id, stream) in stranded {
            if !lost {
                if let Ok(_current) = memgov_backend::shell::make_current(s, "teardown") {
                    // SAFETY: a stream of this context still captured (its
                    // streams are destroyed later in teardown); the device
                    // is current.
                    let (r, graph) = unsafe { T::end_capture(stream.0) };
                    if let (true, Some(graph)) = (r == T::SUCCESS, graph) {
                        // SAFETY: the graph just made, never instantiated.
                        let _ = unsafe { T::graph_destroy(graph) };
                    }
                }
            }
            s.capture_gate().end(id);
        }
    }

    /// Teardown of a lost context: forget the graphs without driver calls
    /// (they go with the context); later destroys do nothing.
    pub fn close(&self) {
        lock(&self.live).graphs.clear();
    }

    /// Destroy the graphs still live after every launch finished (the
    /// context's [`wait_launches`](Context::wait_launches), admitted by the
    /// gate), returning their pools to the arena; returns how many there
    /// were. Later destroys do nothing.
    pub fn teardown<C: Context<Table = T>>(
        &self,
        s: &C,
        arena: &C::Arena,
    ) -> Result<usize, BackendError> {
        let graphs: Vec<(RawGraph<T>, u64)> =
            lock(&self.live).graphs.drain().map(|(_, v)| v).collect();
        if graphs.is_empty() {
            return Ok(0);
        }
        let _call = s.capture_gate().call("teardown", false)?;
        let _current = memgov_backend::shell::make_current(s, "teardown")?;
        s.wait_launches("teardown")?;
        let n = graphs.len();
        for (raw, pool) in graphs {
            destroy_raw(s, raw, "teardown")?;
            arena.retire(pool);
        }
        Ok(n)
    }

    /// The graphs' part of a context's teardown, before the arena's: on a
    /// lost context (or one without an arena, which has no graphs) forget
    /// them ([`close`](Self::close)); otherwise destroy the live ones after
    /// their launches ([`teardown`](Self::teardown)) and refuse, naming
    /// how many there were and `destroy_with` (`"CudaGraph::destroy"`),
    /// when any was.
    pub fn finish<C: Context<Table = T>>(
        &self,
        s: &C,
        arena: Option<&C::Arena>,
        lost: bool,
        destroy_with: &'static str,
    ) -> Result<(), BackendError> {
        let Some(arena) = arena.filter(|_| !lost) else {
            self.close();
            return Ok(());
        };
        match self.teardown(s, arena)? {
            0 => Ok(()),
            n => Err(err::<T>(
                "teardown",
                BackendErrorKind::InvalidArgument,
                format!(
                    "{n} executable graph(s) were still live at teardown: they were destroyed \
                     after their launches finished and their capture pools given back; destroy \
                     graphs with {destroy_with} before teardown"
                ),
            )),
        }
    }

    fn insert(&self, raw: RawGraph<T>, pool: u64) -> u64 {
        let mut st = lock(&self.live);
        st.next += 1;
        let key = st.next;
        st.graphs.insert(key, (raw, pool));
        key
    }

    fn get(&self, key: u64) -> Option<(RawGraph<T>, u64)> {
        lock(&self.live).graphs.get(&key).copied()
    }
}

fn destroy_raw<C: Context>(
    s: &C,
    raw: RawGraph<TableOf<C>>,
    op: &'static str,
) -> Result<(), BackendError> {
    let n = &TableOf::<C>::CAPTURE_NAMES;
    // SAFETY: handles made by the capture's end, destroyed once (taken out
    // of the pins first); every launch has finished (the caller waited);
    // the device is current.
    let r = unsafe { TableOf::<C>::exec_destroy(raw.exec.0) };
    s.checked(op, n.exec_destroy, r)?;
    // SAFETY: as above.
    let r = unsafe { TableOf::<C>::graph_destroy(raw.graph.0) };
    s.checked(op, n.graph_destroy, r)
}

/// A stream capture under way: its pool, the copies it recorded, and how
/// to end it. Dropping it without [`end`](Self::end) ends the capture,
/// discards the graph and returns the pool.
pub struct CaptureCore<C: Context> {
    shared: Arc<C>,
    arena: Arc<C::Arena>,
    pins: Arc<Pins<C::Table>>,
    stream: Raw<StreamOf<C>>,
    id: u64,
    pool: CapturePool,
    inputs: Vec<Box<[u8]>>,
    outputs: Vec<Box<[u8]>>,
    /// Set by end(): nothing left for Drop to undo.
    done: bool,
}

impl<C: Context> CaptureCore<C> {
    /// Begin capturing `stream` (a live stream of the context, checked by
    /// the caller) with a pool of `config.pool_bytes` (rounded up to
    /// `align`) taken from the context's arena first with `allocate`
    /// (mapped now, so nothing maps during the capture), through the
    /// capture gate, which learns the capture's id. A context without an
    /// arena is refused (`Unsupported`, naming `arena_setting`, the
    /// vendor's `CudaConfig::arena`). On failure the pool goes back to the
    /// arena at once (nothing used it).
    #[allow(clippy::too_many_arguments)]
    pub fn begin(
        shared: Arc<C>,
        arena: Option<Arc<C::Arena>>,
        pins: Arc<Pins<C::Table>>,
        stream: StreamOf<C>,
        config: CaptureConfig,
        align: u64,
        arena_setting: &'static str,
        allocate: impl FnOnce(&C::Arena, &C, u64) -> Result<u64, BackendError>,
    ) -> Result<Self, BackendError> {
        const OP: &str = "begin_capture";
        let Some(arena) = arena else {
            return Err(err::<TableOf<C>>(
                OP,
                BackendErrorKind::Unsupported,
                format!(
                    "a capture pool comes from the context's arena, and this context has none: \
                     create it with {arena_setting}"
                ),
            ));
        };
        let bytes = CapturePool::size_for(
            <TableOf<C> as crate::Vendor>::BACKEND,
            config.pool_bytes,
            align,
        )?;
        let current = memgov_backend::shell::make_current(&*shared, OP)?;
        let pool = allocate(&arena, &shared, bytes)?;
        let n = &TableOf::<C>::CAPTURE_NAMES;
        let g = shared.capture_gate();
        g.begin();
        // SAFETY: a live stream of this context (checked by the caller),
        // whose device is current.
        let r = unsafe { TableOf::<C>::begin_capture(stream, config.mode) };
        let begun = shared.checked(OP, n.begin_capture, r).and_then(|()| {
            // SAFETY: the stream is live.
            let (r, id) = unsafe { TableOf::<C>::capture_id(stream) };
            shared.checked(OP, n.capture_id, r).map(|()| id)
        });
        g.begun(
            begun.as_ref().ok().copied(),
            TableOf::<C>::stream_key(stream),
        );
        drop(current);
        match begun {
            Ok(id) => Ok(Self {
                shared,
                arena,
                pins,
                stream: Raw(stream),
                id,
                pool: CapturePool::new(pool, bytes),
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

    /// The driver's id of this capture.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes of the pool, and of it carved so far.
    pub fn pool_usage(&self) -> (u64, u64) {
        (self.pool.bytes(), self.pool.used())
    }

    /// Bytes of the pool not carved yet.
    pub fn pool_free(&self) -> u64 {
        self.pool.free()
    }

    /// Carve `bytes` aligned to `align` from the pool: no driver call.
    /// Refused with [`PoolExhausted`] when they do not fit; the capture
    /// stays valid. Returns the device address.
    pub fn allocate(&mut self, bytes: u64, align: u64) -> Result<u64, PoolExhausted> {
        self.pool
            .carve(<TableOf<C> as crate::Vendor>::BACKEND, bytes, align)
    }

    fn check_range(
        &self,
        op: &'static str,
        (ptr, bytes): (u64, u64),
        offset: u64,
        len: u64,
    ) -> Result<(), BackendError> {
        if self.pool.holds(ptr, bytes, offset, len) {
            Ok(())
        } else {
            Err(err::<TableOf<C>>(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "{len} B at offset {offset} of a {bytes} B capture buffer at {ptr:#x} is not \
                     inside this capture's pool: use buffers this capture allocated, within their \
                     length"
                ),
            ))
        }
    }

    /// Record a copy of `data` into the buffer `buf` (address, bytes) at
    /// `offset`; every launch of the graph repeats it. The graph keeps
    /// `data`.
    pub fn upload(
        &mut self,
        buf: (u64, u64),
        offset: u64,
        data: Vec<u8>,
    ) -> Result<(), BackendError> {
        const OP: &str = "capture_upload";
        self.check_range(OP, buf, offset, data.len() as u64)?;
        let data = data.into_boxed_slice();
        let s = &*self.shared;
        let _current = memgov_backend::shell::make_current(s, OP)?;
        // SAFETY: the destination lies in the pool (checked above), which the
        // graph pins; the source is owned by the graph from here on (a boxed
        // slice does not move when the Vec holding it grows), and the driver
        // does not write through it.
        let r = unsafe {
            TableOf::<C>::copy_htod_async(
                buf.0 + offset,
                data.as_ptr() as usize,
                data.len(),
                self.stream.0,
            )
        };
        s.checked(OP, TableOf::<C>::NAMES.copy_htod_async, r)?;
        self.inputs.push(data);
        Ok(())
    }

    /// Record a copy of `len` bytes of the buffer `buf` at `offset` into a
    /// host buffer the graph owns; returns its index, read after a launch
    /// with [`GraphCore::read_output`].
    pub fn download(
        &mut self,
        buf: (u64, u64),
        offset: u64,
        len: usize,
    ) -> Result<usize, BackendError> {
        const OP: &str = "capture_download";
        self.check_range(OP, buf, offset, len as u64)?;
        let mut host = vec![0u8; len].into_boxed_slice();
        let s = &*self.shared;
        let _current = memgov_backend::shell::make_current(s, OP)?;
        // SAFETY: the source lies in the pool (checked above); the
        // destination is owned by the graph, which outlives every launch
        // (destroy waits for them first).
        let r = unsafe {
            TableOf::<C>::copy_dtoh_async(
                host.as_mut_ptr() as usize,
                buf.0 + offset,
                len,
                self.stream.0,
            )
        };
        s.checked(OP, TableOf::<C>::NAMES.copy_dtoh_async, r)?;
        self.outputs.push(host);
        Ok(self.outputs.len() - 1)
    }

    /// End the capture and instantiate its graph. The pool is pinned by the
    /// graph until it is destroyed (or teardown).
    pub fn end(mut self) -> Result<GraphCore<C>, BackendError> {
        const OP: &str = "end_capture";
        self.done = true;
        let s = self.shared.clone();
        let graph = match self.end_raw(&s) {
            Ok(g) => g,
            Err(e) => {
                // Nothing was or will be launched: the pool goes back at
                // once (a capture the driver still holds records no more
                // work, and its graph is discarded when it ends).
                self.arena.retire(self.pool.base());
                return Err(e);
            }
        };
        let instantiated = memgov_backend::shell::make_current(&*s, OP).and_then(|_current| {
            // SAFETY: a graph the driver just returned; the device is
            // current.
            let (r, exec) = unsafe { TableOf::<C>::instantiate(graph) };
            s.checked(OP, TableOf::<C>::CAPTURE_NAMES.instantiate, r)
                .map(|()| exec)
        });
        let exec = match instantiated {
            Ok(exec) => exec,
            Err(e) => {
                // SAFETY: the graph just made, destroyed once; never
                // launched.
                let _ = unsafe { TableOf::<C>::graph_destroy(graph) };
                self.arena.retire(self.pool.base());
                return Err(e);
            }
        };
        let raw = RawGraph {
            exec: Raw(exec),
            graph: Raw(graph),
        };
        let key = self.pins.insert(raw, self.pool.base());
        Ok(GraphCore {
            shared: s,
            arena: self.arena.clone(),
            pins: self.pins.clone(),
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

    /// End the capture in the driver, then, once the driver's capture is
    /// over, tell the gate (which runs deferred trims when it was the
    /// last). After a failed end the driver is asked whether the stream
    /// still captures: a stream still capturing (active, or invalidated and
    /// still to be ended), or a device that could not be made current,
    /// keeps the gate's record, so that no other thread's gated call
    /// invalidates the capture; the context's teardown ends it.
    fn end_raw(&self, s: &C) -> Result<GraphOf<C>, BackendError> {
        const OP: &str = "end_capture";
        let mut over = false;
        let r = memgov_backend::shell::make_current(s, OP).and_then(|_current| {
            // SAFETY: the capturing stream, its device current.
            let (r, graph) = unsafe { TableOf::<C>::end_capture(self.stream.0) };
            let r = s.checked(OP, TableOf::<C>::CAPTURE_NAMES.end_capture, r);
            // SAFETY: as above.
            over = r.is_ok() || !unsafe { TableOf::<C>::still_capturing(self.stream.0) };
            r.and_then(|()| {
                graph.ok_or_else(|| {
                    err::<TableOf<C>>(
                        OP,
                        BackendErrorKind::Other,
                        "the driver ended the capture without a graph",
                    )
                })
            })
        });
        if over {
            // Out of capture (ended, or invalidated and ended): the gate
            // lets gated calls run again.
            lock(&self.pins.stranded).retain(|&(id, _)| id != self.id);
            s.capture_gate().end(self.id);
        } else {
            let mut stranded = lock(&self.pins.stranded);
            if !stranded.iter().any(|&(id, _)| id == self.id) {
                stranded.push((self.id, self.stream));
            }
        }
        r
    }
}

impl<C: Context> Drop for CaptureCore<C> {
    /// A capture dropped without `end` is ended and its graph discarded.
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let s = self.shared.clone();
        if let Ok(graph) = self.end_raw(&s) {
            if let Ok(_current) = memgov_backend::shell::make_current(&*s, "end_capture") {
                // SAFETY: the graph just made, never instantiated or launched.
                let _ = unsafe { TableOf::<C>::graph_destroy(graph) };
            }
        }
        self.arena.retire(self.pool.base());
    }
}

/// An instantiated graph made by a capture: launched any number of times on
/// any stream of its context, then destroyed. It pins its pool and its host
/// buffers until then. Dropping it destroys it; when that is refused (on a
/// thread whose own capture is under way) the graph stays pinned, its host
/// buffers kept, until teardown.
pub struct GraphCore<C: Context> {
    shared: Arc<C>,
    arena: Arc<C::Arena>,
    pins: Arc<Pins<C::Table>>,
    key: u64,
    pool_bytes: u64,
    used: u64,
    host: HostBuffers,
    /// Every launch finished and the graph is out of the pins: the host
    /// buffers may go.
    destroyed: bool,
}

impl<C: Context> GraphCore<C> {
    /// The graph's handles and its pool's device address.
    fn raw_and_pool(&self, op: &'static str) -> Result<(RawGraph<C::Table>, u64), BackendError> {
        self.pins.get(self.key).ok_or_else(|| {
            err::<TableOf<C>>(
                op,
                BackendErrorKind::InvalidArgument,
                "the graph was destroyed by its context's teardown",
            )
        })
    }

    /// The context the graph belongs to.
    pub fn shared(&self) -> &C {
        &self.shared
    }

    /// The graph (not the executable one), while it lives: for a vendor's
    /// own queries of its nodes.
    pub fn raw_graph(&self, op: &'static str) -> Result<GraphOf<C>, BackendError> {
        self.raw_and_pool(op).map(|(r, _)| r.graph.0)
    }

    /// Bytes of the pool the capture carved, and the pool's size.
    pub fn pool_usage(&self) -> (u64, u64) {
        (self.used, self.pool_bytes)
    }

    /// Queue one run of the graph on `stream`, a live stream of the
    /// context (the caller checked it).
    ///
    /// Refused with `InvalidArgument` while the arena sleeps (the pool's
    /// memory is reserved, not mapped: the graph's copies would fault), as
    /// copies to sleeping memory are. A sleep asked for meanwhile waits
    /// until the launch is queued, then waits for it.
    pub fn launch(&self, stream: StreamOf<C>) -> Result<(), BackendError> {
        const OP: &str = "graph_launch";
        let s = &*self.shared;
        let (raw, pool) = self.raw_and_pool(OP)?;
        let _use = s.sleep_gate().enter();
        self.arena.check_awake(
            <TableOf<C> as crate::Vendor>::BACKEND,
            OP,
            pool,
            self.pool_bytes,
        )?;
        let _current = memgov_backend::shell::make_current(s, OP)?;
        // SAFETY: a live executable graph of this context (pinned until
        // destroy); a live stream of it, its device current.
        let r = unsafe { TableOf::<C>::launch(raw.exec.0, stream) };
        s.checked(OP, TableOf::<C>::CAPTURE_NAMES.launch, r)
    }

    /// Wait for every launch of the context (admitted by the gate) and copy
    /// out what the graph's download `slot` holds. `&mut self`: no launch
    /// of this graph can be queued meanwhile.
    pub fn read_output(&mut self, slot: usize) -> Result<Vec<u8>, BackendError> {
        const OP: &str = "graph_read_output";
        let n = self.host.outputs.len();
        if slot >= n {
            return Err(err::<TableOf<C>>(
                OP,
                BackendErrorKind::InvalidArgument,
                format!("output slot {slot} is not one of this graph's {n}"),
            ));
        }
        let s = &*self.shared;
        s.check_usable(OP)?;
        self.raw_and_pool(OP)?;
        {
            let _call = s.capture_gate().call(OP, true)?;
            let _current = memgov_backend::shell::make_current(s, OP)?;
            s.wait_launches(OP)?;
        }
        Ok(self.host.outputs[slot].to_vec())
    }

    /// Whether it was destroyed (by its owner or by teardown).
    pub fn is_destroyed(&self) -> bool {
        self.destroyed || self.raw_and_pool("graph_destroyed").is_err()
    }

    /// Wait for every launch (admitted by the gate), destroy the executable
    /// graph and the graph, and only then return the pool to the arena. On
    /// failure the graph is kept (still pinned, its pool still taken) so
    /// that the caller can try again; once it succeeded, later calls do
    /// nothing and [`launch`](Self::launch) is refused.
    pub fn destroy_now(&mut self, op: &'static str) -> Result<(), BackendError> {
        if self.destroyed {
            return Ok(());
        }
        let s = &*self.shared;
        let Ok((raw, _)) = self.raw_and_pool(op) else {
            // Teardown destroyed it after every launch, or forgot it with a
            // lost context.
            self.destroyed = true;
            return Ok(());
        };
        let _call = s.capture_gate().call(op, true)?;
        let _current = memgov_backend::shell::make_current(s, op)?;
        s.wait_launches(op)?;
        let taken = lock(&self.pins.live).graphs.remove(&self.key);
        self.destroyed = true;
        if let Some((_, pool)) = taken {
            destroy_raw(s, raw, op)?;
            self.arena.retire(pool);
        }
        Ok(())
    }
}

impl<C: Context> Drop for GraphCore<C> {
    fn drop(&mut self) {
        if self.destroy_now("graph_drop").is_err() && !self.destroyed {
            let host = std::mem::replace(
                &mut self.host,
                HostBuffers {
                    _inputs: Vec::new(),
                    outputs: Vec::new(),
                },
            );
            lock(&self.pins.live).orphans.push(host);
        }
    }
}

type BufferOf<C> = CaptureBuffer<<TableOf<C> as CaptureTable>::DevicePtr>;

/// Device memory carved from a capture pool: valid while the graph made by
/// the capture lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureBuffer<P: DevicePtr> {
    ptr: u64,
    bytes: u64,
    _ptr: PhantomData<fn() -> P>,
}

impl<P: DevicePtr> CaptureBuffer<P> {
    /// Its device address.
    pub fn device_ptr(&self) -> P {
        P::from_addr(self.ptr)
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
/// [`Graph::read_output`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputSlot(usize);

/// A stream capture under way (`CudaContext::begin_capture`): allocations
/// carved from its pool and copies recorded on its stream, then
/// [`end`](Self::end) makes the graph. It borrows its context for `'a`.
pub struct Capture<'a, C: Context> {
    core: CaptureCore<C>,
    _ctx: PhantomData<&'a C>,
}

impl<C: Context> std::fmt::Debug for Capture<'_, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (pool, used) = self.core.pool_usage();
        f.debug_struct(TableOf::<C>::CAPTURE_NAMES.capture)
            .field("id", &self.core.id())
            .field("pool", &pool)
            .field("used", &used)
            .finish()
    }
}

/// The size of the pool a capture takes for `pool_bytes`: at least 1,
/// rounded up to 256 bytes (as `cuMemAlloc` aligns its allocations),
/// checked (`PoolTooLarge`, an `InvalidArgument`, when that passes
/// `u64::MAX`).
pub fn pool_bytes<T: CaptureTable>(pool_bytes: u64) -> Result<u64, BackendError> {
    Ok(CapturePool::size_for(T::BACKEND, pool_bytes, ALIGN)?)
}

/// A vendor context's capture methods: `capture_pool_bytes` ([`pool_bytes`]
/// over `$table`) and `begin_capture` ([`Capture::begin`], the pool taken
/// with the arena's `allocate`) on `$context` (fields `shared`, `arena`,
/// `pins`); the attributes given document `begin_capture` further.
#[macro_export]
macro_rules! capture_methods {
    (impl $context:ident<$table:ty> { stream: $stream:ty, capture: $capture:ident, }
     $(#[$begin:meta])*) => {
        impl $context {
            /// The size of the pool [`begin_capture`](Self::begin_capture) takes
            /// for `pool_bytes` ([`pool_bytes`](memgov_stream_ordered::capture::pool_bytes)).
            pub fn capture_pool_bytes(
                pool_bytes: u64,
            ) -> Result<u64, ::memgov_backend::BackendError> {
                $crate::capture::pool_bytes::<$table>(pool_bytes)
            }

            /// Begin capturing `stream` into a graph
            /// ([`Capture::begin`](memgov_stream_ordered::capture::Capture::begin)).
            $(#[$begin])*
            pub fn begin_capture(
                &self,
                stream: &$stream,
                config: ::memgov_backend::capability::CaptureConfig,
            ) -> Result<$capture<'_>, ::memgov_backend::BackendError> {
                let parts = &self.parts;
                let (shared, arena, pins) = (&parts.shared, parts.arena.as_ref(), &parts.pins);
                $capture::begin(shared, arena, pins, stream, config, |a, s, n| a.allocate(s, n))
            }
        }
    };
}

impl<C: Context> Capture<'_, C> {
    /// Begin capturing `stream` into a graph, with a pool of
    /// `config.pool_bytes` taken from the context's arena first (mapped
    /// now, so nothing maps during the capture) with `allocate`. Needs an
    /// arena (`Unsupported` otherwise, naming the vendor's setting) and a
    /// library with the capture calls
    /// ([`CaptureTable::capture_supported`]).
    ///
    /// Waits for memgov's maps and unmaps under way to finish; while the
    /// capture is under way, later ones wait for it to end.
    pub fn begin(
        shared: &Arc<C>,
        arena: Option<&Arc<C::Arena>>,
        pins: &Arc<Pins<C::Table>>,
        stream: &C::Stream,
        config: CaptureConfig,
        allocate: impl FnOnce(&C::Arena, &C, u64) -> Result<u64, BackendError>,
    ) -> Result<Self, BackendError> {
        const OP: &str = "begin_capture";
        shared.check_usable(OP)?;
        let raw = shared.raw_stream(OP, stream)?;
        TableOf::<C>::capture_supported()?;
        let core = CaptureCore::begin(
            shared.clone(),
            arena.cloned(),
            pins.clone(),
            raw,
            config,
            ALIGN,
            TableOf::<C>::CAPTURE_NAMES.arena_setting,
            allocate,
        )?;
        Ok(Self {
            core,
            _ctx: PhantomData,
        })
    }

    /// The driver's id of this capture.
    pub fn id(&self) -> u64 {
        self.core.id()
    }

    /// Bytes of the pool not carved yet.
    pub fn pool_free(&self) -> u64 {
        self.core.pool_free()
    }

    /// Carve `bytes` from the pool: no driver call. Refused with
    /// [`PoolExhausted`] when they do not fit; the capture stays valid.
    pub fn allocate(&mut self, bytes: u64) -> Result<BufferOf<C>, PoolExhausted> {
        let ptr = self.core.allocate(bytes, ALIGN)?;
        Ok(CaptureBuffer {
            ptr,
            bytes,
            _ptr: PhantomData,
        })
    }

    /// Record a copy of `data` into `buf` at `offset`; every launch of the
    /// graph repeats it. The graph keeps `data`.
    pub fn upload(
        &mut self,
        buf: &BufferOf<C>,
        offset: u64,
        data: Vec<u8>,
    ) -> Result<(), BackendError> {
        self.core.upload((buf.ptr, buf.bytes), offset, data)
    }

    /// Record a copy of `len` bytes of `buf` at `offset` into a host buffer
    /// the graph owns; read it after a launch with
    /// [`Graph::read_output`].
    pub fn download(
        &mut self,
        buf: &BufferOf<C>,
        offset: u64,
        len: usize,
    ) -> Result<OutputSlot, BackendError> {
        self.core
            .download((buf.ptr, buf.bytes), offset, len)
            .map(OutputSlot)
    }

    /// End the capture and instantiate its graph. The pool is pinned by the
    /// graph until [`Graph::destroy`] (or teardown). A capture dropped
    /// without `end` is ended and its graph discarded.
    pub fn end(self) -> Result<Graph<C>, BackendError> {
        self.core.end().map(|core| Graph { core })
    }
}

/// An instantiated graph made by a capture: launched any number of times on
/// any stream of its context, then destroyed. It pins its pool and its host
/// buffers until then.
///
/// Dropping it destroys it as [`destroy`](Self::destroy) does; when that is
/// refused (on a thread whose own capture is under way) the graph stays
/// pinned, its host buffers kept, until teardown.
pub struct Graph<C: Context> {
    core: GraphCore<C>,
}

impl<C: Context> std::fmt::Debug for Graph<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (used, pool) = self.core.pool_usage();
        f.debug_struct(TableOf::<C>::CAPTURE_NAMES.graph)
            .field("pool", &pool)
            .field("used", &used)
            .finish()
    }
}

impl<C: Context> Graph<C> {
    /// Bytes of the pool the capture carved, and the pool's size.
    pub fn pool_usage(&self) -> (u64, u64) {
        self.core.pool_usage()
    }

    /// Bytes of device memory the graph's own allocation nodes take. Such
    /// nodes come from stream-ordered allocations (`cuMemAllocAsync`) a
    /// runtime queued on the capturing stream itself; memgov's capture
    /// makes none (its allocations carve the pool). The driver keeps that
    /// memory for the graph while it may launch, so the sum is what the
    /// graph holds at most (the driver may reuse memory between
    /// allocations whose lifetimes do not overlap). On CUDA the sum of
    /// `bytesize` over its `CU_GRAPH_NODE_TYPE_MEM_ALLOC` nodes
    /// (`cuGraphGetNodes`, `cuGraphNodeGetType`,
    /// `cuGraphMemAllocNodeGetParams`); always 0 on HIP, whose graph nodes
    /// memgov does not read (graph memory a runtime's own `hipMallocAsync`
    /// on the capturing stream makes is not charged).
    pub fn graph_memory_bytes(&self) -> Result<u64, BackendError> {
        const OP: &str = "graph_memory";
        if !TableOf::<C>::READS_GRAPH_NODES {
            return Ok(0);
        }
        let s = self.core.shared();
        s.check_usable(OP)?;
        let graph = self.core.raw_graph(OP)?;
        let _current = memgov_backend::shell::make_current(s, OP)?;
        // SAFETY: a live graph of this context (pinned until destroy); the
        // context is current.
        unsafe { TableOf::<C>::graph_memory(s, graph) }
    }

    /// Queue one run of the graph on `stream`.
    ///
    /// Refused with `InvalidArgument` while the arena sleeps (the pool's
    /// memory is reserved, not mapped: the graph's copies would fault), as
    /// copies to sleeping memory are; wake the arena first. A sleep asked
    /// for meanwhile waits until the launch is queued, then waits for it.
    pub fn launch(&self, stream: &C::Stream) -> Result<(), BackendError> {
        const OP: &str = "graph_launch";
        let s = self.core.shared();
        s.check_usable(OP)?;
        let raw = s.raw_stream(OP, stream)?;
        self.core.launch(raw)
    }

    /// Wait for every launch of the context (admitted by the gate: CUDA's
    /// `cuCtxSynchronize`, every stream of the context on HIP) and copy out
    /// what the graph's download `slot` holds. `&mut self`: no launch of
    /// this graph can be queued meanwhile.
    pub fn read_output(&mut self, slot: OutputSlot) -> Result<Vec<u8>, BackendError> {
        self.core.read_output(slot.0)
    }

    /// Wait for every launch (as [`read_output`](Self::read_output) does),
    /// destroy the executable graph and the graph, and only then return
    /// the pool to the arena and free the host buffers.
    pub fn destroy(mut self) -> Result<(), BackendError> {
        self.core.destroy_now("graph_destroy")
    }

    /// [`destroy`](Self::destroy) in place: on failure the graph is kept
    /// (still pinned, its pool still taken) so that the caller can try
    /// again; once it succeeded, later calls do nothing and
    /// [`launch`](Self::launch) is refused.
    pub fn try_destroy(&mut self) -> Result<(), BackendError> {
        self.core.destroy_now("graph_destroy")
    }

    /// Whether [`try_destroy`](Self::try_destroy) (or teardown) destroyed it.
    pub fn is_destroyed(&self) -> bool {
        self.core.is_destroyed()
    }
}

memgov_backend::impl_capture_capabilities! {
    impl<C: Context>
    capture: Capture<'_, C>,
    graph: Graph<C>,
    stream: C::Stream,
    buffer: BufferOf<C>,
    slot: OutputSlot,
}
