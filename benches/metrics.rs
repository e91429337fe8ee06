//! The metrics pages (feature `metrics`, docs/metrics.md), null backend:
//!
//! * rendering what Prometheus scrapes from a machine of 64 processes with
//!   8 contexts each: the exporter's page of a 64-process ledger, and 64
//!   governor pages of 8 contexts (`memgov::metrics::render`, snapshot
//!   included);
//! * what a scrape costs the allocation path: before the criterion rows it
//!   prints the two-thread row (two threads, two streams of one context, as
//!   in `benches/scaling.rs`, the context's process budget on the ledger
//!   and its block cache on, so that each cycle takes its stream's cache
//!   lock)
//!   while a third thread scrapes both pages back to back (the governor's
//!   snapshot and the ledger's read live), against the same row while the
//!   third thread renders the same pages from snapshots taken before (the
//!   same formatting work on the CPU, touching no governor and no ledger),
//!   and against the row alone; interleaved batches in the same run. On a
//!   machine with fewer than three cores the third thread takes CPU from
//!   the two either way: the live-against-copy ratio is the scrape's own
//!   effect.
//!
//! The criterion rows time the pages, and the two-thread row alone, beside
//! a thread scraping and beside a thread rendering copies (each a row of
//! its own, in the same run).
//!
//! Instruction counts, where the wall clock is too noisy (a loaded
//! machine): `MEMGOV_METRICS_CALLGRIND=alone|scraping|copies` runs the
//! two-thread row once (2 x 20000 cycles, or 2 x
//! `MEMGOV_METRICS_CALLGRIND_CYCLES`), alone or beside the third thread,
//! and exits; under `valgrind --tool=callgrind
//! --toggle-collect='*linux::run'` the count is the allocation path's
//! alone, whatever the third thread does:
//!
//! ```text
//! for m in alone scraping copies; do
//!   MEMGOV_METRICS_CALLGRIND=$m valgrind --tool=callgrind --toggle-collect='*linux::run' \
//!     --callgrind-out-file=cg.$m target/release/deps/metrics-<hash> --bench
//! done
//! ```
//!
//! Smoke run (CI): `cargo bench --bench metrics --features metrics -- --test`.

#[cfg(target_os = "linux")]
mod linux {
    use criterion::Criterion;
    use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
    use memgov::metrics::{render, render_ledgers, render_snapshot, LedgerFigures};
    use memgov::null::NullContext;
    use memgov::{
        Alloc, CacheConfig, ContextConfig, ContextHandle, DeviceBuffer, GovernedStream, Governor,
        GovernorSnapshot, ProcessBudget, Role, SharedBudget,
    };
    use std::hint::black_box;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Barrier;
    use std::time::{Duration, Instant};

    const PROCESSES: usize = 64;
    const CONTEXTS: usize = 8;

    /// The allocation path: `n` cycles of one stream. Never inlined, so that
    /// callgrind can count the instructions in it alone
    /// (`--toggle-collect='*linux::run'`).
    #[inline(never)]
    fn run(ctx: &ContextHandle<NullContext>, stream: &GovernedStream<NullContext>, n: u64) {
        for _ in 0..n {
            drop(black_box(ctx.allocate(
                stream,
                Alloc::new(black_box(4096), Role::Activation),
            )));
        }
    }

