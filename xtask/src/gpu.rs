//! `cargo xtask gpu <backend>`: one backend's checks on the device it finds.
//!
//! First `memgov check --backend <backend>`, built with only that backend and
//! run without any stand-in on the library path, says how the backend runs
//! here: on real hardware, on a software driver (Vulkan on lavapipe), or not
//! at all (no driver). Then:
//!
//! * CUDA on real hardware: `scripts/gpu-check.sh` (the conformance and
//!   backend tests, the fault-matrix row, `memgov check`, the bench row,
//!   compute-sanitizer where present); without a driver, the stand-in libcuda
//!   (`scripts/ci/40-cuda.sh`).
//! * HIP on real hardware: the HIP tests and the fault-matrix row on the
//!   device; without one, the stand-in runtime (`scripts/ci/45-hip.sh`).
//! * Vulkan: its tests, the validation-layer tests and the fault-matrix row
//!   on whichever driver the loader finds, real or lavapipe; none is an error
//!   that names the package to install.
//! * host: the conformance suite and the fault-matrix row (embedded).
//!
//! The tier ends by saying which of these ran.

use std::path::{Path, PathBuf};

use crate::step::{Failure, Steps};
use crate::{cargo, script};

/// How `memgov check` found the backend running here.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Found {
    RealHardware,
    SoftwareDriver,
    Embedded,
    /// No driver or device: `memgov check` ran no case.
    Absent,
}

impl Found {
    /// From the closing line of `memgov check`: "ran on real hardware: …;
    /// on software drivers: …; on stand-ins: …; embedded: …". `None` when
    /// there is no such line: the check did not run (it failed to build, or
    /// crashed), which says nothing about the machine.
    fn from_check_output(out: &str, backend: &str) -> Option<Self> {
        let line = out
            .lines()
            .find(|l| l.starts_with("ran on real hardware:"))?;
        let names = |label: &str| -> bool {
            line.split(';').map(str::trim).any(|part| {
                part.strip_prefix(label)
                    .is_some_and(|rest| rest.split(',').any(|n| n.trim() == backend))
            })
        };
        Some(if names("ran on real hardware:") {
            Self::RealHardware
        } else if names("on software drivers:") {
            Self::SoftwareDriver
        } else if names("embedded:") {
            Self::Embedded
        } else {
            Self::Absent
        })
    }
}

/// Runs `backend`'s checks on what this machine has, and says which ran.
pub fn run(steps: &mut Steps, root: &Path, backend: &str) -> Result<(), Failure> {
    let feature = match backend {
        "cuda" | "hip" | "vulkan" => Some(backend),
        "host" => None,
        other => {
            return Err(Failure::Usage(format!(
                "cargo xtask gpu: no backend called `{other}`; one of cuda, hip, vulkan, host"
            )))
        }
    };
    let found = probe(steps, root, backend, feature)?;
    match (backend, found) {
        ("cuda", Found::RealHardware) => {
            steps.note("gpu cuda: an NVIDIA driver and device are present: real hardware".into());
            let dir = target_dir(root)?.join("gpu-check");
            let mut prepare = script(root, "scripts/gpu-check.sh");
            prepare.arg("prepare").arg(&dir);
            steps.run("build the CUDA check's binaries", &mut prepare)?;
            let mut check = std::process::Command::new("bash");
            check.arg(dir.join("gpu-check.sh")).arg("run").arg(&dir);
            steps.run("the CUDA check on the GPU", &mut check)?;
            steps.note("gpu cuda: ran on real hardware".into());
        }
        ("cuda", _) => {
            steps.note(
                "gpu cuda: no NVIDIA driver or device here: running on the stand-in libcuda".into(),
            );
            steps.run(
                "the CUDA backend on its stand-in",
                script(root, "scripts/ci/40-cuda.sh"),
            )?;
            steps.note("gpu cuda: ran on the stand-in (no real GPU)".into());
        }
        ("hip", Found::RealHardware) => {
            steps
                .note("gpu hip: a HIP runtime and an AMD device are present: real hardware".into());
            steps.run(
                "the HIP tests on the GPU",
                cargo(
                    root,
                    &[
                        "test",
                        "--locked",
                        "--release",
                        "-p",
                        "memgov-hip",
                        "--test",
                        "hip",
                    ],
                ),
            )?;
            fault_matrix(steps, root, "hip")?;
            steps.note("gpu hip: ran on real hardware".into());
        }
        ("hip", _) => {
            steps.note(
                "gpu hip: no HIP runtime or AMD device here: running on the stand-in runtime"
                    .into(),
            );
            steps.run(
                "the HIP backend on its stand-in",
                script(root, "scripts/ci/45-hip.sh").env("MEMGOV_INSTALL", "0"),
            )?;
            steps.note("gpu hip: ran on the stand-in (no real GPU)".into());
        }
        ("vulkan", Found::RealHardware | Found::SoftwareDriver) => {
            let on = if found == Found::RealHardware {
                "real hardware"
            } else {
                "a software driver (lavapipe)"
            };
            for test in ["vulkan", "vulkan_layers_env"] {
                steps.run(
                    &format!("the Vulkan tests ({test}) on {on}"),
                    cargo(
                        root,
                        &["test", "--locked", "-p", "memgov-vulkan", "--test", test],
                    ),
                )?;
            }
            fault_matrix(steps, root, "vulkan")?;
            steps.note(format!("gpu vulkan: ran on {on}"));
        }
        ("vulkan", _) => {
            return Err(Failure::Missing(
                "a Vulkan driver: no GPU driver and no lavapipe (Debian's mesa-vulkan-drivers \
                 and libvulkan1; cargo xtask setup installs them)"
                    .into(),
            ))
        }
        _ => {
            steps.run(
                "the conformance suite on the host backend",
                cargo(
                    root,
                    &[
                        "test",
                        "--locked",
                        "-p",
                        "memgov",
                        "--test",
                        "conformance_host",
                    ],
                ),
            )?;
            fault_matrix(steps, root, "host")?;
            steps.note("gpu host: ran embedded (the host backend needs no GPU)".into());
        }
    }
    Ok(())
}

