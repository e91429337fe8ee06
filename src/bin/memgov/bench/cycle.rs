//! The interleaved governed-vs-raw timing loop every backend's cycle row runs.
//!
//! A backend's `bench/<backend>.rs` owns its two cycles (a governed allocate +
//! stream-ordered free, and the raw driver calls it is measured against) and
//! hands them to [`interleaved`]; the timing, warm-up and rounding live here
//! once. Both `memgov bench` and the criterion benches under `benches/`
//! include this file (the benches through `#[path]`), so it uses only `std`
//! and memgov's public API.

#![cfg(any(feature = "cuda", feature = "hip", feature = "vulkan"))]

use memgov::BackendError;
use std::time::{Duration, Instant};

/// Run `iterations` governed cycles and `iterations` raw cycles (after a
/// warm-up of `max(iterations / 10, 10)` of each), interleaved in rounds, and
/// return nanoseconds per cycle: `(governed, raw)`.
///
/// Both cycles take the same `state`, so a backend whose two cycles share one
/// context passes it once and a backend with two separate ones passes a pair.
/// The caller tears `state` down afterwards, in the order its backend needs.
/// The first error from either cycle ends the run and is returned.
pub fn interleaved<S>(
    iterations: u32,
    state: &mut S,
    mut governed: impl FnMut(&mut S) -> Result<(), BackendError>,
    mut raw: impl FnMut(&mut S) -> Result<(), BackendError>,
) -> Result<(u64, u64), BackendError> {
    let iterations = iterations.max(1);
    let warm = (iterations / 10).max(10);
    for _ in 0..warm {
        governed(state)?;
        raw(state)?;
    }
    // Interleave in rounds so that machine noise hits both sides alike.
    let rounds = 10u32.min(iterations);
    let per = iterations / rounds;
    let (mut gt, mut rt) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..per {
            governed(state)?;
        }
        gt += t.elapsed();
        let t = Instant::now();
        for _ in 0..per {
            raw(state)?;
        }
        rt += t.elapsed();
    }
    let n = u128::from(per * rounds).max(1);
    Ok(((gt.as_nanos() / n) as u64, (rt.as_nanos() / n) as u64))
}
