//! The settings of a HIP context: [`HipConfig`].

use crate::arena::ArenaConfig;

/// Which allocator the context uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllocatorChoice {
    /// `hipMallocFromPoolAsync` from a pool of the context's own where the
    /// device supports memory pools, else the `hipMalloc` fallback.
    #[default]
    Auto,
    /// Always `hipMalloc`, freed with `hipFree` after an event on the
    /// releasing stream.
    Plain,
}

/// Settings of a HIP context.
#[derive(Debug, Clone, Default)]
pub struct HipConfig {
    /// Device ordinal (`hipSetDevice`), 0 by default.
    pub device: u32,
    /// Stream-ordered pool or the `hipMalloc` fallback.
    pub allocator: AllocatorChoice,
    /// A virtual-memory arena for device memory (see [`ArenaConfig`]), or
    /// `None` (the default) for the pool or fallback above. With an arena,
    /// device allocations come from one address range reserved for the
    /// context's life, backed by granules mapped as needed; page-locked
    /// host memory is unchanged. Where the loaded ROCm lacks the virtual
    /// memory calls, `HipContext::new` answers `Unsupported` naming the
    /// first one missing.
    pub arena: Option<ArenaConfig>,
}
