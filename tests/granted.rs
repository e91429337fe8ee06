//! Budgets the cluster granted (`memgov::granted`): every format of the
//! four variables and every bad value, as a table read through a fake
//! environment (the rules are HAMi-core's README and `get_limit_from_env`,
//! and NVIDIA's MPS documentation of `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`,
//! not this crate's code); then the grant as the process level of the
//! budget tree, alone and under a machine ledger, named in refusals and
//! snapshots.

use memgov::granted::{granted_limit, GrantedLimit, GrantedLimitError};
use memgov::host::{HostConfig, HostContext};
use memgov::SharedBudget;
use memgov::{Alloc, BudgetScope, ContextConfig, Governor, GovernorError, ProcessBudget, Role};

const K: u64 = 1 << 10;
const M: u64 = 1 << 20;
const G: u64 = 1 << 30;

fn read(
    vars: &[(&str, &str)],
    device: u32,
    total: Option<u64>,
) -> Result<Option<GrantedLimit>, GrantedLimitError> {
    granted_limit(device, total, |name| {
        vars.iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| (*v).to_owned())
    })
}

/// Every format: the variables set, the device asked about, and the
/// limit expected with the variable it must be named after.
#[test]
fn every_format_reads_as_documented() {
    type Case = (
        &'static [(&'static str, &'static str)],
        u32,
        Option<(u64, &'static str)>,
    );
    let cases: &[Case] = &[
        // Nothing set, or set empty (HAMi-core: as if unset).
        (&[], 0, None),
        (&[("CUDA_DEVICE_MEMORY_LIMIT", "")], 0, None),
        (&[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")], 0, None),
        (&[("MEMGOV_DEVICE_LIMIT", "")], 0, None),
        // HAMi-core's README: 1g, 1024m, 1048576k, 1073741824 are the same.
        (
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")],
            0,
            Some((G, "CUDA_DEVICE_MEMORY_LIMIT")),
        ),
        (
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1G")],
            0,
            Some((G, "CUDA_DEVICE_MEMORY_LIMIT")),
        ),
        (
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1024m")],
            0,
            Some((G, "CUDA_DEVICE_MEMORY_LIMIT")),
        ),
        (
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1024M")],
            0,
            Some((G, "CUDA_DEVICE_MEMORY_LIMIT")),
        ),
        (
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1048576k")],
            0,
            Some((G, "CUDA_DEVICE_MEMORY_LIMIT")),
        ),
        (
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1048576K")],
            0,
            Some((G, "CUDA_DEVICE_MEMORY_LIMIT")),
        ),
        (
            &[("CUDA_DEVICE_MEMORY_LIMIT", "1073741824")],
            0,
            Some((G, "CUDA_DEVICE_MEMORY_LIMIT")),
        ),
        // What HAMi's device plugin writes: one per device, in MiB.
        (
            &[("CUDA_DEVICE_MEMORY_LIMIT_0", "3000m")],
            0,
            Some((3000 * M, "CUDA_DEVICE_MEMORY_LIMIT_0")),
        ),
        // Another device's variable does not apply.
        (&[("CUDA_DEVICE_MEMORY_LIMIT_1", "3000m")], 0, None),
        (
            &[("CUDA_DEVICE_MEMORY_LIMIT_1", "3000m")],
            1,
            Some((3000 * M, "CUDA_DEVICE_MEMORY_LIMIT_1")),
        ),
        // HAMi's rule: _<i> replaces the plain one for device i, even larger.
        (
            &[
                ("CUDA_DEVICE_MEMORY_LIMIT", "2g"),
                ("CUDA_DEVICE_MEMORY_LIMIT_0", "3g"),
            ],
            0,
            Some((3 * G, "CUDA_DEVICE_MEMORY_LIMIT_0")),
        ),
        (
            &[
                ("CUDA_DEVICE_MEMORY_LIMIT", "2g"),
                ("CUDA_DEVICE_MEMORY_LIMIT_0", "3g"),
            ],
            1,
            Some((2 * G, "CUDA_DEVICE_MEMORY_LIMIT")),
        ),
        // NVIDIA's MPS example: 0=1G,1=512MB.
        (
            &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G,1=512MB")],
            0,
            Some((G, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")),
        ),
        (
            &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G,1=512MB")],
            1,
            Some((512 * M, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")),
        ),
        (
            &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G,1=512MB")],
            2,
            None,
        ),
        (
            &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=3072M")],
            0,
            Some((3 * G, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")),
        ),
        (
            &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=5GB")],
            0,
            Some((5 * G, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")),
        ),
        (
            &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", " 0 = 2g , 1=1g ")],
            0,
            Some((2 * G, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")),
        ),
        // memgov's own: one size for every device, or a list.
        (
            &[("MEMGOV_DEVICE_LIMIT", "12GiB")],
            3,
            Some((12 * G, "MEMGOV_DEVICE_LIMIT")),
        ),
        (
            &[("MEMGOV_DEVICE_LIMIT", "512mib")],
            0,
            Some((512 * M, "MEMGOV_DEVICE_LIMIT")),
        ),
        (
            &[("MEMGOV_DEVICE_LIMIT", "64KB")],
            0,
            Some((64 * K, "MEMGOV_DEVICE_LIMIT")),
        ),
        (
            &[("MEMGOV_DEVICE_LIMIT", "2T")],
            0,
            Some((2 << 40, "MEMGOV_DEVICE_LIMIT")),
        ),
        (
            &[("MEMGOV_DEVICE_LIMIT", "4096")],
            0,
            Some((4096, "MEMGOV_DEVICE_LIMIT")),
        ),
        (
            &[("MEMGOV_DEVICE_LIMIT", "4096B")],
            0,
            Some((4096, "MEMGOV_DEVICE_LIMIT")),
        ),
        (
            &[("MEMGOV_DEVICE_LIMIT", "0=12GiB,1=8GiB")],
            1,
            Some((8 * G, "MEMGOV_DEVICE_LIMIT")),
        ),
        (&[("MEMGOV_DEVICE_LIMIT", "0=12GiB")], 1, None),
        // The smallest limit of all that apply wins.
        (
            &[
                ("MEMGOV_DEVICE_LIMIT", "6g"),
                ("CUDA_DEVICE_MEMORY_LIMIT_0", "4000m"),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=5G"),
            ],
            0,
            Some((4000 * M, "CUDA_DEVICE_MEMORY_LIMIT_0")),
        ),
        (
            &[
                ("MEMGOV_DEVICE_LIMIT", "2g"),
                ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ],
            0,
            Some((2 * G, "MEMGOV_DEVICE_LIMIT")),
        ),
        (
            &[
                ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G"),
            ],
            0,
            Some((G, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")),
        ),
        // A tie names the first in the table's order.
        (
            &[
                ("MEMGOV_DEVICE_LIMIT", "1g"),
                ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G"),
            ],
            0,
            Some((G, "MEMGOV_DEVICE_LIMIT")),
        ),
        (
            &[
                ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G"),
            ],
            0,
            Some((G, "CUDA_DEVICE_MEMORY_LIMIT")),
        ),
        // Exactly the device's total is allowed.
        (
            &[("CUDA_DEVICE_MEMORY_LIMIT", "4096g")],
            0,
            Some((4 << 40, "CUDA_DEVICE_MEMORY_LIMIT")),
        ),
    ];
    for (vars, device, want) in cases {
        let got = read(vars, *device, Some(4 << 40))
            .unwrap_or_else(|e| panic!("{vars:?} on device {device}: {e}"));
        let got = got.map(|g| {
            assert_eq!(g.device, *device);
            let value = vars.iter().find(|(n, _)| *n == g.variable).unwrap().1;
            assert_eq!(g.value, value, "{vars:?}");
            (g.bytes, g.variable)
        });
        let want = want.map(|(b, v)| (b, v.to_owned()));
        assert_eq!(got, want, "{vars:?} on device {device}");
    }
}

/// Every bad value: an error of the expected kind, naming the variable,
/// never a default.
#[test]
fn every_bad_value_is_an_error_naming_the_variable() {
    type Check = fn(&GrantedLimitError) -> bool;
    let suffix: Check = |e| matches!(e, GrantedLimitError::UnknownSuffix { .. });
    let number: Check = |e| matches!(e, GrantedLimitError::NotANumber { .. });
    let zero: Check = |e| matches!(e, GrantedLimitError::Zero { .. });
    let overflow: Check = |e| matches!(e, GrantedLimitError::Overflow { .. });
    let list: Check = |e| matches!(e, GrantedLimitError::DeviceList { .. });
    let above: Check = |e| matches!(e, GrantedLimitError::AboveDevice { .. });
    let cases: &[(&str, &str, u32, Check)] = &[
        // HAMi-core knows k, m, g alone: anything else is refused (it would
        // read "4gb" as 4 bytes).
        ("CUDA_DEVICE_MEMORY_LIMIT", "4gb", 0, suffix),
        ("CUDA_DEVICE_MEMORY_LIMIT", "4GiB", 0, suffix),
        ("CUDA_DEVICE_MEMORY_LIMIT", "4t", 0, suffix),
        ("CUDA_DEVICE_MEMORY_LIMIT", "4 g", 0, suffix),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "3000x", 0, suffix),
        ("CUDA_DEVICE_MEMORY_LIMIT", "g", 0, number),
        ("CUDA_DEVICE_MEMORY_LIMIT", "-1g", 0, number),
        ("CUDA_DEVICE_MEMORY_LIMIT", "1.5g", 0, suffix),
        ("CUDA_DEVICE_MEMORY_LIMIT", "0x10g", 0, suffix),
        ("CUDA_DEVICE_MEMORY_LIMIT", "010g", 0, number),
        ("CUDA_DEVICE_MEMORY_LIMIT", "0", 0, zero),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "0m", 0, zero),
        ("CUDA_DEVICE_MEMORY_LIMIT", "17179869184g", 0, overflow),
        (
            "CUDA_DEVICE_MEMORY_LIMIT",
            "99999999999999999999999",
            0,
            overflow,
        ),
        ("CUDA_DEVICE_MEMORY_LIMIT", "17g", 0, above),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "16385m", 0, above),
        // MPS: a unit is required, and M/MB/G/GB are the ones documented.
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1024", 0, suffix),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1T", 0, suffix),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1GiB", 0, suffix),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=0G", 0, zero),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=G", 0, number),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "1G", 0, list),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G,", 0, list),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ",0=1G", 0, list),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G,,1=1G", 0, list),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G;1=1G", 0, suffix),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "gpu0=1G", 0, list),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "-1=1G", 0, list),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "=1G", 0, list),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G,0=2G", 0, list),
        (
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            "99999999999=1G",
            0,
            list,
        ),
        // A bad entry for another device is still an error.
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G,1=lots", 0, number),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=17G", 0, above),
        // memgov's own.
        ("MEMGOV_DEVICE_LIMIT", "12 gigabytes", 0, suffix),
        ("MEMGOV_DEVICE_LIMIT", "12PiB", 0, suffix),
        ("MEMGOV_DEVICE_LIMIT", "0", 0, zero),
        ("MEMGOV_DEVICE_LIMIT", "0=1G,x=2G", 0, list),
        ("MEMGOV_DEVICE_LIMIT", "0=1G,1=2G,1=3G", 0, list),
        ("MEMGOV_DEVICE_LIMIT", "1=1G,0=bad", 1, number),
        ("MEMGOV_DEVICE_LIMIT", "20000000T", 0, overflow),
        ("MEMGOV_DEVICE_LIMIT", "32GiB", 0, above),
    ];
    for (var, value, device, check) in cases {
        let e = read(&[(var, value)], *device, Some(16 * G))
            .expect_err(&format!("{var}={value} must be refused"));
        assert!(check(&e), "{var}={value}: wrong kind: {e:?}");
        let msg = e.to_string();
        assert!(msg.starts_with(var), "{var}={value}: {msg}");
        assert!(msg.contains(&format!("{value:?}")), "{var}={value}: {msg}");
    }
    // A bad variable is an error even when another, valid one is smaller.
    let e = read(
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=2X"),
        ],
        0,
        None,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        "{e}"
    );
    // ... and a bad plain HAMi variable while the per-device one wins.
    let e = read(
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "2q"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"),
        ],
        0,
        None,
    )
    .unwrap_err();
    assert!(
        e.to_string().starts_with("CUDA_DEVICE_MEMORY_LIMIT="),
        "{e}"
    );
    // Above the device: only when the total is known.
    assert_eq!(
        read(&[("CUDA_DEVICE_MEMORY_LIMIT", "17g")], 0, None)
            .unwrap()
            .unwrap()
            .bytes,
        17 * G
    );
    // The message carries the numbers.
    let e = read(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "20g")], 0, Some(16 * G)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "CUDA_DEVICE_MEMORY_LIMIT_0=\"20g\": 20.0 GiB (21474836480 bytes) on device 0 is above the device's 16.0 GiB (17179869184 bytes) of memory; the value was meant for another device, or is wrong: fix it"
    );
}

