//! List where the weights of an ONNX model file sit, and which of them
//! `GovernedAllocator::session` can place in governed memory.
//!
//! ```sh
//! cargo run --manifest-path examples/onnxruntime/Cargo.toml --example weights -- model.onnx
//! ```

use memgov_onnxruntime::{weights, WeightKind};
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut status = ExitCode::SUCCESS;
    for path in std::env::args().skip(1) {
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("{path}: {e}");
                status = ExitCode::FAILURE;
                continue;
            }
        };
        let all = match weights(&bytes) {
            Ok(w) => w,
            Err(e) => {
                eprintln!("{path}: {e}");
                status = ExitCode::FAILURE;
                continue;
            }
        };
        let sum = |f: &dyn Fn(&memgov_onnxruntime::Weight) -> bool| {
            let ws: Vec<_> = all.iter().filter(|w| f(w)).collect();
            (ws.len(), ws.iter().map(|w| w.bytes).sum::<u64>())
        };
        let placeable = sum(&|w| w.kind != WeightKind::SubgraphInitializer && w.raw.is_some());
        let typed = sum(&|w| w.kind != WeightKind::SubgraphInitializer && w.raw.is_none());
        let sub = sum(&|w| w.kind == WeightKind::SubgraphInitializer);
        let constants = sum(&|w| w.kind == WeightKind::Constant);
        println!(
            "{path}: {} B file; placeable in governed memory (main-graph initializers and Constant nodes \
             stored as raw data) {} ({} B); the same stored otherwise {} ({} B); subgraph initializers \
             {} ({} B); of all those, Constant nodes {} ({} B)",
            bytes.len(),
            placeable.0,
            placeable.1,
            typed.0,
            typed.1,
            sub.0,
            sub.1,
            constants.0,
            constants.1
        );
    }
    status
}
