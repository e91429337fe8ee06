//! What a registered allocator leaves behind for good: the block ONNX
//! Runtime holds a pointer to, and nothing that block could reach. A
//! counting global allocator measures the Rust heap over many
//! register → session → drop → retire cycles; a retired context's record
//! (about 10 KB with its shards) must not be among what stays.
//!
//! Needs the ONNX Runtime library (`ORT_DYLIB_PATH`); without it the test
//! prints `skipped: <why>` and passes.

use memgov::host::{HostConfig, HostContext};
use memgov::{ContextConfig, Governor, Role};
use memgov_onnxruntime::{environment, GovernedAllocator, MatMulAdd};
use ort::session::Session;
use ort::value::Tensor;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

/// The system allocator, counting the bytes live on the Rust heap.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY: every call is forwarded to `System` with the same arguments; the
// counter does not change what is allocated.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: forwarded as is (the caller keeps `GlobalAlloc`'s contract).
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(p, layout) }
    }
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        // SAFETY: forwarded as is.
        unsafe { System.realloc(p, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// One allocator's whole life: register, create a session, run it, drop
/// everything, retire the context.
fn cycle(env: &ort::environment::Environment, model: &MatMulAdd, bytes: &[u8]) {
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new().label("cycle").budget(64 << 20),
    );
    let alloc = GovernedAllocator::register(env, &ctx, Role::Activation).unwrap();
    let mut s = alloc
        .strict(|| {
            Session::builder(env)?
                .with_env_allocators()?
                .with_intra_threads(1)?
                .commit_from_memory(bytes)
        })
        .unwrap();
    let x = Tensor::from_array(([4usize, model.k], model.input(4))).unwrap();
    drop(s.run(ort::inputs!["X" => x]).unwrap());
    assert!(alloc.stats().allocations > 0);
    drop(s);
    drop(alloc);
    ctx.retire()
        .wait(Instant::now() + Duration::from_secs(20))
        .unwrap();
    assert_eq!(ctx.snapshot().charged, 0);
}

#[test]
fn a_dropped_allocator_keeps_only_its_block() {
    let env = match environment() {
        Ok(env) => env,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let model = MatMulAdd::new(64, 64);
    let bytes = model.to_onnx();
    // Warm up what is made once per process (ONNX Runtime's kernel
    // registry, the `ort` crate's statics).
    for _ in 0..3 {
        cycle(&env, &model, &bytes);
    }
    const CYCLES: i64 = 20;
    let before = LIVE.load(Ordering::Relaxed);
    for _ in 0..CYCLES {
        cycle(&env, &model, &bytes);
    }
    let per_allocator = (LIVE.load(Ordering::Relaxed) - before) / CYCLES;
    println!("kept per registered allocator: {per_allocator} B of Rust heap");
    assert!(
        per_allocator <= 1024,
        "each allocator keeps {per_allocator} B: more than its block"
    );
}
