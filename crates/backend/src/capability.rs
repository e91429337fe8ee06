//! Capabilities a backend may offer beyond [`DeviceContext`]: a
//! virtual-memory arena, sleep and wake of its physical memory at stable
//! addresses, and graph capture with a pool reserved before capture.
//!
//! Each capability is a trait, so that the conformance cases that define
//! what it means (`memgov-conformance`'s `capability` module) are written
//! once and run on every backend that declares it. The method names are
//! those of the CUDA backend, the first to offer them (`CudaArena::trim`,
//! `CudaArena::sleep`, `CudaContext::begin_capture`, ...); another backend
//! implements the traits over its own calls with the same meaning.
//!
//! The settings and refusals the capabilities share ([`CaptureConfig`],
//! [`CaptureMode`], [`PoolExhausted`], [`SleepReport`], [`ArenaUsage`]) live
//! here, so that generic code can make and read them.

use crate::{BackendError, BackendErrorKind, DeviceContext};

/// What an arena holds, in bytes unless said otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArenaUsage {
    /// Address space reserved for the arena's life (costs no memory).
    pub reserved: u64,
    /// Physical memory mapped: in use, cached, quarantined-mapped. What
    /// the arena's limit bounds.
    pub mapped: u64,
    /// Bytes of live allocations.
    pub in_use: u64,
    /// Mapped granules no allocation uses: what a trim gives back.
    pub cached: u64,
    /// Granules released by a sleep, which a wake maps again.
    pub asleep: u64,
    /// The granule: the unit of mapping.
    pub granule: u64,
    /// Granules the driver would not give back, kept out of use.
    pub quarantined: usize,
}

/// What a sleep gave back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SleepReport {
    /// Physical bytes unmapped and released (granules in use and cached).
    pub released: u64,
    /// Bytes of contents kept in page-locked host memory for the wake.
    pub offloaded: u64,
}

/// A handle on a backend's virtual-memory arena: one address range reserved
/// for the context's life, backed by physical memory granule by granule.
///
/// Guarantees a backend declaring it must keep (the conformance cases check
/// each): an allocation's address never changes while it lives, also across
/// growth of the arena; [`ArenaUsage::mapped`] counts physical memory only,
/// never the reservation; a trim gives back whole cached granules.
pub trait VirtualArena: Clone + Send + Sync + 'static {
    /// What the arena holds now.
    fn usage(&self) -> ArenaUsage;

    /// Give back every cached granule; returns the bytes given back. While
    /// a graph capture is under way the trim is deferred (returns 0) to the
    /// capture's end.
    fn trim(&self) -> Result<u64, BackendError>;

    /// Set the most physical memory the arena maps, rounded down to whole
    /// granules. Lowering it unmaps nothing.
    fn set_limit(&self, bytes: u64);
}

/// An arena whose physical memory can be released while its addresses stay
/// reserved, and mapped again at the same addresses.
pub trait SleepWake: VirtualArena {
    /// Wait for the context's streams, then unmap and release every granule,
    /// keeping the contents of those in use in host memory when
    /// `keep_contents` is set.
    fn sleep(&self, keep_contents: bool) -> Result<SleepReport, BackendError>;

    /// Map every sleeping granule again at its address and restore the
    /// contents kept. A wake that does not fit the limit is refused before
    /// anything is mapped. Returns the bytes mapped.
    fn wake(&self) -> Result<u64, BackendError>;

    /// Put the allocations at the device addresses `ptrs` to sleep: every
    /// granule only they use is released (its contents kept when
    /// `keep_contents` is set); the other allocations stay mapped and
    /// usable. A granule already asleep is not released again.
    fn sleep_ranges(&self, ptrs: &[u64], keep_contents: bool) -> Result<SleepReport, BackendError>;

    /// Wake the allocations at `ptrs`: their sleeping granules mapped again
    /// at the same addresses, contents restored. Returns the bytes mapped.
    fn wake_ranges(&self, ptrs: &[u64]) -> Result<u64, BackendError>;
}

/// A backend whose contexts can carry a [`VirtualArena`].
pub trait ArenaBackend: DeviceContext {
    /// The arena's handle.
    type Arena: SleepWake;

    /// The context's arena, when it was created with one.
    fn arena(&self) -> Option<Self::Arena>;

    /// The device address of an allocation, to check it stays put.
    fn device_address(&self, memory: &Self::Memory) -> u64;
}

