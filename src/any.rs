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
//! A program that does not care which GPU it runs on opens the best backend
//! present with [`AnyContext::open_best`] (CUDA, then HIP, then Vulkan, then
//! the embedded host backend), or lets its user choose with
//! [`AnyContext::open_from_env`] and the `MEMGOV_BACKEND` variable. The
//! choice is made at run time, so enabling a backend's feature only adds a
//! candidate: code that builds with one feature set builds with every other.
//!
//! ```
//! use memgov::any::{AnyContext, BackendKind};
//! use memgov::{Alloc, ContextConfig, Governor, Role};
//! use std::time::{Duration, Instant};
//!
//! let gov: Governor<AnyContext> = Governor::new();
//! let a = gov.register(AnyContext::open(BackendKind::Host)?, ContextConfig::new().label("a"));
//! let b = gov.register(AnyContext::open("null".parse()?)?, ContextConfig::new().label("b"));
//! let (sa, sb) = (a.create_stream("s")?, b.create_stream("s")?);
//! drop(a.allocate(&sa, Alloc::new(4096, Role::Weights))?);
//! drop(b.allocate(&sb, Alloc::new(4096, Role::Weights))?);
//! drop((sa, sb));
//! for ctx in [a, b] {
//!     ctx.retire().wait(Instant::now() + Duration::from_secs(5))?;
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::{
    BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription, MemoryInfo,
    RetireSignal, Tier,
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
        ///
        /// Which variants exist depends on the enabled features, so a `match`
        /// outside this crate needs a wildcard arm: that keeps the features
        /// additive (a dependency enabling `cuda` cannot break it).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
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

            fn identity(&self) -> memgov_backend::DeviceIdentity {
                match self {
                    $( #[cfg($($cfg)*)] Self::$variant(c) => c.identity(), )*
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

            fn allocate_in(&self, stream: &AnyStream, bytes: u64, tier: Tier) -> Result<AnyMemory, BackendError> {
                match (self, stream) {
                    $(
                        #[cfg($($cfg)*)]
                        (Self::$variant(c), AnyStream::$variant(s)) => {
                            c.allocate_in(s, bytes, tier).map(AnyMemory::$variant)
                        }
                    )*
                    #[allow(unreachable_patterns)]
                    (ctx, _) => Err(mismatch(ctx.kind(), "allocate_in", "a stream")),
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

/// The variable [`AnyContext::open_from_env`] reads: backend names in any
/// case, separated by commas, tried in the order given
/// (`MEMGOV_BACKEND=vulkan,host`).
pub const BACKEND_VAR: &str = "MEMGOV_BACKEND";

/// The order [`AnyContext::open_best`] tries backends in: the most specific
/// GPU backend first, the embedded host backend last (it always opens).
pub const BEST_ORDER: &[&str] = &["cuda", "hip", "vulkan", "host"];

/// Why no context could be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// A name in the list is no backend memgov knows.
    #[error(
        "unknown backend '{name}' in {source_of}; known backends: {known}",
        known = BACKENDS.iter().map(|b| b.name).collect::<Vec<_>>().join(", ")
    )]
    UnknownBackend {
        /// The name as given.
        name: String,
        /// Where the list came from (`MEMGOV_BACKEND`, ...).
        source_of: &'static str,
    },
    /// Every candidate was tried and none opened.
    #[error(
        "no backend could be opened ({}); {}",
        attempts.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "),
        if attempts.iter().all(|a| a.kind.is_some()) {
            "no driver or device is present for any of them; name another backend in MEMGOV_BACKEND (host always opens)"
        } else {
            "build with the feature named, or name another backend in MEMGOV_BACKEND (host always opens)"
        }
    )]
    NoBackendOpened {
        /// One entry per candidate, in the order tried.
        attempts: Vec<OpenAttempt>,
    },
}

/// One backend [`AnyContext::open_first`] tried, and why it did not open.
#[derive(Debug)]
pub struct OpenAttempt {
    /// The backend's name.
    pub name: &'static str,
    /// Its kind; `None` when it is not compiled into this build.
    pub kind: Option<BackendKind>,
    /// What opening it returned; `None` when it is not compiled in (then
    /// [`feature`](Self::feature) names what builds it).
    pub error: Option<BackendError>,
    /// The cargo feature that builds it.
    pub feature: Option<&'static str>,
}

impl fmt::Display for OpenAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.error, self.feature) {
            (Some(e), _) => write!(f, "{}: {e}", self.name),
            (None, Some(feature)) => write!(
                f,
                "{}: not compiled in (build with --features {feature})",
                self.name
            ),
            (None, None) => write!(f, "{}: not compiled in", self.name),
        }
    }
}

