//! What a backend provides: the [`DeviceContext`] trait, the [`RetireSignal`]
//! a stream-ordered free fires when it has executed, and [`BackendError`].
//!
//! The trait is deliberately small and monomorphic (associated types, no
//! boxing; the wgpu-hal `Api` pattern). Everything about budgets, pins and
//! lifecycle lives in the governor; a backend only has to do what its driver
//! does, in stream order, and tell the truth about when a free has retired.

use std::fmt;

/// How a backend reached the device it drives. Reports and `memgov check`
/// print this so that nobody mistakes a stand-in for real hardware.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Execution {
    /// A physical GPU through its vendor driver.
    RealHardware,
    /// A software implementation of a real API (Mesa's lavapipe / llvmpipe).
    SoftwareDriver,
    /// A stand-in driver library that imitates a vendor driver on host threads.
    StandIn,
    /// memgov's own simulated device (the host backend).
    Embedded,
}

impl fmt::Display for Execution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::RealHardware => "real hardware",
            Self::SoftwareDriver => "software driver",
            Self::StandIn => "stand-in",
            Self::Embedded => "embedded",
        })
    }
}

/// What a context runs on. Captured once at registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceDescription {
    /// Backend name: `"host"`, `"cuda"`, `"hip"`, `"vulkan"`, ...
    pub backend: &'static str,
    /// Vendor as the driver reports it.
    pub vendor: String,
    /// Device name as the driver reports it.
    pub name: String,
    /// Index of the device within its backend.
    pub ordinal: u32,
    /// Total device memory the context can address, in bytes.
    pub total_bytes: u64,
    /// Driver and API versions, free text.
    pub driver: String,
    /// Real hardware, software driver, stand-in or embedded.
    pub execution: Execution,
    /// Whether memory freed stream-ordered on a stream can be reused at once by
    /// allocations ordered after it on the same stream (CUDA / HIP memory
    /// pools). When true, admission credits bytes pending on a stream to new
    /// allocations on that stream.
    pub stream_ordered_reuse: bool,
}

/// A level of memory a context allocates in, each governed under its own
/// limit.
///
/// * [`Device`](Self::Device): memory on the device (`cuMemAllocAsync`,
///   `hipMallocAsync`, a `DEVICE_LOCAL` Vulkan heap). What
///   [`DeviceContext::allocate`] returns.
/// * [`PinnedHost`](Self::PinnedHost): page-locked host memory the device
///   copies to and from without staging (`cuMemHostAlloc`, `hipHostMalloc`,
///   a `HOST_VISIBLE | HOST_COHERENT` Vulkan memory type). It takes no
///   device memory, but it is a scarce resource of its own: every pinned
///   byte is RAM the OS can neither page out nor give to anyone else.
///
/// Managed (unified) memory and disk are not tiers: see the "Tiers" section
/// of `docs/architecture.md` for what they would need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Tier {
    /// Device memory.
    Device,
    /// Page-locked (pinned) host memory.
    PinnedHost,
}

impl Tier {
    /// Every tier, in order.
    pub const ALL: [Tier; 2] = [Tier::Device, Tier::PinnedHost];

    /// Its name in reports, JSON and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Device => "device",
            Self::PinnedHost => "pinned-host",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Free and total device memory as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes the driver says are free now.
    pub free: u64,
    /// Bytes the device has in all.
    pub total: u64,
}

/// What kind of failure a backend reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendErrorKind {
    /// The device has no room for the request.
    OutOfMemory,
    /// The device or its context is lost; nothing queued on it will run.
    DeviceLost,
    /// The call was malformed (bad size, wrong stream, out of bounds).
    InvalidArgument,
    /// The backend cannot do this at all.
    Unsupported,
    /// The driver or device is not present on this machine.
    Unavailable,
    /// Anything else the driver reported.
    Other,
}

/// An error reported by a backend or its driver.
///
/// Carries the operation, the driver's own code where there is one, and
/// whether the device is lost: the governor marks a context lost by itself
/// when any backend call returns an error with [`BackendErrorKind::DeviceLost`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{backend} {operation} failed ({kind:?}{}): {message}", code.map(|c| format!(", driver code {c}")).unwrap_or_default())]
pub struct BackendError {
    /// Backend name, as in [`DeviceDescription::backend`].
    pub backend: &'static str,
    /// The trait operation that failed (`"allocate"`, `"free_async"`, ...).
    pub operation: &'static str,
    /// Classification.
    pub kind: BackendErrorKind,
    /// The driver's numeric result, where it has one.
    pub code: Option<i64>,
    /// Human-readable detail, with numbers.
    pub message: String,
}

