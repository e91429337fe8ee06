//! Sleep and wake: live buffers whose memory the backend gives back while
//! their addresses (and the buffers) stay the caller's, accounted by the
//! governor.
//!
//! A backend that can release a context's physical memory and map it again
//! at the same addresses (the CUDA backend's virtual-memory arena,
//! `CudaArena::sleep` / `wake`) does the device side; the governor does the
//! books around it, whatever the backend:
//!
//! * [`ContextHandle::sleep_with`] empties the context's block cache, runs
//!   the backend's sleep under a gate claim (with no lock held), then
//!   *suspends* the device-tier bytes of the live buffers of the given
//!   roles: they come off every level of the budget tree (the context's
//!   budget, its shared budget, the process budget, the machine ledger), so
//!   other contexts can be admitted into them, while the buffers stay live.
//! * [`ContextHandle::wake_with`] admits the suspended bytes of the given
//!   roles (every sleeping role when none is given) back through every
//!   level exactly as an allocation of that size is admitted (block caches,
//!   [`Admission`](super::Admission)'s wait or refuse, pressure
//!   responders); only once they fit does it run the backend's wake. A
//!   wake that does not fit is a [`GovernorError::BudgetExceeded`] naming
//!   the level and its numbers, with nothing changed: the roles still
//!   sleep and may be woken later. If the backend's wake fails, the
//!   admission is given back and the roles stay asleep.
//!
//! Sleep is kept role by role: roles put to sleep together may wake apart
//! (vLLM's pattern: wake the weights, reload them, then wake the KV
//! cache), and a role may be put to sleep while others sleep. A role
//! sleeps from the sleep that named it to the wake that names it (or
//! names none); the context is [`SleepState::Asleep`] while any does, and
//! snapshots say which ([`RoleUsage::asleep`](super::RoleUsage::asleep)).
//!
//! # Invariants
//!
//! * One sleep or wake runs at a time per context: one state word holds the
//!   roles asleep and the step running, changed by compare and swap; a call
//!   that finds a step running, a role it would sleep asleep already or a
//!   role it would wake awake is a typed [`GovernorError::Sleep`] with
//!   nothing done. A failed or panicking step puts the roles back as they
//!   were.
//! * The backend call and the suspension (or the resumption) happen under
//!   one gate claim: `force` and teardown, which close the gate, see the
//!   buffers either before or after their bytes moved, never half-way.
//! * The books' side is kept in `ledger/charges.rs`: the suspended amounts, and
//!   the identity that charged is live, pending, quarantined, awaiting
//!   teardown, reserved, cached and outside bytes less those on no level.
//!   A buffer that leaves live while asleep (released, quarantined, lost,
//!   reclaimed) takes its bytes out of the suspended amount as it goes and
//!   carries only the rest onward, so a release, a teardown or a loss while
//!   asleep gives back nothing twice and leaves nothing charged.
//!
//! # Allocation while asleep
//!
//! A sleeping context still admits allocations, of any role: they are
//! charged like any other (the suspended bytes are not theirs), and the
//! backend decides whether it can serve them (a CUDA arena asleep whole
//! refuses them; with a set asleep it maps fresh granules, never the
//! sleeping ones). Copies to and from sleeping memory are the backend's to
//! refuse (the arenas refuse them as asleep). A wake admits only what is
//! still suspended.

use super::admission::{admit_resume, reserve_refused};
use super::error::GovernorError;
use super::handle::ContextHandle;
use super::ledger::RefusedAt;
use super::record::sleep::{Refused, RoleSet, SleepWord};
use super::record::ContextInner;
use super::role::Role;
use super::snapshot::SleepState;
use super::units::Bytes;
use crate::backend::vmm::{with_host_copy_budget, HostCopyBudget};
use crate::trace::EventKind;
use crate::{BackendError, BackendErrorKind, DeviceContext, Tier};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

/// What a [`sleep_with`](ContextHandle::sleep_with) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slept<R> {
    /// Device-tier bytes of live buffers taken off every budget level.
    pub suspended: u64,
    /// Those bytes by role, indexed like [`Role::ALL`] (0 for a role not
    /// put to sleep).
    pub by_role: [u64; 5],
    /// What the backend's sleep returned.
    pub backend: R,
}

/// What a [`wake_with`](ContextHandle::wake_with) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Woken<R> {
    /// Bytes admitted back onto every budget level.
    pub resumed: u64,
    /// Those bytes by role, indexed like [`Role::ALL`] (0 for a role not
    /// woken).
    pub by_role: [u64; 5],
    /// What the backend's wake returned.
    pub backend: R,
}

/// A step in progress: ends it with the roles asleep before it, `back`,
/// when dropped (an error or a panic), unless [`done`](Self::done) ended it
/// with the roles asleep after it.
struct Step<'a> {
    word: &'a SleepWord,
    back: RoleSet,
}

