//! Graph capture on a governed context, for every backend with the capture
//! capability ([`CaptureBackend`]: CUDA, HIP): the capture pool charged to
//! the context's budget before the capture begins, and the graph holding
//! that charge, and the context, until it is destroyed.
//!
//! A backend's own `begin_capture` takes its pool from the context's arena
//! and knows nothing of budgets. Once the context is registered with a
//! [`Governor`](crate::Governor), [`CaptureExt::capture`] is the way in
//! (`memgov::cuda_capture` and `memgov::hip_capture` name it with the
//! vendor's types):
//!
//! * **Charged before capture.** The pool is a [`Reservation`] of the
//!   context's budget (and the shared budgets above it), made before any
//!   driver call, of the size the backend will take
//!   ([`CaptureBackend::capture_pool_bytes`]). A pool that does not fit is
//!   the governor's [`GovernorError::BudgetExceeded`], with every number,
//!   and nothing is begun: no stream capture, no arena memory taken.
//! * **Held while the graph lives.** The [`GovernedGraph`] owns the
//!   reservation: the pool's bytes stay charged, and the reservation's pin
//!   keeps the context from tearing down, until the graph is destroyed
//!   ([`GovernedGraph::destroy`], or dropping it). A retire waits for it and
//!   lists the pool in the context's snapshot (`reservations`, labelled
//!   `"capture pool"`) meanwhile.
//! * **Graph memory is governed.** A graph may hold device memory of its
//!   own: memory-allocation nodes made by a runtime's stream-ordered
//!   allocations on the capturing stream (memgov's capture makes none: its
//!   allocations carve the pool). After instantiation the graph's
//!   allocation nodes are summed ([`CapturedGraph::graph_memory_bytes`])
//!   and charged to the context as memory outside memgov
//!   ([`ContextHandle::report_outside`]) while the graph lives.
//!
//! The capture runs inside [`ContextHandle::with_backend`]: a `force` of the
//! context waits for it to end.

use crate::backend::capability::{CaptureBackend, CaptureConfig, CapturedGraph, PoolCapture};
use crate::{
    BackendError, ContextHandle, ContextOperation, GovernedStream, GovernorError, OutsideUsage,
    Reservation, Reserve,
};

/// The label of a capture pool's reservation in snapshots and refusals.
pub const POOL_LABEL: &str = "capture pool";

/// The capture a backend begins (`CudaCapture`, `HipCapture`).
pub type CaptureOf<'a, C> = <C as CaptureBackend>::Capture<'a>;

/// A host buffer a recorded download of backend `C` writes into.
pub type SlotOf<C> = <<C as CaptureBackend>::Graph as CapturedGraph>::Slot;

/// Graph capture on a governed context whose backend captures.
pub trait CaptureExt {
    /// The context's backend.
    type Backend: CaptureBackend;

    /// Capture `stream` into a graph: charge the pool of
    /// `config.pool_bytes` to the context's budget, begin the capture with
    /// a pool of that size from the context's arena, run `record`
    /// (allocations carved from the pool, copies recorded on the stream,
    /// kernels of the caller's own queued on the backend's raw stream), end
    /// the capture and instantiate the graph.
    ///
    /// ```no_run
    /// # #[cfg(feature = "cuda")] {
    /// use memgov::cuda::{ArenaConfig, CaptureConfig, CaptureMode, CudaConfig, CudaContext};
    /// use memgov::cuda_capture::CaptureExt;
    /// use memgov::{ContextConfig, Governor};
    /// let gov = Governor::new();
    /// let ctx = gov.register(
    ///     CudaContext::new(CudaConfig { arena: Some(ArenaConfig::default()), ..CudaConfig::default() })?,
    ///     ContextConfig::new().budget(1 << 30),
    /// );
    /// let s = ctx.create_stream("decode")?;
    /// let config = CaptureConfig { pool_bytes: 64 << 20, mode: CaptureMode::Global };
    /// let (mut graph, out) = ctx.capture(&s, config, |cap| {
    ///     let buf = cap.allocate(4096)?;
    ///     cap.upload(&buf, 0, vec![7; 4096])?;
    ///     cap.download(&buf, 0, 4096)
    /// })?;
    /// assert_eq!(ctx.snapshot().charged, 64 << 20); // the pool, charged until destroy
    /// graph.launch(&s)?;
    /// assert_eq!(graph.read_output(out)?, vec![7; 4096]);
    /// graph.destroy()?;
    /// # }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`GovernorError::BudgetExceeded`] when the pool does not fit (nothing
    /// begun); [`GovernorError::WrongContext`] for another context's
    /// stream; [`GovernorError::Pin`] or [`GovernorError::DeviceLost`] on a
    /// retiring or lost context; [`GovernorError::Reclaimed`] for a stream
    /// reclaimed by `force`; [`GovernorError::Backend`] for a pool too
    /// large to round (nothing charged or begun), and for what
    /// `begin_capture`, `record` or the end of the capture returned (the
    /// capture is ended and its pool given back, and the charge returned).
    fn capture<R>(
        &self,
        stream: &GovernedStream<Self::Backend>,
        config: CaptureConfig,
        record: impl FnOnce(&mut CaptureOf<'_, Self::Backend>) -> Result<R, BackendError>,
    ) -> Result<(GovernedGraph<Self::Backend>, R), GovernorError>;
}

impl<C: CaptureBackend> CaptureExt for ContextHandle<C> {
    type Backend = C;

