//! State-machine property test of the budget tree.
//!
//! A process budget over two device budgets ([`SharedBudget::with_parent`]),
//! two host contexts on each, every level with a random limit. Random
//! sequences of allocations (kept, or put in a cache that the context's
//! pressure responder, of a random priority, gives back), releases, and
//! memory recorded outside memgov at each level (and those records dropped)
//! run against a reference model of the tree, checked after **every step**:
//!
//! * every operation's outcome is the model's: admitted, or refused by the
//!   level the model names (context, device, process), with that level's
//!   limit; the responders asked are the model's, in its order (lowest
//!   priority first, stopping as soon as the allocation fits);
//! * every level's charged and outside totals are the model's;
//! * no level is ever over its limit but by outside records (an outside
//!   record exists already, so it is charged whatever the limit), and an
//!   admitted allocation leaves every level it is charged to within its
//!   limit;
//! * at the end, once every buffer and record is dropped, every level holds
//!   0 bytes: every byte was returned, and returned once.
//!
//! Cases: `PROPTEST_CASES` (default 256). CI (`scripts/ci/20-properties.sh`):
//! `PROPTEST_CASES=10000 cargo test --release --test properties_tree`.

use memgov::host::{HostConfig, HostContext};
use memgov::{
    Alloc, BudgetScope, ContextConfig, ContextHandle, DeviceBuffer, GovernedStream, Governor,
    OutsideRecord, OutsideUsage, ProcessBudget, Role, SharedBudget,
};
use proptest::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const KIB: u64 = 1024;
/// Contexts 0 and 1 are on device 0, 2 and 3 on device 1.
const CONTEXTS: usize = 4;

fn device_of(c: usize) -> usize {
    c / 2
}

/// A level of the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    Context(usize),
    Device(usize),
    Process,
}

#[derive(Debug, Clone)]
enum Step {
    /// Allocate `bytes` on a context, kept in its list or in its cache (the
    /// cache is what its responder gives back).
    Allocate { ctx: usize, bytes: u64, cache: bool },
    /// Drop a kept buffer (its stream synchronized: the release settles).
    Release { ctx: usize, index: usize },
    /// Record outside memory at a level.
    Outside { at: At, bytes: u64 },
    /// Drop an outside record.
    DropOutside(usize),
}

fn step() -> impl Strategy<Value = Step> {
    let bytes = prop_oneof![1u64..64 * KIB, (1u64..12).prop_map(|k| k * 64 * KIB)];
    let at = prop_oneof![
        (0..CONTEXTS).prop_map(At::Context),
        (0..2usize).prop_map(At::Device),
        Just(At::Process),
    ];
    prop_oneof![
        6 => (0..CONTEXTS, bytes.clone(), any::<bool>())
            .prop_map(|(ctx, bytes, cache)| Step::Allocate { ctx, bytes, cache }),
        3 => (0..CONTEXTS, any::<usize>()).prop_map(|(ctx, index)| Step::Release { ctx, index }),
        1 => (at, bytes).prop_map(|(at, bytes)| Step::Outside { at, bytes }),
        1 => any::<usize>().prop_map(Step::DropOutside),
    ]
}

/// What the model keeps of one level.
#[derive(Debug, Clone, Copy, Default)]
struct Level {
    limit: u64,
    charged: u64,
    outside: u64,
}

impl Level {
    fn fits(&self, bytes: u64) -> bool {
        self.charged
            .checked_add(bytes)
            .is_some_and(|n| n <= self.limit)
    }
}

/// The reference model.
#[derive(Debug, Clone)]
struct Model {
    contexts: [Level; CONTEXTS],
    devices: [Level; 2],
    process: Level,
    priority: [u32; CONTEXTS],
    kept: [Vec<u64>; CONTEXTS],
    cache: [Vec<u64>; CONTEXTS],
    /// Live outside records, in the order made.
    outside: Vec<(At, u64)>,
}

impl Model {
    /// The levels a charge on context `c` is on.
    fn chain(&mut self, c: usize) -> [&mut Level; 3] {
        let d = device_of(c);
        [
            &mut self.contexts[c],
            &mut self.devices[d],
            &mut self.process,
        ]
    }