impl Step<'_> {
    fn done(self, asleep: RoleSet) {
        self.word.end(asleep);
        std::mem::forget(self);
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        self.word.end(self.back);
    }
}

/// Bytes a wake admitted and has not handed to the suspended amounts yet:
/// given back to every level when dropped (the wake failed or panicked).
struct Admitted<'a, C: DeviceContext> {
    ctx: &'a ContextInner<C>,
    by_role: [u64; 5],
}

impl<C: DeviceContext> Drop for Admitted<'_, C> {
    fn drop(&mut self) {
        let bytes: u64 = self.by_role.iter().sum();
        if bytes > 0 {
            self.ctx.ledger.give_back(bytes);
        }
    }
}

/// The context's pinned host tier as the budget of the page-locked host
/// copies a backend's sleep makes (and its wake frees) on the thread
/// running the sleep or wake (see `memgov_backend::vmm::HostCopyBudget`).
struct HostCopies<C: DeviceContext> {
    ctx: Arc<ContextInner<C>>,
    /// A charge the tier refused, and its size: the sleep's error.
    refused: Cell<Option<(RefusedAt, u64)>>,
}

impl<C: DeviceContext> HostCopies<C> {
    fn new(ctx: &Arc<ContextInner<C>>) -> Rc<Self> {
        Rc::new(Self {
            ctx: ctx.clone(),
            refused: Cell::new(None),
        })
    }

    /// Run the backend's call `f` with the copies charged here.
    fn around<R>(self: &Rc<Self>, f: impl FnOnce() -> R) -> R {
        with_host_copy_budget(self.clone(), f)
    }

    /// The typed refusal of a charge the tier refused while `f` ran.
    fn refusal(&self) -> Option<super::GovernorError> {
        let (refused, bytes) = self.refused.take()?;
        Some(reserve_refused(&self.ctx, refused, bytes))
    }
}

impl<C: DeviceContext> HostCopyBudget for HostCopies<C> {
    fn charge(&self, bytes: u64) -> Result<(), BackendError> {
        let refused = match self.ctx.ledger.charge_sleep_copies(bytes) {
            Ok(()) => return Ok(()),
            Err(r) => r,
        };
        let (charged, limit) = match &refused {
            RefusedAt::Tier(_, r) => (r.charged, r.limit),
            _ => (0, 0),
        };
        self.refused.set(Some((refused, bytes)));
        Err(BackendError::new(
            self.ctx.description.backend,
            "sleep",
            BackendErrorKind::OutOfMemory,
            format!(
                "keeping the contents needs {} of page-locked host memory, but the context's {} \
                 tier holds {} of its {} limit; nothing was put to sleep (raise \
                 ContextConfig::tier_budget(Tier::PinnedHost, ..), free pinned host buffers, or \
                 sleep without keeping the contents)",
                Bytes(bytes),
                Tier::PinnedHost,
                Bytes(charged),
                Bytes(limit)
            ),
        ))
    }

    fn give_back(&self, bytes: u64) {
        self.ctx.ledger.return_sleep_copies(bytes);
    }
}

