//! Plugins and the unload gate.
//!
//! A plugin is a handle that the calls creating streams, buffers, pin
//! sources, pins, pressure callbacks and ORT allocators may name. Everything
//! created that way is counted against it until it is gone: live objects
//! until destroyed or released, a buffer's release until it has retired on
//! the device, a pressure callback until removed and no call is in it. The
//! plugin may be unloaded only when every count is zero; the loader
//! (`memgov_plugin_open` / `memgov_plugin_close`) refuses `dlclose` until
//! then, so no callback or deferred release can run code that is gone.
//!
//! While the loader runs a plugin's init function, the plugin may not be
//! closed or unregistered (its code is running); if init fails, everything
//! it created for the plugin is released or destroyed, and the library is
//! closed once its queued releases have retired.

use crate::ffi::*;
use crate::objects::{snapshot_of, Ctx, Slot};
use crate::registry::{self, lock, Kind};
use crate::status::*;
use crate::{get, handle, id, memgov_plugin, opt_str, put, req_str, write_sized};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Arc, Mutex};

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    streams: u64,
    buffers: u64,
    buffer_bytes: u64,
    pin_sources: u64,
    pins: u64,
    allocators: u64,
    /// Set while `close`/`unregister` checks the counts: new charges are
    /// refused, so that a zero count stays zero until the library is gone.
    closing: bool,
    /// Set while `memgov_plugin_open` runs the plugin's init function: its
    /// code is running, so it may not be closed.
    initializing: bool,
}

/// Something created for a plugin while its init function ran.
enum Created {
    /// A registry handle (stream, buffer, pin source, pin, callback).
    Handle(u64),
    /// An ORT allocator, by address.
    Ort(usize),
}

/// A library loaded by `memgov_plugin_open`.
struct Library {
    handle: usize,
    path: String,
}

pub(crate) struct PluginObj {
    name: String,
    counts: Mutex<Counts>,
    /// Pressure callbacks registered with this plugin.
    slots: Mutex<Vec<Arc<Slot>>>,
    /// Releases queued per context, not yet known to have retired.
    pending: Mutex<Vec<(Ctx, u64)>>,
    library: Mutex<Option<Library>>,
    /// What was created for it while its init function ran (`Some` only
    /// then), to clean up if init fails.
    in_init: Mutex<Option<Vec<Created>>>,
}

impl Kind for PluginObj {
    const TAG: u8 = 8;
    const NAME: &'static str = "plugin";
}

/// What a charge counts.
pub(crate) enum What {
    Stream,
    Buffer(u64),
    PinSource,
    Pin,
    Allocator,
}

/// One object counted against a plugin; dropping it takes the count back.
pub(crate) struct Charge {
    plugin: Arc<PluginObj>,
    what: What,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut c = lock(&self.plugin.counts);
        match self.what {
            What::Stream => c.streams -= 1,
            What::Buffer(bytes) => {
                c.buffers -= 1;
                c.buffer_bytes -= bytes;
            }
            What::PinSource => c.pin_sources -= 1,
            What::Pin => c.pins -= 1,
            What::Allocator => c.allocators -= 1,
        }
    }
}

fn closing_error(p: &PluginObj) -> Error {
    Error::new(
        MEMGOV_ERR_RETIRING,
        format!(
            "plugin '{}' is being unloaded; it may not create anything",
            p.name
        ),
    )
}

/// Count a new object against `plugin` (none: not counted).
pub(crate) fn charge(plugin: Option<&Arc<PluginObj>>, what: What) -> Result<Option<Charge>> {
    let Some(p) = plugin else { return Ok(None) };
    let mut c = lock(&p.counts);
    if c.closing {
        return Err(closing_error(p));
    }
    match what {
        What::Stream => c.streams += 1,
        What::Buffer(bytes) => {
            c.buffers += 1;
            c.buffer_bytes += bytes;
        }
        What::PinSource => c.pin_sources += 1,
        What::Pin => c.pins += 1,
        What::Allocator => c.allocators += 1,
    }
    drop(c);
    Ok(Some(Charge {
        plugin: p.clone(),
        what,
    }))
}

/// Note a handle created for `plugin` (none: nothing to note): while its
/// init function runs, it is cleaned up should init fail.
pub(crate) fn created(plugin: Option<&Arc<PluginObj>>, id: u64) {
    if let Some(p) = plugin {
        if let Some(list) = lock(&p.in_init).as_mut() {
            list.push(Created::Handle(id));
        }
    }
}

