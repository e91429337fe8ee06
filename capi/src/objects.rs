//! Governors, contexts, streams, buffers, pins and pressure callbacks.

use crate::ffi::*;
use crate::plugin::{charge, created, Charge, PluginObj, What};
use crate::registry::{self, lock, Kind};
use crate::status::*;
use crate::{
    get, handle, id, memgov_buffer, memgov_callback, memgov_context, memgov_governor, memgov_pin,
    memgov_pin_source, memgov_plugin, memgov_stream, opt_str, put, read_sized, req_str,
    write_sized,
};
use memgov::any::{AnyContext, AnyMemory, BackendKind, BACKENDS};
use memgov::host::{HostConfig, HostContext};
use memgov::{
    Admission, Alloc, ContextConfig, ContextHandle, ContextState, DeviceBuffer, GovernedStream,
    Governor, PressureRequest, ProviderContextPin, ProviderContextPinSource, Role, TeardownReport,
};
use std::cell::Cell;
use std::ffi::{c_char, c_void};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub(crate) type Ctx = ContextHandle<AnyContext>;

pub(crate) struct GovernorObj {
    gov: Governor<AnyContext>,
}
impl Kind for GovernorObj {
    const TAG: u8 = 1;
    const NAME: &'static str = "governor";
}
impl GovernorObj {
    pub(crate) fn governor(&self) -> &Governor<AnyContext> {
        &self.gov
    }
}

pub(crate) struct ContextObj {
    pub(crate) ctx: Ctx,
}
impl Kind for ContextObj {
    const TAG: u8 = 2;
    const NAME: &'static str = "context";
}

pub(crate) struct StreamObj {
    pub(crate) stream: GovernedStream<AnyContext>,
    /// Its context, to allocate through (a handle does not pin).
    pub(crate) ctx: Ctx,
    /// Dropped after the stream (declaration order): the plugin's count
    /// falls when the stream is gone.
    _charge: Option<Charge>,
}
impl Kind for StreamObj {
    const TAG: u8 = 3;
    const NAME: &'static str = "stream";
}

pub(crate) struct BufferObj {
    /// `None` once a release has taken it.
    buffer: Mutex<Option<DeviceBuffer<AnyContext>>>,
    ctx: Ctx,
    bytes: u64,
    plugin: Option<Arc<PluginObj>>,
    charge: Mutex<Option<Charge>>,
}
impl Kind for BufferObj {
    const TAG: u8 = 4;
    const NAME: &'static str = "buffer";
}

pub(crate) struct PinSourceObj {
    source: Arc<dyn ProviderContextPinSource>,
    plugin: Option<Arc<PluginObj>>,
    _charge: Option<Charge>,
}
impl Kind for PinSourceObj {
    const TAG: u8 = 5;
    const NAME: &'static str = "pin source";
}

pub(crate) struct PinObj {
    _pin: Box<dyn ProviderContextPin>,
    _charge: Option<Charge>,
}
impl Kind for PinObj {
    const TAG: u8 = 6;
    const NAME: &'static str = "pin";
}

/// A C pressure callback as the governor holds it. The responder stays in
/// the context for its life; removing the callback disables it and waits
/// for the calls in it ([`Slot::disable`]), and `outstanding` tells the
/// unload gate whether it may still run or is running.
pub(crate) struct Slot {
    state: Mutex<SlotState>,
    /// Signalled when a call leaves the callback.
    left: Condvar,
    f: unsafe extern "C" fn(*const memgov_pressure_request, *mut c_void) -> u64,
    user: usize,
}

#[derive(Default)]
struct SlotState {
    /// False once removed: no call enters after that.
    disabled: bool,
    /// Calls inside the callback now.
    running: u64,
}

thread_local! {
    /// The pressure callback this thread is inside (its slot's address), or
    /// 0. A thread is inside at most one: callbacks are not re-entered.
    static INSIDE: Cell<usize> = const { Cell::new(0) };
}

/// Whether this thread is inside a pressure callback.
pub(crate) fn inside_a_callback() -> bool {
    INSIDE.try_with(|i| i.get() != 0).unwrap_or(false)
}

impl Slot {
    fn new(
        f: unsafe extern "C" fn(*const memgov_pressure_request, *mut c_void) -> u64,
        user: usize,
    ) -> Self {
        Self {
            state: Mutex::new(SlotState::default()),
            left: Condvar::new(),
            f,
            user,
        }
    }

    fn key(&self) -> usize {
        self as *const Slot as usize
    }

    /// Whether the callback may still run, or is running.
    pub(crate) fn outstanding(&self) -> bool {
        let st = lock(&self.state);
        !st.disabled || st.running > 0
    }

