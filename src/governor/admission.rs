//! Admission: charge the budgets, call the backend, and when either says no,
//! release the block cache's bytes, wait for pending releases and ask
//! pressure responders before giving up.

use super::budget::Refusal;
use super::charges::ChargeRefused;
use super::config::{Admission, PressureRequest, Role};
use super::error::{BudgetExceeded, BudgetScope, GovernorError};
use super::record::{add, ContextInner};
use super::stream::StreamShared;
use crate::sync::lock;
use crate::trace::EventKind;
use crate::{BackendErrorKind, DeviceContext};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// One attempt's refusal.
enum Refused {
    Budget(BudgetScope, Refusal),
    /// The backend itself is out of memory.
    Device(crate::BackendError),
}

/// Charge and allocate, with the context's admission policy. The caller holds
/// a pin for the allocation; on error it must release it.
///
/// On success the allocation is already counted live (under the gate claim,
/// so that `force` either sees it or never lets it be made).
#[inline]
pub(crate) fn admit<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
) -> Result<C::Memory, GovernorError> {
    // Fast path, inlined into `allocate`: an allocation that fits at once
    // never reads the clock (a clock read costs about as much as the rest of
    // the bookkeeping). The deadline and `waited` count from the first
    // refusal, in the out-of-line slow path.
    match attempt(ctx, stream, bytes, role) {
        Ok(memory) => Ok(memory),
        Err(Ok(refused)) => admit_refused(ctx, stream, bytes, role, refused),
        Err(Err(fatal)) => Err(fatal),
    }
}

/// The rest of [`admit`] once the first attempt was refused: wait, ask the
/// pressure responders, or report the refusal.
#[cold]
#[inline(never)]
fn admit_refused<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
    refused: Refused,
) -> Result<C::Memory, GovernorError> {
    let mut first = Some(refused);
    let start = Instant::now();
    let deadline = match ctx.admission {
        Admission::FailFast => None,
        Admission::WaitForPending { timeout } => Some(start + timeout),
    };
    let mut asked_responders = false;
    let mut reclaimed = 0u64;
    let mut waited = false;
    loop {
        let outcome = match first.take() {
            Some(refused) => Err(Ok(refused)),
            // Every later attempt comes after a wait for room or a round of
            // pressure responders: a context that stopped accepting work in
            // the meantime admits nothing, even if the wait made room.
            None if !ctx.accepting() => return Err(ctx.unavailable_error()),
            None => attempt(ctx, stream, bytes, role),
        };
        let mut refused = match outcome {
            Ok(memory) => return Ok(memory),
            Err(Ok(refused)) => refused,
            Err(Err(fatal)) => return Err(fatal),
        };
        // A request larger than a limit it is held to can never be admitted,
        // whatever is released or reclaimed: refuse it at once, without
        // waiting or asking a responder. Checked after every refusal, since
        // a limit may be lowered while this allocation waits.
        if let Some(never) = never_fits(ctx, bytes) {
            add(&ctx.counters.admission_refusals, 1);
            let waited = if waited {
                start.elapsed()
            } else {
                Duration::ZERO
            };
            return Err(exceeded(ctx, never, bytes, role, waited, reclaimed));
        }
        // A context that stopped accepting work (retired, forced, lost)
        // admits nothing that has to wait for room: give up at once, so that
        // this allocation's pin does not hold its teardown up.
        if !ctx.accepting() {
            return Err(ctx.unavailable_error());
        }
        // 0. Give the block cache's bytes back, before anything waits or a
        //    responder is asked: freed stream-ordered, they are pending now,
        //    and the next attempt (or the wait below) sees them return.
        if ctx.cache.bytes() > 0
            && super::cache::release_for_pressure(ctx, shortfall(ctx, &refused, bytes)) > 0
        {
            continue;
        }
        // 1. Wait for pending releases to retire, if the policy allows and
        //    there is something pending that could help. Register first,
        //    then see what is pending, then look again: a release that
        //    settled after the refusal above and before the registration is
        //    seen by the second attempt, and one that settles after the
        //    registration wakes the wait. What is pending is read *before*
        //    that attempt: a settlement counts as no longer pending only
        //    once its bytes are back in the budget (`release.rs`), so
        //    reading "nothing pending" means the attempt after it saw every
        //    settled byte, and a refusal then is final. (Read after the
        //    attempt, a settlement landing in between would read as "nothing
        //    to wait for" while the attempt had missed its bytes.)
        if let Some(d) = deadline {
            if Instant::now() < d {
                let waiter = SettlementWaiter::register(ctx, &refused);
                let pending = pending_in_scope(ctx, &refused);
                refused = match attempt(ctx, stream, bytes, role) {
                    Ok(memory) => return Ok(memory),
                    Err(Ok(again)) => again,
                    Err(Err(fatal)) => return Err(fatal),
                };
                if !ctx.accepting() {
                    return Err(ctx.unavailable_error());
                }
                if pending > 0 || pending_in_scope(ctx, &refused) > 0 {
                    if waiter.covers(&refused) {
                        add(&ctx.counters.admission_waits, 1);
                        waited = true;
                        waiter.wait(d);
                    }
                    continue;
                }
            }
        }
        // 2. Ask pressure responders once, with no lock held.
        if !asked_responders {
            asked_responders = true;
            let responders = lock(&ctx.responders).clone();
            if !responders.is_empty() {
                let req = PressureRequest {
                    context: ctx.id,
                    role,
                    requested: bytes,
                    shortfall: shortfall(ctx, &refused, bytes),
                };
                if let Some(t) = &ctx.trace {
                    t.event(
                        stream.trace_tag,
                        Some(role),
                        EventKind::Pressure,
                        req.shortfall,
                        Some(format!("{} responder(s) asked", responders.len())),
                    );
                }
                for r in &responders {
                    add(&ctx.counters.pressure_calls, 1);
                    reclaimed = reclaimed.saturating_add(r(&req));
                }
                continue;
            }
        }
        add(&ctx.counters.admission_refusals, 1);
        return Err(exceeded(
            ctx,
            refused,
            bytes,
            role,
            start.elapsed(),
            reclaimed,
        ));
    }
}