/// [`created`] for an ORT allocator.
pub(crate) fn created_ort(plugin: Option<&Arc<PluginObj>>, allocator: usize) {
    if let Some(p) = plugin {
        if let Some(list) = lock(&p.in_init).as_mut() {
            list.push(Created::Ort(allocator));
        }
    }
}

impl PluginObj {
    fn new(name: String) -> Self {
        Self {
            name,
            counts: Mutex::new(Counts::default()),
            slots: Mutex::new(Vec::new()),
            pending: Mutex::new(Vec::new()),
            library: Mutex::new(None),
            in_init: Mutex::new(None),
        }
    }

    pub(crate) fn add_slot(&self, slot: &Arc<Slot>) -> Result<()> {
        // The counts' lock orders this against `close`'s check.
        let c = lock(&self.counts);
        if c.closing {
            return Err(closing_error(self));
        }
        lock(&self.slots).push(slot.clone());
        Ok(())
    }

    /// A release of one of this plugin's buffers was queued on `ctx`.
    pub(crate) fn release_queued(&self, ctx: &Ctx) {
        let mut pending = lock(&self.pending);
        match pending.iter_mut().find(|(c, _)| c.id() == ctx.id()) {
            Some((_, n)) => *n += 1,
            None => pending.push((ctx.clone(), 1)),
        }
    }

    /// Releases of this plugin's buffers not known to have retired.
    ///
    /// The governor counts pending releases per context, not per owner, so
    /// this is an upper bound that is exact at zero: for each context, the
    /// plugin's releases queued since the context was last seen with none
    /// pending, capped by the context's pending count. A context seen with
    /// none pending (or terminated) retires every release counted before the
    /// look.
    fn pending_releases(&self) -> u64 {
        let seen: Vec<(Ctx, u64)> = lock(&self.pending).clone();
        let mut total = 0;
        let mut drained = Vec::new();
        for (ctx, n) in &seen {
            // A governor call: no lock of ours is held.
            let s = snapshot_of(ctx);
            if s.total.pending_count == 0 || s.lifecycle == MEMGOV_LIFECYCLE_TERMINATED {
                drained.push((ctx.id(), *n));
            } else {
                total += (*n).min(s.total.pending_count);
            }
        }
        if !drained.is_empty() {
            let mut pending = lock(&self.pending);
            for (cid, n) in drained {
                // Only the releases counted before the look retired; any
                // queued since stay counted.
                if let Some(e) = pending.iter_mut().find(|(c, _)| c.id() == cid) {
                    e.1 = e.1.saturating_sub(n);
                }
            }
            pending.retain(|(_, n)| *n > 0);
        }
        total
    }

    pub(crate) fn outstanding(&self) -> memgov_plugin_outstanding {
        let c = *lock(&self.counts);
        let callbacks = {
            let mut slots = lock(&self.slots);
            slots.retain(|s| s.outstanding());
            slots.len() as u64
        };
        memgov_plugin_outstanding {
            size: std::mem::size_of::<memgov_plugin_outstanding>() as u32,
            reserved: 0,
            streams: c.streams,
            buffers: c.buffers,
            buffer_bytes: c.buffer_bytes,
            pending_releases: self.pending_releases(),
            pin_sources: c.pin_sources,
            pins: c.pins,
            callbacks,
            allocators: c.allocators,
        }
    }

    fn busy(&self, o: &memgov_plugin_outstanding, action: &str) -> Error {
        Error::new(
            MEMGOV_ERR_BUSY,
            format!(
                "plugin '{}' may not be {action}: {} live stream(s), {} live buffer(s) ({} B), {} queued release(s) not retired, {} pin source(s), {} pin(s), {} pressure callback(s), {} ORT allocator(s) outstanding; release them (and synchronize the streams the releases were queued on), then try again",
                self.name, o.streams, o.buffers, o.buffer_bytes, o.pending_releases, o.pin_sources, o.pins, o.callbacks, o.allocators
            ),
        )
    }

    fn in_init_error(&self, action: &str) -> Error {
        Error::new(
            MEMGOV_ERR_BUSY,
            format!(
                "plugin '{}' may not be {action} while its init function runs (memgov_plugin_open \
                 has not returned): dlclose would unmap the code that is running; to give up, \
                 return nonzero from init, and memgov_plugin_open cleans up what init created \
                 and unloads it",
                self.name
            ),
        )
    }

