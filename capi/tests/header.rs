//! `include/memgov.h` is kept in step with the library: it compiles as C11
//! and C++17 with warnings as errors; every struct's size and every field's
//! offset, as the C compiler lays them out, equal the Rust definitions; every
//! constant has the library's value; and the functions it declares are
//! exactly the `memgov_*` symbols the shared library exports.

mod common;

use common::*;
use memgov_capi::*;
use std::collections::{BTreeMap, BTreeSet};
use std::mem::{offset_of, size_of};
use std::process::Command;

fn header() -> String {
    std::fs::read_to_string(include_dir().join("memgov.h")).expect("memgov.h")
}

/// A struct's name, its size, and each field's name and offset.
type Layout = (&'static str, usize, Vec<(&'static str, usize)>);

/// Every struct of the header as Rust lays it out.
fn rust_layouts() -> Vec<Layout> {
    macro_rules! layouts {
        ($($s:ident { $($f:ident),* $(,)? })*) => {
            vec![$((
                stringify!($s),
                size_of::<$s>(),
                vec![$((stringify!($f), offset_of!($s, $f))),*],
            )),*]
        };
    }
    layouts! {
        memgov_context_options { size, reserved, backend, label, budget, wait_for_pending_ms, host_op_delay_us }
        memgov_pressure_request { size, role, requested, shortfall }
        memgov_teardown_report {
            size, lost, forced, backend_status, retired_releases, abandoned_releases, settled_lost,
            reclaimed_buffers, quarantined_bytes, awaiting_teardown_bytes, unsettled_releases, elapsed_ns
        }
        memgov_role_usage { live_bytes, live_count, pending_bytes, pending_count, quarantined_bytes, quarantined_count }
        memgov_snapshot {
            size, lifecycle, budget_limit, charged, peak, awaiting_teardown, total, by_role,
            pins_streams, pins_buffers, pins_pending_releases, pins_external, pins_other,
            allocations, releases_queued, retired, abandoned, quarantined, admission_refusals,
            pressure_calls, backend_errors
        }
        memgov_plugin_outstanding {
            size, reserved, streams, buffers, buffer_bytes, pending_releases, pin_sources, pins,
            callbacks, allocators
        }
        memgov_ort_allocator { version, Alloc, Free, Info, Reserve }
    }
}

