//! `memgov bench`: the governor's cost against the physical floor, measured
//! against a baseline in the same run, printed as medians and ratios.
//!
//! Every figure is compared with a baseline measured in the same process,
//! samples of figure and baseline interleaved, so that a noisy machine moves
//! both. Ratios are what the targets are about; absolute numbers are printed
//! for orientation only. The same workloads exist as criterion benches under
//! `benches/` (see `docs/performance.md`).
//!
//! Flags: `--quick` (fewer, shorter samples: a smoke run of a few seconds),
//! `--json` (one JSON object instead of the table), `--filter WORD` (only rows
//! whose key or figure contains WORD), `--list`.
//!
//! The heap-bytes rows need [`CountingAllocator`] as the process's global
//! allocator; without it they print `n/a`.

mod alloc;

pub use alloc::{counting_allocator_installed, CountingAllocator, HeapCounter, HeapDelta};

use crate::host::{HostConfig, HostContext};
use crate::null::NullContext;
use crate::{
    ContextConfig, ContextHandle, DeviceContext, GovernedStream, Governor, RetireSignal, Role,
};
use std::hint::black_box;
use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What a row's ratio must satisfy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    /// ratio <= x
    AtMost(f64),
    /// ratio >= x
    AtLeast(f64),
    /// value <= x in the row's unit (no baseline)
    ValueAtMost(f64),
}

impl Target {
    fn describe(&self, unit: &str) -> String {
        match *self {
            Target::AtMost(x) => format!("<= {x}x"),
            Target::AtLeast(x) => format!(">= {x}x"),
            Target::ValueAtMost(x) => format!("<= {x} {unit}"),
        }
    }
}

/// One line of the table.
#[derive(Debug, Clone)]
pub struct Row {
    /// Short key, for `--filter`.
    pub key: &'static str,
    /// What is measured.
    pub figure: String,
    /// What it is compared with.
    pub baseline: String,
    /// Median of the figure.
    pub value: Option<f64>,
    /// Median of the baseline.
    pub baseline_value: Option<f64>,
    /// Unit of `value` and `baseline_value`.
    pub unit: &'static str,
    /// The ratio the target is about.
    pub ratio: Option<f64>,
    /// The target.
    pub target: Target,
    /// Whether the target is met; `None` when the row could not be measured.
    pub met: Option<bool>,
    /// Why a row could not be measured, or how to read it.
    pub note: Option<String>,
}

impl Row {
    fn new(
        key: &'static str,
        figure: &str,
        baseline: &str,
        unit: &'static str,
        target: Target,
    ) -> Self {
        Self {
            key,
            figure: figure.into(),
            baseline: baseline.into(),
            value: None,
            baseline_value: None,
            unit,
            ratio: None,
            target,
            met: None,
            note: None,
        }
    }

    fn with(mut self, value: f64, baseline: Option<f64>, ratio: Option<f64>) -> Self {
        self.value = Some(value);
        self.baseline_value = baseline;
        self.ratio = ratio;
        self.met = Some(match self.target {
            Target::AtMost(x) => ratio.is_some_and(|r| r <= x),
            Target::AtLeast(x) => ratio.is_some_and(|r| r >= x),
            Target::ValueAtMost(x) => value <= x,
        });
        self
    }

    fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }
}

/// How long and how often to measure.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Samples of each side.
    pub samples: usize,
    /// Target length of one sample.
    pub sample: Duration,
    /// Samples of the teardown wake-up (one hand-off each).
    pub wakeups: usize,
    /// Samples of the 1,000,000-release drain.
    pub big_drains: usize,
}

