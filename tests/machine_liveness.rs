//! The machine ledger's liveness and books, as a user in a container, a
//! runtime that forks, or a careless caller would meet them. Every test
//! uses a ledger of its own in a temporary directory; the ones that need
//! other processes run this test binary again (`MEMGOV_LIVENESS_CHILD`
//! naming what the child does, entered through `child_process_entry`) and
//! talk to it over its stdin and stdout, one line per step, so that every
//! step happens in a fixed order.
//!
//! * `pid_namespaces_do_not_reclaim_each_other`: two processes in pid
//!   namespaces of their own (`unshare --pid --fork --mount-proc`, both pid
//!   1 there) share one ledger: neither reclaims the other, and the second
//!   is refused what would take the ledger over its limit.
//! * `a_process_whose_main_thread_exited_keeps_its_slot`: a process whose
//!   main thread has exited (a zombie leader, other threads running) keeps
//!   its slot through sweeps and goes on charging into it.
//! * `killed_processes_in_pid_namespaces_give_everything_back`: processes
//!   in pid namespaces of their own, killed with SIGKILL mid-churn, are
//!   reclaimed exactly.
//! * `an_idle_lease_is_given_back_once`: a membership whose last holder is
//!   dropped while its doorbell thread serves a trim returns its idle
//!   lease once.
//! * `uncharge_beyond_what_was_charged_is_refused`: giving back more than
//!   was charged is an error, and changes nothing.
//! * `floors_hold_under_concurrent_joins`: two joiners released by a
//!   barrier, many rounds: their floors never exceed the limit together.
//! * `snapshots_add_up_while_processes_charge`: snapshots taken while four
//!   processes charge are consistent; `check` never calls the busy ledger
//!   inconsistent.
//! * `a_forked_childs_membership_is_inert`: the child's copy of a
//!   membership charges nothing into the parent's slot and does not panic;
//!   `a_forked_child_does_not_keep_a_dead_parents_slot`: nor does it keep
//!   the parent's slot lock.
//! * `extreme_outside_figures_do_not_overflow`.

#![cfg(target_os = "linux")]

use memgov::host::{HostConfig, HostContext};
use memgov::machine::{
    JoinOptions, LedgerOptions, MachineError, MachineLedger, MachineMember, RefusedBy,
};
use memgov::{Alloc, ContextConfig, Governor, MemoryInfo, ProcessBudget, Role, SharedBudget};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const CHILD: &str = "MEMGOV_LIVENESS_CHILD";
const PATH: &str = "MEMGOV_LIVENESS_PATH";
const ARG: &str = "MEMGOV_LIVENESS_ARG";
const READY: &str = "MEMGOV-READY";
const KEY: &str = "liveness-device";

/// A temporary directory for one test's segments, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir = std::env::temp_dir().join(format!(
            "memgov-liveness-{name}-{}-{nanos}",
            std::process::id()
        ));
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

fn ledger(path: &Path, limit: u64) -> MachineLedger {
    MachineLedger::open(&LedgerOptions::new(KEY, limit).path(path)).unwrap()
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

/// Wait for a state (never decides an outcome): up to 10 s.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether this machine lets us make pid namespaces (root, or user
/// namespaces allowed); `Err` says why not.
fn can_unshare() -> Result<(), String> {
    match Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("unshare --pid --fork --mount-proc true: {s}")),
        Err(e) => Err(format!("no unshare: {e}")),
    }
}

/// A child process driven line by line.
struct Driven {
    child: Child,
    input: Option<ChildStdin>,
    output: BufReader<ChildStdout>,
}