/// How a capture restricts other calls while it is under way (as CUDA's
/// `CUstreamCaptureMode` and HIP's `hipStreamCaptureMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CaptureMode {
    /// Potentially unsafe calls are prohibited on every thread while the
    /// capture is under way (the drivers' default).
    #[default]
    Global,
    /// Prohibited only on the capturing thread.
    ThreadLocal,
    /// Not prohibited; the capture may end on another thread.
    Relaxed,
}

/// A capture's settings: the pool its allocations come from, and its mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureConfig {
    /// Bytes of device memory taken from the arena before capture begins;
    /// every allocation during the capture is carved from them.
    pub pool_bytes: u64,
    /// The capture mode.
    pub mode: CaptureMode,
}

/// An allocation during capture did not fit in what is left of the pool.
/// The capture is still valid: end it, or carve less.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolExhausted {
    /// The backend whose capture refused (`"cuda"`, ...).
    pub backend: &'static str,
    /// Bytes asked for (before alignment).
    pub requested: u64,
    /// Bytes of the pool still free.
    pub free: u64,
    /// The pool's size.
    pub pool: u64,
}

impl std::fmt::Display for PoolExhausted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the capture pool has {} B free of {} B, {} B asked; nothing was allocated and the \
             capture is still valid: begin the capture with a larger CaptureConfig::pool_bytes",
            self.free, self.pool, self.requested
        )
    }
}

impl std::error::Error for PoolExhausted {}

impl From<PoolExhausted> for BackendError {
    fn from(e: PoolExhausted) -> Self {
        BackendError::new(
            e.backend,
            "capture_allocate",
            BackendErrorKind::OutOfMemory,
            e.to_string(),
        )
    }
}

/// A backend that captures a stream's work into a graph, with a pool taken
/// from its arena before the capture begins.
///
/// Guarantees (checked by the conformance cases): no driver allocation
/// while a capture is under way; running out of the pool is a typed
/// [`PoolExhausted`] and the capture stays valid; arena trims are deferred
/// to the end of the capture, never run during it; the graph keeps its pool
/// until it is destroyed.
pub trait CaptureBackend: ArenaBackend {
    /// A capture under way.
    type Capture<'a>: PoolCapture<Graph = Self::Graph>
    where
        Self: 'a;
    /// The instantiated graph a capture makes.
    type Graph: CapturedGraph<Stream = Self::Stream>;

    /// The size of the pool [`begin_capture`](Self::begin_capture) takes
    /// for `config.pool_bytes` (rounded as it rounds, checked), so that a
    /// caller can charge it before anything begins; refused as
    /// `begin_capture` would refuse it.
    fn capture_pool_bytes(&self, config: &CaptureConfig) -> Result<u64, BackendError>;

    /// Take the pool from the arena, then begin capturing `stream`.
    fn begin_capture<'a>(
        &'a self,
        stream: &Self::Stream,
        config: CaptureConfig,
    ) -> Result<Self::Capture<'a>, BackendError>;
}

/// A capture under way: allocations carved from its pool, copies recorded.
pub trait PoolCapture {
    /// Device memory carved from the pool.
    type Buffer: Copy;
    /// The graph [`end`](Self::end) makes.
    type Graph: CapturedGraph;

    /// The driver's id of the capture.
    fn id(&self) -> u64;
    /// Bytes of the pool not carved yet.
    fn pool_free(&self) -> u64;
    /// Carve `bytes` from the pool, with no driver call.
    fn allocate(&mut self, bytes: u64) -> Result<Self::Buffer, PoolExhausted>;
    /// Record a copy of `data` into `buf` at `offset`.
    fn upload(
        &mut self,
        buf: &Self::Buffer,
        offset: u64,
        data: Vec<u8>,
    ) -> Result<(), BackendError>;
    /// Record a copy of `len` bytes of `buf` at `offset` to a host buffer.
    fn download(
        &mut self,
        buf: &Self::Buffer,
        offset: u64,
        len: usize,
    ) -> Result<<Self::Graph as CapturedGraph>::Slot, BackendError>;
    /// End the capture and instantiate its graph.
    fn end(self) -> Result<Self::Graph, BackendError>;
}

/// An instantiated graph that pins its pool until destroyed.
pub trait CapturedGraph {
    /// The backend's stream.
    type Stream;
    /// A host buffer a recorded download writes into.
    type Slot: Copy;

