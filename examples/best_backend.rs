//! Governed GPU memory on the best backend present, chosen at run time:
//! CUDA, then HIP, then Vulkan (those compiled in), then the embedded host
//! backend. `MEMGOV_BACKEND` names others (`MEMGOV_BACKEND=vulkan,host`).
//!
//! The program is `common/mod.rs`'s `run`; this file opens the device.
//!
//! ```sh
//! cargo run -p memgov --features vulkan,cuda --example best_backend
//! ```

mod common;

use memgov::any::AnyContext;
use std::process::ExitCode;

fn main() -> ExitCode {
    common::main(|| Ok(AnyContext::open_from_env()?))
}
