//! Settings of a CUDA context, and what a runtime lends memgov when it
//! adopts a context the runtime already owns.

use crate::arena::ArenaConfig;
use cudarc::driver::sys::{CUcontext, CUstream};

/// Settings of a CUDA context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaConfig {
    /// Device ordinal (`cuDeviceGet`).
    pub ordinal: u32,
    /// Release threshold of memgov's own memory pool
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`), or `None` for the driver's
    /// default (0: freed memory goes back to the driver at every
    /// synchronization). The default, `u64::MAX`, keeps freed memory cached
    /// in the pool instead: the governor's budget already bounds what is live
    /// or pending, so the cache never grows past the budget's high-water
    /// mark, and teardown trims and destroys the pool. The pool is created by
    /// the context (`cuMemPoolCreate`) and used by it alone; the device's
    /// default pool, which other users of the device share, is never changed.
    pub release_threshold: Option<u64>,
    /// A virtual-memory arena for device memory (see [`ArenaConfig`]), or
    /// `None` (the default) for memgov's stream-ordered pool. With an arena,
    /// device allocations come from one address range reserved for the
    /// context's life, backed by granules mapped as needed; page-locked host
    /// memory is unchanged.
    pub arena: Option<ArenaConfig>,
}

impl Default for CudaConfig {
    fn default() -> Self {
        Self {
            ordinal: 0,
            release_threshold: Some(u64::MAX),
            arena: None,
        }
    }
}

/// A context and streams a runtime already owns, lent to memgov by
/// [`CudaContext::adopt`](crate::CudaContext::adopt).
#[derive(Debug)]
pub struct AdoptedContext {
    /// The device the context belongs to.
    pub ordinal: u32,
    /// The runtime's context (primary or not).
    pub context: CUcontext,
    /// Streams of that context that `create_stream` hands out, in order,
    /// before it creates streams of its own.
    pub streams: Vec<CUstream>,
}
