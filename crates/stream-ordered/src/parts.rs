//! The parts of a vendor's public context (`CudaContext`, `HipContext`):
//! the state its threads share, its virtual-memory arena and the pins of
//! its captures' graphs ([`Parts`]), and what is read from them the same
//! way on every vendor.

use crate::arena::{Arena, ArenaHandle};
use crate::capture::Pins;
use crate::memory;
use crate::result::{err, Vendor};
use crate::retire::{self, Releases};
use crate::state::{Block, Origin};
use crate::stream::{self, StreamContext};
use crate::table::{CaptureTable, Context, StreamTable, VmmTable};
use crate::teardown::LOST_DRAIN;
use memgov_backend::shell::Current;
use memgov_backend::{
    BackendError, BackendErrorKind, BackendProbe, DeviceDescription, DeviceIdentity, Execution,
    MemoryInfo,
};
use std::sync::Arc;

/// The vendor's books of its live allocations, which every copy checks
/// and teardown empties.
pub trait Books: Context<Table: StreamTable> {
    /// What the books keep of a live allocation.
    type Entry;

    /// Whether `memory` (an allocation of this context) is live: not freed,
    /// nor handed to a free.
    fn is_live(&self, memory: &Block) -> bool;

    /// Take the live allocations carved from `arena` out of the books (the
    /// arena's teardown releases their granules); their sizes.
    fn forget_arena_allocations(&self, arena: &Self::Arena) -> Vec<u64>;

    /// Take `memory` out of the books (it is being freed); `None` when it
    /// is not live.
    fn take_live(&self, memory: &Block) -> Option<Self::Entry>;

    /// Put `memory` back into the books: its free was refused.
    fn put_back(&self, memory: &Block, entry: Self::Entry);
}

/// A vendor context's parts: the shared state (the caller's, the
/// callbacks' and the free thread's), the arena device memory comes from
/// when the context's configuration asked for one, and the executable
/// graphs made by captures on the arena that are still live.
pub struct Parts<C: Context> {
    /// The state the context's threads share.
    pub shared: Arc<C>,
    /// The virtual-memory arena, when configured.
    pub arena: Option<Arc<C::Arena>>,
    /// The live executable graphs of captures on the arena.
    pub pins: Arc<Pins<C::Table>>,
}

impl<C: Context> Parts<C> {
    /// The parts of a context just opened, with no arena yet.
    pub fn new(shared: C) -> Self {
        Self {
            shared: Arc::new(shared),
            arena: None,
            pins: Arc::default(),
        }
    }

    /// A handle on the context's virtual-memory arena (snapshot, trim,
    /// limit, sleep and wake), or `None` when none was configured.
    pub fn arena_handle(&self) -> Option<ArenaHandle<C>> {
        self.arena
            .as_ref()
            .map(|a| ArenaHandle::new(a.clone(), self.shared.clone()))
    }

    /// The probe every backend reports through; it outlives teardown.
    pub fn probe(&self) -> BackendProbe {
        self.shared.probe().clone()
    }

    /// The device's UUID and PCI address, as far as the driver reported
    /// them when the context was made.
    pub fn identity(&self) -> DeviceIdentity {
        self.shared.state().device.identity.clone()
    }

    /// The description of the device for the governor: the vendor's name
    /// (`NVIDIA`), the driver as `driver` words it, and whether memory freed
    /// on a stream is reusable at once by later work on it (never with an
    /// arena, whose ranges come back only once their release retired).
    pub fn description(&self, vendor: &str, driver: String, pool_reuse: bool) -> DeviceDescription {
        let d = &self.shared.state().device;
        DeviceDescription {
            backend: C::Table::BACKEND,
            vendor: vendor.to_owned(),
            name: d.name.clone(),
            ordinal: d.ordinal,
            total_bytes: d.total_bytes,
            driver,
            execution: d.execution,
            stream_ordered_reuse: self.arena.is_none() && pool_reuse,
        }
    }

