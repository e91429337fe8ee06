//! Admission: charge the budgets, call the backend, and when either says no,
//! release the block cache's bytes, wait for pending releases and ask
//! pressure responders before giving up.

use super::config::Admission;
use super::error::{BudgetExceeded, BudgetScope, GovernorError};
use super::ledger::Refusal;
use super::ledger::{Above, Entry, Note, RefusedAt};
use super::pressure::{PressureLevel, PressureRequest, RegisteredResponder};
use super::record::stream::StreamShared;
use super::record::ContextInner;
use super::role::Role;
use crate::sync::lock;
use crate::trace::EventKind;
use crate::{BackendErrorKind, DeviceContext, Tier};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Why one attempt at an allocation was not admitted: a budget level of
/// the tree (with the word's [`Refusal`]: what it held and its limit), the
/// backend out of memory, or the machine ledger. Named apart from the
/// ledger's [`RefusedAt`] (which level of the tree refused a charge) and the
/// word's [`Refusal`], which it carries.
enum Denial {
    /// A budget of the tree, or a tier's own budget.
    Budget(BudgetScope, Refusal),
    /// The backend itself is out of memory.
    Device(crate::BackendError),
    /// The machine ledger, with every process's figures.
    #[cfg(target_os = "linux")]
    Machine(super::ledger::MachineRefused),
}

impl From<RefusedAt> for Denial {
    #[inline]
    fn from(refused: RefusedAt) -> Self {
        match refused {
            RefusedAt::Context(r) => Self::Budget(BudgetScope::Context, r),
            RefusedAt::Shared(label, r) => Self::Budget(BudgetScope::Shared(label), r),
            RefusedAt::Process(label, r) => Self::Budget(BudgetScope::Process(label), r),
            RefusedAt::Tier(tier, r) => Self::Budget(BudgetScope::Tier(tier), r),
            #[cfg(target_os = "linux")]
            RefusedAt::Machine(m) => Self::Machine(m),
        }
    }
}

impl Denial {
    /// The level above the context that refused, if one did.
    fn above(&self) -> Option<Above> {
        match self {
            Self::Budget(BudgetScope::Shared(_), _) => Some(Above::Shared),
            Self::Budget(BudgetScope::Process(_), _) => Some(Above::Process),
            // What this process has pending returns to the ledger through
            // the process level: wait there (other processes' releases are
            // asked for through the ledger's doorbell).
            #[cfg(target_os = "linux")]
            Self::Machine(_) => Some(Above::Process),
            _ => None,
        }
    }

    /// The level whose responders a refusal asks.
    fn pressure_level(&self) -> PressureLevel {
        match self {
            // A tier's refusal asks nobody (`admit_in`); were it to, the
            // context's own responders would be the ones to ask.
            Self::Budget(BudgetScope::Context | BudgetScope::Tier(_), _) => PressureLevel::Context,
            Self::Budget(BudgetScope::Shared(_), _) => PressureLevel::Shared,
            Self::Budget(BudgetScope::Process(_), _) => PressureLevel::Process,
            Self::Budget(BudgetScope::Device, _) | Self::Device(_) => PressureLevel::Device,
            Self::Budget(BudgetScope::Machine(_), _) => PressureLevel::Machine,
            #[cfg(target_os = "linux")]
            Self::Machine(_) => PressureLevel::Machine,
        }
    }
}

/// The most rounds of asking the responders of every context under a
/// shared level: another round only while the last one freed something.
const RECLAIM_ROUNDS: usize = 3;

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

/// What an admission makes once its bytes are charged: a buffer on a
/// stream ([`admit`]), or nothing more than the charge (a wake taking its
/// suspended bytes back, [`admit_resume`]). The refusal path is the same
/// for both: caches, waits, responders, the typed refusal.
trait Request<C: DeviceContext> {
    type Made;
    /// The trace tag of the stream asking (0: not traced).
    fn trace_tag(&self) -> u32;
    /// One attempt: charge every level, then make it.
    #[allow(clippy::type_complexity)]
    fn attempt(
        &self,
        ctx: &ContextInner<C>,
        bytes: u64,
        role: Role,
    ) -> Result<Self::Made, Result<Denial, GovernorError>>;
    /// Make it with its charge already held (a reclaim's claim).
    fn make_charged(
        &self,
        ctx: &ContextInner<C>,
        bytes: u64,
        role: Role,
    ) -> Result<Self::Made, GovernorError>;
}

impl<C: DeviceContext> Request<C> for StreamShared<C> {
    type Made = C::Memory;
    fn trace_tag(&self) -> u32 {
        self.trace_tag
    }
    fn attempt(
        &self,
        ctx: &ContextInner<C>,
        bytes: u64,
        role: Role,
    ) -> Result<C::Memory, Result<Denial, GovernorError>> {
        attempt(ctx, self, bytes, role)
    }
    fn make_charged(
        &self,
        ctx: &ContextInner<C>,
        bytes: u64,
        role: Role,
    ) -> Result<C::Memory, GovernorError> {
        allocate_charged(ctx, self, bytes, role, Tier::Device, Held::Claimed)
    }
}

