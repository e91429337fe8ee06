//! What the governor reports. Every message carries the numbers and the way out.

use super::report::{Outstanding, TeardownReport};
use super::role::Role;
use super::units::{Bytes, Elapsed};
use crate::{BackendError, ProviderContextIdentity, ProviderContextPinError};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A context as every error names it: its identity and its label
/// (`#1.0 'llm'`), so that a message read in a log says which model or
/// device it is about without a lookup.
///
/// One pointer wide: errors carry it on every path, and the hot paths return
/// `Result`s whose size the error sets.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ContextName(Arc<(ProviderContextIdentity, Box<str>)>);

impl ContextName {
    /// The name of context `id` labelled `label`.
    pub fn new(id: ProviderContextIdentity, label: impl Into<Box<str>>) -> Self {
        Self(Arc::new((id, label.into())))
    }

    /// The context's identity.
    pub fn id(&self) -> ProviderContextIdentity {
        self.0 .0
    }

    /// The label it was registered with (`ContextConfig::label`), or
    /// `backend:ordinal` when it was given none.
    pub fn label(&self) -> &str {
        &self.0 .1
    }
}

impl fmt::Display for ContextName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} '{}'", self.id(), self.label())
    }
}

impl fmt::Debug for ContextName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContextName({self})")
    }
}

impl PartialEq<ProviderContextIdentity> for ContextName {
    fn eq(&self, other: &ProviderContextIdentity) -> bool {
        self.id() == *other
    }
}

/// Which budget refused an allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetScope {
    /// The context's own budget.
    Context,
    /// A budget shared with other contexts, by label.
    Shared(String),
    /// The device itself (the backend reported out of memory).
    Device,
    /// The limit of a tier other than the device's
    /// ([`ContextConfig::tier_budget`](super::ContextConfig::tier_budget)),
    /// or, with `driver` set, the driver out of that tier's memory.
    Tier(crate::Tier),
    /// The [`ProcessBudget`](super::ProcessBudget) above the shared budget,
    /// by label.
    Process(String),
    /// The machine ledger every process on the device shares, by its device
    /// key ([`BudgetExceeded::machine`] has every process's figures).
    Machine(String),
}

impl fmt::Display for BudgetScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Context => f.write_str("context budget"),
            Self::Shared(l) => write!(f, "shared budget '{l}'"),
            Self::Device => f.write_str("device memory"),
            Self::Tier(t) => write!(f, "{t} tier budget"),
            Self::Process(l) => write!(f, "process budget '{l}'"),
            Self::Machine(k) => write!(f, "machine ledger '{k}'"),
        }
    }
}