    /// The device's free and total memory, as the driver reports them.
    pub fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        const OP: &str = "memory_info";
        let s = &*self.shared;
        s.check_usable(OP)?;
        let _current = s.make_current(OP)?;
        // SAFETY: the device is current.
        let (r, free, total) = unsafe { C::Table::mem_get_info() };
        s.checked(OP, C::Table::NAMES.mem_get_info, r)?;
        Ok(MemoryInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    /// Whether the driver is memgov's stand-in rather than the vendor's.
    pub fn is_stand_in(&self) -> bool {
        self.shared.state().device.execution == Execution::StandIn
    }

    /// Refuse a copy to or from arena memory while the arena, or a set the
    /// memory is in, sleeps (its addresses are reserved but nothing is
    /// mapped behind them).
    pub fn check_awake(&self, op: &'static str, memory: &Block) -> Result<(), BackendError> {
        match &self.arena {
            Some(a) if memory.origin == Origin::Arena => {
                a.check_awake(C::Table::BACKEND, op, memory.device, memory.bytes)
            }
            _ => Ok(()),
        }
    }
}

impl<C: Books + StreamContext> Parts<C> {
    /// Refuse to destroy `stream` while it captures (the capture gate):
    /// a stream destroyed under a capture invalidates it.
    pub fn before_destroy(&self, stream: &C::Stream) -> Result<(), BackendError> {
        let key = C::Table::stream_key(stream.as_ref().raw());
        self.shared
            .capture_gate()
            .before_destroy("destroy_stream", key)
    }

    /// Refuse to synchronize `stream` while it captures (the capture gate).
    pub fn before_sync(&self, stream: &C::Stream) -> Result<(), BackendError> {
        let key = C::Table::stream_key(stream.as_ref().raw());
        self.shared.capture_gate().before_sync("synchronize", key)
    }

    /// Copy `src` to `offset` of `memory` on `stream`; returns once the
    /// copy has executed (so `src` may be reused).
    pub fn write(
        &self,
        stream: &C::Stream,
        memory: &Block,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.copy(
            "write",
            stream,
            memory,
            (offset, src.len()),
            |s, raw, at| {
                // SAFETY: `copy`'s checks: [at, at + len) lies inside a live
                // allocation of this context, the stream is a live stream of it,
                // the device is current where the vendor needs it.
                unsafe { memory::write(s, raw, at, src) }
            },
        )
    }

    /// Copy `dst.len()` bytes at `offset` of `memory` into `dst` on
    /// `stream`; returns once `dst` holds them.
    pub fn read(
        &self,
        stream: &C::Stream,
        memory: &Block,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        self.copy("read", stream, memory, (offset, dst.len()), |s, raw, at| {
            // SAFETY: as in `write`.
            unsafe { memory::read(s, raw, at, dst) }
        })
    }