/// A wake's admission of suspended bytes: the charge alone (the backend's
/// wake runs after it, see `suspend.rs`).
struct Resume;

impl<C: DeviceContext> Request<C> for Resume {
    type Made = ();
    fn trace_tag(&self) -> u32 {
        0
    }
    fn attempt(
        &self,
        ctx: &ContextInner<C>,
        bytes: u64,
        role: Role,
    ) -> Result<(), Result<Denial, GovernorError>> {
        // Any shard's lease may carry it, as for a reservation.
        ctx.ledger
            .charge(Entry::new(bytes, role, Tier::Device, 0), 0)
            .map_err(|refused| Ok(refused.into()))
    }
    fn make_charged(&self, _: &ContextInner<C>, _: u64, _: Role) -> Result<(), GovernorError> {
        Ok(())
    }
}

/// Charge `bytes` of `role` to every level for a wake, with the context's
/// admission policy, exactly as an allocation of that size would be
/// admitted (block caches, waits for pending releases, pressure responders,
/// the typed refusal), without calling the backend. On success the bytes
/// are charged; the caller moves them off `suspended` or gives them back.
pub(crate) fn admit_resume<C: DeviceContext>(
    ctx: &ContextInner<C>,
    bytes: u64,
    role: Role,
) -> Result<(), GovernorError> {
    match Resume.attempt(ctx, bytes, role) {
        Ok(()) => Ok(()),
        Err(Ok(refused)) => admit_refused(ctx, &Resume, bytes, role, refused),
        Err(Err(fatal)) => Err(fatal),
    }
}

/// The rest of [`admit`] once the first attempt was refused: wait, ask the
/// pressure responders, or report the refusal.
#[cold]
#[inline(never)]
fn admit_refused<C: DeviceContext, R: Request<C>>(
    ctx: &ContextInner<C>,
    stream: &R,
    bytes: u64,
    role: Role,
    refused: Denial,
) -> Result<R::Made, GovernorError> {
    let mut first = Some(refused);
    let start = Instant::now();
    let deadline = match ctx.admission {
        Admission::FailFast => None,
        Admission::WaitForPending { timeout } => Some(start + timeout),
    };
    let mut asked_responders = false;
    let mut reclaimed = 0u64;
    let mut waited = false;
    #[cfg(target_os = "linux")]
    let mut asked_machine = false;
    #[cfg(target_os = "linux")]
    let mut unanswered = Vec::new();
    loop {
        let outcome = match first.take() {
            Some(refused) => Err(Ok(refused)),
            // Every later attempt comes after a wait for room or a round of
            // pressure responders: a context that stopped accepting work in
            // the meantime admits nothing, even if the wait made room.
            None if !ctx.accepting() => return Err(ctx.unavailable_error()),
            None => stream.attempt(ctx, bytes, role),
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
            ctx.ledger.note(Note::Refusal);
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
        // On the machine ledger, once: this process's block caches, then the
        // other processes (dead ones reclaimed, idle leases, caches, lower
        // priorities above their floors), waited for up to the deadline.
        // With `WaitForPending` this repeats until the deadline: the room
        // may come from another process at any time.
        #[cfg(target_os = "linux")]
        if let Denial::Machine(_) = &refused {
            let again = asked_machine && deadline.is_some_and(|d| Instant::now() < d);
            if again {
                std::thread::sleep(Duration::from_millis(2));
            }
            if let Some(m) = ctx
                .ledger
                .charges()
                .machine()
                .filter(|_| !asked_machine || again)
            {
                asked_machine = true;
                release_caches(ctx, &refused, shortfall(ctx, &refused, bytes));
                // Only a physical device's figures are the machine's: an
                // embedded device or a stand-in driver is this process's own.
                if ctx.description.execution == crate::Execution::RealHardware {
                    if let Some(info) = ctx.enter().and_then(|b| b.memory_info().ok()) {
                        m.observe_device(info);
                    }
                }
                let d = deadline.unwrap_or_else(|| Instant::now() + m.inner().answer_timeout);
                waited |= deadline.is_some();
                unanswered = m.make_room(bytes, d);
                continue;
            }
        }
        // 0. Give block caches' bytes back, before anything waits or a
        //    responder is asked: the context's own, and on a refusal by a
        //    level above it those of every context under that level. Freed
        //    stream-ordered, they are pending now, and the next attempt (or
        //    the wait below) sees them return.
        if release_caches(ctx, &refused, shortfall(ctx, &refused, bytes)) > 0 {
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
                refused = match stream.attempt(ctx, bytes, role) {
                    Ok(memory) => return Ok(memory),
                    Err(Ok(again)) => again,
                    Err(Err(fatal)) => return Err(fatal),
                };
                if !ctx.accepting() {
                    return Err(ctx.unavailable_error());
                }
                if pending > 0 || pending_in_scope(ctx, &refused) > 0 {
                    if waiter.covers(&refused) {
                        ctx.ledger.note(Note::Wait);
                        waited = true;
                        waiter.wait(d);
                    }
                    continue;
                }
            }
        }
        // 2. Ask pressure responders once, with no lock held: this
        //    context's for a refusal of its own budget (or of the device
        //    when it shares no budget), every context's under the level
        //    otherwise, lowest priority first.
        if !asked_responders {
            asked_responders = true;
            let level = refused.pressure_level();
            if level != PressureLevel::Context && ctx.ledger.charges().shared().is_some() {
                match reclaim_across(ctx, stream, bytes, role, &refused, &mut reclaimed) {
                    Reclaim::Admitted(memory) => return Ok(memory),
                    Reclaim::Failed(e) => return Err(e),
                    Reclaim::Asked => continue,
                    Reclaim::NoResponders => {}
                }
            } else {
                let mut responders = lock(&ctx.responders).clone();
                if !responders.is_empty() {
                    responders.sort_by_key(|r| r.priority);
                    let req = PressureRequest {
                        context: ctx.id,
                        level,
                        role,
                        requested: bytes,
                        shortfall: shortfall(ctx, &refused, bytes),
                    };
                    if let Some(t) = &ctx.trace {
                        t.event(
                            stream.trace_tag(),
                            Some(role),
                            EventKind::Pressure,
                            req.shortfall,
                            Some(format!("{} responder(s) asked", responders.len())),
                        );
                    }
                    for r in &responders {
                        ctx.ledger.note(Note::PressureCall);
                        reclaimed = reclaimed.saturating_add((r.responder)(&req));
                    }
                    continue;
                }
            }
        }
        ctx.ledger.note(Note::Refusal);
        #[cfg(target_os = "linux")]
        if let Denial::Machine(m) = &mut refused {
            m.unanswered = std::mem::take(&mut unanswered);
        }
        // `waited` only when this allocation did wait: a refusal under
        // `FailFast`, or with nothing pending to wait for, says so.
        let waited = if waited {
            start.elapsed()
        } else {
            Duration::ZERO
        };
        return Err(exceeded(ctx, refused, bytes, role, waited, reclaimed));
    }
}

