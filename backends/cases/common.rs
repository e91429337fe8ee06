//! What every CUDA and HIP test file that runs its cases in child processes
//! on the stand-in shares, written once against the `vendor` module of the
//! vendor's `tests/common/mod.rs` (see `README.md` beside it): whether the
//! stand-in is loaded, running a case in a child that must pass or must be
//! stopped by the stand-in, the stand-in's hooks (its counters, its fault
//! and pause knobs), and the capability fault cells, arena fault cases and
//! arena stress of `memgov-conformance` on it.

#[path = "../stand-ins/support/child.rs"]
pub mod child_process;

use super::vendor::{self, ArenaConfig, Config, Context};
use memgov::BackendErrorKind;
use std::os::raw::c_char;

// The arena binaries use the virtual memory entries and knobs, the capture
// ones not.
#[allow(unused_imports)]
pub use super::vendor::{
    BANNER, CREATE_ENTRY, EXIT_CHECK, FAIL_UNMAP_AT, FAIL_VMM_AT, LATENCY, MAP_ENTRY,
    RELEASE_ENTRY, SEED, SET_ACCESS_ENTRY, UNMAP_ENTRY,
};

/// Declares, in a vendor's `vendor` module, the vendor's stand-in and the
/// driver's entry points these cases fail or hold, from a table:
///
/// - `vendor` (lower case) and `VENDOR` (upper case): the vendor's name,
///   from which the stand-in's names are made the one way the stand-ins
///   spell them (`backends/stand-ins/README.md`): `NAME`, what its hooks
///   are called after (`memgov_standin_<vendor>_vmm`, ...), its latency
///   knobs `LATENCY` and `SEED`, its exit check `EXIT_CHECK`, its knobs
///   failing the `n`th virtual memory call and the `n`th unmap
///   (`FAIL_VMM_AT`, `FAIL_UNMAP_AT`), and `BANNER`, how its aborts begin,
///   which names `library` (`LIBRARY`, the library the stand-in stands in
///   for);
/// - then, by the names these cases use, the driver's entry points the
///   arena fault cases and stress fail or hold: `RELEASE_ENTRY`,
///   `MAP_ENTRY`, `HOST_ALLOC_ENTRY` (page-locked host memory),
///   `CREATE_ENTRY`, `SET_ACCESS_ENTRY`, `UNMAP_ENTRY`.
macro_rules! stand_in {
    (
        vendor: $vendor:literal,
        VENDOR: $upper:literal,
        library: $library:literal,
        $($entry:ident: $name:literal),* $(,)?
    ) => {
        pub const NAME: &str = $vendor;
        pub const LIBRARY: &str = $library;
        pub const LATENCY: &str = concat!("MEMGOV_STANDIN_", $upper, "_LATENCY_US");
        pub const SEED: &str = concat!("MEMGOV_STANDIN_", $upper, "_LATENCY_SEED");
        pub const EXIT_CHECK: &str = concat!("MEMGOV_STANDIN_", $upper, "_EXIT_CHECK");
        pub const FAIL_VMM_AT: &str = concat!("MEMGOV_STANDIN_", $upper, "_FAIL_VMM_AT");
        pub const FAIL_UNMAP_AT: &str = concat!("MEMGOV_STANDIN_", $upper, "_FAIL_UNMAP_AT");
        pub const BANNER: &str = concat!("memgov ", $library, " stand-in: contract violation:");
        $(pub const $entry: &str = $name;)*
    };
}

/// The environment variable listing the entry points whose fault cells a
/// child runs (`name:min,name:min`).
pub const FAULT_ENTRIES: &str = "MEMGOV_FAULT_CELL_ENTRIES";

/// Whether the stand-in is what the backend opens (after printing why not).
pub fn on_stand_in() -> bool {
    match Context::new(Config::default()) {
        Ok(ctx) => {
            let stand_in = vendor::is_stand_in(&ctx);
            memgov::DeviceContext::teardown(ctx, false).expect("teardown");
            if !stand_in {
                println!(
                    "skipped: needs the stand-in {} (this is real hardware)",
                    vendor::LIBRARY
                );
            }
            stand_in
        }
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            println!("skipped: {}", e.message);
            false
        }
        Err(e) => panic!("{}::new failed: {e}", std::any::type_name::<Context>()),
    }
}

