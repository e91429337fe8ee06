//! A third vendor plugged into the core with its tables alone: a toy driver
//! whose calls are logged and whose results a test scripts. It checks the
//! core's own logic against what the tables promise (the granule's undo,
//! the reservation's checks, the lost-teardown drain, a stream ordered
//! after another, a retired stream reaped, teardown's stream steps, the
//! context's own pool), with no stand-in.

use memgov_backend::capability::CaptureMode;
use memgov_backend::shell::MakeCurrent;
use memgov_backend::vmm::{self, ArenaConfig, Gate, GranuleDriver, Slot};
use memgov_backend::{
    BackendError, BackendErrorKind, BackendProbe, DeviceIdentity, RetireOutcome, RetireSignal,
    Tickets,
};
use memgov_stream_ordered::open::{
    self, OpenNames, OpenTable, Opened, NAME_BYTES, PCI_BUS_ID_BYTES,
};
use memgov_stream_ordered::retire::{self, Queued, RetireTable, Settle};
use memgov_stream_ordered::state::{Device, State, Stream, STAND_IN_NAME};
use memgov_stream_ordered::stream::{self, StreamContext};
use memgov_stream_ordered::table::{
    CaptureNames, CaptureTable, Context, StreamNames, StreamTable, VmmNames, VmmTable,
};
use memgov_stream_ordered::{arena, teardown, Class, Hints, Vendor};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_char;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

const OK: i32 = 0;
const NOT_READY: i32 = 1;
const REFUSED: i32 = 2;
const LOST: i32 = 3;
const UNAVAILABLE: i32 = 4;
const UNSUPPORTED: i32 = 5;

thread_local! {
    /// Calls made on this test's thread, in order.
    static LOG: RefCell<Vec<&'static str>> = const { RefCell::new(Vec::new()) };
    /// Results a call returns instead of success, by name.
    static SCRIPT: RefCell<HashMap<&'static str, i32>> = RefCell::new(HashMap::new());
    /// Tickets whose callback `toyLaunchCallback` queued, in order.
    static CALLBACKS: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// How many devices `toyGetDeviceCount` reports.
    static DEVICES: RefCell<i32> = const { RefCell::new(1) };
    /// What `toyMemGetGranularity` answers.
    static GRANULE: RefCell<usize> = const { RefCell::new(4096) };
}

fn call(name: &'static str) -> i32 {
    LOG.with(|l| l.borrow_mut().push(name));
    SCRIPT.with(|s| s.borrow().get(name).copied().unwrap_or(OK))
}

fn script(name: &'static str, code: i32) {
    SCRIPT.with(|s| s.borrow_mut().insert(name, code));
}

fn log() -> Vec<&'static str> {
    LOG.with(|l| l.borrow().clone())
}

struct Toy;

impl Vendor for Toy {
    const BACKEND: &'static str = "toy";
    const NAME: &'static str = "Toy";
    const DRIVER: &'static str = "toy driver";
    type Code = i32;
    const SUCCESS: i32 = OK;
    const HINTS: Hints = Hints {
        device_lost: "; restart the toy",
        unavailable: "; plug the toy in",
    };

    fn classify(code: i32) -> Class {
        match code {
            OK => Class::Success,
            NOT_READY => Class::NotReady,
            LOST => Class::DeviceLost,
            UNAVAILABLE => Class::Unavailable,
            UNSUPPORTED => Class::NotSupported,
            _ => Class::Other,
        }
    }

    fn name(code: i32) -> String {
        format!("TOY_{code}")
    }

    fn number(code: i32) -> i64 {
        i64::from(code)
    }
}

impl VmmTable for Toy {
    type Handle = u64;
    type Stream = u64;
    type Prop = ();

    const NAMES: VmmNames = VmmNames {
        arena: "ToyArena",
        mem_granularity: "toyMemGetGranularity",
        mem_address_reserve: "toyMemAddressReserve",
        mem_address_free: "toyMemAddressFree",
        mem_get_info: "toyMemGetInfo",
        stream_query: "toyStreamQuery",
        mem_create: "toyMemCreate",
        mem_map: "toyMemMap",
        mem_set_access: "toyMemSetAccess",
        mem_unmap: "toyMemUnmap",
        mem_release: "toyMemRelease",
        host_alloc: "toyHostAlloc",
        host_free: "toyHostFree",
        stream_create: "toyStreamCreate",
        stream_sync: "toyStreamSynchronize",
        copy_dtoh_async: "toyMemcpyDtoHAsync",
        copy_htod_async: "toyMemcpyHtoDAsync",
    };

    unsafe fn mem_granularity(_: &()) -> (i32, usize) {
        (call("toyMemGetGranularity"), GRANULE.with(|g| *g.borrow()))
    }
    unsafe fn mem_address_reserve(_: usize, _: usize) -> (i32, u64) {
        (call("toyMemAddressReserve"), 0x10_0000)
    }
    unsafe fn mem_address_free(_: u64, _: usize) -> i32 {
        call("toyMemAddressFree")
    }
    unsafe fn mem_get_info() -> (i32, usize, usize) {
        (call("toyMemGetInfo"), 1 << 29, 1 << 30)
    }
    unsafe fn stream_query(_: u64) -> i32 {
        call("toyStreamQuery")
    }
    unsafe fn mem_create(_: usize, _: &()) -> (i32, u64) {
        (call("toyMemCreate"), 7)
    }
    unsafe fn mem_map(_: u64, _: usize, _: u64) -> i32 {
        call("toyMemMap")
    }
    unsafe fn mem_set_access(_: u64, _: usize, _: &()) -> i32 {
        call("toyMemSetAccess")
    }
    unsafe fn mem_unmap(_: u64, _: usize) -> i32 {
        call("toyMemUnmap")
    }
    unsafe fn mem_release(_: u64) -> i32 {
        call("toyMemRelease")
    }
    unsafe fn host_alloc(_: usize) -> (i32, usize) {
        (call("toyHostAlloc"), 0)
    }
    unsafe fn host_free(_: usize) -> i32 {
        call("toyHostFree")
    }
    unsafe fn stream_create() -> (i32, u64) {
        (call("toyStreamCreate"), 1)
    }
    unsafe fn stream_sync(_: u64) -> i32 {
        call("toyStreamSynchronize")
    }
    unsafe fn stream_destroy(_: u64) -> i32 {
        call("toyStreamDestroy")
    }
    unsafe fn copy_dtoh_async(_: usize, _: u64, _: usize, _: u64) -> i32 {
        call("toyMemcpyDtoHAsync")
    }
    unsafe fn copy_htod_async(_: u64, _: usize, _: usize, _: u64) -> i32 {
        call("toyMemcpyHtoDAsync")
    }
}

impl CaptureTable for Toy {
    type Graph = u64;
    type Exec = u64;