/// Allocate `bytes` whose charge is already held (taken out of a
/// reservation): the backend call and the live count of [`attempt`], without
/// charging. The caller holds a pin and puts the bytes back on error.
pub(crate) fn allocate_charged<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
) -> Result<C::Memory, GovernorError> {
    let Some(backend) = ctx.enter_on(stream.shard) else {
        return Err(ctx.unavailable_error());
    };
    let result = backend.allocate(stream.raw(), bytes);
    if result.is_ok() {
        ctx.stats.admit(stream.shard, role, bytes);
    }
    drop(backend);
    result.map_err(|e| {
        if e.kind == BackendErrorKind::OutOfMemory {
            ctx.note_backend_error(&e);
            add(&ctx.counters.admission_refusals, 1);
            exceeded(ctx, Refused::Device(e), bytes, role, Duration::ZERO, 0)
        } else {
            ctx.backend_failure(e)
        }
    })
}

/// A reservation of `bytes` the budgets refused: refused at once (a
/// reservation is asked for ahead of need, so it neither waits nor asks
/// responders), counted as a refusal.
pub(crate) fn reserve_refused<C: DeviceContext>(
    ctx: &ContextInner<C>,
    refused: ChargeRefused,
    bytes: u64,
) -> GovernorError {
    let refused = match refused {
        ChargeRefused::Context(r) => Refused::Budget(BudgetScope::Context, r),
        ChargeRefused::Shared(label, r) => Refused::Budget(BudgetScope::Shared(label), r),
    };
    add(&ctx.counters.admission_refusals, 1);
    exceeded(ctx, refused, bytes, Role::Other, Duration::ZERO, 0)
}

/// `Ok(memory)`, `Err(Ok(refusal))` to retry, or `Err(Err(error))` to fail.
#[allow(clippy::type_complexity)]
#[inline]
fn attempt<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
) -> Result<C::Memory, Result<Refused, GovernorError>> {
    ctx.charges
        .charge(stream.shard, bytes, stream.credit())
        .map_err(|refused| {
            Ok(match refused {
                ChargeRefused::Context(r) => Refused::Budget(BudgetScope::Context, r),
                ChargeRefused::Shared(label, r) => Refused::Budget(BudgetScope::Shared(label), r),
            })
        })?;
    // Charged to both budgets now: returned on every path below that does
    // not end in a live buffer, unwinding out of the backend included.
    let charge = Charge { ctx, bytes };
    // The gate closes only once retire has begun (force, teardown): this
    // allocation was not admitted, and says so with the error a retiring
    // context gives (`Reclaimed` is for buffers and streams that existed).
    let Some(backend) = ctx.enter_on(stream.shard) else {
        return Err(Err(ctx.unavailable_error()));
    };
    let result = backend.allocate(stream.raw(), bytes);
    if result.is_ok() {
        ctx.stats.admit(stream.shard, role, bytes);
        charge.keep();
    }
    drop(backend);
    result.map_err(|e| {
        if e.kind == BackendErrorKind::OutOfMemory {
            ctx.note_backend_error(&e);
            Ok(Refused::Device(e))
        } else {
            Err(ctx.backend_failure(e))
        }
    })
}