    /// Never call the callback again, and wait until no call is in it, so
    /// that the caller may free its `user_data` once this returns. Two cases
    /// do not wait for every call (see docs/c-api.md, "Pressure
    /// callbacks"):
    ///
    /// * from inside this callback, the call in progress on this thread is
    ///   the caller's own: it is not waited for (it ends when the callback
    ///   returns); calls on other threads are;
    /// * from inside another pressure callback nothing is waited for: two
    ///   callbacks removing each other on two threads would wait for each
    ///   other forever. No new call starts either way.
    ///
    /// No lock is held while a call runs: the lock covers the state only,
    /// and the wait releases it.
    pub(crate) fn disable(&self) {
        let here = INSIDE.try_with(Cell::get).unwrap_or(0);
        let own = u64::from(here == self.key());
        let wait = here == 0 || here == self.key();
        let mut st = lock(&self.state);
        st.disabled = true;
        while wait && st.running > own {
            st = self.left.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn call(&self, req: &PressureRequest) -> u64 {
        // An allocation made from inside a pressure callback on this thread
        // asks no callback again: it is admitted or refused as it stands.
        if inside_a_callback() {
            return 0;
        }
        {
            let mut st = lock(&self.state);
            if st.disabled {
                return 0;
            }
            st.running += 1;
        }
        struct Leave<'a>(&'a Slot);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                let _ = INSIDE.try_with(|i| i.set(0));
                let mut st = lock(&self.0.state);
                st.running -= 1;
                drop(st);
                self.0.left.notify_all();
            }
        }
        let _ = INSIDE.try_with(|i| i.set(self.key()));
        let _leave = Leave(self);
        let request = memgov_pressure_request {
            size: std::mem::size_of::<memgov_pressure_request>() as u32,
            role: role_index(req.role),
            requested: req.requested,
            shortfall: req.shortfall,
        };
        // SAFETY: `f` is the function the caller registered, with its
        // `user` pointer; it is entered only while not disabled (checked
        // under the state's lock, which `disable` takes), and `disable`
        // waits for this call before its remove returns, so `user` is still
        // the caller's. The unload gate keeps its library loaded until it is
        // disabled and no call is in it (`outstanding`). No memgov lock is
        // held here.
        unsafe { (self.f)(&request, self.user as *mut c_void) }
    }
}

pub(crate) struct CallbackObj {
    slot: Arc<Slot>,
}
impl Kind for CallbackObj {
    const TAG: u8 = 7;
    const NAME: &'static str = "pressure callback";
}

pub(crate) fn role_from(role: u32) -> Result<Role> {
    Role::ALL.get(role as usize).copied().ok_or_else(|| {
        Error::invalid(format!(
            "role {role} is not a MEMGOV_ROLE_* value (0..={})",
            Role::ALL.len() - 1
        ))
    })
}

pub(crate) fn role_index(role: Role) -> u32 {
    Role::ALL.iter().position(|r| *r == role).unwrap_or(4) as u32
}

fn plugin_arg(p: *const memgov_plugin) -> Result<Option<Arc<PluginObj>>> {
    if p.is_null() {
        Ok(None)
    } else {
        get::<PluginObj, _>(p).map(Some)
    }
}

