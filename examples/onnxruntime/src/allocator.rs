//! The `OrtAllocator` whose memory comes from a memgov context.
//!
//! ONNX Runtime keeps the raw `OrtAllocator*` it was given for as long as any
//! session or tensor that used it lives, and tells nobody when the last one
//! is gone (`UnregisterAllocator` only stops *new* sessions from finding it).
//! So the C-visible part here, a small [`Shell`], is never freed: it lives
//! for the rest of the process, a few hundred bytes per allocator. Everything
//! that holds the context (the context handle, the registration pin, the
//! stream, the live buffers) is detachable and goes away when it should, and
//! the shell's address map is given back once it is empty after the handle
//! is dropped.

use crate::error::Error;
use memgov::host::HostContext;
use memgov::{
    Alloc, ContextHandle, DeviceBuffer, DeviceContext, GovernedStream, GovernorError,
    ProviderContextPin, Role,
};
use ort::environment::Environment;
use ort::sys as ffi;
use ort::AsPointer;
use std::alloc::Layout;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Label of the registration pin and of the allocator's stream: what a retire
/// timeout names while ONNX Runtime still holds the context.
pub const HOLDER: &str = "onnxruntime";

/// The site ONNX Runtime's allocations through this allocator are counted
/// at, with call-site attribution on
/// ([`ContextConfig::attribution`](memgov::ContextConfig::attribution) or
/// `MEMGOV_ATTRIBUTION=1`): the runtime calls it from its own C++ code, so
/// no Rust line of the caller's is there to name.
pub const ALLOCATOR_SITE: &str = "onnxruntime allocator";

/// Bytes added to every allocation. ONNX Runtime's own CPU allocator pads its
/// blocks the same way, because some MLAS kernels (symmetric quantised GEMM)
/// read a little past the end of their buffers.
pub const PAD: u64 = 64;

/// Alignment every allocation meets: what ONNX Runtime's CPU kernels are
/// given by its own allocator (`MlasGetPreferredBufferAlignment()`, 64 B on
/// x86-64).
pub const ALIGN: usize = 64;

/// Contexts whose allocations the CPU can address directly.
pub trait HostAddressable: DeviceContext {
    /// The address of `memory`, if the CPU can read and write it.
    fn host_ptr(memory: &Self::Memory) -> Option<NonNull<u8>>;
}

impl HostAddressable for HostContext {
    fn host_ptr(memory: &Self::Memory) -> Option<NonNull<u8>> {
        NonNull::new(memory.as_ptr())
    }
}

impl HostAddressable for memgov::any::AnyContext {
    fn host_ptr(memory: &Self::Memory) -> Option<NonNull<u8>> {
        match memory {
            memgov::any::AnyMemory::Host(m) => NonNull::new(m.as_ptr()),
            _ => None,
        }
    }
}

thread_local! {
    /// Nesting depth of `GovernedAllocator::strict` on this thread.
    static STRICT: Cell<u32> = const { Cell::new(0) };
    /// The first refusal inside the innermost `strict` scope on this thread:
    /// what the scope returns once the runtime's call is over.
    static REFUSED: RefCell<Option<Error>> = const { RefCell::new(None) };
}

/// Counters of one allocator, from its creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AllocatorStats {
    /// `Alloc` calls answered with memory.
    pub allocations: u64,
    /// Bytes of those, padding included (governed and overdraft).
    pub allocated_bytes: u64,
    /// `Free` calls that released an allocation.
    pub frees: u64,
    /// Bytes ONNX Runtime holds now (governed and overdraft, padding
    /// included).
    pub live_bytes: u64,
    /// Highest `live_bytes` seen.
    pub peak_bytes: u64,
    /// Allocations served from the process heap because memgov refused them
    /// (or the allocator handle was already dropped).
    pub overdrafts: u64,
    /// Bytes of those.
    pub overdraft_bytes: u64,
    /// Allocations refused inside [`GovernedAllocator::strict`]: each was
    /// served from the process heap (and counted in `overdrafts`), and the
    /// scope then failed with the first refusal's error.
    pub refusals: u64,
    /// `Free` calls with a pointer this allocator never gave out (ignored).
    pub unknown_frees: u64,
}

/// Where one pointer handed to ONNX Runtime came from.
enum Entry<C: DeviceContext> {
    Governed(DeviceBuffer<C>),
    Overdraft(Layout),
}

