//! State-machine property test of tiers against a reference model.
//!
//! Random sequences of allocations in the device and the pinned host tier,
//! writes, releases (by drop, and `release_on` another stream), releases the
//! backend refuses (quarantined), retirements of executed frees, and limit
//! changes of either tier run on one context of the host backend, wrapped in
//! `Watched` so that retirements are held until a `RetireHeld` step, and
//! charged to a device's `SharedBudget`. After **every step** the governor
//! must agree with a small model, per tier:
//!
//! * live, pending and quarantined bytes, and the charge (their sum);
//! * no admission takes a tier over its limit: an allocation is admitted
//!   exactly when it fits under its own tier's limit, and refused naming
//!   that tier otherwise (`BudgetScope::Context` for the device tier,
//!   `BudgetScope::Tier(PinnedHost)` for pinned host memory);
//! * pinned host bytes are never on the device budget: the context budget
//!   and the shared one carry exactly the device tier's bytes;
//! * the backend holds exactly the pinned bytes whose free has not run.
//!
//! At the end every buffer is released and the context retired: every byte
//! of every tier is back (both budgets, the tier, the backend), and every
//! release settled once.
//!
//! Cases: `PROPTEST_CASES` (default 256). CI (`scripts/ci/20-properties.sh`)
//! runs 10 000 in release (10 to 25 s).

use memgov::host::{HostConfig, HostContext, HostControls};
use memgov::{
    Alloc, BudgetScope, ContextConfig, ContextHandle, DeviceBuffer, GovernedStream, Governor,
    GovernorError, Role, SharedBudget, Tier,
};
use memgov_conformance::{WatchLog, Watched};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Backend = Watched<HostContext>;

const DEVICE_LIMIT: u64 = 256 << 10;
const PINNED_LIMIT: u64 = 128 << 10;
/// The device's shared budget: above the context's, so that the context
/// budget refuses first and the shared one only ever mirrors device bytes.
const SHARED_LIMIT: u64 = 4 * DEVICE_LIMIT;

#[derive(Debug, Clone)]
enum Step {
    Allocate {
        tier: Tier,
        stream: usize,
        bytes: u64,
    },
    Write {
        buf: usize,
        len: usize,
    },
    Drop(usize),
    ReleaseOn {
        buf: usize,
        stream: usize,
    },
    /// The backend refuses the next free: that release is quarantined.
    RefuseNextFree,
    RetireHeld,
    SetLimit {
        tier: Tier,
        bytes: u64,
    },
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::Device), Just(Tier::PinnedHost)]
}

fn step() -> impl Strategy<Value = Step> {
    let idx = 0usize..6;

    let bytes = prop_oneof![
        8 => 1u64..=(48 << 10),
        1 => (PINNED_LIMIT / 2)..=(DEVICE_LIMIT + 1),
    ];
    prop_oneof![
        30 => (tier(), 0usize..2, bytes).prop_map(|(tier, stream, bytes)| Step::Allocate { tier, stream, bytes }),
        6 => (idx.clone(), 1usize..256).prop_map(|(buf, len)| Step::Write { buf, len }),
        14 => idx.clone().prop_map(Step::Drop),
        5 => (idx.clone(), 0usize..2).prop_map(|(buf, stream)| Step::ReleaseOn { buf, stream }),
        3 => Just(Step::RefuseNextFree),
        10 => Just(Step::RetireHeld),
        3 => (tier(), 0u64..=(2 * DEVICE_LIMIT)).prop_map(|(tier, bytes)| Step::SetLimit { tier, bytes }),
    ]
}

/// One tier's amounts, as the model keeps them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Amounts {
    live: u64,
    pending: u64,
    quarantined: u64,
}

impl Amounts {
    fn charged(&self) -> u64 {
        self.live + self.pending + self.quarantined
    }
}

/// The reference model.
#[derive(Debug, Clone)]
struct Model {
    device: Amounts,
    pinned: Amounts,
    device_limit: u64,
    pinned_limit: u64,
    /// Bytes of releases queued and held (not yet retired), by tier.
    held: Vec<(Tier, u64)>,
    queued: u64,
}

impl Model {
    fn of(&mut self, tier: Tier) -> &mut Amounts {
        match tier {
            Tier::Device => &mut self.device,
            _ => &mut self.pinned,
        }
    }

