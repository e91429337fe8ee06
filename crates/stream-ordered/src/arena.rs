//! The virtual-memory arena's driver glue, written once over the vendor's
//! table: one granule's steps (create, map, set access, each undone on
//! failure; unmap, release), the page-locked copies of a sleep and a wake on
//! a stream of their own, and the two as the [`vmm::GranuleDriver`] and
//! [`vmm::SleepDriver`] the arena core (`memgov_backend::vmm`) drives.
//!
//! A vendor provides its entry points ([`VmmTable`], on its vendor type)
//! and a context to run them in ([`Context`], on its shared state: the
//! checked call that marks a context lost on a sticky code, the device
//! made current, the capture gate, the streams drained). Every message
//! names the vendor's own call ([`VmmNames`]).

use crate::result::{err, Class, Vendor};
use crate::retire;
use crate::table::{Context, HandleOf, VmmNames, VmmTable};
use memgov_backend::shell::{self, Current};
use memgov_backend::vmm::{self, ArenaConfig, Slot};
use memgov_backend::{BackendError, BackendErrorKind, BackendProbe};
use std::cell::Cell;
use std::time::{Duration, Instant};

use memgov_backend::capability::SleepReport;
use std::sync::Arc;

type TableOf<C> = <C as Context>::Table;
type PropOf<C> = <TableOf<C> as VmmTable>::Prop;

/// The books of a new arena: ask the granularity of granules made with
/// `prop`, reserve `config.reserve_bytes` (at least one granule, rounded up
/// to whole granules) of address space once for the arena's life, and
/// bound the bytes mapped by `config.limit_bytes`. The device is current;
/// the reservation is freed by [`free_reservation`].
pub fn reserve<C: Context>(
    s: &C,
    config: &ArenaConfig,
    prop: &PropOf<C>,
) -> Result<vmm::Arena<HandleOf<C>>, BackendError> {
    let n = &TableOf::<C>::NAMES;
    // SAFETY: the device is current (the caller's guard).
    let (r, g) = unsafe { TableOf::<C>::mem_granularity(prop) };
    s.checked("arena", n.mem_granularity, r)?;
    let granule = g as u64;
    if granule == 0 || !granule.is_power_of_two() {
        return Err(err::<TableOf<C>>(
            "arena",
            BackendErrorKind::Other,
            format!(
                "the {} reports an allocation granularity of {granule} B, not a power of two",
                TableOf::<C>::DRIVER
            ),
        ));
    }
    let size = config
        .reserve_bytes
        .max(1)
        .checked_next_multiple_of(granule)
        .ok_or_else(|| {
            err::<TableOf<C>>(
                "arena",
                BackendErrorKind::InvalidArgument,
                format!("a reservation of {} B overflows", config.reserve_bytes),
            )
        })?;
    // SAFETY: the device is current; freed once, in `free_reservation`.
    let (r, base) = unsafe { TableOf::<C>::mem_address_reserve(size as usize, granule as usize) };
    s.checked("arena", n.mem_address_reserve, r)
        .map_err(|e| BackendError {
            message: format!(
                "{} (reserving {size} B of address space for the arena; ask for less with \
                 ArenaConfig::reserve_bytes)",
                e.message
            ),
            ..e
        })?;
    Ok(vmm::Arena::new(
        base,
        size,
        granule,
        config.limit_bytes,
        n.arena,
    ))
}

/// Free the arena's reservation at teardown, once nothing is mapped in it
/// (its granules were given back by `vmm::Arena::teardown`).
pub fn free_reservation<C: Context>(
    s: &C,
    books: &vmm::Arena<HandleOf<C>>,
) -> Result<(), BackendError> {
    // SAFETY: the range reserved in `reserve`, freed once; nothing is
    // mapped in it any more.
    let r = unsafe { TableOf::<C>::mem_address_free(books.base, books.size as usize) };
    s.checked("teardown", TableOf::<C>::NAMES.mem_address_free, r)
}

