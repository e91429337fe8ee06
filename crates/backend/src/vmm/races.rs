//! The arena's books under the interleavings an LLM server drives: a
//! release retiring while its set wakes, a wake failing half-way, the
//! driver refusing a release, a capture on the calling thread, a whole
//! sleep racing a set's. Each interleaving is forced (a hook inside the
//! driver step, or a thread held until another is parked on the arena's
//! condition variable), never left to timing; every allocation is checked
//! against the live ones for overlap and against the driver's mappings.

use super::state::Slot;
use super::{Arena, GranuleDriver, MapError, SleepDriver};
use crate::{lock, BackendError, BackendErrorKind};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

const G: u64 = 2 << 20;
const BASE: u64 = 0x10_0000_0000;

type Hook = Arc<dyn Fn(usize) + Send + Sync>;

/// A driver usable from several threads: handles are numbers, granules
/// mapped are a set, host copies are numbered; hooks run inside a map or an
/// offload (no arena lock held), and failures are planted by granule.
#[derive(Default)]
struct Driver {
    mapped: Mutex<BTreeSet<usize>>,
    hosts: Mutex<HashMap<usize, u64>>,
    next_host: AtomicU32,
    on_map: Mutex<Option<Hook>>,
    on_offload: Mutex<Option<Hook>>,
    /// Granules whose next map fails.
    fail_map: Mutex<Vec<usize>>,
    /// Granules whose next release is refused after the unmap.
    refuse_release: Mutex<Vec<usize>>,
    /// The offload (counting from 1) that fails.
    fail_offload: AtomicU32,
    offloads: AtomicU32,
    /// Make-current calls to fail.
    fail_current: AtomicU32,
    /// The thread whose own capture is under way.
    capturing: Mutex<Option<ThreadId>>,
    /// An unmap ran on the capturing thread (which invalidates its capture).
    unmapped_in_capture: AtomicBool,
}

impl Driver {
    fn own(&self) -> bool {
        *lock(&self.capturing) == Some(std::thread::current().id())
    }
}

impl GranuleDriver for Driver {
    type Handle = u64;
    type Current = ();

    fn backend(&self) -> &'static str {
        "fake"
    }
    fn make_current(&self, op: &'static str) -> Result<(), BackendError> {
        let left = self.fail_current.load(Ordering::SeqCst);
        if left > 0 {
            self.fail_current.store(left - 1, Ordering::SeqCst);
            let e = BackendError::new("fake", op, BackendErrorKind::Other, "planted: not current");
            return Err(e);
        }
        Ok(())
    }
    fn refuse_own_capture(&self, op: &'static str) -> Result<(), BackendError> {
        if self.own() {
            let e = BackendError::new("fake", op, BackendErrorKind::InvalidArgument, "own capture");
            return Err(e);
        }
        Ok(())
    }
    fn map(&self, g: usize, op: &'static str) -> Result<u64, MapError<u64>> {
        let hook = lock(&self.on_map).clone();
        if let Some(hook) = hook {
            hook(g);
        }
        let mut fail = lock(&self.fail_map);
        if let Some(i) = fail.iter().position(|&f| f == g) {
            fail.remove(i);
            let e = BackendError::new("fake", op, BackendErrorKind::OutOfMemory, "planted map");
            return Err((e, None));
        }
        assert!(lock(&self.mapped).insert(g), "granule {g} mapped twice");
        Ok(100 + g as u64)
    }
    fn unmap(&self, g: usize, h: u64, _: &'static str) -> Result<(), Slot<u64>> {
        assert_eq!(h, 100 + g as u64, "the handle mapped at that granule");
        if self.own() {
            self.unmapped_in_capture.store(true, Ordering::SeqCst);
        }
        assert!(lock(&self.mapped).remove(&g), "unmap of a mapped granule");
        let mut refuse = lock(&self.refuse_release);
        if let Some(i) = refuse.iter().position(|&r| r == g) {
            refuse.remove(i);
            return Err(Slot::Quarantined {
                handle: Some(h),
                mapped: false,
            });
        }
        Ok(())
    }
    fn release(&self, _: u64, _: &'static str) -> Result<(), BackendError> {
        Ok(())
    }
    fn free_host(&self, host: usize, _: &'static str) {
        assert!(
            lock(&self.hosts).remove(&host).is_some(),
            "host copy freed once"
        );
    }
}

