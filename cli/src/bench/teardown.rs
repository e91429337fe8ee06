//! The teardown wake-up and drain, shared by `memgov bench` and the
//! criterion bench `benches/teardown.rs` (which includes this file).

use memgov::null::NullContext;
use memgov::{Alloc, ContextConfig, Governor, Role};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// One teardown wake-up: a thread waits in `RetireHandle::wait` for a
/// context whose last pending release is parked; the main thread fires it.
/// Returns the time from the firing to the wait returning (teardown
/// included).
pub fn wakeup_governed() -> Duration {
    teardown_after_parked(1, Duration::from_secs(30))
}

/// The baseline of [`wakeup_governed`]: a bare `Mutex<bool>` + `Condvar`
/// hand-off between two threads, set up and timed the same way.
pub fn wakeup_bare() -> Duration {
    let pair = (Mutex::new(false), Condvar::new());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            tx.send(()).expect("main waits");
            let mut g = pair.0.lock().expect("lock");
            while !*g {
                g = pair.1.wait(g).expect("wait");
            }
            Instant::now()
        });
        rx.recv().expect("waiter started");
        std::thread::sleep(Duration::from_millis(1));
        let t0 = Instant::now();
        *pair.0.lock().expect("lock") = true;
        pair.1.notify_all();
        waiter.join().expect("waiter").duration_since(t0)
    })
}

/// Drain `n` pending releases at teardown: a thread waits in
/// `RetireHandle::wait` while the device fires every parked signal; the time
/// from the first firing to the wait returning, in milliseconds.
pub fn drain_once(n: usize) -> f64 {
    teardown_after_parked(n, Duration::from_secs(600)).as_nanos() as f64 / 1e6
}

/// `n` releases parked in a null context that is retiring, a thread asleep
/// in `RetireHandle::wait` (at most `patience`); the time from firing the
/// first parked signal to the wait returning (teardown included).
fn teardown_after_parked(n: usize, patience: Duration) -> Duration {
    let gov = Governor::new();
    let null = NullContext::deferred(n);
    let parked = null.controls();
    let ctx = gov.register(null, ContextConfig::new());
    let stream = ctx.create_stream("s").expect("stream");
    for _ in 0..n {
        drop(
            ctx.allocate(&stream, Alloc::new(4096, Role::Activation))
                .expect("allocate"),
        );
    }
    drop(stream);
    let handle = ctx.retire();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            tx.send(()).expect("main waits");
            let r = handle.wait(Instant::now() + patience);
            let t = Instant::now();
            assert!(r.is_ok(), "teardown wait failed: {r:?}");
            t
        });
        rx.recv().expect("waiter started");
        std::thread::sleep(Duration::from_millis(1)); // let it fall asleep
        let t0 = Instant::now();
        assert_eq!(parked.retire_parked(), n);
        waiter.join().expect("waiter").duration_since(t0)
    })
}
