//! Statistics of live and pending buffers, sharded by stream, and of
//! quarantined releases, by role.
//!
//! # Invariants (enforced here: every field is private to this module)
//!
//! * Each step of a buffer's life is one named operation that moves its
//!   bytes and its count together: [`admit`](Stats::admit) (allocation, or
//!   arrival by `release_on` another stream), [`queue`](Stats::queue)
//!   (stream-ordered release), [`settle`](Stats::settle) (retired or
//!   abandoned), [`leave`](Stats::leave) (left live without being queued in
//!   this shard: device lost, quarantined, reclaimed, moved).
//! * The totals are monotonic, so live = admitted - queued - gone and
//!   pending = queued - settled never go negative for a reader that reads
//!   the later steps first (each Acquire, pairing with the Release of every
//!   step). The one exception is [`unqueue`](Stats::unqueue), the undo of a
//!   free the backend refused, which the saturation of the differences
//!   covers.
//! * Every change of the admitted, queued and gone totals happens under a
//!   gate claim (the callers' invariant, see `record/mod.rs`), so that
//!   [`reclaim_live`](Stats::reclaim_live), called by `force` once the gate
//!   has drained, reads stable live totals.
//! * Live bytes are also kept as running totals ([`LiveTotal`]) with the
//!   highest value each took, moved by the same operations, so that the most
//!   ever live at once is known without sampling. By default each shard
//!   keeps its own (on its own line: streams on different shards still
//!   write nothing in common), and [`peak_live`](Stats::peak_live) is the
//!   sum of the shards' peaks: exact when one shard held every live buffer
//!   (one stream, or streams sharing a shard), an upper bound otherwise
//!   (their peaks need not coincide). With exact peaks on
//!   ([`Tuning::exact_peak`](crate::Tuning::exact_peak)) one
//!   context-wide total is kept instead, on a line of its own, and its
//!   highest value is the peak, exact across streams, at the price of one
//!   line that every stream writes twice per allocate and release.

use crate::governor::role::Role;
use crate::governor::shards::SHARDS;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Bytes and a count of objects, moved together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Amount {
    pub bytes: u64,
    pub count: u64,
}

impl Amount {
    fn wrapping_add(self, o: Amount) -> Amount {
        Amount {
            bytes: self.bytes.wrapping_add(o.bytes),
            count: self.count.wrapping_add(o.count),
        }
    }

    fn saturating_sub(self, o: Amount) -> Amount {
        Amount {
            bytes: self.bytes.saturating_sub(o.bytes),
            count: self.count.saturating_sub(o.count),
        }
    }
}

/// Live and pending amounts of one role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Usage {
    pub live: Amount,
    pub pending: Amount,
}

/// A monotonic total of bytes and objects (two words).
#[derive(Debug, Default)]
struct Total {
    bytes: AtomicU64,
    count: AtomicU64,
}

impl Total {
    /// Add one step. Release, so that a reader that sees a later step of a
    /// buffer's life (Acquire) also sees its earlier steps.
    #[inline]
    fn add(&self, bytes: u64, count: u64) {
        self.bytes.fetch_add(bytes, Ordering::Release);
        self.count.fetch_add(count, Ordering::Release);
    }

    /// Undo one step (a refused free only).
    #[inline]
    fn sub(&self, bytes: u64) {
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.count.fetch_sub(1, Ordering::Relaxed);
    }

    #[inline]
    fn load(&self) -> Amount {
        Amount {
            bytes: self.bytes.load(Ordering::Acquire),
            count: self.count.load(Ordering::Acquire),
        }
    }
}

/// The event totals of one role in one shard.
#[derive(Debug, Default)]
struct ShardRole {
    admitted: Total,
    queued: Total,
    settled: Total,
    gone: Total,
}

impl ShardRole {
    /// Live now. Stable only while the gate is closed and drained.
    fn live(&self) -> Amount {
        let a = self.admitted.load();
        let q = self.queued.load();
        let g = self.gone.load();
        Amount {
            bytes: a.bytes.wrapping_sub(q.bytes).wrapping_sub(g.bytes),
            count: a.count.wrapping_sub(q.count).wrapping_sub(g.count),
        }
    }
}

/// One shard: the statistics of the streams assigned to it, on cache lines
/// of their own.
#[repr(align(128))]
#[derive(Debug, Default)]
struct Shard {
    roles: [ShardRole; 5],
    /// The shard's live bytes and their peak (per-shard peaks only).
    live: LiveTotal,
}

/// Quarantined bytes and releases of one role (rare: not sharded). The
/// bytes are read by shared-budget admission (what a retiring context will
/// give back), the count only by snapshots.
#[derive(Debug, Default)]
struct Quarantine {
    bytes: AtomicU64,
    count: AtomicU64,
}

