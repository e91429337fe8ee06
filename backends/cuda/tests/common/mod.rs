//! What the CUDA test files that run their cases in child processes on the
//! stand-in share: whether the stand-in is loaded, and running a case in a
//! child that must pass or must be stopped by the stand-in.

#![allow(dead_code)]

#[path = "../../../stand-ins/support/child.rs"]
pub mod child_process;

use memgov::cuda::{CudaConfig, CudaContext};
use memgov::BackendErrorKind;

pub const LATENCY: &str = "MEMGOV_STANDIN_CUDA_LATENCY_US";
pub const SEED: &str = "MEMGOV_STANDIN_CUDA_LATENCY_SEED";
pub const EXIT_CHECK: &str = "MEMGOV_STANDIN_CUDA_EXIT_CHECK";
pub const BANNER: &str = "memgov libcuda stand-in: contract violation:";

/// Whether the stand-in is what the loader finds (after printing why not).
pub fn on_stand_in() -> bool {
    match CudaContext::new(CudaConfig::default()) {
        Ok(ctx) => {
            let stand_in = ctx.is_stand_in();
            memgov::DeviceContext::teardown(ctx, false).expect("teardown");
            if !stand_in {
                println!("skipped: needs the stand-in libcuda (this is real hardware)");
            }
            stand_in
        }
        Err(e) if e.kind == BackendErrorKind::Unavailable => {
            println!("skipped: {}", e.message);
            false
        }
        Err(e) => panic!("CudaContext::new failed: {e}"),
    }
}

/// Case `case` run in a child (the test binary again, with `child_var`
/// naming the case), on the stand-in only. A latency without a seed gets
/// an empty seed, so that the parent's seed does not leak into the child.
pub fn child(child_var: &str, case: &str, env: &[(&str, &str)]) -> Option<child_process::ChildRun> {
    if !on_stand_in() {
        return None;
    }
    let mut env = env.to_vec();
    if env.iter().any(|(k, _)| *k == LATENCY) && !env.iter().any(|(k, _)| *k == SEED) {
        env.push((SEED, ""));
    }
    Some(child_process::run(child_var, case, &env))
}

/// The child ran case `case` to its end.
pub fn passes(child_var: &str, case: &str, env: &[(&str, &str)]) {
    if let Some(run) = child(child_var, case, env) {
        print!("{}", run.stdout);
        child_process::assert_passed(case, &run, &format!("child {case}: ok"));
    }
}

/// The stand-in stopped the child with the contract violation `what`.
pub fn aborts(child_var: &str, case: &str, env: &[(&str, &str)], what: &str) {
    if let Some(run) = child(child_var, case, env) {
        child_process::assert_aborted(case, &run, BANNER, what, &format!("child {case}: ok"));
    }
}