    /// Close the gate: refuse new charges, check that nothing is
    /// outstanding, and run `then` (the `dlclose`) with the gate closed. On
    /// refusal the gate reopens.
    fn close_gate(
        &self,
        action: &str,
        out: *mut memgov_plugin_outstanding,
        then: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        {
            let mut c = lock(&self.counts);
            if c.initializing {
                return Err(self.in_init_error(action));
            }
            if c.closing {
                return Err(Error::new(
                    MEMGOV_ERR_RETIRING,
                    format!(
                        "plugin '{}' is already being {action} by another call",
                        self.name
                    ),
                ));
            }
            c.closing = true;
        }
        let o = self.outstanding();
        if !out.is_null() {
            // SAFETY: a sized struct with its size set (contract).
            if let Err(e) = unsafe { write_sized(out, o, "memgov_plugin_outstanding") } {
                lock(&self.counts).closing = false;
                return Err(e);
            }
        }
        if o.total() > 0 {
            lock(&self.counts).closing = false;
            return Err(self.busy(&o, action));
        }
        let r = then();
        if r.is_err() {
            lock(&self.counts).closing = false;
        }
        r
    }
}

/// Register a plugin (a library loaded by the caller itself): pass the
/// handle to the calls that create things on its behalf.
#[no_mangle]
pub unsafe extern "C" fn memgov_plugin_register(
    name: *const c_char,
    out: *mut *mut memgov_plugin,
) -> i32 {
    guard("memgov_plugin_register", || {
        // SAFETY: NUL-terminated (contract).
        let name = unsafe { req_str(name, "name") }?;
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        let h = registry::insert(Arc::new(PluginObj::new(name.to_owned())));
        // SAFETY: checked non-null; writable by contract.
        unsafe { put(out, handle(h)) }
    })
}

/// Whether the plugin may be unloaded: `MEMGOV_OK` when nothing is
/// outstanding against it, `MEMGOV_ERR_BUSY` otherwise; `out` (may be NULL)
/// says what is outstanding either way.
#[no_mangle]
pub unsafe extern "C" fn memgov_plugin_may_unload(
    plugin: *mut memgov_plugin,
    out: *mut memgov_plugin_outstanding,
) -> i32 {
    guard("memgov_plugin_may_unload", || {
        let p = get::<PluginObj, _>(plugin)?;
        let o = p.outstanding();
        if !out.is_null() {
            // SAFETY: a sized struct with its size set (contract).
            unsafe { write_sized(out, o, "memgov_plugin_outstanding") }?;
        }
        if o.total() > 0 {
            return Err(p.busy(&o, "unloaded"));
        }
        Ok(())
    })
}

/// Unregister a plugin registered with `memgov_plugin_register`: refused
/// with `MEMGOV_ERR_BUSY` (and `out` filled) while anything is outstanding.
#[no_mangle]
pub unsafe extern "C" fn memgov_plugin_unregister(
    plugin: *mut memgov_plugin,
    out: *mut memgov_plugin_outstanding,
) -> i32 {
    guard("memgov_plugin_unregister", || {
        let p = get::<PluginObj, _>(plugin)?;
        if lock(&p.counts).initializing {
            return Err(p.in_init_error("unregistered"));
        }
        if lock(&p.library).is_some() {
            return Err(Error::invalid(
                "the plugin was loaded by memgov_plugin_open; close it with memgov_plugin_close",
            ));
        }
        p.close_gate("unregistered", out, || {
            registry::remove::<PluginObj>(id(plugin)).map(drop)
        })
    })
}

const RTLD_NOW: c_int = 2;
const RTLD_LOCAL: c_int = 0;

#[link(name = "dl")]
extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlclose(handle: *mut c_void) -> c_int;
    fn dlerror() -> *mut c_char;
}

fn dl_error(what: &str) -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc,
    // valid until the next dl call on this thread; copied at once.
    let e = unsafe { dlerror() };
    if e.is_null() {
        format!("{what}: no further detail from the dynamic loader")
    } else {
        // SAFETY: as above.
        let s = unsafe { CStr::from_ptr(e) };
        format!("{what}: {}", s.to_string_lossy())
    }
}

