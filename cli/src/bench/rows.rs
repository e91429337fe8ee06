//! The governor's own rows: pins, the null and host cycles, two threads,
//! the teardown wake-up and drain, heap bytes.

use super::alloc::{counting_allocator_installed, HeapCounter, HeapDelta};
use super::floor::{ClaimWord, ClaimedFloorPin, ClaimedFloorSource, FloorPin};
use super::measure::{calibrate, compare, median, per_iter, Plan};
use super::row::{Row, Target};
use super::teardown::{drain_once, wakeup_bare, wakeup_governed};
use memgov::any::AnyContext;
use memgov::host::{HostConfig, HostContext};
use memgov::null::NullContext;
use memgov::{
    Alloc, CacheConfig, ContextConfig, ContextHandle, DeviceContext, GovernedStream, Governor,
    ProviderContextPinSource, Reserve, RetireSignal, Role,
};
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

fn arc_baseline() -> impl FnMut(u64) {
    let arc = Arc::new(0u64);
    move |n| {
        for _ in 0..n {
            drop(black_box(Arc::clone(black_box(&arc))));
        }
    }
}

const ARC: &str = "Arc::clone + drop";

pub fn pin(plan: &Plan) -> Row {
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

const BOX_ARC: &str = "Box::new + Arc::clone + drops (Box<dyn ProviderContextPin>)";

pub fn boxed_pin(plan: &Plan) -> Row {
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new());
    let source = ctx.pin_source(Some("bench"));
    let mut pin = |n: u64| {
        for _ in 0..n {
            drop(black_box(source.pin()));
        }
    };
    let context = source.context();
    let alive = Arc::new(0u64);
    let mut floor = |n: u64| {
        for _ in 0..n {
            drop(black_box(FloorPin::boxed(black_box(&alive), context)));
        }
    };
    let (v, f) = compare(plan, &mut pin, &mut floor);
    // What the floor plus a claim word costs on this machine, in the same
    // run: the least any pin teardown can wait for costs.
    let claims = Arc::new(ClaimWord::default());
    let mut claimed = |n: u64| {
        for _ in 0..n {
            drop(black_box(ClaimedFloorPin::take(
                black_box(&claims),
                context,
            )));
        }
    };
    let (claimed_ns, f2) = compare(plan, &mut claimed, &mut floor);
    // And through the contract's API, as every holder calls it.
    let contract: Arc<dyn ProviderContextPinSource> =
        Arc::new(ClaimedFloorSource::new(&claims, context));
    let mut through_contract = |n: u64| {
        for _ in 0..n {
            drop(black_box(contract.pin()));
        }
    };
    let (contract_ns, f3) = compare(plan, &mut through_contract, &mut floor);
    // For continuity with earlier tables: the same pin against the bare
    // reference count.
    let (v_arc, arc) = compare(plan, &mut pin, &mut arc_baseline());
    Row::new(
        "boxed-pin",
        "Box<dyn ProviderContextPin> via pin_source().pin() + drop",
        BOX_ARC,
        "ns",
        Target::AtMost(1.5),
    )
    .with(v, Some(f), Some(v / f))
    .note(format!(
        "the floor plus one claim word (compare-and-swap + subtraction, no governor code) = {claimed_ns:.1} ns = {:.2}x of the floor; the same through the contract's API (a dyn source returning a Result, refusing when closed or full) = {contract_ns:.1} ns = {:.2}x, so the pin is {:.2}x of that; vs Arc::clone + drop ({arc:.1} ns): {:.1}x",
        claimed_ns / f2,
        contract_ns / f3,
        v / f * f3 / contract_ns,
        v_arc / arc
    ))
}

pub fn null_cycle(plan: &Plan) -> Row {
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new().budget(1 << 40));
    let stream = ctx.create_stream("bench").expect("null stream");
    let mut cycle = |n: u64| {
        for _ in 0..n {
            drop(black_box(ctx.allocate(
                &stream,
                Alloc::new(black_box(4096), Role::Activation),
            )));
        }
    };
    let (v, b) = compare(plan, &mut cycle, &mut arc_baseline());
    Row::new(
        "null-cycle",
        "governor's own cost: allocate + release, null backend (signal inline)",
        ARC,
        "ns",
        Target::AtMost(12.0),
    )
    .with(v, Some(b), Some(v / b))
}

