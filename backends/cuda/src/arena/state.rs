//! The arena's books, kept by the driver-agnostic core
//! ([`memgov_backend::vmm`]).

pub use memgov_backend::vmm::{ArenaSnapshot, Quarantined};
