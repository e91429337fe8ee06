//! What a context of any vendor holds, below the calls that move it: the
//! device it opened ([`Device`]), its shared state ([`State`]: id, lost
//! state and probe, streams, sleep gate), and the handles it hands out
//! ([`Stream`], [`Block`]). The vendor's shared state extends a [`State`]
//! with what only that vendor keeps (CUDA's primary context and pool,
//! HIP's allocator choice), and its public stream and memory types wrap a
//! [`Stream`] and a [`Block`]: every vendor's handles carry the same parts
//! and are checked the same way.

use crate::result::{Checked, Vendor};
use memgov_backend::shell::Shell;
use memgov_backend::vmm::SleepGate;
use memgov_backend::{lock, BackendProbe, DeviceIdentity, Execution, Tier};
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The device name prefix of memgov's stand-in drivers (see
/// `backends/stand-ins/README.md`): a device named so makes its context
/// report [`Execution::StandIn`]. No NVIDIA or AMD device is named so.
pub const STAND_IN_NAME: &str = "memgov stand-in";

/// Ids of stream-ordered contexts in this process, stamped into their
/// streams and allocations so that another context's handles are refused.
static CONTEXT_IDS: AtomicU64 = AtomicU64::new(1);

/// A driver handle carried across threads (in a context's registries and
/// pins, shared by its threads). CUDA's and HIP's handles have no thread
/// affinity: any host thread may pass one to the driver with its context
/// current; a `Raw` only carries the value, and is made only from a vendor
/// table's handle types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raw<T>(pub T);

// SAFETY: see the type's documentation: the handles a table names are
// plain values the driver accepts from any thread; `Raw` never
// dereferences them.
unsafe impl<T: Copy> Send for Raw<T> {}
// SAFETY: as above; a shared reference only copies the value.
unsafe impl<T: Copy> Sync for Raw<T> {}

/// What opening a device learnt about it, read once when the context is
/// made: what `describe` and `identity` report.
#[derive(Debug, Clone)]
pub struct Device {
    /// The device's ordinal in the driver's numbering.
    pub ordinal: u32,
    /// The driver's name of the device.
    pub name: String,
    /// UUID and PCI address, as far as the driver reported them.
    pub identity: DeviceIdentity,
    /// The device's memory in bytes.
    pub total_bytes: u64,
    /// The driver (and runtime) versions, as `describe` reports them.
    pub driver: String,
    /// Real hardware, or memgov's stand-in (by the device's name).
    pub execution: Execution,
}

impl Device {
    /// The facts of device `ordinal`; a name starting with
    /// [`STAND_IN_NAME`] is the stand-in's.
    pub fn new(
        ordinal: u32,
        name: String,
        identity: DeviceIdentity,
        total_bytes: u64,
        driver: String,
    ) -> Self {
        let execution = if name.starts_with(STAND_IN_NAME) {
            Execution::StandIn
        } else {
            Execution::RealHardware
        };
        Self {
            ordinal,
            name,
            identity,
            total_bytes,
            driver,
            execution,
        }
    }
}

/// A context's streams: the live ones by id (with whether a runtime lent
/// it: then memgov never destroys it), the adopted streams not yet handed
/// out, and the retired ones (destroyed by the governor, their work
/// possibly still queued). No lock is held while the driver is called.
#[derive(Debug)]
pub struct Streams<S> {
    pub(crate) live: Mutex<HashMap<u64, (Raw<S>, bool)>>,
    pub(crate) lendable: Mutex<VecDeque<Raw<S>>>,
    retired: Mutex<Vec<Raw<S>>>,
}

impl<S: Copy> Default for Streams<S> {
    fn default() -> Self {
        Self::lending(Vec::new())
    }
}

impl<S: Copy> Streams<S> {
    /// A registry that hands out `adopted` (a runtime's own streams) before
    /// it creates any.
    pub fn lending(adopted: Vec<S>) -> Self {
        Self {
            live: Mutex::default(),
            lendable: Mutex::new(adopted.into_iter().map(Raw).collect()),
            retired: Mutex::default(),
        }
    }

    /// Take live stream `id` out: its handle and whether it was adopted.
    pub fn remove(&self, id: u64) -> Option<(S, bool)> {
        lock(&self.live)
            .remove(&id)
            .map(|(r, adopted)| (r.0, adopted))
    }

    /// The handles of the live streams.
    pub fn live(&self) -> Vec<S> {
        lock(&self.live).values().map(|(r, _)| r.0).collect()
    }

