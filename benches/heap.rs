//! Heap bytes the governor allocates per live allocation and per pending
//! release, counted by a counting global allocator installed here. Not a
//! timing: prints the `memgov bench` heap rows.
//!
//! Run: `cargo bench --bench heap`.

#[global_allocator]
static ALLOC: memgov::bench::CountingAllocator = memgov::bench::CountingAllocator::new();

fn main() {
    std::process::exit(memgov::bench::main(&["--filter".into(), "heap".into()]));
}