    const CAPTURE_NAMES: CaptureNames = CaptureNames {
        begin_capture: "toyBeginCapture",
        capture_id: "toyCaptureId",
        end_capture: "toyEndCapture",
        instantiate: "toyInstantiate",
        exec_destroy: "toyExecDestroy",
        graph_destroy: "toyGraphDestroy",
        launch: "toyLaunch",
        capture: "ToyCapture",
        graph: "ToyGraph",
        arena_setting: "ToyConfig::arena",
    };

    type DevicePtr = u64;
    const READS_GRAPH_NODES: bool = false;

    unsafe fn graph_memory<C: Context<Table = Self>>(_: &C, _: u64) -> Result<u64, BackendError> {
        Ok(0)
    }

    unsafe fn begin_capture(_: u64, _: CaptureMode) -> i32 {
        call("toyBeginCapture")
    }
    unsafe fn capture_id(_: u64) -> (i32, u64) {
        (call("toyCaptureId"), 1)
    }
    unsafe fn end_capture(_: u64) -> (i32, Option<u64>) {
        (call("toyEndCapture"), Some(1))
    }
    unsafe fn still_capturing(_: u64) -> bool {
        false
    }
    unsafe fn instantiate(_: u64) -> (i32, u64) {
        (call("toyInstantiate"), 1)
    }
    unsafe fn exec_destroy(_: u64) -> i32 {
        call("toyExecDestroy")
    }
    unsafe fn graph_destroy(_: u64) -> i32 {
        call("toyGraphDestroy")
    }
    unsafe fn launch(_: u64, _: u64) -> i32 {
        call("toyLaunch")
    }
    fn stream_key(stream: u64) -> usize {
        stream as usize
    }
}

impl RetireTable for Toy {
    const LAUNCH_CALLBACK: &'static str = "toyLaunchCallback";

    unsafe fn launch_callback(_: u64, ticket: u64) -> i32 {
        let r = call("toyLaunchCallback");
        if r == OK {
            CALLBACKS.with(|c| c.borrow_mut().push(ticket));
        }
        r
    }
}

/// The toy's context: always current, never lost.
struct ToyContext {
    state: State<Toy, u64>,
}

/// The toy's device (a stand-in by its name).
fn toy_device() -> Device {
    let name = format!("{STAND_IN_NAME} toy");
    let identity = DeviceIdentity::named("toy", &name);
    Device::new(0, name, identity, 1 << 30, "toy driver 1.0".into())
}

impl Default for ToyContext {
    fn default() -> Self {
        Self {
            state: State::new(toy_device(), Vec::new()),
        }
    }
}

/// The core's arena: the toy queues no releases and keeps nothing beside.
type ToyArena = arena::Arena<ToyContext, ()>;

impl MakeCurrent for ToyContext {
    type Handle = u8;
    fn ours(&self) -> u8 {
        1
    }
    fn current(&self, _: &'static str) -> Result<u8, BackendError> {
        Ok(1)
    }
    fn enter(&self, _: &'static str, _: u8) -> Result<(), BackendError> {
        Ok(())
    }
    fn leave(&self, _: u8) {}
}

impl Context for ToyContext {
    type Table = Toy;
    type Stream = u64;
    type Arena = ToyArena;

    fn checked(&self, op: &'static str, call: &str, code: i32) -> Result<(), BackendError> {
        memgov_stream_ordered::result::check::<Toy>(op, call, code)
    }
    fn capture_gate(&self) -> &'static Gate {
        static GATE: OnceLock<Gate> = OnceLock::new();
        GATE.get_or_init(|| Gate::new("toy", "ToyCapture"))
    }
    fn quiesce(&self, op: &'static str) -> Result<(), BackendError> {
        arena::drain(self, &[1], op, None, Duration::ZERO)
    }
    fn granule_prop(_: &ToyArena) {}
    fn state(&self) -> &State<Toy, u64> {
        &self.state
    }
    fn raw_stream(&self, _: &'static str, stream: &u64) -> Result<u64, BackendError> {
        Ok(*stream)
    }
    fn wait_launches(&self, op: &'static str) -> Result<(), BackendError> {
        self.quiesce(op)
    }
}

fn toy_arena(s: &ToyContext) -> ToyArena {
    let config = ArenaConfig {
        reserve_bytes: 1 << 20,
        limit_bytes: 1 << 20,
    };
    ToyArena::reserve(s, &config, (0, &()), BackendProbe::new(), ()).expect("reserve")
}

#[test]
fn the_cores_arena_maps_on_allocation_and_gives_everything_back_at_teardown() {
    let s = ToyContext::default();
    let a = toy_arena(&s);
    assert_eq!(log(), ["toyMemGetGranularity", "toyMemAddressReserve"]);
    assert_eq!(a.allocate(&s, 100).expect("allocate"), 0x10_0000);
    a.teardown(&s).expect("teardown");
    let calls: Vec<_> = log().into_iter().skip(2).collect();
    assert_eq!(
        calls,
        [
            "toyMemCreate",
            "toyMemMap",
            "toyMemSetAccess",
            "toyMemUnmap",
            "toyMemRelease",
            "toyMemAddressFree"
        ]
    );
}

#[test]
fn a_granule_whose_access_and_unmap_are_refused_is_quarantined_mapped_naming_both() {
    let s = ToyContext::default();
    let a = toy_arena(&s);
    script("toyMemSetAccess", REFUSED);
    script("toyMemUnmap", REFUSED);
    let d = arena::driver(&s, &a);
    let (e, slot) = d.map(0, "allocate").expect_err("set access refused");
    assert!(
        matches!(
            slot,
            Some(Slot::Quarantined {
                handle: Some(7),
                mapped: true
            })
        ),
        "{slot:?}"
    );
    assert!(
        e.message.contains("toyMemSetAccess returned TOY_2 (2)"),
        "{e}"
    );
    assert!(e.message.contains("its mapping at 0x100000 stays"), "{e}");
    assert!(e.message.contains("toyMemUnmap returned TOY_2"), "{e}");
    assert!(e.message.ends_with("(quarantined)"), "{e}");
    // Created, mapped, refused access, refused unmap; never released (the
    // handle is still mapped).
    let calls: Vec<_> = log().into_iter().skip(2).collect();
    assert_eq!(
        calls,
        [
            "toyMemCreate",
            "toyMemMap",
            "toyMemSetAccess",
            "toyMemUnmap"
        ]
    );
}

#[test]
fn a_granule_whose_map_is_refused_is_released_and_nothing_is_left() {
    let s = ToyContext::default();
    let a = toy_arena(&s);
    script("toyMemMap", REFUSED);
    let (e, slot) = arena::driver(&s, &a)
        .map(1, "allocate")
        .expect_err("map refused");
    assert!(slot.is_none(), "{slot:?}");
    assert!(e.message.contains("toyMemMap returned TOY_2"), "{e}");
    assert!(!e.message.contains("quarantined"), "{e}");
    let calls: Vec<_> = log().into_iter().skip(2).collect();
    assert_eq!(calls, ["toyMemCreate", "toyMemMap", "toyMemRelease"]);
}