    /// Take every live stream out: handle, adopted.
    pub fn drain(&self) -> Vec<(S, bool)> {
        let mut live = lock(&self.live);
        live.drain()
            .map(|(_, (r, adopted))| (r.0, adopted))
            .collect()
    }

    /// Keep a destroyed stream whose work may still be queued until the
    /// stream module's `reap_retired` (or teardown) destroys it.
    pub fn retire(&self, raw: S) {
        lock(&self.retired).push(Raw(raw));
    }

    /// Whether any retired stream waits to be destroyed.
    pub fn has_retired(&self) -> bool {
        !lock(&self.retired).is_empty()
    }

    /// Take the retired streams out of everyone else's reach: the caller
    /// destroys them or puts them back ([`keep_retired`](Self::keep_retired)).
    pub fn take_retired(&self) -> Vec<S> {
        let taken = std::mem::take(&mut *lock(&self.retired));
        taken.into_iter().map(|r| r.0).collect()
    }

    /// Put retired streams back.
    pub fn keep_retired(&self, raw: Vec<S>) {
        lock(&self.retired).extend(raw.into_iter().map(Raw));
    }
}

/// What every stream-ordered context's threads share (the caller's, the
/// callbacks' through their routes, the free thread's), whatever the
/// vendor: its id, the device, the shell (lost, dead and closing state, and
/// the probe), the streams and the arena's sleep gate. Dropping it calls no
/// driver function.
pub struct State<T: Vendor, S> {
    /// This context's id in the process (stamped into its handles).
    pub id: u64,
    /// The device the context opened.
    pub device: Device,
    /// Lost (declared by the governor, or a sticky code from the driver,
    /// whose message is the reason kept), dead (the driver's own sticky
    /// code), closing, and the probe the loss is reported to.
    pub shell: Shell<Checked<T>>,
    /// Live streams (created or adopted), adopted streams not yet handed
    /// out, and retired streams.
    pub streams: Streams<S>,
    /// Sleeps of the arena against copies and launches between their
    /// awake check and their enqueue.
    pub sleep_gate: SleepGate,
    next_id: AtomicU64,
}

impl<T: Vendor, S: Copy> State<T, S> {
    /// The state of a context just opened on `device`, handing out
    /// `adopted` (a runtime's own streams) before it creates any.
    pub fn new(device: Device, adopted: Vec<S>) -> Self {
        let shell = Shell::new(
            format!("{} device {}", T::NAME, device.ordinal),
            BackendProbe::new(),
        );
        Self {
            id: CONTEXT_IDS.fetch_add(1, Ordering::Relaxed),
            device,
            shell,
            streams: Streams::lending(adopted),
            sleep_gate: SleepGate::default(),
            next_id: AtomicU64::new(1),
        }
    }

    /// The next id of a stream or allocation of this context.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The fields every context's `Debug` shows, under the vendor's type
    /// name (`CudaContext`); the vendor adds its own.
    pub fn debug<'a, 'b>(
        &self,
        f: &'a mut std::fmt::Formatter<'b>,
        name: &str,
    ) -> std::fmt::DebugStruct<'a, 'b> {
        let mut d = f.debug_struct(name);
        d.field("id", &self.id)
            .field("ordinal", &self.device.ordinal)
            .field("name", &self.device.name)
            .field("execution", &self.device.execution)
            .field("lost", &self.shell.is_lost());
        d
    }
}

/// A stream of a context, as its public handle (`CudaStream`, `HipStream`)
/// carries it: the raw handle, the stream's id, the id of the context that
/// made it, and whether a runtime lent it. A plain handle: dropping it does
/// nothing. Only the core makes one (when a stream is registered), so a
/// handle is never forged: its raw handle is the one the context made.
#[derive(Debug)]
pub struct Stream<S> {
    raw: Raw<S>,
    id: u64,
    context: u64,
    adopted: bool,
}

impl<S: Copy> Stream<S> {
    pub(crate) fn new(raw: S, id: u64, context: u64, adopted: bool) -> Self {
        Self {
            raw: Raw(raw),
            id,
            context,
            adopted,
        }
    }

    /// The driver's handle.
    pub fn raw(&self) -> S {
        self.raw.0
    }

    /// This stream's number within its context (for logs).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The id of the context that made it (checked on every use).
    pub fn context(&self) -> u64 {
        self.context
    }

