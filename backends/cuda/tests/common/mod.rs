//! What the CUDA test files that run their cases in child processes on the
//! stand-in share: the part every vendor shares (`backends/cases/common.rs`:
//! whether the stand-in is loaded, children that must pass or must be
//! stopped by the stand-in, the stand-in's hooks, the conformance fault
//! cells, arena fault cases and stress), instantiated for CUDA through the
//! `vendor` module below.

#![allow(dead_code)]

#[macro_use]
#[path = "../../../cases/common.rs"]
mod shared;

pub use shared::*;

pub mod raw_copy;

/// What the shared part needs of CUDA.
mod vendor {
    use std::ffi::CStr;

    pub use memgov::cuda::{
        ArenaConfig, CudaArena as Arena, CudaConfig as Config, CudaContext as Context,
    };

    stand_in! {
        vendor: "cuda",
        VENDOR: "CUDA",
        library: "libcuda",
        RELEASE_ENTRY: "cuMemRelease",
        MAP_ENTRY: "cuMemMap",
        HOST_ALLOC_ENTRY: "cuMemHostAlloc",
        CREATE_ENTRY: "cuMemCreate",
        SET_ACCESS_ENTRY: "cuMemSetAccess",
        UNMAP_ENTRY: "cuMemUnmap",
    }

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