    fn limit(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Device => self.device_limit,
            _ => self.pinned_limit,
        }
    }
}

struct World {
    _gov: Governor<Backend>,
    ctx: ContextHandle<Backend>,
    log: Arc<WatchLog>,
    controls: HostControls,
    shared: SharedBudget,
    streams: Vec<GovernedStream<Backend>>,
    bufs: Vec<DeviceBuffer<Backend>>,
    m: Model,
}

impl World {
    fn new() -> Self {
        let host = HostContext::new(HostConfig {
            capacity: 1 << 30,
            ..HostConfig::default()
        })
        .expect("host backend");
        let controls = host.controls();
        let watched = Watched::new(host);
        let log = watched.log();
        log.hold_retirements(true);
        let shared = SharedBudget::new("device", SHARED_LIMIT);
        let gov = Governor::new();
        let ctx = gov.register(
            watched,
            ContextConfig::new()
                .label("tiers")
                .budget(DEVICE_LIMIT)
                .tier_budget(Tier::PinnedHost, PINNED_LIMIT)
                .shared_budget(shared.clone()),
        );
        let streams = (0..2)
            .map(|i| ctx.create_stream(format!("s{i}")).expect("stream"))
            .collect();
        Self {
            _gov: gov,
            ctx,
            log,
            controls,
            shared,
            streams,
            bufs: Vec::new(),
            m: Model {
                device: Amounts::default(),
                pinned: Amounts::default(),
                device_limit: DEVICE_LIMIT,
                pinned_limit: PINNED_LIMIT,
                held: Vec::new(),
                queued: 0,
            },
        }
    }

    /// A release of `buf` was queued (and its retirement held) or, if the
    /// backend was told to refuse it, quarantined.
    fn released(&mut self, tier: Tier, bytes: u64, refused: bool) {
        let a = self.m.of(tier);
        a.live -= bytes;
        if refused {
            a.quarantined += bytes;
        } else {
            a.pending += bytes;
            self.m.held.push((tier, bytes));
            self.m.queued += 1;
        }
    }

    fn apply(&mut self, s: &Step, refuse_next: &mut bool) -> Result<(), TestCaseError> {
        match *s {
            Step::Allocate {
                tier,
                stream,
                bytes,
            } => {
                let fits = self.m.of(tier).charged() + bytes <= self.m.limit(tier);
                let r = self.ctx.allocate(
                    &self.streams[stream],
                    Alloc::new(bytes, Role::Other).tier(tier),
                );
                match (r, fits) {
                    (Ok(b), true) => {
                        prop_assert_eq!(b.tier(), tier);
                        self.m.of(tier).live += bytes;
                        self.bufs.push(b);
                    }
                    (Err(GovernorError::BudgetExceeded(e)), false) => {
                        let scope = match tier {
                            Tier::Device => BudgetScope::Context,
                            t => BudgetScope::Tier(t),
                        };
                        prop_assert_eq!(&e.scope, &scope, "refusal names its tier: {}", e);
                        prop_assert_eq!(e.limit, self.m.limit(tier));
                        prop_assert_eq!(e.pending, self.m.of(tier).pending);
                    }
                    (r, fits) => {
                        let (had, limit) = (*self.m.of(tier), self.m.limit(tier));
                        return Err(TestCaseError::fail(format!(
                            "allocate {bytes} B in {tier} (model: fits {fits}, {had:?} of {limit} B) gave {:?}",
                            r.map(|b| b.len())
                        )));
                    }
                }
            }
            Step::Write { buf, len } => {
                if let Some(b) = self.bufs.get(buf % self.bufs.len().max(1)) {
                    let len = len.min(b.len() as usize);
                    let data: Vec<u8> = (0..len).map(|i| i as u8).collect();
                    b.write(0, &data)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let mut back = vec![0u8; len];
                    b.read(0, &mut back)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(back, data);
                }
            }
            Step::Drop(i) | Step::ReleaseOn { buf: i, .. } => {
                if self.bufs.is_empty() {
                    return Ok(());
                }
                let b = self.bufs.swap_remove(i % self.bufs.len());
                let (tier, bytes) = (b.tier(), b.len());
                let refused = std::mem::take(refuse_next);
                if let Step::ReleaseOn { stream, .. } = *s {
                    let r = b.release_on(&self.streams[stream]);
                    prop_assert_eq!(r.is_err(), refused, "release_on: {:?}", r.err());
                } else {
                    drop(b);
                }
                self.released(tier, bytes, refused);
            }
            Step::RefuseNextFree => {
                if !*refuse_next {
                    self.controls.refuse_next_frees(1);
                    *refuse_next = true;
                }
            }
            Step::RetireHeld => {
                let n = self.log.release_held();
                prop_assert_eq!(n, self.m.held.len(), "held retirements");
                for (tier, bytes) in std::mem::take(&mut self.m.held) {
                    self.m.of(tier).pending -= bytes;
                }
            }
            Step::SetLimit { tier, bytes } => {
                self.ctx.set_budget(tier, bytes);
                match tier {
                    Tier::Device => self.m.device_limit = bytes,
                    _ => self.m.pinned_limit = bytes,
                }
            }
        }
        Ok(())
    }