/// The device tier's live, pending and quarantined bytes: every buffer's
/// (the statistics count all tiers) less those of the other tiers.
fn device_tier<C: DeviceContext>(ctx: &ContextInner<C>) -> (u64, u64, u64) {
    let other = ctx
        .ledger
        .charges()
        .tier_amounts(Tier::PinnedHost)
        .unwrap_or_default();
    (
        ctx.live_bytes().saturating_sub(other.live),
        ctx.pending_bytes().saturating_sub(other.pending),
        ctx.ledger
            .stats()
            .quarantined_bytes()
            .saturating_sub(other.quarantined),
    )
}

/// Charge and allocate in `tier`, a tier other than the device's (whose
/// allocations go through [`admit`]): the tier's own budget, then the
/// backend's [`allocate_in`](DeviceContext::allocate_in). Kept apart so that
/// the device path carries no tier code.
///
/// A refusal waits, under the context's admission policy, for the tier's
/// own pending releases; pressure responders are not asked (they give back
/// device memory, which does not help here). A request over the tier's
/// limit is refused at once. The caller holds a pin, as for [`admit`].
#[inline(never)]
pub(crate) fn admit_in<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
    tier: Tier,
) -> Result<C::Memory, GovernorError> {
    debug_assert_ne!(tier, Tier::Device);
    let start = Instant::now();
    let deadline = match ctx.admission {
        Admission::FailFast => None,
        Admission::WaitForPending { timeout } => Some(start + timeout),
    };
    let mut waited = false;
    let mut next = attempt_in(ctx, stream, bytes, role, tier);
    loop {
        let mut refused = match next {
            Ok(memory) => return Ok(memory),
            Err(Ok(refused)) => refused,
            Err(Err(fatal)) => return Err(fatal),
        };
        let limit = ctx
            .ledger
            .charges()
            .tier_amounts(tier)
            .map_or(0, |a| a.limit);
        let never = bytes > limit;
        if !never && !ctx.accepting() {
            return Err(ctx.unavailable_error());
        }
        // Wait as `admit_refused` does: register, read what is pending, try
        // again, and sleep only if a settlement could still make room.
        if let (false, Some(d), Denial::Budget(..)) = (never, deadline, &refused) {
            if Instant::now() < d {
                let waiter = SettlementWaiter::register(ctx, &refused);
                let pending = pending_in_scope(ctx, &refused);
                refused = match attempt_in(ctx, stream, bytes, role, tier) {
                    Ok(memory) => return Ok(memory),
                    Err(Ok(again)) => again,
                    Err(Err(fatal)) => return Err(fatal),
                };
                if matches!(refused, Denial::Budget(..))
                    && (pending > 0 || pending_in_scope(ctx, &refused) > 0)
                {
                    ctx.ledger.note(Note::Wait);
                    waited = true;
                    waiter.wait(d);
                    drop(waiter);
                    if !ctx.accepting() {
                        return Err(ctx.unavailable_error());
                    }
                    next = attempt_in(ctx, stream, bytes, role, tier);
                    continue;
                }
            }
        }
        ctx.ledger.note(Note::Refusal);
        let waited = if waited {
            start.elapsed()
        } else {
            Duration::ZERO
        };
        return Err(exceeded_in(ctx, tier, refused, bytes, role, waited));
    }
}