/// The numbers behind a refused allocation.
///
/// When `requested` exceeds `limit`, the request could never fit in that
/// scope: it was refused at once, without waiting for pending releases or
/// asking pressure responders (`waited` is zero unless an earlier attempt
/// waited before the limit was lowered).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetExceeded {
    /// The context that asked.
    pub context: ContextName,
    /// Which budget refused.
    pub scope: BudgetScope,
    /// Role of the allocation.
    pub role: Role,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes live in the refusing scope (in buffers, not reserved).
    pub live: u64,
    /// Bytes this context holds in reservations and has not allocated yet:
    /// charged, and so part of what the refusing scope holds. (On a shared
    /// budget the reservations of other contexts count as their `live`.)
    pub reserved: u64,
    /// This context's reservations with bytes left, largest first.
    pub reserved_by: Vec<super::snapshot::ReservationUsage>,
    /// Bytes whose release is queued but has not retired.
    pub pending: u64,
    /// Bytes held in quarantine.
    pub quarantined: u64,
    /// Bytes whose free never ran (abandoned releases, buffers reclaimed by
    /// force or released on a lost device): charged until their context's
    /// teardown.
    pub awaiting_teardown: u64,
    /// Bytes recorded as allocated outside memgov in the refusing scope
    /// (runtime weights, library workspaces): charged, shown as "outside
    /// memgov".
    pub outside: u64,
    /// The limit of the refusing scope.
    pub limit: u64,
    /// `limit` minus everything charged.
    pub available: u64,
    /// How long the allocation waited for pending releases (or, on the
    /// machine ledger, for other processes to make room): zero when it did
    /// not wait, as under [`Admission::FailFast`](super::Admission::FailFast)
    /// or when nothing was pending, and then the message does not speak of
    /// waiting.
    pub waited: Duration,
    /// Bytes pressure responders said they gave back.
    pub reclaimed_by_responders: u64,
    /// What the driver said, when the device itself refused
    /// ([`BudgetScope::Device`]).
    pub driver: Option<BackendError>,
    /// The variable the refusing level's limit came from, when the cluster
    /// granted it ([`ProcessBudget::granted`](super::ProcessBudget::granted);
    /// the machine ledger's own refusal carries it in
    /// [`MachineRefusal::process_limit_from`](crate::machine::MachineRefusal::process_limit_from)).
    pub limit_from: Option<String>,
    /// Every process's figures, when the machine ledger refused
    /// ([`BudgetScope::Machine`]).
    #[cfg(target_os = "linux")]
    pub machine: Option<Box<crate::machine::MachineRefusal>>,
    /// Who holds the memory, as the refusing context sees it: its largest
    /// call sites and roles, its block cache, its sleeping memory.
    pub holders: Holders,
}

/// Who holds the memory at a refusal, as the refusing context sees it
/// ([`BudgetExceeded::holders`]). Filled in for refusals of
/// [`ContextHandle::allocate`](crate::ContextHandle::allocate),
/// [`Reservation::allocate`](crate::Reservation::allocate) and
/// [`ContextHandle::reserve`](crate::ContextHandle::reserve).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Holders {
    /// The context's call sites holding the most live bytes, largest first,
    /// at most [`Holders::NAMED`]; empty with attribution off
    /// ([`ContextConfig::attribution`](super::ContextConfig::attribution)).
    pub by_site: Vec<super::snapshot::SiteUsage>,
    /// The context's roles holding live bytes, largest first.
    pub by_role: Vec<(Role, u64)>,
    /// Bytes the context's block cache keeps: charged, given back by
    /// [`ContextHandle::trim_cache`](crate::ContextHandle::trim_cache).
    pub cached: u64,
    /// Bytes of the context's memory asleep: off every budget until a wake
    /// admits them again.
    pub asleep: u64,
    /// Whether the context attributes allocations to call sites.
    pub attributed: bool,
}

impl Holders {
    /// How many sites a refusal names.
    pub const NAMED: usize = 5;
}

impl fmt::Display for Holders {
    /// `held at src/a.rs:10:5 1.0 GiB (4 buffers), ...; by role: ...;
    /// cache keeps ...; asleep ...`, the parts with something to say.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        if !self.by_site.is_empty() {
            f.write_str("held at ")?;
            for (i, s) in self.by_site.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{} {:#}", s.site, Bytes(s.live_bytes))?;
                if let Some(label) = &s.label {
                    write!(f, " '{label}'")?;
                }
                write!(
                    f,
                    " ({} buffer{})",
                    s.live_count,
                    if s.live_count == 1 { "" } else { "s" }
                )?;
            }
            sep = "; ";
        }
        if !self.by_role.is_empty() {
            write!(f, "{sep}by role: ")?;
            for (i, (role, bytes)) in self.by_role.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{:#} {role}", Bytes(*bytes))?;
            }
            sep = "; ";
        }
        if self.cached > 0 {
            write!(f, "{sep}the block cache keeps {:#}", Bytes(self.cached))?;
            sep = "; ";
        }
        if self.asleep > 0 {
            write!(f, "{sep}{:#} asleep", Bytes(self.asleep))?;
        }
        Ok(())
    }
}