impl SleepDriver for Driver {
    fn quiesce(&self, _: &'static str) -> Result<(), BackendError> {
        Ok(())
    }
    fn offload(&self, at: u64, _: u64) -> Result<usize, BackendError> {
        let hook = lock(&self.on_offload).clone();
        if let Some(hook) = hook {
            hook(((at - BASE) / G) as usize);
        }
        let n = self.offloads.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.fail_offload.load(Ordering::SeqCst) {
            let e = BackendError::new("fake", "offload", BackendErrorKind::OutOfMemory, "planted");
            return Err(e);
        }
        let host = 0x1000 + self.next_host.fetch_add(1, Ordering::SeqCst) as usize;
        lock(&self.hosts).insert(host, at);
        Ok(host)
    }
    fn restore(&self, at: u64, host: usize, _: u64) -> Result<(), BackendError> {
        assert_eq!(
            lock(&self.hosts).get(&host),
            Some(&at),
            "restored where it was"
        );
        Ok(())
    }
}

/// The live allocations, each checked when it is made: inside the
/// reservation, overlapping no other, on granules the driver has mapped.
#[derive(Default)]
struct Live(Vec<(u64, u64)>);

impl Live {
    fn take(&mut self, a: &Arena<u64>, d: &Driver, bytes: u64) -> Result<u64, BackendError> {
        let p = a.allocate(d, bytes)?;
        let len = bytes.next_multiple_of(super::ALIGN);
        assert!(
            a.contains(p) && p + len <= a.base + a.size,
            "{p:#x} in the reservation"
        );
        for &(q, l) in &self.0 {
            assert!(
                p + len <= q || q + l <= p,
                "{p:#x}+{len:#x} overlaps the live {q:#x}+{l:#x}"
            );
        }
        let mapped = lock(&d.mapped);
        for g in (p - BASE) / G..(p - BASE + len).div_ceil(G) {
            assert!(
                mapped.contains(&(g as usize)),
                "{p:#x}+{len:#x} lies on granule {g}, which the driver has not mapped"
            );
        }
        self.0.push((p, len));
        Ok(p)
    }

    fn retire(&mut self, a: &Arena<u64>, p: u64) {
        self.0.retain(|&(q, _)| q != p);
        a.retire(p);
    }

    /// Allocate `bytes` until the arena refuses; returns how many fit.
    fn fill(&mut self, a: &Arena<u64>, d: &Driver, bytes: u64) -> u64 {
        let mut n = 0;
        while self.take(a, d, bytes).is_ok() {
            n += 1;
        }
        n
    }
}

fn arena(granules: u64, limit: u64) -> Arena<u64> {
    Arena::new(BASE, granules * G, G, limit, "Fake")
}

/// Spin (yielding) until `what` holds: a forced interleaving's wait for a
/// thread to reach its point, with no time limit of its own.
fn until(what: impl Fn() -> bool) {
    while !what() {
        std::thread::yield_now();
    }
}

