//! Building and running C programs against the library, for the tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The cargo profile directory the test runs from (`<target dir>/debug`),
/// where `libmemgov_capi.so` is built next to the test binaries' `deps/`.
/// Found from the test executable's own path, so it follows
/// `CARGO_TARGET_DIR` and `build.target-dir`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("<target dir>/<profile>/deps/<test>")
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
        let dir = process_scratch("caps");
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

/// A fresh scratch directory under the target directory, of this test
/// executable alone where the name is one every executable uses (the
/// checks made once per process), so that test executables run side by
/// side never share one.
pub fn process_scratch(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let stem = exe
        .file_stem()
        .expect("test executable name")
        .to_string_lossy()
        .into_owned();
    scratch(&format!("{name}-{stem}"))
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
    cmd.args([
        "-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-O1", "-pthread",
    ])
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

/// Compile a C program that loads the library itself (`dlopen`), not linked
/// against it.
pub fn build_c_dlopen(source: &Path, out: &Path, extra: &[&str]) {
    let mut cmd = Command::new(cc());
    cmd.args([
        "-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-O1", "-pthread",
    ])
    .arg("-I")
    .arg(include_dir())
    .args(extra)
    .arg(source)
    .arg("-o")
    .arg(out)
    .arg("-ldl");
    run_ok(&mut cmd);
}

/// How a C test program runs: plainly, built with AddressSanitizer and
/// UndefinedBehaviorSanitizer, or under valgrind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Plain,
    Sanitizers,
    Valgrind,
}

impl Mode {
    /// Compiler flags for the C programs (and plugins) of this mode.
    pub fn cflags(self) -> &'static [&'static str] {
        match self {
            Mode::Sanitizers => &[
                "-fsanitize=address,undefined",
                "-fno-sanitize-recover=undefined",
                "-fno-omit-frame-pointer",
            ],
            _ => &[],
        }
    }

    /// Whether this machine can run the mode; prints `skipped: ...` if not.
    pub fn available(self) -> bool {
        match self {
            Mode::Plain => true,
            Mode::Sanitizers => {
                if sanitizers_build() {
                    true
                } else {
                    println!(
                        "skipped: {} cannot build with -fsanitize=address,undefined",
                        cc()
                    );
                    false
                }
            }
            Mode::Valgrind => {
                if have("valgrind") {
                    true
                } else {
                    println!("skipped: valgrind is not installed (apt-get install valgrind)");
                    false
                }
            }
        }
    }

    /// The command that runs `exe` in this mode.
    pub fn command(self, exe: &Path) -> Command {
        match self {
            Mode::Plain => Command::new(exe),
            Mode::Sanitizers => {
                let mut c = Command::new(exe);
                // The C programs are instrumented; the Rust library is not,
                // but its mallocs go through ASan's interposed allocator.
                c.env(
                    "ASAN_OPTIONS",
                    "detect_leaks=1:abort_on_error=0:halt_on_error=1",
                )
                .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1");
                c
            }
            Mode::Valgrind => {
                let mut c = Command::new("valgrind");
                c.args([
                    "--quiet",
                    "--error-exitcode=99",
                    "--errors-for-leak-kinds=definite",
                    "--leak-check=full",
                    "--show-leak-kinds=definite",
                ])
                .arg(exe);
                c
            }
        }
    }

    /// What a passing run of this mode prints.
    pub fn clean(self) -> &'static str {
        match self {
            Mode::Plain => "plain: clean",
            Mode::Sanitizers => "asan: clean",
            Mode::Valgrind => "valgrind: clean",
        }
    }
}

/// Whether the C compiler builds and links with ASan and UBSan.
fn sanitizers_build() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        let probe = process_scratch("sanitizers-probe");
        let src = probe.join("probe.c");
        std::fs::write(&src, "int main(void) { return 0; }\n").unwrap();
        Command::new(cc())
            .args(Mode::Sanitizers.cflags())
            .arg(&src)
            .arg("-o")
            .arg(probe.join("probe"))
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    })
}

/// Compile a plugin: a shared object whose memgov symbols resolve against
/// the library the host already loaded.
pub fn build_plugin(source: &Path, out: &Path, extra: &[&str]) {
    let mut cmd = Command::new(cc());
    cmd.args([
        "-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-O1", "-fPIC", "-shared", "-pthread",
    ])
    .arg("-I")
    .arg(include_dir())
    .args(extra)
    .arg(source)
    .arg("-o")
    .arg(out);
    run_ok(&mut cmd);
}