fn deadline(timeout_ms: u64) -> Instant {
    let now = Instant::now();
    now.checked_add(Duration::from_millis(timeout_ms))
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

// ---------------------------------------------------------------- governor

/// Create a governor.
#[no_mangle]
pub unsafe extern "C" fn memgov_governor_create(out: *mut *mut memgov_governor) -> i32 {
    guard("memgov_governor_create", || {
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        let h = registry::insert(Arc::new(GovernorObj {
            gov: Governor::new(),
        }));
        // SAFETY: non-null; the caller passes a writable pointer.
        unsafe { put(out, handle(h)) }
    })
}

/// Destroy a governor: every context it governs is retired (new work is
/// refused); each tears down once its last stream, buffer, pin and pending
/// release is gone.
#[no_mangle]
pub extern "C" fn memgov_governor_destroy(gov: *mut memgov_governor) -> i32 {
    guard("memgov_governor_destroy", || {
        // Dropped here, outside the registry's lock.
        drop(registry::remove::<GovernorObj>(id(gov))?);
        Ok(())
    })
}

// ----------------------------------------------------------------- context

fn open_context(gov: &GovernorObj, opts: &memgov_context_options) -> Result<Ctx> {
    // SAFETY: the options' strings are NUL-terminated or NULL (contract of
    // `memgov_context_open`).
    let name = unsafe { req_str(opts.backend, "memgov_context_options.backend") }?;
    // SAFETY: as above.
    let label = unsafe { opt_str(opts.label, "memgov_context_options.label") }?;
    let kind: BackendKind = match name.parse() {
        Ok(k) => k,
        Err(unknown) => {
            let status = if BACKENDS.iter().any(|b| b.name == name) {
                MEMGOV_ERR_UNAVAILABLE
            } else {
                MEMGOV_ERR_INVALID_ARGUMENT
            };
            let why = BACKENDS
                .iter()
                .find(|b| b.name == name)
                .and_then(|b| b.not_compiled_in())
                .map_or(unknown.to_string(), |w| format!("backend '{name}': {w}"));
            return Err(Error::new(status, why));
        }
    };
    let backend = if kind == BackendKind::Host && opts.host_op_delay_us > 0 {
        AnyContext::from(HostContext::new(HostConfig {
            op_delay: Duration::from_micros(opts.host_op_delay_us),
            ..HostConfig::default()
        })?)
    } else {
        AnyContext::open(kind)?
    };
    let mut config = ContextConfig::new();
    if let Some(l) = label {
        config = config.label(l);
    }
    // One meaning with Rust's `ContextConfig::budget`: 0 admits nothing;
    // MEMGOV_UNLIMITED is no budget (the same as none set).
    if opts.budget != MEMGOV_UNLIMITED {
        config = config.budget(opts.budget);
    }
    if opts.wait_for_pending_ms > 0 {
        config = config.admission(Admission::WaitForPending {
            timeout: Duration::from_millis(opts.wait_for_pending_ms),
        });
    }
    Ok(gov.gov.register(backend, config))
}

/// Open a context on a compiled-in backend and govern it.
#[no_mangle]
pub unsafe extern "C" fn memgov_context_open(
    gov: *mut memgov_governor,
    options: *const memgov_context_options,
    out: *mut *mut memgov_context,
) -> i32 {
    guard("memgov_context_open", || {
        let g = get::<GovernorObj, _>(gov)?;
        // SAFETY: `options` is NULL or a sized struct (the header's contract).
        let opts = unsafe {
            read_sized(
                options,
                std::mem::size_of::<memgov_context_options>(),
                "memgov_context_options",
            )
        }?;
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        let ctx = open_context(&g, &opts)?;
        let h = registry::insert(Arc::new(ContextObj { ctx }));
        // SAFETY: checked non-null above; writable by contract.
        unsafe { put(out, handle(h)) }
    })
}

/// Drop the caller's context handle. The context stays governed (and keeps
/// its streams and buffers); retire it first to tear it down.
#[no_mangle]
pub extern "C" fn memgov_context_close(ctx: *mut memgov_context) -> i32 {
    guard("memgov_context_close", || {
        drop(registry::remove::<ContextObj>(id(ctx))?);
        Ok(())
    })
}

/// Change the context's budget (bytes; allocations already charged stay):
/// 0 admits nothing more, `MEMGOV_UNLIMITED` lifts the limit.
#[no_mangle]
pub extern "C" fn memgov_context_set_budget(ctx: *mut memgov_context, bytes: u64) -> i32 {
    guard("memgov_context_set_budget", || {
        get::<ContextObj, _>(ctx)?
            .ctx
            .set_budget(memgov::Tier::Device, bytes);
        Ok(())
    })
}

/// Declare the device lost: new work fails with `MEMGOV_ERR_DEVICE_LOST`,
/// pending releases settle without calling the device.
#[no_mangle]
pub unsafe extern "C" fn memgov_context_mark_lost(
    ctx: *mut memgov_context,
    reason: *const c_char,
) -> i32 {
    guard("memgov_context_mark_lost", || {
        let c = get::<ContextObj, _>(ctx)?;
        // SAFETY: NULL or NUL-terminated (contract).
        let reason = unsafe { opt_str(reason, "reason") }?.unwrap_or("marked lost by the caller");
        c.ctx.mark_lost(reason);
        Ok(())
    })
}

fn usage(u: memgov::RoleUsage) -> memgov_role_usage {
    memgov_role_usage {
        live_bytes: u.live_bytes,
        live_count: u.live_count,
        pending_bytes: u.pending_bytes,
        pending_count: u.pending_count,
        quarantined_bytes: u.quarantined_bytes,
        quarantined_count: u.quarantined_count,
    }
}

pub(crate) fn snapshot_of(ctx: &Ctx) -> memgov_snapshot {
    let s = ctx.snapshot();
    memgov_snapshot {
        size: std::mem::size_of::<memgov_snapshot>() as u32,
        lifecycle: match s.lifecycle {
            ContextState::Active => MEMGOV_LIFECYCLE_ACTIVE,
            ContextState::Retiring => MEMGOV_LIFECYCLE_RETIRING,
            ContextState::Lost => MEMGOV_LIFECYCLE_LOST,
            ContextState::Terminated => MEMGOV_LIFECYCLE_TERMINATED,
        },
        budget_limit: s.budget_limit,
        charged: s.charged,
        peak: s.peak,
        awaiting_teardown: s.awaiting_teardown,
        total: usage(s.total()),
        by_role: s.by_role.map(usage),
        pins_streams: s.pins.streams,
        pins_buffers: s.pins.buffers,
        pins_pending_releases: s.pins.pending_releases,
        pins_external: s.pins.external,
        pins_other: s.pins.other,
        allocations: s.counters.allocations,
        releases_queued: s.counters.releases_queued,
        retired: s.counters.retired,
        abandoned: s.counters.abandoned,
        quarantined: s.counters.quarantined,
        admission_refusals: s.counters.admission_refusals,
        pressure_calls: s.counters.pressure_calls,
        backend_errors: s.counters.backend_errors,
    }
}

/// A point-in-time view of the context. Set `out->size` first.
#[no_mangle]
pub unsafe extern "C" fn memgov_context_snapshot(
    ctx: *mut memgov_context,
    out: *mut memgov_snapshot,
) -> i32 {
    guard("memgov_context_snapshot", || {
        let c = get::<ContextObj, _>(ctx)?;
        // SAFETY: NULL or a sized struct with its size set (contract).
        unsafe { write_sized(out, snapshot_of(&c.ctx), "memgov_snapshot") }
    })
}

/// The context's call sites as JSON, as `ContextSnapshot::sites`
/// serialises: `[{"site": "model.c:42", "label": null, "live_bytes": 4096,
/// "live_count": 1, "peak_bytes": 4096, "allocations": 1, "refusals": 0}, ...]`,
/// most live bytes first; `[]` unless the context attributes allocations
/// (`MEMGOV_ATTRIBUTION=1`). Written into `buf` as `snprintf` does: at most
/// `len - 1` bytes and a NUL when `len > 0`, nothing when `buf` is NULL or
/// `len` is 0; `*needed` (may be NULL) gets the whole text's length without
/// the NUL, so a call with `len` 0 sizes the buffer for the next.
///
/// # Safety
///
/// `ctx` is a context handle; `buf` is NULL or valid for `len` bytes;
/// `needed` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn memgov_context_sites_json(
    ctx: *mut memgov_context,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> i32 {
    guard("memgov_context_sites_json", || {
        let c = get::<ContextObj, _>(ctx)?;
        let text = sites_json(&c.ctx.snapshot().sites);
        let bytes = text.as_bytes();
        if !buf.is_null() && len > 0 {
            let n = bytes.len().min(len - 1);
            // SAFETY: `buf` is valid for `len` bytes (contract) and `n <
            // len`: `n` bytes and the NUL after them fit; the text is ours,
            // so the two do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
                buf.add(n).write(0);
            }
        }
        if !needed.is_null() {
            // SAFETY: non-null and writable (contract).
            unsafe { needed.write(bytes.len()) };
        }
        Ok(())
    })
}