/// [`attempt`] in a tier other than the device's.
#[allow(clippy::type_complexity)]
fn attempt_in<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
    tier: Tier,
) -> Result<C::Memory, Result<Denial, GovernorError>> {
    let entry = Entry::new(bytes, role, tier, stream.shard);
    ctx.ledger
        .charge(entry, 0)
        .map_err(|refused| Ok(refused.into()))?;
    // Given back on every path that does not end in a live buffer.
    let charge = Charge { ctx, entry };
    let Some(backend) = ctx.enter_on(stream.shard) else {
        return Err(Err(ctx.unavailable_error()));
    };
    let result = backend.allocate_in(stream.raw(), bytes, tier);
    if result.is_ok() {
        charge.admit();
    }
    drop(backend);
    result.map_err(|e| backend_refusal(ctx, e))
}

/// A backend's refusal of an allocation: out of memory is a refusal to
/// retry after a wait or reclaim, anything else an error to return.
#[cold]
fn backend_refusal<C: DeviceContext>(
    ctx: &ContextInner<C>,
    e: crate::BackendError,
) -> Result<Denial, GovernorError> {
    if e.kind == BackendErrorKind::OutOfMemory {
        ctx.note_backend_error(&e);
        Ok(Denial::Device(e))
    } else {
        Err(ctx.backend_failure(e))
    }
}

/// The refusal of an allocation in `tier`, with the tier's numbers (the
/// driver's error, when the driver itself was out of the tier's memory).
fn exceeded_in<C: DeviceContext>(
    ctx: &ContextInner<C>,
    tier: Tier,
    refused: Denial,
    bytes: u64,
    role: Role,
    waited: Duration,
) -> GovernorError {
    let a = ctx.ledger.charges().tier_amounts(tier).unwrap_or_default();
    let reserved_by: Vec<_> = ctx
        .reservations
        .usage()
        .into_iter()
        .filter(|r| r.tier == tier)
        .collect();
    let (limit, charged, driver) = match refused {
        Denial::Budget(_, r) => (r.limit, r.charged, None),
        Denial::Device(e) => (a.limit, a.charged, Some(e)),
        // A tier other than the device's is never charged on the ledger.
        #[cfg(target_os = "linux")]
        Denial::Machine(_) => (a.limit, a.charged, None),
    };
    GovernorError::BudgetExceeded(Box::new(BudgetExceeded {
        context: ctx.name(),
        scope: BudgetScope::Tier(tier),
        role,
        requested: bytes,
        live: a.live,
        reserved: reserved_by.iter().map(|r| r.left).sum(),
        reserved_by,
        outside: 0,
        pending: a.pending,
        quarantined: a.quarantined,
        awaiting_teardown: a.awaiting_teardown,
        limit,
        available: limit.saturating_sub(charged),
        waited,
        reclaimed_by_responders: 0,
        driver,
        limit_from: None,
        #[cfg(target_os = "linux")]
        machine: None,
        holders: Default::default(),
    }))
}

/// How asking the responders under a shared level ended.
enum Reclaim<M> {
    /// The allocation fits and was made.
    Admitted(M),
    /// It fit, and the backend failed it.
    Failed(GovernorError),
    /// Responders were asked and it still does not fit.
    Asked,
    /// No context under the level has a responder.
    NoResponders,
}

/// The contexts under the level a refusal asks (the device's shared budget,
/// or every device under the process budget); empty for the context's own
/// budget. Collected with the members' lock released before any is asked.
fn members_under<C: DeviceContext>(
    ctx: &ContextInner<C>,
    level: PressureLevel,
) -> Vec<std::sync::Arc<dyn super::ledger::DeviceMember>> {
    match (level, ctx.ledger.charges().process()) {
        (PressureLevel::Context, _) => Vec::new(),
        (PressureLevel::Process | PressureLevel::Machine, Some(p)) => {
            p.devices().iter().flat_map(|d| d.members()).collect()
        }
        _ => ctx
            .ledger
            .charges()
            .shared()
            .map_or_else(Vec::new, |s| s.0.members()),
    }
}

