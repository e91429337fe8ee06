//! How streams are spread over a context's shards. Imports nothing from its
//! neighbours: every per-shard structure (statistics, leases, pending
//! counts, the gate, the release box cache) sizes itself from here.

/// Number of shards per context. Streams are spread over them round-robin,
/// so up to this many streams update disjoint cache lines.
pub(crate) const SHARDS: usize = 8;
const _: () = assert!(SHARDS <= 256, "shard indices are stored as u8");

/// The shard of a pin taken from the pin word itself (handles, pin
/// sources, streams): released there, not into a lease.
pub(crate) const GLOBAL: usize = usize::MAX;