/// `sites` as a JSON array (the shape of `SiteUsage`'s serialisation).
fn sites_json(sites: &[memgov::SiteUsage]) -> String {
    fn string(out: &mut String, s: &str) {
        out.push('"');
        for ch in s.chars() {
            match ch {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    let mut out = String::from("[");
    for (i, s) in sites.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"site\":");
        string(&mut out, &s.site);
        out.push_str(",\"label\":");
        match &s.label {
            Some(l) => string(&mut out, l),
            None => out.push_str("null"),
        }
        out.push_str(&format!(
            ",\"live_bytes\":{},\"live_count\":{},\"peak_bytes\":{},\"allocations\":{},\"refusals\":{}}}",
            s.live_bytes, s.live_count, s.peak_bytes, s.allocations, s.refusals
        ));
    }
    out.push(']');
    out
}

fn report(r: &TeardownReport) -> memgov_teardown_report {
    memgov_teardown_report {
        size: std::mem::size_of::<memgov_teardown_report>() as u32,
        lost: r.lost.into(),
        forced: r.forced.into(),
        backend_status: match &r.backend_result {
            Ok(()) => MEMGOV_OK,
            Err(e) => Error::from(e.clone()).status,
        },
        retired_releases: r.retired_releases,
        abandoned_releases: r.abandoned_releases,
        settled_lost: r.settled_lost,
        reclaimed_buffers: r.reclaimed_buffers,
        quarantined_bytes: r.quarantined_bytes,
        awaiting_teardown_bytes: r.awaiting_teardown_bytes,
        unsettled_releases: r.unsettled_releases,
        elapsed_ns: u64::try_from(r.elapsed.as_nanos()).unwrap_or(u64::MAX),
    }
}

fn retire(
    ctx: *mut memgov_context,
    timeout_ms: u64,
    out: *mut memgov_teardown_report,
    force: bool,
) -> Result<()> {
    let c = get::<ContextObj, _>(ctx)?;
    if !out.is_null() {
        // Checked before retiring: a report that cannot be written must not
        // leave the context torn down behind an error.
        // SAFETY: non-null, and every sized struct starts with its size.
        let size = unsafe { out.cast::<u32>().read_unaligned() };
        if size < 8 {
            return Err(Error::invalid(format!(
                "memgov_teardown_report.size is {size}; set it to sizeof(memgov_teardown_report) before the call"
            )));
        }
    }
    let h = c.ctx.retire();
    let deadline = deadline(timeout_ms);
    let result = if force {
        h.force(deadline)
    } else {
        h.wait(deadline)
    };
    let r = result.map_err(|e| {
        // A teardown step that panicked ended the context all the same.
        let status = match &e {
            memgov::RetireError::Outstanding { .. } => MEMGOV_ERR_TIMEOUT,
            memgov::RetireError::TeardownPanicked {
                step: memgov::TeardownStep::Backend,
                ..
            } => MEMGOV_ERR_BACKEND,
            _ => MEMGOV_ERR_PANIC,
        };
        Error::new(status, e.to_string())
    })?;
    if out.is_null() {
        return Ok(());
    }
    // SAFETY: a sized struct with its size set (contract).
    unsafe { write_sized(out, report(&r), "memgov_teardown_report") }
}

/// Retire the context (new work is refused from now on) and wait up to
/// `timeout_ms` for every stream, buffer, pin and pending release to go, then
/// tear it down and fill `out` (may be NULL). `MEMGOV_ERR_TIMEOUT` names
/// what is still outstanding; the context stays retiring, and a later call
/// waits again.
#[no_mangle]
pub unsafe extern "C" fn memgov_context_retire(
    ctx: *mut memgov_context,
    timeout_ms: u64,
    out: *mut memgov_teardown_report,
) -> i32 {
    guard("memgov_context_retire", || {
        retire(ctx, timeout_ms, out, false)
    })
}

/// Retire by force: synchronize the streams, reclaim live buffers and
/// streams (their handles then fail with `MEMGOV_ERR_RETIRING`), wait up to
/// `timeout_ms` for pending releases and pins, tear down.
#[no_mangle]
pub unsafe extern "C" fn memgov_context_force_retire(
    ctx: *mut memgov_context,
    timeout_ms: u64,
    out: *mut memgov_teardown_report,
) -> i32 {
    guard("memgov_context_force_retire", || {
        retire(ctx, timeout_ms, out, true)
    })
}

/// Register a pressure callback: called with no lock held, on the
/// allocating thread, when an allocation does not fit; it returns the bytes
/// it gave back. Counted against `plugin` (may be NULL) until removed.
#[no_mangle]
pub unsafe extern "C" fn memgov_pressure_callback_add(
    ctx: *mut memgov_context,
    plugin: *mut memgov_plugin,
    callback: memgov_pressure_fn,
    user_data: *mut c_void,
    out: *mut *mut memgov_callback,
) -> i32 {
    guard("memgov_pressure_callback_add", || {
        let c = get::<ContextObj, _>(ctx)?;
        let plugin = plugin_arg(plugin)?;
        let f = callback.ok_or_else(|| Error::invalid("the callback is NULL"))?;
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        let slot = Arc::new(Slot::new(f, user_data as usize));
        if let Some(p) = &plugin {
            p.add_slot(&slot)?;
        }
        let responder = slot.clone();
        c.ctx.add_pressure_responder(
            memgov::DEFAULT_PRESSURE_PRIORITY,
            move |req: &PressureRequest| responder.call(req),
        );
        let h = registry::insert(Arc::new(CallbackObj { slot }));
        created(plugin.as_ref(), h);
        // SAFETY: checked non-null; writable by contract.
        unsafe { put(out, handle(h)) }
    })
}

/// Remove a pressure callback by handle id: see
/// [`memgov_pressure_callback_remove`].
pub(crate) fn remove_callback(callback_id: u64) -> Result<()> {
    let cb = registry::remove::<CallbackObj>(callback_id)?;
    cb.slot.disable();
    Ok(())
}

/// Remove a pressure callback: no call enters it from now on, and when this
/// returns no call is in it (the caller may free its `user_data`). From
/// inside the callback itself, the caller's own call is not waited for;
/// from inside another pressure callback, nothing is waited for (see
/// docs/c-api.md).
#[no_mangle]
pub extern "C" fn memgov_pressure_callback_remove(callback: *mut memgov_callback) -> i32 {
    guard("memgov_pressure_callback_remove", || {
        remove_callback(id(callback))
    })
}

// ------------------------------------------------------------------ stream

/// Create a stream on the context, counted against `plugin` (may be NULL).
/// It pins the context until destroyed and until every buffer allocated on
/// it is released.
#[no_mangle]
pub unsafe extern "C" fn memgov_stream_create(
    ctx: *mut memgov_context,
    label: *const c_char,
    plugin: *mut memgov_plugin,
    out: *mut *mut memgov_stream,
) -> i32 {
    guard("memgov_stream_create", || {
        let c = get::<ContextObj, _>(ctx)?;
        // SAFETY: NULL or NUL-terminated (contract).
        let label = unsafe { opt_str(label, "label") }?.unwrap_or("stream");
        let plugin = plugin_arg(plugin)?;
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        let charge = charge(plugin.as_ref(), What::Stream)?;
        let stream = c.ctx.create_stream(label)?;
        let h = registry::insert(Arc::new(StreamObj {
            stream,
            ctx: c.ctx.clone(),
            _charge: charge,
        }));
        created(plugin.as_ref(), h);
        // SAFETY: checked non-null; writable by contract.
        unsafe { put(out, handle(h)) }
    })
}

/// Destroy the caller's stream handle. The raw stream is destroyed once the
/// last buffer allocated on it is released too. A stream that a force
/// retire reclaimed: the handle goes, and `MEMGOV_ERR_RETIRING` says so.
#[no_mangle]
pub extern "C" fn memgov_stream_destroy(stream: *mut memgov_stream) -> i32 {
    guard("memgov_stream_destroy", || {
        let s = registry::remove::<StreamObj>(id(stream))?;
        let reclaimed = s.stream.raw().is_none();
        drop(s);
        if reclaimed {
            return Err(Error::new(
                MEMGOV_ERR_RETIRING,
                "the context was force-retired and the stream reclaimed with it; the handle is released",
            ));
        }
        Ok(())
    })
}

/// Block until everything queued on the stream has executed, including the
/// retirement of releases queued on it.
#[no_mangle]
pub extern "C" fn memgov_stream_synchronize(stream: *mut memgov_stream) -> i32 {
    guard("memgov_stream_synchronize", || {
        Ok(get::<StreamObj, _>(stream)?.stream.synchronize()?)
    })
}

pub(crate) fn raw_stream(s: &StreamObj) -> Result<*mut c_void> {
    let raw = s.stream.raw().ok_or_else(|| {
        Error::new(
            MEMGOV_ERR_RETIRING,
            "the context was force-retired; its streams were reclaimed",
        )
    })?;
    #[allow(unreachable_patterns, clippy::match_single_binding)]
    let addr: Option<usize> = match raw {
        #[cfg(feature = "cuda")]
        memgov::any::AnyStream::Cuda(s) => Some(s.cu_stream() as usize),
        #[cfg(feature = "hip")]
        memgov::any::AnyStream::Hip(s) => Some(s.hip_stream() as usize),
        _ => None,
    };
    let addr = addr.ok_or_else(|| {
        Error::new(
            MEMGOV_ERR_UNSUPPORTED,
            "this backend's streams have no raw handle a C caller can use (CUDA: CUstream, HIP: hipStream_t)",
        )
    })?;
    Ok(addr as *mut c_void)
}

/// The raw backend stream (`CUstream`, `hipStream_t`) for work of your own;
/// `MEMGOV_ERR_UNSUPPORTED` on backends without one. Do not destroy it.
#[no_mangle]
pub unsafe extern "C" fn memgov_stream_raw(
    stream: *mut memgov_stream,
    out: *mut *mut c_void,
) -> i32 {
    guard("memgov_stream_raw", || {
        let s = get::<StreamObj, _>(stream)?;
        let raw = raw_stream(&s)?;
        // SAFETY: NULL (refused) or writable by contract.
        unsafe { put(out, raw) }
    })
}

// ------------------------------------------------------------------ buffer

/// Allocate through the governor; returns the buffer's handle id.
pub(crate) fn allocate(
    stream: &StreamObj,
    bytes: u64,
    role: Role,
    plugin: Option<&Arc<PluginObj>>,
    site: Option<&'static str>,
) -> Result<u64> {
    let charge = charge(plugin, What::Buffer(bytes))?;
    let ctx = stream.ctx.clone();
    let alloc = match site {
        Some(site) => Alloc::new(bytes, role).site(site),
        None => Alloc::new(bytes, role),
    };
    let buffer = ctx.allocate(&stream.stream, alloc)?;
    let h = registry::insert(Arc::new(BufferObj {
        buffer: Mutex::new(Some(buffer)),
        ctx,
        bytes,
        plugin: plugin.cloned(),
        charge: Mutex::new(charge),
    }));
    created(plugin, h);
    Ok(h)
}

/// Release a buffer by handle id, on its own stream (`on` = None) or on
/// another stream of its context.
pub(crate) fn release(buffer_id: u64, on: Option<&StreamObj>) -> Result<()> {
    let obj = registry::get::<BufferObj>(buffer_id)?;
    let taken = lock(&obj.buffer).take();
    let Some(buf) = taken else {
        return Err(Error::new(
            MEMGOV_ERR_INVALID_HANDLE,
            "the buffer is already being released",
        ));
    };
    let result = match on {
        Some(s) => buf.release_on(&s.stream),
        None => {
            let own = buf.stream();
            buf.release_on(&own)
        }
    };
    let (queued, error) = match result {
        Ok(()) => (true, None),
        Err(e) => match e.buffer {
            Some(b) => {
                // Refused before anything happened: still live and owned.
                *lock(&obj.buffer) = Some(b);
                return Err(e.error.into());
            }
            None => (false, Some(e.error)),
        },
    };
    // The handle goes; so does the plugin's count of live buffers, and a
    // queued release is counted until it retires.
    let removed = registry::remove::<BufferObj>(buffer_id);
    let charge = lock(&obj.charge).take();
    if queued {
        if let Some(p) = &obj.plugin {
            p.release_queued(&obj.ctx);
        }
    }
    drop((charge, removed));
    match error {
        None => Ok(()),
        Some(e) => Err(e.into()),
    }
}

/// Release a buffer created for a plugin whose init failed; returns the
/// stream the release was queued on, to synchronize (None: not live, or the
/// release was not queued).
pub(crate) fn release_for_cleanup(buffer_id: u64) -> Option<GovernedStream<AnyContext>> {
    let obj = registry::get::<BufferObj>(buffer_id).ok()?;
    let own = lock(&obj.buffer).as_ref().map(|b| b.stream())?;
    drop(obj);
    release(buffer_id, None).ok()?;
    Some(own)
}

/// Allocate `bytes` for `role` on `stream`, counted against `plugin` (may be
/// NULL).
#[no_mangle]
pub unsafe extern "C" fn memgov_buffer_allocate(
    stream: *mut memgov_stream,
    bytes: u64,
    role: u32,
    plugin: *mut memgov_plugin,
    out: *mut *mut memgov_buffer,
) -> i32 {
    guard("memgov_buffer_allocate", || {
        let s = get::<StreamObj, _>(stream)?;
        let role = role_from(role)?;
        let plugin = plugin_arg(plugin)?;
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        let h = allocate(&s, bytes, role, plugin.as_ref(), None)?;
        // SAFETY: checked non-null; writable by contract.
        unsafe { put(out, handle(h)) }
    })
}

/// [`memgov_buffer_allocate`], counted at `site` (a NUL-terminated string
/// such as `"model.c:42"`, or NULL for the C ABI's own line) when the
/// context attributes allocations (`MEMGOV_ATTRIBUTION=1`).
///
/// # Safety
///
/// As [`memgov_buffer_allocate`]; `site` is NULL or a NUL-terminated
/// string valid for the call (copied: the caller may free it after).
#[no_mangle]
pub unsafe extern "C" fn memgov_buffer_allocate_at(
    stream: *mut memgov_stream,
    bytes: u64,
    role: u32,
    plugin: *mut memgov_plugin,
    site: *const c_char,
    out: *mut *mut memgov_buffer,
) -> i32 {
    guard("memgov_buffer_allocate_at", || {
        let s = get::<StreamObj, _>(stream)?;
        let role = role_from(role)?;
        let plugin = plugin_arg(plugin)?;
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        // SAFETY: NULL or a NUL-terminated string (contract).
        let site = unsafe { opt_str(site, "site") }?.map(intern_site);
        let h = allocate(&s, bytes, role, plugin.as_ref(), site)?;
        // SAFETY: checked non-null; writable by contract.
        unsafe { put(out, handle(h)) }
    })
}

/// A C caller's site name as the `&'static str` attribution keeps: each
/// distinct name is copied once and kept for the life of the process (a
/// program has as many as it has allocation sites).
fn intern_site(site: &str) -> &'static str {
    static SITES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut sites = lock(&SITES);
    if let Some(known) = sites.iter().find(|s| **s == site) {
        return known;
    }
    let kept: &'static str = Box::leak(site.to_owned().into_boxed_str());
    sites.push(kept);
    kept
}

