//! The pinned host tier (`Tier::PinnedHost`) through the governor, on a
//! runtime whose device pointer of mapped host memory differs from its host
//! pointer.
//!
//! HIP documents that a copy whose pointers do not match its
//! `hipMemcpyKind` is undefined behaviour, and that the device pointer of
//! mapped host memory (`hipHostGetDevicePointer`) may differ from the host
//! pointer. The stand-in gives mapped host memory a device pointer that
//! differs and aborts the process on a copy of the wrong kind, so every copy
//! the tier makes (its writes, its reads, a migration that reads it) must
//! pass the device pointer where the copy takes a device one.
//!
//! This file uses the governor's public API only. On the stand-in each case
//! runs in a child process (this binary re-executed with one ignored test),
//! with the exit check on, at the latency the parent runs with and at 0 and
//! 300 µs; a copy of the wrong kind aborts the child, and the parent reports
//! the stand-in's message. On an AMD GPU the cases run in this process; with
//! no HIP device every test prints `skipped: ...` and passes.
//!
//! `cargo test -p memgov-hip --test pinned` (with the stand-in:
//! `LD_LIBRARY_PATH=$(backends/stand-ins/build.sh hip)`).

// This file plants no violation: the abort assertions go unused.
#[allow(dead_code)]
#[path = "../../stand-ins/support/child.rs"]
mod child_process;
#[path = "common/table.rs"]
mod table;

use memgov::hip::{HipConfig, HipContext};
use memgov::{
    Alloc, BackendErrorKind, ContextConfig, ContextHandle, DeviceContext, Execution, Governor,
    Role, Tier,
};
use std::time::{Duration, Instant};

/// The environment variable that makes this binary a child running one case.
const CHILD: &str = "MEMGOV_HIP_PINNED_TEST_CHILD";
/// What a child prints when its case ran to the end.
const CHILD_END: &str = "child reached the end";
// The stand-in's knobs (see `backends/stand-ins/README.md`), from the table.
use table::knobs::{EXIT_CHECK, LATENCY, SEED};
const LONG: Duration = Duration::from_secs(60);

/// Where this process runs the cases.
enum Here {
    /// No HIP device or runtime (the reason was printed).
    Nothing,
    /// The stand-in: run each case in children.
    StandIn,
    /// A real device: run the cases in this process.
    Device,
}

fn here() -> Here {
    match HipContext::new(HipConfig::default()) {
        Ok(ctx) => {
            let stand_in = ctx.describe().execution == Execution::StandIn;
            ctx.teardown(false)
                .expect("teardown of the probing context");
            if stand_in {
                Here::StandIn
            } else {
                Here::Device
            }
        }
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            assert!(
                e.message.starts_with("no HIP device") || e.message.starts_with("no HIP runtime"),
                "{e}"
            );
            eprintln!("skipped: {}", e.message);
            Here::Nothing
        }
        Err(e) => panic!("HipContext::new failed: {e}"),
    }
}

/// Run `case` where this process runs cases: on the stand-in in a child at
/// the parent's latency, then at 0 and at 300 µs (each exactly, without a
/// latency seed), with the exit check on; on a device here.
fn run_case(case: &str, body: fn()) {
    match here() {
        Here::Nothing => {}
        Here::Device => body(),
        Here::StandIn => {
            let inherited: &[(&str, &str)] = &[(EXIT_CHECK, "1")];
            let exact = |latency| vec![(EXIT_CHECK, "1"), (LATENCY, latency), (SEED, "")];
            for env in [inherited.to_vec(), exact("0"), exact("300")] {
                let run = child_process::run(CHILD, case, &env);
                child_process::assert_passed(case, &run, CHILD_END);
            }
        }
    }
}

/// A governed context on the default HIP device.
fn governed(gov: &Governor<HipContext>, label: &str) -> ContextHandle<HipContext> {
    let backend = HipContext::new(HipConfig::default()).expect("HIP context");
    gov.register(backend, ContextConfig::new().label(label))
}

/// A pattern that differs at every offset a test reads.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(u32::from(seed)) as u8)
        .collect()
}

/// Retire `ctx` and require a clean backend teardown.
fn retire(ctx: ContextHandle<HipContext>) {
    let report = ctx
        .retire()
        .wait(Instant::now() + LONG)
        .expect("the context retires");
    assert!(report.backend_result.is_ok(), "{:?}", report.backend_result);
    assert_eq!(report.abandoned_releases, 0, "{report:?}");
}