impl Driven {
    /// Run `scenario` in this test binary, in a pid namespace of its own
    /// when `namespace`; returns once it printed its READY line.
    fn spawn(scenario: &str, path: &Path, arg: &str, namespace: bool) -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = if namespace {
            let mut c = Command::new("unshare");
            c.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
                .arg(exe);
            c
        } else {
            Command::new(exe)
        };
        cmd.args([
            "--exact",
            "child_process_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, scenario)
        .env(PATH, path)
        .env(ARG, arg)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        let mut child = cmd.spawn().unwrap();
        let input = child.stdin.take();
        let output = BufReader::new(child.stdout.take().unwrap());
        let mut d = Self {
            child,
            input,
            output,
        };
        d.expect(READY);
        d
    }

    /// The next line the child printed that starts with `prefix` (the
    /// harness prints its own lines around them), less the prefix.
    fn expect(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                self.output.read_line(&mut line).unwrap() > 0,
                "the child ended before it printed '{prefix}'"
            );
            // The harness prints "test child_process_entry ... " before
            // the first line.
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].trim().to_owned();
            }
        }
    }

    /// Send one command and return the child's answer to it.
    fn ask(&mut self, command: &str) -> String {
        let input = self.input.as_mut().unwrap();
        writeln!(input, "{command}").unwrap();
        input.flush().unwrap();
        self.expect("answer:")
    }

    /// Close its stdin (the child leaves the ledger and exits) and wait.
    fn finish(mut self) {
        drop(self.input.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the child failed: {status}");
    }
}

/// The entry point of every child process; in the test run itself (no
/// `MEMGOV_LIVENESS_CHILD`) it returns at once.
#[test]
fn child_process_entry() {
    let Ok(scenario) = std::env::var(CHILD) else {
        return;
    };
    let path = PathBuf::from(env(PATH));
    match scenario.as_str() {
        "member" => child_member(&path, false),
        "leader-exits" => child_member(&path, true),
        "charger" => child_charger(&path),
        "forker" => child_forker(&path),
        "forker-lingers" => child_forker_lingers(&path),
        "idle-twice" => child_idle_twice(&path),
        other => panic!("unknown child scenario {other}"),
    }
}

/// Exit the calling thread alone (the raw `exit` system call, not
/// `exit_group`): run in the main thread by a signal, it leaves a process
/// whose leader has exited while its other threads run, as `pthread_exit`
/// from `main` does.
extern "C" fn exit_this_thread(_: libc::c_int) {
    // SAFETY: a raw system call, async-signal-safe; it ends this thread
    // only, and nothing on its stack is used again.
    unsafe {
        libc::syscall(libc::SYS_exit, 0);
    }
}

