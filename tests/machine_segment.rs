//! The machine ledger's segment file at its edges: where it is made, what
//! is accepted as one, and what a file changed under its processes does.
//!
//! * `a_full_tmpfs_is_a_clear_error`: a ledger made on a tmpfs too small
//!   for it (mounted by the test, as root; `skipped:` otherwise) is an
//!   error naming the size needed, the free space and the way out, and
//!   leaves nothing behind; on a tmpfs with just enough room it works.
//! * `a_creator_killed_half_way_blocks_nothing`: a creator killed (by
//!   strace's syscall fault injection; `skipped:` without strace) while
//!   reserving the segment's pages, or just before linking it, leaves
//!   nothing at the path: the next process opens the key at once.
//! * `a_segment_cut_short_kills_nobody`: a segment truncated under a
//!   member's mapping does not kill it with SIGBUS; `verify` says what
//!   happened; an opener refuses a truncated segment before mapping it.
//! * `only_a_regular_file_of_this_user_is_opened`: a symbolic link, a
//!   named pipe, a directory, a segment writable by the group or by
//!   everyone, another owner's: each refused unchanged, and a shared
//!   ledger (`LedgerOptions::shared`) accepts group write and another
//!   owner, never world write.
//! * `reset_refuses_while_members_live`: `MachineLedger::reset` names the
//!   live processes and removes nothing; `force_reset` removes.
//! * `a_limit_the_total_cannot_count_is_refused`: a ledger asked to
//!   promise more than its total counts (2^32 - 1 units of 4 KiB, 16 TiB
//!   less one unit) is refused with an error naming the maximum, and
//!   nothing is made; at the maximum it opens and charges it whole.
//!
//! Scenarios that could kill their process on a wrong answer run in a
//! child process (this test binary again, with `MEMGOV_SEG_CHILD` naming
//! the scenario).

#![cfg(target_os = "linux")]

use memgov::machine::{
    JoinOptions, LedgerOptions, MachineError, MachineLedger, MAX_TOTAL_BYTES, UNIT,
};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const MIB: u64 = 1 << 20;
const CHILD: &str = "MEMGOV_SEG_CHILD";
const PATH: &str = "MEMGOV_SEG_PATH";