/// Writes and reads through a pinned host buffer, at its start, across its
/// middle and at its end, on its own stream and on another one; every byte
/// read back is checked.
fn write_read() {
    const LEN: u64 = 1 << 20;
    let gov = Governor::new();
    let ctx = governed(&gov, "pinned");
    let (s, other) = (
        ctx.create_stream("s").expect("stream"),
        ctx.create_stream("other").expect("stream"),
    );
    let mut buf = ctx
        .allocate(&s, Alloc::new(LEN, Role::Other).tier(Tier::PinnedHost))
        .expect("pinned allocation");
    assert_eq!(buf.tier(), Tier::PinnedHost);
    let whole = pattern(LEN as usize, 3);
    buf.write(0, &whole).expect("write the whole buffer");
    let mut back = vec![0u8; LEN as usize];
    buf.read(0, &mut back).expect("read the whole buffer");
    assert!(back == whole, "the whole buffer reads back as written");
    for (offset, len, seed) in [
        (0u64, 1usize, 5u8),
        (4095, 4097, 7),
        (LEN / 2 - 100, 200, 11),
        (LEN - 64, 64, 13),
    ] {
        let data = pattern(len, seed);
        buf.write(offset, &data).expect("write");
        let mut got = vec![0u8; len];
        buf.read(offset, &mut got).expect("read");
        assert_eq!(got, data, "{len} B at offset {offset}");
    }
    // The bytes around the last write are still the first pattern.
    let mut edge = vec![0u8; 64];
    buf.read(LEN - 128, &mut edge).expect("read");
    assert_eq!(edge, whole[(LEN - 128) as usize..(LEN - 64) as usize]);
    // Recorded on, and released on, the other stream: its free is ordered
    // after the copies above.
    buf.record_stream(&other).expect("record the other stream");
    buf.release_on(&other).expect("release on the other stream");
    drop((s, other));
    retire(ctx);
}

/// A pinned host buffer moved to another context (`migrate` reads it out
/// through the tier's copies and writes device memory), then its bytes
/// written into a new pinned buffer; every byte checked.
fn migrate() {
    const LEN: u64 = 3 << 20;
    let gov = Governor::new();
    let (old, new) = (governed(&gov, "old"), governed(&gov, "new"));
    let (s0, s1) = (
        old.create_stream("load").expect("stream"),
        new.create_stream("load").expect("stream"),
    );
    let pinned = old
        .allocate(&s0, Alloc::new(LEN, Role::Weights).tier(Tier::PinnedHost))
        .expect("pinned allocation");
    let data = pattern(LEN as usize, 17);
    pinned.write(0, &data).expect("write");
    let moved = new
        .migrate(&s1, vec![pinned])
        .map_err(|e| e.to_string())
        .expect("migrate the pinned buffer");
    let mut back = vec![0u8; LEN as usize];
    moved[0].read(0, &mut back).expect("read the moved buffer");
    assert!(
        back == data,
        "the moved buffer holds the pinned buffer's bytes"
    );
    // And back into the pinned tier of the old context.
    let again = old
        .allocate(&s0, Alloc::new(LEN, Role::Other).tier(Tier::PinnedHost))
        .expect("pinned allocation");
    again.write(0, &back).expect("write");
    let mut check = vec![0u8; 4096];
    again.read(LEN - 4096, &mut check).expect("read");
    assert_eq!(check, data[(LEN - 4096) as usize..]);
    drop((again, moved));
    drop((s0, s1));
    retire(old);
    retire(new);
}

#[test]
fn pinned_tier_writes_and_reads_through_the_device_pointer_of_mapped_host_memory() {
    run_case("write_read", write_read);
}

#[test]
fn migrating_a_pinned_buffer_reads_it_through_the_device_pointer() {
    run_case("migrate", migrate);
}

/// One case per child process. Ignored: only `run_case` runs it.
#[test]
#[ignore = "the child-process entry of the pinned tier's tests"]
fn child_entry() {
    let case = std::env::var(CHILD).expect("run by run_case() with its variable set");
    match case.as_str() {
        "write_read" => write_read(),
        "migrate" => migrate(),
        other => panic!("unknown child case {other}"),
    }
    println!("{CHILD_END}");
}
