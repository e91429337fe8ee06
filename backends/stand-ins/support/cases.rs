//! The backend cases the CUDA and HIP suites share: one body each, run from
//! both suites under the same test name (each suite's `#[test]` calls the
//! case with its backend). What differs between the drivers (how a context
//! is opened, the stand-in's device identity, what a backend checks of an
//! allocation) is the [`StandInBackend`] a suite implements.
//!
//! Cases: [`free_retires_on_a_driver_thread`],
//! [`identity_is_the_drivers_uuid_and_pci_address`],
//! [`foreign_or_double_free_is_refused_and_counted`] (and, in `cache.rs`,
//! the block cache's).

use super::recorded::signal;
use memgov::{BackendProbe, DeviceContext, DeviceIdentity, Execution, RetireOutcome};
use std::time::Duration;

/// How long a case waits for a signal that must fire.
const SETTLE: Duration = Duration::from_secs(10);

/// A GPU backend whose suite runs these cases, on its stand-in or a real
/// device.
pub trait StandInBackend: DeviceContext + Sized {
    /// A context on device 0, or `None` after printing `skipped: <why>`
    /// (no driver, no device).
    fn open() -> Option<Self>;

    /// The context's probe.
    fn probe(&self) -> BackendProbe;

    /// Frees queued whose signal has not settled.
    fn pending_frees(&self) -> usize;

    /// The stand-in's device 0: the first bytes of its UUID and its PCI
    /// address.
    const STAND_IN_UUID_PREFIX: &'static [u8];
    /// See [`STAND_IN_UUID_PREFIX`](Self::STAND_IN_UUID_PREFIX).
    const STAND_IN_PCI: &'static str;
    /// The stand-in's device 0 by its whole key (`gpu-` and its UUID).
    const STAND_IN_KEY: &'static str;

    /// What the suite checks of a fresh allocation (which allocator made
    /// it); nothing by default.
    fn check_allocation(&self, _memory: &Self::Memory) {}
}

/// A stream-ordered free retires through the driver's completion callback
/// (CUDA's host function, HIP's stream callback), on a thread of the
/// driver's, not the caller's; `synchronize` returns after the signal
/// fired, and teardown is clean.
pub fn free_retires_on_a_driver_thread<B: StandInBackend>() {
    let Some(ctx) = B::open() else { return };
    let probe = ctx.probe();
    let s = ctx.create_stream().expect("stream");
    let m = ctx.allocate(&s, 1 << 20).expect("allocate");
    ctx.check_allocation(&m);
    ctx.write(&s, &m, 100, b"retire me").expect("write");
    let (sig, rx) = signal();
    ctx.free_async(&s, m, sig)
        .map_err(|(_, _, e)| e)
        .expect("free_async");
    ctx.synchronize(&s).expect("synchronize");
    let (outcome, thread) = rx.recv_timeout(SETTLE).expect("the signal fired");
    assert_eq!(outcome, RetireOutcome::Retired);
    assert_ne!(
        thread,
        std::thread::current().id(),
        "fired on the caller, not by the driver's callback"
    );
    assert_eq!(ctx.pending_frees(), 0);
    assert_eq!(probe.frees_retired(), 1);
    ctx.destroy_stream(s).expect("destroy_stream");
    ctx.teardown(false).expect("teardown");
    probe.check_clean_teardown().expect("clean teardown");
}

/// The device's identity is the driver's UUID (its key) and PCI address,
/// the stand-in's are the ones it documents, and a second context on the
/// same device names the same device. Prints `device identity: <key> (PCI
/// <address>)`, which CI looks for.
pub fn identity_is_the_drivers_uuid_and_pci_address<B: StandInBackend>() {
    let Some(ctx) = B::open() else { return };
    let id = ctx.identity();
    let uuid = id.uuid().expect("the driver reports a UUID");
    let pci = id
        .pci_bus_id()
        .expect("the driver reports a PCI address")
        .to_owned();
    assert_eq!(
        id.key(),
        DeviceIdentity::named("", "").with_uuid(uuid).key(),
        "{id}"
    );
    if ctx.describe().execution == Execution::StandIn {
        let prefix = B::STAND_IN_UUID_PREFIX;
        assert_eq!(&uuid[..prefix.len()], prefix);
        assert_eq!(uuid[15], 0, "device 0");
        assert_eq!(pci, B::STAND_IN_PCI);
        assert_eq!(id.key(), B::STAND_IN_KEY);
    }
    let again = B::open().expect("a second context");
    assert_eq!(again.identity(), id);
    println!("device identity: {id} (PCI {pci})");
    again.teardown(false).expect("teardown");
    ctx.teardown(false).expect("teardown");
}

/// Another context's memory is refused before the driver sees it
/// (`InvalidArgument`, "not live"), handed back with its signal, and not
/// counted as a violation (that is the caller's mistake, not a second free
/// of the context's own); its own context then frees it as usual.
pub fn foreign_or_double_free_is_refused_and_counted<B: StandInBackend>() {
    let Some(a) = B::open() else { return };
    let b = B::open().expect("a second context");
    let (sa, sb) = (
        a.create_stream().expect("stream"),
        b.create_stream().expect("stream"),
    );
    let m = a.allocate(&sa, 64).expect("allocate");
    let (sig, rx) = signal();
    let (m, sig, e) = b
        .free_async(&sb, m, sig)
        .expect_err("b does not own a's memory");
    assert_eq!(e.kind, memgov::BackendErrorKind::InvalidArgument, "{e}");
    assert!(e.message.contains("not live"), "{e}");
    assert_eq!(b.probe().violations(), 0);
    a.free_async(&sa, m, sig)
        .map_err(|(_, _, e)| e)
        .expect("free_async by its own context");
    assert_eq!(
        rx.recv_timeout(SETTLE).expect("the signal fired").0,
        RetireOutcome::Retired
    );
    a.destroy_stream(sa).expect("destroy_stream");
    b.destroy_stream(sb).expect("destroy_stream");
    a.teardown(false).expect("teardown");
    b.teardown(false).expect("teardown");
}
