//! `cargo xtask`: memgov's development commands, one per tier of testing.
//!
//! ```text
//! cargo xtask check          fmt, clippy (every crate, every backend), the driverless crates' tests
//! cargo xtask test           the whole suite (scripts/test.sh) on a prepared machine; installs nothing
//! cargo xtask loom           the loom models of the lifecycle primitives
//! cargo xtask miri           the library and the driverless tests under Miri, both borrow models
//! cargo xtask gpu <backend>  one backend's checks on its real GPU when present, else its stand-in
//! cargo xtask ci             what `.ci/run` runs: `setup`, then the whole suite
//! cargo xtask setup          install what the suite needs (Debian packages, Miri); root
//! ```
//!
//! The tiers call the repository's scripts, so that the CI and a contributor
//! run the same steps; this crate only chooses which, says what it is about
//! to run and how long each step took, and stops at the first failure.
//! Nothing but `setup` and `ci` installs anything: `test` runs the suite
//! with `MEMGOV_INSTALL=0`, where a missing package is reported with the
//! command that installs it instead of being installed.

mod gpu;
mod step;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use step::{Failure, Steps};

const USAGE: &str = "\
usage: cargo xtask <tier> [args]

tiers, fastest first:
  check            before every commit (under 3 minutes from a warm build): rustfmt, clippy with
                   every backend compiled in and -D warnings, the tests of the crates that need
                   no GPU driver
  loom             after changing crates/sync or the lifecycle: every interleaving of the pin protocol
  miri             after changing unsafe code: the library and the driverless tests under Miri
                   (stacked and tree borrows); extra args go to every `cargo miri test`
  gpu <backend>    after changing a backend (cuda, hip, vulkan, host): its checks on a real GPU
                   when one is present, otherwise on its stand-in or software driver; says which
  test             before a pull request: the whole suite (scripts/test.sh), installing nothing
  ci               what the CI runs (.ci/run): `setup`, then the whole suite
  setup            install the Debian packages and the Miri toolchain the suite needs (root)";

/// The Debian packages and toolchain components the whole suite needs,
/// installed by `scripts/common.sh`'s `suite_setup`.
const SETUP: &str = "source scripts/common.sh && ensure_rust && suite_setup";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(tier) = args.first() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let rest = &args[1..];
    let root = workspace_root();
    let mut steps = Steps::new(tier);
    let outcome = match tier.as_str() {
        "check" => check(&mut steps, &root),
        "test" => steps.run(
            "the whole suite, installing nothing",
            script(&root, "scripts/test.sh").env("MEMGOV_INSTALL", "0"),
        ),
        "loom" => steps.run("loom models", script(&root, "scripts/ci/10-loom.sh")),
        "miri" => miri(&mut steps, &root, rest),
        "gpu" => match rest.first() {
            Some(backend) => gpu::run(&mut steps, &root, backend),
            None => Err(Failure::Usage(
                "cargo xtask gpu <backend>: name one of cuda, hip, vulkan, host".into(),
            )),
        },
        "ci" => steps.run("the CI job (.ci/run)", script(&root, ".ci/run")),
        "setup" => steps.run(
            "suite set-up",
            bash(&root, SETUP).env("MEMGOV_INSTALL", "1"),
        ),
        "help" | "-h" | "--help" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        other => Err(Failure::Usage(format!("no tier called `{other}`"))),
    };
    match outcome {
        Ok(()) => {
            steps.summary();
            ExitCode::SUCCESS
        }
        Err(Failure::Usage(why)) => {
            eprintln!("cargo xtask: {why}\n\n{USAGE}");
            ExitCode::from(2)
        }
        Err(failure) => {
            steps.summary();
            eprintln!("cargo xtask {tier}: {failure}");
            ExitCode::FAILURE
        }
    }
}

/// The inner loop: what to run before a commit. Under three minutes on two
/// cores from a warm build: the slow tests (the C programs under the
/// sanitizers, doc tests, the GPU backends' suites) are left to `test` and
/// `gpu`, and the summary says so.
fn check(steps: &mut Steps, root: &Path) -> Result<(), Failure> {
    if cargo(root, &["fmt", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        steps.run("rustfmt", cargo(root, &["fmt", "--all", "--", "--check"]))?;
    } else {
        steps.skip(
            "rustfmt",
            "rustfmt is not installed (rustup component add rustfmt)",
        );
    }
    if cargo(root, &["clippy", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        steps.run(
            "clippy, every crate with every backend compiled in",
            cargo(
                root,
                &[
                    "clippy",
                    "--locked",
                    "--workspace",
                    "--all-targets",
                    "--features",
                    "serde,tracing,vulkan,cuda,hip,metrics",
                    "--",
                    "-D",
                    "warnings",
                ],
            ),
        )?;
    } else {
        steps.skip(
            "clippy",
            "clippy is not installed (rustup component add clippy)",
        );
    }
    // The unit and integration tests of every crate that needs no GPU
    // driver: the governor, the sync primitives, the host and null backends,
    // the conformance suite and fault matrix on them, the tool, xtask.
    steps.run(
        "tests of the crates that need no driver",
        cargo(
            root,
            &[
                "test",
                "--locked",
                "--workspace",
                "--exclude",
                "memgov-cuda",
                "--exclude",
                "memgov-hip",
                "--exclude",
                "memgov-vulkan",
                "--exclude",
                "memgov-capi",
                "--tests",
            ],
        ),
    )?;
    // The C ABI from Rust and its header; its C programs under the
    // sanitizers and valgrind take minutes (`cargo xtask test` runs them).
    steps.run(
        "tests of the C ABI from Rust",
        cargo(
            root,
            &[
                "test",
                "--locked",
                "-p",
                "memgov-capi",
                "--lib",
                "--test",
                "rust_api",
                "--test",
                "header",
            ],
        ),
    )?;
    steps.note(
        "check: not run here: doc tests, the C ABI's C programs, the GPU backends \
         (cargo xtask gpu <backend>), loom, Miri and the long suites (cargo xtask test)"
            .into(),
    );
    Ok(())
}

/// Miri, when the nightly toolchain has it; the way to install it when not.
fn miri(steps: &mut Steps, root: &Path, args: &[String]) -> Result<(), Failure> {
    let present = cargo(root, &["+nightly", "miri", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !present {
        return Err(Failure::Missing(
            "Miri: the nightly toolchain with the miri and rust-src components \
             (rustup toolchain install nightly --component miri,rust-src, or cargo xtask setup)"
                .into(),
        ));
    }
    let mut cmd = script(root, "scripts/ci/15-miri.sh");
    cmd.args(args).env("MEMGOV_INSTALL", "0");
    steps.run("Miri, stacked and tree borrows", &mut cmd)
}

/// The workspace root: the directory above this crate's manifest.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask/ sits in the workspace root")
        .to_path_buf()
}

/// `cargo ARGS` in the workspace root, with the cargo that runs this tool.
fn cargo(root: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args(args).current_dir(root);
    cmd
}

/// `bash PATH` in the workspace root.
fn script(root: &Path, path: &str) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg(path).current_dir(root);
    cmd
}

/// `bash -c SOURCE` in the workspace root.
fn bash(root: &Path, source: &str) -> Command {
    let mut cmd = Command::new("bash");
    cmd.args(["-c", source]).current_dir(root);
    cmd
}
