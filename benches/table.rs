//! `cargo bench --bench table -- [--quick] [--json] [--filter WORD]`: the
//! `memgov bench` table, from a bench target that installs the counting
//! allocator itself (so the heap rows are measured here too).

#[global_allocator]
static ALLOC: memgov::bench::CountingAllocator = memgov::bench::CountingAllocator::new();

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(memgov::bench::main(&args));
}
