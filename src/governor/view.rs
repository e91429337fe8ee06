//! Building the snapshots of `snapshot.rs` from a context's record.

use super::error::{BudgetExceeded, Holders};
use super::record::{ContextInner, Phase};
use super::report::{Outstanding, PinKind};
use super::role::Role;
use super::snapshot::{
    ContextSnapshot, ContextState, CounterSnapshot, LimitSource, PinCounts, ProcessLimit,
    QuarantineEntry, ReservationUsage, RoleUsage, TierUsage,
};
use crate::{DeviceContext, Tier};
use std::sync::atomic::{AtomicU64, Ordering};

/// Every tier's usage: the tiers other than the device's from their own
/// charges, the device tier's as what is left of the roles' totals.
fn by_tier<C: DeviceContext>(
    ctx: &ContextInner<C>,
    by_role: &[RoleUsage; 5],
    reservations: &[ReservationUsage],
) -> Vec<TierUsage> {
    let total: RoleUsage = by_role.iter().copied().sum();
    let reserved = |tier| {
        reservations
            .iter()
            .filter(|r| r.tier == tier)
            .map(|r| r.left)
            .sum()
    };
    // Live, pending and quarantined bytes of the tiers other than the
    // device's.
    let mut others = (0u64, 0u64, 0u64);
    let mut tiers = Vec::with_capacity(Tier::ALL.len());
    for tier in Tier::ALL.into_iter().skip(1) {
        let a = ctx.ledger.charges().tier_amounts(tier).unwrap_or_default();
        let usage = TierUsage {
            tier,
            limit: a.limit,
            charged: a.charged,
            reserved: reserved(tier),
            live_bytes: a.live,
            pending_bytes: a.pending,
            quarantined_bytes: a.quarantined,
            awaiting_teardown: a.awaiting_teardown,
            sleep_copies: a.sleep_copies,
        };
        others.0 += usage.live_bytes;
        others.1 += usage.pending_bytes;
        others.2 += usage.quarantined_bytes;
        tiers.push(usage);
    }
    tiers.insert(
        0,
        TierUsage {
            tier: Tier::Device,
            limit: ctx.ledger.charges().limit(),
            charged: ctx.ledger.charges().charged(),
            reserved: reserved(Tier::Device),
            live_bytes: total.live_bytes.saturating_sub(others.0),
            pending_bytes: total.pending_bytes.saturating_sub(others.1),
            quarantined_bytes: total.quarantined_bytes.saturating_sub(others.2),
            awaiting_teardown: ctx.ledger.charges().awaiting_teardown(),
            sleep_copies: 0,
        },
    );
    tiers
}

