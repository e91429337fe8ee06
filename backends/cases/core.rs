//! Cases of the CUDA and HIP main suites (`tests/cuda.rs`, `tests/hip.rs`)
//! written once against the `vendor` module of the test binary that
//! includes this file (see `README.md` beside it). The cases every GPU
//! backend runs through one trait are in `backends/stand-ins/support/`.

use crate::vendor::{self, LATENCY};
use memgov::{Alloc, ContextConfig, Governor, Role, Tier};
use std::time::{Duration, Instant};

#[test]
fn pinned_host_release_waits_for_copies_queued_outside_the_governor() {
    // A runtime's own copy into a pinned staging buffer, queued on the
    // buffer's stream (slow), then the buffer dropped: the backend must
    // free it only once the copy has run, or the stand-in aborts.
    vendor::passes("governed_pinned_behind_raw_copy", &[(LATENCY, "200000")]);
}

/// In the child: runs the shared case `case`; false when it is not one of
/// these (the vendor's own cases then).
pub(crate) fn run(case: &str) -> bool {
    match case {
        "governed_pinned_behind_raw_copy" => governed_pinned_behind_raw_copy(),
        _ => return false,
    }
    true
}

fn governed_pinned_behind_raw_copy() {
    let gov = Governor::new();
    let backend = vendor::context();
    let current = vendor::current(&backend);
    let ctx = gov.register(backend, ContextConfig::new());
    let stream = ctx.create_stream("copy").expect("stream");
    let buf = ctx
        .allocate(
            &stream,
            Alloc::new(1 << 16, Role::Other).tier(Tier::PinnedHost),
        )
        .expect("pinned allocation");
    let mem = buf.raw().expect("live buffer");
    assert_eq!(mem.tier(), Tier::PinnedHost);
    let src = vec![9u8; 1 << 16];
    // SAFETY: the memory and stream come from live governed handles (`buf`,
    // `stream`), and `src` outlives the copy: the retire below waits for it.
    unsafe { vendor::copy_in_unwaited(&current, stream.raw().expect("live stream"), mem, &src) };
    // Queued behind the slow copy; the backend frees after it.
    drop(buf);
    drop(stream);
    ctx.retire()
        .wait(Instant::now() + Duration::from_secs(30))
        .expect("retire");
    drop(src);
}