/// Release the buffer stream-ordered on its own stream. The handle is gone
/// afterwards (also when the backend refused the free: the memory is then
/// quarantined, and the status says so).
#[no_mangle]
pub extern "C" fn memgov_buffer_release(buffer: *mut memgov_buffer) -> i32 {
    guard("memgov_buffer_release", || release(id(buffer), None))
}

/// Release the buffer stream-ordered on `stream` (same context), after the
/// work queued on its own stream and every recorded stream.
/// `MEMGOV_ERR_INVALID_ARGUMENT` for a stream of another context: the buffer
/// stays live and its handle valid.
#[no_mangle]
pub extern "C" fn memgov_buffer_release_on(
    buffer: *mut memgov_buffer,
    stream: *mut memgov_stream,
) -> i32 {
    guard("memgov_buffer_release_on", || {
        let s = get::<StreamObj, _>(stream)?;
        release(id(buffer), Some(&s))
    })
}

/// `MEMGOV_ERR_RETIRING` for a buffer a force retire reclaimed.
fn not_reclaimed(b: &DeviceBuffer<AnyContext>) -> Result<()> {
    match b.raw() {
        Some(_) => Ok(()),
        None => Err(Error::new(
            MEMGOV_ERR_RETIRING,
            "the context was force-retired; the buffer's memory was reclaimed (release the handle)",
        )),
    }
}