/// What the C callbacks reach. Part of the shell, which is never freed, so
/// nothing here may keep the context's record alive once the handle is
/// dropped: the handle and the stream are taken out then, and each live
/// buffer holds its context only until ONNX Runtime frees it.
struct State<C: DeviceContext> {
    role: Role,
    /// The context and the allocator's stream; `None` once the handle is
    /// dropped: nothing new is governed then.
    governed: Mutex<Option<(ContextHandle<C>, GovernedStream<C>)>>,
    /// Set with `governed` taken: the address map is given back when it
    /// empties.
    closed: AtomicBool,
    entries: Mutex<HashMap<usize, Entry<C>>>,
    allocations: AtomicU64,
    allocated_bytes: AtomicU64,
    frees: AtomicU64,
    live: AtomicU64,
    peak: AtomicU64,
    overdrafts: AtomicU64,
    overdraft_bytes: AtomicU64,
    refusals: AtomicU64,
    unknown_frees: AtomicU64,
    last_refusal: Mutex<Option<String>>,
}

impl<C: DeviceContext> State<C> {
    /// The state of a fresh allocator: nothing allocated, counted or refused.
    fn new(ctx: ContextHandle<C>, role: Role, stream: GovernedStream<C>) -> Self {
        Self {
            role,
            governed: Mutex::new(Some((ctx, stream))),
            closed: AtomicBool::new(false),
            entries: Mutex::new(HashMap::new()),
            allocations: AtomicU64::new(0),
            allocated_bytes: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            live: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            overdrafts: AtomicU64::new(0),
            overdraft_bytes: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            unknown_frees: AtomicU64::new(0),
            last_refusal: Mutex::new(None),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<C: HostAddressable> State<C> {
    fn alloc(&self, size: usize) -> *mut c_void {
        if size == 0 {
            // What ONNX Runtime's own CPU allocator answers, too.
            return ptr::null_mut();
        }
        let bytes = (size as u64).saturating_add(PAD);
        let refused = match self.governed(bytes) {
            // Counted at the buffer's length, which its free subtracts (a
            // governed block cache rounds a request up to its size class).
            Ok((p, len)) => return self.served(p, len),
            Err(reason) => reason,
        };
        *lock(&self.last_refusal) = Some(refused.to_string());
        // Never null, not even inside `strict`: some ONNX Runtime code (the
        // ConvTranspose weight prepacking, for one) writes to what `Alloc`
        // returned without checking it. Inside `strict` the refusal is kept
        // and the scope fails once the runtime's call is over.
        if STRICT.with(Cell::get) > 0 {
            self.refusals.fetch_add(1, Ordering::Relaxed);
            REFUSED.with(|r| {
                r.borrow_mut().get_or_insert(refused);
            });
        }
        match self.overdraft(bytes) {
            Some(p) => {
                self.overdrafts.fetch_add(1, Ordering::Relaxed);
                self.overdraft_bytes.fetch_add(bytes, Ordering::Relaxed);
                self.served(p, bytes)
            }
            // The process itself is out of memory; nothing better exists.
            None => ptr::null_mut(),
        }
    }

    fn served(&self, p: NonNull<u8>, bytes: u64) -> *mut c_void {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        self.allocated_bytes.fetch_add(bytes, Ordering::Relaxed);
        let live = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(live, Ordering::Relaxed);
        p.as_ptr().cast()
    }

    /// Allocate through the governor. No lock of ours is held while it runs
    /// (admission may wait and call pressure responders).
    fn governed(&self, bytes: u64) -> Result<(NonNull<u8>, u64), Error> {
        let (ctx, stream) = lock(&self.governed).clone().ok_or(Error::Closed)?;
        let buffer = ctx
            .allocate(&stream, Alloc::new(bytes, self.role).site(ALLOCATOR_SITE))
            .map_err(|e: GovernorError| Error::Governor(e))?;
        let p = host_ptr(&ctx, &buffer)?;
        let len = buffer.len();
        lock(&self.entries).insert(p.as_ptr() as usize, Entry::Governed(buffer));
        Ok((p, len))
    }

    fn overdraft(&self, bytes: u64) -> Option<NonNull<u8>> {
        let layout = Layout::from_size_align(usize::try_from(bytes).ok()?, ALIGN).ok()?;
        // SAFETY: `layout` has a nonzero size (`bytes >= PAD`).
        let p = NonNull::new(unsafe { std::alloc::alloc(layout) })?;
        lock(&self.entries).insert(p.as_ptr() as usize, Entry::Overdraft(layout));
        Some(p)
    }

    fn free(&self, p: *mut c_void) {
        if p.is_null() {
            return;
        }
        let entry = lock(&self.entries).remove(&(p as usize));
        // The lock is released before the buffer's stream-ordered release
        // runs (it calls into the backend).
        match entry {
            Some(Entry::Governed(buffer)) => {
                self.released(buffer.len());
                drop(buffer);
            }
            Some(Entry::Overdraft(layout)) => {
                self.released(layout.size() as u64);
                // SAFETY: `p` came from `std::alloc::alloc(layout)` in
                // `overdraft` and was removed from `entries` just now, so it
                // is freed exactly once.
                unsafe { std::alloc::dealloc(p.cast(), layout) };
            }
            None => {
                self.unknown_frees.fetch_add(1, Ordering::Relaxed);
            }
        }
        if self.closed.load(Ordering::Acquire) {
            self.give_back_empty_map();
        }
    }

    /// Replace the address map by an unallocated one if it is empty: a map
    /// that once held a large session's addresses keeps its capacity
    /// otherwise, and the shell is never freed.
    fn give_back_empty_map(&self) {
        let mut entries = lock(&self.entries);
        if entries.is_empty() && entries.capacity() > 0 {
            *entries = HashMap::new();
        }
    }

    /// Let go of everything that holds the context: nothing new is
    /// governed from now on.
    fn close(&self) {
        let taken = lock(&self.governed).take();
        self.closed.store(true, Ordering::Release);
        *lock(&self.last_refusal) = None;
        // Dropped outside the lock: dropping the stream calls the backend.
        drop(taken);
        self.give_back_empty_map();
    }

    fn released(&self, bytes: u64) {
        self.frees.fetch_add(1, Ordering::Relaxed);
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn stats(&self) -> AllocatorStats {
        AllocatorStats {
            allocations: self.allocations.load(Ordering::Relaxed),
            allocated_bytes: self.allocated_bytes.load(Ordering::Relaxed),
            frees: self.frees.load(Ordering::Relaxed),
            live_bytes: self.live.load(Ordering::Relaxed),
            peak_bytes: self.peak.load(Ordering::Relaxed),
            overdrafts: self.overdrafts.load(Ordering::Relaxed),
            overdraft_bytes: self.overdraft_bytes.load(Ordering::Relaxed),
            refusals: self.refusals.load(Ordering::Relaxed),
            unknown_frees: self.unknown_frees.load(Ordering::Relaxed),
        }
    }
}

/// The CPU address of `buffer`, checked against what ONNX Runtime's kernels
/// need.
fn host_ptr<C: HostAddressable>(
    ctx: &ContextHandle<C>,
    buffer: &DeviceBuffer<C>,
) -> Result<NonNull<u8>, Error> {
    let p = buffer
        .raw()
        .and_then(C::host_ptr)
        .ok_or_else(|| Error::Unusable {
            context: ctx.label().to_owned(),
            reason: format!(
                "its backend ({}) has no CPU-addressable memory",
                ctx.description().backend
            ),
        })?;
    if !(p.as_ptr() as usize).is_multiple_of(ALIGN) {
        return Err(Error::Unusable {
            context: ctx.label().to_owned(),
            reason: format!("it returned memory aligned below {ALIGN} B"),
        });
    }
    Ok(p)
}

/// The block ONNX Runtime holds a pointer to. `ort` must be the first field:
/// the callbacks turn the `OrtAllocator*` they get back into a `Shell*`.
#[repr(C)]
struct Shell<C: DeviceContext> {
    ort: ffi::OrtAllocator,
    info: *mut ffi::OrtMemoryInfo,
    state: State<C>,
}

/// # Safety
///
/// `this` must be the `ort` field of a `Shell<C>` made by
/// [`GovernedAllocator::new`] (shells are never freed).
unsafe fn shell<'a, C: DeviceContext>(this: *const ffi::OrtAllocator) -> &'a Shell<C> {
    // SAFETY: per the contract, `this` points at the first field of a live,
    // leaked `Shell<C>`; `repr(C)` puts that field at offset 0.
    unsafe { &*this.cast::<Shell<C>>() }
}

unsafe extern "system" fn alloc_cb<C: HostAddressable>(
    this: *mut ffi::OrtAllocator,
    size: usize,
) -> *mut c_void {
    // SAFETY: ONNX Runtime calls back with the pointer it was registered with,
    // which is the `ort` field of a leaked `Shell<C>`.
    let state = &unsafe { shell::<C>(this) }.state;
    match catch_unwind(AssertUnwindSafe(|| state.alloc(size))) {
        Ok(p) => p,
        // A panic in the governed path: serve from the heap rather than
        // return null inside `Run`.
        Err(_) => catch_unwind(AssertUnwindSafe(|| {
            state
                .overdraft((size as u64).saturating_add(PAD))
                .map_or(ptr::null_mut(), |p| {
                    state.overdrafts.fetch_add(1, Ordering::Relaxed);
                    state.served(p, (size as u64).saturating_add(PAD))
                })
        }))
        .unwrap_or(ptr::null_mut()),
    }
}

unsafe extern "system" fn free_cb<C: HostAddressable>(
    this: *mut ffi::OrtAllocator,
    p: *mut c_void,
) {
    // SAFETY: as in `alloc_cb`.
    let state = &unsafe { shell::<C>(this) }.state;
    // A panic here leaks at most this one allocation; it never unwinds into
    // ONNX Runtime.
    let _ = catch_unwind(AssertUnwindSafe(|| state.free(p)));
}

unsafe extern "system" fn info_cb<C: DeviceContext>(
    this: *const ffi::OrtAllocator,
) -> *const ffi::OrtMemoryInfo {
    // Reading a field cannot panic; the `catch_unwind` keeps the rule simple.
    catch_unwind(|| {
        // SAFETY: as in `alloc_cb`.
        unsafe { shell::<C>(this) }.info.cast_const()
    })
    .unwrap_or(ptr::null())
}

unsafe extern "system" fn reserve_cb<C: HostAddressable>(
    this: *const ffi::OrtAllocator,
    size: usize,
) -> *mut c_void {
    // SAFETY: `Reserve` is `Alloc` without arena bookkeeping; this allocator
    // has no arena. The pointer is the registered one (see `alloc_cb`).
    unsafe { alloc_cb::<C>(this.cast_mut(), size) }
}

/// Turn an ONNX Runtime status into a `Result`, releasing it.
pub(crate) fn check(status: ffi::OrtStatusPtr, what: &'static str) -> Result<(), Error> {
    if status.0.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null status from the API is a live `OrtStatus` that we
    // own; its message is a NUL-terminated string valid until it is released,
    // and it is copied before that.
    let message = unsafe {
        let m = (ort::api().GetErrorMessage)(status.0);
        let s = if m.is_null() {
            String::from("(no message)")
        } else {
            std::ffi::CStr::from_ptr(m).to_string_lossy().into_owned()
        };
        (ort::api().ReleaseStatus)(status.0);
        s
    };
    Err(Error::Ort {
        call: what,
        message,
    })
}

/// An `OrtAllocator` backed by a memgov context, registered on an ONNX
/// Runtime environment for sessions built with
/// `SessionBuilder::with_env_allocators()`.
///
/// * `Alloc` allocates through the governor on a stream labelled
///   [`HOLDER`], under the context's budgets and admission policy, and hands
///   ONNX Runtime the buffer's address ([`ALIGN`]-aligned, [`PAD`] bytes of
///   slack).
/// * `Free` finds the buffer by address and releases it stream-ordered.
/// * While the handle lives it holds a pin labelled [`HOLDER`]: retiring the
///   context waits, and a timeout names `onnxruntime`.
/// * A refusal that remains after the context's admission policy (waiting
///   for pending releases, asking pressure responders) is answered with an
///   overdraft from the process heap, reported in [`stats`](Self::stats),
///   never with null: ONNX Runtime writes to some allocations without
///   checking them (inside `Run`, and in the ConvTranspose weight prepacking
///   while a session is created). Inside [`strict`](Self::strict) (session
///   creation) the scope then fails with the governor's error.
///
/// Dropping the handle unregisters the allocator and lets go of the pin and
/// the stream. Sessions and tensors that still use it keep working: their
/// frees still release governed memory, and new allocations are served as
/// overdrafts. Drop it after the sessions that use it.
pub struct GovernedAllocator<C: HostAddressable> {
    shell: &'static Shell<C>,
    ctx: ContextHandle<C>,
    env: Environment,
    registered: Mutex<bool>,
    pin: Mutex<Option<Box<dyn ProviderContextPin>>>,
}

// SAFETY: the shell is only read through shared references; `State` is
// `Sync` (atomics and mutexes over `Send` values), and `info` is an immutable
// ONNX Runtime object that the API allows reading from any thread.
unsafe impl<C: HostAddressable> Sync for Shell<C> {}
// SAFETY: as for `Sync`; the shell is never moved out of its leaked box.
unsafe impl<C: HostAddressable> Send for Shell<C> {}

impl<C: HostAddressable> GovernedAllocator<C> {
    /// Create the allocator for `ctx` and register it on `env`. Allocations
    /// are charged to `role`.
    ///
    /// # Errors
    ///
    /// [`Error::Governor`] if the context refuses a stream or a pin (it is
    /// retiring or lost); [`Error::Ort`] if ONNX Runtime refuses the
    /// registration (another allocator for CPU memory is registered on `env`:
    /// [`unregister`](Self::unregister) it first).
    pub fn register(env: &Environment, ctx: &ContextHandle<C>, role: Role) -> Result<Self, Error> {
        let stream = ctx.create_stream(HOLDER)?;
        let pin = ctx.pin_source(Some(HOLDER)).pin()?;
        let mut info = ptr::null_mut();
        // SAFETY: the name is a NUL-terminated static string; `info` is a
        // valid out-pointer. A device allocator: arena-type infos are
        // refused by `RegisterAllocator`.
        check(
            unsafe {
                (ort::api().CreateMemoryInfo)(
                    c"Cpu".as_ptr(),
                    ffi::OrtAllocatorType::OrtDeviceAllocator,
                    0,
                    ffi::OrtMemType::OrtMemTypeDefault,
                    &mut info,
                )
            },
            "CreateMemoryInfo",
        )?;
        let mut ort_allocator = {
            // SAFETY: `default()` is unsafe only because the callbacks it
            // leaves empty must be filled before ONNX Runtime sees it; they
            // are, just below.
            unsafe { ffi::OrtAllocator::default() }
        };
        ort_allocator.Alloc = Some(alloc_cb::<C>);
        ort_allocator.Free = Some(free_cb::<C>);
        ort_allocator.Info = Some(info_cb::<C>);
        ort_allocator.Reserve = Some(reserve_cb::<C>);
        let shell: &'static Shell<C> = Box::leak(Box::new(Shell {
            ort: ort_allocator,
            info,
            state: State::new(ctx.clone(), role, stream),
        }));
        let this = Self {
            shell,
            ctx: ctx.clone(),
            env: env.clone(),
            registered: Mutex::new(false),
            pin: Mutex::new(Some(pin)),
        };
        // SAFETY: the environment pointer is live (we hold a clone of the
        // environment) and the allocator lives for the rest of the process.
        check(
            unsafe {
                (ort::api().RegisterAllocator)(
                    this.env.ptr().cast_mut(),
                    ptr::from_ref(&shell.ort).cast_mut(),
                )
            },
            "RegisterAllocator",
        )?;
        *lock(&this.registered) = true;
        Ok(this)
    }

    /// Remove the allocator from the environment, so that sessions created
    /// from now on do not find it (and another allocator can be registered).
    /// Sessions created before keep using it, governed as before. Idempotent.
    pub fn unregister(&self) -> Result<(), Error> {
        let mut registered = lock(&self.registered);
        if !*registered {
            return Ok(());
        }
        // SAFETY: the environment is live (held by `self.env`) and `info` is
        // the memory info the allocator was registered with.
        check(
            unsafe { (ort::api().UnregisterAllocator)(self.env.ptr().cast_mut(), self.shell.info) },
            "UnregisterAllocator",
        )?;
        *registered = false;
        Ok(())
    }

    /// Run `f` (a session creation, typically) so that it fails if any
    /// allocation it makes on this thread is refused, instead of running
    /// over budget.
    ///
    /// A refused allocation is still served (from the process heap, counted
    /// in [`AllocatorStats::refusals`] and `overdrafts`): ONNX Runtime does
    /// not check every `Alloc` for null, and a null written to crashes the
    /// process. Once `f` returns, whatever it made (the session) is dropped,
    /// which gives those bytes back, and the scope returns the first
    /// refusal's error, [`Error::Governor`] with the governor's numbers. If
    /// nothing was refused, `f`'s own result is returned.
    ///
    /// Wrapping `Session::run` in it is allowed but rarely useful: the run's
    /// outputs are dropped on a refusal.
    ///
    /// # Errors
    ///
    /// The first refusal inside the scope, or `f`'s own error.
    pub fn strict<T, E: Into<Error>>(&self, f: impl FnOnce() -> Result<T, E>) -> Result<T, Error> {
        /// Leaves the scope even if `f` panics: restores the depth and the
        /// enclosing scope's refusal.
        struct Scope(Option<Error>);
        impl Drop for Scope {
            fn drop(&mut self) {
                let outer = self.0.take();
                REFUSED.with(|r| *r.borrow_mut() = outer);
                STRICT.with(|s| s.set(s.get() - 1));
            }
        }
        let scope = Scope(REFUSED.with(|r| r.borrow_mut().take()));
        STRICT.with(|s| s.set(s.get() + 1));
        let result = f();
        let refused = REFUSED.with(|r| r.borrow_mut().take());
        drop(scope);
        match (refused, result) {
            (Some(e), Ok(made)) => {
                // Outside the scope: what the session frees is not refused.
                drop(made);
                Err(e)
            }
            (Some(e), Err(_)) => Err(e),
            (None, result) => result.map_err(Into::into),
        }
    }

    /// The context the memory comes from.
    pub fn context(&self) -> &ContextHandle<C> {
        &self.ctx
    }

    /// The allocator's stream (labelled [`HOLDER`]), while the handle lives.
    pub(crate) fn stream(&self) -> Option<GovernedStream<C>> {
        lock(&self.shell.state.governed)
            .as_ref()
            .map(|(_, stream)| stream.clone())
    }

    /// The CPU memory info the allocator is registered with.
    pub(crate) fn memory_info(&self) -> *const ffi::OrtMemoryInfo {
        self.shell.info.cast_const()
    }

    /// Counters since creation.
    pub fn stats(&self) -> AllocatorStats {
        self.shell.state.stats()
    }

    /// Why the last refused allocation was refused (the governor's message,
    /// with its numbers).
    pub fn last_refusal(&self) -> Option<String> {
        lock(&self.shell.state.last_refusal).clone()
    }
}

impl<C: HostAddressable> Drop for GovernedAllocator<C> {
    fn drop(&mut self) {
        let _ = self.unregister();
        // Let go of the context: live buffers keep their own stream until
        // ONNX Runtime frees them. The shell keeps no handle on the context.
        self.shell.state.close();
        drop(lock(&self.pin).take());
    }
}

impl<C: HostAddressable> std::fmt::Debug for GovernedAllocator<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GovernedAllocator")
            .field("context", &self.ctx.label())
            .field("registered", &*lock(&self.registered))
            .field("stats", &self.stats())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    //! The callbacks' logic on a host context, without ONNX Runtime.
    use super::*;
    use memgov::{ContextConfig, Governor};