/// Step 0 of a refused admission: block caches give their bytes back,
/// the requester's own first, then, on a refusal by a level above the
/// context, those of every other context under that level, until
/// `shortfall` bytes are on their way back (all of them when the shortfall
/// is unknown, 0). Cached bytes go before any responder is asked: they cost
/// nothing to give back. Returns the bytes released.
#[cold]
fn release_caches<C: DeviceContext>(
    ctx: &ContextInner<C>,
    refused: &Denial,
    shortfall: u64,
) -> u64 {
    let mut released = 0u64;
    if ctx.cache.bytes() > 0 {
        released = super::cache::release_for_pressure(ctx, shortfall);
    }
    let enough = |released: u64| shortfall > 0 && released >= shortfall;
    if enough(released) {
        return released;
    }
    for member in members_under(ctx, refused.pressure_level()) {
        if member.identity() == ctx.id {
            continue;
        }
        let want = if shortfall == 0 {
            0
        } else {
            shortfall - released
        };
        released = released.saturating_add(member.release_cache_for_pressure(want));
        if enough(released) {
            break;
        }
    }
    released
}

/// One responder to ask, with what orders it.
struct Victim {
    priority: u32,
    /// The requester's own responders go first among equal priorities.
    foreign: bool,
    responder: RegisteredResponder,
}

/// The responders of every context under the level that refused, lowest
/// priority first (the requester's own first among equals, then in the
/// order the contexts joined). Collected with each context's lock taken and
/// released in turn: none is held while they are called.
fn victims<C: DeviceContext>(ctx: &ContextInner<C>, level: PressureLevel) -> Vec<Victim> {
    let members = match level {
        // Called for levels above the context only; the own budget's
        // responders are the context's, asked in `admit_refused`.
        PressureLevel::Context => ctx
            .ledger
            .charges()
            .shared()
            .map_or_else(Vec::new, |s| s.0.members()),
        _ => members_under(ctx, level),
    };
    let mut victims: Vec<Victim> = members
        .iter()
        .flat_map(|m| {
            let foreign = m.identity() != ctx.id;
            m.pressure_responders()
                .into_iter()
                .map(move |responder| Victim {
                    priority: responder.priority,
                    foreign,
                    responder,
                })
        })
        .collect();
    // Stable: equal keys keep the join order.
    victims.sort_by_key(|v| (v.priority, v.foreign));
    victims
}

/// Bytes an allocation asking responders holds for itself on every level
/// (see [`Charges::claim`](super::ledger::Charges::claim)): given back when
/// dropped unless [`keep`](Self::keep) hands them to the allocation.
struct Claim<'a, C: DeviceContext> {
    ctx: &'a ContextInner<C>,
    bytes: u64,
}

impl<'a, C: DeviceContext> Claim<'a, C> {
    fn new(ctx: &'a ContextInner<C>, bytes: u64) -> Self {
        ctx.ledger.claim(bytes);
        Self { ctx, bytes }
    }

    /// Whether the claim is admissible now: every level within its limit.
    fn fits(&self) -> bool {
        self.ctx.ledger.claim_fits()
    }

    fn keep(self) {
        std::mem::forget(self);
    }
}

impl<C: DeviceContext> Drop for Claim<'_, C> {
    fn drop(&mut self) {
        // Room came back on the levels above: whoever waits there looks
        // again.
        self.ctx.ledger.give_back(self.bytes);
    }
}

