//! The vendors' management libraries as memgov reads them
//! (`memgov::machine::device_processes`), on the NVML and ROCm SMI
//! stand-ins (`backends/cuda/stand-in-nvml`, `backends/hip/stand-in-rocm-smi`,
//! on `LD_LIBRARY_PATH`; without them each test prints `skipped:`).
//!
//! * `nvml_lists_of_every_entry_layout`: an NVML with only the 16-byte
//!   unversioned lists, one whose `_v3` lists write 24-byte entries (R550)
//!   and one whose `_v3` lists write 32-byte entries (R535, 535.54.03):
//!   1, 2, 28 and 64 processes, each read exactly (no phantom pid, none
//!   missed, the figures right).
//! * `nvml_lists_never_write_past_the_buffer`: the 32-byte layout with 64
//!   processes under valgrind: no invalid write.
//! * `hostile_answers_are_refused`: counts larger than any buffer, success
//!   with a count above the room, pid 0, NULL and unterminated strings,
//!   from both libraries: each an error naming the call (or, for the
//!   strings, a list read right), never an allocation of what a count says
//!   nor a crash. The children run with their address space limited to
//!   4 GiB, so a count taken as an allocation size fails at once.
//!
//! Every scenario runs in a child process (this test binary again, with
//! `MEMGOV_MGMT_CHILD` naming it), since the stand-ins are steered by
//! environment variables and each library is loaded once per process.

#![cfg(target_os = "linux")]

use memgov::machine::{device_processes, DeviceProcess, ManagementError};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const MIB: u64 = 1 << 20;
const CHILD: &str = "MEMGOV_MGMT_CHILD";
const FILE: &str = "MEMGOV_MGMT_FILE";
const NVML_FILE: &str = "MEMGOV_STANDIN_NVML_PROCESSES";
const NVML_LAYOUT: &str = "MEMGOV_STANDIN_NVML_LAYOUT";
const NVML_HOSTILE: &str = "MEMGOV_STANDIN_NVML_HOSTILE";
const ROCM_FILE: &str = "MEMGOV_STANDIN_ROCM_SMI_PROCESSES";
const ROCM_HOSTILE: &str = "MEMGOV_STANDIN_ROCM_SMI_HOSTILE";
/// The hostile answer a child is given (and expects).
const EXPECT: &str = "MEMGOV_MGMT_EXPECT";

