//! The caller's handle on one registered context.

use super::admission::{admit, admit_in};
use super::buffer::DeviceBuffer;
use super::error::{ContextName, ContextOperation, GovernorError};
use super::pin_source::{ContextPin, PinSource};
use super::pressure::PressureRequest;
use super::record::sites::Names;
use super::record::ContextInner;
use super::report::TeardownReport;
use super::request::{Alloc, Reserve};
use super::reservation::Reservation;
use super::retire::RetireHandle;
use super::role::Role;
use super::snapshot::{ContextSnapshot, ContextState};
use super::stream::GovernedStream;
use super::view::{lifecycle, snapshot};
use crate::sync::lock;
use crate::trace::EventKind;
use crate::{
    DeviceContext, DeviceDescription, MemoryInfo, ProviderContextIdentity, ProviderContextPinError,
    ProviderContextPinSource, Tier,
};
use std::fmt;
use std::panic::Location;
use std::sync::Arc;

/// A registered context. Cheap to clone; holding one does **not** pin the
/// context (retire is never blocked by a handle).
pub struct ContextHandle<C: DeviceContext> {
    pub(crate) inner: Arc<ContextInner<C>>,
}

impl<C: DeviceContext> Clone for ContextHandle<C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<C: DeviceContext> fmt::Debug for ContextHandle<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextHandle")
            .field("id", &self.inner.id)
            .field("label", &self.inner.label())
            .field("lifecycle", &self.lifecycle())
            .finish()
    }
}

impl<C: DeviceContext> ContextHandle<C> {
    /// The context's identity.
    pub fn id(&self) -> ProviderContextIdentity {
        self.inner.id
    }

    /// The label given at registration (or `backend:ordinal`).
    pub fn label(&self) -> &str {
        self.inner.label()
    }

    /// What the backend said it runs on, at registration.
    pub fn description(&self) -> &DeviceDescription {
        &self.inner.description
    }

    /// Where the context is in its life.
    pub fn lifecycle(&self) -> ContextState {
        lifecycle(&self.inner)
    }

    /// The context as errors name it: identity and label.
    pub fn name(&self) -> ContextName {
        self.inner.name()
    }

    /// Free and total memory as the driver reports it now.
    pub fn memory_info(&self) -> Result<MemoryInfo, GovernorError> {
        let ctx = &*self.inner;
        let backend = ctx
            .enter()
            .ok_or_else(|| ctx.pin_error(ProviderContextPinError::ContextUnavailable(ctx.id)))?;
        backend.memory_info().map_err(|e| {
            drop(backend);
            ctx.backend_failure(e)
        })
    }

    /// Create a stream. It pins the context until it (and every buffer
    /// allocated on it) is dropped.
    pub fn create_stream(
        &self,
        label: impl Into<String>,
    ) -> Result<GovernedStream<C>, GovernorError> {
        GovernedStream::create(&self.inner, label.into())
    }