/// The state letter of this process in `/proc/self/stat` (its leader's).
fn own_state() -> char {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    s[s.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .next()
        .unwrap()
        .chars()
        .next()
        .unwrap()
}

/// Join as `ARG`'s name with `ARG`'s bytes charged (no lease), then serve
/// commands from stdin: `sweep` (reclaim dead slots, answer how many),
/// `charge N` (answer admitted or refused), `pid` (this process's pid as
/// it sees it). Leaves at end of input. With `leader_exits`, the main
/// thread exits before READY.
fn child_member(path: &Path, leader_exits: bool) {
    let arg = env(ARG);
    let (name, bytes) = arg.split_once(':').unwrap();
    let ledger = MachineLedger::open(&LedgerOptions::new(KEY, 100 * MIB).path(path)).unwrap();
    let me = ledger.join(JoinOptions::new(name).lease_chunk(0)).unwrap();
    me.charge(bytes.parse().unwrap()).unwrap();
    if leader_exits {
        // SAFETY: installs a handler that only makes a system call.
        unsafe {
            libc::signal(
                libc::SIGUSR1,
                exit_this_thread as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
        let pid = std::process::id() as libc::pid_t;
        // SAFETY: signals this process's main thread (tid = pid), which
        // runs the test harness's loop and is not this thread.
        let r = unsafe { libc::syscall(libc::SYS_tgkill, pid, pid, libc::SIGUSR1) };
        assert_eq!(r, 0);
        eventually("the main thread exited", || own_state() == 'Z');
    }
    println!("{READY}");
    serve_commands(&ledger, &me);
}

fn serve_commands(ledger: &MachineLedger, me: &MachineMember) {
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let answer = match line.split_once(' ') {
            None if line == "sweep" => format!("{}", ledger.sweep().len()),
            None if line == "pid" => format!("{} {}", std::process::id(), own_state()),
            Some(("charge", n)) => match me.charge(n.parse().unwrap()) {
                Ok(()) => "admitted".to_owned(),
                Err(r) => format!("refused {:?}", r.by),
            },
            _ => panic!("unknown command {line}"),
        };
        println!("answer: {answer}");
    }
}

#[test]
fn pid_namespaces_do_not_reclaim_each_other() {
    if let Err(why) = can_unshare() {
        println!("skipped: {why}");
        return;
    }
    let dir = TempDir::new("pidns");
    let path = dir.file("ledger");
    let here = ledger(&path, 100 * MIB);
    let mut a = Driven::spawn("member", &path, &format!("a:{}", 80 * MIB), true);
    let mut b = Driven::spawn("member", &path, "b:0", true);
    // Each is pid 1 of a pid namespace of its own: neither can see the
    // other's pid, and both have the same one.
    assert_eq!(a.ask("pid").split(' ').next(), Some("1"));
    assert_eq!(b.ask("pid").split(' ').next(), Some("1"));
    // b joined (which sweeps) after a charged: a's 80 MiB are still there.
    assert_eq!(here.snapshot().charged, 80 * MIB, "{:?}", here.snapshot());
    assert_eq!(b.ask("sweep"), "0", "b reclaimed a slot");
    assert_eq!(
        b.ask(&format!("charge {}", 80 * MIB)),
        "refused Ledger",
        "b was admitted 80 MiB on a 100 MiB ledger holding 80 MiB"
    );
    assert_eq!(b.ask(&format!("charge {}", 10 * MIB)), "admitted");
    assert_eq!(a.ask("sweep"), "0", "a reclaimed a slot");
    assert!(
        here.sweep().is_empty(),
        "the root namespace reclaimed a slot"
    );
    let snap = here.snapshot();
    assert_eq!(snap.charged, 90 * MIB, "{snap:?}");
    assert_eq!(snap.processes.len(), 2, "{snap:?}");
    assert!(snap.processes.iter().all(|p| p.live && p.alive), "{snap:?}");
    here.check().unwrap();
    a.finish();
    b.finish();
    assert_eq!(here.snapshot().charged, 0);
    assert!(here.snapshot().processes.is_empty());
    println!("two pid namespaces: neither reclaimed the other; 80 MiB refused, 10 MiB admitted");
}

#[test]
fn a_process_whose_main_thread_exited_keeps_its_slot() {
    let dir = TempDir::new("leader");
    let path = dir.file("ledger");
    let here = ledger(&path, 100 * MIB);
    let mut c = Driven::spawn(
        "leader-exits",
        &path,
        &format!("orphan:{}", 40 * MIB),
        false,
    );
    assert!(c.ask("pid").ends_with(" Z"), "the leader is a zombie");
    // Sweeps here and in the process itself: its slot stays.
    assert!(
        here.sweep().is_empty(),
        "a live process's slot was reclaimed"
    );
    assert_eq!(c.ask("sweep"), "0");
    assert_eq!(c.ask(&format!("charge {}", 10 * MIB)), "admitted");
    let snap = here.snapshot();
    assert_eq!(snap.charged, 50 * MIB, "{snap:?}");
    assert_eq!(snap.processes.len(), 1, "{snap:?}");
    assert!(
        snap.processes[0].live && snap.processes[0].alive,
        "{snap:?}"
    );
    here.check().unwrap();
    // Killed, it is reclaimed exactly.
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    eventually("the killed process reclaimed", || {
        here.sweep();
        here.snapshot().processes.is_empty()
    });
    assert_eq!(here.snapshot().charged, 0);
    here.check().unwrap();
}

#[test]
fn killed_processes_in_pid_namespaces_give_everything_back() {
    if let Err(why) = can_unshare() {
        println!("skipped: {why}");
        return;
    }
    let dir = TempDir::new("nskills");
    let path = dir.file("ledger");
    let here = ledger(&path, 100 * MIB);
    let kills: usize = std::env::var("MEMGOV_LIVENESS_KILLS")
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(40);
    let mut killed = 0;
    let mut round = 0u64;
    while killed < kills {
        round += 1;
        // Half in pid namespaces of their own, half in this one.
        let mut children: Vec<Driven> = (0..4)
            .map(|i| Driven::spawn("charger", &path, &format!("{round}{i}"), i % 2 == 0))
            .collect();
        for (i, c) in children.iter_mut().enumerate() {
            // Each has charged and goes on charging: kill it mid-churn.
            c.expect("charged");
            c.child.kill().unwrap();
            killed += 1;
            if i % 2 == 1 {
                here.sweep();
            }
        }
        for mut c in children {
            c.child.wait().unwrap();
        }
        // The namespace's own processes die with its pid 1 (`--kill-child`
        // kills that when unshare dies): wait for their locks to go.
        eventually("every killed process reclaimed", || {
            here.sweep();
            here.snapshot().processes.is_empty()
        });
        let snap = here.snapshot();
        assert_eq!(snap.charged, 0, "round {round}: {snap:?}");
        here.check().unwrap();
    }
    println!("{killed} kills in pid namespaces and out: ledger exact after each round");
}

/// Charge and give back in a loop (no lease: every change touches the
/// ledger), printing `charged` once it holds something.
fn child_charger(path: &Path) {
    let ledger = MachineLedger::open(&LedgerOptions::new(KEY, 100 * MIB).path(path)).unwrap();
    let me = ledger
        .join(JoinOptions::new(format!("charger-{}", env(ARG))).lease_chunk(0))
        .unwrap();
    me.charge(MIB).unwrap();
    println!("{READY}");
    println!("charged");
    let mut x: u64 = env(ARG).parse::<u64>().unwrap() | 1;
    loop {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let n = (1 + x % 64) * 4096;
        if me.charge(n).is_ok() {
            me.uncharge(n).unwrap();
        }
    }
}

/// The numbers: b holds 40 MiB; a (lease 4 MiB, priority below
/// b's) holds a 4 MiB buffer out of an 8 MiB share. b asks for room; a's
/// doorbell gives its 4 MiB idle lease back, then calls its responders,
/// during which this test drops everything of a but what the doorbell's
/// trim holds (the buffer goes back into the idle lease): the trim's end
/// drops the last membership, which leaves on the doorbell thread. The
/// idle lease goes back once: the total is b's 40 MiB, not 36.
#[test]
fn an_idle_lease_is_given_back_once() {
    // In a process of its own: it counts the process's doorbell threads.
    let dir = TempDir::new("idle-twice");
    let path = dir.file("ledger");
    let mut c = Driven::spawn("idle-twice", &path, "", false);
    assert_eq!(
        c.expect("result:"),
        format!("total {} b {} check Ok(())", 40 * MIB, 40 * MIB),
        "the total and the one remaining slot after a left inside its doorbell's trim"
    );
    c.finish();
}

fn child_idle_twice(path: &Path) {
    println!("{READY}");
    let here = ledger(path, 100 * MIB);
    let b = here
        .join(JoinOptions::new("b").lease_chunk(0).priority(100))
        .unwrap();
    b.charge(40 * MIB).unwrap();
    let a = here
        .join(
            JoinOptions::new("a")
                .lease_chunk(4 * MIB)
                .priority(10)
                .answer_timeout(Duration::from_secs(5)),
        )
        .unwrap();
    let a_slot = a.slot();
    eventually("both doorbell threads named", || doorbell_threads() == 2);
    let process = ProcessBudget::with_machine("a", u64::MAX, a);
    let device = SharedBudget::with_parent("gpu", u64::MAX, &process);
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig {
            capacity: 1 << 30,
            ..HostConfig::default()
        })
        .unwrap(),
        ContextConfig::new()
            .label("a")
            .shared_budget(device.clone()),
    );
    let stream = ctx.create_stream("s").unwrap();
    let buf = ctx
        .allocate(&stream, Alloc::new(4 * MIB, Role::Other))
        .unwrap();
    assert_eq!(here.snapshot().charged, 48 * MIB);
    let (called_tx, called_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    ctx.add_pressure_responder(0, move |_| {
        called_tx.send(()).unwrap();
        go_rx.lock().unwrap().recv().unwrap();
        0
    });
    let asker = std::thread::spawn(move || {
        let unanswered = b.make_room(70 * MIB, Instant::now() + Duration::from_secs(10));
        (b, unanswered)
    });
    called_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("a's responder was called");
    // The doorbell serves, inside the responder: drop all of a's.
    drop(buf);
    stream.synchronize().unwrap();
    drop(stream);
    drop(ctx);
    drop(gov);
    drop(device);
    drop(process);
    go_tx.send(()).unwrap();
    let (b, _) = asker.join().unwrap();
    eventually("a left the ledger", || {
        !here.snapshot().processes.iter().any(|p| p.slot == a_slot)
    });
    // a's doorbell thread (which left, inside its serve) has ended: all
    // it would give back, it has.
    eventually("a's doorbell thread ended", || doorbell_threads() == 1);
    println!(
        "result: total {} b {} check {:?}",
        here.snapshot().charged,
        b.charged(),
        here.check().map_err(|e| e.to_string())
    );
}

/// The doorbell threads of this process now (one per membership).
fn doorbell_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter(|t| {
            let comm = t.as_ref().unwrap().path().join("comm");
            std::fs::read_to_string(comm).unwrap_or_default().trim() == "memgov-machine"
        })
        .count()
}

