//! The arena's books, kept by the driver-agnostic core
//! ([`memgov_backend::vmm`]), with CUDA's allocation handle.

use cudarc::driver::sys::CUmemGenericAllocationHandle;

pub use memgov_backend::vmm::{ArenaSnapshot, Quarantined};

/// What backs one granule of the reservation (see [`memgov_backend::vmm::Slot`]).
pub(crate) type Slot = memgov_backend::vmm::Slot<CUmemGenericAllocationHandle>;