fn with_buffer<T>(
    buffer: *const memgov_buffer,
    f: impl FnOnce(&mut DeviceBuffer<AnyContext>) -> Result<T>,
) -> Result<T> {
    let obj = get::<BufferObj, _>(buffer)?;
    let mut slot = lock(&obj.buffer);
    match slot.as_mut() {
        Some(b) => f(b),
        None => Err(Error::new(
            MEMGOV_ERR_INVALID_HANDLE,
            "the buffer is being released",
        )),
    }
}

/// Record that work of your own on `stream` uses the buffer: its release is
/// ordered after the work queued there (PyTorch's `record_stream`).
#[no_mangle]
pub extern "C" fn memgov_buffer_record_stream(
    buffer: *mut memgov_buffer,
    stream: *mut memgov_stream,
) -> i32 {
    guard("memgov_buffer_record_stream", || {
        let s = get::<StreamObj, _>(stream)?;
        with_buffer(buffer, |b| {
            not_reclaimed(b)?;
            Ok(b.record_stream(&s.stream)?)
        })
    })
}

pub(crate) fn device_ptr_of(buffer_id: u64) -> Result<*mut c_void> {
    with_buffer(handle::<memgov_buffer>(buffer_id), |b| {
        let memory = b.raw().ok_or_else(|| {
            Error::new(
                MEMGOV_ERR_RETIRING,
                "the context was force-retired; the buffer's memory was reclaimed",
            )
        })?;
        #[allow(unreachable_patterns)]
        let addr: usize = match memory {
            AnyMemory::Host(m) => m.as_ptr() as usize,
            #[cfg(feature = "cuda")]
            AnyMemory::Cuda(m) => m.device_ptr() as usize,
            #[cfg(feature = "hip")]
            AnyMemory::Hip(m) => m.device_ptr() as usize,
            #[cfg(feature = "vulkan")]
            AnyMemory::Vulkan(m) => match m.device_address() {
                Some(a) => a as usize,
                None => return Err(Error::new(
                    MEMGOV_ERR_UNSUPPORTED,
                    "this Vulkan device has no buffer device address; use memgov_buffer_write/read",
                )),
            },
            _ => return Err(Error::new(
                MEMGOV_ERR_UNSUPPORTED,
                "this backend's memory has no address (null backend); use memgov_buffer_write/read",
            )),
        };
        Ok(addr as *mut c_void)
    })
}

