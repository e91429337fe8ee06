//! Admission through the machine ledger against the process-level cycle,
//! null backend, in the same run: a context on a device budget under a
//! process budget (`process`), and the same under a process budget on a
//! machine ledger (`machine`; a ledger in a temporary directory, the
//! default 8 MiB lease). One cycle is allocate 4 KiB + release. Before the
//! criterion rows it prints the ratio of the two from interleaved batches
//! (the figure docs/sharing-a-gpu.md quotes; target at most 1.3x), then
//! what liveness by slot locks costs: a join + leave, and a sweep of nine
//! live slots (rows too).
//!
//! Smoke run (CI): `cargo bench --bench machine -- --test`.

#[cfg(target_os = "linux")]
mod linux {
    use criterion::Criterion;
    use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
    use memgov::null::NullContext;
    use memgov::{
        Alloc, ContextConfig, ContextHandle, GovernedStream, Governor, ProcessBudget, Role,
        SharedBudget,
    };
    use std::hint::black_box;
    use std::time::{Duration, Instant};

    struct Setup {
        _gov: Governor<NullContext>,
        ctx: ContextHandle<NullContext>,
        stream: GovernedStream<NullContext>,
    }

    fn setup(process: ProcessBudget) -> Setup {
        let device = SharedBudget::with_parent("gpu0", 1 << 40, &process);
        let gov = Governor::new();
        let ctx = gov.register(
            NullContext::new(),
            ContextConfig::new().budget(1 << 40).shared_budget(device),
        );
        let stream = ctx.create_stream("bench").unwrap();
        Setup {
            _gov: gov,
            ctx,
            stream,
        }
    }

    fn cycles(s: &Setup, n: u64) -> Duration {
        let t = Instant::now();
        for _ in 0..n {
            drop(black_box(s.ctx.allocate(
                &s.stream,
                Alloc::new(black_box(4096), Role::Activation),
            )));
        }
        t.elapsed()
    }

    pub fn machine(c: &mut Criterion) {
        let dir = std::env::temp_dir().join(format!("memgov-bench-machine-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ledger =
            MachineLedger::open(&LedgerOptions::new("bench", 1 << 40).path(dir.join("ledger")))
                .unwrap();
        let member = ledger.join(JoinOptions::new("bench")).unwrap();
        let process = setup(ProcessBudget::new("process", 1 << 40));
        let machine = setup(ProcessBudget::with_machine("machine", 1 << 40, member));

        // Interleaved batches, the median of each: both sides see the same
        // machine state (frequency, other load).
        let (mut p, mut m) = (Vec::new(), Vec::new());
        for _ in 0..31 {
            p.push(cycles(&process, 20_000));
            m.push(cycles(&machine, 20_000));
        }
        p.sort();
        m.sort();
        let (p, m) = (
            p[15].as_nanos() as f64 / 20e3,
            m[15].as_nanos() as f64 / 20e3,
        );
        println!(
            "machine ledger: {m:.1} ns per cycle, process level: {p:.1} ns per cycle, ratio {:.2}x",
            m / p
        );

        // What liveness by slot locks costs: a join takes a slot's lock
        // on a description of its own (an open and an fcntl), a leave lets
        // it go; a sweep asks the kernel about each occupied slot (one
        // fcntl F_OFD_GETLK each). Eight other members hold slots here.
        let others: Vec<_> = (0..8)
            .map(|i| ledger.join(JoinOptions::new(format!("other-{i}"))).unwrap())
            .collect();
        let join_leave = |n: u64| {
            let t = Instant::now();
            for _ in 0..n {
                drop(black_box(
                    ledger.join(JoinOptions::new("bench-join")).unwrap(),
                ));
            }
            t.elapsed()
        };
        let sweeps = |n: u64| {
            let t = Instant::now();
            for _ in 0..n {
                black_box(ledger.sweep());
            }
            t.elapsed()
        };
        println!(
            "machine ledger: join + leave {:.1} us, sweep of {} live slots {:.1} us",
            join_leave(200).as_nanos() as f64 / 200e3,
            others.len() + 1,
            sweeps(2000).as_nanos() as f64 / 2000e3,
        );

        let mut g = c.benchmark_group("machine");
        g.bench_function("process level, allocate + release", |b| {
            b.iter_custom(|n| cycles(&process, n))
        });
        g.bench_function("machine ledger, allocate + release", |b| {
            b.iter_custom(|n| cycles(&machine, n))
        });
        g.bench_function("machine ledger, join + leave", |b| {
            b.iter_custom(join_leave)
        });
        g.bench_function("machine ledger, sweep of 9 live slots", |b| {
            b.iter_custom(sweeps)
        });
        g.finish();
        drop(others);
        drop((process, machine, ledger));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(target_os = "linux")]
criterion::criterion_group!(benches, linux::machine);
#[cfg(target_os = "linux")]
criterion::criterion_main!(benches);

#[cfg(not(target_os = "linux"))]
fn main() {}
