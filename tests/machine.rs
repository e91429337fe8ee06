//! The machine ledger across processes: every test runs child processes
//! (this test binary again, with `MEMGOV_MACHINE_CHILD` naming what the
//! child does, entered through `child_process_entry`) on a ledger of its
//! own in a temporary directory, never the default under `/dev/shm`.
//!
//! * `eight_processes_never_over_admit`: 8 processes x 8 threads allocate
//!   and free through the governor on one ledger; a witness word in another
//!   shared file counts the bytes live in every process and is checked
//!   against the ledger's limit after every allocation; every refusal names
//!   the machine level and its numbers show the request did not fit.
//! * `killed_processes_give_everything_back`: processes allocating through
//!   the governor (every allocation touching the ledger: no lease) are
//!   killed with SIGKILL at a point drawn from a seed, some while others
//!   sweep; after every round the ledger is exact (nothing charged, no
//!   slot held, the total the sum of the slots).
//! * `a_holder_trims_for_a_requester` / `a_process_that_does_not_answer_is_named`:
//!   cross-process trim through the doorbell, with a deadline; a stopped
//!   process (SIGSTOP) is reported by name and pid, and not waited for past
//!   the deadline.
//! * bad input: another layout version, a corrupt header, another device's
//!   segment, another user's segment, a process asking more than the
//!   device: each a clear error, the segment unchanged, and recoverable.
//! * `outside_processes_from_the_management_library`: what NVML and ROCm
//!   SMI say processes without a slot use is kept from admission (on their
//!   stand-ins where the real libraries are absent).
//!
//! The processes govern a host context, or, with
//! `MEMGOV_MACHINE_BACKEND=cuda` (and the `cuda` feature), a CUDA context:
//! on the CUDA stand-in in CI, where the ledger's key is the device's UUID
//! as the driver reports it, the same in every process.

#![cfg(target_os = "linux")]

use memgov::host::{HostConfig, HostContext};
use memgov::machine::{JoinOptions, LedgerOptions, MachineError, MachineLedger, MachineMember};
use memgov::{
    any::AnyContext, Admission, Alloc, BudgetScope, ContextConfig, ContextHandle, DeviceContext,
    Governor, GovernorError, ProcessBudget, Role, SharedBudget,
};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const CHILD: &str = "MEMGOV_MACHINE_CHILD";
const PATH: &str = "MEMGOV_MACHINE_PATH";
const WITNESS: &str = "MEMGOV_MACHINE_WITNESS";
const SEED: &str = "MEMGOV_MACHINE_SEED";
const READY: &str = "MEMGOV-READY";
const BACKEND: &str = "MEMGOV_MACHINE_BACKEND";

/// The device context each process governs: the host's, or the CUDA
/// driver's with `MEMGOV_MACHINE_BACKEND=cuda`.
fn device_context() -> AnyContext {
    match std::env::var(BACKEND).as_deref() {
        Err(_) | Ok("") | Ok("host") => HostContext::new(HostConfig {
            capacity: 1 << 40,
            ..HostConfig::default()
        })
        .unwrap()
        .into(),
        #[cfg(feature = "cuda")]
        Ok("cuda") => memgov::cuda::CudaContext::new(memgov::cuda::CudaConfig::default())
            .unwrap_or_else(|e| panic!("{BACKEND}=cuda: no CUDA context: {e}"))
            .into(),
        Ok(other) => panic!("{BACKEND}={other}: not a backend this test binary has (host, or cuda with --features cuda)"),
    }
}

/// The ledger's key: the device's identity, as every process derives it
/// from its own context (for the host backend, a fixed name).
fn key() -> &'static str {
    static KEY: OnceLock<String> = OnceLock::new();
    KEY.get_or_init(|| {
        let ctx = device_context();
        let key = match ctx {
            AnyContext::Host(_) => "test-device".to_owned(),
            _ => ctx.identity().key(),
        };
        ctx.teardown(false).unwrap();
        key
    })
}

/// A temporary directory for one test's segments, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir = std::env::temp_dir().join(format!(
            "memgov-machine-{name}-{}-{nanos}",
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

/// A xorshift generator: every draw follows from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A word in a small shared file: the witness of what every process holds.
struct SharedWord {
    ptr: *mut AtomicU64,
}

// SAFETY: the word is only accessed atomically.
unsafe impl Send for SharedWord {}
// SAFETY: as above.
unsafe impl Sync for SharedWord {}

impl SharedWord {
    fn open(path: &Path) -> Self {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .unwrap();
        f.set_len(4096).unwrap();
        // SAFETY: a shared mapping of the 4096-byte file, checked below;
        // the mapping outlives the file descriptor and is never unmapped
        // (the test process ends first).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Self { ptr: p.cast() }
    }

    fn get(&self) -> &AtomicU64 {
        // SAFETY: page-aligned, in bounds, mapped for the process's life.
        unsafe { &*self.ptr }
    }
}

fn ledger(path: &Path, limit: u64) -> MachineLedger {
    MachineLedger::open(&LedgerOptions::new(key(), limit).path(path)).unwrap()
}