    fn charge(&mut self, c: usize, bytes: u64) {
        for l in self.chain(c) {
            l.charged += bytes;
        }
    }

    fn uncharge(&mut self, c: usize, bytes: u64) {
        for l in self.chain(c) {
            l.charged -= bytes;
        }
    }

    /// The first level on `c`'s chain that refuses `bytes`, in the order a
    /// charge takes them.
    fn refusing(&self, c: usize, bytes: u64) -> Option<At> {
        let d = device_of(c);
        if !self.contexts[c].fits(bytes) {
            Some(At::Context(c))
        } else if !self.devices[d].fits(bytes) {
            Some(At::Device(d))
        } else if !self.process.fits(bytes) {
            Some(At::Process)
        } else {
            None
        }
    }

    /// The first limit `bytes` exceeds on its own.
    fn never_fits(&self, c: usize, bytes: u64) -> Option<At> {
        let d = device_of(c);
        if bytes > self.contexts[c].limit {
            Some(At::Context(c))
        } else if bytes > self.devices[d].limit {
            Some(At::Device(d))
        } else if bytes > self.process.limit {
            Some(At::Process)
        } else {
            None
        }
    }

    /// Context `v`'s responder: gives back its cache.
    fn respond(&mut self, v: usize) -> u64 {
        let freed: u64 = self.cache[v].drain(..).sum();
        self.uncharge(v, freed);
        freed
    }

    /// The contexts asked for a refusal at `at`, in the order asked.
    fn victims(&self, requester: usize, at: At) -> Vec<usize> {
        let mut members: Vec<usize> = match at {
            At::Context(c) => return vec![c],
            At::Device(d) => vec![2 * d, 2 * d + 1],
            At::Process => (0..CONTEXTS).collect(),
        };
        members.sort_by_key(|&m| (self.priority[m], m != requester));
        members
    }

    /// Allocate `bytes` on `c`: `Ok(asked)` with the responders asked, or
    /// `Err((scope, asked))`.
    #[allow(clippy::type_complexity)]
    fn allocate(&mut self, c: usize, bytes: u64) -> Result<Vec<usize>, (At, Vec<usize>)> {
        let mut asked = Vec::new();
        let Some(at) = self.refusing(c, bytes) else {
            self.charge(c, bytes);
            return Ok(asked);
        };
        if let Some(never) = self.never_fits(c, bytes) {
            return Err((never, asked));
        }
        if let At::Context(_) = at {
            asked.push(c);
            self.respond(c);
        } else {
            // Claim over the limits, then ask until every level fits;
            // another round (at most 3) while a round freed something.
            self.charge(c, bytes);
            let mut done = self.chain_fits(c);
            'rounds: for _ in 0..3 {
                if done {
                    break;
                }
                let mut freed = 0;
                for v in self.victims(c, at) {
                    asked.push(v);
                    freed += self.respond(v);
                    if self.chain_fits(c) {
                        done = true;
                        break 'rounds;
                    }
                }
                if freed == 0 {
                    break;
                }
            }
            if done {
                return Ok(asked);
            }
            self.uncharge(c, bytes);
        }
        match self.refusing(c, bytes) {
            None => {
                self.charge(c, bytes);
                Ok(asked)
            }
            Some(again) => Err((self.never_fits(c, bytes).unwrap_or(again), asked)),
        }
    }

    fn chain_fits(&self, c: usize) -> bool {
        let d = device_of(c);
        [self.contexts[c], self.devices[d], self.process]
            .iter()
            .all(|l| l.charged <= l.limit)
    }

    fn record_outside(&mut self, at: At, bytes: u64) {
        let levels: Vec<&mut Level> = match at {
            At::Context(c) => self.chain(c).into_iter().collect(),
            At::Device(d) => vec![&mut self.devices[d], &mut self.process],
            At::Process => vec![&mut self.process],
        };
        for l in levels {
            l.charged += bytes;
            l.outside += bytes;
        }
    }

    fn drop_outside(&mut self, at: At, bytes: u64) {
        let levels: Vec<&mut Level> = match at {
            At::Context(c) => self.chain(c).into_iter().collect(),
            At::Device(d) => vec![&mut self.devices[d], &mut self.process],
            At::Process => vec![&mut self.process],
        };
        for l in levels {
            l.charged -= bytes;
            l.outside -= bytes;
        }
    }
}

