//! Fault injection over any backend: [`FaultInjecting<C>`].
//!
//! A transparent wrapper that, according to a [`FaultPlan`], makes backend
//! operations fail, stall, drop the [`RetireSignal`] of a free unsignalled, or
//! report device loss — so that the governor's error paths can be exercised on
//! every backend, real or simulated, reproducibly from a seed.
//!
//! # What each fault does
//!
//! | [`Fault`] | effect on the wrapped call |
//! |---|---|
//! | [`Fault::Error`] | returns a [`BackendError`] of kind [`BackendErrorKind::Other`] without calling the backend (`free_async` hands memory and signal back) |
//! | [`Fault::OutOfMemory`] | same, with kind [`BackendErrorKind::OutOfMemory`] |
//! | [`Fault::Delay`] | sleeps, then calls the backend normally |
//! | [`Fault::DropSignal`] | `free_async` only: accepts the free, keeps the memory parked (it is released with the context at teardown) and drops the signal unfired, i.e. reports that the free will never execute |
//! | [`Fault::DeviceLost`] | the device is lost from this call on: this call and every later device call return [`BackendErrorKind::DeviceLost`]; the wrapped backend is told through [`DeviceContext::device_lost`] so that it stops executing queued work |
//!
//! Faults never leak: memory and streams the wrapper keeps back are handed to
//! the wrapped backend's `teardown` (streams are destroyed first); a faulted
//! `teardown` still tears the wrapped backend down and then reports the
//! error; a faulted `destroy_stream` parks the stream and destroys it before
//! teardown.
//!
//! # Plans
//!
//! A plan is a list of rules, each naming an [`Operation`], a [`Fault`] and
//! *when* ([`Trigger`]): the n-th call, every call, or at random with a given
//! probability from a seeded generator (splitmix64), so a failing seed
//! reproduces exactly (for a given order of calls). The first matching rule
//! wins; a plan can be replaced at run time through the [`FaultControl`]
//! handle, which stays usable after the backend has been moved into a
//! governor.
//!
//! ```
//! use memgov::fault::{Fault, FaultInjecting, FaultPlan, Operation};
//! use memgov::host::{HostConfig, HostContext};
//! use memgov::{Alloc, ContextConfig, Governor, GovernorError, Role};
//! use std::time::Duration;
//!
//! // The second allocation fails; every free is delayed by 1 ms.
//! let plan = FaultPlan::new()
//!     .nth(Operation::Allocate, 2, Fault::Error)
//!     .always(Operation::FreeAsync, Fault::Delay(Duration::from_millis(1)));
//! let backend = FaultInjecting::new(HostContext::new(HostConfig::default())?, plan);
//! let control = backend.control();
//! let gov = Governor::new();
//! let ctx = gov.register(backend, ContextConfig::new());
//! let stream = ctx.create_stream("s")?;
//! let first = ctx.allocate(&stream, Alloc::new(4096, Role::Workspace))?;
//! let second = ctx.allocate(&stream, Alloc::new(4096, Role::Workspace));
//! assert!(matches!(second, Err(GovernorError::Backend { .. })));
//! assert_eq!(control.injected(Operation::Allocate), 1);
//! drop((first, stream));
//! let report = ctx.retire().wait_timeout(Duration::from_secs(5))?;
//! assert_eq!(report.retired_releases, 1);
//!
//! // Random faults, reproducible from the seed:
//! let _plan = FaultPlan::seeded(42, 0.05, &[Fault::Error, Fault::DropSignal]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::{
    BackendError, BackendErrorKind, DeviceContext, DeviceDescription, MemoryInfo, RetireSignal,
    Tier,
};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use memgov_sync::lock;

/// A backend operation that faults can be injected into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operation {
    /// [`DeviceContext::memory_info`]
    MemoryInfo,
    /// [`DeviceContext::create_stream`]
    CreateStream,
    /// [`DeviceContext::destroy_stream`]
    DestroyStream,
    /// [`DeviceContext::allocate`] and [`DeviceContext::allocate_in`], in
    /// every tier
    Allocate,
    /// [`DeviceContext::free_async`]
    FreeAsync,
    /// [`DeviceContext::write`]
    Write,
    /// [`DeviceContext::read`]
    Read,
    /// [`DeviceContext::synchronize`]
    Synchronize,
    /// [`DeviceContext::order_after`]
    OrderAfter,
    /// [`DeviceContext::teardown`]
    Teardown,
}

