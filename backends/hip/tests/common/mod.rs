//! What the HIP test files that run their cases in child processes on the
//! stand-in share: the part every vendor shares (`backends/cases/common.rs`:
//! whether the stand-in is loaded, children that must pass or must be
//! stopped by the stand-in, the stand-in's hooks, the conformance fault
//! cells, arena fault cases and stress), instantiated for HIP through the
//! `vendor` module (`common_table!`, from HIP's table, `table.rs`).

#![allow(dead_code)]

#[macro_use]
pub mod table;

common_table!();

/// Case `case` run in a child on a partial HIP stand-in, a ROCm lacking
/// some calls: built, as `name` under the target's temporary directory,
/// from the stand-in's `libamdhip64.c`, its `extra` sources only (what is
/// left out is not exported), and the stand-ins' common `standin.c`. The
/// child passed; without the stand-in, `skipped: ...`.
pub fn passes_on_partial_stand_in(name: &str, extra: &[&str], case: &str) {
    if !on_stand_in() {
        return;
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&out).expect("a directory for the partial stand-in");
    let lib = out.join("libamdhip64.so.5");
    let mut cc = std::process::Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()));
    cc.args(["-std=gnu11", "-O1", "-fPIC", "-shared", "-pthread"])
        .arg(format!("-I{root}/stand-ins/common"))
        .arg("-Wl,-soname,libamdhip64.so.5")
        .arg("-o")
        .arg(&lib)
        .arg(format!("{root}/hip/stand-in/libamdhip64.c"));
    for source in extra {
        cc.arg(format!("{root}/hip/stand-in/{source}"));
    }
    let status = cc
        .arg(format!("{root}/stand-ins/common/standin.c"))
        .status()
        .expect("run the C compiler (the stand-in needs one)");
    assert!(status.success(), "building the partial stand-in failed");
    let run = child_process::run(
        crate::CHILD,
        case,
        &[("MEMGOV_HIP_RUNTIME", lib.to_str().expect("a UTF-8 path"))],
    );
    print!("{}", run.stdout);
    child_process::assert_passed(case, &run, &format!("child {case}: ok"));
}
