//! The example plugin (`tests/c/plugin.c`) loaded by a C host
//! (`tests/c/host.c`) through memgov's loader: refused unload while it has
//! buffers, queued releases, a pin, a pin source, a stream or a pressure
//! callback outstanding, unloaded after. Built with the system compiler; run
//! plain, under AddressSanitizer and under valgrind where available.

mod common;

use common::*;
use std::process::Command;

fn build(name: &str, extra: &[&str]) -> (std::path::PathBuf, std::path::PathBuf) {
    library();
    let dir = scratch(name);
    let plugin = dir.join("plugin.so");
    let host = dir.join("host");
    build_plugin(&c_dir().join("plugin.c"), &plugin, extra);
    build_c(&[c_dir().join("host.c")], &host, extra);
    (host, plugin)
}

fn check_output(out: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    for line in [
        "load failures: reported",
        "close after run: MEMGOV_ERR_BUSY: streams 1, buffers 2 (8192 B), pending releases 1, pin sources 1, pins 1, callbacks 1",
        "close after synchronize: MEMGOV_ERR_BUSY: streams 1, buffers 0 (0 B), pending releases 0, pin sources 1, pins 1, callbacks 1",
        "close after releasing the rest: MEMGOV_OK",
        "failed init holding a pin source: unloaded after it went",
        "teardown: 3 releases retired, backend MEMGOV_OK",
        "host: all checks passed",
    ] {
        assert!(stdout.contains(line), "missing '{line}' in:\n{stdout}");
    }
    stdout
}

#[test]
fn plugin_is_refused_unload_until_everything_is_released() {
    let (host, plugin) = build("plain", &[]);
    let out = run_ok(Command::new(&host).arg(&plugin));
    check_output(&out);
}

#[test]
fn plugin_under_address_sanitizer() {
    // The C host and plugin are instrumented; the Rust library is not, but
    // its mallocs go through ASan's interposed allocator.
    let probe = scratch("asan-probe");
    let ok = Command::new(cc())
        .args(["-fsanitize=address", "-x", "c", "-", "-o"])
        .arg(probe.join("a.out"))
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin
                .take()
                .unwrap()
                .write_all(b"int main(void){return 0;}\n")?;
            c.wait()
        })
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        println!("skipped: {} cannot build with -fsanitize=address", cc());
        return;
    }
    let (host, plugin) = build("asan", &["-fsanitize=address", "-fno-omit-frame-pointer"]);
    let out = run_ok(Command::new(&host).arg(&plugin).env(
        "ASAN_OPTIONS",
        "detect_leaks=1:abort_on_error=0:halt_on_error=1",
    ));
    check_output(&out);
    println!("asan: clean");
}

#[test]
fn plugin_under_valgrind() {
    if !have("valgrind") {
        println!("skipped: valgrind is not installed (apt-get install valgrind)");
        return;
    }
    let (host, plugin) = build("valgrind", &[]);
    let out = run_ok(
        Command::new("valgrind")
            .args([
                "--quiet",
                "--error-exitcode=99",
                "--errors-for-leak-kinds=definite",
                "--leak-check=full",
                "--show-leak-kinds=definite",
            ])
            .arg(&host)
            .arg(&plugin),
    );
    check_output(&out);
    println!("valgrind: clean");
}