/// Bytes in live buffers and the most there ever were. Relaxed: each is one
/// atomic with its own modification order, which is the order the peak is
/// taken in.
#[derive(Debug, Default)]
struct LiveTotal {
    bytes: AtomicU64,
    peak: AtomicU64,
}

impl LiveTotal {
    #[inline]
    fn up(&self, bytes: u64) {
        let now = self
            .bytes
            .fetch_add(bytes, Ordering::Relaxed)
            .wrapping_add(bytes);
        // Written only when it rises: the common case reads a line that
        // stays shared.
        if now > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(now, Ordering::Relaxed);
        }
    }

    /// Bytes that were live elsewhere arrive: no new peak.
    #[inline]
    fn arrive(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    #[inline]
    fn down(&self, bytes: u64) {
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// The context-wide live total of exact peaks, on a cache line of its own.
#[repr(align(128))]
#[derive(Debug, Default)]
struct ContextLive(LiveTotal);

/// The statistics of one context.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    shards: [Shard; SHARDS],
    quarantine: [Quarantine; 5],
    /// Whether live bytes are totalled context-wide (exact peaks) rather
    /// than per shard. Fixed at registration.
    exact_peak: bool,
    live: ContextLive,
    next_shard: AtomicUsize,
}

impl Stats {
    /// Statistics that total live bytes context-wide when `exact_peak`,
    /// per shard otherwise.
    pub(crate) fn new(exact_peak: bool) -> Self {
        Self {
            exact_peak,
            ..Self::default()
        }
    }

    /// Where the live bytes of `shard` are totalled.
    #[inline]
    fn live_of(&self, shard: usize) -> &LiveTotal {
        if self.exact_peak {
            &self.live.0
        } else {
            &self.shards[crate::sync::slot_index::<SHARDS>(shard)].live
        }
    }

    /// A shard for a new stream, round-robin.
    pub(crate) fn pick_shard(&self) -> usize {
        self.next_shard.fetch_add(1, Ordering::Relaxed) % SHARDS
    }

    #[inline]
    fn at(&self, shard: usize, role: Role) -> &ShardRole {
        &self.shards[crate::sync::slot_index::<SHARDS>(shard)].roles[role.index()]
    }

    /// An allocation was admitted on a stream of `shard`.
    #[inline]
    pub(super) fn admit(&self, shard: usize, role: Role, bytes: u64) {
        self.at(shard, role).admitted.add(bytes, 1);
        self.live_of(shard).up(bytes);
    }

    /// A live buffer of `from` is released on a stream of `to` (`release_on`
    /// another stream): it leaves `from` and arrives in `to` as if allocated
    /// there. No-op when they are the same shard; a context-wide live total
    /// does not change either way.
    #[inline]
    pub(super) fn transfer(&self, from: usize, to: usize, role: Role, bytes: u64) {
        if from != to {
            self.at(from, role).gone.add(bytes, 1);
            self.at(to, role).admitted.add(bytes, 1);
            if !self.exact_peak {
                // Not a new live moment: the buffer was live in `from`.
                self.live_of(from).down(bytes);
                self.live_of(to).arrive(bytes);
            }
        }
    }

    /// A live buffer's release was queued on a stream of `shard`.
    #[inline]
    pub(super) fn queue(&self, shard: usize, role: Role, bytes: u64) {
        self.at(shard, role).queued.add(bytes, 1);
        self.live_of(shard).down(bytes);
    }

    /// The backend refused the free just queued: undo [`queue`](Self::queue)
    /// (and the [`transfer`](Self::transfer) before it). The buffer is live
    /// again (until its caller quarantines it or hands it back).
    pub(super) fn unqueue(&self, live_shard: usize, queued_shard: usize, role: Role, bytes: u64) {
        self.at(queued_shard, role).queued.sub(bytes);
        if live_shard != queued_shard {
            self.at(queued_shard, role).admitted.sub(bytes);
            self.at(live_shard, role).gone.sub(bytes);
        }
        self.live_of(live_shard).up(bytes);
    }

    /// A release queued on a stream of `shard` settled (retired or
    /// abandoned).
    #[inline]
    pub(super) fn settle(&self, shard: usize, role: Role, bytes: u64) {
        self.at(shard, role).settled.add(bytes, 1);
    }

    /// A live buffer of `shard` left without a release queued here (device
    /// lost, quarantined).
    #[inline]
    pub(super) fn leave(&self, shard: usize, role: Role, bytes: u64) {
        self.at(shard, role).gone.add(bytes, 1);
        self.live_of(shard).down(bytes);
    }

    /// `force`: every live buffer leaves at once. Precondition: the gate is
    /// closed and drained, so the live totals are stable. Returns what left.
    pub(super) fn reclaim_live(&self) -> Amount {
        let mut total = Amount::default();
        for (i, shard) in self.shards.iter().enumerate() {
            let mut left = Amount::default();
            for r in &shard.roles {
                let live = r.live();
                r.gone.add(live.bytes, live.count);
                left = left.wrapping_add(live);
            }
            self.live_of(i).down(left.bytes);
            total = total.wrapping_add(left);
        }
        total
    }

    /// The most bytes ever live at once, and whether that is exact (see the
    /// module docs): with per-shard totals, the sum of the shards' peaks,
    /// exact when at most one shard ever held live bytes.
    pub(crate) fn peak_live(&self) -> (u64, bool) {
        if self.exact_peak {
            return (self.live.0.peak.load(Ordering::Relaxed), true);
        }
        let (mut sum, mut shards) = (0u64, 0);
        for shard in &self.shards {
            let peak = shard.live.peak.load(Ordering::Relaxed);
            if peak > 0 {
                sum = sum.saturating_add(peak);
                shards += 1;
            }
        }
        (sum, shards <= 1)
    }

    /// A release of `role` was refused and quarantined.
    pub(super) fn quarantine(&self, role: Role, bytes: u64) {
        let q = &self.quarantine[role.index()];
        q.bytes.fetch_add(bytes, Ordering::Relaxed);
        q.count.fetch_add(1, Ordering::Relaxed);
    }

    /// A quarantined release died with its context. Release: a reader that
    /// sees the bytes gone (Acquire, [`quarantined`](Self::quarantined)) also
    /// sees the teardown step before it (see
    /// `DeviceMember::returning_at_teardown` in `member.rs`).
    pub(super) fn unquarantine(&self, role: Role, bytes: u64) {
        let q = &self.quarantine[role.index()];
        q.bytes.fetch_sub(bytes, Ordering::Release);
        q.count.fetch_sub(1, Ordering::Relaxed);
    }

    /// Quarantined releases of one role.
    pub(crate) fn quarantined(&self, role: Role) -> Amount {
        let q = &self.quarantine[role.index()];
        Amount {
            bytes: q.bytes.load(Ordering::Acquire),
            count: q.count.load(Ordering::Relaxed),
        }
    }

    /// Quarantined bytes of every role.
    pub(crate) fn quarantined_bytes(&self) -> u64 {
        Role::ALL.iter().map(|&r| self.quarantined(r).bytes).sum()
    }

    /// One role's totals over the shards: settled, gone, queued, admitted,
    /// read in that order (later steps of a buffer's life first, each
    /// Acquire): whatever step of a buffer is seen, its earlier steps, read
    /// afterwards, are seen too, so no difference in [`usage`](Self::usage)
    /// is negative (except transiently around [`unqueue`](Self::unqueue),
    /// which the saturation covers).
    fn totals(&self, role: Role) -> [Amount; 4] {
        let mut t = [Amount::default(); 4];
        for (i, ti) in t.iter_mut().enumerate() {
            for s in &self.shards {
                let r = &s.roles[role.index()];
                let step = match i {
                    0 => &r.settled,
                    1 => &r.gone,
                    2 => &r.queued,
                    _ => &r.admitted,
                };
                *ti = ti.wrapping_add(step.load());
            }
        }
        t
    }

    /// Live and pending amounts of one role, summed over the shards.
    pub(crate) fn usage(&self, role: Role) -> Usage {
        let [settled, gone, queued, admitted] = self.totals(role);
        Usage {
            live: admitted.saturating_sub(queued).saturating_sub(gone),
            pending: queued.saturating_sub(settled),
        }
    }

    /// Live and pending amounts of every role.
    pub(crate) fn usage_all(&self) -> Usage {
        Role::ALL
            .iter()
            .map(|&r| self.usage(r))
            .fold(Usage::default(), |a, u| Usage {
                live: a.live.wrapping_add(u.live),
                pending: a.pending.wrapping_add(u.pending),
            })
    }

    /// Releases settled (retired or abandoned), over every role.
    pub(crate) fn settled_count(&self) -> u64 {
        self.sum_count(0)
    }

    /// Releases queued (and not undone), over every role.
    pub(crate) fn queued_count(&self) -> u64 {
        self.sum_count(2)
    }

    fn sum_count(&self, step: usize) -> u64 {
        Role::ALL
            .iter()
            .map(|&r| self.totals(r)[step].count)
            .fold(0, u64::wrapping_add)
    }
}