impl Plan {
    /// A few seconds in all: proves the rows run, numbers are rough.
    pub const QUICK: Plan = Plan {
        samples: 7,
        sample: Duration::from_millis(2),
        wakeups: 15,
        big_drains: 1,
    };
    /// The default: about half a minute.
    pub const FULL: Plan = Plan {
        samples: 31,
        sample: Duration::from_millis(10),
        wakeups: 101,
        big_drains: 7,
    };
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Nanoseconds per iteration of `f(iters)`, which runs `iters` iterations.
fn per_iter(f: &mut dyn FnMut(u64), iters: u64) -> f64 {
    let t = Instant::now();
    f(iters);
    t.elapsed().as_nanos() as f64 / iters as f64
}

/// Iterations that take about `sample`.
fn calibrate(f: &mut dyn FnMut(u64), sample: Duration) -> u64 {
    f(1); // warm up: first use of threads, caches, lazy statics
    let mut iters = 1u64;
    loop {
        let t = Instant::now();
        f(iters);
        let e = t.elapsed();
        if e >= sample / 4 || iters >= 1 << 30 {
            let scale = sample.as_nanos() as f64 / e.as_nanos().max(1) as f64;
            iters = ((iters as f64 * scale) as u64).max(1);
            break;
        }
        iters *= 2;
    }
    // A hiccup during the doubling makes the estimate too small; check it.
    for _ in 0..4 {
        let t = Instant::now();
        f(iters);
        let e = t.elapsed();
        if e >= sample / 2 || iters >= 1 << 30 {
            break;
        }
        iters = iters.saturating_mul(2);
    }
    iters
}

/// Medians of ns/iteration of `a` and `b`, samples interleaved.
fn compare(plan: &Plan, a: &mut dyn FnMut(u64), b: &mut dyn FnMut(u64)) -> (f64, f64) {
    let (na, nb) = (calibrate(a, plan.sample), calibrate(b, plan.sample));
    let (mut va, mut vb) = (Vec::new(), Vec::new());
    for i in 0..plan.samples {
        if i % 2 == 0 {
            va.push(per_iter(a, na));
            vb.push(per_iter(b, nb));
        } else {
            vb.push(per_iter(b, nb));
            va.push(per_iter(a, na));
        }
    }
    (median(&mut va), median(&mut vb))
}

fn arc_baseline() -> impl FnMut(u64) {
    let arc = Arc::new(0u64);
    move |n| {
        for _ in 0..n {
            drop(black_box(Arc::clone(black_box(&arc))));
        }
    }
}

const ARC: &str = "Arc::clone + drop";

fn row_pin(plan: &Plan) -> Row {
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new());
    let mut pin = |n: u64| {
        for _ in 0..n {
            drop(black_box(ctx.pin()));
        }
    };
    let (v, b) = compare(plan, &mut pin, &mut arc_baseline());
    Row::new(
        "pin",
        "concrete pin acquire + drop (ContextHandle::pin)",
        ARC,
        "ns",
        Target::AtMost(2.0),
    )
    .with(v, Some(b), Some(v / b))
}

fn row_boxed_pin(plan: &Plan) -> Row {
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new());
    let source = ctx.pin_source(Some("bench"));
    let mut pin = |n: u64| {
        for _ in 0..n {
            drop(black_box(source.pin()));
        }
    };
    let (v, b) = compare(plan, &mut pin, &mut arc_baseline());
    // The floor under any Box<dyn ProviderContextPin>: one heap allocation
    // and its free, whatever the pin does.
    let mut boxed = |n: u64| {
        for _ in 0..n {
            drop(black_box(Box::new(black_box(0usize))));
        }
    };
    let (floor, arc) = compare(plan, &mut boxed, &mut arc_baseline());
    Row::new(
        "boxed-pin",
        "Box<dyn ProviderContextPin> via pin_source().pin() + drop",
        ARC,
        "ns",
        Target::AtMost(4.0),
    )
    .with(v, Some(b), Some(v / b))
    .note(format!(
        "floor: Box::new(usize) + drop alone = {floor:.1} ns = {:.1}x Arc::clone + drop",
        floor / arc
    ))
}