impl BudgetExceeded {
    /// Bytes the request is short of: what it asked for less what is
    /// available.
    pub fn shortfall(&self) -> u64 {
        self.requested.saturating_sub(self.available)
    }
}

impl fmt::Display for BudgetExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "context {}: cannot admit {} of {} under the {}: {} live",
            self.context,
            Bytes(self.requested),
            self.role,
            self.scope,
            Bytes(self.live),
        )?;
        if self.reserved > 0 {
            write!(f, " + {} reserved (", Bytes(self.reserved))?;
            const NAMED: usize = 3;
            for (i, r) in self.reserved_by.iter().take(NAMED).enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{} by '{}'", Bytes(r.left), r.label)?;
            }
            if self.reserved_by.len() > NAMED {
                write!(f, ", {} more", self.reserved_by.len() - NAMED)?;
            }
            f.write_str(")")?;
        }
        write!(
            f,
            " + {} pending release + {} quarantined",
            Bytes(self.pending),
            Bytes(self.quarantined),
        )?;
        if self.awaiting_teardown > 0 {
            write!(f, " + {} awaiting teardown", Bytes(self.awaiting_teardown))?;
        }
        if self.outside > 0 {
            write!(f, " + {} outside memgov", Bytes(self.outside))?;
        }
        write!(f, " of a {} limit", Bytes(self.limit))?;
        if let Some(from) = &self.limit_from {
            write!(f, " (granted by {from})")?;
        }
        write!(f, " leaves {} available", Bytes(self.available))?;
        if let Some(e) = &self.driver {
            write!(f, " (the driver said: {e})")?;
        }
        if !self.waited.is_zero() {
            write!(
                f,
                " (after waiting {} for pending releases)",
                Elapsed(self.waited)
            )?;
        }
        if self.reclaimed_by_responders > 0 {
            write!(
                f,
                " (pressure responders gave back {})",
                Bytes(self.reclaimed_by_responders)
            )?;
        }
        let holders = self.holders.to_string();
        if !holders.is_empty() {
            write!(f, "; {holders}")?;
        }
        #[cfg(target_os = "linux")]
        if let Some(m) = &self.machine {
            write!(f, "; {m}")?;
            // The way out with the most to gain: the other process furthest
            // above its floor (what it holds beyond what it was promised).
            let above = m
                .holders
                .iter()
                .filter(|h| h.charged > h.floor)
                .max_by_key(|h| h.charged - h.floor);
            if let (crate::machine::RefusedBy::Ledger, Some(h)) = (m.by, above) {
                write!(
                    f,
                    "; first: '{}' (pid {}) holds {:#} above its {:#} floor",
                    h.name,
                    h.pid,
                    Bytes(h.charged - h.floor),
                    Bytes(h.floor)
                )?;
                if h.cached > 0 {
                    write!(
                        f,
                        ", {:#} of it in block caches it can trim",
                        Bytes(h.cached)
                    )?;
                }
            }
            return Ok(());
        }
        let shortfall = self.shortfall();
        let unused = self
            .reserved_by
            .iter()
            .filter(|r| r.left >= shortfall)
            .min_by_key(|r| r.left);
        if self.requested > self.limit {
            let way_out = match (&self.scope, &self.limit_from) {
                (BudgetScope::Device, _) => "split the allocation or use a device with more memory",
                (_, Some(_)) => "ask the cluster for a larger grant or split the allocation",
                _ => "raise the budget or split the allocation",
            };
            write!(
                f,
                "; {} can never fit under a {} limit: {way_out}",
                Bytes(self.requested),
                Bytes(self.limit)
            )
        } else if let BudgetScope::Tier(t) = self.scope {
            let wait = if self.pending > 0 {
                " or wait for their pending releases (Admission::WaitForPending)"
            } else {
                ""
            };
            write!(
                f,
                "; release {t} buffers{wait}, or raise the {t} limit (ContextConfig::tier_budget)"
            )
        } else if self.holders.cached >= shortfall && self.holders.cached > 0 {
            write!(
                f,
                "; trim the block cache (ContextHandle::trim_cache): it keeps {:#}, the request is {:#} short",
                Bytes(self.holders.cached),
                Bytes(shortfall)
            )
        } else if let Some(r) = unused {
            write!(
                f,
                "; drop or shrink the reservation '{}': {:#} of it is unused, the request is {:#} short",
                r.label,
                Bytes(r.left),
                Bytes(shortfall)
            )
        } else {
            let raise = match &self.limit_from {
                Some(_) => "ask the cluster for a larger grant",
                None => "raise the budget",
            };
            if self.pending > 0 {
                write!(f, "; wait for pending releases to retire (Admission::WaitForPending), release buffers, or {raise}")
            } else if let Some(top) = self.holders.by_site.first() {
                write!(
                    f,
                    "; release buffers made at {} (it holds {:#}), register a pressure responder, or {raise}",
                    top.site,
                    Bytes(top.live_bytes)
                )
            } else {
                write!(
                    f,
                    "; release buffers, register a pressure responder, or {raise}"
                )
            }
        }
    }
}

