//! Call-site attribution: what the allocations made at each call site (and
//! under each label) hold, for snapshots and refusals.
//!
//! A context with attribution on owns one [`Sites`] table; one with it off
//! owns none, and its allocation path pays one test of a `None`. The table
//! is a fixed array of slots found by hashing the caller's
//! `&'static Location` (and label) pointer: a lookup is loads only, a slot
//! is claimed under a lock the first time its site is seen, and an
//! allocation then costs two relaxed read-modify-writes (live bytes,
//! allocations) and a release two more (live bytes, releases). A buffer
//! remembers its slot ([`SiteId`]) and gives its bytes back to it.
//!
//! The same source line may reach the table under more than one pointer (a
//! generic caller monomorphised twice): snapshots merge rows by
//! `file:line:col` and label.

use crate::governor::snapshot::SiteUsage;
use crate::sync::lock;
use std::collections::HashMap;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};

/// A buffer's slot in its context's table, plus one: 0 when the buffer was
/// not attributed.
pub(crate) type SiteId = u32;

/// Slots per context, a power of two: distinct (site, label) pairs past
/// this many share one more slot, labelled [`OVERFLOW_LABEL`].
const SLOTS: usize = 1024;

/// The slot the sites beyond the table's size share.
const OVERFLOW: usize = SLOTS;

/// The label of the slot that the sites beyond the table's size share.
pub(crate) const OVERFLOW_LABEL: &str = "(sites beyond the table's 1024)";

/// Whether `MEMGOV_ATTRIBUTION` asks for attribution (`1`, `true`, `on`,
/// `yes`). Read once per context registration.
pub(crate) fn from_env() -> bool {
    std::env::var("MEMGOV_ATTRIBUTION").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "on" | "yes"
        )
    })
}

/// What an allocation names besides its caller's line: a label, and a
/// site of its own (a C caller's `file:line`, a runtime glue's name) shown
/// instead of the line.
#[derive(Clone, Copy, Default)]
pub(crate) struct Names {
    pub label: Option<&'static str>,
    pub site: Option<&'static str>,
}

fn same(a: Option<&'static str>, b: Option<&'static str>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => std::ptr::eq(a, b),
        _ => false,
    }
}

#[derive(Clone, Copy)]
struct Key {
    location: &'static Location<'static>,
    names: Names,
}

impl Key {
    fn is(&self, location: &'static Location<'static>, names: Names) -> bool {
        std::ptr::eq(self.location, location)
            && same(self.names.label, names.label)
            && same(self.names.site, names.site)
    }
}

#[derive(Default)]
struct Slot {
    key: OnceLock<Key>,
    live_bytes: AtomicU64,
    allocations: AtomicU64,
    releases: AtomicU64,
    peak_bytes: AtomicU64,
    refusals: AtomicU64,
}

/// A site as snapshots and traces name it: the name the allocation gave,
/// or its caller's `file:line:col`.
fn site_name(location: &'static Location<'static>, names: Names) -> String {
    match names.site {
        Some(named) => named.to_owned(),
        None => format!(
            "{}:{}:{}",
            location.file(),
            location.line(),
            location.column()
        ),
    }
}

/// One context's table of call sites.
pub(crate) struct Sites {
    /// `SLOTS` found by hashing, then the overflow slot.
    slots: Box<[Slot; SLOTS + 1]>,
    /// Held only to claim a slot.
    claim: Mutex<()>,
}

impl Sites {
    pub(crate) fn new() -> Self {
        let slots: Box<[Slot]> = (0..=SLOTS).map(|_| Slot::default()).collect();
        let slots: Box<[Slot; SLOTS + 1]> = slots.try_into().ok().expect("SLOTS + 1 slots");
        let _ = slots[OVERFLOW].key.set(Key {
            location: Location::caller(),
            names: Names {
                label: Some(OVERFLOW_LABEL),
                site: None,
            },
        });
        Self {
            slots,
            claim: Mutex::new(()),
        }
    }

    fn start(location: &'static Location<'static>, names: Names) -> usize {
        let l = location as *const Location<'static> as usize;
        let t = names.label.map_or(0, |s| s.as_ptr() as usize ^ s.len());
        let n = names.site.map_or(0, |s| s.as_ptr() as usize ^ s.len());
        let h = (l ^ t.rotate_left(29) ^ n.rotate_left(43)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h >> (usize::BITS - SLOTS.trailing_zeros())) & (SLOTS - 1)
    }

    /// The slot of `location` and `names`, claimed when first seen.
    #[inline]
    fn find(&self, location: &'static Location<'static>, names: Names) -> usize {
        let start = Self::start(location, names);
        // The first probe finds a site seen before, unless another hashed
        // to the same slot first.
        match self.slots[start].key.get() {
            Some(k) if k.is(location, names) => start,
            _ => self.probe(start, location, names),
        }
    }