/// Load a plugin: `dlopen(path, RTLD_NOW | RTLD_LOCAL)`, register it under
/// its path, and call its init function `init_symbol` (NULL:
/// "memgov_plugin_init") as `int32_t init(memgov_plugin* self, void*
/// host_data)`, which returns 0 on success. On `MEMGOV_OK` `*out` is the
/// plugin. While init runs, the plugin may not be closed or unregistered
/// (`MEMGOV_ERR_BUSY`). If init fails, everything it created for the plugin
/// is released or destroyed, its queued releases are waited for (up to
/// [`INIT_CLEANUP_WAIT`]), the library is closed and `*out` is NULL; only if
/// something is still outstanding after that (a release that does not
/// retire) is `*out` set, and the caller closes it later.
#[no_mangle]
pub unsafe extern "C" fn memgov_plugin_open(
    path: *const c_char,
    init_symbol: *const c_char,
    host_data: *mut c_void,
    out: *mut *mut memgov_plugin,
) -> i32 {
    guard("memgov_plugin_open", || {
        // SAFETY: NUL-terminated (contract).
        let path_str = unsafe { req_str(path, "path") }?;
        // SAFETY: NULL or NUL-terminated (contract).
        let init_name =
            unsafe { opt_str(init_symbol, "init_symbol") }?.unwrap_or("memgov_plugin_init");
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        // SAFETY: out is non-null and writable by contract.
        unsafe { put(out, std::ptr::null_mut()) }?;
        let init_c =
            CString::new(init_name).map_err(|_| Error::invalid("init_symbol has a NUL"))?;
        // SAFETY: `path` is a NUL-terminated string; loading runs the
        // library's constructors, which is what loading a plugin means.
        let lib = unsafe { dlopen(path, RTLD_NOW | RTLD_LOCAL) };
        if lib.is_null() {
            return Err(Error::new(
                MEMGOV_ERR_PLUGIN,
                dl_error(&format!("cannot load '{path_str}'")),
            ));
        }
        // SAFETY: `lib` is a live handle from dlopen; the name is NUL-terminated.
        let sym = unsafe { dlsym(lib, init_c.as_ptr()) };
        if sym.is_null() {
            let msg = dl_error(&format!("'{path_str}' has no '{init_name}'"));
            // SAFETY: nothing of the library ran beyond its constructors;
            // nothing memgov holds refers to it.
            unsafe { dlclose(lib) };
            return Err(Error::new(MEMGOV_ERR_PLUGIN, msg));
        }
        let plugin = Arc::new(PluginObj::new(path_str.to_owned()));
        *lock(&plugin.library) = Some(Library {
            handle: lib as usize,
            path: path_str.to_owned(),
        });
        lock(&plugin.counts).initializing = true;
        *lock(&plugin.in_init) = Some(Vec::new());
        let h = registry::insert(plugin.clone());
        // SAFETY: the symbol is the plugin's init function, declared in the
        // header with this signature.
        let init: unsafe extern "C" fn(*mut memgov_plugin, *mut c_void) -> i32 =
            unsafe { std::mem::transmute::<*mut c_void, _>(sym) };
        // No memgov lock is held: init calls back into memgov.
        // SAFETY: the plugin's own init, with its handle and the host's data.
        let rc = unsafe { init(handle(h), host_data) };
        lock(&plugin.counts).initializing = false;
        let made = lock(&plugin.in_init).take().unwrap_or_default();
        if rc == 0 {
            // SAFETY: checked non-null above.
            return unsafe { put(out, handle(h)) };
        }
        let cleaned = !made.is_empty();
        clean_up(&plugin, made);
        let closed = plugin.close_gate("unloaded", std::ptr::null_mut(), || unload(&plugin, h));
        if closed.is_err() {
            // SAFETY: checked non-null above.
            unsafe { put(out, handle(h)) }?;
        }
        Err(Error::new(
            MEMGOV_ERR_PLUGIN,
            format!(
                "'{path_str}': {init_name} returned {rc}{}",
                if closed.is_ok() && !cleaned {
                    "; the library was closed again"
                } else if closed.is_ok() {
                    "; what it created was released and destroyed, and the library was closed again"
                } else {
                    "; what it created was released and destroyed, but releases it queued have not retired, so it stays loaded: synchronize their streams and call memgov_plugin_close"
                }
            ),
        ))
    })
}