/// Bytes charged to the context's budget and its shared one for an
/// allocation being made: given back when dropped, unless [`keep`](Self::keep)
/// says the allocation is live.
struct Charge<'a, C: DeviceContext> {
    ctx: &'a ContextInner<C>,
    bytes: u64,
}

impl<C: DeviceContext> Charge<'_, C> {
    /// The allocation succeeded: the charge stays with its buffer.
    #[inline]
    fn keep(self) {
        std::mem::forget(self);
    }
}

impl<C: DeviceContext> Drop for Charge<'_, C> {
    fn drop(&mut self) {
        self.ctx.charges.uncharge(self.bytes);
    }
}

/// Bytes in the scope of `refused` that are on their way back: pending
/// releases, and on a shared budget also what retiring contexts on it will
/// give back at teardown (a model swap: the old context's quarantined and
/// abandoned bytes return only when it is torn down, which bumps the shared
/// epoch). Read after the waiter registered and before the attempt it
/// guards: a byte counted here as no longer on its way is back in the budget.
fn pending_in_scope<C: DeviceContext>(ctx: &ContextInner<C>, refused: &Refused) -> u64 {
    match refused {
        Refused::Budget(BudgetScope::Shared(_), _) => ctx.charges.shared_on_the_way(),
        _ => ctx.pending_bytes(),
    }
}

/// An allocation about to wait for a release in the scope of its refusal to
/// settle, registered *before* its last attempt: a settlement either comes
/// before the registration (and the attempt sees the room it made: the
/// epoch word orders the two) or moves the epoch read here and wakes the
/// wait. Unregisters when dropped, on every way out.
enum SettlementWaiter<'a, C: DeviceContext> {
    /// The context's own settlements (`settle_epoch`).
    Context { ctx: &'a ContextInner<C>, seen: u64 },
    /// Settlements of every context on the shared budget.
    Shared { ctx: &'a ContextInner<C>, seen: u64 },
}

impl<'a, C: DeviceContext> SettlementWaiter<'a, C> {
    fn register(ctx: &'a ContextInner<C>, refused: &Refused) -> Self {
        match (refused, ctx.charges.shared_epoch()) {
            (Refused::Budget(BudgetScope::Shared(_), _), Some(seen)) => Self::Shared { ctx, seen },
            _ => {
                // Register, fence, then read the epoch to wait past: a
                // settlement either sees the registration (and bumps the
                // epoch and wakes) or is seen by the attempt that follows
                // (see `ContextInner::announce_settlement`).
                ctx.life.settle_epoch.register();
                std::sync::atomic::fence(Ordering::SeqCst);
                Self::Context {
                    ctx,
                    seen: ctx.life.settle_epoch.epoch(),
                }
            }
        }
    }

    /// Whether this registration is for the scope of `refused`.
    fn covers(&self, refused: &Refused) -> bool {
        let shared = matches!(refused, Refused::Budget(BudgetScope::Shared(_), _));
        match self {
            Self::Shared { .. } => shared,
            Self::Context { .. } => !shared,
        }
    }

    /// Sleep until some release in scope settles after the registration,
    /// the context stops accepting work (retire, force, device loss: each
    /// wakes these notifiers after changing what `accepting` reads), or the
    /// deadline passes. Never polls.
    fn wait(&self, deadline: Instant) {
        match *self {
            Self::Shared { ctx, seen } => {
                ctx.charges.wait_shared(seen, deadline, || !ctx.accepting());
            }
            Self::Context { ctx, seen } => {
                ctx.life.settled.wait_until(
                    || ctx.life.settle_epoch.epoch() != seen || !ctx.accepting(),
                    Some(deadline),
                );
            }
        }
    }
}

impl<C: DeviceContext> Drop for SettlementWaiter<'_, C> {
    fn drop(&mut self) {
        if let Self::Context { ctx, .. } = self {
            ctx.life.settle_epoch.unregister();
        }
    }
}

