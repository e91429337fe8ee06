//! The C ABI called from Rust: bad handles, double releases (also racing)
//! and calls after retire return error codes; a plugin's pressure callback
//! still running when it is removed keeps its remove waiting and the unload
//! gate closed until it returns.

use memgov_capi::*;
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;
use std::sync::{Arc, Barrier, Condvar, Mutex};

fn message() -> String {
    // SAFETY: never NULL, NUL-terminated, valid until the next call here.
    unsafe { CStr::from_ptr(memgov_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn ok(rc: i32) {
    assert_eq!(rc, MEMGOV_OK, "{}", message());
}

fn open(gov: *mut memgov_governor, budget: u64) -> *mut memgov_context {
    let opts = memgov_context_options {
        size: std::mem::size_of::<memgov_context_options>() as u32,
        backend: c"host".as_ptr(),
        label: c"rust".as_ptr(),
        budget,
        ..Default::default()
    };
    let mut ctx = null_mut();
    // SAFETY: valid pointers to a sized options struct and an out-pointer.
    ok(unsafe { memgov_context_open(gov, &opts, &mut ctx) });
    ctx
}

fn stream(ctx: *mut memgov_context) -> *mut memgov_stream {
    let mut s = null_mut();
    // SAFETY: a valid label and out-pointer.
    ok(unsafe { memgov_stream_create(ctx, c"s".as_ptr(), null_mut(), &mut s) });
    s
}

fn alloc(
    s: *mut memgov_stream,
    bytes: u64,
    plugin: *mut memgov_plugin,
) -> Result<*mut memgov_buffer, i32> {
    let mut b = null_mut();
    // SAFETY: a valid out-pointer.
    match unsafe { memgov_buffer_allocate(s, bytes, MEMGOV_ROLE_OTHER, plugin, &mut b) } {
        MEMGOV_OK => Ok(b),
        rc => Err(rc),
    }
}

#[test]
fn bad_handles_double_releases_and_calls_after_retire() {
    let mut gov = null_mut();
    // SAFETY: a valid out-pointer.
    ok(unsafe { memgov_governor_create(&mut gov) });
    let ctx = open(gov, MEMGOV_UNLIMITED);
    let s = stream(ctx);

    for bogus in [0usize, 1, 0xdead_beef, usize::MAX, s as usize, ctx as usize] {
        assert_eq!(
            memgov_buffer_release(bogus as *mut memgov_buffer),
            MEMGOV_ERR_INVALID_HANDLE
        );
        assert!(
            message().contains("expected a buffer handle"),
            "{}",
            message()
        );
    }
    assert_eq!(
        memgov_stream_synchronize(ctx as *mut memgov_stream),
        MEMGOV_ERR_INVALID_HANDLE
    );
    assert!(
        message().contains("names another kind of object"),
        "{}",
        message()
    );

    let b = alloc(s, 256, null_mut()).unwrap();
    ok(memgov_buffer_release(b));
    assert_eq!(memgov_buffer_release(b), MEMGOV_ERR_INVALID_HANDLE);
    assert!(message().contains("not live"), "{}", message());

    // A retiring context refuses new work; existing handles still release.
    let live = alloc(s, 256, null_mut()).unwrap();
    // SAFETY: `ctx` is live and a NULL report is allowed.
    let retired = unsafe { memgov_context_retire(ctx, 0, null_mut()) };
    assert_eq!(retired, MEMGOV_ERR_TIMEOUT);
    assert!(message().contains("live buffer"), "{}", message());
    assert_eq!(alloc(s, 256, null_mut()), Err(MEMGOV_ERR_RETIRING));
    ok(memgov_buffer_release(live));
    ok(memgov_stream_destroy(s));
    let mut report = memgov_teardown_report {
        size: std::mem::size_of::<memgov_teardown_report>() as u32,
        ..Default::default()
    };
    // SAFETY: a sized report with its size set.
    ok(unsafe { memgov_context_retire(ctx, 5000, &mut report) });
    assert_eq!(report.retired_releases, 2);
    assert_eq!(memgov_stream_destroy(s), MEMGOV_ERR_INVALID_HANDLE);
    let mut s2 = null_mut();
    // SAFETY: valid label and out-pointer.
    let rc = unsafe { memgov_stream_create(ctx, c"late".as_ptr(), null_mut(), &mut s2) };
    assert_eq!(rc, MEMGOV_ERR_RETIRING, "{}", message());
    ok(memgov_context_close(ctx));
    ok(memgov_governor_destroy(gov));
    assert_eq!(memgov_governor_destroy(gov), MEMGOV_ERR_INVALID_HANDLE);
}

#[test]
fn racing_releases_of_one_buffer_succeed_exactly_once() {
    let mut gov = null_mut();
    // SAFETY: a valid out-pointer.
    ok(unsafe { memgov_governor_create(&mut gov) });
    let ctx = open(gov, MEMGOV_UNLIMITED);
    let s = stream(ctx);
    for _ in 0..50 {
        let b = alloc(s, 64, null_mut()).unwrap() as usize;
        let barrier = Arc::new(Barrier::new(4));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    memgov_buffer_release(b as *mut memgov_buffer)
                })
            })
            .collect();
        let results: Vec<i32> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(
            results.iter().filter(|r| **r == MEMGOV_OK).count(),
            1,
            "{results:?}"
        );
        assert!(results
            .iter()
            .all(|r| *r == MEMGOV_OK || *r == MEMGOV_ERR_INVALID_HANDLE));
    }
    ok(memgov_stream_destroy(s));
    // SAFETY: a NULL report is allowed.
    ok(unsafe { memgov_context_retire(ctx, 5000, null_mut()) });
    ok(memgov_governor_destroy(gov));
}