/// The buffer's raw address: host memory on the host backend, a
/// `CUdeviceptr` / `hipDeviceptr_t` on CUDA / HIP, the buffer device
/// address on Vulkan; `MEMGOV_ERR_UNSUPPORTED` where there is none. Valid
/// until the buffer is released.
#[no_mangle]
pub unsafe extern "C" fn memgov_buffer_device_ptr(
    buffer: *mut memgov_buffer,
    out: *mut *mut c_void,
) -> i32 {
    guard("memgov_buffer_device_ptr", || {
        let p = device_ptr_of(id(buffer))?;
        // SAFETY: NULL (refused) or writable by contract.
        unsafe { put(out, p) }
    })
}

/// The buffer's size in bytes. `MEMGOV_ERR_RETIRING` once a force retire
/// reclaimed it.
#[no_mangle]
pub unsafe extern "C" fn memgov_buffer_size(buffer: *mut memgov_buffer, out: *mut u64) -> i32 {
    guard("memgov_buffer_size", || {
        let bytes = get::<BufferObj, _>(buffer)?.bytes;
        with_buffer(buffer, |b| not_reclaimed(b))?;
        // SAFETY: NULL (refused) or writable by contract.
        unsafe { put(out, bytes) }
    })
}

/// `MEMGOV_ERR_INVALID_ARGUMENT` unless `offset .. offset + len` lies inside
/// the buffer. Checked before a slice is formed from the caller's pointer
/// and length: a length past `isize::MAX`, or one whose end wraps, never
/// becomes a slice.
fn check_range(buffer: *const memgov_buffer, op: &str, offset: u64, len: usize) -> Result<()> {
    let bytes = get::<BufferObj, _>(buffer)?.bytes;
    let inside = u64::try_from(len)
        .ok()
        .filter(|_| isize::try_from(len).is_ok())
        .and_then(|len| offset.checked_add(len))
        .is_some_and(|end| end <= bytes);
    if inside {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{op} of {len} bytes at offset {offset} does not fit the buffer of {bytes} bytes \
             (offset + len must be at most the buffer's size)"
        )))
    }
}

