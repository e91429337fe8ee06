//! Stream-ordered retirement: learning that the stream has passed a queued
//! release (a free, or an arena range given back), written once for every
//! vendor.
//!
//! A release's [`RetireSignal`] waits in its owner's [`Tickets`] (the
//! context's, or the arena's) under a ticket, a number unique in the
//! process. The vendor queues its own callback behind the release
//! ([`RetireTable::launch_callback`]: CUDA's `cuLaunchHostFunc`, HIP's
//! `hipStreamAddCallback`) with the ticket as its user data: a number that
//! is never dereferenced, so a runtime that drops callbacks without running
//! them leaks nothing but a route. The vendor's `extern "C"` trampoline
//! calls [`callback_ran`], which finds the owner through a process-wide
//! route table (ticket -> [`Weak`] of the owner) and lets it
//! [`Settle`] the ticket. Whichever side claims the signal first settles
//! it, once:
//!
//! * the callback, once the stream passed the release: the owner claims the
//!   ticket and retires it (or, when the vendor reports that the stream
//!   failed, abandons it);
//! * device loss or teardown: [`claim_all`] / [`abandon_all`] take every
//!   signal still parked (and their routes), and drop them unfired; a
//!   callback that runs later finds no route, or no ticket, and does
//!   nothing;
//! * a launch that failed ([`queue`]): the release is queued already and the
//!   memory no longer the caller's, so nothing is refused: unless the launch
//!   reported a lost device, the stream is synchronized (the release has then
//!   executed), the caller's `finish` completes it on this thread and the
//!   signal fires; otherwise it is dropped unfired.
//!
//! Synchronous frees (CUDA's `cuMemFreeHost`, HIP's `hipFree` and
//! `hipHostFree` for its `hipMalloc` fallback and page-locked host memory)
//! may not run before the stream passed the memory's last use, nor inside a
//! callback (no driver call there): both vendors hand them to the context's
//! free thread ([`memgov_backend::FreeThread`]), which frees them through
//! the capture gate. How the free thread learns that the stream passed
//! differs, and stays the vendor's, written beside its table:
//!
//! * CUDA parks the signal here ([`queue`]) and the host address in a table
//!   of its own; the host function, when it runs, hands the buffer to the
//!   free thread, which frees a batch of ready buffers and claims their
//!   tickets: no event per free, and `synchronize` frees what its stream
//!   made ready. Device loss abandons the signal but leaves the route (with
//!   [`unroute`] for the pool frees only): the buffer is still freed.
//! * HIP records an event on the stream and queues the free with its
//!   signal; the free thread takes one at a time, waits for the event
//!   (`hipEventSynchronize`), frees and settles, and device loss takes the
//!   frees it has not started off its queue for teardown to free while the
//!   runtime answers (the event, recorded before the free was queued,
//!   still says when the stream passed it).
//!
//! Every free begins the same way ([`begin_free`]): refused on a lost
//! context or a stream not of the context, the memory taken out of the live
//! set (so a second free, or another context's memory, never reaches the
//! driver; a second free is a violation the probe counts), and on refusal
//! everything is as it was.
//!
//! No lock is held across a driver call or a signal's sink: the route
//! table's lock only inserts or removes an entry, and a callback settles its
//! ticket after the route left the table.

use crate::result::{err, Vendor};
use crate::table::{Context, VmmTable};
use memgov_backend::vmm;
use memgov_backend::{
    lock, BackendError, BackendErrorKind, BackendProbe, Claim, RetireSignal, Tickets,
};
use std::cell::Cell;
use std::collections::HashMap;
use std::fmt::{Debug, Display};
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// A vendor's entry point for retirement: queue its callback behind the
/// work on a stream.
pub trait RetireTable: VmmTable {
    /// The call's name, for messages (`cuLaunchHostFunc`,
    /// `hipStreamAddCallback`).
    const LAUNCH_CALLBACK: &'static str;