type Cache = Arc<Mutex<Vec<DeviceBuffer<HostContext>>>>;

/// An outside record of any level.
enum Record {
    Context(OutsideUsage<HostContext>),
    Level(OutsideRecord),
}

impl Record {
    fn bytes(&self) -> u64 {
        match self {
            Self::Context(r) => r.bytes(),
            Self::Level(r) => r.bytes(),
        }
    }
}

/// The system under test.
struct World {
    m: Model,
    // Dropped in this order: records and buffers before the contexts.
    records: Vec<Record>,
    kept: Vec<Vec<DeviceBuffer<HostContext>>>,
    caches: Vec<Cache>,
    streams: Vec<GovernedStream<HostContext>>,
    asked: Arc<Mutex<Vec<usize>>>,
    contexts: Vec<ContextHandle<HostContext>>,
    devices: [SharedBudget; 2],
    process: ProcessBudget,
    _gov: Governor<HostContext>,
}

impl World {
    fn new(limits: &Limits) -> Self {
        let process = ProcessBudget::new("proc", limits.process);
        let devices = [
            SharedBudget::with_parent("gpu0", limits.devices[0], &process),
            SharedBudget::with_parent("gpu1", limits.devices[1], &process),
        ];
        let gov = Governor::new();
        let asked = Arc::new(Mutex::new(Vec::new()));
        let mut contexts = Vec::new();
        let mut streams = Vec::new();
        let mut caches = Vec::new();
        for c in 0..CONTEXTS {
            let host = HostContext::new(HostConfig {
                capacity: 1 << 30,
                ..HostConfig::default()
            })
            .unwrap();
            let ctx = gov.register(
                host,
                ContextConfig::new()
                    .label(format!("c{c}"))
                    .budget(limits.contexts[c])
                    .shared_budget(devices[device_of(c)].clone()),
            );
            let s = ctx.create_stream("s").unwrap();
            let cache: Cache = Arc::default();
            let (cache2, s2, asked2) = (cache.clone(), s.clone(), asked.clone());
            ctx.add_pressure_responder(limits.priority[c], move |_| {
                asked2.lock().unwrap().push(c);
                let freed: Vec<_> = cache2.lock().unwrap().drain(..).collect();
                let bytes = freed.iter().map(|b| b.len()).sum();
                drop(freed);
                s2.synchronize().unwrap();
                bytes
            });
            contexts.push(ctx);
            streams.push(s);
            caches.push(cache);
        }
        let level = |limit| Level {
            limit,
            ..Level::default()
        };
        Self {
            m: Model {
                contexts: limits.contexts.map(level),
                devices: limits.devices.map(level),
                process: level(limits.process),
                priority: limits.priority,
                kept: Default::default(),
                cache: Default::default(),
                outside: Vec::new(),
            },
            records: Vec::new(),
            kept: (0..CONTEXTS).map(|_| Vec::new()).collect(),
            caches,
            streams,
            asked,
            contexts,
            devices,
            process,
            _gov: gov,
        }
    }

    fn scope(&self, at: At) -> BudgetScope {
        match at {
            At::Context(_) => BudgetScope::Context,
            At::Device(d) => BudgetScope::Shared(self.devices[d].label().to_owned()),
            At::Process => BudgetScope::Process(self.process.label().to_owned()),
        }
    }

    fn limit(&self, at: At) -> u64 {
        match at {
            At::Context(c) => self.m.contexts[c].limit,
            At::Device(d) => self.m.devices[d].limit,
            At::Process => self.m.process.limit,
        }
    }

