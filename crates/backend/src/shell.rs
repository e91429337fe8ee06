//! The driver shell: what every backend over a C driver API (CUDA, HIP)
//! wraps around its driver calls, written once.
//!
//! * [`LostState`]: whether the context is lost, and the first reason it
//!   was;
//! * [`Shell`]: that flag, whether the driver itself reported the loss (a
//!   *dead* device: no call that could block is made on it any more), and
//!   whether the context is being torn down; [`Shell::check_usable`] refuses
//!   work on such a context without a driver call, and [`Shell::checked`]
//!   turns a driver result into `Ok` or the backend's classified error,
//!   marking the context lost and dead on a sticky code and reporting the
//!   loss to the probe exactly once;
//! * [`MakeCurrent`] and [`Current`]: make the context (or device) current
//!   on the calling thread for the length of one call, and put back what the
//!   thread had before when the guard drops, on every path.
//!
//! A backend supplies the one thing that differs, how its result codes map
//! to errors, by implementing [`Driver`] (its `result.rs`), and implements
//! [`MakeCurrent`] with its driver's get/set calls.

use crate::{BackendError, BackendErrorKind, BackendProbe};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Whether a GPU backend's context is lost, and the first reason it was.
///
/// Every call on a lost context is refused with that reason instead of going
/// to the driver; the flag is set once, so the caller learns which call made
/// the context lost (and reports it to the probe exactly once).
#[derive(Debug, Default)]
pub struct LostState {
    lost: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl LostState {
    /// Whether the context has been marked lost.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// The flag itself, for waits that end when the context is lost.
    pub fn flag(&self) -> &AtomicBool {
        &self.lost
    }

    /// Mark the context lost, keeping `why` if it is the first reason given.
    /// Returns `true` for the call that made the context lost. The reason is
    /// stored before the flag is set, so whoever sees the flag finds it.
    pub fn mark(&self, why: Option<&str>) -> bool {
        if let Some(why) = why {
            memgov_sync::lock(&self.reason).get_or_insert_with(|| why.to_owned());
        }
        !self.lost.swap(true, Ordering::AcqRel)
    }

    /// The first reason given, else `otherwise`.
    pub fn reason_or(&self, otherwise: &str) -> String {
        memgov_sync::lock(&self.reason)
            .clone()
            .unwrap_or_else(|| otherwise.to_owned())
    }
}

/// How a backend's driver reports results: the one part of the shell that
/// differs between drivers. Implemented (on a marker type) by the backend's
/// `result.rs`, which is where its codes are classified and nowhere else.
pub trait Driver {
    /// The backend's name in errors (`"cuda"`).
    const BACKEND: &'static str;

    /// What a driver call returns (`CUresult`, `hipError_t`).
    type Code: Copy;

    /// `Ok(())` for success, else the error for operation `op` from driver
    /// call `call` returning `code`: its kind (a sticky code is
    /// [`BackendErrorKind::DeviceLost`]), the code, its name and the way out.
    fn check(op: &'static str, call: &str, code: Self::Code) -> Result<(), BackendError>;
}

/// The lost, dead and closing state of one context, shared by its threads,
/// and the checked driver call that keeps it.
///
/// Never calls the driver itself; holds no lock across anything but its own
/// bookkeeping.
pub struct Shell<D: Driver> {
    /// How the device is named in errors (`"CUDA device 0"`).
    device: String,
    probe: BackendProbe,
    lost: LostState,
    /// A driver call returned a sticky code: nothing queued executes any
    /// more, and no call that could block is made.
    dead: AtomicBool,
    /// Teardown has begun: no new work is accepted.
    closing: AtomicBool,
    _driver: PhantomData<fn() -> D>,
}

impl<D: Driver> std::fmt::Debug for Shell<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shell")
            .field("backend", &D::BACKEND)
            .field("device", &self.device)
            .field("lost", &self.is_lost())
            .field("dead", &self.is_dead())
            .field("closing", &self.is_closing())
            .finish()
    }
}

impl<D: Driver> Shell<D> {
    /// The shell of a context on `device` (named so in errors, e.g. `"CUDA
    /// device 0"`), reporting to `probe`.
    pub fn new(device: impl Into<String>, probe: BackendProbe) -> Self {
        Self {
            device: device.into(),
            probe,
            lost: LostState::default(),
            dead: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            _driver: PhantomData,
        }
    }

    /// The probe the shell reports the loss to.
    pub fn probe(&self) -> &BackendProbe {
        &self.probe
    }

    /// The lost flag and its first reason.
    pub fn lost(&self) -> &LostState {
        &self.lost
    }

    /// Whether the context is lost (declared, or reported by the driver).
    pub fn is_lost(&self) -> bool {
        self.lost.is_lost()
    }

    /// Whether the driver itself returned a sticky code.
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Whether teardown has begun.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Mark the context lost, keeping `why` if it is the first reason given;
    /// the probe hears of it once. Returns `true` for the call that made the
    /// context lost.
    pub fn mark_lost(&self, why: Option<&str>) -> bool {
        let first = self.lost.mark(why);
        if first {
            self.probe.device_lost();
        }
        first
    }

