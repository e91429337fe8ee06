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
        let placed = |w: &memgov_onnxruntime::Weight| {
            w.kind != WeightKind::Attribute
                && w.raw.is_some()
                && all.iter().filter(|o| o.name == w.name).count() == 1
        };
        let placeable = sum(&|w| placed(w));
        let outside = sum(&|w| !placed(w));
        let sub = sum(&|w| w.in_subgraph);
        let constants = sum(&|w| w.kind == WeightKind::Constant);
        println!(
            "{path}: {} B file, {} weights ({} B): {} ({} B) placeable in governed memory, {} ({} B) \
             left outside; {} ({} B) in subgraphs, {} ({} B) Constant values",
            bytes.len(),
            all.len(),
            all.iter().map(|w| w.bytes).sum::<u64>(),
            placeable.0,
            placeable.1,
            outside.0,
            outside.1,
            sub.0,
            sub.1,
            constants.0,
            constants.1
        );
        for w in all.iter().filter(|w| !placed(w) && w.bytes > 0) {
            let why = if w.kind == WeightKind::Attribute {
                "a node attribute, not an initializer"
            } else if w.raw.is_none() {
                "not stored as raw bytes"
            } else {
                "its name is given twice"
            };
            println!(
                "  outside: {:?} ({:?}{}, type {}, dims {:?}, {} B): {why}",
                w.name,
                w.kind,
                if w.in_subgraph { ", in a subgraph" } else { "" },
                w.data_type,
                w.dims,
                w.bytes
            );
        }
    }
    status
}
