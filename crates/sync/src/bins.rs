//! [`Bins`]: blocks kept by size class under one lock, handed over to takers
//! until they are closed for good.
//!
//! The governor keeps one per stream for its block cache: a release on the
//! block's own stream [`put`](Bins::put)s the block here instead of freeing
//! it, an allocation of the same class on that stream [`take`](Bins::take)s
//! it back, and retire (or device loss) [`close`](Bins::close)s the bins and
//! frees what they held.
//!
//! # Invariants
//!
//! * Every block is in at most one place: in the bins, or with the one
//!   caller whose `put` was refused, whose `take` returned it, or whose
//!   `close`/[`drain`](Bins::drain) returned it. All four move blocks under
//!   the one lock.
//! * Once `close` has run, `put` refuses every block and `take` finds none:
//!   the closer is handed everything the bins ever kept and did not give
//!   back, so a retire that closes the bins and frees what it got leaves no
//!   block behind.
//! * The totals ([`bytes`](Bins::bytes), [`count`](Bins::count)) change under
//!   the lock with the blocks; they are also readable without it (Relaxed),
//!   for snapshots and for the admission's "is anything cached" check, which
//!   then takes the lock before acting.
//!
//! Modelled in `tests/loom.rs` (`cache_bins_hand_over_and_close`).

use crate::{lock_model as lock, AtomicU64, Mutex, Ordering};
use std::collections::BTreeMap;

/// Blocks by size class, closed for good by [`close`](Self::close).
pub struct Bins<T> {
    inner: Mutex<Inner<T>>,
    bytes: AtomicU64,
    count: AtomicU64,
}

struct Inner<T> {
    closed: bool,
    /// Class size -> the blocks of that class, most recently put last.
    classes: BTreeMap<u64, Vec<T>>,
}

/// Why a [`Bins::put`] handed its block back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutRefused {
    /// The bins were closed (retire or device loss began).
    Closed,
    /// Keeping the block would pass the limit on kept bytes.
    Full,
}

impl<T> Default for Bins<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Bins<T> {
    /// Empty, open bins.
    pub fn new() -> Self {
        Self {
            inner: Mutex::new(Inner {
                closed: false,
                classes: BTreeMap::new(),
            }),
            bytes: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Keep `block` of `class` bytes, unless the bins are closed or would
    /// then hold more than `limit` bytes: then the block comes back with the
    /// reason.
    pub fn put(&self, class: u64, block: T, limit: u64) -> Result<(), (T, PutRefused)> {
        let mut inner = lock(&self.inner);
        if inner.closed {
            return Err((block, PutRefused::Closed));
        }
        let bytes = self.bytes.load(Ordering::Relaxed);
        if bytes.saturating_add(class) > limit {
            return Err((block, PutRefused::Full));
        }
        inner.classes.entry(class).or_default().push(block);
        self.bytes.store(bytes + class, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// A block of exactly `class` bytes, if one is kept (the one put last).
    #[inline]
    pub fn take(&self, class: u64) -> Option<T> {
        if self.count.load(Ordering::Relaxed) == 0 {
            // Nothing kept: no lock. A block put concurrently is simply not
            // seen, as if the put had come after this take.
            return None;
        }
        let mut inner = lock(&self.inner);
        let blocks = inner.classes.get_mut(&class)?;
        let block = blocks.pop()?;
        self.bytes.fetch_sub(class, Ordering::Relaxed);
        self.count.fetch_sub(1, Ordering::Relaxed);
        Some(block)
    }

    /// Take blocks out, largest class first, until at least `bytes` bytes
    /// were taken or none is left. The bins stay open.
    pub fn drain(&self, bytes: u64) -> Vec<(u64, T)> {
        let mut out = Vec::new();
        let mut inner = lock(&self.inner);
        let mut taken = 0u64;
        while taken < bytes {
            let Some(mut entry) = inner.classes.last_entry() else {
                break;
            };
            let class = *entry.key();
            match entry.get_mut().pop() {
                Some(block) => {
                    taken = taken.saturating_add(class);
                    out.push((class, block));
                }
                None => {
                    entry.remove();
                }
            }
        }
        self.bytes
            .fetch_sub(out.iter().map(|(c, _)| *c).sum::<u64>(), Ordering::Relaxed);
        self.count.fetch_sub(out.len() as u64, Ordering::Relaxed);
        out
    }

    /// Take the oldest blocks out, by `age` (smaller is older; the first
    /// block of each class is its oldest), until at least `bytes` bytes were
    /// taken or none is left. The bins stay open.
    pub fn evict_oldest(&self, bytes: u64, age: impl Fn(&T) -> u64) -> Vec<(u64, T)> {
        let mut out = Vec::new();
        let mut inner = lock(&self.inner);
        let mut taken = 0u64;
        while taken < bytes {
            let oldest = inner
                .classes
                .iter()
                .filter_map(|(c, b)| Some((*c, age(b.first()?))))
                .min_by_key(|(_, a)| *a);
            let Some((class, _)) = oldest else { break };
            let block = inner
                .classes
                .get_mut(&class)
                .expect("the class just found")
                .remove(0);
            taken = taken.saturating_add(class);
            out.push((class, block));
        }
        self.bytes.fetch_sub(taken, Ordering::Relaxed);
        self.count.fetch_sub(out.len() as u64, Ordering::Relaxed);
        out
    }

    /// Close for good and hand over every block kept: from now on every
    /// `put` is refused and every `take` finds nothing. A second close
    /// returns nothing.
    pub fn close(&self) -> Vec<(u64, T)> {
        let mut inner = lock(&self.inner);
        inner.closed = true;
        let classes = std::mem::take(&mut inner.classes);
        self.bytes.store(0, Ordering::Relaxed);
        self.count.store(0, Ordering::Relaxed);
        drop(inner);
        classes
            .into_iter()
            .flat_map(|(class, blocks)| blocks.into_iter().map(move |b| (class, b)))
            .collect()
    }

    /// The largest class with a block kept.
    pub fn largest_class(&self) -> Option<u64> {
        lock(&self.inner)
            .classes
            .iter()
            .rev()
            .find(|(_, b)| !b.is_empty())
            .map(|(c, _)| *c)
    }

    /// Whether [`close`](Self::close) has run.
    pub fn is_closed(&self) -> bool {
        lock(&self.inner).closed
    }

    /// Bytes kept now (Relaxed: a snapshot's figure).
    #[inline]
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Blocks kept now (Relaxed: a snapshot's figure).
    #[inline]
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// `(class, blocks)` for every class with a block kept, smallest first.
    pub fn classes(&self) -> Vec<(u64, u64)> {
        lock(&self.inner)
            .classes
            .iter()
            .filter(|(_, b)| !b.is_empty())
            .map(|(c, b)| (*c, b.len() as u64))
            .collect()
    }

    /// Apply `f` to every block kept, under the lock (keep `f` short: it
    /// must not call out to code that could take this lock).
    pub fn for_each(&self, mut f: impl FnMut(u64, &T)) {
        let inner = lock(&self.inner);
        for (class, blocks) in &inner.classes {
            for b in blocks {
                f(*class, b);
            }
        }
    }
}