    /// The driver returned a sticky code: lost (with `why`) and dead. The
    /// flag is set before the context is marked lost, so whoever sees it
    /// lost because of the driver also sees it dead. Returns `true` for the
    /// call that made the context lost.
    pub fn mark_dead(&self, why: &str) -> bool {
        self.dead.store(true, Ordering::Release);
        self.mark_lost(Some(why))
    }

    /// Teardown has begun. Returns `true` for the first call.
    pub fn close(&self) -> bool {
        !self.closing.swap(true, Ordering::AcqRel)
    }

    /// `DeviceLost` (with the first reason) if the context is lost, with no
    /// driver call.
    pub fn check_lost(&self, op: &'static str) -> Result<(), BackendError> {
        if !self.is_lost() {
            return Ok(());
        }
        let why = self.lost.reason_or("declared lost by the governor");
        Err(BackendError::new(
            D::BACKEND,
            op,
            BackendErrorKind::DeviceLost,
            format!(
                "{} is lost ({why}); no further call is made on it: retire this context and \
                 create a new one",
                self.device
            ),
        ))
    }

    /// Refuse work on a lost context (`DeviceLost`, with the first reason)
    /// or one being torn down (`InvalidArgument`), with no driver call.
    pub fn check_usable(&self, op: &'static str) -> Result<(), BackendError> {
        self.check_lost(op)?;
        if self.is_closing() {
            return Err(BackendError::new(
                D::BACKEND,
                op,
                BackendErrorKind::InvalidArgument,
                format!(
                    "the context on {} is being torn down; no new work is accepted: make the \
                     call before teardown, or on a new context",
                    self.device
                ),
            ));
        }
        Ok(())
    }

    /// `Ok` when `code` is success; else the driver's classified error. A
    /// sticky code (a [`BackendErrorKind::DeviceLost`] error) marks the
    /// context lost and dead first, with the error's message as the reason.
    pub fn checked(&self, op: &'static str, call: &str, code: D::Code) -> Result<(), BackendError> {
        D::check(op, call, code).inspect_err(|e| {
            if e.is_device_lost() {
                self.mark_dead(&e.message);
            }
        })
    }
}

/// Making a context (or device) current on the calling thread: the get and
/// set calls of a driver that keeps a current context per host thread.
///
/// [`make_current`] reads what the thread has, changes it only if it is not
/// this context's already, and returns a [`Current`] guard that puts the
/// thread's own back when dropped: a runtime's choice on its threads is
/// never replaced behind its back, and no thread is left with memgov's
/// context current after memgov returns.
pub trait MakeCurrent {
    /// A context or device as the driver names it.
    type Handle: Copy + PartialEq;

    /// This context's (or device's) handle.
    fn ours(&self) -> Self::Handle;

    /// What is current on the calling thread.
    fn current(&self, op: &'static str) -> Result<Self::Handle, BackendError>;

    /// Make `ours` current on the calling thread (a push, or a set).
    fn enter(&self, op: &'static str, ours: Self::Handle) -> Result<(), BackendError>;

    /// Undo a successful [`enter`](Self::enter) on the same thread: what was
    /// current before it, `previous`, is current again (a pop, or a set).
    /// There is no caller to report a failure to; the implementation keeps
    /// it where it keeps such things.
    fn leave(&self, previous: Self::Handle);
}

/// Make `owner`'s context current on the calling thread until the returned
/// guard drops (see [`MakeCurrent`]). Nothing is changed, and nothing
/// restored, when it is current already.
pub fn make_current<'a, M: MakeCurrent>(
    owner: &'a M,
    op: &'static str,
) -> Result<Current<'a, M>, BackendError> {
    let previous = owner.current(op)?;
    let ours = owner.ours();
    if previous == ours {
        return Ok(Current {
            owner,
            restore: None,
            _thread: PhantomData,
        });
    }
    owner.enter(op, ours)?;
    Ok(Current {
        owner,
        restore: Some(previous),
        _thread: PhantomData,
    })
}

/// The calling thread's previous context, current again when this drops:
/// returned by [`make_current`].
#[must_use = "the context stays current only while the guard lives"]
pub struct Current<'a, M: MakeCurrent> {
    owner: &'a M,
    /// What the thread had before, when [`make_current`] changed it.
    restore: Option<M::Handle>,
    /// Not `Send`: what was entered on a thread is left on that thread.
    _thread: PhantomData<*const ()>,
}

impl<M: MakeCurrent> Current<'_, M> {
    /// Whether the guard changed the thread's current context (and so puts
    /// the previous one back).
    pub fn changed(&self) -> bool {
        self.restore.is_some()
    }
}