#[test]
fn a_granularity_that_is_not_a_power_of_two_is_refused_before_reserving() {
    let s = ToyContext::default();
    GRANULE.with(|g| *g.borrow_mut() = 3000);
    let e = arena::reserve(&s, &ArenaConfig::default(), &())
        .err()
        .expect("refused");
    assert_eq!(e.kind, BackendErrorKind::Other);
    assert!(
        e.message
            .contains("the toy driver reports an allocation granularity of 3000 B"),
        "{e}"
    );
    assert_eq!(log(), ["toyMemGetGranularity"]);
}

#[test]
fn a_lost_teardowns_drain_refuses_as_device_lost_once_its_deadline_passed() {
    let s = ToyContext::default();
    script("toyStreamQuery", NOT_READY);
    // A deadline of zero: the first answer "not ready" is already past it.
    let e = arena::drain(
        &s,
        &[1, 2],
        "teardown",
        Some(Duration::ZERO),
        Duration::ZERO,
    )
    .expect_err("still running");
    assert!(e.is_device_lost(), "{e}");
    assert!(
        e.message.contains("still queued 0 s into a lost teardown"),
        "{e}"
    );
    assert!(e.message.contains("stays mapped"), "{e}");
    // The first stream was asked once; the second never.
    assert_eq!(log(), ["toyStreamQuery"]);
    // Without a deadline each stream is synchronized, in order.
    LOG.with(|l| l.borrow_mut().clear());
    arena::drain(&s, &[1, 2], "teardown", None, Duration::ZERO).expect("drained");
    assert_eq!(log(), ["toyStreamSynchronize", "toyStreamSynchronize"]);
}

// Streams: the toy's event calls, and a context that keeps its streams in
// the core's registry.

impl StreamTable for Toy {
    type Event = u64;
    const STREAM_NAMES: StreamNames = StreamNames {
        stream_destroy: "toyStreamDestroy",
        event_create: "toyEventCreate",
        event_record: "toyEventRecord",
        stream_wait_event: "toyStreamWaitEvent",
        event_destroy: "toyEventDestroy",
    };
    const STREAM_CALLS_NEED_CURRENT: bool = false;
    /// The toy's calls may block after a sticky code (as HIP's).
    const CALLS_AFTER_STICKY: bool = false;
    const POLL_INTERVAL: Duration = Duration::ZERO;

    unsafe fn event_create() -> (i32, u64) {
        (call("toyEventCreate"), 9)
    }
    unsafe fn event_record(_: u64, _: u64) -> i32 {
        call("toyEventRecord")
    }
    unsafe fn stream_wait_event(_: u64, _: u64) -> i32 {
        call("toyStreamWaitEvent")
    }
    unsafe fn event_destroy(_: u64) -> i32 {
        call("toyEventDestroy")
    }
}

/// What [`ToyStreams`] takes for a sticky code.
const STICKY: i32 = 3;

memgov_stream_ordered::handle! {
    /// A public stream of the toy: the core's stream.
    pub struct ToyStream(Stream<u64>);
}

/// A toy context that keeps its streams in the core's registry.
struct ToyStreams {
    state: State<Toy, u64>,
}

impl ToyStreams {
    /// A toy context that hands out `adopted` before it creates streams.
    fn lending(adopted: Vec<u64>) -> Self {
        Self {
            state: State::new(toy_device(), adopted),
        }
    }
}

impl Default for ToyStreams {
    fn default() -> Self {
        Self::lending(Vec::new())
    }
}

impl MakeCurrent for ToyStreams {
    type Handle = u8;
    fn ours(&self) -> u8 {
        1
    }
    fn current(&self, _: &'static str) -> Result<u8, BackendError> {
        Ok(1)
    }
    fn enter(&self, _: &'static str, _: u8) -> Result<(), BackendError> {
        Ok(())
    }
    fn leave(&self, _: u8) {}
}

impl Context for ToyStreams {
    type Table = Toy;
    type Stream = ToyStream;
    type Arena = ToyArena;

    /// [`STICKY`] marks the context dead, as a sticky code does.
    fn checked(&self, op: &'static str, call: &str, code: i32) -> Result<(), BackendError> {
        if code == STICKY {
            self.shell().mark_dead("a sticky code");
        }
        memgov_stream_ordered::result::check::<Toy>(op, call, code)
    }
    fn capture_gate(&self) -> &'static Gate {
        static GATE: OnceLock<Gate> = OnceLock::new();
        GATE.get_or_init(|| Gate::new("toy", "ToyCapture"))
    }
    fn quiesce(&self, op: &'static str) -> Result<(), BackendError> {
        stream::quiesce(self, op, None)
    }
    fn granule_prop(_: &ToyArena) {}
    fn state(&self) -> &State<Toy, u64> {
        &self.state
    }
    fn raw_stream(&self, op: &'static str, s: &ToyStream) -> Result<u64, BackendError> {
        stream::check(self, op, s)
    }
    fn wait_launches(&self, op: &'static str) -> Result<(), BackendError> {
        self.quiesce(op)
    }
}

impl StreamContext for ToyStreams {
    fn wrap(stream: Stream<u64>) -> ToyStream {
        ToyStream(stream)
    }
}

fn clear_log() {
    LOG.with(|l| l.borrow_mut().clear());
}

#[test]
fn order_after_records_waits_and_destroys_one_event_and_refuses_foreign_streams() {
    let s = ToyStreams::default();
    let a = stream::create(&s).expect("a");
    let b = stream::create(&s).expect("b");
    assert_eq!(s.shell().probe().live_streams(), 2);
    clear_log();
    stream::order_after(&s, &a, &b).expect("ordered");
    assert_eq!(
        log(),
        [
            "toyEventCreate",
            "toyEventRecord",
            "toyStreamWaitEvent",
            "toyEventDestroy"
        ]
    );
    // A stream is ordered after its own work already: no call.
    clear_log();
    stream::order_after(&s, &a, &a).expect("self");
    assert!(log().is_empty(), "{:?}", log());
    // Another context's stream, and one never created here: refused
    // before any call, naming the stream and the context.
    let other = ToyStreams::default();
    let foreign = stream::create(&other).expect("foreign");
    clear_log();
    let e = stream::order_after(&s, &a, &foreign).expect_err("foreign");
    assert_eq!(e.kind, BackendErrorKind::InvalidArgument, "{e}");
    let (ours, theirs) = (s.context_id(), other.context_id());
    assert_ne!(ours, theirs);
    let named = format!(
        "stream {} is not a live stream of Toy context {ours} (it belongs to context {theirs}",
        foreign.id()
    );
    assert!(e.message.contains(&named), "{e}");
    // Destroyed: no longer in the registry.
    assert!(s.streams().remove(b.id()).is_some());
    stream::order_after(&s, &b, &a).expect_err("destroyed");
    assert!(log().is_empty(), "{:?}", log());
}