/// How long `memgov_plugin_open` waits, after a failed init, for the
/// releases of what init created to retire.
pub const INIT_CLEANUP_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// After a failed init: release, remove and destroy everything created for
/// the plugin while init ran (ORT allocators, buffers, pins, pin sources,
/// pressure callbacks, streams), synchronize the streams its releases were
/// queued on, and wait (up to [`INIT_CLEANUP_WAIT`]) until nothing is
/// outstanding. Objects init already let go of are skipped. No lock is held
/// while the governor is called.
fn clean_up(plugin: &PluginObj, made: Vec<Created>) {
    use crate::objects::{release_for_cleanup, remove_callback, StreamObj};
    let handles: Vec<u64> = made
        .iter()
        .filter_map(|c| match c {
            Created::Handle(id) => Some(*id),
            Created::Ort(_) => None,
        })
        .collect();
    for c in &made {
        if let Created::Ort(a) = c {
            crate::runtimes::ort_discard(*a);
        }
    }
    let of_kind = |tag: u8| {
        handles
            .iter()
            .copied()
            .filter(move |id| (id >> 56) as u8 == tag)
    };
    let mut queues = Vec::new();
    for id in of_kind(crate::objects::BufferObj::TAG) {
        if let Some(q) = release_for_cleanup(id) {
            queues.push(q);
        }
    }
    for id in of_kind(crate::objects::PinObj::TAG) {
        drop(registry::remove::<crate::objects::PinObj>(id));
    }
    for id in of_kind(crate::objects::PinSourceObj::TAG) {
        drop(registry::remove::<crate::objects::PinSourceObj>(id));
    }
    for id in of_kind(crate::objects::CallbackObj::TAG) {
        let _ = remove_callback(id);
    }
    for q in &queues {
        let _ = q.synchronize();
    }
    for id in of_kind(StreamObj::TAG) {
        if let Ok(s) = registry::remove::<StreamObj>(id) {
            // Its queued work, releases included, retires first.
            let _ = s.stream.synchronize();
        }
    }
    drop(queues);
    let deadline = std::time::Instant::now() + INIT_CLEANUP_WAIT;
    let mut pause = std::time::Duration::from_millis(1);
    while plugin.outstanding().total() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(50));
    }
}

/// Take the plugin out of the registry and `dlclose` its library.
fn unload(plugin: &PluginObj, h: u64) -> Result<()> {
    registry::remove::<PluginObj>(h)?;
    if let Some(lib) = lock(&plugin.library).take() {
        // SAFETY: the handle came from dlopen and is closed once (taken out
        // of the plugin). Nothing memgov holds runs its code: every object
        // counted against it is gone (the gate is closed and empty).
        let rc = unsafe { dlclose(lib.handle as *mut c_void) };
        if rc != 0 {
            return Err(Error::new(
                MEMGOV_ERR_PLUGIN,
                dl_error(&format!("dlclose('{}') failed", lib.path)),
            ));
        }
    }
    Ok(())
}

/// Look a symbol of a loaded plugin up (`dlsym`).
#[no_mangle]
pub unsafe extern "C" fn memgov_plugin_symbol(
    plugin: *mut memgov_plugin,
    name: *const c_char,
    out: *mut *mut c_void,
) -> i32 {
    guard("memgov_plugin_symbol", || {
        let p = get::<PluginObj, _>(plugin)?;
        // SAFETY: NUL-terminated (contract).
        let name_str = unsafe { req_str(name, "name") }?;
        if out.is_null() {
            return Err(Error::invalid("the out-pointer is NULL"));
        }
        // The library's lock is held across dlsym, so that a concurrent
        // close (which takes the handle out under it) cannot dlclose it in
        // between. dlsym runs no code of the plugin.
        let library = lock(&p.library);
        let Some(lib) = library.as_ref() else {
            return Err(Error::invalid(format!(
                "plugin '{}' was registered, not loaded by memgov_plugin_open",
                p.name
            )));
        };
        // SAFETY: a live dlopen handle (held under its lock); `name` is
        // NUL-terminated.
        let sym = unsafe { dlsym(lib.handle as *mut c_void, name) };
        drop(library);
        if sym.is_null() {
            return Err(Error::new(
                MEMGOV_ERR_PLUGIN,
                dl_error(&format!("plugin '{}' has no '{name_str}'", p.name)),
            ));
        }
        // SAFETY: checked non-null; writable by contract.
        unsafe { put(out, sym) }
    })
}

/// Unload a plugin loaded by `memgov_plugin_open`: refused with
/// `MEMGOV_ERR_BUSY` (and `out`, may be NULL, filled) while anything is
/// outstanding against it; otherwise its handle is released and its library
/// closed.
#[no_mangle]
pub unsafe extern "C" fn memgov_plugin_close(
    plugin: *mut memgov_plugin,
    out: *mut memgov_plugin_outstanding,
) -> i32 {
    guard("memgov_plugin_close", || {
        let p = get::<PluginObj, _>(plugin)?;
        if lock(&p.counts).initializing {
            return Err(p.in_init_error("unloaded"));
        }
        if lock(&p.library).is_none() {
            return Err(Error::invalid(
                "the plugin was registered, not loaded: unregister it with memgov_plugin_unregister",
            ));
        }
        p.close_gate("unloaded", out, || unload(&p, id(plugin)))
    })
}