/// A temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir =
            std::env::temp_dir().join(format!("memgov-mgmt-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The NVML stand-in's device 0 (the CUDA stand-in's).
fn nvml_device() -> memgov::DeviceIdentity {
    memgov::DeviceIdentity::named("cuda", "stand-in").with_uuid(*b"memgov-standin\0\0")
}

/// The ROCm SMI stand-in's device 0 (the HIP stand-in's).
fn rocm_device() -> memgov::DeviceIdentity {
    memgov::DeviceIdentity::named("hip", "stand-in").with_pci_bus_id("0000:20:00.0")
}

/// Run scenario `name` in a child with `env`, its address space limited to
/// 4 GiB (valgrind, when `under_valgrind`, is not limited: it reserves
/// more); returns (success, stdout and stderr).
fn child(name: &str, env: &[(&str, String)], under_valgrind: bool) -> (bool, String) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = if under_valgrind {
        let mut c = Command::new("valgrind");
        c.args(["-q", "--error-exitcode=99"]).arg(&exe);
        c
    } else {
        Command::new(&exe)
    };
    cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    if !under_valgrind {
        use std::os::unix::process::CommandExt;
        // SAFETY: setrlimit is async-signal-safe and touches nothing of
        // the parent; the closure allocates nothing.
        unsafe {
            cmd.pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: 4 << 30,
                    rlim_max: 4 << 30,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

/// The entry point of every child; in the test run itself it returns.
#[test]
fn child_entry() {
    let Ok(scenario) = std::env::var(CHILD) else {
        return;
    };
    let file = PathBuf::from(env(FILE));
    match scenario.as_str() {
        "nvml-layout" => child_nvml_layout(&file),
        "nvml-hostile" => child_nvml_hostile(&file),
        "rocm-hostile" => child_rocm_hostile(&file),
        other => panic!("unknown child scenario {other}"),
    }
}

/// `device_processes`, or `None` (printing why) where the library is not
/// the stand-in.
fn ask(
    id: &memgov::DeviceIdentity,
) -> Option<Result<memgov::machine::DeviceProcesses, ManagementError>> {
    match device_processes(id) {
        Err(e @ ManagementError::Unavailable { .. }) => {
            println!("{e}");
            None
        }
        Err(ManagementError::Call { code: 6, .. }) => {
            println!("skipped: the management library here is not the stand-in (it does not know the stand-in's device)");
            None
        }
        other => Some(other),
    }
}

/// `n` processes: pids 4000001.., the first 200 MiB, the others 1 MiB
/// each times their index, every fourth on the graphics list too (with
/// less), one figure not available.
fn processes(n: u32) -> (String, Vec<DeviceProcess>) {
    let mut file = String::new();
    let mut want = Vec::new();
    for i in 0..n {
        let pid = 4_000_001 + i;
        let bytes = if i == 0 {
            200 * MIB
        } else {
            u64::from(i) * MIB
        };
        if i == 5 {
            file.push_str(&format!("0 {pid} -\n"));
            want.push(DeviceProcess { pid, bytes: None });
            continue;
        }
        file.push_str(&format!("0 {pid} {bytes}\n"));
        if i % 4 == 3 {
            file.push_str(&format!("0 {pid} 4096 graphics\n"));
        }
        want.push(DeviceProcess {
            pid,
            bytes: Some(bytes),
        });
    }
    // A graphics-only process, and another device's.
    let pid = 4_100_000 + n;
    file.push_str(&format!("0 {pid} 8192 graphics\n1 4200000 999\n"));
    want.push(DeviceProcess {
        pid,
        bytes: Some(8192),
    });
    want.sort_by_key(|p| p.pid);
    (file, want)
}

fn child_nvml_layout(file: &Path) {
    let layout = env(NVML_LAYOUT);
    let id = nvml_device();
    // 28 first: in room for 32 entries of 24 bytes, 28 of 32 do not fit.
    for n in [28, 64, 1, 2] {
        let (text, want) = processes(n);
        std::fs::write(file, text).unwrap();
        let Some(found) = ask(&id) else { return };
        let found = found.unwrap_or_else(|e| panic!("layout {layout}, {n} processes: {e}"));
        assert_eq!(found.library, "nvml");
        assert_eq!(
            found.processes, want,
            "layout {layout}, {n} processes: every process once, none made up, its figure right"
        );
    }
    println!("nvml layout {layout}: 1, 2, 28 and 64 processes read exactly");
}

#[test]
fn nvml_lists_of_every_entry_layout() {
    let dir = TempDir::new("layouts");
    for layout in ["16", "24", "32"] {
        let (ok, out) = child(
            "nvml-layout",
            &[
                (FILE, dir.file("p").display().to_string()),
                (NVML_FILE, dir.file("p").display().to_string()),
                (NVML_LAYOUT, layout.to_owned()),
            ],
            false,
        );
        print!("{out}");
        assert!(ok, "layout {layout}: the child failed: {out}");
        assert!(
            out.contains(&format!(
                "nvml layout {layout}: 1, 2, 28 and 64 processes read exactly"
            )) || out.contains("skipped: "),
            "layout {layout}: the child neither passed nor said why it skipped: {out}"
        );
    }
}

#[test]
fn nvml_lists_never_write_past_the_buffer() {
    if Command::new("valgrind")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .map_or(true, |s| !s.success())
    {
        println!("skipped: valgrind is not installed");
        return;
    }
    let dir = TempDir::new("valgrind");
    let (ok, out) = child(
        "nvml-layout",
        &[
            (FILE, dir.file("p").display().to_string()),
            (NVML_FILE, dir.file("p").display().to_string()),
            (NVML_LAYOUT, "32".to_owned()),
        ],
        true,
    );
    print!("{out}");
    assert!(ok, "under valgrind the child failed: {out}");
    assert!(
        !out.contains("Invalid write") && !out.contains("Invalid read"),
        "{out}"
    );
    if out.contains("nvml layout 32: 1, 2, 28 and 64 processes read exactly") {
        println!("valgrind: clean, the 32-byte layout with up to 64 processes");
    } else {
        assert!(out.contains("skipped: "), "{out}");
    }
}

fn child_nvml_hostile(file: &Path) {
    let hostile = env(EXPECT);
    let id = nvml_device();
    let (text, want) = processes(3);
    std::fs::write(file, text).unwrap();
    let Some(found) = ask(&id) else { return };
    match hostile.as_str() {
        "huge-count" => match found {
            Err(e @ ManagementError::Implausible { .. }) => {
                assert!(e.to_string().contains("4294967295"), "{e}");
                println!("nvml huge-count: {e}");
            }
            other => panic!("a count of 2^32-1 gave {other:?}"),
        },
        "over-count" => match found {
            Err(e @ ManagementError::Implausible { .. }) => {
                assert!(e.to_string().contains("in room for"), "{e}");
                println!("nvml over-count: {e}");
            }
            other => panic!("success with a count above the room gave {other:?}"),
        },
        "null-names" => {
            // NULL error strings and an unterminated driver version: the
            // list is still read right, errors still named.
            assert_eq!(found.unwrap().processes, want);
            let unknown = memgov::DeviceIdentity::named("cuda", "x").with_uuid([7; 16]);
            match device_processes(&unknown) {
                Err(ManagementError::Call {
                    code: 6, message, ..
                }) => {
                    assert_eq!(message, "no description");
                }
                other => panic!("an unknown device gave {other:?}"),
            }
            println!("nvml null-names: list read, errors named");
        }
        "pid0" => {
            // The default answers, with pid 0 listed.
            std::fs::write(file, "0 4000001 4096\n0 0 209715200\n").unwrap();
            match device_processes(&id) {
                Err(e @ ManagementError::Implausible { .. }) => {
                    assert!(e.to_string().contains("pid 0"), "{e}");
                    println!("nvml pid0: {e}");
                }
                other => panic!("pid 0 gave {other:?}"),
            }
        }
        other => panic!("unknown hostile answer {other}"),
    }
}

fn child_rocm_hostile(file: &Path) {
    let hostile = env(EXPECT);
    let id = rocm_device();
    std::fs::write(file, "0 4000001 1048576\n0 4000002 2097152\n").unwrap();
    let Some(found) = ask(&id) else { return };
    match (hostile.as_str(), found) {
        ("huge-count", Err(e @ ManagementError::Implausible { .. })) => {
            assert!(e.to_string().contains("4294967295"), "{e}");
            println!("rocm-smi huge-count: {e}");
        }
        ("over-count", Err(e @ ManagementError::Implausible { .. })) => {
            assert!(e.to_string().contains("in room for"), "{e}");
            println!("rocm-smi over-count: {e}");
        }
        ("pid0", Ok(found)) => {
            assert_eq!(found.processes.len(), 2);
            std::fs::write(file, "0 4000001 1048576\n0 0 2097152\n").unwrap();
            match device_processes(&id) {
                Err(e @ ManagementError::Implausible { .. }) => {
                    assert!(e.to_string().contains("pid 0"), "{e}");
                    println!("rocm-smi pid0: {e}");
                }
                other => panic!("pid 0 gave {other:?}"),
            }
        }
        (h, other) => panic!("hostile answer {h} gave {other:?}"),
    }
}

#[test]
fn hostile_answers_are_refused() {
    let dir = TempDir::new("hostile");
    let f = dir.file("p").display().to_string();
    let runs: [(&str, &str, &str, &str); 7] = [
        (
            "nvml-hostile",
            NVML_HOSTILE,
            "huge-count",
            "nvml huge-count: ",
        ),
        (
            "nvml-hostile",
            NVML_HOSTILE,
            "over-count",
            "nvml over-count: ",
        ),
        (
            "nvml-hostile",
            NVML_HOSTILE,
            "null-names",
            "nvml null-names: ",
        ),
        ("nvml-hostile", NVML_HOSTILE, "pid0", "nvml pid0: "),
        (
            "rocm-hostile",
            ROCM_HOSTILE,
            "huge-count",
            "rocm-smi huge-count: ",
        ),
        (
            "rocm-hostile",
            ROCM_HOSTILE,
            "over-count",
            "rocm-smi over-count: ",
        ),
        ("rocm-hostile", ROCM_HOSTILE, "pid0", "rocm-smi pid0: "),
    ];
    for (scenario, var, value, line) in runs {
        // "pid0" is no hostile mode of the stand-ins: the file lists pid 0.
        let mode = if value == "pid0" { "" } else { value };
        let (ok, out) = child(
            scenario,
            &[
                (FILE, f.clone()),
                (NVML_FILE, f.clone()),
                (ROCM_FILE, f.clone()),
                (var, mode.to_owned()),
                (EXPECT, value.to_owned()),
            ],
            false,
        );
        print!("{out}");
        assert!(ok, "{scenario} {value}: the child failed: {out}");
        assert!(
            out.contains(line) || out.contains("skipped: "),
            "{scenario} {value}: the child neither passed nor said why it skipped: {out}"
        );
    }
}