/// Wait until the work queued on each of `streams` has run, in order,
/// stopping at the first error. With `poll`, ask (the vendor's stream
/// query, every `interval`) until that deadline passes instead of
/// blocking: the error then says work is still running, and that the
/// arena's memory stays mapped (a teardown of a context declared lost).
/// The device is current; every stream is live (or kept alive by the
/// caller for the wait).
pub fn drain<C: Context>(
    s: &C,
    streams: &[<TableOf<C> as VmmTable>::Stream],
    op: &'static str,
    poll: Option<Duration>,
    interval: Duration,
) -> Result<(), BackendError> {
    let n = &TableOf::<C>::NAMES;
    let deadline = poll.map(|d| Instant::now() + d);
    for &raw in streams {
        match deadline {
            // SAFETY: the caller's contract (a live stream, the device
            // current).
            None => s.checked(op, n.stream_sync, unsafe { TableOf::<C>::stream_sync(raw) })?,
            Some(deadline) => loop {
                // SAFETY: as above.
                let r = unsafe { TableOf::<C>::stream_query(raw) };
                if TableOf::<C>::classify(r) != Class::NotReady {
                    s.checked(op, n.stream_query, r)?;
                    break;
                }
                if Instant::now() >= deadline {
                    return Err(err::<TableOf<C>>(
                        op,
                        BackendErrorKind::DeviceLost,
                        format!(
                            "work was still queued {} s into a lost teardown: the arena's \
                             memory stays mapped (unmapping it under running work is undefined)",
                            poll.unwrap_or_default().as_secs()
                        ),
                    ));
                }
                std::thread::sleep(interval);
            },
        }
    }
    Ok(())
}

/// The driver for one operation on `arena`, run in context `s`.
pub fn driver<'a, C: Context>(s: &'a C, arena: &'a C::Arena) -> Driver<'a, C> {
    Driver::new(s, arena, C::granule_prop(arena))
}

/// One context's arena: the driver-agnostic books ([`vmm::Arena`], reached
/// through `Deref`), the device it maps on, the context's probe, the
/// releases queued on its streams (`R`, the vendor's) and what else the
/// vendor keeps (`X`: HIP's runtime version). Lives in an `Arc` shared with
/// the stream callbacks of its releases. The vendors' `arena::Arena`.
pub struct Arena<C: Context, R, X = ()> {
    books: vmm::Arena<HandleOf<C>>,
    /// The ordinal of the device the arena maps on.
    pub ordinal: i32,
    /// The context's probe, for release callbacks that run without it.
    pub probe: BackendProbe,
    /// Releases queued whose stream callback has not run.
    pub releases: R,
    /// What the vendor keeps beside the books.
    pub vendor: X,
}

/// A release's stream callback settles it in the core ([`retire`]), which
/// gives its range back to the books unless the stream failed before it.
impl<C: Context, X: Send + Sync + 'static> retire::Releasing for Arena<C, retire::Releases, X> {
    fn releases(&self) -> (&retire::Releases, &BackendProbe) {
        (&self.releases, &self.probe)
    }
}

impl<C: Context, R, X> std::ops::Deref for Arena<C, R, X> {
    type Target = vmm::Arena<HandleOf<C>>;

    fn deref(&self) -> &Self::Target {
        &self.books
    }
}

impl<C: Context<Arena = Self>, R: Default, X> Arena<C, R, X> {
    /// A new arena on device `ordinal` (current on the calling thread), its
    /// granules made with `prop`: the books of [`reserve`], no release.
    pub fn reserve(
        s: &C,
        config: &ArenaConfig,
        (ordinal, prop): (i32, &PropOf<C>),
        probe: BackendProbe,
        vendor: X,
    ) -> Result<Self, BackendError> {
        let books = reserve(s, config, prop)?;
        let releases = R::default();
        Ok(Self {
            books,
            ordinal,
            probe,
            releases,
            vendor,
        })
    }

    /// Take `bytes`, mapping the granules it needs; returns the device
    /// address. The device must be current on the calling thread.
    pub fn allocate(&self, s: &C, bytes: u64) -> Result<u64, BackendError> {
        self.books.allocate(&driver(s, self), bytes)
    }

