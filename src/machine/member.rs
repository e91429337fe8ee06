//! One process's membership of a machine ledger: its slot, the lease it
//! charges allocations out of, and the doorbell thread that answers other
//! processes' trim requests.
//!
//! # The lease
//!
//! The process charges the ledger in chunks (`JoinOptions::lease_chunk`):
//! an allocation is charged out of the process's idle lease (one
//! compare-and-swap on a process-local word), and only a lease that runs
//! short touches the shared segment, for the allocation plus a chunk. A
//! release goes back into the lease; what is idle beyond one chunk goes
//! back to the ledger. So `W` (the slot's share of the ledger) is always
//! `used + idle`, in whole units. Idle leases are the first thing a trim
//! request takes back, so a refusal that counts another process's idle
//! lease happens only when that process did not answer.

use super::ledger::{self, Refused};
use super::segment::{
    futex_wait, futex_wake, Segment, H_LIMIT, H_NEWS, H_WAITERS, S_ANSWERED, S_ASK, S_CACHED,
    S_CONTEXTS, S_FLOOR, S_GAVE, S_LIMIT, S_PRIORITY, S_RING, S_STATE, S_USED, S_W, S_WAITING,
    UNIT,
};
use super::{Holder, MachineRefusal, RefusedBy};
use crate::sync::lock;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a process budget lends its membership: trimming on request, and
/// the figures `memgov top` shows.
pub(crate) trait Host: Send + Sync {
    /// Give back about `bytes` of device memory (block caches first, then
    /// pressure responders). Returns the bytes released.
    fn trim(&self, bytes: u64) -> u64;
    /// (contexts, bytes in block caches) under the process now.
    fn census(&self) -> (u64, u64);
    /// The process's call sites holding live bytes now (contexts with
    /// attribution on), largest first: what `memgov top` shows per process.
    fn top_sites(&self) -> Vec<(String, u64)>;
}

pub(crate) struct Inner {
    pub(crate) seg: Arc<Segment>,
    pub(crate) slot: usize,
    pub(crate) epoch: u32,
    pub(crate) pid: u32,
    pub(crate) name: String,
    pub(crate) chunk: u64,
    pub(crate) limit: u64,
    pub(crate) floor: u64,
    pub(crate) priority: u32,
    pub(crate) answer_timeout: Duration,
    /// The device whose processes the doorbell thread asks the management
    /// library about (`JoinOptions::watch_device`).
    watch: Option<crate::DeviceIdentity>,
    /// Bytes of the slot's share not charged to allocations (what is
    /// charged to allocations is the share less this: no counter of its
    /// own, so that the hot path is one read-modify-write each way).
    idle: AtomicU64,
    /// One ledger operation at a time for this slot (process-local: it dies
    /// with the process, and nothing else waits on it).
    op: Mutex<()>,
    host: Mutex<Option<Arc<dyn Host>>>,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    left: AtomicBool,
    /// Panics caught on the doorbell thread in calls into the host (its
    /// block caches, pressure responders and census).
    host_panics: AtomicU64,
    /// The slot's lock (see `segment.rs`), held from before the slot was
    /// claimed until after it is free again: while it is held, no sweeper
    /// judges the slot dead.
    lock: Mutex<Option<super::segment::SlotLock>>,
    /// [`FORK_GENERATION`] when this process joined: a forked child's copy
    /// of the membership sees another and is inert.
    fork_generation: u64,
    /// Bytes charged through the public `MachineMember::charge` and not
    /// given back yet: what `MachineMember::uncharge` may give back.
    pub(crate) direct: AtomicU64,
}

/// Bumped in every child a `fork` makes (a `pthread_atfork` handler,
/// registered at the first join): memberships carried into the child by
/// the fork see a generation other than their own and do nothing.
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

extern "C" fn forked_child() {
    // Async-signal-safe: one atomic add.
    FORK_GENERATION.fetch_add(1, SeqCst);
}