fn row_null_cycle(plan: &Plan) -> Row {
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new().budget(1 << 40));
    let stream = ctx.create_stream("bench").expect("null stream");
    let mut cycle = |n: u64| {
        for _ in 0..n {
            drop(black_box(ctx.allocate(
                &stream,
                black_box(4096),
                Role::Activation,
            )));
        }
    };
    let (v, b) = compare(plan, &mut cycle, &mut arc_baseline());
    Row::new(
        "null-cycle",
        "governor's own cost: allocate + release, null backend (signal inline)",
        ARC,
        "ns",
        Target::AtMost(20.0),
    )
    .with(v, Some(b), Some(v / b))
}

fn row_host_cycle(plan: &Plan) -> Row {
    let row = Row::new(
        "host-cycle",
        "governed allocate + stream-ordered release, host backend",
        "raw host allocate + free_async on the same stream",
        "ns",
        Target::AtMost(1.2),
    );
    let gov = Governor::new();
    let ctx = match HostContext::new(HostConfig::default()) {
        Ok(h) => gov.register(h, ContextConfig::new()),
        Err(e) => return row.note(format!("host backend unavailable: {e}")),
    };
    let stream = ctx.create_stream("bench").expect("host stream");
    let raw = HostContext::new(HostConfig::default()).expect("host backend");
    let raw_stream = raw.create_stream().expect("host stream");
    // Each batch ends with a synchronize, so both sides pay for the frees
    // they queued (the stream worker executes them and fires the signals).
    let mut governed = |n: u64| {
        for _ in 0..n {
            drop(black_box(ctx.allocate(
                &stream,
                black_box(4096),
                Role::Activation,
            )));
        }
        stream.synchronize().expect("synchronize");
    };
    let mut baseline = |n: u64| {
        for _ in 0..n {
            let m = raw
                .allocate(&raw_stream, black_box(4096))
                .expect("raw allocate");
            if raw
                .free_async(&raw_stream, m, RetireSignal::from_fn(|_| {}))
                .is_err()
            {
                panic!("raw free_async refused");
            }
        }
        raw.synchronize(&raw_stream).expect("synchronize");
    };
    let (v, b) = compare(plan, &mut governed, &mut baseline);
    drop(stream);
    let _ = ctx.retire().wait_timeout(Duration::from_secs(10));
    let _ = raw.destroy_stream(raw_stream);
    let _ = raw.teardown(false);
    row.with(v, Some(b), Some(v / b))
}

/// Wall time per cycle of two threads running `n` cycles each on the two
/// given (context, stream) pairs, from the common start to the later finish.
fn two_thread_span(
    pairs: [(&ContextHandle<NullContext>, &GovernedStream<NullContext>); 2],
    n: u64,
) -> f64 {
    let barrier = Barrier::new(2);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let hs: Vec<_> = pairs
            .iter()
            .map(|&(ctx, st)| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    let t = Instant::now();
                    null_cycles(ctx, st, n);
                    (t, Instant::now())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench thread"))
            .collect()
    });
    let start = spans.iter().map(|s| s.0).min().expect("two spans");
    let end = spans.iter().map(|s| s.1).max().expect("two spans");
    end.duration_since(start).as_nanos() as f64 / (2 * n) as f64
}

fn null_cycles(ctx: &ContextHandle<NullContext>, stream: &GovernedStream<NullContext>, n: u64) {
    for _ in 0..n {
        drop(black_box(ctx.allocate(
            stream,
            black_box(4096),
            Role::Activation,
        )));
    }
}

