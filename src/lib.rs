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
//! * [`host`]: the embedded backend, a simulated device that needs no GPU.
//! * [`conformance`]: the backend contract suite, runnable by any backend.
//!
//! ```
//! use memgov::{Governor, ContextConfig, Role, DefaultContext, host::HostConfig};
//! use std::time::{Duration, Instant};
//!
//! let gov: Governor<DefaultContext> = Governor::new();
//! let ctx = gov.register(DefaultContext::new(HostConfig::default())?, ContextConfig::new().budget(1 << 20));
//! let stream = ctx.create_stream("main")?;
//! let buf = ctx.allocate(&stream, 4096, Role::Workspace)?;
//! buf.write(0, &[1, 2, 3])?;
//! let mut back = [0u8; 3];
//! buf.read(0, &mut back)?;
//! assert_eq!(back, [1, 2, 3]);
//! drop((buf, stream));
//! let report = ctx.retire().wait(Instant::now() + Duration::from_secs(5))?;
//! assert!(report.backend_result.is_ok());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

/// The README's examples compile and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub mod any;
#[cfg(feature = "cli")]
pub mod bench;
pub mod conformance;
mod context;
pub mod fault;
mod governor;
pub mod pin;
mod probe;
pub(crate) mod sync;

#[path = "../backends/host/mod.rs"]
pub mod host;
#[path = "../backends/null/mod.rs"]
pub mod null;
#[cfg(feature = "vulkan")]
#[path = "../backends/vulkan/mod.rs"]
pub mod vulkan;

pub use context::{
    BackendError, BackendErrorKind, DeviceContext, DeviceDescription, Execution, MemoryInfo,
    RetireOutcome, RetireSignal,
};
pub use governor::*;
pub use probe::BackendProbe;
pub use pin::{
    ProviderContextIdentity, ProviderContextPin, ProviderContextPinError, ProviderContextPinSource,
};

cfg_if::cfg_if! {
    // GPU backend features add their branches here, most specific first.
    if #[cfg(any())] {
    } else {
        /// The backend a program gets when it does not name one: the
        /// embedded host backend unless a GPU backend feature selects another.
        /// Its constructor therefore depends on the enabled features; code
        /// that must build with any feature set names a backend instead.
        pub type DefaultContext = host::HostContext;
    }
}
