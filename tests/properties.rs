//! State-machine property tests.
//!
//! Random sequences of governor operations — create and drop streams,
//! allocate, write, read, release on various streams (including a stream of
//! another context), external pins, retire, wait with a deadline in the past,
//! force, mark lost, retirements of queued frees, and faults injected into the
//! next backend call — run against the host backend wrapped as
//! `Watched<FaultInjecting<HostContext>>`, and are checked after **every step**
//! against a small reference model:
//!
//! * bytes accounted exactly by role and state (live, pending, quarantined),
//!   the charged total, pins by kind;
//! * every operation returns the result the model predicts (each error by
//!   variant);
//! * reservations (reserve, allocate out of one, grow, shrink, drop): the
//!   reserved bytes are charged, a grow the budget refuses changes nothing,
//!   an allocation out of a reservation never takes more than it has left,
//!   and what is left goes back exactly once when it is dropped;
//! * teardown runs at most once, only when the model says everything is
//!   drained, with no release in flight on a healthy device; the host probe
//!   sees no double free and no free after teardown;
//! * at the end every release signal has fired exactly once or was settled as
//!   lost / abandoned, and the device holds no memory.
//!
//! Retirements are made deterministic by holding them in the `Watched`
//! wrapper: the host executes each free at once, and the governor hears about
//! it only at a `Retire` step.
//!
//! Cases: `PROPTEST_CASES` (default 256). Failing sequences shrink to a
//! minimal one. CI (`scripts/ci/20-properties.sh`): `PROPTEST_CASES=10000
//! cargo test --release --test properties`.

use memgov::fault::{Fault, FaultControl, FaultInjecting, FaultPlan, Operation};
use memgov::host::{HostConfig, HostContext};
use memgov::BackendProbe;
use memgov::{
    Alloc, BudgetScope, ContextConfig, ContextHandle, ContextState, DeviceBuffer, GovernedStream,
    Governor, GovernorError, ProviderContextPin, ProviderContextPinError, ProviderContextPinSource,
    Reservation, Reserve, RetireError, Role,
};
use memgov_conformance::{WatchLog, Watched};
use proptest::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Backend = Watched<FaultInjecting<HostContext>>;

const BUDGET: u64 = 1 << 20;

#[derive(Debug, Clone)]
enum Step {
    CreateStream,
    DropStream(usize),
    /// `reserve(bytes)`.
    Reserve(u64),
    /// `Reservation::allocate` out of a live reservation.
    AllocateReserved {
        res: usize,
        stream: usize,
        bytes: u64,
        role: usize,
    },
    /// `Reservation::grow`.
    Grow {
        res: usize,
        bytes: u64,
    },
    /// `Reservation::shrink`.
    Shrink {
        res: usize,
        bytes: u64,
    },
    /// Drop a reservation: what is left goes back.
    DropReservation(usize),
    Allocate {
        stream: usize,
        bytes: u64,
        role: usize,
    },
    AllocateOnForeignStream,
    Write {
        buf: usize,
        offset: u64,
        len: u64,
    },
    Read {
        buf: usize,
        offset: u64,
        len: u64,
    },
    /// Drop the buffer (release on its own stream).
    Drop(usize),
    /// `release_on` another live stream of the same context.
    ReleaseOn {
        buf: usize,
        stream: usize,
    },
    /// `release_on` a stream of another context: refused, buffer returned.
    ReleaseOnForeign(usize),
    Pin,
    Unpin(usize),
    /// Fire the held retirements of executed frees.
    RetireHeld,
    /// Arm a fault on the next call of one backend operation.
    Arm(Operation, Fault),
    Retire,
    /// `retire().wait(deadline in the past)`.
    WaitPast,
    /// `retire().force(deadline in the past)`.
    Force,
    MarkLost,
}

fn role(i: usize) -> Role {
    Role::ALL[i % Role::ALL.len()]
}

fn step() -> impl Strategy<Value = Step> {
    let idx = 0usize..8;
    let bytes = prop_oneof![
        8 => 1u64..=(96 << 10),
        1 => Just(0u64),
        1 => Just(u64::MAX),
        1 => (BUDGET / 2)..=BUDGET + 1,
    ];
    let fault = prop_oneof![
        Just(Fault::Error),
        Just(Fault::OutOfMemory),
        Just(Fault::Delay(Duration::ZERO)),
        Just(Fault::DropSignal),
        Just(Fault::DeviceLost),
    ];
    let op = prop_oneof![
        Just(Operation::Allocate),
        Just(Operation::FreeAsync),
        Just(Operation::Write),
        Just(Operation::Read),
        Just(Operation::CreateStream),
    ];
    let small =
        prop_oneof![4 => 1u64..=(64 << 10), 1 => Just(0u64), 1 => (BUDGET / 4)..=BUDGET + 1];
    prop_oneof![
        4 => small.clone().prop_map(Step::Reserve),
        8 => (idx.clone(), idx.clone(), 0u64..=(48 << 10), 0usize..5).prop_map(|(res, stream, bytes, role)| Step::AllocateReserved { res, stream, bytes, role }),
        2 => (idx.clone(), small.clone()).prop_map(|(res, bytes)| Step::Grow { res, bytes }),
        2 => (idx.clone(), small).prop_map(|(res, bytes)| Step::Shrink { res, bytes }),
        3 => idx.clone().prop_map(Step::DropReservation),
        6 => Just(Step::CreateStream),
        3 => idx.clone().prop_map(Step::DropStream),
        30 => (idx.clone(), bytes, 0usize..5).prop_map(|(stream, bytes, role)| Step::Allocate { stream, bytes, role }),
        1 => Just(Step::AllocateOnForeignStream),
        6 => (idx.clone(), 0u64..(128 << 10), 0u64..512).prop_map(|(buf, offset, len)| Step::Write { buf, offset, len }),
        4 => (idx.clone(), 0u64..(128 << 10), 0u64..512).prop_map(|(buf, offset, len)| Step::Read { buf, offset, len }),
        16 => idx.clone().prop_map(Step::Drop),
        6 => (idx.clone(), idx.clone()).prop_map(|(buf, stream)| Step::ReleaseOn { buf, stream }),
        1 => idx.clone().prop_map(Step::ReleaseOnForeign),
        4 => Just(Step::Pin),
        4 => idx.clone().prop_map(Step::Unpin),
        8 => Just(Step::RetireHeld),
        8 => (op, fault).prop_map(|(o, f)| Step::Arm(o, f)),
        1 => Just(Step::Retire),
        1 => Just(Step::WaitPast),
        1 => Just(Step::Force),
        1 => Just(Step::MarkLost),
    ]
}