fn ld(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

pub(crate) fn lifecycle<C: DeviceContext>(ctx: &ContextInner<C>) -> ContextState {
    match ctx.phase() {
        Phase::Terminated => ContextState::Terminated,
        _ if ctx.is_lost() => ContextState::Lost,
        Phase::Active => ContextState::Active,
        _ => ContextState::Retiring,
    }
}

pub(crate) fn snapshot<C: DeviceContext>(ctx: &ContextInner<C>) -> ContextSnapshot {
    snapshot_with(ctx, true)
}

/// The snapshot; without `cache_classes`, `CacheUsage::by_class` is left
/// empty, so that no stream's cache lock (which a cached allocation takes)
/// is taken: what the metrics render.
pub(crate) fn snapshot_with<C: DeviceContext>(
    ctx: &ContextInner<C>,
    cache_classes: bool,
) -> ContextSnapshot {
    let mut by_role = [RoleUsage::default(); 5];
    let asleep = ctx.sleep.asleep();
    for role in Role::ALL {
        let usage = ctx.ledger.stats().usage(role);
        let quarantined = ctx.ledger.stats().quarantined(role);
        // The books count a cached block as the live buffer it was.
        let (cached_bytes, cached_count) = ctx.cache.of_role(role);
        by_role[role.index()] = RoleUsage {
            live_bytes: usage.live.bytes.saturating_sub(cached_bytes),
            live_count: usage.live.count.saturating_sub(cached_count),
            pending_bytes: usage.pending.bytes,
            pending_count: usage.pending.count,
            quarantined_bytes: quarantined.bytes,
            quarantined_count: quarantined.count,
            suspended_bytes: ctx.ledger.charges().suspended(role),
            asleep: asleep.contains(role),
        };
    }
    let outstanding = Outstanding::collect(ctx);
    let count = |k: PinKind| {
        outstanding
            .items
            .iter()
            .filter(|i| i.kind == k)
            .map(|i| i.count)
            .sum::<u64>()
    };
    let pins = PinCounts {
        streams: ctx.streams_live(),
        buffers: count(PinKind::Buffer),
        pending_releases: ctx.pending_count(),
        external: count(PinKind::External),
        other: count(PinKind::Other),
    };
    let c = &ctx.ledger.counters();
    let (peak, peak_exact) = ctx.ledger.stats().peak_live();
    let reservations = ctx.reservations.usage();
    let by_tier = by_tier(ctx, &by_role, &reservations);
    let reserved = by_tier[0].reserved;
    let sites = ctx.sites.as_ref().map_or_else(Vec::new, |s| s.usage());

    ContextSnapshot {
        context: ctx.id,
        label: ctx.label().to_owned(),
        backend: ctx.description.backend,
        device: ctx.description.name.clone(),
        execution: ctx.description.execution,
        lifecycle: lifecycle(ctx),
        lost_reason: ctx.lost_reason_if_lost(),
        budget_limit: ctx.ledger.charges().limit(),
        charged: ctx.ledger.charges().charged(),
        suspended: ctx.ledger.charges().off_books(),
        sleep: ctx.sleep.get(),
        awaiting_teardown: ctx.ledger.charges().awaiting_teardown(),
        shared_budget: ctx.ledger.charges().shared().map(|s| s.label().to_owned()),
        process_limit: ctx
            .ledger
            .charges()
            .shared()
            .and_then(|s| s.parent())
            .map(|p| ProcessLimit {
                label: p.label().to_owned(),
                limit: p.limit(),
                from: p
                    .limit_from()
                    .map_or(LimitSource::Program, |v| LimitSource::Granted(v.to_owned())),
            }),
        peak,
        peak_exact,
        peak_budget_held: ctx.ledger.charges().peak_held(),
        outside_bytes: ctx.ledger.outside_bytes(),
        reserved,
        reservations,
        by_role,
        by_tier,
        cache: super::cache::usage(ctx, cache_classes),
        quarantine: ctx
            .quarantine_entries()
            .into_iter()
            .map(|(role, bytes, reason)| QuarantineEntry {
                role,
                bytes,
                reason,
            })
            .collect(),
        pins,
        counters: CounterSnapshot {
            allocations: ctx.allocations(),
            releases_queued: ctx.releases_queued(),
            retired: ctx.retired(),
            abandoned: ld(&c.abandoned),
            settled_lost: ld(&c.settled_lost),
            quarantined: ld(&c.quarantined),
            reclaimed: ld(&c.reclaimed),
            admission_refusals: ld(&c.admission_refusals),
            admission_waits: ld(&c.admission_waits),
            pressure_calls: ld(&c.pressure_calls),
            backend_errors: ld(&c.backend_errors),
            late_settlements: ld(&c.late_settlements),
        },
        sites,
        teardown: ctx.teardown_report(),
    }
}

/// Fill in who holds the memory of a refusal of `ctx`'s: its largest call
/// sites (with attribution on) and roles, its cache, its sleeping bytes;
/// then call the context's refusal hook, if it has one, with its snapshot
/// (no lock held). Cold: only a refusal calls it.
#[cold]
pub(crate) fn explain<C: DeviceContext>(ctx: &ContextInner<C>, refusal: &mut BudgetExceeded) {
    let mut by_role: Vec<(Role, u64)> = Role::ALL
        .into_iter()
        .map(|role| {
            let live = ctx.ledger.stats().usage(role).live.bytes;
            (role, live.saturating_sub(ctx.cache.of_role(role).0))
        })
        .filter(|&(_, bytes)| bytes > 0)
        .collect();
    by_role.sort_by_key(|r| std::cmp::Reverse(r.1));
    let mut by_site = ctx.sites.as_ref().map_or_else(Vec::new, |s| s.usage());
    by_site.retain(|s| s.live_bytes > 0);
    by_site.truncate(Holders::NAMED);
    refusal.holders = Holders {
        by_site,
        by_role,
        cached: ctx.cache.bytes(),
        asleep: ctx.ledger.charges().suspended_bytes(),
        attributed: ctx.sites.is_some(),
    };
    if let Some(hook) = &ctx.on_refusal {
        hook(&snapshot(ctx), refusal);
    }
}