    /// Whether this stream was lent by the runtime that adopted the context
    /// (memgov synchronizes it but never destroys it).
    pub fn is_adopted(&self) -> bool {
        self.adopted
    }
}

/// A vendor's public handle over a core part ([`Stream`], [`Block`]): the
/// newtype, reading the part through `Deref` and `AsRef`. Its field is the
/// vendor crate's own: users read a handle but cannot make one. A stream's
/// handle names its raw-handle accessor (`cu_stream`), documented by the
/// vendor.
///
/// ```ignore
/// memgov_stream_ordered::handle! {
///     /// A stream of ordered work on a CUDA context.
///     pub struct CudaStream(Stream<CUstream>);
///     /// The raw `CUstream`, for a runtime's own kernels.
///     pub fn cu_stream;
/// }
/// ```
#[macro_export]
macro_rules! handle {
    (
        $(#[$meta:meta])* pub struct $name:ident(Stream<$raw:ty>);
        $(#[$raw_meta:meta])* pub fn $raw_fn:ident;
    ) => {
        $crate::handle! {
            $(#[$meta])*
            pub struct $name($crate::state::Stream<$raw>);
        }

        impl $name {
            $(#[$raw_meta])*
            pub fn $raw_fn(&self) -> $raw {
                self.0.raw()
            }
        }
    };
    ($(#[$meta:meta])* pub struct $name:ident($inner:ty);) => {
        $(#[$meta])*
        #[derive(Debug)]
        pub struct $name(pub(crate) $inner);

        impl ::std::ops::Deref for $name {
            type Target = $inner;
            fn deref(&self) -> &$inner {
                &self.0
            }
        }

        impl ::std::convert::AsRef<$inner> for $name {
            fn as_ref(&self) -> &$inner {
                &self.0
            }
        }
    };
}

/// Where an allocation came from, and so how it is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The context's own stream-ordered pool (`cuMemAllocFromPoolAsync`,
    /// `hipMallocFromPoolAsync`); freed on a stream (`cuMemFreeAsync`,
    /// `hipFreeAsync`).
    Pool,
    /// HIP's `hipMalloc` fallback; freed with `hipFree` once an event
    /// recorded on the releasing stream has completed.
    Plain,
    /// Page-locked host memory ([`Tier::PinnedHost`]), mapped into the
    /// device's address space; freed once the releasing stream passed it.
    PinnedHost,
    /// Carved from the context's virtual-memory arena; its range returns to
    /// the arena once a callback queued behind its release ran.
    Arena,
}

/// An allocation of a context, as its public handle (`CudaMemory`,
/// `HipMemory`) carries it. A plain handle: dropping it does nothing; only
/// a stream-ordered free (or teardown, for memory the governor abandoned)
/// returns it.
#[derive(Debug)]
pub struct Block {
    /// The device's address of it; for page-locked host memory the
    /// device's view of the host buffer, whose value may differ from the
    /// host address.
    pub device: u64,
    /// The host address of page-locked host memory; 0 for device memory.
    pub host: usize,
    /// Size in bytes as requested.
    pub bytes: u64,
    /// This allocation's number within its context.
    pub id: u64,
    /// The id of the context that allocated it (checked on every use).
    pub context: u64,
    /// Where it came from.
    pub origin: Origin,
}

/// How messages name an allocation: its number, size and device address
/// (`3 (4096 B at 0x7f0000)`), after the word for its kind.
impl std::fmt::Display for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} B at {:#x})", self.id, self.bytes, self.device)
    }
}

impl Block {
    /// Size in bytes as requested.
    pub fn len(&self) -> u64 {
        self.bytes
    }

    /// Always false: zero-byte allocations are refused.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Whether it came from the stream-ordered pool, a plain allocation,
    /// page-locked host memory or the arena.
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// The tier it was allocated in.
    pub fn tier(&self) -> Tier {
        match self.origin {
            Origin::PinnedHost => Tier::PinnedHost,
            Origin::Pool | Origin::Plain | Origin::Arena => Tier::Device,
        }
    }

    /// The host address of page-locked host memory (`None` for device
    /// memory), valid while the allocation is: for host code and the host
    /// side of copies.
    pub fn host_ptr(&self) -> Option<*mut c_void> {
        (self.host != 0).then_some(self.host as *mut c_void)
    }

    /// The allocation's own address: the host address of page-locked host
    /// memory (what the vendor's host free takes), else the device address.
    pub fn own(&self) -> usize {
        if self.host != 0 {
            self.host
        } else {
            self.device as usize
        }
    }
}
