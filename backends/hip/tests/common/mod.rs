//! What the HIP test files that run their cases in child processes on the
//! stand-in share: the part every vendor shares (`backends/cases/common.rs`:
//! whether the stand-in is loaded, children that must pass or must be
//! stopped by the stand-in, the stand-in's hooks, the conformance fault
//! cells, arena fault cases and stress), instantiated for HIP through the
//! `vendor` module below.

#![allow(dead_code)]

#[path = "../../../stand-ins/support/child.rs"]
pub mod child_process;
#[path = "../../../cases/common.rs"]
mod shared;

pub use shared::*;

/// What the shared part needs of HIP.
mod vendor {
    use std::ffi::CStr;

    pub use memgov::hip::{
        ArenaConfig, HipArena as Arena, HipConfig as Config, HipContext as Context,
    };

    pub const LATENCY: &str = "MEMGOV_STANDIN_HIP_LATENCY_US";
    pub const SEED: &str = "MEMGOV_STANDIN_HIP_LATENCY_SEED";
    pub const EXIT_CHECK: &str = "MEMGOV_STANDIN_HIP_EXIT_CHECK";
    pub const BANNER: &str = "memgov libamdhip64 stand-in: contract violation:";

    /// The library the stand-in stands in for, and the context's name.
    pub const LIBRARY: &str = "libamdhip64";
    pub const CONTEXT_NAME: &str = "HipContext";

    /// The stand-in's hooks.
    pub const VMM_HOOK: &CStr = c"memgov_standin_hip_vmm";
    pub const CAPTURE_HOOK: &CStr = c"memgov_standin_hip_capture";
    pub const FAIL_ENTRY_HOOK: &CStr = c"memgov_standin_hip_fail_entry";
    pub const PAUSE_ENTRY_HOOK: &CStr = c"memgov_standin_hip_pause_entry";
    pub const ENTRY_PAUSED_HOOK: &CStr = c"memgov_standin_hip_entry_paused";
    pub const RESUME_ENTRY_HOOK: &CStr = c"memgov_standin_hip_resume_entry";

    /// The runtime's entry points the arena fault cases and stress fail or
    /// hold.
    pub const RELEASE_ENTRY: &str = "hipMemRelease";
    pub const MAP_ENTRY: &str = "hipMemMap";
    pub const HOST_ALLOC_ENTRY: &str = "hipHostMalloc";
    pub const CREATE_ENTRY: &str = "hipMemCreate";
    pub const SET_ACCESS_ENTRY: &str = "hipMemSetAccess";
    pub const UNMAP_ENTRY: &str = "hipMemUnmap";

    /// Whether `ctx` runs on the stand-in.
    pub fn is_stand_in(ctx: &Context) -> bool {
        use memgov::DeviceContext;
        ctx.describe().execution == memgov::Execution::StandIn
    }

    /// A symbol of the loaded stand-in runtime.
    pub fn standin_symbol(name: &CStr) -> *mut std::ffi::c_void {
        memgov::hip::raw::symbol(name).expect("the stand-in's hook")
    }
}