/// A governor and one context (`device_context`) under a process budget
/// on the ledger.
fn governed(
    member: MachineMember,
    name: &str,
    admission: Admission,
) -> (Governor<AnyContext>, ContextHandle<AnyContext>) {
    let process = ProcessBudget::with_machine(name, u64::MAX, member);
    let device = SharedBudget::with_parent("gpu", u64::MAX, &process);
    let gov = Governor::new();
    let ctx = gov.register(
        device_context(),
        ContextConfig::new()
            .label(name)
            .shared_budget(device)
            .admission(admission),
    );
    (gov, ctx)
}

fn spawn(scenario: &str, path: &Path, extra: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "child_process_entry",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD, scenario)
    .env(PATH, path)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Read the child's stdout up to its READY line; returns the reader for
/// the rest.
fn wait_ready(child: &mut Child) -> BufReader<std::process::ChildStdout> {
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child ended before it was ready"
        );
        // The harness prints "test child_process_entry ... " before it.
        if line.trim_end().ends_with(READY) {
            return out;
        }
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: signals a child this test spawned and has not reaped.
    let r = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(r, 0, "kill({}, {sig})", child.id());
}

/// Wait until every thread of `pid` is stopped (state `T` in
/// `/proc/<pid>/task/*/stat`): a SIGSTOP takes effect as each thread is
/// next scheduled, which on a loaded machine is not at once.
fn wait_stopped(pid: u32) {
    eventually("the holder stopped", || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .all(|t| {
                let stat =
                    std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap_or_default();
                stat.rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().next())
                    == Some("T")
            })
    });
}

/// Wait for a state (never decides an outcome): up to 10 s.
/// Wait (sweeping) until every byte is back on the ledger.
fn settled_empty(ledger: &MachineLedger) {
    eventually("every byte back on the ledger", || {
        ledger.sweep();
        ledger.snapshot().charged == 0
    });
}

fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

/// The entry point of every child process; in the test run itself (no
/// `MEMGOV_MACHINE_CHILD`) it returns at once.
#[test]
fn child_process_entry() {
    let Ok(scenario) = std::env::var(CHILD) else {
        return;
    };
    let path = PathBuf::from(env(PATH));
    match scenario.as_str() {
        "hammer" => child_hammer(&path),
        "churn" => child_churn(&path),
        "holder" => child_holder(&path),
        "nvml" => child_nvml(&path),
        "rocm-smi" => child_rocm_smi(&path),
        other => panic!("unknown child scenario {other}"),
    }
}

// --- 8 processes x 8 threads ---

const HAMMER_LIMIT: u64 = 48 * MIB;
const THREADS: usize = 8;
const ITERATIONS: usize = 600;

fn child_hammer(path: &Path) {
    let witness = SharedWord::open(Path::new(&env(WITNESS)));
    let seed: u64 = env(SEED).parse().unwrap();
    let ledger = ledger(path, HAMMER_LIMIT);
    let name = format!("hammer-{seed}");
    let member = ledger
        .join(
            JoinOptions::new(&name)
                .lease_chunk(256 * KIB)
                .answer_timeout(Duration::from_millis(20)),
        )
        .unwrap();
    let (_gov, ctx) = governed(member, &name, Admission::FailFast);
    let refusals = AtomicU64::new(0);
    let admitted = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (ctx, witness, refusals, admitted) = (&ctx, &witness, &refusals, &admitted);
            s.spawn(move || {
                let mut rng = Rng(seed * 1000 + t as u64 + 1);
                let stream = ctx.create_stream("hammer").unwrap();
                let mut live = Vec::new();
                for _ in 0..ITERATIONS {
                    if live.len() >= 4 || (!live.is_empty() && rng.below(3) == 0) {
                        let (buf, bytes) = live.swap_remove(rng.below(live.len() as u64) as usize);
                        witness.get().fetch_sub(bytes, Ordering::SeqCst);
                        drop(buf);
                        continue;
                    }
                    let bytes = (1 + rng.below(64)) * 16 * KIB;
                    match ctx.allocate(&stream, Alloc::new(bytes, Role::Workspace)) {
                        Ok(buf) => {
                            let now = witness.get().fetch_add(bytes, Ordering::SeqCst) + bytes;
                            assert!(
                                now <= HAMMER_LIMIT,
                                "over-admitted: {now} B live across processes, limit {HAMMER_LIMIT}"
                            );
                            admitted.fetch_add(1, Ordering::Relaxed);
                            live.push((buf, bytes));
                        }
                        Err(GovernorError::BudgetExceeded(e)) => {
                            assert_eq!(e.scope, BudgetScope::Machine(key().into()), "{e}");
                            let m = e
                                .machine
                                .as_ref()
                                .expect("a machine refusal has its figures");
                            assert_eq!(m.requested, bytes);
                            assert!(
                                m.requested > m.available() && m.charged + m.requested > m.limit,
                                "refused though it fitted: {e}"
                            );
                            assert_eq!(m.outside, 0, "{e}");
                            assert_eq!(m.limit, HAMMER_LIMIT);
                            let text = e.to_string();
                            assert!(
                                text.contains(&format!("machine ledger '{}'", key())),
                                "{text}"
                            );
                            refusals.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(other) => panic!("unexpected error: {other}"),
                    }
                }
                for (buf, bytes) in live {
                    witness.get().fetch_sub(bytes, Ordering::SeqCst);
                    drop(buf);
                }
            });
        }
    });
    // Leave as a well-behaved process does: retire the context (its frees
    // settle, its charges come back) before the process ends.
    ctx.retire()
        .wait_timeout(Duration::from_secs(10))
        .expect("the context retired");
    println!(
        "COUNTS {} {}",
        admitted.load(Ordering::Relaxed),
        refusals.load(Ordering::Relaxed)
    );
}

