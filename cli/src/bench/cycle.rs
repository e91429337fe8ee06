//! The interleaved governed-vs-raw timing loop every backend's cycle row runs.
//!
//! A backend's `bench/<backend>.rs` owns its two cycles (a governed allocate +
//! stream-ordered free, and the raw driver calls it is measured against) and
//! hands them to [`interleaved`]; the timing, warm-up and rounding live here
//! once. Both `memgov bench` and the criterion benches under `benches/`
//! include this file (the benches through `#[path]`), so it uses only `std`
//! and memgov's public API.

#![cfg(any(feature = "cuda", feature = "hip", feature = "vulkan"))]

use memgov::{BackendError, BackendErrorKind, ContextHandle, DeviceContext, GovernedStream};
use std::fmt::Display;
use std::time::{Duration, Instant};

/// A governor error met by the governed side of `backend`'s cycle, as the
/// [`BackendError`] a `cycle_ratio` returns.
pub fn governed_error(backend: &'static str, e: impl Display) -> BackendError {
    BackendError::new(
        backend,
        "bench",
        BackendErrorKind::Other,
        format!("governed cycle failed: {e}"),
    )
}

/// The end of a governed cycle: synchronize its stream (if it still holds
/// one), retire the context and wait up to a minute for the teardown, which
/// returns the backend's own teardown result.
pub fn retire<C: DeviceContext>(
    backend: &'static str,
    ctx: &ContextHandle<C>,
    stream: Option<GovernedStream<C>>,
) -> Result<(), BackendError> {
    if let Some(s) = stream {
        s.synchronize().map_err(|e| governed_error(backend, e))?;
    }
    let report = ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(60))
        .map_err(|e| governed_error(backend, e))?;
    report.backend_result
}

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