/// The refusal of the first limit `bytes` exceeds on its own: the context's
/// budget, its shared budget, or the device's total memory (when the backend
/// reports one). `None` when the request could fit once enough is released.
fn never_fits<C: DeviceContext>(ctx: &ContextInner<C>, bytes: u64) -> Option<Refused> {
    let context = ctx.charges.limit();
    if bytes > context {
        let charged = ctx.charges.charged();
        return Some(Refused::Budget(
            BudgetScope::Context,
            Refusal {
                charged,
                limit: context,
            },
        ));
    }
    if let Some(s) = ctx.charges.shared() {
        if bytes > s.limit() {
            return Some(Refused::Budget(
                BudgetScope::Shared(s.label().to_owned()),
                Refusal {
                    charged: s.charged(),
                    limit: s.limit(),
                },
            ));
        }
    }
    let total = ctx.description.total_bytes;
    if total > 0 && bytes > total {
        let charged = ctx
            .live_bytes()
            .saturating_add(ctx.pending_bytes())
            .saturating_add(ctx.stats.quarantined_bytes())
            .saturating_add(ctx.charges.awaiting_teardown());
        return Some(Refused::Budget(
            BudgetScope::Device,
            Refusal {
                charged,
                limit: total,
            },
        ));
    }
    None
}

fn shortfall<C: DeviceContext>(ctx: &ContextInner<C>, refused: &Refused, bytes: u64) -> u64 {
    match refused {
        Refused::Budget(_, r) => r.charged.saturating_add(bytes).saturating_sub(r.limit),
        Refused::Device(_) => {
            let free = ctx
                .enter()
                .and_then(|b| b.memory_info().ok())
                .map_or(0, |m| m.free);
            bytes.saturating_sub(free)
        }
    }
}

fn exceeded<C: DeviceContext>(
    ctx: &ContextInner<C>,
    refused: Refused,
    bytes: u64,
    role: Role,
    waited: Duration,
    reclaimed: u64,
) -> GovernorError {
    let (scope, charged, pending, quarantined, awaiting_teardown, limit, available, driver) =
        match refused {
            Refused::Budget(BudgetScope::Shared(label), r) => {
                let s = ctx
                    .charges
                    .shared_amounts()
                    .expect("shared refusal implies a shared budget");
                (
                    BudgetScope::Shared(label),
                    r.charged,
                    s.pending,
                    s.quarantined,
                    s.awaiting_teardown,
                    r.limit,
                    r.limit.saturating_sub(r.charged),
                    None,
                )
            }
            Refused::Budget(scope, r) => (
                scope,
                r.charged,
                ctx.pending_bytes(),
                ctx.stats.quarantined_bytes(),
                ctx.charges.awaiting_teardown(),
                r.limit,
                r.limit.saturating_sub(r.charged),
                None,
            ),
            Refused::Device(e) => {
                let info = ctx.enter().and_then(|b| b.memory_info().ok());
                let (free, total) =
                    info.map_or((0, ctx.description.total_bytes), |m| (m.free, m.total));
                let live = ctx.live_bytes();
                let (pending, quarantined) = (ctx.pending_bytes(), ctx.stats.quarantined_bytes());
                let awaiting = ctx.charges.awaiting_teardown();
                (
                    BudgetScope::Device,
                    live.saturating_add(pending)
                        .saturating_add(quarantined)
                        .saturating_add(awaiting),
                    pending,
                    quarantined,
                    awaiting,
                    total,
                    free,
                    Some(e),
                )
            }
        };
    // What is charged and neither reserved, pending, quarantined nor
    // awaiting teardown is live. The device's figure counts buffers only: a
    // reservation holds budget, not device memory.
    let (reserved, reserved_by) = match scope {
        BudgetScope::Device => (0, Vec::new()),
        _ => ctx.reservations.usage(),
    };
    let live = charged
        .saturating_sub(reserved)
        .saturating_sub(pending)
        .saturating_sub(quarantined)
        .saturating_sub(awaiting_teardown);
    GovernorError::BudgetExceeded(Box::new(BudgetExceeded {
        context: ctx.name(),
        scope,
        role,
        requested: bytes,
        live,
        reserved,
        reserved_by,
        pending,
        quarantined,
        awaiting_teardown,
        limit,
        available,
        waited,
        reclaimed_by_responders: reclaimed,
        driver,
    }))
}
