//! The cache's data in the record: the blocks a stream's bins hold and the
//! context-wide limits and totals. What the cache does with them (hits,
//! puts, eviction, flushes, trims) is `cache.rs`'s.

use crate::governor::config::CacheConfig;
use crate::governor::role::Role;
use crate::sync::Bins;
use crate::DeviceContext;
use std::sync::atomic::{AtomicU64, Ordering};

/// A cached block: the memory, and the role of the buffer it was.
pub(crate) struct Block<M> {
    pub memory: M,
    pub role: Role,
    /// When it was cached (the context's put count then): the oldest
    /// blocks make room for newer ones.
    pub stamp: u64,
}

/// A stream's bins.
pub(crate) type StreamBins<C> = Bins<Block<<C as DeviceContext>::Memory>>;

/// The context-wide side of the cache: its limits and its totals by role.
#[derive(Default)]
pub(crate) struct ContextCache {
    pub config: Option<CacheConfig>,
    /// Cached bytes and blocks by role (the role of the buffer each was),
    /// so that snapshots can take them out of each role's live figures.
    pub bytes: [AtomicU64; 5],
    pub count: [AtomicU64; 5],
    /// Bytes cached over every role and stream: the figure held to
    /// `max_bytes`.
    pub total: AtomicU64,
    pub hits: AtomicU64,
    /// Puts so far: the next block's stamp.
    pub clock: AtomicU64,
    /// Bytes freed to make room for newer blocks.
    pub evicted: AtomicU64,
    /// Bytes the cache gave back under admission pressure.
    pub pressure_released: AtomicU64,
    /// Bytes given back by `trim_cache`.
    pub trimmed: AtomicU64,
}

impl ContextCache {
    pub(crate) fn new(config: Option<CacheConfig>) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// Whether the context caches (a stream creates its bins then).
    pub(crate) fn enabled(&self) -> bool {
        self.config.is_some()
    }

    /// Bytes cached now, over every stream.
    pub(crate) fn bytes(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Cached bytes and blocks of `role`.
    pub(crate) fn of_role(&self, role: Role) -> (u64, u64) {
        (
            self.bytes[role.index()].load(Ordering::Relaxed),
            self.count[role.index()].load(Ordering::Relaxed),
        )
    }
}