/// The grant is the process level: an allocation over it is refused there,
/// and the refusal names the variable.
#[test]
fn a_grant_is_the_process_level_and_refusals_name_it() {
    let grant = read(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "3m")], 0, Some(64 * M))
        .unwrap()
        .unwrap();
    let process = ProcessBudget::granted("worker", 8 * M, &grant);
    assert_eq!(process.limit(), 3 * M);
    assert_eq!(process.limit_from(), Some("CUDA_DEVICE_MEMORY_LIMIT_0"));
    let gpu0 = SharedBudget::with_parent("gpu0", 8 * M, &process);
    let gov = Governor::new();
    let ctx = gov.register(
        HostContext::new(HostConfig::default()).unwrap(),
        ContextConfig::new().shared_budget(gpu0),
    );
    let s = ctx.create_stream("s").unwrap();
    let _a = ctx.allocate(&s, Alloc::new(2 * M, Role::Weights)).unwrap();
    let err = ctx
        .allocate(&s, Alloc::new(2 * M, Role::Weights))
        .unwrap_err();
    let GovernorError::BudgetExceeded(b) = &err else {
        panic!("{err}");
    };
    assert_eq!(b.scope, BudgetScope::Process("worker".into()));
    assert_eq!(b.limit, 3 * M);
    assert_eq!(b.limit_from.as_deref(), Some("CUDA_DEVICE_MEMORY_LIMIT_0"));
    let msg = err.to_string();
    assert!(
        msg.contains("limit (granted by CUDA_DEVICE_MEMORY_LIMIT_0) leaves")
            && msg.ends_with("or ask the cluster for a larger grant"),
        "{msg}"
    );
    // A request that can never fit says where to ask.
    let err = ctx
        .allocate(&s, Alloc::new(4 * M, Role::Weights))
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("ask the cluster for a larger grant"),
        "{err}"
    );
    // Another level's refusal names no grant.
    let err = ctx
        .allocate(&s, Alloc::new(1 << 40, Role::Weights))
        .unwrap_err();
    let GovernorError::BudgetExceeded(b) = &err else {
        panic!("{err}");
    };
    assert_ne!(b.scope, BudgetScope::Process("worker".into()));
    assert_eq!(b.limit_from, None, "{err}");

    // A grant above the limit asked for does not raise it, nor is named.
    let process = ProcessBudget::granted("worker", 2 * M, &grant);
    assert_eq!((process.limit(), process.limit_from()), (2 * M, None));
    // Without a grant, nothing is named.
    assert_eq!(ProcessBudget::new("plain", M).limit_from(), None);
}