impl<M: MakeCurrent> Drop for Current<'_, M> {
    fn drop(&mut self) {
        if let Some(previous) = self.restore.take() {
            self.owner.leave(previous);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};

    struct Fake;

    impl Driver for Fake {
        const BACKEND: &'static str = "fake";
        type Code = i32;
        fn check(op: &'static str, call: &str, code: i32) -> Result<(), BackendError> {
            let kind = match code {
                0 => return Ok(()),
                2 => BackendErrorKind::OutOfMemory,
                700 => BackendErrorKind::DeviceLost,
                _ => BackendErrorKind::Other,
            };
            Err(BackendError::from_driver_call(
                "fake",
                op,
                kind,
                call,
                "FAKE",
                i64::from(code),
                "",
            ))
        }
    }

    fn shell() -> Shell<Fake> {
        Shell::new("fake device 3", BackendProbe::new())
    }

    #[test]
    fn a_sticky_code_marks_lost_and_dead_and_reports_once() {
        let s = shell();
        assert_eq!(s.checked("allocate", "fakeAlloc", 0), Ok(()));
        let oom = s.checked("allocate", "fakeAlloc", 2).unwrap_err();
        assert_eq!(oom.kind, BackendErrorKind::OutOfMemory);
        assert!(!s.is_lost() && !s.is_dead());
        assert!(!s.probe().lost());

        let e = s.checked("free_async", "fakeFree", 700).unwrap_err();
        assert!(e.is_device_lost());
        assert!(s.is_lost() && s.is_dead());
        assert!(s.probe().lost());
        // A second sticky code keeps the first reason.
        let _ = s.checked("write", "fakeCopy", 700);
        let refused = s.check_usable("read").unwrap_err();
        assert_eq!(refused.kind, BackendErrorKind::DeviceLost);
        assert!(
            refused.message.contains("fakeFree returned FAKE (700)"),
            "{refused}"
        );
        assert!(refused.message.contains("fake device 3"), "{refused}");
        assert!(!refused.message.contains("fakeCopy"), "{refused}");
    }

    #[test]
    fn declared_loss_is_not_dead_and_reports_once() {
        let s = shell();
        assert!(s.mark_lost(None));
        assert!(!s.mark_lost(Some("later")));
        assert!(s.is_lost() && !s.is_dead());
        let e = s.check_usable("allocate").unwrap_err();
        assert_eq!(e.kind, BackendErrorKind::DeviceLost);
        // The first call gave no reason; a later one did.
        assert!(e.message.contains("(later)"), "{e}");
    }

    #[test]
    fn a_closing_context_refuses_work_but_is_not_lost() {
        let s = shell();
        assert_eq!(s.check_usable("allocate"), Ok(()));
        assert!(s.close());
        assert!(!s.close());
        let e = s.check_usable("allocate").unwrap_err();
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
        assert!(e.message.contains("torn down"), "{e}");
        assert_eq!(s.check_lost("allocate"), Ok(()));
    }

    /// A thread's current context as a driver keeps it, with every call
    /// recorded.
    struct Thread {
        ours: u32,
        current: Cell<u32>,
        fail_enter: bool,
        calls: RefCell<Vec<String>>,
    }

    impl MakeCurrent for Thread {
        type Handle = u32;
        fn ours(&self) -> u32 {
            self.ours
        }
        fn current(&self, _op: &'static str) -> Result<u32, BackendError> {
            self.calls.borrow_mut().push("get".into());
            Ok(self.current.get())
        }
        fn enter(&self, op: &'static str, ours: u32) -> Result<(), BackendError> {
            self.calls.borrow_mut().push(format!("enter {ours}"));
            if self.fail_enter {
                return Fake::check(op, "fakeSet", 1);
            }
            self.current.set(ours);
            Ok(())
        }
        fn leave(&self, previous: u32) {
            self.calls.borrow_mut().push(format!("leave {previous}"));
            self.current.set(previous);
        }
    }

    fn thread(ours: u32, current: u32, fail_enter: bool) -> Thread {
        Thread {
            ours,
            current: Cell::new(current),
            fail_enter,
            calls: RefCell::default(),
        }
    }

    #[test]
    fn the_guard_restores_what_the_thread_had() {
        let t = thread(1, 7, false);
        {
            let g = make_current(&t, "write").unwrap();
            assert!(g.changed());
            assert_eq!(t.current.get(), 1);
        }
        assert_eq!(t.current.get(), 7);
        assert_eq!(*t.calls.borrow(), ["get", "enter 1", "leave 7"]);
    }

    #[test]
    fn nothing_changes_when_the_context_is_current_already() {
        let t = thread(1, 1, false);
        drop(make_current(&t, "write").unwrap());
        assert_eq!(t.current.get(), 1);
        assert_eq!(*t.calls.borrow(), ["get"]);
    }

    #[test]
    fn a_failed_enter_restores_nothing() {
        let t = thread(1, 7, true);
        let e = make_current(&t, "write").err().unwrap();
        assert_eq!(e.operation, "write");
        assert_eq!(t.current.get(), 7);
        assert_eq!(*t.calls.borrow(), ["get", "enter 1"]);
    }
}