fn row_two_threads(plan: &Plan) -> Row {
    let row = Row::new(
        "two-threads",
        "two threads, two streams of one context, null backend: ns per cycle",
        "one thread: ns per cycle",
        "ns",
        Target::AtLeast(1.5),
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let gov = Governor::new();
    let config = || ContextConfig::new().budget(1 << 40);
    let ctx = gov.register(NullContext::new(), config());
    let streams = [
        ctx.create_stream("a").expect("stream"),
        ctx.create_stream("b").expect("stream"),
    ];
    // The control: two contexts that share nothing, so that the run shows
    // what this machine lets two threads do right now.
    let other = gov.register(NullContext::new(), config());
    let other_stream = other.create_stream("c").expect("stream");
    let mut one = |n: u64| null_cycles(&ctx, &streams[0], n);
    let n = calibrate(&mut one, plan.sample);
    let (mut singles, mut shared, mut apart) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..plan.samples {
        singles.push(per_iter(&mut one, n));
        shared.push(two_thread_span(
            [(&ctx, &streams[0]), (&ctx, &streams[1])],
            n,
        ));
        apart.push(two_thread_span(
            [(&ctx, &streams[0]), (&other, &other_stream)],
            n,
        ));
    }
    let (v, b, c) = (
        median(&mut shared),
        median(&mut singles),
        median(&mut apart),
    );
    let control = b / c;
    let mut row = row.with(v, Some(b), Some(b / v)).note(format!(
        "ratio = throughput of two threads / one thread; control: two threads on two separate contexts (nothing shared) = {control:.2}x"
    ));
    if cores < 2 {
        row.note = Some(format!("only {cores} core available: the target needs two"));
        row.met = None;
    } else if control < 1.2 && row.met == Some(false) {
        row.note = Some(format!(
            "{}; the machine itself gives two threads less than 1.2x now, so the target cannot be judged in this run",
            row.note.unwrap_or_default()
        ));
        row.met = None;
    }
    row
}

/// One teardown wake-up: a thread waits in `RetireHandle::wait` for a
/// context whose last pending release is parked; the main thread fires it.
/// Returns the time from the firing to the wait returning (teardown
/// included).
pub fn wakeup_governed() -> Duration {
    let gov = Governor::new();
    let null = NullContext::deferred(1);
    let probe = null.probe();
    let ctx = gov.register(null, ContextConfig::new());
    let stream = ctx.create_stream("s").expect("stream");
    drop(
        ctx.allocate(&stream, 4096, Role::Activation)
            .expect("allocate"),
    );
    drop(stream);
    let handle = ctx.retire();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            tx.send(()).expect("main waits");
            let r = handle.wait(Instant::now() + Duration::from_secs(30));
            let t = Instant::now();
            assert!(r.is_ok(), "teardown wait failed: {r:?}");
            t
        });
        rx.recv().expect("waiter started");
        std::thread::sleep(Duration::from_millis(1)); // let it fall asleep
        let t0 = Instant::now();
        assert_eq!(probe.retire_parked(), 1);
        waiter.join().expect("waiter").duration_since(t0)
    })
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

fn row_wakeup(plan: &Plan) -> Row {
    let row = Row::new(
        "wakeup",
        "teardown wake-up: last retirement -> RetireHandle::wait returns",
        "bare Mutex + Condvar hand-off between two threads",
        "us",
        Target::AtMost(2.0),
    );
    let us = |d: Duration| d.as_nanos() as f64 / 1e3;
    let (mut gv, mut bv) = (Vec::new(), Vec::new());
    for i in 0..plan.wakeups {
        if i % 2 == 0 {
            gv.push(us(wakeup_governed()));
            bv.push(us(wakeup_bare()));
        } else {
            bv.push(us(wakeup_bare()));
            gv.push(us(wakeup_governed()));
        }
    }
    let (v, b) = (median(&mut gv), median(&mut bv));
    row.with(v, Some(b), Some(v / b))
        .note("the waiter sleeps on a condition variable; nothing polls")
}

/// Drain `n` pending releases at teardown: a thread waits in
/// `RetireHandle::wait` while the device fires every parked signal; the time
/// from the first firing to the wait returning, in milliseconds.
pub fn drain_once(n: usize) -> f64 {
    let gov = Governor::new();
    let null = NullContext::deferred(n);
    let probe = null.probe();
    let ctx = gov.register(null, ContextConfig::new());
    let stream = ctx.create_stream("s").expect("stream");
    for _ in 0..n {
        drop(
            ctx.allocate(&stream, 4096, Role::Activation)
                .expect("allocate"),
        );
    }
    drop(stream);
    let handle = ctx.retire();
    let (tx, rx) = std::sync::mpsc::channel();
    let ms = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            tx.send(()).expect("main waits");
            let r = handle.wait(Instant::now() + Duration::from_secs(600));
            let t = Instant::now();
            assert!(r.is_ok(), "teardown wait failed: {r:?}");
            t
        });
        rx.recv().expect("waiter started");
        std::thread::sleep(Duration::from_millis(1));
        let t0 = Instant::now();
        assert_eq!(probe.retire_parked(), n);
        let t1 = waiter.join().expect("waiter");
        t1.duration_since(t0).as_nanos() as f64 / 1e6
    });
    ms
}