pub fn host_cycle(plan: &Plan) -> Row {
    let row = Row::new(
        "host-cycle",
        "governed allocate + stream-ordered release, host backend",
        "raw host allocate + free_async on the same stream",
        "ns",
        Target::AtMost(1.5),
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
                Alloc::new(black_box(4096), Role::Activation),
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

/// The block cache's hit cycle (allocate served from the stream's cache +
/// release back into it) on the host backend, against the raw host
/// backend's allocate + free_async (what every uncached allocation pays),
/// and against the governed cycle on the null backend (the governor's own
/// cost with a backend that does nothing).
pub fn cached_cycle(plan: &Plan) -> Vec<Row> {
    let raw_row = Row::new(
        "cached-cycle",
        "allocate + release served by the block cache, host backend",
        "raw host allocate + free_async on the same stream",
        "ns",
        Target::AtMost(1.0),
    );
    let null_row = Row::new(
        "cached-vs-null",
        "allocate + release served by the block cache, host backend",
        "governed allocate + release, null backend",
        "ns",
        Target::AtMost(3.0),
    );
    let gov = Governor::new();
    let ctx = match HostContext::new(HostConfig::default()) {
        Ok(h) => gov.register(h, ContextConfig::new().cache(CacheConfig::new(1 << 20))),
        Err(e) => {
            let note = format!("host backend unavailable: {e}");
            return vec![raw_row.note(note.clone()), null_row.note(note)];
        }
    };
    let stream = ctx.create_stream("bench").expect("host stream");
    // The first allocation fills the cache; every one after it is a hit.
    drop(ctx.allocate(&stream, Alloc::new(4096, Role::Activation)));
    let mut cached = |n: u64| {
        for _ in 0..n {
            drop(black_box(ctx.allocate(
                &stream,
                Alloc::new(black_box(4096), Role::Activation),
            )));
        }
        stream.synchronize().expect("synchronize");
    };
    let raw = HostContext::new(HostConfig::default()).expect("host backend");
    let raw_stream = raw.create_stream().expect("host stream");
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
    let (v, b) = compare(plan, &mut cached, &mut baseline);
    let hits = ctx.snapshot().cache.hits;
    let raw_row = raw_row
        .with(v, Some(b), Some(v / b))
        .note(format!("{hits} cache hits, 1 backend allocation"));
    let null_gov = Governor::new();
    let null = null_gov.register(NullContext::new(), ContextConfig::new().budget(1 << 40));
    let null_stream = null.create_stream("bench").expect("null stream");
    let mut plain = |n: u64| null_cycles(&null, &null_stream, n);
    let (v2, b2) = compare(plan, &mut cached, &mut plain);
    drop(stream);
    let _ = ctx.retire().wait_timeout(Duration::from_secs(10));
    let _ = raw.destroy_stream(raw_stream);
    let _ = raw.teardown(false);
    vec![raw_row, null_row.with(v2, Some(b2), Some(v2 / b2))]
}

/// Allocating out of a reservation and releasing, against the plain
/// governed cycle on the same null backend: what a reservation adds to (or
/// saves from) the hot path. The reservation is made once, large enough for
/// every cycle the row runs (each release gives its bytes to the budget,
/// not back to the reservation).
pub fn reserve_cycle(plan: &Plan) -> Row {
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new());
    let stream = ctx.create_stream("bench").expect("null stream");
    let reservation = ctx
        .reserve(Reserve::new(1 << 60, "bench"))
        .expect("reserve");
    let mut out_of_reservation = |n: u64| {
        for _ in 0..n {
            drop(black_box(reservation.allocate(
                &stream,
                Alloc::new(black_box(4096), Role::KvCache),
            )));
        }
    };
    let mut plain = |n: u64| null_cycles(&ctx, &stream, n);
    let (v, b) = compare(plan, &mut out_of_reservation, &mut plain);
    Row::new(
        "reserve-cycle",
        "allocate out of a reservation + release, null backend",
        "plain governed allocate + release on the same context",
        "ns",
        Target::AtMost(1.1),
    )
    .with(v, Some(b), Some(v / b))
}

/// The null cycle with call-site attribution on against the same cycle
/// with it off, in the same run.
pub fn attributed_null_cycle(plan: &Plan) -> Row {
    let gov = Governor::new();
    let on = gov.register(
        NullContext::new(),
        ContextConfig::new().budget(1 << 40).attribution(true),
    );
    let on_stream = on.create_stream("bench").expect("null stream");
    let off = gov.register(
        NullContext::new(),
        ContextConfig::new().budget(1 << 40).attribution(false),
    );
    let off_stream = off.create_stream("bench").expect("null stream");
    let mut attributed = |n: u64| null_cycles(&on, &on_stream, n);
    let mut plain = |n: u64| null_cycles(&off, &off_stream, n);
    let (v, b) = compare(plan, &mut attributed, &mut plain);
    Row::new(
        "attributed-null-cycle",
        "allocate + release with call-site attribution on, null backend",
        "the same with attribution off",
        "ns",
        Target::AtMost(1.15),
    )
    .with(v, Some(b), Some(v / b))
}

/// The null cycle through `AnyContext` (one `match` per backend call)
/// against the same cycle on `NullContext` directly.
pub fn any_null_cycle(plan: &Plan) -> Row {
    let gov = Governor::new();
    let ctx = gov.register(NullContext::new(), ContextConfig::new().budget(1 << 40));
    let stream = ctx.create_stream("bench").expect("null stream");
    let any_gov = Governor::new();
    let any = any_gov.register(
        AnyContext::from(NullContext::new()),
        ContextConfig::new().budget(1 << 40),
    );
    let any_stream = any.create_stream("bench").expect("null stream");
    let mut through_any = |n: u64| {
        for _ in 0..n {
            drop(black_box(any.allocate(
                &any_stream,
                Alloc::new(black_box(4096), Role::Activation),
            )));
        }
    };
    let mut direct = |n: u64| null_cycles(&ctx, &stream, n);
    let (v, b) = compare(plan, &mut through_any, &mut direct);
    Row::new(
        "any-null-cycle",
        "allocate + release through AnyContext, null backend",
        "the same on NullContext directly",
        "ns",
        Target::AtMost(1.1),
    )
    .with(v, Some(b), Some(v / b))
}

/// Wall time per cycle of two threads running `n` cycles each on the two
/// given (context, stream) pairs, from the common start to the later finish.
fn two_thread_span(
    pairs: [(&ContextHandle<NullContext>, &GovernedStream<NullContext>); 2],
    n: u64,
) -> f64 {
    thread_span(&pairs, n)
}

/// One thread per (context, stream) pair, `n` null cycles each, from a
/// common start to the last finish: ns per cycle done.
fn thread_span(
    pairs: &[(&ContextHandle<NullContext>, &GovernedStream<NullContext>)],
    n: u64,
) -> f64 {
    let barrier = Barrier::new(pairs.len());
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
    let start = spans.iter().map(|s| s.0).min().expect("a span");
    let end = spans.iter().map(|s| s.1).max().expect("a span");
    end.duration_since(start).as_nanos() as f64 / (pairs.len() as u64 * n) as f64
}

/// 1, 2, 4 and 8 threads (as many of those as the machine has cores for),
/// each on its own stream of one context, against the same count on as many
/// separate contexts. The row is the largest count; the note has the curve.
pub fn thread_curve(plan: &Plan) -> Row {
    let row = Row::new(
        "thread-curve",
        "k threads on k streams of one context (largest k): ns per cycle",
        "k threads on k separate contexts",
        "ns",
        // One context reaches at least 85 % of the separate contexts'
        // throughput: its ns per cycle are at most 1/0.85 of theirs.
        Target::AtMost(1.18),
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let counts: Vec<usize> = [1, 2, 4, 8].into_iter().filter(|&k| k <= cores).collect();
    let gov = Governor::new();
    let config = || ContextConfig::new().budget(1 << 40);
    let shared = gov.register(NullContext::new(), config());
    let shared_streams: Vec<_> = (0..8)
        .map(|i| shared.create_stream(format!("s{i}")).expect("stream"))
        .collect();
    let apart: Vec<_> = (0..8)
        .map(|_| gov.register(NullContext::new(), config()))
        .collect();
    let apart_streams: Vec<_> = apart
        .iter()
        .map(|c| c.create_stream("a").expect("stream"))
        .collect();
    let n = calibrate(
        &mut |n| null_cycles(&shared, &shared_streams[0], n),
        plan.sample,
    );
    let mut curve = Vec::new();
    let mut last = (0.0, 0.0);
    let mut apart_one = None;
    for &k in &counts {
        let one: Vec<_> = shared_streams[..k].iter().map(|s| (&shared, s)).collect();
        let sep: Vec<_> = apart.iter().zip(&apart_streams).take(k).collect();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..plan.samples {
            a.push(thread_span(&one, n));
            b.push(thread_span(&sep, n));
        }
        let (v, base) = (median(&mut a), median(&mut b));
        apart_one.get_or_insert(base);
        curve.push(format!("{k}: {v:.0} vs {base:.0} ns ({:.2}x)", v / base));
        last = (v, base);
    }
    let (v, b) = last;
    let most = counts.last().copied().unwrap_or(1);
    // Throughput of the separate contexts at the largest count over one
    // thread: what the machine gives that many threads right now.
    let scaling = apart_one.unwrap_or(b) / b;
    let mut row = row.with(v, Some(b), Some(v / b)).note(format!(
        "ns per cycle, one context vs separate contexts, by thread count: {}; this machine has {cores} cores, so {most} threads is the most measured; separate contexts scale {scaling:.2}x at {most}",
        curve.join(", "),
    ));
    if most < 2 || scaling < 1.2 {
        row.note = Some(format!(
            "{}; the machine gives {most} threads less than 1.2x now, so the target cannot be judged in this run",
            row.note.unwrap_or_default()
        ));
        row.met = None;
    }
    row
}

fn null_cycles(ctx: &ContextHandle<NullContext>, stream: &GovernedStream<NullContext>, n: u64) {
    for _ in 0..n {
        drop(black_box(ctx.allocate(
            stream,
            Alloc::new(black_box(4096), Role::Activation),
        )));
    }
}

pub fn two_threads(plan: &Plan) -> Row {
    let row = Row::new(
        "two-threads",
        "two threads, two streams of one context, null backend: ns per cycle",
        "one thread: ns per cycle",
        "ns",
        Target::AtLeast(1.6),
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
    let share = (b / v) / control;
    let mut row = row.with(v, Some(b), Some(b / v)).note(format!(
        "ratio = throughput of two threads / one thread; control: two threads on two separate contexts (nothing shared) = {control:.2}x, so one context reaches {:.0} % of it (target: >= 85 %)",
        share * 100.0
    ));
    if row.met == Some(true) && share < 0.85 {
        row.met = Some(false);
    }
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

pub fn wakeup(plan: &Plan) -> Row {
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

pub fn drain(plan: &Plan) -> Row {
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

pub fn heap(_plan: &Plan) -> Vec<Row> {
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
        let why =
            "needs the counting global allocator of the memgov binary (see docs/performance.md)";
        return vec![live.note(why), pending.note(why)];
    }
    const N: usize = 10_000;
    let gov = Governor::new();
    let null = NullContext::deferred(N);
    let parked = null.controls();
    let ctx = gov.register(null, ContextConfig::new().budget(1 << 40));
    let stream = ctx.create_stream("s").expect("stream");
    let mut held = Vec::with_capacity(N);
    // Warm up whatever is allocated once (thread-locals, lazy statics).
    drop(
        ctx.allocate(&stream, Alloc::new(4096, Role::Activation))
            .expect("allocate"),
    );
    parked.retire_parked();

    let counter = HeapCounter::start();
    for _ in 0..N {
        held.push(
            ctx.allocate(&stream, Alloc::new(4096, Role::Activation))
                .expect("allocate"),
        );
    }
    let per_live = counter.finish();

    let counter = HeapCounter::start();
    held.clear(); // N releases, parked by the backend in room reserved up front
    let per_pending = counter.finish();
    assert_eq!(parked.parked_count(), N);
    parked.retire_parked();
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