/// Every constant of the header with the library's value.
fn rust_constants() -> Vec<(&'static str, u64)> {
    let mut v: Vec<(&'static str, u64)> = STATUS_NAMES
        .iter()
        .map(|(code, name)| (*name, *code as u64))
        .collect();
    v.extend([
        ("MEMGOV_ABI_VERSION", u64::from(MEMGOV_ABI_VERSION)),
        ("MEMGOV_UNLIMITED", MEMGOV_UNLIMITED),
        ("MEMGOV_CAP_BACKEND_HOST", MEMGOV_CAP_BACKEND_HOST),
        ("MEMGOV_CAP_BACKEND_NULL", MEMGOV_CAP_BACKEND_NULL),
        ("MEMGOV_CAP_BACKEND_CUDA", MEMGOV_CAP_BACKEND_CUDA),
        ("MEMGOV_CAP_BACKEND_HIP", MEMGOV_CAP_BACKEND_HIP),
        ("MEMGOV_CAP_BACKEND_VULKAN", MEMGOV_CAP_BACKEND_VULKAN),
        ("MEMGOV_CAP_RECORD_STREAM", MEMGOV_CAP_RECORD_STREAM),
        (
            "MEMGOV_CAP_PRESSURE_CALLBACKS",
            MEMGOV_CAP_PRESSURE_CALLBACKS,
        ),
        ("MEMGOV_CAP_PLUGIN_LOADER", MEMGOV_CAP_PLUGIN_LOADER),
        ("MEMGOV_CAP_TORCH_ALLOCATOR", MEMGOV_CAP_TORCH_ALLOCATOR),
        ("MEMGOV_CAP_ORT_ALLOCATOR", MEMGOV_CAP_ORT_ALLOCATOR),
        ("MEMGOV_CAP_RESERVATIONS", MEMGOV_CAP_RESERVATIONS),
        ("MEMGOV_ROLE_WEIGHTS", u64::from(MEMGOV_ROLE_WEIGHTS)),
        ("MEMGOV_ROLE_KV_CACHE", u64::from(MEMGOV_ROLE_KV_CACHE)),
        ("MEMGOV_ROLE_ACTIVATION", u64::from(MEMGOV_ROLE_ACTIVATION)),
        ("MEMGOV_ROLE_WORKSPACE", u64::from(MEMGOV_ROLE_WORKSPACE)),
        ("MEMGOV_ROLE_OTHER", u64::from(MEMGOV_ROLE_OTHER)),
        ("MEMGOV_ROLE_COUNT", MEMGOV_ROLE_COUNT as u64),
        (
            "MEMGOV_LIFECYCLE_ACTIVE",
            u64::from(MEMGOV_LIFECYCLE_ACTIVE),
        ),
        (
            "MEMGOV_LIFECYCLE_RETIRING",
            u64::from(MEMGOV_LIFECYCLE_RETIRING),
        ),
        ("MEMGOV_LIFECYCLE_LOST", u64::from(MEMGOV_LIFECYCLE_LOST)),
        (
            "MEMGOV_LIFECYCLE_TERMINATED",
            u64::from(MEMGOV_LIFECYCLE_TERMINATED),
        ),
        (
            "MEMGOV_ORT_ALLOCATOR_VERSION",
            u64::from(MEMGOV_ORT_ALLOCATOR_VERSION),
        ),
    ]);
    v
}

#[test]
fn every_constant_of_the_header_is_checked() {
    let checked: BTreeSet<&str> = rust_constants().iter().map(|(n, _)| *n).collect();
    let defined: BTreeSet<String> = header()
        .lines()
        .filter_map(|l| l.strip_prefix("#define MEMGOV_"))
        .map(|rest| format!("MEMGOV_{}", rest.split_whitespace().next().unwrap()))
        .filter(|n| n != "MEMGOV_H")
        .collect();
    let missing: Vec<_> = defined
        .iter()
        .filter(|d| !checked.contains(d.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "constants of memgov.h the ABI test does not check: {missing:?}"
    );
}

#[test]
fn header_compiles_as_c11_and_cxx17_with_warnings_as_errors() {
    let dir = scratch("header");
    let src = "#include \"memgov.h\"\nint main(void) { return memgov_abi_version() == MEMGOV_ABI_VERSION ? 0 : 1; }\n";
    std::fs::write(dir.join("t.c"), src).unwrap();
    std::fs::write(dir.join("t.cpp"), src.replace("(void)", "()")).unwrap();
    let flags = ["-Wall", "-Wextra", "-Werror", "-Wpedantic", "-fsyntax-only"];
    run_ok(
        Command::new(cc())
            .arg("-std=c11")
            .args(flags)
            .arg("-I")
            .arg(include_dir())
            .arg(dir.join("t.c")),
    );
    println!("memgov.h: C11 -Wall -Wextra -Wpedantic -Werror: ok");
    if !have(&cxx()) {
        // scripts/ci/55-capi.sh installs g++ when it is missing.
        println!("skipped: no C++ compiler ({}); install g++", cxx());
        return;
    }
    run_ok(
        Command::new(cxx())
            .arg("-std=c++17")
            .args(flags)
            .arg("-I")
            .arg(include_dir())
            .arg(dir.join("t.cpp")),
    );
    println!("memgov.h: C++17 -Wall -Wextra -Wpedantic -Werror: ok");
}

#[test]
fn struct_layouts_and_constants_match_the_rust_definitions() {
    let layouts = rust_layouts();
    let constants = rust_constants();
    let mut c = String::from(
        "#include \"memgov.h\"\n#include <stdio.h>\n#include <stddef.h>\nint main(void) {\n",
    );
    for (s, _, fields) in &layouts {
        c += &format!("    printf(\"{s} %zu\\n\", sizeof({s}));\n");
        for (f, _) in fields {
            c += &format!("    printf(\"{s}.{f} %zu\\n\", offsetof({s}, {f}));\n");
        }
    }
    for (name, _) in &constants {
        c += &format!("    printf(\"{name} %llu\\n\", (unsigned long long)({name}));\n");
    }
    c += "    return 0;\n}\n";
    let dir = scratch("layout");
    std::fs::write(dir.join("layout.c"), c).unwrap();
    let exe = dir.join("layout");
    run_ok(
        Command::new(cc())
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
            .arg(include_dir())
            .arg(dir.join("layout.c"))
            .arg("-o")
            .arg(&exe),
    );
    let out = run_ok(&mut Command::new(&exe));
    let c_side: BTreeMap<String, u64> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_owned(), v.parse().unwrap())
        })
        .collect();
    let mut mismatches = Vec::new();
    let mut checked = 0;
    let mut expect = |key: String, rust: u64| {
        checked += 1;
        match c_side.get(&key) {
            Some(&c) if c == rust => {}
            other => mismatches.push(format!("{key}: C {other:?}, Rust {rust}")),
        }
    };
    for (s, size, fields) in &layouts {
        expect(s.to_string(), *size as u64);
        for (f, off) in fields {
            expect(format!("{s}.{f}"), *off as u64);
        }
    }
    for (name, value) in &constants {
        expect(name.to_string(), *value);
    }
    assert!(
        mismatches.is_empty(),
        "memgov.h disagrees with the library:\n{}",
        mismatches.join("\n")
    );
    println!(
        "ABI layout: {} structs, {checked} sizes, offsets and constants agree",
        layouts.len()
    );
}

#[test]
fn declared_functions_are_exactly_the_exported_ones() {
    let mut declared = BTreeSet::new();
    for line in header().lines() {
        let t = line.trim_start();
        if t.starts_with("/*")
            || t.starts_with('*')
            || t.starts_with("typedef")
            || t.starts_with('#')
        {
            continue;
        }
        for (i, _) in t.match_indices("memgov_") {
            let rest = &t[i..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if rest[name.len()..].starts_with('(') && (i == 0 || !t[..i].ends_with("(*")) {
                declared.insert(name);
            }
        }
    }
    if !have("nm") {
        println!("skipped: nm (binutils) is not installed");
        return;
    }
    let out = run_ok(
        Command::new("nm")
            .args(["-D", "--defined-only"])
            .arg(library()),
    );
    let exported: BTreeSet<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with("memgov_"))
        .map(str::to_owned)
        .collect();
    let undeclared: Vec<_> = exported.difference(&declared).collect();
    let missing: Vec<_> = declared.difference(&exported).collect();
    assert!(
        undeclared.is_empty() && missing.is_empty(),
        "exported but not in memgov.h: {undeclared:?}; in memgov.h but not exported: {missing:?}"
    );
    println!(
        "memgov.h declares the {} functions the library exports",
        declared.len()
    );
}