/// Ask the responders of every context under the level that refused
/// (`refused`: the shared budget, the process budget, or the device's
/// memory), lowest priority first, until the allocation fits; another round
/// while a round freed something, at most [`RECLAIM_ROUNDS`].
///
/// On a budget level the requester first claims its bytes on every level,
/// over the limits (see [`Charges::claim`](super::ledger::Charges::claim)):
/// a byte a responder frees there pays the claim off, and an allocation
/// racing it is refused until the claim is paid in full; the claim is the
/// allocation's charge once every level is within its limit, and is given
/// back if that never happens. The device's own memory cannot be claimed
/// (anything on the device, memgov's or not, may take it): there the
/// allocation is retried after each responder.
#[cold]
#[inline(never)]
fn reclaim_across<C: DeviceContext, R: Request<C>>(
    ctx: &ContextInner<C>,
    stream: &R,
    bytes: u64,
    role: Role,
    refused: &Denial,
    reclaimed: &mut u64,
) -> Reclaim<R::Made> {
    let level = refused.pressure_level();
    let victims = victims(ctx, level);
    if victims.is_empty() {
        return Reclaim::NoResponders;
    }
    if let Some(t) = &ctx.trace {
        t.event(
            stream.trace_tag(),
            Some(role),
            EventKind::Pressure,
            shortfall(ctx, refused, bytes),
            Some(format!(
                "{} responder(s) under the {level:?} level",
                victims.len()
            )),
        );
    }
    // The device's memory and the machine ledger cannot be claimed (the
    // ledger is held to its limit for every process): retried after each
    // responder instead.
    let on_budget = !matches!(level, PressureLevel::Device | PressureLevel::Machine);
    let claim = on_budget.then(|| Claim::new(ctx, bytes));
    // Whether the allocation fits now: claimed in full on a budget level;
    // on the device, attempted (its outcome in `admitted`).
    let mut admitted = None;
    let mut fits = |claim: &Option<Claim<'_, C>>| -> bool {
        if let Some(claim) = claim {
            return claim.fits();
        }
        match stream.attempt(ctx, bytes, role) {
            Ok(memory) => {
                admitted = Some(Ok(memory));
                true
            }
            Err(Ok(_)) => false,
            Err(Err(fatal)) => {
                admitted = Some(Err(fatal));
                true
            }
        }
    };
    let mut done = fits(&claim);
    'rounds: for _ in 0..RECLAIM_ROUNDS {
        if done {
            break;
        }
        let mut freed = 0u64;
        for v in &victims {
            let req = PressureRequest {
                context: ctx.id,
                level,
                role,
                requested: bytes,
                shortfall: claim.as_ref().map_or_else(
                    || shortfall(ctx, refused, bytes),
                    |_| ctx.ledger.charges().claim_shortfall(),
                ),
            };
            ctx.ledger.note(Note::PressureCall);
            let gave = (v.responder.responder)(&req);
            freed = freed.saturating_add(gave);
            *reclaimed = reclaimed.saturating_add(gave);
            if fits(&claim) {
                done = true;
                break 'rounds;
            }
        }
        if freed == 0 {
            break;
        }
    }
    if let Some(result) = admitted {
        return match result {
            Ok(memory) => Reclaim::Admitted(memory),
            Err(e) => Reclaim::Failed(e),
        };
    }
    let Some(claim) = claim.filter(|_| done) else {
        return Reclaim::Asked;
    };
    // Claimed in full: the charge is held, allocate without charging again.
    if !ctx.accepting() {
        return Reclaim::Failed(ctx.unavailable_error());
    }
    match stream.make_charged(ctx, bytes, role) {
        Ok(memory) => {
            claim.keep();
            Reclaim::Admitted(memory)
        }
        Err(e) => Reclaim::Failed(e),
    }
}

/// Where the charge of [`allocate_charged`] is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Held {
    /// Taken out of a reservation.
    Reserved,
    /// A reclaim's claim.
    Claimed,
}

/// Allocate `bytes` in `tier` whose charge is already held (`held`): the
/// backend call and the live count of [`attempt`], without charging. The
/// caller holds a pin and puts the bytes back on error.
pub(crate) fn allocate_charged<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
    tier: Tier,
    held: Held,
) -> Result<C::Memory, GovernorError> {
    let Some(backend) = ctx.enter_on(stream.shard) else {
        return Err(ctx.unavailable_error());
    };
    let result = match tier {
        Tier::Device => backend.allocate(stream.raw(), bytes),
        _ => backend.allocate_in(stream.raw(), bytes, tier),
    };
    if result.is_ok() {
        let entry = Entry::new(bytes, role, tier, stream.shard);
        match held {
            Held::Reserved => ctx.ledger.admit_reserved(entry),
            Held::Claimed => ctx.ledger.admit(entry),
        }
    }
    drop(backend);
    result.map_err(|e| {
        if e.kind == BackendErrorKind::OutOfMemory {
            ctx.note_backend_error(&e);
            ctx.ledger.note(Note::Refusal);
            match tier {
                Tier::Device => exceeded(ctx, Denial::Device(e), bytes, role, Duration::ZERO, 0),
                _ => exceeded_in(ctx, tier, Denial::Device(e), bytes, role, Duration::ZERO),
            }
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
    refused: RefusedAt,
    bytes: u64,
) -> GovernorError {
    ctx.ledger.note(Note::Refusal);
    if let RefusedAt::Tier(tier, r) = refused {
        let refused = Denial::Budget(BudgetScope::Tier(tier), r);
        return exceeded_in(ctx, tier, refused, bytes, Role::Other, Duration::ZERO);
    }
    exceeded(ctx, refused.into(), bytes, Role::Other, Duration::ZERO, 0)
}

/// `Ok(memory)`, `Err(Ok(refusal))` to retry, or `Err(Err(error))` to fail.
#[allow(clippy::type_complexity)]
#[inline]
fn attempt<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    bytes: u64,
    role: Role,
) -> Result<C::Memory, Result<Denial, GovernorError>> {
    let entry = Entry::new(bytes, role, Tier::Device, stream.shard);
    ctx.ledger
        .charge(entry, stream.credit())
        .map_err(|refused| Ok(refused.into()))?;
    // Charged to every level now: returned on every path below that does
    // not end in a live buffer, unwinding out of the backend included.
    let charge = Charge { ctx, entry };
    // The gate closes only once retire has begun (force, teardown): this
    // allocation was not admitted, and says so with the error a retiring
    // context gives (`Reclaimed` is for buffers and streams that existed).
    let Some(backend) = ctx.enter_on(stream.shard) else {
        return Err(Err(ctx.unavailable_error()));
    };
    let result = backend.allocate(stream.raw(), bytes);
    if result.is_ok() {
        charge.admit();
    }
    drop(backend);
    result.map_err(|e| backend_refusal(ctx, e))
}

/// Bytes charged (to the tier's budget, and for the device tier to every
/// level above) for an allocation being made: given back when dropped,
/// unless [`admit`](Self::admit) says the allocation is live.
struct Charge<'a, C: DeviceContext> {
    ctx: &'a ContextInner<C>,
    entry: Entry,
}

impl<C: DeviceContext> Charge<'_, C> {
    /// The allocation succeeded: live, and the charge stays with its buffer.
    #[inline]
    fn admit(self) {
        self.ctx.ledger.admit(self.entry);
        std::mem::forget(self);
    }
}

