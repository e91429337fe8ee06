//! Choosing a backend at run time.
//!
//! [`AnyContext`] is a `DeviceContext` that dispatches to whichever backend it
//! holds, so one `Governor<AnyContext>` can govern contexts of different
//! backends side by side, and a runtime can move work from one device to
//! another by registering a new context and retiring the old one.
//!
//! Streams and memory carry their backend: using a stream or an allocation
//! of one backend with a context of another is reported as
//! `InvalidArgument`, and on a refused free the memory and its signal come
//! back unharmed.
//!
//! ```
//! use memgov::any::{AnyContext, BackendKind};
//! use memgov::{ContextConfig, Governor, Role};
//! use std::time::{Duration, Instant};
//!
//! let gov: Governor<AnyContext> = Governor::new();
//! let a = gov.register(AnyContext::open(BackendKind::Host)?, ContextConfig::new().label("a"));
//! let b = gov.register(AnyContext::open("null".parse()?)?, ContextConfig::new().label("b"));
//! let (sa, sb) = (a.create_stream("s")?, b.create_stream("s")?);
//! drop(a.allocate(&sa, 4096, Role::Weights)?);
//! drop(b.allocate(&sb, 4096, Role::Weights)?);
//! drop((sa, sb));
//! for ctx in [a, b] {
//!     ctx.retire().wait(Instant::now() + Duration::from_secs(5))?;
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::host::{HostConfig, HostContext};
use crate::null::NullContext;
use crate::{
    BackendError, BackendErrorKind, DeviceContext, DeviceDescription, MemoryInfo, RetireSignal,
};
use std::fmt;
use std::str::FromStr;

/// The backends this build can open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The embedded simulated device.
    Host,
    /// Every call returns at once (tests and benchmarks).
    Null,
    /// Vulkan through ash (feature `vulkan`).
    #[cfg(feature = "vulkan")]
    Vulkan,
}

impl BackendKind {
    /// Every kind compiled into this build.
    pub fn all() -> Vec<BackendKind> {
        #[allow(unused_mut)]
        let mut v = vec![BackendKind::Host, BackendKind::Null];
        #[cfg(feature = "vulkan")]
        v.push(BackendKind::Vulkan);
        v
    }

    /// Lower-case name, as in `DeviceDescription::backend`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Null => "null",
            #[cfg(feature = "vulkan")]
            Self::Vulkan => "vulkan",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A backend name that this build does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend '{0}'; this build has: {known}", known = BackendKind::all().iter().map(|k| k.name()).collect::<Vec<_>>().join(", "))]
pub struct UnknownBackend(pub String);

impl FromStr for BackendKind {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        BackendKind::all()
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownBackend(s.to_owned()))
    }
}

/// A context of any backend compiled in.
// One value per device context: the size of the largest variant is no cost.
#[allow(clippy::large_enum_variant)]
#[non_exhaustive]
pub enum AnyContext {
    /// The embedded simulated device.
    Host(HostContext),
    /// The null backend.
    Null(NullContext),
    /// A Vulkan device.
    #[cfg(feature = "vulkan")]
    Vulkan(crate::vulkan::VulkanContext),
}

/// A stream of an [`AnyContext`].
#[non_exhaustive]
pub enum AnyStream {
    /// Host stream.
    Host(<HostContext as DeviceContext>::Stream),
    /// Null stream.
    Null(<NullContext as DeviceContext>::Stream),
    /// Vulkan stream.
    #[cfg(feature = "vulkan")]
    Vulkan(<crate::vulkan::VulkanContext as DeviceContext>::Stream),
}

/// An allocation of an [`AnyContext`].
#[non_exhaustive]
pub enum AnyMemory {
    /// Host memory.
    Host(<HostContext as DeviceContext>::Memory),
    /// Null memory.
    Null(<NullContext as DeviceContext>::Memory),
    /// Vulkan memory.
    #[cfg(feature = "vulkan")]
    Vulkan(<crate::vulkan::VulkanContext as DeviceContext>::Memory),
}

impl AnyContext {
    /// Open a context of `kind` with that backend's default settings (first
    /// or best device).
    pub fn open(kind: BackendKind) -> Result<Self, BackendError> {
        Ok(match kind {
            BackendKind::Host => Self::Host(HostContext::new(HostConfig::default())?),
            BackendKind::Null => Self::Null(NullContext::new()),
            #[cfg(feature = "vulkan")]
            BackendKind::Vulkan => {
                Self::Vulkan(crate::vulkan::VulkanContext::new(Default::default())?)
            }
        })
    }