/// The reference model: what the governor should account.
#[derive(Debug, Default, Clone)]
struct Model {
    retiring: bool,
    /// The device is lost (as far as the model's predictions go).
    lost: bool,
    /// The governor's lost flag (also set by mark_lost after termination).
    lost_flag: bool,
    forced: bool,
    terminated: bool,
    live: [(u64, u64); 5],
    pending: [(u64, u64); 5],
    quarantined: [(u64, u64); 5],
    /// Live streams (handles or buffers keep them).
    streams_alive: u64,
    external: u64,
    max_pins: u64,
    /// Frees the host accepted and executed; their governor signals are held.
    executed: u64,
    /// Pending releases by role, in order, for settling.
    pending_list: Vec<(usize, u64)>,
    armed: Option<(Operation, Fault)>,
    releases_queued: u64,
    abandoned: u64,
    /// Bytes whose free never ran (abandoned, reclaimed by force, released on
    /// a lost device): charged until teardown.
    awaiting: u64,
    /// What each live reservation has left, in `World::reservations` order;
    /// each holds a pin.
    reserved: Vec<u64>,
}

impl Model {
    fn pins(&self) -> u64 {
        self.streams_alive
            + self.live.iter().map(|l| l.1).sum::<u64>()
            + self.external
            + self.reserved.len() as u64
    }
    fn charged(&self) -> u64 {
        (0..5)
            .map(|i| self.live[i].0 + self.pending[i].0 + self.quarantined[i].0)
            .sum::<u64>()
            + self.awaiting
            + self.reserved.iter().sum::<u64>()
    }
    fn closed(&self) -> bool {
        self.retiring || self.lost
    }
    fn drained(&self) -> bool {
        self.closed() && self.pins() == 0 && (self.lost || self.pending_list.is_empty())
    }
    /// Consume the armed fault if it is for `op`.
    fn take(&mut self, op: Operation) -> Option<Fault> {
        match self.armed {
            Some((o, f)) if o == op => {
                self.armed = None;
                Some(f)
            }
            _ => None,
        }
    }
}

struct Buf {
    buf: DeviceBuffer<Backend>,
    /// Index into `World::stream_slots` of the stream it lives on.
    stream: usize,
    bytes: u64,
    role: usize,
    reclaimed: bool,
}

struct World {
    _gov: Governor<Backend>,
    ctx: ContextHandle<Backend>,
    log: Arc<WatchLog>,
    control: FaultControl<HostContext>,
    probe: BackendProbe,
    streams: Vec<GovernedStream<Backend>>,
    /// Per stream ever created: live buffers on it, and whether its handle is held.
    slot_buffers: Vec<u64>,
    slot_handle: Vec<bool>,
    /// Which slot each held handle in `streams` is.
    stream_slot: Vec<usize>,
    bufs: Vec<Buf>,
    source: Arc<dyn ProviderContextPinSource>,
    pins: Vec<Box<dyn ProviderContextPin>>,
    reservations: Vec<Reservation<Backend>>,
    second_stream: GovernedStream<Backend>,
    _second_gov: Governor<Backend>,
    m: Model,
    teardown_seen: bool,
}

fn past() -> Instant {
    Instant::now()
        .checked_sub(Duration::from_millis(1))
        .unwrap_or_else(Instant::now)
}

impl World {
    fn new(max_pins: u64) -> Self {
        let host = HostContext::new(HostConfig {
            capacity: 4 * BUDGET,
            ..HostConfig::default()
        })
        .unwrap();
        let probe = host.probe();
        let faulty = FaultInjecting::new(host, FaultPlan::new());
        let control = faulty.control();
        let watched = Watched::new(faulty);
        let log = watched.log();
        log.hold_retirements(true);
        let gov = Governor::new();
        let ctx = gov.register(
            watched,
            ContextConfig::new()
                .label("prop")
                .budget(BUDGET)
                .max_pins(max_pins),
        );
        let source = ctx.pin_source(Some("plugin"));
        let second_gov = Governor::new();
        let second = second_gov.register(
            Watched::new(FaultInjecting::new(
                HostContext::new(HostConfig::default()).unwrap(),
                FaultPlan::new(),
            )),
            ContextConfig::new().label("second"),
        );
        let second_stream = second.create_stream("second").unwrap();
        Self {
            _gov: gov,
            ctx,
            log,
            control,
            probe,
            streams: Vec::new(),
            slot_buffers: Vec::new(),
            slot_handle: Vec::new(),
            stream_slot: Vec::new(),
            bufs: Vec::new(),
            source,
            pins: Vec::new(),
            reservations: Vec::new(),
            second_stream,
            _second_gov: second_gov,
            m: Model {
                max_pins,
                ..Model::default()
            },
            teardown_seen: false,
        }
    }

