//! How long and how often to measure, and the interleaved comparison every
//! timed row uses.

use std::time::{Duration, Instant};

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
    /// Cycles per side of a backend's raw-vs-governed row.
    pub backend_cycles: u32,
}

impl Plan {
    /// A few seconds in all: proves the rows run, numbers are rough.
    pub const QUICK: Plan = Plan {
        samples: 7,
        sample: Duration::from_millis(2),
        wakeups: 15,
        big_drains: 1,
        backend_cycles: 200,
    };
    /// The default: about half a minute.
    pub const FULL: Plan = Plan {
        samples: 31,
        sample: Duration::from_millis(10),
        wakeups: 101,
        big_drains: 7,
        backend_cycles: 2000,
    };
}

/// The median (NaN for no samples).
pub fn median(v: &mut [f64]) -> f64 {
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
pub fn per_iter(f: &mut dyn FnMut(u64), iters: u64) -> f64 {
    let t = Instant::now();
    f(iters);
    t.elapsed().as_nanos() as f64 / iters as f64
}

/// Iterations that take about `sample`.
pub fn calibrate(f: &mut dyn FnMut(u64), sample: Duration) -> u64 {
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
pub fn compare(plan: &Plan, a: &mut dyn FnMut(u64), b: &mut dyn FnMut(u64)) -> (f64, f64) {
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
