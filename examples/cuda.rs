//! Governed CUDA memory: the first program a runtime author writes,
//! on the CUDA backend.
//!
//! The program is `common/mod.rs`'s `run`; this file opens the device.
//!
//! ```sh
//! LD_LIBRARY_PATH=$(backends/stand-ins/build.sh cuda) cargo run -p memgov --features cuda --example cuda
//! ```
//!
//! Needs the NVIDIA driver's `libcuda` (loaded at run time; the CUDA toolkit is not needed). Without one it prints why, as `skipped: ...`, and exits 0.

mod common;

use memgov::cuda::{CudaConfig, CudaContext};
use std::process::ExitCode;

fn main() -> ExitCode {
    common::main(|| Ok(CudaContext::new(CudaConfig::default())?))
}
