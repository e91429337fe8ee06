//! Re-running this test binary as a child process, for the tests that must
//! watch a process die: planted contract violations the stand-in driver
//! aborts on, and knobs that hold for a whole process.
//!
//! The child runs only the ignored test named `child_entry`, with an
//! environment variable naming the case; the test file's `child_entry` reads
//! it, runs that case and prints the file's end marker when it got through.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus};

/// The signal a stand-in raises on a contract violation (`abort()`).
const SIGABRT: i32 = 6;

/// How a child process ended and what it printed.
pub struct ChildRun {
    /// Exit status (a code, or the signal that ended it).
    pub status: ExitStatus,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
}

impl ChildRun {
    /// Both streams, stderr first, for failure messages.
    pub fn output(&self) -> String {
        format!("{}{}", self.stderr, self.stdout)
    }
}

/// Run case `case` of this binary's `child_entry` in a child process, with
/// `var` set to `case` and the extra environment `env`.
pub fn run(var: &str, case: &str, env: &[(&str, &str)]) -> ChildRun {
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([
            "--ignored",
            "--exact",
            "child_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(var, case)
        .envs(env.iter().copied())
        .output()
        .expect("spawn the child test process");
    ChildRun {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The child of `case` exited 0 and printed `end` on stdout.
pub fn assert_passed(case: &str, run: &ChildRun, end: &str) {
    assert!(
        run.status.success(),
        "child {case} failed ({}):\n{}",
        run.status,
        run.output()
    );
    assert!(
        run.stdout.contains(end),
        "child {case} never printed '{end}':\n{}",
        run.output()
    );
}

/// The child of `case` was aborted by the stand-in: it died of SIGABRT, its
/// stderr carries the stand-in's contract-violation `banner` and `what`, and
/// it never printed `end` (the violation was caught where it was planted).
pub fn assert_aborted(case: &str, run: &ChildRun, banner: &str, what: &str, end: &str) {
    assert_eq!(
        run.status.signal(),
        Some(SIGABRT),
        "child {case} must die of SIGABRT, it ended with {}:\n{}",
        run.status,
        run.output()
    );
    assert!(
        run.stderr.contains(banner),
        "child {case}: no '{banner}' on stderr:\n{}",
        run.output()
    );
    assert!(
        run.stderr.contains(what),
        "child {case}: abort message lacks '{what}':\n{}",
        run.output()
    );
    assert!(
        !run.output().contains(end),
        "child {case} ran past the violation:\n{}",
        run.output()
    );
}

/// Declares the test file's `child_entry`: ignored in a normal run; in the
/// child (`$var` set to a case) it runs the case through `$shared` (the
/// shared cases' `run`, false for a case it does not know), else through
/// `$own` (the file's own cases), and prints the end marker `child CASE:
/// ok` when the case got through.
#[allow(unused_macros)]
macro_rules! child_entry {
    ($var:expr, $shared:path, $own:path) => {
        /// Entry point of the re-executed binary; does nothing in a normal
        /// run.
        #[test]
        #[ignore = "runs only as the child process of another test"]
        fn child_entry() {
            let Ok(case) = std::env::var($var) else {
                return;
            };
            if !$shared(&case) {
                $own(&case);
            }
            println!("child {case}: ok");
        }
    };
}
#[allow(unused_imports)]
pub(crate) use child_entry;
