//! Call-site attribution: every allocation counted where it was made
//! (`#[track_caller]`), in snapshots, in the difference of two snapshots and
//! in a refusal's holders.

use memgov::host::{HostConfig, HostContext};
use memgov::{
    Alloc, BudgetExceeded, ContextConfig, ContextHandle, DeviceBuffer, GovernedStream, Governor,
    GovernorError, Reserve, Role,
};
use std::panic::Location;
use std::sync::{Arc, Mutex};

fn context(gov: &Governor<HostContext>, config: ContextConfig) -> ContextHandle<HostContext> {
    gov.register(
        HostContext::new(HostConfig::default()).expect("host context"),
        config,
    )
}

fn refusal(e: GovernorError) -> Box<BudgetExceeded> {
    match e {
        GovernorError::BudgetExceeded(b) => b,
        other => panic!("expected a budget refusal, got {other}"),
    }
}

/// `ctx.allocate` called from this function's caller's line (the
/// location `#[track_caller]` carries through), and that line as
/// `file:line:col`: where the test's allocation sits, whatever the
/// formatting of the call.
#[track_caller]
fn allocate_here(
    ctx: &ContextHandle<HostContext>,
    stream: &GovernedStream<HostContext>,
    alloc: Alloc,
) -> (Result<DeviceBuffer<HostContext>, GovernorError>, String) {
    let at = Location::caller();
    assert_eq!(at.file(), file!());
    (
        ctx.allocate(stream, alloc),
        format!("{}:{}:{}", at.file(), at.line(), at.column()),
    )
}

/// A workload that allocates and releases at one line each step, and at
/// another line keeps (leaks) one buffer every fourth step: the snapshot
/// difference names the leaking line, and only it.
#[test]
fn a_planted_leak_is_found_by_site_in_the_snapshot_difference() {
    let gov = Governor::new();
    let ctx = context(&gov, ContextConfig::new().attribution(true));
    let stream = ctx.create_stream("main").unwrap();
    let mut leaked = Vec::new();
    let mut leak_site = String::new();
    let mut step = |ctx: &ContextHandle<HostContext>, i: usize| {
        let scratch = ctx
            .allocate(&stream, Alloc::new(8192, Role::Activation))
            .unwrap();
        drop(scratch);
        if i % 4 == 0 {
            let (kept, site) = allocate_here(ctx, &stream, Alloc::new(1024, Role::KvCache));
            leaked.push(kept.unwrap());
            leak_site = site;
        }
    };
    for i in 0..8 {
        step(&ctx, i);
    }
    let before = ctx.snapshot();
    for i in 8..40 {
        step(&ctx, i);
    }
    let after = ctx.snapshot();
    let grown = after.sites_grown_since(&before);
    assert_eq!(grown.len(), 1, "only the leaking line grew: {grown:#?}");
    let leak = &grown[0];
    assert_eq!(leak.site, leak_site, "the leak's line");
    assert!(
        leak.site.starts_with("tests/attribution.rs:"),
        "{}",
        leak.site
    );
    assert_eq!((leak.before, leak.after), (2 * 1024, 10 * 1024));
    assert_eq!((leak.count_before, leak.count_after), (2, 10));
    // The scratch line holds nothing and was counted every step.
    let scratch = after
        .sites
        .iter()
        .find(|s| s.live_bytes == 0)
        .expect("the scratch site is listed");
    assert_eq!((scratch.allocations, scratch.peak_bytes), (40, 8192));
    drop(leaked);
}