/// The stand-in's `memgov_standin_cuda_vmm`: {reservations, reserved
/// bytes, handles, physical bytes, mappings, mapped bytes}.
pub fn vmm() -> [u64; 6] {
    use libloading::os::unix::{Library, RTLD_LAZY};
    const RTLD_NOLOAD: std::os::raw::c_int = 4;
    // SAFETY: the stand-in is loaded already (cudarc opened it); the hook
    // has the declared signature (`int (unsigned long long out[6])`).
    unsafe {
        let lib = Library::open(Some("libcuda.so.1"), RTLD_NOLOAD | RTLD_LAZY)
            .expect("the stand-in libcuda is loaded");
        let query: libloading::os::unix::Symbol<unsafe extern "C" fn(*mut u64) -> i32> =
            lib.get(b"memgov_standin_cuda_vmm").expect("hook");
        let mut out = [u64::MAX; 6];
        assert_eq!(query(out.as_mut_ptr()), 0);
        out
    }
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
pub fn capability_factory() -> Result<CudaContext, memgov::BackendError> {
    CudaContext::new(CudaConfig {
        arena: Some(memgov::cuda::ArenaConfig {
            reserve_bytes: 256 << 20,
            limit_bytes: 128 << 20,
        }),
        ..CudaConfig::default()
    })
}

/// The environment variable listing the entry points whose fault cells a
/// child runs.
pub const FAULT_ENTRIES: &str = "MEMGOV_FAULT_CELL_ENTRIES";

/// The stand-in's `memgov_standin_cuda_fail_entry`: the `n`th call of
/// `entry` from now on fails (`None`: no fault).
pub fn fail_entry(entry: Option<(&str, u64)>) {
    use libloading::os::unix::{Library, RTLD_LAZY};
    const RTLD_NOLOAD: std::os::raw::c_int = 4;
    let name = entry.map(|(e, _)| std::ffi::CString::new(e).expect("no NUL"));
    let n = entry.map_or(0, |(_, n)| n);
    // SAFETY: the stand-in is loaded already (cudarc opened it); the hook
    // has the declared signature (`int (const char *, unsigned long long)`)
    // and copies the name.
    unsafe {
        let lib = Library::open(Some("libcuda.so.1"), RTLD_NOLOAD | RTLD_LAZY)
            .expect("the stand-in libcuda is loaded");
        let set: libloading::os::unix::Symbol<
            unsafe extern "C" fn(*const std::os::raw::c_char, u64) -> i32,
        > = lib.get(b"memgov_standin_cuda_fail_entry").expect("hook");
        let p = name.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        assert_eq!(set(p, n), 0);
    }
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
pub fn fault_cells(child_var: &str, entries: &[(&str, u32)]) {
    let list: Vec<String> = entries.iter().map(|(e, m)| format!("{e}:{m}")).collect();
    passes(
        child_var,
        "fault_cells",
        &[(FAULT_ENTRIES, list.join(",").as_str()), (EXIT_CHECK, "1")],
    );
}

/// In a child on the stand-in: the arena's case `name` under a refused
/// `cuMemRelease` or `cuMemHostAlloc` and on a capturing thread
/// (`memgov_conformance::arena_faults`), printed as `arena fault case NAME:
/// In a child on the stand-in: the arena stress with `seed`
/// (`memgov_conformance::arena_stress`), printed as `arena stress seed N:
/// ok: ...`; panics when it failed.
pub fn arena_stress_child(seed: u64) {
    assert!(on_stand_in(), "the arena stress runs on the stand-in");
    let d = memgov_conformance::arena_faults::Driver {
        factory: &capability_factory,
        fail: &fail_entry,
        held: &driver_held,
        release: "cuMemRelease",
        pause: &pause_entry,
        paused: &entry_paused,
        resume: &resume_entry,
        map: "cuMemMap",
        mapping: &|a: &memgov::cuda::CudaArena| a.snapshot().mapping,
        host_alloc: "cuMemHostAlloc",
    };
    let e = memgov_conformance::arena_stress::StressEntries {
        pause: &pause_entry,
        paused: &entry_paused,
        resume: &resume_entry,
        map: "cuMemMap",
        create: "cuMemCreate",
        set_access: "cuMemSetAccess",
        unmap: "cuMemUnmap",
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
        release: "cuMemRelease",
        pause: &pause_entry,
        paused: &entry_paused,
        resume: &resume_entry,
        map: "cuMemMap",
        mapping: &|a: &memgov::cuda::CudaArena| a.snapshot().mapping,
        host_alloc: "cuMemHostAlloc",
    };
    match memgov_conformance::arena_faults::run(&d, name) {
        Ok(line) => println!("arena fault case {name}: ok: {line}"),
        Err(e) => panic!("arena fault case {name}: {e}"),
    }
}

/// A symbol of the loaded stand-in libcuda.
fn standin_symbol<T: Copy>(name: &[u8]) -> T {
    use libloading::os::unix::{Library, RTLD_LAZY};
    const RTLD_NOLOAD: std::os::raw::c_int = 4;
    // SAFETY: the stand-in is loaded already (cudarc opened it); the caller
    // names the symbol's declared type.
    unsafe {
        let lib = Library::open(Some("libcuda.so.1"), RTLD_NOLOAD | RTLD_LAZY)
            .expect("the stand-in libcuda is loaded");
        let f: libloading::os::unix::Symbol<T> = lib.get(name).expect("the stand-in's hook");
        *f
    }
}

/// The stand-in's pause knob: the `n`th call of `entry` from now on blocks
/// until [`resume_entry`] (`None`: none).
pub fn pause_entry(entry: Option<(&str, u64)>) {
    let name = entry.map(|(e, _)| std::ffi::CString::new(e).expect("no NUL"));
    let n = entry.map_or(0, |(_, n)| n);
    let set: unsafe extern "C" fn(*const std::os::raw::c_char, u64) -> i32 =
        standin_symbol(b"memgov_standin_cuda_pause_entry\0");
    let ptr = name.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: the hook's declared signature; a NUL-terminated name (copied)
    // or null, and a count.
    assert_eq!(unsafe { set(ptr, n) }, 0);
}

/// Whether a call is held by the pause knob.
pub fn entry_paused() -> bool {
    let f: unsafe extern "C" fn() -> i32 = standin_symbol(b"memgov_standin_cuda_entry_paused\0");
    // SAFETY: the hook's declared signature, no arguments.
    unsafe { f() != 0 }
}

/// Let the call held by the pause knob go on.
pub fn resume_entry() {
    let f: unsafe extern "C" fn() = standin_symbol(b"memgov_standin_cuda_resume_entry\0");
    // SAFETY: the hook's declared signature, no arguments.
    unsafe { f() }
}