#[test]
fn eight_processes_never_over_admit() {
    let ctx = device_context();
    println!(
        "the processes govern {} ({}), on ledger '{}'",
        ctx.describe().backend,
        ctx.describe().execution,
        key()
    );
    ctx.teardown(false).unwrap();
    let dir = TempDir::new("hammer");
    let path = dir.file("ledger");
    let witness = dir.file("witness");
    let ledger = ledger(&path, HAMMER_LIMIT);
    let _ = SharedWord::open(&witness);
    let children: Vec<_> = (0..8)
        .map(|i| {
            spawn(
                "hammer",
                &path,
                &[
                    (WITNESS, witness.display().to_string()),
                    (SEED, (i + 1).to_string()),
                ],
            )
        })
        .collect();
    let (mut admitted, mut refused) = (0u64, 0u64);
    for child in children {
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "a hammer process failed: {text}");
        let counts = text
            .lines()
            .find_map(|l| l.split("COUNTS ").nth(1))
            .expect("the child printed its counts");
        let mut it = counts.split(' ').map(|n| n.parse::<u64>().unwrap());
        admitted += it.next().unwrap();
        refused += it.next().unwrap();
    }
    assert!(admitted > 1000, "{admitted} admitted");
    assert!(
        refused > 0,
        "the ledger never refused: the test proved nothing"
    );
    // A process that ended before its membership was dropped (its last
    // reference can be on a thread the exit cut short) is dead: a sweep
    // reclaims it, exactly.
    settled_empty(&ledger);
    let snap = ledger.snapshot();
    assert_eq!(snap.charged, 0, "{snap:?}");
    assert!(snap.processes.is_empty(), "{snap:?}");
    ledger.check().unwrap();
    eprintln!("8 x {THREADS} threads: {admitted} admitted, {refused} refused on the machine");
}

// --- Random kills ---

fn child_churn(path: &Path) {
    let seed: u64 = env(SEED).parse().unwrap();
    let ledger = ledger(path, 64 * MIB);
    let member = ledger
        .join(JoinOptions::new(format!("churn-{seed}")).lease_chunk(0))
        .unwrap();
    let sweeper = member.clone();
    let (_gov, ctx) = governed(member, "churn", Admission::FailFast);
    println!("{READY}");
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (ctx, sweeper) = (&ctx, &sweeper);
            s.spawn(move || {
                let mut rng = Rng(seed * 7 + t + 1);
                let stream = ctx.create_stream("churn").unwrap();
                let mut live = Vec::new();
                for i in 0u64.. {
                    if i % 64 == 0 {
                        sweeper.sweep();
                    }
                    if live.len() >= 3 || (!live.is_empty() && rng.below(2) == 0) {
                        live.swap_remove(rng.below(live.len() as u64) as usize);
                        continue;
                    }
                    if let Ok(b) = ctx.allocate(
                        &stream,
                        Alloc::new((1 + rng.below(32)) * 4 * KIB, Role::Other),
                    ) {
                        live.push(b);
                    }
                }
            });
        }
    });
}

#[test]
fn killed_processes_give_everything_back() {
    let dir = TempDir::new("kills");
    let path = dir.file("ledger");
    let ledger = ledger(&path, 64 * MIB);
    let kills: usize = std::env::var("MEMGOV_MACHINE_KILLS")
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(1000);
    let seed: u64 = std::env::var(SEED)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    let mut rng = Rng(seed | 1);
    const AT_ONCE: usize = 8;
    let mut killed = 0usize;
    let mut round = 0u64;
    let start = Instant::now();
    while killed < kills {
        round += 1;
        let mut children: Vec<Child> = (0..AT_ONCE)
            .map(|i| {
                spawn(
                    "churn",
                    &path,
                    &[(SEED, (round * 100 + i as u64).to_string())],
                )
            })
            .collect();
        let _outs: Vec<_> = children.iter_mut().map(wait_ready).collect();
        for (i, child) in children.iter_mut().enumerate() {
            // A point drawn from the seed: up to 3 ms into the churn.
            std::thread::sleep(Duration::from_micros(rng.below(3000)));
            child.kill().unwrap();
            killed += 1;
            // Sweep while the others still run, sometimes before the dead
            // one is reaped (a zombie holds nothing).
            if i % 3 == 0 {
                ledger.sweep();
            }
        }
        for mut child in children {
            child.wait().unwrap();
        }
        ledger.sweep();
        let snap = ledger.snapshot();
        assert_eq!(
            (snap.charged, snap.processes.len()),
            (0, 0),
            "round {round} (seed {seed}): the ledger is not exact after the kills: {snap:?}"
        );
        ledger.check().unwrap();
    }
    eprintln!(
        "{killed} kills in {round} rounds, {:.1} s, ledger exact after each ({} slots reclaimed by sweeps)",
        start.elapsed().as_secs_f64(),
        ledger.snapshot().reclaims
    );
}