/// The operation that was handed an object of another context
/// ([`GovernorError::WrongContext`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ContextOperation {
    /// [`ContextHandle::allocate`](crate::ContextHandle::allocate): the
    /// operation's context is the handle's.
    Allocate,
    /// [`DeviceBuffer::record_stream`](crate::DeviceBuffer::record_stream):
    /// the operation's context is the buffer's.
    RecordStream,
    /// [`DeviceBuffer::release_on`](crate::DeviceBuffer::release_on): the
    /// operation's context is the buffer's.
    ReleaseOn,
    /// [`ContextHandle::migrate`](crate::ContextHandle::migrate): the
    /// operation's context is the target's.
    Migrate,
}

impl ContextOperation {
    /// The method's name, as a reader finds it in the docs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Allocate => "allocate",
            Self::RecordStream => "record_stream",
            Self::ReleaseOn => "release_on",
            Self::Migrate => "migrate",
        }
    }
}

impl fmt::Display for ContextOperation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What an operation was handed that belongs to another context
/// ([`GovernorError::WrongContext`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ForeignObject {
    /// A [`GovernedStream`](crate::GovernedStream), by its label.
    Stream {
        /// The label the stream was created with.
        label: String,
    },
}

impl fmt::Display for ForeignObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Stream { label } => write!(f, "stream '{label}'"),
        }
    }
}

/// The message of [`GovernorError::WrongContext`]: what was called on what,
/// what it was handed, and the way out, which depends on the operation.
fn wrong_context(
    operation: ContextOperation,
    context: &ContextName,
    passed: &ForeignObject,
    passed_context: &ContextName,
) -> String {
    let (on, way_out) = match operation {
        ContextOperation::Allocate => (
            format!("on context {context}"),
            format!("allocate on a stream of context {context} (ContextHandle::create_stream)"),
        ),
        ContextOperation::RecordStream => (
            format!("on a buffer of context {context}"),
            format!("record only streams of context {context}; nothing was recorded"),
        ),
        ContextOperation::ReleaseOn => (
            format!("of a buffer of context {context}"),
            format!("release it on a stream of context {context}; the buffer is handed back unchanged in ReleaseError::buffer"),
        ),
        ContextOperation::Migrate => (
            format!("into context {context}"),
            format!("copy on a stream of the target context {context}; every source buffer is handed back in MigrateError::buffers"),
        ),
    };
    format!("{operation} {on} was passed {passed} of context {passed_context}; {way_out}")
}