#[test]
fn a_release_retiring_during_its_set_s_wake_frees_its_range_once() {
    let d = Arc::new(Driver::default());
    let a = Arc::new(arena(4, u64::MAX));
    let mut live = Live::default();
    let p = live.take(&a, &d, G / 2).expect("p");
    let q = live.take(&a, &d, G / 2).expect("q");
    assert_eq!(q, p + G / 2, "p and q share granule 0");
    a.sleep_ranges(&*d, &[p, q], true).expect("sleep p and q");
    // q's release retires while the wake maps granule 0.
    let (a2, retired) = (a.clone(), Arc::new(AtomicBool::new(false)));
    let r2 = retired.clone();
    *lock(&d.on_map) = Some(Arc::new(move |g| {
        if g == 0 && !r2.swap(true, Ordering::SeqCst) {
            a2.retire(q);
        }
    }));
    assert_eq!(a.wake_ranges(&*d, &[p]).expect("wake"), G);
    assert!(retired.load(Ordering::SeqCst), "q retired during the wake");
    *lock(&d.on_map) = None;
    live.0.retain(|&(x, _)| x != q);
    // Every byte but p's, once: 7 half granules, none overlapping.
    assert_eq!(live.fill(&a, &d, G / 2), 7);
    assert_eq!(a.snapshot().in_use, 4 * G);
}

#[test]
fn a_failed_wake_keeps_the_space_of_a_release_retired_during_it_out_of_the_allocator() {
    let d = Arc::new(Driver::default());
    let a = Arc::new(arena(4, u64::MAX));
    let mut live = Live::default();
    let p = live.take(&a, &d, G / 2).expect("p");
    let q = live.take(&a, &d, G / 2).expect("q");
    let r = live.take(&a, &d, G).expect("r, granule 1");
    a.sleep_ranges(&*d, &[p, q, r], true)
        .expect("sleep the set");
    let a2 = a.clone();
    let retired = Arc::new(AtomicBool::new(false));
    let r2 = retired.clone();
    *lock(&d.on_map) = Some(Arc::new(move |g| {
        if g == 0 && !r2.swap(true, Ordering::SeqCst) {
            a2.retire(q);
        }
    }));
    lock(&d.fail_map).push(1);
    a.wake_ranges(&*d, &[p, r])
        .expect_err("granule 1 fails to map");
    assert!(retired.load(Ordering::SeqCst));
    *lock(&d.on_map) = None;
    live.0.retain(|&(x, _)| x != q);
    assert_eq!(a.snapshot().asleep, 2 * G, "the set sleeps still");
    // Nothing lands in the sleeping granules (each allocation is checked
    // to lie on mapped granules): granules 2 and 3 only.
    assert_eq!(live.fill(&a, &d, G / 2), 4);
    for x in live.0.split_off(2) {
        live.retire(&a, x.0);
    }
    a.wake_ranges(&*d, &[p, r]).expect("the second wake");
    // q's space comes back once: one more half granule than granules 2 and 3.
    assert_eq!(live.fill(&a, &d, G / 2), 5);
}

#[test]
fn a_quarantined_granule_stays_out_of_the_allocator_when_its_users_retire() {
    let d = Driver::default();
    let a = arena(4, u64::MAX);
    let mut live = Live::default();
    let p = live.take(&a, &d, G).expect("p, granule 0");
    lock(&d.refuse_release).push(0);
    a.sleep_ranges(&d, &[p], true)
        .expect_err("the release is refused");
    let s = a.snapshot();
    assert_eq!(s.quarantined.len(), 1);
    assert!(!s.quarantined[0].mapped);
    // Its memory is gone: copies are refused, also after a wake.
    let e = a.check_awake("fake", "write", p, 16).expect_err("unmapped");
    assert!(e.message.contains("quarantined"), "{e}");
    assert_eq!(a.wake(&d).expect("nothing asleep to wake"), 0);
    a.check_awake("fake", "write", p, 16)
        .expect_err("still unmapped");
    live.retire(&a, p);
    // Granules 1 to 3 only, each checked to be mapped.
    assert_eq!(live.fill(&a, &d, G / 2), 6);
}

#[test]
fn a_refused_release_stays_counted_against_the_limit() {
    let d = Driver::default();
    let a = arena(16, 4 * G);
    let mut live = Live::default();
    for _ in 0..4 {
        live.take(&a, &d, G).expect("a granule");
    }
    for (p, _) in std::mem::take(&mut live.0) {
        a.retire(p);
    }
    lock(&d.refuse_release).push(0);
    a.trim(&d, "trim").expect_err("granule 0's release refused");
    let s = a.snapshot();
    assert_eq!(
        (s.mapped, s.unreleased),
        (0, G),
        "the driver still holds granule 0"
    );
    assert_eq!(live.fill(&a, &d, G), 3, "3 more fit a 4-granule limit");
    assert_eq!(lock(&d.mapped).len() + 1, 4, "the driver holds 4, not 5");
}

