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
//!   to pick one at run time.
//! * [`conformance`]: the backend contract suite, runnable by any backend.
//!
//! The crates under it: `memgov-api` (the pin contract, no dependencies),
//! `memgov-backend` (what a backend implements, re-exported as [`backend`]),
//! one crate per backend (`memgov-host`, `memgov-null`, `memgov-cuda`,
//! `memgov-hip`, `memgov-vulkan`, re-exported as modules). The `memgov`
//! command-line tool is its own package, `memgov-cli`.
//!
//! ```
//! use memgov::host::{HostConfig, HostContext};
//! use memgov::{ContextConfig, Governor, Role};
//! use std::time::{Duration, Instant};
//!
//! let gov: Governor<HostContext> = Governor::new();
//! let ctx = gov.register(HostContext::new(HostConfig::default())?, ContextConfig::new().budget(1 << 20));
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

#[macro_use]
mod backends;

pub mod any;
pub mod conformance;
mod governor;

/// The pin contract shared with plugins and execution providers (the
/// `memgov-api` crate, which depends on nothing).
pub mod pin {
    pub use memgov_api::*;
}

/// Fault injection over any backend (the `memgov-backend` crate's
/// [`fault`](memgov_backend::fault) module).
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
    BackendError, BackendErrorKind, BackendProbe, DeviceContext, DeviceDescription, Execution,
    MemoryInfo, RetireOutcome, RetireSignal,
};

cfg_if::cfg_if! {
    // The most specific GPU backend enabled: cuda, then hip, then vulkan;
    // the host backend when none is.
    if #[cfg(feature = "cuda")] {
        /// The backend a program gets when it does not name one: the most
        /// specific GPU backend enabled (`cuda`, then `hip`, then `vulkan`),
        /// the embedded host backend when none is. Here: CUDA.
        ///
        /// Its constructor therefore depends on the enabled features; code
        /// that must build with any feature set names a backend instead.
        pub type DefaultContext = cuda::CudaContext;
    } else if #[cfg(feature = "hip")] {
        /// The backend a program gets when it does not name one: the most
        /// specific GPU backend enabled (`cuda`, then `hip`, then `vulkan`),
        /// the embedded host backend when none is. Here: HIP.
        ///
        /// Its constructor therefore depends on the enabled features; code
        /// that must build with any feature set names a backend instead.
        pub type DefaultContext = hip::HipContext;
    } else if #[cfg(feature = "vulkan")] {
        /// The backend a program gets when it does not name one: the most
        /// specific GPU backend enabled (`cuda`, then `hip`, then `vulkan`),
        /// the embedded host backend when none is. Here: Vulkan.
        ///
        /// Its constructor therefore depends on the enabled features; code
        /// that must build with any feature set names a backend instead.
        pub type DefaultContext = vulkan::VulkanContext;
    } else {
        /// The backend a program gets when it does not name one: the most
        /// specific GPU backend enabled (`cuda`, then `hip`, then `vulkan`),
        /// the embedded host backend when none is. Here: the host backend.
        ///
        /// Its constructor therefore depends on the enabled features; code
        /// that must build with any feature set names a backend instead.
        pub type DefaultContext = host::HostContext;
    }
}

#[cfg(test)]
mod default_context_tests {
    /// `DefaultContext` follows the enabled features: run under each
    /// feature set (`--no-default-features`, `--features vulkan`, ...).
    #[test]
    fn default_context_is_the_most_specific_backend_enabled() {
        let expected = if cfg!(feature = "cuda") {
            "CudaContext"
        } else if cfg!(feature = "hip") {
            "HipContext"
        } else if cfg!(feature = "vulkan") {
            "VulkanContext"
        } else {
            "HostContext"
        };
        let name = std::any::type_name::<crate::DefaultContext>();
        assert!(
            name.ends_with(expected),
            "DefaultContext is {name}; with these features it should be {expected}"
        );
    }
}
