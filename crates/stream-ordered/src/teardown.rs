//! Teardown's steps that are the same on every vendor: the first error
//! kept while every step still runs ([`FirstError`]), every stream the
//! governor left synchronized ([`sync_streams`]) and destroyed
//! ([`destroy_streams`]), and what a forced retire left live freed on a
//! stream of teardown's own, waited for and destroyed ([`on_own_stream`]).
//!
//! The order of the steps, and the vendor's own ones, stay with the vendor
//! beside its table: when its free thread is stopped (CUDA first of all, as
//! its frees are teardown's from then on; HIP once the streams are
//! synchronized, so that the thread finishes the frees whose events have
//! completed), the arena's part, its kinds of memory, its pool, CUDA's
//! release of the primary context and its poll of a lost context's streams,
//! HIP's count of the contexts alive.
//!
//! After a sticky code a vendor whose calls may block
//! ([`StreamTable::CALLS_AFTER_STICKY`] false: HIP) makes no further call:
//! what is left dies with the device and is only counted.

use crate::stream::{destroy_raw, RawOf, StreamContext};
use crate::table::{StreamTable, VmmTable};
use memgov_backend::BackendError;
use std::time::Duration;

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