    fn apply(&mut self, step: &Step) -> Result<(), TestCaseError> {
        match *step {
            Step::Allocate { ctx, bytes, cache } => {
                self.asked.lock().unwrap().clear();
                let expected = self.m.allocate(ctx, bytes);
                let got =
                    self.contexts[ctx].allocate(&self.streams[ctx], Alloc::new(bytes, Role::Other));
                let asked = std::mem::take(&mut *self.asked.lock().unwrap());
                if !asked.is_empty() {
                    RECLAIMS.fetch_add(1, Ordering::Relaxed);
                }
                match (expected, got) {
                    (Ok(want), Ok(buffer)) => {
                        ADMITTED.fetch_add(1, Ordering::Relaxed);
                        prop_assert_eq!(asked, want, "responders asked");
                        prop_assert!(self.m.chain_fits(ctx), "admitted over a limit");
                        if cache {
                            self.m.cache[ctx].push(bytes);
                            self.caches[ctx].lock().unwrap().push(buffer);
                        } else {
                            self.m.kept[ctx].push(bytes);
                            self.kept[ctx].push(buffer);
                        }
                    }
                    (Err((at, want)), Err(e)) => {
                        prop_assert_eq!(asked, want, "responders asked");
                        REFUSED[match at {
                            At::Context(_) => 0,
                            At::Device(_) => 1,
                            At::Process => 2,
                        }]
                        .fetch_add(1, Ordering::Relaxed);
                        let b = e.budget();
                        prop_assert!(b.is_some(), "not a budget refusal: {}", e);
                        let b = b.unwrap();
                        prop_assert_eq!(&b.scope, &self.scope(at), "{}", e);
                        prop_assert_eq!(b.limit, self.limit(at), "{}", e);
                        prop_assert_eq!(b.requested, bytes);
                    }
                    (want, got) => {
                        prop_assert!(
                            false,
                            "model {:?}, governor {:?}",
                            want,
                            got.map(|b| b.len())
                        );
                    }
                }
            }
            Step::Release { ctx, index } => {
                if !self.kept[ctx].is_empty() {
                    let i = index % self.kept[ctx].len();
                    drop(self.kept[ctx].swap_remove(i));
                    let bytes = self.m.kept[ctx].swap_remove(i);
                    self.streams[ctx].synchronize().unwrap();
                    self.m.uncharge(ctx, bytes);
                }
            }
            Step::Outside { at, bytes } => {
                let record = match at {
                    At::Context(c) => Record::Context(self.contexts[c].report_outside(bytes)),
                    At::Device(d) => Record::Level(self.devices[d].report_outside(bytes)),
                    At::Process => Record::Level(self.process.report_outside(bytes)),
                };
                self.records.push(record);
                self.m.outside.push((at, bytes));
                self.m.record_outside(at, bytes);
            }
            Step::DropOutside(index) => {
                if !self.records.is_empty() {
                    let i = index % self.records.len();
                    let record = self.records.swap_remove(i);
                    let (at, bytes) = self.m.outside.swap_remove(i);
                    prop_assert_eq!(record.bytes(), bytes);
                    drop(record);
                    self.m.drop_outside(at, bytes);
                }
            }
        }
        self.check()
    }

    /// Every level's totals are the model's, and none is over its limit
    /// but by outside records.
    fn check(&self) -> Result<(), TestCaseError> {
        let mut levels = Vec::new();
        for (c, ctx) in self.contexts.iter().enumerate() {
            // The model is quiet between steps: the books balance exactly.
            if let Err(e) = ctx.check_books() {
                prop_assert!(false, "{}", e);
            }
            let s = ctx.snapshot();
            levels.push((
                format!("c{c}"),
                s.charged,
                s.outside_bytes,
                self.m.contexts[c],
            ));
        }
        for (d, dev) in self.devices.iter().enumerate() {
            levels.push((
                dev.label().to_owned(),
                dev.charged(),
                dev.outside(),
                self.m.devices[d],
            ));
        }
        let p = &self.process;
        levels.push(("proc".into(), p.charged(), p.outside(), self.m.process));
        for (name, charged, outside, want) in levels {
            prop_assert_eq!(charged, want.charged, "{} charged", name);
            prop_assert_eq!(outside, want.outside, "{} outside", name);
            if charged > want.limit {
                OVER_BY_OUTSIDE.fetch_add(1, Ordering::Relaxed);
            }
            prop_assert!(
                charged - outside <= want.limit,
                "{} over its limit: {} charged, {} outside, {} limit",
                name,
                charged,
                outside,
                want.limit
            );
        }
        for dev in &self.devices {
            prop_assert_eq!(dev.pending(), 0, "{} pending", dev.label());
        }
        Ok(())
    }