    /// Queue the vendor's trampoline on `stream`, with `ticket` as its user
    /// data; the trampoline calls [`callback_ran`] once the stream reaches
    /// it, and makes no driver call.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of the current context.
    unsafe fn launch_callback(stream: Self::Stream, ticket: u64) -> Self::Code;
}

/// The first steps of every `free_async`: refuse on a lost context or a
/// stream that is not a live stream of `ctx`, then take the memory out of
/// the live set (`take`, called only when the memory is this context's:
/// `memory_context` is the context it names). An allocation of this
/// context that is no longer live is a second free, which the probe counts
/// as a violation; another context's is the caller's mistake, reported to
/// the caller only. On refusal nothing was taken. `what` names the memory in
/// messages (`allocation 3 (4096 B at 0x7f00)`).
pub fn begin_free<C, L>(
    ctx: &C,
    stream: &C::Stream,
    memory_context: u64,
    what: impl Display,
    take: impl FnOnce() -> Option<L>,
) -> Result<L, BackendError>
where
    C: Context,
    C::Table: RetireTable,
{
    ctx.check_usable("free_async")?;
    ctx.raw_stream("free_async", stream)?;
    let (id, probe) = (ctx.state().id, ctx.probe());
    let ours = memory_context == id;
    if let Some(live) = ours.then(take).flatten() {
        return Ok(live);
    }
    if ours {
        probe.violation(
            C::Table::BACKEND,
            format!("free_async of {what}, which is not live in context {id}"),
        );
    }
    Err(err::<C::Table>(
        "free_async",
        BackendErrorKind::InvalidArgument,
        format!(
            "{what} is not live in {} context {id} (freed already, or another context's: \
             free each allocation once, in the context that made it)",
            C::Table::NAME,
        ),
    ))
}

/// What owns parked tickets and settles one when its callback ran.
pub trait Settle: Send + Sync + 'static {
    /// The callback queued for `ticket` ran; `ok` is false when the vendor
    /// reported that the stream failed before it. Runs on a driver thread:
    /// no driver call, no lock held across a sink.
    fn settle(&self, ticket: u64, ok: bool);
}

/// Tickets are unique in the process: a callback's user data names one.
static NEXT_TICKET: AtomicU64 = AtomicU64::new(1);

/// A ticket no other release in the process has.
pub fn next_ticket() -> u64 {
    NEXT_TICKET.fetch_add(1, Ordering::Relaxed)
}

type Routes = Mutex<HashMap<u64, Weak<dyn Settle>>>;

/// Ticket -> the owner that queued it, for the callbacks.
fn routes() -> &'static Routes {
    static ROUTES: OnceLock<Routes> = OnceLock::new();
    ROUTES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Callbacks that took their route and have not yet returned from their
/// owner's [`Settle::settle`]: a settle claims its ticket and then counts it
/// on the probe, and teardown ([`forget_owner`]) waits for those under way,
/// so that no count lands after teardown returned.
static SETTLING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread is inside a settle (a teardown run from a
    /// signal's sink does not wait for itself).
    static IN_SETTLE: Cell<bool> = const { Cell::new(false) };
}

/// How long teardown waits for settles under way on driver threads; they
/// make no driver call and take short locks only, so this is reached only
/// if a sink blocks.
const SETTLE_WAIT: Duration = Duration::from_secs(10);

/// One settle under way: counted in [`SETTLING`] until dropped (also when
/// the settle panics).
struct Settling;

