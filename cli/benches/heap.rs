//! Heap bytes the governor allocates per live allocation and per pending
//! release, counted by a counting global allocator installed here. Not a
//! timing: prints the `memgov bench` heap rows.
//!
//! Run: `cargo bench --bench heap`.

/// The harness of the `memgov` binary.
#[path = "../src/bench/mod.rs"]
mod bench;

#[global_allocator]
static ALLOC: bench::CountingAllocator = bench::CountingAllocator::new();

fn main() {
    let args = ["--filter".to_owned(), "heap".to_owned()];
    std::process::exit(bench::main_from_args(args).into());
}
