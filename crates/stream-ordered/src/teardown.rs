//! Teardown's steps that are the same on every vendor: the first error
//! kept while every step still runs ([`FirstError`]), the frees a direct
//! caller left pending reported ([`report_pending`]), every stream the
//! governor left synchronized ([`sync_streams`]) and destroyed
//! ([`destroy_streams`]), those retired waited for and destroyed
//! ([`destroy_retired`]), what a forced retire left live freed on a stream
//! of teardown's own, waited for and destroyed ([`on_own_stream`],
//! [`free_leftovers`] over the vendor's [`TeardownTable::free_async`]), a
//! declared-lost context's queued work polled until it ran
//! ([`drain_lost`]), what is left counted as gone without a call
//! ([`forget_all`]), and the end every teardown shares ([`finish`]: the
//! callbacks' routes forgotten, the probe told).
//!
//! The order of the steps, and the vendor's own ones, stay with the vendor
//! beside its table: when its free thread is stopped (CUDA first of all, as
//! its frees are teardown's from then on; HIP once the streams are
//! synchronized, so that the thread finishes the frees whose events have
//! completed), the arena's part, its kinds of memory, its pool, CUDA's
//! retired streams and its release of the primary context, whether a lost
//! context is drained (CUDA, whose driver may still answer) or released at
//! once (HIP), HIP's count of the contexts alive.
//!
//! After a sticky code a vendor whose calls may block
//! ([`StreamTable::CALLS_AFTER_STICKY`] false: HIP) makes no further call:
//! what is left dies with the device and is only counted.

use crate::result::err;
use crate::retire::{forget_owner, Settle};
use crate::stream::{destroy_raw, RawOf, StreamContext};
use crate::table::{Context, StreamTable, VmmTable};
use crate::{Class, Vendor};
use memgov_backend::{BackendError, BackendErrorKind};
use std::time::{Duration, Instant};

/// How long a teardown of a context declared lost, whose driver still
/// answers, waits for queued work (polling, never blocking) before it
/// leaves what that work may still use (the arena's mappings, the primary
/// context) to the device.
pub const LOST_DRAIN: Duration = Duration::from_secs(5);

/// The first error of a teardown whose later steps still run.
#[derive(Debug, Default)]
pub struct FirstError(Option<BackendError>);

impl FirstError {
    /// Keep `r`'s error if it is the first.
    pub fn keep(&mut self, r: Result<(), BackendError>) {
        if let Err(e) = r {
            self.0.get_or_insert(e);
        }
    }

    /// `Ok`, or the first error kept.
    pub fn into_result(self) -> Result<(), BackendError> {
        self.0.map_or(Ok(()), Err)
    }
}

/// Whether no further driver call is made on `s` (a sticky code seen by a
/// vendor whose calls may block after one).
pub fn stopped<C: StreamContext>(s: &C) -> bool {
    !C::Table::CALLS_AFTER_STICKY && s.shell().is_dead()
}

/// Synchronize every stream of `streams` (taken out of the registry, or
/// still in it: teardown holds the only handles), keeping the first error.
/// The context is current.
pub fn sync_streams<C: StreamContext>(
    s: &C,
    op: &'static str,
    streams: &[RawOf<C>],
    errors: &mut FirstError,
) {
    for &raw in streams {
        if stopped(s) {
            break;
        }
        // SAFETY: a live stream of this context, not destroyed before
        // teardown destroys it; the context is current.
        let r = unsafe { C::Table::stream_sync(raw) };
        errors.keep(s.checked(op, C::Table::NAMES.stream_sync, r));
    }
}

/// Destroy the streams taken out of the registry (handle, adopted), each
/// counted as destroyed: those memgov created are destroyed where `call`
/// allows driver calls (the context current, the device answering) and
/// none has been stopped since; an adopted stream is the runtime's and only
/// counted.
pub fn destroy_streams<C: StreamContext>(
    s: &C,
    op: &'static str,
    streams: Vec<(RawOf<C>, bool)>,
    call: bool,
    errors: &mut FirstError,
) {
    for (raw, adopted) in streams {
        if call && !adopted && !stopped(s) {
            // Taken out of the registry by the caller, so destroyed once;
            // its work ran (synchronized by teardown).
            errors.keep(destroy_raw(s, op, raw));
        } else {
            s.shell().probe().stream_destroyed();
        }
    }
}