/// What stopped a context accepting work, named in the refusals that
/// follow ([`GovernorError::Pin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RetiredBy {
    /// [`ContextHandle::retire`](crate::ContextHandle::retire) (and
    /// [`RetireHandle::force`](crate::RetireHandle::force) after it).
    Retire,
    /// The [`Governor`](crate::Governor) it was registered with was dropped,
    /// which retires every context still registered.
    GovernorDropped,
}

impl fmt::Display for RetiredBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Retire => "ContextHandle::retire",
            Self::GovernorDropped => "the drop of its Governor",
        })
    }
}

/// The governor's words for a pin refusal: the contract's own message names
/// the context by identity only, which the variant already does with its
/// label; a refusal because the context retired says what retired it.
fn pin_refusal(refusal: &ProviderContextPinError, retired_by: &Option<RetiredBy>) -> &'static str {
    match (refusal, retired_by) {
        (ProviderContextPinError::ContextUnavailable(_), Some(RetiredBy::GovernorDropped)) => {
            "no longer accepting work: its Governor was dropped, which retires every context registered with it; keep the Governor alive while its contexts are in use, or register a new context with a live Governor"
        }
        (ProviderContextPinError::ContextUnavailable(_), Some(RetiredBy::Retire)) => {
            "no longer accepting work: retired by ContextHandle::retire (retiring or torn down); keep what was to be released, and register a new context for new work"
        }
        (ProviderContextPinError::ContextUnavailable(_), None) => {
            "no longer accepting work (retiring or torn down); keep what was to be released, and register a new context for new work"
        }
        (ProviderContextPinError::PinCountOverflow(_), _) => {
            "too many outstanding pins (ContextConfig::max_pins); drop pins, buffers or streams you no longer need"
        }
    }
}

/// What a [`GovernorError::Sleep`] could not sleep or wake.
fn sleep_subject(role: Option<Role>) -> String {
    match role {
        Some(r) => format!("its {r} role, which is "),
        None => "a context that is ".to_owned(),
    }
}

/// The way out of a [`GovernorError::Sleep`], by the state found.
fn sleep_way_out(state: super::snapshot::SleepState, role: Option<Role>) -> &'static str {
    use super::snapshot::SleepState::*;
    match (state, role) {
        (Awake, Some(_)) => {
            "its memory is the device's already; wake only roles put to sleep \
             (ContextHandle::sleeping_roles lists them)"
        }
        (Asleep, Some(_)) => {
            "it sleeps already; leave it out of the sleep, or wake it first \
             (ContextHandle::wake_with)"
        }
        (Awake, None) => {
            "it has nothing suspended to wake; put it to sleep first (ContextHandle::sleep_with)"
        }
        (Asleep, None) => "it sleeps already; wake it first (ContextHandle::wake_with)",
        (FallingAsleep | Waking, _) => {
            "another sleep or wake of it is running on another thread; retry once that returns"
        }
    }
}