/// A context's snapshot says where its process level's limit came from:
/// the variable the cluster set, or the program; in its JSON too.
#[test]
fn the_snapshot_names_where_the_process_limit_came_from() {
    use memgov::{LimitSource, ProcessLimit};
    let grant = read(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "3m")], 0, Some(16 * M))
        .unwrap()
        .unwrap();
    let gov = Governor::new();
    let snap_of = |shared: Option<SharedBudget>| {
        let mut config = ContextConfig::new();
        if let Some(s) = shared {
            config = config.shared_budget(s);
        }
        let ctx = gov.register(HostContext::new(HostConfig::default()).unwrap(), config);
        ctx.snapshot()
    };
    let granted = ProcessBudget::granted("worker", u64::MAX, &grant);
    let snap = snap_of(Some(SharedBudget::with_parent("gpu0", 8 * M, &granted)));
    assert_eq!(
        snap.process_limit,
        Some(ProcessLimit {
            label: "worker".into(),
            limit: 3 * M,
            from: LimitSource::Granted("CUDA_DEVICE_MEMORY_LIMIT_0".into()),
        })
    );
    assert_eq!(
        snap.process_limit.as_ref().unwrap().from.to_string(),
        "CUDA_DEVICE_MEMORY_LIMIT_0"
    );
    let program = ProcessBudget::new("trainer", 5 * M);
    let snap = snap_of(Some(SharedBudget::with_parent("gpu0", 8 * M, &program)));
    let limit = snap.process_limit.clone().unwrap();
    assert_eq!(
        (limit.label.as_str(), limit.limit, &limit.from),
        ("trainer", 5 * M, &LimitSource::Program)
    );
    assert_eq!(limit.from.to_string(), "set by the program");
    #[cfg(feature = "serde")]
    {
        let v = serde_json::to_value(&snap).unwrap();
        assert_eq!(
            v["process_limit"],
            serde_json::json!({"label": "trainer", "limit": 5 * M, "from": {"kind": "program"}})
        );
        let v = serde_json::to_value(snap_of(Some(SharedBudget::with_parent(
            "gpu0",
            8 * M,
            &granted,
        ))))
        .unwrap();
        assert_eq!(
            v["process_limit"]["from"],
            serde_json::json!({"kind": "granted", "variable": "CUDA_DEVICE_MEMORY_LIMIT_0"})
        );
    }
    // A shared budget with no process level above, or none at all: no
    // process limit.
    assert_eq!(
        snap_of(Some(SharedBudget::new("alone", 8 * M))).process_limit,
        None
    );
    assert_eq!(snap_of(None).process_limit, None);
}