fn row_drain(plan: &Plan) -> Row {
    let row = Row::new(
        "drain",
        "draining 1,000,000 pending releases at teardown (waiter waiting)",
        "draining 100,000",
        "ms",
        Target::AtMost(12.0),
    );
    let (mut big, mut small) = (Vec::new(), Vec::new());
    for _ in 0..plan.big_drains {
        for _ in 0..3 {
            small.push(drain_once(100_000));
        }
        big.push(drain_once(1_000_000));
    }
    // The fastest run of each size: a 1,000,000-release drain lasts several
    // scheduler time slices, so on a loaded machine its median measures the
    // other processes more than the drain (the 100,000 one mostly fits in
    // one slice and would look better than it is).
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (v, b) = (min(&big), min(&small));
    row.with(v, Some(b), Some(v / b)).note(format!(
        "fastest of {} and {} runs; linear growth is 10x",
        big.len(),
        small.len()
    ))
}

fn heap_rows() -> Vec<Row> {
    let live = Row::new(
        "heap-live",
        "heap bytes the governor allocates per live allocation",
        "counting global allocator",
        "B",
        Target::ValueAtMost(64.0),
    );
    let pending = Row::new(
        "heap-pending",
        "heap bytes the governor allocates per pending release",
        "counting global allocator",
        "B",
        Target::ValueAtMost(64.0),
    );
    if !counting_allocator_installed() {
        let why = "needs memgov::bench::CountingAllocator as the global allocator (see docs/performance.md)";
        return vec![live.note(why), pending.note(why)];
    }
    const N: usize = 10_000;
    let gov = Governor::new();
    let null = NullContext::deferred(N);
    let probe = null.probe();
    let ctx = gov.register(null, ContextConfig::new().budget(1 << 40));
    let stream = ctx.create_stream("s").expect("stream");
    let mut held = Vec::with_capacity(N);
    // Warm up whatever is allocated once (thread-locals, lazy statics).
    drop(
        ctx.allocate(&stream, 4096, Role::Activation)
            .expect("allocate"),
    );
    probe.retire_parked();

    let counter = HeapCounter::start();
    for _ in 0..N {
        held.push(
            ctx.allocate(&stream, 4096, Role::Activation)
                .expect("allocate"),
        );
    }
    let per_live = counter.finish();

    let counter = HeapCounter::start();
    held.clear(); // N releases, parked by the backend in room reserved up front
    let per_pending = counter.finish();
    assert_eq!(probe.parked_count(), N);
    probe.retire_parked();
    drop(held);
    drop(stream);
    let _ = ctx.retire().wait_timeout(Duration::from_secs(10));

    let b = |d: HeapDelta| d.net().max(0) as f64 / N as f64;
    let calls = |d: HeapDelta| {
        format!(
            "{:.2} heap allocations each",
            d.allocations as f64 / N as f64
        )
    };
    vec![
        live.with(b(per_live), None, None).note(calls(per_live)),
        pending
            .with(b(per_pending), None, None)
            .note(calls(per_pending)),
    ]
}

/// Every row, in the order of issue #5.
pub const ROWS: &[&str] = &[
    "pin",
    "boxed-pin",
    "null-cycle",
    "host-cycle",
    "two-threads",
    "wakeup",
    "heap",
    "drain",
    "vulkan-cycle",
];

