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

/// `n thing` or `n things`.
fn count(f: &mut fmt::Formatter<'_>, n: u64, thing: &str) -> fmt::Result {
    write!(f, "{n} {thing}{}", if n == 1 { "" } else { "s" })
}

/// One paragraph for a log: what the teardown did, in the report's order,
/// leaving out what did not happen (nothing abandoned, nothing forced, ...).
///
/// ```text
/// context #1.0 'llm' torn down in 1.2 ms: 12 releases retired; the backend's teardown returned Ok
/// context #2.0 'vision' torn down in 48.0 ms, forced: 3 releases retired, 1 abandoned, 2 live buffers reclaimed by force; returned at teardown: 0 B quarantined, 6.0 MiB awaiting teardown; the backend's teardown failed: ...
/// ```
impl fmt::Display for TeardownReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "context {} '{}' torn down in {}",
            self.context,
            self.label,
            super::Elapsed(self.elapsed)
        )?;
        if self.lost_in_teardown {
            f.write_str(", device lost (first seen by the backend's teardown)")?;
        } else if self.lost {
            f.write_str(", device lost")?;
        }
        if self.forced {
            f.write_str(", forced")?;
        }
        f.write_str(": ")?;
        count(f, self.retired_releases, "release")?;
        f.write_str(" retired")?;
        if self.abandoned_releases > 0 {
            write!(f, ", {} abandoned", self.abandoned_releases)?;
        }
        if self.settled_lost > 0 {
            f.write_str(", ")?;
            count(f, self.settled_lost, "live buffer")?;
            f.write_str(" released on the lost device")?;
        }
        if self.reclaimed_buffers > 0 {
            f.write_str(", ")?;
            count(f, self.reclaimed_buffers, "live buffer")?;
            f.write_str(" reclaimed by force")?;
        }
        if self.quarantined_bytes > 0 || self.awaiting_teardown_bytes > 0 {
            write!(
                f,
                "; returned at teardown: {} quarantined, {} awaiting teardown",
                super::Bytes(self.quarantined_bytes),
                super::Bytes(self.awaiting_teardown_bytes)
            )?;
        }
        if self.unsettled_releases > 0 {
            f.write_str("; ")?;
            count(f, self.unsettled_releases, "release")?;
            f.write_str(" the backend still held after teardown (a backend bug)")?;
        }
        match &self.backend_result {
            Ok(()) => f.write_str("; the backend's teardown returned Ok"),
            Err(e) => write!(f, "; the backend's teardown failed: {e}"),
        }
    }
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
