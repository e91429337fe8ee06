//! # memgov
//!
//! Governs device memory for ML runtimes across GPU vendors: budgets per
//! context and per device, memory roles, stream-ordered release, and a
//! lifecycle whose one guarantee is that **no free ever runs after its context
//! is destroyed**.
//!
//! * [`pin`]: the pin contract shared with plugins and execution providers.
//! * [`DeviceContext`]: what a backend provides.
//! * [`Governor`]: the generic governor; [`ContextHandle`], [`DeviceBuffer`],
//!   [`GovernedStream`], [`RetireHandle`].
//! * [`BackendProbe`]: what every backend reports about its own bookkeeping.
//! * [`host`]: the embedded backend, a simulated device that needs no GPU;
//!   [`null`] for tests and benchmarks; GPU backends behind their features.
//! * [`any`]: every backend memgov knows, and [`AnyContext`](any::AnyContext)
//!   to pick one at run time: [`open_best`](any::AnyContext::open_best) opens
//!   the best backend present (CUDA, HIP, Vulkan, then the host backend),
//!   [`open_from_env`](any::AnyContext::open_from_env) honours
//!   `MEMGOV_BACKEND`. The backend features only add candidates: code that
//!   builds with one feature set builds with every other.
//!
//! The backend contract suite, the fault matrix and the `Watched` observer
//! are the test kit, `memgov-conformance`, a crate of their own that this
//! library does not depend on.
//!
//! The crates under it: `memgov-api` (the pin contract, no dependencies),
//! `memgov-backend` (what a backend implements, re-exported as [`backend`]),
//! one crate per backend (`memgov-host`, `memgov-null`, `memgov-cuda`,
//! `memgov-hip`, `memgov-vulkan`, re-exported as modules). The `memgov`
//! command-line tool is its own package, `memgov-cli`.
//!
//! ```
//! use memgov::host::{HostConfig, HostContext};
//! use memgov::{Alloc, ContextConfig, Governor, Role};
//! use std::time::{Duration, Instant};
//!
//! let gov: Governor<HostContext> = Governor::new();
//! let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().budget(1 << 20));
//! let stream = ctx.create_stream("main")?;
//! let buf = ctx.allocate(&stream, Alloc::new(4096, Role::Workspace))?;
//! buf.write(0, &[1, 2, 3])?;
//! let mut back = [0u8; 3];
//! buf.read(0, &mut back)?;
//! assert_eq!(back, [1, 2, 3]);
//! drop((buf, stream));
//! let report = ctx.retire().wait(Instant::now() + Duration::from_secs(5))?;
//! assert!(report.backend_result.is_ok());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

/// The README's examples compile and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

#[macro_use]
mod backends;

pub mod any;
pub mod capture;
/// Graph capture on a governed CUDA context ([`capture`] with CUDA's types):
/// the pool charged to the budget until the graph is destroyed.
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda_capture {
    pub use crate::capture::{CaptureExt, POOL_LABEL};
    /// A graph made by [`CaptureExt::capture`] on a CUDA context.
    pub type GovernedGraph = crate::capture::GovernedGraph<crate::cuda::CudaContext>;
}
/// Graph capture on a governed HIP context ([`capture`] with HIP's types):
/// the pool charged to the budget until the graph is destroyed.
#[cfg(feature = "hip")]
#[cfg_attr(docsrs, doc(cfg(feature = "hip")))]
pub mod hip_capture {
    pub use crate::capture::{CaptureExt, POOL_LABEL};
    /// A graph made by [`CaptureExt::capture`] on a HIP context.
    pub type GovernedGraph = crate::capture::GovernedGraph<crate::hip::HipContext>;
}
mod governor;
pub mod granted;
#[cfg(target_os = "linux")]
pub mod machine;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
pub mod trace;

/// The pin contract shared with plugins and execution providers (the
/// `memgov-api` crate, which depends on nothing).
pub mod pin {
    pub use memgov_api::*;
}

/// Fault injection over any backend (the `memgov-backend` crate's
/// `fault` module).
pub use memgov_backend::fault;

/// Everything a backend implements and uses: the `memgov-backend` crate.
/// A backend crate depends on that crate alone; the governor's own uses
/// name the items re-exported at this crate's root.
pub use memgov_backend as backend;

pub(crate) use memgov_sync as sync;

// `pub use memgov_host as host;`, `pub use memgov_null as null;` ..., each
// behind its feature, from the one list in `src/backends.rs`.
backend_list!(declare_backend_modules);

pub use governor::*;
pub use memgov_api::{
    ProviderContextIdentity, ProviderContextPin, ProviderContextPinError, ProviderContextPinSource,
};
pub use memgov_backend::{
    BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription, DeviceIdentity,
    Execution, MemoryInfo, RetireOutcome, RetireSignal, Tier,
};