/// Three sites hold 512, 256 and 128 KiB of a 1 MiB budget; a fourth asks
/// for 256 KiB. The refusal names the 512 KiB site first, with its bytes,
/// then the others in order, and ends by pointing at it.
#[test]
fn a_refusal_names_the_biggest_site_first_with_its_bytes() {
    let gov = Governor::new();
    let ctx = context(&gov, ContextConfig::new().budget(1 << 20).attribution(true));
    let s = ctx.create_stream("main").unwrap();
    // Made smallest first, so that the order of the refusal's list is its
    // own doing.
    let (small, small_site) = allocate_here(&ctx, &s, Alloc::new(128 << 10, Role::Activation));
    let (mid, mid_site) = allocate_here(&ctx, &s, Alloc::new(256 << 10, Role::KvCache));
    let (big, big_site) = allocate_here(&ctx, &s, Alloc::new(512 << 10, Role::Weights));
    let (e, refused_site) = allocate_here(&ctx, &s, Alloc::new(256 << 10, Role::Activation));
    let b = refusal(e.unwrap_err());
    let sites: Vec<(&str, u64)> = b
        .holders
        .by_site
        .iter()
        .map(|s| (s.site.as_str(), s.live_bytes))
        .collect();
    assert_eq!(
        sites,
        vec![
            (big_site.as_str(), 512 << 10),
            (mid_site.as_str(), 256 << 10),
            (small_site.as_str(), 128 << 10)
        ]
    );
    assert_eq!(
        b.holders.by_role,
        vec![
            (Role::Weights, 512 << 10),
            (Role::KvCache, 256 << 10),
            (Role::Activation, 128 << 10)
        ]
    );
    let text = b.to_string();
    let first = format!(
        "held at {big_site} 512.0 KiB (1 buffer), {mid_site} 256.0 KiB (1 buffer), {small_site} 128.0 KiB (1 buffer); by role: 512.0 KiB weights"
    );
    assert!(text.contains(&first), "{text}\nlacks: {first}");
    assert!(
        text.ends_with(&format!(
            "; release buffers made at {big_site} (it holds 512.0 KiB), register a pressure responder, or raise the budget"
        )),
        "{text}"
    );
    // The refused line counts one refusal and no allocation.
    let snap = ctx.snapshot();
    let refused = snap
        .sites
        .iter()
        .find(|r| r.site == refused_site)
        .expect("the refused site");
    assert_eq!(
        (refused.refusals, refused.allocations, refused.live_bytes),
        (1, 0, 0)
    );
    println!("{text}");
    drop((big, mid, small));
}

/// The way out a refusal ends with follows the situation: an unused
/// reservation that would cover the shortfall is named before anything
/// else.
#[test]
fn a_refusal_points_at_an_unused_reservation_that_would_make_room() {
    let gov = Governor::new();
    let ctx = context(&gov, ContextConfig::new().budget(1 << 20).attribution(true));
    let s = ctx.create_stream("main").unwrap();
    let idle = ctx.reserve(Reserve::new(512 << 10, "request-9")).unwrap();
    let _held = ctx
        .allocate(&s, Alloc::new(384 << 10, Role::Weights))
        .unwrap();
    let b = refusal(
        ctx.allocate(&s, Alloc::new(256 << 10, Role::Activation))
            .unwrap_err(),
    );
    let text = b.to_string();
    assert!(
        text.ends_with("; drop or shrink the reservation 'request-9': 512.0 KiB of it is unused, the request is 128.0 KiB short"),
        "{text}"
    );
    drop(idle);
}

/// Labels aggregate like sites: one row per (site, label).
#[test]
fn labels_split_a_site_and_reservations_count_at_their_caller() {
    let gov = Governor::new();
    let ctx = context(&gov, ContextConfig::new().budget(4 << 20).attribution(true));
    let s = ctx.create_stream("main").unwrap();
    let mut kept = Vec::new();
    let mut at = String::new();
    for layer in ["layer 0", "layer 1", "layer 1"] {
        let (b, site) = allocate_here(&ctx, &s, Alloc::new(4096, Role::KvCache).label(layer));
        kept.push(b.unwrap());
        at = site;
    }
    let request = ctx.reserve(Reserve::new(64 << 10, "request-1")).unwrap();
    let r_line = line!() + 1;
    let from_reservation = request.allocate(&s, Alloc::new(16 << 10, Role::KvCache));
    let from_reservation = from_reservation.unwrap();
    let snap = ctx.snapshot();
    let row = |label: &str| {
        snap.sites
            .iter()
            .find(|r| r.label.as_deref() == Some(label))
            .unwrap_or_else(|| panic!("no row for {label}: {:#?}", snap.sites))
    };
    assert_eq!(
        (row("layer 1").live_bytes, row("layer 1").live_count),
        (8192, 2)
    );
    assert_eq!(
        (row("layer 0").live_bytes, row("layer 0").live_count),
        (4096, 1)
    );
    assert_eq!(row("layer 0").site, at);
    assert_eq!(row("layer 1").site, at);
    let r = snap
        .site(&format!("{}:{r_line}", file!()))
        .expect("the reservation's caller");
    assert_eq!((r.live_bytes, r.label.as_deref()), (16 << 10, None));
    drop(kept);
    drop(from_reservation);
    let snap = ctx.snapshot();
    assert!(
        snap.sites
            .iter()
            .all(|s| s.live_bytes == 0 && s.live_count == 0),
        "{:#?}",
        snap.sites
    );
    assert_eq!(row("layer 1").peak_bytes, 8192);
}