impl BackendError {
    /// A new error.
    pub fn new(
        backend: &'static str,
        operation: &'static str,
        kind: BackendErrorKind,
        message: impl Into<String>,
    ) -> Self {
        Self {
            backend,
            operation,
            kind,
            code: None,
            message: message.into(),
        }
    }

    /// Attach the driver's result code.
    pub fn with_code(mut self, code: i64) -> Self {
        self.code = Some(code);
        self
    }

    /// Whether this error means the device (or its context) is lost.
    pub fn is_device_lost(&self) -> bool {
        self.kind == BackendErrorKind::DeviceLost
    }

    /// The error for driver call `call` that returned `code` (named `name`)
    /// during `op`, classified as `kind`. Every driver-code error reads the
    /// same way on every backend: `"{call} returned {name} ({code}){hint}"`,
    /// with the code attached; `hint` is empty or starts with `"; "` and says
    /// the way out.
    pub fn from_driver_call(
        backend: &'static str,
        op: &'static str,
        kind: BackendErrorKind,
        call: &str,
        name: &str,
        code: i64,
        hint: &str,
    ) -> Self {
        Self::new(
            backend,
            op,
            kind,
            format!("{call} returned {name} ({code}){hint}"),
        )
        .with_code(code)
    }
}

/// The error of a backend asked to allocate in a tier it does not have.
pub fn tier_unsupported(backend: &'static str, tier: Tier) -> BackendError {
    BackendError::new(
        backend,
        "allocate_in",
        BackendErrorKind::Unsupported,
        format!("the {backend} backend has no {tier} tier; allocate in the device tier instead"),
    )
}

/// The way out of a driver's out-of-memory code, as a driver-call hint.
pub const OUT_OF_MEMORY_HINT: &str = "; free memory (or lower the budget) and retry";

/// How a stream-ordered release ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetireOutcome {
    /// The free executed on the device.
    Retired,
    /// The signal was dropped without firing: the free never will execute
    /// (device lost, or the backend refused it after accepting it).
    Abandoned,
}

/// Receiver of a [`RetireSignal`]. Implemented by the governor's pending
/// release record and by closures.
pub trait RetireSink: Send {
    /// Called exactly once, with how the release ended.
    fn settle(self: Box<Self>, outcome: RetireOutcome);
}

struct FnSink<F>(F);

impl<F: FnOnce(RetireOutcome) + Send> RetireSink for FnSink<F> {
    fn settle(self: Box<Self>, outcome: RetireOutcome) {
        (self.0)(outcome)
    }
}

/// Fired exactly once when a stream-ordered free has executed on the device.
///
/// A backend receives one with every [`DeviceContext::free_async`] and must
/// either call [`RetireSignal::retire`] once the free has executed, or drop it
/// unfired if the free never will (device lost). Dropping it unfired is
/// reported to the governor as [`RetireOutcome::Abandoned`]; it is never
/// mistaken for a retirement.
///
/// Firing may happen on any thread, including a driver callback thread: the
/// governor's receiver only touches atomics and wakes waiters, takes no lock
/// that user code can hold, and never calls back into the backend.
#[must_use = "a RetireSignal must be fired when the free executes, or dropped if it never will"]
pub struct RetireSignal {
    sink: Option<Box<dyn RetireSink>>,
}

impl RetireSignal {
    /// A signal that settles `sink`: how a governor receives retirements.
    pub fn from_sink(sink: Box<dyn RetireSink>) -> Self {
        Self { sink: Some(sink) }
    }

    /// A signal that runs `f` when it settles. For backend tests and raw
    /// baselines that drive a backend without the governor.
    pub fn from_fn(f: impl FnOnce(RetireOutcome) + Send + 'static) -> Self {
        Self::from_sink(Box::new(FnSink(f)))
    }

    /// Drops the receiver without settling it: for a release the backend
    /// refused, which the governor that made the signal unwinds itself.
    pub fn defuse(self) {
        let mut this = std::mem::ManuallyDrop::new(self);
        // The sink's settle is never called; dropping the box only drops its
        // fields.
        drop(this.take_sink());
    }

    fn take_sink(&mut self) -> Option<Box<dyn RetireSink>> {
        self.sink.take()
    }

    /// The free has executed: report it. Consumes the signal, so it cannot
    /// fire twice.
    pub fn retire(mut self) {
        if let Some(sink) = self.sink.take() {
            sink.settle(RetireOutcome::Retired);
        }
    }
}

impl Drop for RetireSignal {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            sink.settle(RetireOutcome::Abandoned);
        }
    }
}

impl fmt::Debug for RetireSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetireSignal")
            .field("pending", &self.sink.is_some())
            .finish()
    }
}