/// The numbers: b holds 68 MiB; a, with nothing charged, gives
/// back 60 MiB. That is refused and changes nothing, and c is not then
/// admitted 80 MiB on the 100 MiB ledger.
#[test]
fn uncharge_beyond_what_was_charged_is_refused() {
    let dir = TempDir::new("overdrawn");
    let path = dir.file("ledger");
    let here = ledger(&path, 100 * MIB);
    let b = here.join(JoinOptions::new("b").lease_chunk(0)).unwrap();
    b.charge(68 * MIB).unwrap();
    let a = here
        .join(JoinOptions::new("a").lease_chunk(8 * MIB))
        .unwrap();
    let e = a.uncharge(60 * MIB).unwrap_err();
    assert!(
        matches!(
            e,
            MachineError::Overdrawn {
                asked,
                held: 0,
                ..
            } if asked == 60 * MIB
        ),
        "{e}"
    );
    assert!(e.to_string().contains("60.0 MiB"), "{e}");
    assert_eq!(here.snapshot().charged, 68 * MIB);
    let c = here.join(JoinOptions::new("c").lease_chunk(0)).unwrap();
    let r = c.charge(80 * MIB).unwrap_err();
    assert_eq!(r.by, RefusedBy::Ledger, "{r}");
    // What a charged comes back, and no more.
    a.charge(3 * MIB).unwrap();
    assert!(a.uncharge(3 * MIB + 1).is_err());
    a.uncharge(3 * MIB).unwrap();
    assert!(a.uncharge(1).is_err());
    here.check().unwrap();
    drop((a, b, c));
    assert_eq!(here.snapshot().charged, 0);
}

