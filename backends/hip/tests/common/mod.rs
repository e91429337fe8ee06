//! What the HIP test files share for the capability cases and fault cells
//! (memgov-conformance's `capability` module) on the stand-in: the context
//! they run on, what the stand-in holds, and its fault hook.

#![allow(dead_code)]

use memgov::hip::raw as hip;
use memgov::hip::{ArenaConfig, HipConfig, HipContext};

/// The environment variable listing the entry points whose fault cells a
/// child runs (`name:min,name:min`).
pub const FAULT_ENTRIES: &str = "MEMGOV_FAULT_CELL_ENTRIES";

/// A context with an arena of 256 MiB of address space, 128 MiB mapped at
/// most: what the capability cases and fault cells run on.
pub fn capability_factory() -> Result<HipContext, memgov::BackendError> {
    HipContext::new(HipConfig {
        arena: Some(ArenaConfig {
            reserve_bytes: 256 << 20,
            limit_bytes: 128 << 20,
        }),
        ..HipConfig::default()
    })
}

/// A stand-in hook `int (unsigned long long out[N])`, called.
fn counters<const N: usize>(name: &std::ffi::CStr) -> [u64; N] {
    let p = hip::symbol(name).expect("the stand-in's hook");
    // SAFETY: the stand-in's hook, `int (unsigned long long out[N])`.
    let query: unsafe extern "C" fn(*mut u64) -> i32 = unsafe { std::mem::transmute(p) };
    let mut out = [u64::MAX; N];
    // SAFETY: N writable slots.
    assert_eq!(unsafe { query(out.as_mut_ptr()) }, 0);
    out
}

/// The stand-in's `memgov_standin_hip_vmm`: {reservations, reserved
/// bytes, handles, physical bytes, mappings, mapped bytes}.
pub fn vmm() -> [u64; 6] {
    counters(c"memgov_standin_hip_vmm")
}

/// The stand-in's `memgov_standin_hip_capture`: {captures begun,
/// invalidated, runtime allocations made during a capture, launches}.
pub fn capture_stats() -> [u64; 4] {
    counters(c"memgov_standin_hip_capture")
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

/// The stand-in's `memgov_standin_hip_fail_entry`: the `n`th call of
/// `entry` from now on fails (`None`: no fault).
pub fn fail_entry(entry: Option<(&str, u64)>) {
    let name = entry.map(|(e, _)| std::ffi::CString::new(e).expect("no NUL"));
    let n = entry.map_or(0, |(_, n)| n);
    let p = hip::symbol(c"memgov_standin_hip_fail_entry").expect("the stand-in's hook");
    // SAFETY: the stand-in's hook, `int (const char *, unsigned long long)`;
    // it copies the name.
    let set: unsafe extern "C" fn(*const std::os::raw::c_char, u64) -> i32 =
        unsafe { std::mem::transmute(p) };
    let ptr = name.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: a NUL-terminated name (or null) and a count.
    assert_eq!(unsafe { set(ptr, n) }, 0);
}

/// In a child on the stand-in: the capability fault cells of every entry
/// point listed in `MEMGOV_FAULT_CELL_ENTRIES`; the exit check covers the
/// process.
pub fn fault_cells_child() {
    let list = std::env::var(FAULT_ENTRIES).expect("the entry points");
    let lines = memgov_conformance::capability::run_fault_cells(
        &list,
        &fail_entry,
        &capability_factory,
        &driver_held,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    lines.iter().for_each(|l| println!("{l}"));
}

/// In a child on the stand-in: the arena's case `name` under a refused
/// `hipMemRelease` or `hipHostMalloc` and on a capturing thread
/// (`memgov_conformance::arena_faults`), printed as `arena fault case NAME:
/// In a child on the stand-in: the arena stress with `seed`
/// (`memgov_conformance::arena_stress`), printed as `arena stress seed N:
/// ok: ...`; panics when it failed.
pub fn arena_stress_child(seed: u64) {
    let d = memgov_conformance::arena_faults::Driver {
        factory: &capability_factory,
        fail: &fail_entry,
        held: &driver_held,
        release: "hipMemRelease",
        pause: &pause_entry,
        paused: &entry_paused,
        resume: &resume_entry,
        map: "hipMemMap",
        mapping: &|a: &memgov::hip::HipArena| a.snapshot().mapping,
        host_alloc: "hipHostMalloc",
    };
    let e = memgov_conformance::arena_stress::StressEntries {
        pause: &pause_entry,
        paused: &entry_paused,
        resume: &resume_entry,
        map: "hipMemMap",
        create: "hipMemCreate",
        set_access: "hipMemSetAccess",
        unmap: "hipMemUnmap",
    };
    match memgov_conformance::arena_stress::run(&d, &e, seed) {
        Ok(line) => println!("arena stress seed {seed}: ok: {line}"),
        Err(e) => panic!("arena stress seed {seed}: {e}"),
    }
}

/// ok: ...`; panics when it failed.
pub fn arena_fault_child(name: &str) {
    let d = memgov_conformance::arena_faults::Driver {
        factory: &capability_factory,
        fail: &fail_entry,
        held: &driver_held,
        release: "hipMemRelease",
        pause: &pause_entry,
        paused: &entry_paused,
        resume: &resume_entry,
        map: "hipMemMap",
        mapping: &|a: &memgov::hip::HipArena| a.snapshot().mapping,
        host_alloc: "hipHostMalloc",
    };
    match memgov_conformance::arena_faults::run(&d, name) {
        Ok(line) => println!("arena fault case {name}: ok: {line}"),
        Err(e) => panic!("arena fault case {name}: {e}"),
    }
}

/// The stand-in's pause knob: the `n`th call of `entry` from now on blocks
/// until [`resume_entry`] (`None`: none).
pub fn pause_entry(entry: Option<(&str, u64)>) {
    let name = entry.map(|(e, _)| std::ffi::CString::new(e).expect("no NUL"));
    let n = entry.map_or(0, |(_, n)| n);
    let p = hip::symbol(c"memgov_standin_hip_pause_entry").expect("the stand-in's hook");
    // SAFETY: the stand-in's hook, `int (const char *, unsigned long long)`;
    // it copies the name.
    let set: unsafe extern "C" fn(*const std::os::raw::c_char, u64) -> i32 =
        unsafe { std::mem::transmute(p) };
    let ptr = name.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: a NUL-terminated name (or null) and a count.
    assert_eq!(unsafe { set(ptr, n) }, 0);
}

/// Whether a call is held by the pause knob.
pub fn entry_paused() -> bool {
    let p = hip::symbol(c"memgov_standin_hip_entry_paused").expect("the stand-in's hook");
    // SAFETY: the stand-in's hook, `int (void)`.
    let f: unsafe extern "C" fn() -> i32 = unsafe { std::mem::transmute(p) };
    // SAFETY: no arguments.
    unsafe { f() != 0 }
}

/// Let the call held by the pause knob go on.
pub fn resume_entry() {
    let p = hip::symbol(c"memgov_standin_hip_resume_entry").expect("the stand-in's hook");
    // SAFETY: the stand-in's hook, `void (void)`.
    let f: unsafe extern "C" fn() = unsafe { std::mem::transmute(p) };
    // SAFETY: no arguments.
    unsafe { f() }
}
