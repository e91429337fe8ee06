//! Governed HIP memory: the first program a runtime author writes,
//! on the HIP backend.
//!
//! The program is `common/mod.rs`'s `run`; this file opens the device.
//!
//! ```sh
//! HIP_PATH=/usr LD_LIBRARY_PATH=$(backends/stand-ins/build.sh hip) cargo run -p memgov --features hip --example hip
//! ```
//!
//! Needs ROCm's `libamdhip64` and an AMD GPU (building needs ROCm's headers: `HIP_PATH`). Without one it prints why, as `skipped: ...`, and exits 0.

mod common;

use memgov::hip::{HipConfig, HipContext};
use std::process::ExitCode;

fn main() -> ExitCode {
    common::main(|| Ok(HipContext::new(HipConfig::default())?))
}
