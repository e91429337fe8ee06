//! `memgov report SNAPSHOT.json` and `memgov report OLD.json NEW.json`:
//! one snapshot as a plain-text page (who holds what, by context, role and
//! call site), or what grew between two (by call site, most growth first).
//!
//! A snapshot is the JSON of a `GovernorSnapshot` (`memgov run --snapshot
//! FILE`) or of one `ContextSnapshot` (`serde_json::to_writer(file,
//! &ctx.snapshot())` with memgov's `serde` feature, or the refusal hook of
//! `memgov run --snapshot-on-refusal FILE`).

use memgov::{Bytes, Role};
use serde_json::Value;
use std::fmt::Write as _;

/// Whether `v` is a snapshot (a governor's, with `contexts`, or one
/// context's, with `by_role`) rather than a trace.
pub fn is_snapshot(v: &Value) -> bool {
    v.get("contexts").is_some_and(Value::is_array) || v.get("by_role").is_some()
}

/// The contexts of a snapshot.
fn contexts(v: &Value) -> Vec<&Value> {
    match v.get("contexts").and_then(Value::as_array) {
        Some(all) => all.iter().collect(),
        None => vec![v],
    }
}

fn u(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

fn s<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

fn b(bytes: u64) -> String {
    format!("{:#}", Bytes(bytes))
}

fn site_name(site: &Value) -> String {
    match site.get("label").and_then(Value::as_str) {
        Some(label) => format!("{} '{label}'", s(site, "site")),
        None => s(site, "site").to_owned(),
    }
}

/// One snapshot as a page of text.
/// The context's process level, where its snapshot has one: "process
/// level 'worker': 3.0 GiB limit, granted by CUDA_DEVICE_MEMORY_LIMIT_0"
/// (or "set by the program").
fn process_level(c: &Value) -> Option<String> {
    let p = c.get("process_limit").filter(|p| !p.is_null())?;
    let limit = if u(p, "limit") == u64::MAX {
        "no limit".to_owned()
    } else {
        format!("{} limit", b(u(p, "limit")))
    };
    let from = &p["from"];
    let from = match from["kind"].as_str() {
        Some("granted") => format!("granted by {}", s(from, "variable")),
        Some("program") => "set by the program".to_owned(),
        _ => "from an unknown source".to_owned(),
    };
    Some(format!(
        "process level '{}': {limit}, {from}",
        s(p, "label")
    ))
}

pub fn render(name: &str, v: &Value) -> String {
    let mut out = String::new();
    let all = contexts(v);
    let _ = writeln!(out, "memgov snapshot {name}: {} context(s)", all.len());
    for c in all {
        let _ = writeln!(
            out,
            "\ncontext '{}' ({}, {}): {} charged of a {} limit, peak {} live",
            s(c, "label"),
            s(c, "backend"),
            c.get("lifecycle").and_then(Value::as_str).unwrap_or("?"),
            b(u(c, "charged")),
            if u(c, "budget_limit") == u64::MAX {
                "unlimited".to_owned()
            } else {
                b(u(c, "budget_limit"))
            },
            b(u(c, "peak")),
        );
        if let Some(level) = process_level(c) {
            let _ = writeln!(out, "  {level}");
        }
        let _ = writeln!(out, "  by role:");
        let _ = writeln!(
            out,
            "    {:<12} {:>10} {:>6} {:>10} {:>12}",
            "role", "live", "count", "pending", "quarantined"
        );
        if let Some(roles) = c.get("by_role").and_then(Value::as_array) {
            for (role, r) in Role::ALL.iter().zip(roles) {
                if u(r, "live_bytes") + u(r, "pending_bytes") + u(r, "quarantined_bytes") == 0 {
                    continue;
                }
                let _ = writeln!(
                    out,
                    "    {:<12} {:>10} {:>6} {:>10} {:>12}",
                    role.to_string(),
                    b(u(r, "live_bytes")),
                    u(r, "live_count"),
                    b(u(r, "pending_bytes")),
                    b(u(r, "quarantined_bytes")),
                );
            }
        }
        let cached = c.get("cache").map_or(0, |k| u(k, "cached_bytes"));
        if cached > 0 || u(c, "reserved") > 0 || u(c, "outside_bytes") > 0 {
            let _ = writeln!(
                out,
                "  also charged: {} in the block cache, {} reserved and unused, {} outside memgov",
                b(cached),
                b(u(c, "reserved")),
                b(u(c, "outside_bytes"))
            );
        }
        let sites = c.get("sites").and_then(Value::as_array);
        match sites {
            Some(sites) if !sites.is_empty() => {
                let _ = writeln!(out, "  by call site, most live bytes first:");
                let _ = writeln!(
                    out,
                    "    {:>10} {:>6} {:>10} {:>8} {:>7}  site",
                    "live", "count", "peak", "allocs", "refused"
                );
                for site in sites {
                    let _ = writeln!(
                        out,
                        "    {:>10} {:>6} {:>10} {:>8} {:>7}  {}",
                        b(u(site, "live_bytes")),
                        u(site, "live_count"),
                        b(u(site, "peak_bytes")),
                        u(site, "allocations"),
                        u(site, "refusals"),
                        site_name(site),
                    );
                }
            }
            _ => {
                let _ = writeln!(
                    out,
                    "  no call sites: attribution was off (ContextConfig::attribution, or MEMGOV_ATTRIBUTION=1)"
                );
            }
        }
    }
    out
}

/// What grew between `old` and `new`, context by context (matched by
/// label), site by site, most growth first; and the sites that shrank.
pub fn diff(old_name: &str, old: &Value, new_name: &str, new: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "memgov snapshot difference: {old_name} -> {new_name}");
    let olds = contexts(old);
    for c in contexts(new) {
        let label = s(c, "label");
        let before = olds.iter().find(|o| s(o, "label") == label);
        let empty = Vec::new();
        let sites_of = |v: Option<&&Value>| -> Vec<Value> {
            v.and_then(|v| v.get("sites"))
                .and_then(Value::as_array)
                .unwrap_or(&empty)
                .clone()
        };
        let (was, now) = (sites_of(before), sites_of(Some(&c)));
        let key = |v: &Value| (s(v, "site").to_owned(), v.get("label").cloned());
        // (growth, before, after, count before, count after, site)
        let mut rows: Vec<(i128, u64, u64, u64, u64, String)> = Vec::new();
        for n in &now {
            let o = was.iter().find(|o| key(o) == key(n));
            let (ob, oc) = o.map_or((0, 0), |o| (u(o, "live_bytes"), u(o, "live_count")));
            let (nb, nc) = (u(n, "live_bytes"), u(n, "live_count"));
            if nb != ob {
                rows.push((
                    i128::from(nb) - i128::from(ob),
                    ob,
                    nb,
                    oc,
                    nc,
                    site_name(n),
                ));
            }
        }
        for o in &was {
            if !now.iter().any(|n| key(n) == key(o)) && u(o, "live_bytes") > 0 {
                let ob = u(o, "live_bytes");
                rows.push((-i128::from(ob), ob, 0, u(o, "live_count"), 0, site_name(o)));
            }
        }
        rows.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.5.cmp(&b.5)));
        let live = |v: Option<&&Value>| {
            v.and_then(|v| v.get("by_role"))
                .and_then(Value::as_array)
                .map_or(0, |r| r.iter().map(|r| u(r, "live_bytes")).sum::<u64>())
        };
        let _ = writeln!(
            out,
            "\ncontext '{label}': {} live -> {} live{}",
            b(live(before)),
            b(live(Some(&c))),
            if before.is_none() {
                " (not in the earlier snapshot)"
            } else {
                ""
            }
        );
        if now.is_empty() && was.is_empty() {
            let _ = writeln!(
                out,
                "  no call sites: attribution was off (ContextConfig::attribution, or MEMGOV_ATTRIBUTION=1)"
            );
            continue;
        }
        if rows.is_empty() {
            let _ = writeln!(out, "  no site's live bytes changed");
            continue;
        }
        let _ = writeln!(
            out,
            "    {:>11} {:>10} {:>10} {:>9}  site",
            "change", "before", "after", "buffers"
        );
        for (growth, ob, nb, oc, nc, site) in rows {
            let sign = if growth >= 0 { "+" } else { "-" };
            let _ = writeln!(
                out,
                "    {:>11} {:>10} {:>10} {:>9}  {site}",
                format!("{sign}{}", b(growth.unsigned_abs() as u64)),
                b(ob),
                b(nb),
                format!("{oc}->{nc}"),
            );
        }
    }
    out
}