/// A temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir =
            std::env::temp_dir().join(format!("memgov-seg-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Every name in the directory.
    fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn opts(path: &Path) -> LedgerOptions {
    LedgerOptions::new("seg-test", 64 * MIB).path(path)
}

/// Run scenario `name` in a child, its command line prefixed by `wrap`
/// (e.g. strace); returns (exit status, stdout and stderr).
fn child(name: &str, path: &Path, wrap: &[&str]) -> (std::process::ExitStatus, String) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match wrap.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .env(PATH, path)
        .stdin(Stdio::null());
    let out = cmd.output().unwrap();
    (
        out.status,
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn child_entry() {
    let Ok(scenario) = std::env::var(CHILD) else {
        return;
    };
    let path = PathBuf::from(std::env::var(PATH).unwrap());
    match scenario.as_str() {
        "open" => child_open(&path),
        "full" => child_full(&path),
        "cut-short" => child_cut_short(&path),
        other => panic!("unknown scenario {other}"),
    }
}

/// Open (creating) the ledger and charge on it.
fn child_open(path: &Path) {
    let l = MachineLedger::open(&opts(path)).unwrap();
    l.join(JoinOptions::new("opener"))
        .unwrap()
        .charge(MIB)
        .unwrap();
    println!("opened {}", path.display());
}

/// Open a 64-slot ledger (33,280 B) on a tmpfs with less room.
fn child_full(path: &Path) {
    let e = MachineLedger::open(&opts(path).slots(64)).unwrap_err();
    let MachineError::NoSpace {
        needed, free, dir, ..
    } = &e
    else {
        panic!("a full tmpfs gave {e}");
    };
    assert_eq!(*needed, 512 + 64 * 512);
    assert!(*free < *needed, "{e}");
    assert_eq!(dir, path.parent().unwrap());
    let text = e.to_string();
    for part in [
        "32.5 KiB",
        &dir.display().to_string(),
        "--shm-size",
        "LedgerOptions::path",
    ] {
        assert!(text.contains(part), "'{part}' missing from: {text}");
    }
    println!("full tmpfs: {text}");
}

/// Join, truncate the file under the mapping, and keep using the ledger.
fn child_cut_short(path: &Path) {
    let l = MachineLedger::open(&opts(path)).unwrap();
    let m = l.join(JoinOptions::new("cut").lease_chunk(0)).unwrap();
    m.charge(2 * MIB).unwrap();
    l.verify().unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(0)
        .unwrap();
    // Every one of these touches pages past the file's new end.
    let _ = m.charge(MIB);
    let snap = l.snapshot();
    let _ = l.check();
    let _ = m.uncharge(MIB);
    drop(m);
    let e = l.verify().unwrap_err();
    assert!(matches!(e, MachineError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains("cut short to 0 B"), "{e}");
    println!(
        "cut short: alive after touching the truncated segment ({} slots seen); {e}",
        snap.slots
    );
}

#[test]
fn a_full_tmpfs_is_a_clear_error() {
    if !is_root() {
        println!("skipped: mounting a small tmpfs needs root");
        return;
    }
    let dir = TempDir::new("tmpfs");
    let mount = |size: &str| {
        Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir.0)
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    let umount = || {
        let _ = Command::new("umount").arg(&dir.0).status();
    };
    if !mount("16k") {
        println!("skipped: mount -t tmpfs failed (no CAP_SYS_ADMIN in this container)");
        return;
    }
    // A data loader's files take what is left of 16 KiB but one page.
    std::fs::write(dir.file("loader"), vec![1u8; 12 << 10]).unwrap();
    let path = dir.file("ledger");
    let (status, out) = child("full", &path, &[]);
    let left = dir.names();
    umount();
    print!("{out}");
    assert!(
        status.success(),
        "the process opening a ledger on a full tmpfs failed ({status}): {out}"
    );
    assert_eq!(left, ["loader"], "a failed creation left files behind");
    // With room for it (a fresh 64 KiB tmpfs), the same ledger works.
    assert!(mount("64k"));
    let (status, out) = child("open", &path, &[]);
    umount();
    assert!(status.success(), "{out}");
    println!("full tmpfs: refused with the numbers and the way out; nothing left behind");
}

#[test]
fn a_creator_killed_half_way_blocks_nothing() {
    if Command::new("strace")
        .arg("-V")
        .stdout(Stdio::null())
        .status()
        .map_or(true, |s| !s.success())
    {
        println!("skipped: strace is not installed (it kills the creator at a chosen system call)");
        return;
    }
    let dir = TempDir::new("killed");
    // Killed at the first call that sizes the file (ftruncate, fallocate),
    // or at the one that links it at its path.
    for (i, calls) in ["ftruncate,fallocate", "link,linkat,renameat2"]
        .into_iter()
        .enumerate()
    {
        let path = dir.file(&format!("ledger-{i}"));
        let trace = format!("trace={calls}");
        let inject = format!("inject={calls}:signal=SIGKILL");
        let (status, out) = child(
            "open",
            &path,
            &[
                "strace",
                "-f",
                "-qq",
                "-o",
                "/dev/null",
                "-e",
                &trace,
                "-e",
                &inject,
            ],
        );
        assert!(
            !status.success() && !out.contains("opened"),
            "the creator was not killed at {calls}: {out}"
        );
        assert!(
            !path.exists(),
            "a creator killed at {calls} left a file at the path"
        );
        // The next process opens the key at once.
        let l = MachineLedger::open(&opts(&path)).unwrap();
        l.join(JoinOptions::new("next"))
            .unwrap()
            .charge(MIB)
            .unwrap();
        println!("creator killed at {calls}: nothing at the path, the next process opened it");
    }
    println!("killed creators: nothing blocks the key");
}

#[test]
fn a_segment_cut_short_kills_nobody() {
    let dir = TempDir::new("cut");
    let path = dir.file("ledger");
    let (status, out) = child("cut-short", &path, &[]);
    print!("{out}");
    assert!(
        status.success(),
        "the member of a segment cut short died ({status}): {out}"
    );
    assert!(out.contains("cut short: alive"), "{out}");
    // An opener refuses a truncated segment before mapping it, whatever
    // the length: shorter than the header, or than its slots.
    for len in [0, 100, 600] {
        let path = dir.file(&format!("short-{len}"));
        drop(MachineLedger::open(&opts(&path)).unwrap());
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len)
            .unwrap();
        let e = MachineLedger::open(&opts(&path)).unwrap_err();
        assert!(matches!(e, MachineError::Corrupt { .. }), "{len} B: {e}");
        assert!(e.to_string().contains("truncated"), "{len} B: {e}");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len, "changed");
    }
    println!("truncated segments refused before mapping");
}

#[test]
fn only_a_regular_file_of_this_user_is_opened() {
    let dir = TempDir::new("trust");
    // A symbolic link to a good segment: not followed.
    let real = dir.file("real");
    drop(MachineLedger::open(&opts(&real)).unwrap());
    let link = dir.file("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let e = MachineLedger::open(&opts(&link)).unwrap_err();
    assert!(
        matches!(&e, MachineError::NotRegular { found, .. } if found == "a symbolic link"),
        "{e}"
    );
    let e = MachineLedger::open_existing(&link).unwrap_err();
    assert!(matches!(e, MachineError::NotRegular { .. }), "{e}");
    // A named pipe, a directory.
    let fifo = dir.file("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = MachineLedger::open(&opts(&fifo)).unwrap_err();
    assert!(
        matches!(&e, MachineError::NotRegular { found, .. } if found == "a named pipe"),
        "{e}"
    );
    let sub = dir.file("sub");
    std::fs::create_dir(&sub).unwrap();
    let e = MachineLedger::open(&opts(&sub)).unwrap_err();
    assert!(
        matches!(&e, MachineError::NotRegular { found, .. } if found == "a directory"),
        "{e}"
    );
    // Group or world write: refused unless shared; world write always.
    let before = std::fs::read(&real).unwrap();
    for (mode, shared_ok) in [(0o620, true), (0o660, true), (0o602, false), (0o666, false)] {
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(mode)).unwrap();
        let e = MachineLedger::open(&opts(&real)).unwrap_err();
        assert!(
            matches!(&e, MachineError::OpenToOthers { mode: m, .. } if *m == mode),
            "{mode:o}: {e}"
        );
        assert!(e.to_string().contains("LedgerOptions::shared"), "{e}");
        let shared = MachineLedger::open(&opts(&real).shared());
        assert_eq!(shared.is_ok(), shared_ok, "{mode:o} shared: {shared:?}");
        drop(shared);
        assert_eq!(std::fs::read(&real).unwrap(), before, "{mode:o}: changed");
    }
    // A shared ledger is made group-writable, whatever the umask.
    let shared = dir.file("shared");
    let l = MachineLedger::open(&opts(&shared).shared()).unwrap();
    assert_eq!(std::fs::metadata(&shared).unwrap().mode() & 0o777, 0o660);
    drop(l);
    let e = MachineLedger::open(&opts(&shared)).unwrap_err();
    assert!(matches!(e, MachineError::OpenToOthers { .. }), "{e}");
    // Another owner: refused, unless shared.
    if is_root() {
        let c = std::ffi::CString::new(shared.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 4242, 4242) }, 0);
        let e = MachineLedger::open(&opts(&shared)).unwrap_err();
        assert!(
            matches!(e, MachineError::ForeignOwner { owner: 4242, .. }),
            "{e}"
        );
        let l = MachineLedger::open(&opts(&shared).shared()).unwrap();
        l.join(JoinOptions::new("co-tenant"))
            .unwrap()
            .charge(MIB)
            .unwrap();
        println!("trust: another owner's shared ledger accepted when shared is asked for");
    } else {
        println!("skipped: handing a segment to another owner needs root");
    }
    println!("trust: symbolic link, named pipe, directory, group and world write refused");
}

#[test]
fn reset_refuses_while_members_live() {
    let dir = TempDir::new("reset");
    let path = dir.file("ledger");
    let l = MachineLedger::open(&opts(&path)).unwrap();
    let m = l.join(JoinOptions::new("still-here")).unwrap();
    m.charge(MIB).unwrap();
    let e = MachineLedger::reset(&path).unwrap_err();
    let MachineError::InUse { holders, .. } = &e else {
        panic!("reset of a live ledger gave {e}");
    };
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0].name, "still-here");
    assert_eq!(holders[0].pid, std::process::id());
    let text = e.to_string();
    assert!(
        text.contains("'still-here' (pid ") && text.contains("force_reset"),
        "{text}"
    );
    assert!(path.exists(), "reset removed a ledger in use");
    MachineLedger::force_reset(&path).unwrap();
    assert!(!path.exists());
    drop(m);
    // Nobody left: reset removes.
    let path = dir.file("idle");
    drop(MachineLedger::open(&opts(&path)).unwrap());
    MachineLedger::reset(&path).unwrap();
    assert!(!path.exists());
}

