//! What the governor reports. Every message carries the numbers and the way out.

use super::config::Role;
use super::report::Outstanding;
use crate::{BackendError, ProviderContextIdentity, ProviderContextPinError};
use std::fmt;
use std::time::Duration;

/// Which budget refused an allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetScope {
    /// The context's own budget.
    Context,
    /// A budget shared with other contexts, by label.
    Shared(String),
    /// The device itself (the backend reported out of memory).
    Device,
}

impl fmt::Display for BudgetScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Context => f.write_str("context budget"),
            Self::Shared(l) => write!(f, "shared budget '{l}'"),
            Self::Device => f.write_str("device memory"),
        }
    }
}

/// The numbers behind a refused allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetExceeded {
    /// The context that asked.
    pub context: ProviderContextIdentity,
    /// Its label.
    pub label: String,
    /// Which budget refused.
    pub scope: BudgetScope,
    /// Role of the allocation.
    pub role: Role,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes live in the refusing scope.
    pub live: u64,
    /// Bytes whose release is queued but has not retired.
    pub pending: u64,
    /// Bytes held in quarantine.
    pub quarantined: u64,
    /// Bytes whose free never ran (abandoned releases, buffers reclaimed by
    /// force or released on a lost device): charged until their context's
    /// teardown.
    pub awaiting_teardown: u64,
    /// The limit of the refusing scope.
    pub limit: u64,
    /// `limit` minus everything charged.
    pub available: u64,
    /// How long the allocation waited for pending releases.
    pub waited: Duration,
    /// Bytes pressure responders said they gave back.
    pub reclaimed_by_responders: u64,
    /// What the driver said, when the device itself refused
    /// ([`BudgetScope::Device`]).
    pub driver: Option<BackendError>,
}

impl fmt::Display for BudgetExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "context {} '{}': cannot admit {} B of {} under the {}: {} B live + {} B pending release + {} B quarantined",
            self.context,
            self.label,
            self.requested,
            self.role,
            self.scope,
            self.live,
            self.pending,
            self.quarantined,
        )?;
        if self.awaiting_teardown > 0 {
            write!(f, " + {} B awaiting teardown", self.awaiting_teardown)?;
        }
        write!(
            f,
            " of a {} B limit leaves {} B available",
            self.limit, self.available
        )?;
        if let Some(e) = &self.driver {
            write!(f, " (the driver said: {e})")?;
        }
        if !self.waited.is_zero() {
            write!(f, " (after waiting {:?} for pending releases)", self.waited)?;
        }
        if self.reclaimed_by_responders > 0 {
            write!(
                f,
                " (pressure responders gave back {} B)",
                self.reclaimed_by_responders
            )?;
        }
        if self.pending > 0 {
            f.write_str("; wait for pending releases to retire (Admission::WaitForPending), release buffers, or raise the budget")
        } else {
            f.write_str("; release buffers, register a pressure responder, or raise the budget")
        }
    }
}

/// Errors of governed operations.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GovernorError {
    /// The context is retiring, lost or terminated, or has too many pins.
    #[error(transparent)]
    Pin(#[from] ProviderContextPinError),

    /// The allocation does not fit; every number is in the payload.
    #[error("{0}")]
    BudgetExceeded(Box<BudgetExceeded>),

    /// Zero-byte allocations are refused: no driver gives them a stable
    /// address, and they would hold a pin for nothing.
    #[error("context {context}: zero-byte allocation of {role} refused; ask for at least 1 B")]
    ZeroSized {
        /// The context asked.
        context: ProviderContextIdentity,
        /// The role asked for.
        role: Role,
    },

    /// An access outside the buffer.
    #[error("context {context}: {op} of {len} B at offset {offset} is out of bounds of a {size} B buffer; keep offset + len <= {size}")]
    OutOfBounds {
        /// The buffer's context.
        context: ProviderContextIdentity,
        /// `"write"` or `"read"`.
        op: &'static str,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Buffer size.
        size: u64,
    },

    /// A buffer was used with a stream of another context.
    #[error("buffer of context {buffer_context} used with a stream of context {stream_context}; release it on a stream of its own context")]
    WrongContext {
        /// Context that owns the buffer.
        buffer_context: ProviderContextIdentity,
        /// Context that owns the stream.
        stream_context: ProviderContextIdentity,
    },

    /// The device was lost; nothing more will run on it.
    #[error(
        "context {context}: device lost ({reason}); retire the context and register a new one"
    )]
    DeviceLost {
        /// The lost context.
        context: ProviderContextIdentity,
        /// Why it was declared lost.
        reason: String,
    },

    /// The context was force-retired; this buffer or stream was reclaimed.
    #[error("context {context}: force-retired; its buffers and streams were reclaimed")]
    Reclaimed {
        /// The context.
        context: ProviderContextIdentity,
    },

    /// The backend reported an error.
    #[error("context {context}: {source}")]
    Backend {
        /// The context.
        context: ProviderContextIdentity,
        /// What the backend said.
        source: BackendError,
    },
}

impl GovernorError {
    /// The budget numbers, if this is a budget refusal.
    pub fn budget(&self) -> Option<&BudgetExceeded> {
        match self {
            Self::BudgetExceeded(b) => Some(b),
            _ => None,
        }
    }
}

/// Why a retire did not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RetireError {
    /// Work is still outstanding. Wait again, release what is listed, or
    /// call `force`.
    #[error("context {context} '{label}' still has outstanding work after {waited:?}: {outstanding}; drop or release what is listed, wait again, or call force()")]
    Outstanding {
        /// The context.
        context: ProviderContextIdentity,
        /// Its label.
        label: String,
        /// How long this call waited.
        waited: Duration,
        /// What still holds the context.
        outstanding: Outstanding,
    },
}