/// Wait for, then destroy, the streams the governor destroyed while their
/// work could still run (retired: [`Streams::retire`]), taken out of the
/// retired list so each is destroyed once; each was counted as destroyed
/// when it was retired. Called before the leftovers are freed, as that
/// work may use them. The context is current.
///
/// [`Streams::retire`]: crate::stream::Streams::retire
pub fn destroy_retired<C: StreamContext>(s: &C, op: &'static str, errors: &mut FirstError) {
    for raw in s.streams().take_retired() {
        if stopped(s) {
            continue;
        }
        // SAFETY: a stream this context created, out of the retired list
        // (so destroyed once, here); the context is current.
        let r = unsafe { C::Table::stream_sync(raw) };
        errors.keep(s.checked(op, C::Table::NAMES.stream_sync, r));
        // SAFETY: as above; its work has completed.
        let r = unsafe { C::Table::stream_destroy(raw) };
        errors.keep(s.checked(op, C::Table::STREAM_NAMES.stream_destroy, r));
    }
}

/// Run `work` with a stream of teardown's own (created, non-blocking, on
/// the current context; known to no registry), then wait for it and
/// destroy it: what a forced retire left live is freed there, ordered after
/// nothing but the streams teardown synchronized before. The first error
/// is returned; after a sticky code on a vendor that stops calling, the
/// stream is left to die with the device.
pub fn on_own_stream<C: StreamContext>(
    s: &C,
    op: &'static str,
    work: impl FnOnce(RawOf<C>) -> Result<(), BackendError>,
) -> Result<(), BackendError> {
    let n = &C::Table::NAMES;
    // SAFETY: the caller has the context current.
    let (r, raw) = unsafe { C::Table::stream_create() };
    s.checked(op, n.stream_create, r)?;
    let mut result = work(raw);
    if stopped(s) {
        return result;
    }
    // SAFETY: the stream created above, live until destroyed below.
    let r = unsafe { C::Table::stream_sync(raw) };
    result = result.and(s.checked(op, n.stream_sync, r));
    if stopped(s) {
        return result;
    }
    // SAFETY: the stream created above, its work done, destroyed once.
    let r = unsafe { C::Table::stream_destroy(raw) };
    result.and(s.checked(op, C::Table::STREAM_NAMES.stream_destroy, r))
}

/// A vendor's entry point teardown needs beyond its stream table: the
/// stream-ordered free of the pool memory a forced retire left live.
pub trait TeardownTable: StreamTable {
    /// [`free_async`](Self::free_async)'s name, for messages
    /// (`cuMemFreeAsync`).
    const FREE_ASYNC: &'static str;

    /// Queue the free of the pool allocation at `ptr` on `stream`.
    ///
    /// # Safety
    ///
    /// `ptr` came from the context's stream-ordered allocation and is freed
    /// once; every stream that used it was synchronized; `stream` is live,
    /// of the current context.
    unsafe fn free_async(ptr: u64, stream: Self::Stream) -> Self::Code;
}

/// The governor tears down only after every release retired: `pending`
/// stream-ordered frees still queued at a teardown of a context that is not
/// lost mean a direct caller broke that contract, reported to the probe as
/// a violation (`what`: the vendor's words for them, "still pending").
/// Teardown still waits for them before it frees anything.
pub fn report_pending<C: Context>(s: &C, pending: usize, what: &str) {
    if pending != 0 {
        s.probe().violation(
            <C::Table as Vendor>::BACKEND,
            format!("teardown with {pending} stream-ordered frees {what}"),
        );
    }
}