    /// The rest of [`find`](Self::find): linear probing from `start`,
    /// claiming the first free slot.
    #[inline(never)]
    fn probe(&self, start: usize, location: &'static Location<'static>, names: Names) -> usize {
        for i in 1..SLOTS {
            let at = (start + i) & (SLOTS - 1);
            match self.slots[at].key.get() {
                Some(k) if k.is(location, names) => return at,
                Some(_) => continue,
                None => return self.claim(start, location, names),
            }
        }
        OVERFLOW
    }

    #[cold]
    fn claim(&self, start: usize, location: &'static Location<'static>, names: Names) -> usize {
        let _claim = lock(&self.claim);
        for i in 0..SLOTS {
            let at = (start + i) & (SLOTS - 1);
            let slot = &self.slots[at];
            match slot.key.get() {
                Some(k) if k.is(location, names) => return at,
                Some(_) => continue,
                None => {
                    let _ = slot.key.set(Key { location, names });
                    return at;
                }
            }
        }
        OVERFLOW
    }

    /// Count a live buffer of `bytes` made at `location`; its id, for
    /// [`release`](Self::release).
    #[inline]
    pub(crate) fn admit(
        &self,
        location: &'static Location<'static>,
        names: Names,
        bytes: u64,
    ) -> SiteId {
        let at = self.find(location, names);
        let slot = &self.slots[at];
        let live = slot
            .live_bytes
            .fetch_add(bytes, Relaxed)
            .wrapping_add(bytes);
        slot.allocations.fetch_add(1, Relaxed);
        if live > slot.peak_bytes.load(Relaxed) {
            slot.peak_bytes.fetch_max(live, Relaxed);
        }
        at as SiteId + 1
    }

    /// A buffer counted by [`admit`](Self::admit) as `site` is released
    /// (or reclaimed): its bytes are no longer live there.
    #[inline]
    pub(crate) fn release(&self, site: SiteId, bytes: u64) {
        if let Some(slot) = (site as usize)
            .checked_sub(1)
            .and_then(|i| self.slots.get(i))
        {
            slot.live_bytes.fetch_sub(bytes, Relaxed);
            slot.releases.fetch_add(1, Relaxed);
        }
    }

    /// An allocation at `location` was refused: the site's id.
    #[cold]
    pub(crate) fn refused(&self, location: &'static Location<'static>, names: Names) -> SiteId {
        let at = self.find(location, names);
        self.slots[at].refusals.fetch_add(1, Relaxed);
        at as SiteId + 1
    }

    /// The site counted as `site` as snapshots name it (`file:line:col`,
    /// or the name the allocation gave), and its label.
    pub(crate) fn name(&self, site: SiteId) -> Option<(String, Option<&'static str>)> {
        let (location, names) = self.key(site)?;
        Some((site_name(location, names), names.label))
    }

    /// Where the buffer counted as `site` was made, and its names.
    pub(crate) fn key(&self, site: SiteId) -> Option<(&'static Location<'static>, Names)> {
        let slot = self.slots.get((site as usize).checked_sub(1)?)?;
        slot.key.get().map(|k| (k.location, k.names))
    }

    /// Every site's figures, merged by `file:line:col` and label, most live
    /// bytes first (then most allocations, then by site).
    pub(crate) fn usage(&self) -> Vec<SiteUsage> {
        let mut merged: HashMap<(String, Option<&'static str>), SiteUsage> = HashMap::new();
        for slot in self.slots.iter() {
            let Some(key) = slot.key.get() else { continue };
            let allocations = slot.allocations.load(Relaxed);
            let refusals = slot.refusals.load(Relaxed);
            if allocations == 0 && refusals == 0 {
                continue;
            }
            let releases = slot.releases.load(Relaxed);
            let site = site_name(key.location, key.names);
            let row = merged
                .entry((site.clone(), key.names.label))
                .or_insert_with(|| SiteUsage {
                    site,
                    label: key.names.label.map(str::to_owned),
                    ..SiteUsage::default()
                });
            row.live_bytes += slot.live_bytes.load(Relaxed);
            row.live_count += allocations.saturating_sub(releases);
            row.peak_bytes += slot.peak_bytes.load(Relaxed);
            row.allocations += allocations;
            row.refusals += refusals;
        }
        let mut rows: Vec<SiteUsage> = merged.into_values().collect();
        rows.sort_by(|a, b| {
            b.live_bytes
                .cmp(&a.live_bytes)
                .then(b.allocations.cmp(&a.allocations))
                .then_with(|| a.site.cmp(&b.site))
                .then_with(|| a.label.cmp(&b.label))
        });
        rows
    }
}