    /// Queue one run on `stream`.
    fn launch(&self, stream: &Self::Stream) -> Result<(), BackendError>;
    /// Wait for the launches and copy out what download `slot` holds.
    fn read_output(&mut self, slot: Self::Slot) -> Result<Vec<u8>, BackendError>;
    /// Bytes of the pool the capture carved, and the pool's size.
    fn pool_usage(&self) -> (u64, u64);
    /// Bytes of device memory the graph's own allocation nodes hold (made
    /// by a runtime's stream-ordered allocations on the capturing stream;
    /// memgov's captures make none).
    fn graph_memory_bytes(&self) -> Result<u64, BackendError>;
    /// Wait for the launches, destroy the graph, give its pool back.
    fn destroy(self) -> Result<(), BackendError>;
    /// [`destroy`](Self::destroy) in place: on failure the graph is kept
    /// (still pinned, its pool still taken) and the call can be made again;
    /// once it succeeded, later calls do nothing.
    fn try_destroy(&mut self) -> Result<(), BackendError>;
}

/// Implement every capability trait for a backend whose types have the
/// inherent methods of the same names (`snapshot`, `trim`, `set_limit`,
/// `sleep`, `wake`, `sleep_ranges`, `wake_ranges`, `arena`,
/// `begin_capture`, ...): each trait method calls the inherent one, so the
/// conformance cases written over the traits test exactly what a caller of
/// the backend's own types gets. The arena's `snapshot` must return a value
/// with the fields of `vmm::ArenaSnapshot`.
///
/// ```text
/// memgov_backend::impl_capabilities! {
///     arena: CudaArena,
///     context: CudaContext,
///     memory: CudaMemory => |m| m.device_ptr(),
///     capture: CudaCapture,
///     graph: CudaGraph,
///     stream: CudaStream,
///     buffer: CaptureBuffer,
///     slot: OutputSlot,
/// }
/// ```
///
/// Handles whose capability traits are implemented where their types are
/// (generic handles, as the stream-ordered core's) are named after
/// `handles_implemented,`: only the context's traits are implemented; see
/// [`impl_arena_capabilities!`](crate::impl_arena_capabilities) and
/// [`impl_capture_capabilities!`](crate::impl_capture_capabilities).
#[macro_export]
macro_rules! impl_capabilities {
    (
        arena: $arena:ty,
        context: $ctx:ty,
        memory: $mem:ty => |$m:ident| $addr:expr,
        capture: $cap:ident,
        graph: $graph:ty,
        stream: $stream:ty,
        buffer: $buf:ty,
        slot: $slot:ty $(,)?
    ) => {
        $crate::impl_arena_capabilities!(impl<> for $arena);
        $crate::impl_capture_capabilities! {
            impl<>
            capture: $cap<'_>,
            graph: $graph,
            stream: $stream,
            buffer: $buf,
            slot: $slot,
        }
        $crate::impl_capabilities! {
            handles_implemented,
            arena: $arena,
            context: $ctx,
            memory: $mem => |$m| $addr,
            capture: $cap,
            graph: $graph,
            stream: $stream,
        }
    };
    (
        handles_implemented,
        arena: $arena:ty,
        context: $ctx:ty,
        memory: $mem:ty => |$m:ident| $addr:expr,
        capture: $cap:ident,
        graph: $graph:ty,
        stream: $stream:ty $(,)?
    ) => {
        impl $crate::capability::ArenaBackend for $ctx {
            type Arena = $arena;

            fn arena(&self) -> Option<$arena> {
                <$ctx>::arena(self)
            }

            fn device_address(&self, $m: &$mem) -> u64 {
                $addr
            }
        }

        impl $crate::capability::CaptureBackend for $ctx {
            type Capture<'a> = $cap<'a>;
            type Graph = $graph;

            fn capture_pool_bytes(
                &self,
                config: &$crate::capability::CaptureConfig,
            ) -> Result<u64, $crate::BackendError> {
                <$ctx>::capture_pool_bytes(config.pool_bytes)
            }

            fn begin_capture<'a>(
                &'a self,
                stream: &$stream,
                config: $crate::capability::CaptureConfig,
            ) -> Result<$cap<'a>, $crate::BackendError> {
                <$ctx>::begin_capture(self, stream, config)
            }
        }

    };
}