/// Two processes' worth of joins (two threads, each joining with a 60 MiB
/// floor on a 100 MiB ledger) released together by a barrier, 300 rounds:
/// never both admitted.
#[test]
fn floors_hold_under_concurrent_joins() {
    let dir = TempDir::new("floors");
    let path = dir.file("ledger");
    let here = ledger(&path, 100 * MIB);
    let rounds: usize = std::env::var("MEMGOV_LIVENESS_ROUNDS")
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(300);
    let mut one = 0;
    for round in 0..rounds {
        let barrier = Arc::new(Barrier::new(2));
        let joins: Vec<_> = (0..2)
            .map(|i| {
                let (barrier, here) = (Arc::clone(&barrier), here.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    here.join(JoinOptions::new(format!("floor-{i}")).floor(60 * MIB))
                })
            })
            .collect();
        let joined: Vec<_> = joins.into_iter().map(|j| j.join().unwrap()).collect();
        let admitted = joined.iter().filter(|j| j.is_ok()).count();
        assert!(
            admitted <= 1,
            "round {round}: both admitted with 60 MiB floors on a 100 MiB ledger"
        );
        for j in &joined {
            if let Err(e) = j {
                assert!(matches!(e, MachineError::Floors { .. }), "{e}");
            }
        }
        one += admitted;
        drop(joined);
        assert!(here.snapshot().processes.is_empty());
    }
    println!("{rounds} rounds of two joins with floors: {one} admitted one, none both");
}

