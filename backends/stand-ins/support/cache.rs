//! The governed block cache on a stand-in driver: the test the CUDA and HIP
//! suites share.

use memgov::{Alloc, BackendProbe, CacheConfig, ContextConfig, DeviceContext, Governor, Role};
use std::time::{Duration, Instant};

/// 400 allocations of varying sizes alternating between two streams of a
/// caching context (every seventh released on the other stream, so freed
/// ordered after its own), each reused block written and read back; then
/// the stand-in must have seen no violation and a clean teardown. `name`
/// labels the printed figures.
pub fn reuses_blocks_only_on_their_stream<C: DeviceContext>(
    ctx: C,
    probe: BackendProbe,
    name: &str,
) {
    let gov = Governor::new();
    let handle = gov.register(
        ctx,
        ContextConfig::new()
            .label("cache")
            .cache(CacheConfig::new(8 << 20)),
    );
    let streams = [
        handle.create_stream("a").expect("stream"),
        handle.create_stream("b").expect("stream"),
    ];
    for i in 0..400u64 {
        let s = &streams[(i % 2) as usize];
        let bytes = 4096 * (1 + i % 5);
        let buf = handle
            .allocate(s, Alloc::new(bytes, Role::Workspace))
            .expect("allocate");
        let tag = [(i % 251) as u8; 64];
        buf.write(0, &tag).expect("write");
        let mut back = [0u8; 64];
        buf.read(0, &mut back).expect("read");
        assert_eq!(back, tag);
        if i % 7 == 0 {
            buf.release_on(&streams[((i + 1) % 2) as usize])
                .map_err(|e| e.error)
                .expect("release_on");
        }
    }
    let snap = handle.snapshot();
    assert!(snap.cache.hits > 300, "{:?}", snap.cache);
    drop(streams);
    let report = handle
        .retire()
        .wait(Instant::now() + Duration::from_secs(30))
        .expect("retire");
    assert!(report.backend_result.is_ok(), "{:?}", report.backend_result);
    assert_eq!(probe.violations(), 0, "{:?}", probe.violation_log());
    probe.check_clean_teardown().expect("clean teardown");
    println!(
        "cache: {name}: 400 allocations, {} cache hits, {} backend allocations, 0 violations",
        snap.cache.hits, snap.counters.allocations
    );
}