/// Implement [`VirtualArena`] and [`SleepWake`] for an arena handle with
/// the inherent methods of the same names (`snapshot`, `trim`,
/// `set_limit`, `sleep`, `wake`, `sleep_ranges`, `wake_ranges`), generic or
/// not: `impl_arena_capabilities!(impl<C: Context> for ArenaHandle<C>)`.
#[macro_export]
macro_rules! impl_arena_capabilities {
    (impl<$($g:ident: $b:path),*> for $arena:ty) => {
        impl<$($g: $b),*> $crate::capability::VirtualArena for $arena {
            fn usage(&self) -> $crate::capability::ArenaUsage {
                let s = <$arena>::snapshot(self);
                $crate::capability::ArenaUsage {
                    reserved: s.reserved,
                    mapped: s.mapped,
                    in_use: s.in_use,
                    cached: s.cached,
                    asleep: s.asleep,
                    granule: s.granule,
                    quarantined: s.quarantined.len(),
                }
            }

            fn trim(&self) -> Result<u64, $crate::BackendError> {
                <$arena>::trim(self)
            }

            fn set_limit(&self, bytes: u64) {
                <$arena>::set_limit(self, bytes);
            }
        }

        impl<$($g: $b),*> $crate::capability::SleepWake for $arena {
            fn sleep(
                &self,
                keep_contents: bool,
            ) -> Result<$crate::capability::SleepReport, $crate::BackendError> {
                <$arena>::sleep(self, keep_contents)
            }

            fn wake(&self) -> Result<u64, $crate::BackendError> {
                <$arena>::wake(self)
            }

            fn sleep_ranges(
                &self,
                ptrs: &[u64],
                keep_contents: bool,
            ) -> Result<$crate::capability::SleepReport, $crate::BackendError> {
                <$arena>::sleep_ranges(self, ptrs, keep_contents)
            }

            fn wake_ranges(&self, ptrs: &[u64]) -> Result<u64, $crate::BackendError> {
                <$arena>::wake_ranges(self, ptrs)
            }
        }
    };
}

/// Implement [`PoolCapture`] and [`CapturedGraph`] for a capture and its
/// graph with the inherent methods of the same names, generic or not:
/// `impl_capture_capabilities! { impl<C: Context> capture: Capture<'_, C>,
/// graph: Graph<C>, stream: C::Stream, buffer: Buffer, slot: Slot }`.
#[macro_export]
macro_rules! impl_capture_capabilities {
    (
        impl<$($g:ident: $b:path),*>
        capture: $cap:ty,
        graph: $graph:ty,
        stream: $stream:ty,
        buffer: $buf:ty,
        slot: $slot:ty $(,)?
    ) => {
        impl<$($g: $b),*> $crate::capability::PoolCapture for $cap {
            type Buffer = $buf;
            type Graph = $graph;

            fn id(&self) -> u64 {
                <$cap>::id(self)
            }

            fn pool_free(&self) -> u64 {
                <$cap>::pool_free(self)
            }

            fn allocate(&mut self, bytes: u64) -> Result<$buf, $crate::capability::PoolExhausted> {
                <$cap>::allocate(self, bytes)
            }

            fn upload(
                &mut self,
                buf: &$buf,
                offset: u64,
                data: Vec<u8>,
            ) -> Result<(), $crate::BackendError> {
                <$cap>::upload(self, buf, offset, data)
            }

            fn download(
                &mut self,
                buf: &$buf,
                offset: u64,
                len: usize,
            ) -> Result<$slot, $crate::BackendError> {
                <$cap>::download(self, buf, offset, len)
            }

            fn end(self) -> Result<$graph, $crate::BackendError> {
                <$cap>::end(self)
            }
        }

        impl<$($g: $b),*> $crate::capability::CapturedGraph for $graph {
            type Stream = $stream;
            type Slot = $slot;

            fn launch(&self, stream: &$stream) -> Result<(), $crate::BackendError> {
                <$graph>::launch(self, stream)
            }

            fn read_output(&mut self, slot: $slot) -> Result<Vec<u8>, $crate::BackendError> {
                <$graph>::read_output(self, slot)
            }

            fn pool_usage(&self) -> (u64, u64) {
                <$graph>::pool_usage(self)
            }

            fn graph_memory_bytes(&self) -> Result<u64, $crate::BackendError> {
                <$graph>::graph_memory_bytes(self)
            }

            fn destroy(self) -> Result<(), $crate::BackendError> {
                <$graph>::destroy(self)
            }

            fn try_destroy(&mut self) -> Result<(), $crate::BackendError> {
                <$graph>::try_destroy(self)
            }
        }
    };
}