#[test]
fn a_limit_the_total_cannot_count_is_refused() {
    assert_eq!(MAX_TOTAL_BYTES, ((1u64 << 32) - 1) * UNIT);
    let dir = TempDir::new("wide-limit");
    let path = dir.file("ledger");
    for limit in [MAX_TOTAL_BYTES + 1, 16 << 40, 1 << 50, u64::MAX] {
        let e = MachineLedger::open(&LedgerOptions::new("seg-test", limit).path(&path))
            .err()
            .unwrap_or_else(|| panic!("a limit of {limit} bytes was accepted"));
        let MachineError::BadLimit {
            limit: asked, max, ..
        } = &e
        else {
            panic!("a limit of {limit} bytes gave {e}");
        };
        assert_eq!((*asked, *max), (limit, MAX_TOTAL_BYTES));
        let text = e.to_string();
        assert!(
            text.contains(&MAX_TOTAL_BYTES.to_string()) && text.contains(&limit.to_string()),
            "{text}"
        );
        assert!(!path.exists(), "a refused ledger was made");
    }
    let l =
        MachineLedger::open(&LedgerOptions::new("seg-test", MAX_TOTAL_BYTES).path(&path)).unwrap();
    assert_eq!(l.limit(), MAX_TOTAL_BYTES);
    let m = l.join(JoinOptions::new("whole").lease_chunk(0)).unwrap();
    m.charge(MAX_TOTAL_BYTES).unwrap();
    assert_eq!(l.charged(), MAX_TOTAL_BYTES);
    assert!(m.charge(UNIT).is_err(), "past the limit");
    // A limit set above what the total counts is the most it counts.
    l.set_limit(u64::MAX);
    assert_eq!(l.limit(), MAX_TOTAL_BYTES);
    assert!(m.charge(UNIT).is_err(), "past what the total counts");
    assert_eq!(l.charged(), MAX_TOTAL_BYTES);
    m.uncharge(MAX_TOTAL_BYTES).unwrap();
    assert_eq!(l.charged(), 0);
}