#[test]
fn a_refused_record_queues_no_wait_and_still_destroys_the_event() {
    let s = ToyStreams::default();
    let a = stream::create(&s).expect("a");
    let b = stream::create(&s).expect("b");
    clear_log();
    script("toyEventRecord", REFUSED);
    let e = stream::order_after(&s, &a, &b).expect_err("refused");
    assert!(e.message.contains("toyEventRecord"), "{e}");
    assert_eq!(
        log(),
        ["toyEventCreate", "toyEventRecord", "toyEventDestroy"]
    );
}

#[test]
fn after_a_sticky_code_a_vendor_whose_calls_may_block_destroys_no_event() {
    let s = ToyStreams::default();
    let a = stream::create(&s).expect("a");
    let b = stream::create(&s).expect("b");
    clear_log();
    // The wait fails with a sticky code: the event is left to the device.
    script("toyStreamWaitEvent", STICKY);
    let e = stream::order_after(&s, &a, &b).expect_err("sticky");
    assert!(e.message.contains("toyStreamWaitEvent"), "{e}");
    assert_eq!(
        log(),
        ["toyEventCreate", "toyEventRecord", "toyStreamWaitEvent"]
    );
    // A dead context refuses before any call.
    clear_log();
    stream::order_after(&s, &a, &b).expect_err("dead");
    assert!(log().is_empty(), "{:?}", log());
    // Teardown's own stream stops at a sticky code in its work: created,
    // nothing after (no synchronize that may never return).
    let s = ToyStreams::default();
    clear_log();
    script("toyMemcpyHtoDAsync", STICKY);
    let r = teardown::on_own_stream(&s, "teardown", |raw| {
        // SAFETY: the toy's call only logs.
        let r = unsafe { Toy::copy_htod_async(0, 0, 0, raw) };
        s.checked("teardown", "toyMemcpyHtoDAsync", r)
    });
    r.expect_err("sticky");
    assert_eq!(log(), ["toyStreamCreate", "toyMemcpyHtoDAsync"]);
}

#[test]
fn adopted_streams_are_lent_before_any_is_created_and_never_destroyed() {
    let s = ToyStreams::lending(vec![42]);
    let lent = stream::create(&s).expect("lent");
    assert_eq!(lent.raw(), 42);
    assert!(lent.is_adopted());
    assert!(log().is_empty(), "{:?}", log());
    let made = stream::create(&s).expect("made");
    assert_eq!(made.raw(), 1);
    assert!(!made.is_adopted());
    assert_eq!(log(), ["toyStreamCreate"]);
    clear_log();
    // Teardown: both synchronized, only the one memgov created destroyed,
    // both counted.
    let streams = s.streams().drain();
    let raw: Vec<u64> = streams.iter().map(|&(r, _)| r).collect();
    let mut errors = teardown::FirstError::default();
    teardown::sync_streams(&s, "teardown", &raw, &mut errors);
    teardown::destroy_streams(&s, "teardown", streams, true, &mut errors);
    errors.into_result().expect("clean");
    let mut calls = log();
    calls.sort_unstable();
    assert_eq!(
        calls,
        [
            "toyStreamDestroy",
            "toyStreamSynchronize",
            "toyStreamSynchronize"
        ]
    );
    assert_eq!(s.shell().probe().live_streams(), 0);
}

#[test]
fn a_retired_stream_is_destroyed_only_once_its_query_says_its_work_ran() {
    let s = ToyStreams::default();
    s.streams().retire(3);
    script("toyStreamQuery", NOT_READY);
    stream::reap_retired(&s, "synchronize").expect("still running is no error");
    assert_eq!(log(), ["toyStreamQuery"]);
    assert!(s.streams().has_retired());
    // A quiesce waits for it too, and leaves it retired.
    clear_log();
    stream::quiesce(&s, "trim", None).expect("quiesced");
    assert_eq!(log(), ["toyStreamSynchronize"]);
    assert!(s.streams().has_retired());
    clear_log();
    script("toyStreamQuery", OK);
    stream::reap_retired(&s, "synchronize").expect("reaped");
    assert_eq!(log(), ["toyStreamQuery", "toyStreamDestroy"]);
    assert!(!s.streams().has_retired());
}

/// What owns the toy's releases: parked signals with an address each.
struct Owner {
    tickets: Tickets<u64>,
    probe: BackendProbe,
}

impl Settle for Owner {
    fn settle(&self, ticket: u64, ok: bool) {
        if let Some(claim) = self.tickets.claim(ticket) {
            retire::settle_claim(claim, ok, &self.probe);
        }
    }
}

fn owner() -> Arc<Owner> {
    Arc::new(Owner {
        tickets: Tickets::default(),
        probe: BackendProbe::new(),
    })
}

/// A signal that records its outcome.
fn signal() -> (RetireSignal, Arc<Mutex<Vec<RetireOutcome>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    (
        RetireSignal::from_fn(move |o| s.lock().unwrap().push(o)),
        seen,
    )
}

/// Queue a release of 4096 B at `at` on stream 1 of a toy context.
fn queue(
    o: &Arc<Owner>,
    at: u64,
    finish: impl FnOnce(&u64) -> bool,
) -> (Queued<u64>, Arc<Mutex<Vec<RetireOutcome>>>) {
    let s = ToyContext::default();
    let (signal, seen) = signal();
    let weak = Arc::downgrade(o);
    // SAFETY: the toy's streams are numbers; nothing is dereferenced.
    let q = unsafe {
        retire::queue(
            &s,
            &o.probe,
            weak,
            &o.tickets,
            1,
            (retire::next_ticket(), signal, 4096, at),
            finish,
        )
    };
    (q, seen)
}

fn queued_tickets() -> Vec<u64> {
    CALLBACKS.with(|c| c.borrow().clone())
}

#[test]
fn a_queued_release_is_settled_once_by_its_callback_routed_by_number() {
    let o = owner();
    let (q, seen) = queue(&o, 0x1000, |_| {
        panic!("finish runs only after a failed launch")
    });
    assert_eq!(q, Queued::Behind);
    assert_eq!(log(), ["toyLaunchCallback"]);
    let tickets = queued_tickets();
    assert_eq!(tickets.len(), 1);
    assert!(
        seen.lock().unwrap().is_empty(),
        "nothing fires before the stream passed"
    );
    retire::callback_ran(tickets[0], true);
    retire::callback_ran(tickets[0], true);
    assert_eq!(*seen.lock().unwrap(), [RetireOutcome::Retired]);
    assert_eq!((o.probe.frees_retired(), o.probe.frees_abandoned()), (1, 0));
    assert!(o.tickets.is_empty());
}