    /// A copy of `len` bytes at `offset` of `memory`: the checks, then,
    /// holding the sleep gate until the copy is queued (and synchronized,
    /// so no sleep unmaps between the awake check and the enqueue), the
    /// awake check and the range; an empty copy stops there; else the
    /// device made current where the vendor's stream calls need it, and
    /// `queue` with the stream and the device address.
    fn copy(
        &self,
        op: &'static str,
        stream: &C::Stream,
        memory: &Block,
        (offset, len): (u64, usize),
        queue: impl FnOnce(&C, <C::Table as VmmTable>::Stream, u64) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let s = &*self.shared;
        let raw = self.copy_checks(op, stream, memory)?;
        let _use = s.sleep_gate().enter();
        self.check_awake(op, memory)?;
        let at = memory::range::<C>(op, memory.device, memory.bytes, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let _current = if C::Table::STREAM_CALLS_NEED_CURRENT {
            Some(s.make_current(op)?)
        } else {
            None
        };
        queue(s, raw, at)
    }

    /// The checks of a copy, with no driver call: a usable context, a live
    /// stream of its own (whose handle it returns), a live allocation of
    /// its own.
    fn copy_checks(
        &self,
        op: &'static str,
        stream: &C::Stream,
        memory: &Block,
    ) -> Result<<C::Table as VmmTable>::Stream, BackendError> {
        let s = &*self.shared;
        s.check_usable(op)?;
        let raw = s.raw_stream(op, stream)?;
        let id = s.state().id;
        if memory.context != id || !s.is_live(memory) {
            return Err(err::<C::Table>(
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "allocation {memory} is not live in {} context {id} (it belongs to \
                     context {}, or was freed)",
                    C::Table::NAME,
                    memory.context
                ),
            ));
        }
        Ok(raw)
    }
}

impl<C, X> Parts<C>
where
    C: Books + StreamContext + Context<Arena = Arena<C, Releases, X>>,
    X: Send + Sync + 'static,
{
    /// `free_async` of arena memory: the free's first checks (the memory
    /// taken out of the books), then the release queued behind a callback
    /// on `stream`, which gives the range back to the arena once the stream
    /// passed the memory's last use (and, through `order_after`, every
    /// other stream that used it) and fires `signal`. No driver call unmaps
    /// anything here: trim, sleep and teardown do, on a caller's thread. On
    /// refusal the memory is back in the books and returned with the signal.
    #[allow(clippy::result_large_err)]
    pub fn arena_free_async<M: AsRef<Block>>(
        &self,
        arena: &Arc<Arena<C, Releases, X>>,
        stream: &C::Stream,
        memory: M,
        signal: memgov_backend::RetireSignal,
    ) -> Result<(), Refused<M>>
    where
        C::Table: retire::RetireTable,
    {
        let s = &*self.shared;
        let (_entry, _current, memory, signal) =
            begin_free(s, stream, memory, signal, "arena allocation")?;
        let (b, raw) = (memory.as_ref(), stream.as_ref().raw());
        // SAFETY: the stream is a live stream of this context (checked by
        // `begin_free`), which is current; the memory is `arena`'s and was
        // taken out of the live set.
        unsafe { retire::queue_release(s, arena, raw, signal, b.bytes, b.device) };
        Ok(())
    }

    /// Device loss: the arena's queued releases are dropped unfired (their
    /// callbacks will not run).
    pub fn abandon_arena_releases(&self) {
        if let Some(a) = &self.arena {
            retire::abandon_all(&a.releases, self.shared.probe());
        }
    }

    /// Teardown's first steps: the captures a failed end left live ended
    /// in the driver unless `stranded_lost` (or abandoned), the live graphs
    /// destroyed unless `graphs_lost` (`destroy_with` names the call for
    /// messages), then the arena: its allocations forgotten, the context's
    /// streams quiesced (on a context declared lost, polled for at most
    /// [`LOST_DRAIN`]) so that no queued work still uses a granule, its
    /// queued releases abandoned, every granule unmapped and released and
    /// the range freed. On a dead device nothing is called: what is left
    /// dies with it. Before anything waits at the gate these captures
    /// hold closed.
    pub fn close_captures_and_arena(
        &self,
        lost: bool,
        (stranded_lost, graphs_lost): (bool, bool),
        destroy_with: &'static str,
    ) -> Result<(), BackendError> {
        let s = &*self.shared;
        self.pins.end_stranded(s, stranded_lost);
        let graphs = self
            .pins
            .finish(s, self.arena.as_deref(), graphs_lost, destroy_with);
        let Some(arena) = &self.arena else {
            return graphs;
        };
        for bytes in s.forget_arena_allocations(arena) {
            s.probe().freed(bytes);
        }
        let lost = lost || s.is_lost();
        if s.shell().is_dead() {
            retire::abandon_all(&arena.releases, s.probe());
            return graphs;
        }
        let current = s.make_current("teardown")?;
        // Nothing queued may still use a granule when it is unmapped.
        let drained = stream::quiesce(s, "teardown", lost.then_some(LOST_DRAIN));
        // The streams ran everything queued (or the drain gave up): a
        // release whose callback has not run by now never will; its range
        // goes with the arena.
        retire::abandon_all(&arena.releases, s.probe());
        drained?;
        let released = arena.teardown(s);
        drop(current);
        released.and(graphs)
    }
}

/// A refused free: the memory and its signal handed back, with why.
pub type Refused<M> = (M, memgov_backend::RetireSignal, BackendError);

/// The first steps of a free of `memory` (`kind` names it in messages:
/// `allocation`, `arena allocation`): [`retire::begin_free`], which takes
/// it out of the vendor's books, then the device made current. On refusal
/// the memory is back in the books and handed back with `signal`.
#[allow(clippy::result_large_err, clippy::type_complexity)]
pub fn begin_free<'a, C, M>(
    s: &'a C,
    stream: &C::Stream,
    memory: M,
    signal: memgov_backend::RetireSignal,
    kind: &str,
) -> Result<(C::Entry, Current<'a, C>, M, memgov_backend::RetireSignal), Refused<M>>
where
    C: Books<Table: retire::RetireTable>,
    M: AsRef<Block>,
{
    let b = memory.as_ref();
    let what = format_args!("{kind} {b}");
    let entry = match retire::begin_free(s, stream, b.context, what, || s.take_live(b)) {
        Ok(entry) => entry,
        Err(e) => return Err((memory, signal, e)),
    };
    match s.make_current("free_async") {
        Ok(current) => Ok((entry, current, memory, signal)),
        Err(e) => {
            s.put_back(memory.as_ref(), entry);
            Err((memory, signal, e))
        }
    }
}

/// The vendor's public context as the governor's `DeviceContext`, written
/// once: `device_context!(CudaContext, CudaStream, CudaMemory)`. The
/// context holds its [`Parts`] in a field `parts`; its memory wraps a
/// [`Block`] (`AsRef`). What the vendor does its own way are inherent
/// methods of the context, which the impl calls:
///
/// * `describe_impl(&self) -> DeviceDescription` (see
///   [`Parts::description`]);
/// * `allocate_impl(&self, &Stream, u64) -> Result<Memory>`: device memory,
///   the arena's when there is one;
/// * `allocate_pinned_impl(&self, &Stream, u64) -> Result<Memory>`:
///   page-locked host memory;
/// * `free_async_impl(&self, &Stream, Memory, RetireSignal) -> Result<(),
///   (Memory, RetireSignal, BackendError)>`: memory of the pool (or the
///   vendor's other sources); the arena's ([`Origin::Arena`]) is
///   [`Parts::arena_free_async`];
/// * `destroy_stream_impl(&self, Stream)` and `synchronize_impl(&self,
///   &Stream)`, both `-> Result<()>`, after the capture gate admitted them;
/// * `device_lost_impl(&self)` (the arena's releases are then abandoned
///   here) and `teardown_impl(self, bool) -> Result<()>`.
///
/// Identity, memory info, stream creation and cross-stream order, the
/// copies and the capture gate's checks are the core's.
#[macro_export]
macro_rules! device_context {
    ($context:ty, $stream:ty, $memory:ty) => {
        impl ::memgov_backend::DeviceContext for $context {
            type Stream = $stream;
            type Memory = $memory;

            fn describe(&self) -> ::memgov_backend::DeviceDescription {
                self.describe_impl()
            }

            fn identity(&self) -> ::memgov_backend::DeviceIdentity {
                self.parts.identity()
            }

            fn memory_info(
                &self,
            ) -> ::std::result::Result<::memgov_backend::MemoryInfo, ::memgov_backend::BackendError>
            {
                self.parts.memory_info()
            }

            fn create_stream(
                &self,
            ) -> ::std::result::Result<$stream, ::memgov_backend::BackendError> {
                $crate::stream::create(&*self.parts.shared)
            }

            fn destroy_stream(
                &self,
                stream: $stream,
            ) -> ::std::result::Result<(), ::memgov_backend::BackendError> {
                self.parts.before_destroy(&stream)?;
                self.destroy_stream_impl(stream)
            }

            fn allocate(
                &self,
                stream: &$stream,
                bytes: u64,
            ) -> ::std::result::Result<$memory, ::memgov_backend::BackendError> {
                self.allocate_impl(stream, bytes)
            }

            fn allocate_in(
                &self,
                stream: &$stream,
                bytes: u64,
                tier: ::memgov_backend::Tier,
            ) -> ::std::result::Result<$memory, ::memgov_backend::BackendError> {
                match tier {
                    ::memgov_backend::Tier::Device => self.allocate_impl(stream, bytes),
                    _ => self.allocate_pinned_impl(stream, bytes),
                }
            }

            fn free_async(
                &self,
                stream: &$stream,
                memory: $memory,
                retired: ::memgov_backend::RetireSignal,
            ) -> ::std::result::Result<
                (),
                (
                    $memory,
                    ::memgov_backend::RetireSignal,
                    ::memgov_backend::BackendError,
                ),
            > {
                let origin = ::std::convert::AsRef::<$crate::state::Block>::as_ref(&memory).origin;
                match &self.parts.arena {
                    Some(a) if origin == $crate::state::Origin::Arena => {
                        self.parts.arena_free_async(a, stream, memory, retired)
                    }
                    _ => self.free_async_impl(stream, memory, retired),
                }
            }

            fn write(
                &self,
                stream: &$stream,
                memory: &$memory,
                offset: u64,
                src: &[u8],
            ) -> ::std::result::Result<(), ::memgov_backend::BackendError> {
                self.parts.write(stream, memory.as_ref(), offset, src)
            }

            fn read(
                &self,
                stream: &$stream,
                memory: &$memory,
                offset: u64,
                dst: &mut [u8],
            ) -> ::std::result::Result<(), ::memgov_backend::BackendError> {
                self.parts.read(stream, memory.as_ref(), offset, dst)
            }

            fn synchronize(
                &self,
                stream: &$stream,
            ) -> ::std::result::Result<(), ::memgov_backend::BackendError> {
                self.parts.before_sync(stream)?;
                self.synchronize_impl(stream)
            }

            fn order_after(
                &self,
                stream: &$stream,
                after: &$stream,
            ) -> ::std::result::Result<(), ::memgov_backend::BackendError> {
                $crate::stream::order_after(&*self.parts.shared, stream, after)
            }

            fn device_lost(&self) {
                self.device_lost_impl();
                self.parts.abandon_arena_releases();
            }

            fn teardown(
                self,
                lost: bool,
            ) -> ::std::result::Result<(), ::memgov_backend::BackendError> {
                self.teardown_impl(lost)
            }
        }
    };
}