    fn capture<R>(
        &self,
        stream: &GovernedStream<C>,
        config: CaptureConfig,
        record: impl FnOnce(&mut CaptureOf<'_, C>) -> Result<R, BackendError>,
    ) -> Result<(GovernedGraph<C>, R), GovernorError> {
        if stream.context() != self.id() {
            return Err(GovernorError::wrong_context(
                ContextOperation::Allocate,
                self.name(),
                stream,
            ));
        }
        let raw = stream.raw().ok_or_else(|| GovernorError::Reclaimed {
            context: self.name(),
        })?;
        let backend_error = |source| GovernorError::Backend {
            context: self.name(),
            source,
        };
        // The pool's size as the backend takes it from the arena (checked:
        // a size too large to round is refused before any charge).
        let pool_bytes = self
            .with_backend(|ctx| ctx.capture_pool_bytes(&config))?
            .map_err(backend_error)?;
        // Charged first: a refusal here has begun nothing.
        let pool = self.reserve(Reserve::new(pool_bytes, POOL_LABEL))?;
        let (graph, out, graph_bytes) = self
            .with_backend(|ctx| {
                let mut cap = ctx.begin_capture(raw, config)?;
                // On an error the capture's drop ends it and gives the pool
                // back to the arena.
                let out = record(&mut cap)?;
                let graph = cap.end()?;
                // A graph whose memory cannot be read is destroyed, not
                // left ungoverned.
                match graph.graph_memory_bytes() {
                    Ok(bytes) => Ok((graph, out, bytes)),
                    Err(e) => {
                        drop(graph);
                        Err(e)
                    }
                }
            })?
            .map_err(backend_error)?;
        let graph_memory = (graph_bytes > 0).then(|| self.report_outside(graph_bytes));
        Ok((
            GovernedGraph {
                graph,
                graph_memory,
                pool: Some(pool),
            },
            out,
        ))
    }
}

/// A graph made by [`CaptureExt::capture`]: its pool charged to the
/// context's budget (and its graph memory, if any, charged as memory
/// outside memgov), and the context held, until it is destroyed.
///
/// Dropping it destroys it as [`destroy`](Self::destroy) does. A destroy
/// that fails (on a thread whose own capture is under way, or when the
/// driver refuses) keeps everything as it was, so it can be tried again;
/// when a drop's destroy fails, the backend keeps the graph pinned until
/// the context's teardown destroys it, and the charges are returned.
pub struct GovernedGraph<C: CaptureBackend> {
    graph: C::Graph,
    /// Graph memory (allocation nodes) charged while the graph lives.
    graph_memory: Option<OutsideUsage<C>>,
    /// The pool's charge and the context's pin; taken when the graph is
    /// destroyed.
    pool: Option<Reservation<C>>,
}

impl<C: CaptureBackend> std::fmt::Debug for GovernedGraph<C>
where
    C::Graph: std::fmt::Debug,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GovernedGraph")
            .field("graph", &self.graph)
            .field("graph_memory", &self.graph_memory_bytes())
            .field("destroyed", &self.pool.is_none())
            .finish()
    }
}

impl<C: CaptureBackend> GovernedGraph<C> {
    /// Queue one run of the graph on `stream`.
    ///
    /// # Errors
    ///
    /// [`GovernorError::Reclaimed`] for a stream reclaimed by `force`;
    /// [`GovernorError::Backend`] for what the launch returned (also after
    /// the graph was destroyed, and while the context's arena sleeps).
    pub fn launch(&self, stream: &GovernedStream<C>) -> Result<(), GovernorError> {
        let raw = stream.raw().ok_or_else(|| GovernorError::Reclaimed {
            context: stream.context_name(),
        })?;
        self.graph
            .launch(raw)
            .map_err(|source| GovernorError::Backend {
                context: stream.context_name(),
                source,
            })
    }

    /// Wait for every launch of the context and copy out what the graph's
    /// download `slot` holds.
    pub fn read_output(&mut self, slot: SlotOf<C>) -> Result<Vec<u8>, BackendError> {
        self.graph.read_output(slot)
    }

    /// Bytes of the pool the capture carved, and the pool's size.
    pub fn pool_usage(&self) -> (u64, u64) {
        self.graph.pool_usage()
    }

    /// Bytes of graph memory (allocation nodes) charged for the graph.
    pub fn graph_memory_bytes(&self) -> u64 {
        self.graph_memory.as_ref().map_or(0, OutsideUsage::bytes)
    }

    /// Whether the graph was destroyed (its charges returned).
    pub fn is_destroyed(&self) -> bool {
        self.pool.is_none()
    }

    /// Wait for every launch, destroy the graph, give its pool back to the
    /// arena, and only then return its charges and the context's pin. Later
    /// calls do nothing. On failure nothing changes and the call can be
    /// made again.
    pub fn destroy(&mut self) -> Result<(), BackendError> {
        if self.pool.is_none() {
            return Ok(());
        }
        self.graph.try_destroy()?;
        self.graph_memory = None;
        self.pool = None;
        Ok(())
    }
}

impl<C: CaptureBackend> Drop for GovernedGraph<C> {
    fn drop(&mut self) {
        // On failure the fields drop after this: the backend keeps the
        // graph pinned until teardown (see the type's docs).
        let _ = self.destroy();
    }
}