#[test]
fn the_capturing_thread_s_allocation_is_refused_rather_than_waiting_for_a_granule_in_transition() {
    let d = Arc::new(Driver::default());
    let a = Arc::new(arena(4, u64::MAX));
    // B maps granule 0 and, inside the map, waits for A's capture to end (as
    // the gate makes it).
    let ended = Arc::new(AtomicBool::new(false));
    let in_map = Arc::new(AtomicBool::new(false));
    let (e2, m2) = (ended.clone(), in_map.clone());
    *lock(&d.on_map) = Some(Arc::new(move |_| {
        m2.store(true, Ordering::SeqCst);
        until(|| e2.load(Ordering::SeqCst));
    }));
    *lock(&d.capturing) = Some(std::thread::current().id());
    let (a2, d2) = (a.clone(), d.clone());
    let b = std::thread::spawn(move || a2.allocate(&*d2, G / 2));
    until(|| in_map.load(Ordering::SeqCst));
    // A, capturing: its allocation lands in granule 0, in transition.
    let (a3, d3) = (a.clone(), d.clone());
    let me = std::thread::current().id();
    let own = std::thread::spawn(move || {
        *lock(&d3.capturing) = Some(std::thread::current().id());
        a3.allocate(&*d3, G / 2)
    });
    until(|| own.is_finished() || lock(&a.state).waiting > 0);
    let waited = lock(&a.state).waiting > 0;
    // End the capture either way, so that nothing is left hanging.
    *lock(&d.capturing) = Some(me);
    ended.store(true, Ordering::SeqCst);
    let r = own.join().expect("A");
    b.join().expect("B").expect("B's allocation");
    assert!(
        !waited,
        "the capturing thread waited for a granule in transition"
    );
    let e = r.expect_err("refused at once");
    assert!(e.message.contains("own capture"), "{e}");
}

#[test]
fn the_capturing_thread_s_allocation_over_the_limit_never_unmaps() {
    let d = Driver::default();
    let a = arena(8, 2 * G);
    let mut live = Live::default();
    let p = live.take(&a, &d, G).expect("p");
    live.take(&a, &d, G).expect("q");
    live.retire(&a, p);
    *lock(&d.capturing) = Some(std::thread::current().id());
    // Two granules past q: over the limit, so granule 0 would be trimmed.
    let e = live.take(&a, &d, 2 * G).expect_err("refused");
    assert!(e.message.contains("own capture"), "{e}");
    let e = a.trim(&d, "trim").expect_err("refused");
    assert!(e.message.contains("own capture"), "{e}");
    assert!(
        !d.unmapped_in_capture.load(Ordering::SeqCst),
        "cuMemUnmap inside the capture"
    );
    assert_eq!(a.snapshot().cached, G, "the cached granule stays");
    *lock(&d.capturing) = None;
    // Once the capture ended, the same allocation trims granule 0.
    let e = live.take(&a, &d, 2 * G).expect_err("still over the limit");
    assert_eq!(e.kind, BackendErrorKind::OutOfMemory, "{e}");
    assert_eq!(a.snapshot().cached, 0, "trimmed");
}