/// Charge and give back without a lease, forever (killed by the test).
fn child_forker(path: &Path) {
    let ledger = MachineLedger::open(&LedgerOptions::new(KEY, 100 * MIB).path(path)).unwrap();
    let me = ledger
        .join(JoinOptions::new("parent").lease_chunk(8 * MIB))
        .unwrap();
    me.charge(4 * MIB).unwrap();
    // SAFETY: fork in a process whose only other thread (the harness's
    // main thread) is blocked waiting for this test, and the membership's
    // doorbell thread, which holds no lock the child takes: the child
    // checks its copy is inert before taking any.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // Out of the parent's idle lease or by a refill: refused.
            let lease = me.charge(MIB).map_err(|r| r.by);
            let refill = me.charge(64 * MIB).map_err(|r| r.by);
            let back = me.uncharge(MIB).map_err(|e| e.to_string());
            let room = me.make_room(MIB, Instant::now());
            drop(me);
            let ok = lease == Err(RefusedBy::SlotLost)
                && refill == Err(RefusedBy::SlotLost)
                && back.as_ref().is_err_and(|e| e.contains("fork"))
                && room.is_empty();
            if ok {
                0
            } else {
                eprintln!("child: {lease:?} {refill:?} {back:?} {room:?}");
                1
            }
        }))
        .unwrap_or(2);
        // SAFETY: ends the forked child without running the parent's
        // atexit handlers or the harness.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    println!("{READY}");
    println!(
        "child: exit {} charged {}",
        if libc::WIFEXITED(status) {
            libc::WEXITSTATUS(status)
        } else {
            -1
        },
        me.charged()
    );
    // The parent's membership works on.
    me.charge(MIB).unwrap();
    me.uncharge(5 * MIB).unwrap();
    println!("parent: charged {}", me.charged());
}

#[test]
fn a_forked_childs_membership_is_inert() {
    let dir = TempDir::new("fork");
    let path = dir.file("ledger");
    let here = ledger(&path, 100 * MIB);
    let mut p = Driven::spawn("forker", &path, "", false);
    assert_eq!(
        p.expect("child:"),
        format!("exit 0 charged {}", 12 * MIB),
        "the child's copy was not inert, or the parent's share changed"
    );
    p.expect("parent:");
    p.finish();
    assert_eq!(here.snapshot().charged, 0);
    here.check().unwrap();
}

/// Join, charge 4 MiB, fork a child that only sleeps (it prints its pid),
/// then print READY and wait to be killed.
fn child_forker_lingers(path: &Path) {
    let ledger = MachineLedger::open(&LedgerOptions::new(KEY, 100 * MIB).path(path)).unwrap();
    let me = ledger
        .join(JoinOptions::new("parent").lease_chunk(0))
        .unwrap();
    me.charge(4 * MIB).unwrap();
    let mut up = [0 as libc::c_int; 2];
    // SAFETY: a pipe into a valid two-int array.
    assert_eq!(unsafe { libc::pipe(up.as_mut_ptr()) }, 0);
    // SAFETY: the child makes only async-signal-safe calls (write, pause).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // The fork's child handlers have run once fork returns here: say
        // so, then sleep until the test's SIGKILL.
        // SAFETY: writes one byte from a live buffer to the pipe.
        unsafe { libc::write(up[1], b"u".as_ptr().cast(), 1) };
        loop {
            // SAFETY: sleeps until a signal.
            unsafe { libc::pause() };
        }
    }
    let mut b = 0u8;
    // SAFETY: reads one byte into a live buffer from the pipe.
    let n = unsafe { libc::read(up[0], (&mut b as *mut u8).cast(), 1) };
    assert_eq!(n, 1);
    println!("{READY}");
    println!("forked: {pid}");
    std::thread::sleep(Duration::from_secs(3600));
    drop(me);
}