/// A backend: one device context of one driver.
///
/// # Contract
///
/// * Every call may come from any thread; the governor never holds a lock
///   while calling in.
/// * Work on one stream executes in the order it was queued.
/// * [`free_async`](Self::free_async) queues the free behind all work already
///   on the stream and returns at once. The backend fires the `retired`
///   signal exactly once when the free has executed, or drops it unfired if it
///   never will. On refusal it hands the memory and the signal back.
/// * [`teardown`](Self::teardown) is called exactly once, after the governor
///   has observed every pin drop to zero: every release it queued has retired
///   (or, when `lost` is true, been given up), and every stream the governor
///   created has been destroyed — unless the context was force-retired, in
///   which case teardown must also destroy streams and free memory the
///   governor has abandoned (the `C::Stream` / `C::Memory` values the governor
///   still holds are dropped afterwards and must have no side effects).
/// * With `lost == true` the device is gone: teardown must not execute queued
///   frees, touch freed memory, or wait for the device; it drops any
///   `RetireSignal` it still holds.
/// * The governor only passes a context its own streams and memory, and
///   ranges inside the allocation; the trait's methods are safe, so a backend
///   still refuses, with [`BackendErrorKind::InvalidArgument`] and before any
///   driver call, a stream or memory of another context and a range past the
///   end of the allocation (`raw_misuse_is_refused` in the conformance suite),
///   handing back what a refused `free_async` took. Whatever a backend's
///   handles allow beyond the trait (rebuilding one from a raw value, say),
///   it checks too: a freed or destroyed driver object never reaches the
///   driver from safe code.
/// * A free is ordered only within its own stream. When memory was used on
///   other streams, the governor calls [`order_after`](Self::order_after)
///   for each before it queues the free.
///
/// # Tiers
///
/// [`allocate`](Self::allocate) allocates device memory;
/// [`allocate_in`](Self::allocate_in) allocates in any [`Tier`] the backend
/// has. The `Memory` it returns remembers its tier, so that `free_async`,
/// `write`, `read` and `teardown` treat it the way its tier needs. Every rule
/// above holds for every tier; in particular the free of pinned host memory
/// is stream-ordered exactly like a device free: it executes after every
/// copy queued on the stream before it (and, through `order_after`, on the
/// streams the governor named), and the `retired` signal fires only after
/// the host memory is back with the driver. A driver whose host free is
/// synchronous (`cuMemFreeHost`, `hipHostFree`) queues it behind the stream
/// (an event the backend waits for off the stream), never inside a stream
/// callback, where driver calls are forbidden; and teardown does not destroy
/// the context while such a free is outstanding.
pub trait DeviceContext: Send + Sync + Sized + 'static {
    /// A stream (queue) of ordered work.
    type Stream: Send + Sync;
    /// A raw allocation. Dropping it must have no side effects: only
    /// `free_async` or `teardown` release device memory.
    type Memory: Send + Sync;

    /// What this context runs on. Called once, at registration.
    fn describe(&self) -> DeviceDescription;

    /// Which physical device this context runs on, as every process and API
    /// on the machine names it (its UUID or PCI address where the driver
    /// reports them): the key of the machine ledger processes sharing the
    /// device join. The default names the device by backend, name and
    /// ordinal, which only a device that is the process's own (embedded, a
    /// stand-in) should rely on.
    fn identity(&self) -> crate::DeviceIdentity {
        let d = self.describe();
        crate::DeviceIdentity::named(d.backend, format!("{} {}", d.name, d.ordinal))
    }

    /// Free and total memory as the driver sees it now.
    fn memory_info(&self) -> Result<MemoryInfo, BackendError>;

    /// Create a stream.
    fn create_stream(&self) -> Result<Self::Stream, BackendError>;

    /// Destroy a stream. Work already queued on it still executes (and its
    /// signals still fire); the backend finishes it before or after returning.
    fn destroy_stream(&self, stream: Self::Stream) -> Result<(), BackendError>;

    /// Allocate `bytes` (> 0), usable by work queued on `stream` from now on.
    fn allocate(&self, stream: &Self::Stream, bytes: u64) -> Result<Self::Memory, BackendError>;

    /// Allocate `bytes` (> 0) in `tier`, usable by work queued on `stream`
    /// from now on. `Tier::Device` is [`allocate`](Self::allocate).
    ///
    /// The default has the device tier only, and refuses every other tier
    /// with [`BackendErrorKind::Unsupported`], naming it: a backend that has
    /// pinned host memory overrides this (every backend in this repository
    /// does).
    fn allocate_in(
        &self,
        stream: &Self::Stream,
        bytes: u64,
        tier: Tier,
    ) -> Result<Self::Memory, BackendError> {
        match tier {
            Tier::Device => self.allocate(stream, bytes),
            other => Err(tier_unsupported(self.describe().backend, other)),
        }
    }

    /// Queue the free of `memory` behind all work already on `stream`.
    ///
    /// On refusal the memory and the signal come back to the caller, who
    /// still owns them.
    #[allow(clippy::type_complexity)]
    fn free_async(
        &self,
        stream: &Self::Stream,
        memory: Self::Memory,
        retired: RetireSignal,
    ) -> Result<(), (Self::Memory, RetireSignal, BackendError)>;

    /// Copy `src` into `memory` at `offset`, ordered on `stream`. Returns when
    /// `src` may be reused.
    fn write(
        &self,
        stream: &Self::Stream,
        memory: &Self::Memory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError>;

    /// Copy from `memory` at `offset` into `dst`, ordered on `stream`. Returns
    /// when `dst` holds the data.
    fn read(
        &self,
        stream: &Self::Stream,
        memory: &Self::Memory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError>;

    /// Block until all work queued on `stream` has executed (and the signals
    /// of frees on it have fired).
    fn synchronize(&self, stream: &Self::Stream) -> Result<(), BackendError>;

    /// Order every operation queued on `stream` from now on after every
    /// operation already queued on `after` (both streams of this context).
    ///
    /// The governor calls this before it queues a free on a stream other than
    /// the one the memory was allocated on, or that the memory was recorded
    /// as used on: a stream-ordered free is ordered only within its own
    /// stream, so without this the free (and, with pool reuse, the next
    /// allocation on `stream`) could overtake work still queued on `after`.
    /// It returns without waiting for the device: CUDA records an event on
    /// `after` and makes `stream` wait on it (`cuEventRecord` +
    /// `cuStreamWaitEvent`), HIP the same with `hipEventRecord` +
    /// `hipStreamWaitEvent`.
    ///
    /// The default blocks until `after` has drained ([`synchronize`](Self::synchronize)),
    /// which is correct for every backend and slow; backends with events or
    /// semaphores override it. Called with `stream` and `after` distinct.
    /// The default never looks at `stream`, so a backend that keeps it
    /// accepts another context's `stream` here, which the contract's misuse rule (and the
    /// suite's `raw_misuse_is_refused`) forbids. Override it to refuse both
    /// streams with [`BackendErrorKind::InvalidArgument`] before ordering.
    fn order_after(&self, stream: &Self::Stream, after: &Self::Stream) -> Result<(), BackendError> {
        let _ = stream;
        self.synchronize(after)
    }

    /// The governor has declared the device lost. Stop executing queued work;
    /// signals of frees that will never run may be dropped from now on.
    /// Called at most once, before `teardown(lost = true)`.
    fn device_lost(&self) {}

    /// Destroy the context. Called exactly once, after every pin is gone.
    fn teardown(self, lost: bool) -> Result<(), BackendError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[test]
    fn signal_fires_once_and_drop_is_abandonment() {
        let retired = Arc::new(AtomicU32::new(0));
        let abandoned = Arc::new(AtomicU32::new(0));
        let mk = || {
            let (r, a) = (retired.clone(), abandoned.clone());
            RetireSignal::from_fn(move |o| {
                match o {
                    RetireOutcome::Retired => r.fetch_add(1, Ordering::SeqCst),
                    RetireOutcome::Abandoned => a.fetch_add(1, Ordering::SeqCst),
                };
            })
        };
        mk().retire();
        drop(mk());
        assert_eq!(retired.load(Ordering::SeqCst), 1);
        assert_eq!(abandoned.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_missing_tier_is_unsupported_and_named() {
        assert_eq!(Tier::PinnedHost.to_string(), "pinned-host");
        let e = tier_unsupported("acme", Tier::PinnedHost);
        assert_eq!(
            (e.kind, e.operation, e.backend),
            (BackendErrorKind::Unsupported, "allocate_in", "acme")
        );
        assert_eq!(
            e.to_string(),
            "acme allocate_in failed (Unsupported): the acme backend has no pinned-host tier; \
             allocate in the device tier instead"
        );
    }

    #[test]
    fn error_message_carries_code_and_kind() {
        let e = BackendError::new(
            "cuda",
            "allocate",
            BackendErrorKind::OutOfMemory,
            "asked 4096 B, 0 B free",
        )
        .with_code(2);
        assert_eq!(
            e.to_string(),
            "cuda allocate failed (OutOfMemory, driver code 2): asked 4096 B, 0 B free"
        );
        assert!(!e.is_device_lost());
    }
}
