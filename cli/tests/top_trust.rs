//! `memgov top` facing other processes: names written by them are escaped
//! before they reach the terminal, and `--reset` refuses to remove a
//! ledger that live processes use unless `--force` says they are gone.

#![cfg(target_os = "linux")]

use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
use std::path::PathBuf;
use std::process::Command;

fn memgov(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_memgov"))
        .args(args)
        .output()
        .expect("run memgov");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memgov-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn top_escapes_names_from_other_processes() {
    let dir = temp_dir("top-escape");
    let path = dir.join("ledger");
    let ledger = MachineLedger::open(&LedgerOptions::new("escape", 64 << 20).path(&path)).unwrap();
    // A slot name that would clear the screen, retitle the terminal and
    // ring its bell; another with a C1 CSI.
    let evil = ledger
        .join(JoinOptions::new("ev\u{1b}[2J\u{1b}]0;pwned\u{7}il"))
        .unwrap();
    let csi = ledger.join(JoinOptions::new("c1\u{9b}31m")).unwrap();
    let p = path.to_str().unwrap();
    let (code, out) = memgov(&["top", "--path", p, "--once"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        !out.chars().any(|c| c.is_control() && c != '\n'),
        "a control character reached the terminal: {out:?}"
    );
    assert!(out.contains("ev\\u{1b}[2J\\u{1b}]0~"), "{out}");
    assert!(out.contains("c1\\u{9b}31m"), "{out}");
    drop((evil, csi));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn top_reset_refuses_while_members_live() {
    let dir = temp_dir("top-reset");
    let path = dir.join("ledger");
    let ledger = MachineLedger::open(&LedgerOptions::new("reset", 64 << 20).path(&path)).unwrap();
    let me = ledger.join(JoinOptions::new("still-here")).unwrap();
    me.charge(1 << 20).unwrap();
    let p = path.to_str().unwrap();
    let (code, out) = memgov(&["top", "--path", p, "--reset"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!("'still-here' (pid {})", std::process::id())),
        "{out}"
    );
    assert!(out.contains("--reset --force"), "{out}");
    assert!(path.exists(), "--reset removed a ledger in use");
    let (code, out) = memgov(&["top", "--path", p, "--reset", "--force"]);
    assert_eq!(code, 0, "{out}");
    assert!(!path.exists(), "--reset --force left it");
    // --force is only for --reset.
    let (code, _) = memgov(&["top", "--path", p, "--force"]);
    assert_ne!(code, 0);
    drop(me);
    let _ = std::fs::remove_dir_all(&dir);
}
