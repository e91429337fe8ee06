//! State-machine property tests of the block cache.
//!
//! Random sequences of operations on a caching context (create and drop
//! streams, allocate sizes around the class boundaries and past the largest
//! cached block, drop, release on another stream, record another stream
//! then drop, trim, retirement of the queued frees, and a refused
//! `free_async` that quarantines the memory) run against
//! `Watched<FaultInjecting<HostContext>>`, with retirements held in the wrapper so that
//! "pending" is deterministic, and are checked after **every step** against a
//! reference model of the cache (which stream keeps which block, by class,
//! in which order):
//!
//! * no block is handed out twice: an allocation never returns memory that
//!   is live or cached;
//! * a hit is exactly the block the model predicts, from the allocating
//!   stream's own cache, and makes no backend call; a miss makes one, and
//!   never returns a block cached anywhere (so no block freed on one stream
//!   reaches another before its stream-ordered free has retired: the only
//!   way to another stream is through the backend);
//! * `charged == live + cached + pending + quarantined` at every step, and
//!   each figure is the model's (a refused free of a cached block, on its
//!   way out by trim, eviction or a stream's drop, is quarantined like a
//!   buffer's, and its release error is reported when one was asked for);
//! * at the end (retire, which flushes the cache) every byte is returned,
//!   every free retired and the host probe saw a clean teardown.
//!
//! Cases: `PROPTEST_CASES` (default 256). CI (`scripts/ci/20-properties.sh`)
//! runs more.

use memgov::fault::{Fault, FaultControl, FaultInjecting, FaultPlan, Operation};
use memgov::host::{HostConfig, HostContext};
use memgov::{
    size_class, Alloc, BackendProbe, CacheConfig, ContextConfig, ContextHandle, DeviceBuffer,
    GovernedStream, Governor, Role,
};
use memgov_conformance::{WatchLog, Watched};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Backend = Watched<FaultInjecting<HostContext>>;

/// The cache keeps at most this much, in blocks of at most `MAX_BLOCK`.
const MAX_BYTES: u64 = 256 << 10;
const MAX_BLOCK: u64 = 96 << 10;

#[derive(Debug, Clone)]
enum Step {
    CreateStream,
    DropStream(usize),
    Allocate {
        stream: usize,
        bytes: u64,
        role: usize,
    },
    Drop(usize),
    ReleaseOn {
        buf: usize,
        stream: usize,
    },
    RecordThenDrop {
        buf: usize,
        stream: usize,
    },
    Trim(u64),
    /// Synchronize every stream and let the held retirements through.
    Retire,
    /// The next `free_async` (a buffer's, or a cached block's on its way
    /// out) is refused: the memory is quarantined until teardown.
    RefuseNextFree,
}

fn step() -> impl Strategy<Value = Step> {
    let idx = 0usize..8;
    // Few distinct classes, so that hits are common; some past MAX_BLOCK.
    let bytes = prop_oneof![
        4 => (1u64..=4).prop_map(|k| k * 512 - 100),
        2 => (1u64..=3).prop_map(|k| k * (32 << 10)),
        1 => (MAX_BLOCK - 10)..=(MAX_BLOCK + 10),
        1 => 1u64..=(200 << 10),
    ];
    prop_oneof![
        3 => Just(Step::CreateStream),
        1 => idx.clone().prop_map(Step::DropStream),
        12 => (idx.clone(), bytes, 0usize..5).prop_map(|(stream, bytes, role)| Step::Allocate { stream, bytes, role }),
        8 => idx.clone().prop_map(Step::Drop),
        2 => (idx.clone(), idx.clone()).prop_map(|(buf, stream)| Step::ReleaseOn { buf, stream }),
        1 => (idx.clone(), idx.clone()).prop_map(|(buf, stream)| Step::RecordThenDrop { buf, stream }),
        1 => prop_oneof![Just(1u64), Just(64u64 << 10), Just(u64::MAX)].prop_map(Step::Trim),
        2 => Just(Step::Retire),
        1 => Just(Step::RefuseNextFree),
    ]
}

/// Where a block (by address) is, in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Where {
    Live,
    Cached(usize),
    /// Its free was refused: owned by the backend until teardown.
    Quarantined,
}

struct StreamModel {
    /// The handle; `None` once dropped (the stream lives on while buffers
    /// allocated on it do).
    handle: Option<GovernedStream<Backend>>,
    /// Live buffers allocated on it.
    buffers: usize,
    /// Class -> (stamp, address), most recently cached last.
    cache: BTreeMap<u64, Vec<(u64, usize)>>,
}

