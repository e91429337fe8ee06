//! Governed memory on the embedded host backend: a simulated device whose
//! streams are worker threads, so this runs on any machine.
//!
//! The program is `common/mod.rs`'s `run`; this file opens the device.
//!
//! ```sh
//! cargo run -p memgov --example host
//! ```

mod common;

use memgov::host::{HostConfig, HostContext};
use std::process::ExitCode;

fn main() -> ExitCode {
    common::main(|| Ok(HostContext::new(HostConfig::default())?))
}