    fn arm(&mut self, op: Operation, fault: Fault) {
        self.control.set_plan(FaultPlan::new().nth(op, 1, fault));
        self.m.armed = Some((op, fault));
    }

    fn disarm(&mut self) {
        self.control.set_plan(FaultPlan::new());
        self.m.armed = None;
    }

    /// The backend reported a lost device.
    fn lose(&mut self) {
        self.m.lost_flag = true;
        if self.m.terminated {
            return;
        }
        self.m.lost = true;
        self.m.armed = None; // lost: nothing reaches the plan any more
    }

    /// A stream slot lost a reference; the stream dies with the last.
    fn slot_unref(&mut self, slot: usize) {
        if !self.slot_handle[slot] && self.slot_buffers[slot] == 0 && !self.m.forced {
            self.m.streams_alive -= 1;
        }
    }

    /// Wait until the host has executed every free it accepted (its signal
    /// is then held by `Watched`), so that the state is deterministic.
    fn quiesce(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.log.retired.load(Ordering::SeqCst) < self.m.executed && !self.m.lost {
            assert!(
                Instant::now() < deadline,
                "host did not execute {} queued frees: {}",
                self.m.executed,
                self.log.summary()
            );
            std::thread::yield_now();
        }
    }

    /// Release the buffer at `i` on stream handle `on` (None: its own stream).
    fn release(&mut self, i: usize, on: Option<usize>) -> Result<(), TestCaseError> {
        let b = self.bufs.swap_remove(i);
        let (bytes, role, slot) = (b.bytes, b.role, b.stream);
        let result = match on {
            None => {
                drop(b.buf);
                Ok(())
            }
            Some(h) => b.buf.release_on(&self.streams[h]).map_err(|e| e.error),
        };
        self.slot_buffers[slot] -= 1;
        if b.reclaimed {
            // Force already revoked its pin and uncharged it.
            if on.is_some() {
                prop_assert!(
                    matches!(result, Err(GovernorError::Reclaimed { .. })),
                    "release of reclaimed: {result:?}"
                );
            }
        } else if self.m.lost {
            prop_assert!(result.is_ok(), "release on lost device: {result:?}");
            self.m.live[role].0 -= bytes;
            self.m.live[role].1 -= 1;
            // The device has it back only when the context is destroyed.
            self.m.awaiting += bytes;
        } else {
            self.m.live[role].0 -= bytes;
            self.m.live[role].1 -= 1;
            match self.m.take(Operation::FreeAsync) {
                Some(Fault::Error) | Some(Fault::OutOfMemory) => {
                    if on.is_some() {
                        prop_assert!(
                            matches!(result, Err(GovernorError::Backend { .. })),
                            "refused free: {result:?}"
                        );
                    }
                    self.m.quarantined[role].0 += bytes;
                    self.m.quarantined[role].1 += 1;
                }
                Some(Fault::DeviceLost) => {
                    prop_assert!(
                        result.is_ok(),
                        "free on a device lost just now settles: {result:?}"
                    );
                    self.m.awaiting += bytes;
                    self.lose();
                }
                Some(Fault::DropSignal) => {
                    prop_assert!(result.is_ok(), "{result:?}");
                    self.m.releases_queued += 1;
                    self.m.abandoned += 1;
                    // Never freed: the backend frees it at teardown.
                    self.m.awaiting += bytes;
                }
                Some(Fault::Delay(_)) | None => {
                    prop_assert!(result.is_ok(), "{result:?}");
                    self.m.releases_queued += 1;
                    self.m.executed += 1;
                    self.m.pending[role].0 += bytes;
                    self.m.pending[role].1 += 1;
                    self.m.pending_list.push((role, bytes));
                }
            }
        }
        self.slot_unref(slot);
        Ok(())
    }

