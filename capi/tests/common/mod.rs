//! Building and running C programs against the library, for the tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The cargo profile directory the test runs from (`target/debug`), where
/// `libmemgov_capi.so` is built next to the test binaries' `deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// Where the shared library of this build is: `deps/`, next to the test
/// binaries (`cargo test` builds the package's library with every crate type
/// there and copies it up to the profile directory only on `cargo build`).
pub fn lib_dir() -> PathBuf {
    profile_dir().join("deps")
}

/// The shared library the C programs link, checked to be the one built with
/// this test's features: its capability bits equal those of the library
/// linked into this test.
pub fn library() -> PathBuf {
    let lib = lib_dir().join("libmemgov_capi.so");
    assert!(
        lib.exists(),
        "{} is missing: cargo builds it with the package's library (crate-type cdylib)",
        lib.display()
    );
    static CHECKED: std::sync::Once = std::sync::Once::new();
    CHECKED.call_once(|| {
        let dir = scratch("caps");
        std::fs::write(
            dir.join("caps.c"),
            "#include \"memgov.h\"\n#include <stdio.h>\nint main(void) { printf(\"%llu\\n\", (unsigned long long)memgov_capabilities()); return 0; }\n",
        )
        .unwrap();
        build_c(&[dir.join("caps.c")], &dir.join("caps"), &[]);
        let out = run_ok(&mut Command::new(dir.join("caps")));
        let theirs: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        let ours = memgov_capi::memgov_capabilities();
        assert_eq!(
            theirs,
            ours,
            "{} was built with other features than this test (capabilities {theirs:#x}, expected {ours:#x}); rebuild it with the same --features (cargo keeps one unhashed cdylib per profile: after building with other features, `touch capi/src/lib.rs`)",
            lib.display()
        );
    });
    lib
}

pub fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include")
}

pub fn c_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c")
}

/// A fresh scratch directory under the target directory.
pub fn scratch(name: &str) -> PathBuf {
    let dir = profile_dir().join("capi-tests").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

/// The C compiler: `$CC` or `cc`.
pub fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_owned())
}

/// The C++ compiler: `$CXX` or `c++`.
pub fn cxx() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned())
}

pub fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Run a command; panic with its output if it fails.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    if !out.status.success() {
        panic!(
            "{cmd:?} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// Compile and link C sources into `out` against the library.
pub fn build_c(sources: &[PathBuf], out: &Path, extra: &[&str]) {
    let lib_dir = lib_dir();
    let mut cmd = Command::new(cc());
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-O1"])
        .arg("-I")
        .arg(include_dir())
        .args(extra)
        .args(sources)
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", lib_dir.display()))
        // DT_RPATH, not DT_RUNPATH: it wins over LD_LIBRARY_PATH, which
        // `cargo test` points at the profile directory, where `cargo build`
        // leaves a copy of the library that may be of other features or
        // older sources.
        .arg("-Wl,--disable-new-dtags")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-lmemgov_capi");
    run_ok(&mut cmd);
}

/// Compile a plugin: a shared object whose memgov symbols resolve against
/// the library the host already loaded.
pub fn build_plugin(source: &Path, out: &Path, extra: &[&str]) {
    let mut cmd = Command::new(cc());
    cmd.args([
        "-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-O1", "-fPIC", "-shared",
    ])
    .arg("-I")
    .arg(include_dir())
    .args(extra)
    .arg(source)
    .arg("-o")
    .arg(out);
    run_ok(&mut cmd);
}
