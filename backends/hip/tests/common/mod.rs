//! What the HIP test files that run their cases in child processes on the
//! stand-in share: the part every vendor shares (`backends/cases/common.rs`:
//! whether the stand-in is loaded, children that must pass or must be
//! stopped by the stand-in, the stand-in's hooks, the conformance fault
//! cells, arena fault cases and stress), instantiated for HIP through the
//! `vendor` module below.

#![allow(dead_code)]

#[macro_use]
#[path = "../../../cases/common.rs"]
mod shared;

pub use shared::*;

/// What the shared part needs of HIP.
mod vendor {
    use std::ffi::CStr;

    pub use memgov::hip::{
        ArenaConfig, HipArena as Arena, HipConfig as Config, HipContext as Context,
    };

    stand_in! {
        vendor: "hip",
        VENDOR: "HIP",
        library: "libamdhip64",
        release: "hipMemRelease",
        map: "hipMemMap",
        host_alloc: "hipHostMalloc",
        create: "hipMemCreate",
        set_access: "hipMemSetAccess",
        unmap: "hipMemUnmap",
    }

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
