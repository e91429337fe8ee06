//! `cargo bench --bench table -- [--quick] [--json] [--filter WORD]`: the
//! `memgov bench` table, from a bench target that installs the counting
//! allocator itself (so the heap rows are measured here too).

/// The harness of the `memgov` binary.
#[path = "../src/bench/mod.rs"]
mod bench;

#[global_allocator]
static ALLOC: bench::CountingAllocator = bench::CountingAllocator::new();

fn main() {
    std::process::exit(bench::main_from_args(std::env::args().skip(1)).into());
}