    /// Drop every buffer and record, retire every context: every level is
    /// back to 0.
    fn finish(mut self) -> Result<(), TestCaseError> {
        self.records.clear();
        for c in 0..CONTEXTS {
            self.kept[c].clear();
            self.caches[c].lock().unwrap().clear();
            self.streams[c].synchronize().unwrap();
        }
        self.streams.clear();
        for ctx in &self.contexts {
            ctx.retire()
                .wait(Instant::now() + Duration::from_secs(10))
                .map_err(|e| TestCaseError::fail(format!("retire: {e}")))?;
            let s = ctx.snapshot();
            prop_assert_eq!((s.charged, s.outside_bytes), (0, 0), "{}", ctx.label());
        }
        for dev in &self.devices {
            prop_assert_eq!(
                (dev.charged(), dev.pending(), dev.outside()),
                (0, 0, 0),
                "{}",
                dev.label()
            );
        }
        let p = &self.process;
        prop_assert_eq!((p.charged(), p.pending(), p.outside()), (0, 0, 0));
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Limits {
    contexts: [u64; CONTEXTS],
    devices: [u64; 2],
    process: u64,
    priority: [u32; CONTEXTS],
}

fn limits() -> impl Strategy<Value = Limits> {
    let limit = (2u64..24).prop_map(|k| k * 64 * KIB);
    (
        proptest::array::uniform4(limit.clone()),
        proptest::array::uniform2(limit.clone()),
        limit.prop_map(|l| l * 2),
        proptest::array::uniform4(0u32..3),
    )
        .prop_map(|(contexts, devices, process, priority)| Limits {
            contexts,
            devices,
            process,
            priority,
        })
}

static ADMITTED: AtomicU64 = AtomicU64::new(0);
static RECLAIMS: AtomicU64 = AtomicU64::new(0);
/// Refusals by the context, device and process levels.
static REFUSED: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
static OVER_BY_OUTSIDE: AtomicU64 = AtomicU64::new(0);

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

/// The tree against its model, `PROPTEST_CASES` cases of up to 60 steps.
#[test]
fn budget_tree_matches_reference_model() {
    let config = ProptestConfig {
        cases: cases(),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let strategy = (limits(), proptest::collection::vec(step(), 1..60));
    let start = Instant::now();
    let result = runner.run(&strategy, |(limits, steps)| {
        let mut w = World::new(&limits);
        for s in &steps {
            w.apply(s)?;
        }
        w.finish()
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
    println!(
        "properties_tree: {} cases, {} allocations admitted, {} asked responders, refused by context/device/process {}/{}/{}, {} level-steps over a limit by outside memory; {:.1?}",
        cases(),
        ld(&ADMITTED),
        ld(&RECLAIMS),
        ld(&REFUSED[0]),
        ld(&REFUSED[1]),
        ld(&REFUSED[2]),
        ld(&OVER_BY_OUTSIDE),
        start.elapsed()
    );
    if cases() >= 100 {
        for (what, n) in [
            ("admitted", ld(&ADMITTED)),
            ("reclaims", ld(&RECLAIMS)),
            ("context refusals", ld(&REFUSED[0])),
            ("device refusals", ld(&REFUSED[1])),
            ("process refusals", ld(&REFUSED[2])),
            ("levels over by outside memory", ld(&OVER_BY_OUTSIDE)),
        ] {
            assert!(n > 0, "no case reached {what}");
        }
    }
}