    /// Give every mapped granule back at teardown (every stream was
    /// synchronized), then the reservation; a refused unmap keeps the
    /// reservation (freeing it under a mapping is undefined), and both are
    /// reported.
    pub fn teardown(&self, s: &C) -> Result<(), BackendError> {
        self.books.teardown(&driver(s, self))?;
        free_reservation(s, &self.books)
    }
}

/// A trim the end of the last capture runs.
fn trim_deferred<C: Context>(arena: &C::Arena, s: &C) {
    let _ = arena.trim(&driver(s, arena), "trim");
}

/// A handle on a context's arena (`CudaContext::arena`,
/// `HipContext::arena`): its snapshot, trim, limit, sleep and wake. It
/// stays usable after the context is handed to the governor (a pressure
/// responder can hold one), and refuses work once the context is torn
/// down. The vendors' `CudaArena` and `HipArena` are this type over their
/// contexts.
pub struct ArenaHandle<C: Context> {
    arena: Arc<C::Arena>,
    shared: Arc<C>,
}

impl<C: Context> ArenaHandle<C> {
    /// The handle on `arena`, a context's arena, run in `shared`.
    pub fn new(arena: Arc<C::Arena>, shared: Arc<C>) -> Self {
        Self { arena, shared }
    }

    /// What the arena holds: reserved, mapped, in use, cached, asleep,
    /// quarantined.
    pub fn snapshot(&self) -> vmm::ArenaSnapshot {
        self.arena.snapshot()
    }

    /// Give back every cached granule (mapped, no allocation in it),
    /// unmapped and released one by one; returns the bytes given back.
    ///
    /// While a graph capture is under way anywhere in the process the trim
    /// is deferred (unmapping would invalidate it): it returns 0 at once,
    /// and the end of the last capture runs it.
    pub fn trim(&self) -> Result<u64, BackendError> {
        let (s, arena) = (&self.shared, &self.arena);
        s.check_usable("trim")?;
        let deferred = s
            .capture_gate()
            .defer_trim(arena.base, arena, s, trim_deferred::<C>);
        if deferred {
            return Ok(0);
        }
        arena.trim(&driver(&**s, &**arena), "trim")
    }

    /// Set the most physical memory the arena maps, rounded down to whole
    /// granules. Lowering it unmaps nothing: later maps and wakes are
    /// refused until enough is given back.
    pub fn set_limit(&self, bytes: u64) {
        self.arena.set_limit(bytes);
    }

    /// Sleeps of this arena waiting for copies or graph launches between
    /// their awake check and their enqueue (for tests that force that
    /// interleaving).
    pub fn sleeps_waiting(&self) -> usize {
        self.shared.sleep_gate().counts().1
    }

