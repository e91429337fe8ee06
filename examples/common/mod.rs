//! The program every backend example runs (`host.rs`, `vulkan.rs`,
//! `cuda.rs`, `hip.rs`, `best_backend.rs`): each opens its device and hands
//! it to [`main`], which runs [`run`] on it.

use memgov::backend::{BackendError, BackendErrorKind};
use memgov::{Alloc, ContextConfig, DeviceContext, Governor, Role};
use std::error::Error;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Opens a device with `open` and runs [`run`] on it. A backend whose
/// driver is not on this machine (`BackendErrorKind::Unavailable`) is
/// `skipped: <why>` and exit 0; any other error is printed and exit 1.
pub fn main<C: DeviceContext>(open: impl FnOnce() -> Result<C, Box<dyn Error>>) -> ExitCode {
    let result = match open() {
        Ok(device) => run(device),
        Err(e) => match e.downcast_ref::<BackendError>() {
            Some(b) if b.kind == BackendErrorKind::Unavailable => {
                println!("skipped: {}", b.message);
                Ok(())
            }
            _ => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Register `device` with a 64 MiB budget, allocate on a stream, write and
/// read back, release stream-ordered, retire, and print the report.
pub fn run<C: DeviceContext>(device: C) -> Result<(), Box<dyn Error>> {
    let gov: Governor<C> = Governor::new();
    let ctx = gov.register(
        device,
        ContextConfig::new().label("example").budget(64 << 20),
    );
    let d = ctx.description();
    println!("{}: {} ({}, {})", d.backend, d.name, d.execution, d.driver);

    let stream = ctx.create_stream("main")?;
    let buf = ctx.allocate(&stream, Alloc::new(1 << 20, Role::Activation))?;
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    buf.write(0, &pattern)?;
    let mut back = vec![0u8; pattern.len()];
    buf.read(0, &mut back)?;
    if let Some(at) = back.iter().zip(&pattern).position(|(b, p)| b != p) {
        return Err(format!("byte {at} read back differs from what was written").into());
    }
    println!(
        "allocated {} bytes, wrote and read back {} bytes",
        buf.len(),
        back.len()
    );

    // The free is queued on the stream: it runs after the work before it,
    // and the context cannot be destroyed until it has.
    buf.release_on(&stream)?;
    drop(stream);

    let report = ctx
        .retire()
        .wait(Instant::now() + Duration::from_secs(10))?;
    println!(
        "retired in {:?}: {} stream-ordered release(s) executed, {} abandoned, backend teardown {}",
        report.elapsed,
        report.retired_releases,
        report.abandoned_releases,
        match &report.backend_result {
            Ok(()) => "ok".to_owned(),
            Err(e) => e.to_string(),
        }
    );
    report.backend_result?;
    Ok(())
}