struct Buf {
    buffer: DeviceBuffer<Backend>,
    stream: usize,
    class: u64,
    addr: usize,
}

struct Harness {
    _gov: Governor<Backend>,
    ctx: ContextHandle<Backend>,
    log: Arc<WatchLog>,
    faults: FaultControl<HostContext>,
    /// Whether the next `free_async` will be refused.
    refuse_next_free: bool,
    probe: BackendProbe,
    /// In creation order; `None` once gone (handle dropped, no buffers).
    streams: Vec<Option<StreamModel>>,
    bufs: Vec<Buf>,
    blocks: HashMap<usize, Where>,
    live: u64,
    cached: u64,
    pending: u64,
    quarantined: u64,
    /// Blocks cached so far: the next one's stamp.
    clock: u64,
}

fn role(i: usize) -> Role {
    Role::ALL[i % Role::ALL.len()]
}

impl Harness {
    fn new() -> Self {
        let gov = Governor::new();
        let host = HostContext::new(HostConfig::default()).unwrap();
        let probe = host.probe();
        let faulty = FaultInjecting::new(host, FaultPlan::new());
        let faults = faulty.control();
        let device = Watched::new(faulty);
        let log = device.log();
        log.hold_retirements(true);
        let ctx = gov.register(
            device,
            ContextConfig::new()
                .label("prop-cache")
                .cache(CacheConfig::new(MAX_BYTES).max_block(MAX_BLOCK)),
        );
        Self {
            _gov: gov,
            ctx,
            log,
            faults,
            refuse_next_free: false,
            probe,
            streams: Vec::new(),
            bufs: Vec::new(),
            blocks: HashMap::new(),
            live: 0,
            cached: 0,
            pending: 0,
            quarantined: 0,
            clock: 0,
        }
    }

    fn calls(&self) -> u64 {
        self.log.calls.load(Ordering::SeqCst)
    }

    fn stream_index(&self, i: usize) -> Option<usize> {
        let alive: Vec<usize> = (0..self.streams.len())
            .filter(|&s| self.streams[s].as_ref().is_some_and(|m| m.handle.is_some()))
            .collect();
        (!alive.is_empty()).then(|| alive[i % alive.len()])
    }

    /// A stream whose handle is gone and whose last buffer left: dropped,
    /// and its cache freed stream-ordered.
    fn maybe_gone(&mut self, s: usize) {
        let m = self.streams[s].as_ref().unwrap();
        if m.handle.is_none() && m.buffers == 0 {
            let m = self.streams[s].take().unwrap();
            for (class, addrs) in m.cache {
                for (_, a) in addrs {
                    self.cached -= class;
                    self.free(class, a);
                }
            }
        }
    }

    /// The model of one stream-ordered free of `class` bytes at `addr`:
    /// pending, or quarantined when the backend refuses it.
    fn free(&mut self, class: u64, addr: usize) {
        if std::mem::take(&mut self.refuse_next_free) {
            self.quarantined += class;
            self.blocks.insert(addr, Where::Quarantined);
        } else {
            self.pending += class;
            self.blocks.remove(&addr);
        }
    }