    fn state(
        gov: &Governor<HostContext>,
        budget: u64,
    ) -> (State<HostContext>, ContextHandle<HostContext>) {
        let ctx = gov.register(
            HostContext::new(memgov::host::HostConfig::default()).unwrap(),
            ContextConfig::new().label("unit").budget(budget),
        );
        let stream = ctx.create_stream(HOLDER).unwrap();
        (State::new(ctx.clone(), Role::Activation, stream), ctx)
    }

    /// With attribution on, what ONNX Runtime allocates through the
    /// allocator is counted at [`ALLOCATOR_SITE`], not at this crate's line.
    #[test]
    fn allocations_are_counted_at_the_allocators_site() {
        let gov = Governor::new();
        let ctx = gov.register(
            HostContext::new(memgov::host::HostConfig::default()).unwrap(),
            ContextConfig::new()
                .label("sites")
                .budget(1 << 20)
                .attribution(true),
        );
        let stream = ctx.create_stream(HOLDER).unwrap();
        let s = State::new(ctx.clone(), Role::Activation, stream);
        let (a, b) = (s.alloc(1000), s.alloc(3000));
        assert!(!a.is_null() && !b.is_null());
        let sites = ctx.snapshot().sites;
        let rows: Vec<_> = sites
            .iter()
            .map(|r| (r.site.as_str(), r.live_count, r.live_bytes))
            .collect();
        assert_eq!(rows, [(ALLOCATOR_SITE, 2, 4000 + 2 * PAD)]);
        assert_eq!(ALLOCATOR_SITE, "onnxruntime allocator");
        s.free(a);
        s.free(b);
        s.close();
        ctx.retire()
            .wait_timeout(std::time::Duration::from_secs(5))
            .unwrap();
    }