/// A parent killed while a child it forked lives on: the child's copy of
/// the parent's slot lock went at the fork, so the parent's slot is
/// reclaimed at once, not when the child exits.
#[test]
fn a_forked_child_does_not_keep_a_dead_parents_slot() {
    let dir = TempDir::new("fork-lingers");
    let path = dir.file("ledger");
    let here = ledger(&path, 100 * MIB);
    let mut p = Driven::spawn("forker-lingers", &path, "", false);
    let child: libc::pid_t = p.expect("forked:").parse().unwrap();
    assert_eq!(here.snapshot().charged, 4 * MIB);
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    let reclaimed = here.sweep();
    // SAFETY: signals the forked child (reparented, still alive: it only
    // sleeps) before any assertion can end the test.
    unsafe { libc::kill(child, libc::SIGKILL) };
    assert_eq!(
        reclaimed.len(),
        1,
        "the dead parent's slot was not reclaimed while its forked child lived: {:?}",
        here.snapshot()
    );
    assert_eq!(reclaimed[0].bytes, 4 * MIB);
    assert_eq!(here.snapshot().charged, 0);
    here.check().unwrap();
}

/// Four processes charge and give back without a lease while snapshots
/// are taken: every snapshot's rows add up to its total, and `check`
/// never calls the busy ledger inconsistent.
#[test]
fn snapshots_add_up_while_processes_charge() {
    let dir = TempDir::new("snapshots");
    let path = dir.file("ledger");
    let here = ledger(&path, 100 * MIB);
    let mut children: Vec<Driven> = (0..4)
        .map(|i| Driven::spawn("charger", &path, &format!("7{i}"), false))
        .collect();
    for c in &mut children {
        c.expect("charged");
    }
    let (mut consistent, mut unsettled) = (0, 0);
    for i in 0..2000 {
        let snap = here.snapshot();
        if snap.consistent {
            consistent += 1;
            let sum: u64 = snap.processes.iter().map(|p| p.charged).sum();
            assert_eq!(sum, snap.charged, "snapshot {i}: torn: {snap:?}");
        }
        match here.check() {
            Ok(()) => {}
            Err(MachineError::Unsettled { .. }) => unsettled += 1,
            Err(e) => panic!("check {i} called a busy ledger inconsistent: {e}"),
        }
    }
    assert!(consistent > 0, "no snapshot was consistent");
    for mut c in children {
        c.child.kill().unwrap();
        c.child.wait().unwrap();
    }
    eventually("the chargers reclaimed", || {
        here.sweep();
        here.snapshot().processes.is_empty()
    });
    here.check().unwrap();
    println!("2000 snapshots under 4 charging processes: {consistent} consistent, the rest marked; {unsettled} checks could not judge");
}

/// Outside figures at the top of their range: nothing overflows (a panic
/// in a debug build), admission refuses, and the snapshot and check agree.
#[test]
fn extreme_outside_figures_do_not_overflow() {
    let dir = TempDir::new("extreme");
    let path = dir.file("ledger");
    let here = ledger(&path, 100 * MIB);
    let m = here.join(JoinOptions::new("m").lease_chunk(0)).unwrap();
    m.charge(MIB).unwrap();
    here.observe_device(MemoryInfo {
        total: u64::MAX,
        free: 0,
    });
    let snap = here.snapshot();
    assert_eq!(snap.outside, (u64::MAX - MIB) / 4096 * 4096, "{snap:?}");
    assert_eq!(snap.available(), 0);
    let r = m.charge(4096).unwrap_err();
    assert_eq!((r.by, r.available()), (RefusedBy::Ledger, 0), "{r}");
    let found = memgov::machine::DeviceProcesses {
        library: "nvml",
        processes: vec![
            memgov::machine::DeviceProcess {
                pid: 4_000_001,
                bytes: Some(u64::MAX),
            },
            memgov::machine::DeviceProcess {
                pid: 4_000_002,
                bytes: Some(u64::MAX),
            },
        ],
    };
    here.observe_processes(&found);
    let snap = here.snapshot();
    assert!(snap.outside_processes >= u64::MAX / 2, "{snap:?}");
    assert!(m.make_room(MIB, Instant::now()).is_empty());
    here.check().unwrap();
    m.uncharge(MIB).unwrap();
}