#[test]
fn a_wake_maps_only_the_granules_with_live_users() {
    let d = Driver::default();
    let a = arena(8, u64::MAX);
    let mut live = Live::default();
    let p = live.take(&a, &d, G).expect("p");
    let q = live.take(&a, &d, 2 * G).expect("q");
    a.sleep(&d, true).expect("sleep");
    live.retire(&a, q);
    assert_eq!(a.wake(&d).expect("wake"), G, "p's granule only");
    assert_eq!(*lock(&d.mapped), BTreeSet::from([0]));
    assert!(lock(&d.hosts).is_empty(), "q's host copies freed");
    let s = a.snapshot();
    assert_eq!((s.mapped, s.cached, s.asleep), (G, 0, 0));
    // A set: the same.
    let r = live.take(&a, &d, G).expect("r");
    let t = live.take(&a, &d, G).expect("t");
    a.sleep_ranges(&d, &[r, t], true).expect("sleep r and t");
    live.retire(&a, t);
    assert_eq!(a.wake_ranges(&d, &[r]).expect("wake r"), G);
    assert_eq!(a.wake(&d).expect("nothing else"), 0);
    assert_eq!(lock(&d.mapped).len(), 2, "p's and r's granules");
    assert_eq!(live.fill(&a, &d, G), 6, "t's granule free again");
    live.retire(&a, p);
    live.retire(&a, r);
}

#[test]
fn a_sleep_whose_copy_fails_leaves_the_arena_awake_with_nothing_released() {
    let d = Driver::default();
    let a = arena(8, u64::MAX);
    let mut live = Live::default();
    live.take(&a, &d, 3 * G).expect("p");
    d.fail_offload.store(2, Ordering::SeqCst);
    a.sleep(&d, true).expect_err("the second copy fails");
    assert!(!a.is_asleep(), "the arena is awake, as the caller is told");
    assert_eq!(lock(&d.mapped).len(), 3, "nothing released");
    assert!(lock(&d.hosts).is_empty(), "the first copy freed");
    assert_eq!(a.snapshot().asleep, 0);
    live.take(&a, &d, G).expect("allocations go on");
    a.sleep(&d, true).expect("a later sleep");
    assert_eq!(a.wake(&d).expect("wake"), 4 * G);
}

#[test]
fn a_whole_sleep_waiting_on_a_set_s_sleep_is_refused_once_the_set_sleeps() {
    let d = Arc::new(Driver::default());
    let a = Arc::new(arena(4, u64::MAX));
    let mut live = Live::default();
    let p = live.take(&a, &d, G).expect("p");
    live.take(&a, &d, G).expect("q");
    let (go, in_copy) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (g2, c2) = (go.clone(), in_copy.clone());
    *lock(&d.on_offload) = Some(Arc::new(move |_| {
        c2.store(true, Ordering::SeqCst);
        until(|| g2.load(Ordering::SeqCst));
    }));
    let (a2, d2) = (a.clone(), d.clone());
    let set = std::thread::spawn(move || a2.sleep_ranges(&*d2, &[p], true));
    until(|| in_copy.load(Ordering::SeqCst));
    let (a3, d3) = (a.clone(), d.clone());
    let whole = std::thread::spawn(move || a3.sleep(&*d3, false));
    until(|| lock(&a.state).waiting > 0);
    go.store(true, Ordering::SeqCst);
    set.join().expect("set").expect("the set sleeps");
    let e = whole.join().expect("whole").expect_err("a set sleeps");
    assert!(e.message.contains("sleep_ranges"), "{e}");
    assert!(!a.is_asleep());
    *lock(&d.on_offload) = None;
    assert_eq!(a.wake(&*d).expect("wake the set"), G);
}

#[test]
fn a_teardown_that_cannot_make_the_context_current_keeps_every_handle() {
    let d = Driver::default();
    let a = arena(4, u64::MAX);
    let p = a.allocate(&d, G).expect("p");
    let q = a.allocate(&d, G).expect("q");
    a.sleep_ranges(&d, &[q], true).expect("q sleeps");
    a.retire(p);
    d.fail_current.store(1, Ordering::SeqCst);
    a.teardown(&d).expect_err("not current");
    a.teardown(&d).expect("the second teardown");
    assert!(lock(&d.mapped).is_empty(), "granule 0 unmapped");
    assert!(lock(&d.hosts).is_empty(), "q's host copy freed");
}