    /// Run `f` on the arena's books with a driver, once the context is
    /// usable and the capture gate admits `op`: no capture begins while it
    /// runs, and one under way is waited for (sleep and wake synchronize
    /// every stream of the context, the captured one included). A sleep
    /// (`sleeping`) also holds the context's sleep gate against copies and
    /// launches between their awake check and their enqueue.
    fn gated<R>(
        &self,
        op: &'static str,
        sleeping: bool,
        f: impl FnOnce(&vmm::Arena<HandleOf<C>>, &Driver<'_, C>) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        let (s, arena) = (&*self.shared, &*self.arena);
        s.check_usable(op)?;
        let _call = s.capture_gate().call(op, true)?;
        let _sleep = sleeping.then(|| s.sleep_gate().sleep());
        f(arena, &driver(s, arena))
    }

    /// Put the arena to sleep: wait for every stream of the context, then
    /// unmap and release every granule, copying the contents of those in
    /// use to page-locked host memory first when `keep_contents` is set.
    /// Addresses stay reserved and allocations stay live (but unusable
    /// until [`wake`](Self::wake)). Refused while a set sleeps
    /// ([`sleep_ranges`](Self::sleep_ranges)).
    pub fn sleep(&self, keep_contents: bool) -> Result<SleepReport, BackendError> {
        self.gated("sleep", true, |a, d| a.sleep(d, keep_contents))
    }

    /// Wake the arena: map every sleeping granule again at its address and
    /// copy back the contents kept. Refused with `OutOfMemory` before any
    /// mapping when the granules do not fit the arena's limit. Returns the
    /// bytes mapped. Also wakes a set put to sleep with
    /// [`sleep_ranges`](Self::sleep_ranges), whole.
    pub fn wake(&self) -> Result<u64, BackendError> {
        self.gated("wake", false, |a, d| a.wake(d))
    }

    /// Put the allocations at `ptrs` (device pointers of live allocations
    /// of this arena) to sleep: wait for every stream of the context, then
    /// unmap and release each granule that only they use, copying its
    /// contents to page-locked host memory first when `keep_contents` is
    /// set. Granules shared with other allocations stay mapped; the other
    /// allocations stay usable. Copies to and from the set are refused
    /// until [`wake_ranges`](Self::wake_ranges). The rules are the shared
    /// core's (`memgov_backend::vmm`, its `sleep_set` module).
    pub fn sleep_ranges(
        &self,
        ptrs: &[u64],
        keep_contents: bool,
    ) -> Result<SleepReport, BackendError> {
        self.gated("sleep_ranges", true, |a, d| {
            a.sleep_ranges(d, ptrs, keep_contents)
        })
    }

    /// Wake the allocations at `ptrs`: map every sleeping granule under
    /// them again at its address and copy back the contents kept. Refused
    /// with `OutOfMemory` before any mapping when they do not fit the
    /// arena's limit; one that fails half-way unmaps what it mapped and
    /// leaves the set asleep. Returns the bytes mapped.
    pub fn wake_ranges(&self, ptrs: &[u64]) -> Result<u64, BackendError> {
        self.gated("wake_ranges", false, |a, d| a.wake_ranges(d, ptrs))
    }
}

impl<C: Context> Clone for ArenaHandle<C> {
    fn clone(&self) -> Self {
        Self::new(self.arena.clone(), self.shared.clone())
    }
}

impl<C: Context> std::fmt::Debug for ArenaHandle<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(TableOf::<C>::NAMES.arena)
            .field("base", &format_args!("{:#x}", self.arena.base))
            .field("reserved", &self.arena.size)
            .field("granule", &self.arena.granule)
            .finish()
    }
}

memgov_backend::impl_arena_capabilities!(impl<C: Context> for ArenaHandle<C>);

/// One arena operation's driver: the context, the arena's books, the
/// properties its granules are created with, and the sleep's or wake's own
/// copy stream (made on first use, synchronized and destroyed on drop).
pub struct Driver<'a, C: Context> {
    s: &'a C,
    books: &'a vmm::Arena<HandleOf<C>>,
    prop: <C::Table as VmmTable>::Prop,
    copies: Cell<Option<<C::Table as VmmTable>::Stream>>,
}

impl<'a, C: Context> Driver<'a, C> {
    /// A driver for one operation on `books`, run in context `s`.
    pub fn new(
        s: &'a C,
        books: &'a vmm::Arena<HandleOf<C>>,
        prop: <C::Table as VmmTable>::Prop,
    ) -> Self {
        Self {
            s,
            books,
            prop,
            copies: Cell::new(None),
        }
    }