    /// Two threads, `n` cycles each: the wall time for both to finish.
    fn two_threads(
        ctx: &ContextHandle<NullContext>,
        streams: &[GovernedStream<NullContext>; 2],
        n: u64,
    ) -> Duration {
        let barrier = Barrier::new(2);
        let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
            let hs: Vec<_> = streams
                .iter()
                .map(|st| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        let t = Instant::now();
                        run(ctx, st, n);
                        (t, Instant::now())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let start = spans.iter().map(|s| s.0).min().unwrap();
        let end = spans.iter().map(|s| s.1).max().unwrap();
        end.duration_since(start).max(Duration::from_nanos(1))
    }

    /// One machine's scrape: the exporter's ledger page and every process's
    /// own page (here the same governor, rendered once per process).
    fn scrape(ledger: &MachineLedger, gov: &Governor<NullContext>, processes: usize) -> usize {
        let mut bytes = render_ledgers(&[LedgerFigures::read(ledger)], 0).len();
        for _ in 0..processes {
            bytes += render(gov).len();
        }
        bytes
    }

    /// The same pages rendered from snapshots taken before.
    fn scrape_copy(figures: &[LedgerFigures], snap: &GovernorSnapshot) -> usize {
        render_ledgers(figures, 0).len() + render_snapshot(snap, "bench", 1).len()
    }

    fn median(mut v: Vec<Duration>) -> f64 {
        v.sort();
        v[v.len() / 2].as_nanos() as f64
    }

    /// The two-thread row while `beside` runs in a third thread, until the
    /// row ends; how many times it ran.
    fn with_beside(
        ctx: &ContextHandle<NullContext>,
        streams: &[GovernedStream<NullContext>; 2],
        n: u64,
        beside: &(dyn Fn() -> usize + Sync),
    ) -> (Duration, u64) {
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let stop = &stop;
            let h = s.spawn(move || {
                let mut runs = 0;
                while !stop.load(Ordering::Relaxed) {
                    black_box(beside());
                    runs += 1;
                }
                runs
            });
            let t = two_threads(ctx, streams, n);
            stop.store(true, Ordering::Relaxed);
            (t, h.join().unwrap())
        })
    }

    pub fn metrics(c: &mut Criterion) {
        let dir = std::env::temp_dir().join(format!("memgov-bench-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ledger = MachineLedger::open(
            &LedgerOptions::new("bench-metrics", 1 << 40)
                .path(dir.join("ledger"))
                .slots(PROCESSES),
        )
        .unwrap();
        // This process's slot carries the governor below; 63 more slots
        // hold a charge each, as other processes would.
        let own = ledger.join(JoinOptions::new("bench")).unwrap();
        let others: Vec<_> = (1..PROCESSES)
            .map(|i| {
                let m = ledger
                    .join(JoinOptions::new(format!("worker-{i}")).lease_chunk(0))
                    .unwrap();
                m.charge((i as u64) << 20).unwrap();
                m
            })
            .collect();
        let process = ProcessBudget::with_machine("bench", 1 << 40, own);
        let device = SharedBudget::with_parent("gpu0", 1 << 40, &process);
        let gov = Governor::new();
        let ctxs: Vec<_> = (0..CONTEXTS)
            .map(|i| {
                gov.register(
                    NullContext::new(),
                    ContextConfig::new()
                        .label(format!("ctx-{i}"))
                        .budget(1 << 40)
                        .shared_budget(device.clone())
                        .cache(CacheConfig::new(64 << 20)),
                )
            })
            .collect();
        let held: Vec<DeviceBuffer<NullContext>> = ctxs
            .iter()
            .map(|c| {
                let s = c.create_stream("held").unwrap();
                c.allocate(&s, Alloc::new(1 << 20, Role::Weights)).unwrap()
            })
            .collect();
        let ctx = &ctxs[0];
        let streams = [
            ctx.create_stream("a").unwrap(),
            ctx.create_stream("b").unwrap(),
        ];

        // Under callgrind: one two-thread row, alone or beside a thread
        // scraping or rendering copies, and nothing else (see the module's
        // docs).
        if let Ok(mode) = std::env::var("MEMGOV_METRICS_CALLGRIND") {
            let figures = [LedgerFigures::read(&ledger)];
            let snap = gov.snapshot();
            let live = || scrape(&ledger, &gov, 1);
            let copy = || scrape_copy(&figures, &snap);
            let cycles: u64 =
                std::env::var("MEMGOV_METRICS_CALLGRIND_CYCLES").map_or(20_000, |v| {
                    v.parse()
                        .expect("MEMGOV_METRICS_CALLGRIND_CYCLES: a number")
                });
            let scrapes = match mode.as_str() {
                "alone" => {
                    two_threads(ctx, &streams, cycles);
                    0
                }
                "scraping" => with_beside(ctx, &streams, cycles, &live).1,
                "copies" => with_beside(ctx, &streams, cycles, &copy).1,
                other => panic!("MEMGOV_METRICS_CALLGRIND={other}: give alone, scraping or copies"),
            };
            println!("metrics callgrind {mode}: 2 x {cycles} cycles, {scrapes} pages beside");
            drop((held, streams, ctxs, gov, others, ledger));
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }

        // The two-thread row alone, beside live scrapes, beside renders of
        // copies; interleaved batches, the median of each.
        const N: u64 = 20_000;
        const BATCHES: usize = 21;
        let figures = [LedgerFigures::read(&ledger)];
        let snap = gov.snapshot();
        let live = || scrape(&ledger, &gov, 1);
        let copy = || scrape_copy(&figures, &snap);
        let (mut alone, mut scraped, mut copied) = (Vec::new(), Vec::new(), Vec::new());
        let (mut scrapes, mut copies) = (0, 0);
        for _ in 0..BATCHES {
            alone.push(two_threads(ctx, &streams, N));
            let (t, k) = with_beside(ctx, &streams, N, &live);
            scraped.push(t);
            scrapes += k;
            let (t, k) = with_beside(ctx, &streams, N, &copy);
            copied.push(t);
            copies += k;
        }
        let n = N as f64;
        let (a, s, k) = (median(alone) / n, median(scraped) / n, median(copied) / n);
        println!(
            "metrics: two threads, one context: {s:.1} ns per cycle beside live scrapes ({scrapes} scrapes), {k:.1} ns beside renders of copies ({copies}), {a:.1} ns alone; scrape ratio {:.2}x against the copies, {:.2}x against alone",
            s / k,
            s / a
        );

        let mut g = c.benchmark_group("metrics");
        g.bench_function("ledger page, 64 processes", |b| {
            b.iter(|| black_box(render_ledgers(&[LedgerFigures::read(&ledger)], 0)))
        });
        g.bench_function("one process's page, 8 contexts", |b| {
            b.iter(|| black_box(render(&gov)))
        });
        g.bench_function(
            "64 processes x 8 contexts: the ledger page + 64 pages",
            |b| b.iter(|| black_box(scrape(&ledger, &gov, PROCESSES))),
        );
        g.bench_function("two threads, one context, no scrapes", |b| {
            b.iter_custom(|n| two_threads(ctx, &streams, n))
        });
        g.bench_function("two threads, one context, a thread scraping", |b| {
            b.iter_custom(|n| with_beside(ctx, &streams, n, &live).0)
        });
        g.bench_function("two threads, one context, a thread rendering copies", |b| {
            b.iter_custom(|n| with_beside(ctx, &streams, n, &copy).0)
        });
        g.finish();
        drop((held, streams, ctxs, gov, others, ledger));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(target_os = "linux")]
criterion::criterion_group!(benches, linux::metrics);
#[cfg(target_os = "linux")]
criterion::criterion_main!(benches);

#[cfg(not(target_os = "linux"))]
fn main() {}