// --- Trim across processes ---

const TRIM_LIMIT: u64 = 64 * MIB;

/// Holds 48 MiB in 1 MiB buffers and gives them back to a pressure
/// responder; priority 10 (asked first), floor 8 MiB.
fn child_holder(path: &Path) {
    let ledger = ledger(path, TRIM_LIMIT);
    let member = ledger
        .join(JoinOptions::new("holder").priority(10).floor(8 * MIB))
        .unwrap();
    let (_gov, ctx) = governed(member, "holder", Admission::FailFast);
    let stream = ctx.create_stream("hold").unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    for _ in 0..48 {
        held.lock().unwrap().push(
            ctx.allocate(&stream, Alloc::new(MIB, Role::KvCache))
                .unwrap(),
        );
    }
    let h = Arc::clone(&held);
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |req| {
        let mut held = h.lock().unwrap();
        let mut freed = 0;
        while freed < req.shortfall && held.len() > 8 {
            held.pop();
            freed += MIB;
        }
        freed
    });
    println!("{READY}");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn requester(path: &Path, timeout: Duration) -> (Governor<AnyContext>, ContextHandle<AnyContext>) {
    let member = ledger(path, TRIM_LIMIT)
        .join(JoinOptions::new("requester").priority(200))
        .unwrap();
    governed(member, "requester", Admission::WaitForPending { timeout })
}

#[test]
fn a_holder_trims_for_a_requester() {
    let dir = TempDir::new("trim");
    let path = dir.file("ledger");
    let ledger = ledger(&path, TRIM_LIMIT);
    let mut holder = spawn("holder", &path, &[]);
    let _out = wait_ready(&mut holder);
    let (_gov, ctx) = requester(&path, Duration::from_secs(10));
    let stream = ctx.create_stream("ask").unwrap();
    let t = Instant::now();
    let got = ctx.allocate(&stream, Alloc::new(32 * MIB, Role::Weights));
    let waited = t.elapsed();
    holder.kill().unwrap();
    holder.wait().unwrap();
    let buf = got.unwrap_or_else(|e| panic!("the holder did not make room: {e}"));
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    drop(buf);
    drop((stream, ctx, _gov));
    settled_empty(&ledger);
}

#[test]
fn a_process_that_does_not_answer_is_named() {
    let dir = TempDir::new("stopped");
    let path = dir.file("ledger");
    let ledger = ledger(&path, TRIM_LIMIT);
    let mut holder = spawn("holder", &path, &[]);
    let _out = wait_ready(&mut holder);
    signal(&holder, libc::SIGSTOP);
    wait_stopped(holder.id());
    let deadline = Duration::from_millis(300);
    let (_gov, ctx) = requester(&path, deadline);
    let stream = ctx.create_stream("ask").unwrap();
    let t = Instant::now();
    let got = ctx.allocate(&stream, Alloc::new(32 * MIB, Role::Weights));
    let waited = t.elapsed();
    signal(&holder, libc::SIGCONT);
    let Err(GovernorError::BudgetExceeded(e)) = got else {
        holder.kill().unwrap();
        panic!("a stopped holder made room: {got:?}");
    };
    assert_eq!(e.scope, BudgetScope::Machine(key().into()));
    let m = e.machine.as_ref().unwrap();
    assert_eq!(m.unanswered.len(), 1, "{e}");
    assert_eq!(
        (m.unanswered[0].name.as_str(), m.unanswered[0].pid),
        ("holder", holder.id())
    );
    let text = e.to_string();
    assert!(
        text.contains(&format!(
            "did not answer in time: 'holder' (pid {}",
            holder.id()
        )),
        "{text}"
    );
    assert!(waited >= deadline, "{waited:?}");
    assert!(waited < deadline + Duration::from_secs(3), "{waited:?}");
    // Once the holder is gone its bytes come back, and the request fits.
    holder.kill().unwrap();
    holder.wait().unwrap();
    let buf = ctx
        .allocate(&stream, Alloc::new(32 * MIB, Role::Weights))
        .unwrap();
    drop(buf);
    drop((stream, ctx, _gov));
    // The release settles on the host stream's worker; the membership
    // leaves the ledger with the last context.
    settled_empty(&ledger);
}

// --- One process, several slots ---