fn vulkan_row(plan: &Plan) -> Row {
    let row = Row::new(
        "vulkan-cycle",
        "governed allocate + write + stream-ordered free, Vulkan backend",
        "the same cycle with raw ash + gpu-allocator",
        "ns",
        Target::AtMost(1.3),
    );
    #[cfg(feature = "vulkan")]
    {
        let iterations = if plan.samples <= Plan::QUICK.samples {
            200
        } else {
            2000
        };
        match crate::vulkan::bench::cycle_ratio(iterations) {
            Ok((governed, raw)) => {
                let (g, r) = (governed as f64, raw.max(1) as f64);
                row.with(g, Some(r), Some(g / r))
                    .note(format!("{iterations} cycles per side, interleaved rounds"))
            }
            Err(e) => row.note(format!("Vulkan unavailable: {e}")),
        }
    }
    #[cfg(not(feature = "vulkan"))]
    {
        let _ = plan;
        row.note("built without feature `vulkan`")
    }
}

/// Run the rows whose key or figure contains `filter` (all when `None`).
pub fn run(plan: &Plan, filter: Option<&str>, mut progress: impl FnMut(&str)) -> Vec<Row> {
    let wanted = |key: &str| filter.is_none_or(|f| key.contains(f));
    let mut rows = Vec::new();
    for &key in ROWS {
        if !wanted(key) {
            continue;
        }
        progress(key);
        match key {
            "pin" => rows.push(row_pin(plan)),
            "boxed-pin" => rows.push(row_boxed_pin(plan)),
            "null-cycle" => rows.push(row_null_cycle(plan)),
            "host-cycle" => rows.push(row_host_cycle(plan)),
            "two-threads" => rows.push(row_two_threads(plan)),
            "wakeup" => rows.push(row_wakeup(plan)),
            "heap" => rows.extend(heap_rows()),
            "drain" => rows.push(row_drain(plan)),
            "vulkan-cycle" => rows.push(vulkan_row(plan)),
            _ => unreachable!(),
        }
    }
    rows
}

fn fmt_num(v: Option<f64>) -> String {
    match v {
        None => "n/a".into(),
        Some(v) if v.abs() >= 100.0 => format!("{v:.0}"),
        Some(v) if v.abs() >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

fn fmt_met(m: Option<bool>) -> &'static str {
    match m {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "n/a",
    }
}

/// The table as text.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let header = [
        "figure",
        "median",
        "baseline",
        "base median",
        "ratio",
        "target",
        "met",
    ];
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.figure.clone(),
                r.value
                    .map_or("n/a".into(), |v| format!("{} {}", fmt_num(Some(v)), r.unit)),
                r.baseline.clone(),
                r.baseline_value
                    .map_or("-".into(), |v| format!("{} {}", fmt_num(Some(v)), r.unit)),
                r.ratio
                    .map_or("-".into(), |v| format!("{}x", fmt_num(Some(v)))),
                r.target.describe(r.unit),
                fmt_met(r.met).into(),
            ]
        })
        .collect();
    let mut width = header.map(str::len);
    for c in &cells {
        for (w, s) in width.iter_mut().zip(c.iter()) {
            *w = (*w).max(s.chars().count());
        }
    }
    let line = |c: &[String]| {
        let mut l = String::new();
        for (i, (s, w)) in c.iter().zip(width.iter()).enumerate() {
            if i > 0 {
                l.push_str(" | ");
            }
            let pad = w - s.chars().count();
            // Numbers right-aligned, text left-aligned.
            if matches!(i, 1 | 3 | 4) {
                l.push_str(&" ".repeat(pad));
                l.push_str(s);
            } else {
                l.push_str(s);
                l.push_str(&" ".repeat(pad));
            }
        }
        l.trim_end().to_owned() + "\n"
    };
    out.push_str(&line(&header.map(String::from)));
    out.push_str(&line(&width.map(|w| "-".repeat(w))));
    for c in &cells {
        out.push_str(&line(c));
    }
    let notes: Vec<_> = rows
        .iter()
        .filter_map(|r| r.note.as_ref().map(|n| format!("  {}: {n}\n", r.key)))
        .collect();
    if !notes.is_empty() {
        out.push_str("notes:\n");
        for n in notes {
            out.push_str(&n);
        }
    }
    out
}

fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn json_num(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v}"),
        _ => "null".into(),
    }
}

/// The rows as one JSON object.
pub fn json(rows: &[Row], plan: &Plan, quick: bool) -> String {
    let mut o = String::from("{\n");
    o.push_str(&format!(
        "  \"tool\": \"memgov bench\",\n  \"version\": {},\n  \"mode\": {},\n  \"samples\": {},\n  \"cores\": {},\n  \"rows\": [\n",
        json_str(env!("CARGO_PKG_VERSION")),
        json_str(if quick { "quick" } else { "full" }),
        plan.samples,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    ));
    for (i, r) in rows.iter().enumerate() {
        let (kind, bound) = match r.target {
            Target::AtMost(x) => ("ratio_at_most", x),
            Target::AtLeast(x) => ("ratio_at_least", x),
            Target::ValueAtMost(x) => ("value_at_most", x),
        };
        o.push_str(&format!(
            "    {{\"key\": {}, \"figure\": {}, \"baseline\": {}, \"unit\": {}, \"median\": {}, \"baseline_median\": {}, \"ratio\": {}, \"target\": {{\"kind\": {}, \"bound\": {}}}, \"met\": {}, \"note\": {}}}{}\n",
            json_str(r.key),
            json_str(&r.figure),
            json_str(&r.baseline),
            json_str(r.unit),
            json_num(r.value),
            json_num(r.baseline_value),
            json_num(r.ratio),
            json_str(kind),
            bound,
            r.met.map_or("null".into(), |m| m.to_string()),
            r.note.as_deref().map_or("null".into(), json_str),
            if i + 1 < rows.len() { "," } else { "" }
        ));
    }
    o.push_str("  ]\n}\n");
    o
}

const USAGE: &str = "usage: memgov bench [--quick] [--json] [--filter WORD] [--check] [--list]
  --quick        a smoke run of a few seconds (rough numbers)
  --json         print one JSON object instead of the table
  --filter WORD  only rows whose key contains WORD
  --check        exit with status 1 when a measured row misses its target
  --list         print the row keys and exit
Exit status: 0 (also when a target is missed, unless --check), 2 on bad usage.";

/// Entry point of `memgov bench`. Returns the process exit code.
pub fn main(args: &[String]) -> i32 {
    let (mut json_out, mut quick, mut check, mut filter) = (false, false, false, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => json_out = true,
            "--quick" => quick = true,
            "--check" => check = true,
            // `cargo bench` passes this to harness-less bench targets.
            "--bench" => {}
            "--filter" => match it.next() {
                Some(f) => filter = Some(f.clone()),
                None => {
                    eprintln!("memgov bench: --filter needs a word\n{USAGE}");
                    return 2;
                }
            },
            "--list" => {
                for k in ROWS {
                    println!("{k}");
                }
                return 0;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return 0;
            }
            s if s.starts_with("--filter=") => filter = Some(s["--filter=".len()..].to_owned()),
            other => {
                eprintln!("memgov bench: unknown argument '{other}'\n{USAGE}");
                return 2;
            }
        }
    }
    let plan = if quick { Plan::QUICK } else { Plan::FULL };
    let rows = run(&plan, filter.as_deref(), |key| {
        if !json_out {
            eprintln!("memgov bench: measuring {key} ...");
        }
    });
    if json_out {
        print!("{}", json(&rows, &plan, quick));
    } else {
        println!(
            "memgov bench ({} mode, {} samples per side, {} cores; medians, same-run baselines)",
            if quick { "quick" } else { "full" },
            plan.samples,
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        print!("{}", table(&rows));
    }
    if check && rows.iter().any(|r| r.met == Some(false)) {
        1
    } else {
        0
    }
}
