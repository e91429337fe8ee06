//! Streams: the context's registry of its streams ([`Streams`]) and what
//! is done with them the same way on every vendor: a stream created (or
//! lent by a runtime that adopted the context), checked on every use,
//! synchronized, ordered after another with an event, quiesced, and, for a
//! vendor that retires destroyed streams, reaped once their work ran.
//!
//! What differs between the vendors stays with their tables:
//!
//! * destroying a stream: `cuStreamDestroy` returns before the host
//!   functions queued on the stream have run, so CUDA *retires* a
//!   destroyed stream ([`Streams::retire`]) and destroys it once a query
//!   says its work completed ([`reap_retired`], from the next calls and
//!   from its free thread), while HIP synchronizes the stream (and waits for
//!   its free callbacks) and then destroys it at once: the vendor crates
//!   write their `destroy_stream` over this module's parts;
//! * whether a stream call needs the context current, and whether a call is
//!   still made after a sticky code
//!   ([`StreamTable::STREAM_CALLS_NEED_CURRENT`],
//!   [`StreamTable::CALLS_AFTER_STICKY`]);
//! * CUDA's adopted streams (a runtime's own, lent through
//!   [`Streams::lending`]): synchronized but never destroyed.

use crate::result::err;
pub use crate::state::{Stream, Streams};
use crate::table::{Context, Raw, StreamTable, VmmTable};
use crate::{Class, Vendor};
use memgov_backend::shell::make_current;
use memgov_backend::{lock, BackendError, BackendErrorKind};
use std::time::Duration;

/// The raw stream handle of a context's table.
pub type RawOf<C> = <<C as Context>::Table as VmmTable>::Stream;

/// A context whose streams the core keeps: implemented by the vendor's
/// shared state beside [`Context`], whose public stream wraps the core's
/// [`Stream`].
pub trait StreamContext: Context<Table: StreamTable, Stream: AsRef<Stream<RawOf<Self>>>> {
    /// The context's streams.
    fn streams(&self) -> &Streams<RawOf<Self>> {
        &self.state().streams
    }

    /// This context's id in the process (stamped into its streams).
    fn context_id(&self) -> u64 {
        self.state().id
    }

    /// The next id of a stream (or allocation) of this context.
    fn next_id(&self) -> u64 {
        self.state().next_id()
    }

    /// The vendor's public stream over a stream just registered.
    fn wrap(stream: Stream<RawOf<Self>>) -> Self::Stream;
}

/// The raw handle of `stream` once it is a live stream of `s`;
/// `InvalidArgument` (another context's stream, or one destroyed) with no
/// driver call.
pub fn check<C: StreamContext>(
    s: &C,
    op: &'static str,
    stream: &C::Stream,
) -> Result<RawOf<C>, BackendError> {
    let stream = stream.as_ref();
    let (raw, id, owner) = (stream.raw(), stream.id(), stream.context());
    if owner != s.context_id() || !lock(&s.streams().live).contains_key(&id) {
        return Err(err::<C::Table>(
            op,
            BackendErrorKind::InvalidArgument,
            format!(
                "stream {id} is not a live stream of {} context {} (it belongs to context \
                 {owner}, or was destroyed): use a stream this context created and has not \
                 destroyed",
                <C::Table as Vendor>::NAME,
                s.context_id()
            ),
        ));
    }
    Ok(raw)
}

/// A stream for the governor: an adopted one not yet handed out, else a
/// new non-blocking stream on the context.
pub fn create<C: StreamContext>(s: &C) -> Result<C::Stream, BackendError> {
    const OP: &str = "create_stream";
    s.check_usable(OP)?;
    let lent = lock(&s.streams().lendable).pop_front();
    let (raw, adopted) = match lent.map(|r| r.0) {
        Some(raw) => (raw, true),
        None => {
            let _current = make_current(s, OP)?;
            // SAFETY: the context is current (above) and alive
            // (`check_usable`: teardown has not run).
            let (r, raw) = unsafe { C::Table::stream_create() };
            s.checked(OP, C::Table::NAMES.stream_create, r)?;
            (raw, false)
        }
    };
    let id = s.next_id();
    lock(&s.streams().live).insert(id, (Raw(raw), adopted));
    s.shell().probe().stream_created();
    Ok(C::wrap(Stream::new(raw, id, s.context_id(), adopted)))
}

/// Wait for the work queued on `stream` (the driver's synchronize); what
/// the vendor waits for after it (its frees' callbacks) is the caller's.
pub fn synchronize<C: StreamContext>(
    s: &C,
    op: &'static str,
    stream: &C::Stream,
) -> Result<(), BackendError> {
    s.check_usable(op)?;
    let raw = check(s, op, stream)?;
    sync_raw(s, op, raw)
}