#[test]
fn refusals_are_exact_and_floors_are_kept() {
    let dir = TempDir::new("floors");
    let path = dir.file("ledger");
    let ledger = ledger(&path, 16 * MIB);
    let a = ledger
        .join(JoinOptions::new("a").lease_chunk(0).floor(4 * MIB))
        .unwrap();
    let b = ledger.join(JoinOptions::new("b").lease_chunk(MIB)).unwrap();
    // b may use everything but a's unused floor.
    b.charge(12 * MIB).unwrap();
    let r = b.charge(4096).unwrap_err();
    assert_eq!(
        (r.charged, r.limit, r.floors_reserved),
        (12 * MIB, 16 * MIB, 4 * MIB)
    );
    assert!(
        r.to_string().contains("kept for other processes' floors"),
        "{r}"
    );
    // a's floor is its own.
    a.charge(4 * MIB).unwrap();
    let r = a.charge(1).unwrap_err();
    assert_eq!(r.available(), 0, "{r}");
    a.uncharge(4 * MIB).unwrap();
    b.uncharge(12 * MIB).unwrap();
    assert_eq!(a.charged(), 0, "no lease: everything went back");
    assert!(
        b.charged() <= 2 * MIB + 4096,
        "b keeps at most two chunks idle"
    );
    // A floor the ledger cannot hold with a's is refused, nothing changed.
    let e = ledger
        .join(JoinOptions::new("c").floor(13 * MIB))
        .unwrap_err();
    assert!(matches!(e, MachineError::Floors { .. }), "{e}");
    let e = ledger
        .join(JoinOptions::new("d").limit(17 * MIB))
        .unwrap_err();
    assert!(matches!(e, MachineError::AboveDevice { .. }), "{e}");
    assert_eq!(ledger.snapshot().processes.len(), 2);
    drop((a, b));
    let snap = ledger.snapshot();
    assert_eq!((snap.charged, snap.processes.len()), (0, 0), "{snap:?}");
}

#[test]
fn outside_bytes_are_kept_from_admission() {
    let dir = TempDir::new("outside");
    let path = dir.file("ledger");
    let ledger = ledger(&path, 16 * MIB);
    let a = ledger.join(JoinOptions::new("a").lease_chunk(0)).unwrap();
    a.charge(2 * MIB).unwrap();
    // The driver says 8 MiB are used: 2 MiB are a's, 6 MiB nobody's.
    ledger.observe_device(memgov::MemoryInfo {
        free: 16 * MIB,
        total: 24 * MIB,
    });
    assert_eq!(ledger.outside(), 6 * MIB);
    let r = a.charge(9 * MIB).unwrap_err();
    assert_eq!((r.charged, r.outside), (2 * MIB, 6 * MIB));
    assert!(
        r.to_string()
            .contains("6.0 MiB (6291456 bytes) outside memgov"),
        "{r}"
    );
    a.charge(8 * MIB).unwrap();
    a.uncharge(10 * MIB).unwrap();
    assert_eq!(ledger.snapshot().outside, 6 * MIB);
}

// --- Bad input ---

fn write_word(path: &Path, offset: u64, value: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&value.to_le_bytes(), offset).unwrap();
}

#[test]
fn bad_segments_are_refused_unchanged_and_recoverable() {
    let dir = TempDir::new("bad");
    let open =
        |path: &Path, key: &str| MachineLedger::open(&LedgerOptions::new(key, 16 * MIB).path(path));
    type Check = fn(&MachineError) -> bool;
    let cases: [(&str, u64, u64, Check); 4] = [
        ("another layout version", 8, 7, |e| {
            matches!(
                e,
                MachineError::LayoutVersion {
                    found: 7,
                    expected: memgov::machine::LAYOUT_VERSION,
                    ..
                }
            )
        }),
        ("a corrupt magic", 0, 0xdead_beef, |e| {
            matches!(e, MachineError::Corrupt { .. })
        }),
        ("a slot count that breaks the checksum", 16, 200, |e| {
            matches!(e, MachineError::Corrupt { .. })
        }),
        ("a checksum overwritten", 32, 1, |e| {
            matches!(e, MachineError::Corrupt { .. })
        }),
    ];
    for (i, (what, offset, value, is)) in cases.into_iter().enumerate() {
        let path = dir.file(&format!("bad-{i}"));
        let l = open(&path, key()).unwrap();
        let m = l.join(JoinOptions::new("keeper").lease_chunk(0)).unwrap();
        m.charge(MIB).unwrap();
        write_word(&path, offset, value);
        let before = std::fs::read(&path).unwrap();
        let e = open(&path, key()).unwrap_err();
        assert!(is(&e), "{what}: {e}");
        let text = e.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(
            text.contains("MachineLedger::reset") || text.contains("reset"),
            "{text}"
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            before,
            "{what}: the segment changed"
        );
        // Recoverable: reset, and a new ledger at the same path.
        MachineLedger::reset(&path).unwrap();
        let fresh = open(&path, key()).unwrap();
        fresh
            .join(JoinOptions::new("new"))
            .unwrap()
            .charge(MIB)
            .unwrap();
        drop(m);
    }
    // Another device's segment.
    let path = dir.file("other-device");
    let _l = open(&path, "gpu-a").unwrap();
    let e = open(&path, "gpu-b").unwrap_err();
    assert!(
        matches!(&e, MachineError::WrongDevice { found, expected, .. } if found == "gpu-a" && expected == "gpu-b"),
        "{e}"
    );
    // A truncated segment.
    let path = dir.file("truncated");
    drop(open(&path, key()).unwrap());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(600)
        .unwrap();
    let e = open(&path, key()).unwrap_err();
    assert!(matches!(e, MachineError::Corrupt { .. }), "{e}");
    // A free slot holding bytes (a neighbour writing into the table): the
    // check says so, the repair rebuilds the total, and the ledger works.
    let path = dir.file("hostile");
    let l = open(&path, key()).unwrap();
    write_word(&path, 512 + 5 * 512 + 16, 1 << 20);
    let e = l.check().unwrap_err();
    assert!(matches!(e, MachineError::Inconsistent { .. }), "{e}");
    let (before, after) = l.repair();
    assert_eq!((before, after), (0, 0));
    l.check().unwrap();
    l.join(JoinOptions::new("after-repair"))
        .unwrap()
        .charge(15 * MIB)
        .unwrap();
}