fn watch_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a child handler that only bumps an atomic
        // (async-signal-safe, as a handler run after fork must be); no
        // prepare or parent handler.
        unsafe {
            libc::pthread_atfork(None, None, Some(forked_child));
        }
    });
}

/// Why a membership no longer operates on its slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Lost {
    /// It left the ledger.
    Left,
    /// This is a forked child's copy of the parent's membership.
    Forked { parent: u32 },
    /// The slot's state word is not the one this membership wrote.
    Taken { found: u64 },
}

impl Lost {
    pub(crate) fn describe(&self, slot: usize, epoch: u32) -> String {
        match self {
            Lost::Left => format!("it left slot {slot} of the ledger"),
            Lost::Forked { parent } => format!(
                "this process is a fork of pid {parent}, whose membership (slot {slot}) it carries; a forked child joins the ledger itself"
            ),
            Lost::Taken { found } => format!(
                "slot {slot} (epoch {epoch}) was taken from it: the slot is now {:?}, epoch {}, pid {}",
                ledger::st_kind(*found),
                ledger::st_epoch(*found),
                ledger::st_pid(*found)
            ),
        }
    }
}

/// This process counted among the ledger's waiters (`H_WAITERS`) while it
/// lives, and in its slot's own count (`S_WAITING`): the ledger's count
/// first, the slot's after (and back in the other order), so that what a
/// dead process left in the ledger's count is at least its slot's, which a
/// reclaim takes off (`ledger::reclaim`).
struct Waiting<'a>(&'a Segment, usize);

impl<'a> Waiting<'a> {
    fn new(seg: &'a Segment, slot: usize) -> Self {
        seg.word32(H_WAITERS).fetch_add(1, SeqCst);
        seg.slot32(slot, S_WAITING).fetch_add(1, SeqCst);
        Self(seg, slot)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.slot32(self.1, S_WAITING).fetch_sub(1, SeqCst);
        self.0.word32(H_WAITERS).fetch_sub(1, SeqCst);
    }
}

fn units_for(bytes: u64) -> u64 {
    bytes.div_ceil(UNIT)
}

impl Inner {
    pub(crate) fn new(
        seg: Arc<Segment>,
        slot: usize,
        epoch: u32,
        name: String,
        opts: &super::JoinOptions,
        lock: super::segment::SlotLock,
    ) -> Self {
        watch_forks();
        Self {
            seg,
            slot,
            epoch,
            pid: std::process::id(),
            name,
            chunk: opts.lease_chunk,
            limit: opts.limit,
            floor: opts.floor,
            priority: opts.priority,
            answer_timeout: opts.answer_timeout,
            watch: opts.watch.clone(),
            idle: AtomicU64::new(0),
            op: Mutex::new(()),
            host: Mutex::new(None),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            left: AtomicBool::new(false),
            host_panics: AtomicU64::new(0),
            lock: Mutex::new(Some(lock)),
            fork_generation: FORK_GENERATION.load(SeqCst),
            direct: AtomicU64::new(0),
        }
    }

    /// Whether this is the membership of the process that joined (not a
    /// forked child's copy).
    #[inline]
    fn in_joiner(&self) -> bool {
        FORK_GENERATION.load(Relaxed) == self.fork_generation
    }

    /// Whether this membership still holds its slot: it has not left, this
    /// is the process that joined, and the slot's state word is still the
    /// one it wrote. Checked before every operation on the segment (under
    /// `op`, so no operation of this membership runs between the check
    /// and its commit).
    pub(crate) fn holds_slot(&self) -> Result<(), Lost> {
        if !self.in_joiner() {
            return Err(Lost::Forked { parent: self.pid });
        }
        if self.left.load(Acquire) {
            return Err(Lost::Left);
        }
        let live = ledger::st_pack(ledger::Kind::Live, self.epoch, self.pid);
        let found = self.seg.slot(self.slot, S_STATE).load(SeqCst);
        if found != live {
            return Err(Lost::Taken { found });
        }
        Ok(())
    }