#[cfg(target_os = "linux")]
mod machine {
    use super::*;
    use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger, RefusedBy};

    fn ledger(name: &str, limit: u64) -> (MachineLedger, std::path::PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("memgov-granted-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ledger");
        let _ = std::fs::remove_file(&path);
        let key = format!("granted-{name}-{}", std::process::id());
        let l = MachineLedger::open(&LedgerOptions::new(key, limit).path(&path)).unwrap();
        (l, dir)
    }

    /// Joined with a grant: the slot's limit is the grant, the snapshot and
    /// the ledger's refusal name its variable, and the process level under
    /// the membership takes the same limit.
    #[test]
    fn a_grant_on_the_ledger_is_shown_and_named() {
        let (l, dir) = ledger("shown", 64 * M);
        let grant = read(
            &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=8M")],
            0,
            Some(64 * M),
        )
        .unwrap()
        .unwrap();
        let me = l
            .join(
                JoinOptions::new("mps-client")
                    .granted(&grant)
                    .lease_chunk(0),
            )
            .unwrap();
        assert_eq!(me.limit(), 8 * M);
        assert_eq!(
            me.limit_from().as_deref(),
            Some("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        );
        let snap = l.snapshot();
        let p = snap.processes.iter().find(|p| p.slot == me.slot()).unwrap();
        assert_eq!(p.limit, 8 * M);
        assert_eq!(
            p.limit_from.as_deref(),
            Some("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        );

        let r = me.charge(9 * M).unwrap_err();
        assert_eq!(r.by, RefusedBy::ProcessLimit);
        assert_eq!(
            r.process_limit_from.as_deref(),
            Some("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        );
        assert!(
            r.to_string()
                .contains("limit on the machine (granted by CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)"),
            "{r}"
        );

        let process = ProcessBudget::with_machine("mps-client", 32 * M, me.clone());
        assert_eq!(process.limit(), 8 * M);
        assert_eq!(
            process.limit_from(),
            Some("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        );
        drop(process);
        let slot = me.slot();
        drop(me);

        // The slot taken again without a grant names none.
        let again = l.join(JoinOptions::new("plain").lease_chunk(0)).unwrap();
        assert_eq!(again.slot(), slot);
        assert_eq!(again.limit_from(), None);
        let snap = l.snapshot();
        assert_eq!(
            snap.processes
                .iter()
                .find(|p| p.slot == slot)
                .unwrap()
                .limit_from,
            None
        );
        let process = ProcessBudget::with_machine("plain", 32 * M, again);
        assert_eq!((process.limit(), process.limit_from()), (32 * M, None));
        drop(process);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A grant above what the ledger allows is capped to the ledger (a plain
    /// limit above it is still refused), and the slot says so.
    #[test]
    fn a_grant_above_the_ledger_is_capped_to_it() {
        let (l, dir) = ledger("capped", 16 * M);
        let grant = read(&[("MEMGOV_DEVICE_LIMIT", "32MiB")], 0, None)
            .unwrap()
            .unwrap();
        let me = l.join(JoinOptions::new("big").granted(&grant)).unwrap();
        assert_eq!(me.limit(), 16 * M);
        assert_eq!(
            me.limit_from().as_deref(),
            Some("MEMGOV_DEVICE_LIMIT, capped to the ledger")
        );
        let process = ProcessBudget::with_machine("big", u64::MAX, me);
        assert_eq!(process.limit(), 16 * M);
        drop(process);
        assert!(l.join(JoinOptions::new("plain").limit(32 * M)).is_err());
        // A grant above a smaller limit already given keeps that limit.
        let me = l
            .join(JoinOptions::new("small").limit(4 * M).granted(&grant))
            .unwrap();
        assert_eq!((me.limit(), me.limit_from()), (4 * M, None));
        drop(me);
        // A limit given after the grant replaces it, and names nothing.
        let me = l
            .join(JoinOptions::new("later").granted(&grant).limit(2 * M))
            .unwrap();
        assert_eq!((me.limit(), me.limit_from()), (2 * M, None));
        drop(me);
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The grant read from the environment at join, in child processes of this
/// test binary (each with the variables of the family set as the case
/// says and every other one removed): the process environment is the
/// input, so no test in this process sets it. The child joins a ledger of
/// the parent's (`MEMGOV_GRANTED_PATH`) as `MEMGOV_GRANTED_CHILD` says and
/// prints one `result:` line.
#[cfg(target_os = "linux")]
mod from_env {
    use super::*;
    use memgov::machine::{JoinOptions, LedgerOptions, MachineLedger};
    use std::process::Command;

    const CHILD: &str = "MEMGOV_GRANTED_CHILD";
    const PATH: &str = "MEMGOV_GRANTED_PATH";
    const FAMILY: [&str; 3] = [
        "MEMGOV_DEVICE_LIMIT",
        "CUDA_DEVICE_MEMORY_LIMIT",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    ];

    /// The entry point of every child; in the test run itself (no
    /// `MEMGOV_GRANTED_CHILD`) it returns at once.
    #[test]
    fn child_process_entry() {
        let Ok(what) = std::env::var(CHILD) else {
            return;
        };
        let path = std::env::var(PATH).unwrap();
        let words: Vec<&str> = what.split(' ').collect();
        let number = |key: &str| {
            words
                .iter()
                .find_map(|w| w.strip_prefix(key))
                .map(|v| v.parse::<u64>().unwrap())
        };
        let device = number("device=").map(|d| u32::try_from(d).unwrap());
        let total = number("total=");
        let result = if words[0] == "budget" {
            ProcessBudget::from_env("worker", 64 * M, device, total)
                .map(|p| format!("ok limit={} from={:?}", p.limit(), p.limit_from()))
                .map_err(|e| e.to_string())
        } else {
            let ledger_limit = number("ledger=").unwrap_or(64 * M);
            let l =
                MachineLedger::open(&LedgerOptions::new("granted-env", ledger_limit).path(path))
                    .unwrap();
            let mut opts = JoinOptions::new("child").lease_chunk(0);
            if let Some(d) = device {
                opts = opts.device(d);
            }
            if let Some(t) = total {
                opts = opts.device_total(t);
            }
            if let Some(limit) = number("limit=") {
                opts = opts.limit(limit);
            }
            if words.contains(&"ignore") {
                opts = opts.ignore_granted_env();
            }
            l.join(opts)
                .map(|me| {
                    // The slot says the same as the membership.
                    let snap = l.snapshot();
                    let p = snap.processes.iter().find(|p| p.slot == me.slot()).unwrap();
                    assert_eq!(p.limit_from, me.limit_from());
                    if me.limit() != u64::MAX {
                        assert_eq!(p.limit, me.limit());
                    }
                    // The process level under the membership takes a
                    // granted limit (a limit of the program's own stays the
                    // ledger's).
                    let process = ProcessBudget::with_machine("child", u64::MAX, me.clone());
                    assert_eq!(process.limit_from(), me.limit_from().as_deref());
                    if me.limit_from().is_some() {
                        assert_eq!(process.limit(), me.limit());
                    }
                    format!("ok limit={} from={:?}", me.limit(), me.limit_from())
                })
                .map_err(|e| e.to_string())
        };
        match result {
            Ok(r) => println!("result: {r}"),
            Err(e) => println!("result: error {e}"),
        }
    }

    /// Run a child doing `what` with `vars` set (and no other variable of
    /// the family); its `result:` line, less the prefix.
    fn child(name: &str, what: &str, vars: &[(&str, &str)]) -> String {
        let dir =
            std::env::temp_dir().join(format!("memgov-granted-env-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "from_env::child_process_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, what)
        .env(PATH, dir.join("ledger"));
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy().into_owned();
            if FAMILY.iter().any(|f| k.starts_with(f)) {
                cmd.env_remove(k);
            }
        }
        cmd.envs(vars.iter().copied());
        let out = cmd.output().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the child failed: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("result: ").map(|(_, r)| r.to_owned()))
            .unwrap_or_else(|| panic!("no result line:\n{stdout}"));
        line
    }

    /// A case: its name, what the child does, the variables set, and what
    /// is expected.
    type Case<T> = (
        &'static str,
        &'static str,
        &'static [(&'static str, &'static str)],
        T,
    );

    /// A membership's limit when it has none.
    const NONE: u64 = u64::MAX;

    fn ok(limit: u64, from: Option<&str>) -> String {
        format!("ok limit={limit} from={from:?}")
    }

    /// Each variable of the family, set in the container's environment,
    /// is the joined process's limit, named on its slot; the smallest
    /// wins; a grant above the ledger is capped to it.
    #[test]
    fn join_takes_the_grant_from_the_environment() {
        let cases: &[Case<String>] = &[
            ("none", "join", &[], ok(NONE, None)),
            (
                "hami-indexed",
                "join device=0",
                &[("CUDA_DEVICE_MEMORY_LIMIT_0", "8m")],
                ok(8 * M, Some("CUDA_DEVICE_MEMORY_LIMIT_0")),
            ),
            (
                "hami-indexed-1",
                "join device=1",
                &[
                    ("CUDA_DEVICE_MEMORY_LIMIT_0", "8m"),
                    ("CUDA_DEVICE_MEMORY_LIMIT_1", "6m"),
                ],
                ok(6 * M, Some("CUDA_DEVICE_MEMORY_LIMIT_1")),
            ),
            (
                "hami-all",
                "join",
                &[("CUDA_DEVICE_MEMORY_LIMIT", "6144k")],
                ok(6 * M, Some("CUDA_DEVICE_MEMORY_LIMIT")),
            ),
            (
                "mps",
                "join device=1",
                &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4M,1=2M")],
                ok(2 * M, Some("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")),
            ),
            (
                "mps-other-device",
                "join device=2",
                &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4M,1=2M")],
                ok(NONE, None),
            ),
            (
                "memgov",
                "join",
                &[("MEMGOV_DEVICE_LIMIT", "5MiB")],
                ok(5 * M, Some("MEMGOV_DEVICE_LIMIT")),
            ),
            (
                "smallest",
                "join device=0",
                &[
                    ("CUDA_DEVICE_MEMORY_LIMIT_0", "8m"),
                    ("MEMGOV_DEVICE_LIMIT", "0=3MiB"),
                ],
                ok(3 * M, Some("MEMGOV_DEVICE_LIMIT")),
            ),
            (
                "capped",
                "join ledger=16777216",
                &[("MEMGOV_DEVICE_LIMIT", "32MiB")],
                ok(16 * M, Some("MEMGOV_DEVICE_LIMIT, capped to the ledger")),
            ),
            (
                "own-limit-smaller",
                "join limit=2097152",
                &[("MEMGOV_DEVICE_LIMIT", "5MiB")],
                ok(2 * M, None),
            ),
            (
                "budget",
                "budget device=0",
                &[("CUDA_DEVICE_MEMORY_LIMIT_0", "7m")],
                ok(7 * M, Some("CUDA_DEVICE_MEMORY_LIMIT_0")),
            ),
            ("budget-none", "budget", &[], ok(64 * M, None)),
        ];
        for (name, what, vars, want) in cases {
            let got = child(name, what, vars);
            assert_eq!(&got, want, "{name}: {what} with {vars:?}");
        }
    }

    /// `ignore_granted_env` joins without reading the grant, even one that
    /// would not read.
    #[test]
    fn the_opt_out_ignores_the_environment() {
        for (name, vars) in [
            ("ignore", &[("MEMGOV_DEVICE_LIMIT", "5MiB")][..]),
            ("ignore-bad", &[("CUDA_DEVICE_MEMORY_LIMIT_0", "4gb")][..]),
        ] {
            let got = child(name, "join device=0 ignore", vars);
            assert_eq!(got, ok(NONE, None), "{vars:?}");
        }
    }

    /// A value that is no limit fails the join, the error naming the
    /// variable; so does a per-device variable when the join named no
    /// device, and a grant above the device's memory.
    #[test]
    fn a_bad_value_fails_the_join_naming_the_variable() {
        let cases: &[Case<&[&str]>] = &[
            (
                "bad-unit",
                "join device=0",
                &[("CUDA_DEVICE_MEMORY_LIMIT_0", "4gb")],
                &[
                    "not joined",
                    "CUDA_DEVICE_MEMORY_LIMIT_0=\"4gb\"",
                    "unknown unit",
                ],
            ),
            (
                "bad-other",
                "join device=0",
                &[
                    ("CUDA_DEVICE_MEMORY_LIMIT_0", "8m"),
                    ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1T"),
                ],
                &["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=\"0=1T\"", "unknown unit"],
            ),
            (
                "zero",
                "join",
                &[("MEMGOV_DEVICE_LIMIT", "0")],
                &["MEMGOV_DEVICE_LIMIT=\"0\"", "a limit of 0 bytes"],
            ),
            (
                "no-device-hami",
                "join",
                &[("CUDA_DEVICE_MEMORY_LIMIT_0", "8m")],
                &[
                    "CUDA_DEVICE_MEMORY_LIMIT_0=\"8m\" grants a limit per device",
                    "JoinOptions::device",
                ],
            ),
            (
                "no-device-mps",
                "join",
                &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G")],
                &["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=\"0=1G\" grants a limit per device"],
            ),
            (
                "no-device-bad-list",
                "join",
                &[("MEMGOV_DEVICE_LIMIT", "0=1G,0=2G")],
                &["MEMGOV_DEVICE_LIMIT", "the device is named twice"],
            ),
            (
                "above-device",
                "join device=0 total=8388608",
                &[("CUDA_DEVICE_MEMORY_LIMIT_0", "16m")],
                &["CUDA_DEVICE_MEMORY_LIMIT_0=\"16m\"", "above the device's"],
            ),
            (
                "budget-bad",
                "budget device=0",
                &[("CUDA_DEVICE_MEMORY_LIMIT", "1.5g")],
                &["CUDA_DEVICE_MEMORY_LIMIT=\"1.5g\""],
            ),
        ];
        for (name, what, vars, want) in cases {
            let got = child(name, what, vars);
            assert!(got.starts_with("error "), "{name}: joined: {got}");
            for w in *want {
                assert!(got.contains(w), "{name}: {w:?} not in: {got}");
            }
        }
    }
}
