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
//! [`BACKENDS`] lists every backend memgov knows, compiled into this build or
//! not (with the feature that builds it); [`BackendKind`] names those that
//! are. All of it is generated from one list (`src/backends.rs`), and the
//! dispatch is one `match` per call: no boxing, no vtable.
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

use crate::{
    BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription, MemoryInfo,
    RetireSignal,
};
use std::fmt;
use std::str::FromStr;

/// One backend memgov knows, compiled into this build or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendEntry {
    /// Lower-case name, as in `DeviceDescription::backend`.
    pub name: &'static str,
    /// The cargo feature that builds it; `None` for backends always built.
    pub feature: Option<&'static str>,
    /// Its kind, when it is compiled into this build.
    pub kind: Option<BackendKind>,
}

impl BackendEntry {
    /// Why the backend cannot be opened in this build, for a user: `None`
    /// when it is compiled in.
    pub fn not_compiled_in(&self) -> Option<String> {
        match (self.kind, self.feature) {
            (Some(_), _) => None,
            (None, Some(feature)) => {
                Some(format!("not compiled in (build with --features {feature})"))
            }
            (None, None) => Some("not compiled in".to_owned()),
        }
    }
}

/// Generates every backend-naming item of this module from the one list in
/// `src/backends.rs`.
macro_rules! any_backends {
    ($( ($variant:ident, $module:ident, $krate:ident, [$($cfg:tt)*], $feature:literal,
         $doc:literal, $context:ident, $open:expr, $check:expr) ),* $(,)?) => {
        /// The backends this build can open.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum BackendKind {
            $( #[doc = $doc] #[cfg($($cfg)*)] $variant, )*
        }

        /// Every backend memgov knows, in the order of the list, with the
        /// ones compiled out of this build (their `kind` is `None`).
        pub const BACKENDS: &[BackendEntry] = &[
            $(
                BackendEntry {
                    name: stringify!($module),
                    feature: if $feature.is_empty() { None } else { Some($feature) },
                    kind: {
                        #[cfg($($cfg)*)]
                        let kind = Some(BackendKind::$variant);
                        #[cfg(not($($cfg)*))]
                        let kind = None;
                        kind
                    },
                },
            )*
        ];

        impl BackendKind {
            /// Every kind compiled into this build.
            pub fn all() -> Vec<BackendKind> {
                BACKENDS.iter().filter_map(|b| b.kind).collect()
            }

            /// Lower-case name, as in `DeviceDescription::backend`.
            pub fn name(self) -> &'static str {
                match self {
                    $( #[cfg($($cfg)*)] Self::$variant => stringify!($module), )*
                }
            }
        }

        /// A context of any backend compiled in.
        // One value per device context: the size of the largest variant is
        // no cost.
        #[allow(clippy::large_enum_variant)]
        #[non_exhaustive]
        pub enum AnyContext {
            $( #[doc = $doc] #[cfg($($cfg)*)] $variant(crate::$module::$context), )*
        }

        /// A stream of an [`AnyContext`].
        #[non_exhaustive]
        pub enum AnyStream {
            $(
                #[doc = $doc]
                #[cfg($($cfg)*)]
                $variant(<crate::$module::$context as DeviceContext>::Stream),
            )*
        }

        /// An allocation of an [`AnyContext`].
        #[non_exhaustive]
        pub enum AnyMemory {
            $(
                #[doc = $doc]
                #[cfg($($cfg)*)]
                $variant(<crate::$module::$context as DeviceContext>::Memory),
            )*
        }

        $(
            #[cfg($($cfg)*)]
            impl From<crate::$module::$context> for AnyContext {
                fn from(c: crate::$module::$context) -> Self {
                    Self::$variant(c)
                }
            }
        )*

        impl AnyContext {
            /// Open a context of `kind` with that backend's default settings
            /// (first or best device).
            pub fn open(kind: BackendKind) -> Result<Self, BackendError> {
                match kind {
                    $( #[cfg($($cfg)*)] BackendKind::$variant => $open.map(Self::$variant), )*
                }
            }

            /// Open a context of `kind` the way `memgov check` runs the
            /// conformance suite on it: with the backend's own checking on
            /// where it has some (the Vulkan validation layer, when
            /// installed), reported through [`probe`](Self::probe).
            pub fn open_for_check(kind: BackendKind) -> Result<Self, BackendError> {
                match kind {
                    $( #[cfg($($cfg)*)] BackendKind::$variant => $check.map(Self::$variant), )*
                }
            }

            /// Which backend this is.
            pub fn kind(&self) -> BackendKind {
                match self {
                    $( #[cfg($($cfg)*)] Self::$variant(_) => BackendKind::$variant, )*
                }
            }

            /// The probe of the context held: its bookkeeping, readable
            /// after its teardown.
            pub fn probe(&self) -> BackendProbe {
                match self {
                    $( #[cfg($($cfg)*)] Self::$variant(c) => c.probe(), )*
                }
            }
        }

        impl DeviceContext for AnyContext {
            type Stream = AnyStream;
            type Memory = AnyMemory;

            fn describe(&self) -> DeviceDescription {
                match self {
                    $( #[cfg($($cfg)*)] Self::$variant(c) => c.describe(), )*
                }
            }

            fn memory_info(&self) -> Result<MemoryInfo, BackendError> {
                match self {
                    $( #[cfg($($cfg)*)] Self::$variant(c) => c.memory_info(), )*
                }
            }

            fn create_stream(&self) -> Result<AnyStream, BackendError> {
                match self {
                    $( #[cfg($($cfg)*)] Self::$variant(c) => c.create_stream().map(AnyStream::$variant), )*
                }
            }

            fn destroy_stream(&self, stream: AnyStream) -> Result<(), BackendError> {
                match (self, stream) {
                    $( #[cfg($($cfg)*)] (Self::$variant(c), AnyStream::$variant(s)) => c.destroy_stream(s), )*
                    #[allow(unreachable_patterns)]
                    (ctx, _) => Err(mismatch(ctx.kind(), "destroy_stream", "a stream")),
                }
            }

            fn allocate(&self, stream: &AnyStream, bytes: u64) -> Result<AnyMemory, BackendError> {
                match (self, stream) {
                    $(
                        #[cfg($($cfg)*)]
                        (Self::$variant(c), AnyStream::$variant(s)) => {
                            c.allocate(s, bytes).map(AnyMemory::$variant)
                        }
                    )*
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
                    $(
                        #[cfg($($cfg)*)]
                        (Self::$variant(c), AnyStream::$variant(s), AnyMemory::$variant(m)) => c
                            .free_async(s, m, retired)
                            .map_err(|(m, r, e)| (AnyMemory::$variant(m), r, e)),
                    )*
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
                match (self, stream, memory) {
                    $(
                        #[cfg($($cfg)*)]
                        (Self::$variant(c), AnyStream::$variant(s), AnyMemory::$variant(m)) => {
                            c.write(s, m, offset, src)
                        }
                    )*
                    #[allow(unreachable_patterns)]
                    (ctx, _, _) => Err(mismatch(ctx.kind(), "write", "a stream or memory")),
                }
            }

            fn read(
                &self,
                stream: &AnyStream,
                memory: &AnyMemory,
                offset: u64,
                dst: &mut [u8],
            ) -> Result<(), BackendError> {
                match (self, stream, memory) {
                    $(
                        #[cfg($($cfg)*)]
                        (Self::$variant(c), AnyStream::$variant(s), AnyMemory::$variant(m)) => {
                            c.read(s, m, offset, dst)
                        }
                    )*
                    #[allow(unreachable_patterns)]
                    (ctx, _, _) => Err(mismatch(ctx.kind(), "read", "a stream or memory")),
                }
            }

            fn synchronize(&self, stream: &AnyStream) -> Result<(), BackendError> {
                match (self, stream) {
                    $( #[cfg($($cfg)*)] (Self::$variant(c), AnyStream::$variant(s)) => c.synchronize(s), )*
                    #[allow(unreachable_patterns)]
                    (ctx, _) => Err(mismatch(ctx.kind(), "synchronize", "a stream")),
                }
            }

            fn order_after(&self, stream: &AnyStream, after: &AnyStream) -> Result<(), BackendError> {
                match (self, stream, after) {
                    $(
                        #[cfg($($cfg)*)]
                        (Self::$variant(c), AnyStream::$variant(s), AnyStream::$variant(a)) => {
                            c.order_after(s, a)
                        }
                    )*
                    #[allow(unreachable_patterns)]
                    (ctx, _, _) => Err(mismatch(ctx.kind(), "order_after", "a stream")),
                }
            }

            fn device_lost(&self) {
                match self {
                    $( #[cfg($($cfg)*)] Self::$variant(c) => c.device_lost(), )*
                }
            }

            fn teardown(self, lost: bool) -> Result<(), BackendError> {
                match self {
                    $( #[cfg($($cfg)*)] Self::$variant(c) => c.teardown(lost), )*
                }
            }
        }
    };
}

backend_list!(any_backends);

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

impl fmt::Debug for AnyContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AnyContext").field(&self.kind()).finish()
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
    fn every_known_backend_is_listed_and_compiled_out_ones_name_their_feature() {
        let names: Vec<_> = BACKENDS.iter().map(|b| b.name).collect();
        assert_eq!(names, ["host", "null", "cuda", "hip", "vulkan"]);
        for b in BACKENDS {
            match b.kind {
                Some(k) => {
                    assert_eq!(k.name(), b.name);
                    assert_eq!(b.not_compiled_in(), None);
                }
                None => assert_eq!(
                    b.not_compiled_in().as_deref(),
                    Some(format!("not compiled in (build with --features {})", b.name).as_str())
                ),
            }
        }
        let vulkan = BACKENDS.iter().find(|b| b.name == "vulkan").unwrap();
        assert_eq!(vulkan.kind.is_some(), cfg!(feature = "vulkan"));
        assert_eq!(
            BackendKind::all().len(),
            BACKENDS.iter().filter(|b| b.kind.is_some()).count()
        );
    }

    #[test]
    fn the_probe_of_the_context_held_sees_its_work() {
        let host = AnyContext::open(BackendKind::Host).unwrap();
        let probe = host.probe();
        let s = host.create_stream().unwrap();
        let m = host.allocate(&s, 4096).unwrap();
        assert_eq!((probe.live_allocations(), probe.used_bytes()), (1, 4096));
        host.free_async(&s, m, RetireSignal::from_fn(|_| {}))
            .map_err(|(_, _, e)| e)
            .unwrap();
        host.synchronize(&s).unwrap();
        host.destroy_stream(s).unwrap();
        host.teardown(false).unwrap();
        assert_eq!(probe.frees_retired(), 1);
        assert_eq!(probe.check_clean_teardown(), Ok(()));
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
