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
//! * [`ContextHandle::wake_with`] admits the suspended bytes back through
//!   every level exactly as an allocation of that size is admitted (block
//!   caches, [`Admission`](super::Admission)'s wait or refuse, pressure
//!   responders); only once they fit does it run the backend's wake. A
//!   wake that does not fit is a [`GovernorError::BudgetExceeded`] naming
//!   the level and its numbers, with nothing changed: the context is still
//!   asleep and may be woken later. If the backend's wake fails, the
//!   admission is given back and the context stays asleep.
//!
//! # Invariants
//!
//! * One sleep or wake runs at a time per context: the state word moves
//!   Awake -> FallingAsleep -> Asleep -> Waking -> Awake by compare and
//!   swap, and a call that finds another state is a typed
//!   [`GovernorError::Sleep`] with nothing done. A failed or panicking step
//!   puts the state back where it was.
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
//! A sleeping context still admits allocations: they are charged like any
//! other (the suspended bytes are not theirs), and the backend decides
//! whether it can serve them (a CUDA arena maps fresh granules; a backend
//! that cannot allocate while asleep refuses with its own error). A wake
//! admits only what is still suspended.

use super::admission::admit_resume;
use super::error::GovernorError;
use super::handle::ContextHandle;
use super::record::sleep::SleepWord;
use super::record::ContextInner;
use super::role::Role;
use super::snapshot::SleepState;
use crate::{BackendError, DeviceContext};

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
    /// What the backend's wake returned.
    pub backend: R,
}

/// A step in progress: puts the state back to `back` when dropped (an
/// error or a panic), unless [`done`](Self::done) moved it on.
struct Step<'a> {
    word: &'a SleepWord,
    back: SleepState,
}

impl Step<'_> {
    fn done(self, to: SleepState) {
        self.word.set(to);
        std::mem::forget(self);
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        self.word.set(self.back);
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

/// `roles` with duplicates removed; every role when empty.
fn roles_or_all(roles: &[Role]) -> Vec<Role> {
    let mut out: Vec<Role> = Role::ALL
        .into_iter()
        .filter(|r| roles.is_empty() || roles.contains(r))
        .collect();
    out.dedup();
    out
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
    /// Call it with no allocation or release of those roles in flight on
    /// other threads: the bytes suspended are the roles' live bytes once the
    /// backend's sleep returned.
    ///
    /// # Errors
    ///
    /// [`GovernorError::Sleep`] when the context is not awake (asleep
    /// already, or another sleep or wake is running); the error a retiring
    /// or lost context gives ([`GovernorError::Pin`],
    /// [`GovernorError::DeviceLost`]); [`GovernorError::Backend`] when `f`
    /// fails. In every case nothing is suspended and the context stays
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
    /// let refused = llm.wake_with(|_host| Ok(())).unwrap_err();
    /// assert!(refused.budget().is_some());
    /// assert_eq!(llm.sleep_state(), SleepState::Asleep);
    ///
    /// drop(scratch);
    /// ostream.synchronize()?;
    /// let woken = llm.wake_with(|_host| Ok(()))?;
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
        ctx.sleep
            .step(SleepState::Awake, SleepState::FallingAsleep)
            .map_err(|found| sleep_error(ctx, "sleep", found))?;
        let step = Step {
            word: &ctx.sleep,
            back: SleepState::Awake,
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
        let out = match f(&backend) {
            Ok(out) => out,
            Err(e) => {
                // The claim first: a device-lost error marks the context
                // lost, which calls the backend's hook under a claim of its
                // own.
                drop(backend);
                return Err(ctx.backend_failure(e));
            }
        };
        // Still under the gate claim: `force` sees the live bytes before or
        // after they were suspended.
        let mut by_role = [0u64; 5];
        for role in roles_or_all(roles) {
            let live = ctx.ledger.stats().usage(role).live.bytes;
            let device = live
                .saturating_sub(ctx.cache.of_role(role).0)
                .saturating_sub(ctx.ledger.charges().other_tiers_live(role));
            ctx.ledger.suspend(role, device);
            by_role[role.index()] = device;
        }
        drop(backend);
        step.done(SleepState::Asleep);
        let suspended = by_role.iter().sum();
        #[cfg(feature = "tracing")]
        tracing::info!(context = %ctx.id, label = %ctx.label(), suspended, "memgov: context asleep; its live bytes are suspended");
        Ok(Slept {
            suspended,
            by_role,
            backend: out,
        })
    }

    /// Wake a sleeping context: admit its suspended bytes back onto every
    /// budget level, as allocations of that size would be admitted (block
    /// caches, the [`Admission`](super::Admission) policy, pressure
    /// responders), and only then run the backend's wake `f` under a gate
    /// claim with no lock held. The roles are admitted one after another;
    /// a refusal of any gives back what the others were admitted.
    ///
    /// # Errors
    ///
    /// [`GovernorError::BudgetExceeded`] when the suspended bytes of a role
    /// do not fit (the level, its numbers and the way out are in the
    /// payload); [`GovernorError::Sleep`] when the context is not asleep;
    /// the error a retiring or lost context gives; [`GovernorError::Backend`]
    /// when `f` fails. In every case nothing changed: the context is still
    /// asleep and its bytes still suspended.
    ///
    /// See [`sleep_with`](Self::sleep_with) for an example.
    pub fn wake_with<R>(
        &self,
        f: impl FnOnce(&C) -> Result<R, BackendError>,
    ) -> Result<Woken<R>, GovernorError> {
        let ctx = &*self.inner;
        ctx.sleep
            .step(SleepState::Asleep, SleepState::Waking)
            .map_err(|found| sleep_error(ctx, "wake", found))?;
        let step = Step {
            word: &ctx.sleep,
            back: SleepState::Asleep,
        };
        if !ctx.accepting() {
            return Err(ctx.unavailable_error());
        }
        let mut admitted = Admitted {
            ctx,
            by_role: [0; 5],
        };
        for role in Role::ALL {
            let bytes = ctx.ledger.charges().suspended(role);
            if bytes > 0 {
                admit_resume(ctx, bytes, role)?;
                admitted.by_role[role.index()] = bytes;
            }
        }
        let Some(backend) = ctx.enter() else {
            return Err(ctx.unavailable_error());
        };
        let out = match f(&backend) {
            Ok(out) => out,
            Err(e) => {
                drop(backend);
                return Err(ctx.backend_failure(e));
            }
        };
        // Under the gate claim, as the suspension was.
        let by_role = std::mem::take(&mut admitted.by_role);
        let mut resumed = 0;
        for role in Role::ALL {
            resumed += ctx.ledger.resume(role, by_role[role.index()]);
        }
        drop(backend);
        step.done(SleepState::Awake);
        #[cfg(feature = "tracing")]
        tracing::info!(context = %ctx.id, label = %ctx.label(), resumed, "memgov: context awake; its suspended bytes are charged again");
        Ok(Woken {
            resumed,
            backend: out,
        })
    }

    /// Whether the context's memory sleeps now.
    pub fn sleep_state(&self) -> SleepState {
        self.inner.sleep.get()
    }
}

/// The refusal of a sleep or wake the state does not allow.
#[cold]
fn sleep_error<C: DeviceContext>(
    ctx: &ContextInner<C>,
    operation: &'static str,
    state: SleepState,
) -> GovernorError {
    GovernorError::Sleep {
        context: ctx.name(),
        operation,
        state,
    }
}