/// The backends to try, in order, for a value of [`BACKEND_VAR`]: `None`,
/// or a value of only spaces and commas, gives [`BEST_ORDER`]; otherwise the
/// names given, in any case, each once. An unknown name is an error listing
/// the known ones; a backend not compiled in stays in the list, and
/// [`AnyContext::open_first`] reports which feature builds it.
///
/// A pure function of the value, so a program can check the variable before
/// it opens anything.
///
/// ```
/// use memgov::any::{backend_preference, BEST_ORDER};
///
/// let names = |v| backend_preference(v).map(|l| l.iter().map(|b| b.name).collect::<Vec<_>>());
/// assert_eq!(names(None).unwrap(), BEST_ORDER);
/// assert_eq!(names(Some(" Vulkan, HOST ,vulkan")).unwrap(), ["vulkan", "host"]);
/// assert!(names(Some("tpu")).unwrap_err().to_string().contains("known backends: host, null"));
/// ```
pub fn backend_preference(value: Option<&str>) -> Result<Vec<&'static BackendEntry>, OpenError> {
    let names: Vec<String> = value
        .unwrap_or("")
        .split(',')
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
        .collect();
    if names.is_empty() {
        return Ok(BEST_ORDER.iter().filter_map(|n| entry(n)).collect());
    }
    let mut list: Vec<&'static BackendEntry> = Vec::with_capacity(names.len());
    for name in names {
        let found = entry(&name).ok_or(OpenError::UnknownBackend {
            name,
            source_of: BACKEND_VAR,
        })?;
        if !list.iter().any(|b| b.name == found.name) {
            list.push(found);
        }
    }
    Ok(list)
}

fn entry(name: &str) -> Option<&'static BackendEntry> {
    BACKENDS.iter().find(|b| b.name == name)
}

impl AnyContext {
    /// Open the best backend present: the first of [`BEST_ORDER`] (CUDA,
    /// HIP, Vulkan, host) that is compiled in and opens, with its default
    /// settings. The host backend needs no GPU, so this fails only when
    /// the host backend itself cannot start.
    pub fn open_best() -> Result<Self, OpenError> {
        Self::open_first(&backend_preference(None)?)
    }

    /// Open the first backend of the list in `MEMGOV_BACKEND`
    /// ([`BACKEND_VAR`]) that opens, or the best backend present when the
    /// variable is unset or empty (see [`backend_preference`]).
    pub fn open_from_env() -> Result<Self, OpenError> {
        let value = std::env::var(BACKEND_VAR).ok();
        Self::open_first(&backend_preference(value.as_deref())?)
    }

    /// Open the first of `candidates` that is compiled in and opens, with
    /// its default settings ([`open`](Self::open)); the error says, for each
    /// one, why it did not.
    pub fn open_first(candidates: &[&BackendEntry]) -> Result<Self, OpenError> {
        open_first_with(candidates, Self::open)
    }
}