#[test]
fn a_callback_reporting_a_failed_stream_abandons_and_one_for_a_dropped_owner_does_nothing() {
    let o = owner();
    let (_, failed) = queue(&o, 0x1000, |_| true);
    let (_, orphan) = queue(&o, 0x2000, |_| true);
    let t = queued_tickets();
    retire::callback_ran(t[0], false);
    assert_eq!(*failed.lock().unwrap(), [RetireOutcome::Abandoned]);
    assert_eq!(o.probe.frees_abandoned(), 1);
    // The owner goes (its parked signal with it, unfired); the callback
    // that runs after finds no route to follow.
    drop(o);
    retire::callback_ran(t[1], true);
    assert_eq!(*orphan.lock().unwrap(), [RetireOutcome::Abandoned]);
}

#[test]
fn a_failed_launch_synchronizes_the_stream_and_finishes_on_the_callers_thread() {
    let o = owner();
    script("toyLaunchCallback", REFUSED);
    let mut finished = None;
    let (q, seen) = queue(&o, 0x3000, |&at| {
        finished = Some(at);
        true
    });
    assert_eq!(q, Queued::Settled(0x3000, true));
    assert_eq!(finished, Some(0x3000));
    assert_eq!(log(), ["toyLaunchCallback", "toyStreamSynchronize"]);
    assert_eq!(*seen.lock().unwrap(), [RetireOutcome::Retired]);
    assert_eq!(o.probe.frees_retired(), 1);
    assert!(o.tickets.is_empty() && queued_tickets().is_empty());
}

#[test]
fn a_failed_launch_whose_synchronize_or_finish_fails_or_that_lost_the_device_abandons() {
    let o = owner();
    script("toyLaunchCallback", REFUSED);
    script("toyStreamSynchronize", REFUSED);
    let (q, seen) = queue(&o, 0x4000, |_| panic!("the stream was not synchronized"));
    assert_eq!(q, Queued::Settled(0x4000, false));
    assert_eq!(*seen.lock().unwrap(), [RetireOutcome::Abandoned]);

    script("toyStreamSynchronize", OK);
    let (q, seen) = queue(&o, 0x5000, |_| false);
    assert_eq!(q, Queued::Settled(0x5000, false));
    assert_eq!(*seen.lock().unwrap(), [RetireOutcome::Abandoned]);

    // A lost device: no synchronize (it would not return what is needed).
    script("toyLaunchCallback", LOST);
    LOG.with(|l| l.borrow_mut().clear());
    let (q, seen) = queue(&o, 0x6000, |_| panic!("the device is lost"));
    assert_eq!(q, Queued::Settled(0x6000, false));
    assert_eq!(log(), ["toyLaunchCallback"]);
    assert_eq!(*seen.lock().unwrap(), [RetireOutcome::Abandoned]);
    assert_eq!((o.probe.frees_retired(), o.probe.frees_abandoned()), (0, 3));
}

#[test]
fn device_loss_abandons_every_parked_signal_and_a_later_callback_does_nothing() {
    let o = owner();
    let (_, a) = queue(&o, 0x1000, |_| true);
    let (_, b) = queue(&o, 0x2000, |_| true);
    let mut items = retire::abandon_all(&o.tickets, &o.probe);
    items.sort_unstable();
    assert_eq!(items, [0x1000, 0x2000]);
    for t in queued_tickets() {
        retire::callback_ran(t, true);
    }
    assert_eq!(*a.lock().unwrap(), [RetireOutcome::Abandoned]);
    assert_eq!(*b.lock().unwrap(), [RetireOutcome::Abandoned]);
    assert_eq!((o.probe.frees_retired(), o.probe.frees_abandoned()), (0, 2));
}

/// A toy arena with the releases queued on its streams.
struct Releasing {
    arena: ToyArena,
    releases: Tickets<u64>,
    probe: BackendProbe,
}

impl std::ops::Deref for Releasing {
    type Target = vmm::Arena<u64>;
    fn deref(&self) -> &Self::Target {
        &self.arena
    }
}

impl retire::Releasing for Releasing {
    fn releases(&self) -> (&Tickets<u64>, &BackendProbe) {
        (&self.releases, &self.probe)
    }
}

#[test]
fn an_arena_release_gives_its_range_back_only_when_the_stream_passed_it() {
    let s = ToyContext::default();
    let a = Arc::new(Releasing {
        arena: toy_arena(&s),
        releases: Tickets::default(),
        probe: BackendProbe::new(),
    });
    let d = arena::driver(&s, &a.arena);
    let first = a.allocate(&d, 4096).expect("allocate");
    let second = a.allocate(&d, 4096).expect("allocate");
    let third = a.allocate(&d, 4096).expect("allocate");
    let used = a.snapshot().in_use;
    for at in [first, second] {
        let (signal, _) = signal();
        // SAFETY: the toy's streams are numbers; nothing is dereferenced.
        unsafe { retire::queue_release(&s, &a, 1, signal, 4096, at) };
    }
    assert_eq!(
        a.snapshot().in_use,
        used,
        "nothing back before the stream passed"
    );
    let t = queued_tickets();
    retire::callback_ran(t[0], false);
    retire::callback_ran(t[1], true);
    // The failed stream's range stays out of the free list; the other is
    // back.
    assert_eq!(a.snapshot().in_use, used - 4096);
    assert_eq!((a.probe.frees_retired(), a.probe.frees_abandoned()), (1, 1));

    // A failed launch: the stream is synchronized and the range is back at
    // once.
    script("toyLaunchCallback", REFUSED);
    let (signal, seen) = signal();
    // SAFETY: as above.
    unsafe { retire::queue_release(&s, &a, 1, signal, 4096, third) };
    assert_eq!(*seen.lock().unwrap(), [RetireOutcome::Retired]);
    assert_eq!(a.snapshot().in_use, used - 8192);
}

#[test]
fn a_copy_is_queued_then_synchronized_and_a_range_past_the_end_is_refused() {
    use memgov_stream_ordered::memory;
    let s = ToyContext::default();
    let at = memory::range::<ToyContext>("write", 0x1000, 64, 50, 14).expect("ends at 64");
    assert_eq!(at, 0x1000 + 50);
    let e = memory::range::<ToyContext>("write", 0x1000, 64, 50, 15).expect_err("ends at 65");
    assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
    assert!(
        e.to_string()
            .contains("15 B at offset 50 runs past the 64 B allocation"),
        "{e}"
    );
    let e = memory::range::<ToyContext>("read", 0, 64, u64::MAX, 1).expect_err("overflows");
    assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
    for (bytes, why) in [(0, "0-byte"), (u64::MAX, "size_t")] {
        if bytes == u64::MAX && usize::BITS == 64 {
            continue;
        }
        let e = memory::allocation_size(&s, &1, bytes).expect_err(why);
        assert!(e.to_string().contains(why), "{e}");
    }
    assert_eq!(memory::allocation_size(&s, &1, 4096).expect("fits"), 4096);
    // SAFETY: the toy's addresses are numbers; nothing is dereferenced.
    unsafe { memory::write(&s, 1, at, &[1; 14]) }.expect("write");
    let mut back = [0u8; 14];
    // SAFETY: as above.
    unsafe { memory::read(&s, 1, at, &mut back) }.expect("read");
    assert_eq!(
        log(),
        [
            "toyMemcpyHtoDAsync",
            "toyStreamSynchronize",
            "toyMemcpyDtoHAsync",
            "toyStreamSynchronize"
        ]
    );
    script("toyMemcpyDtoHAsync", REFUSED);
    // SAFETY: as above.
    let e = unsafe { memory::read(&s, 1, at, &mut back) }.expect_err("refused copy");
    assert!(e.to_string().contains("toyMemcpyDtoHAsync"), "{e}");
    assert_eq!(
        log().last(),
        Some(&"toyMemcpyDtoHAsync"),
        "no synchronize after a refused copy"
    );
}