    #[test]
    fn governed_then_overdraft_then_strict_refusal_served_and_all_of_it_comes_back() {
        let gov = Governor::new();
        let (s, ctx) = state(&gov, 4096);
        assert!(s.alloc(0).is_null());

        let a = s.alloc(1000);
        assert!(!a.is_null() && (a as usize).is_multiple_of(ALIGN));
        assert_eq!(ctx.snapshot().charged, 1000 + PAD);
        // SAFETY: `a` is a live allocation of 1000 + PAD bytes.
        unsafe { std::ptr::write_bytes(a.cast::<u8>(), 0xab, 1000 + PAD as usize) };

        // Over the budget: served from the heap, reported, not charged.
        let b = s.alloc(8000);
        assert!(!b.is_null() && (b as usize).is_multiple_of(ALIGN));
        assert_eq!(s.stats().overdrafts, 1);
        assert_eq!(s.stats().overdraft_bytes, 8000 + PAD);
        assert_eq!(ctx.snapshot().charged, 1000 + PAD);
        assert!(lock(&s.last_refusal)
            .as_deref()
            .is_some_and(|m| m.contains("cannot admit")));

        // The same refusal inside a strict scope: still served (writable),
        // and the scope's refusal is the governor's error.
        STRICT.with(|d| d.set(1));
        let c = s.alloc(8000);
        STRICT.with(|d| d.set(0));
        assert!(!c.is_null());
        // SAFETY: `c` is a live allocation of 8000 + PAD bytes.
        unsafe { std::ptr::write_bytes(c.cast::<u8>(), 0, 8000) };
        assert_eq!(s.stats().refusals, 1);
        assert_eq!(s.stats().overdrafts, 2);
        let refused = REFUSED.with(|r| r.borrow_mut().take());
        assert!(
            matches!(
                &refused,
                Some(Error::Governor(GovernorError::BudgetExceeded(_)))
            ),
            "{refused:?}"
        );

        s.free(ptr::null_mut());
        let mut stranger = 0u8;
        s.free(ptr::from_mut(&mut stranger).cast());
        assert_eq!(s.stats().unknown_frees, 1);

        s.free(a);
        s.free(b);
        s.free(c);
        let stats = s.stats();
        assert_eq!(
            (stats.allocations, stats.frees, stats.live_bytes),
            (3, 3, 0)
        );
        assert_eq!(stats.peak_bytes, 1000 + PAD + 2 * (8000 + PAD));

        // Closed: nothing new is governed, the shell keeps no handle on the
        // context, its address map is given back, and the context can retire.
        assert!(lock(&s.entries).capacity() > 0);
        s.close();
        assert!(lock(&s.governed).is_none());
        assert_eq!(lock(&s.entries).capacity(), 0);
        let d = s.alloc(10);
        assert!(!d.is_null());
        assert_eq!(s.stats().overdrafts, 3);
        s.free(d);
        assert_eq!(lock(&s.entries).capacity(), 0, "given back once empty");
        assert_eq!(
            s.stats().allocated_bytes,
            1000 + 2 * 8000 + 10 + 4 * PAD,
            "every byte served is counted once, governed or not"
        );
        let report = ctx
            .retire()
            .wait(std::time::Instant::now() + std::time::Duration::from_secs(10))
            .unwrap();
        assert_eq!(report.retired_releases, 1);
        assert_eq!(ctx.snapshot().charged, 0);
    }
}