    fn names() -> &'static VmmNames {
        &<C::Table as VmmTable>::NAMES
    }

    /// The address of granule `g`.
    fn at(&self, g: usize) -> u64 {
        self.books.base + g as u64 * self.books.granule
    }

    /// Undo a half-made granule: unmap (when mapped) and release. The error
    /// says what could not be undone.
    fn undo(
        &self,
        h: HandleOf<C>,
        mapped: Option<(u64, usize)>,
        e: BackendError,
        op: &'static str,
    ) -> vmm::MapError<HandleOf<C>> {
        if let Some((at, size)) = mapped {
            // SAFETY: the mapping made by `map`, unused (its access was
            // never granted), unmapped once.
            let r = unsafe { C::Table::mem_unmap(at, size) };
            if let Err(u) = self.s.checked(op, Self::names().mem_unmap, r) {
                let why = format!("its mapping at {at:#x} stays ({})", u.message);
                let slot = Slot::Quarantined {
                    handle: Some(h),
                    mapped: true,
                };
                return (with(e, why), Some(slot));
            }
        }
        match vmm::GranuleDriver::release(self, h, op) {
            Ok(()) => (e, None),
            Err(u) => {
                let why = format!("its handle stays unreleased ({})", u.message);
                let slot = Slot::Quarantined {
                    handle: Some(h),
                    mapped: false,
                };
                (with(e, why), Some(slot))
            }
        }
    }

    /// The copy stream, made on first use.
    fn copies(&self, op: &'static str) -> Result<<C::Table as VmmTable>::Stream, BackendError> {
        if let Some(raw) = self.copies.get() {
            return Ok(raw);
        }
        // SAFETY: the core made the device current before any copy.
        let (r, raw) = unsafe { C::Table::stream_create() };
        self.s.checked(op, Self::names().stream_create, r)?;
        self.copies.set(Some(raw));
        Ok(raw)
    }

    fn sync(
        &self,
        op: &'static str,
        raw: <C::Table as VmmTable>::Stream,
    ) -> Result<(), BackendError> {
        // SAFETY: the driver's own copy stream, alive until the driver drops.
        let r = unsafe { C::Table::stream_sync(raw) };
        self.s.checked(op, Self::names().stream_sync, r)
    }
}

fn with(e: BackendError, why: String) -> BackendError {
    BackendError {
        message: format!(
            "{}; undoing the granule failed: {why} (quarantined)",
            e.message
        ),
        ..e
    }
}

impl<C: Context> Drop for Driver<'_, C> {
    fn drop(&mut self) {
        let Some(raw) = self.copies.take() else {
            return;
        };
        if let Ok(_current) = shell::make_current(self.s, "sleep") {
            // SAFETY: the copy stream made by `copies`, destroyed once,
            // after its copies completed (synchronized here as well).
            unsafe {
                let _ = C::Table::stream_sync(raw);
                let _ = C::Table::stream_destroy(raw);
            }
        }
    }
}

impl<'a, C: Context> vmm::GranuleDriver for Driver<'a, C> {
    type Handle = HandleOf<C>;
    type Current = Current<'a, C>;