/// An owner whose settle stops between claiming its ticket and counting it,
/// until told to go on: the window a driver thread can be preempted in.
struct SlowOwner {
    tickets: Tickets<u64>,
    probe: BackendProbe,
    entered: Mutex<std::sync::mpsc::Sender<()>>,
    go: Mutex<std::sync::mpsc::Receiver<()>>,
}

impl Settle for SlowOwner {
    fn settle(&self, ticket: u64, ok: bool) {
        if let Some(claim) = self.tickets.claim(ticket) {
            self.entered.lock().unwrap().send(()).unwrap();
            self.go.lock().unwrap().recv().unwrap();
            retire::settle_claim(claim, ok, &self.probe);
        }
    }
}

#[test]
fn forgetting_an_owner_waits_for_a_settle_under_way_so_its_count_lands_first() {
    let (entered_tx, entered) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel();
    let o = Arc::new(SlowOwner {
        tickets: Tickets::default(),
        probe: BackendProbe::new(),
        entered: Mutex::new(entered_tx),
        go: Mutex::new(go_rx),
    });
    let s = ToyContext::default();
    let (signal, seen) = signal();
    let weak: std::sync::Weak<dyn Settle> = Arc::downgrade(&o) as _;
    // SAFETY: the toy's streams are numbers; nothing is dereferenced.
    let q = unsafe {
        retire::queue(
            &s,
            &o.probe,
            weak,
            &o.tickets,
            1,
            (retire::next_ticket(), signal, 4096, 0x5000),
            |_| true,
        )
    };
    assert_eq!(q, Queued::Behind);
    let ticket = *queued_tickets().last().expect("queued");
    // The driver thread runs the callback and stops inside the settle,
    // its ticket claimed and not yet counted.
    let driver = std::thread::spawn(move || retire::callback_ran(ticket, true));
    entered.recv().unwrap();
    // Teardown forgets the owner: it must not return before the count.
    let (done_tx, done) = std::sync::mpsc::channel();
    let teardown = {
        let o = o.clone();
        std::thread::spawn(move || {
            retire::forget_owner(&*o);
            done_tx.send(o.probe.frees_retired()).unwrap();
        })
    };
    // Without the wait, teardown returns at once and sees no retired free.
    if let Ok(counted) = done.recv_timeout(Duration::from_millis(200)) {
        panic!("forget_owner returned while a settle was under way (it saw {counted} retired)");
    }
    go.send(()).unwrap();
    assert_eq!(done.recv().unwrap(), 1, "the settle's count landed first");
    driver.join().unwrap();
    teardown.join().unwrap();
    assert_eq!(*seen.lock().unwrap(), [RetireOutcome::Retired]);
}

/// The toy's stream-ordered free, for what a forced retire left live.
impl teardown::TeardownTable for Toy {
    const FREE_ASYNC: &'static str = "toyFreeAsync";

    unsafe fn free_async(_: u64, _: u64) -> i32 {
        call("toyFreeAsync")
    }
}

/// A toy context with two streams it created and one retired.
fn two_live_one_retired() -> ToyStreams {
    let s = ToyStreams::default();
    stream::create(&s).expect("a");
    stream::create(&s).expect("b");
    s.streams().retire(3);
    clear_log();
    s
}

#[test]
fn a_lost_drain_queries_every_live_and_retired_stream_once_they_ran() {
    let s = two_live_one_retired();
    teardown::drain_lost(&s, "teardown", "kept").expect("drained");
    // No blocking call: one query each, the retired one included.
    assert_eq!(log(), ["toyStreamQuery"; 3]);
    // The retired stream stays retired for the release that follows.
    assert!(s.streams().has_retired());
    assert!(!s.shell().is_dead());
}

#[test]
fn a_sticky_query_in_a_lost_drain_means_the_device_is_gone_not_an_error() {
    let s = two_live_one_retired();
    script("toyStreamQuery", STICKY);
    teardown::drain_lost(&s, "teardown", "kept").expect("nothing will run: drained");
    assert_eq!(log(), ["toyStreamQuery"], "no query after the sticky one");
    assert!(
        s.shell().is_dead(),
        "the sticky code marks the context dead"
    );
}

#[test]
fn a_refused_query_in_a_lost_drain_is_its_error() {
    let s = two_live_one_retired();
    script("toyStreamQuery", REFUSED);
    let e = teardown::drain_lost(&s, "teardown", "kept").expect_err("refused");
    assert!(e.message.contains("toyStreamQuery"), "{e}");
    assert_eq!(e.operation, "teardown");
    assert!(!s.shell().is_dead());
}

/// Two leftovers freed on teardown's own stream, each free tried.
const TWO_FREED_ON_OWN_STREAM: [&str; 5] = [
    "toyStreamCreate",
    "toyFreeAsync",
    "toyFreeAsync",
    "toyStreamSynchronize",
    "toyStreamDestroy",
];

#[test]
fn leftovers_are_freed_on_teardowns_own_stream_which_is_waited_for_and_destroyed() {
    let s = ToyStreams::default();
    let mut freed = Vec::new();
    teardown::free_leftovers(&s, "teardown", [(0x10, 4096), (0x20, 8192)], |b| {
        freed.push(b)
    })
    .expect("freed");
    assert_eq!(log(), TWO_FREED_ON_OWN_STREAM);
    assert_eq!(freed, [4096, 8192]);
}

#[test]
fn a_refused_leftover_free_is_not_counted_and_the_rest_still_run() {
    let s = ToyStreams::default();
    script("toyFreeAsync", REFUSED);
    let mut freed = Vec::new();
    let e = teardown::free_leftovers(&s, "teardown", [(0x10, 4096), (0x20, 8192)], |b| {
        freed.push(b)
    })
    .expect_err("refused");
    assert!(e.message.contains("toyFreeAsync"), "{e}");
    assert!(freed.is_empty(), "{freed:?}");
    assert_eq!(log(), TWO_FREED_ON_OWN_STREAM);
}