/// Off (the default without `MEMGOV_ATTRIBUTION`): nothing is listed, and a
/// refusal says what it can without sites.
#[test]
fn without_attribution_no_site_is_kept() {
    let gov = Governor::new();
    let ctx = context(&gov, ContextConfig::new().budget(8192).attribution(false));
    let s = ctx.create_stream("main").unwrap();
    let _a = ctx
        .allocate(&s, Alloc::new(8192, Role::Weights).label("weights"))
        .unwrap();
    let b = refusal(ctx.allocate(&s, Alloc::new(1, Role::Weights)).unwrap_err());
    assert!(ctx.snapshot().sites.is_empty());
    assert!(!b.holders.attributed && b.holders.by_site.is_empty());
    assert_eq!(b.holders.by_role, vec![(Role::Weights, 8192)]);
    assert!(b.to_string().contains("; by role: 8.0 KiB weights;"), "{b}");
}

/// The refusal hook sees the snapshot, sites included, before the error
/// comes back.
#[test]
fn the_refusal_hook_gets_the_snapshot_with_its_sites() {
    let seen: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let keep = seen.clone();
    let gov = Governor::new();
    let ctx = context(
        &gov,
        ContextConfig::new()
            .budget(8192)
            .attribution(true)
            .on_refusal(move |snap, refusal| {
                let mut seen = keep.lock().unwrap();
                for s in &snap.sites {
                    seen.push((s.site.clone(), s.refusals));
                }
                seen.push(("requested".into(), refusal.requested));
            }),
    );
    let s = ctx.create_stream("main").unwrap();
    let (_a, site) = allocate_here(&ctx, &s, Alloc::new(8192, Role::Weights));
    assert!(ctx.allocate(&s, Alloc::new(100, Role::Weights)).is_err());
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen.iter().any(|(s, n)| *s == site && *n == 0), "{seen:?}");
    // The refused site's refusal is counted before the hook runs.
    assert!(
        seen.iter().any(|(site, n)| site != "requested" && *n == 1),
        "{seen:?}"
    );
    assert_eq!(seen[2], ("requested".to_owned(), 100));
}

/// A buffer moved to another context stays counted where it was made.
#[test]
fn a_migrated_buffer_keeps_its_site() {
    let gov = Governor::new();
    let old = context(&gov, ContextConfig::new().attribution(true));
    let new = context(&gov, ContextConfig::new().attribution(true));
    let (s0, s1) = (
        old.create_stream("a").unwrap(),
        new.create_stream("b").unwrap(),
    );
    let (w, site) = allocate_here(&old, &s0, Alloc::new(4096, Role::Weights).label("w"));
    let moved = new.migrate(&s1, vec![w.unwrap()]).unwrap();
    let snap = new.snapshot();
    let row = snap
        .sites
        .iter()
        .find(|r| r.site == site)
        .expect("the original site");
    assert_eq!((row.live_bytes, row.label.as_deref()), (4096, Some("w")));
    drop(moved);
}

#[cfg(feature = "serde")]
#[test]
fn the_snapshot_serialises_its_sites() {
    let gov = Governor::new();
    let ctx = context(&gov, ContextConfig::new().attribution(true));
    let s = ctx.create_stream("main").unwrap();
    let _a = ctx
        .allocate(&s, Alloc::new(4096, Role::Weights).label("w"))
        .unwrap();
    let v = serde_json::to_value(ctx.snapshot()).unwrap();
    let site = &v["sites"][0];
    assert!(
        site["site"].as_str().unwrap().starts_with(file!()),
        "{site}"
    );
    assert_eq!(site["label"], "w");
    for (k, want) in [
        ("live_bytes", 4096),
        ("live_count", 1),
        ("peak_bytes", 4096),
        ("allocations", 1),
        ("refusals", 0),
    ] {
        assert_eq!(site[k], want, "{k} in {site}");
    }
}

