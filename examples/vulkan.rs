//! Governed Vulkan memory: the first program a runtime author writes,
//! on the Vulkan backend.
//!
//! The program is `common/mod.rs`'s `run`; this file opens the device.
//!
//! ```sh
//! cargo run -p memgov --features vulkan --example vulkan
//! ```
//!
//! Needs a Vulkan loader and driver (Mesa's lavapipe is a software one). Without one it prints why, as `skipped: ...`, and exits 0.

mod common;

use memgov::vulkan::{VulkanConfig, VulkanContext};
use std::process::ExitCode;

fn main() -> ExitCode {
    common::main(|| Ok(VulkanContext::new(VulkanConfig::default())?))
}