    fn apply(&mut self, step: &Step) -> Result<(), TestCaseError> {
        match step {
            Step::CreateStream => {
                let r = self.ctx.create_stream("s");
                if self.m.terminated || self.m.closed() || self.m.lost_flag {
                    prop_assert!(r.is_err(), "stream created on a closed context");
                    if self.m.lost_flag {
                        prop_assert!(matches!(r, Err(GovernorError::DeviceLost { .. })), "{r:?}");
                    } else {
                        prop_assert!(
                            matches!(
                                r,
                                Err(GovernorError::Pin {
                                    refusal: ProviderContextPinError::ContextUnavailable(_),
                                    ..
                                })
                            ),
                            "{r:?}"
                        );
                    }
                } else if self.m.pins() >= self.m.max_pins {
                    prop_assert!(
                        matches!(
                            r,
                            Err(GovernorError::Pin {
                                refusal: ProviderContextPinError::PinCountOverflow(_),
                                ..
                            })
                        ),
                        "{r:?}"
                    );
                } else {
                    match self.m.take(Operation::CreateStream) {
                        Some(Fault::Error) | Some(Fault::OutOfMemory) => {
                            prop_assert!(matches!(r, Err(GovernorError::Backend { .. })), "{r:?}")
                        }
                        Some(Fault::DeviceLost) => {
                            prop_assert!(
                                matches!(r, Err(GovernorError::DeviceLost { .. })),
                                "create_stream on a lost device: {r:?}"
                            );
                            self.lose();
                        }
                        _ => {
                            let s =
                                r.map_err(|e| TestCaseError::fail(format!("create_stream: {e}")))?;
                            self.streams.push(s);
                            self.stream_slot.push(self.slot_buffers.len());
                            self.slot_buffers.push(0);
                            self.slot_handle.push(true);
                            self.m.streams_alive += 1;
                        }
                    }
                }
            }
            Step::DropStream(i) => {
                if !self.streams.is_empty() {
                    let h = i % self.streams.len();
                    drop(self.streams.swap_remove(h));
                    let slot = self.stream_slot.swap_remove(h);
                    self.slot_handle[slot] = false;
                    self.slot_unref(slot);
                }
            }
            Step::Allocate {
                stream,
                bytes,
                role: ri,
            } => {
                if self.streams.is_empty() {
                    return Ok(());
                }
                let h = stream % self.streams.len();
                let role = role(*ri);
                let r = self
                    .ctx
                    .allocate(&self.streams[h], Alloc::new(*bytes, role));
                let m = &mut self.m;
                if *bytes == 0 {
                    prop_assert!(matches!(r, Err(GovernorError::ZeroSized { .. })), "{r:?}");
                } else if m.closed() || m.lost_flag {
                    if m.lost_flag {
                        prop_assert!(matches!(r, Err(GovernorError::DeviceLost { .. })), "{r:?}");
                    } else {
                        prop_assert!(
                            matches!(
                                r,
                                Err(GovernorError::Pin {
                                    refusal: ProviderContextPinError::ContextUnavailable(_),
                                    ..
                                })
                            ),
                            "{r:?}"
                        );
                    }
                } else if m.pins() >= m.max_pins {
                    prop_assert!(
                        matches!(
                            r,
                            Err(GovernorError::Pin {
                                refusal: ProviderContextPinError::PinCountOverflow(_),
                                ..
                            })
                        ),
                        "{r:?}"
                    );
                } else if m.charged().checked_add(*bytes).is_none_or(|c| c > BUDGET) {
                    match &r {
                        Err(GovernorError::BudgetExceeded(b)) => {
                            prop_assert_eq!(&b.scope, &BudgetScope::Context);
                            prop_assert_eq!(b.requested, *bytes);
                            prop_assert_eq!(b.limit, BUDGET);
                            prop_assert_eq!(b.available, BUDGET - m.charged());
                        }
                        other => prop_assert!(false, "expected BudgetExceeded, got {other:?}"),
                    }
                } else {
                    match m.take(Operation::Allocate) {
                        Some(Fault::Error) => {
                            prop_assert!(matches!(r, Err(GovernorError::Backend { .. })), "{r:?}")
                        }
                        Some(Fault::OutOfMemory) => match &r {
                            Err(GovernorError::BudgetExceeded(b)) => {
                                prop_assert_eq!(&b.scope, &BudgetScope::Device)
                            }
                            other => {
                                prop_assert!(false, "expected device BudgetExceeded, got {other:?}")
                            }
                        },
                        Some(Fault::DeviceLost) => {
                            prop_assert!(
                                matches!(r, Err(GovernorError::DeviceLost { .. })),
                                "{r:?}"
                            );
                            self.lose();
                        }
                        _ => {
                            let buf = r.map_err(|e| {
                                TestCaseError::fail(format!("allocate {bytes}: {e}"))
                            })?;
                            prop_assert_eq!(buf.len(), *bytes);
                            let slot = self.stream_slot[h];
                            self.slot_buffers[slot] += 1;
                            self.m.live[*ri % 5].0 += bytes;
                            self.m.live[*ri % 5].1 += 1;
                            self.bufs.push(Buf {
                                buf,
                                stream: slot,
                                bytes: *bytes,
                                role: *ri % 5,
                                reclaimed: false,
                            });
                        }
                    }
                }
            }
            Step::Reserve(bytes) => {
                let r = self.ctx.reserve(Reserve::new(*bytes, "r"));
                let m = &mut self.m;
                if *bytes == 0 {
                    prop_assert!(matches!(r, Err(GovernorError::ZeroSized { .. })), "{r:?}");
                } else if m.closed() || m.lost_flag {
                    if m.lost_flag {
                        prop_assert!(matches!(r, Err(GovernorError::DeviceLost { .. })), "{r:?}");
                    } else {
                        prop_assert!(
                            matches!(
                                r,
                                Err(GovernorError::Pin {
                                    refusal: ProviderContextPinError::ContextUnavailable(_),
                                    ..
                                })
                            ),
                            "{r:?}"
                        );
                    }
                } else if m.pins() >= m.max_pins {
                    prop_assert!(
                        matches!(
                            r,
                            Err(GovernorError::Pin {
                                refusal: ProviderContextPinError::PinCountOverflow(_),
                                ..
                            })
                        ),
                        "{r:?}"
                    );
                } else if m.charged().checked_add(*bytes).is_none_or(|c| c > BUDGET) {
                    match &r {
                        Err(GovernorError::BudgetExceeded(b)) => {
                            prop_assert_eq!(&b.scope, &BudgetScope::Context);
                            prop_assert_eq!(b.available, BUDGET - m.charged());
                            prop_assert_eq!(b.reserved, m.reserved.iter().sum::<u64>());
                        }
                        other => prop_assert!(false, "expected BudgetExceeded, got {other:?}"),
                    }
                } else {
                    let res =
                        r.map_err(|e| TestCaseError::fail(format!("reserve {bytes}: {e}")))?;
                    prop_assert_eq!(res.left(), *bytes);
                    self.reservations.push(res);
                    m.reserved.push(*bytes);
                }
            }
            Step::AllocateReserved {
                res,
                stream,
                bytes,
                role: ri,
            } => {
                if self.reservations.is_empty() || self.streams.is_empty() {
                    return Ok(());
                }
                let k = res % self.reservations.len();
                let h = stream % self.streams.len();
                let r =
                    self.reservations[k].allocate(&self.streams[h], Alloc::new(*bytes, role(*ri)));
                let m = &mut self.m;
                let left = m.reserved[k];
                if *bytes == 0 {
                    prop_assert!(matches!(r, Err(GovernorError::ZeroSized { .. })), "{r:?}");
                } else if m.closed() || m.lost_flag {
                    prop_assert!(
                        matches!(
                            r,
                            Err(GovernorError::DeviceLost { .. } | GovernorError::Pin { .. })
                        ),
                        "{r:?}"
                    );
                } else if m.pins() >= m.max_pins {
                    prop_assert!(
                        matches!(
                            r,
                            Err(GovernorError::Pin {
                                refusal: ProviderContextPinError::PinCountOverflow(_),
                                ..
                            })
                        ),
                        "{r:?}"
                    );
                } else if *bytes > left {
                    match &r {
                        Err(GovernorError::ReservationExhausted {
                            requested, left: l, ..
                        }) => prop_assert_eq!((*requested, *l), (*bytes, left)),
                        other => {
                            prop_assert!(false, "expected ReservationExhausted, got {other:?}")
                        }
                    }
                } else {
                    match m.take(Operation::Allocate) {
                        Some(Fault::Error) => {
                            prop_assert!(matches!(r, Err(GovernorError::Backend { .. })), "{r:?}")
                        }
                        Some(Fault::OutOfMemory) => match &r {
                            Err(GovernorError::BudgetExceeded(b)) => {
                                prop_assert_eq!(&b.scope, &BudgetScope::Device)
                            }
                            other => {
                                prop_assert!(false, "expected device BudgetExceeded, got {other:?}")
                            }
                        },
                        Some(Fault::DeviceLost) => {
                            prop_assert!(
                                matches!(r, Err(GovernorError::DeviceLost { .. })),
                                "{r:?}"
                            );
                            self.lose();
                        }
                        _ => {
                            let buf = r.map_err(|e| {
                                TestCaseError::fail(format!("allocate {bytes} reserved: {e}"))
                            })?;
                            let slot = self.stream_slot[h];
                            self.slot_buffers[slot] += 1;
                            self.m.reserved[k] -= bytes;
                            RESERVED_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
                            self.m.live[*ri % 5].0 += bytes;
                            self.m.live[*ri % 5].1 += 1;
                            self.bufs.push(Buf {
                                buf,
                                stream: slot,
                                bytes: *bytes,
                                role: *ri % 5,
                                reclaimed: false,
                            });
                        }
                    }
                }
                if let Some(left) = self.m.reserved.get(k) {
                    prop_assert_eq!(self.reservations[k].left(), *left, "left after allocate");
                }
            }
            Step::Grow { res, bytes } => {
                if self.reservations.is_empty() {
                    return Ok(());
                }
                let k = res % self.reservations.len();
                let r = self.reservations[k].grow(*bytes);
                let m = &mut self.m;
                if m.charged().checked_add(*bytes).is_none_or(|c| c > BUDGET) {
                    match &r {
                        Err(GovernorError::BudgetExceeded(b)) => {
                            prop_assert_eq!(&b.scope, &BudgetScope::Context)
                        }
                        other => prop_assert!(false, "expected BudgetExceeded, got {other:?}"),
                    }
                } else {
                    prop_assert!(r.is_ok(), "grow by {bytes}: {r:?}");
                    m.reserved[k] += bytes;
                }
                // A refused grow changed nothing.
                prop_assert_eq!(self.reservations[k].left(), self.m.reserved[k]);
            }
            Step::Shrink { res, bytes } => {
                if self.reservations.is_empty() {
                    return Ok(());
                }
                let k = res % self.reservations.len();
                let given = self.reservations[k].shrink(*bytes);
                let expect = self.m.reserved[k].min(*bytes);
                prop_assert_eq!(given, expect, "shrink gives back at most what is left");
                self.m.reserved[k] -= given;
            }
            Step::DropReservation(i) => {
                if !self.reservations.is_empty() {
                    let k = i % self.reservations.len();
                    drop(self.reservations.swap_remove(k));
                    self.m.reserved.swap_remove(k);
                }
            }
            Step::AllocateOnForeignStream => {
                let other = self.second_stream.clone();
                let r = self.ctx.allocate(&other, Alloc::new(64, Role::Other));
                prop_assert!(
                    matches!(r, Err(GovernorError::WrongContext { .. })),
                    "{r:?}"
                );
            }
            Step::Write { buf, offset, len } | Step::Read { buf, offset, len } => {
                if self.bufs.is_empty() {
                    return Ok(());
                }
                let is_write = matches!(step, Step::Write { .. });
                let i = buf % self.bufs.len();
                let size = self.bufs[i].bytes;
                let data = vec![0xA5u8; *len as usize];
                let mut out = vec![0u8; *len as usize];
                let r = if is_write {
                    self.bufs[i].buf.write(*offset, &data)
                } else {
                    self.bufs[i].buf.read(*offset, &mut out)
                };
                if offset + len > size {
                    match &r {
                        Err(GovernorError::OutOfBounds {
                            offset: o,
                            len: l,
                            size: s,
                            ..
                        }) => {
                            prop_assert_eq!((*o, *l, *s), (*offset, *len, size))
                        }
                        other => prop_assert!(false, "expected OutOfBounds, got {other:?}"),
                    }
                } else if self.m.lost_flag {
                    prop_assert!(matches!(r, Err(GovernorError::DeviceLost { .. })), "{r:?}");
                } else if self.bufs[i].reclaimed {
                    prop_assert!(matches!(r, Err(GovernorError::Reclaimed { .. })), "{r:?}");
                } else {
                    let op = if is_write {
                        Operation::Write
                    } else {
                        Operation::Read
                    };
                    match self.m.take(op) {
                        Some(Fault::Error) | Some(Fault::OutOfMemory) => {
                            prop_assert!(matches!(r, Err(GovernorError::Backend { .. })), "{r:?}")
                        }
                        Some(Fault::DeviceLost) => {
                            prop_assert!(
                                matches!(r, Err(GovernorError::DeviceLost { .. })),
                                "{r:?}"
                            );
                            self.lose();
                        }
                        _ => prop_assert!(r.is_ok(), "{op} in bounds: {r:?}"),
                    }
                }
            }
            Step::Drop(i) => {
                if !self.bufs.is_empty() {
                    let i = i % self.bufs.len();
                    self.release(i, None)?;
                }
            }
            Step::ReleaseOn { buf, stream } => {
                if !self.bufs.is_empty() && !self.streams.is_empty() {
                    let i = buf % self.bufs.len();
                    let h = stream % self.streams.len();
                    self.release(i, Some(h))?;
                }
            }
            Step::ReleaseOnForeign(i) => {
                if let (false, Some(other)) = (self.bufs.is_empty(), self.second_stream()) {
                    let i = i % self.bufs.len();
                    let b = self.bufs.swap_remove(i);
                    let Buf {
                        buf,
                        stream,
                        bytes,
                        role,
                        reclaimed,
                    } = b;
                    match buf.release_on(&other) {
                        Err(e) => {
                            prop_assert!(
                                matches!(e.error, GovernorError::WrongContext { .. }),
                                "{:?}",
                                e.error
                            );
                            let buf = e.buffer.ok_or_else(|| {
                                TestCaseError::fail("WrongContext must hand the buffer back")
                            })?;
                            self.bufs.push(Buf {
                                buf,
                                stream,
                                bytes,
                                role,
                                reclaimed,
                            });
                        }
                        Ok(()) => prop_assert!(
                            false,
                            "release on a stream of another context was accepted"
                        ),
                    }
                }
            }
            Step::Pin => {
                let r = self.source.pin();
                if self.m.closed() || self.m.lost_flag {
                    prop_assert!(
                        matches!(r, Err(ProviderContextPinError::ContextUnavailable(_))),
                        "{r:?}"
                    );
                } else if self.m.pins() >= self.m.max_pins {
                    prop_assert!(
                        matches!(r, Err(ProviderContextPinError::PinCountOverflow(_))),
                        "{r:?}"
                    );
                } else {
                    self.pins
                        .push(r.map_err(|e| TestCaseError::fail(format!("pin: {e}")))?);
                    self.m.external += 1;
                }
            }
            Step::Unpin(i) => {
                if !self.pins.is_empty() {
                    drop(self.pins.swap_remove(i % self.pins.len()));
                    self.m.external -= 1;
                }
            }
            Step::RetireHeld => {
                let n = self.log.release_held() as u64;
                if !self.m.terminated {
                    let expected = self.m.pending_list.len() as u64;
                    prop_assert_eq!(n, expected, "held retirements");
                    for (role, bytes) in self.m.pending_list.drain(..) {
                        self.m.pending[role].0 -= bytes;
                        self.m.pending[role].1 -= 1;
                    }
                }
            }
            Step::Arm(op, fault) => {
                if self.m.lost {
                    return Ok(());
                }
                self.arm(*op, *fault);
            }
            Step::Retire => {
                let _ = self.ctx.retire();
                self.m.retiring = true;
            }
            Step::WaitPast => {
                let h = self.ctx.retire();
                self.m.retiring = true;
                let r = h.wait(past());
                self.check_finish(r)?;
            }
            Step::Force => {
                let h = self.ctx.retire();
                self.m.retiring = true;
                let r = h.force(past());
                if !self.m.terminated && !self.m.forced {
                    self.m.forced = true;
                    // Live buffers and streams are reclaimed; pins revoked.
                    for b in &mut self.bufs {
                        b.reclaimed = true;
                    }
                    // Still on the device until teardown frees it.
                    self.m.awaiting += self.m.live.iter().map(|l| l.0).sum::<u64>();
                    for i in 0..5 {
                        self.m.live[i] = (0, 0);
                    }
                    self.m.streams_alive = 0;
                }
                self.check_finish(r)?;
            }
            Step::MarkLost => {
                let first = self.ctx.mark_lost("lost by the property test");
                prop_assert_eq!(
                    first,
                    !self.m.lost_flag,
                    "mark_lost returns whether it was the first"
                );
                self.lose();
            }
        }
        self.quiesce();
        self.background_teardown()?;
        self.check()
    }

