//! # memgov-stream-ordered
//!
//! The driver-agnostic core of memgov's backends over a stream-ordered GPU
//! driver API: CUDA's driver API and ROCm's HIP runtime have the same shape
//! (stream-ordered allocation from a pool, host callbacks on a stream,
//! events, a virtual-memory API of reserve / create / map / set access /
//! unmap / release, graph capture), and memgov drives both the same way.
//! What a vendor provides is a table ([`Vendor`]): its result codes
//! classified into the core's [`Class`], its names for messages (so an
//! error still names `cuMemMap` on CUDA and `hipMemMap` on HIP), and its
//! entry points under neutral names. The logic written over that table
//! lives here once:
//!
//! * [`state`]: what a context of any vendor holds: the device it opened,
//!   its [`state::State`] (id, shell, streams, sleep gate), which the
//!   vendor's shared state extends, and the parts of its public handles
//!   ([`state::Stream`], [`state::Block`]);
//! * [`open`]: opening a device (the count, none or an ordinal out of
//!   range refused, the handle, name, total memory and advisory identity)
//!   over the vendor's [`open::OpenTable`], the vendor's own steps in two
//!   hooks;
//! * [`table`]: the rest of the table, the vendor's entry points under
//!   neutral names ([`table::VmmTable`], [`table::CaptureTable`]) and the
//!   context they run in ([`table::Context`]);
//! * [`result`]: a driver result becoming a [`BackendError`] (kind, code,
//!   the driver's name for it, the way out), and [`Checked`], the
//!   [`shell::Driver`] of any vendor;
//! * [`arena`]: the virtual-memory arena's driver glue: one granule's
//!   create / map / set-access (each step undone on failure) and unmap /
//!   release, the sleep's page-locked copies on a stream of its own, the
//!   whole as a [`vmm::GranuleDriver`] and [`vmm::SleepDriver`] for the
//!   arena core in `memgov_backend::vmm`, and the public arena handle
//!   ([`arena::ArenaHandle`]: `CudaArena`, `HipArena`);
//! * [`memory`]: the checks before an allocation and a copy, and the
//!   blocking copy over the table's copy and synchronize calls;
//! * [`retire`]: stream-ordered retirement: a release's signal parked
//!   under a ticket, the vendor's callback routed back to its owner by
//!   number, the failed launch, device loss ([`retire::RetireTable`] is the
//!   vendor's one entry point);
//! * [`capture`]: stream capture: a capture under way carving its pool and
//!   recording copies, its end (the gate told only once the driver's
//!   capture is over), the graph it makes (launched, read, destroyed after
//!   every launch), and the context's pins, which teardown empties; the
//!   public [`capture::Capture`] and [`capture::Graph`] (`CudaCapture`,
//!   `HipGraph`, ...);
//! * [`stream`]: the context's streams ([`stream::Streams`]: live, lent by
//!   a runtime, retired), each checked on use, created, synchronized,
//!   ordered after another with an event ([`table::StreamTable`]), quiesced,
//!   and reaped once retired;
//! * [`pinned`]: page-locked host memory for the pinned tier, allocated
//!   mapped over [`pinned::PinnedTable`];
//! * [`pool`]: the context's own memory pool, created with its release
//!   threshold and trimmed and destroyed at teardown
//!   ([`pool::PoolTable`]);
//! * [`parts`]: a vendor context's parts (shared state, arena, capture
//!   pins) and what is read from them the same way on every vendor;
//! * [`teardown`]: teardown's steps that are the same on every vendor
//!   (the frees a direct caller left pending reported, every stream
//!   synchronized and destroyed, what a forced retire left freed on a
//!   stream of teardown's own over the vendor's
//!   [`teardown::TeardownTable`], a declared-lost context's streams polled
//!   until their work ran, what is left counted as gone without a call, the
//!   callbacks' routes forgotten, the first error kept); the order of the
//!   steps and the vendor's own ones stay with the vendor.
//!
//! The vendors' public types are aliases of the core's generic ones over
//! their shared state, so each is documented once, here.
//!
//! What really differs between the vendors stays in the vendor crates,
//! written beside their table: CUDA's primary context pushed and popped
//! around each call against HIP's per-thread current device; HIP's
//! `hipMalloc` fallback where the runtime has no memory pools and its
//! mapped host pointers; CUDA's adopted contexts; ROCm's two layouts of
//! `hipMemAllocationProp`.
//!
//! Why a crate of its own rather than modules of `memgov-backend`: that
//! crate is what *every* backend implements and uses (Vulkan and the
//! embedded host backend included), and knows nothing of streams that run
//! host callbacks or of a driver's result codes; this crate holds what only
//! the drivers of CUDA's shape share. It depends on `memgov-backend` alone,
//! and a third vendor of that shape plugs in by implementing its tables.
//!
//! Layers, each importing only those below it: [`result`] (the vendor and
//! its codes), then [`state`] (what a context holds), then [`open`] (a
//! device opened) and [`table`] (the entry points and the context) side by
//! side, then [`memory`] and [`retire`] side by side, then [`pinned`] (over
//! [`memory`]'s checks), then [`arena`] (whose releases [`retire`] settles)
//! and [`capture`] side by side (neither imports the other), then
//! [`stream`] (which drains through the arena's `drain`), then
//! [`teardown`], then [`pool`] (whose release is a teardown step), then
//! [`parts`] (a vendor context's parts, over all of
//! them).
//!
//! [`BackendError`]: memgov_backend::BackendError
//! [`shell::Driver`]: memgov_backend::shell::Driver
//! [`vmm::GranuleDriver`]: memgov_backend::vmm::GranuleDriver
//! [`vmm::SleepDriver`]: memgov_backend::vmm::SleepDriver

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod arena;
pub mod capture;
pub mod memory;
pub mod open;
pub mod parts;
pub mod pinned;
pub mod pool;
pub mod result;
pub mod retire;
pub mod state;
pub mod stream;
pub mod table;
pub mod teardown;

pub use result::{Checked, Class, Hints, Vendor};
