//! The block cache: freed blocks kept per stream and size class, handed back
//! to allocations of the same class on the same stream without a backend
//! call, and given back to the device whenever the governor needs the bytes.
//!
//! # Where it sits
//!
//! Each stream of a context with the cache on
//! ([`ContextConfig::cache`](super::ContextConfig::cache)) owns one
//! [`Bins`](crate::sync::Bins). A buffer released on its own stream, with no other stream
//! recorded on it, is [`put`](crate::sync::Bins::put) there instead of being freed; an
//! allocation on that stream first [`take`](crate::sync::Bins::take)s a block of its size
//! class. Sizes are rounded up to a class ([`size_class`]) so that a block
//! fits every later request of its class exactly: no splitting, no
//! coalescing (a split block would have to track its neighbours and their
//! streams, and a coalesced one the streams of every part; reuse by exact
//! class needs neither, and the rounding wastes at most 511 bytes below
//! 1 MiB and under 12.5% above).
//!
//! # The cross-stream rule
//!
//! A block is only ever reused on the stream it was freed on. Stream order
//! then makes the reuse safe with no event at all: whatever the old owner
//! queued on the stream runs before whatever the new owner queues. A block
//! is never handed to another stream from the cache: a release on another
//! stream ([`DeviceBuffer::release_on`](super::DeviceBuffer::release_on)),
//! or of a buffer with streams recorded on it, is an ordinary stream-ordered
//! free, and so is every block the cache gives back (trim, pressure, retire,
//! device loss): another stream gets those bytes only from the backend,
//! after the free has retired.
//!
//! # Accounting
//!
//! A cached block keeps the pin, the charge and the live statistics of the
//! buffer it was: the governor's books still count it as a live buffer, and
//! snapshots report it apart ([`CacheUsage`]) by subtracting what the cache
//! holds from the live figures. So `charged = live + cached + pending +
//! quarantined + awaiting teardown`, and `force` reclaims a cached block
//! exactly like a live buffer (revoking its pin) should one still be on its
//! way out of the cache when the gate closes.
//!
//! # Who empties it
//!
//! * An admission refused by any budget or by the device releases cached
//!   blocks (all streams, largest first, at least the shortfall) before it
//!   waits or asks a pressure responder, and then retries.
//! * [`ContextHandle::trim_cache`](super::ContextHandle::trim_cache), on
//!   demand.
//! * `begin_retire` and device loss close every stream's bins and release
//!   what they held, so that a cached block never keeps a retire from
//!   draining; dropping a stream does the same for its own.
//!
//! # On the timeline
//!
//! A traced context caches like any other. `put` records a kept block as
//! [`EventKind::Cached`] before another allocation can take it, a hit is
//! recorded by its caller as [`EventKind::Reused`] at the allocation's
//! site, and every block given back (each of the paths above, and eviction)
//! is released as [`Freed::Cached`], which its release records as a
//! role-bearing [`EventKind::Trimmed`] naming the path, in place of
//! `Released`: the timeline's cached bytes are the snapshot's.

use super::record::cache::{Block, ContextCache};
use super::record::sites::SiteId;
use super::record::stream::StreamShared;
use super::record::ContextInner;
use super::release::{release, Freed};
use super::role::Role;
use super::snapshot::CacheUsage;
use crate::sync::lock;
use crate::trace::EventKind;
use crate::DeviceContext;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Requests up to this size are rounded to multiples of [`SMALL_STEP`].
pub const SMALL_LIMIT: u64 = 1 << 20;
/// The class step below [`SMALL_LIMIT`].
pub const SMALL_STEP: u64 = 512;

/// The size class of a request of `bytes` (> 0): a multiple of 512 bytes up
/// to 1 MiB; above that, eight classes per power of two (a request in
/// `(2^k, 2^(k+1)]` rounds up to a multiple of `2^(k-3)`), so a class is
/// never more than 12.5% larger than the request. Requests too large to
/// round (within 2^60 of `u64::MAX`) are their own class.
pub fn size_class(bytes: u64) -> u64 {
    if bytes <= SMALL_LIMIT {
        return bytes.div_ceil(SMALL_STEP) * SMALL_STEP;
    }
    let k = 63 - (bytes - 1).leading_zeros();
    let step = 1u64 << (k - 3);
    bytes
        .checked_add(step - 1)
        .map_or(bytes, |b| b & !(step - 1))
}

impl ContextCache {
    /// The size a request of `bytes` is allocated at: its class when the
    /// cache would keep it, `bytes` otherwise.
    #[inline]
    pub(crate) fn round(&self, bytes: u64) -> u64 {
        match self.config {
            Some(c) if bytes <= c.max_block => size_class(bytes),
            _ => bytes,
        }
    }