/// Case `case` run in a child (the test binary again, with the binary's
/// `CHILD` variable naming the case), on the stand-in only. A latency
/// without a seed gets an empty seed, so that the parent's seed does not
/// leak into the child.
pub fn child(case: &str, env: &[(&str, &str)]) -> Option<child_process::ChildRun> {
    if !on_stand_in() {
        return None;
    }
    let mut env = env.to_vec();
    if env.iter().any(|(k, _)| *k == LATENCY) && !env.iter().any(|(k, _)| *k == SEED) {
        env.push((SEED, ""));
    }
    Some(child_process::run(crate::CHILD, case, &env))
}

/// The child ran case `case` to its end.
pub fn passes(case: &str, env: &[(&str, &str)]) {
    if let Some(run) = child(case, env) {
        print!("{}", run.stdout);
        child_process::assert_passed(case, &run, &format!("child {case}: ok"));
    }
}

/// The stand-in stopped the child with the contract violation `what`.
pub fn aborts(case: &str, env: &[(&str, &str)], what: &str) {
    if let Some(run) = child(case, env) {
        child_process::assert_aborted(case, &run, BANNER, what, &format!("child {case}: ok"));
    }
}

/// The stand-in's hook `memgov_standin_<vendor>_<what>`.
fn hook(what: &str) -> *mut std::ffi::c_void {
    let name = format!("memgov_standin_{}_{what}", vendor::NAME);
    vendor::standin_symbol(&std::ffi::CString::new(name).expect("no NUL"))
}

/// A stand-in hook `int (unsigned long long out[N])`, called.
fn counters<const N: usize>(what: &str) -> [u64; N] {
    let p = hook(what);
    // SAFETY: the stand-in's hook, `int (unsigned long long out[N])`.
    let query: unsafe extern "C" fn(*mut u64) -> i32 = unsafe { std::mem::transmute(p) };
    let mut out = [u64::MAX; N];
    // SAFETY: N writable slots.
    assert_eq!(unsafe { query(out.as_mut_ptr()) }, 0);
    out
}

/// The stand-in's virtual memory counters (`memgov_standin_<vendor>_vmm`):
/// {reservations, reserved bytes, handles, physical bytes, mappings,
/// mapped bytes}.
pub fn vmm() -> [u64; 6] {
    counters("vmm")
}

/// The stand-in's capture counters (`memgov_standin_<vendor>_capture`):
/// {captures begun, invalidated, driver allocations made during a capture,
/// launches}.
pub fn capture_stats() -> [u64; 4] {
    counters("capture")
}

/// What the stand-in holds, as the capability fault cells read it.
pub fn driver_held() -> memgov_conformance::capability::DriverHeld {
    let v = vmm();
    memgov_conformance::capability::DriverHeld {
        reservations: v[0],
        handles: v[2],
        mapped_bytes: v[5],
    }
}

/// A context with an arena of 256 MiB of address space, 128 MiB mapped at
/// most: what the capability cases and fault cells run on.
pub fn capability_factory() -> Result<Context, memgov::BackendError> {
    Context::new(Config {
        arena: Some(ArenaConfig {
            reserve_bytes: 256 << 20,
            limit_bytes: 128 << 20,
        }),
        ..Config::default()
    })
}

/// A stand-in knob `int (const char *entry, unsigned long long n)` set to
/// `entry` (`None`: cleared).
fn set_knob(what: &str, entry: Option<(&str, u64)>) {
    let name = entry.map(|(e, _)| std::ffi::CString::new(e).expect("no NUL"));
    let n = entry.map_or(0, |(_, n)| n);
    let p = hook(what);
    // SAFETY: the stand-in's hook, `int (const char *, unsigned long long)`;
    // it copies the name.
    let set: unsafe extern "C" fn(*const c_char, u64) -> i32 = unsafe { std::mem::transmute(p) };
    let ptr = name.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: a NUL-terminated name (or null) and a count.
    assert_eq!(unsafe { set(ptr, n) }, 0);
}

/// The stand-in's fault knob: the `n`th call of `entry` from now on fails
/// (`None`: no fault).
pub fn fail_entry(entry: Option<(&str, u64)>) {
    set_knob("fail_entry", entry);
}