/// Free the pool allocations a forced retire left live, `(address, bytes)`,
/// on a stream of teardown's own ([`on_own_stream`]), calling `freed` with
/// the bytes of each free the driver accepted. Every stream that used them
/// was synchronized, which orders the frees after that use; after a sticky
/// code on a vendor that stops calling, the rest are left to the device.
/// The context is current.
pub fn free_leftovers<C>(
    s: &C,
    op: &'static str,
    leftover: impl IntoIterator<Item = (u64, u64)>,
    mut freed: impl FnMut(u64),
) -> Result<(), BackendError>
where
    C: StreamContext<Table: TeardownTable>,
{
    on_own_stream(s, op, |stream| {
        let mut result = Ok(());
        for (ptr, bytes) in leftover {
            if stopped(s) {
                continue;
            }
            // SAFETY: the caller's contract: a live pool allocation of this
            // context, freed once (taken out of the live set); every stream
            // that used it was synchronized; `stream` is teardown's own,
            // live, and the context current.
            let r = unsafe { C::Table::free_async(ptr, stream) };
            match s.checked(op, C::Table::FREE_ASYNC, r) {
                Ok(()) => freed(bytes),
                Err(e) => result = result.and(Err(e)),
            }
        }
        result
    })
}

/// Wait for the work queued on a context declared lost whose driver still
/// answers: every live and retired stream is queried (no blocking call)
/// each [`StreamTable::POLL_INTERVAL`] until all ran (`Ok`), a sticky code
/// shows the device really is gone (`Ok`, the context now dead: nothing is
/// queued that will run), or [`LOST_DRAIN`] has passed: `DeviceLost`,
/// saying how many streams still run and then `kept` (what the vendor
/// keeps rather than release under running work, and how to reclaim it).
/// Another failed query is returned as it is. Makes the context current.
pub fn drain_lost<C: StreamContext>(
    s: &C,
    op: &'static str,
    kept: &str,
) -> Result<(), BackendError> {
    let mut waiting = s.streams().live();
    let retired = s.streams().take_retired();
    waiting.extend(retired.iter().copied());
    s.streams().keep_retired(retired);
    let deadline = Instant::now() + LOST_DRAIN;
    let _current = s.make_current(op)?;
    loop {
        let mut still = Vec::new();
        for &raw in &waiting {
            // SAFETY: a stream this context created or adopted, not
            // destroyed (teardown holds the only copies now); the context
            // is current.
            let r = unsafe { C::Table::stream_query(raw) };
            match C::Table::classify(r) {
                Class::Success => {}
                Class::NotReady => still.push(raw),
                _ => {
                    let e = match s.shell().checked(op, C::Table::NAMES.stream_query, r) {
                        Err(e) => e,
                        Ok(()) => continue,
                    };
                    if e.is_device_lost() {
                        return Ok(());
                    }
                    return Err(e);
                }
            }
        }
        if still.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(err::<C::Table>(
                op,
                BackendErrorKind::DeviceLost,
                format!(
                    "the context was declared lost, the driver still answers and {} of \
                     memgov's streams still have queued work after {:?}: {kept}",
                    still.len(),
                    LOST_DRAIN
                ),
            ));
        }
        waiting = still;
        std::thread::sleep(C::Table::POLL_INTERVAL);
    }
}

/// Count the allocations of `freed` (their bytes) and the context's streams
/// as gone without calling the driver, and drop its retired streams: on a
/// dead device they go with the context; on one still running memgov's work
/// at the drain's deadline they stay with what the vendor keeps.
pub fn forget_all<C: StreamContext>(s: &C, freed: impl IntoIterator<Item = u64>) {
    for bytes in freed {
        s.probe().freed(bytes);
    }
    for _ in s.streams().drain() {
        s.probe().stream_destroyed();
    }
    s.streams().take_retired();
}

/// The end of every teardown: the routes of the callbacks still queued are
/// forgotten (one the driver still runs, or never runs on a dead device,
/// finds no context; one settling now is waited for, so that its count
/// lands before teardown returns), then the probe counts the context torn
/// down.
pub fn finish<C: Context + Settle>(s: &C) {
    forget_owner(s);
    s.probe().torn_down_now();
}