#[test]
fn after_a_sticky_leftover_free_a_vendor_whose_calls_may_block_makes_no_call() {
    let s = ToyStreams::default();
    script("toyFreeAsync", STICKY);
    teardown::free_leftovers(&s, "teardown", [(0x10, 4096), (0x20, 8192)], |_| ())
        .expect_err("sticky");
    // The second free, the synchronize and the destroy are left to the
    // device.
    assert_eq!(log(), ["toyStreamCreate", "toyFreeAsync"]);
}

#[test]
fn frees_left_pending_at_teardown_are_a_violation_naming_how_many() {
    let s = ToyStreams::default();
    teardown::report_pending(&s, 0, "still pending");
    assert_eq!(s.probe().violations(), 0);
    teardown::report_pending(&s, 3, "still pending");
    assert_eq!(s.probe().violations(), 1);
    assert_eq!(
        s.probe().violation_log(),
        ["teardown with 3 stream-ordered frees still pending"]
    );
}

#[test]
fn forgetting_at_teardown_counts_streams_and_memory_gone_with_no_call() {
    let s = two_live_one_retired();
    assert_eq!(s.probe().live_streams(), 2);
    teardown::forget_all(&s, [4096, 8192]);
    assert!(log().is_empty(), "{:?}", log());
    assert_eq!(s.probe().live_streams(), 0);
    assert!(!s.streams().has_retired());
    assert!(s.streams().live().is_empty());
}

#[test]
fn retired_streams_are_waited_for_then_destroyed_once_at_teardown() {
    let s = ToyStreams::default();
    s.streams().retire(3);
    s.streams().retire(4);
    let mut errors = teardown::FirstError::default();
    teardown::destroy_retired(&s, "teardown", &mut errors);
    errors.into_result().expect("destroyed");
    // Each synchronized before it is destroyed; none left to destroy again.
    assert_eq!(
        log(),
        [
            "toyStreamSynchronize",
            "toyStreamDestroy",
            "toyStreamSynchronize",
            "toyStreamDestroy"
        ]
    );
    assert!(!s.streams().has_retired());
    // A refused synchronize is kept, and the stream still destroyed.
    let s = ToyStreams::default();
    s.streams().retire(3);
    clear_log();
    script("toyStreamSynchronize", REFUSED);
    let mut errors = teardown::FirstError::default();
    teardown::destroy_retired(&s, "teardown", &mut errors);
    let e = errors.into_result().expect_err("refused");
    assert!(e.message.contains("toyStreamSynchronize"), "{e}");
    assert_eq!(log(), ["toyStreamSynchronize", "toyStreamDestroy"]);
}

// ---- opening a device ----------------------------------------------------

impl OpenTable for Toy {
    type Device = u8;

    const OPEN_NAMES: OpenNames = OpenNames {
        device_count: "toyGetDeviceCount",
        device_get: "toyDeviceGet",
        device_name: "toyDeviceGetName",
        device_total_mem: "toyDeviceTotalMem",
    };

    const IDENTITY_LAST: bool = true;

    unsafe fn device_count() -> (i32, i32) {
        (call("toyGetDeviceCount"), DEVICES.with(|d| *d.borrow()))
    }
    unsafe fn device_get(ordinal: i32) -> (i32, u8) {
        (call("toyDeviceGet"), 0x40 + ordinal as u8)
    }
    unsafe fn device_name(buf: &mut [c_char; NAME_BYTES], device: u8) -> i32 {
        // Fills the whole buffer, no NUL: the core terminates it.
        buf.fill(b'n' as c_char);
        buf[0] = device as c_char;
        call("toyDeviceGetName")
    }
    unsafe fn device_uuid(device: u8) -> (i32, [u8; 16]) {
        (call("toyDeviceGetUuid"), [device; 16])
    }
    unsafe fn device_pci_bus_id(buf: &mut [c_char; PCI_BUS_ID_BYTES], _: u8) -> i32 {
        for (b, c) in buf.iter_mut().zip(b"0000:65:00.0\0") {
            *b = *c as c_char;
        }
        call("toyDeviceGetPCIBusId")
    }
    unsafe fn device_total_mem(_: u8) -> (i32, usize) {
        (call("toyDeviceTotalMem"), 1 << 30)
    }
}

/// Open `ordinal` on a toy reporting `devices`, the log cleared first;
/// `words` logs its call and answers the version words.
fn open_toy(devices: i32, ordinal: u32) -> Result<Opened<u8, &'static str, u8>, BackendError> {
    clear_log();
    DEVICES.with(|d| *d.borrow_mut() = devices);
    open::open::<Toy, _, _>(
        ordinal,
        |device| {
            assert_eq!(
                log().last(),
                Some(&"toyDeviceGet"),
                "entered after the handle"
            );
            assert_eq!(device, 0x40 + ordinal as u8);
            Ok("entered")
        },
        |device, name| {
            call("toyWords");
            assert_eq!(
                name.len(),
                NAME_BYTES - 1,
                "the name ends at the buffer's last byte"
            );
            Ok(("toy driver 2.1".to_owned(), device))
        },
    )
}

#[test]
fn opening_asks_count_handle_name_total_words_then_identity_in_order() {
    let opened = open_toy(3, 2).expect("open");
    assert_eq!(
        log(),
        [
            "toyGetDeviceCount",
            "toyDeviceGet",
            "toyDeviceGetName",
            "toyDeviceTotalMem",
            "toyWords",
            "toyDeviceGetUuid",
            "toyDeviceGetPCIBusId",
        ]
    );
    assert_eq!(
        (opened.handle, opened.entered, opened.own),
        (0x42, "entered", 0x42)
    );
    let d = &opened.device;
    assert_eq!(
        (d.ordinal, d.total_bytes, d.driver.as_str()),
        (2, 1 << 30, "toy driver 2.1")
    );
    assert!(
        d.name.starts_with('B') && d.name.len() == NAME_BYTES - 1,
        "{}",
        d.name
    );
    assert_eq!(d.identity.backend(), "toy");
    assert_eq!(d.identity.uuid(), Some([0x42; 16]));
    assert_eq!(d.identity.pci_bus_id(), Some("0000:65:00.0"));
}

#[test]
fn no_device_is_unavailable_naming_the_count_call_and_asks_nothing_more() {
    let e = open_toy(0, 0).unwrap_err();
    assert_eq!(e.kind, BackendErrorKind::Unavailable);
    assert_eq!(
        e.message,
        "no Toy device (toyGetDeviceCount returned TOY_0, 0 devices)"
    );
    assert_eq!(log(), ["toyGetDeviceCount"]);

    // The count call itself answering "no device" (an Unavailable code).
    script("toyGetDeviceCount", UNAVAILABLE);
    let e = open_toy(1, 0).unwrap_err();
    script("toyGetDeviceCount", OK);
    assert_eq!(e.kind, BackendErrorKind::Unavailable);
    assert!(
        e.message
            .starts_with("no Toy device (toyGetDeviceCount returned TOY_4, 0 devices)"),
        "{e}"
    );
    assert_eq!(e.code, Some(i64::from(UNAVAILABLE)));
    assert_eq!(log(), ["toyGetDeviceCount"]);

    // Any other failure of the count call is that code's own error.
    script("toyGetDeviceCount", REFUSED);
    let e = open_toy(1, 0).unwrap_err();
    script("toyGetDeviceCount", OK);
    assert_eq!(e.kind, BackendErrorKind::Other);
    assert!(e.message.contains("toyGetDeviceCount"), "{e}");
    assert!(!e.message.contains("no Toy device"), "{e}");
}