/// A layer that allocates for others names their site
/// ([`Alloc::site`]): the row shows that name instead of the layer's line,
/// one row per name.
#[test]
fn a_named_site_is_shown_instead_of_the_line() {
    let gov = Governor::new();
    let ctx = context(&gov, ContextConfig::new().attribution(true));
    let s = ctx.create_stream("main").unwrap();
    // One line of glue, two callers it allocates for.
    let glue =
        |site: &'static str, bytes| ctx.allocate(&s, Alloc::new(bytes, Role::Other).site(site));
    let a = glue("model.c:42", 4096).unwrap();
    let b = glue("model.c:77", 8192).unwrap();
    let snap = ctx.snapshot();
    let rows: Vec<(&str, u64)> = snap
        .sites
        .iter()
        .map(|r| (r.site.as_str(), r.live_bytes))
        .collect();
    assert_eq!(rows, vec![("model.c:77", 8192), ("model.c:42", 4096)]);
    drop((a, b));
}

/// A refused reservation names the holders too, and runs the hook.
#[test]
fn a_refused_reservation_names_the_holders_and_runs_the_hook() {
    let calls = Arc::new(Mutex::new(0));
    let count = calls.clone();
    let gov = Governor::new();
    let ctx = context(
        &gov,
        ContextConfig::new()
            .budget(1 << 20)
            .attribution(true)
            .on_refusal(move |_, _| *count.lock().unwrap() += 1),
    );
    let s = ctx.create_stream("main").unwrap();
    let (held, site) = allocate_here(&ctx, &s, Alloc::new(768 << 10, Role::KvCache));
    let e = match ctx.reserve(Reserve::new(512 << 10, "request-3")) {
        Err(e) => e,
        Ok(_) => panic!("a reservation over the budget was admitted"),
    };
    let b = refusal(e);
    assert_eq!(b.holders.by_site[0].site, site);
    assert_eq!(b.holders.by_site[0].live_bytes, 768 << 10);
    assert_eq!(*calls.lock().unwrap(), 1);
    drop(held);
}

/// A refusal by the machine ledger ends by naming the other process
/// furthest above its floor, with what it could trim. (The refusal is built
/// from its parts: its figures are the ledger's, `tests/machine.rs` makes
/// real ones across processes.)
#[cfg(target_os = "linux")]
#[test]
fn a_machine_refusal_ends_with_the_process_furthest_above_its_floor() {
    use memgov::machine::{Holder, MachineRefusal, RefusedBy};
    use memgov::{BudgetScope, ContextName, ProviderContextIdentity};
    const GIB: u64 = 1 << 30;
    let holder = |name: &str, pid, charged, floor, cached| Holder {
        name: name.into(),
        pid,
        charged,
        cached,
        floor,
        priority: 0,
    };
    let machine = MachineRefusal {
        ledger: "gpu-0".into(),
        by: RefusedBy::Ledger,
        requested: 2 * GIB,
        charged: 15 * GIB,
        limit: 16 * GIB,
        outside: 0,
        floors_reserved: 0,
        process: "me".into(),
        pid: 10,
        process_charged: 3 * GIB,
        process_limit: u64::MAX,
        process_limit_from: None,
        lost: None,
        holders: vec![
            // Holds the most, but most of it is its floor.
            holder("trainer", 11, 8 * GIB, 7 * GIB, 0),
            // Holds less, all of it above its floor.
            holder("batch", 12, 4 * GIB, 0, GIB),
        ],
        unanswered: Vec::new(),
    };
    let refusal = BudgetExceeded {
        context: ContextName::new(
            ProviderContextIdentity::new(1.try_into().unwrap(), 0),
            "llm",
        ),
        scope: BudgetScope::Machine("gpu-0".into()),
        role: Role::Activation,
        requested: 2 * GIB,
        live: 3 * GIB,
        reserved: 0,
        reserved_by: Vec::new(),
        pending: 0,
        quarantined: 0,
        awaiting_teardown: 0,
        outside: 0,
        limit: 16 * GIB,
        limit_from: None,
        available: GIB,
        waited: std::time::Duration::ZERO,
        reclaimed_by_responders: 0,
        driver: None,
        machine: Some(Box::new(machine)),
        holders: Default::default(),
    };
    let text = refusal.to_string();
    assert!(
        text.ends_with("; first: 'batch' (pid 12) holds 4.0 GiB above its 0 bytes floor, 1.0 GiB of it in block caches it can trim"),
        "{text}"
    );
}

