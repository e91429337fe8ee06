//! A stream's shared record: what a [`GovernedStream`](crate::GovernedStream)'s
//! clones, its buffers and its pending releases hold. The behaviour (its
//! creation and drop) is `stream.rs`'s; its bins are `cache.rs`'s.

use super::ContextInner;
use crate::governor::record::cache::StreamBins;
use crate::DeviceContext;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) struct StreamShared<C: DeviceContext> {
    pub ctx: Arc<ContextInner<C>>,
    /// `None` only after destroy (in Drop) or for reclaimed streams.
    pub raw: Option<C::Stream>,
    pub label: String,
    /// This stream's statistics shard in `ctx.shards`.
    pub shard: usize,
    /// This stream's tag in its context's trace (0 when not traced).
    pub trace_tag: u32,
    /// Bytes pending release on this stream, for stream-ordered reuse credit.
    /// Present only where the backend reuses stream-ordered frees.
    pub pending_bytes: Option<Arc<AtomicU64>>,
    /// Blocks freed on this stream and kept for reuse on it (see
    /// `cache.rs`). Present only on a caching context.
    pub cache: Option<StreamBins<C>>,
}

impl<C: DeviceContext> StreamShared<C> {
    #[inline]
    pub(crate) fn raw(&self) -> &C::Stream {
        self.raw.as_ref().expect("stream present until drop")
    }

    #[inline]
    pub(crate) fn credit(&self) -> u64 {
        self.pending_bytes
            .as_ref()
            .map_or(0, |p| p.load(Ordering::Relaxed))
    }
}