/// Blocks in the callback until told to return.
struct Gate {
    state: Mutex<(bool, bool)>, // (entered, go)
    cv: Condvar,
}

unsafe extern "C" fn blocking_callback(
    _r: *const memgov_pressure_request,
    user: *mut c_void,
) -> u64 {
    // SAFETY: `user` is the `Gate` the test keeps alive until the callback
    // has returned.
    let gate = unsafe { &*(user as *const Gate) };
    let mut st = gate.state.lock().unwrap();
    st.0 = true;
    gate.cv.notify_all();
    while !st.1 {
        st = gate.cv.wait(st).unwrap();
    }
    0
}

#[test]
fn a_removed_callback_still_running_keeps_the_plugin_loaded() {
    let mut gov = null_mut();
    // SAFETY: a valid out-pointer.
    ok(unsafe { memgov_governor_create(&mut gov) });
    let ctx = open(gov, 4096);
    let s = stream(ctx);
    let held = alloc(s, 4096, null_mut()).unwrap();
    let mut plugin = null_mut();
    // SAFETY: valid name and out-pointer.
    ok(unsafe { memgov_plugin_register(c"callbacks".as_ptr(), &mut plugin) });
    let gate = Arc::new(Gate {
        state: Mutex::new((false, false)),
        cv: Condvar::new(),
    });
    let mut cb = null_mut();
    // SAFETY: the callback and its user data outlive every call.
    ok(unsafe {
        memgov_pressure_callback_add(
            ctx,
            plugin,
            Some(blocking_callback),
            Arc::as_ptr(&gate) as *mut c_void,
            &mut cb,
        )
    });
    let s_addr = s as usize;
    let allocating = std::thread::spawn(move || {
        alloc(s_addr as *mut memgov_stream, 4096, null_mut()).map(|b| b as usize)
    });
    {
        let mut st = gate.state.lock().unwrap();
        while !st.0 {
            st = gate.cv.wait(st).unwrap();
        }
    }
    // The callback is inside its code: removing it stops new calls and
    // waits for this one to return; until then the plugin may not be
    // unloaded.
    let cb_addr = cb as usize;
    let removing = std::thread::spawn(move || {
        memgov_pressure_callback_remove(cb_addr as *mut memgov_callback)
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(
        !removing.is_finished(),
        "remove returned while a call was in the callback"
    );
    let mut o = memgov_plugin_outstanding {
        size: std::mem::size_of::<memgov_plugin_outstanding>() as u32,
        ..Default::default()
    };
    // SAFETY: `plugin` is registered and `o` is a sized struct with its
    // size set, live for the call.
    let unregistered = unsafe { memgov_plugin_unregister(plugin, &mut o) };
    assert_eq!(unregistered, MEMGOV_ERR_BUSY);
    assert_eq!(o.callbacks, 1, "{o:?}");
    assert!(
        message().contains("1 pressure callback(s)"),
        "{}",
        message()
    );
    {
        let mut st = gate.state.lock().unwrap();
        st.1 = true;
        gate.cv.notify_all();
    }
    ok(removing.join().unwrap());
    assert_eq!(allocating.join().unwrap(), Err(MEMGOV_ERR_OUT_OF_MEMORY));
    // SAFETY: as above.
    ok(unsafe { memgov_plugin_unregister(plugin, &mut o) });
    assert_eq!(o.total(), 0);
    ok(memgov_buffer_release(held));
    ok(memgov_stream_destroy(s));
    // SAFETY: a NULL report is allowed.
    ok(unsafe { memgov_context_retire(ctx, 5000, null_mut()) });
    ok(memgov_governor_destroy(gov));
}

/// A callback that removes itself, says so, and then blocks in its code
/// until told to return.
struct SelfRemoving {
    callback: Mutex<usize>,
    removed: Mutex<Option<i32>>,
    gate: Gate,
}

unsafe extern "C" fn self_removing_callback(
    _r: *const memgov_pressure_request,
    user: *mut c_void,
) -> u64 {
    // SAFETY: `user` is the `SelfRemoving` the test keeps alive until the
    // callback has returned.
    let me = unsafe { &*(user as *const SelfRemoving) };
    let cb = *me.callback.lock().unwrap();
    *me.removed.lock().unwrap() = Some(memgov_pressure_callback_remove(cb as *mut memgov_callback));
    let mut st = me.gate.state.lock().unwrap();
    st.0 = true;
    me.gate.cv.notify_all();
    while !st.1 {
        st = me.gate.cv.wait(st).unwrap();
    }
    0
}

/// A pressure callback that removed itself is still running in the
/// plugin's code: every refusal of the unload gate (may_unload, unregister)
/// counts it in `callbacks` and names it, until it returns; then the gate
/// opens. The callback's progress is driven by the test (no timing).
#[test]
fn a_running_callback_that_removed_itself_is_counted_until_it_returns() {
    let mut gov = null_mut();
    // SAFETY: a valid out-pointer.
    ok(unsafe { memgov_governor_create(&mut gov) });
    let ctx = open(gov, 4096);
    let s = stream(ctx);
    let held = alloc(s, 4096, null_mut()).unwrap();
    let mut plugin = null_mut();
    // SAFETY: valid name and out-pointer.
    ok(unsafe { memgov_plugin_register(c"self-removing".as_ptr(), &mut plugin) });
    let me = Arc::new(SelfRemoving {
        callback: Mutex::new(0),
        removed: Mutex::new(None),
        gate: Gate {
            state: Mutex::new((false, false)),
            cv: Condvar::new(),
        },
    });
    let mut cb = null_mut();
    // SAFETY: the callback and its user data outlive every call.
    ok(unsafe {
        memgov_pressure_callback_add(
            ctx,
            plugin,
            Some(self_removing_callback),
            Arc::as_ptr(&me) as *mut c_void,
            &mut cb,
        )
    });
    *me.callback.lock().unwrap() = cb as usize;
    let s_addr = s as usize;
    let allocating = std::thread::spawn(move || {
        alloc(s_addr as *mut memgov_stream, 4096, null_mut()).map(|b| b as usize)
    });
    {
        let mut st = me.gate.state.lock().unwrap();
        while !st.0 {
            st = me.gate.cv.wait(st).unwrap();
        }
    }
    // Removed (its own call is not waited for), and still running.
    assert_eq!(*me.removed.lock().unwrap(), Some(MEMGOV_OK));
    let fresh = || memgov_plugin_outstanding {
        size: std::mem::size_of::<memgov_plugin_outstanding>() as u32,
        ..Default::default()
    };
    let mut o = fresh();
    // SAFETY: `plugin` is registered and `o` is a sized struct with its
    // size set, live for the call.
    let may_unload = unsafe { memgov_plugin_may_unload(plugin, &mut o) };
    assert_eq!(may_unload, MEMGOV_ERR_BUSY);
    assert_eq!((o.callbacks, o.total()), (1, 1), "{o:?}");
    let mut o = fresh();
    // SAFETY: as above.
    let unregistered = unsafe { memgov_plugin_unregister(plugin, &mut o) };
    assert_eq!(unregistered, MEMGOV_ERR_BUSY);
    assert_eq!((o.callbacks, o.total()), (1, 1), "{o:?}");
    assert!(
        message().contains("1 pressure callback(s)"),
        "{}",
        message()
    );
    {
        let mut st = me.gate.state.lock().unwrap();
        st.1 = true;
        me.gate.cv.notify_all();
    }
    assert_eq!(allocating.join().unwrap(), Err(MEMGOV_ERR_OUT_OF_MEMORY));
    let mut o = fresh();
    // SAFETY: as above.
    ok(unsafe { memgov_plugin_unregister(plugin, &mut o) });
    assert_eq!(o.total(), 0, "{o:?}");
    ok(memgov_buffer_release(held));
    ok(memgov_stream_destroy(s));
    // SAFETY: a NULL report is allowed.
    ok(unsafe { memgov_context_retire(ctx, 5000, null_mut()) });
    ok(memgov_governor_destroy(gov));
}