/// [`AnyContext::open_first`] with the opener given, so tests can make a
/// backend fail.
fn open_first_with(
    candidates: &[&BackendEntry],
    mut open: impl FnMut(BackendKind) -> Result<AnyContext, BackendError>,
) -> Result<AnyContext, OpenError> {
    let mut attempts = Vec::with_capacity(candidates.len());
    for candidate in candidates {
        let error = match candidate.kind {
            Some(kind) => match open(kind) {
                Ok(context) => return Ok(context),
                Err(e) => Some(e),
            },
            None => None,
        };
        attempts.push(OpenAttempt {
            name: candidate.name,
            kind: candidate.kind,
            error,
            feature: candidate.feature,
        });
    }
    Err(OpenError::NoBackendOpened { attempts })
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
    use crate::{Alloc, ContextConfig, Governor, Role};

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

    fn names(list: &[&BackendEntry]) -> Vec<&'static str> {
        list.iter().map(|b| b.name).collect()
    }

    #[test]
    fn an_unset_or_blank_variable_gives_the_best_order() {
        for value in [None, Some(""), Some(" , ,")] {
            assert_eq!(
                names(&backend_preference(value).unwrap()),
                ["cuda", "hip", "vulkan", "host"],
                "{value:?}"
            );
        }
    }

    #[test]
    fn the_variable_names_backends_in_any_case_each_once_in_its_order() {
        let list = backend_preference(Some("NULL, Host,null ,CUDA")).unwrap();
        assert_eq!(names(&list), ["null", "host", "cuda"]);
        assert_eq!(list[0].kind, Some(BackendKind::Null));
    }

    #[test]
    fn an_unknown_name_is_an_error_listing_the_known_ones() {
        let e = backend_preference(Some("host,tpu")).unwrap_err();
        assert!(matches!(&e, OpenError::UnknownBackend { name, .. } if name == "tpu"));
        assert_eq!(
            e.to_string(),
            "unknown backend 'tpu' in MEMGOV_BACKEND; known backends: host, null, cuda, hip, vulkan"
        );
    }

    #[test]
    fn the_first_backend_that_opens_is_chosen_and_the_rest_are_not_tried() {
        let list = backend_preference(Some("null,host")).unwrap();
        let mut tried = Vec::new();
        let ctx = open_first_with(&list, |kind| {
            tried.push(kind);
            match kind {
                BackendKind::Null => Err(BackendError::new(
                    "null",
                    "open",
                    BackendErrorKind::Unavailable,
                    "no device",
                )),
                k => AnyContext::open(k),
            }
        })
        .unwrap();
        assert_eq!(ctx.kind(), BackendKind::Host);
        assert_eq!(tried, [BackendKind::Null, BackendKind::Host]);
        ctx.teardown(false).unwrap();

        let mut tried = Vec::new();
        let ctx = open_first_with(&list, |kind| {
            tried.push(kind);
            AnyContext::open(kind)
        })
        .unwrap();
        assert_eq!(
            (ctx.kind(), tried),
            (BackendKind::Null, vec![BackendKind::Null])
        );
        ctx.teardown(false).unwrap();
    }

    #[test]
    fn when_none_opens_each_backend_says_why() {
        let list = backend_preference(Some("vulkan,host")).unwrap();
        let e = open_first_with(&list, |kind| {
            Err(BackendError::new(
                kind.name(),
                "open",
                BackendErrorKind::Unavailable,
                format!("no {kind} device"),
            ))
        })
        .unwrap_err();
        let OpenError::NoBackendOpened { attempts } = &e else {
            panic!("{e}")
        };
        assert_eq!(
            attempts.iter().map(|a| a.name).collect::<Vec<_>>(),
            ["vulkan", "host"]
        );
        let message = e.to_string();
        assert!(message.contains("no host device"), "{message}");
        if cfg!(feature = "vulkan") {
            assert!(message.contains("no vulkan device"), "{message}");
        } else {
            assert!(
                message.contains("vulkan: not compiled in (build with --features vulkan)"),
                "{message}"
            );
            assert!(
                message.contains("build with the feature named"),
                "{message}"
            );
        }
    }

    #[test]
    fn the_best_backend_present_is_opened() {
        // Which GPU backends open depends on the machine; the host backend
        // always does, and nothing after it in the order is tried.
        let best = AnyContext::open_best().unwrap();
        let expected = BEST_ORDER
            .iter()
            .filter_map(|n| entry(n).and_then(|b| b.kind))
            .find(|&k| match AnyContext::open(k) {
                Ok(c) => c.teardown(false).is_ok(),
                Err(_) => false,
            })
            .unwrap();
        assert_eq!(best.kind(), expected);
        if BackendKind::all() == [BackendKind::Host, BackendKind::Null] {
            assert_eq!(best.kind(), BackendKind::Host);
        }
        best.teardown(false).unwrap();
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
            let b = c.allocate(&s, Alloc::new(4096, Role::Weights)).unwrap();
            b.write(0, b"abc").unwrap();
            drop(b);
            s.synchronize().unwrap();
        }
        assert!(ctxs.len() >= 2);
    }
}
