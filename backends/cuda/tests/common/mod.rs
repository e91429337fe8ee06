//! What the CUDA test files that run their cases in child processes on the
//! stand-in share: the part every vendor shares (`backends/cases/common.rs`:
//! whether the stand-in is loaded, children that must pass or must be
//! stopped by the stand-in, the stand-in's hooks, the conformance fault
//! cells, arena fault cases and stress), instantiated for CUDA through the
//! `vendor` module below.

#![allow(dead_code)]

#[path = "../../../stand-ins/support/child.rs"]
pub mod child_process;
#[path = "../../../cases/common.rs"]
mod shared;

pub use shared::*;

/// What the shared part needs of CUDA.
mod vendor {
    use std::ffi::CStr;

    pub use memgov::cuda::{
        ArenaConfig, CudaArena as Arena, CudaConfig as Config, CudaContext as Context,
    };

    pub const LATENCY: &str = "MEMGOV_STANDIN_CUDA_LATENCY_US";
    pub const SEED: &str = "MEMGOV_STANDIN_CUDA_LATENCY_SEED";
    pub const EXIT_CHECK: &str = "MEMGOV_STANDIN_CUDA_EXIT_CHECK";
    pub const BANNER: &str = "memgov libcuda stand-in: contract violation:";

    /// The library the stand-in stands in for, and the context's name.
    pub const LIBRARY: &str = "libcuda";
    pub const CONTEXT_NAME: &str = "CudaContext";

    /// The stand-in's hooks.
    pub const VMM_HOOK: &CStr = c"memgov_standin_cuda_vmm";
    pub const CAPTURE_HOOK: &CStr = c"memgov_standin_cuda_capture";
    pub const FAIL_ENTRY_HOOK: &CStr = c"memgov_standin_cuda_fail_entry";
    pub const PAUSE_ENTRY_HOOK: &CStr = c"memgov_standin_cuda_pause_entry";
    pub const ENTRY_PAUSED_HOOK: &CStr = c"memgov_standin_cuda_entry_paused";
    pub const RESUME_ENTRY_HOOK: &CStr = c"memgov_standin_cuda_resume_entry";

    /// The driver's entry points the arena fault cases and stress fail or
    /// hold.
    pub const RELEASE_ENTRY: &str = "cuMemRelease";
    pub const MAP_ENTRY: &str = "cuMemMap";
    pub const HOST_ALLOC_ENTRY: &str = "cuMemHostAlloc";
    pub const CREATE_ENTRY: &str = "cuMemCreate";
    pub const SET_ACCESS_ENTRY: &str = "cuMemSetAccess";
    pub const UNMAP_ENTRY: &str = "cuMemUnmap";

    /// Whether `ctx` runs on the stand-in.
    pub fn is_stand_in(ctx: &Context) -> bool {
        ctx.is_stand_in()
    }

    /// A symbol of the loaded stand-in libcuda.
    pub fn standin_symbol(name: &CStr) -> *mut std::ffi::c_void {
        use libloading::os::unix::{Library, RTLD_LAZY};
        const RTLD_NOLOAD: std::os::raw::c_int = 4;
        // SAFETY: the stand-in is loaded already (cudarc opened it); the
        // caller calls the symbol with its declared type.
        unsafe {
            let lib = Library::open(Some("libcuda.so.1"), RTLD_NOLOAD | RTLD_LAZY)
                .expect("the stand-in libcuda is loaded");
            let f: libloading::os::unix::Symbol<*mut std::ffi::c_void> = lib
                .get(name.to_bytes_with_nul())
                .expect("the stand-in's hook");
            *f
        }
    }
}