/// Errors of governed operations.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GovernorError {
    /// The context is retiring or torn down, or has too many pins; the
    /// pin contract's refusal is in `refusal`.
    #[error("context {context}: {}", pin_refusal(refusal, retired_by))]
    Pin {
        /// The context.
        context: ContextName,
        /// Why the pin was refused.
        refusal: ProviderContextPinError,
        /// What retired the context, when the refusal is
        /// [`ContextUnavailable`](ProviderContextPinError::ContextUnavailable)
        /// because it did (`None` otherwise).
        retired_by: Option<RetiredBy>,
    },

    /// The allocation does not fit; every number is in the payload.
    #[error("{0}")]
    BudgetExceeded(Box<BudgetExceeded>),

    /// An allocation out of a reservation asked for more than the
    /// reservation has left; nothing changed.
    #[error("context {context}: reservation '{label}' has {} left, cannot allocate {} out of it; grow the reservation (Reservation::grow) or allocate outside it", Bytes(*left), Bytes(*requested))]
    ReservationExhausted {
        /// The reservation's context.
        context: ContextName,
        /// The reservation's label.
        label: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes the reservation had left.
        left: u64,
    },

    /// An allocation out of a reservation named a tier other than the
    /// reservation's; nothing changed.
    #[error("context {context}: reservation '{label}' holds {reservation} bytes, cannot allocate in {asked} out of it; leave the tier out of the Alloc (the reservation's is used) or reserve in {asked}")]
    WrongTier {
        /// The reservation's context.
        context: ContextName,
        /// The reservation's label.
        label: String,
        /// The reservation's tier.
        reservation: crate::Tier,
        /// The tier the allocation asked for.
        asked: crate::Tier,
    },

    /// Zero-byte allocations are refused: no driver gives them a stable
    /// address, and they would hold a pin for nothing.
    #[error("context {context}: zero-byte allocation of {role} refused; ask for at least 1 byte")]
    ZeroSized {
        /// The context asked.
        context: ContextName,
        /// The role asked for.
        role: Role,
    },

    /// An access outside the buffer.
    #[error("context {context}: {op} of {} at offset {offset} is out of bounds of a {} buffer; keep offset + len <= {size}", Bytes(*.len), Bytes(*.size))]
    OutOfBounds {
        /// The buffer's context.
        context: ContextName,
        /// `"write"` or `"read"`.
        op: &'static str,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Buffer size.
        size: u64,
    },

    /// An operation was handed an object of another context: a stream to
    /// allocate, record or release on, or to migrate with. Nothing was done;
    /// a buffer being released or migrated is handed back.
    #[error("{}", wrong_context(*.operation, .context, .passed, .passed_context))]
    WrongContext {
        /// What was called.
        operation: ContextOperation,
        /// The context the operation works in: the handle's for `allocate`
        /// and `migrate`, the buffer's for `record_stream` and `release_on`.
        context: ContextName,
        /// What it was handed.
        passed: ForeignObject,
        /// The context that owns what was handed.
        passed_context: ContextName,
    },

    /// The device was lost; nothing more will run on it.
    #[error(
        "context {context}: device lost ({reason}); retire the context and register a new one"
    )]
    DeviceLost {
        /// The lost context.
        context: ContextName,
        /// Why it was declared lost.
        reason: String,
    },

    /// The context was force-retired; this buffer or stream was reclaimed.
    #[error("context {context}: force-retired; its buffers and streams were reclaimed")]
    Reclaimed {
        /// The context.
        context: ContextName,
    },

    /// A sleep or wake the context's [`SleepState`](super::snapshot::SleepState)
    /// does not allow
    /// ([`ContextHandle::sleep_with`](crate::ContextHandle::sleep_with),
    /// [`wake_with`](crate::ContextHandle::wake_with)); nothing was done.
    #[error("context {context}: cannot {operation} {}{state}; {}", sleep_subject(*.role), sleep_way_out(*.state, *.role))]
    Sleep {
        /// The context.
        context: ContextName,
        /// `"sleep"` or `"wake"`.
        operation: &'static str,
        /// The state it was found in: the context's, or the role's when
        /// `role` is set.
        state: super::snapshot::SleepState,
        /// The role named in the call that was in the wrong state (a sleep
        /// of a role asleep already, a wake of a role awake); `None` when
        /// the context's state refused it.
        role: Option<Role>,
    },

    /// The backend reported an error.
    #[error("context {context}: {source}")]
    Backend {
        /// The context.
        context: ContextName,
        /// What the backend said.
        source: BackendError,
    },
}

impl GovernorError {
    /// `operation` in `context` was handed `stream`, which belongs to
    /// another context.
    pub(crate) fn wrong_context<C: crate::DeviceContext>(
        operation: ContextOperation,
        context: ContextName,
        stream: &crate::GovernedStream<C>,
    ) -> Self {
        Self::WrongContext {
            operation,
            context,
            passed: ForeignObject::Stream {
                label: stream.label().to_owned(),
            },
            passed_context: stream.context_name(),
        }
    }