    /// Which backend this is.
    pub fn kind(&self) -> BackendKind {
        match self {
            Self::Host(_) => BackendKind::Host,
            Self::Null(_) => BackendKind::Null,
            #[cfg(feature = "vulkan")]
            Self::Vulkan(_) => BackendKind::Vulkan,
        }
    }
}

impl fmt::Debug for AnyContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AnyContext").field(&self.kind()).finish()
    }
}

impl From<HostContext> for AnyContext {
    fn from(c: HostContext) -> Self {
        Self::Host(c)
    }
}

impl From<NullContext> for AnyContext {
    fn from(c: NullContext) -> Self {
        Self::Null(c)
    }
}

#[cfg(feature = "vulkan")]
impl From<crate::vulkan::VulkanContext> for AnyContext {
    fn from(c: crate::vulkan::VulkanContext) -> Self {
        Self::Vulkan(c)
    }
}

fn mismatch(ctx: BackendKind, op: &'static str, what: &str) -> BackendError {
    BackendError::new(
        "any",
        op,
        BackendErrorKind::InvalidArgument,
        format!("{what} of another backend used with a {ctx} context; use streams and memory of the same context"),
    )
}

/// Dispatch `$body` to the backend held, binding the inner context to `$c`.
macro_rules! each {
    ($self:expr, $c:ident => $body:expr) => {
        match $self {
            AnyContext::Host($c) => $body,
            AnyContext::Null($c) => $body,
            #[cfg(feature = "vulkan")]
            AnyContext::Vulkan($c) => $body,
        }
    };
}

/// Dispatch with a stream (and optionally memory) of the same backend.
macro_rules! with_stream {
    ($self:expr, $s:expr, $op:literal, |$c:ident, $st:ident| $body:expr) => {
        match ($self, $s) {
            (AnyContext::Host($c), AnyStream::Host($st)) => $body,
            (AnyContext::Null($c), AnyStream::Null($st)) => $body,
            #[cfg(feature = "vulkan")]
            (AnyContext::Vulkan($c), AnyStream::Vulkan($st)) => $body,
            #[allow(unreachable_patterns)]
            (ctx, _) => Err(mismatch(ctx.kind(), $op, "a stream")),
        }
    };
}

macro_rules! with_memory {
    ($self:expr, $s:expr, $m:expr, $op:literal, |$c:ident, $st:ident, $mem:ident| $body:expr) => {
        match ($self, $s, $m) {
            (AnyContext::Host($c), AnyStream::Host($st), AnyMemory::Host($mem)) => $body,
            (AnyContext::Null($c), AnyStream::Null($st), AnyMemory::Null($mem)) => $body,
            #[cfg(feature = "vulkan")]
            (AnyContext::Vulkan($c), AnyStream::Vulkan($st), AnyMemory::Vulkan($mem)) => $body,
            #[allow(unreachable_patterns)]
            (ctx, _, _) => Err(mismatch(ctx.kind(), $op, "a stream or memory")),
        }
    };
}

impl DeviceContext for AnyContext {
    type Stream = AnyStream;
    type Memory = AnyMemory;

    fn describe(&self) -> DeviceDescription {
        each!(self, c => c.describe())
    }

    fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
        each!(self, c => c.memory_info())
    }

    fn create_stream(&self) -> Result<AnyStream, BackendError> {
        match self {
            Self::Host(c) => c.create_stream().map(AnyStream::Host),
            Self::Null(c) => c.create_stream().map(AnyStream::Null),
            #[cfg(feature = "vulkan")]
            Self::Vulkan(c) => c.create_stream().map(AnyStream::Vulkan),
        }
    }

    fn destroy_stream(&self, stream: AnyStream) -> Result<(), BackendError> {
        with_stream!(self, stream, "destroy_stream", |c, s| c.destroy_stream(s))
    }

    fn allocate(&self, stream: &AnyStream, bytes: u64) -> Result<AnyMemory, BackendError> {
        match (self, stream) {
            (Self::Host(c), AnyStream::Host(s)) => c.allocate(s, bytes).map(AnyMemory::Host),
            (Self::Null(c), AnyStream::Null(s)) => c.allocate(s, bytes).map(AnyMemory::Null),
            #[cfg(feature = "vulkan")]
            (Self::Vulkan(c), AnyStream::Vulkan(s)) => c.allocate(s, bytes).map(AnyMemory::Vulkan),
            #[allow(unreachable_patterns)]
            (ctx, _) => Err(mismatch(ctx.kind(), "allocate", "a stream")),
        }
    }

    fn free_async(
        &self,
        stream: &AnyStream,
        memory: AnyMemory,
        retired: RetireSignal,
    ) -> Result<(), (AnyMemory, RetireSignal, BackendError)> {
        match (self, stream, memory) {
            (Self::Host(c), AnyStream::Host(s), AnyMemory::Host(m)) => c
                .free_async(s, m, retired)
                .map_err(|(m, r, e)| (AnyMemory::Host(m), r, e)),
            (Self::Null(c), AnyStream::Null(s), AnyMemory::Null(m)) => c
                .free_async(s, m, retired)
                .map_err(|(m, r, e)| (AnyMemory::Null(m), r, e)),
            #[cfg(feature = "vulkan")]
            (Self::Vulkan(c), AnyStream::Vulkan(s), AnyMemory::Vulkan(m)) => c
                .free_async(s, m, retired)
                .map_err(|(m, r, e)| (AnyMemory::Vulkan(m), r, e)),
            #[allow(unreachable_patterns)]
            (ctx, _, m) => Err((
                m,
                retired,
                mismatch(ctx.kind(), "free_async", "a stream or memory"),
            )),
        }
    }

    fn write(
        &self,
        stream: &AnyStream,
        memory: &AnyMemory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), BackendError> {
        with_memory!(self, stream, memory, "write", |c, s, m| c
            .write(s, m, offset, src))
    }

    fn read(
        &self,
        stream: &AnyStream,
        memory: &AnyMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), BackendError> {
        with_memory!(self, stream, memory, "read", |c, s, m| c
            .read(s, m, offset, dst))
    }

    fn synchronize(&self, stream: &AnyStream) -> Result<(), BackendError> {
        with_stream!(self, stream, "synchronize", |c, s| c.synchronize(s))
    }

    fn device_lost(&self) {
        each!(self, c => c.device_lost())
    }

    fn teardown(self, lost: bool) -> Result<(), BackendError> {
        each!(self, c => c.teardown(lost))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ContextConfig, Governor, Role};

    #[test]
    fn names_round_trip_and_unknown_names_list_the_known() {
        for k in BackendKind::all() {
            assert_eq!(k.name().parse::<BackendKind>().unwrap(), k);
        }
        let e = "tpu".parse::<BackendKind>().unwrap_err();
        assert!(
            e.to_string()
                .starts_with("unknown backend 'tpu'; this build has: host, null"),
            "{e}"
        );
    }

    #[test]
    fn mixing_backends_is_an_error_not_ub() {
        let host = AnyContext::open(BackendKind::Host).unwrap();
        let null = AnyContext::open(BackendKind::Null).unwrap();
        let hs = host.create_stream().unwrap();
        let ns = null.create_stream().unwrap();
        let e = host
            .allocate(&ns, 16)
            .err()
            .unwrap_or_else(|| panic!("foreign stream refused"));
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
        let m = null.allocate(&ns, 16).unwrap();
        let (m, _sig, e) = host
            .free_async(&hs, m, RetireSignal::from_fn(|_| {}))
            .err()
            .unwrap_or_else(|| panic!("foreign memory refused"));
        assert!(e.message.contains("another backend"), "{e}");
        null.free_async(&ns, m, RetireSignal::from_fn(|_| {}))
            .map_err(|(_, _, e)| e)
            .unwrap();
        host.destroy_stream(hs).unwrap();
        null.destroy_stream(ns).unwrap();
        host.teardown(false).unwrap();
        null.teardown(false).unwrap();
    }

    #[test]
    fn one_governor_many_backends() {
        let gov: Governor<AnyContext> = Governor::new();
        let ctxs: Vec<_> = BackendKind::all()
            .into_iter()
            .filter_map(|k| AnyContext::open(k).ok())
            .map(|c| gov.register(c, ContextConfig::new()))
            .collect();
        for c in &ctxs {
            let s = c.create_stream("s").unwrap();
            let b = c.allocate(&s, 4096, Role::Weights).unwrap();
            b.write(0, b"abc").unwrap();
            drop(b);
            s.synchronize().unwrap();
        }
        assert!(ctxs.len() >= 2);
    }
}