/// Copy `len` bytes from `src` into the buffer at `offset`, ordered on its
/// stream. `MEMGOV_ERR_INVALID_ARGUMENT` unless `offset + len` is at most the
/// buffer's size.
#[no_mangle]
pub unsafe extern "C" fn memgov_buffer_write(
    buffer: *mut memgov_buffer,
    offset: u64,
    src: *const c_void,
    len: usize,
) -> i32 {
    guard("memgov_buffer_write", || {
        check_range(buffer, "write", offset, len)?;
        if src.is_null() && len > 0 {
            return Err(Error::invalid("src is NULL"));
        }
        let data: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: non-null, `len` readable bytes by contract, and `len`
            // is at most the buffer's size (checked above), so within
            // `isize::MAX`.
            unsafe { std::slice::from_raw_parts(src.cast::<u8>(), len) }
        };
        with_buffer(buffer, |b| Ok(b.write(offset, data)?))
    })
}

/// Copy `len` bytes of the buffer at `offset` into `dst`, ordered on its
/// stream (returns once the copy is done). `MEMGOV_ERR_INVALID_ARGUMENT`
/// unless `offset + len` is at most the buffer's size.
#[no_mangle]
pub unsafe extern "C" fn memgov_buffer_read(
    buffer: *mut memgov_buffer,
    offset: u64,
    dst: *mut c_void,
    len: usize,
) -> i32 {
    guard("memgov_buffer_read", || {
        check_range(buffer, "read", offset, len)?;
        if dst.is_null() && len > 0 {
            return Err(Error::invalid("dst is NULL"));
        }
        let data: &mut [u8] = if len == 0 {
            &mut []
        } else {
            // SAFETY: non-null, `len` writable bytes by contract, and `len`
            // is at most the buffer's size (checked above), so within
            // `isize::MAX`.
            unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), len) }
        };
        with_buffer(buffer, |b| Ok(b.read(offset, data)?))
    })
}

// -------------------------------------------------------------------- pins

/// A source of pins on the context for an external holder: `holder` labels
/// its pins in snapshots and retire timeouts. Counted against `plugin` (may
/// be NULL), as is every pin taken from it.
#[no_mangle]
pub unsafe extern "C" fn memgov_pin_source_create(
    ctx: *mut memgov_context,
    holder: *const c_char,
    plugin: *mut memgov_plugin,
    out: *mut *mut memgov_pin_source,
) -> i32 {
    guard("memgov_pin_source_create", || {
        let c = get::<ContextObj, _>(ctx)?;
        // SAFETY: NULL or NUL-terminated (contract).
        let holder = unsafe { opt_str(holder, "holder") }?;
        let plugin = plugin_arg(plugin)?;
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        let charge = charge(plugin.as_ref(), What::PinSource)?;
        let source = c.ctx.pin_source(holder);
        let h = registry::insert(Arc::new(PinSourceObj {
            source,
            plugin: plugin.clone(),
            _charge: charge,
        }));
        created(plugin.as_ref(), h);
        // SAFETY: checked non-null; writable by contract.
        unsafe { put(out, handle(h)) }
    })
}

/// Destroy a pin source. Pins taken from it stay held until released.
#[no_mangle]
pub extern "C" fn memgov_pin_source_destroy(source: *mut memgov_pin_source) -> i32 {
    guard("memgov_pin_source_destroy", || {
        drop(registry::remove::<PinSourceObj>(id(source))?);
        Ok(())
    })
}

/// Take a pin: while held, the context cannot finish tearing down.
/// `MEMGOV_ERR_RETIRING` once it is retiring: then do not queue the work you
/// wanted to pin.
#[no_mangle]
pub unsafe extern "C" fn memgov_pin_acquire(
    source: *mut memgov_pin_source,
    out: *mut *mut memgov_pin,
) -> i32 {
    guard("memgov_pin_acquire", || {
        let s = get::<PinSourceObj, _>(source)?;
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        let charge = charge(s.plugin.as_ref(), What::Pin)?;
        let pin = s.source.pin()?;
        let h = registry::insert(Arc::new(PinObj {
            _pin: pin,
            _charge: charge,
        }));
        created(s.plugin.as_ref(), h);
        // SAFETY: checked non-null; writable by contract.
        unsafe { put(out, handle(h)) }
    })
}

/// Drop a pin.
#[no_mangle]
pub extern "C" fn memgov_pin_release(pin: *mut memgov_pin) -> i32 {
    guard("memgov_pin_release", || {
        drop(registry::remove::<PinObj>(id(pin))?);
        Ok(())
    })
}