    /// The context the error is about: the one the operation ran in.
    pub fn context(&self) -> &ContextName {
        match self {
            Self::Pin { context, .. }
            | Self::ReservationExhausted { context, .. }
            | Self::WrongTier { context, .. }
            | Self::ZeroSized { context, .. }
            | Self::OutOfBounds { context, .. }
            | Self::WrongContext { context, .. }
            | Self::DeviceLost { context, .. }
            | Self::Reclaimed { context }
            | Self::Sleep { context, .. }
            | Self::Backend { context, .. } => context,
            Self::BudgetExceeded(b) => &b.context,
        }
    }

    /// The pin contract's refusal, if this is one.
    pub fn pin_refusal(&self) -> Option<ProviderContextPinError> {
        match self {
            Self::Pin { refusal, .. } => Some(*refusal),
            _ => None,
        }
    }

    /// The budget numbers, if this is a budget refusal.
    pub fn budget(&self) -> Option<&BudgetExceeded> {
        match self {
            Self::BudgetExceeded(b) => Some(b),
            _ => None,
        }
    }
}

/// The step of a teardown that failed ([`RetireError::TeardownPanicked`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TeardownStep {
    /// The backend's [`DeviceContext::teardown`](crate::DeviceContext::teardown).
    Backend,
    /// The governor's teardown accounting: returning to the context's
    /// budgets (and every level above it) the charges no executed free
    /// returned.
    Accounting,
    /// Recording the teardown: the context's trace, the `tracing` event
    /// (a subscriber is user code).
    Reporting,
}

impl fmt::Display for TeardownStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Backend => "the backend's teardown (DeviceContext::teardown)",
            Self::Accounting => {
                "the governor's teardown accounting (returning the context's charges to its budgets)"
            }
            Self::Reporting => "recording the teardown (its trace or tracing event)",
        })
    }
}

/// The way out of a [`RetireError::TeardownPanicked`], by the step that
/// panicked.
fn teardown_way_out(step: TeardownStep) -> &'static str {
    match step {
        TeardownStep::Backend => {
            "the context is terminated and its charges returned (the report is in RetireError::TeardownPanicked::report and ContextHandle::teardown_report); the backend's teardown has a bug"
        }
        TeardownStep::Accounting => {
            "the context is terminated, but charges it held may not have been returned to its budgets (Governor::snapshot shows what each level holds); this is a bug in memgov: please report it with this message"
        }
        TeardownStep::Reporting => {
            "the context is terminated and its charges returned (the report is in RetireError::TeardownPanicked::report and ContextHandle::teardown_report); look at the tracing subscriber that panicked"
        }
    }
}

/// Why a retire did not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetireError {
    /// Work is still outstanding. Wait again, release what is listed, or
    /// call `force`.
    #[error("context {context} still has outstanding work after {}: {outstanding}; drop or release what is listed, wait again, or call force()", Elapsed(*.waited))]
    Outstanding {
        /// The context.
        context: ContextName,
        /// How long this call waited.
        waited: Duration,
        /// What still holds the context.
        outstanding: Outstanding,
    },

    /// A step of the teardown panicked. The panic was caught: the context
    /// is terminated all the same (its backend is gone, nothing waits on it
    /// any more), and every waiter, whichever way it waits, gets this
    /// error.
    #[error("context {context}: teardown failed: {step} panicked: {message}; {}", teardown_way_out(*step))]
    TeardownPanicked {
        /// The context.
        context: ContextName,
        /// The step that panicked (the last one, when several did).
        step: TeardownStep,
        /// The panic's message (and that of an earlier step's panic).
        message: String,
        /// The teardown's report, when its accounting ran to the end (every
        /// step but [`TeardownStep::Accounting`]): the same one
        /// [`ContextHandle::teardown_report`](crate::ContextHandle::teardown_report)
        /// returns.
        report: Option<Box<TeardownReport>>,
    },
}