impl Drop for Settling {
    fn drop(&mut self) {
        IN_SETTLE.with(|f| f.set(false));
        SETTLING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The vendor's trampoline ran for `ticket` (`ok`: the stream did not
/// fail): the owner, if it is still alive, settles it. Never panics.
pub fn callback_ran(ticket: u64, ok: bool) {
    let owner = {
        let mut r = lock(routes());
        let owner = r.remove(&ticket).and_then(|w| w.upgrade());
        // Counted under the routes lock: a teardown that removes the
        // owner's routes after this sees the settle under way.
        owner.map(|o| {
            SETTLING.fetch_add(1, Ordering::SeqCst);
            (o, Settling)
        })
    };
    if let Some((owner, settling)) = owner {
        IN_SETTLE.with(|f| f.set(true));
        owner.settle(ticket, ok);
        // The owner goes before the count does: teardown returns with no
        // driver thread holding its context.
        drop(owner);
        drop(settling);
    }
}

/// Remove every route to `owner` (teardown: a callback that still runs
/// afterwards finds no owner and does nothing), then wait until the
/// callbacks that took a route before have finished settling (at most
/// ten seconds), so that their counts land before teardown returns.
pub fn forget_owner<S: Settle>(owner: &S) {
    let me = (owner as *const S).cast::<()>();
    lock(routes()).retain(|_, w| !std::ptr::eq(w.as_ptr().cast::<()>(), me));
    let own = usize::from(IN_SETTLE.with(Cell::get));
    let deadline = Instant::now() + SETTLE_WAIT;
    while SETTLING.load(Ordering::SeqCst) > own && Instant::now() < deadline {
        std::thread::yield_now();
    }
}

/// Remove the routes of `tickets` (their callbacks will not run, or their
/// signals were settled another way and the callbacks have nothing to do).
pub fn unroute(tickets: impl IntoIterator<Item = u64>) {
    let mut r = lock(routes());
    for t in tickets {
        r.remove(&t);
    }
}

/// Take every signal still parked in `tickets`, and their routes (device
/// loss, teardown). Settle them after this returns.
pub fn claim_all<T>(tickets: &Tickets<T>) -> Vec<Claim<T>> {
    let claims = tickets.claim_all();
    unroute(claims.iter().map(Claim::ticket));
    claims
}

/// [`claim_all`], then abandon each (counted on `probe`, the signal dropped
/// unfired); returns the items.
pub fn abandon_all<T>(tickets: &Tickets<T>, probe: &BackendProbe) -> Vec<T> {
    claim_all(tickets)
        .into_iter()
        .map(|c| c.abandon(probe))
        .collect()
}

/// Settle a claim: retire it when `ok`, else abandon it.
pub fn settle_claim<T>(claim: Claim<T>, ok: bool, probe: &BackendProbe) -> T {
    if ok {
        claim.retire(probe)
    } else {
        claim.abandon(probe)
    }
}

/// The arena's [`Settle`]: the release of the range at the parked address
/// ran, so give it back to `arena` and retire the signal; when the stream
/// failed before it, the memory may still be in use by what failed: it stays
/// out of the free list and the signal is abandoned.
pub fn settle_release<H: Copy + Eq + Debug>(
    arena: &vmm::Arena<H>,
    releases: &Tickets<u64>,
    probe: &BackendProbe,
    ticket: u64,
    ok: bool,
) {
    if let Some(claim) = releases.claim(ticket) {
        if ok {
            arena.retire(*claim.item());
        }
        settle_claim(claim, ok, probe);
    }
}

/// An arena's releases whose callback has not run: their signals by ticket,
/// each with the address to give back.
pub type Releases = Tickets<u64>;

/// A vendor's arena (its books reached through `Deref`) with the releases
/// queued on its streams: the core settles them ([`Settle`], through
/// [`settle_release`]) and queues them ([`queue_release`]).
pub trait Releasing: Send + Sync + 'static {
    /// The releases whose callback has not run (by ticket, each with the
    /// address to give back), and the probe they are counted on.
    fn releases(&self) -> (&Tickets<u64>, &BackendProbe);
}

impl<A, H> Settle for A
where
    A: Releasing + Deref<Target = vmm::Arena<H>>,
    H: Copy + Eq + Debug,
{
    fn settle(&self, ticket: u64, ok: bool) {
        let (releases, probe) = self.releases();
        settle_release(self, releases, probe, ticket, ok);
    }
}

/// Queue the release of the `bytes` B arena allocation at `at` behind the
/// work on `stream` ([`queue`]; after a failed launch and a synchronize the
/// range goes back at once).
///
/// # Safety
///
/// As for [`queue`]; the allocation is `arena`'s and was taken out of the
/// context's live set.
pub unsafe fn queue_release<C, A, H>(
    ctx: &C,
    arena: &Arc<A>,
    stream: <C::Table as VmmTable>::Stream,
    signal: RetireSignal,
    bytes: u64,
    at: u64,
) where
    C: Context,
    C::Table: RetireTable,
    A: Releasing + Deref<Target = vmm::Arena<H>>,
    H: Copy + Eq + Debug,
{
    let (releases, probe) = arena.releases();
    let owner: Weak<dyn Settle> = Arc::downgrade(arena) as Weak<dyn Settle>;
    let back = |&at: &u64| {
        arena.retire(at);
        true
    };
    // SAFETY: the caller's contract.
    unsafe {
        queue(
            ctx,
            probe,
            owner,
            releases,
            stream,
            (next_ticket(), signal, bytes, at),
            back,
        )
    };
}

/// What became of a release handed to [`queue`].
#[derive(Debug, PartialEq, Eq)]
pub enum Queued<T> {
    /// The callback is queued behind it: the owner settles it.
    Behind,
    /// The launch failed and this thread settled it: retired (`true`), or
    /// abandoned; the item parked with it.
    Settled(T, bool),
    /// The launch failed and device loss had claimed it already.
    Gone,
}

/// Park `signal` (releasing `bytes`, with `item`) under `ticket` (from
/// [`next_ticket`]) in `owner`'s `tickets`, route the ticket to `owner`, and queue the vendor's
/// callback behind the release on `stream` (see the module's documentation
/// for a failed launch: `finish` completes the release on this thread once
/// the stream is synchronized, `false` when it failed).
///
/// # Safety
///
/// `stream` is a live stream of `ctx`, which is current; the release is
/// queued on it already (or, for a release with no driver call of its own,
/// the caller owns the memory until the ticket settles).
#[allow(clippy::too_many_arguments)]
pub unsafe fn queue<C, T>(
    ctx: &C,
    probe: &BackendProbe,
    owner: Weak<dyn Settle>,
    tickets: &Tickets<T>,
    stream: <C::Table as VmmTable>::Stream,
    (ticket, signal, bytes, item): (u64, RetireSignal, u64, T),
    finish: impl FnOnce(&T) -> bool,
) -> Queued<T>
where
    C: Context,
    C::Table: RetireTable,
{
    // The ticket is in both tables before the callback can run.
    tickets.park(ticket, signal, bytes, item);
    lock(routes()).insert(ticket, owner);
    // SAFETY: the caller's contract: a live stream of the current context;
    // the user data is a number the trampoline never dereferences.
    let r = unsafe { <C::Table as RetireTable>::launch_callback(stream, ticket) };
    let launch = ctx.checked("free_async", <C::Table as RetireTable>::LAUNCH_CALLBACK, r);
    if launch.is_ok() {
        return Queued::Behind;
    }
    // The callback will never run.
    unroute([ticket]);
    let Some(claim) = tickets.claim(ticket) else {
        return Queued::Gone;
    };
    if !launch.is_err_and(|e| e.is_device_lost()) {
        // SAFETY: the stream is live; the context is current.
        let r = unsafe { <C::Table as VmmTable>::stream_sync(stream) };
        let names = <C::Table as VmmTable>::NAMES;
        if ctx.checked("free_async", names.stream_sync, r).is_ok() {
            // The stream has passed the memory's last use.
            let ok = finish(claim.item());
            return Queued::Settled(settle_claim(claim, ok, probe), ok);
        }
    }
    Queued::Settled(claim.abandon(probe), false)
}
