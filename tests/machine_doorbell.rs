//! The doorbell thread of a machine-ledger member survives what it calls:
//! a pressure responder that panics while trimming for another process is
//! caught and counted (`MachineMember::doorbell_panics`), the ring is
//! answered, and the next ring is served (the responder, working again,
//! makes the room).

#![cfg(target_os = "linux")]

use memgov::host::{HostConfig, HostContext};
use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
use memgov::{Admission, Alloc, ContextConfig, Governor, ProcessBudget, Role, SharedBudget};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_panicking_responder_does_not_stop_the_doorbell() {
    let dir = TempDir(std::env::temp_dir().join(format!("memgov-doorbell-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let ledger =
        MachineLedger::open(&LedgerOptions::new("doorbell", 64 * MIB).path(dir.0.join("ledger")))
            .unwrap();

    // The holder: 48 MiB in 1 MiB buffers, a responder whose first call
    // panics and whose later calls give buffers back.
    let member = ledger
        .join(JoinOptions::new("holder").priority(10).lease_chunk(0))
        .unwrap();
    let holder = member.clone();
    let process = ProcessBudget::with_machine("holder", u64::MAX, member);
    let device = SharedBudget::with_parent("gpu", u64::MAX, &process);
    let gov: Governor<HostContext> = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new()
            .label("holder")
            .shared_budget(device)
            .admission(Admission::FailFast),
    );
    let stream = ctx.create_stream("hold").unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    for _ in 0..48 {
        held.lock().unwrap().push(
            ctx.allocate(&stream, Alloc::new(MIB, Role::KvCache))
                .unwrap(),
        );
    }
    let calls = Arc::new(AtomicU32::new(0));
    let (h, c) = (Arc::clone(&held), Arc::clone(&calls));
    ctx.add_pressure_responder(memgov::DEFAULT_PRESSURE_PRIORITY, move |req| {
        if c.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("a responder with a bug");
        }
        let mut held = h.lock().unwrap();
        let mut freed = 0;
        while freed < req.shortfall && !held.is_empty() {
            held.pop();
            freed += MIB;
        }
        freed
    });

    // The requester: 32 MiB do not fit beside the holder's 48.
    let requester = ledger
        .join(JoinOptions::new("requester").priority(200).lease_chunk(0))
        .unwrap();
    assert!(requester.charge(32 * MIB).is_err());
    // First ring: the responder panics on the holder's doorbell thread,
    // which answers anyway. (The deadline only bounds a broken run.)
    let unanswered = requester.make_room(32 * MIB, Instant::now() + Duration::from_secs(20));
    assert!(
        unanswered.is_empty(),
        "the holder did not answer after its responder panicked: {unanswered:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(holder.doorbell_panics(), 1);
    assert!(requester.charge(32 * MIB).is_err(), "nothing was freed yet");
    // Second ring: the same thread serves it; the responder frees.
    let unanswered = requester.make_room(32 * MIB, Instant::now() + Duration::from_secs(20));
    assert!(
        unanswered.is_empty(),
        "the holder's doorbell thread stopped serving: {unanswered:?}"
    );
    assert!(calls.load(Ordering::SeqCst) >= 2);
    requester.charge(32 * MIB).unwrap();
    // The holder stores its answer once its trim has settled: wait for it
    // (a state, not a time: 10 s only bounds a broken run).
    let row = || {
        ledger
            .snapshot()
            .processes
            .into_iter()
            .find(|p| p.name == "holder")
            .unwrap()
    };
    let until = Instant::now() + Duration::from_secs(10);
    while row().unanswered_rings != 0 {
        assert!(
            Instant::now() < until,
            "the second ring was never answered: {:?}",
            row()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let row = row();
    assert_eq!(holder.doorbell_panics(), 1);
    assert!(row.charged <= 32 * MIB, "{row:?}");
    println!(
        "doorbell: a responder's panic caught ({} caught), the ring answered, the next ring served: the holder holds {} MiB",
        holder.doorbell_panics(),
        row.charged / MIB
    );
    requester
        .uncharge(32 * MIB)
        .expect("gives back what it charged");
    drop((stream, ctx, gov, process, holder, requester));
}