/// `memgov check --backend BACKEND` without any stand-in on the library
/// path: how the backend runs on this machine.
fn probe(
    steps: &mut Steps,
    root: &Path,
    backend: &str,
    feature: Option<&str>,
) -> Result<Found, Failure> {
    let mut args = vec![
        "run",
        "--locked",
        "--release",
        "--quiet",
        "-p",
        "memgov-cli",
    ];
    if let Some(f) = feature {
        args.extend(["--features", f]);
    }
    args.extend(["--", "check", "--backend", backend]);
    let mut cmd = cargo(root, &args);
    if let Some(path) = std::env::var_os("LD_LIBRARY_PATH") {
        // A stand-in left on the path would pass for the driver.
        let kept: Vec<_> = std::env::split_paths(&path)
            .filter(|p| !p.to_string_lossy().contains("stand-ins"))
            .collect();
        cmd.env(
            "LD_LIBRARY_PATH",
            std::env::join_paths(kept).unwrap_or_default(),
        );
    }
    println!("\n=== how {backend} runs here: memgov check --backend {backend}");
    let failed = |status: String| Failure::Step {
        name: format!("memgov check --backend {backend}"),
        command: format!("cargo {}", args.join(" ")),
        status,
    };
    let out = cmd
        .output()
        .map_err(|e| failed(format!("could not start: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    let found = Found::from_check_output(&text, backend)
        .ok_or_else(|| failed(format!("{}, without its closing line", out.status)))?;
    if found != Found::Absent && !out.status.success() {
        // The backend ran and a case failed: that is the finding.
        return Err(failed(out.status.to_string()));
    }
    steps.note(format!(
        "gpu {backend}: memgov check found it running: {found:?}"
    ));
    Ok(found)
}

/// Cargo's target directory (`CARGO_TARGET_DIR`, a configured
/// `build.target-dir`, or `target/`), from `cargo metadata`.
fn target_dir(root: &Path) -> Result<PathBuf, Failure> {
    let args = ["metadata", "--locked", "--format-version", "1", "--no-deps"];
    let failed = |status: String| Failure::Step {
        name: "find cargo's target directory".into(),
        command: format!("cargo {}", args.join(" ")),
        status,
    };
    let out = cargo(root, &args)
        .output()
        .map_err(|e| failed(format!("could not start: {e}")))?;
    if !out.status.success() {
        return Err(failed(out.status.to_string()));
    }
    let json = String::from_utf8_lossy(&out.stdout);
    let key = "\"target_directory\":\"";
    json.find(key)
        .and_then(|at| {
            let rest = &json[at + key.len()..];
            rest.find('"').map(|end| PathBuf::from(&rest[..end]))
        })
        .ok_or_else(|| failed("no target_directory in its output".into()))
}

/// The backend's row of the fault matrix, in release as the suite runs it.
fn fault_matrix(steps: &mut Steps, root: &Path, backend: &str) -> Result<(), Failure> {
    let mut args = vec!["test", "--locked", "--release", "-p", "memgov"];
    if backend != "host" {
        args.extend(["--features", backend]);
    }
    args.extend([
        "--test",
        "fault_matrix",
        "--",
        "fault_matrix_every_backend",
        "--nocapture",
        "--test-threads=1",
    ]);
    // The backend's rows alone, and a failure if it cannot be opened.
    let mut command = cargo(root, &args);
    command.env("MEMGOV_FAULT_MATRIX_BACKENDS", backend);
    steps.run(&format!("the fault matrix's {backend} row"), command)
}

#[cfg(test)]
mod tests {
    use super::Found;

    const LINE: &str = "ran on real hardware: cuda; on software drivers: vulkan; \
                        on stand-ins: hip; embedded: host, null";

    #[test]
    fn the_closing_line_of_memgov_check_says_how_each_backend_ran() {
        let found = |out, backend| Found::from_check_output(out, backend);
        assert_eq!(found(LINE, "cuda"), Some(Found::RealHardware));
        assert_eq!(found(LINE, "vulkan"), Some(Found::SoftwareDriver));
        assert_eq!(found(LINE, "host"), Some(Found::Embedded));
        // A stand-in is not the device: the tier runs the stand-in's own
        // checks instead.
        assert_eq!(found(LINE, "hip"), Some(Found::Absent));
        let none = "ran on real hardware: none; on software drivers: none; \
                    on stand-ins: none; embedded: host";
        assert_eq!(found(none, "cuda"), Some(Found::Absent));
        // No closing line: `memgov check` did not run (a build error), which
        // must not read as "no GPU here".
        assert_eq!(found("error[E0599]: no variant", "cuda"), None);
    }
}