    /// Call into the host (user code: pressure responders) from the
    /// doorbell thread; a panic there is caught, counted and reported (the
    /// panic hook has printed it; with `tracing`, a warning names the slot),
    /// so the thread keeps answering rings, sweeping and publishing.
    /// `None` when it panicked.
    fn host_call<T>(&self, what: &'static str, f: impl FnOnce() -> T) -> Option<T> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(v) => Some(v),
            Err(payload) => {
                let n = self.host_panics.fetch_add(1, Relaxed) + 1;
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".to_owned());
                #[cfg(feature = "tracing")]
                tracing::warn!(slot = self.slot, name = %self.name, what, panics = n, message = %message, "memgov: a panic on the machine ledger's doorbell thread was caught; the thread keeps serving");
                #[cfg(not(feature = "tracing"))]
                let _ = (what, n, message);
                None
            }
        }
    }

    /// Panics caught on the doorbell thread so far.
    pub(crate) fn host_panics(&self) -> u64 {
        self.host_panics.load(Relaxed)
    }

    pub(crate) fn set_host(&self, host: Arc<dyn Host>) {
        *lock(&self.host) = Some(host);
    }

    /// The slot's share of the ledger (bytes).
    pub(crate) fn share(&self) -> u64 {
        ledger::w_units(self.seg.slot(self.slot, S_W).load(SeqCst)) * UNIT
    }

    /// Bytes charged to allocations: the share less the idle lease (read
    /// apart, so off by a refill in progress at most).
    pub(crate) fn used(&self) -> u64 {
        self.share().saturating_sub(self.idle())
    }

    pub(crate) fn idle(&self) -> u64 {
        self.idle.load(Relaxed)
    }

    fn publish(&self) {
        self.seg.slot(self.slot, S_USED).store(self.used(), Relaxed);
    }

    /// Units the other slots' floors keep from this slot: for each live
    /// or joining slot, what its floor has not used yet.
    fn others_unmet_floors(&self) -> u64 {
        let seg = &self.seg;
        (0..seg.slots())
            .filter(|&i| i != self.slot)
            .filter(|&i| {
                matches!(
                    ledger::st_kind(seg.slot(i, S_STATE).load(Acquire)),
                    ledger::Kind::Live | ledger::Kind::Claiming
                )
            })
            .map(|i| {
                let floor = seg.slot(i, S_FLOOR).load(Relaxed) / UNIT;
                floor.saturating_sub(ledger::w_units(seg.slot(i, S_W).load(Acquire)))
            })
            .fold(0, u64::saturating_add)
    }

    /// One ledger operation of `+units`, held to the ledger's limit (less
    /// what the device uses outside memgov and the others' unmet floors)
    /// and to this process's own limit. The caller holds `op`.
    fn grow(&self, units: u64) -> Result<(), (RefusedBy, Option<u64>)> {
        self.holds_slot().map_err(|_| (RefusedBy::SlotLost, None))?;
        let mine = ledger::w_units(self.seg.slot(self.slot, S_W).load(SeqCst));
        if mine.saturating_add(units).saturating_mul(UNIT) > self.limit {
            return Err((RefusedBy::ProcessLimit, None));
        }
        let limit_units = ledger::limit(&self.seg) / UNIT;
        let outside = ledger::outside_units(&self.seg);
        // Floors are read once per refill, not per commit attempt: a floor
        // is kept against refills that read the table after its holder
        // joined.
        let floors = self.others_unmet_floors();
        let fits = |after: u64| after.saturating_add(outside).saturating_add(floors) <= limit_units;
        match ledger::operate(&self.seg, self.slot, units as i64, Some(&fits)) {
            Ok(_) => Ok(()),
            Err(Refused::Limit { total_units }) => {
                Err((RefusedBy::Ledger, Some(total_units * UNIT)))
            }
            Err(Refused::Impossible { total, .. }) => Err((RefusedBy::Ledger, Some(total * UNIT))),
        }
    }

    /// Charge `bytes` for an allocation: out of the idle lease, else by a
    /// refill of the allocation plus a chunk, else of the allocation alone.
    #[inline]
    pub(crate) fn charge(&self, bytes: u64) -> Result<(), Box<MachineRefusal>> {
        let mut idle = self.idle.load(Relaxed);
        // A forked child's copy charges nothing out of the parent's lease:
        // the slow path refuses it.
        while idle >= bytes && self.in_joiner() {
            match self
                .idle
                .compare_exchange_weak(idle, idle - bytes, AcqRel, Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(now) => idle = now,
            }
        }
        self.charge_slow(bytes)
    }

    #[cold]
    fn charge_slow(&self, bytes: u64) -> Result<(), Box<MachineRefusal>> {
        if !self.in_joiner() {
            // `op` may have been held by a thread the fork left behind.
            return Err(Box::new(self.refusal(bytes, RefusedBy::SlotLost, None)));
        }
        let _op = lock(&self.op);
        let have = self.idle.swap(0, AcqRel);
        if have >= bytes {
            self.idle.fetch_add(have - bytes, AcqRel);
            return Ok(());
        }
        let need = bytes - have;
        let mut tries = vec![units_for(need.saturating_add(self.chunk))];
        if self.chunk > 0 {
            tries.push(units_for(need));
        }
        let mut by = (RefusedBy::Ledger, None);
        for units in tries {
            match self.grow(units) {
                Ok(()) => {
                    self.idle.fetch_add(units * UNIT - need, AcqRel);
                    self.publish();
                    return Ok(());
                }
                Err(b) => {
                    by = b;
                    if by.0 == RefusedBy::SlotLost {
                        break;
                    }
                }
            }
        }
        self.idle.fetch_add(have, AcqRel);
        Err(Box::new(self.refusal(bytes, by.0, by.1)))
    }

    /// Charge `bytes` whatever the limits (memory that exists already, or a
    /// reclaim's claim).
    pub(crate) fn force_charge(&self, bytes: u64) {
        if !self.in_joiner() {
            return;
        }
        let _op = lock(&self.op);
        if self.holds_slot().is_err() {
            // Nothing to charge on: the next refill is refused, naming why.
            return;
        }
        let have = self.idle.swap(0, AcqRel);
        if have >= bytes {
            self.idle.fetch_add(have - bytes, AcqRel);
        } else {
            let units = units_for(bytes - have);
            let _ = ledger::operate(&self.seg, self.slot, units as i64, None);
            self.idle.fetch_add(units * UNIT - (bytes - have), AcqRel);
        }
        self.publish();
    }

    /// `bytes` charged here came back: into the lease, and what is idle
    /// beyond one chunk back to the ledger.
    #[inline]
    pub(crate) fn uncharge(&self, bytes: u64) {
        let idle = self.idle.fetch_add(bytes, AcqRel) + bytes;
        // Keep up to two chunks idle; beyond that, back to one.
        if idle >= self.chunk.saturating_mul(2).saturating_add(UNIT) {
            self.return_idle(self.chunk);
        }
    }

    /// Give the idle lease beyond `keep` back to the ledger, in whole
    /// units. Returns the bytes given back.
    pub(crate) fn return_idle(&self, keep: u64) -> u64 {
        if !self.in_joiner() {
            return 0;
        }
        let _op = lock(&self.op);
        if self.holds_slot().is_err() {
            // The lease went with the slot (or is the parent's): nothing
            // of it is this membership's to give back.
            self.idle.store(0, Release);
            return 0;
        }
        let mut idle = self.idle.load(Acquire);
        loop {
            let units = idle.saturating_sub(keep) / UNIT;
            if units == 0 {
                self.publish();
                return 0;
            }
            match self
                .idle
                .compare_exchange(idle, idle - units * UNIT, AcqRel, Acquire)
            {
                Ok(_) => {
                    // The share covers the idle lease (it is `used +
                    // idle`): an impossible give-back is refused, counted,
                    // and changes nothing.
                    if ledger::operate(&self.seg, self.slot, -(units as i64), None).is_err() {
                        return 0;
                    }
                    self.publish();
                    return units * UNIT;
                }
                Err(now) => idle = now,
            }
        }
    }

    /// Whether the ledger is within its limit (a claim that forced a charge
    /// on it can be kept).
    pub(crate) fn fits(&self) -> bool {
        self.over() == 0
    }

    /// How far the ledger is over its limit, in bytes.
    pub(crate) fn over(&self) -> u64 {
        if !self.in_joiner() {
            return 0;
        }
        let total = ledger::total_units(&self.seg) * UNIT;
        total
            .saturating_add(ledger::outside_bytes(&self.seg))
            .saturating_sub(ledger::limit(&self.seg))
    }

    /// The refusal of `bytes`, with every process's figures; `seen` is the
    /// total the refused commit saw (bytes), which the refusal reports.
    pub(crate) fn refusal(&self, bytes: u64, by: RefusedBy, seen: Option<u64>) -> MachineRefusal {
        let snap = super::snapshot_of(&self.seg);
        let floors = self.others_unmet_floors() * UNIT;
        MachineRefusal {
            ledger: self.seg.key().to_owned(),
            by,
            requested: bytes,
            charged: seen.unwrap_or(snap.charged),
            limit: snap.limit,
            outside: snap.outside,
            floors_reserved: floors,
            process: self.name.clone(),
            pid: self.pid,
            process_charged: self.share(),
            process_limit: self.limit,
            process_limit_from: self.seg.slot_limit_from(self.slot),
            holders: snap
                .processes
                .iter()
                .filter(|p| p.slot != self.slot)
                .map(Holder::from)
                .collect(),
            unanswered: Vec::new(),
            lost: match by {
                RefusedBy::SlotLost => self
                    .holds_slot()
                    .err()
                    .map(|l| l.describe(self.slot, self.epoch)),
                _ => None,
            },
        }
    }

    /// Ask the other processes for room for `bytes`: reclaim dead slots,
    /// then ring the doorbells of those that can give (idle leases, block
    /// caches, or a lower priority above their floor), lowest priority
    /// first, and wait until the room is there, every one asked answered,
    /// or `deadline`. Returns those that did not answer in time.
    pub(crate) fn make_room(&self, bytes: u64, deadline: Instant) -> Vec<Holder> {
        if self.holds_slot().is_err() {
            return Vec::new();
        }
        ledger::sweep(&self.seg);
        if self.room_for(bytes) {
            return Vec::new();
        }
        let snap = super::snapshot_of(&self.seg);
        let mut shortfall = snap
            .charged
            .saturating_add(snap.outside)
            .saturating_add(bytes)
            .saturating_sub(snap.limit);
        let mut cands: Vec<_> = snap
            .processes
            .iter()
            .filter(|p| p.slot != self.slot && p.live)
            .filter_map(|p| {
                let idle = p.charged.saturating_sub(p.used);
                let above = if p.priority < self.priority {
                    (p.charged.saturating_sub(idle + p.cached)).saturating_sub(p.floor)
                } else {
                    0
                };
                let can = idle + p.cached + above;
                (can > 0).then_some((p, can))
            })
            .collect();
        cands.sort_by_key(|(p, can)| (p.priority, std::cmp::Reverse(*can)));
        let mut asked = Vec::new();
        for (p, can) in cands {
            if shortfall == 0 {
                break;
            }
            let want = shortfall.min(can);
            self.seg.slot(p.slot, S_ASK).fetch_max(want, AcqRel);
            let ring = self.seg.slot32(p.slot, S_RING);
            let r = ring.fetch_add(1, AcqRel).wrapping_add(1);
            futex_wake(ring);
            asked.push((p, r));
            shortfall -= want;
        }
        let answered = |p: &super::ProcessSnapshot, r: u32| {
            let a = self.seg.slot(p.slot, S_ANSWERED).load(Acquire) as u32;
            (a.wrapping_sub(r) as i32) >= 0
                || self.seg.slot(p.slot, S_STATE).load(Acquire) >> 62 != 2
        };
        // Sleep on the news word between looks: a holder bumps it when it
        // answers and whenever a share is given back (`ledger::announce`).
        // The wait is capped, so a change nobody announces (another
        // process's outside memory going away, a holder of an older build)
        // is still seen within 50 ms.
        let _waiting = Waiting::new(&self.seg, self.slot);
        let news = self.seg.word32(H_NEWS);
        loop {
            let seen = news.load(SeqCst);
            if self.room_for(bytes) || asked.iter().all(|(p, r)| answered(p, *r)) {
                return Vec::new();
            }
            let now = Instant::now();
            if now >= deadline {
                return asked
                    .iter()
                    .filter(|(p, r)| !answered(p, *r))
                    .map(|(p, _)| Holder::from(*p))
                    .collect();
            }
            futex_wait(news, seen, (deadline - now).min(Duration::from_millis(50)));
        }
    }

    fn room_for(&self, bytes: u64) -> bool {
        let limit = ledger::limit(&self.seg);
        let total = (ledger::total_units(&self.seg) * UNIT)
            .saturating_add(ledger::outside_bytes(&self.seg));
        total
            .saturating_add(self.others_unmet_floors().saturating_mul(UNIT))
            .saturating_add(bytes.saturating_sub(self.idle()))
            <= limit
    }

    /// Serve one ring of the doorbell: idle leases first, then the host's
    /// trim; wait (briefly) for the releases it queued to settle and give
    /// those back too. Returns the bytes given back.
    fn serve(&self) -> u64 {
        let ask = self.seg.slot(self.slot, S_ASK).swap(0, AcqRel);
        let mut gave = self.return_idle(0);
        if ask > gave {
            let host = lock(&self.host).clone();
            if let Some(host) = host {
                // A responder that panicked freed nothing it could say:
                // what did come back is still given below.
                let freed = self
                    .host_call("trim", || host.trim(ask - gave))
                    .unwrap_or(0);
                // The trim queued stream-ordered frees: their bytes come
                // back into the lease as they settle. Wait for them (a
                // bounded while) before answering, so that the requester's
                // next attempt sees them.
                let until = Instant::now() + self.answer_timeout.min(Duration::from_millis(200));
                loop {
                    gave += self.return_idle(0);
                    if gave >= ask.min(freed) || Instant::now() >= until {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        self.seg.slot(self.slot, S_GAVE).fetch_add(gave, Relaxed);
        gave
    }

    fn census(&self) {
        let host = lock(&self.host).clone();
        if let Some((contexts, cached)) = host
            .as_ref()
            .and_then(|h| self.host_call("census", || h.census()))
        {
            self.seg
                .slot(self.slot, S_CONTEXTS)
                .store(contexts, Relaxed);
            self.seg.slot(self.slot, S_CACHED).store(cached, Relaxed);
        }
        if let Some(sites) = host.and_then(|h| self.host_call("top_sites", || h.top_sites())) {
            self.seg.set_slot_sites(self.slot, &sites);
        }
        self.publish();
    }

    /// The doorbell thread: answers rings, publishes the census, sweeps
    /// dead slots about once a second.
    pub(crate) fn start(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        let handle = std::thread::Builder::new()
            .name("memgov-machine".into())
            .spawn(move || {
                let mut last_sweep = Instant::now();
                let mut last_watch: Option<Instant> = None;
                loop {
                    let Some(m) = me.upgrade() else { return };
                    if m.stop.load(Acquire) {
                        return;
                    }
                    let ring = m.seg.slot32(m.slot, S_RING);
                    let r = ring.load(Acquire);
                    let answered = m.seg.slot(m.slot, S_ANSWERED).load(Acquire) as u32;
                    if r != answered {
                        m.serve();
                        if m.stop.load(Acquire) {
                            // It left while serving (the trim dropped the
                            // last membership): the slot is no longer its.
                            return;
                        }
                        m.seg.slot(m.slot, S_ANSWERED).store(u64::from(r), Release);
                        ledger::announce(&m.seg);
                        continue;
                    }
                    m.census();
                    if last_sweep.elapsed() >= Duration::from_secs(1) {
                        last_sweep = Instant::now();
                        ledger::sweep(&m.seg);
                    }
                    if let Some(id) = &m.watch {
                        if last_watch.is_none_or(|t| t.elapsed() >= Duration::from_secs(2)) {
                            last_watch = Some(Instant::now());
                            // Without the library there is nothing to
                            // observe; the driver's view still counts.
                            if let Ok(found) = super::device_processes(id) {
                                super::observe_processes(&m.seg, &found);
                            }
                        }
                    }
                    let seg = Arc::clone(&m.seg);
                    let slot = m.slot;
                    // Not holding the membership while asleep: dropping it
                    // stops the thread.
                    drop(m);
                    futex_wait(seg.slot32(slot, S_RING), r, Duration::from_millis(250));
                }
            })
            .expect("spawn the memgov-machine doorbell thread");
        *lock(&self.thread) = Some(handle);
    }

    /// Leave the ledger: stop the doorbell thread, give every byte back,
    /// free the slot.
    pub(crate) fn leave(&self) {
        if !self.in_joiner() {
            // A forked child's copy: the slot is the parent's, and the
            // doorbell thread did not survive the fork.
            return;
        }
        if self.left.swap(true, SeqCst) {
            return;
        }
        self.stop.store(true, Release);
        let ring = self.seg.slot32(self.slot, S_RING);
        ring.fetch_add(1, AcqRel);
        futex_wake(ring);
        if let Some(t) = lock(&self.thread).take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        // No operation of this membership runs past here (each checks
        // `left` under `op`), and the idle lease goes back with the whole
        // share: none of it is this membership's to give back again.
        let _op = lock(&self.op);
        self.idle.store(0, Release);
        let live = ledger::st_pack(ledger::Kind::Live, self.epoch, self.pid);
        // Take the slot as its own reclaimer, holding its lock: the same
        // path a sweeper takes for a dead process, so what it gives back is
        // exact.
        let _ = ledger::reclaim(&self.seg, self.slot, live, self.pid, false);
        // Free: let the lock go (a sweeper finding it free now finds the
        // slot free too).
        drop(lock(&self.lock).take());
    }

    /// A membership whose join failed (its slot already given back, or
    /// taken): let the slot's lock go; it never operates.
    pub(crate) fn abandon(&self) {
        self.left.store(true, SeqCst);
        drop(lock(&self.lock).take());
    }

    pub(crate) fn set_limit_word(&self) {
        self.seg.slot(self.slot, S_LIMIT).store(self.limit, Relaxed);
        // Sequentially consistent: the join's floors check reads the
        // others' floors after this (see `floors_of_others`).
        self.seg.slot(self.slot, S_FLOOR).store(self.floor, SeqCst);
        self.seg
            .slot(self.slot, S_PRIORITY)
            .store(u64::from(self.priority), Relaxed);
    }

    pub(crate) fn ledger_limit(&self) -> u64 {
        self.seg.word(H_LIMIT).load(Relaxed)
    }
}

use std::sync::atomic::Ordering::Release;

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.in_joiner() {
            // The doorbell thread's handle names a thread of the parent:
            // neither join nor detach it here.
            let t = self.thread.get_mut().unwrap_or_else(|e| e.into_inner());
            std::mem::forget(t.take());
        }
    }
}