    /// Count `bytes` of `role` in, unless the cache would then hold more
    /// than `max` bytes.
    fn arrived(&self, role: Role, bytes: u64, max: u64) -> bool {
        let fits = self
            .total
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                t.checked_add(bytes).filter(|&n| n <= max)
            })
            .is_ok();
        if !fits {
            return false;
        }
        self.bytes[role.index()].fetch_add(bytes, Ordering::Relaxed);
        self.count[role.index()].fetch_add(1, Ordering::Relaxed);
        true
    }

    fn left(&self, role: Role, bytes: u64) {
        self.total.fetch_sub(bytes, Ordering::Relaxed);
        self.bytes[role.index()].fetch_sub(bytes, Ordering::Relaxed);
        self.count[role.index()].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serve an allocation of `class` bytes on `stream` from its bins. The block
/// keeps the pin and the charge it held; `None` when the stream has no
/// cache, no block of the class, or the gate is closed.
#[inline]
pub(crate) fn hit<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    class: u64,
    role: Role,
) -> Option<C::Memory> {
    let bins = stream.cache.as_ref()?;
    if bins.count() == 0 {
        return None;
    }
    // Under a gate claim, like every change of the live statistics: `force`
    // either sees the block live before or after its role changed.
    let gate = ctx.enter_on(stream.shard)?;
    // A retiring or lost context admits nothing, cached or not: between
    // retire (or loss) beginning and its flush closing these bins, the
    // allocation goes on to the pin, which is refused with the right error.
    if !ctx.accepting() {
        return None;
    }
    let block = bins.take(class)?;
    ctx.cache.left(block.role, class);
    if block.role != role {
        // A block released while its role slept may carry suspended bytes:
        // they follow it.
        let entry = super::ledger::Entry::new(class, role, crate::Tier::Device, stream.shard);
        ctx.ledger.retag(entry, block.role);
    }
    drop(gate);
    ctx.cache.hits.fetch_add(1, Ordering::Relaxed);
    // On a traced context the caller records the reuse, at its site.
    Some(block.memory)
}

/// Keep a released buffer's `memory` (`bytes`, a class size, of `role`,
/// last used on `stream` only) in `stream`'s bins. Gives the memory back
/// when the stream has no cache, `bytes` is not a class the cache keeps,
/// the device is lost, the bins are closed or full: the caller then frees
/// it stream-ordered. On a traced context the kept block is recorded as
/// [`EventKind::Cached`] at the buffer's `site`, before another allocation
/// can take it.
#[inline]
pub(crate) fn put<C: DeviceContext>(
    ctx: &ContextInner<C>,
    stream: &StreamShared<C>,
    memory: C::Memory,
    bytes: u64,
    role: Role,
    site: SiteId,
) -> Result<(), C::Memory> {
    let (Some(bins), Some(config)) = (stream.cache.as_ref(), ctx.cache.config) else {
        return Err(memory);
    };
    if bytes > config.max_block || size_class(bytes) != bytes || ctx.is_lost() {
        return Err(memory);
    }
    // Counted (and held to the limit) before it can be taken: a hit
    // subtracts right after its take.
    if !ctx.cache.arrived(role, bytes, config.max_bytes) {
        // Full: make room by freeing this stream's oldest blocks, if they
        // are enough (the newest block is the likelier to be asked for
        // again: the sizes a runtime asks for drift with its inputs).
        let need = ctx
            .cache
            .bytes()
            .saturating_add(bytes)
            .saturating_sub(config.max_bytes);
        if bytes > config.max_bytes || bins.bytes() < need {
            return Err(memory);
        }
        let oldest = bins.evict_oldest(need, |b| b.stamp);
        let evicted = release_blocks(stream, oldest, "evicted for a newer block");
        ctx.cache.evicted.fetch_add(evicted, Ordering::Relaxed);
        if !ctx.cache.arrived(role, bytes, config.max_bytes) {
            return Err(memory);
        }
    }
    let stamp = ctx.cache.clock.fetch_add(1, Ordering::Relaxed);
    // A stream's trace tag is set only on a traced context.
    if stream.trace_tag != 0 {
        let tag = stream.trace_tag;
        ctx.trace_event_at(tag, Some(role), EventKind::Cached, bytes, None, site);
    }
    match bins.put(
        bytes,
        Block {
            memory,
            role,
            stamp,
        },
        u64::MAX,
    ) {
        Ok(()) => Ok(()),
        Err((block, _)) if stream.trace_tag != 0 => {
            // Closed meanwhile (retire, device loss): on the timeline the
            // block was cached, so it leaves the cache as a flushed one.
            release_blocks(stream, vec![(bytes, block)], "flushed");
            Ok(())
        }
        Err((block, _)) => {
            ctx.cache.left(role, bytes);
            Err(block.memory)
        }
    }
}

/// Release `blocks` of `stream` stream-ordered, as the live buffers the
/// books still count them as; on a traced context each is recorded as
/// [`EventKind::Trimmed`] with `why` as its note. Returns the bytes
/// released.
fn release_blocks<C: DeviceContext>(
    stream: &StreamShared<C>,
    blocks: Vec<(u64, Block<C::Memory>)>,
    why: &'static str,
) -> u64 {
    let ctx = &stream.ctx;
    let mut released = 0u64;
    for (class, block) in blocks {
        ctx.cache.left(block.role, class);
        released = released.saturating_add(class);
        // Whatever the outcome (queued, settled on a lost device, reclaimed
        // by a force that counted the block live, quarantined), the block's
        // pin and charge move exactly as a live buffer's would.
        let _ = release(
            ctx,
            stream.shard,
            stream,
            &[],
            block.memory,
            class,
            block.role,
            crate::Tier::Device,
            Freed::Cached(why),
        );
    }
    released
}

