//! Run the MatMul + Add model on ONNX Runtime with every CPU allocation
//! governed by a memgov context, print the outputs next to the values
//! computed in Rust, then retire the context and print its teardown report.
//!
//! ```sh
//! ORT_DYLIB_PATH=/path/to/libonnxruntime.so.1.32.0 \
//!     cargo run --manifest-path examples/onnxruntime/Cargo.toml --example matmul_add
//! ```

use memgov::host::{HostConfig, HostContext};
use memgov::{ContextConfig, Governor, Role};
use memgov_onnxruntime::{environment, GovernedAllocator, MatMulAdd};
use ort::value::Tensor;
use std::process::ExitCode;
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    let env = match environment() {
        Ok(env) => env,
        Err(why) => {
            println!("skipped: {why}");
            return ExitCode::SUCCESS;
        }
    };
    match run(&env) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("matmul_add: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(env: &ort::environment::Environment) -> Result<(), Box<dyn std::error::Error>> {
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default())?,
        ContextConfig::new().label("onnx-cpu").budget(16 << 20),
    );
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation)?;
    let model = MatMulAdd::new(3, 4);
    let bytes = model.to_onnx();
    println!(
        "model: Y = X[N,3] . W[3,4] + B[4], {} bytes of ONNX",
        bytes.len()
    );
    // The weights go into governed buffers; ONNX Runtime reads them there.
    let mut session = alloc.session(env, &bytes, Ok)?;
    println!(
        "weights: {} B in {} governed buffers, {} B left in ONNX Runtime's heap",
        session.governed_weight_bytes(),
        session.governed_weights(),
        session.outside_weight_bytes()
    );

    let rows = 2;
    let x = model.input(rows);
    let expected = model.reference(&x);
    let outputs =
        session.run(ort::inputs!["X" => Tensor::from_array(([rows, model.k], x.clone()))?])?;
    let (shape, y) = outputs["Y"].try_extract_tensor::<f32>()?;
    println!("X = {x:?}");
    println!("Y (onnxruntime, shape {shape:?}) = {y:?}");
    println!("Y (reference)              = {expected:?}");
    if y != expected.as_slice() {
        return Err("ONNX Runtime's output differs from the reference".into());
    }
    let snap = ctx.snapshot();
    println!(
        "governed: {} allocations, {} B charged now, peak {} B, {} B reported outside, allocator {:?}",
        snap.counters.allocations,
        snap.charged,
        snap.peak,
        snap.outside_bytes,
        alloc.stats()
    );

    drop(outputs);
    drop(session);
    drop(alloc);
    let report = ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(10))?;
    println!("teardown: {report:?}");
    let end = ctx.snapshot();
    println!(
        "after teardown: {} B charged, lifecycle {:?}",
        end.charged, end.lifecycle
    );
    if end.charged != 0 || report.reclaimed_buffers != 0 || report.backend_result.is_err() {
        return Err("the teardown was not clean".into());
    }
    Ok(())
}