impl Operation {
    /// Every operation, in trait order.
    pub const ALL: [Operation; 10] = [
        Operation::MemoryInfo,
        Operation::CreateStream,
        Operation::DestroyStream,
        Operation::Allocate,
        Operation::FreeAsync,
        Operation::Write,
        Operation::Read,
        Operation::Synchronize,
        Operation::OrderAfter,
        Operation::Teardown,
    ];

    /// The trait method's name.
    pub const fn name(self) -> &'static str {
        match self {
            Operation::MemoryInfo => "memory_info",
            Operation::CreateStream => "create_stream",
            Operation::DestroyStream => "destroy_stream",
            Operation::Allocate => "allocate",
            Operation::FreeAsync => "free_async",
            Operation::Write => "write",
            Operation::Read => "read",
            Operation::Synchronize => "synchronize",
            Operation::OrderAfter => "order_after",
            Operation::Teardown => "teardown",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What to do to one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Fail with [`BackendErrorKind::Other`] without calling the backend.
    Error,
    /// Fail with [`BackendErrorKind::OutOfMemory`] without calling the backend.
    OutOfMemory,
    /// Sleep this long, then call the backend.
    Delay(Duration),
    /// `free_async` only (elsewhere: no effect): accept the free, drop its
    /// signal unfired, keep the memory until teardown.
    DropSignal,
    /// Declare the device lost from this call on.
    DeviceLost,
}

impl Fault {
    /// Every kind of fault, with a 1 ms delay.
    pub const ALL: [Fault; 5] = [
        Fault::Error,
        Fault::OutOfMemory,
        Fault::Delay(Duration::from_millis(1)),
        Fault::DropSignal,
        Fault::DeviceLost,
    ];

    /// A short name for tables.
    pub fn name(&self) -> &'static str {
        match self {
            Fault::Error => "error",
            Fault::OutOfMemory => "out-of-memory",
            Fault::Delay(_) => "delay",
            Fault::DropSignal => "drop-signal",
            Fault::DeviceLost => "device-lost",
        }
    }

    /// Whether this fault changes anything for `op`.
    pub fn applies_to(&self, op: Operation) -> bool {
        match self {
            Fault::DropSignal => op == Operation::FreeAsync,
            _ => true,
        }
    }
}

/// When a rule fires.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Trigger {
    /// On the n-th call of the operation (1-based), once.
    Nth(u64),
    /// On every call.
    Always,
    /// On each call with this probability (0.0 ..= 1.0), drawn from the plan's
    /// seeded generator.
    Probability(f64),
}

#[derive(Debug, Clone)]
struct Rule {
    op: Option<Operation>,
    trigger: Trigger,
    faults: Vec<Fault>,
}

/// Which faults to inject, and when. Built with the methods below; the first
/// matching rule wins.
#[derive(Debug, Clone)]
pub struct FaultPlan {
    seed: u64,
    rules: Vec<Rule>,
}

impl Default for FaultPlan {
    fn default() -> Self {
        Self::new()
    }
}

impl FaultPlan {
    /// A plan that injects nothing (seed 0).
    pub fn new() -> Self {
        Self {
            seed: 0,
            rules: Vec::new(),
        }
    }

    /// Inject `fault` on the `n`-th call (1-based) of `op`.
    pub fn nth(mut self, op: Operation, n: u64, fault: Fault) -> Self {
        self.rules.push(Rule {
            op: Some(op),
            trigger: Trigger::Nth(n),
            faults: vec![fault],
        });
        self
    }

    /// Inject `fault` on every call of `op`.
    pub fn always(mut self, op: Operation, fault: Fault) -> Self {
        self.rules.push(Rule {
            op: Some(op),
            trigger: Trigger::Always,
            faults: vec![fault],
        });
        self
    }

    /// Inject `fault` on each call of `op` with probability `p`.
    pub fn sometimes(mut self, op: Operation, p: f64, fault: Fault) -> Self {
        self.rules.push(Rule {
            op: Some(op),
            trigger: Trigger::Probability(p),
            faults: vec![fault],
        });
        self
    }

