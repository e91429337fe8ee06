//! `memgov bench` measurements (being written; see issue #5).

/// Entry point of `memgov bench`. Returns the process exit code.
pub fn main(_args: &[String]) -> i32 {
    eprintln!("memgov bench: not implemented yet");
    2
}