    /// The governor agrees with the model, tier by tier.
    fn check(&self) -> Result<(), TestCaseError> {
        // The model is quiet between steps: the books balance exactly.
        if let Err(e) = self.ctx.check_books() {
            prop_assert!(false, "{}", e);
        }
        let snap = self.ctx.snapshot();
        for (tier, want, limit) in [
            (Tier::Device, self.m.device, self.m.device_limit),
            (Tier::PinnedHost, self.m.pinned, self.m.pinned_limit),
        ] {
            let Some(t) = snap.tier(tier) else {
                return Err(TestCaseError::fail(format!(
                    "no {tier} tier in the snapshot"
                )));
            };
            let got = Amounts {
                live: t.live_bytes,
                pending: t.pending_bytes,
                quarantined: t.quarantined_bytes,
            };
            prop_assert_eq!(got, want, "{} amounts", tier);
            prop_assert_eq!(t.charged, want.charged(), "{} charged", tier);
            prop_assert_eq!(t.limit, limit, "{} limit", tier);
        }
        // Pinned host bytes are on neither device budget.
        prop_assert_eq!(snap.charged, self.m.device.charged(), "context budget");
        prop_assert_eq!(
            self.shared.charged(),
            self.m.device.charged(),
            "shared budget"
        );
        // The backend holds the pinned bytes whose free has not run: live
        // and quarantined, once the streams have run every queued free (a
        // held retirement is held in the governor's view only).
        for s in &self.streams {
            s.synchronize()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        prop_assert_eq!(
            self.controls.pinned_in_use(),
            self.m.pinned.live + self.m.pinned.quarantined,
            "pinned bytes held by the backend"
        );
        Ok(())
    }
}

fn run_case(steps: &[Step]) -> Result<(), TestCaseError> {
    let mut w = World::new();
    let mut refuse_next = false;
    for s in steps {
        w.apply(s, &mut refuse_next)?;
        w.check()?;
    }
    // Everything back: release every buffer, fire the held retirements,
    // retire the context.
    if refuse_next {
        // Disarm the refusal: the releases below must all be queued.
        w.controls.refuse_next_frees(0);
    }
    while let Some(b) = w.bufs.pop() {
        let (tier, bytes) = (b.tier(), b.len());
        drop(b);
        w.released(tier, bytes, false);
    }
    // `check` runs every queued free first, so that all of them are held.
    w.check()?;
    w.apply(&Step::RetireHeld, &mut false)?;
    w.log.hold_retirements(false);
    w.check()?;
    w.streams.clear();
    let report = w
        .ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(10))
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(report.retired_releases, w.m.queued);
    prop_assert_eq!(
        report.quarantined_bytes,
        w.m.device.quarantined + w.m.pinned.quarantined
    );
    let snap = w.ctx.snapshot();
    for t in &snap.by_tier {
        prop_assert_eq!(
            (
                t.charged,
                t.live_bytes,
                t.pending_bytes,
                t.quarantined_bytes
            ),
            (0, 0, 0, 0),
            "{} after teardown",
            t.tier
        );
    }
    prop_assert_eq!(w.shared.charged(), 0);
    Ok(())
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

#[test]
fn tiers_match_reference_model() {
    let config = ProptestConfig {
        cases: cases(),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let start = Instant::now();
    let result = runner.run(&proptest::collection::vec(step(), 1..60), |steps| {
        run_case(&steps)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    println!(
        "properties_tiers: {} cases; {:.1?}",
        cases(),
        start.elapsed()
    );
}