/// Close `stream`'s bins for good and free what they held (stream drop,
/// retire, device loss), `why` the timeline's note.
pub(crate) fn flush_stream<C: DeviceContext>(stream: &StreamShared<C>, why: &'static str) -> u64 {
    match &stream.cache {
        Some(bins) => release_blocks(stream, bins.close(), why),
        None => 0,
    }
}

/// The live streams of `ctx` that have bins, upgraded (outside the lock).
fn cached_streams<C: DeviceContext>(ctx: &ContextInner<C>) -> Vec<Arc<StreamShared<C>>> {
    if !ctx.cache.enabled() {
        return Vec::new();
    }
    lock(&ctx.streams)
        .iter()
        .filter_map(|w| w.upgrade())
        .filter(|s| s.cache.is_some())
        .collect()
}

/// Close every stream's bins and free what they held: `begin_retire` and
/// device loss. A stream dropped here (its last handle gone meanwhile)
/// flushes itself.
pub(crate) fn flush_all<C: DeviceContext>(ctx: &ContextInner<C>) -> u64 {
    let why = if ctx.is_lost() {
        "the device is lost"
    } else {
        "retire"
    };
    cached_streams(ctx)
        .iter()
        .map(|s| flush_stream(s, why))
        .sum()
}

/// Free cached blocks, largest first over every stream, until at least
/// `bytes` were released or the cache is empty, `why` the timeline's note.
/// Returns the bytes released.
pub(crate) fn trim<C: DeviceContext>(ctx: &ContextInner<C>, bytes: u64, why: &'static str) -> u64 {
    if ctx.cache.bytes() == 0 {
        return 0;
    }
    let streams = cached_streams(ctx);
    let mut released = 0u64;
    while released < bytes {
        // The stream holding the largest block; one block at a time.
        let largest = streams
            .iter()
            .filter_map(|s| Some((s.cache.as_ref()?.largest_class()?, s)))
            .max_by_key(|(class, _)| *class);
        let Some((_, s)) = largest else { break };
        let Some(bins) = &s.cache else { break };
        released = released.saturating_add(release_blocks(s, bins.drain(1), why));
    }
    released
}

/// An admission was refused: give cached bytes back (at least `shortfall`,
/// all of them when the shortfall is unknown) before it waits or asks a
/// responder. Returns the bytes released.
pub(crate) fn release_for_pressure<C: DeviceContext>(ctx: &ContextInner<C>, shortfall: u64) -> u64 {
    let want = if shortfall == 0 { u64::MAX } else { shortfall };
    let released = trim(ctx, want, "pressure");
    ctx.cache
        .pressure_released
        .fetch_add(released, Ordering::Relaxed);
    released
}

/// `ContextHandle::trim_cache`.
pub(crate) fn trim_on_demand<C: DeviceContext>(ctx: &ContextInner<C>, bytes: u64) -> u64 {
    let released = trim(ctx, bytes, "trim_cache");
    ctx.cache.trimmed.fetch_add(released, Ordering::Relaxed);
    released
}

pub(crate) fn usage<C: DeviceContext>(ctx: &ContextInner<C>, classes: bool) -> CacheUsage {
    let c = &ctx.cache;
    let mut by_class = std::collections::BTreeMap::<u64, u64>::new();
    // The classes are counted under each stream's bins lock; the totals
    // are read without it.
    let streams = if classes {
        cached_streams(ctx)
    } else {
        Vec::new()
    };
    for s in streams {
        if let Some(bins) = &s.cache {
            for (class, n) in bins.classes() {
                *by_class.entry(class).or_default() += n;
            }
        }
    }
    let by_role = Role::ALL.map(|r| c.of_role(r));
    CacheUsage {
        enabled: c.enabled(),
        cached_bytes: by_role.iter().map(|r| r.0).sum(),
        cached_count: by_role.iter().map(|r| r.1).sum(),
        by_role,
        by_class: by_class.into_iter().collect(),
        hits: c.hits.load(Ordering::Relaxed),
        pressure_released: c.pressure_released.load(Ordering::Relaxed),
        trimmed: c.trimmed.load(Ordering::Relaxed),
        evicted: c.evicted.load(Ordering::Relaxed),
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn classes_round_up_within_bounds() {
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(512), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 17));
        assert_eq!(size_class(3 << 20), 3 << 20);
        for b in [
            1u64,
            700,
            4095,
            1 << 20,
            (1 << 20) + 1,
            5_000_000,
            1 << 33,
            (1 << 33) + 7,
        ] {
            let c = size_class(b);
            assert!(c >= b, "{b} -> {c}");
            assert_eq!(size_class(c), c, "a class is its own class: {b} -> {c}");
            if b > 1 << 20 {
                assert!(c - b <= b / 8, "{b} -> {c}: over 12.5%");
            } else {
                assert!(c - b < 512);
            }
        }
        assert_eq!(size_class(u64::MAX), u64::MAX);
    }
}