    fn apply(&mut self, step: &Step) -> Result<(), TestCaseError> {
        match *step {
            Step::CreateStream => {
                let label = format!("s{}", self.streams.len());
                let handle = self.ctx.create_stream(&label).unwrap();
                self.streams.push(Some(StreamModel {
                    handle: Some(handle),
                    buffers: 0,
                    cache: BTreeMap::new(),
                }));
            }
            Step::DropStream(i) => {
                if let Some(s) = self.stream_index(i) {
                    self.streams[s].as_mut().unwrap().handle = None;
                    self.maybe_gone(s);
                }
            }
            Step::Allocate {
                stream,
                bytes,
                role: r,
            } => {
                let Some(s) = self.stream_index(stream) else {
                    return Ok(());
                };
                let class = if bytes <= MAX_BLOCK {
                    size_class(bytes)
                } else {
                    bytes
                };
                let predicted = self.streams[s]
                    .as_mut()
                    .unwrap()
                    .cache
                    .get_mut(&class)
                    .and_then(|v| v.pop())
                    .map(|(_, a)| a);
                let before = self.calls();
                let handle = self.streams[s].as_ref().unwrap().handle.clone().unwrap();
                let buffer = self
                    .ctx
                    .allocate(&handle, Alloc::new(bytes, role(r)))
                    .unwrap();
                prop_assert_eq!((buffer.len(), buffer.charged()), (bytes, class));
                let addr = buffer.raw().unwrap().as_ptr() as usize;
                match predicted {
                    Some(p) => {
                        prop_assert_eq!(addr, p, "a hit hands out the block cached last");
                        prop_assert_eq!(self.blocks.get(&addr), Some(&Where::Cached(s)));
                        prop_assert_eq!(self.calls(), before, "a hit calls nothing");
                        self.cached -= class;
                    }
                    None => {
                        prop_assert!(self.calls() > before, "a miss allocates");
                        prop_assert!(
                            !self.blocks.contains_key(&addr),
                            "a fresh allocation returned a block the model holds: {:?}",
                            self.blocks.get(&addr)
                        );
                    }
                }
                self.blocks.insert(addr, Where::Live);
                self.live += class;
                self.streams[s].as_mut().unwrap().buffers += 1;
                self.bufs.push(Buf {
                    buffer,
                    stream: s,
                    class,
                    addr,
                });
            }
            Step::Drop(i) => {
                if !self.bufs.is_empty() {
                    let b = self.bufs.swap_remove(i % self.bufs.len());
                    let (buffer, rest) = (b.buffer, (b.stream, b.class, b.addr));
                    drop(buffer);
                    self.release_model_parts(rest, true);
                }
            }
            Step::ReleaseOn { buf, stream } => {
                if self.bufs.is_empty() {
                    return Ok(());
                }
                let Some(s) = self.stream_index(stream) else {
                    return Ok(());
                };
                let b = self.bufs.swap_remove(buf % self.bufs.len());
                let target = self.streams[s].as_ref().unwrap().handle.clone().unwrap();
                let own = b.stream == s;
                let rest = (b.stream, b.class, b.addr);
                let result = b.buffer.release_on(&target);
                drop(target);
                // On another stream: an ordinary free, pending there.
                self.release_model_parts(rest, own);
                // Its own free refused: the error says so, the buffer is gone.
                if self.blocks.get(&rest.2) == Some(&Where::Quarantined) {
                    prop_assert!(
                        matches!(
                            &result,
                            Err(e) if e.buffer.is_none()
                                && matches!(e.error, memgov::GovernorError::Backend { .. })
                        ),
                        "{result:?}"
                    );
                } else {
                    prop_assert!(result.is_ok(), "{result:?}");
                }
            }
            Step::RecordThenDrop { buf, stream } => {
                if self.bufs.is_empty() {
                    return Ok(());
                }
                let Some(s) = self.stream_index(stream) else {
                    return Ok(());
                };
                let mut b = self.bufs.swap_remove(buf % self.bufs.len());
                let other = self.streams[s].as_ref().unwrap().handle.clone().unwrap();
                b.buffer.record_stream(&other).unwrap();
                drop(other);
                let cacheable = b.stream == s; // recording its own stream changes nothing
                let rest = (b.stream, b.class, b.addr);
                drop(b.buffer);
                self.release_model_parts(rest, cacheable);
            }
            Step::Trim(bytes) => {
                let released = self.ctx.trim_cache(bytes);
                let mut expected = 0u64;
                while expected < bytes {
                    // The largest class; among streams holding it, the last
                    // created.
                    let mut best: Option<(u64, usize)> = None;
                    for (s, m) in self.streams.iter().enumerate() {
                        let Some(m) = m else { continue };
                        if let Some((&c, _)) = m.cache.iter().rev().find(|(_, v)| !v.is_empty()) {
                            if best.is_none_or(|(bc, _)| c >= bc) {
                                best = Some((c, s));
                            }
                        }
                    }
                    let Some((class, s)) = best else { break };
                    let (_, addr) = self.streams[s]
                        .as_mut()
                        .unwrap()
                        .cache
                        .get_mut(&class)
                        .unwrap()
                        .pop()
                        .unwrap();
                    self.cached -= class;
                    self.free(class, addr);
                    expected += class;
                }
                prop_assert_eq!(released, expected);
            }
            Step::Retire => self.settle(),
            Step::RefuseNextFree => {
                self.faults
                    .set_plan(FaultPlan::new().nth(Operation::FreeAsync, 1, Fault::Error));
                self.refuse_next_free = true;
            }
        }
        Ok(())
    }

