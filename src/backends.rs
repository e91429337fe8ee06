//! The one list of backends.
//!
//! Every place that names backends is generated from `backend_list!`: the
//! backend modules in `lib.rs`, [`BackendKind`](crate::any::BackendKind),
//! [`AnyContext`](crate::any::AnyContext) and its dispatch, and
//! [`any::BACKENDS`](crate::any::BACKENDS), which the `memgov` tool reads for
//! its `info` and `check` rows (a backend compiled out keeps its row, with the
//! feature that builds it).
//!
//! Adding a backend is its folder under `backends/`, its cargo feature, and
//! one line here.

/// Calls `$callback!` with one entry per backend, in the order `memgov info`
/// and `memgov check` print them:
///
/// `(Variant, module, crate, [cfg predicate], "feature",
///   "doc line", ContextType, open expression, check expression)`
///
/// * the crate is the backend's own (`backends/<module>/`), a dependency of
///   this one behind the feature;
/// * the feature is `""` for a backend that is always built (`[all()]`);
/// * a backend compiled out keeps its rows, which say which feature builds
///   it;
/// * `open` makes a context with the backend's default settings (first or
///   best device); `check` makes the one `memgov check` runs the conformance
///   suite on (the Vulkan one turns the validation layer on when installed).
macro_rules! backend_list {
    ($callback:ident) => {
        $callback! {
            // (Variant, module, crate, [cfg], "feature", "doc", Context, open, check)
            (Host, host, memgov_host, [all()], "", "The embedded simulated device (always built).", HostContext, crate::host::HostContext::new(Default::default()), crate::host::HostContext::new(Default::default())),
            (Null, null, memgov_null, [all()], "", "Every call returns at once: tests and benchmarks (always built).", NullContext, Ok(crate::null::NullContext::new()), crate::null::NullContext::for_check()),
            (Cuda, cuda, memgov_cuda, [feature = "cuda"], "cuda", "NVIDIA GPUs through the CUDA driver API (feature `cuda`).", CudaContext, crate::cuda::CudaContext::new(Default::default()), crate::cuda::CudaContext::for_check()),
            (Hip, hip, memgov_hip, [feature = "hip"], "hip", "AMD GPUs through ROCm HIP (feature `hip`).", HipContext, crate::hip::HipContext::new(Default::default()), crate::hip::HipContext::for_check()),
            (Vulkan, vulkan, memgov_vulkan, [feature = "vulkan"], "vulkan", "Vulkan through ash (feature `vulkan`).", VulkanContext, crate::vulkan::VulkanContext::new(Default::default()), crate::vulkan::VulkanContext::for_check()),
        }
    };
}

/// Re-exports each backend's crate as a module (`pub use memgov_host as
/// host;` ...) behind its feature.
macro_rules! declare_backend_modules {
    ($( ($variant:ident, $module:ident, $krate:ident, [$($cfg:tt)*], $feature:literal,
         $doc:literal, $context:ident, $open:expr, $check:expr) ),* $(,)?) => {
        $(
            #[cfg($($cfg)*)]
            #[cfg_attr(docsrs, doc(cfg($($cfg)*)))]
            #[doc = $doc]
            #[doc = concat!("\n\nThe `", stringify!($krate), "` crate.")]
            #[doc(inline)]
            pub use $krate as $module;
        )*
    };
}