    /// Random faults on every operation: each call draws, with probability
    /// `p`, one of `faults` that applies to it. Reproducible from `seed`.
    pub fn seeded(seed: u64, p: f64, faults: &[Fault]) -> Self {
        Self {
            seed,
            rules: vec![Rule {
                op: None,
                trigger: Trigger::Probability(p),
                faults: faults.to_vec(),
            }],
        }
    }

    /// Replace the seed of the generator behind probabilistic rules.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

/// splitmix64: a tiny seedable generator, good enough to pick faults, and
/// the one harnesses use for their own seeded choices so that a seed printed
/// by a failing run replays the same run.
///
/// ```
/// let (mut a, mut b) = (memgov::fault::SplitMix64::new(7), memgov::fault::SplitMix64::new(7));
/// assert_eq!(a.next_u64(), b.next_u64());
/// ```
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator that starts from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// True with probability `p` (never for `p <= 0`).
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p && p > 0.0
    }
}

struct PlanState {
    plan: FaultPlan,
    rng: SplitMix64,
    calls: [u64; Operation::ALL.len()],
}

impl PlanState {
    fn new(plan: FaultPlan) -> Self {
        let rng = SplitMix64::new(plan.seed);
        Self {
            plan,
            rng,
            calls: [0; Operation::ALL.len()],
        }
    }

    fn decide(&mut self, op: Operation) -> Option<Fault> {
        self.calls[op.index()] += 1;
        let n = self.calls[op.index()];
        for rule in &self.plan.rules {
            if rule.op.is_some_and(|o| o != op) {
                continue;
            }
            let applicable: Vec<Fault> = rule
                .faults
                .iter()
                .copied()
                .filter(|f| f.applies_to(op))
                .collect();
            if applicable.is_empty() {
                continue;
            }
            let fire = match rule.trigger {
                Trigger::Nth(k) => n == k,
                Trigger::Always => true,
                Trigger::Probability(p) => self.rng.chance(p),
            };
            if fire {
                let pick = if applicable.len() == 1 {
                    0
                } else {
                    (self.rng.next_u64() % applicable.len() as u64) as usize
                };
                return Some(applicable[pick]);
            }
        }
        None
    }
}

struct Shared<C: DeviceContext> {
    state: Mutex<PlanState>,
    injected: [AtomicU64; Operation::ALL.len()],
    lost: AtomicBool,
    inner_told_lost: AtomicBool,
    dropped_signals: AtomicU64,
    parked_memory: Mutex<Vec<C::Memory>>,
    parked_streams: Mutex<Vec<C::Stream>>,
    torn_down: AtomicBool,
}

/// Controls and observes a [`FaultInjecting`] backend from outside, also after
/// it has been moved into a governor and after its teardown.
pub struct FaultControl<C: DeviceContext>(Arc<Shared<C>>);

impl<C: DeviceContext> Clone for FaultControl<C> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<C: DeviceContext> fmt::Debug for FaultControl<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultControl")
            .field("injected", &self.total_injected())
            .field("lost", &self.is_lost())
            .field("dropped_signals", &self.dropped_signals())
            .finish()
    }
}

impl<C: DeviceContext> FaultControl<C> {
    /// Replace the plan (call counts restart at zero, the generator at the
    /// new plan's seed).
    pub fn set_plan(&self, plan: FaultPlan) {
        *lock(&self.0.state) = PlanState::new(plan);
    }

    /// Faults injected into `op` so far (delays included).
    pub fn injected(&self, op: Operation) -> u64 {
        self.0.injected[op.index()].load(Ordering::SeqCst)
    }

    /// Faults injected so far, all operations.
    pub fn total_injected(&self) -> u64 {
        self.0
            .injected
            .iter()
            .map(|a| a.load(Ordering::SeqCst))
            .sum()
    }

    /// Calls of `op` seen so far under the current plan.
    pub fn calls(&self, op: Operation) -> u64 {
        lock(&self.0.state).calls[op.index()]
    }

    /// Whether an injected device loss has happened.
    pub fn is_lost(&self) -> bool {
        self.0.lost.load(Ordering::SeqCst)
    }

    /// Signals dropped unfired by [`Fault::DropSignal`].
    pub fn dropped_signals(&self) -> u64 {
        self.0.dropped_signals.load(Ordering::SeqCst)
    }

