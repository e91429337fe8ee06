//! The arena's books: free address ranges, live blocks, and each granule's
//! slot and users. Plain data under the arena's lock; no driver call.
//!
//! A granule's [`Slot`] is its mapped state, and every step between slots
//! is taken by one thread that marked the granule in transition (`Mapping`,
//! `Unmapping`) under the lock: no handle is mapped, unmapped or released
//! twice, and none is forgotten.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

/// What backs one granule of the reservation; `H` is the driver's handle
/// of physical memory (`CUmemGenericAllocationHandle`,
/// `hipMemGenericAllocationHandle_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot<H> {
    /// Nothing mapped; the handle (if any) released.
    Unmapped,
    /// A thread is creating and mapping it.
    Mapping,
    /// Mapped, accessible read-write, backed by this handle.
    Mapped(H),
    /// A thread is unmapping and releasing it.
    Unmapping,
    /// The driver refused to unmap (`mapped`) or to release it: kept out of
    /// the allocator for the arena's life, retried at teardown.
    Quarantined {
        /// The handle not released (`None`: released, still mapped).
        handle: Option<H>,
        /// Whether its mapping stays.
        mapped: bool,
    },
    /// Released while the arena sleeps; its contents wait in page-locked
    /// host memory at `host` (0: not kept).
    Asleep {
        /// The host address of the contents kept, or 0.
        host: usize,
    },
}

impl<H> Slot<H> {
    /// Whether a thread is mapping or unmapping it (others wait).
    pub fn in_transition(&self) -> bool {
        matches!(self, Slot::Mapping | Slot::Unmapping)
    }
}

/// One granule's slot and users.
#[derive(Debug, Clone, Copy)]
pub struct Granule<H> {
    /// What backs it.
    pub slot: Slot<H>,
    /// Live blocks overlapping it (their release has not retired).
    pub users: u32,
    /// Its free space is kept out of the free list: it sleeps with a set
    /// (until the wake that maps it commits), or it is quarantined (for the
    /// arena's life). A block inside it that retires is carved out again
    /// ([`State::keep_out`]).
    pub held_out: bool,
}

/// A granule the driver would not give back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantined {
    /// Its device address.
    pub address: u64,
    /// Whether it is still mapped (the unmap was refused) rather than only
    /// unreleased.
    pub mapped: bool,
}

/// What an arena holds, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaSnapshot {
    /// Address space reserved for the arena's life.
    pub reserved: u64,
    /// Physical memory mapped (in use, cached and quarantined-mapped).
    pub mapped: u64,
    /// Physical memory of quarantined granules unmapped but not released:
    /// the driver still holds it, and it counts against the arena's limit
    /// with `mapped` until teardown gives it back.
    pub unreleased: u64,
    /// Physical memory being mapped now (granules a thread is creating and
    /// mapping, for an allocation or a wake), counted against the limit.
    pub mapping: u64,
    /// Bytes of live allocations (each rounded up to 256 B).
    pub in_use: u64,
    /// Mapped granules no allocation uses: what a trim gives back.
    pub cached: u64,
    /// Granules released while the arena sleeps, which a wake maps again.
    pub asleep: u64,
    /// The granule size (the driver's recommended allocation granularity).
    pub granule: u64,
    /// Live allocations.
    pub blocks: usize,
    /// Granules the driver would not give back.
    pub quarantined: Vec<Quarantined>,
}

/// The books of one arena, under its lock.
pub struct State<H> {
    /// Free ranges: offset -> length, coalesced.
    free: BTreeMap<u64, u64>,
    /// Live blocks: offset -> length.
    pub blocks: HashMap<u64, u64>,
    /// Every granule of the reservation, by index.
    pub slots: Vec<Granule<H>>,
    granule: u64,
    /// Bytes mapped (in use, cached, quarantined-mapped).
    pub mapped: u64,
    /// Bytes of quarantined granules unmapped whose handle the driver would
    /// not release: the driver still holds them, so they count against the
    /// limit until teardown gives them back.
    pub unreleased: u64,
    /// Bytes being mapped (counted against the limit).
    pub mapping: u64,
    /// Bytes of live blocks.
    pub in_use: u64,
    /// Set by sleep, cleared by a wake that mapped everything again.
    pub asleep: bool,
    /// Set by teardown: nothing is mapped or unmapped after.
    pub closed: bool,
    /// Threads waiting for a granule to leave its transition (for tests
    /// that force an interleaving: they wait until a thread is parked).
    pub waiting: usize,
}

impl<H: Copy> State<H> {
    /// Books of a reservation of `size` bytes in granules of `granule`:
    /// all free, nothing mapped.
    pub fn new(size: u64, granule: u64) -> Self {
        let n = (size / granule) as usize;
        Self {
            free: BTreeMap::from([(0, size)]),
            blocks: HashMap::new(),
            slots: vec![
                Granule {
                    slot: Slot::Unmapped,
                    users: 0,
                    held_out: false,
                };
                n
            ],
            granule,
            mapped: 0,
            unreleased: 0,
            mapping: 0,
            in_use: 0,
            asleep: false,
            closed: false,
            waiting: 0,
        }
    }