    /// Nobody keeps a `RetireHandle` between steps: a retiring context that
    /// has drained tears down in the background, on a reaper thread. Wait
    /// for it, and apply the teardown to the model.
    fn background_teardown(&mut self) -> Result<(), TestCaseError> {
        if !self.m.retiring || self.m.terminated || !self.m.drained() {
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.ctx.lifecycle() != ContextState::Terminated {
            prop_assert!(
                Instant::now() < deadline,
                "drained and unattended, yet no background teardown: {:?}",
                self.m
            );
            std::thread::yield_now();
        }
        let report = self.ctx.teardown_report();
        prop_assert!(report.is_some(), "background teardown keeps its report");
        self.terminate();
        Ok(())
    }

    /// What teardown does to the model: quarantine died with the context, a
    /// lost device's pending releases were given up, and every byte whose
    /// free never ran is back.
    fn terminate(&mut self) {
        self.m.terminated = true;
        for i in 0..5 {
            self.m.quarantined[i] = (0, 0);
        }
        if self.m.lost {
            for (role, bytes) in self.m.pending_list.drain(..) {
                self.m.pending[role].0 -= bytes;
                self.m.pending[role].1 -= 1;
                self.m.abandoned += 1;
            }
        }
        self.m.awaiting = 0;
    }

    /// A stream of a second context of the same backend type.
    fn second_stream(&self) -> Option<GovernedStream<Backend>> {
        Some(self.second_stream.clone())
    }

    fn check_finish(
        &mut self,
        r: Result<memgov::TeardownReport, RetireError>,
    ) -> Result<(), TestCaseError> {
        if self.m.terminated || self.m.drained() {
            let report =
                r.map_err(|e| TestCaseError::fail(format!("expected teardown, got {e}")))?;
            prop_assert_eq!(report.lost, self.m.lost);
            if !self.m.terminated {
                self.terminate();
            }
        } else {
            match r {
                Err(RetireError::Outstanding { outstanding, .. }) => {
                    prop_assert!(
                        !outstanding.is_empty(),
                        "an Outstanding error lists what is outstanding"
                    );
                }
                Ok(rep) => prop_assert!(
                    false,
                    "teardown with work outstanding: {rep:?}; model {:?}",
                    self.m
                ),
                Err(e) => prop_assert!(false, "{e}; model {:?}", self.m),
            }
        }
        Ok(())
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        // The model is quiet between steps: the books balance exactly.
        if let Err(e) = self.ctx.check_books() {
            prop_assert!(false, "{}", e);
        }
        let s = self.ctx.snapshot();
        for i in 0..5 {
            let u = s.by_role[i];
            prop_assert_eq!(
                (u.live_bytes, u.live_count),
                self.m.live[i],
                "live of {}",
                role(i)
            );
            prop_assert_eq!(
                (u.pending_bytes, u.pending_count),
                self.m.pending[i],
                "pending of {}",
                role(i)
            );
            prop_assert_eq!(
                (u.quarantined_bytes, u.quarantined_count),
                self.m.quarantined[i],
                "quarantined of {}",
                role(i)
            );
        }
        prop_assert_eq!(s.charged, self.m.charged(), "charged");
        prop_assert_eq!(
            (s.reserved, s.reservations.len()),
            (
                self.m.reserved.iter().sum::<u64>(),
                self.m.reserved.iter().filter(|l| **l > 0).count()
            ),
            "reserved"
        );
        prop_assert_eq!(s.awaiting_teardown, self.m.awaiting, "awaiting teardown");
        prop_assert_eq!(s.pins.external, self.m.external, "external pins");
        prop_assert_eq!(s.pins.streams, self.m.streams_alive, "stream pins");
        prop_assert_eq!(
            s.pins.pending_releases,
            self.m.pending_list.len() as u64,
            "pending pins"
        );
        let expected = if self.m.terminated {
            ContextState::Terminated
        } else if self.m.lost {
            ContextState::Lost
        } else if self.m.retiring {
            ContextState::Retiring
        } else {
            ContextState::Active
        };
        prop_assert_eq!(s.lifecycle, expected);
        // Destroy: at most once, and only once the model is drained.
        let teardowns = self.log.teardowns.load(Ordering::SeqCst);
        prop_assert!(teardowns <= 1, "teardown ran {teardowns} times");
        prop_assert_eq!(teardowns == 1, self.m.terminated, "teardown iff terminated");
        if teardowns == 1 && !self.teardown_seen {
            self.teardown_seen = true;
            if !self.m.lost {
                prop_assert_eq!(
                    self.log.unsettled_at_teardown.load(Ordering::SeqCst),
                    0,
                    "teardown with releases in flight"
                );
            }
        }
        prop_assert_eq!(
            self.probe.violations(),
            0,
            "host contract violations: {:?}",
            self.probe.violation_log()
        );
        prop_assert_eq!(s.counters.late_settlements, 0);
        Ok(())
    }

    /// Drop everything, retire, and check that nothing is left.
    fn finish(mut self) -> Result<(), TestCaseError> {
        self.disarm();
        while !self.bufs.is_empty() {
            self.release(0, None)?;
            self.quiesce();
        }
        self.pins.clear();
        self.m.external = 0;
        self.reservations.clear();
        self.m.reserved.clear();
        for slot in std::mem::take(&mut self.stream_slot) {
            self.slot_handle[slot] = false;
            self.slot_unref(slot);
        }
        self.streams.clear();
        self.quiesce();
        // Dropping the last pin of a retiring context on a lost device lets
        // it tear down on the reaper thread at once (a lost device's pending
        // releases do not hold it), and teardown drops the held signals.
        // Apply that teardown to the model before releasing held signals,
        // as every step does, or the release races the reaper.
        self.background_teardown()?;
        self.apply(&Step::RetireHeld)?;
        self.apply(&Step::WaitPast)?;
        prop_assert!(
            self.m.terminated,
            "everything dropped, yet no teardown: {:?}",
            self.m
        );
        let s = self.ctx.snapshot();
        prop_assert_eq!(s.charged, 0);
        prop_assert_eq!(s.pins.total(), 0);
        prop_assert_eq!(
            self.probe.used_bytes(),
            0,
            "device memory left after teardown"
        );
        prop_assert_eq!(self.probe.teardowns(), 1);
        // Every signal fired once or was settled as lost / abandoned.
        let log = &self.log;
        let (queued, retired, abandoned) = (
            log.frees_queued.load(Ordering::SeqCst),
            log.retired.load(Ordering::SeqCst),
            log.abandoned.load(Ordering::SeqCst),
        );
        prop_assert_eq!(queued, retired + abandoned, "signals: {}", log.summary());
        prop_assert_eq!(log.held(), 0);
        prop_assert_eq!(
            s.counters.releases_queued,
            s.counters.retired + s.counters.abandoned,
            "governor settlements"
        );
        prop_assert_eq!(s.counters.releases_queued, self.m.releases_queued);
        Ok(())
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

static STEPS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);
static TEARDOWNS_BEFORE_END: AtomicU64 = AtomicU64::new(0);
static INJECTED: AtomicU64 = AtomicU64::new(0);
static LOST: AtomicU64 = AtomicU64::new(0);
static FORCED: AtomicU64 = AtomicU64::new(0);
static QUARANTINED: AtomicU64 = AtomicU64::new(0);
static RESERVED_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

fn run_case(steps: &[Step], max_pins: u64) -> Result<(), TestCaseError> {
    let mut w = World::new(max_pins);
    for s in steps {
        w.apply(s)?;
    }
    STEPS.fetch_add(steps.len() as u64, Ordering::Relaxed);
    ALLOCATED.fetch_add(w.ctx.snapshot().counters.allocations, Ordering::Relaxed);
    QUARANTINED.fetch_add(w.ctx.snapshot().counters.quarantined, Ordering::Relaxed);
    TEARDOWNS_BEFORE_END.fetch_add(w.m.terminated as u64, Ordering::Relaxed);
    INJECTED.fetch_add(w.control.total_injected(), Ordering::Relaxed);
    LOST.fetch_add(w.m.lost as u64, Ordering::Relaxed);
    FORCED.fetch_add(w.m.forced as u64, Ordering::Relaxed);
    w.finish()
}

/// The state machine, `PROPTEST_CASES` cases of up to 60 steps. Prints the
/// figures docs/reliability.md quotes and checks that the cases really
/// reached the interesting states.
#[test]
fn governor_matches_reference_model() {
    let cases = cases();
    let config = ProptestConfig {
        cases,
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let strategy = (
        prop_oneof![
            // Half the cases keep the context open until the end (more
            // allocations, releases and faults); half retire, force or lose it
            // along the way.
            proptest::collection::vec(
                step().prop_map(|s| match s {
                    Step::Retire | Step::WaitPast | Step::Force | Step::MarkLost =>
                        Step::RetireHeld,
                    s => s,
                }),
                1..80
            ),
            proptest::collection::vec(step(), 1..80),
        ],
        prop_oneof![3 => Just(1u64 << 40), 1 => 2u64..12],
    );
    let start = Instant::now();
    let result = runner.run(&strategy, |(steps, max_pins)| run_case(&steps, max_pins));
    if let Err(e) = result {
        panic!("{e}");
    }
    let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
    println!(
        "properties: {cases} cases, {} steps, {} allocations ({} out of reservations), {} faults injected, {} quarantined releases, {} cases lost the device, {} forced, {} torn down mid-sequence; {:.1?}",
        ld(&STEPS), ld(&ALLOCATED), ld(&RESERVED_ALLOCATIONS), ld(&INJECTED), ld(&QUARANTINED), ld(&LOST), ld(&FORCED), ld(&TEARDOWNS_BEFORE_END), start.elapsed()
    );
    if cases >= 100 {
        for (what, n) in [
            ("allocations", ld(&ALLOCATED)),
            ("allocations out of reservations", ld(&RESERVED_ALLOCATIONS)),
            ("faults", ld(&INJECTED)),
            ("quarantines", ld(&QUARANTINED)),
            ("lost", ld(&LOST)),
            ("forced", ld(&FORCED)),
            ("teardowns", ld(&TEARDOWNS_BEFORE_END)),
        ] {
            assert!(
                n > 0,
                "no case reached {what}: the generator does not cover the state space"
            );
        }
    }
}