    /// Allocations kept back by [`Fault::DropSignal`] and not yet released
    /// with the context.
    pub fn parked_memory(&self) -> usize {
        lock(&self.0.parked_memory).len()
    }

    /// Whether the wrapped backend has been torn down.
    pub fn torn_down(&self) -> bool {
        self.0.torn_down.load(Ordering::SeqCst)
    }
}

/// A backend wrapped with a [`FaultPlan`]. Behaves exactly like `C` except
/// where the plan says otherwise. See the [module documentation](self).
pub struct FaultInjecting<C: DeviceContext> {
    inner: C,
    shared: Arc<Shared<C>>,
}

impl<C: DeviceContext> fmt::Debug for FaultInjecting<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultInjecting")
            .field("control", &self.control())
            .finish()
    }
}

fn injected_error(op: Operation, kind: BackendErrorKind) -> BackendError {
    BackendError::new(
        "fault",
        op.name(),
        kind,
        format!("{kind:?} injected into {op} by FaultInjecting"),
    )
}

fn lost_error(op: Operation) -> BackendError {
    BackendError::new(
        "fault",
        op.name(),
        BackendErrorKind::DeviceLost,
        format!("device lost (injected by FaultInjecting); {op} refused"),
    )
}

impl<C: DeviceContext> FaultInjecting<C> {
    /// Wrap `inner` with `plan`.
    pub fn new(inner: C, plan: FaultPlan) -> Self {
        Self {
            inner,
            shared: Arc::new(Shared {
                state: Mutex::new(PlanState::new(plan)),
                injected: Default::default(),
                lost: AtomicBool::new(false),
                inner_told_lost: AtomicBool::new(false),
                dropped_signals: AtomicU64::new(0),
                parked_memory: Mutex::new(Vec::new()),
                parked_streams: Mutex::new(Vec::new()),
                torn_down: AtomicBool::new(false),
            }),
        }
    }

    /// A handle to change the plan and read what was injected.
    pub fn control(&self) -> FaultControl<C> {
        FaultControl(self.shared.clone())
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    fn tell_inner_lost(&self) {
        if !self.shared.inner_told_lost.swap(true, Ordering::SeqCst) {
            self.inner.device_lost();
        }
    }

    /// Decide what happens to one call of `op`. The plan's lock is released
    /// before anything else happens (delays sleep without it; the backend is
    /// never called under it). `Err` means: fail the call with this error.
    fn gate(&self, op: Operation) -> Result<Option<Fault>, BackendError> {
        let device_call = !matches!(op, Operation::DestroyStream | Operation::Teardown);
        if device_call && self.shared.lost.load(Ordering::SeqCst) {
            return Err(lost_error(op));
        }
        let fault = lock(&self.shared.state).decide(op);
        let Some(fault) = fault else { return Ok(None) };
        self.shared.injected[op.index()].fetch_add(1, Ordering::SeqCst);
        match fault {
            Fault::Error => Err(injected_error(op, BackendErrorKind::Other)),
            Fault::OutOfMemory => Err(injected_error(op, BackendErrorKind::OutOfMemory)),
            Fault::Delay(d) => {
                std::thread::sleep(d);
                Ok(Some(fault))
            }
            Fault::DropSignal => Ok(Some(fault)),
            Fault::DeviceLost => {
                self.shared.lost.store(true, Ordering::SeqCst);
                self.tell_inner_lost();
                Err(lost_error(op))
            }
        }
    }
}

impl<C: DeviceContext> DeviceContext for FaultInjecting<C> {
    type Stream = C::Stream;
    type Memory = C::Memory;

    fn describe(&self) -> DeviceDescription {
        self.inner.describe()
    }

    fn identity(&self) -> crate::DeviceIdentity {
        self.inner.identity()
    }

    fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        self.gate(Operation::MemoryInfo)?;
        self.inner.memory_info()
    }

    fn create_stream(&self) -> Result<C::Stream, BackendError> {
        self.gate(Operation::CreateStream)?;
        self.inner.create_stream()
    }

    fn destroy_stream(&self, stream: C::Stream) -> Result<(), BackendError> {
        match self.gate(Operation::DestroyStream) {
            Ok(_) => self.inner.destroy_stream(stream),
            Err(e) => {
                // The stream is kept and destroyed before teardown: a fault
                // must not leak it.
                lock(&self.shared.parked_streams).push(stream);
                Err(e)
            }
        }
    }