impl<C: DeviceContext> Drop for Charge<'_, C> {
    fn drop(&mut self) {
        self.ctx.ledger.uncharge(self.entry);
    }
}

/// Bytes in the scope of `refused` that are on their way back: pending
/// releases, and on a shared or process budget also what retiring contexts
/// under it will
/// give back at teardown (a model swap: the old context's quarantined and
/// abandoned bytes return only when it is torn down, which bumps the shared
/// epoch). Read after the waiter registered and before the attempt it
/// guards: a byte counted here as no longer on its way is back in the budget.
fn pending_in_scope<C: DeviceContext>(ctx: &ContextInner<C>, refused: &Denial) -> u64 {
    match (refused, refused.above()) {
        (Denial::Budget(BudgetScope::Tier(tier), _), _) => ctx
            .ledger
            .charges()
            .tier_amounts(*tier)
            .map_or(0, |a| a.pending),
        (_, Some(which)) => ctx.ledger.charges().on_the_way(which),
        // The device tier's: pending releases of other tiers give back
        // nothing here.
        (_, None) => device_tier(ctx).1,
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
    /// Settlements of every context under a level above (the shared
    /// budget, the process budget).
    Above {
        ctx: &'a ContextInner<C>,
        which: Above,
        seen: u64,
    },
}

impl<'a, C: DeviceContext> SettlementWaiter<'a, C> {
    fn register(ctx: &'a ContextInner<C>, refused: &Denial) -> Self {
        match refused
            .above()
            .and_then(|which| Some((which, ctx.ledger.charges().epoch(which)?)))
        {
            Some((which, seen)) => Self::Above { ctx, which, seen },
            None => {
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
    fn covers(&self, refused: &Denial) -> bool {
        match self {
            Self::Above { which, .. } => refused.above() == Some(*which),
            Self::Context { .. } => refused.above().is_none(),
        }
    }

    /// Sleep until some release in scope settles after the registration,
    /// the context stops accepting work (retire, force, device loss: each
    /// wakes these notifiers after changing what `accepting` reads), or the
    /// deadline passes. Never polls.
    fn wait(&self, deadline: Instant) {
        match *self {
            Self::Above { ctx, which, seen } => {
                ctx.ledger
                    .charges()
                    .wait_above(which, seen, deadline, || !ctx.accepting());
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
/// budget, its shared budget, the process budget above that, or the device's
/// total memory (when the backend reports one). `None` when the request could fit once enough is released.
fn never_fits<C: DeviceContext>(ctx: &ContextInner<C>, bytes: u64) -> Option<Denial> {
    let context = ctx.ledger.charges().limit();
    if bytes > context {
        let charged = ctx.ledger.charges().charged();
        return Some(Denial::Budget(
            BudgetScope::Context,
            Refusal {
                charged,
                limit: context,
            },
        ));
    }
    if let Some(s) = ctx.ledger.charges().shared() {
        if bytes > s.limit() {
            return Some(Denial::Budget(
                BudgetScope::Shared(s.label().to_owned()),
                Refusal {
                    charged: s.charged(),
                    limit: s.limit(),
                },
            ));
        }
    }
    if let Some(p) = ctx.ledger.charges().process() {
        if bytes > p.limit() {
            return Some(Denial::Budget(
                BudgetScope::Process(p.label().to_owned()),
                Refusal {
                    charged: p.charged(),
                    limit: p.limit(),
                },
            ));
        }
    }
    #[cfg(target_os = "linux")]
    if let Some(m) = ctx.ledger.charges().machine() {
        let m = m.inner();
        if bytes > m.ledger_limit() {
            let r = m.refusal(bytes, crate::machine::RefusedBy::Ledger, None);
            return Some(Denial::Machine(Box::new(r)));
        }
    }
    let total = ctx.description.total_bytes;
    if total > 0 && bytes > total {
        let (live, pending, quarantined) = device_tier(ctx);
        let charged = live
            .saturating_add(pending)
            .saturating_add(quarantined)
            .saturating_add(ctx.ledger.charges().awaiting_teardown());
        return Some(Denial::Budget(
            BudgetScope::Device,
            Refusal {
                charged,
                limit: total,
            },
        ));
    }
    None
}

fn shortfall<C: DeviceContext>(ctx: &ContextInner<C>, refused: &Denial, bytes: u64) -> u64 {
    match refused {
        Denial::Budget(_, r) => r.charged.saturating_add(bytes).saturating_sub(r.limit),
        #[cfg(target_os = "linux")]
        Denial::Machine(m) => match m.by {
            crate::machine::RefusedBy::Ledger => bytes.saturating_sub(m.available()),
            crate::machine::RefusedBy::ProcessLimit => m
                .process_charged
                .saturating_add(bytes)
                .saturating_sub(m.process_limit),
            // No room made here can admit into a slot that is not its own.
            crate::machine::RefusedBy::SlotLost => bytes,
        },
        Denial::Device(_) => {
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
    refused: Denial,
    bytes: u64,
    role: Role,
    waited: Duration,
    reclaimed: u64,
) -> GovernorError {
    let above = refused.above();
    #[cfg(target_os = "linux")]
    let mut machine = None;
    let (
        scope,
        charged,
        pending,
        quarantined,
        awaiting_teardown,
        outside,
        limit,
        available,
        driver,
    ) = match refused {
        #[cfg(target_os = "linux")]
        Denial::Machine(m) => {
            let a = ctx
                .ledger
                .charges()
                .amounts(Above::Process)
                .expect("a machine refusal implies a process level");
            let (limit, charged, available) = match m.by {
                crate::machine::RefusedBy::Ledger => (m.limit, m.charged, m.available()),
                crate::machine::RefusedBy::ProcessLimit => (
                    m.process_limit,
                    m.process_charged,
                    m.process_limit.saturating_sub(m.process_charged),
                ),
                crate::machine::RefusedBy::SlotLost => (m.limit, m.charged, 0),
            };
            let out = (
                BudgetScope::Machine(m.ledger.clone()),
                charged,
                a.pending,
                a.quarantined,
                a.awaiting_teardown,
                m.outside,
                limit,
                available,
                None,
            );
            machine = Some(m);
            out
        }
        Denial::Budget(scope, r) if above.is_some() => {
            let a = above
                .and_then(|which| ctx.ledger.charges().amounts(which))
                .expect("a refusal above the context implies that level");
            (
                scope,
                r.charged,
                a.pending,
                a.quarantined,
                a.awaiting_teardown,
                a.outside,
                r.limit,
                r.limit.saturating_sub(r.charged),
                None,
            )
        }
        Denial::Budget(scope, r) => {
            let (_, pending, quarantined) = device_tier(ctx);
            (
                scope,
                r.charged,
                pending,
                quarantined,
                ctx.ledger.charges().awaiting_teardown(),
                ctx.ledger.outside_bytes(),
                r.limit,
                r.limit.saturating_sub(r.charged),
                None,
            )
        }
        Denial::Device(e) => {
            let info = ctx.enter().and_then(|b| b.memory_info().ok());
            let (free, total) =
                info.map_or((0, ctx.description.total_bytes), |m| (m.free, m.total));
            let (live, pending, quarantined) = device_tier(ctx);
            let awaiting = ctx.ledger.charges().awaiting_teardown();
            let outside = ctx.ledger.outside_bytes();
            (
                BudgetScope::Device,
                live.saturating_add(pending)
                    .saturating_add(quarantined)
                    .saturating_add(awaiting)
                    .saturating_add(outside),
                pending,
                quarantined,
                awaiting,
                outside,
                total,
                free,
                Some(e),
            )
        }
    };
    // What is charged and neither reserved, pending, quarantined, awaiting
    // teardown nor outside memgov is live. The device's figure counts
    // buffers only: a reservation holds budget, not device memory.
    let reserved_by: Vec<_> = match scope {
        BudgetScope::Device => Vec::new(),
        _ => ctx
            .reservations
            .usage()
            .into_iter()
            .filter(|r| r.tier == Tier::Device)
            .collect(),
    };
    let reserved = reserved_by.iter().map(|r| r.left).sum();
    let live = charged
        .saturating_sub(reserved)
        .saturating_sub(pending)
        .saturating_sub(quarantined)
        .saturating_sub(awaiting_teardown)
        .saturating_sub(outside);
    let limit_from = match scope {
        BudgetScope::Process(_) => ctx.ledger.charges().process(),
        _ => None,
    }
    .and_then(|p| p.limit_from().map(str::to_owned));
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
        outside,
        limit,
        available,
        waited,
        reclaimed_by_responders: reclaimed,
        driver,
        limit_from,
        #[cfg(target_os = "linux")]
        machine,
        holders: Default::default(),
    }))
}