/// The stand-in's pause knob: the `n`th call of `entry` from now on blocks
/// until [`resume_entry`] (`None`: none).
pub fn pause_entry(entry: Option<(&str, u64)>) {
    set_knob("pause_entry", entry);
}

/// Whether a call is held by the pause knob.
pub fn entry_paused() -> bool {
    let p = hook("entry_paused");
    // SAFETY: the stand-in's hook, `int (void)`.
    let f: unsafe extern "C" fn() -> i32 = unsafe { std::mem::transmute(p) };
    // SAFETY: no arguments.
    unsafe { f() != 0 }
}

/// Let the call held by the pause knob go on.
pub fn resume_entry() {
    let p = hook("resume_entry");
    // SAFETY: the stand-in's hook, `void (void)`.
    let f: unsafe extern "C" fn() = unsafe { std::mem::transmute(p) };
    // SAFETY: no arguments.
    unsafe { f() }
}

/// In a child: the capability fault cells of every entry point listed in
/// `MEMGOV_FAULT_CELL_ENTRIES` (`name:min,name:min`), set through the
/// stand-in's hook; the exit check covers the process.
pub fn fault_cells_child() {
    let list = std::env::var(FAULT_ENTRIES).expect("the entry points");
    // Loads the stand-in, whose hook sets the faults.
    assert!(on_stand_in(), "fault cells run on the stand-in");
    let lines = memgov_conformance::capability::run_fault_cells(
        &list,
        &fail_entry,
        &capability_factory,
        &driver_held,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    lines.iter().for_each(|l| println!("{l}"));
}

/// In the parent: the fault cells of `entries` (entry point, the fewest
/// positions it must have) in one child with the exit check on.
pub fn fault_cells(entries: &[(&str, u32)]) {
    let list: Vec<String> = entries.iter().map(|(e, m)| format!("{e}:{m}")).collect();
    passes(
        "fault_cells",
        &[(FAULT_ENTRIES, list.join(",").as_str()), (EXIT_CHECK, "1")],
    );
}

/// The arena's driver as `memgov_conformance::arena_faults` drives it: the
/// stand-in's knobs and the vendor's entry names.
fn arena_driver() -> memgov_conformance::arena_faults::Driver<'static, Context> {
    memgov_conformance::arena_faults::Driver {
        factory: &capability_factory,
        fail: &fail_entry,
        held: &driver_held,
        release: vendor::RELEASE_ENTRY,
        pause: &pause_entry,
        paused: &entry_paused,
        resume: &resume_entry,
        map: vendor::MAP_ENTRY,
        mapping: &mapping,
        host_alloc: vendor::HOST_ALLOC_ENTRY,
    }
}

/// The bytes `arena` is mapping now.
fn mapping(arena: &vendor::Arena) -> u64 {
    arena.snapshot().mapping
}

/// In a child on the stand-in: the arena stress with `seed`
/// (`memgov_conformance::arena_stress`), printed as `arena stress seed N:
/// ok: ...`; panics when it failed.
pub fn arena_stress_child(seed: u64) {
    assert!(on_stand_in(), "the arena stress runs on the stand-in");
    let e = memgov_conformance::arena_stress::StressEntries {
        pause: &pause_entry,
        paused: &entry_paused,
        resume: &resume_entry,
        map: vendor::MAP_ENTRY,
        create: vendor::CREATE_ENTRY,
        set_access: vendor::SET_ACCESS_ENTRY,
        unmap: vendor::UNMAP_ENTRY,
    };
    match memgov_conformance::arena_stress::run(&arena_driver(), &e, seed) {
        Ok(line) => println!("arena stress seed {seed}: ok: {line}"),
        Err(e) => panic!("arena stress seed {seed}: {e}"),
    }
}

/// In a child on the stand-in: the arena's case `name` under a refused
/// release or page-locked allocation and on a capturing thread
/// (`memgov_conformance::arena_faults`), printed as `arena fault case NAME:
/// ok: ...`; panics when it failed.
pub fn arena_fault_child(name: &str) {
    match memgov_conformance::arena_faults::run(&arena_driver(), name) {
        Ok(line) => println!("arena fault case {name}: ok: {line}"),
        Err(e) => panic!("arena fault case {name}: {e}"),
    }
}
