//! What a context reports about its end: the teardown report and the
//! holders that keep a teardown waiting. Plain data, importing nothing from
//! its neighbours but the memory role, so that every module that builds or
//! carries a report (retire, the record, errors, snapshots) can name these
//! without naming each other.

use super::role::Role;
use crate::{BackendError, ProviderContextIdentity};
use std::fmt;
use std::time::Duration;

/// What a finished teardown did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TeardownReport {
    /// The context.
    pub context: ProviderContextIdentity,
    /// Its label.
    pub label: String,
    /// Whether the device was lost: declared lost (by the caller's
    /// `mark_lost` or a device-lost error the governor saw) before teardown,
    /// in which case teardown did not touch it, or found lost by the
    /// backend's own teardown ([`lost_in_teardown`](Self::lost_in_teardown)).
    pub lost: bool,
    /// Whether the loss was first seen by the backend's teardown: the context
    /// was torn down as healthy and the driver answered a call of that
    /// teardown with a device-lost error (CUDA's sticky 700,
    /// `hipErrorLaunchFailure`, `VK_ERROR_DEVICE_LOST`, ...), which is then
    /// [`backend_result`](Self::backend_result). What that teardown had not
    /// freed yet went with the device.
    pub lost_in_teardown: bool,
    /// Whether `force` reclaimed live buffers and streams.
    pub forced: bool,
    /// Stream-ordered releases whose free executed.
    pub retired_releases: u64,
    /// Releases whose signal was dropped unfired (never executed).
    pub abandoned_releases: u64,
    /// Live buffers of a lost device released without calling it.
    pub settled_lost: u64,
    /// Live buffers reclaimed by `force`.
    pub reclaimed_buffers: u64,
    /// Bytes that were in quarantine and died with the context.
    pub quarantined_bytes: u64,
    /// Bytes whose free never ran on the device (releases abandoned, buffers
    /// reclaimed by force or released on a lost device), charged until this
    /// teardown returned them.
    pub awaiting_teardown_bytes: u64,
    /// Pending releases of a lost device whose signals the backend still held
    /// after teardown (should be zero; nonzero is a backend bug).
    pub unsettled_releases: u64,
    /// From the first `retire()` to the end of teardown.
    pub elapsed: Duration,
    /// What the backend's teardown returned.
    pub backend_result: Result<(), BackendError>,
}

/// The kind of holder keeping a context from tearing down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum PinKind {
    /// A live stream.
    Stream,
    /// A live buffer.
    Buffer,
    /// A release queued on the device that has not retired.
    PendingRelease,
    /// A pin held by an external holder through a pin source.
    External,
    /// A borrowed pin or an allocation in flight.
    Other,
}

impl fmt::Display for PinKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Stream => "stream",
            Self::Buffer => "live buffer",
            Self::PendingRelease => "pending release",
            Self::External => "external pin",
            Self::Other => "other pin",
        })
    }
}

/// One group of outstanding holders.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct OutstandingItem {
    /// What kind of holder.
    pub kind: PinKind,
    /// Memory role, for buffers and pending releases.
    pub role: Option<Role>,
    /// How many.
    pub count: u64,
    /// Bytes they hold.
    pub bytes: u64,
    /// Holder label: stream label or pin-source label.
    pub holder: Option<String>,
}

/// Everything that still holds a context.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Outstanding {
    /// Groups by kind, role and holder.
    pub items: Vec<OutstandingItem>,
}

impl Outstanding {
    /// Whether nothing is listed.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl fmt::Display for Outstanding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.items.is_empty() {
            return f.write_str("nothing");
        }
        for (i, it) in self.items.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{} {}", it.count, it.kind)?;
            if it.count != 1 {
                f.write_str("s")?;
            }
            if let Some(r) = it.role {
                write!(f, " of {r}")?;
            }
            if it.bytes > 0 {
                write!(f, " holding {}", super::Bytes(it.bytes))?;
            }
            if let Some(h) = &it.holder {
                write!(f, " held by '{h}'")?;
            }
        }
        Ok(())
    }
}