    fn backend(&self) -> &'static str {
        <C::Table as Vendor>::BACKEND
    }

    fn make_current(&self, op: &'static str) -> Result<Self::Current, BackendError> {
        shell::make_current(self.s, op)
    }

    fn refuse_own_capture(&self, op: &'static str) -> Result<(), BackendError> {
        self.s.capture_gate().refuse_own(op)
    }

    /// Back granule `g` with fresh physical memory, accessible read-write
    /// from the arena's device: create, map, set access, each undone on
    /// failure; an undo the driver refuses is reported by the error's
    /// message and the slot returned with it.
    fn map(&self, g: usize, op: &'static str) -> Result<HandleOf<C>, vmm::MapError<HandleOf<C>>> {
        let n = Self::names();
        // Held until the granule is mapped: no capture begins in between.
        let _call = self
            .s
            .capture_gate()
            .call(op, true)
            .map_err(|e| (e, None))?;
        let at = self.at(g);
        let size = self.books.granule as usize;
        // SAFETY: one granule (a multiple of the granularity); the device is
        // current.
        let (r, h) = unsafe { C::Table::mem_create(size, &self.prop) };
        self.s.checked(op, n.mem_create, r).map_err(|e| (e, None))?;
        // SAFETY: `at` is a granule-aligned granule of the arena's
        // reservation that this thread owns (marked Mapping), so nothing is
        // mapped there; `h` is the handle just created, of exactly one
        // granule.
        let r = unsafe { C::Table::mem_map(at, size, h) };
        if let Err(e) = self.s.checked(op, n.mem_map, r) {
            return Err(self.undo(h, None, e, op));
        }
        // SAFETY: [at, at + size) is exactly the mapping made above.
        let r = unsafe { C::Table::mem_set_access(at, size, &self.prop) };
        if let Err(e) = self.s.checked(op, n.mem_set_access, r) {
            return Err(self.undo(h, Some((at, size)), e, op));
        }
        Ok(h)
    }

    /// Unmap granule `g` (backed by `h`) and release `h`. `Err` carries the
    /// slot to quarantine it in: still mapped, or unmapped but unreleased.
    fn unmap(&self, g: usize, h: HandleOf<C>, op: &'static str) -> Result<(), Slot<HandleOf<C>>> {
        // Never refused (`refuse_own` is false): waits while a capture is
        // under way on another thread.
        let _call = self.s.capture_gate().call(op, false);
        let at = self.at(g);
        // SAFETY: granule `g` is mapped with `h` and owned by this thread
        // (Unmapping, or undone before anyone used it); no allocation
        // overlaps it, and every stream passed the release of the last that
        // did.
        let r = unsafe { C::Table::mem_unmap(at, self.books.granule as usize) };
        if self.s.checked(op, Self::names().mem_unmap, r).is_err() {
            return Err(Slot::Quarantined {
                handle: Some(h),
                mapped: true,
            });
        }
        self.release(h, op).map_err(|_| Slot::Quarantined {
            handle: Some(h),
            mapped: false,
        })
    }

    /// Release a handle (its memory goes once no mapping uses it).
    fn release(&self, h: HandleOf<C>, op: &'static str) -> Result<(), BackendError> {
        let _call = self.s.capture_gate().call(op, false)?;
        // SAFETY: a handle of this arena, released once: every caller takes
        // it out of the granule's slot first.
        let r = unsafe { C::Table::mem_release(h) };
        self.s.checked(op, Self::names().mem_release, r)
    }

    fn free_host(&self, host: usize, op: &'static str) {
        // A potentially unsafe call: waits for captures under way (sleep and
        // wake hold a gate call already; this is the arena teardown's).
        let _call = self.s.capture_gate().call(op, false);
        // SAFETY: page-locked memory this arena allocated for a sleeping
        // granule's contents, freed once (the slot holding it was taken out
        // of the state); no copy uses it (every stream was synchronized).
        let r = unsafe { C::Table::host_free(host) };
        let _ = self.s.checked(op, Self::names().host_free, r);
    }
}

/// Sleep and wake: the copies go on the driver's own stream, synchronized
/// after each granule.
impl<C: Context> vmm::SleepDriver for Driver<'_, C> {
    fn quiesce(&self, op: &'static str) -> Result<(), BackendError> {
        self.s.quiesce(op)
    }

    fn offload(&self, at: u64, bytes: u64) -> Result<usize, BackendError> {
        let n = Self::names();
        let raw = self.copies("sleep")?;
        // SAFETY: the device is current.
        let (r, host) = unsafe { C::Table::host_alloc(bytes as usize) };
        self.s.checked("sleep", n.host_alloc, r)?;
        // SAFETY: the granule at `at` is mapped read-write; `host` holds
        // `bytes` and outlives the copy (synchronized below).
        let r = unsafe { C::Table::copy_dtoh_async(host, at, bytes as usize, raw) };
        let copied = self
            .s
            .checked("sleep", n.copy_dtoh_async, r)
            .and_then(|()| self.sync("sleep", raw));
        if let Err(e) = copied {
            vmm::GranuleDriver::free_host(self, host, "sleep");
            return Err(e);
        }
        Ok(host)
    }

    fn restore(&self, at: u64, host: usize, bytes: u64) -> Result<(), BackendError> {
        let raw = self.copies("wake")?;
        // SAFETY: `host` holds one granule of contents; the granule at `at`
        // was just mapped read-write; the host memory outlives the copy
        // (synchronized below).
        let r = unsafe { C::Table::copy_htod_async(at, host, bytes as usize, raw) };
        self.s.checked("wake", Self::names().copy_htod_async, r)?;
        self.sync("wake", raw)
    }
}
