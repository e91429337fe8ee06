//! The example plugin (`tests/c/plugin.c`) loaded by a C host
//! (`tests/c/host.c`) through memgov's loader: refused unload while it has
//! buffers, queued releases, a pin, a pin source, a stream or a pressure
//! callback outstanding, unloaded after; an init that fails having created
//! things is cleaned up and unloaded; an init that closes its own plugin is
//! refused. Built with the system compiler; run plain, under
//! AddressSanitizer and UndefinedBehaviorSanitizer, and under valgrind where
//! available.

mod common;

use common::*;

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
        "close while a removed callback runs: MEMGOV_ERR_BUSY: streams 0, buffers 0 (0 B), pending releases 0, pin sources 0, pins 0, callbacks 1",
        "close after the callback returned: MEMGOV_OK",
        "failed init holding a stream, buffers, a pin and a callback: cleaned up and unloaded (pins 0)",
        "close from inside init: MEMGOV_ERR_BUSY, unregister: MEMGOV_ERR_BUSY",
        "teardown: 5 releases retired, backend MEMGOV_OK",
        "host: all checks passed",
    ] {
        assert!(stdout.contains(line), "missing '{line}' in:\n{stdout}");
    }
    stdout
}

fn plugin(mode: Mode) {
    if !mode.available() {
        return;
    }
    let (host, plugin) = build(&format!("{mode:?}"), mode.cflags());
    let out = run_ok(mode.command(&host).arg(&plugin));
    check_output(&out);
    println!("{}", mode.clean());
}

#[test]
fn plugin_is_refused_unload_until_everything_is_released() {
    plugin(Mode::Plain);
}

#[test]
fn plugin_under_address_sanitizer() {
    plugin(Mode::Sanitizers);
}

#[test]
fn plugin_under_valgrind() {
    plugin(Mode::Valgrind);
}