    /// The granules `[offset, offset + len)` overlaps.
    pub fn granules_of(&self, offset: u64, len: u64) -> Range<usize> {
        (offset / self.granule) as usize..(offset + len).div_ceil(self.granule) as usize
    }

    /// First fit: take `len` bytes at the lowest free offset that has room
    /// (packing allocations into the granules already mapped first), or
    /// `None` when no free range is long enough.
    pub fn take_range(&mut self, len: u64) -> Option<u64> {
        let (&start, &flen) = self.free.iter().find(|(_, &l)| l >= len)?;
        self.free.remove(&start);
        if flen > len {
            self.free.insert(start + len, flen - len);
        }
        Some(start)
    }

    /// Return a range to the free list, merged with its neighbours.
    pub fn put_range(&mut self, mut offset: u64, mut len: u64) {
        if let Some((&p, &plen)) = self.free.range(..offset).next_back() {
            if p + plen == offset {
                self.free.remove(&p);
                offset = p;
                len += plen;
            }
        }
        if let Some(&nlen) = self.free.get(&(offset + len)) {
            self.free.remove(&(offset + len));
            len += nlen;
        }
        self.free.insert(offset, len);
    }

    /// The granule size.
    pub fn granule(&self) -> u64 {
        self.granule
    }

    /// Carve granule `g`'s free space out of the free list (its live blocks
    /// stay).
    pub fn carve_granule(&mut self, g: usize) {
        self.carve(g as u64 * self.granule, self.granule);
    }

    /// Carve `[offset, offset + len)` out of the free list (it must be
    /// free: no live block overlaps it).
    fn carve(&mut self, offset: u64, len: u64) {
        let end = offset + len;
        let hits: Vec<(u64, u64)> = self
            .free
            .range(..end)
            .filter(|(&s, &l)| s + l > offset)
            .map(|(&s, &l)| (s, l))
            .collect();
        for (s, l) in hits {
            self.free.remove(&s);
            if s < offset {
                self.free.insert(s, offset - s);
            }
            if s + l > end {
                self.free.insert(end, s + l - end);
            }
        }
    }

    /// Keep granule `g` out of use for the arena's life: its free space
    /// carved out of the free list now and whenever a block inside it
    /// retires. Its bytes stay counted against the limit until teardown
    /// gives them back: in `mapped` while mapped, in `unreleased` once
    /// unmapped with the handle unreleased. `_base` is kept for callers'
    /// symmetry.
    pub fn quarantine(&mut self, g: usize, slot: Slot<H>, _base: u64, granule: u64) {
        if let Slot::Quarantined { mapped: false, .. } = slot {
            self.mapped -= granule.min(self.mapped);
            self.unreleased += granule;
        }
        self.slots[g].slot = slot;
        self.slots[g].held_out = true;
        self.carve(g as u64 * granule, granule);
    }

    /// After the block `[offset, offset + len)` went back to the free list:
    /// carve out again what it gave back inside granules held out (asleep
    /// with a set, or quarantined).
    pub fn keep_out(&mut self, offset: u64, len: u64) {
        for g in self.granules_of(offset, len) {
            if self.slots[g].held_out {
                self.carve_granule(g);
            }
        }
    }

    /// Bytes the driver holds for the arena, bounded by its limit: mapped,
    /// being mapped, and quarantined unreleased.
    pub fn held(&self) -> u64 {
        self.mapped + self.mapping + self.unreleased
    }

    /// Bytes of mapped granules without users: what a trim gives back.
    pub fn cached(&self) -> u64 {
        self.slots
            .iter()
            .filter(|g| g.users == 0 && matches!(g.slot, Slot::Mapped(_)))
            .count() as u64
            * self.granule
    }

    /// What the books hold, for an arena at `base` of `reserved` bytes.
    pub fn snapshot(&self, base: u64, reserved: u64, granule: u64) -> ArenaSnapshot {
        let quarantined = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(g, s)| match s.slot {
                Slot::Quarantined { mapped, .. } => Some(Quarantined {
                    address: base + g as u64 * granule,
                    mapped,
                }),
                _ => None,
            })
            .collect();
        ArenaSnapshot {
            reserved,
            mapped: self.mapped,
            unreleased: self.unreleased,
            mapping: self.mapping,
            in_use: self.in_use,
            cached: self.cached(),
            asleep: self
                .slots
                .iter()
                .filter(|g| matches!(g.slot, Slot::Asleep { .. }))
                .count() as u64
                * granule,
            granule,
            blocks: self.blocks.len(),
            quarantined,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_coalesce_and_carve() {
        let mut s = State::<u64>::new(8 << 20, 2 << 20);
        let a = s.take_range(1 << 20).unwrap();
        let b = s.take_range(3 << 20).unwrap();
        assert_eq!((a, b), (0, 1 << 20));
        assert_eq!(s.granules_of(b, 3 << 20), 0..2);
        s.put_range(a, 1 << 20);
        s.put_range(b, 3 << 20);
        assert_eq!(s.free, BTreeMap::from([(0, 8 << 20)]));
        s.carve(2 << 20, 2 << 20);
        assert_eq!(s.free, BTreeMap::from([(0, 2 << 20), (4 << 20, 4 << 20)]));
        assert_eq!(s.take_range(3 << 20), Some(4 << 20));
    }
}