/// With the block cache on, a block kept by the cache is no site's: the
/// site that released it holds nothing, and the allocation the cache
/// serves again is counted where it was made.
#[test]
fn a_cached_block_is_counted_at_the_site_that_takes_it_again() {
    let gov = Governor::new();
    let ctx = context(
        &gov,
        ContextConfig::new()
            .attribution(true)
            .cache(memgov::CacheConfig::new(1 << 20)),
    );
    let s = ctx.create_stream("main").unwrap();
    let (first, first_site) = allocate_here(&ctx, &s, Alloc::new(4096, Role::Activation));
    drop(first.unwrap());
    let (again, again_site) = allocate_here(&ctx, &s, Alloc::new(4096, Role::Activation));
    let again = again.unwrap();
    let snap = ctx.snapshot();
    assert_eq!(snap.cache.hits, 1, "served by the cache");
    let row = |site: &str| snap.sites.iter().find(|r| r.site == site).cloned().unwrap();
    assert_eq!(
        (row(&first_site).live_bytes, row(&first_site).allocations),
        (0, 1)
    );
    assert_eq!(
        (row(&again_site).live_bytes, row(&again_site).allocations),
        (4096, 1)
    );
    drop(again);
    assert!(ctx.snapshot().sites.iter().all(|r| r.live_bytes == 0));
}

/// Threads allocating at once at sites the table has not seen yet: each
/// site gets one row (a slot is claimed once, whoever comes first), and
/// every allocation and release is counted. Run 20 times over, all threads
/// released together by a barrier at each site's first allocation.
#[test]
fn threads_racing_to_a_new_site_share_one_row_and_lose_no_count() {
    const THREADS: usize = 4;
    const CYCLES: u64 = if cfg!(miri) { 4 } else { 200 };
    for _ in 0..20 {
        let gov = Governor::new();
        let ctx = context(&gov, ContextConfig::new().attribution(true));
        let barrier = std::sync::Barrier::new(THREADS);
        let sites: Vec<(String, String)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    scope.spawn(|| {
                        let s = ctx.create_stream("t").unwrap();
                        let mut kept = Vec::new();
                        barrier.wait();
                        let (a, site_a) = allocate_here(&ctx, &s, Alloc::new(512, Role::Other));
                        kept.push(a.unwrap());
                        barrier.wait();
                        let (b, site_b) =
                            allocate_here(&ctx, &s, Alloc::new(1024, Role::Other).label("racing"));
                        drop(b.unwrap());
                        for _ in 1..CYCLES {
                            let (a, _) = allocate_here(&ctx, &s, Alloc::new(512, Role::Other));
                            drop(a.unwrap());
                        }
                        drop(kept);
                        (site_a, site_b)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let snap = ctx.snapshot();
        assert_eq!(snap.sites.len(), 3, "{:#?}", snap.sites);
        // The first allocation and the loop's are two lines.
        let row = |site: &str, label: Option<&str>| {
            snap.sites
                .iter()
                .find(|r| r.site == site && r.label.as_deref() == label)
                .cloned()
                .unwrap_or_else(|| panic!("no row {site} {label:?}: {:#?}", snap.sites))
        };
        let first = row(&sites[0].0, None);
        assert_eq!(
            (first.allocations, first.live_bytes, first.live_count),
            (THREADS as u64, 0, 0)
        );
        assert!(first.peak_bytes >= 512 && first.peak_bytes <= 512 * THREADS as u64);
        let racing = row(&sites[0].1, Some("racing"));
        assert_eq!((racing.allocations, racing.live_bytes), (THREADS as u64, 0));
        let total: u64 = snap.sites.iter().map(|r| r.allocations).sum();
        assert_eq!(total, THREADS as u64 * (CYCLES + 1));
        assert!(
            sites.iter().all(|s| *s == sites[0]),
            "one line per call: {sites:?}"
        );
    }
}

/// The refusal hook runs after the refused allocation let go of its pin:
/// the snapshot it gets counts the stream and the live buffer, nothing in
/// flight (so a hook may retire the context and wait for it).
#[test]
fn the_refusal_hook_runs_with_no_pin_of_the_refused_allocation() {
    let pins = Arc::new(Mutex::new(Vec::new()));
    let seen = pins.clone();
    let gov = Governor::new();
    let ctx = context(
        &gov,
        ContextConfig::new()
            .budget(8192)
            .on_refusal(move |snap, _| seen.lock().unwrap().push(snap.pins.total())),
    );
    let s = ctx.create_stream("main").unwrap();
    let held = ctx.allocate(&s, Alloc::new(8192, Role::Weights)).unwrap();
    let quiet = ctx.snapshot().pins.total();
    assert!(ctx.allocate(&s, Alloc::new(1, Role::Weights)).is_err());
    assert_eq!(*pins.lock().unwrap(), vec![quiet]);
    drop(held);
}