#[test]
fn an_ordinal_out_of_range_is_refused_naming_the_count_before_any_device_call() {
    for ordinal in [2, u32::MAX] {
        let e = open_toy(2, ordinal).unwrap_err();
        assert_eq!(e.kind, BackendErrorKind::InvalidArgument);
        assert!(
            e.message.contains(&format!(
                "Toy device ordinal {ordinal} is out of range: the toy driver reports 2 devices (0..2)"
            )),
            "{e}"
        );
        assert_eq!(log(), ["toyGetDeviceCount"]);
    }
}

#[test]
fn a_failed_uuid_or_bus_id_leaves_that_part_out_and_the_open_succeeds() {
    script("toyDeviceGetUuid", REFUSED);
    let opened = open_toy(1, 0);
    script("toyDeviceGetUuid", OK);
    let identity = opened.expect("open").device.identity;
    assert_eq!(identity.uuid(), None);
    assert_eq!(identity.pci_bus_id(), Some("0000:65:00.0"));

    script("toyDeviceGetPCIBusId", REFUSED);
    let opened = open_toy(1, 0);
    script("toyDeviceGetPCIBusId", OK);
    let identity = opened.expect("open").device.identity;
    assert_eq!(identity.uuid(), Some([0x40; 16]));
    assert_eq!(identity.pci_bus_id(), None);
}

#[test]
fn a_failed_name_or_total_fails_the_open_naming_the_call_before_the_words() {
    for failing in ["toyDeviceGetName", "toyDeviceTotalMem"] {
        script(failing, REFUSED);
        let e = open_toy(1, 0).unwrap_err();
        script(failing, OK);
        assert!(e.message.contains(failing), "{e}");
        assert!(!log().contains(&"toyWords"), "{:?}", log());
        assert_eq!(log().last(), Some(&failing));
    }
}

// The context's own memory pool.

impl memgov_stream_ordered::pool::PoolTable for Toy {
    type Pool = u64;
    const POOL_NAMES: memgov_stream_ordered::pool::PoolNames =
        memgov_stream_ordered::pool::PoolNames {
            create: "toyMemPoolCreate",
            set_attribute: "toyMemPoolSetAttribute",
            trim: "toyMemPoolTrimTo",
            destroy: "toyMemPoolDestroy",
        };

    unsafe fn pool_create(_: i32) -> (i32, u64) {
        (call("toyMemPoolCreate"), 77)
    }
    unsafe fn pool_set_release_threshold(_: u64, _: u64) -> i32 {
        call("toyMemPoolSetAttribute")
    }
    unsafe fn pool_trim(_: u64) -> i32 {
        call("toyMemPoolTrimTo")
    }
    unsafe fn pool_destroy(_: u64) -> i32 {
        call("toyMemPoolDestroy")
    }
}

fn create_pool(threshold: Option<u64>) -> Result<Option<u64>, BackendError> {
    // SAFETY: the toy's pool calls touch no memory; any ordinal will do.
    unsafe { memgov_stream_ordered::pool::create::<Toy>("new", 0, threshold) }
}

/// Teardown's pool step on `s`, with the first error it kept.
fn release_pool(s: &ToyStreams) -> Result<(), BackendError> {
    let mut errors = teardown::FirstError::default();
    // SAFETY: the toy's pool calls touch no memory; the pool is never used
    // again by the core.
    unsafe { memgov_stream_ordered::pool::release(s, "teardown", 77, &mut errors) };
    errors.into_result()
}

#[test]
fn a_pool_gets_its_release_threshold_and_a_driver_without_pools_gives_none() {
    let made = create_pool(Some(1 << 20));
    assert_eq!(made.expect("created"), Some(77));
    assert_eq!(log(), ["toyMemPoolCreate", "toyMemPoolSetAttribute"]);
    // No threshold asked: no attribute set.
    clear_log();
    assert_eq!(create_pool(None).expect("created"), Some(77));
    assert_eq!(log(), ["toyMemPoolCreate"]);
    // A driver without pools for the device: no pool, no error, no call
    // after the create.
    clear_log();
    script("toyMemPoolCreate", UNSUPPORTED);
    assert_eq!(create_pool(Some(1)).expect("no pool"), None);
    assert_eq!(log(), ["toyMemPoolCreate"]);
    // Any other refusal is an error naming the call.
    clear_log();
    script("toyMemPoolCreate", REFUSED);
    let e = create_pool(Some(1)).expect_err("refused");
    assert!(e.to_string().contains("toyMemPoolCreate"), "{e}");
    assert_eq!(log(), ["toyMemPoolCreate"]);
}

#[test]
fn a_pool_whose_threshold_is_refused_is_destroyed_before_the_error_returns() {
    script("toyMemPoolSetAttribute", REFUSED);
    let e = create_pool(Some(1 << 20)).expect_err("refused");
    assert!(e.to_string().contains("toyMemPoolSetAttribute"), "{e}");
    assert_eq!(
        log(),
        [
            "toyMemPoolCreate",
            "toyMemPoolSetAttribute",
            "toyMemPoolDestroy"
        ]
    );
}

#[test]
fn teardown_trims_then_destroys_the_pool_and_calls_nothing_after_a_sticky_code() {
    let s = ToyStreams::default();
    release_pool(&s).expect("released");
    assert_eq!(log(), ["toyMemPoolTrimTo", "toyMemPoolDestroy"]);
    // A refused destroy is kept as teardown's error.
    clear_log();
    script("toyMemPoolDestroy", REFUSED);
    let e = release_pool(&s).expect_err("refused");
    assert!(e.to_string().contains("toyMemPoolDestroy"), "{e}");
    assert_eq!(log(), ["toyMemPoolTrimTo", "toyMemPoolDestroy"]);
    // The toy's calls may block after a sticky code, as HIP's: the trim's
    // sticky answer is the last call, and the error it kept is the loss.
    clear_log();
    script("toyMemPoolTrimTo", STICKY);
    let e = release_pool(&s).expect_err("lost");
    assert_eq!(e.kind, BackendErrorKind::DeviceLost, "{e}");
    assert_eq!(log(), ["toyMemPoolTrimTo"]);
    // Once dead, nothing is called at all.
    clear_log();
    release_pool(&s).expect("nothing to do");
    assert!(log().is_empty(), "{:?}", log());
}