    /// Allocate what `alloc` asks for (its bytes, for its role, in its tier:
    /// the device unless [`Alloc::tier`] says otherwise), usable on
    /// `stream`, under the context's budgets and admission policy.
    ///
    /// ```
    /// use memgov::{Alloc, Governor, ContextConfig, Role, host::{HostContext, HostConfig}};
    /// let gov = Governor::new();
    /// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().budget(1 << 20));
    /// let stream = ctx.create_stream("main")?;
    /// let buf = ctx.allocate(&stream, Alloc::new(4096, Role::Activation))?;
    /// buf.write(0, b"hello")?;
    /// drop(buf); // queued stream-ordered; its pin retires with the free
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// A buffer in any tier is governed the same way: born pinned, released
    /// stream-ordered on its stream (after every copy queued there before
    /// the release, and after the streams it was recorded on), its pin held
    /// until the free has executed, so teardown waits for it. Only the
    /// budget differs: pinned host bytes are charged to the tier's budget
    /// ([`ContextConfig::tier_budget`](super::ContextConfig::tier_budget)),
    /// never to the device budget or a shared one. A refusal names the tier
    /// ([`BudgetScope::Tier`](super::BudgetScope::Tier)).
    ///
    /// ```
    /// use memgov::{Alloc, ContextConfig, Governor, Role, Tier, host::{HostContext, HostConfig}};
    /// let gov = Governor::new();
    /// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new());
    /// let stream = ctx.create_stream("copy")?;
    /// let staging = ctx.allocate(&stream, Alloc::new(4096, Role::Other).tier(Tier::PinnedHost))?;
    /// staging.write(0, b"batch")?;
    /// let mut back = [0u8; 5];
    /// staging.read(0, &mut back)?;
    /// assert_eq!(&back, b"batch");
    /// drop(staging); // freed after the copies queued before it, like device memory
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`GovernorError::ZeroSized`], [`GovernorError::WrongContext`],
    /// [`GovernorError::Pin`] (retiring, or too many pins),
    /// [`GovernorError::DeviceLost`], [`GovernorError::BudgetExceeded`] with
    /// every number, or [`GovernorError::Backend`] (with
    /// [`BackendErrorKind::Unsupported`](crate::BackendErrorKind::Unsupported)
    /// from a backend without the tier).
    ///
    /// With attribution on ([`ContextConfig::attribution`](super::ContextConfig::attribution)),
    /// the buffer is counted at the caller's line (`#[track_caller]`) and
    /// under [`Alloc::label`].
    #[inline]
    #[track_caller]
    pub fn allocate(
        &self,
        stream: &GovernedStream<C>,
        alloc: Alloc,
    ) -> Result<DeviceBuffer<C>, GovernorError> {
        self.allocate_at(stream, alloc, Location::caller())
    }

    /// [`allocate`](Self::allocate), counted at `site` instead of the
    /// caller's line (for a layer that names its own callers' sites).
    #[inline]
    pub(crate) fn allocate_at(
        &self,
        stream: &GovernedStream<C>,
        alloc: Alloc,
        site: &'static Location<'static>,
    ) -> Result<DeviceBuffer<C>, GovernorError> {
        match alloc.tier {
            None | Some(Tier::Device) => self.allocate_tiered(stream, alloc, Tier::Device, site),
            Some(tier) => self.allocate_tiered(stream, alloc, tier, site),
        }
    }

    /// The body of [`allocate`](Self::allocate): inlined into each arm of
    /// its tier match, so that the device path's tier tests fold away.
    #[inline(always)]
    fn allocate_tiered(
        &self,
        stream: &GovernedStream<C>,
        alloc: Alloc,
        tier: Tier,
        site: &'static Location<'static>,
    ) -> Result<DeviceBuffer<C>, GovernorError> {
        let (bytes, role) = (alloc.bytes, alloc.role);
        let ctx = &self.inner;
        if !Arc::ptr_eq(&stream.shared.ctx, ctx) {
            return Err(GovernorError::wrong_context(
                ContextOperation::Allocate,
                ctx.name(),
                stream,
            ));
        }
        if bytes == 0 {
            return Err(GovernorError::ZeroSized {
                context: ctx.name(),
                role,
            });
        }
        // With the cache on, in the device tier (the only one it keeps):
        // the request's size class, and a block of that class freed on this
        // stream, if one is kept (it brings its pin and its charge).
        let len = bytes;
        let bytes = if tier == Tier::Device {
            let bytes = ctx.cache.round(bytes);
            if let Some(memory) = super::cache::hit(ctx, &stream.shared, bytes, role) {
                let site = ctx
                    .sites
                    .as_ref()
                    .map_or(0, |s| s.admit(site, alloc.names(), bytes));
                // The stream's tag is set only on a traced context.
                if stream.shared.trace_tag != 0 {
                    let tag = stream.shared.trace_tag;
                    ctx.trace_event_at(tag, Some(role), EventKind::Reused, bytes, None, site);
                }
                return Ok(DeviceBuffer {
                    stream: stream.shared.clone(),
                    memory: Some(memory),
                    bytes,
                    len,
                    role,
                    tier,
                    recorded: None,
                    site,
                });
            }
            bytes
        } else {
            bytes
        };
        // Born pinned: the pin is taken before anything is charged. The guard
        // releases it on every failure path below, and when a pressure
        // responder or the backend panics inside `admit`: the panic reaches
        // our caller and the context stays governable.
        let tag = stream.shared.trace_tag;
        let pin = match ContextPin::acquire_on(ctx, stream.shared.shard) {
            Ok(pin) => pin,
            Err(e) => {
                let e = ctx.pin_error(e);
                return Err(refused(ctx, tag, role, bytes, e, site, alloc.names()));
            }
        };
        // Counted live inside `admit`; `allocations` is derived.
        let admitted = if tier == Tier::Device {
            admit(ctx, &stream.shared, bytes, role)
        } else {
            admit_in(ctx, &stream.shared, bytes, role, tier)
        };
        let memory = match admitted {
            Ok(memory) => memory,
            Err(e) => {
                // The pin goes first: the refusal hook may retire the
                // context and wait for it.
                drop(pin);
                return Err(refused(ctx, tag, role, bytes, e, site, alloc.names()));
            }
        };
        let site = ctx
            .sites
            .as_ref()
            .map_or(0, |s| s.admit(site, alloc.names(), bytes));
        // The stream's tag is set only on a traced context.
        if stream.shared.trace_tag != 0 {
            let tag = stream.shared.trace_tag;
            ctx.trace_event_at(tag, Some(role), EventKind::Allocated, bytes, None, site);
        }
        pin.transfer();
        Ok(DeviceBuffer {
            stream: stream.shared.clone(),
            memory: Some(memory),
            bytes,
            len,
            role,
            tier,
            recorded: None,
            site,
        })
    }

    /// Reserve what `reserve` asks for (its bytes, in its tier: the device
    /// unless [`Reserve::tier`] says otherwise) under the context's budgets
    /// (and its shared budget) now, for allocations made later out of the reservation
    /// ([`Reservation::allocate`]) without being charged again. The
    /// reservation holds only its unused bytes: an allocation moves its bytes
    /// to the buffer, whose release returns them to the budgets; dropping
    /// the reservation returns what is left, once. It holds a pin like a
    /// buffer, so `retire().wait` waits for it to be dropped; `force`
    /// reclaims buffers and streams but still waits for reservations (they
    /// hold budget, not device memory). Refused at once when the budgets
    /// have no room (no wait, no responders). Snapshots list live
    /// reservations by label, and a refusal names the largest ones.
    ///
    /// ```
    /// use memgov::{Alloc, Governor, ContextConfig, Reserve, Role, host::{HostContext, HostConfig}};
    /// let gov = Governor::new();
    /// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().budget(1 << 20));
    /// let stream = ctx.create_stream("main")?;
    /// let request = ctx.reserve(Reserve::new(64 << 10, "request-17"))?;
    /// let kv = request.allocate(&stream, Alloc::new(16 << 10, Role::KvCache))?;
    /// assert_eq!(request.left(), 48 << 10);
    /// // Over what is left: refused, the reservation unchanged.
    /// assert!(request.allocate(&stream, Alloc::new(64 << 10, Role::KvCache)).is_err());
    /// drop((kv, request)); // the unused 48 KiB go back to the budget now
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// In a tier, the bytes are charged to the tier's budget, and
    /// allocations out of the reservation are made in that tier (pinned
    /// host staging for a request's offloaded KV cache, say):
    ///
    /// ```
    /// use memgov::{Alloc, ContextConfig, Governor, Reserve, Role, Tier, host::{HostConfig, HostContext}};
    /// let gov = Governor::new();
    /// let ctx = gov.register(
    ///     HostContext::new(HostConfig::default())?,
    ///     ContextConfig::new().tier_budget(Tier::PinnedHost, 1 << 20),
    /// );
    /// let stream = ctx.create_stream("offload")?;
    /// let staging = ctx.reserve(Reserve::new(256 << 10, "request-17 offload").tier(Tier::PinnedHost))?;
    /// let block = staging.allocate(&stream, Alloc::new(64 << 10, Role::KvCache))?;
    /// assert_eq!(block.tier(), Tier::PinnedHost);
    /// assert_eq!(ctx.snapshot().tier(Tier::PinnedHost).unwrap().live_bytes, 64 << 10);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`GovernorError::ZeroSized`], [`GovernorError::Pin`] (retiring, or
    /// too many pins), [`GovernorError::BudgetExceeded`] with every number
    /// (the tier's, when its budget refuses).
    pub fn reserve(&self, reserve: Reserve<'_>) -> Result<Reservation<C>, GovernorError> {
        Reservation::new(&self.inner, reserve.tier, reserve.bytes, reserve.label).map_err(
            |mut e| {
                if let GovernorError::BudgetExceeded(refusal) = &mut e {
                    super::view::explain(&self.inner, refusal);
                }
                e
            },
        )
    }

    /// A borrowed pin: the cheapest way to hold the context across a piece of
    /// work queued from code that has the handle.
    #[inline]
    pub fn pin(&self) -> Result<ContextPin<'_, C>, ProviderContextPinError> {
        self.inner.acquire_pin()?;
        Ok(ContextPin {
            ctx: &self.inner,
            shard: super::shards::GLOBAL,
        })
    }

    /// A source of owned pins for an external holder (plugin, execution
    /// provider). The label appears in snapshots and in retire timeouts.
    pub fn pin_source(&self, holder: Option<&str>) -> Arc<dyn ProviderContextPinSource> {
        Arc::new(PinSource::new(&self.inner, holder.map(str::to_owned)))
    }

    /// Register a callback asked to give memory back when an allocation does
    /// not fit, asked in `priority` order: lowest first
    /// ([`DEFAULT_PRESSURE_PRIORITY`](super::DEFAULT_PRESSURE_PRIORITY) when
    /// the order does not matter). Called with no lock held, on the
    /// allocating thread.
    ///
    /// An allocation refused by this context's own budget asks this
    /// context's responders. One refused by a shared level (the device's
    /// [`SharedBudget`](super::SharedBudget), the
    /// [`ProcessBudget`](super::ProcessBudget) above it, or the device's
    /// memory) asks the responders of every context under that level,
    /// lowest priority first (the requester's own first among equals),
    /// retrying after each: it stops as soon as the allocation fits, so a
    /// higher priority is not asked when a lower one freed enough. What a
    /// responder frees on a budget level is kept for the requester (see
    /// `docs/architecture.md`, "Budget tree"). Rounds repeat, at most three,
    /// while a round freed something.
    ///
    /// ```
    /// use memgov::{Alloc, Governor, ContextConfig, Role, SharedBudget, host::{HostConfig, HostContext}};
    /// let gpu0 = SharedBudget::new("gpu0", 2 << 20);
    /// let gov = Governor::new();
    /// let batch = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().shared_budget(gpu0.clone()));
    /// let online = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().shared_budget(gpu0));
    /// let s = batch.create_stream("s")?;
    /// let cache = std::sync::Mutex::new(Some(batch.allocate(&s, Alloc::new(2 << 20, Role::KvCache))?));
    /// // The batch context's cache goes first when the device is short.
    /// batch.add_pressure_responder(0, move |_| {
    ///     let freed = cache.lock().unwrap().take().map_or(0, |b| b.len());
    ///     s.synchronize().unwrap();
    ///     freed
    /// });
    /// let t = online.create_stream("t")?;
    /// let _b = online.allocate(&t, Alloc::new(1 << 20, Role::Activation))?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn add_pressure_responder(
        &self,
        priority: u32,
        responder: impl Fn(&PressureRequest) -> u64 + Send + Sync + 'static,
    ) {
        lock(&self.inner.responders).push(super::pressure::RegisteredResponder {
            priority,
            responder: Arc::new(responder),
        });
    }

    /// Change the limit of `tier` (`Tier::Device`: the context's budget,
    /// [`ContextConfig::budget`](super::ContextConfig::budget)). Allocations
    /// already charged stay.
    pub fn set_budget(&self, tier: Tier, bytes: u64) {
        self.inner.ledger.charges().set_tier_limit(tier, bytes);
    }

    /// Declare the device lost: new work is refused, pending releases are
    /// settled without calling the device, and teardown will not touch it.
    /// Returns false if it was already lost.
    pub fn mark_lost(&self, reason: &str) -> bool {
        self.inner.mark_lost(reason)
    }

    /// Start retiring: new pins, streams and allocations fail with
    /// `ContextUnavailable` from now on; existing holders finish. The handle
    /// waits for them and tears down.
    pub fn retire(&self) -> RetireHandle<C> {
        RetireHandle::new(&self.inner)
    }

    /// How the context's teardown ended, once it has: the same report
    /// [`RetireHandle::wait`] returns, also when the teardown ran in the
    /// background (nobody waiting) or on `Governor` drop.
    pub fn teardown_report(&self) -> Option<TeardownReport> {
        self.inner.teardown_report()
    }

    /// Free up to `bytes` (at least that many when the cache holds them) of
    /// the blocks the cache keeps, largest first over every stream,
    /// stream-ordered like any release: they become pending and the budget
    /// gets them back when the frees retire. Returns the bytes released (0
    /// when the cache is off or empty). `u64::MAX` empties the cache.
    ///
    /// See [`ContextConfig::cache`](super::ContextConfig::cache).
    pub fn trim_cache(&self, bytes: u64) -> u64 {
        super::cache::trim_on_demand(&self.inner, bytes)
    }

    /// A point-in-time view of this context.
    pub fn snapshot(&self) -> ContextSnapshot {
        snapshot(&self.inner)
    }

    /// Check that this context's books balance: for each tier, the bytes
    /// charged to its budget are exactly the live (cached blocks included),
    /// pending, quarantined, awaiting-teardown, reserved and outside bytes,
    /// less those whose memory sleeps. Teardown checks the same identity
    /// itself; this is for a runtime's own tests and for chasing a leak.
    ///
    /// Exact on a quiet context only: an allocation, release or settlement
    /// running at the same moment may be half-seen and reported as an
    /// [`Imbalance`](super::Imbalance). On a quiet context an `Err` is a
    /// memgov bug, and its message names every term.
    ///
    /// ```
    /// use memgov::{Alloc, ContextConfig, Governor, Role, host::{HostConfig, HostContext}};
    ///
    /// let gov = Governor::new();
    /// let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().budget(1 << 20));
    /// let stream = ctx.create_stream("s")?;
    /// let kv = ctx.allocate(&stream, Alloc::new(4096, Role::KvCache))?;
    /// let _outside = ctx.report_outside(512);
    /// ctx.check_books()?;
    /// # drop(kv);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_books(&self) -> Result<(), super::Imbalance> {
        let reservations = &self.inner.reservations;
        self.inner
            .ledger
            .audit(|tier| reservations.left_in(tier))
            .map_err(|e| e.of(self.inner.name().to_string()))
    }
}

/// A refused allocation: traced, counted at its site, and, when a budget
/// refused, told who holds the memory
/// ([`BudgetExceeded::holders`](super::BudgetExceeded::holders)).
#[cold]
#[inline(never)]
pub(crate) fn refused<C: DeviceContext>(
    ctx: &ContextInner<C>,
    tag: u32,
    role: Role,
    bytes: u64,
    e: GovernorError,
    site: &'static Location<'static>,
    names: Names,
) -> GovernorError {
    let site = ctx.sites.as_ref().map_or(0, |s| s.refused(site, names));
    let mut e = ctx.trace_refused(tag, role, bytes, e, site);
    if let GovernorError::BudgetExceeded(refusal) = &mut e {
        super::view::explain(ctx, refusal);
    }
    e
}