impl<C: DeviceContext> ContextHandle<C> {
    /// Put the live buffers of `roles` (every role when empty) to sleep:
    /// empty the block cache ([`trim_cache`](Self::trim_cache)), run the
    /// backend's sleep `f` under a gate claim with no lock held, then take
    /// the device-tier bytes of those buffers off every budget level. The
    /// buffers stay live and keep their addresses; other contexts under the
    /// same [`SharedBudget`](super::SharedBudget) or
    /// [`ProcessBudget`](super::ProcessBudget) can be admitted into the
    /// room. Pinned host buffers are not suspended (their memory is not the
    /// device's).
    ///
    /// The page-locked host memory the backend's sleep fills with the
    /// contents it keeps (the CUDA and HIP arenas' `sleep(true)`,
    /// `sleep_ranges(.., true)`) is charged to the context's pinned host
    /// tier ([`ContextConfig::tier_budget`](super::ContextConfig::tier_budget)),
    /// before the first copy is made; snapshots show it
    /// ([`TierUsage::sleep_copies`](super::TierUsage::sleep_copies)) until
    /// the wake ([`wake_with`](Self::wake_with)) that frees it gives it
    /// back. A sleep whose copies the tier cannot hold is refused with
    /// nothing released. Only copies made on the thread running `f` are
    /// charged (the arenas' sleep and wake run there); a wake made outside
    /// [`wake_with`](Self::wake_with) leaves the charge until teardown.
    ///
    /// Call it with no allocation or release of those roles in flight on
    /// other threads: the bytes suspended are the roles' live bytes once the
    /// backend's sleep returned.
    ///
    /// # Errors
    ///
    /// [`GovernorError::BudgetExceeded`] (of the pinned host tier) when the
    /// host copies of the contents kept do not fit, with nothing put to
    /// sleep; [`GovernorError::Sleep`] when a role named sleeps already
    /// (the error names it) or another sleep or wake is running; the error
    /// a retiring
    /// or lost context gives ([`GovernorError::Pin`],
    /// [`GovernorError::DeviceLost`]); [`GovernorError::Backend`] when `f`
    /// fails. In every case nothing is suspended and the roles named stay
    /// awake.
    ///
    /// # Example
    ///
    /// The host backend has no memory to release: the closure does
    /// nothing, and the example shows the accounting. (With the CUDA
    /// arena, `f` is `|cuda| cuda.arena().expect("arena").sleep(true)`.)
    ///
    /// ```
    /// use memgov::{Alloc, ContextConfig, Governor, Role, SharedBudget, SleepState};
    /// use memgov::host::{HostConfig, HostContext};
    ///
    /// let device = SharedBudget::new("gpu0", 64 << 20);
    /// let gov = Governor::new();
    /// let host = || HostContext::new(HostConfig::default());
    /// let llm = gov.register(host()?, ContextConfig::new().label("llm").shared_budget(device.clone()));
    /// let other = gov.register(host()?, ContextConfig::new().label("embed").shared_budget(device.clone()));
    /// let stream = llm.create_stream("decode")?;
    /// let weights = llm.allocate(&stream, Alloc::new(48 << 20, Role::Weights))?;
    ///
    /// let slept = llm.sleep_with(&[], |_host| Ok(()))?;
    /// assert_eq!(slept.suspended, 48 << 20);
    /// assert_eq!(llm.sleep_state(), SleepState::Asleep);
    /// assert_eq!(device.charged(), 0, "the sleeping bytes are on no budget");
    ///
    /// // Another context uses the room while the model sleeps.
    /// let ostream = other.create_stream("embed")?;
    /// let scratch = other.allocate(&ostream, Alloc::new(32 << 20, Role::Workspace))?;
    /// // Waking needs the room back: refused, with nothing changed.
    /// let refused = llm.wake_with(&[], |_host| Ok(())).unwrap_err();
    /// assert!(refused.budget().is_some());
    /// assert_eq!(llm.sleep_state(), SleepState::Asleep);
    ///
    /// drop(scratch);
    /// ostream.synchronize()?;
    /// let woken = llm.wake_with(&[], |_host| Ok(()))?;
    /// assert_eq!(woken.resumed, 48 << 20);
    /// assert_eq!(device.charged(), 48 << 20);
    /// drop(weights);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn sleep_with<R>(
        &self,
        roles: &[Role],
        f: impl FnOnce(&C) -> Result<R, BackendError>,
    ) -> Result<Slept<R>, GovernorError> {
        let ctx = &*self.inner;
        let named = RoleSet::of_or_all(roles);
        let before = ctx
            .sleep
            .begin_sleep(named)
            .map_err(|found| sleep_error(ctx, "sleep", found))?;
        let step = Step {
            word: &ctx.sleep,
            back: before,
        };
        if !ctx.accepting() {
            return Err(ctx.unavailable_error());
        }
        // Cached blocks count as live buffers in the books: freed first,
        // they come back through their settled frees like any release.
        self.trim_cache(u64::MAX);
        let Some(backend) = ctx.enter() else {
            return Err(ctx.unavailable_error());
        };
        let copies = HostCopies::new(&self.inner);
        let out = match copies.around(|| f(&backend)) {
            Ok(out) => out,
            Err(e) => {
                // The claim first: a device-lost error marks the context
                // lost, which calls the backend's hook under a claim of its
                // own.
                drop(backend);
                if let Some(refused) = copies.refusal() {
                    return Err(refused);
                }
                return Err(ctx.backend_failure(e));
            }
        };
        // Still under the gate claim: `force` sees the live bytes before or
        // after they were suspended.
        let mut by_role = [0u64; 5];
        for role in named.roles() {
            let live = ctx.ledger.stats().usage(role).live.bytes;
            let device = live
                .saturating_sub(ctx.cache.of_role(role).0)
                .saturating_sub(ctx.ledger.charges().other_tiers_live(role));
            ctx.ledger.suspend(role, device);
            by_role[role.index()] = device;
        }
        drop(backend);
        step.done(before.or(named));
        trace_roles(ctx, EventKind::Slept, &by_role);
        let suspended = by_role.iter().sum();
        #[cfg(feature = "tracing")]
        tracing::info!(context = %ctx.id, label = %ctx.label(), suspended, "memgov: context asleep; its live bytes are suspended");
        Ok(Slept {
            suspended,
            by_role,
            backend: out,
        })
    }

    /// Wake the sleeping roles `roles` (every sleeping role when empty):
    /// admit their suspended bytes back onto every budget level, as
    /// allocations of that size would be admitted (block caches, the
    /// [`Admission`](super::Admission) policy, pressure responders), and
    /// only then run the backend's wake `f` under a gate claim with no lock
    /// held. `f` wakes the memory of those roles (with the CUDA or HIP
    /// arena, `wake_ranges` of their allocations; `wake` when every role
    /// wakes). The roles are admitted one after another; a refusal of any
    /// gives back what the others were admitted. Roles not named keep
    /// sleeping, their bytes suspended, and are woken by a later call.
    ///
    /// # Errors
    ///
    /// [`GovernorError::BudgetExceeded`] when the suspended bytes of a role
    /// do not fit (the level, its numbers and the way out are in the
    /// payload); [`GovernorError::Sleep`] when nothing sleeps, when a role
    /// named is awake (the error names it) or when another sleep or wake
    /// runs;
    /// the error a retiring or lost context gives; [`GovernorError::Backend`]
    /// when `f` fails. In every case nothing changed: the roles still
    /// sleep and their bytes are still suspended.
    ///
    /// See [`sleep_with`](Self::sleep_with) for an example.
    pub fn wake_with<R>(
        &self,
        roles: &[Role],
        f: impl FnOnce(&C) -> Result<R, BackendError>,
    ) -> Result<Woken<R>, GovernorError> {
        let ctx = &*self.inner;
        let named = (!roles.is_empty()).then(|| RoleSet::of_or_all(roles));
        let before = ctx
            .sleep
            .begin_wake(named)
            .map_err(|found| sleep_error(ctx, "wake", found))?;
        let waking = named.unwrap_or(before);
        let step = Step {
            word: &ctx.sleep,
            back: before,
        };
        if !ctx.accepting() {
            return Err(ctx.unavailable_error());
        }
        let mut admitted = Admitted {
            ctx,
            by_role: [0; 5],
        };
        for role in waking.roles() {
            let bytes = ctx.ledger.charges().suspended(role);
            if bytes > 0 {
                admit_resume(ctx, bytes, role)?;
                admitted.by_role[role.index()] = bytes;
            }
        }
        let Some(backend) = ctx.enter() else {
            return Err(ctx.unavailable_error());
        };
        // The copies the wake frees go back to the pinned host tier.
        let out = match HostCopies::new(&self.inner).around(|| f(&backend)) {
            Ok(out) => out,
            Err(e) => {
                drop(backend);
                return Err(ctx.backend_failure(e));
            }
        };
        // Under the gate claim, as the suspension was.
        let admitted = std::mem::take(&mut admitted.by_role);
        let mut by_role = [0u64; 5];
        for role in waking.roles() {
            by_role[role.index()] = ctx.ledger.resume(role, admitted[role.index()]);
        }
        let resumed = by_role.iter().sum();
        drop(backend);
        step.done(before.minus(waking));
        trace_roles(ctx, EventKind::Woke, &by_role);
        #[cfg(feature = "tracing")]
        tracing::info!(context = %ctx.id, label = %ctx.label(), resumed, "memgov: context awake; its suspended bytes are charged again");
        Ok(Woken {
            resumed,
            by_role,
            backend: out,
        })
    }

    /// Whether the context's memory sleeps now: [`SleepState::Asleep`]
    /// while any role sleeps ([`sleeping_roles`](Self::sleeping_roles)
    /// says which).
    pub fn sleep_state(&self) -> SleepState {
        self.inner.sleep.get()
    }

    /// The roles whose memory sleeps now, in [`Role::ALL`]'s order: put to
    /// sleep by [`sleep_with`](Self::sleep_with) and not woken since.
    pub fn sleeping_roles(&self) -> Vec<Role> {
        self.inner.sleep.asleep().roles().collect()
    }
}

/// Records `kind` for each role with bytes in `by_role` (in
/// [`Role::ALL`]'s order), when the context is traced.
fn trace_roles<C: DeviceContext>(ctx: &ContextInner<C>, kind: EventKind, by_role: &[u64; 5]) {
    if ctx.trace.is_some() {
        for role in Role::ALL {
            let bytes = by_role[role.index()];
            if bytes > 0 {
                ctx.trace_event(0, Some(role), kind, bytes, None);
            }
        }
    }
}

/// The refusal of a sleep or wake the state does not allow.
#[cold]
fn sleep_error<C: DeviceContext>(
    ctx: &ContextInner<C>,
    operation: &'static str,
    (state, role): Refused,
) -> GovernorError {
    GovernorError::Sleep {
        context: ctx.name(),
        operation,
        state,
        role,
    }
}