#[test]
fn another_users_segment_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("owner");
    let path = dir.file("ledger");
    drop(ledger(&path, 16 * MIB));
    let before = std::fs::read(&path).unwrap();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let e = if root {
        // Root can hand the file to another user, and must still refuse it.
        let c = std::ffi::CString::new(path.display().to_string()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 4242, 4242) }, 0);
        let e = MachineLedger::open(&LedgerOptions::new(key(), 16 * MIB).path(&path)).unwrap_err();
        assert!(
            matches!(
                e,
                MachineError::ForeignOwner {
                    owner: 4242,
                    uid: 0,
                    ..
                }
            ),
            "{e}"
        );
        e
    } else {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o000)).unwrap();
        let e = MachineLedger::open(&LedgerOptions::new(key(), 16 * MIB).path(&path)).unwrap_err();
        assert!(matches!(e, MachineError::Permission { .. }), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        e
    };
    assert!(e.to_string().contains("LedgerOptions::path"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

// --- Outside processes, from the management library ---

/// The NVML stand-in's device 0 (the CUDA stand-in's device 0: the same
/// UUID and PCI address).
fn stand_in_device() -> memgov::DeviceIdentity {
    memgov::DeviceIdentity::named("cuda", "stand-in").with_uuid(*b"memgov-standin\0\0")
}

const NVML_FILE: &str = "MEMGOV_STANDIN_NVML_PROCESSES";

fn child_nvml(path: &Path) {
    use memgov::machine::{device_processes, DeviceProcess, ManagementError};
    let file = PathBuf::from(env(NVML_FILE));
    let id = stand_in_device();
    let me = std::process::id();
    std::fs::write(
        &file,
        format!(
            "0 {me} 104857600\n0 4000001 209715200\n0 4000002 -\n0 4000003 52428800 graphics\n\
             0 4000001 1048576 graphics\n1 4000009 999999999\n"
        ),
    )
    .unwrap();
    let found = match device_processes(&id) {
        Ok(f) => f,
        Err(e @ ManagementError::Unavailable { .. }) => {
            println!("{e}");
            return;
        }
        Err(ManagementError::Call { code: 6, .. }) => {
            println!("skipped: libnvidia-ml.so.1 here is not the stand-in (it does not know the stand-in's device)");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let p = |pid, bytes| DeviceProcess { pid, bytes };
    assert_eq!(found.library, "nvml");
    assert_eq!(
        found.processes,
        vec![
            p(me, Some(100 * MIB)),
            p(4000001, Some(200 * MIB)),
            p(4000002, None),
            p(4000003, Some(50 * MIB)),
        ],
        "compute and graphics lists merged per pid, the larger figure kept, device 1 left out"
    );
    // By PCI address, the same device.
    let by_pci = memgov::DeviceIdentity::named("hip", "x").with_pci_bus_id("0000:10:00.0");
    assert_eq!(
        device_processes(&by_pci).unwrap().processes,
        found.processes
    );
    // A device NVML does not know: its error, named.
    let unknown = memgov::DeviceIdentity::named("cuda", "x").with_uuid([7; 16]);
    match device_processes(&unknown) {
        Err(ManagementError::Call {
            code: 6,
            function,
            message,
            ..
        }) => {
            assert_eq!(function, "nvmlDeviceGetHandleByUUID");
            assert_eq!(message, "Not Found");
        }
        other => panic!("an unknown device gave {other:?}"),
    }

    let ledger = ledger(path, 1 << 30);
    let member = ledger
        .join(JoinOptions::new("watcher").lease_chunk(0))
        .unwrap();
    // This process has a slot: only the other three are outside.
    let outside = ledger.observe_processes(&found);
    assert_eq!(
        outside.iter().map(|p| p.pid).collect::<Vec<_>>(),
        [4000001, 4000002, 4000003]
    );
    let snap = ledger.snapshot();
    assert_eq!(snap.outside_processes, 250 * MIB);
    assert_eq!(
        snap.outside,
        250 * MIB,
        "the driver was never observed: NVML's figure counts"
    );
    let e = member.charge(800 * MIB).unwrap_err();
    assert_eq!(e.outside, 250 * MIB, "{e}");
    member.charge(700 * MIB).unwrap();
    member.uncharge(700 * MIB).unwrap();

    // More processes than the first query has room for: asked again.
    let many: String = (0..40)
        .map(|i| format!("0 {} 1048576\n", 5000000 + i))
        .collect();
    std::fs::write(&file, many).unwrap();
    let found = device_processes(&id).unwrap();
    assert_eq!(found.processes.len(), 40);
    ledger.observe_processes(&found);
    assert_eq!(ledger.snapshot().outside_processes, 40 * MIB);

    // A member that watches the device observes it from its doorbell thread.
    std::fs::write(&file, "0 4000100 314572800\n").unwrap();
    let watcher = ledger
        .join(JoinOptions::new("watching").watch_device(id.clone()))
        .unwrap();
    eventually("the doorbell thread observed NVML", || {
        ledger.snapshot().outside_processes == 300 * MIB
    });
    drop((watcher, member));
    println!("nvml: 3 of 4 processes outside the ledger, 250 MiB kept from admission; 40 processes read in two queries; a watching member observed 300 MiB");
}

#[test]
fn outside_processes_from_the_management_library() {
    let dir = TempDir::new("nvml");
    let path = dir.file("ledger");
    if std::env::var(BACKEND).as_deref() == Ok("cuda") {
        // The CUDA stand-in's device is the NVML stand-in's device 0.
        let from_key = memgov::DeviceIdentity::from_key(key()).unwrap();
        assert_eq!(from_key.uuid(), stand_in_device().uuid(), "{}", key());
    }
    let mut child = spawn(
        "nvml",
        &path,
        &[(NVML_FILE, dir.file("processes").display().to_string())],
    );
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    let status = child.wait().unwrap();
    print!("{out}");
    assert!(status.success(), "the nvml child failed: {out}");
    assert!(
        out.contains("nvml: 3 of 4 processes") || out.contains("skipped: "),
        "the child neither passed nor said why it skipped: {out}"
    );
}

const ROCM_SMI_FILE: &str = "MEMGOV_STANDIN_ROCM_SMI_PROCESSES";

fn child_rocm_smi(path: &Path) {
    use memgov::machine::{device_processes, DeviceProcess, ManagementError};
    let file = PathBuf::from(env(ROCM_SMI_FILE));
    let me = std::process::id();
    std::fs::write(
        &file,
        format!("0 {me} 1048576\n0 4000001 104857600\n1 4000001 999\n1 4000002 5000\n"),
    )
    .unwrap();
    // The HIP stand-in's devices 0 and 1 (device 1's BDFID carries
    // partition bits, which a reader masks).
    let dev0 = memgov::DeviceIdentity::named("hip", "stand-in").with_pci_bus_id("0000:20:00.0");
    let dev1 = memgov::DeviceIdentity::named("hip", "stand-in").with_pci_bus_id("0000:21:00.0");
    let found = match device_processes(&dev0) {
        Ok(f) => f,
        Err(e @ ManagementError::Unavailable { .. }) => {
            println!("{e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let p = |pid, bytes| DeviceProcess {
        pid,
        bytes: Some(bytes),
    };
    assert_eq!(
        found.library, "rocm-smi",
        "a HIP device asks ROCm SMI first"
    );
    assert_eq!(
        found.processes,
        vec![p(me, MIB), p(4000001, 100 * MIB)],
        "the figures on this device, not the process's total; device 1's process left out"
    );
    assert_eq!(
        device_processes(&dev1).unwrap().processes,
        vec![p(4000001, 999), p(4000002, 5000)]
    );
    let nowhere = memgov::DeviceIdentity::named("hip", "x").with_pci_bus_id("0000:99:00.0");
    assert!(
        matches!(
            device_processes(&nowhere),
            Err(ManagementError::Call { code: 6 | 10, .. })
        ),
        "a device no library knows is an error naming the call"
    );
    let ledger = ledger(path, 1 << 30);
    let member = ledger.join(JoinOptions::new("amd").lease_chunk(0)).unwrap();
    let outside = ledger.observe_processes(&found);
    assert_eq!(outside, vec![p(4000001, 100 * MIB)]);
    assert_eq!(ledger.snapshot().outside, 100 * MIB);
    drop(member);
    println!("rocm-smi: 1 of 2 processes on the device outside the ledger, 100 MiB kept from admission; per-device figures, partition bits masked");
}

#[test]
fn outside_processes_from_rocm_smi() {
    let dir = TempDir::new("rocm-smi");
    let path = dir.file("ledger");
    let mut child = spawn(
        "rocm-smi",
        &path,
        &[
            (ROCM_SMI_FILE, dir.file("processes").display().to_string()),
            ("MEMGOV_STANDIN_HIP_DEVICES", "2".to_owned()),
        ],
    );
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    let status = child.wait().unwrap();
    print!("{out}");
    assert!(status.success(), "the rocm-smi child failed: {out}");
    assert!(
        out.contains("rocm-smi: 1 of 2 processes") || out.contains("skipped: "),
        "the child neither passed nor said why it skipped: {out}"
    );
}

/// With attribution on, each process publishes its largest call sites by
/// live bytes in its slot (summed over its contexts, the top
/// `SITE_ENTRIES`, each cut to `SITE_TEXT` bytes on a character boundary):
/// what `memgov top` shows under it. They follow the process's buffers.
#[test]
fn a_process_publishes_its_largest_sites_in_its_slot() {
    use memgov::machine::{SITE_ENTRIES, SITE_TEXT};
    const LONG: &str = "sssssssssssssssssssssssssssssssssssssssssssssssé and more";
    let dir = TempDir::new("sites");
    let l = MachineLedger::open(&LedgerOptions::new("sites", 256 * MIB).path(dir.file("ledger")))
        .unwrap();
    let member = l.join(JoinOptions::new("attributed")).unwrap();
    let process = ProcessBudget::with_machine("attributed", u64::MAX, member);
    let device = SharedBudget::with_parent("gpu", u64::MAX, &process);
    let gov = Governor::new();
    let register = |label: &str, on: bool| {
        gov.register(
            HostContext::new(HostConfig::default()).unwrap(),
            ContextConfig::new()
                .label(label)
                .shared_budget(device.clone())
                .attribution(on),
        )
    };
    let (a, b, off) = (
        register("a", true),
        register("b", true),
        register("off", false),
    );
    let (sa, sb, so) = (
        a.create_stream("s").unwrap(),
        b.create_stream("s").unwrap(),
        off.create_stream("s").unwrap(),
    );
    let mut held = Vec::new();
    let kv = Alloc::new(3 * MIB, Role::KvCache).label("kv");
    let kv_line = line!() + 1;
    held.push(a.allocate(&sa, kv).unwrap());
    // One site over two contexts: 1 MiB in each.
    for (ctx, s) in [(&a, &sa), (&b, &sb)] {
        let named = Alloc::new(MIB, Role::Weights).site("model.c:42");
        held.push(ctx.allocate(s, named).unwrap());
    }
    let long = Alloc::new(MIB + MIB / 2, Role::Weights).site(LONG);
    held.push(b.allocate(&sb, long).unwrap());
    for _ in 0..5 {
        let small = Alloc::new(64 << 10, Role::Activation).site("small.c:1");
        held.push(b.allocate(&sb, small).unwrap());
    }
    let least = Alloc::new(4 << 10, Role::Activation).site("least.c:1");
    held.push(a.allocate(&sa, least).unwrap());
    // Not attributed: in no row.
    held.push(
        off.allocate(&so, Alloc::new(8 * MIB, Role::Weights))
            .unwrap(),
    );

    let sites = || -> Vec<(String, u64)> {
        l.snapshot()
            .processes
            .into_iter()
            .find(|p| p.name == "attributed")
            .unwrap()
            .sites
            .into_iter()
            .map(|s| (s.site, s.live_bytes))
            .collect()
    };
    // The doorbell thread publishes every quarter second or so, maybe
    // while the buffers above were still being made: wait for a publication
    // that counts all of them (the four largest sites hold 3 MiB + 2 MiB +
    // 1.5 MiB + 320 KiB), then check it row by row.
    let all = 3 * MIB + 2 * MIB + (MIB + MIB / 2) + 5 * (64 << 10);
    eventually(
        "the process's sites published, every buffer counted",
        || {
            let rows = sites();
            rows.len() == SITE_ENTRIES && rows.iter().map(|r| r.1).sum::<u64>() == all
        },
    );
    let rows = sites();
    let kv_site = &rows[0].0;
    assert!(
        kv_site.starts_with(&format!("tests/machine.rs:{kv_line}:")) && kv_site.ends_with(" 'kv'"),
        "{rows:?}"
    );
    let cut = &LONG[..SITE_TEXT - 1];
    assert_eq!(
        rows[1..],
        [
            ("model.c:42".to_owned(), 2 * MIB),
            (cut.to_owned(), MIB + MIB / 2),
            ("small.c:1".to_owned(), 5 * (64 << 10)),
        ],
        "largest first, the long name cut before its two-byte character"
    );
    assert_eq!(rows[0].1, 3 * MIB);
    drop(held);
    eventually("the sites follow the buffers", || sites().is_empty());
    drop((sa, sb, so));
    for ctx in [a, b, off] {
        ctx.retire().wait_timeout(Duration::from_secs(10)).unwrap();
    }
}
