//! A fixed amount of one workload, for instruction counts under
//! `valgrind --tool=callgrind` (repeatable where wall-clock timings are not):
//!
//! ```text
//! cargo bench --bench profile --no-run
//! valgrind --tool=callgrind target/release/deps/profile-* null-cycle 100000
//! ```
//!
//! Run it with two iteration counts and subtract to get instructions per
//! iteration without the set-up. The cost of call-site attribution is the
//! ratio of `null-cycle-attributed` to `null-cycle` counted so, in one
//! session (target: at most 1.15; 721 / 638 = 1.13 as
//! `docs/diagnosing-oom.md` reports). Workloads: `arc`, `pin`, `boxed-pin`,
//! `null-cycle`, `null-cycle-attributed` (the same with call-site
//! attribution on), `pending` (allocate + release parked, then drained).

use memgov::null::NullContext;
use memgov::{Alloc, ContextConfig, Governor, Role};
use std::hint::black_box;
use std::sync::Arc;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let what = args.first().map(String::as_str).unwrap_or("null-cycle");
    let n: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let gov = Governor::new();
    match what {
        "arc" => {
            let a = Arc::new(0u64);
            for _ in 0..n {
                drop(black_box(Arc::clone(black_box(&a))));
            }
        }
        "pin" => {
            let ctx = gov.register(NullContext::new(), ContextConfig::new());
            for _ in 0..n {
                drop(black_box(ctx.pin()));
            }
        }
        "boxed-pin" => {
            let ctx = gov.register(NullContext::new(), ContextConfig::new());
            let src = ctx.pin_source(Some("profile"));
            for _ in 0..n {
                drop(black_box(src.pin()));
            }
        }
        "null-cycle" => {
            let ctx = gov.register(NullContext::new(), ContextConfig::new().budget(1 << 40));
            let s = ctx.create_stream("p").unwrap();
            for _ in 0..n {
                drop(black_box(
                    ctx.allocate(&s, Alloc::new(black_box(4096), Role::Activation)),
                ));
            }
        }
        "null-cycle-attributed" => {
            let ctx = gov.register(
                NullContext::new(),
                ContextConfig::new().budget(1 << 40).attribution(true),
            );
            let s = ctx.create_stream("p").unwrap();
            for _ in 0..n {
                drop(black_box(
                    ctx.allocate(&s, Alloc::new(black_box(4096), Role::Activation)),
                ));
            }
        }
        "pending" => {
            let null = NullContext::deferred(n as usize);
            let parked = null.controls();
            let ctx = gov.register(null, ContextConfig::new());
            let s = ctx.create_stream("p").unwrap();
            for _ in 0..n {
                drop(black_box(
                    ctx.allocate(&s, Alloc::new(black_box(4096), Role::Activation)),
                ));
            }
            parked.retire_parked();
        }
        other => {
            eprintln!("unknown workload {other}");
            std::process::exit(2);
        }
    }
}