    fn release_model_parts(&mut self, (stream, class, addr): (usize, u64, usize), cacheable: bool) {
        // `release_model` without the buffer (already released).
        let s = stream;
        self.live -= class;
        let cacheable = cacheable && class <= MAX_BLOCK && size_class(class) == class;
        if cacheable && self.cached + class > MAX_BYTES {
            // Full: the stream's oldest blocks make room, if they are enough.
            let need = self.cached + class - MAX_BYTES;
            let m = self.streams[s].as_mut().unwrap();
            let held: u64 = m.cache.iter().map(|(c, v)| c * v.len() as u64).sum();
            if class <= MAX_BYTES && held >= need {
                let mut evicted = Vec::new();
                let mut bytes = 0;
                while bytes < need {
                    let (&c, _) = m
                        .cache
                        .iter()
                        .filter(|(_, v)| !v.is_empty())
                        .min_by_key(|(_, v)| v[0].0)
                        .unwrap();
                    let (_, a) = m.cache.get_mut(&c).unwrap().remove(0);
                    evicted.push((c, a));
                    bytes += c;
                }
                for (c, a) in evicted {
                    self.cached -= c;
                    self.free(c, a);
                }
            }
        }
        if cacheable && self.cached + class <= MAX_BYTES {
            self.cached += class;
            self.blocks.insert(addr, Where::Cached(s));
            let stamp = self.clock;
            self.clock += 1;
            let m = self.streams[s].as_mut().unwrap();
            m.cache.entry(class).or_default().push((stamp, addr));
        } else {
            self.free(class, addr);
        }
        self.streams[s].as_mut().unwrap().buffers -= 1;
        self.maybe_gone(s);
    }

    /// Every free queued so far executes and its retirement reaches the
    /// governor.
    fn settle(&mut self) {
        for m in self.streams.iter().flatten() {
            if let Some(h) = &m.handle {
                h.synchronize().unwrap();
            }
        }
        // Frees queued on streams dropped since execute on the host's
        // stream workers, which may still be running them: wait until every
        // queued free has fired (and was parked), then let them through.
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.log.in_flight() > 0 {
            assert!(Instant::now() < deadline, "{}", self.log.summary());
            std::thread::yield_now();
        }
        self.log.release_held();
        self.pending = 0;
    }

    fn check(&self) -> Result<(), TestCaseError> {
        // The model is quiet between steps: the books balance exactly.
        if let Err(e) = self.ctx.check_books() {
            prop_assert!(false, "{}", e);
        }
        let snap = self.ctx.snapshot();
        let total = snap.total();
        prop_assert_eq!(total.live_bytes, self.live, "live");
        prop_assert_eq!(snap.cache.cached_bytes, self.cached, "cached");
        prop_assert_eq!(total.pending_bytes, self.pending, "pending");
        prop_assert_eq!(total.quarantined_bytes, self.quarantined, "quarantined");
        prop_assert_eq!(
            snap.charged,
            total.live_bytes
                + snap.cache.cached_bytes
                + total.pending_bytes
                + total.quarantined_bytes,
            "charged == live + cached + pending + quarantined"
        );
        let by_class: u64 = snap.cache.by_class.iter().map(|(c, n)| c * n).sum();
        prop_assert_eq!(by_class, self.cached, "by class");
        prop_assert!(self.cached <= MAX_BYTES);
        Ok(())
    }

    fn finish(mut self) -> Result<(), TestCaseError> {
        // The end is not modelled step by step: nothing is refused there.
        self.faults.set_plan(FaultPlan::new());
        self.refuse_next_free = false;
        for b in std::mem::take(&mut self.bufs) {
            drop(b.buffer);
        }
        let retire = self.ctx.retire();
        prop_assert_eq!(self.ctx.snapshot().cache.cached_bytes, 0, "retire flushed");
        for m in self.streams.iter_mut().flatten() {
            m.handle = None;
        }
        self.log.hold_retirements(false);
        self.log.release_held();
        let report = retire
            .wait(Instant::now() + Duration::from_secs(20))
            .map_err(|e| TestCaseError::fail(format!("{e}: {}", self.log.summary())))?;
        prop_assert!(!report.lost);
        prop_assert_eq!(report.quarantined_bytes, self.quarantined);
        prop_assert_eq!(self.log.in_flight(), 0, "{}", self.log.summary());
        prop_assert_eq!(
            self.probe.violations(),
            0,
            "{:?}",
            self.probe.violation_log()
        );
        self.probe
            .check_clean_teardown()
            .map_err(TestCaseError::fail)?;
        prop_assert_eq!(self.probe.used_bytes(), 0);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
        .. ProptestConfig::default()
    })]

    #[test]
    fn the_cache_matches_its_model(steps in proptest::collection::vec(step(), 1..60)) {
        let mut h = Harness::new();
        h.apply(&Step::CreateStream)?;
        h.apply(&Step::CreateStream)?;
        for s in &steps {
            h.apply(s)?;
            h.check()?;
        }
        h.finish()?;
    }
}