    fn allocate(&self, stream: &C::Stream, bytes: u64) -> Result<C::Memory, BackendError> {
        self.gate(Operation::Allocate)?;
        self.inner.allocate(stream, bytes)
    }

    fn allocate_in(
        &self,
        stream: &C::Stream,
        bytes: u64,
        tier: Tier,
    ) -> Result<C::Memory, BackendError> {
        self.gate(Operation::Allocate)?;
        self.inner.allocate_in(stream, bytes, tier)
    }

    fn free_async(
        &self,
        stream: &C::Stream,
        memory: C::Memory,
        retired: RetireSignal,
    ) -> Result<(), (C::Memory, RetireSignal, BackendError)> {
        match self.gate(Operation::FreeAsync) {
            Err(e) => Err((memory, retired, e)),
            Ok(Some(Fault::DropSignal)) => {
                lock(&self.shared.parked_memory).push(memory);
                self.shared.dropped_signals.fetch_add(1, Ordering::SeqCst);
                drop(retired);
                Ok(())
            }
            Ok(_) => self.inner.free_async(stream, memory, retired),
        }
    }

    fn write(
        &self,
        stream: &C::Stream,
        memory: &C::Memory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.gate(Operation::Write)?;
        self.inner.write(stream, memory, offset, src)
    }

    fn read(
        &self,
        stream: &C::Stream,
        memory: &C::Memory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        self.gate(Operation::Read)?;
        self.inner.read(stream, memory, offset, dst)
    }

    fn synchronize(&self, stream: &C::Stream) -> Result<(), BackendError> {
        self.gate(Operation::Synchronize)?;
        self.inner.synchronize(stream)
    }

    fn order_after(&self, stream: &C::Stream, after: &C::Stream) -> Result<(), BackendError> {
        self.gate(Operation::OrderAfter)?;
        self.inner.order_after(stream, after)
    }

    fn device_lost(&self) {
        self.shared.lost.store(true, Ordering::SeqCst);
        self.tell_inner_lost();
    }

    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        let fault = self.gate(Operation::Teardown);
        let lost = lost || self.shared.lost.load(Ordering::SeqCst);
        // Streams parked by a faulted destroy_stream go first, then the
        // backend itself; parked memory dies with it.
        let streams = std::mem::take(&mut *lock(&self.shared.parked_streams));
        let mut first_err = None;
        if !lost {
            for s in streams {
                if let Err(e) = self.inner.destroy_stream(s) {
                    first_err.get_or_insert(e);
                }
            }
        } else {
            drop(streams);
        }
        let result = self.inner.teardown(lost);
        let parked = std::mem::take(&mut *lock(&self.shared.parked_memory));
        drop(parked);
        self.shared.torn_down.store(true, Ordering::SeqCst);
        result?;
        if let Some(e) = first_err {
            return Err(e);
        }
        fault.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_plans_reproduce() {
        let draw = |seed| {
            let mut st = PlanState::new(FaultPlan::seeded(seed, 0.3, &Fault::ALL));
            (0..200)
                .map(|i| st.decide(Operation::ALL[i % Operation::ALL.len()]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let hits = draw(7).iter().filter(|f| f.is_some()).count();
        assert!(
            (30..=90).contains(&hits),
            "p = 0.3 of 200 calls gave {hits}"
        );
    }

    #[test]
    fn nth_fires_once_and_drop_signal_only_on_free() {
        let mut st = PlanState::new(FaultPlan::new().nth(Operation::Allocate, 2, Fault::Error));
        assert_eq!(st.decide(Operation::Allocate), None);
        assert_eq!(st.decide(Operation::Allocate), Some(Fault::Error));
        assert_eq!(st.decide(Operation::Allocate), None);
        let mut st = PlanState::new(FaultPlan::new().always(Operation::Write, Fault::DropSignal));
        assert_eq!(st.decide(Operation::Write), None);
        let mut st =
            PlanState::new(FaultPlan::new().always(Operation::FreeAsync, Fault::DropSignal));
        assert_eq!(st.decide(Operation::FreeAsync), Some(Fault::DropSignal));
    }
}