/// The driver's synchronize of `raw`, the context made current first where
/// the vendor needs it.
///
/// `raw` is a stream of `s` that stays live for the call.
pub fn sync_raw<C: StreamContext>(
    s: &C,
    op: &'static str,
    raw: RawOf<C>,
) -> Result<(), BackendError> {
    let _current = if C::Table::STREAM_CALLS_NEED_CURRENT {
        Some(make_current(s, op)?)
    } else {
        None
    };
    // SAFETY: the caller's contract (a live stream of this context); the
    // context is current where the vendor needs it.
    let r = unsafe { C::Table::stream_sync(raw) };
    s.checked(op, C::Table::NAMES.stream_sync, r)
}

/// Destroy `raw`, a stream of `s` already taken out of the registry whose
/// queued work has run (counted as destroyed).
pub fn destroy_raw<C: StreamContext>(
    s: &C,
    op: &'static str,
    raw: RawOf<C>,
) -> Result<(), BackendError> {
    s.shell().probe().stream_destroyed();
    // SAFETY: the caller's contract: created by this context, out of the
    // registry (so destroyed once, here), its work done; the context is
    // current where the vendor needs it.
    let r = unsafe { C::Table::stream_destroy(raw) };
    s.checked(op, C::Table::STREAM_NAMES.stream_destroy, r)
}

/// Order every operation queued on `stream` from now on after everything
/// already queued on `after`: an event (timing disabled) recorded on
/// `after`, a wait for it queued on `stream`, and the event destroyed at
/// once (legal while the wait is pending: the driver releases it once the
/// wait has run). Returns without waiting for the device.
pub fn order_after<C: StreamContext>(
    s: &C,
    stream: &C::Stream,
    after: &C::Stream,
) -> Result<(), BackendError> {
    const OP: &str = "order_after";
    let n = &C::Table::STREAM_NAMES;
    s.check_usable(OP)?;
    let raw = check(s, OP, stream)?;
    let after_raw = check(s, OP, after)?;
    if stream.as_ref().id() == after.as_ref().id() {
        // A stream is ordered after its own queued work already.
        return Ok(());
    }
    // Events belong to the current context (device).
    let _current = make_current(s, OP)?;
    // SAFETY: the context is current.
    let (r, event) = unsafe { C::Table::event_create() };
    s.checked(OP, n.event_create, r)?;
    // SAFETY: the event just created; `after` is a live stream of this
    // context (checked above).
    let r = unsafe { C::Table::event_record(event, after_raw) };
    let mut result = s.checked(OP, n.event_record, r);
    if result.is_ok() {
        // SAFETY: the recorded event; `stream` is a live stream of this
        // context.
        let r = unsafe { C::Table::stream_wait_event(raw, event) };
        result = s.checked(OP, n.stream_wait_event, r);
    }
    if C::Table::CALLS_AFTER_STICKY || !s.shell().is_dead() {
        // SAFETY: the event created above, destroyed once; legal with the
        // wait still queued.
        let r = unsafe { C::Table::event_destroy(event) };
        result = result.and(s.checked(OP, n.event_destroy, r));
    }
    result
}

/// Destroy the retired streams whose work has completed; a sticky error
/// from a query is observed here (the context is then lost). The queries
/// are not blocking calls: a stream still running stays retired.
pub fn reap_retired<C: StreamContext>(s: &C, op: &'static str) -> Result<(), BackendError> {
    if !s.streams().has_retired() || s.shell().is_lost() {
        return Ok(());
    }
    let _current = make_current(s, op)?;
    let mut keep = Vec::new();
    let mut result = Ok(());
    // Held only here from now on: no other call uses them.
    for raw in s.streams().take_retired() {
        if s.shell().is_lost() {
            keep.push(raw);
            continue;
        }
        // SAFETY: a stream this context created and the governor
        // destroyed, taken out of the retired list; the context is current.
        let r = unsafe { C::Table::stream_query(raw) };
        match C::Table::classify(r) {
            Class::Success => {
                // SAFETY: as above; its work has completed.
                let r = unsafe { C::Table::stream_destroy(raw) };
                result = result.and(s.checked(op, C::Table::STREAM_NAMES.stream_destroy, r));
            }
            Class::NotReady => keep.push(raw),
            _ => {
                keep.push(raw);
                result = result.and(s.checked(op, C::Table::NAMES.stream_query, r));
            }
        }
    }
    s.streams().keep_retired(keep);
    result
}

/// Wait until every stream of the context ran what is queued on it: the
/// live streams, and the retired ones (taken out of the retired list while
/// waited on, so that a reap elsewhere does not destroy one under the wait,
/// and put back after). With `poll`, query every
/// [`StreamTable::POLL_INTERVAL`] until that deadline passes instead of
/// blocking: the error then says work is still running (see
/// [`crate::arena::drain`]). The context is current.
pub fn quiesce<C: StreamContext>(
    s: &C,
    op: &'static str,
    poll: Option<Duration>,
) -> Result<(), BackendError> {
    let mut streams = s.streams().live();
    let retired = s.streams().take_retired();
    streams.extend(retired.iter().copied());
    let interval = C::Table::POLL_INTERVAL;
    let result = crate::arena::drain(s, &streams, op, poll, interval);
    s.streams().keep_retired(retired);
    result
}
